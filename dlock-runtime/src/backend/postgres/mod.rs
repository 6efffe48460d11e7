//! The Postgres backend (feature `postgres`): locks as rows of one table, judged by the
//! database's clock, over a pool of ordinary connections — and PgBouncer-safe.
//!
//! * **Every operation is one function call** (`SELECT <schema>.<prefix>acquire($1, …)`), so
//!   one statement, one implicit transaction and one round trip: the PL/pgSQL functions of
//!   [`schema`](self#schema) serialise the grants of one lock name with a transaction-level
//!   advisory lock, compare owner tokens, keep the fair waiter queue and draw fencing tokens —
//!   what the Lua scripts do on Redis. A statement timeout or a dropped connection rolls the
//!   whole call back: there is no half-taken lock.
//! * **Expiry by the database's clock**: a lease is `expires_at = clock_timestamp() + ttl`,
//!   compared with `clock_timestamp()`; the client's clock is never sent. `clock_timestamp()`
//!   is the database host's *wall* clock: a step forward of it (an NTP step, a VM resumed and
//!   resynchronised, an operator's `date -s`) ends every lease early by the step, while the
//!   holder's own lease clock, which is monotonic, still counts its lock held — another
//!   owner can then be granted it while the first still works: two holders on one server. A
//!   step back lengthens leases (a dead holder's lock frees late). Keep the database host's
//!   clock slewed, not stepped (chrony without `makestep` past boot, `ntpd -x`); the fencing
//!   token still orders the two holders' writes at a resource that checks it.
//! * **Durable grants**: every grant, handoff, lease extension and idempotency result commits
//!   with its WAL written out on the server: `synchronous_commit = off` (server, database, role
//!   or connection) is raised to `local` for its own transaction, stronger settings are left
//!   alone (see [`schema`](self#schema)): with it `off`, a crash
//!   right after the answer lost the grant and the sequence's advance, so the lock went to a
//!   second owner with the same fencing token.
//! * **Fencing tokens** are an epoch × 2^48 plus the next value of one sequence per schema
//!   and prefix (`<prefix>fence`): never reused on one database (sequences are WAL-logged and
//!   jump ahead after a crash, and a grant's commit waits for its WAL, above), across every
//!   key, expiry, restart — and failover to an asynchronous standby that missed the latest
//!   grants, since promotion starts a new WAL timeline and the epoch follows the timeline up.
//!   A copy of the data raises the epoch only when its server is on another timeline than the
//!   original was (a promoted server's dump restored on a new cluster, timeline 1: by one); a
//!   copy on the same timeline — a never-promoted server's dump restored, `pg_upgrade`, a
//!   storage snapshot, an Aurora clone — goes on from the sequence value it was made with and
//!   issues the original's tokens again: raise its epoch by hand before it serves (see
//!   [`schema`](self#schema), *Fencing across a copy*). A token is drawn only under the lock
//!   name's advisory lock, after the previous grant of that name committed, so tokens of one
//!   key are strictly increasing.
//! * **Fair waiting**: a `waiters` table keeps each lock's line (place from the same sequence,
//!   an entry expiry the waiter refreshes with each attempt); a lock is granted only when it is
//!   free and the caller is first among the live entries. A release grants the lock to the first
//!   live waiter in the same transaction (direct handoff: a new fencing token, a lease of
//!   `min(ttl, waiter ttl)` that ends no later than the waiter's entry would have, so a waiter
//!   that died blocks the lock no longer than its entry did) and wakes it with `pg_notify`. The waiter then asks once and is
//!   granted what is already its own, with the lease counted from that attempt: the
//!   notification comes on another connection than the waiter's attempts, so one that came
//!   late — after an attempt that found the handed-over lease lapsed and the lock gone to the
//!   next in line — taken as the grant itself, would have let two guards hold the lock.
//! * **Semaphores and read-write locks** ([`LockKind`]): a `holders` and a `queue` table under
//!   the same advisory lock per name, the ready-prefix rule of the
//!   [`backend`](super#semaphores-and-read-write-locks) module docs in `kind_acquire` and
//!   `kind_release`, fencing tokens from the same sequence; a release notifies exactly the
//!   waiters it lets in (no handoff). See `kinds` and [`schema`](self#schema).
//! * **Release notifications**: `LISTEN` on one dedicated connection per backend (one channel,
//!   `<schema>.<prefix>release` — or, when that is longer than the 63 bytes Postgres allows,
//!   its first 46 bytes, `~` and a digest of it; a release only notifies when someone
//!   waits), feeding the locker's [`ReleaseHub`]. The connection reconnects on its own and
//!   wakes every local waiter each time it is up (a watch made while it was down is answered
//!   at once, without waiting for it, so its waiter may have missed a release meanwhile).
//!   Without the `NOTIFY` coming round, only some waiters of the same backend hear of a
//!   release: a lock's [`release`](Backend::release) answers the waiter it handed the lock
//!   to, which is woken at once if it waits on this backend (with or without `LISTEN`); a
//!   semaphore's or read-write lock's release answers the waiters it let in, woken here only
//!   when the backend has no `LISTEN` session configured at all. Everything else reaches
//!   local waiters only through `LISTEN`: a handoff made by an abandon, an idempotency
//!   completion or abort, or [`force_release`](PostgresBackend::force_release), and the
//!   wake-up of a barging waiter when a lock is deleted; without `LISTEN` (or while it is
//!   down) those waiters, and every waiter on another backend, wake on their fallback timers.
//!   One channel per schema and prefix means every listening backend (one per service
//!   instance) receives every such notification and drops those for locks it has no waiter
//!   of: cheap for tens of instances; per-lock channels (as on Redis) would need `LISTEN`
//!   churn and are not built. Without it (PgBouncer in transaction pooling, see below, or
//!   [`PostgresOptions::notifications`] off) waiters re-check on their fallback timers and
//!   find a handed-over lock already theirs. A `LISTEN` session that cannot be made (a wrong
//!   [`notify_url`](PostgresOptions::notify_url), its server down) never fails a lock call:
//!   waiters run on their timers until it is up.
//! * **Deadlines**: every call — taking a pooled connection included — is bounded by
//!   [`PostgresOptions::command_timeout`]; an unreachable or hung database is
//!   [`LockError::Unavailable`] (503), never a hang. Connection strings may carry passwords:
//!   errors never quote them.
//! * **Connections are made a few at a time**: at most
//!   [`connects_at_once`](PostgresOptions::connects_at_once) (2) of the pool's, and a call that
//!   finds none idle while others are being made takes whichever comes first, its turn to make
//!   one or a connection going back to the pool — so after a database restart a process does
//!   not remake its whole pool at once against the restarted server (see `connecting`).
//! * **A call given up is not forgotten**: a statement whose answer the caller stopped waiting
//!   for (the command timeout, or a dropped future) still runs on the server, so its
//!   connection never goes back to the pool; it gets a cancel request and is closed once the
//!   statement has ended, and an acquire's owner token stays gated until then, so the
//!   acquire's undo lands after any late grant (see `flight`). An acquire attempt (or an
//!   idempotency `begin`) that has no connection yet when its request stops waiting for it
//!   (its deadline, an error, a dropped future) leaves the pool's queue and is never sent, and
//!   an acquire or begin whose every attempt ended unsent leaves no undo behind: after an
//!   outage, or under a burst that fills the pool's queue, the late attempts and their undos
//!   would otherwise queue ahead of the live calls, which then time out in turn.
//!
//! # Client: tokio-postgres with deadpool-postgres
//!
//! [tokio-postgres](https://docs.rs/tokio-postgres) with a [deadpool-postgres] pool, because of
//! PgBouncer: in transaction pooling mode PgBouncer 1.18 (Debian 12's) hands each transaction to
//! any server connection, so a named prepared statement made on one is missing on the next, and
//! so is an *unnamed* statement when a client splits Parse/Describe and Bind/Execute across two
//! `Sync`s — which is what sqlx does for every query, persistent or not. tokio-postgres's
//! `query_typed` sends Parse (unnamed), Bind, Execute and Sync as one batch with the parameter
//! types given by the caller, so each call is self-contained on whatever server connection
//! PgBouncer picks, and costs one round trip (no prepare step); the schema is created with the
//! simple query protocol. deadpool-postgres is the maintained pool for tokio-postgres, and the
//! type [`PostgresBackend::from_pool`] takes, so a service can share its own pool.
//! Only the `runtime` feature of tokio-postgres is used.
//!
//! # PgBouncer
//!
//! Everything works through PgBouncer in transaction pooling mode, except `LISTEN`, which needs
//! a session: give the backend a direct URL for notifications
//! ([`PostgresOptions::notify_url`], or `dlock_notify=<percent-encoded URL>` in the URL given to
//! [`Locker::from_url`](crate::Locker::from_url)), or turn notifications off
//! (`dlock_notify=off`): waiters then wake on their timers (a handoff waits at most one backoff
//! step, bounded by a third of the waiter TTL). With notifications on and no notify URL, the
//! main URL is used for `LISTEN`: do not do that through PgBouncer in transaction pooling —
//! the session then hears nothing other sessions send, which it finds out when it starts (a
//! probe sent through the pool to a channel only it listens on does not come): it logs a
//! `WARN` saying so, [`is_listening`](PostgresBackend::is_listening) stays `false`, waiters
//! run on their timers, and it is tried again every 30 s. The same goes for a `notify_url`
//! naming another database than the pool's.
//!
//! # Schema
//!
//! Created on first use, idempotently, in [`PostgresOptions::schema`] (default `dlock`) with
//! table prefix [`PostgresOptions::table_prefix`] (default `dlock_`) — or, with
//! [`PostgresOptions::create_schema`] off, applied by your migrations from
//! `dlock-runtime/sql/postgres.sql` ([`PostgresOptions::ddl`] renders it for other names). The
//! file lists the privileges the backend needs. Tables are logged: locks survive a database
//! restart (their leases keep running by the database's clock). Rows of holders that died are
//! swept in small batches by later acquires. The functions need the default isolation level,
//! `READ COMMITTED` (each statement sees what committed before it): a grant in a transaction
//! under another level — a database's, role's or connection's `default_transaction_isolation`
//! — is refused with [`LockError::Misconfigured`] (schema version 8). Under `REPEATABLE READ`
//! a semaphore or read-write lock was granted beside holders its snapshot could not see. Where
//! the database defaults to another level, set `read committed` for the role the backend
//! connects as (`ALTER ROLE … SET default_transaction_isolation = 'read committed'`) or in
//! its connection options.
//!
//! # Transaction-scoped locks
//!
//! [`lock_in_transaction`] takes `pg_advisory_xact_lock` inside the caller's own transaction, so
//! the lock and the writes it protects commit or roll back together (see [`xact`]).
//!
//! # URLs
//!
//! `postgres://user:pass@host:port/db?…` or `postgresql://…`, any parameter tokio-postgres
//! understands (`application_name`, `connect_timeout`, `options`, `sslmode`), plus
//! `dlock_schema`, `dlock_table_prefix` and `dlock_notify`.
//!
//! **TLS** follows `sslmode` (feature `postgres-tls`, rustls with ring): `disable` is plaintext;
//! `prefer` (tokio-postgres's default) and `require` use TLS, and the server's certificate is
//! always verified — against the operating system's roots plus
//! [`PostgresOptions::tls_root_certificates`] — with its name checked against the URL's host
//! (libpq's `verify-full`); `prefer` falls back to plaintext only when the server offers no TLS
//! at all. A certificate that fails verification, a failed handshake, and `require` against a
//! server without TLS are [`LockError::Misconfigured`] (500): retrying does not change them.
//! Over a Unix socket (`host=/run/postgresql`, `postgres://user@%2Frun%2Fpostgresql/db`) there
//! is no TLS, as with libpq and the server itself: `prefer` is plaintext there, and `require`
//! for a socket host is refused at once ([`LockError::Misconfigured`]). Without the feature,
//! `prefer` is plaintext and `require` is refused with an error naming the feature. The
//! `LISTEN` session uses the same rule.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{NoTls, Row};

