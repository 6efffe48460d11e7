//! The lease layer: [`Lease`], one held lock as the core sees it, and [`Undo`], the one
//! undo-on-cancel guard of an attempt in flight.
//!
//! A `Lease` is the watchdog's per-lock state (owner token, fencing token, local lease clock,
//! watchdog registration, loss signal) plus the rule that ends it: one final, owner-checked step
//! (a release, or an idempotency record stored with the release) whose answer settles the lease;
//! until then, dropping it hands an owner-checked release to the watchdog's background task.
//! [`LockGuard`](crate::LockGuard) and the idempotency feature's `IdempotentOperation` are thin
//! wrappers over it, so
//! loss detection, `extend` and cancel safety are written once.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::backend::{OwnerToken, SendSlot};
use crate::context::LockInfo;
use crate::key::ResourceName;
use crate::watchdog::{Cmd, GuardState, Watchdog};
use crate::LockError;

/// The read-side methods every lease-holding handle has ([`LockGuard`](crate::LockGuard),
/// `IdempotentOperation`), forwarding to its `lease` field, so they are written once.
macro_rules! lease_handle_methods {
    ($ty:ty) => {
        impl $ty {
            /// The (encoded) logical key.
            pub fn key(&self) -> &str {
                self.lease.key()
            }

            /// What is held: a lock, a semaphore permit, a read or a write hold.
            pub fn kind(&self) -> $crate::LockKind {
                self.lease.resource().kind()
            }

            /// The fencing token of this acquisition: strictly greater than every token issued
            /// for the key before. Pass it to the resource you write so it can reject a stale
            /// holder.
            pub fn fencing_token(&self) -> u64 {
                self.lease.fencing_token()
            }

            /// Key and fencing token together.
            pub fn info(&self) -> $crate::LockInfo {
                self.lease.info()
            }

            /// Whether the lock is still held as far as this process can tell: not reported
            /// lost and the local lease (last successful renewal or extend + TTL) has not run
            /// out.
            pub fn is_held(&self) -> bool {
                self.lease.is_held()
            }

            /// Resolves when the lock is known to be gone: renewal refused, renewal failing
            /// until the lease ran out, or the local lease clock ran out (e.g. after a process
            /// freeze). Never resolves while the lock is held. Cancel-safe; may be called any
            /// number of times.
            pub async fn lost(&self) {
                self.lease.lost().await
            }

            /// Polls `fut` with this lock visible to [`current_lock`](crate::current_lock)
            /// (and to nested `#[distributed_lock]` calls, which then re-enter). For
            /// hand-written futures that own the handle, such as a middleware's response
            /// future; async code uses [`with_lock`](crate::with_lock).
            pub fn poll_scoped<F: std::future::Future + ?Sized>(
                &self,
                fut: std::pin::Pin<&mut F>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<F::Output> {
                self.lease.poll_scoped(fut, cx)
            }

            /// Runs `f` with this lock visible to [`current_lock`](crate::current_lock) (and to
            /// nested `#[distributed_lock]` calls, which then re-enter): for code that is not a
            /// future, such as a tower service's `call`, which runs before its future is first
            /// polled.
            pub fn in_scope<R>(&self, f: impl FnOnce() -> R) -> R {
                self.lease.in_scope(f)
            }
        }
    };
}
pub(crate) use lease_handle_methods;

/// One held lock (see the [module docs](self)).
pub(crate) struct Lease {
    state: Arc<GuardState>,
    watchdog: Arc<Watchdog>,
    locker_id: u64,
    /// The final step was answered (or handed to the background): drop has nothing to do.
    settled: AtomicBool,
    /// The watch on this lease that the task's held locks carry ([`Lease::loss_watch`]).
    watch: std::sync::OnceLock<crate::context::Watch>,
}

impl Lease {
    pub(crate) fn new(state: Arc<GuardState>, watchdog: Arc<Watchdog>, locker_id: u64) -> Self {
        state.held_from_now();
        Lease {
            state,
            watchdog,
            locker_id,
            settled: AtomicBool::new(false),
            watch: std::sync::OnceLock::new(),
        }
    }

    /// Keeps the lock at least `hold` from now: a release before then leaves it to expire
    /// when the hold ends (see [`LockRequest::hold_at_least`](crate::LockRequest::hold_at_least)).
    /// The hold lives in the guard state, so that the watchdog giving back a lock reported lost
    /// keeps it too.
    pub(crate) fn hold_at_least(&mut self, hold: Duration) {
        let until = self
            .watchdog
            .now_ns()
            .saturating_add(u64::try_from(hold.as_nanos()).unwrap_or(u64::MAX));
        self.state.set_hold_until(until);
    }

    /// Drops the minimum hold: the final step deletes the lock.
    pub(crate) fn clear_hold(&mut self) {
        self.state.set_hold_until(0);
    }

    /// What is left of the minimum hold, `None` once it has ended; a rest shorter than
    /// [`MIN_TTL`](crate::MIN_TTL) is kept that long (it was released at once: up to 10 ms
    /// before the hold ended). Rounded up to the next whole millisecond, and one more: servers take a lease in whole milliseconds
    /// (dropping the rest) and count it from a clock read in whole milliseconds, so the exact
    /// rest could free the lock up to 2 ms before the hold ends (seen in CI: 1.4998 s into a
    /// 1.5 s hold on Redis).
    pub(crate) fn hold_left(&self) -> Option<Duration> {
        self.state.hold_left(self.watchdog.now_ns())
    }

    /// A view of this lease's state for another task (see [`LeaseProbe`]).
    pub(crate) fn probe(&self) -> LeaseProbe {
        LeaseProbe {
            state: self.state.clone(),
            watchdog: self.watchdog.clone(),
        }
    }

    #[cfg(test)]
    pub(crate) fn state(&self) -> &GuardState {
        &self.state
    }

    pub(crate) fn watchdog(&self) -> &Arc<Watchdog> {
        &self.watchdog
    }

    pub(crate) fn locker_id(&self) -> u64 {
        self.locker_id
    }

    pub(crate) fn resource(&self) -> &ResourceName {
        &self.state.resource
    }

    pub(crate) fn token(&self) -> &OwnerToken {
        &self.state.token
    }

    /// The (encoded) logical key.
    pub(crate) fn key(&self) -> &str {
        self.state.resource.key().as_str()
    }

    pub(crate) fn fencing_token(&self) -> u64 {
        self.state.fencing_token
    }

    pub(crate) fn info(&self) -> LockInfo {
        LockInfo::new(self.state.resource.key().clone(), self.state.fencing_token)
            .with_kind(self.state.resource.kind())
    }

    /// The span of a step on this lease (`dlock.extend`, `dlock.release`, …): the key as the
    /// locker's tracing shows it, the lock's name and backend.
    pub(crate) fn span(&self, name: &'static str) -> tracing::Span {
        let key = self.watchdog.key_log().show(self.key());
        let labels = self.state.labels;
        match name {
            "dlock.extend" => {
                tracing::debug_span!("dlock.extend", key = %key, name = labels.name, backend = labels.backend)
            }
            "dlock.release" => {
                tracing::debug_span!("dlock.release", key = %key, name = labels.name, backend = labels.backend)
            }
            "dlock.idempotency.complete" => {
                tracing::debug_span!("dlock.idempotency.complete", key = %key, name = labels.name, backend = labels.backend)
            }
            _ => {
                tracing::debug_span!("dlock.idempotency.abort", key = %key, name = labels.name, backend = labels.backend)
            }
        }
    }

    /// Not reported lost, and the local lease has not run out.
    pub(crate) fn is_held(&self) -> bool {
        self.watchdog.is_held(&self.state)
    }

    /// The time left on the local lease.
    pub(crate) fn remaining(&self) -> Duration {
        let now = self.watchdog.now_ns();
        Duration::from_nanos(self.state.lease_end_ns().saturating_sub(now))
    }

    /// Sets the lease to `ttl` from now; the local lease and the watchdog follow (see
    /// [`LockGuard::extend`](crate::LockGuard::extend)).
    pub(crate) async fn extend(&self, ttl: Duration) -> Result<(), LockError> {
        crate::util::validate_ttl(ttl)?;
        self.watchdog.extend(&self.state, ttl).await
    }

    /// Resolves when the lock is known to be lost.
    pub(crate) async fn lost(&self) {
        self.watchdog.wait_lost(&self.state).await
    }

    /// Polls `fut` with this lock visible to [`current_lock`](crate::current_lock).
    pub(crate) fn in_scope<R>(&self, f: impl FnOnce() -> R) -> R {
        crate::context::in_scope(self.locker_id, self.info(), self.loss_watch(), f)
    }

    /// The watch on this lease that the task's held locks carry (made once per lease, on the
    /// first scope that shows it).
    pub(crate) fn loss_watch(&self) -> crate::context::Watch {
        self.watch
            .get_or_init(|| crate::context::watch(self.probe()))
            .clone()
    }

    pub(crate) fn poll_scoped<F: Future + ?Sized>(
        &self,
        fut: std::pin::Pin<&mut F>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        self.in_scope(|| fut.poll(cx))
    }

    /// Stops renewal, so that none can follow the final step.
    fn stop(&self) {
        self.state.done.store(true, Ordering::Release);
        self.watchdog.unschedule(&self.state);
    }

    /// The final step: stops renewal, waits for a renewal of this lock already on its way (so
    /// none can land after the step, and undo a release's shortened lease), then runs the
    /// future `step` makes — owner-checked, answering whether the lock was still ours — under
    /// the command deadline. `step` is called only then, told whether the local lease still
    /// held when this was called (a step that would do more than release — store a record — does
    /// only the release when it did not): a backend that does its work when called (the memory
    /// backend) still works after renewal stopped. Answered: the lease is
    /// settled ([`LockError::Lost`] if it was not ours, or if the local lease had run out
    /// before). Not answered: the error, and an owner-checked release goes to the background
    /// task at once, retried until it lands or the lease has run out. Dropped before either:
    /// drop hands the release to the background.
    pub(crate) async fn settle<F>(
        &self,
        what: &'static str,
        step: impl FnOnce(bool) -> F,
    ) -> Result<(), LockError>
    where
        F: Future<Output = Result<bool, LockError>>,
    {
        // A lease that had run out before this call is lost, whatever the backend answers: a
        // backend may find the lock still this owner's (nobody took it since), but the holder
        // was told it was lost, and ran without the lock's protection. Judged now, not after
        // the wait below: a renewal on its way that the backend applied but answers after the
        // local lease's end is not counted (this lease is settling), and the lock was this
        // owner's all along — judged after the wait, a release made while held answered `Lost`
        // (and an idempotent operation's `complete` stored nothing, so it ran again).
        let held_until_now = self.is_held();
        self.stop();
        // A renewal batch holds the turn from before its `done` check until its answer is in,
        // within the command timeout; the batches after `stop` leave this lock alone.
        let _turn = self.state.turn.lock().await;
        let res = self
            .watchdog
            .with_deadline(what, step(held_until_now))
            .await;
        self.settled.store(true, Ordering::Release);
        match res {
            Ok(still_ours) => self.state.settle_release(still_ours && held_until_now),
            Err(e) => {
                self.release_later();
                Err(e)
            }
        }
    }

    fn release_later(&self) {
        let (resource, token) = (self.state.resource.clone(), self.state.token.clone());
        self.watchdog.later(match self.hold_left() {
            Some(left) => Cmd::Expire(
                resource,
                token,
                crate::watchdog::lease_clock_ns()
                    .saturating_add(u64::try_from(left.as_nanos()).unwrap_or(u64::MAX)),
                // Not `left`: a backend still down when the hold ends would leave the lock to
                // its TTL; the retries go on, and release it then.
                self.state.ttl(),
                self.state.turn.clone(),
            ),
            None => Cmd::Release(resource, token, self.state.ttl()),
        });
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.state.held_until_now();
        if !self.settled.load(Ordering::Acquire) {
            self.stop();
            self.release_later();
        }
    }
}

/// A read-only view of a [`Lease`] for another task: whether it is still held, and its loss.
/// It does not keep the lock: once the lease is settled or dropped, the probe's owner must stop
/// asking it (a released lease is not reported lost).
#[derive(Clone)]
pub(crate) struct LeaseProbe {
    state: Arc<GuardState>,
    watchdog: Arc<Watchdog>,
}

impl crate::context::LossWatch for LeaseProbe {
    fn lost(&self) -> futures_util::future::BoxFuture<'_, ()> {
        Box::pin(LeaseProbe::lost(self))
    }

    fn is_held(&self) -> bool {
        LeaseProbe::is_held(self)
    }
}

