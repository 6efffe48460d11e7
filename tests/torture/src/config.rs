//! Command line, modes and the run configuration.

use std::collections::BTreeMap;
use std::time::Duration;

/// `--name value` pairs and `--flag`s.
#[derive(Debug, Default)]
pub(crate) struct Args {
    values: BTreeMap<String, String>,
    flags: Vec<String>,
}

impl Args {
    /// Parses `args` (without the program name and mode word).
    pub(crate) fn parse(args: &[String]) -> Result<Args, String> {
        let mut out = Args::default();
        let mut it = args.iter().peekable();
        while let Some(a) = it.next() {
            let Some(name) = a.strip_prefix("--") else {
                return Err(format!("unexpected argument `{a}`"));
            };
            if let Some((k, v)) = name.split_once('=') {
                out.values.insert(k.to_owned(), v.to_owned());
            } else if it.peek().is_some_and(|n| !n.starts_with("--")) {
                let v = it.next().cloned().unwrap_or_default();
                out.values.insert(name.to_owned(), v);
            } else {
                out.flags.push(name.to_owned());
            }
        }
        Ok(out)
    }

    /// Whether `--name` was given as a flag.
    pub(crate) fn flag(&self, name: &str) -> bool {
        self.flags.iter().any(|f| f == name)
    }

    /// `--name value` as text.
    pub(crate) fn string(&self, name: &str) -> Option<String> {
        self.values.get(name).cloned()
    }

    /// `--name <u64>`.
    pub(crate) fn num(&self, name: &str) -> Result<Option<u64>, String> {
        self.values
            .get(name)
            .map(|v| {
                v.parse()
                    .map_err(|_| format!("--{name}: not a number: {v}"))
            })
            .transpose()
    }

    /// `--name <lo>..<hi>` (or a single number).
    pub(crate) fn range(&self, name: &str) -> Result<Option<(u64, u64)>, String> {
        let Some(v) = self.values.get(name) else {
            return Ok(None);
        };
        let bad = || format!("--{name}: expected <lo>..<hi>, got {v}");
        match v.split_once("..") {
            Some((a, b)) => {
                let (a, b) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if a > b {
                    return Err(bad());
                }
                Ok(Some((a, b)))
            }
            None => {
                let x = v.parse().map_err(|_| bad())?;
                Ok(Some((x, x)))
            }
        }
    }

    /// Names of everything given, for rejecting unknown options.
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.values
            .keys()
            .map(String::as_str)
            .chain(self.flags.iter().map(String::as_str))
    }
}

/// The names of `kinds` (`name` of each), comma-separated, as the command line and the
/// report spell lists.
pub(crate) fn names_of<K: Copy>(kinds: &[K], name: fn(K) -> &'static str) -> String {
    kinds.iter().map(|&k| name(k)).collect::<Vec<_>>().join(",")
}

/// Which lock backend a phase runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BackendKind {
    /// One Redis server.
    Redis,
    /// Redlock over five servers.
    Redlock,
    /// One PostgreSQL server (the Postgres backend).
    Postgres,
    /// A Redis Cluster of 3 masters and 3 replicas (`dlock_tests::redis_cluster`), reached
    /// directly: its client follows the addresses the nodes announce, so no proxy fits in
    /// between.
    Cluster,
    /// A master, its replica and three sentinels (`dlock_tests::redis_sentinel`), reached
    /// through the sentinels, directly.
    Sentinel,
    /// An etcd cluster of 3 members (`dlock_tests::etcd_server`), reached directly.
    Etcd,
    /// A ZooKeeper ensemble of 3 servers (`dlock_tests::zookeeper_server`), reached directly.
    Zookeeper,
}

impl BackendKind {
    /// Every backend, in the order a run takes them.
    pub(crate) const ALL: [BackendKind; 7] = [
        BackendKind::Redis,
        BackendKind::Redlock,
        BackendKind::Postgres,
        BackendKind::Cluster,
        BackendKind::Sentinel,
        BackendKind::Etcd,
        BackendKind::Zookeeper,
    ];

