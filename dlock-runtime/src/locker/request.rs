//! [`LockRequest`]: taking one lock — one attempt, fair waiting, or deferring the work.

use std::fmt;
use std::future::{Future, IntoFuture};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tracing::Instrument as _;

use crate::backend::{AcquireArgs, Attempt, BoxFuture, WaitMode, Watch};
use crate::key::{LockKind, ResourceName};
use crate::lease::{Grant, Undo};
use crate::util::validate_ttl;
use crate::{LockError, LockGuard, LockKey, OnFail, RetryPolicy};

use super::Locker;

/// A request for one lock, from [`Locker::lock`] — or for a semaphore permit
/// ([`Locker::semaphore`]) or a read or write hold of a read-write lock ([`Locker::rw`]), with
/// the same options and the same [`LockGuard`]. Set options, then `acquire` (or `.await` it
/// directly) or `try_acquire`.
#[must_use = "a lock request does nothing until acquired"]
pub struct LockRequest<'a> {
    pub(super) locker: &'a Locker,
    pub(super) key: Result<LockKey, LockError>,
    pub(super) ttl: Option<Duration>,
    pub(super) on_fail: Option<OnFail>,
    pub(super) auto_renew: bool,
    pub(super) replicas: Option<u32>,
    pub(super) hold_at_least: Option<Duration>,
    pub(super) kind: LockKind,
    pub(super) name: &'static str,
}

impl fmt::Debug for LockRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockRequest")
            .field("key", &self.key)
            .field("ttl", &self.ttl)
            .field("on_fail", &self.on_fail)
            .field("auto_renew", &self.auto_renew)
            .field("replicas", &self.replicas)
            .field("hold_at_least", &self.hold_at_least)
            .field("kind", &self.kind)
            .field("name", &self.name)
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

    /// How many replicas must have the lock before it counts as taken (Redis — one server,
    /// Sentinel or a cluster — with `WAIT`). Default: the locker's
    /// ([`LockerBuilder::replicas`](crate::LockerBuilder::replicas)), which defaults to 0 — a
    /// grant on the master is enough.
    ///
    /// With `n > 0`, a lock the master granted is renewed and then waited on until `n` replicas
    /// acknowledge it (within ¾ of the command timeout); when fewer do, it is released again
    /// and the request fails with [`LockError::Unavailable`]. An acknowledged lock survives a
    /// failover to one of those replicas. A backend without replicas (memory, Redlock) answers
    /// [`LockError::Unsupported`].
    pub fn replicas(mut self, n: u32) -> Self {
        self.replicas = Some(n);
        self
    }

    /// Keeps the lock at least `hold` after it was acquired, even when it is released sooner —
    /// ShedLock's `lockAtLeastFor`, for scheduled jobs: when several instances run the same
    /// tick with skewed clocks, the one that comes late still finds the lock taken and skips.
    ///
    /// A release (or drop) before `hold` has passed does not delete the lock: it stops renewal
    /// and sets the lease (owner-checked) to what is left of `hold`, so the lock frees by itself
    /// when the hold ends. After that, release is as usual. A lock the watchdog renewed after
    /// its guard was reported lost, and so gives back, is kept to the hold the same way: the
    /// holder was told it lost the lock, but no other owner takes it before the hold ends.
    /// `hold` must not exceed the TTL
    /// ([`LockError::InvalidTtl`] otherwise). The rest is rounded up to the next whole
    /// millisecond plus one (servers count leases in whole milliseconds), on etcd to whole
    /// seconds, and kept at least [`MIN_TTL`](crate::MIN_TTL): the lock never frees before
    /// the hold ends.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
    /// use std::time::Duration;
    /// let locker = dlock_runtime::Locker::memory();
    /// let guard = locker
    ///     .lock("job:nightly-report")
    ///     .ttl(Duration::from_secs(60))
    ///     .hold_at_least(Duration::from_secs(30))
    ///     .acquire()
    ///     .await?;
    /// guard.release().await?; // done early: the lock stays until 30 s after the acquire
    /// assert!(locker.lock("job:nightly-report").try_acquire().await?.is_none());
    /// # Ok(()) }
    /// ```
    pub fn hold_at_least(mut self, hold: Duration) -> Self {
        self.hold_at_least = Some(hold);
        self
    }

    /// The lock's name in metrics and traces: a bounded name for a family of keys (the
    /// attribute passes its key template, e.g. `order:<id>`), never the key itself, so the
    /// number of metric series stays bounded. Default: [`UNNAMED`](crate::metrics::UNNAMED).
    pub fn name(mut self, name: &'static str) -> Self {
        self.name = name;
        self
    }

    /// What this request takes: [`LockKind::Exclusive`] from [`Locker::lock`].
    pub fn kind(&self) -> LockKind {
        self.kind
    }

    /// The checked key, TTL and name of what this request takes; [`LockError::Reentrant`] when
    /// the current task already holds the key through this locker.
    fn target(&mut self) -> Result<(LockKey, Duration, ResourceName), LockError> {
        let locker = self.locker;
        let key = std::mem::replace(&mut self.key, Err(LockError::NoLocker))?;
        let ttl = validate_ttl(self.ttl.unwrap_or(locker.inner.config.default_ttl))?;
        match self.kind {
            LockKind::Semaphore { permits: 0 } => {
                return Err(LockError::InvalidPermits { permits: 0 })
            }
            LockKind::Exclusive => {}
            // Replica acknowledgement renews and waits on a lock's key only.
            _ if self.replicas.unwrap_or(locker.inner.config.replicas) > 0 => {
                return Err(LockError::unsupported(
                    locker.backend().name(),
                    "replica acknowledgement of semaphores and read-write locks",
                ))
            }
            _ => {}
        }
        if let Some(hold) = self.hold_at_least {
            if hold > ttl {
                return Err(LockError::InvalidTtl {
                    ttl,
                    reason: format!("hold_at_least ({hold:?}) must not exceed the ttl"),
                });
            }
        }
        // Any hold of the same lock by this task would make this request wait for itself: a
        // read or write hold for either mode of a read-write lock (probing with `Read` finds
        // both), any permit of the semaphore, the lock itself.
        let probe = match self.kind {
            LockKind::Read | LockKind::Write => LockKind::Read,
            kind => kind,
        };
        match crate::context::reentered(locker.id(), &key, probe) {
            // Lost (or its lease ran out): what the task would re-enter is gone.
            Some((_, watch, _)) if !watch.is_held() => return Err(LockError::lost(key.as_str())),
            Some(_) => return Err(LockError::reentrant(key.as_str())),
            None => {}
        }
        let resource = locker.resource(key.clone()).with_kind(self.kind);
        Ok((key, ttl, resource))
    }

    /// Acquires the lock with the request's strategy.
    ///
    /// Fails with [`LockError::Reentrant`] when the current task already holds `key` through
    /// `#[distributed_lock]` or [`with_lock`](crate::with_lock) on this locker: waiting would
    /// wait for itself. (Nested attribute calls re-enter instead; a guard merely kept in a
    /// variable is not known to the task — wrap the work in [`with_lock`](crate::with_lock).)
    ///
    /// Fails with [`LockError::Lost`] when the grant's answer came after the lease it granted
    /// had run out (a round trip slower than the TTL, a frozen process): a guard is never
    /// handed out not holding its lock. (A wait through outages,
    /// [`RetryPolicy::through_outages`](crate::RetryPolicy::through_outages), asks again.)
    ///
    /// Cancel-safe: dropping this future at any point never leaves the lock held without a
    /// guard — whatever reached the backend is undone in the background (and a queued waiter
    /// leaves the queue).
    pub async fn acquire(self) -> Result<LockGuard, LockError> {
        let (labels, start) = (self.locker.labels(self.name), Instant::now());
        let out = self.acquire_inner().await;
        labels.finished(out.as_ref().map(|_| true), start);
        out
    }

    async fn acquire_inner(mut self) -> Result<LockGuard, LockError> {
        let locker = self.locker;
        let (key, ttl, resource) = self.target()?;
        let on_fail = self
            .on_fail
            .clone()
            .unwrap_or_else(|| locker.inner.config.on_fail.clone());
        let span = tracing::debug_span!(
            "dlock.acquire",
            key = %locker.key_log().show(key.as_str()),
            name = self.name,
            backend = locker.backend_name(),
        );
        let take = Take::new(locker, ttl, &self);
        match on_fail {
            // `acquire` has no work to defer: one attempt, like Reject.
            OnFail::Reject | OnFail::Defer(_) => {
                match attempt_once(locker, resource.clone(), take)
                    .instrument(span)
                    .await?
                {
                    Ok(guard) => Ok(guard),
                    Err(remaining) => Err(LockError::contended(resource.key().as_str(), remaining)),
                }
            }
            OnFail::Retry(policy) => {
                wait_for(locker, resource, take, policy)
                    .instrument(span)
                    .await
            }
        }
    }

    /// One attempt, whatever the strategy: `Ok(None)` when someone else holds the lock;
    /// [`LockError::Lost`] when the grant's answer came after its lease had run out (see
    /// [`acquire`](LockRequest::acquire)).
    pub async fn try_acquire(self) -> Result<Option<LockGuard>, LockError> {
        let (labels, start) = (self.locker.labels(self.name), Instant::now());
        let out = self.try_acquire_inner().await;
        labels.finished(out.as_ref().map(Option::is_some), start);
        out
    }

    async fn try_acquire_inner(mut self) -> Result<Option<LockGuard>, LockError> {
        let locker = self.locker;
        let (key, ttl, resource) = self.target()?;
        let span = tracing::debug_span!(
            "dlock.try_acquire",
            key = %locker.key_log().show(key.as_str()),
            name = self.name,
            backend = locker.backend_name(),
        );
        let take = Take::new(locker, ttl, &self);
        Ok(attempt_once(locker, resource, take)
            .instrument(span)
            .await?
            .ok())
    }

    /// Skip-if-running, for scheduled jobs (ShedLock's use case): one attempt; when the lock is
    /// free, runs `work` under it (visible to [`current_lock`](crate::current_lock)), releases
    /// it and returns `Ok(Some(output))`; when another owner holds it, returns `Ok(None)` at
    /// once without running `work` — another instance is doing the job. Errors (backend down,
    /// invalid key) are returned as usual. Combine with [`hold_at_least`](Self::hold_at_least)
    /// so that an instance whose clock is a little behind does not run the same tick again.
    ///
    /// ShedLock's `lockAtMostFor` — a lock that ends after a fixed time, even while its job still
    /// runs — is [`auto_renew(false)`](Self::auto_renew) with that TTL: renewed (the default),
    /// the lock lasts as long as `work` does, and ends within one TTL only if this process dies.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
    /// use std::time::Duration;
    /// let locker = dlock_runtime::Locker::memory();
    /// let ran = locker
    ///     .lock("job:cleanup")
    ///     .hold_at_least(Duration::from_secs(5))
    ///     .run_or_skip(async { "cleaned" })
    ///     .await?;
    /// assert_eq!(ran, Some("cleaned"));
    /// // Within the 5 s hold, another instance skips the tick.
    /// assert_eq!(locker.lock("job:cleanup").run_or_skip(async { "again" }).await?, None);
    /// # Ok(()) }
    /// ```
    pub async fn run_or_skip<F: Future>(self, work: F) -> Result<Option<F::Output>, LockError> {
        let locker = self.locker;
        let Some(guard) = self.try_acquire().await? else {
            return Ok(None);
        };
        Ok(Some(run_under(locker, guard, work).await))
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
    pub async fn run<F>(mut self, work: F) -> Result<F::Output, LockError>
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
            return Ok(run_under(locker, guard, work).await);
        };
        let (labels, start, name) = (locker.labels(self.name), Instant::now(), self.name);
        let taken = async {
            let (key, ttl, resource) = self.target()?;
            let take = Take::new(locker, ttl, &self);
            Ok((attempt_once(locker, resource, take).await?, key, ttl))
        }
        .await;
        let (attempted, key, ttl) = match taken {
            Ok(taken) => taken,
            Err(e) => {
                labels.finished(Err(&e), start);
                return Err(e);
            }
        };
        if let Ok(guard) = attempted {
            labels.finished(Ok(true), start);
            return Ok(run_under(locker, guard, work).await);
        }
        let pushed = locker.inner.defer.push(
            key.as_str(),
            name,
            policy,
            Box::new(LockedWork {
                locker: Held::Live(locker.clone()),
                key: key.clone(),
                kind: self.kind,
                ttl,
                auto_renew: self.auto_renew,
                replicas: self.replicas,
                hold_at_least: self.hold_at_least,
                name,
                work: Box::pin(async move {
                    let _ = work.await;
                }),
            }),
        );
        let err = match pushed {
            Ok(job_id) => LockError::Deferred {
                key: key.as_str().to_owned(),
                job_id,
            },
            Err(e) => e,
        };
        labels.finished(Err(&err), start);
        Err(err)
    }
}

