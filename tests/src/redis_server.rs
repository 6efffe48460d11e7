//! Starts real `redis-server` processes for tests and benchmarks, and reaches them past the
//! locker ([`RedisServer::conn`], [`RedisServer::query`]).
//!
//! Each [`RedisServer`] is a fresh process on a free loopback port, with persistence off and
//! its working directory in a private temporary folder. [`RedisServer::start`] returns once the
//! server answers `PING`; dropping the value kills the process and removes the folder. The
//! servers never touch the machine's shared Redis on 6379.
//!
//! If `redis-server` is not installed, starting one panics with a message saying how to get
//! it (the project's test command installs it): a Redis test never silently skips.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A `redis-server` child process on `127.0.0.1:<port>`.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    paused: bool,
    /// Arguments beyond the defaults (cluster mode, …), kept for restarts.
    extra: Vec<String>,
    /// The process is killed when the thread that started it ends (servers shared by a
    /// whole test binary, which would otherwise outlive it).
    die_with_parent: bool,
    /// A Redis Sentinel: started with `sentinel.conf` (in its folder) and `--sentinel`.
    sentinel: bool,
}

static SEQ: AtomicU64 = AtomicU64::new(0);

fn binary() -> String {
    std::env::var("DLOCK_REDIS_SERVER").unwrap_or_else(|_| "redis-server".to_owned())
}

