//! [`LockRequest`]: taking one lock — one attempt, fair waiting, or deferring the work.

use std::fmt;
use std::future::{Future, IntoFuture};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tracing::Instrument as _;

use crate::backend::{AcquireArgs, Attempt, BoxFuture, WaitMode, Watch};
use crate::key::ResourceName;
use crate::lease::{Grant, Undo};
use crate::util::validate_ttl;
use crate::{LockError, LockGuard, LockKey, OnFail, RetryPolicy};

use super::Locker;

/// A request for one lock, from [`Locker::lock`]. Set options, then `acquire` (or `.await` it
/// directly) or `try_acquire`.
#[must_use = "a lock request does nothing until acquired"]
pub struct LockRequest<'a> {
    pub(super) locker: &'a Locker,
    pub(super) key: Result<LockKey, LockError>,
    pub(super) ttl: Option<Duration>,
    pub(super) on_fail: Option<OnFail>,
    pub(super) auto_renew: bool,
    pub(super) replicas: Option<u32>,
}

impl fmt::Debug for LockRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockRequest")
            .field("key", &self.key)
            .field("ttl", &self.ttl)
            .field("on_fail", &self.on_fail)
            .field("auto_renew", &self.auto_renew)
            .field("replicas", &self.replicas)
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
        let take = Take::new(locker, ttl, self.auto_renew, self.replicas);
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

    /// One attempt, whatever the strategy: `Ok(None)` when someone else holds the lock.
    pub async fn try_acquire(self) -> Result<Option<LockGuard>, LockError> {
        let locker = self.locker;
        let key = self.key?;
        let ttl = validate_ttl(self.ttl.unwrap_or(locker.inner.config.default_ttl))?;
        let span = tracing::debug_span!("dlock.try_acquire", key = %key);
        let resource = locker.resource(key);
        let take = Take::new(locker, ttl, self.auto_renew, self.replicas);
        Ok(attempt_once(locker, resource, take)
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
        let take = Take::new(locker, ttl, self.auto_renew, self.replicas);
        match attempt_once(locker, resource, take).await? {
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

/// What a request takes: the lease it asks for, whether the watchdog renews it, and how many
/// replicas must have it ([`LockRequest::replicas`]).
#[derive(Clone, Copy, Debug)]
struct Take {
    ttl: Duration,
    auto_renew: bool,
    replicas: u32,
}

impl Take {
    fn new(locker: &Locker, ttl: Duration, auto_renew: bool, replicas: Option<u32>) -> Self {
        Take {
            ttl,
            auto_renew,
            replicas: replicas.unwrap_or(locker.inner.config.replicas),
        }
    }
}

/// One acquire attempt: `Ok(grant)` when the lock is ours, `Err(remaining)` when someone else
/// holds it (or is ahead in the queue).
async fn attempt(
    locker: &Locker,
    flight: &Undo<'_>,
    take: Take,
    mode: WaitMode,
) -> Result<Result<Grant, Option<Duration>>, LockError> {
    let sent_ns = locker.watchdog().now_ns();
    let args = AcquireArgs {
        resource: flight.resource(),
        token: flight.token(),
        ttl: take.ttl,
        mode,
        waiter_ttl: locker.waiter_ttl_for(take.ttl),
    };
    let out = locker
        .with_deadline("acquire", locker.backend().acquire(args))
        .await?;
    Ok(match out {
        Attempt::Acquired { fencing_token } => Ok(Grant {
            fencing_token,
            ttl: take.ttl,
            lease: take.ttl,
            sent_ns,
            auto_renew: take.auto_renew,
        }),
        Attempt::Held { remaining } => Err(remaining),
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
    replicas: u32,
) -> Result<LockGuard, LockError> {
    if replicas > 0 {
        replicated(locker, &mut flight, grant.ttl, replicas).await?;
        // The renewal sent before `WAIT` set the whole lease; counting it from the grant's
        // request is conservative.
        grant.lease = grant.ttl;
    }
    let (ttl, short) = (grant.ttl, grant.lease < grant.ttl && !grant.auto_renew);
    let guard = LockGuard::new(flight.into_lease(grant, locker.id()));
    if short {
        guard.extend(ttl).await?;
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
    match attempt(locker, &flight, take, WaitMode::Try).await? {
        Ok(grant) => Ok(Ok(hold(locker, flight, grant, take.replicas).await?)),
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
    let start = Instant::now();
    let deadline = start + policy.wait;
    let mode = if policy.fair {
        WaitMode::Queue
    } else {
        WaitMode::Barge
    };
    // Armed until the guard exists: a timeout, an error or a dropped future leaves the queue
    // and undoes whatever the last attempt may have taken.
    let waiter_ttl = locker.waiter_ttl_for(take.ttl);
    // A lock handed over by a release comes with a lease this long, so that a waiter that died
    // holds it no longer than its queue entry would have held up the queue.
    let handoff_lease = take.ttl.min(waiter_ttl);
    let mut flight = Undo::new(locker.watchdog(), resource, take.ttl.max(waiter_ttl));
    let refresh = waiter_ttl / 3;
    let mut watch: Option<(Watch, WaitingCount<'_>)> = None;
    let mut step = 0u32;
    let fifo = policy.fair && locker.backend().fifo();
    // When the last attempt that found the lock held was sent. A release that hands the lock
    // to this waiter does so after that attempt reached the backend, so the handed-over lease
    // is counted from then: never later than it really started.
    let mut asked_ns;
    loop {
        asked_ns = locker.watchdog().now_ns();
        let remaining = match attempt(locker, &flight, take, mode).await? {
            Ok(grant) => return hold(locker, flight, grant, take.replicas).await,
            Err(remaining) => remaining,
        };
        let now = Instant::now();
        if let Some(grant) = handed_over(&watch, take, handoff_lease, asked_ns) {
            return hold(locker, flight, grant, take.replicas).await;
        }
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
            if let Some(grant) = handed_over(&watch, take, handoff_lease, asked_ns) {
                return hold(locker, flight, grant, take.replicas).await;
            }
        }
    }
}

/// The grant of a lock that a release handed to this waiter (direct handoff), if one did.
fn handed_over(
    watch: &Option<(Watch, WaitingCount<'_>)>,
    take: Take,
    lease: Duration,
    asked_ns: u64,
) -> Option<Grant> {
    let fencing_token = watch.as_ref()?.0.take_handoff()?;
    Some(Grant {
        fencing_token,
        ttl: take.ttl,
        lease,
        sent_ns: asked_ns,
        auto_renew: take.auto_renew,
    })
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
