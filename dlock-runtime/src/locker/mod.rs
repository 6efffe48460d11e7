//! [`Locker`]: one lock store with its configuration. Its builder is in `builder`, a lock
//! request (one attempt, fair waiting, deferring) in `request`.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use crate::backend::{Backend, IntoBackend, MemoryBackend};
use crate::key::{LockKind, ResourceName};
use crate::watchdog::Watchdog;
use crate::{LockError, LockKey, OnFail};

mod builder;
pub(crate) mod contention;
mod kinds;
mod request;

pub use builder::LockerBuilder;
pub use contention::ContentionEvent;
pub use kinds::RwLockRequest;
pub use request::LockRequest;

static NEXT_LOCKER_ID: AtomicU64 = AtomicU64::new(1);

/// The entry point: a handle to one lock store with its configuration. Cheap to clone (an
/// `Arc` inside), `Send + Sync`; clones share the backend connection, the renewal watchdog and
/// the notification subscriptions.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
/// use std::time::Duration;
/// use dlock_runtime::Locker;
///
/// let locker = Locker::memory();
/// let guard = locker.lock("report:2026-11").ttl(Duration::from_secs(30)).acquire().await?;
/// assert!(locker.lock("report:2026-11").try_acquire().await?.is_none());
/// guard.release().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Locker {
    inner: Arc<Inner>,
}

/// A [`Locker`] that does not keep it alive (a dead letter's: see `LockedWork`).
#[derive(Clone)]
pub(crate) struct WeakLocker(std::sync::Weak<Inner>);

impl Locker {
    /// A handle that does not keep this locker alive.
    pub(crate) fn downgrade(&self) -> WeakLocker {
        WeakLocker(Arc::downgrade(&self.inner))
    }
}

impl WeakLocker {
    pub(crate) fn upgrade(&self) -> Option<Locker> {
        self.0.upgrade().map(|inner| Locker { inner })
    }
}

struct Inner {
    id: u64,
    backend: Arc<dyn Backend>,
    watchdog: Arc<Watchdog>,
    config: Config,
    /// Tasks currently waiting for a lock (subscribed to its release).
    waiting: AtomicUsize,
    /// The in-process delay queue for `OnFail::Defer`.
    defer: crate::defer::DeferQueue,
    /// Recent contended attempts.
    contention: contention::ContentionLog,
}

#[derive(Clone, Debug)]
struct Config {
    prefix: String,
    command_timeout: Duration,
    default_ttl: Duration,
    waiter_ttl: Duration,
    on_fail: OnFail,
    defer_limits: crate::defer::QueueLimits,
    replicas: u32,
    key_log: crate::key::KeyLog,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            prefix: "dlock".to_owned(),
            command_timeout: Duration::from_secs(1),
            default_ttl: dlock_limits::DEFAULT_TTL,
            waiter_ttl: Duration::from_secs(5),
            on_fail: OnFail::Reject,
            defer_limits: crate::defer::QueueLimits::default(),
            replicas: 0,
            key_log: crate::key::KeyLog::default(),
        }
    }
}

impl fmt::Debug for Locker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locker")
            .field("backend", &self.inner.backend.name())
            .field("prefix", &self.inner.config.prefix)
            .finish_non_exhaustive()
    }
}

impl Locker {
    /// A locker over a fresh in-process [`MemoryBackend`], with default settings.
    pub fn memory() -> Self {
        Self::new(MemoryBackend::new())
    }

    /// A locker over `backend`, with default settings (see [`LockerBuilder`]).
    pub fn new(backend: impl IntoBackend) -> Self {
        LockerBuilder::new().build(backend)
    }