use self::connecting::{GatedConnect, Making};
use super::{
    AcquireArgs, Attempt, Backend, BoxFuture, ExtendItem, OwnerToken, ReleaseHub, SendMark,
    SendSlot, WaitMode, Watch,
};
use crate::key::{LockKind, ResourceName};
use crate::LockError;

pub use deadpool_postgres;
pub use tokio_postgres;

mod admin;
mod connecting;
mod flight;
mod idempotency;
mod kinds;
mod listener;
mod schema;
#[cfg(feature = "postgres-tls")]
mod tls;
pub mod xact;

pub use self::xact::{lock_in_transaction, try_lock_in_transaction, xact_lock_id};

/// Settings of the Postgres backend. Defaults: schema `dlock`, table prefix `dlock_`, create
/// the schema on first use, command timeout 1 s, connect timeout 1 s, pool of 16 connections
/// made at most 2 at a time, notifications on over the main URL.
#[derive(Clone)]
#[non_exhaustive]
pub struct PostgresOptions {
    /// The schema of the backend's tables and functions: `[a-z_][a-z0-9_]*`, at most 40 bytes.
    pub schema: String,
    /// Prefix of every table, sequence and function name: `[a-z_][a-z0-9_]*` or empty, at most
    /// 16 bytes.
    pub table_prefix: String,
    /// Whether the backend runs its (idempotent) DDL when it starts and finds the schema
    /// missing or older. Off: it checks the version and fails if the schema is not there.
    pub create_schema: bool,
    /// Deadline of every call, including waiting for a pooled connection.
    pub command_timeout: Duration,
    /// Deadline of a connection's socket connect (per host the URL names) and of the schema
    /// check at start; a pooled connection is made within ten of them in all (TLS, the startup
    /// message and authentication included), so a server that takes a connection and never
    /// answers does not hold up the pool. A `connect_timeout` in the URL takes its place.
    pub connect_timeout: Duration,
    /// Connections in the pool the backend makes (not used with
    /// [`from_pool`](PostgresBackend::from_pool), whose pool's size counts instead). Also the
    /// most connections the backend uses at once, counting those it is still draining after a
    /// call timed out with its statement running.
    pub pool_size: usize,
    /// Connections of the pool being made at once, at most (not used with
    /// [`from_pool`](PostgresBackend::from_pool), whose pool makes its own). A call that finds
    /// no idle connection while that many are being made waits, within its command timeout,
    /// for whichever comes first: its turn to make one, or a connection going back to the pool
    /// (a connection it gave up on is still made, for the next call). After a database restart
    /// every process would otherwise remake its whole pool at once against the restarted
    /// server; also, against a server that does not answer, a process sends this many
    /// connection attempts at a time, not one per call.
    pub connects_at_once: usize,
    /// Whether to `LISTEN` for release notifications.
    pub notifications: bool,
    /// A direct connection string for `LISTEN` (when the main one goes through PgBouncer in
    /// transaction pooling, or for [`from_pool`](PostgresBackend::from_pool), whose pool cannot
    /// listen). `None`: the main URL ([`connect`](PostgresBackend::connect)) or no notifications
    /// (`from_pool`).
    pub notify_url: Option<String>,
    /// Root certificates (PEM) trusted besides the operating system's, for TLS (feature
    /// `postgres-tls`; a URL's `sslmode=prefer` or `require`).
    #[cfg(feature = "postgres-tls")]
    pub tls_root_certificates: Option<Vec<u8>>,
}

impl std::fmt::Debug for PostgresOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The notify URL may carry a password.
        f.debug_struct("PostgresOptions")
            .field("schema", &self.schema)
            .field("table_prefix", &self.table_prefix)
            .field("create_schema", &self.create_schema)
            .field("command_timeout", &self.command_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("pool_size", &self.pool_size)
            .field("connects_at_once", &self.connects_at_once)
            .field("notifications", &self.notifications)
            .field("notify_url", &self.notify_url.as_ref().map(|_| ".."))
            .finish()
    }
}

