//! A real Sentinel deployment for tests: one master, one replica and three sentinels, each a
//! `redis-server` (the sentinels with `--sentinel`) on a free loopback port in its own
//! temporary folder. The sentinels call the master down after [`DOWN_AFTER`] and fail over
//! with a quorum of two. Starting one takes a few seconds (the sentinels must find each other
//! and the replica): start it once per test binary ([`shared`]) and give each test keys of its
//! own; a test that fails the master over starts its own ([`RedisSentinel::start`]).

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::proxy::Proxy;
use crate::redis_cluster::redis_cli;
use crate::RedisServer;

/// The name the sentinels monitor the master under.
pub const MASTER_NAME: &str = "dlock";

/// How long the master may be unreachable before the sentinels call it down.
pub const DOWN_AFTER: Duration = Duration::from_millis(500);

/// A running Sentinel deployment. Dropping it stops every server.
#[derive(Debug)]
pub struct RedisSentinel {
    /// The data nodes: the first master, then its replica. Which one is master now is the
    /// sentinels' call ([`RedisSentinel::master_port`]).
    pub servers: Vec<RedisServer>,
    /// The three sentinels.
    pub sentinels: Vec<RedisServer>,
    /// `(proxy port, data node's port)` when the sentinels reach a data node through a proxy
    /// ([`RedisSentinel::start_behind_proxy`]: the first master,
    /// [`RedisSentinel::start_with_replica_behind_proxy`]: the replica): they name the proxy's
    /// port.
    proxied: Option<(u16, u16)>,
}

impl RedisSentinel {
    /// Starts a master, a replica of it and three sentinels monitoring it, and waits until the
    /// sentinels know the replica and each other.
    ///
    /// # Panics
    /// If a server does not start or the deployment is not ready within 30 s.
    pub fn start() -> Self {
        Self::start_inner(false)
    }

    fn start_inner(owned_by_thread: bool) -> Self {
        let server = |extra: &[&str]| {
            if owned_by_thread {
                RedisServer::start_owned_by_thread(extra)
            } else {
                RedisServer::start_with(extra)
            }
        };
        let master = server(&[]);
        Self::around(master, None, DOWN_AFTER, owned_by_thread)
    }

    /// Starts a deployment like [`start`](RedisSentinel::start) whose sentinels — and so every
    /// client that asks them for the master — reach the master through a [`Proxy`] in front of
    /// it, and call it down only after `down_after`. A test can then make the clients'
    /// connections to the master go silent ([`Proxy::set_latency`]) without a failover, as long
    /// as it is done well within `down_after / 2` (after that a sentinel drops its own link and
    /// makes a new one through the proxy). Needs a multi-thread runtime: the proxy forwards on
    /// it while this waits for the deployment.
    ///
    /// # Panics
    /// If a server or the proxy does not start, or the deployment is not ready within 30 s.
    pub async fn start_behind_proxy(down_after: Duration) -> (Self, Proxy) {
        let master = RedisServer::start_with(&[]);
        let proxy = Proxy::start(master.port()).await.expect("start the proxy");
        let port = proxy.port();
        let deployment =
            tokio::task::block_in_place(|| Self::around(master, Some(port), down_after, false));
        (deployment, proxy)
    }

    /// Starts a deployment like [`start`](RedisSentinel::start) whose replica the sentinels —
    /// and so, once it is promoted, every client that asks them for the master — reach through
    /// a [`Proxy`] in front of it (the replica announces the proxy's port), with the sentinels
    /// calling a node down after `down_after`. A test can then slow down what clients send to the
    /// promoted replica ([`Proxy::set_latency`], best before the failover) while it watches the
    /// replica directly. Needs a multi-thread runtime: the proxy forwards on it while this
    /// waits for the deployment.
    ///
    /// # Panics
    /// If a server or the proxy does not start, or the deployment is not ready within 30 s.
    pub async fn start_with_replica_behind_proxy(down_after: Duration) -> (Self, Proxy) {
        let master = RedisServer::start_with(&[]);
        let replica = RedisServer::start_with(&[]);
        let proxy = Proxy::start(replica.port()).await.expect("start the proxy");
        for (name, value) in [
            ("replica-announce-ip", "127.0.0.1".to_owned()),
            ("replica-announce-port", proxy.port().to_string()),
        ] {
            let () = replica
                .query(redis::cmd("CONFIG").arg("SET").arg(name).arg(value))
                .await;
        }
        let () = replica
            .query(redis::cmd("REPLICAOF").arg("127.0.0.1").arg(master.port()))
            .await;
        let proxied = Some((proxy.port(), replica.port()));
        let deployment = tokio::task::block_in_place(|| {
            Self::with_replica(master, replica, proxied, None, down_after, false)
        });
        (deployment, proxy)
    }

