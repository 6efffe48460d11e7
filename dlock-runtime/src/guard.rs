//! [`LockGuard`]: proof of holding a lock, and the handle to keep, extend, watch and release it.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use tracing::Instrument as _;

use crate::lease::Lease;
use crate::LockError;

/// A held lock.
///
/// * Renewed by the [`Locker`](crate::Locker)'s watchdog every third of its local lease (TTL/3, less
///   where the backend's lease margin shortens the local lease) while held (unless the request turned
///   auto-renewal off), so a long critical section keeps its lock.
/// * [`lost`](LockGuard::lost) resolves as soon as the lock is known to be gone: an extend was
///   refused, renewal kept failing until the lease ran out, or the local lease clock ran out
///   (e.g. the process was frozen).
/// * [`release`](LockGuard::release) releases and tells you whether the lock was still yours.
/// * Dropping the guard releases it in the background without blocking the current thread;
///   the release is owner-checked, so a guard whose lock expired and was taken by someone else
///   never releases the new owner's lock. It is released even when dropped off any tokio
///   runtime, or after the runtime that ran the locker's background task shut down (the task
///   moves to a fallback thread).
#[must_use = "the lock is released when the guard is dropped"]
pub struct LockGuard {
    lease: Lease,
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("key", &self.key())
            .field("fencing_token", &self.fencing_token())
            .field("held", &self.is_held())
            .finish()
    }
}

crate::lease::lease_handle_methods!(LockGuard);

impl LockGuard {
    pub(crate) fn new(lease: Lease) -> Self {
        LockGuard { lease }
    }

    /// See [`Lease::hold_at_least`].
    pub(crate) fn hold_at_least(&mut self, hold: Duration) {
        self.lease.hold_at_least(hold);
    }

    pub(crate) fn clear_hold(&mut self) {
        self.lease.clear_hold();
    }

    #[cfg(test)]
    pub(crate) fn lease(&self) -> &Lease {
        &self.lease
    }

    /// The watch on this lock's lease that the task's held locks carry.
    pub(crate) fn loss_watch(&self) -> crate::context::Watch {
        self.lease.loss_watch()
    }

    /// A view of this lock's lease for another task (leader election's `is_leader`).
    pub(crate) fn probe(&self) -> crate::lease::LeaseProbe {
        self.lease.probe()
    }

    pub(crate) fn locker_id(&self) -> u64 {
        self.lease.locker_id()
    }

    /// The time left on the local lease.
    pub fn remaining(&self) -> Duration {
        self.lease.remaining()
    }

    /// Sets the lease to `ttl` from now (owner-checked), and makes `ttl` the lease the watchdog
    /// renews from now on. Fails with [`LockError::Lost`] if the lock is no longer ours — also
    /// when the local lease has run out ([`is_held`](LockGuard::is_held) is false; nothing is
    /// sent), and when [`lost`](LockGuard::lost) resolved while the extend was on its way (the
    /// local lease ran out first), whatever the backend answered: a lock once lost stays lost.
    ///
    /// `ttl` may be shorter than the current lease: after `extend` returns, the backend's
    /// expiry, the local lease ([`is_held`](LockGuard::is_held), [`remaining`](LockGuard::remaining),
    /// [`lost`](LockGuard::lost)) and the watchdog's next renewal (due a third of the new local
    /// lease later) all
    /// follow `ttl`. A watchdog renewal of this lock already on its way is waited for first, so
    /// it can never overwrite the new lease. If the backend does not answer
    /// ([`LockError::Unavailable`]), or this future is dropped before it answered, the new lease
    /// may or may not be in place: the local lease then ends at the earlier of the old and the
    /// new one, and the watchdog (if on) retries soon with `ttl`.
    pub async fn extend(&self, ttl: Duration) -> Result<(), LockError> {
        self.lease
            .extend(ttl)
            .instrument(self.lease.span("dlock.extend"))
            .await
    }

    /// Releases the lock. `Ok(())` when it was still ours; [`LockError::Lost`] when it had
    /// expired (and maybe been taken by another owner, whose lock is left alone);
    /// [`LockError::Unavailable`] when the backend did not answer in time. In that case the
    /// release is not given up: it is handed to the locker's background task, which retries
    /// it (owner-checked) until it lands or the lease has run out, so the key frees as soon as
    /// the backend is back rather than at the end of the TTL.
    ///
    /// Cancel-safe: if this future is dropped before the backend answered, the release is
    /// handed to the background task as on drop.
    ///
    /// With a minimum hold ([`LockRequest::hold_at_least`](crate::LockRequest::hold_at_least))
    /// that has not passed yet, the lock is not deleted: renewal stops and its lease is set
    /// (owner-checked) to what is left of the hold, so it frees by itself when the hold ends.
    /// Dropping the guard does the same in the background.
    pub async fn release(self) -> Result<(), LockError> {
        let lease = &self.lease;
        let backend = lease.watchdog().backend();
        // What is left of the hold is read when the step is sent, after a renewal on its way.
        lease
            .settle("release", |_| match lease.hold_left() {
                Some(left) => backend.expire(lease.resource(), lease.token(), left),
                None => backend.release(lease.resource(), lease.token()),
            })
            .instrument(lease.span("dlock.release"))
            .await
    }

    /// Releases the lock at once, whatever minimum hold it carries: a lock given back because
    /// the whole it was taken for failed (one key of [`Locker::lock_all`](crate::Locker::lock_all)
    /// was busy) was never held for the work the hold protects.
    pub(crate) async fn give_back(mut self) -> Result<(), LockError> {
        self.lease.clear_hold();
        self.release().await
    }
}

/// Runs `fut` with the lock `guard` holds visible to [`current_lock`](crate::current_lock) (and to nested
/// `#[distributed_lock]` calls, which re-enter instead of waiting for themselves).
///
/// ```
/// # async fn f(locker: dlock_runtime::Locker) -> Result<(), dlock_runtime::LockError> {
/// let guard = locker.lock("report:2026-11").acquire().await?;
/// dlock_runtime::with_lock(&guard, async {
///     assert!(dlock_runtime::current_lock().is_some());
/// })
/// .await;
/// guard.release().await?;
/// # Ok(()) }
/// ```
pub fn with_lock<'g, F: Future + 'g>(
    guard: &'g LockGuard,
    fut: F,
) -> impl Future<Output = F::Output> + 'g {
    crate::context::scope(guard.locker_id(), guard.info(), guard.loss_watch(), fut)
}