    /// Connects to the backend named by `url`, with default settings:
    ///
    /// * `memory://` — a fresh in-process store;
    /// * `redis://host:port[/db]`, `rediss://…` (feature `tls`) — one Redis server;
    /// * `redis+cluster://[user:pass@]host:port,host:port,…`, `rediss+cluster://…` (feature
    ///   `cluster`) — a Redis Cluster (Redis ≥ 7: release notifications use sharded pub/sub),
    ///   reached through any of the listed nodes;
    /// * `redis+sentinel://[user:pass@]s1:p1,s2:p2,…/<master-name>[/<db>][?sentinel_password=…]`,
    ///   `rediss+sentinel://…` (feature `sentinel`) — the master of a Sentinel-monitored group,
    ///   found through the sentinels and followed through a failover: commands in flight when
    ///   the master dies fail as [`LockError::Unavailable`], the next ones go to the promoted
    ///   replica; a holder whose lock the promoted replica did not have is told through
    ///   [`LockGuard::lost`](crate::LockGuard::lost); fencing tokens keep increasing. Replication
    ///   is asynchronous: a lock granted just before the failover may be lost unless the request
    ///   asked for [`replicas`](crate::LockRequest::replicas). The userinfo's credentials
    ///   are the servers'; sentinels with a password of their own get it as `sentinel_password`
    ///   (and an ACL user as `sentinel_username`), percent-encoded;
    /// * `redlock://host:port,host:port,host:port` — Redlock over independent servers (each
    ///   part may also be a full `redis://` URL); see [`RedlockBackend`](crate::backend::RedlockBackend);
    /// * `postgres://[user:pass@]host:port/db[?…]`, `postgresql://…` (feature `postgres`; TLS
    ///   per `sslmode` with feature `postgres-tls`) — a Postgres database; see
    ///   `backend::postgres` for the URL's parameters (schema, table prefix, a direct notify URL
    ///   for PgBouncer).
    /// * `etcd://[user:password@]host:port,host:port,…` (feature `etcd`) — an etcd cluster,
    ///   through any of its members, with the lock recipe of etcd's concurrency package (module
    ///   `backend::etcd`); fencing tokens are the holder key's create revision.
    /// * `zk://host:port,host:port,…[/chroot][?session_timeout_ms=N]` (feature `zookeeper`) — a
    ///   ZooKeeper ensemble, with the ephemeral-sequential-node recipe (module
    ///   `backend::zookeeper`); fencing tokens are the holder node's creation zxid.
    ///
    /// Fails with [`LockError::Unavailable`] if the server does not answer in time, and with
    /// [`LockError::InvalidKey`]-free typed errors for unknown schemes.
    pub async fn from_url(url: &str) -> Result<Self, LockError> {
        LockerBuilder::new().connect(url).await
    }

    /// Starts a [`LockerBuilder`] (namespace prefix, timeouts, defaults).
    pub fn builder() -> LockerBuilder {
        LockerBuilder::new()
    }

    /// Starts a request for the lock on `key`: a literal key (`&str`, `String`) or a
    /// [`LockKey`]. Invalid keys are reported by `acquire`/`try_acquire`.
    pub fn lock(&self, key: impl IntoLockKey) -> LockRequest<'_> {
        self.request(key, LockKind::Exclusive)
    }

    /// A request for what `kind` takes on `key` (see [`Locker::semaphore`], [`Locker::rw`]).
    pub(crate) fn request(&self, key: impl IntoLockKey, kind: LockKind) -> LockRequest<'_> {
        LockRequest {
            locker: self,
            key: key.into_lock_key(),
            ttl: None,
            on_fail: None,
            auto_renew: true,
            replicas: None,
            hold_at_least: None,
            kind,
            name: crate::metrics::UNNAMED,
        }
    }

    /// The namespace prefix of every key this locker touches.
    pub fn prefix(&self) -> &str {
        &self.inner.config.prefix
    }

    /// The backend's name (`"memory"`, `"redis"`, …).
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend.name()
    }

    /// This locker's in-process delay queue, where [`OnFail::Defer`] puts work whose lock is
    /// busy (list and re-queue dead letters, shut it down gracefully).
    pub fn defer_queue(&self) -> &crate::defer::DeferQueue {
        &self.inner.defer
    }

    /// How many tasks of this locker are currently waiting for a lock: queued, subscribed to
    /// its release, and past their first check after subscribing (a task counts from its first
    /// sleep), so a release from the moment it is counted wakes it. A metric, and what tests
    /// use to know a waiter is in line.
    pub fn waiting(&self) -> usize {
        self.inner.waiting.load(Ordering::Acquire)
    }

    /// How many watchdog renewals have succeeded since this locker was built (a counter for
    /// metrics).
    pub fn renewals(&self) -> u64 {
        self.inner.watchdog.renewals()
    }

    /// How many held guards the watchdog is currently renewing.
    pub fn renewing(&self) -> usize {
        self.inner.watchdog.scheduled()
    }

    /// The TTL of requests that don't set one ([`LockerBuilder::default_ttl`]).
    pub fn default_ttl(&self) -> Duration {
        self.inner.config.default_ttl
    }

    /// What requests do when the lock is held, unless they say ([`LockerBuilder::default_on_fail`]).
    pub(crate) fn default_on_fail(&self) -> &OnFail {
        &self.inner.config.on_fail
    }

    /// `key` as this locker's `tracing` spans and events show it: a short keyed hash
    /// (`#` and 12 hex digits, stable within the process) unless the locker was built with
    /// [`LockerBuilder::trace_plain_keys`]. For a middleware's own log lines about a lock.
    pub fn trace_key<'a>(&self, key: &'a str) -> impl fmt::Display + 'a {
        self.inner.config.key_log.show(key)
    }

    /// `err`'s message with its key shown as [`trace_key`](Locker::trace_key) shows it: what
    /// to log instead of `err` itself.
    pub fn trace_error<'a>(&self, err: &'a LockError) -> impl fmt::Display + 'a {
        self.inner.config.key_log.error(err)
    }

    /// How many replicas a request that does not say must reach ([`LockerBuilder::replicas`]).
    pub(crate) fn default_replicas(&self) -> u32 {
        self.inner.config.replicas
    }

    pub(crate) fn key_log(&self) -> crate::key::KeyLog {
        self.inner.config.key_log
    }

    /// The metric labels of requests named `name` on this locker.
    pub(crate) fn labels(&self, name: &'static str) -> crate::metrics::Labels {
        crate::metrics::Labels::new(self.inner.backend.name(), name)
    }

    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    /// The waiter-queue entry life for a request with lease `ttl`: the locker's waiter TTL, but
    /// no longer than the lease (and at least 300 ms), so the waiters of a process that died
    /// hold up a short lock's queue for about as long as the lock itself would have.
    pub(crate) fn waiter_ttl_for(&self, ttl: Duration) -> Duration {
        self.inner
            .config
            .waiter_ttl
            .min(ttl.max(Duration::from_millis(300)))
    }

    pub(crate) fn watchdog(&self) -> &Arc<Watchdog> {
        &self.inner.watchdog
    }

    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }

    pub(crate) fn note_contention(&self, key: &LockKey, remaining: Option<Duration>) {
        self.inner.contention.note(key, remaining);
    }

    /// This locker's contended acquire attempts of the last `window` (at most the newest
    /// 4096), oldest first: in-process, for an ops page or a log line.
    pub fn recent_contention(&self, window: Duration) -> Vec<ContentionEvent> {
        self.inner.contention.since(window)
    }

    /// The backend-facing name of `key` under this locker's prefix.
    pub fn resource(&self, key: LockKey) -> ResourceName {
        ResourceName::new(&self.inner.config.prefix, key)
    }

    pub(crate) async fn with_deadline<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        self.inner.watchdog.with_deadline(what, fut).await
    }
}