    /// A replica of `master` and three sentinels monitoring it at `monitored` (its own port if
    /// none).
    fn around(
        master: RedisServer,
        monitored: Option<u16>,
        down_after: Duration,
        owned_by_thread: bool,
    ) -> Self {
        let master_port = master.port().to_string();
        let extra = ["--replicaof", "127.0.0.1", &master_port];
        let replica = if owned_by_thread {
            RedisServer::start_owned_by_thread(&extra)
        } else {
            RedisServer::start_with(&extra)
        };
        let proxied = monitored.map(|p| (p, master.port()));
        Self::with_replica(
            master,
            replica,
            proxied,
            monitored,
            down_after,
            owned_by_thread,
        )
    }

    /// `master`, its `replica` and three sentinels monitoring the master at `monitored` (its
    /// own port if none); `proxied` is a proxy's port and the data node's behind it.
    fn with_replica(
        master: RedisServer,
        replica: RedisServer,
        proxied: Option<(u16, u16)>,
        monitored: Option<u16>,
        down_after: Duration,
        owned_by_thread: bool,
    ) -> Self {
        let monitored_port = monitored.unwrap_or(master.port());
        let config = format!(
            "sentinel resolve-hostnames no\n\
             sentinel monitor {MASTER_NAME} 127.0.0.1 {monitored_port} 2\n\
             sentinel down-after-milliseconds {MASTER_NAME} {}\n\
             sentinel failover-timeout {MASTER_NAME} 2000\n\
             sentinel parallel-syncs {MASTER_NAME} 1\n",
            down_after.as_millis()
        );
        let sentinels = (0..3)
            .map(|_| RedisServer::start_sentinel(&config, owned_by_thread))
            .collect();
        let deployment = RedisSentinel {
            proxied,
            servers: vec![master, replica],
            sentinels,
        };
        deployment.wait_ready(Duration::from_secs(30));
        deployment
    }

    /// The data node's port behind `port`, a port the sentinels name (the proxy's, if they
    /// reach the master through one).
    fn behind(&self, port: u16) -> u16 {
        match self.proxied {
            Some((proxy, master)) if proxy == port => master,
            _ => port,
        }
    }

