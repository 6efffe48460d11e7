//! `dlock-bench`: dlock against the physical floor (`raw`: hand-written commands on one shared
//! multiplexed connection) and `rslock` (crates.io), on `redis-server` processes it starts
//! itself on free loopback ports.
//!
//! ```text
//! cargo run --release -p dlock-bench -- --quick     # under 2 minutes on 2 cores
//! cargo run --release -p dlock-bench                # longer, steadier
//! ```
//!
//! Prints a markdown table and writes `compare.json` and `handoff.svg` to `target/bench/`
//! (`CARGO_TARGET_DIR` if set). See `bench/README.md` for what each scenario measures.

mod admin;
mod clients;
mod contended;
mod etcd;
mod held;
mod kinds;
#[cfg(feature = "layer")]
mod layer;
mod plot;
mod postgres;
mod redlock;
mod report;
mod stats;
mod sys;
mod uncontended;
mod zookeeper;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::admin::Admin;
use crate::clients::{Client, Driver};
use crate::stats::{round3, us, Sorted};

pub(crate) type BenchError = Box<dyn std::error::Error + Send + Sync>;

/// Tokio worker threads (the target machine has 2 cores, shared with the servers).
pub(crate) const WORKERS: usize = 2;

/// Every scenario, in run order.
const SCENARIOS: [&str; 13] = [
    "uncontended",
    "contended",
    "contended_think",
    "redlock",
    "cluster",
    "sentinel",
    "etcd",
    "zookeeper",
    "held_at_scale",
    "layer_overhead",
    "postgres",
    "semaphore",
    "rwlock",
];

/// How long and how much.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub(crate) quick: bool,
    /// Warm-up before each measured window (per driver).
    pub(crate) warm: Duration,
    /// Each measured window (per driver and round).
    pub(crate) measure: Duration,
    /// Rounds: every driver runs once per round, drivers interleaved, and its rounds are
    /// pooled, so that drifting background load hits every driver alike.
    pub(crate) rounds: usize,
    /// Redlock acquires with 2 of 5 servers frozen, per driver.
    pub(crate) paused_samples: usize,
    /// Redlock failing acquires with 3 of 5 servers frozen, per driver.
    pub(crate) failing_samples: usize,
    pub(crate) held_locks: usize,
    pub(crate) held_for: Duration,
    pub(crate) only: Option<Vec<String>>,
    /// The drivers to run (all by default).
    pub(crate) drivers: Vec<Driver>,
}

impl Plan {
    fn parse(args: &[String]) -> Result<Plan, String> {
        let mut quick = false;
        let mut only = None;
        let mut drivers = Driver::ALL.to_vec();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--quick" => quick = true,
                "--only" => {
                    let list = it.next().ok_or("--only needs a comma-separated list")?;
                    let names: Vec<String> = list.split(',').map(str::to_owned).collect();
                    if let Some(bad) = names.iter().find(|n| !SCENARIOS.contains(&n.as_str())) {
                        return Err(format!(
                            "unknown scenario `{bad}` (known: {})",
                            SCENARIOS.join(", ")
                        ));
                    }
                    only = Some(names);
                }
                "--drivers" => {
                    let list = it.next().ok_or("--drivers needs a comma-separated list")?;
                    drivers = list
                        .split(',')
                        .map(|n| {
                            Driver::ALL
                                .into_iter()
                                .find(|d| d.name() == n)
                                .ok_or_else(|| {
                                    format!("unknown driver `{n}` (known: raw, dlock, rslock)")
                                })
                        })
                        .collect::<Result<_, _>>()?;
                }
                "-h" | "--help" => return Err(String::new()),
                other => return Err(format!("unknown argument `{other}`")),
            }
        }
        Ok(if quick {
            Plan {
                quick,
                warm: Duration::from_millis(500),
                measure: Duration::from_secs(1),
                rounds: 2,
                paused_samples: 5,
                failing_samples: 2,
                held_locks: 100_000,
                held_for: Duration::from_secs(10),
                only,
                drivers,
            }
        } else {
            Plan {
                quick,
                warm: Duration::from_secs(1),
                measure: Duration::from_secs(4),
                rounds: 3,
                paused_samples: 20,
                failing_samples: 5,
                held_locks: 100_000,
                held_for: Duration::from_secs(60),
                only,
                drivers,
            }
        })
    }

    /// (warm-up, window, tasks) of the uncontended load.
    pub(crate) fn load(&self) -> (Duration, Duration, usize) {
        (self.warm, self.measure, uncontended::TASKS)
    }

    /// (warm-up, window, tasks) of the one-task latency pass.
    pub(crate) fn one_task(&self) -> (Duration, Duration, usize) {
        (self.warm / 2, self.measure / 2, 1)
    }

    fn wants(&self, scenario: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|o| o.iter().any(|s| s == scenario))
    }
}