impl Default for PostgresOptions {
    fn default() -> Self {
        PostgresOptions {
            schema: schema::DEFAULT_SCHEMA.to_owned(),
            table_prefix: schema::DEFAULT_PREFIX.to_owned(),
            create_schema: true,
            command_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
            pool_size: 16,
            connects_at_once: 2,
            notifications: true,
            notify_url: None,
            #[cfg(feature = "postgres-tls")]
            tls_root_certificates: None,
        }
    }
}

impl PostgresOptions {
    /// Sets [`schema`](PostgresOptions::schema).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Sets [`table_prefix`](PostgresOptions::table_prefix). Empty only in a schema of
    /// dlock's own: an empty prefix in `public` is [`LockError::Misconfigured`] at connect.
    pub fn table_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.table_prefix = prefix.into();
        self
    }

    /// Sets [`create_schema`](PostgresOptions::create_schema).
    pub fn create_schema(mut self, yes: bool) -> Self {
        self.create_schema = yes;
        self
    }

    /// Sets [`command_timeout`](PostgresOptions::command_timeout).
    pub fn command_timeout(mut self, d: Duration) -> Self {
        self.command_timeout = d;
        self
    }

    /// Sets [`connect_timeout`](PostgresOptions::connect_timeout).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// Sets [`pool_size`](PostgresOptions::pool_size) (at least 1).
    pub fn pool_size(mut self, n: usize) -> Self {
        self.pool_size = n.max(1);
        self
    }

    /// Sets [`connects_at_once`](PostgresOptions::connects_at_once) (at least 1).
    pub fn connects_at_once(mut self, n: usize) -> Self {
        self.connects_at_once = n.max(1);
        self
    }

    /// Sets [`notifications`](PostgresOptions::notifications).
    pub fn notifications(mut self, on: bool) -> Self {
        self.notifications = on;
        self
    }

    /// Sets [`notify_url`](PostgresOptions::notify_url) (and turns notifications on).
    pub fn notify_url(mut self, url: impl Into<String>) -> Self {
        self.notify_url = Some(url.into());
        self.notifications = true;
        self
    }

    /// Sets [`tls_root_certificates`](PostgresOptions::tls_root_certificates) (PEM).
    #[cfg(feature = "postgres-tls")]
    pub fn tls_root_certificates(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root_certificates = Some(pem.into());
        self
    }

    /// The DDL the backend runs for these names (what `dlock-runtime/sql/postgres.sql` is for
    /// the defaults), for teams that run their own migrations.
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] if the schema or prefix is not a plain identifier.
    pub fn ddl(&self) -> Result<String, LockError> {
        self.check_names()?;
        Ok(schema::render(&self.schema, &self.table_prefix))
    }

    /// The schema and prefix are configuration (options or the URL's `dlock_schema` and
    /// `dlock_table_prefix`), not a request's key: a bad one is
    /// [`LockError::Misconfigured`] (500), not [`LockError::InvalidKey`] (400, the client's
    /// fault).
    fn check_names(&self) -> Result<(), LockError> {
        if !schema::valid_identifier(&self.schema, 40, false) {
            return Err(LockError::misconfigured(
                "postgres schema must match [a-z_][a-z0-9_]* (at most 40 bytes)",
                None,
            ));
        }
        if !schema::valid_identifier(&self.table_prefix, 16, true) {
            return Err(LockError::misconfigured(
                "postgres table prefix must match [a-z_][a-z0-9_]* or be empty (at most 16 bytes)",
                None,
            ));
        }
        // The schema's tables and functions are made `IF NOT EXISTS` and `OR REPLACE`: without
        // a prefix, in the schema every application shares, they would take over an
        // application's own `locks` or `queue` table (whose old rows the sweep then deletes)
        // and replace its `release(text, text)`.
        if self.table_prefix.is_empty() && self.schema == "public" {
            return Err(LockError::misconfigured(
                "postgres table prefix may be empty only in a schema of dlock's own, not `public`",
                None,
            ));
        }
        Ok(())
    }
}

/// A lock store in a Postgres database. Cheap to clone.
///
/// ```no_run
/// # async fn f() -> Result<(), dlock_runtime::LockError> {
/// use dlock_runtime::backend::{PostgresBackend, PostgresOptions};
/// use dlock_runtime::Locker;
///
/// let backend = PostgresBackend::connect(
///     "postgres://app@127.0.0.1:5432/app",
///     PostgresOptions::default(),
/// )
/// .await?;
/// let locker = Locker::new(backend);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("options", &self.inner.opts)
            .finish_non_exhaustive()
    }
}

struct Inner {
    pool: Pool,
    sql: schema::Statements,
    hub: Arc<ReleaseHub>,
    opts: PostgresOptions,
    /// The listener's state; dropping it ends the listener task.
    listening: Option<tokio::sync::watch::Receiver<bool>>,
    /// Owner tokens with a grant in flight (see [`PostgresBackend::gated`]).
    gates: Mutex<HashMap<OwnerToken, Arc<tokio::sync::Mutex<()>>>>,
    /// How the pool's connections are made, for cancel requests (`None`: a pool given to
    /// [`PostgresBackend::from_pool`]; cancel requests then go without TLS, best-effort).
    cancel: Option<Connector>,
    /// How many of the pool's connections are made at once (`None`: a pool given to
    /// [`PostgresBackend::from_pool`], which makes its own; see [`connecting`]).
    making: Option<Arc<Making>>,
    /// One permit per connection of the pool, taken by a call for as long as its connection
    /// is in use — and, when the call stops waiting for its statement, until the connection
    /// has been drained (see [`flight`]). Without it a pool hands out a new connection for
    /// each one detached to be drained, and a database too slow for the command timeout
    /// (every call timing out, each drain lasting up to ten command timeouts) saw up to
    /// eleven times the pool's connections per process.
    slots: Arc<tokio::sync::Semaphore>,
    /// `LISTEN` sessions that did not hear their probe (see `listener`).
    probes_unheard: std::sync::atomic::AtomicU64,
}

/// Maps a client error to [`LockError::Unavailable`], or to [`LockError::Misconfigured`] when
/// the database refused for good ([`refused_for_good`]) or TLS did ([`tls_refused`]), naming
/// the SQLSTATE when the database answered (never the connection string).
fn pg_err(what: &str, e: tokio_postgres::Error) -> LockError {
    let own = e
        .as_db_error()
        .filter(|db| db.code().code() == "54000" || db.message().starts_with("dlock: "));
    let detail = match (e.code(), own) {
        // The schema's own refusals (`next_fence`'s tokens exhausted, naming the epoch and
        // sequence; `read_committed`'s isolation level, naming the level and what to set): what
        // an operator needs to read.
        (Some(code), Some(db)) => {
            format!("postgres {what}: error {}: {}", code.code(), db.message())
        }
        // A key (or record) with characters the database's encoding has no place for.
        (Some(code), None) if matches!(code.code(), "22P05" | "22021") => format!(
            "postgres {what}: error {}: the database's encoding cannot store this key (create \
             it with ENCODING 'UTF8')",
            code.code()
        ),
        (Some(code), None) => format!("postgres {what}: error {}", code.code()),
        (None, _) if e.is_closed() => format!("postgres {what}: connection closed"),
        // The client's own errors (I/O, TLS, protocol) never quote the connection string.
        (None, _) => format!("postgres {what}: {e}"),
    };
    let permanent = e
        .as_db_error()
        .is_some_and(|db| refused_for_good(db.code().code(), db.routine()))
        || tls_refused(&e);
    LockError::backend(detail, Some(Box::new(e)), permanent)
}

