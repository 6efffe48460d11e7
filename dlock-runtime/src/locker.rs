//! [`Locker`], its builder, and the lock request builder.

use std::fmt;
use std::future::{Future, IntoFuture};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use tracing::Instrument as _;

use crate::backend::{
    AcquireArgs, Attempt, Backend, BoxFuture, IntoBackend, MemoryBackend, OwnerToken, WaitMode,
    Watch,
};
use crate::engine::Engine;
use crate::key::{validate_prefix, ResourceName};
use crate::lease::{Lease, Undo};
use crate::util::validate_ttl;
use crate::{LockError, LockGuard, LockKey, OnFail, RetryPolicy};

static NEXT_LOCKER_ID: AtomicU64 = AtomicU64::new(1);

/// The entry point: a handle to one lock store with its configuration. Cheap to clone (an
/// `Arc` inside), `Send + Sync`; clones share the backend connection, the renewal engine and
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

struct Inner {
    id: u64,
    backend: Arc<dyn Backend>,
    engine: Arc<Engine>,
    config: Config,
    /// Tasks currently waiting for a lock (subscribed to its release).
    waiting: AtomicUsize,
    /// The in-process delay queue for `OnFail::Defer`.
    defer: crate::defer::DeferQueue,
}

#[derive(Clone, Debug)]
struct Config {
    prefix: String,
    command_timeout: Duration,
    default_ttl: Duration,
    waiter_ttl: Duration,
    on_fail: OnFail,
    defer_limits: crate::defer::QueueLimits,
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
    /// * `redlock://host:port,host:port,host:port` — Redlock over independent servers (each
    ///   part may also be a full `redis://` URL); see [`RedlockBackend`](crate::backend::RedlockBackend).
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
        LockRequest {
            locker: self,
            key: key.into_lock_key(),
            ttl: None,
            on_fail: None,
            auto_renew: true,
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

    /// How many tasks of this locker are currently waiting for a lock (queued and subscribed
    /// to its release). A metric, and what tests use to know a waiter is in line.
    pub fn waiting(&self) -> usize {
        self.inner.waiting.load(Ordering::Acquire)
    }

    /// How many watchdog renewals have succeeded since this locker was built (a counter for
    /// metrics).
    pub fn renewals(&self) -> u64 {
        self.inner.engine.renewals()
    }

    /// How many held guards the watchdog is currently renewing.
    pub fn renewing(&self) -> usize {
        self.inner.engine.scheduled()
    }

    /// The TTL of requests that don't set one ([`LockerBuilder::default_ttl`]).
    pub fn default_ttl(&self) -> Duration {
        self.inner.config.default_ttl
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

    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.inner.engine
    }

    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
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
        self.inner.engine.with_deadline(what, fut).await
    }

    fn make_guard(
        &self,
        resource: ResourceName,
        token: OwnerToken,
        fencing_token: u64,
        ttl: Duration,
        sent_ns: u64,
        auto_renew: bool,
    ) -> LockGuard {
        let state =
            self.inner
                .engine
                .register(resource, token, fencing_token, ttl, sent_ns, auto_renew);
        LockGuard::new(Lease::new(state, self.inner.engine.clone(), self.id()))
    }
}

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
    pub fn waiter_ttl(mut self, d: Duration) -> Self {
        self.config.waiter_ttl = d.max(Duration::from_millis(30));
        self
    }

    /// The bounds of the locker's in-process [`DeferQueue`](crate::defer::DeferQueue): how many
    /// jobs may wait, and how long and how many dead letters are kept.
    pub fn defer_limits(mut self, limits: crate::defer::QueueLimits) -> Self {
        self.config.defer_limits = limits;
        self
    }

    /// Builds a locker over `backend`.
    ///
    /// # Panics
    /// If the prefix is invalid (use [`try_build`](LockerBuilder::try_build) to get an error).
    pub fn build(self, backend: impl IntoBackend) -> Locker {
        match self.try_build(backend) {
            Ok(l) => l,
            Err(e) => panic!("{e}"),
        }
    }

    /// Builds a locker over `backend`, or reports an invalid prefix.
    pub fn try_build(self, backend: impl IntoBackend) -> Result<Locker, LockError> {
        if let Some(reason) = self.prefix_error {
            return Err(LockError::invalid_key(reason));
        }
        let backend = backend.into_backend();
        let engine = Engine::new(backend.clone(), self.config.command_timeout);
        let defer = crate::defer::DeferQueue::with_limits(self.config.defer_limits.clone());
        Ok(Locker {
            inner: Arc::new(Inner {
                id: NEXT_LOCKER_ID.fetch_add(1, Ordering::Relaxed),
                backend,
                engine,
                config: self.config,
                waiting: AtomicUsize::new(0),
                defer,
            }),
        })
    }

    /// Builds a locker over a fresh in-process store.
    pub fn memory(self) -> Result<Locker, LockError> {
        self.try_build(MemoryBackend::new())
    }

    /// Connects to the backend named by `url` (see [`Locker::from_url`]).
    pub async fn connect(self, url: &str) -> Result<Locker, LockError> {
        let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
        match scheme {
            "memory" => self.memory(),
            #[cfg(feature = "redis")]
            "redis" | "rediss" | "redis+unix" | "unix" => {
                let opts = crate::backend::RedisOptions::default()
                    .command_timeout(self.config.command_timeout)
                    .connect_timeout(self.config.command_timeout);
                let backend = crate::backend::RedisBackend::connect(url, opts).await?;
                self.try_build(backend)
            }
            #[cfg(feature = "redis")]
            "redlock" => {
                let opts = crate::backend::RedlockOptions::default()
                    .connect_timeout(self.config.command_timeout);
                let backend = crate::backend::RedlockBackend::connect_url(url, opts).await?;
                self.try_build(backend)
            }
            _ => Err(LockError::unavailable(
                format!("unsupported locker url scheme `{scheme}://` (known: memory://, redis://, rediss://, redlock://)"),
                None,
            )),
        }
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

/// A request for one lock, from [`Locker::lock`]. Set options, then `acquire` (or `.await` it
/// directly) or `try_acquire`.
#[must_use = "a lock request does nothing until acquired"]
pub struct LockRequest<'a> {
    locker: &'a Locker,
    key: Result<LockKey, LockError>,
    ttl: Option<Duration>,
    on_fail: Option<OnFail>,
    auto_renew: bool,
}