/// A loopback port nothing listened on a moment ago (the OS picked it for a listener that is
/// closed again): for tests that need "nothing listening here".
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free loopback port")
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers.
    ///
    /// # Panics
    /// If `redis-server` is missing or does not come up within 10 seconds.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Like [`start`](RedisServer::start), with more `redis-server` arguments (they override
    /// the defaults; e.g. `["--cluster-enabled", "yes"]`). Its temporary folder holds whatever
    /// files they make (a cluster's `nodes.conf`).
    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_inner(extra, false)
    }

    /// Like [`start_with`](RedisServer::start_with), but the server is killed by the kernel
    /// when the thread that started it ends — for servers a whole test binary shares (kept in
    /// a static, never dropped): start them on a thread that lives as long as the process.
    pub fn start_owned_by_thread(extra: &[&str]) -> Self {
        Self::start_inner(extra, true)
    }

    /// Starts a Redis Sentinel (`redis-server <conf> --sentinel`) whose configuration file
    /// holds `config` (its `sentinel monitor …` lines), like
    /// [`start_owned_by_thread`](RedisServer::start_owned_by_thread) when `owned_by_thread`.
    pub fn start_sentinel(config: &str, owned_by_thread: bool) -> Self {
        Self::start_inner_as(&[], owned_by_thread, Some(config))
    }

    fn start_inner(extra: &[&str], die_with_parent: bool) -> Self {
        Self::start_inner_as(extra, die_with_parent, None)
    }

    fn start_inner_as(extra: &[&str], die_with_parent: bool, sentinel: Option<&str>) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "dlock-redis-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create redis temp dir");
        if let Some(config) = sentinel {
            std::fs::write(dir.join("sentinel.conf"), config).expect("write sentinel.conf");
        }
        // Another process may grab the port between our probe and redis binding it: retry.
        for _ in 0..10 {
            let port = free_port();
            let mut server = RedisServer {
                child: None,
                port,
                dir: dir.clone(),
                paused: false,
                extra: extra.iter().map(|a| (*a).to_owned()).collect(),
                die_with_parent,
                sentinel: sentinel.is_some(),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("could not start redis-server on a free port after 10 tries");
    }

    fn spawn(&mut self) -> bool {
        // A shared server runs under `setpriv --pdeathsig KILL` (util-linux), which execs
        // redis-server in the same process with the parent-death signal set.
        let mut command = if self.die_with_parent {
            let mut c = Command::new("setpriv");
            c.args(["--pdeathsig", "KILL", "--"]).arg(binary());
            c
        } else {
            Command::new(binary())
        };
        if self.sentinel {
            command
                .arg(self.dir.join("sentinel.conf"))
                .arg("--sentinel");
        }
        let child = command
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--protected-mode",
                "no",
                "--loglevel",
                "warning",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => panic!(
                "cannot run `{}` ({e}). Install it (`apt-get install redis-server`) or run the \
                 project's test command, `./scripts/test`, which installs it.",
                binary()
            ),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return false; // exited: port taken, most likely
            }
            // The port may have been taken by another process's server between our probe and
            // the bind: only our own child counts as up.
            if ping(self.port) && server_pid(self.port) == Some(child.id()) {
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            let ok = Command::new("kill")
                .args([sig, &pid.to_string()])
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            assert!(ok, "kill {sig} {pid} failed");
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&mut self) {
        self.signal("-STOP");
        self.paused = true;
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&mut self) {
        self.signal("-CONT");
        self.paused = false;
    }

    /// Kills the server (SIGKILL); its data is gone.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            if self.paused {
                let _ = Command::new("kill")
                    .args(["-CONT", &c.id().to_string()])
                    .status();
                self.paused = false;
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port (empty: persistence is off).
    ///
    /// # Panics
    /// If it does not come back within 10 seconds.
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.spawn() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("redis-server did not come back on port {}", self.port);
    }

    /// Whether the server answers `PING` now.
    pub fn is_up(&self) -> bool {
        ping(self.port)
    }

    /// A new connection of its own to the server, for tests that read or change keys behind
    /// the locker's back.
    ///
    /// # Panics
    /// If the server does not accept the connection.
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .expect("connect to redis")
    }

    /// Adds the ACL user `user` (password `pw`), who may run every command on every key and
    /// channel, and returns a URL that signs in as it (`redis://<user>:pw@127.0.0.1:<port>`);
    /// [`confine`](Self::confine) takes its keys away, [`unconfine`](Self::unconfine) gives
    /// them back.
    ///
    /// # Panics
    /// If the server refuses the `ACL SETUSER`.
    pub async fn user_url(&self, user: &str) -> String {
        let mut setuser = redis::cmd("ACL");
        setuser.arg(&["SETUSER", user, "reset", "on", ">pw", "~*", "&*", "+@all"]);
        let () = self.query(&setuser).await;
        format!("redis://{user}:pw@127.0.0.1:{}", self.port)
    }

    /// Leaves the ACL user `user` only keys under `other:` — none of a locker's or a durable
    /// queue's: from then on the server refuses its commands on them for good (`NOPERM`).
    ///
    /// # Panics
    /// If the server refuses the `ACL SETUSER`.
    pub async fn confine(&self, user: &str) {
        let mut setuser = redis::cmd("ACL");
        setuser.arg(&["SETUSER", user, "resetkeys", "~other:*"]);
        let () = self.query(&setuser).await;
    }

    /// Gives the ACL user `user` every key again (after [`confine`](Self::confine)).
    ///
    /// # Panics
    /// If the server refuses the `ACL SETUSER`.
    pub async fn unconfine(&self, user: &str) {
        let mut setuser = redis::cmd("ACL");
        setuser.arg(&["SETUSER", user, "~*"]);
        let () = self.query(&setuser).await;
    }

    /// [`user_url`](Self::user_url) of a [confined](Self::confine) user: a server that refuses
    /// a locker's commands for good (`NOPERM`).
    ///
    /// # Panics
    /// If the server refuses the `ACL SETUSER`.
    pub async fn confined_user_url(&self, user: &str) -> String {
        let url = self.user_url(user).await;
        self.confine(user).await;
        url
    }

    /// Runs one command on a new connection ([`conn`](Self::conn)) and returns its reply, e.g.
    /// `server.query::<i64>(redis::cmd("DEL").arg(key))`.
    ///
    /// # Panics
    /// If the server cannot be reached or answers with an error.
    pub async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        cmd.query_async(&mut self.conn().await).await.unwrap()
    }

    /// How many times the server has run `command` (from clients, or from scripts), not
    /// counting calls that failed (an `EVALSHA` answered `NOSCRIPT` before the script is
    /// loaded).
    pub async fn calls(&self, command: &str) -> u64 {
        self.try_calls(command).await.expect("INFO commandstats")
    }

    /// [`calls`](RedisServer::calls), or why the server could not be asked (a connection
    /// refused or reset while the sentinels reconfigure it).
    pub async fn try_calls(&self, command: &str) -> Result<u64, redis::RedisError> {
        let mut conn = redis::Client::open(self.url())?
            .get_multiplexed_async_connection()
            .await?;
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await?;
        let prefix = format!("cmdstat_{command}:");
        let Some(stats) = info.lines().find_map(|l| l.strip_prefix(prefix.as_str())) else {
            return Ok(0);
        };
        let field = |name: &str| -> u64 {
            stats
                .split(',')
                .find_map(|kv| kv.strip_prefix(name))
                .map_or(0, |n| n.parse().unwrap())
        };
        Ok(field("calls=") - field("failed_calls="))
    }

    /// How many times the server answered `command` with an error: rejected before it ran (an
    /// ACL that denies a key it names) or failed while running (a script that a `NOPERM`
    /// ended).
    pub async fn error_calls(&self, command: &str) -> u64 {
        let info: String = self.query(redis::cmd("INFO").arg("commandstats")).await;
        let prefix = format!("cmdstat_{command}:");
        let Some(stats) = info.lines().find_map(|l| l.strip_prefix(prefix.as_str())) else {
            return 0;
        };
        stats
            .split(',')
            .filter_map(|kv| {
                kv.strip_prefix("rejected_calls=")
                    .or_else(|| kv.strip_prefix("failed_calls="))
            })
            .map(|n| n.parse::<u64>().unwrap())
            .sum()
    }

    /// A [`Locker`](dlock_runtime::Locker) on this server with the default settings
    /// (`Locker::from_url`).
    ///
    /// # Panics
    /// If it cannot connect.
    pub async fn locker(&self) -> dlock_runtime::Locker {
        dlock_runtime::Locker::from_url(&self.url())
            .await
            .expect("connect to redis")
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn ping(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    matches!(s.read_exact(&mut buf), Ok(()) if &buf == b"+PONG\r\n")
}

/// The `process_id` a server on `port` reports in `INFO server`.
fn server_pid(port: u16) -> Option<u32> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    s.write_all(b"INFO server\r\n").ok()?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while buf.len() < 64 * 1024 {
        let n = s.read(&mut chunk).ok()?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf);
        if let Some(rest) = text.split("process_id:").nth(1) {
            if let Some(line) = rest.split("\r\n").next().filter(|_| rest.contains("\r\n")) {
                return line.trim().parse().ok();
            }
        }
    }
    None
}