    /// The stream of the run's random numbers this backend's phase draws from: its place in
    /// [`ALL`](Self::ALL), whichever backends a run takes, so that `--seed N --backend B`
    /// repeats the schedule of B's phase in any run with seed N (it was forked by the place in
    /// the run's list: a run of one backend drew another schedule).
    pub(crate) fn stream(self) -> u64 {
        let at = Self::ALL.iter().position(|&k| k == self);
        at.expect("every backend is in ALL") as u64 + 1
    }

    /// The backends of `--smoke` (the `cargo test`): all but the consensus stores, whose
    /// 3-member clusters and JVMs would double its time.
    pub(crate) const SMOKE: [BackendKind; 5] = [
        BackendKind::Redis,
        BackendKind::Redlock,
        BackendKind::Postgres,
        BackendKind::Cluster,
        BackendKind::Sentinel,
    ];

    /// The fault kinds that lose locks on the lock servers themselves: a standalone Redis
    /// restarted empty (Redlock: one node of five, so that a majority may be had twice), a
    /// Redis master killed or frozen whose promoted replica missed the latest writes
    /// (replication is asynchronous). An overlap of two live holders charged to one of them is
    /// expected of the backend; under any other fault, or before the first, it fails the run
    /// (see [`PhaseReport::overlaps_unpaused`](crate::report::PhaseReport)). PostgreSQL keeps
    /// its locks through a restart, and a consensus store (`etcd`, `zookeeper`) through every
    /// store fault.
    pub(crate) fn lossy_faults(self) -> &'static [FaultKind] {
        use FaultKind::*;
        match self {
            BackendKind::Redis | BackendKind::Redlock => &[Restart],
            BackendKind::Cluster | BackendKind::Sentinel => &[MasterKill, MasterPause],
            BackendKind::Postgres | BackendKind::Etcd | BackendKind::Zookeeper => &[],
        }
    }

    /// How long after its last renewal a holder's (or waiter's) key of a lease of `ttl` may
    /// still block others on this backend. etcd: the session lease's class — `ttl` rounded up
    /// to whole seconds (at least 1), plus the session's second of headroom — plus up to the
    /// 500 ms of etcd's expiry sweep (`dlock_runtime::backend::etcd`). Everywhere else: `ttl`.
    pub(crate) fn lease_bound(self, ttl: Duration) -> Duration {
        match self {
            BackendKind::Etcd => {
                let secs = ttl.as_millis().div_ceil(1000).max(1) as u64;
                Duration::from_secs(secs + 1) + Duration::from_millis(500)
            }
            _ => ttl,
        }
    }

    /// `redis` / `redlock` / `postgres` / `cluster` / `sentinel`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            BackendKind::Redis => "redis",
            BackendKind::Redlock => "redlock",
            BackendKind::Postgres => "postgres",
            BackendKind::Cluster => "cluster",
            BackendKind::Sentinel => "sentinel",
            BackendKind::Etcd => "etcd",
            BackendKind::Zookeeper => "zookeeper",
        }
    }

    /// Parses [`name`](BackendKind::name).
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        BackendKind::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown backend `{s}` ({})",
                    names_of(&BackendKind::ALL, BackendKind::name)
                )
            })
    }

    /// How many standalone lock servers it runs on (none for a cluster, which starts its own).
    pub(crate) fn servers(self) -> usize {
        match self {
            BackendKind::Redis | BackendKind::Postgres => 1,
            BackendKind::Redlock => 5,
            BackendKind::Cluster
            | BackendKind::Sentinel
            | BackendKind::Etcd
            | BackendKind::Zookeeper => 0,
        }
    }

    /// The fault kinds that apply to it. Standalone servers sit behind proxies (`latency`,
    /// `cut`) and are restarted empty (`restart`); a cluster's masters are killed and frozen
    /// instead, and fail over to their replicas, and its slots are moved.
    pub(crate) fn faults(self) -> &'static [FaultKind] {
        use FaultKind::*;
        match self {
            BackendKind::Redis | BackendKind::Redlock | BackendKind::Postgres => {
                &[Pause, Kill, Restart, Latency, Cut]
            }
            BackendKind::Cluster => &[Pause, Kill, MasterKill, MasterPause, Reshard],
            BackendKind::Sentinel => &[Pause, Kill, MasterKill, MasterPause],
            BackendKind::Etcd | BackendKind::Zookeeper => &[Pause, Kill, LeaderKill, MemberFreeze],
        }
    }
}

