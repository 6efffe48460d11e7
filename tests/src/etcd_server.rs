//! Starts real `etcd` processes for tests: one member ([`EtcdCluster::start`], and
//! [`shared`], one per test binary) or a cluster of three ([`EtcdCluster::start_cluster`]) on
//! free loopback ports (client and peer), with their data in a private temporary folder (on
//! `/dev/shm` when there is one), and
//! the faults the tests inject (kill, restart, freeze with SIGSTOP).
//!
//! Members run with a 50 ms heartbeat and a 500 ms election timeout, so a new leader is elected
//! within about a second and the smallest lease etcd grants is one second. Every member runs
//! under `setpriv --pdeathsig KILL`: it dies with the thread that started it, and dropping the
//! [`EtcdCluster`] kills it and removes the folder. If `etcd` is not installed, starting one
//! panics saying how to get it (`./scripts/test` installs Debian's `etcd-server`): an etcd
//! test never silently skips.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::redis_server::{free_port, on_owner_thread};

static SEQ: AtomicU64 = AtomicU64::new(0);

/// Where members keep their data: `/dev/shm` when the machine has it (a memory file system:
/// etcd fsyncs every write, which on a loaded disk can take longer than a test's command
/// timeout), else the temporary folder.
pub(crate) fn data_root() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    if shm.is_dir() {
        shm
    } else {
        std::env::temp_dir()
    }
}

/// The data folders' name: `dlock-etcd-<pid>-<n>`.
const DIR_PREFIX: &str = "dlock-etcd-";

/// Removes the data folders (named `<prefix><pid>-…`) of test processes that are gone: the
/// server a test binary shares is never dropped (it dies with the process), so its folder — on
/// `/dev/shm`, memory, about 120 MB with etcd's preallocated WAL — is left behind. Only folders
/// named by a harness whose process no longer exists are touched.
pub(crate) fn sweep_dead_dirs(prefix: &str) {
    // Without /proc nothing says which processes live: leave everything.
    if !PathBuf::from("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(data_root()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !PathBuf::from(format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn binary() -> String {
    std::env::var("DLOCK_ETCD").unwrap_or_else(|_| "etcd".to_owned())
}

/// One member of an [`EtcdCluster`].
#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
    paused: bool,
    /// A second client port serving TLS ([`EtcdCluster::start_tls`]).
    tls_port: Option<u16>,
}

/// A running etcd cluster of one or more members, all on `127.0.0.1`.
#[derive(Debug)]
pub struct EtcdCluster {
    members: Vec<Member>,
    dir: PathBuf,
    token: String,
    /// `ca.crt`, `server.crt`, `server.key` when members serve TLS too.
    tls_dir: Option<PathBuf>,
}

impl EtcdCluster {
    /// One member, ready (it has elected itself leader).
    ///
    /// # Panics
    /// If `etcd` is missing or does not come up within 20 seconds.
    pub fn start() -> Self {
        Self::start_n(1)
    }

    /// Three members forming one cluster, ready (a leader is elected).
    ///
    /// # Panics
    /// If `etcd` is missing or the cluster does not come up within 20 seconds.
    pub fn start_cluster() -> Self {
        Self::start_n(3)
    }

    /// One member that also serves TLS on a second client port ([`tls_url`](Self::tls_url)),
    /// with a server certificate for `127.0.0.1` and `localhost` from a throwaway CA
    /// ([`ca_file`](Self::ca_file)); its plain port stays for the harness's own probes.
    ///
    /// # Panics
    /// As [`start`](Self::start), or if `openssl` cannot make the certificates.
    pub fn start_tls() -> Self {
        Self::start_inner(1, true)
    }

