//! [`LockerBuilder`]: a locker's settings.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{Config, Inner, Locker, NEXT_LOCKER_ID};
use crate::backend::{IntoBackend, MemoryBackend};
use crate::key::validate_prefix;
use crate::watchdog::Watchdog;
use crate::{LockError, OnFail};

/// Builds a [`Locker`]. Defaults: prefix `"dlock"`, command timeout 1 s, default TTL 30 s,
/// waiter-queue entry TTL 5 s, [`OnFail::Reject`].
#[derive(Clone, Debug, Default)]
#[must_use]
pub struct LockerBuilder {
    config: Config,
    prefix_error: Option<String>,
}

impl LockerBuilder {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// The namespace prefix (`<prefix>:{<key>}`); lockers with different prefixes never
    /// contend. Must not contain `{`, `}`, whitespace or control characters; may be empty.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        self.prefix_error = validate_prefix(&prefix).err().map(|e| e.to_string());
        self.config.prefix = prefix;
        self
    }

    /// The deadline of every backend call (acquire attempt, release, extend, renewal batch).
    /// More than zero: there is no "no timeout" (zero is [`LockError::Misconfigured`] when
    /// the locker is built, as every call would time out). Keep it well below the TTLs of
    /// renewed locks — a third or less: a renewal whose answer never comes is given up after
    /// it, and the next must still go out within the lease.
    pub fn command_timeout(mut self, d: Duration) -> Self {
        self.config.command_timeout = d;
        self
    }

    /// The TTL of requests that don't set one.
    pub fn default_ttl(mut self, d: Duration) -> Self {
        self.config.default_ttl = d;
        self
    }

    /// The strategy of requests that don't set one.
    pub fn default_on_fail(mut self, on_fail: OnFail) -> Self {
        self.config.on_fail = on_fail;
        self
    }

    /// How long a waiter's place in a queue lives without being refreshed (at most; a request
    /// whose lease is shorter uses its lease, but at least 300 ms). A live waiter refreshes it
    /// at least every third of this; a waiter that died holds up the queue at most this long.
    /// Between 30 ms and 60 s (values outside are clamped).
    pub fn waiter_ttl(mut self, d: Duration) -> Self {
        self.config.waiter_ttl = d.clamp(Duration::from_millis(30), Duration::from_secs(60));
        self
    }

    /// How many replicas must have a lock before it counts as taken, for requests that don't
    /// say ([`LockRequest::replicas`](crate::LockRequest::replicas); idempotency requests too,
    /// for their key's lock and their record:
    /// [`IdempotencyRequest::replicas`](crate::idempotency::IdempotencyRequest::replicas)).
    /// Default 0. Redis only (one
    /// server, Sentinel, a cluster); other backends answer
    /// [`LockError::Unsupported`] when it is above 0. Replica acknowledgement covers exclusive
    /// locks only: above 0, a semaphore or read-write request (also one the attribute makes,
    /// `permits`/`mode`) answers [`LockError::Unsupported`] too — use a locker of its own
    /// for those.
    pub fn replicas(mut self, n: u32) -> Self {
        self.config.replicas = n;
        self
    }

    /// The bounds of the locker's in-process [`DeferQueue`](crate::defer::DeferQueue): how many
    /// jobs may wait, and how long and how many dead letters are kept.
    pub fn defer_limits(mut self, limits: crate::defer::QueueLimits) -> Self {
        self.config.defer_limits = limits;
        self
    }

    /// Whether this locker's `tracing` spans and events record keys as they are (`true`) or
    /// redacted (`false`, the default): a short keyed hash (`#` and 12 hex digits of SHA-256
    /// over a per-process random secret and the key), the same for one key within a process,
    /// so one lock's events can be followed without the key — which may hold user data —
    /// reaching the logs. Metrics never carry keys (see [`crate::metrics`]).
    pub fn trace_plain_keys(mut self, plain: bool) -> Self {
        self.config.key_log = crate::key::KeyLog { plain };
        self
    }

    /// Builds a locker over `backend`.
    ///
    /// # Panics
    /// If the prefix is invalid or the command timeout zero (use
    /// [`try_build`](LockerBuilder::try_build) to get an error).
    pub fn build(self, backend: impl IntoBackend) -> Locker {
        match self.try_build(backend) {
            Ok(l) => l,
            Err(e) => panic!("{e}"),
        }
    }

    /// Builds a locker over `backend`, or reports an invalid prefix
    /// ([`LockError::InvalidKey`]) or a zero command timeout ([`LockError::Misconfigured`]).
    pub fn try_build(self, backend: impl IntoBackend) -> Result<Locker, LockError> {
        self.check()?;
        let backend = backend.into_backend();
        let watchdog = Watchdog::new(
            backend.clone(),
            self.config.command_timeout,
            self.config.key_log,
        );
        let defer = crate::defer::DeferQueue::with_limits(self.config.defer_limits.clone())
            .key_log(self.config.key_log);
        Ok(Locker {
            inner: Arc::new(Inner {
                id: NEXT_LOCKER_ID.fetch_add(1, Ordering::Relaxed),
                backend,
                watchdog,
                config: self.config,
                waiting: AtomicUsize::new(0),
                defer,
                contention: Default::default(),
            }),
        })
    }

    /// The settings no locker can work with.
    fn check(&self) -> Result<(), LockError> {
        if let Some(reason) = &self.prefix_error {
            return Err(LockError::invalid_key(reason.clone()));
        }
        if self.config.command_timeout.is_zero() {
            return Err(LockError::misconfigured(
                "command_timeout must be more than zero: it bounds every backend call, and a \
                 zero deadline would fail them all (there is no \"no timeout\")",
                None,
            ));
        }
        Ok(())
    }

    /// Builds a locker over a fresh in-process store.
    pub fn memory(self) -> Result<Locker, LockError> {
        self.try_build(MemoryBackend::new())
    }

    /// The Redis connection settings this locker's URL forms use: the command timeout for
    /// commands and for connecting.
    #[cfg(feature = "redis")]
    fn redis_options(&self) -> crate::backend::RedisOptions {
        crate::backend::RedisOptions::default()
            .command_timeout(self.config.command_timeout)
            .connect_timeout(self.config.command_timeout)
    }

    /// Connects to the backend named by `url` (see [`Locker::from_url`]).
    pub async fn connect(self, url: &str) -> Result<Locker, LockError> {
        // Before connecting: with a zero timeout the connect itself would fail, as unavailable.
        self.check()?;
        let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
        match scheme {
            "memory" => self.memory(),
            #[cfg(feature = "redis")]
            "redis" | "rediss" | "redis+unix" | "unix" => {
                let opts = self.redis_options();
                let backend = crate::backend::RedisBackend::connect(url, opts).await?;
                self.try_build(backend)
            }
            #[cfg(feature = "cluster")]
            "redis+cluster" | "rediss+cluster" => {
                let opts = self.redis_options();
                let backend =
                    crate::backend::RedisBackend::connect_cluster(
                        &crate::backend::redis::conn::cluster_urls(url)?,
                        opts,
                    )
                        .await?;
                self.try_build(backend)
            }
            #[cfg(feature = "sentinel")]
            "redis+sentinel" | "rediss+sentinel" => {
                let opts = self.redis_options();
                let backend = crate::backend::RedisBackend::connect_sentinel(url, opts).await?;
                self.try_build(backend)
            }
            #[cfg(feature = "etcd")]
            "etcd" | "etcds" => {
                let opts = crate::backend::EtcdOptions::default()
                    .command_timeout(self.config.command_timeout)
                    .connect_timeout(self.config.command_timeout);
                let backend = crate::backend::EtcdBackend::connect(url, opts).await?;
                self.try_build(backend)
            }
            #[cfg(feature = "zookeeper")]
            "zk" => {
                let opts = crate::backend::ZkOptions::default()
                    .command_timeout(self.config.command_timeout);
                let backend = crate::backend::ZkBackend::connect(url, opts).await?;
                self.try_build(backend)
            }
            #[cfg(feature = "redis")]
            "redlock" => {
                let opts = crate::backend::RedlockOptions::default()
                    .connect_timeout(self.config.command_timeout);
                let backend = crate::backend::RedlockBackend::connect_url(url, opts).await?;
                self.try_build(backend)
            }
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => {
                let opts = crate::backend::PostgresOptions::default()
                    .command_timeout(self.config.command_timeout)
                    .connect_timeout(self.config.command_timeout);
                let backend = crate::backend::PostgresBackend::connect(url, opts).await?;
                self.try_build(backend)
            }
            _ => Err(LockError::misconfigured(
                format!("unsupported locker url scheme `{scheme}://` (known: memory://, redis://, rediss://, redis+cluster://, rediss+cluster://, redis+sentinel://, rediss+sentinel://, redlock://, postgres://, postgresql://, etcd://, etcds://, zk://; redis+cluster needs feature `cluster`, redis+sentinel feature `sentinel`, postgres feature `postgres`, etcd feature `etcd`, zk feature `zookeeper`)"),
                None,
            )),
        }
    }
}