/// The kinds of fault the coordinator injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FaultKind {
    /// SIGSTOP a lock holder (preferably past its last check) for longer than the TTL, then
    /// SIGCONT it: the GC-pause case.
    Pause,
    /// SIGKILL a lock holder (a replacement worker is started).
    Kill,
    /// Kill a lock server and start it again, empty, on the same port (Redlock: one of five).
    Restart,
    /// Add latency in the proxies (Redlock: on two of five nodes, above the node timeout).
    Latency,
    /// Close every proxied connection and refuse new ones for a moment.
    Cut,
    /// SIGKILL a master (seeded choice); its replica takes over after the node timeout; the
    /// killed node is started again and rejoins as a replica.
    MasterKill,
    /// SIGSTOP a master for 0.5–2 node timeouts, then SIGCONT it: past the node timeout its
    /// replica takes over and the woken master rejoins as a replica.
    MasterPause,
    /// Move the slot of a lock key (seeded), with its live lock, fencing counter and queue, to
    /// another master (seeded), the way `redis-cli --cluster reshard` does.
    Reshard,
    /// etcd, ZooKeeper: SIGKILL the leader; lifted once another member leads; the killed
    /// member is started again on its data and rejoins before the next fault.
    LeaderKill,
    /// etcd, ZooKeeper: SIGSTOP one member of three (seeded; a minority, possibly the leader)
    /// for 1–2.5 s, then SIGCONT it; the next fault waits until it serves again.
    MemberFreeze,
}

impl FaultKind {
    /// Every kind, in a fixed order.
    pub(crate) const ALL: [FaultKind; 10] = [
        FaultKind::Pause,
        FaultKind::Kill,
        FaultKind::Restart,
        FaultKind::Latency,
        FaultKind::Cut,
        FaultKind::MasterKill,
        FaultKind::MasterPause,
        FaultKind::Reshard,
        FaultKind::LeaderKill,
        FaultKind::MemberFreeze,
    ];

    /// Parses [`name`](FaultKind::name).
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        FaultKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let all = names_of(&FaultKind::ALL, FaultKind::name);
                format!("unknown fault `{s}` ({all})")
            })
    }

    /// Short name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            FaultKind::Pause => "pause",
            FaultKind::Kill => "kill",
            FaultKind::Restart => "restart",
            FaultKind::Latency => "latency",
            FaultKind::Cut => "cut",
            FaultKind::MasterKill => "master-kill",
            FaultKind::MasterPause => "master-pause",
            FaultKind::Reshard => "reshard",
            FaultKind::LeaderKill => "leader-kill",
            FaultKind::MemberFreeze => "member-freeze",
        }
    }
}