    /// `etcds://127.0.0.1:<tls port>` of every member ([`start_tls`](Self::start_tls)).
    ///
    /// # Panics
    /// If the members do not serve TLS.
    pub fn tls_url(&self) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.tls_port.expect("not a TLS cluster")))
            .collect();
        format!("etcds://{}", hosts.join(","))
    }

    /// The CA certificate (PEM file) the members' TLS certificates chain to.
    ///
    /// # Panics
    /// If the members do not serve TLS.
    pub fn ca_file(&self) -> PathBuf {
        self.tls_dir
            .as_ref()
            .expect("not a TLS cluster")
            .join("ca.crt")
    }

    fn start_n(n: usize) -> Self {
        Self::start_inner(n, false)
    }

    fn start_inner(n: usize, tls: bool) -> Self {
        let token = format!(
            "{DIR_PREFIX}{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        sweep_dead_dirs(DIR_PREFIX);
        let dir = data_root().join(&token);
        std::fs::create_dir_all(&dir).expect("create etcd temp dir");
        // Outside `dir`, which a failed start removes.
        let tls_dir = tls.then(|| {
            let d = std::env::temp_dir().join(format!("{token}-tls"));
            std::fs::create_dir_all(&d).expect("create etcd TLS dir");
            crate::postgres_server::make_certificates(&d);
            d
        });
        // Another process may take a probed port before etcd binds it: start again then.
        for _ in 0..5 {
            let members = (0..n)
                .map(|i| Member {
                    name: format!("{token}-{i}"),
                    client_port: free_port(),
                    peer_port: free_port(),
                    child: None,
                    paused: false,
                    tls_port: tls.then(free_port),
                })
                .collect();
            let mut cluster = EtcdCluster {
                members,
                dir: dir.clone(),
                token: token.clone(),
                tls_dir: tls_dir.clone(),
            };
            for i in 0..n {
                cluster.spawn(i);
            }
            if cluster.wait_ready(Duration::from_secs(20)) {
                return cluster;
            }
            drop(cluster); // kills the members, removes the folder
            std::fs::create_dir_all(&dir).expect("create etcd temp dir");
        }
        panic!("could not start an etcd cluster of {n} on free ports after 5 tries");
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn(&mut self, i: usize) {
        let initial = self.initial_cluster();
        let data = self.dir.join(&self.members[i].name);
        let tls_dir = self.tls_dir.clone();
        let m = &mut self.members[i];
        let mut client = format!("http://127.0.0.1:{}", m.client_port);
        let mut tls_args: Vec<String> = Vec::new();
        if let (Some(port), Some(d)) = (m.tls_port, &tls_dir) {
            client.push_str(&format!(",https://127.0.0.1:{port}"));
            tls_args.push("--cert-file".into());
            tls_args.push(d.join("server.crt").display().to_string());
            tls_args.push("--key-file".into());
            tls_args.push(d.join("server.key").display().to_string());
        }
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let child = Command::new("setpriv")
            .args(["--pdeathsig", "KILL", "--"])
            .arg(binary())
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &self.token])
            .args(&tls_args)
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .args(["--log-level", "error"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        match child {
            Ok(c) => m.child = Some(c),
            Err(e) => panic!(
                "cannot run `setpriv … {}` ({e}). Install etcd (`apt-get install etcd-server`) or \
                 run the project's test command, `./scripts/test`, which installs it.",
                binary()
            ),
        }
    }

    /// Whether every running member answers, belongs to this cluster, and sees a leader.
    fn wait_ready(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let mut ready = true;
            for m in &mut self.members {
                let Some(c) = m.child.as_mut() else { continue };
                if let Ok(Some(_)) = c.try_wait() {
                    return false; // exited: a port was taken, most likely
                }
                // Only our own member counts: its name carries this cluster's unique token.
                let ours = post(m.client_port, "/v3/cluster/member/list")
                    .is_some_and(|body| body.contains(&m.name));
                let leader = status(m.client_port).is_some_and(|(_, leader)| leader != 0);
                ready &= ours && leader;
            }
            if ready {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// How many members it has.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Always `false`: a cluster has at least one member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The server version the first member reports on its `/version` endpoint (`3.4.23`).
    pub fn server_version(&self) -> Option<String> {
        let body = get(self.members.first()?.client_port, "/version")?;
        let rest = body.split("\"etcdserver\":\"").nth(1)?;
        Some(rest.split('"').next()?.to_owned())
    }

    /// `etcd://127.0.0.1:<p1>,127.0.0.1:<p2>,…` over every member.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect();
        format!("etcd://{}", hosts.join(","))
    }

    /// `etcd://127.0.0.1:<port>` of member `i` alone: a client that reaches only that member.
    pub fn member_url(&self, i: usize) -> String {
        format!("etcd://127.0.0.1:{}", self.members[i].client_port)
    }

    /// The client port of member `i`.
    pub fn client_port(&self, i: usize) -> u16 {
        self.members[i].client_port
    }

    /// The index of the member that is leader now, as a running, unfrozen member reports it.
    pub fn leader(&self) -> Option<usize> {
        for m in self
            .members
            .iter()
            .filter(|m| m.child.is_some() && !m.paused)
        {
            if let Some((_, leader)) = status(m.client_port).filter(|(_, l)| *l != 0) {
                return self.members.iter().position(|o| {
                    status(o.client_port).is_some_and(|(id, _)| id == leader) && o.child.is_some()
                });
            }
        }
        None
    }

    /// Waits (bounded) until a running member reports a leader, and returns its index.
    ///
    /// # Panics
    /// If none does within `limit`.
    pub fn wait_leader(&self, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(l) = self.leader() {
                return l;
            }
            assert!(Instant::now() < deadline, "no etcd leader within {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, i: usize, sig: &str) {
        if let Some(c) = &self.members[i].child {
            let ok = Command::new("kill")
                .args([sig, &c.id().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "kill {sig} on etcd member {i} failed");
        }
    }

    /// The value of the gauge or counter `name` (without labels) that member `i` reports on
    /// its `/metrics`, if it answers.
    pub fn metric(&self, i: usize, name: &str) -> Option<f64> {
        metric(self.members[i].client_port, name)
    }

    /// Freezes member `i` (SIGSTOP): its connections stay open, nothing is answered.
    pub fn pause(&mut self, i: usize) {
        self.signal(i, "-STOP");
        self.members[i].paused = true;
    }

    /// Thaws member `i` (SIGCONT).
    pub fn resume(&mut self, i: usize) {
        self.signal(i, "-CONT");
        self.members[i].paused = false;
    }

    /// Kills member `i` (SIGKILL); its data folder stays for [`restart`](Self::restart).
    pub fn kill(&mut self, i: usize) {
        kill_child(&mut self.members[i]);
    }

    /// Starts a killed member `i` again on the same ports and data, and waits until it is
    /// back in the cluster.
    ///
    /// # Panics
    /// If it is not back within 20 seconds.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
        assert!(
            self.wait_ready(Duration::from_secs(20)),
            "etcd member {i} did not come back"
        );
    }
}

fn kill_child(m: &mut Member) {
    if let Some(mut c) = m.child.take() {
        if m.paused {
            let _ = Command::new("kill")
                .args(["-CONT", &c.id().to_string()])
                .status();
            m.paused = false;
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            kill_child(m);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        if let Some(d) = &self.tls_dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

impl EtcdCluster {
    /// Turns on etcd's authentication with a `root` user whose password is `password`
    /// (through the member's JSON gateway). Clients must log in from then on.
    ///
    /// # Panics
    /// If a step fails.
    pub fn enable_auth(&self, password: &str) {
        let port = self.members[0].client_port;
        let steps = [
            (
                "/v3/auth/user/add",
                format!(r#"{{"name":"root","password":"{password}"}}"#),
            ),
            (
                "/v3/auth/user/grant",
                r#"{"user":"root","role":"root"}"#.to_owned(),
            ),
            ("/v3/auth/enable", "{}".to_owned()),
        ];
        for (path, body) in steps {
            assert!(post_body(port, path, &body).is_some(), "etcd {path} failed");
        }
    }
}

impl EtcdCluster {
    /// Adds the user `name` (password `password`) with read and write permission only on the
    /// keys under `other/` — none of a locker's. Before [`enable_auth`](Self::enable_auth).
    ///
    /// # Panics
    /// If a step fails.
    pub fn add_confined_user(&self, name: &str, password: &str) {
        let port = self.members[0].client_port;
        // The gateway takes bytes as base64: `other/` and its range end `other0`.
        let (key, end) = ("b3RoZXIv", "b3RoZXIw");
        let steps = [
            ("/v3/auth/role/add", format!(r#"{{"name":"{name}"}}"#)),
            (
                "/v3/auth/role/grant",
                format!(
                    r#"{{"name":"{name}","perm":{{"permType":"READWRITE","key":"{key}","range_end":"{end}"}}}}"#
                ),
            ),
            (
                "/v3/auth/user/add",
                format!(r#"{{"name":"{name}","password":"{password}"}}"#),
            ),
            (
                "/v3/auth/user/grant",
                format!(r#"{{"user":"{name}","role":"{name}"}}"#),
            ),
        ];
        for (path, body) in steps {
            assert!(post_body(port, path, &body).is_some(), "etcd {path} failed");
        }
    }
}

/// POSTs `{}` to a gRPC-gateway path of the member on `port`; the body, when it answers 200.
fn post(port: u16, path: &str) -> Option<String> {
    post_body(port, path, "{}")
}

/// POSTs a JSON `body` to a gRPC-gateway path of the member on `port`; the answer's body, when
/// it is 200.
fn post_body(port: u16, path: &str, body: &str) -> Option<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
}

/// GETs `path` from the member on `port` (HTTP/1.0: no chunked body); the body, when it is 200.
fn get(port: u16, path: &str) -> Option<String> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(2000))).ok()?;
    let req = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    s.write_all(req.as_bytes()).ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    let status = head.lines().next()?;
    status
        .split_whitespace()
        .nth(1)
        .is_some_and(|c| c == "200")
        .then(|| body.to_owned())
}

/// The value of the metric `name` (without labels) on the member on `port`'s `/metrics`.
fn metric(port: u16, name: &str) -> Option<f64> {
    let metrics = get(port, "/metrics")?;
    let line = metrics
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))?;
    line.split_whitespace().nth(1)?.parse::<f64>().ok()
}

/// The first `"<field>":"<number>"` in a gateway JSON body (uint64s are JSON strings).
fn number_field(body: &str, field: &str) -> Option<u64> {
    let rest = body.split(&format!("\"{field}\":\"")).nth(1)?;
    rest.split('"').next()?.parse().ok()
}

/// (member id, leader id) as the member on `port` reports them.
fn status(port: u16) -> Option<(u64, u64)> {
    let body = post(port, "/v3/maintenance/status")?;
    Some((
        number_field(&body, "member_id")?,
        number_field(&body, "leader").unwrap_or(0),
    ))
}

/// The single-member etcd of this test binary, started on first use and kept for the binary's
/// life (the kernel kills it when the process ends).
pub fn shared() -> Arc<Mutex<EtcdCluster>> {
    static SHARED: OnceLock<Arc<Mutex<EtcdCluster>>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            Arc::new(Mutex::new(on_owner_thread(
                "etcd-owner",
                EtcdCluster::start,
            )))
        })
        .clone()
}

/// A consensus deployment of a few members — an etcd cluster ([`EtcdCluster`]) or a ZooKeeper
/// ensemble ([`ZkEnsemble`](crate::zookeeper_server::ZkEnsemble)) —, as the fault harness
/// drives it: kill the leader, freeze a minority, bring everything back.
///
/// Members started by these harnesses die with the thread that started them (`setpriv
/// --pdeathsig`): call [`heal`](Quorum::heal), which starts killed members again, from a
/// thread that outlives the deployment.
pub trait Quorum: Send {
    /// The locker URL over every member (`etcd://…`, `zk://…`).
    fn url(&self) -> String;
    /// How many members it has.
    fn members(&self) -> usize;
    /// The leader's index now, as a running, unfrozen member reports it.
    fn leader(&self) -> Option<usize>;
    /// Kills member `i` (SIGKILL); its data stays for [`heal`](Quorum::heal) to start it again.
    fn kill(&mut self, i: usize);
    /// Freezes member `i` (SIGSTOP).
    fn pause(&mut self, i: usize);
    /// Thaws member `i` (SIGCONT).
    fn resume(&mut self, i: usize);
    /// How many expired leases member `i` has had revoked, by its own count — etcd's
    /// `etcd_debugging_server_lease_expired_total`, counted by the member that asked for the
    /// revoke (the leader, or an old leader that does not know it is one no more) —, or `None`
    /// when it does not answer or the store has no such count (ZooKeeper).
    fn leases_revoked(&self, i: usize) -> Option<u64> {
        let _ = i;
        None
    }
    /// Thaws every frozen member, starts every killed one on its ports and data, and waits
    /// (bounded) until every member serves in the one cluster again.
    ///
    /// # Panics
    /// If they do not within 60 seconds.
    fn heal(&mut self);
}

impl Quorum for EtcdCluster {
    fn url(&self) -> String {
        EtcdCluster::url(self)
    }

    fn members(&self) -> usize {
        self.len()
    }

    fn leader(&self) -> Option<usize> {
        EtcdCluster::leader(self)
    }

    fn kill(&mut self, i: usize) {
        EtcdCluster::kill(self, i);
    }

    fn pause(&mut self, i: usize) {
        EtcdCluster::pause(self, i);
    }

    fn resume(&mut self, i: usize) {
        EtcdCluster::resume(self, i);
    }

    fn leases_revoked(&self, i: usize) -> Option<u64> {
        metric(
            self.members[i].client_port,
            "etcd_debugging_server_lease_expired_total",
        )
        .map(|n| n as u64)
    }

    fn heal(&mut self) {
        for i in 0..self.members.len() {
            if self.members[i].paused {
                self.resume(i);
            }
            if self.members[i].child.is_none() {
                self.spawn(i);
            }
        }
        assert!(
            self.wait_ready(Duration::from_secs(60)),
            "etcd members not back in one cluster within 60 s"
        );
    }
}