/// Runs `work` holding `guard` (visible to [`current_lock`](crate::current_lock)), then
/// releases it.
async fn run_under<F: Future>(locker: &Locker, guard: LockGuard, work: F) -> F::Output {
    let out = crate::context::scope(locker.id(), guard.info(), guard.loss_watch(), work).await;
    if let Err(e) = guard.release().await {
        tracing::warn!(
            error = %locker.trace_error(&e),
            "dlock: lock was not cleanly released after the work finished"
        );
    }
    out
}

/// Deferred work under its lock: what the in-process [`DeferQueue`](crate::defer::DeferQueue)
/// attempts when the work's turn comes, with the options of the request it came from (a
/// deferred run is protected as an immediate one would have been).
struct LockedWork {
    locker: Held,
    key: LockKey,
    kind: LockKind,
    ttl: Duration,
    auto_renew: bool,
    replicas: Option<u32>,
    hold_at_least: Option<Duration>,
    name: &'static str,
    work: BoxFuture<'static, ()>,
}

/// The locker of a [`LockedWork`]: held while the work may run, and not while it is a dead
/// letter (nothing but a handle of the locker can requeue it).
enum Held {
    Live(Locker),
    Parked(super::WeakLocker),
}

impl LockedWork {
    /// The work's locker, held again if it was parked; `None` when it is gone.
    fn live(&mut self) -> Option<Locker> {
        if let Held::Parked(weak) = &self.locker {
            self.locker = Held::Live(weak.upgrade()?);
        }
        match &self.locker {
            Held::Live(locker) => Some(locker.clone()),
            Held::Parked(_) => None,
        }
    }
}

impl crate::defer::DeferredWork for LockedWork {
    fn dead(&mut self) {
        if let Held::Live(locker) = &self.locker {
            self.locker = Held::Parked(locker.downgrade());
        }
    }

    fn revive(&mut self) -> bool {
        self.live().is_some()
    }