/// Everything a run is configured with.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    /// `smoke`, `quick` or `long`.
    pub(crate) mode: &'static str,
    /// Seed of the fault schedule and every random choice.
    pub(crate) seed: u64,
    /// Backends to run, in order.
    pub(crate) backends: Vec<BackendKind>,
    /// Worker processes.
    pub(crate) procs: u32,
    /// Tasks per worker process.
    pub(crate) tasks: u32,
    /// Lock keys contended on.
    pub(crate) keys: u32,
    /// Lock TTL.
    pub(crate) ttl: Duration,
    /// Waiter-queue entry TTL (`LockerBuilder::waiter_ttl`).
    pub(crate) waiter_ttl: Duration,
    /// Locker command timeout.
    pub(crate) command_timeout: Duration,
    /// Redlock per-node timeout.
    pub(crate) node_timeout: Duration,
    /// Rounds of faults per backend; a round is every kind in `faults` that applies to the
    /// backend ([`BackendKind::faults`]) once, in a seeded order.
    pub(crate) rounds: u32,
    /// The fault kinds of a round.
    pub(crate) faults: Vec<FaultKind>,
    /// Liveness margin on top of the TTL.
    pub(crate) margin: Duration,
    /// Pause between one fault's recovery and the next fault, ms range.
    pub(crate) gap_ms: (u64, u64),
    /// Critical section work phase, ms range.
    pub(crate) work_ms: (u64, u64),
    /// Critical section commit window, ms range.
    pub(crate) commit_ms: (u64, u64),
    /// Whether the resource checks fencing tokens (off only for the `--no-fencing`
    /// demonstration).
    pub(crate) fencing: bool,
}

impl Config {
    /// The liveness bound on `backend`: no key goes longer than this without a completed
    /// critical section. A dead or frozen holder's lock frees within the TTL (on etcd: its
    /// session lease, [`BackendKind::lease_bound`]); its process's dead waiter entries (fair
    /// queue) stop blocking within the waiter TTL (likewise); the margin covers the waiters'
    /// fallback wake-up (at most a third of the waiter TTL), reconnects and the critical
    /// section itself.
    pub(crate) fn stall_bound(&self, backend: BackendKind) -> Duration {
        backend.lease_bound(self.ttl.max(self.waiter_ttl)) + self.margin
    }

    /// The largest [`stall_bound`](Config::stall_bound) over the run's backends.
    pub(crate) fn max_stall_bound(&self) -> Duration {
        (self.backends.iter())
            .map(|&b| self.stall_bound(b))
            .max()
            .unwrap_or(self.ttl.max(self.waiter_ttl) + self.margin)
    }

    fn preset(mode: &'static str) -> Config {
        let base = Config {
            mode,
            seed: 0,
            backends: BackendKind::ALL.to_vec(),
            procs: 4,
            tasks: 16,
            keys: 4,
            ttl: Duration::from_millis(1000),
            waiter_ttl: Duration::from_millis(1000),
            command_timeout: Duration::from_millis(500),
            node_timeout: Duration::from_millis(50),
            rounds: 3,
            faults: FaultKind::ALL.to_vec(),
            margin: Duration::from_millis(1000),
            gap_ms: (300, 800),
            work_ms: (1, 3),
            commit_ms: (4, 8),
            fencing: true,
        };
        match mode {
            "smoke" => Config {
                backends: BackendKind::SMOKE.to_vec(),
                procs: 2,
                tasks: 4,
                keys: 2,
                ttl: Duration::from_millis(500),
                waiter_ttl: Duration::from_millis(500),
                command_timeout: Duration::from_millis(300),
                rounds: 1,
                margin: Duration::from_millis(1500),
                gap_ms: (100, 200),
                ..base
            },
            "quick" => base,
            _ => Config { rounds: 20, ..base },
        }
    }

