//! Starts real ZooKeeper servers for tests: one standalone server ([`ZkEnsemble::start`], and
//! [`shared`], one per test binary) or an ensemble of three ([`ZkEnsemble::start_ensemble`]) on
//! free loopback ports (client, peer and election; the admin server is off), with their data in
//! a private temporary folder (on `/dev/shm` when there is one), and the faults the tests inject
//! (kill, restart, freeze with SIGSTOP).
//!
//! Servers run Debian's `zookeeper` jars (`/usr/share/java/zookeeper.jar`, or `DLOCK_ZK_JAR`) on
//! the machine's `java` with a 200 ms tick (sessions of 0.4 s up to 60 s; `maxSessionTimeout`
//! raised so the default 30 s session is granted), `forceSync=no`, and a small JIT-light heap so
//! that a JVM starts in about a second. Readiness is a real request: the four-letter command
//! `srvr` answering with a `Mode` (standalone, leader or follower) — which a server without a
//! quorum does not. Every server runs under `setpriv --pdeathsig KILL`, spawned from one thread
//! that lives as long as the process (a server dies with the thread that spawned it, and a
//! test's threads end with the test): it dies with the test binary, and dropping the
//! [`ZkEnsemble`] kills it and removes the folder. If ZooKeeper
//! or Java is missing, starting one panics saying how to get them (`./scripts/test` installs
//! Debian's `zookeeper`): a ZooKeeper test never silently skips.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::etcd_server::{data_root, sweep_dead_dirs, Quorum};
use crate::redis_server::{free_port, on_owner_thread};

static SEQ: AtomicU64 = AtomicU64::new(0);

/// The data folders' name: `dlock-zk-<pid>-<n>`.
const DIR_PREFIX: &str = "dlock-zk-";

fn jar() -> String {
    std::env::var("DLOCK_ZK_JAR").unwrap_or_else(|_| "/usr/share/java/zookeeper.jar".to_owned())
}

/// The server's jar, and slf4j's simple logger when installed (warnings go to the server's
/// `server.log` in its folder; without it the server logs nothing).
fn classpath() -> String {
    let simple = "/usr/share/java/slf4j-simple.jar";
    if std::path::Path::new(simple).exists() {
        format!("{}:{simple}", jar())
    } else {
        jar()
    }
}

/// One server of a [`ZkEnsemble`].
#[derive(Debug)]
struct Server {
    id: usize,
    client_port: u16,
    peer_port: u16,
    election_port: u16,
    child: Option<Child>,
    paused: bool,
}

/// A running ZooKeeper deployment of one standalone server or an ensemble, all on `127.0.0.1`.
#[derive(Debug)]
pub struct ZkEnsemble {
    servers: Vec<Server>,
    dir: PathBuf,
}

impl ZkEnsemble {
    /// One standalone server, ready.
    ///
    /// # Panics
    /// If ZooKeeper or Java is missing or the server does not come up within 30 seconds.
    pub fn start() -> Self {
        Self::start_n(1)
    }

    /// Three servers forming one ensemble, ready (a leader is elected, the others follow).
    ///
    /// # Panics
    /// If ZooKeeper or Java is missing or the ensemble does not come up within 30 seconds.
    pub fn start_ensemble() -> Self {
        Self::start_n(3)
    }