/// Whether a SQLSTATE says the database refused in a way retrying does not change: class 28
/// (wrong credentials, no `pg_hba.conf` entry), class 42 (no privilege on the lock tables —
/// `42501` — or a table, function or column missing: a schema not installed or dropped),
/// `3D000` (no such database), `3F000` (no such schema), `0A000` (a feature the server or
/// pooler does not support; also how `read_committed` refuses a grant under another isolation
/// level than `READ COMMITTED`), class 54 (a program limit: `54000` is how `next_fence`
/// reports fencing tokens exhausted — 2^48 grants on one epoch, or 2^15 epochs: never reached
/// in practice, but never passing either, as every later grant fails the same way), and
/// `22P05`/`22021` (a key with characters the database's encoding cannot store: a `LATIN1`
/// database and a Cyrillic key — the same key fails the same way every time).
/// Everything else — connection errors (class 08), a standby's `25006` read-only answer,
/// shutdowns (57), lock or statement timeouts, serialization failures, too many connections
/// (53) — passes with a failover, a restart or load. So does one `54000`: the NOTIFY queue
/// full (raised in `PreCommit_Notify`, the server's `routine`, which unlike the message is
/// never translated), refusing every commit that notifies — a release, an abandon, a handoff
/// with waiters — while the slowest listening session of the whole server has not read on (a
/// stalled listener, or a session that ran `LISTEN` left in an open transaction); it passes
/// once that session reads on or ends. As a refusal for good it ended waits through outages
/// at once and answered 500.
pub(crate) fn refused_for_good(sqlstate: &str, routine: Option<&str>) -> bool {
    let notify_queue_full = sqlstate == "54000" && routine == Some("PreCommit_Notify");
    sqlstate.starts_with("28")
        || sqlstate.starts_with("42")
        || (sqlstate.starts_with("54") && !notify_queue_full)
        || matches!(sqlstate, "3D000" | "3F000" | "0A000" | "22P05" | "22021")
}

/// Whether a connection failed because TLS refused it (feature `postgres-tls`): the server's
/// certificate failed verification (unknown issuer, expired, another name), the handshake
/// failed, or `require` met a server that offers no TLS. Retrying meets the same certificate
/// and the same server settings: [`LockError::Misconfigured`]. A connection reset or timeout
/// during the handshake is an I/O error, not this, and stays [`LockError::Unavailable`].
#[cfg(feature = "postgres-tls")]
fn tls_refused(e: &tokio_postgres::Error) -> bool {
    use std::error::Error as _;
    let mut next = e.source();
    while let Some(err) = next {
        if err.is::<rustls::Error>() || err.is::<rustls::pki_types::InvalidDnsNameError>() {
            return true;
        }
        // tokio-rustls reports the handshake's `rustls::Error` inside an `io::Error`, whose
        // `source` skips it.
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.is::<rustls::Error>())
            {
                return true;
            }
        }
        // tokio-postgres's own words for `require` against a server without TLS.
        if err.to_string() == "server does not support TLS" {
            return true;
        }
        next = err.source();
    }
    false
}

#[cfg(not(feature = "postgres-tls"))]
fn tls_refused(_: &tokio_postgres::Error) -> bool {
    false
}

/// Splits `url` into the tokio-postgres configuration and this crate's own parameters
/// (`dlock_schema`, `dlock_table_prefix`, `dlock_notify`), applied to `opts`.
pub(crate) fn parse_url(
    url: &str,
    mut opts: PostgresOptions,
) -> Result<(tokio_postgres::Config, PostgresOptions), LockError> {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, q),
        None => (url, ""),
    };
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "dlock_schema" => opts.schema = percent_decode(v)?,
            "dlock_table_prefix" => opts.table_prefix = percent_decode(v)?,
            "dlock_notify" if v == "off" => opts.notifications = false,
            "dlock_notify" => opts = opts.notify_url(percent_decode(v)?),
            _ => rest.push(pair),
        }
    }
    let url = if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    let config = pg_config(&url)?;
    Ok((config, opts))
}

/// Parses a connection string; the error never quotes it (it may carry a password). What
/// the client would refuse only when connecting — no host, lists of hosts, `hostaddr`s and
/// ports that do not match — is refused here, as `Misconfigured`: refused by every connection
/// attempt instead, it was reported as the database being down (`Unavailable`, 503).
fn pg_config(url: &str) -> Result<tokio_postgres::Config, LockError> {
    let config: tokio_postgres::Config = url
        .parse()
        .map_err(|_| LockError::misconfigured("invalid postgres url", None))?;
    let (hosts, addrs) = (config.get_hosts().len(), config.get_hostaddrs().len());
    let invalid = |what: &str| {
        Err(LockError::misconfigured(
            format!("postgres url: {what}"),
            None,
        ))
    };
    if hosts == 0 && addrs == 0 {
        return invalid("no host (name the server, or a Unix socket directory with host=)");
    }
    if hosts != 0 && addrs != 0 && hosts != addrs {
        return invalid("as many hostaddr as hosts are needed");
    }
    let ports = config.get_ports().len();
    if ports > 1 && ports != hosts.max(addrs) {
        return invalid("one port for every host, or one for all of them");
    }
    Ok(config)
}

/// How the backend's connections are made: plaintext, or TLS over rustls (feature
/// `postgres-tls`), chosen by the connection string's `sslmode`.
#[derive(Clone)]
pub(crate) enum Connector {
    Plain,
    #[cfg(feature = "postgres-tls")]
    Tls(tls::MakeRustls),
}

impl Connector {
    /// Over a Unix socket there is no TLS (the server answers `N` to a TLS request on a socket,
    /// as libpq never asks there): `prefer` with only socket hosts is plaintext without asking,
    /// and `require` with any socket host can never be met, so it is refused here rather than
    /// by every connection attempt.
    fn for_config(
        config: &tokio_postgres::Config,
        opts: &PostgresOptions,
    ) -> Result<Self, LockError> {
        use tokio_postgres::config::SslMode;
        #[cfg(unix)]
        let is_socket =
            |h: &tokio_postgres::config::Host| matches!(h, tokio_postgres::config::Host::Unix(_));
        #[cfg(not(unix))]
        let is_socket = |_: &tokio_postgres::config::Host| false;
        // `hostaddr`, when given, is what the connection goes to (always TCP).
        let hosts = if config.get_hostaddrs().is_empty() {
            config.get_hosts()
        } else {
            &[]
        };
        let any_socket = hosts.iter().any(is_socket);
        let only_sockets = !hosts.is_empty() && hosts.iter().all(is_socket);
        let mode = config.get_ssl_mode();
        #[cfg(feature = "postgres-tls")]
        if mode != SslMode::Disable && !only_sockets {
            // Refused by every connection the client makes (to a server that offers TLS).
            if config.get_hosts().is_empty() {
                return Err(LockError::misconfigured(
                    "postgres url: TLS needs the server's name to verify its certificate, and \
                     only hostaddr is given: add host= (the name), or use sslmode=disable",
                    None,
                ));
            }
            if mode == SslMode::Prefer
                && config.get_ssl_negotiation() == tokio_postgres::config::SslNegotiation::Direct
            {
                return Err(LockError::misconfigured(
                    "postgres url: sslnegotiation=direct needs sslmode=require (or stronger)",
                    None,
                ));
            }
        }
        match mode {
            SslMode::Disable => Ok(Connector::Plain),
            SslMode::Require if any_socket => Err(LockError::misconfigured(
                "postgres url: sslmode=require cannot be met over a Unix socket (a server never \
                 offers TLS on one): use sslmode=disable or prefer for a socket host, or a TCP \
                 host for TLS",
                None,
            )),
            SslMode::Prefer if only_sockets => Ok(Connector::Plain),
            #[cfg(feature = "postgres-tls")]
            _ => Ok(Connector::Tls(tls::MakeRustls::new(
                opts.tls_root_certificates.as_deref(),
            )?)),
            #[cfg(not(feature = "postgres-tls"))]
            SslMode::Prefer => {
                let _ = opts;
                Ok(Connector::Plain)
            }
            #[cfg(not(feature = "postgres-tls"))]
            _ => Err(LockError::misconfigured(
                "postgres url: this sslmode needs TLS, which needs the cargo feature `postgres-tls`",
                None,
            )),
        }
    }