    /// Builds the configuration from the command line.
    pub(crate) fn from_args(args: &Args) -> Result<Config, String> {
        const KNOWN: &[&str] = &[
            "quick",
            "smoke",
            "long",
            "seed",
            "backend",
            "procs",
            "tasks",
            "keys",
            "ttl-ms",
            "waiter-ttl-ms",
            "command-timeout-ms",
            "node-timeout-ms",
            "rounds",
            "faults",
            "margin-ms",
            "gap-ms",
            "work-ms",
            "commit-ms",
            "no-fencing",
            "help",
        ];
        if let Some(bad) = args.names().find(|n| !KNOWN.contains(n)) {
            return Err(format!("unknown option --{bad}"));
        }
        let mode = if args.flag("smoke") {
            "smoke"
        } else if args.flag("quick") {
            "quick"
        } else {
            "long"
        };
        let mut c = Config::preset(mode);
        c.seed = match args.num("seed")? {
            Some(s) => s,
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64 % 1_000_000_000)
                .unwrap_or(1),
        };
        if let Some(b) = args.string("backend") {
            c.backends = match b.as_str() {
                "all" => BackendKind::ALL.to_vec(),
                "both" => vec![BackendKind::Redis, BackendKind::Redlock],
                list => list
                    .split(',')
                    .map(BackendKind::parse)
                    .collect::<Result<Vec<_>, _>>()?,
            };
        }
        let ms = Duration::from_millis;
        if let Some(v) = args.num("procs")? {
            c.procs = v.max(1) as u32;
        }
        if let Some(v) = args.num("tasks")? {
            c.tasks = v.max(1) as u32;
        }
        if let Some(v) = args.num("keys")? {
            c.keys = v.max(1) as u32;
        }
        if let Some(v) = args.num("ttl-ms")? {
            c.ttl = ms(v.max(100));
        }
        c.waiter_ttl = args.num("waiter-ttl-ms")?.map(ms).unwrap_or(c.ttl);
        if let Some(v) = args.num("command-timeout-ms")? {
            c.command_timeout = ms(v);
        }
        if let Some(v) = args.num("node-timeout-ms")? {
            c.node_timeout = ms(v);
        }
        if let Some(v) = args.num("rounds")? {
            c.rounds = v.max(1) as u32;
        }
        if let Some(v) = args.string("faults") {
            c.faults = v
                .split(',')
                .map(FaultKind::parse)
                .collect::<Result<Vec<_>, _>>()?;
        }
        if let Some(v) = args.num("margin-ms")? {
            c.margin = ms(v);
        }
        if let Some(v) = args.range("gap-ms")? {
            c.gap_ms = v;
        }
        if let Some(v) = args.range("work-ms")? {
            c.work_ms = v;
        }
        if let Some(v) = args.range("commit-ms")? {
            c.commit_ms = v;
        }
        c.fencing = !args.flag("no-fencing");
        Ok(c)
    }
}

/// The `--help` text.
pub(crate) const USAGE: &str = "\
dlock-torture: fault-injection harness for dlock (see tests/README.md)

usage:
  dlock-torture [--quick | --smoke] [options]    coordinator (default: the long mode)
  dlock-torture worker ...                       a worker process (spawned by the coordinator)

modes:
  --smoke    2 procs x 4 tasks, 2 keys, TTL 500 ms, one round per backend (the cargo test)
  --quick    4 procs x 16 tasks, 4 keys, TTL 1 s, 3 rounds per backend (CI; about 5 min)
  (none)     the long mode: as --quick with 20 rounds per backend (release checks)

options:
  --seed N                 repeat a run's fault schedule (printed at the start and the end);
                           with --backend B, the schedule of B's phase in any run of seed N
  --backend B[,B...]       redis, redlock, postgres, cluster, sentinel, etcd, zookeeper; `all` (the
                           default; --smoke: all but etcd and zookeeper) or `both` (redis,redlock)
  --procs N  --tasks N  --keys N
  --ttl-ms N  --waiter-ttl-ms N  --command-timeout-ms N  --node-timeout-ms N
  --rounds N               rounds of faults per backend (each round: every fault kind once)
  --faults K,K,...         the fault kinds of a round; each backend takes those that apply:
                           redis, redlock: pause,kill,restart,latency,cut
                           cluster: pause,kill,master-kill,master-pause,reshard
                           sentinel: pause,kill,master-kill,master-pause
                           etcd, zookeeper: pause,kill,leader-kill,member-freeze
  --margin-ms N            liveness bound = max(TTL, waiter TTL) + margin (etcd: its session
                           lease of that: whole seconds rounded up + 1 s + 0.5 s sweep)
  --gap-ms A..B  --work-ms A..B  --commit-ms A..B
  --no-fencing             the resource accepts every write: shows what the overlaps do
                           without the token check (expected to FAIL)
";
