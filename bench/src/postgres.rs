//! Scenario `postgres`: the Postgres backend on a PostgreSQL this bench starts itself
//! (`dlock_tests::PostgresServer`: a throwaway cluster, `fsync` off, on a free loopback port),
//! against two floors measured in the same run over the same client (tokio-postgres
//! `query_typed` on a deadpool pool of [`POOL`] connections):
//!
//! * `floor`: a hand-written lease lock — one `INSERT … ON CONFLICT DO UPDATE … WHERE expired`
//!   to take, one owner-checked `DELETE` to release — the least a lease table costs;
//! * `advisory`: plain session-level `pg_try_advisory_lock` / `pg_advisory_unlock` on one
//!   pooled connection held for the pair (no lease, no fencing, no crash safety beyond the
//!   session).
//!
//! Uncontended: [`POOL`] tasks, each taking and releasing keys no one else uses. Contended:
//! [`contended::TASKS`] tasks on one key holding it 1 ms — dlock with `OnFail::retry(30 s)`
//! (fair queue, LISTEN/NOTIFY, direct handoff) against `pg_advisory_lock` (blocking, the
//! server's own lock queue).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::backend::postgres::deadpool_postgres::{
    Manager, ManagerConfig, Pool, RecyclingMethod,
};
use dlock_runtime::backend::postgres::tokio_postgres::types::Type;
use dlock_runtime::backend::postgres::tokio_postgres::NoTls;
use dlock_runtime::backend::{OwnerToken, PostgresBackend, PostgresOptions};
use dlock_runtime::{Locker, OnFail};
use dlock_tests::PostgresServer;
use serde_json::{json, Value};

use crate::contended;
use crate::stats::{ms, round1, round3, us, Sorted};
use crate::{progress, BenchError, Plan};

/// Connections of each pool, and tasks of the uncontended load.
pub(crate) const POOL: usize = 16;
const TTL: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Driver {
    Floor,
    Advisory,
    Dlock,
}

impl Driver {
    fn name(self) -> &'static str {
        match self {
            Driver::Floor => "floor",
            Driver::Advisory => "advisory",
            Driver::Dlock => "dlock",
        }
    }
}

#[derive(Clone)]
struct Clients {
    pool: Pool,
    locker: Locker,
}

const TAKE: &str = "INSERT INTO bench_floor AS f (name, owner, expires_at) \
    VALUES ($1, $2, clock_timestamp() + $3 * interval '1 millisecond') \
    ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at \
    WHERE f.expires_at < clock_timestamp() RETURNING 1";
const GIVE: &str = "DELETE FROM bench_floor WHERE name = $1 AND owner = $2";

fn key_id(key: &str) -> i64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default().hash_one(key) as i64
}

/// One acquire + release of `key`; `false` when the key was busy.
async fn pair(c: &Clients, d: Driver, key: &str) -> Result<bool, BenchError> {
    match d {
        Driver::Floor => {
            let client = c.pool.get().await?;
            let token = OwnerToken::generate();
            let ttl = TTL.as_millis() as i64;
            let took = client
                .query_typed(
                    TAKE,
                    &[
                        (&key, Type::TEXT),
                        (&token.as_str(), Type::TEXT),
                        (&ttl, Type::INT8),
                    ],
                )
                .await?;
            if took.is_empty() {
                return Ok(false);
            }
            client
                .query_typed(GIVE, &[(&key, Type::TEXT), (&token.as_str(), Type::TEXT)])
                .await?;
            Ok(true)
        }
        Driver::Advisory => {
            let client = c.pool.get().await?;
            let id = key_id(key);
            let rows = client
                .query_typed("SELECT pg_try_advisory_lock($1)", &[(&id, Type::INT8)])
                .await?;
            if !rows.first().is_some_and(|r| r.get::<_, bool>(0)) {
                return Ok(false);
            }
            client
                .query_typed("SELECT pg_advisory_unlock($1)", &[(&id, Type::INT8)])
                .await?;
            Ok(true)
        }
        Driver::Dlock => match c.locker.lock(key).ttl(TTL).try_acquire().await? {
            Some(g) => {
                g.release().await?;
                Ok(true)
            }
            None => Ok(false),
        },
    }
}

struct Pairs {
    pairs: usize,
    secs: f64,
    lat: Sorted,
}

async fn uncontended(
    c: &Clients,
    d: Driver,
    (warm, measure): (Duration, Duration),
    round: usize,
) -> Result<Pairs, BenchError> {
    let start = Instant::now();
    let (from, end) = (start + warm, start + warm + measure);
    let mut tasks = Vec::new();
    for t in 0..POOL {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut n = 0u64;
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let key = format!("u:{}:{round}:{t}:{n}", d.name());
                n += 1;
                let ok = pair(&c, d, &key).await?;
                if !ok {
                    return Err::<_, BenchError>(format!("{key} busy: nobody else uses it").into());
                }
                if t0 >= from {
                    lat.push(t0.elapsed());
                }
            }
            Ok(lat)
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await??);
    }
    Ok(Pairs {
        pairs: lat.len(),
        secs: measure.as_secs_f64(),
        lat: Sorted::from_durations(lat),
    })
}

