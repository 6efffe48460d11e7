//! Worker mode (`dlock-torture worker …`): one OS process, spawned by the coordinator, running
//! `tasks` tasks that take locks on the shared keys and do a fenced read-modify-write on the
//! resource inside each critical section.
//!
//! One critical section, as a careful user writes it:
//!
//! 1. `acquire` the lock (fair wait, bounded);
//! 2. fenced **read** of the counter with the guard's fencing token;
//! 3. "work" for a few ms, racing `guard.lost()` — if the lock is reported lost, stop here
//!    (outcome `abort`, nothing written). In one section of four the work also changes the
//!    lease with `extend`: shortens it (to 30–80 % of the TTL), or shortens it and then
//!    lengthens it back to the full TTL — never beyond, so the liveness bound still holds. A
//!    failed extend is treated like a loss (outcome `abort`);
//! 4. check `guard.is_held()` one last time (outcome `abort` if not);
//!
//!    A section also keeps a **margin** of its lease: the longest commit window plus
//!    [`END_SLACK`] (a fifth of the TTL if less). One acquired with less left is released unread (`short_leases`); one whose
//!    lease comes within the margin of its end while it works (renewals failing), or at the last
//!    check, ends as `abort` (`margin_aborts`, counted in `lost_aborts` too). A live section then ends — its write and its
//!    end record on the resource — before its lease, and an overlap of two live holders is the
//!    lock service's doing: it fails the run, except under a fault that loses locks on the
//!    server (see the coordinator's report);
//! 5. the **commit window**: the write is on its way to the resource (a few ms, modelling
//!    serialisation and the network). Nothing can check the lock any more: a process frozen
//!    here (GC pause, SIGSTOP) sends its write right after it wakes, without knowing it slept.
//!    The worker tells the resource it entered this phase, so the coordinator can freeze it
//!    exactly here;
//! 6. fenced **write** of `read + 1` (outcome `ok`, or `fenced` when refused);
//! 7. `release` — which, when a fault cuts the connection at that moment, fails and is then
//!    finished by the locker's background task; `locks_left` checks that none is leaked.
//!
//! The worker stops when its stdin closes (the coordinator's signal, and also what happens if
//! the coordinator dies), finishing or cancelling what is in flight, then prints one line of
//! client-side counters (`worker id=… cs=… …`) and exits 0.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::backend::{RedlockBackend, RedlockOptions};
use dlock_runtime::{LockError, Locker, OnFail};
use tokio::io::AsyncReadExt as _;
use tokio::sync::watch;

use crate::config::{Args, BackendKind};
use crate::resource::Resource;
use crate::rng::Rng;

/// The settings of one worker process, passed on its command line.
#[derive(Clone, Debug)]
pub(crate) struct WorkerConfig {
    /// Worker number (unique in the run; respawns get new numbers).
    pub(crate) id: u32,
    /// Which lock backend.
    pub(crate) backend: BackendKind,
    /// Lock servers, as the workers reach them (through the proxies).
    pub(crate) lock_urls: Vec<String>,
    /// The resource server (direct).
    pub(crate) resource_url: String,
    /// Number of keys (`k0`…).
    pub(crate) keys: u32,
    /// Tasks in this process.
    pub(crate) tasks: u32,
    /// Lock TTL.
    pub(crate) ttl_ms: u64,
    /// Waiter-queue entry TTL.
    pub(crate) waiter_ttl_ms: u64,
    /// Locker command timeout.
    pub(crate) command_timeout_ms: u64,
    /// Redlock per-node timeout.
    pub(crate) node_timeout_ms: u64,
    /// How long an acquire waits before giving up.
    pub(crate) wait_ms: u64,
    /// Work phase length range.
    pub(crate) work_ms: (u64, u64),
    /// Commit window length range.
    pub(crate) commit_ms: (u64, u64),
    /// RNG seed of this worker.
    pub(crate) seed: u64,
}