impl LeaseProbe {
    /// See [`Lease::is_held`]; and not once the guard is released or dropped, whatever the
    /// lease clock says (a probe outlives its guard).
    pub(crate) fn is_held(&self) -> bool {
        !self.state.done.load(Ordering::Acquire) && self.watchdog.is_held(&self.state)
    }

    /// See [`Lease::lost`].
    pub(crate) async fn lost(&self) {
        self.watchdog.wait_lost(&self.state).await
    }
}

/// Undoes an attempt in flight (an acquire, an idempotency `begin`) if it is dropped before its
/// reply is in: the owner token is made before anything is sent, so the background task can
/// always release what the attempt may have taken and remove the queue entry it may have made.
/// It keeps trying for `horizon`, by when that lock and entry have expired on their own.
pub(crate) struct Undo<'a> {
    watchdog: &'a Arc<Watchdog>,
    resource: ResourceName,
    token: OwnerToken,
    horizon: Duration,
    armed: bool,
    /// Where the attempt under way keeps its send mark ([`Undo::next_attempt`]), if it has
    /// one.
    slot: Option<SendSlot>,
    /// Whether an attempt under this token has ended (see [`Undo::noted`]), and whether one
    /// may have reached the backend. Only a token whose every attempt was given up on before
    /// it was sent, with at least one made, has nothing to undo.
    noted: bool,
    maybe_sent: bool,
}