/// Things [`Locker::lock`] accepts as a key.
pub trait IntoLockKey {
    /// Validates and encodes the key.
    fn into_lock_key(self) -> Result<LockKey, LockError>;
}

impl IntoLockKey for LockKey {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        Ok(self)
    }
}

impl IntoLockKey for &LockKey {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        Ok(self.clone())
    }
}

impl IntoLockKey for &str {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        LockKey::new(self)
    }
}

impl IntoLockKey for String {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        LockKey::new(&self)
    }
}

impl IntoLockKey for &String {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        LockKey::new(self)
    }
}

impl IntoLockKey for Result<LockKey, LockError> {
    fn into_lock_key(self) -> Result<LockKey, LockError> {
        self
    }
}

static DEFAULT_LOCKER: RwLock<Option<Locker>> = RwLock::new(None);

/// Sets the locker that `#[distributed_lock]` uses when the attribute has no `locker = …`.
/// Call it once at startup; a later call replaces it (returning the previous one), which is
/// mostly useful in tests.
///
/// ```
/// let previous = dlock_runtime::set_default_locker(dlock_runtime::Locker::memory());
/// assert!(dlock_runtime::default_locker().is_some());
/// # let _ = previous;
/// ```
pub fn set_default_locker(locker: Locker) -> Option<Locker> {
    DEFAULT_LOCKER
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .replace(locker)
}

/// The locker set with [`set_default_locker`], if any.
pub fn default_locker() -> Option<Locker> {
    DEFAULT_LOCKER
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_locker_takes_a_backend_by_value_arc_or_box() {
        let shared = MemoryBackend::new();
        let by_arc = Locker::new(Arc::new(shared.clone()));
        let boxed: Box<dyn Backend> = Box::new(shared.clone());
        let by_box = Locker::new(boxed);
        let by_value = Locker::new(shared);
        let g = by_arc.lock("k").try_acquire().await.unwrap().unwrap();
        assert!(by_box.lock("k").try_acquire().await.unwrap().is_none());
        assert!(by_value.lock("k").try_acquire().await.unwrap().is_none());
        g.release().await.unwrap();
        assert!(by_box.lock("k").try_acquire().await.unwrap().is_some());
    }

    #[test]
    fn bad_prefix_is_a_typed_error() {
        let err = Locker::builder().prefix("a{b").memory().unwrap_err();
        assert!(err.is_invalid(), "{err}");
    }

    /// A zero command timeout ("no timeout" in many configuration files) is refused when the
    /// locker is built, before any connect: every backend call would time out at once. Before,
    /// it was taken, and only the memory backend (whose calls are ready at once) worked.
    #[tokio::test]
    async fn a_zero_command_timeout_is_misconfigured() {
        let zero = || Locker::builder().command_timeout(Duration::ZERO);
        let err = zero().memory().unwrap_err();
        assert!(err.is_misconfigured(), "{err}");
        assert!(err.to_string().contains("command_timeout"), "{err}");
        let err = zero().connect("redis://127.0.0.1:1").await.unwrap_err();
        assert!(err.is_misconfigured(), "{err}");
        assert!(zero()
            .command_timeout(Duration::from_millis(1))
            .memory()
            .is_ok());
    }

    #[tokio::test]
    async fn unknown_url_scheme_is_a_typed_error() {
        let err = Locker::from_url("zookeeper://x").await.unwrap_err();
        assert!(err.to_string().contains("unsupported"), "{err}");
    }
}
