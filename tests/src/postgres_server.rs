//! Real PostgreSQL servers (and PgBouncers in front of them) for tests.
//!
//! [`PostgresServer::start`] makes a throwaway cluster with `initdb` in a private temporary
//! folder (trust authentication, `fsync` off), runs `postgres` on a free loopback port with its
//! unix socket in that folder, and returns once it answers *as itself* (its data directory is
//! ours). Dropping the value kills it and removes the folder. It never touches the machine's
//! own server on 5432.
//!
//! `initdb` and `postgres` refuse to run as root: when the tests run as root, the folder is
//! given to the `postgres` OS user and both run as that user (`setpriv`). The binaries come
//! from the newest `/usr/lib/postgresql/<version>/bin` (or `$DLOCK_PG_BIN`); the project's test
//! command (`./scripts/test`) installs Debian's `postgresql` and `pgbouncer` when missing. A
//! missing binary panics with that advice: a Postgres test never skips.
//!
//! A server takes a second or two to make: a test binary shares one ([`shared`]), started on a
//! thread that lives as long as the process and killed by the kernel with it, and gives each
//! test its own keys, schema or database.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::redis_server::free_port;

static SEQ: AtomicU64 = AtomicU64::new(0);

/// The folder of the PostgreSQL binaries: `$DLOCK_PG_BIN`, or the newest
/// `/usr/lib/postgresql/<version>/bin`.
///
/// # Panics
/// If there is none.
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("DLOCK_PG_BIN") {
        return PathBuf::from(dir);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    match versions.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "no PostgreSQL server binaries in /usr/lib/postgresql/<version>/bin. Install them \
             (`apt-get install postgresql`) or run the project's test command, `./scripts/test`, \
             which installs them; or point $DLOCK_PG_BIN at them."
        ),
    }
}