impl<'a> Undo<'a> {
    /// Armed, with a fresh owner token.
    pub(crate) fn new(
        watchdog: &'a Arc<Watchdog>,
        resource: ResourceName,
        horizon: Duration,
    ) -> Self {
        Undo {
            watchdog,
            resource,
            token: OwnerToken::generate(),
            horizon,
            armed: true,
            slot: None,
            noted: false,
            maybe_sent: false,
        }
    }

    /// Another attempt under this token is about to be made, with a [`slot`](Self::slot) of
    /// its own for the backend's send mark (see [`SendMark`](crate::backend::SendMark)).
    pub(crate) fn next_attempt(&mut self) {
        self.seal_mark();
        self.slot = Some(SendSlot::default());
    }

    /// The slot of the attempt under way ([`next_attempt`](Self::next_attempt)).
    pub(crate) fn slot(&self) -> Option<&SendSlot> {
        self.slot.as_ref()
    }

    /// The attempt under way has ended — answered, failed, or given up on: one whose mark is
    /// now sealed unsent will never be sent; any other may have been.
    pub(crate) fn noted(&mut self) {
        if self.slot.is_some() {
            self.seal_mark();
        } else {
            self.noted = true;
            self.maybe_sent = true;
        }
    }

    fn seal_mark(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.noted = true;
            self.maybe_sent |= slot.seal();
        }
    }

    pub(crate) fn resource(&self) -> &ResourceName {
        &self.resource
    }

    pub(crate) fn token(&self) -> &OwnerToken {
        &self.token
    }

    /// The reply is in: nothing is left to undo (or someone else now owns what was taken).
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
    }

    /// Another attempt with the same token is about to be sent.
    pub(crate) fn arm(&mut self) {
        self.armed = true;
    }

    /// Whether something sent under this token may still have to be undone.
    pub(crate) fn is_armed(&self) -> bool {
        self.armed
    }

    /// The attempt took the lock (granted with `fencing_token`, the request sent at `sent_ns`):
    /// the lease takes over from the undo, registered with the watchdog.
    pub(crate) fn into_lease(mut self, grant: Grant, locker_id: u64) -> Lease {
        self.disarm();
        let state = self.watchdog.register(
            self.resource.clone(),
            self.token.clone(),
            grant.fencing_token,
            grant.ttl,
            grant.lease,
            grant.sent_ns,
            grant.auto_renew,
            grant.labels,
        );
        Lease::new(state, self.watchdog.clone(), locker_id)
    }
}

