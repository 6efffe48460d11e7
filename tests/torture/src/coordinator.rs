//! Coordinator mode (the default): starts the servers, the proxies and the worker processes,
//! injects the seeded fault schedule, stops everything, checks for locks left behind, and
//! reports.
//!
//! One **phase** per backend:
//!
//! 1. start the lock servers (1 for `redis`, 5 for `redlock`, 1 PostgreSQL for `postgres`, each
//!    behind a [`Proxy`]; for `cluster` a 3-master/3-replica Redis Cluster, reached directly) and
//!    the resource server (direct, never faulted);
//! 2. spawn `procs` worker processes (`current_exe() worker …`) and wait until every key has
//!    completed a critical section;
//! 3. run `rounds` rounds of faults; a round is every [`FaultKind`] of the configuration that
//!    applies to the backend ([`BackendKind::faults`]) once, in an order drawn
//!    from the seed, with seeded parameters. Faults run one at a time: inject, lift, wait until
//!    every key has progressed again (bounded), then a seeded gap;
//! 4. lift everything, close the workers' stdin (they finish, release and exit), and count the
//!    lock keys left on the lock servers (then wait, bounded, to see whether those expire);
//! 5. replay the resource's logs into a [`PhaseReport`].

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use dlock_tests::etcd_server::EtcdCluster;
use dlock_tests::redis_cluster::{key_slot, RedisCluster, NODE_TIMEOUT};
use dlock_tests::redis_sentinel::{RedisSentinel, DOWN_AFTER};
use dlock_tests::redis_server::Failover;
use dlock_tests::zookeeper_server::ZkEnsemble;
use dlock_tests::{PostgresServer, Quorum, RedisServer};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
use tokio::process::{Child, ChildStdin, Command};

use crate::config::{names_of, BackendKind, Config, FaultKind};
use crate::report::{self, FaultRecord, PhaseReport};
use crate::resource::{Entrant, Resource};
use crate::rng::Rng;
use crate::worker::{self, WorkerConfig};
use dlock_tests::proxy::Proxy;

type Shared<T> = Arc<Mutex<T>>;

fn lock<T: ?Sized>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Sends signals through one long-lived `sh` (its `kill` is a builtin: no fork per signal),
/// so a SIGSTOP lands within a fraction of a millisecond of the decision — the commit window
/// it aims at is only a few ms long. (The workspace forbids `unsafe`, so no `libc::kill`.)
struct Signaller {
    _sh: Child,
    stdin: ChildStdin,
    acks: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl Signaller {
    fn start() -> Result<Signaller, String> {
        let mut sh = Command::new("sh")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start sh: {e}"))?;
        let stdin = sh.stdin.take().ok_or("sh stdin")?;
        let stdout = sh.stdout.take().ok_or("sh stdout")?;
        Ok(Signaller {
            _sh: sh,
            stdin,
            acks: tokio::io::BufReader::new(stdout).lines(),
        })
    }

    /// Sends `sig` (`STOP`, `CONT`, `KILL`) to `pid` and waits until it was sent. Returns
    /// whether `kill` succeeded.
    async fn send(&mut self, sig: &str, pid: u32) -> bool {
        let cmd = format!("if kill -{sig} {pid} 2>/dev/null; then echo ok; else echo no; fi\n");
        if self.stdin.write_all(cmd.as_bytes()).await.is_err() {
            return false;
        }
        let _ = self.stdin.flush().await;
        matches!(self.acks.next_line().await, Ok(Some(l)) if l == "ok")
    }
}

/// One step run on a [`QuorumOwner`]'s thread.
type QuorumStep = Box<dyn FnOnce(&mut dyn Quorum) + Send>;

/// A consensus deployment (`etcd`, `zookeeper`) on a thread of its own that lives as long as
/// the phase: its members die with the thread that started them (`setpriv --pdeathsig`), so
/// every step that starts one — the start, a restart after `leader-kill` — runs there, never
/// on a blocking-pool thread that tokio retires when idle. Dropping it ends the thread, which
/// drops the deployment (members killed, folders removed).
struct QuorumOwner {
    steps: std::sync::mpsc::Sender<QuorumStep>,
}

impl QuorumOwner {
    async fn start(make: fn() -> Box<dyn Quorum>) -> Result<QuorumOwner, String> {
        let (steps, rx) = std::sync::mpsc::channel::<QuorumStep>();
        let (ready, started) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("quorum-owner".into())
            .spawn(move || {
                let mut q = make();
                let _ = ready.send(());
                for step in rx {
                    step(&mut *q);
                }
            })
            .map_err(|e| format!("cannot start the quorum's owner thread: {e}"))?;
        started
            .await
            .map_err(|_| "the cluster did not start (see the panic above)".to_owned())?;
        Ok(QuorumOwner { steps })
    }

    /// Runs `f` on the deployment, on the owner thread.
    async fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Quorum) -> R + Send + 'static,
    ) -> Result<R, String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let step: QuorumStep = Box::new(move |q| {
            let _ = tx.send(f(q));
        });
        self.steps
            .send(step)
            .map_err(|_| "the quorum's owner thread is gone".to_owned())?;
        rx.await
            .map_err(|_| "a step on the cluster failed (see the panic above)".to_owned())
    }
}