    /// Waits until every running sentinel knows the two other sentinels and every running
    /// replica, and every replica's link to the master is up: what a failover needs.
    ///
    /// # Panics
    /// If that does not happen within `limit`.
    pub fn wait_ready(&self, limit: Duration) {
        let replicas = self.servers.iter().filter(|s| s.is_up()).count() - 1;
        let deadline = Instant::now() + limit;
        loop {
            let sentinels_ok = self.sentinels.iter().filter(|s| s.is_up()).all(|s| {
                let fields = sentinel_fields(s.port());
                fields.get("num-other-sentinels").map(String::as_str) == Some("2")
                    && fields.get("num-slaves") == Some(&replicas.to_string())
                    && fields.get("flags").map(String::as_str) == Some("master")
            });
            let master = self.master_port().map(|p| self.behind(p));
            let replicas_ok = self
                .servers
                .iter()
                .filter(|s| s.is_up() && Some(s.port()) != master)
                .all(|s| {
                    redis_cli(s.port(), &["info", "replication"])
                        .is_some_and(|i| i.contains("master_link_status:up"))
                });
            if sentinels_ok && replicas_ok {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "sentinel deployment not ready within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The master's port as the first sentinel that answers names it.
    pub fn master_port(&self) -> Option<u16> {
        self.sentinels.iter().filter(|s| s.is_up()).find_map(|s| {
            let out = redis_cli(
                s.port(),
                &["sentinel", "get-master-addr-by-name", MASTER_NAME],
            )?;
            out.lines().nth(1)?.trim().parse().ok()
        })
    }

    /// The data node (index into [`servers`](RedisSentinel::servers)) that is master now.
    ///
    /// # Panics
    /// If no sentinel names a master, or it is not one of ours.
    pub fn master_index(&self) -> usize {
        let port = self.behind(self.master_port().expect("no sentinel names a master"));
        self.servers
            .iter()
            .position(|s| s.port() == port)
            .unwrap_or_else(|| panic!("the sentinels name port {port}, not one of ours"))
    }

    /// Waits until the sentinels name a master other than the one on `old` (a failover).
    ///
    /// # Panics
    /// If that does not happen within `limit`.
    pub fn wait_failover_from(&self, old: u16, limit: Duration) -> u16 {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(port) = self.master_port().filter(|&p| p != old) {
                let promoted = redis_cli(port, &["role"]).is_some_and(|r| r.starts_with("master"));
                if promoted {
                    return port;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no failover from port {old} within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `redis+sentinel://127.0.0.1:<s1>,127.0.0.1:<s2>,127.0.0.1:<s3>/dlock`, for
    /// `Locker::from_url`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        format!("redis+sentinel://{}/{MASTER_NAME}", hosts.join(","))
    }
}

impl crate::redis_server::Failover for RedisSentinel {
    fn url(&self) -> String {
        RedisSentinel::url(self)
    }

    fn node_ports(&self) -> Vec<u16> {
        self.servers.iter().map(RedisServer::port).collect()
    }

    fn master_ports(&self) -> Vec<u16> {
        self.master_port().into_iter().collect()
    }

    fn node(&mut self, port: u16) -> &mut RedisServer {
        self.servers
            .iter_mut()
            .find(|s| s.port() == port)
            .unwrap_or_else(|| panic!("no data node on port {port}"))
    }

    fn wait_failed_over(&self, port: u16, limit: Duration) {
        self.wait_failover_from(port, limit);
    }

    /// Settled: the sentinels have named the same master, with no failover under way, for
    /// 3 × [`DOWN_AFTER`] in a row (the sentinels agree a master is down, elect a leader,
    /// promote).
    fn wait_healthy(&self, limit: Duration) -> Duration {
        let deadline = Instant::now() + limit;
        let settle = DOWN_AFTER * 3;
        let mut since = (Instant::now(), self.master_port());
        while since.0.elapsed() < settle {
            assert!(
                Instant::now() < deadline,
                "the sentinels did not settle on a master within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
            let now = self.master_port();
            let in_failover = self.sentinels.iter().filter(|s| s.is_up()).any(|s| {
                sentinel_fields(s.port())
                    .get("flags")
                    .is_some_and(|f| f != "master")
            });
            if now != since.1 || now.is_none() || in_failover {
                since = (Instant::now(), now);
            }
        }
        self.wait_ready(deadline.saturating_duration_since(Instant::now()));
        since.0.elapsed()
    }
}

/// `SENTINEL MASTER <name>` of the sentinel on `port`, as field → value (empty if it does not
/// answer).
fn sentinel_fields(port: u16) -> std::collections::HashMap<String, String> {
    let Some(out) = redis_cli(port, &["sentinel", "master", MASTER_NAME]) else {
        return Default::default();
    };
    let lines: Vec<&str> = out.lines().map(str::trim).collect();
    lines
        .chunks(2)
        .filter_map(|kv| match kv {
            [k, v] => Some(((*k).to_owned(), (*v).to_owned())),
            _ => None,
        })
        .collect()
}

/// The Sentinel deployment of this test binary, started on first use and kept for the binary's
/// life (its servers are killed by the kernel when the process ends, like
/// [`redis_cluster::shared`](crate::redis_cluster::shared)'s).
pub fn shared() -> Arc<Mutex<RedisSentinel>> {
    static SHARED: OnceLock<Arc<Mutex<RedisSentinel>>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let deployment = crate::redis_server::on_owner_thread("redis-sentinel-owner", || {
                RedisSentinel::start_inner(true)
            });
            Arc::new(Mutex::new(deployment))
        })
        .clone()
}