impl fmt::Debug for LockRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockRequest")
            .field("key", &self.key)
            .field("ttl", &self.ttl)
            .field("on_fail", &self.on_fail)
            .field("auto_renew", &self.auto_renew)
            .finish()
    }
}

impl<'a> LockRequest<'a> {
    /// The lease. Default: the locker's default TTL (30 s). Must be within
    /// [`MIN_TTL`](crate::MIN_TTL)..=[`MAX_TTL`](crate::MAX_TTL). With auto-renewal (the default) the lock is held until
    /// released, however long that takes; the TTL is how quickly it frees if this process dies.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// What to do when the lock is held. Default: the locker's default ([`OnFail::Reject`]).
    pub fn on_fail(mut self, on_fail: OnFail) -> Self {
        self.on_fail = Some(on_fail);
        self
    }

    /// Whether the watchdog renews the lock while the guard lives (default `true`). With
    /// `false` the lock ends after one TTL, released or not, and the guard reports it lost then.
    pub fn auto_renew(mut self, on: bool) -> Self {
        self.auto_renew = on;
        self
    }

    /// Acquires the lock with the request's strategy.
    ///
    /// Cancel-safe: dropping this future at any point never leaves the lock held without a
    /// guard — whatever reached the backend is undone in the background (and a queued waiter
    /// leaves the queue).
    pub async fn acquire(self) -> Result<LockGuard, LockError> {
        let locker = self.locker;
        let key = self.key?;
        let ttl = validate_ttl(self.ttl.unwrap_or(locker.inner.config.default_ttl))?;
        let on_fail = self
            .on_fail
            .unwrap_or_else(|| locker.inner.config.on_fail.clone());
        let span = tracing::debug_span!("dlock.acquire", key = %key);
        let resource = locker.resource(key);
        match on_fail {
            // `acquire` has no work to defer: one attempt, like Reject.
            OnFail::Reject | OnFail::Defer(_) => {
                match attempt_once(locker, resource.clone(), ttl, self.auto_renew)
                    .instrument(span)
                    .await?
                {
                    Ok(guard) => Ok(guard),
                    Err(remaining) => Err(LockError::contended(resource.key().as_str(), remaining)),
                }
            }
            OnFail::Retry(policy) => {
                wait_for(locker, resource, ttl, self.auto_renew, policy)
                    .instrument(span)
                    .await
            }
        }
    }

    /// One attempt, whatever the strategy: `Ok(None)` when someone else holds the lock.
    pub async fn try_acquire(self) -> Result<Option<LockGuard>, LockError> {
        let locker = self.locker;
        let key = self.key?;
        let ttl = validate_ttl(self.ttl.unwrap_or(locker.inner.config.default_ttl))?;
        let span = tracing::debug_span!("dlock.try_acquire", key = %key);
        let resource = locker.resource(key);
        Ok(attempt_once(locker, resource, ttl, self.auto_renew)
            .instrument(span)
            .await?
            .ok())
    }