/// Polls (on the owner thread) until a member other than `not` leads; whether one did within
/// `limit`.
fn wait_new_leader(q: &dyn Quorum, not: usize, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if q.leader().is_some_and(|l| l != not) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

struct WorkerProc {
    name: String,
    pid: u32,
    child: Child,
    stdin: Option<ChildStdin>,
    out: tokio::task::JoinHandle<Vec<String>>,
}

/// The worker processes of one phase.
struct Workers {
    exe: PathBuf,
    template: WorkerConfig,
    procs: Vec<WorkerProc>,
    next_id: u32,
    crashes: Vec<String>,
    stats: Vec<String>,
    seed: Rng,
}

impl Workers {
    fn spawn(&mut self) -> Result<(), String> {
        let id = self.next_id;
        self.next_id += 1;
        let cfg = WorkerConfig {
            id,
            seed: self.seed.fork(u64::from(id)).next_u64(),
            ..self.template.clone()
        };
        let mut child = Command::new(&self.exe)
            .args(cfg.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot spawn a worker ({}): {e}", self.exe.display()))?;
        let pid = child.id().unwrap_or(0);
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let out = tokio::spawn(async move {
            let mut lines = Vec::new();
            if let Some(stdout) = stdout {
                let mut r = tokio::io::BufReader::new(stdout).lines();
                while let Ok(Some(l)) = r.next_line().await {
                    lines.push(l);
                }
            }
            lines
        });
        self.procs.push(WorkerProc {
            name: format!("w{id}"),
            pid,
            child,
            stdin,
            out,
        });
        Ok(())
    }

    fn by_pid(&self, pid: u32) -> Option<usize> {
        self.procs.iter().position(|p| p.pid == pid)
    }

    /// Reaps workers that exited on their own (a crash: they only exit when told) and
    /// replaces them.
    fn check(&mut self) -> Result<(), String> {
        let mut i = 0;
        while i < self.procs.len() {
            if let Ok(Some(status)) = self.procs[i].child.try_wait() {
                let p = self.procs.remove(i);
                let msg = format!(
                    "worker {} (pid {}) exited on its own: {status}",
                    p.name, p.pid
                );
                eprintln!("torture: {msg}");
                self.crashes.push(msg);
                self.spawn()?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// SIGKILLs the worker at `idx`, reaps it and starts a replacement. Returns its name.
    async fn kill(&mut self, idx: usize) -> Result<String, String> {
        let mut p = self.procs.remove(idx);
        let _ = p.child.start_kill();
        let _ = p.child.wait().await;
        p.out.abort();
        self.spawn()?;
        Ok(p.name)
    }

    /// Resumes everyone (harmless if not stopped), closes every stdin, and waits.
    async fn stop_all(&mut self, sig: &mut Signaller) {
        for p in &self.procs {
            sig.send("CONT", p.pid).await;
        }
        for p in &mut self.procs {
            p.stdin = None;
        }
        for mut p in self.procs.drain(..) {
            let status = tokio::time::timeout(Duration::from_secs(30), p.child.wait()).await;
            match status {
                Ok(Ok(s)) if s.success() => {}
                Ok(Ok(s)) => self
                    .crashes
                    .push(format!("worker {} exited with {s} when stopped", p.name)),
                _ => {
                    let _ = p.child.start_kill();
                    let _ = p.child.wait().await;
                    self.crashes
                        .push(format!("worker {} did not stop within 30 s", p.name));
                }
            }
            if let Ok(lines) = p.out.await {
                self.stats
                    .extend(lines.into_iter().filter(|l| l.starts_with("worker ")));
            }
        }
    }
}

/// A lock server of a phase: Redis, or PostgreSQL for the `postgres` backend.
#[derive(Debug)]
enum LockServer {
    Redis(RedisServer),
    Postgres(PostgresServer),
}

impl LockServer {
    fn start_many(backend: BackendKind) -> Vec<LockServer> {
        match backend {
            BackendKind::Postgres => vec![LockServer::Postgres(PostgresServer::start())],
            _ => dlock_tests::redis_server::start_many(backend.servers())
                .into_iter()
                .map(LockServer::Redis)
                .collect(),
        }
    }

    fn port(&self) -> u16 {
        match self {
            LockServer::Redis(s) => s.port(),
            LockServer::Postgres(s) => s.port(),
        }
    }

    /// Kills the server, waits `down`, starts it again on the same port (Redis: empty;
    /// PostgreSQL: crash recovery of its data).
    fn restart_after(&mut self, down: Duration) {
        match self {
            LockServer::Redis(s) => {
                s.stop();
                std::thread::sleep(down);
                s.restart();
            }
            LockServer::Postgres(s) => {
                s.kill();
                std::thread::sleep(down);
                s.restart();
            }
        }
    }
}

/// The URL workers reach a lock server by, through its proxy.
fn lock_url(backend: BackendKind, proxy: &Proxy) -> String {
    match backend {
        BackendKind::Postgres => format!(
            "{}/postgres",
            proxy.url().replacen("redis://", "postgres://postgres@", 1)
        ),
        _ => proxy.url(),
    }
}

/// What a backend's lock servers are, as started.
enum LockServers {
    /// Standalone servers (`redis`, `redlock`, `postgres`), each behind a proxy.
    Standalone(Vec<LockServer>),
    /// A Redis Cluster.
    Cluster(RedisCluster),
    /// A master, a replica and three sentinels.
    Sentinel(RedisSentinel),
    /// A consensus store (`etcd`, `zookeeper`), started apart ([`QuorumOwner`]).
    Quorum,
}

/// One backend's servers, proxies, resource and workers.
struct Phase {
    backend: BackendKind,
    /// Standalone lock servers (`redis`, `redlock`, `postgres`), each behind one of `proxies`.
    servers: Vec<Shared<LockServer>>,
    server_ports: Vec<u16>,
    proxies: Vec<Proxy>,
    /// The cluster (`cluster`), for resharding.
    cluster: Option<Shared<RedisCluster>>,
    /// The deployment whose masters fail over (`cluster`, `sentinel`); no standalone servers,
    /// no proxies: its clients follow the addresses the nodes or the sentinels announce.
    failover: Option<Shared<dyn Failover>>,
    /// The etcd cluster or ZooKeeper ensemble (`etcd`, `zookeeper`), reached directly.
    quorum: Option<QuorumOwner>,
    resource_server: RedisServer,
    resource: Resource,
    workers: Workers,
    keys: Vec<String>,
    rng: Rng,
    cfg: Config,
    faults: Vec<FaultRecord>,
    /// Faults after which some key made no progress within the liveness bound and 5 s.
    unrecovered: u64,
    signaller: Signaller,
}

impl Phase {
    async fn start(cfg: &Config, backend: BackendKind, rng: Rng) -> Result<Phase, String> {
        let (lock_servers, resource_server) = tokio::task::spawn_blocking(move || {
            let lock_servers = match backend {
                BackendKind::Cluster => LockServers::Cluster(RedisCluster::start(3, 1)),
                BackendKind::Sentinel => LockServers::Sentinel(RedisSentinel::start()),
                BackendKind::Etcd | BackendKind::Zookeeper => LockServers::Quorum,
                _ => LockServers::Standalone(LockServer::start_many(backend)),
            };
            (lock_servers, RedisServer::start())
        })
        .await
        .map_err(|e| format!("starting the servers: {e}"))?;
        let quorum = match backend {
            BackendKind::Etcd => Some(
                QuorumOwner::start(|| Box::new(EtcdCluster::start_cluster()) as Box<dyn Quorum>)
                    .await?,
            ),
            // The JVMs take seconds to start: once per run (one phase per backend).
            BackendKind::Zookeeper => Some(
                QuorumOwner::start(|| Box::new(ZkEnsemble::start_ensemble()) as Box<dyn Quorum>)
                    .await?,
            ),
            _ => None,
        };
        let (servers, cluster, failover): (_, _, Option<Shared<dyn Failover>>) = match lock_servers
        {
            LockServers::Standalone(s) => (s, None, None),
            LockServers::Cluster(c) => {
                let c = Arc::new(Mutex::new(c));
                (Vec::new(), Some(c.clone()), Some(c))
            }
            LockServers::Sentinel(s) => (Vec::new(), None, Some(Arc::new(Mutex::new(s)))),
            LockServers::Quorum => (Vec::new(), None, None),
        };
        let server_ports: Vec<u16> = servers.iter().map(LockServer::port).collect();
        let mut proxies = Vec::new();
        for &port in &server_ports {
            proxies.push(
                Proxy::start(port)
                    .await
                    .map_err(|e| format!("proxy: {e}"))?,
            );
        }
        let lock_urls = match (&failover, &quorum) {
            (Some(f), _) => vec![lock(f).url()],
            (None, Some(q)) => vec![q.run(|q| q.url()).await?],
            (None, None) => proxies.iter().map(|p| lock_url(backend, p)).collect(),
        };
        let resource = Resource::connect(&resource_server.url())
            .await
            .map_err(|e| format!("resource: {e}"))?;
        if !cfg.fencing {
            resource
                .disable_fencing()
                .await
                .map_err(|e| format!("resource: {e}"))?;
        }
        let keys: Vec<String> = (0..cfg.keys).map(|k| format!("k{k}")).collect();
        let ms = |d: Duration| d.as_millis() as u64;
        let template = WorkerConfig {
            id: 0,
            backend,
            lock_urls,
            resource_url: resource_server.url(),
            keys: cfg.keys,
            tasks: cfg.tasks,
            ttl_ms: ms(cfg.ttl),
            waiter_ttl_ms: ms(cfg.waiter_ttl),
            command_timeout_ms: ms(cfg.command_timeout),
            node_timeout_ms: ms(cfg.node_timeout),
            wait_ms: 10_000,
            work_ms: cfg.work_ms,
            commit_ms: cfg.commit_ms,
            seed: 0,
        };
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let workers = Workers {
            exe,
            template,
            procs: Vec::new(),
            next_id: 1,
            crashes: Vec::new(),
            stats: Vec::new(),
            seed: rng.fork(0x5eed),
        };
        Ok(Phase {
            backend,
            servers: servers
                .into_iter()
                .map(|s| Arc::new(Mutex::new(s)))
                .collect(),
            server_ports,
            proxies,
            cluster,
            failover,
            quorum,
            resource_server,
            resource,
            workers,
            keys,
            rng,
            cfg: cfg.clone(),
            faults: Vec::new(),
            unrecovered: 0,
            signaller: Signaller::start()?,
        })
    }

    fn tag(&self) -> &'static str {
        self.backend.name()
    }

    async fn now_us(&self) -> Result<u64, String> {
        self.resource
            .now_us()
            .await
            .map_err(|e| format!("resource: {e}"))
    }

    /// Waits until every key has an accepted write after `since_us`, up to `limit`.
    /// Returns when that happened (µs), or `None` on timeout.
    async fn wait_progress(
        &mut self,
        since_us: u64,
        limit: Duration,
    ) -> Result<Option<u64>, String> {
        let deadline = Instant::now() + limit;
        loop {
            self.workers.check()?;
            let last = self
                .resource
                .last_writes(&self.keys)
                .await
                .map_err(|e| format!("resource: {e}"))?;
            if last.iter().all(|&t| t > since_us) {
                return Ok(last.into_iter().max());
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A worker currently inside a critical section, chosen at random; with `prefer_commit`,
    /// one past its last lock check if one shows up within `within`.
    async fn pick_holder(
        &mut self,
        prefer_commit: bool,
        within: Duration,
    ) -> Option<(usize, Entrant)> {
        let deadline = Instant::now() + within;
        loop {
            let inside = self.resource.inside().await.unwrap_or_default();
            let live: Vec<(usize, Entrant)> = inside
                .into_iter()
                .filter_map(|e| self.workers.by_pid(e.pid).map(|i| (i, e)))
                .collect();
            let timed_out = Instant::now() >= deadline;
            let pool: Vec<&(usize, Entrant)> = if prefer_commit && !timed_out {
                live.iter().filter(|(_, e)| e.phase == "commit").collect()
            } else {
                live.iter().collect()
            };
            if !pool.is_empty() {
                let pick = pool[self.rng.below(pool.len() as u64) as usize].clone();
                return Some(pick);
            }
            if timed_out && Instant::now() >= deadline + within {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    async fn record(&self, what: String) -> Result<u64, String> {
        self.resource
            .fault(&what)
            .await
            .map_err(|e| format!("resource: {e}"))
    }

    /// Injects one fault and lifts it. Returns its record, or `None`
    /// when there was no lock holder to pause or kill.
    async fn inject(&mut self, kind: FaultKind) -> Result<Option<FaultRecord>, String> {
        let ttl = self.cfg.ttl;
        match kind {
            FaultKind::Pause => {
                let dur = ttl.mul_f64(1.5 + self.rng.below(1001) as f64 / 1000.0);
                let Some((_, victim)) = self.pick_holder(true, Duration::from_secs(2)).await else {
                    return Ok(None);
                };
                let detail = format!(
                    "victim={} pid={} key={} phase={} for_ms={}",
                    victim.writer,
                    victim.pid,
                    victim.key,
                    victim.phase,
                    dur.as_millis()
                );
                let start_us = self.record(format!("pause {detail}")).await?;
                self.signaller.send("STOP", victim.pid).await;
                tokio::time::sleep(dur).await;
                self.signaller.send("CONT", victim.pid).await;
                let end_us = self.record("pause-end".into()).await?;
                let victim = Some((victim.key, victim.writer));
                Ok(Some(FaultRecord::new(
                    kind, start_us, end_us, detail, victim,
                )))
            }
            FaultKind::Kill => {
                let Some((idx, victim)) = self.pick_holder(false, Duration::from_secs(2)).await
                else {
                    return Ok(None);
                };
                let detail = format!(
                    "victim={} pid={} key={} phase={}",
                    victim.writer, victim.pid, victim.key, victim.phase
                );
                let start_us = self.record(format!("kill {detail}")).await?;
                let name = self.workers.kill(idx).await?;
                self.resource
                    .killed(&self.keys, &name, victim.pid)
                    .await
                    .map_err(|e| format!("resource: {e}"))?;
                let victim = Some((victim.key, victim.writer));
                Ok(Some(FaultRecord::new(
                    kind, start_us, start_us, detail, victim,
                )))
            }
            FaultKind::Restart => {
                let node = self.rng.below(self.servers.len() as u64) as usize;
                let down = self.rng.millis(50, 300);
                let detail = format!(
                    "node={node} port={} down_ms={}",
                    self.server_ports[node],
                    down.as_millis()
                );
                let start_us = self.record(format!("restart {detail}")).await?;
                let server = self.servers[node].clone();
                tokio::task::spawn_blocking(move || lock(&server).restart_after(down))
                    .await
                    .map_err(|e| format!("restart: {e}"))?;
                let end_us = self.record("restart-end".into()).await?;
                Ok(Some(FaultRecord::new(kind, start_us, end_us, detail, None)))
            }
            FaultKind::Latency => {
                let dur = self.rng.millis(1000, 2500);
                let (targets, latency) = match self.backend {
                    // Every connection slower, well within the command timeout.
                    BackendKind::Redis | BackendKind::Postgres => {
                        ((0..self.proxies.len()).collect::<Vec<_>>(), {
                            let hi = (self.cfg.command_timeout.as_millis() as u64 / 6).max(5);
                            self.rng.millis(hi / 3, hi)
                        })
                    }
                    // Two of five nodes slower than the node timeout: they vote "no".
                    BackendKind::Redlock => {
                        let mut idx: Vec<usize> = (0..self.proxies.len()).collect();
                        self.rng.shuffle(&mut idx);
                        idx.truncate(2);
                        idx.sort_unstable();
                        let nt = self.cfg.node_timeout.as_millis() as u64;
                        (idx, self.rng.millis(nt, nt * 3))
                    }
                    BackendKind::Cluster
                    | BackendKind::Sentinel
                    | BackendKind::Etcd
                    | BackendKind::Zookeeper => return Err("latency needs proxies".into()),
                };
                let detail = format!(
                    "nodes={targets:?} one_way_ms={} for_ms={}",
                    latency.as_millis(),
                    dur.as_millis()
                );
                let start_us = self.record(format!("latency {detail}")).await?;
                for &i in &targets {
                    self.proxies[i].set_latency(latency);
                }
                tokio::time::sleep(dur).await;
                for &i in &targets {
                    self.proxies[i].set_latency(Duration::ZERO);
                }
                let end_us = self.record("latency-end".into()).await?;
                Ok(Some(FaultRecord::new(kind, start_us, end_us, detail, None)))
            }
            FaultKind::Cut => {
                let refuse = self.rng.millis(100, 400);
                let start_us = self.record("cut".into()).await?;
                let mut cut = 0;
                for p in &self.proxies {
                    cut += p.cut(true);
                }
                tokio::time::sleep(refuse).await;
                for p in &self.proxies {
                    p.allow();
                }
                let detail = format!("connections={cut} refuse_ms={}", refuse.as_millis());
                let end_us = self.record(format!("cut-end {detail}")).await?;
                Ok(Some(FaultRecord::new(kind, start_us, end_us, detail, None)))
            }
            FaultKind::Reshard => {
                let cluster = self.cluster.clone().ok_or("reshard needs a cluster")?;
                let (running, masters) = {
                    let c = cluster.clone();
                    tokio::task::spawn_blocking(move || {
                        let c = lock(&c);
                        (c.running_ports(), c.master_ports())
                    })
                    .await
                    .map_err(|e| format!("cluster ports: {e}"))?
                };
                let key = &self.keys[self.rng.below(self.keys.len() as u64) as usize];
                let seed = masters[0];
                let slot = key_slot(seed, &format!("torture:{{{key}}}")).await;
                let from = RedisCluster::range_of(seed, slot).await.master;
                let others: Vec<u16> = masters.into_iter().filter(|&m| m != from).collect();
                let to = others[self.rng.below(others.len() as u64) as usize];
                let detail = format!("key={key} slot={slot} from={from} to={to}");
                let start_us = self.record(format!("reshard {detail}")).await?;
                // Ten keys per MIGRATE: `redis-cli --cluster reshard`'s default pipeline.
                RedisCluster::move_slot_among(&running, slot, from, to, 10)
                    .await
                    .map_err(|e| format!("reshard {detail}: {e}"))?;
                let end_us = self.record("reshard-end".into()).await?;
                Ok(Some(FaultRecord::new(kind, start_us, end_us, detail, None)))
            }
            FaultKind::LeaderKill => {
                let q = self
                    .quorum
                    .as_ref()
                    .ok_or("leader-kill needs etcd or zookeeper")?;
                let leader = q
                    .run(|q| {
                        let deadline = Instant::now() + Duration::from_secs(10);
                        loop {
                            match q.leader() {
                                Some(l) => return Some(l),
                                None if Instant::now() >= deadline => return None,
                                None => std::thread::sleep(Duration::from_millis(10)),
                            }
                        }
                    })
                    .await?
                    .ok_or("no leader to kill within 10 s")?;
                let detail = format!("member={leader}");
                let start_us = self.record(format!("leader-kill {detail}")).await?;
                let elected = q
                    .run(move |q| {
                        q.kill(leader);
                        wait_new_leader(q, leader, Duration::from_secs(30))
                    })
                    .await?;
                if !elected {
                    return Err(format!("leader-kill {detail}: no new leader within 30 s"));
                }
                // Lifted: another member leads.
                let end_us = self.record("leader-kill-end".into()).await?;
                // The killed member comes back on its data and rejoins before the next fault.
                q.run(|q| q.heal()).await?;
                Ok(Some(FaultRecord::new(kind, start_us, end_us, detail, None)))
            }
            FaultKind::MemberFreeze => {
                let q = self
                    .quorum
                    .as_ref()
                    .ok_or("member-freeze needs etcd or zookeeper")?;
                let members = q.run(|q| q.members()).await?;
                let member = self.rng.below(members as u64) as usize;
                let frozen = self.rng.millis(1000, 2500);
                let leader = q.run(|q| q.leader()).await?;
                let detail = format!(
                    "member={member} leader={} for_ms={}",
                    leader == Some(member),
                    frozen.as_millis()
                );
                let start_us = self.record(format!("member-freeze {detail}")).await?;
                let revoked_before = q
                    .run(move |q| {
                        let revoked = q.leases_revoked(member);
                        q.pause(member);
                        std::thread::sleep(frozen);
                        q.resume(member);
                        revoked
                    })
                    .await?;
                // To the others a frozen leader is a dead one, and a thawed one is stale: the
                // ensemble serves again once a leader has a quorum (after an election, or the
                // old leader re-established). Lifted then, as a leader-kill is lifted when
                // another member leads (the fault's "lasted" shows how long it took). A
                // follower's freeze is lifted at its thaw; the ensemble is healed after.
                let frozen_leader = leader == Some(member);
                if frozen_leader {
                    q.run(|q| q.heal()).await?;
                }
                let end_us = self.record("member-freeze-end".into()).await?;
                if !frozen_leader {
                    q.run(|q| q.heal()).await?;
                }
                let mut record = FaultRecord::new(kind, start_us, end_us, detail, None);
                // etcd before etcd-io/etcd#16822 (Debian 12 ships 3.4.23): a leader thawed
                // from a freeze still runs its lease clock as leader, finds the leases it
                // stopped hearing of expired, and has them revoked through the new leader —
                // leases the new leader kept alive, so their keys (a holder's lock) vanish
                // under a live holder (etcd-io/etcd#15247). The thawed member counts each such
                // revoke as an expired lease while another member leads: that is the evidence.
                if frozen_leader {
                    let (revoked_after, leader_now) = q
                        .run(move |q| (q.leases_revoked(member), q.leader()))
                        .await?;
                    if let (Some(before), Some(after)) = (revoked_before, revoked_after) {
                        if after > before && leader_now.is_some_and(|l| l != member) {
                            record.server_bug = Some(format!(
                                "the thawed etcd leader (member {member}) revoked {} lease(s) the \
                                 new leader kept alive (etcd-io/etcd#15247, fixed by #16822)",
                                after - before
                            ));
                            println!(
                                "[{}] fault member-freeze: {}",
                                self.backend.name(),
                                record.server_bug.as_deref().unwrap_or_default()
                            );
                        }
                    }
                }
                Ok(Some(record))
            }
            FaultKind::MasterKill | FaultKind::MasterPause => {
                let failover = self
                    .failover
                    .clone()
                    .ok_or("master faults need a cluster or sentinel")?;
                let masters = {
                    let c = failover.clone();
                    tokio::task::spawn_blocking(move || lock(&c).master_ports())
                        .await
                        .map_err(|e| format!("master ports: {e}"))?
                };
                let port = masters[self.rng.below(masters.len() as u64) as usize];
                // Frozen for 0.5–2 times what makes the master count as down.
                let down_after = match self.backend {
                    BackendKind::Sentinel => DOWN_AFTER,
                    _ => NODE_TIMEOUT,
                };
                let frozen = down_after.mul_f64(0.5 + self.rng.below(1501) as f64 / 1000.0);
                let detail = match kind {
                    FaultKind::MasterKill => format!("port={port}"),
                    _ => format!("port={port} for_ms={}", frozen.as_millis()),
                };
                let start_us = self.record(format!("{} {detail}", kind.name())).await?;
                let c = failover.clone();
                let (settled_for, mut repairs) = tokio::task::spawn_blocking(move || {
                    let mut c = lock(&c);
                    if kind == FaultKind::MasterKill {
                        c.node(port).stop();
                        c.wait_failed_over(port, Duration::from_secs(30));
                        (Duration::ZERO, Vec::new())
                    } else {
                        c.node(port).pause();
                        std::thread::sleep(frozen);
                        c.node(port).resume();
                        c.wait_healthy_repairing(Duration::from_secs(30))
                    }
                })
                .await
                .map_err(|e| format!("{}: {e}", kind.name()))?;
                // Lifted: the shard serves again (its replica promoted, or its master back).
                // A frozen master woken near its down-after time may still be failed over
                // after it serves again; lifted is when the deployment settled on the master
                // that serves from then on, which `wait_healthy` saw a while ago.
                let end_us = self
                    .record(format!("{}-end", kind.name()))
                    .await?
                    .saturating_sub(settled_for.as_micros() as u64)
                    .max(start_us);
                // The killed master comes back and rejoins as a replica; the frozen one, if it
                // was replaced meanwhile, has rejoined as a replica too. Every master has a
                // replica again before the next fault.
                repairs.extend(
                    tokio::task::spawn_blocking(move || {
                        let mut c = lock(&failover);
                        if kind == FaultKind::MasterKill {
                            c.node(port).restart();
                        }
                        c.wait_healthy_repairing(Duration::from_secs(30)).1
                    })
                    .await
                    .map_err(|e| format!("{} rejoin: {e}", kind.name()))?,
                );
                let mut record = FaultRecord::new(kind, start_us, end_us, detail, None);
                // A Redis Cluster before 7.2.4 can leave slots served by nobody after the old
                // master rejoins (redis/redis#12564); the harness gives them back, as an
                // operator would, and says so. Their keys are gone: what that does to the
                // locks in them is charged to the server.
                if !repairs.is_empty() {
                    let bug = repairs.join("; ");
                    println!("[{}] fault {}: {bug}", self.backend.name(), kind.name());
                    record.server_bug = Some(bug);
                }
                Ok(Some(record))
            }
        }
    }

    /// Counts lock keys (and waiter queues) on every lock server, directly (not proxied).
    async fn leftovers(&self) -> (u64, u64) {
        if self.backend == BackendKind::Postgres {
            return postgres_leftovers(self.server_ports[0]).await;
        }
        if let Some(q) = &self.quorum {
            let Ok(url) = q.run(|q| q.url()).await else {
                return (0, 0);
            };
            return match self.backend {
                BackendKind::Etcd => etcd_leftovers(&url).await,
                _ => zookeeper_leftovers(&url).await,
            };
        }
        let mut locks = 0;
        let mut queues = 0;
        let ports = match &self.failover {
            // Each key once: on its master.
            Some(c) => {
                let c = c.clone();
                tokio::task::spawn_blocking(move || lock(&c).master_ports())
                    .await
                    .unwrap_or_default()
            }
            None => self.server_ports.clone(),
        };
        for port in ports {
            let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}")) else {
                continue;
            };
            let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
                continue;
            };
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg("torture:*")
                .query_async(&mut conn)
                .await
                .unwrap_or_default();
            // A lock key lingers after a lease that ended without a release (its holder was
            // killed): its PTTL is then at most the linger, and it is free. Held is more.
            let linger = dlock_runtime::backend::RedisBackend::LINGER.as_millis() as i64;
            for key in keys.iter().filter(|k| k.ends_with('}')) {
                let pttl: i64 = redis::cmd("PTTL")
                    .arg(key)
                    .query_async(&mut conn)
                    .await
                    .unwrap_or(-2);
                if pttl > linger || pttl == -1 {
                    locks += 1;
                }
            }
            queues += keys.iter().filter(|k| k.ends_with("}:q")).count() as u64;
        }
        (locks, queues)
    }

    /// The whole phase. Returns its report.
    async fn run(mut self) -> Result<PhaseReport, String> {
        let tag = self.tag();
        for _ in 0..self.cfg.procs {
            self.workers.spawn()?;
        }
        let t0 = self.now_us().await?;
        if self
            .wait_progress(t0, Duration::from_secs(30))
            .await?
            .is_none()
        {
            self.workers.stop_all(&mut self.signaller).await;
            return Err(format!(
                "[{tag}] no progress on every key within 30 s of start"
            ));
        }

        let mut schedule = Vec::new();
        let kinds: Vec<FaultKind> = (self.cfg.faults.iter().copied())
            .filter(|k| self.backend.faults().contains(k))
            .collect();
        for _ in 0..self.cfg.rounds {
            let mut round = kinds.clone();
            self.rng.shuffle(&mut round);
            schedule.extend(round);
        }
        match &self.failover {
            Some(c) => println!(
                "[{tag}] data nodes on ports {:?} (masters first; workers reach them directly); resource on port {}",
                lock(c).node_ports(),
                self.resource_server.port()
            ),
            None => match &self.quorum {
                Some(q) => println!(
                    "[{tag}] members at {} (workers reach them directly); resource on port {}",
                    q.run(|q| q.url()).await?,
                    self.resource_server.port()
                ),
                None => println!(
                    "[{tag}] lock servers on ports {:?} (workers reach them through proxies); resource on port {}",
                    self.server_ports,
                    self.resource_server.port()
                ),
            },
        }
        println!("[{tag}] schedule: {}", names_of(&schedule, FaultKind::name));

        let bound = self.cfg.stall_bound(self.backend);
        for (n, kind) in schedule.into_iter().enumerate() {
            let Some(f) = self.inject(kind).await? else {
                println!(
                    "[{tag}] fault {:>2} {:<7} skipped: nobody inside a critical section",
                    n + 1,
                    kind.name()
                );
                continue;
            };
            println!(
                "[{tag}] fault {:>2} {:<7} {} (lasted {} ms)",
                n + 1,
                kind.name(),
                f.detail,
                f.end_us.saturating_sub(f.start_us) / 1000,
            );
            // Before the next fault, every key must have completed a section that started
            // after this one was lifted (sections in flight at that moment don't count).
            let settle = self.cfg.work_ms.1 + self.cfg.commit_ms.1 + 50;
            let since = f.end_us + settle * 1000;
            if self
                .wait_progress(since, bound + Duration::from_secs(5))
                .await?
                .is_none()
            {
                // A failure of the run: the stall would otherwise be charged to whichever
                // later fault it ended under (a restart that empties the server clears a lock
                // left held for good), measured only from that fault's end.
                self.unrecovered += 1;
                println!(
                    "[{tag}] fault {:>2} {:<7} some key made no progress within {} ms",
                    n + 1,
                    kind.name(),
                    (bound + Duration::from_secs(5)).as_millis()
                );
            }
            self.faults.push(f);
            let gap = self.rng.millis(self.cfg.gap_ms.0, self.cfg.gap_ms.1);
            tokio::time::sleep(gap).await;
        }

        // Stop: nothing is faulted any more; workers finish and release.
        for p in &self.proxies {
            p.allow();
            p.set_latency(Duration::ZERO);
        }
        let stop_us = self.now_us().await?;
        self.workers.stop_all(&mut self.signaller).await;
        // Every worker has exited after releasing what it held and letting its locker's
        // background task send the undo of cancelled acquires. Every killed holder's lock has
        // expired already: each key was taken again after the last fault (the recovery wait
        // above). A waiter whose undo did not land before its process exited leaves a queue
        // entry that lives up to the waiter TTL, and a release may hand it the lock: a lease of
        // at most the waiter TTL (the runtime's bound for a dead waiter). So a lock still held
        // one command timeout plus one waiter TTL after the stop was leaked.
        // (On etcd a dead waiter's key lives as long as its session lease,
        // `BackendKind::lease_bound`.)
        let waiter_bound = self.backend.lease_bound(self.cfg.waiter_ttl);
        tokio::time::sleep(self.cfg.command_timeout + waiter_bound).await;
        let (locks, queues) = self.leftovers().await;
        // Diagnostic: do leaked locks at least expire within the liveness bound?
        let waited = Instant::now();
        let mut unexpired = locks;
        while unexpired > 0 && waited.elapsed() < bound {
            tokio::time::sleep(Duration::from_millis(50)).await;
            unexpired = self.leftovers().await.0;
        }

        // Replay the logs.
        let mut r = PhaseReport {
            stall_bound_ms: bound.as_millis() as u64,
            ..PhaseReport::default()
        };
        let stopped = report::stopped_workers(&self.faults);
        // A task frozen while its lock was being granted enters once it wakes and reads the
        // acquire's answer: within one command timeout of the thaw.
        let grace_us = self.cfg.command_timeout.as_micros() as u64;
        let mut completions = Vec::new();
        let mut logs = std::collections::HashMap::new();
        for key in &self.keys {
            let log = self
                .resource
                .log(key)
                .await
                .map_err(|e| format!("resource: {e}"))?;
            if let Some(dir) = std::env::var_os("DLOCK_TORTURE_DUMP") {
                let path = PathBuf::from(dir).join(format!("{tag}-{key}.log"));
                let _ = std::fs::write(&path, log.join("\n"));
            }
            completions.push(report::replay(&log, &stopped, grace_us, &mut r)?);
            logs.insert(key.clone(), log);
            let (val, ver) = self
                .resource
                .final_state(key)
                .await
                .map_err(|e| format!("resource: {e}"))?;
            if val != ver {
                r.value_mismatch += 1;
            }
        }
        if let Some(dir) = std::env::var_os("DLOCK_TORTURE_DUMP") {
            let faults: Vec<String> = self
                .faults
                .iter()
                .map(|f| format!("{} {} {} {}", f.start_us, f.end_us, f.kind.name(), f.detail))
                .collect();
            let path = PathBuf::from(dir).join(format!("{tag}-faults.log"));
            let _ = std::fs::write(&path, format!("{}\nstop {stop_us}\n", faults.join("\n")));
        }
        let (per_fault, max) = report::stalls(&completions, &self.faults, stop_us);
        r.fault_stalls = per_fault;
        r.max_stall = max;
        r.pauses = self
            .faults
            .iter()
            .filter(|f| f.kind == FaultKind::Pause)
            .count() as u64;
        r.locks_left = locks;
        r.locks_unexpired = unexpired;
        r.queues_left = queues;
        r.worker_crashes = self.workers.crashes.len() as u64;
        r.unrecovered = self.unrecovered;
        for line in &self.workers.stats {
            if let Some(m) = worker::parse_stats(line) {
                for (k, v) in m {
                    *r.client.entry(k).or_default() += v;
                }
            }
        }
        for (n, (f, stall)) in self.faults.iter().zip(&r.fault_stalls).enumerate() {
            let over = if stall.after_ms > bound.as_millis() as u64 {
                "  <-- OVER BOUND"
            } else {
                ""
            };
            let victim = match &f.victim {
                Some((key, writer)) => {
                    let end = logs
                        .get(key)
                        .and_then(|log| report::outcome_after(log, writer, f.start_us));
                    let end = end.as_deref().unwrap_or("never ended");
                    if f.kind == FaultKind::Pause && end == "fenced" {
                        r.pauses_fenced += 1;
                    }
                    format!("; victim's section: {end}")
                }
                None => String::new(),
            };
            println!(
                "[{tag}] fault {:>2} {:<7} longest stall {:>5} ms after it was lifted (longest gap {:>5} ms){victim}{over}",
                n + 1,
                f.kind.name(),
                stall.after_ms,
                stall.gap_ms,
            );
            // A stall over the bound explains itself: what the key's log shows in it.
            if !over.is_empty() {
                if let Some((k, from, to)) = stall.window {
                    let key = &self.keys[k];
                    println!(
                        "[{tag}]   key {key}: no accepted write from {from} to {to} µs (fault {} from {} to {} µs)",
                        n + 1,
                        f.start_us,
                        f.end_us
                    );
                    let log = logs.get(key).map_or(&[][..], Vec::as_slice);
                    for line in report::excerpt(log, from, to, 12) {
                        println!("[{tag}]     {line}");
                    }
                }
            }
        }
        // Overlaps of two live holders, charged to the latest fault that started before the
        // second one entered.
        r.overlaps_server_bug = report::server_bug_overlaps(&r.unpaused_at, &self.faults);
        let lossy = self.backend.lossy_faults();
        for &at in &r.unpaused_at {
            let charged = report::charged_to(&self.faults, at);
            let fault = match charged {
                Some(i) => format!("fault {} {}", i + 1, self.faults[i].kind.name()),
                None => "before the first fault".to_owned(),
            };
            println!("[{tag}] overlap of two holders not frozen nor killed, during or after {fault} (resource time {at} µs)");
            let Some(f) = charged.map(|i| &self.faults[i]) else {
                continue;
            };
            if let Some(bug) = &f.server_bug {
                println!("[{tag}]   charged to the server, not the lock service: {bug}");
            } else if lossy.contains(&f.kind) {
                r.overlaps_lossy += 1;
                println!(
                    "[{tag}]   expected: a {} loses locks on this backend",
                    f.kind.name()
                );
            }
        }
        for c in &self.workers.crashes {
            println!("[{tag}] CRASH: {c}");
        }
        if locks > 0 {
            println!(
                "[{tag}] {locks} lock key(s) left after the workers exited; {unexpired} still there {} ms later",
                waited.elapsed().as_millis()
            );
        }
        let accepted: u64 = self.proxies.iter().map(Proxy::accepted).sum();
        let mut client: Vec<String> = r.client.iter().map(|(k, v)| format!("{k}={v}")).collect();
        client.sort();
        println!(
            "[{tag}] client counters: {} proxied_connections={accepted}",
            client.join(" ")
        );
        Ok(r)
    }
}

/// Runs every phase; prints the report; returns the exit code.
/// Held locks (live leases) and keys with live waiters in the Postgres backend's tables,
/// read directly (not proxied). Unreachable: counted as none (the phase reports the fault).
async fn postgres_leftovers(port: u16) -> (u64, u64) {
    use dlock_runtime::backend::postgres::tokio_postgres;
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let Ok((client, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await else {
        return (0, 0);
    };
    tokio::spawn(conn);
    let count = async |sql: &str| -> u64 {
        match client.query_one(sql, &[]).await {
            Ok(row) => row.get::<_, i64>(0) as u64,
            Err(_) => 0,
        }
    };
    let locks = count(
        "SELECT count(*) FROM dlock.dlock_locks \
         WHERE name LIKE 'torture:%' AND expires_at > clock_timestamp()",
    )
    .await;
    let queues = count(
        "SELECT count(DISTINCT name) FROM dlock.dlock_waiters \
         WHERE name LIKE 'torture:%' AND expires_at > clock_timestamp()",
    )
    .await;
    (locks, queues)
}

/// Locks (lock directories with a key) and queues (with more than one) under the etcd
/// backend's prefix `dlock/`: every key there is a holder's or a waiter's, on a lease that a
/// dead owner's death ends within [`BackendKind::lease_bound`].
async fn etcd_leftovers(url: &str) -> (u64, u64) {
    let endpoints: Vec<String> = (url.trim_start_matches("etcd://").split(','))
        .map(|h| format!("http://{h}"))
        .collect();
    let Ok(mut client) = etcd_client::Client::connect(&endpoints, None).await else {
        return (0, 0);
    };
    let options = etcd_client::GetOptions::new()
        .with_prefix()
        .with_keys_only();
    let Ok(resp) = client.get("dlock/", Some(options)).await else {
        return (0, 0);
    };
    let mut dirs: std::collections::HashMap<Vec<u8>, u64> = std::collections::HashMap::new();
    for kv in resp.kvs() {
        let key = kv.key();
        let dir = key
            .iter()
            .rposition(|&b| b == b'/')
            .map_or(key, |i| &key[..i]);
        *dirs.entry(dir.to_vec()).or_default() += 1;
    }
    let queues = dirs.values().filter(|&&n| n > 1).count() as u64;
    (dirs.len() as u64, queues)
}

/// Held locks (lock nodes whose lowest child's lease, counted from its `mtime`, has not run
/// out) and queues (lock nodes with more than one child) under the ZooKeeper backend's
/// `/dlock`. A killed worker's nodes stay until its session expires, lapsed: free.
async fn zookeeper_leftovers(url: &str) -> (u64, u64) {
    let hosts = url.trim_start_matches("zk://");
    let connect = zookeeper_client::Client::connector()
        .with_session_timeout(Duration::from_secs(5))
        .connect(hosts);
    let Ok(Ok(client)) = tokio::time::timeout(Duration::from_secs(5), connect).await else {
        return (0, 0);
    };
    let Ok(dirs) = client.list_children("/dlock").await else {
        return (0, 0);
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let (mut locks, mut queues) = (0, 0);
    for dir in dirs {
        let dir = format!("/dlock/{dir}");
        let Ok(mut kids) = client.list_children(&dir).await else {
            continue;
        };
        if kids.len() > 1 {
            queues += 1;
        }
        // `<token>-<sequence>`: the lowest sequence holds.
        kids.sort_by_key(|k| k.rsplit('-').next().and_then(|s| s.parse::<u64>().ok()));
        let Some(head) = kids.first() else { continue };
        if let Ok((data, stat)) = client.get_data(&format!("{dir}/{head}")).await {
            let lease: i64 = (std::str::from_utf8(&data).ok())
                .and_then(|d| d.parse().ok())
                .unwrap_or(i64::MAX);
            if stat.mtime.saturating_add(lease) > now_ms {
                locks += 1;
            }
        }
    }
    (locks, queues)
}

pub(crate) async fn run(cfg: Config) -> i32 {
    let started = Instant::now();
    println!(
        "torture: mode={} seed={} backends={} procs={} tasks={} keys={} ttl_ms={} waiter_ttl_ms={} \
         command_timeout_ms={} node_timeout_ms={} rounds={} faults={} fencing={} stall_bound_ms={}",
        cfg.mode,
        cfg.seed,
        names_of(&cfg.backends, BackendKind::name),
        cfg.procs,
        cfg.tasks,
        cfg.keys,
        cfg.ttl.as_millis(),
        cfg.waiter_ttl.as_millis(),
        cfg.command_timeout.as_millis(),
        cfg.node_timeout.as_millis(),
        cfg.rounds,
        names_of(&cfg.faults, FaultKind::name),
        if cfg.fencing { "on" } else { "off" },
        cfg.max_stall_bound().as_millis(),
    );
    let root = Rng::new(cfg.seed);
    let mut reports = Vec::new();
    let mut errors = Vec::new();
    for &backend in &cfg.backends {
        let result = match Phase::start(&cfg, backend, phase_rng(&root, backend)).await {
            Ok(phase) => phase.run().await,
            Err(e) => Err(e),
        };
        match result {
            Ok(r) => {
                println!("[{}] {}", backend.name(), phase_line(&r));
                reports.push(r);
            }
            Err(e) => {
                println!("[{}] ERROR: {e}", backend.name());
                errors.push(format!("{}: {e}", backend.name()));
            }
        }
    }

    let sum = |f: fn(&PhaseReport) -> u64| reports.iter().map(f).sum::<u64>();
    let max_stall = reports
        .iter()
        .map(|r| r.max_stall.after_ms)
        .max()
        .unwrap_or(0);
    let max_gap = reports
        .iter()
        .map(|r| r.max_stall.gap_ms)
        .max()
        .unwrap_or(0);
    let bound = cfg.max_stall_bound().as_millis() as u64;
    let unpaused = sum(|r| {
        r.overlaps_unpaused
            .saturating_sub(r.overlaps_server_bug)
            .saturating_sub(r.overlaps_lossy)
    });
    let lossy = sum(|r| r.overlaps_lossy);
    let server_bug = sum(|r| r.overlaps_server_bug);
    let stale = sum(|r| r.stale_writes_accepted);
    let reuse = sum(|r| r.token_reuse);
    let mismatch = sum(|r| r.value_mismatch);
    let locks_left = sum(|r| r.locks_left);
    let crashes = sum(|r| r.worker_crashes);
    let cs = sum(|r| r.cs);
    let client = |k: &str| -> u64 {
        reports
            .iter()
            .map(|r| r.client.get(k).copied().unwrap_or(0))
            .sum()
    };
    let extends = client("extend_shorter") + client("extend_longer");
    let failed_releases = client("release_err");
    let mut why = errors;
    if cs > 0 && (client("extend_shorter") == 0 || client("extend_longer") == 0) {
        why.push("the workers never shortened and lengthened a lease with extend".to_owned());
    }
    if stale > 0 {
        why.push(format!("{stale} stale write(s) accepted"));
    }
    if reuse > 0 {
        why.push(format!("{reuse} fencing token(s) issued twice"));
    }
    if mismatch > 0 {
        why.push(format!("{mismatch} key(s) lost an increment"));
    }
    if locks_left > 0 {
        why.push(format!("{locks_left} lock(s) left held"));
    }
    for r in &reports {
        if r.max_stall.after_ms > r.stall_bound_ms {
            why.push(format!(
                "a key stalled {} ms > bound {} ms",
                r.max_stall.after_ms, r.stall_bound_ms
            ));
        }
    }
    if unpaused > 0 {
        why.push(format!(
            "{unpaused} overlap(s) of two live holders not explained by a fault that loses \
             locks on the server"
        ));
    }
    if server_bug > 0 {
        println!(
            "torture: {server_bug} overlap(s) of two live holders charged to a known server \
             defect (see the phase's lines above), not to the lock service"
        );
    }
    if crashes > 0 {
        why.push(format!("{crashes} worker crash(es)"));
    }
    let unrecovered = sum(|r| r.unrecovered);
    if unrecovered > 0 {
        why.push(format!(
            "{unrecovered} fault(s) after which some key made no progress within the liveness \
             bound and 5 s"
        ));
    }
    if cs == 0 {
        why.push("no critical section completed".to_owned());
    }
    for w in &why {
        println!("torture: FAIL: {w}");
    }
    let result = if why.is_empty() { "pass" } else { "fail" };
    println!(
        "summary: result={result} mode={} seed={} backends={} cs={cs} overlaps={} \
         overlaps_fenced={} overlaps_unexplained={unpaused} overlaps_lossy={lossy} overlaps_server_bug={server_bug} stale_writes_rejected={} \
         stale_reads_rejected={} would_be_lost_updates={} stale_writes_accepted={stale} token_reuse={reuse} \
         value_mismatch={mismatch} locks_left={locks_left} \
         max_stall_ms={max_stall} stall_bound_ms={bound} max_gap_ms={max_gap} faults={} \
         worker_crashes={crashes} extends={extends} failed_releases={failed_releases} \
         elapsed_s={}",
        cfg.mode,
        cfg.seed,
        names_of(&cfg.backends, BackendKind::name),
        sum(|r| r.overlaps),
        sum(|r| r.overlaps_fenced),
        sum(|r| r.stale_writes_rejected),
        sum(|r| r.stale_reads_rejected),
        sum(|r| r.would_be_lost_updates),
        sum(|r| r.fault_stalls.len() as u64),
        started.elapsed().as_secs(),
    );
    i32::from(!why.is_empty())
}

fn phase_line(r: &PhaseReport) -> String {
    format!(
        "cs={} overlaps={} overlap_entries={} overlaps_wrote={} overlaps_fenced={} \
         overlaps_aborted={} overlaps_other={} overlaps_unpaused={} overlaps_lossy={} inverted_overlaps={} \
         stale_writes_rejected={} \
         stale_reads_rejected={} would_be_lost_updates={} stale_writes_accepted={} \
         token_reuse={} value_mismatch={} lost_aborts={} unfinished={} max_stall_ms={} \
         stall_bound_ms={} max_gap_ms={} pauses={} pauses_fenced={} locks_left={} locks_unexpired={} queues_left={} worker_crashes={} unrecovered={}",
        r.cs,
        r.overlaps,
        r.overlap_entries,
        r.overlaps_wrote,
        r.overlaps_fenced,
        r.overlaps_aborted,
        r.overlaps_other,
        r.overlaps_unpaused,
        r.overlaps_lossy,
        r.inverted_overlaps,
        r.stale_writes_rejected,
        r.stale_reads_rejected,
        r.would_be_lost_updates,
        r.stale_writes_accepted,
        r.token_reuse,
        r.value_mismatch,
        r.lost_aborts,
        r.unfinished,
        r.max_stall.after_ms,
        r.stall_bound_ms,
        r.max_stall.gap_ms,
        r.pauses,
        r.pauses_fenced,
        r.locks_left,
        r.locks_unexpired,
        r.queues_left,
        r.worker_crashes,
        r.unrecovered,
    )
}

/// The random numbers of `backend`'s phase in a run whose root is `root`: its backend's stream
/// ([`BackendKind::stream`]), whichever other backends the run takes.
fn phase_rng(root: &Rng, backend: BackendKind) -> Rng {
    root.fork(backend.stream())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A phase draws the same numbers alone (`--seed N --backend B`) as in a run of every
    /// backend with that seed — and, in a run of every backend, the numbers it drew before
    /// (forked by its place in the list), so that the seeds of earlier runs still repeat them.
    #[test]
    fn a_phase_draws_the_same_numbers_alone_as_in_a_run_of_every_backend() {
        let root = Rng::new(902_281_025);
        for (i, &backend) in BackendKind::ALL.iter().enumerate() {
            let in_full_run = root.fork(i as u64 + 1).next_u64();
            assert_eq!(
                phase_rng(&root, backend).next_u64(),
                in_full_run,
                "{backend:?}"
            );
        }
        assert_ne!(
            phase_rng(&root, BackendKind::Postgres).next_u64(),
            root.fork(1).next_u64(),
            "a run of Postgres alone drew the first backend's numbers"
        );
    }
}