    /// The pool's manager: connections made as `self` says, as `making` lets them.
    fn manager(&self, config: tokio_postgres::Config, making: Arc<Making>) -> Manager {
        let mc = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        match self {
            Connector::Plain => {
                Manager::from_connect(config, GatedConnect { tls: NoTls, making }, mc)
            }
            #[cfg(feature = "postgres-tls")]
            Connector::Tls(t) => {
                let tls = t.clone();
                Manager::from_connect(config, GatedConnect { tls, making }, mc)
            }
        }
    }
}

fn percent_decode(s: &str) -> Result<String, LockError> {
    crate::util::percent_decode(s).ok_or_else(|| {
        LockError::misconfigured("invalid percent-encoding in a postgres url parameter", None)
    })
}

impl PostgresBackend {
    /// Connects to `url` (`postgres://…` or `postgresql://…`, see the [module docs](self#urls)),
    /// with a pool of [`pool_size`](PostgresOptions::pool_size) connections, creates the schema
    /// if needed and starts listening for release notifications. Fails with
    /// [`LockError::Unavailable`] if the database does not answer within the connect and
    /// command timeouts.
    pub async fn connect(url: &str, opts: PostgresOptions) -> Result<Self, LockError> {
        let (mut config, opts) = parse_url(url, opts)?;
        opts.check_names()?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(opts.connect_timeout);
        }
        if config.get_application_name().is_none() {
            config.application_name("dlock");
        }
        let connector = Connector::for_config(&config, &opts)?;
        let notify = match (&opts.notify_url, opts.notifications) {
            (_, false) => None,
            (Some(u), true) => Some(Self::notify_config(u, &opts)?),
            (None, true) => Some((config.clone(), connector.clone())),
        };
        let making = Making::new(opts.connects_at_once);
        let manager = connector.manager(config, making.clone());
        let pool = Pool::builder(manager)
            .max_size(opts.pool_size)
            // For `Making::get`'s zero create timeout (no timeout is set by default).
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| LockError::misconfigured(format!("postgres pool: {e}"), None))?;
        Self::start(pool, notify, Some(connector), Some(making), opts).await
    }

    /// A backend over a pool the service already has (its connections are shared, not
    /// reserved). A pool's connections cannot `LISTEN`, so release notifications need
    /// [`notify_url`](PostgresOptions::notify_url); without it waiters use their timers.
    /// Creates the schema if needed ([`create_schema`](PostgresOptions::create_schema)).
    pub async fn from_pool(pool: Pool, opts: PostgresOptions) -> Result<Self, LockError> {
        opts.check_names()?;
        let notify = match (&opts.notify_url, opts.notifications) {
            (Some(u), true) => Some(Self::notify_config(u, &opts)?),
            _ => None,
        };
        Self::start(pool, notify, None, None, opts).await
    }

    fn notify_config(
        url: &str,
        opts: &PostgresOptions,
    ) -> Result<(tokio_postgres::Config, Connector), LockError> {
        let mut config = pg_config(url)?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(opts.connect_timeout);
        }
        if config.get_application_name().is_none() {
            config.application_name("dlock-listen");
        }
        let connector = Connector::for_config(&config, opts)?;
        Ok((config, connector))
    }

    async fn start(
        pool: Pool,
        notify: Option<(tokio_postgres::Config, Connector)>,
        cancel: Option<Connector>,
        making: Option<Arc<Making>>,
        opts: PostgresOptions,
    ) -> Result<Self, LockError> {
        let sql = schema::Statements::new(&opts.schema, &opts.table_prefix);
        let hub = ReleaseHub::new();
        let slots = Arc::new(tokio::sync::Semaphore::new(pool.status().max_size.max(1)));
        // Cyclic: the listener sends its probe through the backend's pool (and holds it only
        // while it does).
        let inner = Arc::new_cyclic(|me| {
            let listening = notify.map(|(config, connector)| {
                listener::spawn(
                    config,
                    connector,
                    schema::channel(&opts.schema, &opts.table_prefix),
                    Arc::downgrade(&hub),
                    me.clone(),
                    opts.connect_timeout.saturating_add(opts.command_timeout),
                )
            });
            Inner {
                slots,
                pool,
                sql,
                hub,
                opts,
                listening,
                gates: Mutex::new(HashMap::new()),
                cancel,
                making,
                probes_unheard: Default::default(),
            }
        });
        let backend = PostgresBackend { inner };
        // Saturating: either may be `Duration::MAX` ("no deadline"), and `+` would panic.
        let opts = &backend.inner.opts;
        let limit = opts.connect_timeout.saturating_add(opts.command_timeout);
        match tokio::time::timeout(limit, backend.ensure_schema()).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(LockError::unavailable(
                    format!("postgres did not answer within {limit:?}"),
                    None,
                ))
            }
        }
        Ok(backend)
    }

    /// Checks the schema's version; runs the DDL if it is missing or older (and allowed to).
    async fn ensure_schema(&self) -> Result<(), LockError> {
        let client = self.pooled("connect").await?;
        // The caller's deadline may drop this: never hand the pool a busy connection.
        let mut flight = self.in_flight(client, None);
        let out = self.check_or_create_schema(flight.client()).await;
        // A DDL batch that failed part-way (a lock timeout, a missing privilege) leaves its
        // session in an aborted transaction: never handed back to the pool — with
        // `from_pool`, the service's own — where every later statement on it would fail.
        match out {
            Ok(()) => flight.done(),
            Err(_) => flight.discard(),
        }
        out
    }

    async fn check_or_create_schema(
        &self,
        client: &tokio_postgres::Client,
    ) -> Result<(), LockError> {
        // Missing is only what says so: no such function (42883) or schema (3F000). Any other
        // error — a shutdown (57P01), a cancel (57014), a lost connection (08…) — is the
        // error it is (usually `Unavailable`), not "no schema", which with `create_schema`
        // off is a permanent `Misconfigured`.
        let found = match client.query_typed(&self.inner.sql.version, &[]).await {
            Ok(rows) => rows.first().and_then(|r| r.try_get::<_, i32>(0).ok()),
            Err(e)
                if e.code()
                    .is_some_and(|c| matches!(c.code(), "42883" | "3F000")) =>
            {
                None
            }
            Err(e) => return Err(pg_err("schema check", e)),
        };
        let (s, p) = (&self.inner.opts.schema, &self.inner.opts.table_prefix);
        // With names too long for a plain channel, functions made by a release before the
        // digest notify on a name `pg_notify` refuses: replaced whenever allowed.
        let stale = schema::channel_is_digest(s, p) && self.inner.opts.create_schema;
        // A newer schema is never replaced by this client's older functions.
        if found.is_some_and(|v| v > schema::VERSION || (v == schema::VERSION && !stale)) {
            return self.check_fence_cache(client).await;
        }
        if !self.inner.opts.create_schema {
            return Err(LockError::misconfigured(
                format!(
                    "postgres schema `{}` (prefix `{}`) is missing or older than version {}, and \
                     create_schema is off: apply dlock-runtime/sql/postgres.sql",
                    self.inner.opts.schema,
                    self.inner.opts.table_prefix,
                    schema::VERSION
                ),
                None,
            ));
        }
        let ddl = schema::render(&self.inner.opts.schema, &self.inner.opts.table_prefix);
        client
            .batch_execute(&ddl)
            .await
            .map_err(|e| pg_err("create schema", e))?;
        self.check_fence_cache(client).await
    }

    /// The fencing sequence must hand out its numbers one at a time (`CACHE 1`, as the schema
    /// makes it): with a cache, each session draws from a block of its own, and a key's next
    /// token, drawn on another pooled connection, can be lower than its last. Changed by hand
    /// or by a migration tool, it is [`LockError::Misconfigured`].
    async fn check_fence_cache(&self, client: &tokio_postgres::Client) -> Result<(), LockError> {
        let (s, p) = (&self.inner.opts.schema, &self.inner.opts.table_prefix);
        let sequence = format!("{p}fence");
        let rows = client
            .query_typed(
                "SELECT cache_size FROM pg_catalog.pg_sequences \
                 WHERE schemaname = $1 AND sequencename = $2",
                &[(s, Type::TEXT), (&sequence, Type::TEXT)],
            )
            .await;
        let rows = match rows {
            Ok(rows) => rows,
            // No `pg_sequences` (before PostgreSQL 10) or no right to read it: not checked.
            Err(e)
                if e.code()
                    .is_some_and(|c| matches!(c.code(), "42P01" | "42501")) =>
            {
                return Ok(())
            }
            Err(e) => return Err(pg_err("schema check", e)),
        };
        match rows.first().and_then(|r| r.try_get::<_, i64>(0).ok()) {
            Some(cache) if cache > 1 => Err(LockError::misconfigured(
                format!(
                    "postgres sequence `{s}.{sequence}` caches {cache} numbers per session: \
                     fencing tokens would not increase per key (run `ALTER SEQUENCE \
                     {s}.{sequence} CACHE 1`)"
                ),
                None,
            )),
            _ => Ok(()),
        }
    }

    /// The options in force.
    pub fn options(&self) -> &PostgresOptions {
        &self.inner.opts
    }

    /// The pool the backend uses.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// Whether the `LISTEN` connection is up now and hears what other sessions send (always
    /// `false` without notifications). A session that hears nothing of a probe sent to it
    /// through the pool — made through PgBouncer in transaction pooling, or on another database
    /// than the pool's — is not up: it logs a `WARN` and is made again every 30 s.
    pub fn is_listening(&self) -> bool {
        self.inner.listening.as_ref().is_some_and(|l| *l.borrow())
    }

    /// How many `LISTEN` sessions did not hear the probe sent to them (see
    /// [`is_listening`](Self::is_listening)); for tests.
    #[doc(hidden)]
    pub fn listen_probes_unheard(&self) -> u64 {
        (self.inner.probes_unheard).load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Frees the lock named `resource` (a [`ResourceName`] string such as `dlock:{order:1}`)
    /// whoever holds it — or, for a semaphore or read-write lock (`dlock:{k}:sem`,
    /// `dlock:{k}:rw`), drops every holder: an operator's tool for a stuck lock, and how tests
    /// take a lock away behind its holder's back. The holders learn at their next renewal;
    /// waiters re-check on their timers. Returns whether a row was deleted.
    pub async fn force_release(&self, resource: &str) -> Result<bool, LockError> {
        let rows = self
            .call(
                "force release",
                &self.inner.sql.delete,
                &[(&resource, Type::TEXT)],
            )
            .await?;
        Ok(!rows.is_empty())
    }

    /// Runs one statement on a pooled connection, both bounded by the command timeout.
    pub(crate) async fn call(
        &self,
        what: &str,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, LockError> {
        self.call_gated(what, sql, params, None, None).await
    }

    /// [`call`](Self::call) with `gate` closed until the statement has ended — also when the
    /// caller stops waiting first: then the connection leaves the pool and a drain task keeps
    /// the gate closed until the statement is over (see [`flight`]). With `sent`, the
    /// statement is an attempt whose request may give up on it: given up on before a pooled
    /// connection was free, it stops waiting for one and is never sent (see [`SendMark`]).
    async fn call_gated(
        &self,
        what: &str,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
        gate: Option<flight::Gate>,
        sent: Option<&SendMark>,
    ) -> Result<Vec<Row>, LockError> {
        let limit = self.inner.opts.command_timeout;
        let run = async {
            let given_up = || {
                LockError::unavailable(
                    format!("postgres {what}: given up on before it was sent"),
                    None,
                )
            };
            let client = match sent {
                None => self.pooled(what).await?,
                Some(mark) => tokio::select! {
                    biased;
                    () = mark.sealed() => return Err(given_up()),
                    client = self.pooled(what) => client?,
                },
            };
            if sent.is_some_and(|mark| !mark.send()) {
                return Err(given_up());
            }
            // From here, stopping early (the timeout below, or the caller dropping this)
            // drops `flight` with the statement unanswered.
            let mut flight = self.in_flight(client, gate);
            let out = flight
                .client()
                .query_typed(sql, params)
                .await
                .map_err(|e| pg_err(what, e));
            flight.done();
            out
        };
        match tokio::time::timeout(limit, run).await {
            Ok(r) => r,
            Err(_) => Err(LockError::unavailable(
                format!("postgres {what} timed out after {limit:?}"),
                None,
            )),
        }
    }

    /// One call whose answer is a single integer (`bigint` or `integer`).
    async fn call_int(
        &self,
        what: &str,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<i64, LockError> {
        int_of(what, &self.call(what, sql, params).await?)
    }

    pub(crate) fn sql(&self) -> &schema::Statements {
        &self.inner.sql
    }

    /// A connection from the pool, with its slot ([`Inner::slots`]).
    async fn pooled(&self, what: &str) -> Result<flight::Pooled, LockError> {
        let slot = self
            .inner
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| LockError::unavailable(format!("postgres {what}: pool closed"), None))?;
        // Got in a task of its own, which holds the slot: a connection still being made when
        // its caller gives up (the command timeout, a dropped request) is made to its end and
        // goes to the pool for the next call. Made in the caller, it was dropped half-made:
        // where making one takes longer than the command timeout leaves (TLS and
        // authentication over a long link take several round trips, a statement one), every
        // call timed out making a connection once the pool's were gone — for good — and after
        // a database restart each reconnect that came too late began again, while the
        // restarted server made the connections only to see them closed.
        let pool = self.inner.pool.clone();
        let making = self.inner.making.clone();
        tokio::spawn(async move {
            let client = match &making {
                Some(m) => m.get(&pool).await?,
                None => pool.get().await?,
            };
            let slot = connecting::Slot::new(slot, making);
            Ok(flight::Pooled { client, slot })
        })
        .await
        .map_err(|e| LockError::unavailable(format!("postgres {what}: pool task: {e}"), None))?
        .map_err(|e| pool_err(what, e))
    }

    /// `client` with a statement about to be sent (see [`flight::InFlight`]).
    fn in_flight(&self, client: flight::Pooled, gate: Option<flight::Gate>) -> flight::InFlight {
        let opts = &self.inner.opts;
        flight::InFlight::new(
            client,
            gate,
            self.inner.cancel.clone(),
            flight::drain_limit(opts.command_timeout),
        )
    }

    /// Runs `call` — an operation that may grant `token` a lock, or undo one — in order with
    /// every other such operation of `token`, and to its end even if the caller stops waiting.
    ///
    /// Cancel safety needs the order: calls go out on different pooled connections, so a
    /// cancelled acquire's undo ([`Backend::abandon`]) could otherwise overtake the acquire it
    /// undoes on the server, find nothing, and let the acquire grant a lock nobody holds. Here
    /// a grant runs in its own task holding the token's gate until its statement has ended on
    /// the server — when the database answered, or, after the command timeout, once the
    /// connection it went out on has been drained (see [`flight`]) — and the undo takes the
    /// gate first.
    ///
    /// An attempt with a send mark (see [`SendMark`]) holds it: one its request gives up on
    /// before it was sent is never sent, and the request then knows there is nothing to undo;
    /// one already sent is undone as above.
    pub(crate) async fn gated(
        &self,
        token: &OwnerToken,
        spawn: bool,
        what: &'static str,
        sql: fn(&schema::Statements) -> &String,
        params: Params,
        sent: Option<&SendSlot>,
    ) -> Result<Vec<Row>, LockError> {
        let sent = sent.map(SendSlot::hold);
        let gate = flight::Gate::close(&self.inner, token).await;
        let me = self.clone();
        let fut = async move {
            let sql = sql(&me.inner.sql);
            me.call_gated(what, sql, &refs(&params), Some(gate), sent.as_deref())
                .await
        };
        if spawn {
            tokio::spawn(fut).await.unwrap_or_else(|e| {
                Err(LockError::unavailable(
                    format!("postgres call task: {e}"),
                    None,
                ))
            })
        } else {
            fut.await
        }
    }
}

/// Owned parameters of a [`PostgresBackend::gated`] call (it may outlive its caller).
pub(crate) type Params = Vec<(Box<dyn ToSql + Sync + Send>, Type)>;

/// Borrowed [`Params`], as [`PostgresBackend::call`] takes them.
pub(crate) fn refs(params: &Params) -> Vec<(&(dyn ToSql + Sync), Type)> {
    params
        .iter()
        .map(|(v, t)| (&**v as &(dyn ToSql + Sync), t.clone()))
        .collect()
}

/// A text parameter.
pub(crate) fn text(s: &str) -> (Box<dyn ToSql + Sync + Send>, Type) {
    (Box::new(s.to_owned()), Type::TEXT)
}

/// A `bigint` parameter.
pub(crate) fn int8(n: i64) -> (Box<dyn ToSql + Sync + Send>, Type) {
    (Box::new(n), Type::INT8)
}

/// The wait mode as the acquire functions take it (`p_mode`: 0 try, 1 queue, 2 barge).
pub(crate) fn mode(mode: WaitMode) -> (Box<dyn ToSql + Sync + Send>, Type) {
    let code: i32 = match mode {
        WaitMode::Try => 0,
        WaitMode::Queue => 1,
        WaitMode::Barge => 2,
    };
    (Box::new(code), Type::INT4)
}

/// The single integer (`bigint` or `integer`) a call answered.
pub(crate) fn int_of(what: &str, rows: &[Row]) -> Result<i64, LockError> {
    let row = rows.first().ok_or_else(|| malformed(what))?;
    row.try_get::<_, i64>(0)
        .or_else(|_| row.try_get::<_, i32>(0).map(i64::from))
        .map_err(|_| malformed(what))
}

fn malformed(what: &str) -> LockError {
    LockError::unavailable(format!("postgres {what}: malformed reply"), None)
}

fn pool_err(what: &str, e: deadpool_postgres::PoolError) -> LockError {
    match e {
        deadpool_postgres::PoolError::Backend(e) => pg_err(what, e),
        other => LockError::unavailable(format!("postgres {what}: pool: {other}"), None),
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

impl Backend for PostgresBackend {
    fn name(&self) -> &'static str {
        "postgres"
    }

    /// A lease is a whole number of milliseconds from `clock_timestamp()` (microseconds), read
    /// after the request arrived: the part of `ttl` below a millisecond.
    fn lease_margin(&self, ttl: Duration) -> Duration {
        crate::util::whole_ms_margin(ttl, 0)
    }

    fn idempotency(&self) -> Option<&dyn super::IdempotencyStore> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn super::AdminStore> {
        Some(self)
    }

    fn acquire<'a>(&'a self, args: AcquireArgs<'a>) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(async move {
            let params: Params = vec![
                text(args.resource.as_str()),
                text(args.token.as_str()),
                int8(millis(args.ttl)),
                mode(args.mode),
                int8(millis(args.waiter_ttl)),
            ];
            let rows = self
                .gated(
                    args.token,
                    true,
                    "acquire",
                    |s| &s.acquire,
                    params,
                    args.sent,
                )
                .await?;
            Ok(Attempt::from_reply(int_of("acquire", &rows)?))
        })
    }

    fn acquire_kind<'a>(
        &'a self,
        args: AcquireArgs<'a>,
    ) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(self.acquire_kind_once(args))
    }

    fn release<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            if resource.kind() != LockKind::Exclusive {
                return self.release_kind(resource, token, false).await;
            }
            let rows = self
                .call(
                    "release",
                    &self.inner.sql.release,
                    &[
                        (&resource.as_str(), Type::TEXT),
                        (&token.as_str(), Type::TEXT),
                    ],
                )
                .await?;
            let row = rows.first().ok_or_else(|| malformed("release"))?;
            let answer: Option<String> = row.try_get(0).map_err(|_| malformed("release"))?;
            let Some(answer) = answer else {
                return Ok(false);
            };
            // Handed to a waiter: if it waits in this process, it is woken now rather than
            // through the LISTEN session (which still tells the others). Woken, not handed the
            // grant: this task may be polled late, and the waiter's attempts are answered on
            // other connections (see `listener::deliver`).
            if let Some((next, _fence)) = answer.split_once('\t') {
                self.inner.hub.notify(resource.as_str(), Some(next));
            }
            Ok(true)
        })
    }

    fn extend<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let item = ExtendItem {
                resource: resource.clone(),
                token: token.clone(),
                ttl,
            };
            let mut out = self.extend_batch(std::slice::from_ref(&item)).await?;
            Ok(out.pop().unwrap_or(false))
        })
    }

    fn extend_many<'a>(
        &'a self,
        items: &'a [ExtendItem],
    ) -> BoxFuture<'a, Vec<Result<bool, LockError>>> {
        Box::pin(async move {
            super::extend_in_chunks(items, EXTEND_CHUNK, |chunk| async move {
                let held = self.extend_batch(chunk).await?;
                Ok(held.into_iter().map(Ok).collect())
            })
            .await
        })
    }

    fn abandon<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<(), LockError>> {
        Box::pin(async move {
            if resource.kind() != LockKind::Exclusive {
                return self.release_kind(resource, token, true).await.map(|_| ());
            }
            let params = vec![text(resource.as_str()), text(token.as_str())];
            self.gated(token, false, "abandon", |s| &s.abandon, params, None)
                .await
                .map(|_| ())
        })
    }

    fn watch<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move {
            // Registered, the waiter hears every notification LISTEN delivers from now on, and
            // a lock release over this backend that hands the lock to it (see `release`).
            //
            // Answered at once, also while LISTEN is down or still connecting: waiting for it
            // here (as this did, for half the backend's command timeout) could outlast the
            // locker's own deadline on this call — a smaller command timeout — and fail a
            // healthy acquire with `Unavailable` while LISTEN was unreachable (a wrong
            // `notify_url`). Meanwhile the waiter runs on its timer, and the listener wakes
            // every registered waiter once LISTEN is up: a release between the waiter's next
            // attempt and then is not slept through.
            let (watch, _) = self.inner.hub.register(resource, token, None);
            Ok(watch)
        })
    }
}