impl WorkerConfig {
    /// The command-line arguments that [`WorkerConfig::parse`] reads back.
    pub(crate) fn to_args(&self) -> Vec<String> {
        let mut v = vec!["worker".to_owned()];
        let mut kv = |k: &str, val: String| {
            v.push(format!("--{k}"));
            v.push(val);
        };
        kv("id", self.id.to_string());
        kv("backend", self.backend.name().to_owned());
        // Space-separated: a cluster's or Sentinel's URL holds commas.
        kv("lock-urls", self.lock_urls.join(" "));
        kv("resource-url", self.resource_url.clone());
        kv("keys", self.keys.to_string());
        kv("tasks", self.tasks.to_string());
        kv("ttl-ms", self.ttl_ms.to_string());
        kv("waiter-ttl-ms", self.waiter_ttl_ms.to_string());
        kv("command-timeout-ms", self.command_timeout_ms.to_string());
        kv("node-timeout-ms", self.node_timeout_ms.to_string());
        kv("wait-ms", self.wait_ms.to_string());
        kv("work-ms", format!("{}..{}", self.work_ms.0, self.work_ms.1));
        kv(
            "commit-ms",
            format!("{}..{}", self.commit_ms.0, self.commit_ms.1),
        );
        kv("seed", self.seed.to_string());
        v
    }

    /// Reads the worker's arguments (after `worker`).
    pub(crate) fn parse(args: &Args) -> Result<Self, String> {
        Ok(WorkerConfig {
            id: args.num("id")?.ok_or("--id is required")? as u32,
            backend: BackendKind::parse(&args.string("backend").ok_or("--backend is required")?)?,
            lock_urls: args
                .string("lock-urls")
                .ok_or("--lock-urls is required")?
                .split(' ')
                .map(str::to_owned)
                .collect(),
            resource_url: args
                .string("resource-url")
                .ok_or("--resource-url is required")?,
            keys: args.num("keys")?.unwrap_or(4) as u32,
            tasks: args.num("tasks")?.unwrap_or(16) as u32,
            ttl_ms: args.num("ttl-ms")?.unwrap_or(1000),
            waiter_ttl_ms: args.num("waiter-ttl-ms")?.unwrap_or(1000),
            command_timeout_ms: args.num("command-timeout-ms")?.unwrap_or(500),
            node_timeout_ms: args.num("node-timeout-ms")?.unwrap_or(50),
            wait_ms: args.num("wait-ms")?.unwrap_or(10_000),
            work_ms: args.range("work-ms")?.unwrap_or((1, 3)),
            commit_ms: args.range("commit-ms")?.unwrap_or((4, 8)),
            seed: args.num("seed")?.unwrap_or(0),
        })
    }
}

/// Client-side counters of one worker (the resource's log is the source of truth; these
/// explain it).
#[derive(Default)]
struct Stats {
    acquired: AtomicU64,
    cs_ok: AtomicU64,
    fenced_reads: AtomicU64,
    fenced_writes: AtomicU64,
    lost_aborts: AtomicU64,
    acquire_unavailable: AtomicU64,
    acquire_timeout: AtomicU64,
    acquire_other: AtomicU64,
    release_lost: AtomicU64,
    release_err: AtomicU64,
    resource_err: AtomicU64,
    extend_shorter: AtomicU64,
    extend_longer: AtomicU64,
    extend_failed: AtomicU64,
    short_leases: AtomicU64,
    margin_aborts: AtomicU64,
    /// Acquire error messages (digits stripped) and how often each was seen.
    errors: std::sync::Mutex<BTreeMap<String, u64>>,
}

impl Stats {
    fn line(&self, id: u32) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        format!(
            "worker id={id} acquired={} cs={} fenced_reads={} fenced_writes={} lost_aborts={} \
             acquire_unavailable={} acquire_timeout={} acquire_other={} release_lost={} \
             release_err={} resource_err={} extend_shorter={} extend_longer={} extend_failed={} \
             short_leases={} margin_aborts={}",
            g(&self.acquired),
            g(&self.cs_ok),
            g(&self.fenced_reads),
            g(&self.fenced_writes),
            g(&self.lost_aborts),
            g(&self.acquire_unavailable),
            g(&self.acquire_timeout),
            g(&self.acquire_other),
            g(&self.release_lost),
            g(&self.release_err),
            g(&self.resource_err),
            g(&self.extend_shorter),
            g(&self.extend_longer),
            g(&self.extend_failed),
            g(&self.short_leases),
            g(&self.margin_aborts),
        )
    }
}