fn is_root() -> bool {
    // `id -u` rather than libc: this crate has no unsafe code.
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A command that runs `program` as the `postgres` OS user when we are root (and with
/// `die_with_parent`, killed when the thread that started it ends).
fn command_as_db_user(program: &Path, die_with_parent: bool) -> Command {
    let root = is_root();
    if !root && !die_with_parent {
        return Command::new(program);
    }
    let mut c = Command::new("setpriv");
    if root {
        c.args([
            "--reuid",
            "postgres",
            "--regid",
            "postgres",
            "--init-groups",
        ]);
    }
    if die_with_parent {
        c.args(["--pdeathsig", "KILL"]);
    }
    c.arg("--").arg(program);
    c
}

/// Removes the folders of earlier test binaries that died without cleaning up (a shared
/// server is killed with its binary, never dropped): `dlock-<what>-<pid>-<n>` of a pid gone.
fn remove_stale(what: &str) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    let head = format!("dlock-{what}-");
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(&head)
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A private folder owned by the user the servers run as.
fn temp_dir(what: &str) -> PathBuf {
    remove_stale(what);
    let dir = std::env::temp_dir().join(format!(
        "dlock-{what}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    if is_root() {
        let ok = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "chown {} to the postgres user failed", dir.display());
    }
    dir
}

/// A `postgres` server on `127.0.0.1:<port>`, superuser `postgres`, trust authentication.
#[derive(Debug)]
pub struct PostgresServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    die_with_parent: bool,
    /// Serving TLS with a certificate for `127.0.0.1` and `localhost` ([`start_tls`](Self::start_tls)).
    tls: bool,
    /// Extra `name=value` settings, passed as `-c` at every start ([`start_with`](Self::start_with)).
    settings: Vec<String>,
}

impl PostgresServer {
    /// Makes a cluster and starts it on a free port.
    ///
    /// # Panics
    /// If the binaries are missing, `initdb` fails, or the server does not come up in 30 s.
    pub fn start() -> Self {
        Self::start_inner(false, false, &[])
    }

    /// Like [`start`](Self::start), with extra server settings (`"synchronous_commit=off"`),
    /// kept for every [`restart`](Self::restart).
    ///
    /// # Panics
    /// As [`start`](Self::start).
    pub fn start_with(settings: &[&str]) -> Self {
        Self::start_inner(false, false, settings)
    }

    /// Like [`start`](Self::start), serving TLS too (`ssl = on`) with a server certificate for
    /// `127.0.0.1` and `localhost` issued by a throwaway CA; returns that CA's certificate (PEM).
    ///
    /// # Panics
    /// As [`start`](Self::start), or if `openssl` cannot make the certificates.
    pub fn start_tls() -> (Self, Vec<u8>) {
        let server = Self::start_inner(false, true, &[]);
        let ca = std::fs::read(server.dir.join("ca.crt")).expect("read ca.crt");
        (server, ca)
    }

    /// A CA and a server certificate signed by it, in `dir` (the key readable by the server).
    fn make_certificates(dir: &Path) {
        make_certificates(dir);
        if is_root() {
            let _ = Command::new("chown")
                .args(["postgres:postgres", "server.key", "server.crt"])
                .current_dir(dir)
                .status();
        }
        let _ = Command::new("chmod")
            .args(["600", "server.key"])
            .current_dir(dir)
            .status();
    }

    fn start_inner(die_with_parent: bool, tls: bool, settings: &[&str]) -> Self {
        let dir = temp_dir("pg");
        let data = dir.join("data");
        let out = command_as_db_user(&bin_dir().join("initdb"), false)
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ])
            .output()
            .unwrap_or_else(|e| panic!("cannot run initdb ({e})"));
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if tls {
            Self::make_certificates(&dir);
        }
        let settings = settings.iter().map(|s| (*s).to_owned()).collect();
        Self::spawn_on_a_free_port(dir, die_with_parent, tls, settings)
    }

    /// Starts the cluster in `dir` on a free port (ten tries: another process may take it).
    fn spawn_on_a_free_port(
        dir: PathBuf,
        die_with_parent: bool,
        tls: bool,
        settings: Vec<String>,
    ) -> Self {
        for _ in 0..10 {
            let mut server = PostgresServer {
                child: None,
                port: free_port(),
                dir: dir.clone(),
                die_with_parent,
                tls,
                settings: settings.clone(),
            };
            if server.spawn(Duration::from_secs(30)) {
                return server;
            }
        }
        panic!(
            "could not start postgres in {} on a free port after 10 tries",
            dir.display()
        );
    }

    /// A hot standby of this server, replicating asynchronously: a base backup streamed from it
    /// (`pg_basebackup -R`), started on a free port in a folder of its own.
    ///
    /// # Panics
    /// If the base backup fails or the standby does not come up in 30 s.
    pub fn start_standby(&self) -> Self {
        let dir = temp_dir("pg");
        let out = command_as_db_user(&bin_dir().join("pg_basebackup"), false)
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .arg("-D")
            .arg(dir.join("data"))
            .args(["-R", "-X", "stream", "--checkpoint=fast", "--no-sync"])
            .output()
            .unwrap_or_else(|e| panic!("cannot run pg_basebackup ({e})"));
        assert!(
            out.status.success(),
            "pg_basebackup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self::spawn_on_a_free_port(dir, false, false, Vec::new())
    }

    /// Waits until `standby` has replayed everything this server had written when called.
    ///
    /// # Panics
    /// If that takes more than 30 s.
    pub fn until_replayed(&self, standby: &PostgresServer) {
        let lsn = self.psql("SELECT pg_current_wal_lsn()");
        let caught_up = format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn");
        let deadline = Instant::now() + Duration::from_secs(30);
        while standby.psql(&caught_up) != "t" {
            assert!(
                Instant::now() < deadline,
                "the standby never replayed {lsn}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Promotes this standby to a primary and waits until it is one (`pg_promote`).
    ///
    /// # Panics
    /// If the promotion does not complete within 30 s.
    pub fn promote(&self) {
        assert_eq!(self.psql("SELECT pg_promote(true, 30)"), "t", "promotion");
    }

    fn spawn(&mut self, limit: Duration) -> bool {
        let mut extra_args = Vec::new();
        if self.tls {
            extra_args.push("-c".to_owned());
            extra_args.push("ssl=on".to_owned());
            for (k, f) in [
                ("ssl_cert_file", "server.crt"),
                ("ssl_key_file", "server.key"),
            ] {
                extra_args.push("-c".to_owned());
                extra_args.push(format!("{k}={}", self.dir.join(f).display()));
            }
        }
        for setting in &self.settings {
            extra_args.push("-c".to_owned());
            extra_args.push(setting.clone());
        }
        let child = command_as_db_user(&bin_dir().join("postgres"), self.die_with_parent)
            .args(&extra_args)
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string()])
            .arg("-k")
            .arg(&self.dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "max_connections=400",
                "-c",
                "shared_buffers=32MB",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.dir.join("server.log"))
                    .expect("server log"),
            ))
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) => panic!("cannot run postgres ({e})"),
        };
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return false; // exited: port taken, or the old shared memory still in use
            }
            // The port may have been taken by another server: only ours counts.
            if self.answers_as_ours() {
                self.child = Some(child);
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    fn answers_as_ours(&self) -> bool {
        matches!(self.psql_try("SHOW data_directory"), Some(d) if Path::new(d.trim()) == self.dir.join("data"))
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:<port>/<db>`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// The folder of the server's Unix socket (`.s.PGSQL.<port>`, the server's `-k`).
    pub fn socket_dir(&self) -> &Path {
        &self.dir
    }

    /// `postgres://postgres@<percent-encoded socket folder>:<port>/<db>`: the same server over
    /// its Unix socket (a host that starts with `/` is a socket folder, as for libpq).
    pub fn socket_url(&self, db: &str) -> String {
        let dir = self.dir.to_str().expect("a UTF-8 temp path");
        let host: String = dir
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                    char::from(b).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        format!("postgres://postgres@{host}:{}/{db}", self.port)
    }

    /// Runs SQL with `psql` on database `postgres` and returns its unaligned output, or `None`
    /// if it failed.
    pub fn psql_try(&self, sql: &str) -> Option<String> {
        self.psql_in_try("postgres", sql)
    }

    /// The client tool `program` (`psql`, `pg_dump`) of the server's release, signed in to
    /// database `db` over TCP as `postgres`.
    fn client(&self, program: &str, db: &str) -> Command {
        let mut c = Command::new(bin_dir().join(program));
        c.args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-d", db]);
        c
    }

    fn psql_in_try(&self, db: &str, sql: &str) -> Option<String> {
        let out = self
            .client("psql", db)
            .args(["-X", "-q", "-A", "-t", "-v"])
            .arg("ON_ERROR_STOP=1")
            .arg("-c")
            .arg(sql)
            .env("PGCONNECT_TIMEOUT", "2")
            .stdin(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Runs SQL with `psql` in database `db`; its unaligned output.
    ///
    /// # Panics
    /// If it fails.
    pub fn psql_in(&self, db: &str, sql: &str) -> String {
        self.psql_in_try(db, sql)
            .unwrap_or_else(|| panic!("psql failed in {db}: {sql}"))
    }

    /// Runs SQL with `psql` on database `postgres`.
    ///
    /// # Panics
    /// If it fails.
    pub fn psql(&self, sql: &str) -> String {
        self.psql_in("postgres", sql)
    }

    /// Copies schema `schema` of database `db` here into database `into` of `to` with
    /// `pg_dump` and `psql` — a dump restored on another cluster.
    ///
    /// # Panics
    /// If the dump or the restore fails.
    pub fn copy_schema(&self, db: &str, schema: &str, to: &PostgresServer, into: &str) {
        let dump = self
            .client("pg_dump", db)
            .args(["-n", schema, "--no-owner"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run pg_dump ({e})"));
        assert!(
            dump.status.success(),
            "pg_dump failed: {}",
            String::from_utf8_lossy(&dump.stderr)
        );
        let mut restore = to
            .client("psql", into)
            .args(["-X", "-q", "-v", "ON_ERROR_STOP=1"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run psql ({e})"));
        std::io::Write::write_all(&mut restore.stdin.take().expect("stdin"), &dump.stdout)
            .expect("feed the dump to psql");
        let out = restore.wait_with_output().expect("psql");
        assert!(
            out.status.success(),
            "restoring the dump failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Creates a fresh database named `<what>_<n>` and returns its name.
    pub fn create_database(&self, what: &str) -> String {
        let name = format!("{what}_{}", SEQ.fetch_add(1, Ordering::Relaxed));
        self.psql(&format!("CREATE DATABASE {name}"));
        name
    }

    /// The process id of the postmaster, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server with SIGKILL — the postmaster and every process it started, at once,
    /// as a machine crash would — and waits for the postmaster.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = c.id().to_string();
            // Frozen first, so it cannot start new children while they are being killed.
            let _ = Command::new("kill").args(["-STOP", &pid]).status();
            let children = Command::new("pgrep")
                .args(["-P", &pid])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            for child in children.split_whitespace() {
                let _ = Command::new("kill").args(["-KILL", child]).status();
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on the same port, with the same data (crash recovery after a
    /// [`kill`](Self::kill)).
    ///
    /// # Panics
    /// If it does not come back within 30 seconds.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if self.spawn(Duration::from_secs(10)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("postgres did not come back on port {}", self.port);
    }

    /// Whether the server answers now.
    pub fn is_up(&self) -> bool {
        self.psql_try("SELECT 1").is_some()
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Makes a value on a new thread that then lives as long as the process (so servers it starts
/// with `die_with_parent` die with the test binary, not with the thread of the first test).
fn on_owner_thread<T: Send + 'static>(name: &str, make: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            tx.send(make()).unwrap();
            loop {
                std::thread::park();
            }
        })
        .expect("spawn an owner thread");
    rx.recv().expect("the owner thread died making its value")
}

/// One server for the whole test binary, started on first use (on a thread that lives as long
/// as the process, so the kernel kills the server with the binary).
pub fn shared() -> Arc<Mutex<PostgresServer>> {
    static SHARED: OnceLock<Arc<Mutex<PostgresServer>>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            on_owner_thread("dlock-postgres-owner", || {
                Arc::new(Mutex::new(PostgresServer::start_inner(true, false, &[])))
            })
        })
        .clone()
}

/// A `pgbouncer` in transaction pooling mode in front of a [`PostgresServer`], on a free
/// loopback port (Debian's `pgbouncer`, run as the `postgres` user when we are root).
#[derive(Debug)]
pub struct PgBouncer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

fn pgbouncer_binary() -> PathBuf {
    std::env::var_os("DLOCK_PGBOUNCER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/sbin/pgbouncer"))
}

impl PgBouncer {
    /// Starts one in front of `server` (every database, user `postgres`), killed when the
    /// thread that started it ends if `die_with_parent`.
    ///
    /// # Panics
    /// If `pgbouncer` is missing or does not answer within 10 seconds.
    pub fn start(server_port: u16, die_with_parent: bool) -> Self {
        let dir = temp_dir("pgbouncer");
        for _ in 0..10 {
            let port = free_port();
            let ini = format!(
                "[databases]\n* = host=127.0.0.1 port={server_port} user=postgres\n\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                 unix_socket_dir = {dir}\nauth_type = trust\nauth_file = {dir}/users.txt\n\
                 pool_mode = transaction\nmax_client_conn = 2000\ndefault_pool_size = 40\n\
                 ignore_startup_parameters = extra_float_digits\nlogfile = {dir}/pgbouncer.log\n\
                 server_reset_query =\n",
                dir = dir.display()
            );
            std::fs::write(dir.join("pgbouncer.ini"), ini).expect("write pgbouncer.ini");
            std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").expect("users.txt");
            if is_root() {
                let _ = Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&dir)
                    .status();
            }
            let child = command_as_db_user(&pgbouncer_binary(), die_with_parent)
                .arg(dir.join("pgbouncer.ini"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let mut child = match child {
                Ok(c) => c,
                Err(e) => panic!(
                    "cannot run pgbouncer ({e}). Install it (`apt-get install pgbouncer`) or run \
                     the project's test command, `./scripts/test`, which installs it."
                ),
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut bouncer = PgBouncer {
                child: None,
                port,
                dir: dir.clone(),
            };
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                // Ours: its log names our port once it listens.
                let log = std::fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default();
                if log.contains(&format!("listening on 127.0.0.1:{port}")) {
                    bouncer.child = Some(child);
                    return bouncer;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_file(dir.join("pgbouncer.log"));
        }
        panic!("could not start pgbouncer on a free port after 10 tries");
    }

    /// `postgres://postgres@127.0.0.1:<port>/<db>` through the bouncer.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One PgBouncer for the whole test binary, in front of [`shared`] (started the same way).
pub fn shared_bouncer() -> Arc<PgBouncer> {
    static SHARED: OnceLock<Arc<PgBouncer>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let port = shared().lock().unwrap_or_else(|e| e.into_inner()).port();
            on_owner_thread("dlock-pgbouncer-owner", move || {
                Arc::new(PgBouncer::start(port, true))
            })
        })
        .clone()
}

/// Makes a throwaway CA (`ca.crt`, `ca.key`) and a server certificate it signed
/// (`server.crt`, `server.key`, for `127.0.0.1` and `localhost`, valid two days) in `dir`, with
/// `openssl`. Shared by the TLS tests of every server the harness starts.
///
/// # Panics
/// If `openssl` is missing or fails.
pub fn make_certificates(dir: &Path) {
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap_or_else(|e| panic!("cannot run openssl ({e})"));
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n",
    )
    .expect("san.ext");
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=dlock test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    ]);
}