    fn start_n(n: usize) -> Self {
        assert!(
            std::path::Path::new(&jar()).exists(),
            "{} not found. Install ZooKeeper (`apt-get install --no-install-recommends zookeeper`) \
             or run the project's test command, `./scripts/test`, which installs it.",
            jar()
        );
        sweep_dead_dirs(DIR_PREFIX);
        let dir = data_root().join(format!(
            "{DIR_PREFIX}{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        // Another process may take a probed port before a server binds it: start again then.
        for _ in 0..5 {
            std::fs::create_dir_all(&dir).expect("create zookeeper temp dir");
            let servers = (1..=n)
                .map(|id| Server {
                    id,
                    client_port: free_port(),
                    peer_port: free_port(),
                    election_port: free_port(),
                    child: None,
                    paused: false,
                })
                .collect();
            let mut zk = ZkEnsemble {
                servers,
                dir: dir.clone(),
            };
            for i in 0..n {
                zk.write_config(i);
                zk.spawn(i);
            }
            if zk.wait_ready(Duration::from_secs(30)) {
                return zk;
            }
            drop(zk); // kills the servers, removes the folder
        }
        panic!("could not start {n} ZooKeeper server(s) on free ports after 5 tries");
    }

    fn server_dir(&self, i: usize) -> PathBuf {
        self.dir.join(format!("s{}", self.servers[i].id))
    }

    fn write_config(&self, i: usize) {
        let dir = self.server_dir(i);
        let data = dir.join("data");
        std::fs::create_dir_all(&data).expect("create zookeeper data dir");
        let s = &self.servers[i];
        let mut cfg = format!(
            "tickTime=200\ninitLimit=20\nsyncLimit=10\ndataDir={}\nclientPort={}\n\
             clientPortAddress=127.0.0.1\nadmin.enableServer=false\nmaxSessionTimeout=60000\n\
             4lw.commands.whitelist=srvr\nforceSync=no\nznode.container.checkIntervalMs=1000\n",
            data.display(),
            s.client_port
        );
        if self.servers.len() > 1 {
            for o in &self.servers {
                cfg.push_str(&format!(
                    "server.{}=127.0.0.1:{}:{}\n",
                    o.id, o.peer_port, o.election_port
                ));
            }
            std::fs::write(data.join("myid"), format!("{}\n", s.id)).expect("write myid");
        }
        std::fs::write(dir.join("zoo.cfg"), cfg).expect("write zoo.cfg");
    }

    fn spawn(&mut self, i: usize) {
        let dir = self.server_dir(i);
        let log = std::fs::File::create(dir.join("server.log")).expect("server log");
        let mut cmd = Command::new("setpriv");
        cmd.args(["--pdeathsig", "KILL", "--", "java"])
            .args(["-Xmx128m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"])
            .arg("-Dzookeeper.root.logger=WARN,CONSOLE")
            .arg(format!("-Dzookeeper.log.dir={}", dir.display()))
            .arg("-Dorg.slf4j.simpleLogger.defaultLogLevel=warn")
            .arg("-cp")
            .arg(classpath())
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(dir.join("zoo.cfg"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        match spawn_kept(cmd) {
            Ok(c) => self.servers[i].child = Some(c),
            Err(e) => panic!(
                "cannot run `setpriv … java` ({e}). Install a Java runtime and ZooKeeper \
                 (`apt-get install --no-install-recommends zookeeper default-jre-headless`) or run \
                 `./scripts/test`, which installs them."
            ),
        }
    }

    /// Whether every running, unfrozen server serves clients (`srvr` names its mode).
    fn wait_ready(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let mut ready = true;
            for s in &mut self.servers {
                let Some(c) = s.child.as_mut() else { continue };
                if let Ok(Some(_)) = c.try_wait() {
                    return false; // exited: a port was taken, most likely
                }
                if !s.paused {
                    ready &= mode(s.client_port).is_some();
                }
            }
            if ready {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// How many servers it has.
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    /// Always `false`.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// `zk://127.0.0.1:<p1>,127.0.0.1:<p2>,…` over every server.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.client_port))
            .collect();
        format!("zk://{}", hosts.join(","))
    }

    /// The client port of server `i`.
    pub fn client_port(&self, i: usize) -> u16 {
        self.servers[i].client_port
    }

    /// The index of the server that is leader now (a standalone server counts as leader).
    pub fn leader(&self) -> Option<usize> {
        self.servers.iter().position(|s| {
            s.child.is_some()
                && !s.paused
                && mode(s.client_port).is_some_and(|m| m == "leader" || m == "standalone")
        })
    }

    /// Waits (bounded) until a running server is leader, and returns its index.
    ///
    /// # Panics
    /// If none is within `limit`.
    pub fn wait_leader(&self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(l) = self.leader() {
                return l;
            }
            assert!(
                Instant::now() < deadline,
                "no ZooKeeper leader within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (bounded) until every running, unfrozen server serves clients again.
    ///
    /// # Panics
    /// If they do not within `limit`.
    pub fn wait_serving(&mut self, limit: Duration) {
        let ok = self.wait_ready(limit);
        assert!(
            ok,
            "ZooKeeper not serving within {limit:?}: (paused, running, mode) {:?}",
            self.servers
                .iter()
                .map(|s| (s.paused, s.child.is_some(), mode(s.client_port)))
                .collect::<Vec<_>>()
        );
    }

    /// Brings every server back after a test's faults, also when the test failed half-way:
    /// thaws the frozen ones, starts the killed ones, and restarts any that does not serve
    /// within 15 seconds (a thawed ZooKeeper 3.8 follower occasionally stays out of the quorum
    /// for long). Never panics (it runs from `Drop`); a deployment that does not come back
    /// fails the next test's request instead.
    pub fn heal(&mut self) {
        for i in 0..self.servers.len() {
            if self.servers[i].paused {
                self.resume(i);
            }
            if self.servers[i].child.is_none() {
                self.spawn(i);
            }
        }
        if self.wait_ready(Duration::from_secs(15)) {
            return;
        }
        for i in 0..self.servers.len() {
            if mode(self.servers[i].client_port).is_none() {
                self.kill(i);
                self.spawn(i);
            }
        }
        let _ = self.wait_ready(Duration::from_secs(30));
    }

    fn signal(&self, i: usize, sig: &str) {
        if let Some(c) = &self.servers[i].child {
            let ok = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "kill {sig} on ZooKeeper server {i} failed");
        }
    }

    /// Freezes server `i` (SIGSTOP): its connections stay open, nothing is answered. Returns
    /// once the kernel reports the process stopped (a signal is delivered asynchronously).
    pub fn pause(&mut self, i: usize) {
        self.signal(i, "-STOP");
        self.servers[i].paused = true;
        let Some(pid) = self.servers[i].child.as_ref().map(Child::id) else {
            return;
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if stopped(pid) {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("ZooKeeper server {i} did not stop after SIGSTOP");
    }

    /// Thaws server `i` (SIGCONT).
    pub fn resume(&mut self, i: usize) {
        self.signal(i, "-CONT");
        self.servers[i].paused = false;
    }

    /// Kills server `i` (SIGKILL); its data stays for [`restart`](Self::restart).
    pub fn kill(&mut self, i: usize) {
        kill_child(&mut self.servers[i]);
    }

    /// Starts a killed server `i` again on the same ports and data, and waits until every
    /// running server serves.
    ///
    /// # Panics
    /// If they do not within 30 seconds.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
        assert!(
            self.wait_ready(Duration::from_secs(30)),
            "ZooKeeper server {i} did not come back"
        );
    }
}

/// Spawns `cmd` from a thread that lives as long as the process. A server under `setpriv
/// --pdeathsig` dies with the thread that spawned it, and a test's threads end with the test:
/// a server a test restarted (a fault test healing the shared ensemble) would die with them and
/// leave the next test a dead server.
fn spawn_kept(cmd: Command) -> std::io::Result<Child> {
    type Job = (Command, std::sync::mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<std::sync::mpsc::Sender<Job>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("zk-spawner".to_owned())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawn the ZooKeeper spawner thread");
        tx
    });
    let (reply, answer) = std::sync::mpsc::channel();
    if spawner.send((cmd, reply)).is_err() {
        return Err(std::io::Error::other(
            "the ZooKeeper spawner thread is gone",
        ));
    }
    answer.recv().unwrap_or_else(|_| {
        Err(std::io::Error::other(
            "the ZooKeeper spawner thread is gone",
        ))
    })
}

fn kill_child(s: &mut Server) {
    if let Some(mut c) = s.child.take() {
        if s.paused {
            let _ = Command::new("kill")
                .args(["-CONT", &c.id().to_string()])
                .status();
            s.paused = false;
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

impl Drop for ZkEnsemble {
    fn drop(&mut self) {
        for s in &mut self.servers {
            kill_child(s);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Quorum for ZkEnsemble {
    fn url(&self) -> String {
        ZkEnsemble::url(self)
    }

    fn members(&self) -> usize {
        self.len()
    }

    fn leader(&self) -> Option<usize> {
        ZkEnsemble::leader(self)
    }

    fn kill(&mut self, i: usize) {
        ZkEnsemble::kill(self, i);
    }

    fn pause(&mut self, i: usize) {
        ZkEnsemble::pause(self, i);
    }

    fn resume(&mut self, i: usize) {
        ZkEnsemble::resume(self, i);
    }

    fn heal(&mut self) {
        ZkEnsemble::heal(self);
        self.wait_serving(Duration::from_secs(30));
    }
}

/// Whether every thread of process `pid` is stopped (`T`) or exited (`Z`, `X`), as
/// `/proc/<pid>/task/*/stat` report them: a JVM's threads stop one by one after a SIGSTOP.
fn stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true; // gone
    };
    tasks.flatten().all(|t| {
        let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
        // `tid (comm) S …`: the state follows the command name's closing parenthesis.
        stat.rsplit_once(") ")
            .is_none_or(|(_, rest)| rest.starts_with(['T', 'Z', 'X', 't']))
    })
}

/// The `Mode:` the server on `port` reports to `srvr` (`standalone`, `leader`, `follower`);
/// `None` when it does not answer or does not serve (no quorum).
fn mode(port: u16) -> Option<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    s.write_all(b"srvr").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    buf.lines()
        .find_map(|l| l.strip_prefix("Mode: "))
        .map(|m| m.trim().to_owned())
}

/// The standalone ZooKeeper server of this test binary, started on first use and kept for the
/// binary's life (the kernel kills it when the process ends).
pub fn shared() -> Arc<Mutex<ZkEnsemble>> {
    static SHARED: OnceLock<Arc<Mutex<ZkEnsemble>>> = OnceLock::new();
    SHARED
        .get_or_init(|| Arc::new(Mutex::new(on_owner_thread("zk-owner", ZkEnsemble::start))))
        .clone()
}