/// Runs a worker process to completion. Returns the process exit code.
pub(crate) fn main(args: &Args) -> i32 {
    let cfg = match WorkerConfig::parse(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("dlock-torture worker: {e}");
            return 2;
        }
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run(cfg)) {
        Ok(line) => {
            println!("{line}");
            0
        }
        Err(e) => {
            eprintln!("dlock-torture worker: {e}");
            1
        }
    }
}

async fn connect_locker(cfg: &WorkerConfig) -> Result<Locker, LockError> {
    let builder = Locker::builder()
        .prefix("torture")
        .command_timeout(Duration::from_millis(cfg.command_timeout_ms))
        .waiter_ttl(Duration::from_millis(cfg.waiter_ttl_ms));
    match cfg.backend {
        BackendKind::Redis
        | BackendKind::Postgres
        | BackendKind::Cluster
        | BackendKind::Sentinel
        | BackendKind::Etcd
        | BackendKind::Zookeeper => builder.connect(&cfg.lock_urls[0]).await,
        BackendKind::Redlock => {
            let urls: Vec<&str> = cfg.lock_urls.iter().map(String::as_str).collect();
            let opts = RedlockOptions::default()
                .node_timeout(Duration::from_millis(cfg.node_timeout_ms))
                .connect_timeout(Duration::from_millis(cfg.command_timeout_ms));
            let backend = RedlockBackend::connect(&urls, opts).await?;
            builder.try_build(backend)
        }
    }
}

async fn run(cfg: WorkerConfig) -> Result<String, String> {
    // A fault may be in progress when a replacement worker starts: keep trying for a while.
    let start = Instant::now();
    let locker = loop {
        match connect_locker(&cfg).await {
            Ok(l) => break l,
            Err(e) if start.elapsed() < Duration::from_secs(15) => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(format!("cannot connect the locker: {e}")),
        }
    };
    let resource = Resource::connect(&cfg.resource_url)
        .await
        .map_err(|e| format!("cannot connect the resource: {e}"))?;

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        // The coordinator closes our stdin to stop us.
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 64];
        while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
        let _ = stop_tx.send(true);
    });

    let stats = Arc::new(Stats::default());
    let root = Rng::new(cfg.seed);
    let trace = Arc::new(Trace::open(cfg.id));
    let mut handles = Vec::new();
    for task in 0..cfg.tasks {
        let t = Task {
            trace: trace.clone(),
            cfg: cfg.clone(),
            writer: format!("w{}.{task}", cfg.id),
            locker: locker.clone(),
            resource: resource.clone(),
            stats: stats.clone(),
            rng: root.fork(u64::from(task) + 1),
            stop: stop_rx.clone(),
        };
        handles.push(tokio::spawn(t.run()));
    }
    for h in handles {
        h.await.map_err(|e| format!("task panicked: {e}"))?;
    }
    // Let the locker's background task send the releases of dropped guards and cancelled
    // acquires before the runtime goes away.
    drop(locker);
    tokio::time::sleep(Duration::from_millis(300)).await;
    if std::env::var_os("DLOCK_TORTURE_VERBOSE").is_some() {
        let errors = stats
            .errors
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (msg, n) in errors.iter() {
            eprintln!("worker {}: {n} x acquire error: {msg}", cfg.id);
        }
    }
    Ok(stats.line(cfg.id))
}

/// A debugging aid: with `DLOCK_TORTURE_TRACE=<dir>`, each worker appends a line per acquire
/// and release (wall-clock µs, task, key, what happened) to `<dir>/w<id>.trace`, to line up
/// with the resource's log when a stall or an overlap needs explaining.
struct Trace(Option<std::sync::Mutex<std::fs::File>>);