const USAGE: &str = "usage: dlock-bench [--quick] [--only SCENARIO,…] [--drivers DRIVER,…]

Starts its own redis-server processes on free loopback ports, runs every driver (raw, dlock,
rslock) through every scenario, prints a markdown table and writes target/bench/compare.json
and target/bench/handoff.svg.

  --quick   short windows: the whole run stays under 2 minutes on 2 cores
  --only    run only these scenarios: uncontended, contended, contended_think, redlock, sentinel,
            cluster, etcd, zookeeper, held_at_scale, layer_overhead, postgres, semaphore, rwlock (for
            profiling; the full
            report needs all)
  --drivers run only these drivers: raw, dlock, rslock (for profiling)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--held-child") {
        return held::child_main(&args[1..]);
    }
    let plan = match Plan::parse(&args) {
        Ok(p) => p,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("dlock-bench: {e}\n");
            }
            eprintln!("{USAGE}");
            return if e.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(2)
            };
        }
    };
    #[cfg(feature = "metrics")]
    {
        // What a service exporting dlock's metrics pays: a real recorder behind the facade.
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        if metrics::set_global_recorder(recorder).is_err() {
            eprintln!("dlock-bench: a metrics recorder was already installed");
        }
        dlock_runtime::metrics::describe();
        println!("metrics: on (Prometheus recorder)");
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dlock-bench: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let res = rt.block_on(run(plan));
    // Background tasks of the drivers may still hold connections: don't wait for them.
    rt.shutdown_timeout(Duration::from_secs(1));
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dlock-bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Connects every driver in `drivers` to `urls`.
async fn connect_all(
    drivers: &[Driver],
    urls: &[String],
) -> Result<Vec<(Driver, Client)>, BenchError> {
    let mut out = Vec::with_capacity(drivers.len());
    for &d in drivers {
        out.push((d, Client::connect(d, urls).await?));
    }
    Ok(out)
}

/// `prev` and `next` pooled with `merge`.
fn pool<T>(prev: Option<T>, next: T, merge: fn(T, T) -> T) -> T {
    match prev {
        Some(p) => merge(p, next),
        None => next,
    }
}

fn skipped(reason: &str) -> Value {
    json!({ "status": "skipped", "reason": reason })
}

fn na(reason: &str) -> Value {
    json!({ "status": "n/a", "reason": reason })
}

fn progress(msg: impl std::fmt::Display) {
    eprintln!("[dlock-bench] {msg}");
}

async fn run(plan: Plan) -> Result<(), BenchError> {
    let started = Instant::now();
    let date = sys::utc_now();
    let load_start = sys::loadavg();
    progress(format!(
        "{} run, {date}; starting 5 redis-server processes",
        if plan.quick { "quick" } else { "default" }
    ));
    let mut servers =
        tokio::task::spawn_blocking(|| dlock_tests::redis_server::start_many(5)).await?;
    let urls: Vec<String> = servers.iter().map(|s| s.url()).collect();
    let one = vec![urls[0].clone()];
    let mut admin = Admin::connect(&urls).await?;
    let redis_version = admin.version().await?;
    let ping = admin.ping_rtt(2000).await?;
    progress(format!(
        "redis {redis_version}; PING round trip p50 {} µs, p99 {} µs",
        us(ping.median()),
        us(ping.pct(99.0))
    ));

    let mut scenarios = Map::new();
    let mut handoffs: Vec<(&str, Vec<(&'static str, Sorted)>)> = Vec::new();

    // 1. uncontended
    if plan.wants("uncontended") {
        let clients = connect_all(&plan.drivers, &one).await?;
        let mut load: Vec<Option<uncontended::Pairs>> = clients.iter().map(|_| None).collect();
        let mut single: Vec<Option<uncontended::Pairs>> = clients.iter().map(|_| None).collect();
        for _ in 0..plan.rounds {
            for (i, (_, c)) in clients.iter().enumerate() {
                admin.flush_all().await?;
                let p = uncontended::run(c, &mut admin, 1, plan.load(), "u").await?;
                load[i] = Some(pool(load[i].take(), p, uncontended::Pairs::merge));
                // The same with one task: latency without queueing.
                admin.flush_all().await?;
                let p = uncontended::run(c, &mut admin, 1, plan.one_task(), "u1").await?;
                single[i] = Some(pool(single[i].take(), p, uncontended::Pairs::merge));
            }
        }
        let mut s = Map::new();
        for (((d, _), p), one_task) in clients.iter().zip(load).zip(single) {
            let (Some(p), Some(one_task)) = (p, one_task) else {
                continue;
            };
            progress(format!(
                "uncontended  {:6}: {:9.0} pairs/s  p50 {:7.1} µs  p99 {:7.1} µs; one task: p50 {:6.1} µs p99 {:6.1} µs",
                d.name(),
                p.per_s(),
                us(p.lat.median()),
                us(p.lat.pct(99.0)),
                us(one_task.lat.median()),
                us(one_task.lat.pct(99.0)),
            ));
            let mut v = p.to_json(*d);
            v["one_task_pairs_per_s"] = json!(stats::round1(one_task.per_s()));
            v["one_task_p50_us"] = json!(us(one_task.lat.median()));
            v["one_task_p99_us"] = json!(us(one_task.lat.pct(99.0)));
            v["one_task_p999_us"] = json!(us(one_task.lat.pct(99.9)));
            s.insert(d.name().into(), v);
        }
        scenarios.insert("uncontended".into(), Value::Object(s));
    }

    // 2. contended, contended_think
    for (name, think) in [
        ("contended", None),
        ("contended_think", Some(contended::THINK)),
    ] {
        if !plan.wants(name) {
            continue;
        }
        let clients = connect_all(&plan.drivers, &one).await?;
        let mut acc: Vec<Option<contended::Contended>> = clients.iter().map(|_| None).collect();
        for _ in 0..plan.rounds {
            for (i, (_, c)) in clients.iter().enumerate() {
                admin.flush_all().await?;
                let r = contended::run(c, &mut admin, think, &plan).await?;
                acc[i] = Some(pool(acc[i].take(), r, contended::Contended::merge));
            }
        }
        let mut s = Map::new();
        let mut h = Vec::new();
        for ((d, _), r) in clients.iter().zip(acc) {
            let Some(r) = r else { continue };
            if r.overlaps > 0 {
                return Err(format!(
                    "{name}/{}: {} overlapping critical sections",
                    d.name(),
                    r.overlaps
                )
                .into());
            }
            progress(format!(
                "{name:15} {:6}: {:7.0} cs/s  wait p99 {:8.2} ms max {:8.2} ms  handoff p50 {:8.1} µs p99 {:8.1} µs  fairness {:.2}",
                d.name(),
                r.cs_per_s(),
                r.wait.pct(99.0).as_secs_f64() * 1e3,
                r.wait.max().as_secs_f64() * 1e3,
                us(r.handoff.median()),
                us(r.handoff.pct(99.0)),
                r.fairness()
            ));
            s.insert(d.name().into(), r.to_json(*d));
            h.push((d.name(), r.handoff));
        }
        scenarios.insert(name.into(), Value::Object(s));
        handoffs.push((name, h));
    }

    // 3. redlock
    if plan.wants("redlock") {
        let mut s = Map::new();
        let clients = connect_all(&plan.drivers, &urls).await?;
        let mut load: Vec<Option<uncontended::Pairs>> = clients.iter().map(|_| None).collect();
        for _ in 0..plan.rounds {
            for (i, (_, c)) in clients.iter().enumerate() {
                admin.flush_all().await?;
                let p = uncontended::run(c, &mut admin, 5, plan.load(), "rl").await?;
                load[i] = Some(pool(load[i].take(), p, uncontended::Pairs::merge));
            }
        }
        for ((d, c), p) in clients.iter().zip(load) {
            let Some(p) = p else { continue };
            let mut fields = match p.to_json(*d) {
                Value::Object(m) => m,
                _ => Map::new(),
            };
            admin.flush_all().await?;
            let f = redlock::faults(c, &mut servers, &plan).await?;
            f.to_json(&mut fields, redlock::deadline(*d));
            progress(format!(
                "redlock      {:6}: {:9.0} pairs/s  2/5 paused acquire median {} ms  3/5 paused failing acquire median {} ms ({})",
                d.name(),
                p.per_s(),
                fields["acquire_2_of_5_paused_median_ms"],
                fields["fail_3_of_5_paused_median_ms"],
                fields["fail_3_of_5_paused_outcome"].as_str().unwrap_or("")
            ));
            s.insert(d.name().into(), Value::Object(fields));
        }
        s.insert(
            "config".into(),
            json!({
                "servers": 5,
                "dlock": "RedlockBackend::connect(5 urls, RedlockOptions::default()): node timeout 50 ms, locker command timeout 1 s",
                "raw": "hand-written fan-out: SET NX PX to all 5 at once, granted at 3 OK, 50 ms per node, undone everywhere on failure",
                "rslock": "LockManager::new(5 urls), defaults: 3 attempts, 0-200 ms random delay, redis-rs 500 ms response timeout",
            }),
        );
        admin.flush_all().await?;
        scenarios.insert("redlock".into(), Value::Object(s));
    }

    // 3b. cluster: dlock on one server and on a 3-master cluster, the uncontended load.
    if plan.wants("cluster") && plan.drivers.contains(&Driver::Dlock) {
        progress("cluster: starting a 3-master Redis Cluster");
        let cluster =
            tokio::task::spawn_blocking(|| dlock_tests::redis_cluster::RedisCluster::start(3, 0))
                .await?;
        let mut admin_c = Admin::connect(&cluster.urls()).await?;
        let single = Client::connect(Driver::Dlock, &one).await?;
        let clustered = Client::Dlock(dlock_runtime::Locker::from_url(&cluster.url()).await?);
        let (mut on_one, mut on_cluster) = (None, None);
        for _ in 0..plan.rounds {
            admin.flush_all().await?;
            let p = uncontended::run(&single, &mut admin, 1, plan.load(), "cs").await?;
            on_one = Some(pool(on_one, p, uncontended::Pairs::merge));
            admin_c.flush_all().await?;
            let p = uncontended::run(&clustered, &mut admin_c, 3, plan.load(), "cc").await?;
            on_cluster = Some(pool(on_cluster, p, uncontended::Pairs::merge));
        }
        if let (Some(a), Some(b)) = (on_one, on_cluster) {
            progress(format!(
                "cluster      dlock : {:9.0} pairs/s on 3 masters, {:9.0} on one server; Redis CPU per pair {:.2} vs {:.2} µs",
                b.per_s(),
                a.per_s(),
                b.work.server.cpu_s * 1e6 / b.pairs.max(1) as f64,
                a.work.server.cpu_s * 1e6 / a.pairs.max(1) as f64,
            ));
            // 100,000 locks held with renewal, spread over the masters, in a child process.
            admin_c.flush_all().await?;
            progress(format!(
                "cluster: {} locks held for {:?} over the 3 masters in a child process",
                plan.held_locks, plan.held_for
            ));
            let held = held::run(&cluster.url(), plan.held_locks, plan.held_for).await?;
            progress(format!("cluster held: {held}"));
            scenarios.insert(
                "cluster".into(),
                json!({
                    "masters": 3,
                    "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
                    "one_server": a.to_json(Driver::Dlock),
                    "cluster": b.to_json(Driver::Dlock),
                    "held_at_scale": held,
                }),
            );
        }
        admin.flush_all().await?;
        drop(cluster);
    }

    // 3c. sentinel: dlock on one server and behind Sentinel (a master with one replica), with
    // and without waiting for the replica's acknowledgement, the uncontended load.
    if plan.wants("sentinel") && plan.drivers.contains(&Driver::Dlock) {
        progress("sentinel: starting a master, a replica and 3 sentinels");
        let deployment =
            tokio::task::spawn_blocking(dlock_tests::redis_sentinel::RedisSentinel::start).await?;
        let master = deployment.servers[deployment.master_index()].url();
        let mut admin_s = Admin::connect(std::slice::from_ref(&master)).await?;
        let single = Client::connect(Driver::Dlock, &one).await?;
        let behind = Client::Dlock(dlock_runtime::Locker::from_url(&deployment.url()).await?);
        let acked = Client::Dlock(
            dlock_runtime::Locker::builder()
                .replicas(1)
                .connect(&deployment.url())
                .await?,
        );
        let (mut on_one, mut on_sentinel, mut on_acked) = (None, None, None);
        for _ in 0..plan.rounds {
            admin.flush_all().await?;
            let p = uncontended::run(&single, &mut admin, 1, plan.load(), "ss").await?;
            on_one = Some(pool(on_one, p, uncontended::Pairs::merge));
            admin_s.flush_all().await?;
            let p = uncontended::run(&behind, &mut admin_s, 1, plan.load(), "sm").await?;
            on_sentinel = Some(pool(on_sentinel, p, uncontended::Pairs::merge));
            admin_s.flush_all().await?;
            let p = uncontended::run(&acked, &mut admin_s, 1, plan.load(), "sa").await?;
            on_acked = Some(pool(on_acked, p, uncontended::Pairs::merge));
        }
        if let (Some(a), Some(b), Some(c)) = (on_one, on_sentinel, on_acked) {
            progress(format!(
                "sentinel     dlock : {:9.0} pairs/s behind Sentinel, {:9.0} with replicas(1), {:9.0} on one server",
                b.per_s(),
                c.per_s(),
                a.per_s(),
            ));
            scenarios.insert(
                "sentinel".into(),
                json!({
                    "replicas": 1,
                    "sentinels": 3,
                    "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
                    "one_server": a.to_json(Driver::Dlock),
                    "sentinel": b.to_json(Driver::Dlock),
                    "sentinel_replicas_1": c.to_json(Driver::Dlock),
                }),
            );
        }
        admin.flush_all().await?;
        drop(deployment);
    }

    // 3d. etcd: dlock's etcd backend against a bare transaction and etcd's lock RPC.
    if plan.wants("etcd") && plan.drivers.contains(&Driver::Dlock) {
        progress("etcd: starting one etcd member");
        let v = etcd::run(&plan).await?;
        progress(format!(
            "etcd         dlock : {} pairs/s ({} µs client CPU per pair); bare txn {} pairs/s \
             ({} µs); etcd lock RPC {} pairs/s ({} µs)",
            v["dlock"]["pairs_per_s"],
            v["dlock"]["client_cpu_us_per_pair"],
            v["bare_txn"]["pairs_per_s"],
            v["bare_txn"]["client_cpu_us_per_pair"],
            v["lock_rpc"]["pairs_per_s"],
            v["lock_rpc"]["client_cpu_us_per_pair"]
        ));
        let (d, r) = (&v["contended"]["dlock"], &v["contended"]["lock_rpc"]);
        progress(format!(
            "etcd contended dlock: {} cs/s, handoff p50/p99 {}/{} µs, fairness {}; \
             lock RPC: {} cs/s, handoff p50/p99 {}/{} µs, fairness {}",
            d["cs_per_s"],
            d["handoff_p50_us"],
            d["handoff_p99_us"],
            d["fairness"],
            r["cs_per_s"],
            r["handoff_p50_us"],
            r["handoff_p99_us"],
            r["fairness"]
        ));
        scenarios.insert("etcd".into(), v);
    }

    // 3d'. ZooKeeper: dlock's ZooKeeper backend against a bare create + delete and the classic
    // recipe written by hand.
    if plan.wants("zookeeper") && plan.drivers.contains(&Driver::Dlock) {
        progress("zookeeper: starting one ZooKeeper server");
        let v = zookeeper::run(&plan).await?;
        progress(format!(
            "zookeeper    dlock : {} pairs/s; bare create+delete {} pairs/s; recipe {} pairs/s",
            v["dlock"]["pairs_per_s"],
            v["bare_create_delete"]["pairs_per_s"],
            v["recipe"]["pairs_per_s"]
        ));
        let (d, r) = (&v["contended"]["dlock"], &v["contended"]["recipe"]);
        progress(format!(
            "zookeeper contended dlock: {} cs/s, handoff p50/p99 {}/{} µs, fairness {}; \
             hand-written recipe: {} cs/s, handoff p50/p99 {}/{} µs, fairness {}",
            d["cs_per_s"],
            d["handoff_p50_us"],
            d["handoff_p99_us"],
            d["fairness"],
            r["cs_per_s"],
            r["handoff_p50_us"],
            r["handoff_p99_us"],
            r["fairness"]
        ));
        scenarios.insert("zookeeper".into(), v);
    }

    // 3e. semaphore (4 permits) and read-write lock (90 % reads), against a hand-written floor.
    for (name, rw) in [("semaphore", false), ("rwlock", true)] {
        if plan.wants(name) && plan.drivers.contains(&Driver::Dlock) {
            admin.flush_all().await?;
            scenarios.insert(name.into(), kinds::run(&one[0], rw, &plan).await?);
        }
    }

    // 4. held at scale
    if plan.wants("held_at_scale") {
        admin.flush_all().await?;
        progress(format!(
            "held_at_scale: {} locks for {:?} in a child process",
            plan.held_locks, plan.held_for
        ));
        let v = held::run(&one[0], plan.held_locks, plan.held_for).await?;
        progress(format!(
            "held_at_scale dlock: rss {} MiB, cpu {} cores, {} renewals/s, lost {}",
            v["rss_max_mib"], v["cpu_cores"], v["renewals_per_s"], v["lost"]
        ));
        admin.flush_all().await?;
        let why = "no watchdog: it has no auto-renewal, so \"held with renewal\" does not exist; \
                   renewing by hand would measure the bench's code, not the library's";
        scenarios.insert(
            "held_at_scale".into(),
            json!({
                "raw": na(why),
                "dlock": v,
                "rslock": na("no watchdog: extend() renews one lock per call and using() runs one timer per lock; \
                              it has no batched auto-renewal to measure"),
            }),
        );
    }

    // 5. layer overhead
    if plan.wants("layer_overhead") {
        admin.flush_all().await?;
        scenarios.insert(
            "layer_overhead".into(),
            layer_overhead(&one[0], &plan, &mut admin).await?,
        );
        admin.flush_all().await?;
    }

    // 6. postgres (its own server and drivers)
    if plan.wants("postgres") {
        scenarios.insert("postgres".into(), postgres::run(&plan).await?);
    }

    for name in SCENARIOS {
        if !scenarios.contains_key(name) {
            scenarios.insert(name.into(), skipped("not selected (--only)"));
        }
    }

    drop(admin);
    drop(servers);

    let meta = json!({
        "date": date,
        "mode": if plan.quick { "quick" } else { "default" },
        "command": format!("cargo run --release -p dlock-bench --{}", if plan.quick { " --quick" } else { "" }),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "tokio_workers": WORKERS,
        "redis_version": redis_version,
        "servers": 5,
        "warm_s": plan.warm.as_secs_f64(),
        "measure_s": plan.measure.as_secs_f64(),
        "rounds": plan.rounds,
        "ping_rtt_p50_us": us(ping.median()),
        "ping_rtt_p99_us": us(ping.pct(99.0)),
        "raw_poll_ms": clients::RAW_POLL.as_secs_f64() * 1e3,
        "dlock_contended": "OnFail::Retry(RetryPolicy::new(30 s)): the default policy (fair FIFO queue, woken by the release) with a long deadline",
        "rslock_contended": "LockManager::lock() (its defaults: 3 attempts, random 0-200 ms between) called again on every failure",
        "raw_contended": "SET NX PX, on failure sleep 1 ms (tokio timer) and try again",
        "hold": "tokio::time::sleep(1 ms); the measured hold is hold_p50_us",
        "total_s": round3(started.elapsed().as_secs_f64()),
        "loadavg_1m_start": load_start,
        "loadavg_1m_end": sys::loadavg(),
        "noise": "others_cpu_cores in each driver's figures: cores busy with other processes during its window",
    });
    let report = report::build(meta, scenarios);

    let dir = sys::target_dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    let json_path = dir.join("compare.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)? + "\n")?;
    let svg_path = dir.join("handoff.svg");
    if !handoffs.is_empty() {
        let panels: Vec<plot::Panel<'_>> = handoffs
            .iter()
            .map(|(name, series)| plot::Panel {
                title: format!(
                    "{name}: {} tasks, 1 ms hold{} — handoff gap",
                    contended::TASKS,
                    if name.ends_with("think") {
                        ", 5 ms pause after release"
                    } else {
                        ""
                    }
                ),
                series: series.iter().map(|(d, s)| (*d, s)).collect(),
            })
            .collect();
        plot::handoff_svg(&svg_path, &panels)?;
    }

    println!("{}", report::markdown(&report));
    progress(format!(
        "wrote {}{}; total {:.1} s",
        json_path.display(),
        if handoffs.is_empty() {
            String::new()
        } else {
            format!(" and {}", svg_path.display())
        },
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

#[cfg(feature = "layer")]
async fn layer_overhead(url: &str, plan: &Plan, admin: &mut Admin) -> Result<Value, BenchError> {
    // The round trip of the budget, measured around this scenario (the machine's load
    // changes over a run).
    let before = admin.ping_rtt(1000).await?;
    let [plain, raw, locked] = layer::run(url, plan).await?;
    let ping = before.merge(admin.ping_rtt(1000).await?);
    // Added latency from the one-connection passes: with 8 connections on 2 shared cores the
    // p99 is the machine's queueing, not the layer's path.
    let added = |h: &layer::Http, p: f64| {
        stats::round1((h.seq.lat.pct(p).as_secs_f64() - plain.seq.lat.pct(p).as_secs_f64()) * 1e6)
    };
    let added_load = |h: &layer::Http| {
        stats::round1(
            (h.load.lat.pct(99.0).as_secs_f64() - plain.load.lat.pct(99.0).as_secs_f64()) * 1e6,
        )
    };
    let budget = 2.0 * ping.median().as_secs_f64() + 100e-6;
    progress(format!(
        "layer_overhead: rps plain {:.0} / raw lock {:.0} / dlock layer {:.0}; one connection, added p50/p99: raw {} / {} µs, dlock {} / {} µs (budget {:.1} µs)",
        plain.load.rps(),
        raw.load.rps(),
        locked.load.rps(),
        added(&raw, 50.0),
        added(&raw, 99.0),
        added(&locked, 50.0),
        added(&locked, 99.0),
        budget * 1e6
    ));
    Ok(json!({
        "status": "ok",
        "plain": plain.to_json(),
        "raw": raw.to_json(),
        "dlock": locked.to_json(),
        "added_p50_us": added(&locked, 50.0),
        "added_p99_us": added(&locked, 99.0),
        "added_p99_under_load_us": added_load(&locked),
        "raw_added_p50_us": added(&raw, 50.0),
        "raw_added_p99_us": added(&raw, 99.0),
        "budget_us": stats::round1(budget * 1e6),
        "budget": "2 × PING round trip (p50, measured just before and after this scenario) + 100 µs",
        "ping_rtt_p50_us": us(ping.median()),
        "added_from": "one-connection passes: p50/p99 of the app minus the plain app's",
        "connections": layer::CONNECTIONS,
        "apps": {
            "plain": "axum hello-world",
            "raw": "the same handler with a hand-written SET NX PX before and EVALSHA compare-and-delete after (the floor of any Redis lock)",
            "dlock": "the same app with DistributedLockLayer::new(locker, key::header(\"x-bench-key\")).ttl(10 s), a unique header value per request",
        },
        "rslock": na("rslock has no tower layer"),
    }))
}

#[cfg(not(feature = "layer"))]
async fn layer_overhead(_url: &str, _plan: &Plan, _admin: &mut Admin) -> Result<Value, BenchError> {
    Ok(skipped("built without feature `layer` (dlock-tower)"))
}