    /// Takes the lock with the request's strategy, runs `work` while holding it (with the lock
    /// visible to [`current_lock`](crate::current_lock)), releases it, and returns the work's
    /// output.
    ///
    /// With [`OnFail::Defer`], a busy lock does not fail the call: `work` goes to the locker's
    /// [`defer_queue`](Locker::defer_queue) and [`LockError::Deferred`] (with the job id) is
    /// returned at once; the queue runs `work` later under the lock, and its output is then
    /// dropped. Hence the `'static + Send` bounds.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::time::Duration;
    /// use dlock_runtime::{Locker, OnFail};
    ///
    /// let locker = Locker::memory();
    /// let held = locker.lock("invoice:7").acquire().await.unwrap();
    /// let outcome = locker
    ///     .lock("invoice:7")
    ///     .on_fail(OnFail::defer(Duration::from_millis(10), 5))
    ///     .run(async { println!("sending invoice 7") })
    ///     .await;
    /// let err = outcome.unwrap_err();
    /// assert!(err.is_deferred());
    /// assert_eq!(err.status(), 202);
    /// drop(held); // the queue runs the work once the lock frees
    /// # }
    /// ```
    pub async fn run<F>(self, work: F) -> Result<F::Output, LockError>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let locker = self.locker;
        let policy = match &self.on_fail {
            Some(OnFail::Defer(p)) => Some(p.clone()),
            None => match &locker.inner.config.on_fail {
                OnFail::Defer(p) => Some(p.clone()),
                _ => None,
            },
            Some(_) => None,
        };
        let Some(policy) = policy else {
            let guard = self.acquire().await?;
            let out = crate::context::scope(locker.id(), guard.info(), work).await;
            if let Err(e) = guard.release().await {
                tracing::warn!(error = %e, "dlock: lock was not cleanly released after the work finished");
            }
            return Ok(out);
        };
        let key = self.key?;
        let ttl = validate_ttl(self.ttl.unwrap_or(locker.inner.config.default_ttl))?;
        let resource = locker.resource(key.clone());
        match attempt_once(locker, resource, ttl, self.auto_renew).await? {
            Ok(guard) => {
                let out = crate::context::scope(locker.id(), guard.info(), work).await;
                if let Err(e) = guard.release().await {
                    tracing::warn!(error = %e, "dlock: lock was not cleanly released after the work finished");
                }
                Ok(out)
            }
            Err(_) => {
                let job_id = locker.inner.defer.push(
                    key.as_str(),
                    policy,
                    Box::new(LockedWork {
                        locker: locker.clone(),
                        key: key.clone(),
                        ttl,
                        work: Box::pin(async move {
                            let _ = work.await;
                        }),
                    }),
                )?;
                Err(LockError::Deferred {
                    key: key.as_str().to_owned(),
                    job_id,
                })
            }
        }
    }
}

/// Deferred work under its lock: what the in-process [`DeferQueue`](crate::defer::DeferQueue)
/// attempts when the work's turn comes.
struct LockedWork {
    locker: Locker,
    key: LockKey,
    ttl: Duration,
    work: BoxFuture<'static, ()>,
}

impl crate::defer::DeferredWork for LockedWork {
    fn attempt(
        self: Box<Self>,
    ) -> BoxFuture<'static, Result<(), Box<dyn crate::defer::DeferredWork>>> {
        Box::pin(async move {
            let attempt = self
                .locker
                .lock(self.key.clone())
                .ttl(self.ttl)
                .try_acquire()
                .await;
            match attempt {
                Ok(Some(guard)) => {
                    let LockedWork { locker, work, .. } = *self;
                    crate::context::scope(locker.id(), guard.info(), work).await;
                    if let Err(e) = guard.release().await {
                        tracing::warn!(error = %e, "dlock: deferred job's lock was not cleanly released");
                    }
                    Ok(())
                }
                Ok(None) => Err(self as Box<dyn crate::defer::DeferredWork>),
                Err(e) => {
                    tracing::debug!(error = %e, "dlock: deferred attempt could not reach the backend");
                    Err(self as Box<dyn crate::defer::DeferredWork>)
                }
            }
        })
    }
}

impl<'a> IntoFuture for LockRequest<'a> {
    type Output = Result<LockGuard, LockError>;
    type IntoFuture = BoxFuture<'a, Result<LockGuard, LockError>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.acquire())
    }
}