/// One critical section: (task, acquire returned, release called).
type Cs = (usize, Instant, Instant);

struct Contended {
    cs: usize,
    secs: f64,
    handoff: Sorted,
    per_task: Vec<usize>,
    overlaps: usize,
}

async fn contended(
    c: &Clients,
    d: Driver,
    (warm, measure): (Duration, Duration),
    round: usize,
) -> Result<Contended, BenchError> {
    let key = format!("contended:{}:{round}", d.name());
    let start = Instant::now();
    let (from, end) = (start + warm, start + warm + measure);
    let mut tasks = Vec::new();
    for t in 0..contended::TASKS {
        let (c, key) = (c.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            let mut out: Vec<Cs> = Vec::new();
            while Instant::now() < end {
                match d {
                    Driver::Dlock => {
                        let g = c
                            .locker
                            .lock(&key)
                            .ttl(TTL)
                            .on_fail(OnFail::retry(Duration::from_secs(30)))
                            .acquire()
                            .await?;
                        let t1 = Instant::now();
                        tokio::time::sleep(contended::HOLD).await;
                        let t2 = Instant::now();
                        g.release().await?;
                        out.push((t, t1, t2));
                    }
                    _ => {
                        let client = c.pool.get().await?;
                        let id = key_id(&key);
                        client
                            .query_typed("SELECT pg_advisory_lock($1)", &[(&id, Type::INT8)])
                            .await?;
                        let t1 = Instant::now();
                        tokio::time::sleep(contended::HOLD).await;
                        let t2 = Instant::now();
                        client
                            .query_typed("SELECT pg_advisory_unlock($1)", &[(&id, Type::INT8)])
                            .await?;
                        out.push((t, t1, t2));
                    }
                }
            }
            Ok::<_, BenchError>(out)
        }));
    }
    let mut all: Vec<Cs> = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    all.sort_by_key(|cs| cs.1);
    let mut handoff = Vec::new();
    let mut overlaps = 0;
    for w in all.windows(2) {
        if w[1].1 < w[0].2 {
            overlaps += 1;
        } else if w[1].1 >= from {
            handoff.push(w[1].1 - w[0].2);
        }
    }
    let counted: Vec<&Cs> = all.iter().filter(|cs| cs.1 >= from).collect();
    let mut per_task = vec![0; contended::TASKS];
    for cs in &counted {
        per_task[cs.0] += 1;
    }
    Ok(Contended {
        cs: counted.len(),
        secs: measure.as_secs_f64(),
        handoff: Sorted::from_durations(handoff),
        per_task,
        overlaps,
    })
}

fn fairness(per_task: &[usize]) -> f64 {
    let min = per_task.iter().copied().min().unwrap_or(0) as f64;
    let max = per_task.iter().copied().max().unwrap_or(0) as f64;
    if max == 0.0 {
        0.0
    } else {
        round3(min / max)
    }
}