impl Trace {
    fn open(id: u32) -> Trace {
        let file = std::env::var_os("DLOCK_TORTURE_TRACE").and_then(|dir| {
            (std::fs::OpenOptions::new().create(true).append(true))
                .open(std::path::Path::new(&dir).join(format!("w{id}.trace")))
                .ok()
        });
        Trace(file.map(std::sync::Mutex::new))
    }

    fn line(&self, who: &str, key: &str, what: std::fmt::Arguments<'_>) {
        let Some(file) = &self.0 else { return };
        let us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        let mut f = file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = std::io::Write::write_fmt(&mut *f, format_args!("{us} {who} {key} {what}\n"));
    }
}

/// Of a section's lease margin, beyond its longest commit window: time for its write and its
/// end record to reach the resource — this, or a fifth of the TTL if less.
const END_SLACK: Duration = Duration::from_millis(200);

struct Task {
    trace: Arc<Trace>,
    cfg: WorkerConfig,
    writer: String,
    locker: Locker,
    resource: Resource,
    stats: Arc<Stats>,
    rng: Rng,
    stop: watch::Receiver<bool>,
}

impl Task {
    async fn run(mut self) {
        let pid = std::process::id();
        let ttl = Duration::from_millis(self.cfg.ttl_ms);
        let wait = Duration::from_millis(self.cfg.wait_ms);
        let margin = Duration::from_millis(self.cfg.commit_ms.1) + END_SLACK.min(ttl / 5);
        let mut stop = self.stop.clone();
        while !*self.stop.borrow() {
            let key = format!("k{}", self.rng.below(u64::from(self.cfg.keys)));
            self.trace.line(&self.writer, &key, format_args!("acquire"));
            let acquire = self
                .locker
                .lock(key.as_str())
                .ttl(ttl)
                .on_fail(OnFail::retry(wait))
                .acquire();
            // Stopping cancels a waiting acquire (the runtime must clean up after it).
            let guard = tokio::select! {
                r = acquire => r,
                _ = stop.wait_for(|s| *s) => break,
            };
            let guard = match guard {
                Ok(g) => g,
                Err(e) => {
                    (self.trace).line(&self.writer, &key, format_args!("acquire-err {e}"));
                    let counter = if e.is_unavailable() {
                        &self.stats.acquire_unavailable
                    } else if e.is_timeout() {
                        &self.stats.acquire_timeout
                    } else {
                        &self.stats.acquire_other
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    let msg: String = e
                        .to_string()
                        .chars()
                        .map(|c| if c.is_ascii_digit() { '#' } else { c })
                        .collect();
                    *self
                        .stats
                        .errors
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .entry(msg)
                        .or_default() += 1;
                    tokio::time::sleep(self.rng.millis(10, 50)).await;
                    continue;
                }
            };
            self.stats.acquired.fetch_add(1, Ordering::Relaxed);
            let token = guard.fencing_token();
            (self.trace).line(&self.writer, &key, format_args!("acquired {token}"));
            let w = self.writer.as_str();
            if guard.remaining() < margin {
                self.stats.short_leases.fetch_add(1, Ordering::Relaxed);
                self.release(guard).await;
                continue;
            }

            // Fenced read.
            let read = match self.resource.begin(&key, token, w, pid).await {
                Ok(Some(r)) => r,
                Ok(None) => {
                    self.stats.fenced_reads.fetch_add(1, Ordering::Relaxed);
                    self.release(guard).await;
                    continue;
                }
                Err(_) => {
                    self.stats.resource_err.fetch_add(1, Ordering::Relaxed);
                    self.release(guard).await;
                    continue;
                }
            };

            // Work, watching for loss like a careful user; sometimes changing the lease.
            let work = self.rng.millis(self.cfg.work_ms.0, self.cfg.work_ms.1);
            let lease_ok = change_lease(&mut self.rng, &self.stats, &guard, ttl).await;
            let lost = !lease_ok || {
                let worked = tokio::time::sleep(work);
                tokio::pin!(worked);
                loop {
                    // Renewals may push the margin's instant back while this works.
                    let near_end = tokio::time::sleep(guard.remaining().saturating_sub(margin));
                    tokio::select! {
                        biased;
                        _ = guard.lost() => break true,
                        _ = &mut worked => break false,
                        _ = near_end => if guard.remaining() < margin {
                            self.stats.margin_aborts.fetch_add(1, Ordering::Relaxed);
                            break true;
                        },
                    }
                }
            };
            let short = !lost && guard.is_held() && guard.remaining() < margin;
            if short {
                self.stats.margin_aborts.fetch_add(1, Ordering::Relaxed);
            }
            if lost || short || !guard.is_held() {
                self.stats.lost_aborts.fetch_add(1, Ordering::Relaxed);
                self.end(&key, token, "abort").await;
                self.release(guard).await;
                continue;
            }

            // Past the last check: the write is on its way.
            if self.resource.commit(&key, token, w, pid).await.is_err() {
                self.stats.resource_err.fetch_add(1, Ordering::Relaxed);
            }
            let window = self.rng.millis(self.cfg.commit_ms.0, self.cfg.commit_ms.1);
            tokio::time::sleep(window).await;
            let outcome = match self
                .resource
                .write(&key, token, w, read, read.val + 1)
                .await
            {
                Ok(true) => {
                    self.stats.cs_ok.fetch_add(1, Ordering::Relaxed);
                    "ok"
                }
                Ok(false) => {
                    self.stats.fenced_writes.fetch_add(1, Ordering::Relaxed);
                    "fenced"
                }
                Err(_) => {
                    self.stats.resource_err.fetch_add(1, Ordering::Relaxed);
                    "error"
                }
            };
            self.end(&key, token, outcome).await;
            self.release(guard).await;
        }
    }

    async fn end(&self, key: &str, token: u64, outcome: &str) {
        if self
            .resource
            .end(key, token, &self.writer, outcome)
            .await
            .is_err()
        {
            self.stats.resource_err.fetch_add(1, Ordering::Relaxed);
        }
    }

    async fn release(&self, guard: dlock_runtime::LockGuard) {
        let key = guard.key().to_owned();
        self.trace.line(&self.writer, &key, format_args!("release"));
        let released = guard.release().await;
        let what = match &released {
            Ok(()) => "ok".to_owned(),
            Err(e) => e.to_string(),
        };
        (self.trace).line(&self.writer, &key, format_args!("released {what}"));
        match released {
            Ok(()) => {}
            Err(e) if e.is_lost() => {
                self.stats.release_lost.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.stats.release_err.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// In one section of four: `extend` to a shorter lease (30–80 % of `ttl`), and in half of
/// those then back to `ttl`. The lease never exceeds `ttl`, so the liveness bound holds.
/// `false` when an extend failed (lost, or the backend did not answer): the section must
/// not write.
async fn change_lease(
    rng: &mut Rng,
    stats: &Stats,
    guard: &dlock_runtime::LockGuard,
    ttl: Duration,
) -> bool {
    if rng.below(4) != 0 {
        return true;
    }
    let ttl_ms = ttl.as_millis() as u64;
    let shorter = rng.millis(ttl_ms * 3 / 10, ttl_ms * 8 / 10);
    let lengthen = rng.below(2) == 0;
    if guard.extend(shorter).await.is_err() {
        stats.extend_failed.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    stats.extend_shorter.fetch_add(1, Ordering::Relaxed);
    // The guard must follow the shorter lease at once (a worker that panics fails the run).
    assert!(
        guard.remaining() <= shorter,
        "after extend({shorter:?}) the guard claims {:?}",
        guard.remaining()
    );
    if lengthen {
        if guard.extend(ttl).await.is_err() {
            stats.extend_failed.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        stats.extend_longer.fetch_add(1, Ordering::Relaxed);
    }
    true
}

/// Parses a worker's stats line into counters.
pub(crate) fn parse_stats(line: &str) -> Option<BTreeMap<String, u64>> {
    let rest = line.strip_prefix("worker ")?;
    Some(
        rest.split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .filter(|(k, _)| *k != "id")
            .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
            .collect(),
    )
}