/// What a granted attempt hands to its lease.
pub(crate) struct Grant {
    pub(crate) fencing_token: u64,
    /// The lease each renewal asks for.
    pub(crate) ttl: Duration,
    /// The lease granted now: `ttl`, or shorter for a lock handed over by a release (see
    /// [`Backend::watch`](crate::backend::Backend::watch)).
    pub(crate) lease: Duration,
    /// When the granting request was sent: the lease clock starts there.
    pub(crate) sent_ns: u64,
    pub(crate) auto_renew: bool,
    /// The request's metric labels.
    pub(crate) labels: crate::metrics::Labels,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        // An attempt dropped under way is given up on: from here, unsent, it stays unsent.
        self.seal_mark();
        // Every attempt was given up on before it was sent: the backend has nothing of this
        // token.
        let nothing_sent = self.noted && !self.maybe_sent;
        if self.armed && !nothing_sent {
            self.watchdog.later(Cmd::Abandon(
                self.resource.clone(),
                self.token.clone(),
                self.horizon,
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::hold_rest;

    #[test]
    fn a_hold_rest_is_rounded_up_to_whole_milliseconds_and_one_more() {
        let min = u64::try_from(crate::util::MIN_TTL.as_nanos()).unwrap();
        assert_eq!(hold_rest(0), None);
        // A rest under the shortest lease is kept that long, not released before the hold
        // ends.
        assert_eq!(hold_rest(1), Some(crate::util::MIN_TTL));
        assert_eq!(
            hold_rest(min - 1),
            Some(crate::util::MIN_TTL + Duration::from_millis(1))
        );
        assert_eq!(
            hold_rest(min),
            Some(crate::util::MIN_TTL + Duration::from_millis(1))
        );
        // 1.4998 s left: a server taking whole ms would keep 1499 ms from a clock read up to
        // 1 ms late, and free the lock before the hold ends.
        assert_eq!(hold_rest(1_499_758_185), Some(Duration::from_millis(1501)));
        assert_eq!(hold_rest(1_500_000_000), Some(Duration::from_millis(1501)));
    }
}