/// Runs `start` on a thread that lives as long as the process and returns what it made: for
/// servers a whole test binary shares, started with
/// [`start_owned_by_thread`](RedisServer::start_owned_by_thread) (the kernel kills them when that
/// thread, hence the process, ends: a static is never dropped).
///
/// # Panics
/// If `start` panics.
pub fn on_owner_thread<T: Send + 'static>(
    name: &str,
    start: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let _ = tx.send(start());
            loop {
                std::thread::park();
            }
        })
        .expect("spawn a server owner thread");
    rx.recv()
        .unwrap_or_else(|_| panic!("{name}: the owner thread died starting its servers"))
}

/// Starts `n` independent servers.
pub fn start_many(n: usize) -> Vec<RedisServer> {
    (0..n).map(|_| RedisServer::start()).collect()
}

/// The servers' [`url`](RedisServer::url)s, in order.
pub fn urls(servers: &[RedisServer]) -> Vec<String> {
    servers.iter().map(RedisServer::url).collect()
}

/// One `redlock://127.0.0.1:<p1>,127.0.0.1:<p2>,…` URL over all the servers.
pub fn redlock_url(servers: &[RedisServer]) -> String {
    let nodes: Vec<String> = servers
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.port()))
        .collect();
    format!("redlock://{}", nodes.join(","))
}

/// A Redis deployment whose masters fail over to their replicas — a cluster
/// ([`RedisCluster`](crate::redis_cluster::RedisCluster)) or Sentinel
/// ([`RedisSentinel`](crate::redis_sentinel::RedisSentinel)) —, as the fault harness drives it.
pub trait Failover: Send {
    /// The locker URL (`redis+cluster://…`, `redis+sentinel://…`).
    fn url(&self) -> String;
    /// The ports of every data node, masters and replicas.
    fn node_ports(&self) -> Vec<u16>;
    /// The ports of the masters now.
    fn master_ports(&self) -> Vec<u16>;
    /// The data node on `port`.
    ///
    /// # Panics
    /// If no node listens there.
    fn node(&mut self, port: u16) -> &mut RedisServer;
    /// Waits until the master that was on `port` has been replaced by a promoted replica.
    ///
    /// # Panics
    /// If that does not happen within `limit`.
    fn wait_failed_over(&self, port: u16, limit: Duration);
    /// Waits until every master serves and every running replica is linked to its master, and
    /// the deployment has settled: it kept the same masters, with no failover under way, for a
    /// while in a row (a master frozen past its down-after time and woken again may still be
    /// failed over a moment later, and nothing announces that it will not be). Returns how long
    /// ago it reached the state it settled in: when the master it settled on began to serve.
    ///
    /// # Panics
    /// If that does not happen within `limit`.
    fn wait_healthy(&self, limit: Duration) -> Duration;
    /// [`wait_healthy`](Failover::wait_healthy), repairing on the way what a known defect of
    /// the server breaks and nothing else repairs; also returns a line per repair (a cluster:
    /// slots a promoted master lost, see `RedisCluster::wait_ready_reclaiming`).
    ///
    /// # Panics
    /// As [`wait_healthy`](Failover::wait_healthy).
    fn wait_healthy_repairing(&self, limit: Duration) -> (Duration, Vec<String>) {
        (self.wait_healthy(limit), Vec::new())
    }
}