    fn attempt(mut self: Box<Self>) -> BoxFuture<'static, crate::defer::Attempted> {
        use crate::defer::NotRun;
        Box::pin(async move {
            let Some(locker) = self.live() else {
                let gone = LockError::unavailable("the locker of this deferred work is gone", None);
                return Err((
                    self as Box<dyn crate::defer::DeferredWork>,
                    NotRun::Failed(gone),
                ));
            };
            let mut request = locker
                .request(self.key.clone(), self.kind)
                .ttl(self.ttl)
                .auto_renew(self.auto_renew)
                .name(self.name);
            request.replicas = self.replicas;
            request.hold_at_least = self.hold_at_least;
            let attempt = request.try_acquire().await;
            match attempt {
                Ok(Some(guard)) => {
                    run_under(&locker, guard, self.work).await;
                    Ok(())
                }
                Ok(None) => Err((self as Box<dyn crate::defer::DeferredWork>, NotRun::Busy)),
                Err(e) => {
                    tracing::debug!(
                        error = %locker.trace_error(&e),
                        "dlock: deferred attempt could not reach the backend"
                    );
                    Err((
                        self as Box<dyn crate::defer::DeferredWork>,
                        NotRun::Failed(e),
                    ))
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

/// What a request takes: the lease it asks for, whether the watchdog renews it, and how many
/// replicas must have it ([`LockRequest::replicas`]).
#[derive(Clone, Copy, Debug)]
struct Take {
    ttl: Duration,
    auto_renew: bool,
    replicas: u32,
    hold_at_least: Option<Duration>,
    /// The request's metric labels.
    labels: crate::metrics::Labels,
}

impl Take {
    fn new(locker: &Locker, ttl: Duration, request: &LockRequest<'_>) -> Self {
        Take {
            ttl,
            auto_renew: request.auto_renew,
            replicas: request.replicas.unwrap_or(locker.inner.config.replicas),
            hold_at_least: request.hold_at_least,
            labels: locker.labels(request.name),
        }
    }
}

/// One acquire attempt: `Ok(grant)` when the lock is ours, `Err(remaining)` when someone else
/// holds it (or is ahead in the queue).
async fn attempt(
    locker: &Locker,
    flight: &mut Undo<'_>,
    take: Take,
    mode: WaitMode,
) -> Result<Result<Grant, Option<Duration>>, LockError> {
    let sent_ns = locker.watchdog().now_ns();
    take.labels.attempt();
    flight.next_attempt();
    let args = AcquireArgs {
        resource: flight.resource(),
        token: flight.token(),
        ttl: take.ttl,
        mode,
        waiter_ttl: locker.waiter_ttl_for(take.ttl),
        renew: take.auto_renew,
        sent: flight.slot(),
    };
    let backend = locker.backend();
    let asked = match args.resource.kind() {
        LockKind::Exclusive => backend.acquire(args),
        _ => backend.acquire_kind(args),
    };
    let out = locker.with_deadline("acquire", asked).await?;
    Ok(match out {
        Attempt::Acquired { fencing_token } => Ok(Grant {
            fencing_token,
            ttl: take.ttl,
            lease: take.ttl,
            sent_ns,
            auto_renew: take.auto_renew,
            labels: take.labels,
        }),
        Attempt::Held { remaining } => {
            locker.note_contention(flight.resource().key(), remaining);
            Err(remaining)
        }
    })
}

/// The guard of a granted lock, once as many replicas as the request asks for have it.
///
/// A lock handed over by a release may come with a lease shorter than `ttl` (see
/// [`Backend::watch`](crate::backend::Backend::watch)): the watchdog renews it to `ttl` in time;
/// without auto-renewal it is extended to `ttl` here, so the caller gets the lease it asked for.
async fn hold(
    locker: &Locker,
    mut flight: Undo<'_>,
    mut grant: Grant,
    take: Take,
) -> Result<LockGuard, LockError> {
    acknowledged(locker, &mut flight, &mut grant, take).await?;
    held(locker, flight, grant, take).await
}

/// The replica acknowledgement a request asks for ([`LockRequest::replicas`]), if any: when it
/// fails, the lock has been given back (see [`replicated`]).
async fn acknowledged(
    locker: &Locker,
    flight: &mut Undo<'_>,
    grant: &mut Grant,
    take: Take,
) -> Result<(), LockError> {
    if take.replicas > 0 {
        replicated(locker, flight, grant.ttl, take.replicas).await?;
        // The renewal sent before `WAIT` set the whole lease; counting it from the grant's
        // request is conservative.
        grant.lease = grant.ttl;
    }
    Ok(())
}

/// [`hold`] once the replicas, if any, have acknowledged the grant.
async fn held(
    locker: &Locker,
    flight: Undo<'_>,
    grant: Grant,
    take: Take,
) -> Result<LockGuard, LockError> {
    let (ttl, short) = (grant.ttl, grant.lease < grant.ttl && !grant.auto_renew);
    let mut guard = LockGuard::new(flight.into_lease(grant, locker.id()));
    if short {
        // Before the hold is set: a guard dropped here (an error, or this future dropped) is
        // released at once, not kept for a hold whose work never ran.
        guard.extend(ttl).await?;
    }
    if !guard.is_held() {
        // The grant's answer came after the lease it granted had run out (an answer slower
        // than the TTL, or a frozen process): a guard that does not hold the lock is never
        // handed out. Given back, in case the lock is still ours on the backend.
        let key = guard.key().to_owned();
        let _ = guard.give_back().await;
        return Err(LockError::lost(&key));
    }
    if let Some(hold) = take.hold_at_least {
        guard.hold_at_least(hold);
    }
    Ok(guard)
}

/// Waits until `replicas` replicas have the lock the flight's token holds. When fewer
/// acknowledge it (or the backend cannot tell), the lock is given back — at once, so the
/// caller's next move finds it free, or by the armed undo in the background — and the error
/// is returned.
async fn replicated(
    locker: &Locker,
    flight: &mut Undo<'_>,
    ttl: Duration,
    replicas: u32,
) -> Result<(), LockError> {
    let backend = locker.backend();
    let asked = backend.replicate(flight.resource(), flight.token(), ttl, replicas);
    let err = match locker.with_deadline("replicate", asked).await {
        Ok(acked) if acked >= replicas => return Ok(()),
        Ok(acked) => LockError::unavailable(
            format!(
                "lock `{}` reached {acked} of the {replicas} replicas asked for in time",
                flight.resource().key()
            ),
            None,
        ),
        Err(e) => e,
    };
    let undo = backend.abandon(flight.resource(), flight.token());
    if locker.with_deadline("abandon", undo).await.is_ok() {
        flight.disarm();
    }
    Err(err)
}

/// One attempt without queueing. `Err(remaining)` when held by someone else.
async fn attempt_once(
    locker: &Locker,
    resource: ResourceName,
    take: Take,
) -> Result<Result<LockGuard, Option<Duration>>, LockError> {
    let mut flight = Undo::new(locker.watchdog(), resource, take.ttl);
    // The reply is in: nothing is left to undo unless we hold the lock, and then the guard
    // takes over.
    let out = attempt(locker, &mut flight, take, WaitMode::Try).await;
    match refused(&mut flight, out)? {
        Ok(grant) => Ok(Ok(hold(locker, flight, grant, take).await?)),
        Err(remaining) => {
            flight.disarm();
            Ok(Err(remaining))
        }
    }
}

async fn wait_for(
    locker: &Locker,
    resource: ResourceName,
    take: Take,
    policy: RetryPolicy,
) -> Result<LockGuard, LockError> {
    // The deadline on tokio's clock, which the sleeps below are on: under a paused clock (a
    // test's `start_paused`) the wait ends by that clock. On the real clock it never did — the
    // runtime moved its clock through every sleep at once, and the waiter asked in a loop
    // until the real deadline.
    let start = tokio::time::Instant::now();
    // A wait past what the clock can count (`Duration::MAX` for "as long as it takes") waits
    // a century instead of overflowing.
    let deadline = start
        .checked_add(policy.wait)
        .unwrap_or_else(|| start + crate::util::CENTURY);
    let mode = if policy.fair {
        WaitMode::Queue
    } else {
        WaitMode::Barge
    };
    // Armed until the guard exists: a timeout, an error or a dropped future leaves the queue
    // and undoes whatever the last attempt may have taken.
    let waiter_ttl = locker.waiter_ttl_for(take.ttl);
    // A lock handed over by a release comes with a lease this long, so that a waiter that died
    // holds it no longer than its queue entry would have held up the queue (on Redis and
    // Postgres it also ends no later than the entry would have; the entry's deadline is the
    // waiter TTL from the last attempt, so counted from that attempt, as below, the lease is
    // never shorter).
    let handoff_lease = take.ttl.min(waiter_ttl);
    let horizon = take.ttl.max(waiter_ttl);
    let mut flight = Undo::new(locker.watchdog(), resource, horizon);
    let refresh = waiter_ttl / 3;
    let mut watch: Option<Watch> = None;
    // Counted in `Locker::waiting` from its first sleep: by then the waiter is queued,
    // subscribed, and has asked since subscribing, so a release from then on wakes it.
    let mut counted: Option<WaitingCount<'_>> = None;
    let mut step = 0u32;
    let fifo = policy.fair && locker.backend().fifo();
    // When the last attempt that found the lock held was sent. A handoff taken is one noted
    // after that attempt's answer (those noted before are dropped, below): the release that
    // made it came after the attempt reached the backend, so the handed-over lease is counted
    // from then — never later than it really started.
    let mut asked_ns;
    // When a release last woke this waiter: the handoff time runs from there.
    let mut woken: Option<Instant> = None;
    let handoff = |woken: Option<Instant>| {
        if let Some(at) = woken {
            take.labels.handoff(at.elapsed());
        }
    };
    // The pause after an answer that the backend is down (with `lost_too`, also after a grant
    // that vanished before it was handed out as a guard), when the policy waits through
    // outages and the deadline leaves time (slept by `outage_pause`): `Err` ends the wait with
    // that answer. Never longer
    // than the refresh interval: the queue entry lives a waiter TTL from the last attempt that
    // reached the backend, so a longer pause after a slow or refused answer (a backend that
    // is up again, or never was down: one timed-out reply) lets the entry lapse — the waiter
    // loses its place, and a release meanwhile hands it a lock it sleeps through. A subscribed
    // waiter also ends the pause when it is notified (a release, a handoff): it asks again at
    // once.
    let outage = |err: LockError, step: u32, lost_too: bool| {
        let retry = policy.through_outages && (err.is_unavailable() || (lost_too && err.is_lost()));
        let pause = retry
            .then(|| deadline.checked_duration_since(tokio::time::Instant::now()))
            .flatten()
            .filter(|left| !left.is_zero())
            .map(|left| {
                policy
                    .backoff_step(step)
                    .max(crate::util::OUTAGE_PAUSE)
                    .min(refresh)
                    .min(left)
            });
        let Some(pause) = pause else { return Err(err) };
        tracing::debug!(error = %err, ?pause, "backend unavailable: waiting through the outage");
        Ok(pause)
    };
    'ask: loop {
        // A grant, from an attempt or handed over by a release; every other way through the
        // loop asks again.
        let mut grant = 'granted: {
            if watch.is_none() && locker.backend().listening(flight.resource()) {
                // The backend already listens for this lock's releases: watch first (no round
                // trip), and this attempt misses no release after it — no attempt again once
                // the watch is made, as below. Failing, the watch is made after the attempt,
                // as below.
                let watched = locker.backend().watch(flight.resource(), flight.token());
                if let Ok(w) = locker.with_deadline("subscribe", watched).await {
                    if !fifo {
                        w.set_barging();
                    }
                    watch = Some(w);
                }
            }
            asked_ns = locker.watchdog().now_ns();
            let out = attempt(locker, &mut flight, take, mode).await;
            let remaining = match refused(&mut flight, out) {
                Ok(Ok(grant)) => {
                    // A release that woke this waiter while its attempt was on the way (it
                    // woke on its timer, or had just subscribed) freed the lock the attempt
                    // took: a handoff too, counted from when the attempt was sent.
                    if woken.is_none() && watch.as_ref().is_some_and(Watch::take_notification) {
                        woken = Some(locker.watchdog().instant_at(asked_ns).into_std());
                    }
                    break 'granted grant;
                }
                Ok(Err(remaining)) => remaining,
                Err(err) => {
                    // The attempt may have taken the lock: the flight stays armed, and the
                    // next attempt by the same token is granted it.
                    woken = None;
                    outage_pause(outage(err, step, false)?, watch.as_ref()).await;
                    step = step.saturating_add(1);
                    continue 'ask;
                }
            };
            let now = tokio::time::Instant::now();
            // A handoff noted before this answer came is stale: had it still stood when the
            // attempt reached the backend, the attempt would have found the lock this
            // waiter's and been granted it. On one Redis server (or Sentinel's master) the
            // pushes come on the attempt's connection, in order, so one that came first was
            // published before the attempt ran; taken, it made a second holder once its lease
            // had lapsed and another waiter had the lock. Backends whose notifications come on
            // another connection only wake the waiter (see `Backend`'s module docs). (redis-rs's
            // connection manager hands pushes to a task of its own: one read just before this
            // answer may still be on its way to the hub; the Redis backend tells the hub how
            // old a grant may be and still be stale — `ReleaseHub::set_floor`.)
            if let Some(w) = &watch {
                let _ = w.take_handoff();
            }
            if now >= deadline {
                return Err(time_out(locker, &mut flight, now - start, remaining).await);
            }
            let Some(w) = &watch else {
                // Subscribe, then attempt again at once: a release between the first attempt
                // and the subscription is caught by that attempt, any later one by the
                // notification.
                let subscribed = locker
                    .with_deadline(
                        "subscribe",
                        locker.backend().watch(flight.resource(), flight.token()),
                    )
                    .await;
                match subscribed {
                    Ok(w) => {
                        if !fifo {
                            w.set_barging();
                        }
                        watch = Some(w);
                    }
                    Err(err) => {
                        outage_pause(outage(err, step, false)?, watch.as_ref()).await;
                        step = step.saturating_add(1);
                    }
                }
                // No attempt starts after the deadline, which subscribing may have passed
                // (asked again then, a slow backend stretched the wait by three command
                // timeouts: the subscription, the attempt, and leaving the queue).
                let now = tokio::time::Instant::now();
                if now >= deadline {
                    return Err(time_out(locker, &mut flight, now - start, remaining).await);
                }
                continue 'ask;
            };
            let mut sleep = policy.backoff_step(step).min(refresh).min(deadline - now);
            if let Some(r) = remaining {
                // Wake when the holder's lease ends, in case it dies without releasing.
                sleep = sleep.min(r.saturating_add(Duration::from_millis(1)));
            }
            step = step.saturating_add(1);
            if counted.is_none() {
                counted = Some(WaitingCount::enter(locker, take.labels));
            }
            tokio::select! {
                // A notification wins over a timer that ran out at the same time.
                biased;
                // A fair waiter is woken alone, when it is first: start over. Barging waiters
                // (Redlock) are woken together; keeping their backoff avoids a lockstep retry.
                _ = w.notified() => {
                    woken = Some(Instant::now());
                    if fifo { step = 0; }
                }
                _ = tokio::time::sleep(sleep) => { woken = None; }
            }
            match handed_over(&watch, take, handoff_lease, asked_ns) {
                Some(grant) if mostly_left(locker, &grant) => break 'granted grant,
                // Handed over with less than half its lease left by the local clock, which
                // counts it from the last attempt (up to a refresh ago, longer than a TTL
                // under the waiter TTL's third): the lock is this token's on the backend, and
                // asking again is granted it with the lease restarted — rather than a guard
                // about to lapse, or none (`Lost`) when it had already.
                Some(_) | None => continue 'ask,
            }
        };
        handoff(woken);
        if let Err(err) = acknowledged(locker, &mut flight, &mut grant, take).await {
            // Given back, and out of the queue: the same token asks again (a fair waiter
            // queues again), or the wait ends. When the give-back went unanswered (the flight
            // is still armed), a new token asks: that give-back may still land, after a new
            // grant to the same token, and free it under its guard. The old flight, dropped,
            // gives back in the background.
            woken = None;
            let unsure = flight.is_armed();
            outage_pause(outage(err, step, true)?, watch.as_ref()).await;
            step = step.saturating_add(1);
            if unsure {
                let resource = flight.resource().clone();
                flight = Undo::new(locker.watchdog(), resource, horizon);
                watch = None;
            } else {
                flight.arm();
            }
            continue 'ask;
        }
        // Kept for a wait through outages, which asks again with a new token if the guard
        // fails before it is handed out.
        let again = policy.through_outages.then(|| flight.resource().clone());
        match held(locker, flight, grant, take).await {
            Ok(guard) => return Ok(guard),
            Err(err) => {
                // The guard was made and dropped, its release under way in the background: a
                // new token asks, so that release cannot free the next grant.
                let Some(resource) = again else {
                    return Err(err);
                };
                woken = None;
                outage_pause(outage(err, step, true)?, None).await;
                step = step.saturating_add(1);
                flight = Undo::new(locker.watchdog(), resource, horizon);
                watch = None;
            }
        }
    }
}

/// Leaves the queue before reporting, so the caller's next move sees it gone, and answers the
/// wait's timeout (`remaining`: the holder's lease left, as the last attempt saw it).
async fn time_out(
    locker: &Locker,
    flight: &mut Undo<'_>,
    waited: Duration,
    remaining: Option<Duration>,
) -> LockError {
    let undo = locker.backend().abandon(flight.resource(), flight.token());
    if locker.with_deadline("abandon", undo).await.is_ok() {
        flight.disarm();
    }
    LockError::timeout(flight.resource().key().as_str(), waited, remaining)
}

/// Sleeps an outage pause; a subscribed waiter also wakes when notified (a release, a
/// handoff), to ask again at once.
async fn outage_pause(pause: Duration, watch: Option<&Watch>) {
    match watch {
        Some(w) => tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = w.notified() => {}
        },
        None => tokio::time::sleep(pause).await,
    }
}

/// An attempt's outcome; a backend that refused the kind ([`LockError::Unsupported`]) took
/// nothing, so there is nothing to undo.
fn refused<T>(flight: &mut Undo<'_>, out: Result<T, LockError>) -> Result<T, LockError> {
    flight.noted();
    if matches!(&out, Err(e) if e.is_unsupported()) {
        flight.disarm();
    }
    out
}

/// Whether at least half of the grant's lease is left by the local clock.
fn mostly_left(locker: &Locker, grant: &Grant) -> bool {
    let lease = u64::try_from(grant.lease.as_nanos()).unwrap_or(u64::MAX);
    let end = grant.sent_ns.saturating_add(lease);
    end.saturating_sub(locker.watchdog().now_ns()) >= lease / 2
}

/// The grant of a lock that a release handed to this waiter (direct handoff), if one did.
fn handed_over(watch: &Option<Watch>, take: Take, lease: Duration, asked_ns: u64) -> Option<Grant> {
    let fencing_token = watch.as_ref()?.take_handoff()?;
    Some(Grant {
        fencing_token,
        ttl: take.ttl,
        lease,
        sent_ns: asked_ns,
        auto_renew: take.auto_renew,
        labels: take.labels,
    })
}

/// Counts a task in [`Locker::waiting`] (and the `dlock_waiters` gauge) while it lives.
struct WaitingCount<'a>(&'a Locker, crate::metrics::Labels);

impl<'a> WaitingCount<'a> {
    fn enter(locker: &'a Locker, labels: crate::metrics::Labels) -> Self {
        locker.inner.waiting.fetch_add(1, Ordering::AcqRel);
        labels.waiting(true);
        WaitingCount(locker, labels)
    }
}

impl Drop for WaitingCount<'_> {
    fn drop(&mut self) {
        self.0.inner.waiting.fetch_sub(1, Ordering::AcqRel);
        self.1.waiting(false);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A dead letter lets go of its locker: once every handle of a locker is dropped, the
    /// locker goes (its backend connections, watchdog and queue task with it) even while its
    /// in-process queue holds a dead letter, which only a handle of it could requeue. Before,
    /// the dead letter kept the locker alive for its whole retention (7 days by default). A
    /// dead letter requeued through a live handle runs as before.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_letter_does_not_keep_its_dropped_locker_alive() {
        let locker = Locker::memory();
        let ran = std::sync::Arc::new(AtomicUsize::new(0));
        let held = locker.lock("k").acquire().await.unwrap();
        let defer = || {
            let ran = ran.clone();
            locker
                .lock("k")
                .on_fail(OnFail::defer(Duration::from_millis(1), 1))
                .run(async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                })
        };
        let dead_letter = async |locker: &Locker| {
            tokio::time::timeout(Duration::from_secs(10), async {
                loop {
                    if let Some(job) = locker.defer_queue().dead_letters().pop() {
                        return job;
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await
            .expect("a dead letter")
        };
        assert!(defer().await.unwrap_err().is_deferred());
        let first = dead_letter(&locker).await;
        held.release().await.unwrap();
        // Requeued through a live handle, it runs.
        assert!(locker.defer_queue().requeue(&first.id));
        tokio::time::timeout(Duration::from_secs(10), async {
            while ran.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the requeued job ran");

        let held = locker.lock("k").acquire().await.unwrap();
        assert!(defer().await.unwrap_err().is_deferred());
        dead_letter(&locker).await;
        held.release().await.unwrap();
        let weak = std::sync::Arc::downgrade(&locker.inner);
        drop(locker);
        tokio::time::timeout(Duration::from_secs(10), async {
            while weak.strong_count() > 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the dropped locker was kept alive by its dead letter");
    }

    #[tokio::test]
    async fn a_by_hand_acquire_of_a_lock_the_task_holds_is_a_typed_error() {
        let locker = Locker::memory();
        let guard = locker.lock("k").acquire().await.unwrap();
        crate::with_lock(&guard, async {
            for err in [
                locker.lock("k").acquire().await.unwrap_err(),
                locker.lock("k").try_acquire().await.unwrap_err(),
                locker.lock("k").run(async {}).await.unwrap_err(),
            ] {
                assert!(err.is_reentrant(), "{err}");
            }
            // Another key, and the same key on another locker, are not re-entrant.
            assert!(locker.lock("other").try_acquire().await.unwrap().is_some());
            assert!(Locker::memory()
                .lock("k")
                .try_acquire()
                .await
                .unwrap()
                .is_some());
        })
        .await;
        guard.release().await.unwrap();
    }

    #[tokio::test]
    async fn hold_at_least_longer_than_the_ttl_is_refused() {
        let locker = Locker::memory();
        let err = locker
            .lock("k")
            .ttl(Duration::from_secs(1))
            .hold_at_least(Duration::from_secs(2))
            .acquire()
            .await
            .unwrap_err();
        assert!(matches!(err, LockError::InvalidTtl { .. }), "{err}");
    }

    #[tokio::test]
    async fn a_dropped_guard_keeps_its_minimum_hold_too() {
        let locker = Locker::memory();
        let hold = Duration::from_millis(300);
        let taken = Instant::now();
        let guard = locker
            .lock("k")
            .ttl(Duration::from_secs(10))
            .hold_at_least(hold)
            .acquire()
            .await
            .unwrap();
        drop(guard);
        loop {
            match locker.lock("k").try_acquire().await.unwrap() {
                Some(_) => break,
                None => assert!(taken.elapsed() < Duration::from_secs(3), "never freed"),
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(taken.elapsed() >= hold, "freed after {:?}", taken.elapsed());
    }

    #[tokio::test]
    async fn run_or_skip_skips_a_held_lock_without_running() {
        let locker = Locker::memory();
        let held = locker.lock("job").acquire().await.unwrap();
        let ran = std::sync::atomic::AtomicBool::new(false);
        let out = locker
            .lock("job")
            .run_or_skip(async { ran.store(true, Ordering::SeqCst) })
            .await
            .unwrap();
        assert!(out.is_none());
        assert!(!ran.load(Ordering::SeqCst));
        held.release().await.unwrap();
        let out = locker
            .lock("job")
            .run_or_skip(async { crate::current_lock().map(|l| l.key().to_owned()) })
            .await
            .unwrap();
        assert_eq!(out, Some(Some("job".to_owned())));
    }

    /// A wait under tokio's paused clock (a test's `start_paused`) ends by that clock:
    /// `retry(10 s)` against a held lock times out after 10 s of the test's time, having asked
    /// a handful of times. Before, its deadline was on the real clock while it slept on tokio's:
    /// the runtime moved its clock through every sleep at once, and the waiter asked in a loop
    /// for 10 real seconds — hundreds of thousands of attempts.
    #[tokio::test(start_paused = true)]
    async fn a_wait_under_a_paused_clock_ends_by_that_clock() {
        let (locker, outage) = outage_locker();
        let held = locker
            .lock("k")
            .ttl(Duration::from_secs(60))
            .auto_renew(false)
            .acquire()
            .await
            .unwrap();
        let before = outage.attempts.load(Ordering::SeqCst);
        let start = tokio::time::Instant::now();
        let err = locker
            .lock("k")
            .on_fail(OnFail::retry(Duration::from_secs(10)))
            .acquire()
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert!(
            start.elapsed() >= Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
        let asked = outage.attempts.load(Ordering::SeqCst) - before;
        assert!(asked < 100, "{asked} attempts in a 10 s wait");
        drop(held);
    }

    /// `Locker::waiting` counts a waiter only once a release would wake it: after it
    /// subscribed and asked again. Counted at the subscription, a release made as soon as the
    /// waiter showed up could come before that second attempt, which then simply took the lock
    /// — no wake, no handoff recorded (the metrics example failed in CI on it).
    #[tokio::test]
    async fn a_waiter_is_counted_once_a_release_would_wake_it() {
        let (locker, outage) = outage_locker();
        let attempts = &outage.attempts;
        let held = locker.lock("k").acquire().await.unwrap();
        let before = attempts.load(Ordering::SeqCst);
        let waiter = tokio::spawn({
            let locker = locker.clone();
            async move {
                locker
                    .lock("k")
                    .on_fail(OnFail::retry(Duration::from_secs(10)))
                    .acquire()
                    .await
            }
        });
        while locker.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        // Its first attempt, and the one after subscribing.
        assert_eq!(attempts.load(Ordering::SeqCst) - before, 2);
        held.release().await.unwrap();
        let guard = waiter.await.unwrap().unwrap();
        assert_eq!(locker.waiting(), 0);
        guard.release().await.unwrap();
    }

    /// The in-memory backend behind a link: each attempt is counted and takes a turn of the
    /// scheduler first, as a round trip to a server would. It can fail: the next
    /// `lost_replies` attempts are made and then answered `Unavailable` (the reply lost: the
    /// lock may have been taken), and the next `failed_watches` subscriptions fail. Replicas: every replica acknowledges, except
    /// that the next `failed_acks` replica waits answer `Unavailable` and the next `lost_acks`
    /// find the grant gone (`Lost`). The next `failed_extends` extends answer `Unavailable`.
    /// With `hand_over`, a release hands the lock to the last subscribed waiter (a lease of the
    /// waiter's queue entry) and tells it so, as Redis does.
    #[derive(Default)]
    struct Outage {
        inner: crate::backend::MemoryBackend,
        attempts: AtomicUsize,
        lost_replies: AtomicUsize,
        failed_watches: AtomicUsize,
        failed_acks: AtomicUsize,
        lost_acks: AtomicUsize,
        failed_extends: AtomicUsize,
        failed_abandons: AtomicUsize,
        /// The next `unsent` attempts fail before they are sent (no connection), which their
        /// send mark tells.
        unsent: AtomicUsize,
        /// The next `held_back` attempts wait unsent (as for a pooled connection) in a task of
        /// their own that outlives the request's wait; once the request has given up on one,
        /// the task asks its send mark whether it may still send, and notes the answer in
        /// `late_sends` (signalled after each).
        held_back: AtomicUsize,
        late_sends: std::sync::Mutex<Vec<bool>>,
        late_seen: tokio::sync::Notify,
        /// The owner token of every abandon that reached the backend, in order; signalled
        /// after each.
        abandoned: std::sync::Mutex<Vec<String>>,
        abandon_seen: tokio::sync::Notify,
        /// The owner token of every acquire attempt, in order.
        tokens: std::sync::Mutex<Vec<String>>,
        hand_over: std::sync::atomic::AtomicBool,
        /// While set, attempts and abandons are refused for good (`Misconfigured`, an ACL
        /// without the lock keys); `refused_abandons` counts the abandons refused.
        refused: std::sync::atomic::AtomicBool,
        refused_abandons: AtomicUsize,
        /// How long each attempt, watch and abandon takes (a slow backend); when each attempt
        /// started is noted in `started`.
        slow: std::sync::Mutex<Duration>,
        started: std::sync::Mutex<Vec<tokio::time::Instant>>,
        hub: std::sync::Arc<crate::backend::ReleaseHub>,
        subscribed: std::sync::Mutex<Option<crate::backend::OwnerToken>>,
    }

    fn take_one(n: &AtomicUsize) -> bool {
        n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    impl crate::backend::Backend for std::sync::Arc<Outage> {
        fn name(&self) -> &'static str {
            "outage"
        }

        fn acquire<'a>(
            &'a self,
            args: AcquireArgs<'a>,
        ) -> BoxFuture<'a, Result<Attempt, LockError>> {
            Box::pin(async move {
                self.started
                    .lock()
                    .unwrap()
                    .push(tokio::time::Instant::now());
                let slow = *self.slow.lock().unwrap();
                tokio::time::sleep(slow).await;
                tokio::task::yield_now().await;
                let slot = args.sent.expect("an acquire attempt has a send slot");
                if self.refused.load(Ordering::SeqCst) {
                    return Err(LockError::misconfigured("NOPERM", None));
                }
                if take_one(&self.unsent) {
                    slot.hold();
                    return Err(LockError::unavailable("connection refused", None));
                }
                if take_one(&self.held_back) {
                    let (mark, me) = (slot.hold(), self.clone());
                    let task = tokio::spawn(async move {
                        mark.sealed().await;
                        let sent = mark.send();
                        me.late_sends.lock().unwrap().push(sent);
                        me.late_seen.notify_one();
                        sent
                    });
                    return match task.await {
                        Ok(true) => Err(LockError::unavailable("sent late", None)),
                        _ => Err(LockError::unavailable("given up on", None)),
                    };
                }
                self.attempts.fetch_add(1, Ordering::SeqCst);
                self.tokens
                    .lock()
                    .unwrap()
                    .push(args.token.as_str().to_owned());
                let out = self.inner.acquire(args).await;
                if take_one(&self.lost_replies) {
                    return Err(LockError::unavailable("the reply was lost", None));
                }
                out
            })
        }

        fn release<'a>(
            &'a self,
            resource: &'a ResourceName,
            token: &'a crate::backend::OwnerToken,
        ) -> BoxFuture<'a, Result<bool, LockError>> {
            Box::pin(async move {
                let released = self.inner.release(resource, token).await?;
                let next = self.subscribed.lock().unwrap().take();
                if let Some(next) = next.filter(|_| released) {
                    let args = AcquireArgs {
                        resource,
                        token: &next,
                        ttl: Duration::from_secs(1),
                        mode: WaitMode::Queue,
                        waiter_ttl: Duration::from_secs(1),
                        renew: false,
                        sent: None,
                    };
                    let Attempt::Acquired { fencing_token } = self.inner.acquire(args).await?
                    else {
                        panic!("the head waiter was not granted the released lock");
                    };
                    self.hub
                        .hand_over(resource.as_str(), next.as_str(), fencing_token);
                }
                Ok(released)
            })
        }

        fn extend<'a>(
            &'a self,
            resource: &'a ResourceName,
            token: &'a crate::backend::OwnerToken,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<bool, LockError>> {
            if take_one(&self.failed_extends) {
                return Box::pin(async { Err(LockError::unavailable("down", None)) });
            }
            self.inner.extend(resource, token, ttl)
        }

        fn abandon<'a>(
            &'a self,
            resource: &'a ResourceName,
            token: &'a crate::backend::OwnerToken,
        ) -> BoxFuture<'a, Result<(), LockError>> {
            if take_one(&self.failed_abandons) {
                return Box::pin(async { Err(LockError::unavailable("no answer", None)) });
            }
            if self.refused.load(Ordering::SeqCst) {
                self.refused_abandons.fetch_add(1, Ordering::SeqCst);
                return Box::pin(async { Err(LockError::misconfigured("NOPERM", None)) });
            }
            let slow = *self.slow.lock().unwrap();
            Box::pin(async move {
                tokio::time::sleep(slow).await;
                let out = self.inner.abandon(resource, token).await;
                (self.abandoned.lock().unwrap()).push(token.as_str().to_owned());
                self.abandon_seen.notify_one();
                out
            })
        }

        fn watch<'a>(
            &'a self,
            resource: &'a ResourceName,
            token: &'a crate::backend::OwnerToken,
        ) -> BoxFuture<'a, Result<Watch, LockError>> {
            if take_one(&self.failed_watches) {
                return Box::pin(async { Err(LockError::unavailable("down", None)) });
            }
            if self.hand_over.load(Ordering::SeqCst) {
                *self.subscribed.lock().unwrap() = Some(token.clone());
                let (watch, _) = self.hub.register(resource, token, None);
                return Box::pin(async { Ok(watch) });
            }
            let slow = *self.slow.lock().unwrap();
            Box::pin(async move {
                tokio::time::sleep(slow).await;
                self.inner.watch(resource, token).await
            })
        }

        fn replicate<'a>(
            &'a self,
            _resource: &'a ResourceName,
            _token: &'a crate::backend::OwnerToken,
            _ttl: Duration,
            replicas: u32,
        ) -> BoxFuture<'a, Result<u32, LockError>> {
            let (failed, lost) = (take_one(&self.failed_acks), take_one(&self.lost_acks));
            Box::pin(async move {
                if failed {
                    return Err(LockError::unavailable("no replica answered", None));
                }
                if lost {
                    return Err(LockError::lost("k"));
                }
                Ok(replicas)
            })
        }
    }

    fn outage_locker() -> (Locker, std::sync::Arc<Outage>) {
        let outage = std::sync::Arc::new(Outage::default());
        (Locker::builder().build(outage.clone()), outage)
    }

    fn through_outages(wait: Duration) -> OnFail {
        OnFail::Retry(
            RetryPolicy::new(wait)
                .backoff(Duration::from_millis(1), Duration::from_millis(5))
                .through_outages(true),
        )
    }

    /// Attempts whose replies were lost took the lock: waiting through the outage, the next
    /// attempt by the same token is granted it — one holder, nothing left behind.
    #[tokio::test]
    async fn a_wait_through_outages_gets_the_lock_its_unanswered_attempts_took() {
        let (locker, outage) = outage_locker();
        outage.lost_replies.store(3, Ordering::SeqCst);
        let guard = locker
            .lock("k")
            .on_fail(through_outages(Duration::from_secs(10)))
            .acquire()
            .await
            .expect("granted once the backend answers");
        assert_eq!(outage.attempts.load(Ordering::SeqCst), 4);
        assert!(locker.lock("k").try_acquire().await.unwrap().is_none());
        guard.release().await.unwrap();
        let again = locker.lock("k").try_acquire().await.unwrap();
        assert!(again.is_some(), "the lock was left taken");
    }

    /// An attempt that failed before it was sent (no connection to send it on), or that its
    /// request gave up on while it waited to be sent, took nothing and queued nothing: it is
    /// not sent afterwards, and no undo goes out for it. One whose reply was lost is undone.
    /// (After an outage, the undos of every attempt refused at connect came due at once and
    /// held up the live requests behind them; under a burst, acquires that timed out queued
    /// for a pooled connection went out late, and their undos queued behind them.)
    #[tokio::test]
    async fn an_attempt_that_was_never_sent_is_not_undone() {
        let outage = std::sync::Arc::new(Outage::default());
        let locker = Locker::builder()
            .command_timeout(Duration::from_millis(50))
            .build(outage.clone());
        outage.unsent.store(1, Ordering::SeqCst);
        let err = locker.lock("k").try_acquire().await.unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        assert_eq!(outage.attempts.load(Ordering::SeqCst), 0, "it was sent");
        // Given up on (timed out) while it waited to be sent: it is not sent afterwards.
        outage.held_back.store(1, Ordering::SeqCst);
        let err = locker.lock("k").try_acquire().await.unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        tokio::time::timeout(Duration::from_secs(10), async {
            while outage.late_sends.lock().unwrap().is_empty() {
                outage.late_seen.notified().await;
            }
        })
        .await
        .expect("the held-back attempt is told its request gave up on it");
        assert_eq!(*outage.late_sends.lock().unwrap(), [false], "sent late");
        outage.lost_replies.store(1, Ordering::SeqCst);
        let err = locker.lock("k").try_acquire().await.unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        let lost = outage.tokens.lock().unwrap()[0].clone();
        // Undos go out in order: once the lost reply's is in, an undo of the unsent attempt
        // would have been too.
        tokio::time::timeout(Duration::from_secs(10), async {
            while !outage.abandoned.lock().unwrap().contains(&lost) {
                outage.abandon_seen.notified().await;
            }
        })
        .await
        .expect("the attempt whose reply was lost is undone");
        assert_eq!(*outage.abandoned.lock().unwrap(), [lost]);
        assert!(locker.lock("k").try_acquire().await.unwrap().is_some());
    }

    /// A waiter whose subscription fails during an outage subscribes again and is woken by the
    /// release.
    #[tokio::test]
    async fn a_wait_through_outages_subscribes_again() {
        let (locker, outage) = outage_locker();
        let held = locker.lock("k").acquire().await.unwrap();
        outage.failed_watches.store(2, Ordering::SeqCst);
        let waiter = tokio::spawn({
            let locker = locker.clone();
            async move {
                locker
                    .lock("k")
                    .on_fail(through_outages(Duration::from_secs(10)))
                    .acquire()
                    .await
            }
        });
        while locker.waiting() == 0 {
            assert!(!waiter.is_finished(), "the waiter gave up");
            tokio::task::yield_now().await;
        }
        assert_eq!(outage.failed_watches.load(Ordering::SeqCst), 0);
        held.release().await.unwrap();
        let guard = waiter.await.unwrap().expect("woken by the release");
        guard.release().await.unwrap();
    }

    /// No attempt starts after a wait's deadline, so a slow backend stretches the wait past it
    /// by up to two command timeouts (an attempt on its way, then leaving the queue). An
    /// attempt answered "held" before the deadline was followed by the subscription, and then
    /// by one more attempt, already past the deadline: three.
    #[tokio::test]
    async fn no_attempt_starts_after_the_deadline_once_subscribed() {
        let outage = std::sync::Arc::new(Outage::default());
        let timeout = Duration::from_secs(1);
        let locker = Locker::builder()
            .command_timeout(timeout)
            .build(outage.clone());
        let held = locker.lock("k").acquire().await.unwrap();
        // The attempt is answered "held" at 600 ms, the subscription at 1,200 ms: past the
        // 1 s deadline.
        *outage.slow.lock().unwrap() = Duration::from_millis(600);
        outage.started.lock().unwrap().clear();
        let start = tokio::time::Instant::now();
        let err = locker
            .lock("k")
            .on_fail(OnFail::Retry(RetryPolicy::new(timeout)))
            .acquire()
            .await
            .expect_err("the lock is held throughout");
        assert!(err.is_timeout(), "{err}");
        let late: Vec<Duration> = outage
            .started
            .lock()
            .unwrap()
            .iter()
            .map(|t| *t - start)
            .filter(|&at| at >= timeout)
            .collect();
        assert!(
            late.is_empty(),
            "attempts started past the deadline: {late:?}"
        );
        assert!(
            start.elapsed() <= timeout * 3,
            "the wait ended {:?} after it began",
            start.elapsed()
        );
        *outage.slow.lock().unwrap() = Duration::ZERO;
        held.release().await.unwrap();
    }

    /// A backend that refuses for good (an ACL without the lock keys, a role without the
    /// schema's privileges): the refused attempt's undo, sent in the background, is refused the
    /// same way and given up at once. Retried until the lease's end, every refused request left
    /// a task sending it every second for as long as the TTL — at a thousand requests a second,
    /// tens of thousands of tasks and as many commands a second while the refusal lasted.
    #[tokio::test(start_paused = true)]
    async fn an_undo_refused_for_good_is_not_retried() {
        let (locker, outage) = outage_locker();
        outage.refused.store(true, Ordering::SeqCst);
        let err = locker
            .lock("k")
            .ttl(Duration::from_secs(10))
            .try_acquire()
            .await
            .expect_err("taken from a backend that refuses");
        assert!(err.is_misconfigured(), "{err}");
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert_eq!(outage.refused_abandons.load(Ordering::SeqCst), 1);
    }

    /// Replicas that do not acknowledge a grant in time, and a give-back of the grant whose
    /// outcome is unknown (it was not answered): the wait through outages asks again with a
    /// new owner token. A late give-back by the old token cannot free a grant to the new one
    /// under its guard; with the same token, it could — two holders.
    #[tokio::test]
    async fn a_give_back_of_unknown_outcome_is_followed_by_a_new_token() {
        let (locker, outage) = outage_locker();
        outage.failed_acks.store(1, Ordering::SeqCst);
        outage.failed_abandons.store(1, Ordering::SeqCst);
        let guard = locker
            .lock("k")
            .replicas(1)
            .on_fail(through_outages(Duration::from_secs(10)))
            .acquire()
            .await
            .expect("granted once the replicas acknowledge");
        let tokens = outage.tokens.lock().unwrap().clone();
        assert!(tokens.len() >= 2, "{tokens:?}");
        assert!(
            tokens[1..].iter().all(|t| *t != tokens[0]),
            "the token whose give-back went unanswered asked again: {tokens:?}"
        );
        guard.release().await.unwrap();
        assert!(locker.lock("k").try_acquire().await.unwrap().is_some());
    }

    /// Replicas that do not acknowledge a grant in time: the lock is given back, and a wait
    /// through outages takes it again and asks them again; by default the wait ends (503) with
    /// the lock given back.
    #[tokio::test]
    async fn a_wait_through_outages_asks_the_replicas_again() {
        let (locker, outage) = outage_locker();
        let acknowledged = |on_fail| locker.lock("k").replicas(1).on_fail(on_fail).acquire();
        outage.failed_acks.store(2, Ordering::SeqCst);
        let guard = acknowledged(through_outages(Duration::from_secs(10)))
            .await
            .expect("granted once the replicas acknowledge");
        assert_eq!(outage.attempts.load(Ordering::SeqCst), 3);
        assert_eq!(outage.failed_acks.load(Ordering::SeqCst), 0);
        guard.release().await.unwrap();

        // A grant gone before its replicas were asked (a master that failed over): taken anew.
        outage.lost_acks.store(1, Ordering::SeqCst);
        let guard = acknowledged(through_outages(Duration::from_secs(10)))
            .await
            .expect("granted anew after the grant was lost");
        assert_eq!(outage.lost_acks.load(Ordering::SeqCst), 0);
        guard.release().await.unwrap();

        outage.failed_acks.store(1, Ordering::SeqCst);
        let err = acknowledged(OnFail::retry(Duration::from_secs(10)))
            .await
            .unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        let again = locker.lock("k").try_acquire().await.unwrap();
        assert!(
            again.is_some(),
            "the unacknowledged lock was not given back"
        );
    }

    /// A lock handed over with a short lease, not renewed by the watchdog, is extended to its
    /// TTL before the guard is handed out; when that extend finds the backend down, the guard
    /// is dropped (its release under way) and a wait through outages asks again with a new
    /// token — by default the wait ends there (503).
    #[tokio::test]
    async fn a_wait_through_outages_asks_anew_when_a_handed_over_lease_cannot_be_extended() {
        for through in [true, false] {
            let outage = std::sync::Arc::new(Outage::default());
            outage.hand_over.store(true, Ordering::SeqCst);
            let locker = Locker::builder()
                .waiter_ttl(Duration::from_secs(1))
                .build(outage.clone());
            let held = locker.lock("k").acquire().await.unwrap();
            let waiter = tokio::spawn({
                let locker = locker.clone();
                let on_fail = if through {
                    through_outages(Duration::from_secs(10))
                } else {
                    OnFail::retry(Duration::from_secs(10))
                };
                async move {
                    let request = locker.lock("k").ttl(Duration::from_secs(10));
                    request.auto_renew(false).on_fail(on_fail).acquire().await
                }
            });
            while locker.waiting() == 0 {
                assert!(!waiter.is_finished(), "the waiter gave up");
                tokio::task::yield_now().await;
            }
            outage.failed_extends.store(1, Ordering::SeqCst);
            held.release().await.unwrap();
            let out = waiter.await.unwrap();
            assert_eq!(outage.failed_extends.load(Ordering::SeqCst), 0);
            if !through {
                let err = out.unwrap_err();
                assert!(err.is_unavailable(), "{err}");
                continue;
            }
            let guard = out.expect("granted to the new token");
            assert!(guard.is_held());
            assert!(locker.lock("k").try_acquire().await.unwrap().is_none());
            guard.release().await.unwrap();
            assert!(locker.lock("k").try_acquire().await.unwrap().is_some());
        }
    }

    /// A lock handed over long after the waiter's last attempt — a TTL (20 ms) shorter than
    /// the time between attempts (a third of the 300 ms waiter TTL) — is asked for again and
    /// granted with its lease restarted; before, the handed-over lease, counted from that
    /// attempt, had run out and the wait ended `Lost`. (How many attempts that takes is not
    /// asserted: on a loaded machine the waiter's 100 ms timer may fire before the release,
    /// and whether the handoff is then taken or asked for again depends on the gap.)
    #[tokio::test]
    async fn a_handoff_whose_lease_ran_out_since_the_last_attempt_is_asked_for_again() {
        let (locker, outage) = outage_locker();
        outage.hand_over.store(true, Ordering::SeqCst);
        let held = locker.lock("k").acquire().await.unwrap();
        let waiter = tokio::spawn({
            let locker = locker.clone();
            async move {
                let policy = RetryPolicy::new(Duration::from_secs(10))
                    .backoff(Duration::from_millis(100), Duration::from_millis(100))
                    .jitter(false);
                let request = locker.lock("k").ttl(Duration::from_millis(20));
                request.on_fail(OnFail::Retry(policy)).acquire().await
            }
        });
        while locker.waiting() == 0 {
            assert!(!waiter.is_finished(), "the waiter gave up");
            tokio::task::yield_now().await;
        }
        // The handed-over lease (20 ms from the last attempt) runs out before the release.
        tokio::time::sleep(Duration::from_millis(50)).await;
        held.release().await.unwrap();
        let guard = waiter.await.unwrap().expect("granted");
        assert!(guard.is_held());
        guard.release().await.unwrap();
    }

    /// By default the first answer that the backend is down ends the wait (503), from an
    /// attempt or from the subscription.
    /// A wait through outages listens for its notification while it pauses after an outage
    /// answer: a lock handed to it then is taken at once, not when the pause ends (up to a
    /// third of its waiter TTL, here 1.67 s of the paused clock).
    #[tokio::test(start_paused = true)]
    async fn a_wait_through_outages_takes_a_handoff_during_its_pause() {
        let (locker, outage) = outage_locker();
        outage.hand_over.store(true, Ordering::SeqCst);
        let held = locker.lock("k").acquire().await.unwrap();
        let waiter = tokio::spawn({
            let locker = locker.clone();
            async move {
                let patient = RetryPolicy::new(Duration::from_secs(60))
                    .backoff(Duration::from_secs(10), Duration::from_secs(10))
                    .jitter(false)
                    .through_outages(true);
                locker
                    .lock("k")
                    .on_fail(OnFail::Retry(patient))
                    .acquire()
                    .await
            }
        });
        while locker.waiting() == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Its next attempt's reply is lost: it pauses before asking again.
        let before = outage.attempts.load(Ordering::SeqCst);
        outage.lost_replies.store(1, Ordering::SeqCst);
        while outage.lost_replies.load(Ordering::SeqCst) == 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(outage.attempts.load(Ordering::SeqCst), before + 1);
        let released = tokio::time::Instant::now();
        held.release().await.unwrap();
        let guard = waiter.await.unwrap().unwrap();
        let took = released.elapsed();
        assert!(
            took < Duration::from_millis(100),
            "took the handed lock after {took:?}"
        );
        guard.release().await.unwrap();
    }

    #[tokio::test]
    async fn by_default_an_outage_ends_the_wait() {
        let (locker, outage) = outage_locker();
        outage.lost_replies.store(1, Ordering::SeqCst);
        let err = locker
            .lock("a")
            .on_fail(OnFail::retry(Duration::from_secs(10)))
            .acquire()
            .await
            .unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        assert_eq!(outage.attempts.load(Ordering::SeqCst), 1);

        let held = locker.lock("b").acquire().await.unwrap();
        outage.failed_watches.store(1, Ordering::SeqCst);
        let err = locker
            .lock("b")
            .on_fail(OnFail::retry(Duration::from_secs(10)))
            .acquire()
            .await
            .unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        held.release().await.unwrap();
    }

    /// A deadline that passes during the outage ends the wait with `Unavailable` (whether the
    /// lock was free is not known), not `Timeout`; what the unanswered attempts took is given
    /// back.
    #[tokio::test]
    async fn a_deadline_in_an_outage_is_unavailable_and_gives_the_lock_back() {
        let (locker, outage) = outage_locker();
        outage.lost_replies.store(usize::MAX, Ordering::SeqCst);
        let err = locker
            .lock("k")
            .ttl(Duration::from_secs(30))
            .on_fail(through_outages(Duration::from_millis(50)))
            .acquire()
            .await
            .unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        assert!(outage.attempts.load(Ordering::SeqCst) > 1);
        outage.lost_replies.store(0, Ordering::SeqCst);
        // The undo runs in the background; the 30 s lease would hold the lock far longer.
        let start = Instant::now();
        while locker.lock("k").try_acquire().await.unwrap().is_none() {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "the lock taken by the unanswered attempts was not given back"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// `Duration::MAX` is how a caller says "wait as long as it takes": it waits, it does not
    /// overflow the deadline's `Instant` (it panicked).
    #[tokio::test]
    async fn a_wait_of_duration_max_waits_for_the_lock() {
        let locker = Locker::memory();
        let free = locker
            .lock("k")
            .on_fail(OnFail::retry(Duration::MAX))
            .acquire()
            .await
            .unwrap();
        let waiter = tokio::spawn({
            let locker = locker.clone();
            async move {
                locker
                    .lock("k")
                    .on_fail(OnFail::retry(Duration::MAX))
                    .acquire()
                    .await
            }
        });
        while locker.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        free.release().await.unwrap();
        let guard = waiter.await.unwrap().unwrap();
        guard.release().await.unwrap();
    }

    /// A deferred job whose attempts find the backend down (503) is tried again at least
    /// `OUTAGE_PAUSE` apart, whatever its delay: such attempts are not counted, so the step
    /// never grows, and a delay of zero asked the backend in a busy loop for as long as the
    /// outage lasted (thousands of attempts in the window below).
    #[tokio::test]
    async fn a_deferred_job_is_not_tried_in_a_busy_loop_while_the_backend_is_down() {
        let (locker, outage) = outage_locker();
        let held = locker.lock("k").acquire().await.unwrap();
        let out = locker
            .lock("k")
            .on_fail(OnFail::defer(Duration::ZERO, 3))
            .run(async {})
            .await;
        assert!(out.unwrap_err().is_deferred());
        // Before the queue's task runs (this test's runtime has one thread, and this task has
        // not yielded since): every attempt of the job finds the backend down.
        outage.unsent.store(1_000_000, Ordering::SeqCst);
        let tried = || 1_000_000 - outage.unsent.load(Ordering::SeqCst);
        let (start, at_start) = (Instant::now(), tried());
        // A window of time to count attempts in (nothing to wait for: the point is how many
        // attempts fit in it).
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (n, took) = (tried() - at_start, start.elapsed());
        // `OUTAGE_PAUSE` apart, on a timer of whole milliseconds: over 9 ms.
        let most = took.as_millis() / (crate::util::OUTAGE_PAUSE.as_millis() - 1) + 1;
        assert!(
            (1..=most as usize).contains(&n),
            "{n} attempts in {took:?} (at most {most})"
        );
        assert!(locker.defer_queue().dead_letters().is_empty());
        assert_eq!(locker.defer_queue().pending().len(), 1);
        outage.unsent.store(0, Ordering::SeqCst);
        drop(held);
    }

    /// Deferred work runs under the options of the request it came from: here its minimum
    /// hold, which keeps the lock after the work finished (the deferred attempt dropped it, so
    /// the lock freed as soon as the deferred work was done).
    #[tokio::test]
    async fn deferred_work_keeps_the_requests_minimum_hold() {
        let locker = Locker::memory();
        let held = locker.lock("job").acquire().await.unwrap();
        let (ran_tx, ran_rx) = tokio::sync::oneshot::channel();
        let out = locker
            .lock("job")
            .ttl(Duration::from_secs(10))
            .hold_at_least(Duration::from_secs(5))
            .on_fail(OnFail::defer(Duration::from_millis(5), 100))
            .run(async move {
                let _ = ran_tx.send(());
            })
            .await;
        assert!(out.unwrap_err().is_deferred());
        held.release().await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), ran_rx)
            .await
            .expect("the deferred work ran")
            .unwrap();
        // The work is done and its guard released at once after it; within the hold, the lock
        // stays taken.
        let until = Instant::now() + Duration::from_millis(500);
        while Instant::now() < until {
            assert!(
                locker.lock("job").try_acquire().await.unwrap().is_none(),
                "the deferred run's lock freed before its minimum hold ended"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A backend that answers every attempt "held", and hands the lock over (as a release's
    /// push would) just before answering its `handoff_at`-th attempt: a handoff that came
    /// before an attempt's "held" answer was made before that attempt ran, so it is stale.
    struct StaleHandoff {
        hub: std::sync::Arc<crate::backend::ReleaseHub>,
        attempts: AtomicUsize,
        handoff_at: usize,
        /// The holder's remaining lease its "held" answers report.
        remaining: Option<Duration>,
    }

    impl crate::backend::Backend for StaleHandoff {
        fn name(&self) -> &'static str {
            "stale-handoff"
        }

        fn acquire<'a>(
            &'a self,
            args: crate::backend::AcquireArgs<'a>,
        ) -> BoxFuture<'a, Result<crate::backend::Attempt, LockError>> {
            if self.attempts.fetch_add(1, Ordering::SeqCst) + 1 == self.handoff_at {
                self.hub
                    .hand_over(args.resource.as_str(), args.token.as_str(), 7);
            }
            Box::pin(std::future::ready(Ok(crate::backend::Attempt::Held {
                remaining: self.remaining,
            })))
        }

        fn release<'a>(
            &'a self,
            _: &'a crate::key::ResourceName,
            _: &'a crate::backend::OwnerToken,
        ) -> BoxFuture<'a, Result<bool, LockError>> {
            Box::pin(std::future::ready(Ok(false)))
        }

        fn extend<'a>(
            &'a self,
            _: &'a crate::key::ResourceName,
            _: &'a crate::backend::OwnerToken,
            _: Duration,
        ) -> BoxFuture<'a, Result<bool, LockError>> {
            Box::pin(std::future::ready(Ok(false)))
        }

        fn abandon<'a>(
            &'a self,
            _: &'a crate::key::ResourceName,
            _: &'a crate::backend::OwnerToken,
        ) -> BoxFuture<'a, Result<(), LockError>> {
            Box::pin(std::future::ready(Ok(())))
        }

        fn watch<'a>(
            &'a self,
            resource: &'a crate::key::ResourceName,
            token: &'a crate::backend::OwnerToken,
        ) -> BoxFuture<'a, Result<Watch, LockError>> {
            let (watch, _) = self.hub.register(resource, token, None);
            Box::pin(std::future::ready(Ok(watch)))
        }
    }

    /// A handoff noted before an attempt's "held" answer is not taken: the lock was not this
    /// waiter's when the attempt ran (it was taken as a grant, a second holder).
    #[tokio::test]
    async fn a_handoff_older_than_a_held_answer_is_not_taken() {
        // Attempt 1, the subscription, attempt 2 (the handoff comes just before its answer).
        let locker = Locker::builder().build(StaleHandoff {
            hub: crate::backend::ReleaseHub::new(),
            attempts: AtomicUsize::new(0),
            handoff_at: 2,
            remaining: None,
        });
        let err = locker
            .lock("k")
            .on_fail(OnFail::retry(Duration::from_millis(300)))
            .acquire()
            .await
            .expect_err("a stale handoff was taken for a grant");
        assert!(err.is_timeout(), "{err}");
    }

    /// A backend (the trait is public) may report any remaining lease for the holder: a wait
    /// does not overflow on it, it times out.
    #[tokio::test]
    async fn a_holders_remaining_lease_of_duration_max_is_no_overflow() {
        let locker = Locker::builder().build(StaleHandoff {
            hub: crate::backend::ReleaseHub::new(),
            attempts: AtomicUsize::new(0),
            handoff_at: usize::MAX,
            remaining: Some(Duration::MAX),
        });
        let err = locker
            .lock("k")
            .on_fail(OnFail::retry(Duration::from_millis(50)))
            .acquire()
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert_eq!(err.retry_after_secs(), Some(u64::MAX));
    }

    /// The in-memory backend, counting acquire attempts, and saying [`Backend::listening`] as
    /// told (its watch never costs a round trip).
    struct Listening {
        inner: crate::backend::MemoryBackend,
        attempts: AtomicUsize,
        listening: bool,
        /// When set, the first attempt answered "held" signals `.0` and keeps its answer until
        /// `.1` is notified.
        held_gate: Option<(tokio::sync::Notify, tokio::sync::Notify)>,
    }

    impl Listening {
        fn new(listening: bool) -> Self {
            Listening {
                inner: crate::backend::MemoryBackend::new(),
                attempts: AtomicUsize::new(0),
                listening,
                held_gate: None,
            }
        }
    }

    impl crate::backend::Backend for Listening {
        fn name(&self) -> &'static str {
            "listening"
        }

        fn acquire<'a>(
            &'a self,
            args: crate::backend::AcquireArgs<'a>,
        ) -> BoxFuture<'a, Result<crate::backend::Attempt, LockError>> {
            self.attempts.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                let out = self.inner.acquire(args).await;
                if let (Some((arrived, go)), Ok(crate::backend::Attempt::Held { .. })) =
                    (&self.held_gate, &out)
                {
                    arrived.notify_one();
                    go.notified().await;
                }
                out
            })
        }

        fn release<'a>(
            &'a self,
            resource: &'a crate::key::ResourceName,
            token: &'a crate::backend::OwnerToken,
        ) -> BoxFuture<'a, Result<bool, LockError>> {
            self.inner.release(resource, token)
        }

        fn extend<'a>(
            &'a self,
            resource: &'a crate::key::ResourceName,
            token: &'a crate::backend::OwnerToken,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<bool, LockError>> {
            self.inner.extend(resource, token, ttl)
        }

        fn abandon<'a>(
            &'a self,
            resource: &'a crate::key::ResourceName,
            token: &'a crate::backend::OwnerToken,
        ) -> BoxFuture<'a, Result<(), LockError>> {
            self.inner.abandon(resource, token)
        }

        fn watch<'a>(
            &'a self,
            resource: &'a crate::key::ResourceName,
            token: &'a crate::backend::OwnerToken,
        ) -> BoxFuture<'a, Result<Watch, LockError>> {
            self.inner.watch(resource, token)
        }

        fn listening(&self, _: &crate::key::ResourceName) -> bool {
            self.listening
        }
    }

    /// A locker over `backend` with timers of a minute or more (only a release's notification
    /// wakes a waiter within a test's 5 s), the lock `k` held on it, and `waiter()`, which
    /// starts a waiter for `k`.
    async fn minute_timers(
        backend: std::sync::Arc<Listening>,
    ) -> (
        Locker,
        LockGuard,
        impl Fn() -> tokio::task::JoinHandle<Result<LockGuard, LockError>>,
    ) {
        let minute = Duration::from_secs(60);
        let locker = Locker::builder().waiter_ttl(minute * 3).build(backend);
        let held = locker.lock("k").ttl(minute).acquire().await.unwrap();
        let waiter = {
            let locker = locker.clone();
            move || {
                let locker = locker.clone();
                tokio::spawn(async move {
                    let wait = RetryPolicy::new(minute * 10)
                        .backoff(minute, minute)
                        .jitter(false);
                    locker
                        .lock("k")
                        .ttl(minute)
                        .on_fail(OnFail::Retry(wait))
                        .acquire()
                        .await
                })
            }
        };
        (locker, held, waiter)
    }

    /// A waiter on a backend already listening for the lock's releases watches before its
    /// first attempt and sleeps on that attempt's answer (one attempt); otherwise it watches
    /// after it and asks again (two). Either way the release that follows reaches it.
    #[tokio::test]
    async fn a_waiter_watches_first_where_the_backend_already_listens() {
        for (listening, asked) in [(true, 1), (false, 2)] {
            let backend = std::sync::Arc::new(Listening::new(listening));
            let (locker, held, waiter) = minute_timers(backend.clone()).await;
            let before = backend.attempts.load(Ordering::SeqCst);
            let waiter = waiter();
            // Counted as waiting from its first sleep, after its last attempt before it.
            tokio::time::timeout(Duration::from_secs(5), async {
                while locker.waiting() == 0 {
                    tokio::task::yield_now().await;
                }
            })
            .await
            .expect("the waiter went to sleep");
            assert_eq!(
                backend.attempts.load(Ordering::SeqCst) - before,
                asked,
                "attempts before the first sleep, listening: {listening}"
            );
            held.release().await.unwrap();
            let guard = tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("the release woke the waiter")
                .unwrap()
                .unwrap();
            guard.release().await.unwrap();
        }
    }

    /// A waiter that watched first hears a release that lands after its attempt ran and
    /// before its answer came: it was watching already (a watch made after the answer, with no
    /// attempt again, would sleep through it — here for a minute).
    #[tokio::test]
    async fn a_waiter_that_watched_first_hears_a_release_right_after_its_attempt() {
        let backend = std::sync::Arc::new(Listening {
            held_gate: Some((tokio::sync::Notify::new(), tokio::sync::Notify::new())),
            ..Listening::new(true)
        });
        // The holder's attempt is granted: the gate does not hold it.
        let (_locker, held, waiter) = minute_timers(backend.clone()).await;
        let waiter = waiter();
        let (arrived, go) = backend.held_gate.as_ref().unwrap();
        tokio::time::timeout(Duration::from_secs(5), arrived.notified())
            .await
            .expect("the waiter's attempt was answered \"held\"");
        held.release().await.unwrap();
        go.notify_one();
        let guard = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter slept through the release")
            .unwrap()
            .unwrap();
        guard.release().await.unwrap();
    }
}