async fn attempt(
    locker: &Locker,
    flight: &Undo<'_>,
    ttl: Duration,
    mode: WaitMode,
) -> Result<(Attempt, u64), LockError> {
    let sent = locker.engine().now_ns();
    let args = AcquireArgs {
        resource: flight.resource(),
        token: flight.token(),
        ttl,
        mode,
        waiter_ttl: locker.waiter_ttl_for(ttl),
    };
    let out = locker
        .with_deadline("acquire", locker.backend().acquire(args))
        .await?;
    Ok((out, sent))
}

/// One attempt without queueing. `Err(remaining)` when held by someone else.
async fn attempt_once(
    locker: &Locker,
    resource: ResourceName,
    ttl: Duration,
    auto_renew: bool,
) -> Result<Result<LockGuard, Option<Duration>>, LockError> {
    let mut flight = Undo::new(locker.engine(), resource, ttl);
    let (out, sent) = attempt(locker, &flight, ttl, WaitMode::Try).await?;
    // The reply is in: nothing is left to undo unless we hold the lock, and then the guard
    // takes over.
    flight.disarm();
    match out {
        Attempt::Acquired { fencing_token } => Ok(Ok(locker.make_guard(
            flight.resource().clone(),
            flight.token().clone(),
            fencing_token,
            ttl,
            sent,
            auto_renew,
        ))),
        Attempt::Held { remaining } => Ok(Err(remaining)),
    }
}

async fn wait_for(
    locker: &Locker,
    resource: ResourceName,
    ttl: Duration,
    auto_renew: bool,
    policy: RetryPolicy,
) -> Result<LockGuard, LockError> {
    let start = Instant::now();
    let deadline = start + policy.wait;
    let mode = if policy.fair {
        WaitMode::Queue
    } else {
        WaitMode::Barge
    };
    // Armed until the guard exists: a timeout, an error or a dropped future leaves the queue
    // and undoes whatever the last attempt may have taken.
    let waiter_ttl = locker.waiter_ttl_for(ttl);
    let mut flight = Undo::new(locker.engine(), resource, ttl.max(waiter_ttl));
    let refresh = waiter_ttl / 3;
    let mut watch: Option<(Watch, WaitingCount<'_>)> = None;
    let mut step = 0u32;
    let fifo = policy.fair && locker.backend().fifo();
    loop {
        let (out, sent) = attempt(locker, &flight, ttl, mode).await?;
        let remaining = match out {
            Attempt::Acquired { fencing_token } => {
                flight.disarm();
                return Ok(locker.make_guard(
                    flight.resource().clone(),
                    flight.token().clone(),
                    fencing_token,
                    ttl,
                    sent,
                    auto_renew,
                ));
            }
            Attempt::Held { remaining } => remaining,
        };
        let now = Instant::now();
        if now >= deadline {
            // Leave the queue before reporting, so the caller's next move sees it gone.
            let undo = locker.backend().abandon(flight.resource(), flight.token());
            if locker.with_deadline("abandon", undo).await.is_ok() {
                flight.disarm();
            }
            return Err(LockError::timeout(
                flight.resource().key().as_str(),
                now - start,
                remaining,
            ));
        }
        if watch.is_none() {
            // Subscribe, then attempt again at once: a release between the first attempt and
            // the subscription is caught by that attempt, any later one by the notification.
            let w = locker
                .with_deadline(
                    "subscribe",
                    locker.backend().watch(flight.resource(), flight.token()),
                )
                .await?;
            watch = Some((w, WaitingCount::enter(locker)));
            continue;
        }
        let mut sleep = policy.backoff_step(step).min(refresh).min(deadline - now);
        if let Some(r) = remaining {
            // Wake when the holder's lease ends, in case it dies without releasing.
            sleep = sleep.min(r + Duration::from_millis(1));
        }
        step = step.saturating_add(1);
        if let Some((w, _)) = &watch {
            tokio::select! {
                // A fair waiter is woken alone, when it is first: start over. Barging waiters
                // (Redlock) are woken together; keeping their backoff avoids a lockstep retry.
                _ = w.notified() => { if fifo { step = 0; } }
                _ = tokio::time::sleep(sleep) => {}
            }
        }
    }
}

/// Counts a task in [`Locker::waiting`] while it lives.
struct WaitingCount<'a>(&'a Locker);

impl<'a> WaitingCount<'a> {
    fn enter(locker: &'a Locker) -> Self {
        locker.inner.waiting.fetch_add(1, Ordering::AcqRel);
        WaitingCount(locker)
    }
}

impl Drop for WaitingCount<'_> {
    fn drop(&mut self) {
        self.0.inner.waiting.fetch_sub(1, Ordering::AcqRel);
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

    #[tokio::test]
    async fn unknown_url_scheme_is_a_typed_error() {
        let err = Locker::from_url("zookeeper://x").await.unwrap_err();
        assert!(err.to_string().contains("unsupported"), "{err}");
    }
}