/// Renewals per statement in a watchdog batch.
const EXTEND_CHUNK: usize = 1000;

impl PostgresBackend {
    /// Owner-checked extension of a batch: one statement for its locks and one for its
    /// permits and read or write holds (run together); `true` for each item extended.
    async fn extend_batch(&self, items: &[ExtendItem]) -> Result<Vec<bool>, LockError> {
        let (locks, kinds): (Vec<&ExtendItem>, Vec<_>) = items
            .iter()
            .partition(|i| i.resource.kind() == LockKind::Exclusive);
        let (locks_out, kinds_out) = tokio::join!(
            self.extend_part(&locks, false),
            self.extend_part(&kinds, true)
        );
        let (mut locks_out, mut kinds_out) = (locks_out?.into_iter(), kinds_out?.into_iter());
        Ok(items
            .iter()
            .map(|i| {
                let out = if i.resource.kind() == LockKind::Exclusive {
                    locks_out.next()
                } else {
                    kinds_out.next()
                };
                out.unwrap_or(false)
            })
            .collect())
    }

    /// Owner-checked extension of a batch of locks (`kinds` false) or of permits and read or
    /// write holds (`kinds`); nothing for an empty batch. One statement, unless a key repeats.
    ///
    /// `extend` answers the names it extended and `kind_extend` the owner tokens (a semaphore's
    /// name has several holders), so two items with the same name (or token) in one statement
    /// could not be told apart: the batch goes out in rounds, each holding every key once —
    /// one round unless the caller repeats a key.
    async fn extend_part(
        &self,
        items: &[&ExtendItem],
        kinds: bool,
    ) -> Result<Vec<bool>, LockError> {
        fn key(i: &ExtendItem, kinds: bool) -> &str {
            if kinds {
                i.token.as_str()
            } else {
                i.resource.as_str()
            }
        }
        let mut out = vec![false; items.len()];
        let mut left: Vec<usize> = (0..items.len()).collect();
        while !left.is_empty() {
            let mut seen = std::collections::HashSet::new();
            let (round, later): (Vec<usize>, Vec<usize>) = left
                .iter()
                .partition(|&&i| seen.insert(key(items[i], kinds)));
            let batch: Vec<&ExtendItem> = round.iter().map(|&i| items[i]).collect();
            let extended = self.extend_round(&batch, kinds).await?;
            for i in round {
                out[i] = extended.contains(key(items[i], kinds));
            }
            left = later;
        }
        Ok(out)
    }