/// The whole scenario.
pub(crate) async fn run(plan: &Plan) -> Result<Value, BenchError> {
    // On a thread that outlives the scenario (see `etcd::run`).
    let server = Arc::new(
        tokio::task::spawn_blocking(|| {
            dlock_tests::redis_server::on_owner_thread("pg-bench", PostgresServer::start)
        })
        .await?,
    );
    let url = server.url("postgres");
    let config: dlock_runtime::backend::postgres::tokio_postgres::Config = url.parse()?;
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager).max_size(POOL).build()?;
    pool.get()
        .await?
        .batch_execute(
            "CREATE TABLE bench_floor (name text PRIMARY KEY, owner text NOT NULL, \
             expires_at timestamptz NOT NULL)",
        )
        .await?;
    let backend = PostgresBackend::connect(
        &url,
        PostgresOptions::default()
            .pool_size(POOL)
            .command_timeout(Duration::from_secs(5)),
    )
    .await?;
    let locker = Locker::builder()
        .prefix("bench")
        .command_timeout(Duration::from_secs(5))
        .try_build(backend)?;
    let c = Clients { pool, locker };
    let version = c
        .pool
        .get()
        .await?
        .query_one("SHOW server_version", &[])
        .await?
        .get::<_, String>(0);
    progress(format!("postgres {version} on port {}", server.port()));

    let drivers = [Driver::Floor, Driver::Advisory, Driver::Dlock];
    let window = (plan.warm, plan.measure);
    let mut un: Vec<Option<Pairs>> = drivers.iter().map(|_| None).collect();
    for round in 0..plan.rounds {
        for (i, &d) in drivers.iter().enumerate() {
            let p = uncontended(&c, d, window, round).await?;
            un[i] = Some(match un[i].take() {
                Some(o) => Pairs {
                    pairs: o.pairs + p.pairs,
                    secs: o.secs + p.secs,
                    lat: o.lat.merge(p.lat),
                },
                None => p,
            });
        }
    }
    let mut uncontended_json = serde_json::Map::new();
    let mut rates = [0.0f64; 3];
    for (i, (&d, p)) in drivers.iter().zip(&un).enumerate() {
        let Some(p) = p else { continue };
        let per_s = p.pairs as f64 / p.secs;
        rates[i] = per_s;
        progress(format!(
            "postgres uncontended {:8}: {per_s:8.0} pairs/s  p50 {:7.1} µs  p99 {:7.1} µs",
            d.name(),
            us(p.lat.median()),
            us(p.lat.pct(99.0))
        ));
        uncontended_json.insert(
            d.name().into(),
            json!({
                "pairs_per_s": round1(per_s),
                "p50_us": us(p.lat.median()),
                "p99_us": us(p.lat.pct(99.0)),
                "max_ms": ms(p.lat.max()),
                "pairs": p.pairs,
                "tasks": POOL,
            }),
        );
    }
    let vs_floor = round3(rates[2] / rates[0].max(1.0));
    let vs_advisory = round3(rates[2] / rates[1].max(1.0));

    let mut co = serde_json::Map::new();
    let mut dlock_fair = 0.0;
    let mut dlock_handoff_p99 = Duration::ZERO;
    for d in [Driver::Advisory, Driver::Dlock] {
        let mut acc: Option<Contended> = None;
        for round in 0..plan.rounds {
            let r = contended(&c, d, window, round).await?;
            acc = Some(match acc {
                Some(o) => Contended {
                    cs: o.cs + r.cs,
                    secs: o.secs + r.secs,
                    handoff: o.handoff.merge(r.handoff),
                    per_task: o
                        .per_task
                        .iter()
                        .zip(&r.per_task)
                        .map(|(a, b)| a + b)
                        .collect(),
                    overlaps: o.overlaps + r.overlaps,
                },
                None => r,
            });
        }
        let Some(r) = acc else { continue };
        if r.overlaps > 0 {
            return Err(format!("postgres contended/{}: {} overlaps", d.name(), r.overlaps).into());
        }
        let f = fairness(&r.per_task);
        progress(format!(
            "postgres contended   {:8}: {:6.0} cs/s  handoff p50 {:7.1} µs p99 {:7.1} µs  fairness {f:.2}",
            d.name(),
            r.cs as f64 / r.secs,
            us(r.handoff.median()),
            us(r.handoff.pct(99.0)),
        ));
        if d == Driver::Dlock {
            dlock_fair = f;
            dlock_handoff_p99 = r.handoff.pct(99.0);
        }
        co.insert(
            d.name().into(),
            json!({
                "cs_per_s": round1(r.cs as f64 / r.secs),
                "handoff_p50_us": us(r.handoff.median()),
                "handoff_p99_us": us(r.handoff.pct(99.0)),
                "fairness": f,
                "per_task": r.per_task,
            }),
        );
    }
    let targets = json!({
        "uncontended_vs_floor": { "value": vs_floor, "target": ">= 0.8", "met": vs_floor >= 0.8 },
        "contended_fairness": { "value": dlock_fair, "target": ">= 0.95", "met": dlock_fair >= 0.95 },
        "handoff_p99_ms": {
            "value": ms(dlock_handoff_p99),
            "target": "<= 2",
            "met": dlock_handoff_p99 <= Duration::from_millis(2),
        },
    });
    progress(format!(
        "postgres: uncontended dlock/floor {vs_floor} (target ≥ 0.8), dlock/advisory {vs_advisory}; \
         contended fairness {dlock_fair} (≥ 0.95), handoff p99 {} ms (≤ 2)",
        ms(dlock_handoff_p99)
    ));
    drop(c);
    drop(server);
    Ok(json!({
        "status": "ok",
        "postgres_version": version,
        "server": "throwaway cluster (initdb), fsync off, on a free loopback port",
        "client": "tokio-postgres query_typed over deadpool-postgres, pool of 16, for all drivers",
        "uncontended": uncontended_json,
        "uncontended_dlock_vs_floor": vs_floor,
        "uncontended_dlock_vs_advisory": vs_advisory,
        "contended": co,
        "targets": targets,
        "floor": "INSERT … ON CONFLICT (name) DO UPDATE … WHERE expired RETURNING 1 to take, DELETE … WHERE name AND owner to release",
        "advisory": "pg_try_advisory_lock / pg_advisory_unlock (uncontended), pg_advisory_lock / pg_advisory_unlock (contended), session-level, on one pooled connection per pair",
    }))
}
