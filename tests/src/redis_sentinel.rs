//! A real Sentinel deployment for tests: one master, one replica and three sentinels, each a
//! `redis-server` (the sentinels with `--sentinel`) on a free loopback port in its own
//! temporary folder. The sentinels call the master down after [`DOWN_AFTER`] and fail over
//! with a quorum of two. Starting one takes a few seconds (the sentinels must find each other
//! and the replica): start it once per test binary ([`shared`]) and give each test keys of its
//! own; a test that fails the master over starts its own ([`RedisSentinel::start`]).

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

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
        let master_port = master.port().to_string();
        let replica = server(&["--replicaof", "127.0.0.1", &master_port]);
        let config = format!(
            "sentinel resolve-hostnames no\n\
             sentinel monitor {MASTER_NAME} 127.0.0.1 {master_port} 2\n\
             sentinel down-after-milliseconds {MASTER_NAME} {}\n\
             sentinel failover-timeout {MASTER_NAME} 2000\n\
             sentinel parallel-syncs {MASTER_NAME} 1\n",
            DOWN_AFTER.as_millis()
        );
        let sentinels = (0..3)
            .map(|_| RedisServer::start_sentinel(&config, owned_by_thread))
            .collect();
        let deployment = RedisSentinel {
            servers: vec![master, replica],
            sentinels,
        };
        deployment.wait_ready(Duration::from_secs(30));
        deployment
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
            let master = self.master_port();
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
        let port = self.master_port().expect("no sentinel names a master");
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