    /// One extension statement for items whose keys are distinct: the keys it extended.
    async fn extend_round(
        &self,
        items: &[&ExtendItem],
        kinds: bool,
    ) -> Result<std::collections::HashSet<String>, LockError> {
        let names: Vec<&str> = items.iter().map(|i| i.resource.as_str()).collect();
        let tokens: Vec<&str> = items.iter().map(|i| i.token.as_str()).collect();
        let ttls: Vec<i64> = items.iter().map(|i| millis(i.ttl)).collect();
        let rows = self
            .call(
                "extend",
                if kinds {
                    &self.inner.sql.kind_extend
                } else {
                    &self.inner.sql.extend
                },
                &[
                    (&names, Type::TEXT_ARRAY),
                    (&tokens, Type::TEXT_ARRAY),
                    (&ttls, Type::INT8_ARRAY),
                ],
            )
            .await?;
        Ok(rows.iter().filter_map(|r| r.try_get(0).ok()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connector(url: &str) -> Result<Connector, LockError> {
        let (config, opts) = parse_url(url, PostgresOptions::default())?;
        Connector::for_config(&config, &opts)
    }

    /// What the client refuses only when it connects is refused by the URL, as
    /// `Misconfigured` (500): a URL no connection can use is no outage. Before, each was
    /// `Unavailable` (503), at every attempt, and `through_outages` waited on it.
    #[test]
    fn urls_no_connection_can_use_are_misconfigured() {
        for url in [
            "postgres://app@/appdb",
            "postgres://app@h1,h2/db?hostaddr=10.0.0.1",
            // Each host of the URL has its port (5432 if none): three ports for two hosts.
            "postgres://app@h1,h2/db?port=1",
            "host=h1,h2 port=1,2,3 user=app",
        ] {
            let err = connector(url).err().expect(url);
            assert!(err.is_misconfigured(), "{url}: {err}");
        }
        assert!(connector("postgres://app@h1:1,h2/db?sslmode=disable").is_ok());
        assert!(connector("host=h1,h2 port=1 user=app sslmode=disable").is_ok());
        assert!(connector("postgres://app@/db?hostaddr=10.0.0.1&sslmode=disable").is_ok());
    }

    /// With TLS, a `hostaddr` without a host name (nothing to verify the certificate against)
    /// and direct TLS negotiation under `prefer` are refused by every connection to a server
    /// offering TLS: refused by the URL instead.
    #[cfg(feature = "postgres-tls")]
    #[test]
    fn tls_settings_no_connection_can_use_are_misconfigured() {
        for url in [
            "postgres://app@/db?hostaddr=10.0.0.1",
            "postgres://app@/db?hostaddr=10.0.0.1&sslmode=require",
            "postgres://app@h1/db?sslnegotiation=direct",
        ] {
            let err = connector(url).err().expect(url);
            assert!(err.is_misconfigured(), "{url}: {err}");
        }
        assert!(connector("postgres://app@h1/db?hostaddr=10.0.0.1").is_ok());
        assert!(connector("postgres://app@h1/db?sslnegotiation=direct&sslmode=require").is_ok());
    }

    /// A socket host never has TLS: `prefer` is plaintext, `require` is refused at once (it
    /// could never be met), with or without the `postgres-tls` feature.
    #[cfg(unix)]
    #[test]
    fn a_socket_host_is_plaintext_and_refuses_require() {
        let socket = "postgres://u@%2Frun%2Fpostgresql:5432/db";
        assert!(matches!(connector(socket), Ok(Connector::Plain)));
        let prefer = format!("{socket}?sslmode=prefer");
        assert!(matches!(connector(&prefer), Ok(Connector::Plain)));
        let err = connector(&format!("{socket}?sslmode=require"))
            .err()
            .expect("require over a socket");
        assert!(err.is_misconfigured(), "{err}");
        assert!(err.to_string().contains("Unix socket"), "{err}");
        // One socket among TCP hosts: `require` can still never be met there.
        let mixed = "postgres://u@db1:5432,%2Frun%2Fpostgresql:5432/db?sslmode=require";
        assert!(connector(mixed).err().is_some_and(|e| e.is_misconfigured()));
    }

    /// With the feature, a TCP host under `prefer` gets the TLS connector, which also takes the
    /// empty host name tokio-postgres gives it for a socket among the hosts.
    #[cfg(feature = "postgres-tls")]
    #[test]
    fn the_tls_connector_takes_a_sockets_empty_host_name() {
        use tokio_postgres::tls::MakeTlsConnect as _;
        let mixed = "postgres://u@db1:5432,%2Frun%2Fpostgresql:5432/db";
        let Ok(Connector::Tls(mut tls)) = connector(mixed) else {
            panic!("prefer with a TCP host uses TLS");
        };
        assert!(tls.make_tls_connect("").is_ok(), "a socket's empty name");
        assert!(tls.make_tls_connect("db1").is_ok());
        assert!(tls.make_tls_connect("not a name").is_err());
    }

    #[test]
    fn exhausted_tokens_are_a_refusal_for_good() {
        assert!(refused_for_good("54000", Some("exec_stmt_raise")));
        assert!(!refused_for_good("P0001", Some("exec_stmt_raise")));
        assert!(!refused_for_good("57P01", None));
        assert!(!refused_for_good("08006", None));
    }

    /// A full NOTIFY queue (`54000` from `PreCommit_Notify`) passes once the listener that
    /// holds it back reads on: unavailable, not misconfigured. (Not reproduced on a server:
    /// the queue holds 8 GB before PostgreSQL 17's `max_notify_queue_pages`.)
    #[test]
    fn a_full_notify_queue_is_no_refusal_for_good() {
        assert!(!refused_for_good("54000", Some("PreCommit_Notify")));
        assert!(refused_for_good("54001", Some("PreCommit_Notify")));
    }

    #[test]
    fn bad_names_are_misconfigured() {
        let err = PostgresOptions::default().schema("A").ddl().unwrap_err();
        assert!(err.is_misconfigured(), "{err}");
        let err = PostgresOptions::default()
            .table_prefix("-")
            .ddl()
            .unwrap_err();
        assert!(err.is_misconfigured(), "{err}");
    }

    /// No prefix in the schema every application shares: the DDL would take over an
    /// application's own `locks` table and `release` function. In a schema of its own, or with
    /// a prefix in `public`, it is fine.
    #[test]
    fn an_empty_prefix_in_public_is_misconfigured() {
        let in_public = PostgresOptions::default().schema("public");
        let err = in_public.clone().table_prefix("").ddl().unwrap_err();
        assert!(err.is_misconfigured(), "{err}");
        assert!(err.to_string().contains("public"), "{err}");
        assert!(in_public.table_prefix("dlock_").ddl().is_ok());
        assert!(PostgresOptions::default()
            .schema("locking")
            .table_prefix("")
            .ddl()
            .is_ok());
    }
}
