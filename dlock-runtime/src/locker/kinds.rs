//! Semaphores and read-write locks: [`Locker::semaphore`], [`Locker::rw`]. Both are requests
//! of the same [`LockRequest`] for a different [`LockKind`], and give the same
//! [`LockGuard`](crate::LockGuard): a lease with a fencing token, watchdog renewal, `lost()`,
//! owner-checked release and release on drop (see `backend` for the rule a backend keeps).

use std::fmt;

use crate::key::LockKind;
use crate::LockRequest;

use super::{IntoLockKey, Locker};

impl Locker {
    /// Starts a request for one of the `permits` permits of the semaphore on `key`: at most
    /// `permits` guards of it live at once, across every locker of the store. Same options and
    /// guard as [`lock`](Locker::lock): a permit has a fencing token, is renewed by the
    /// watchdog, reports [`lost`](crate::LockGuard::lost), and frees within its TTL when its
    /// holder dies. Waiters ([`OnFail::Retry`](crate::OnFail::Retry)) take permits in arrival
    /// order; a release wakes the first waiter only.
    ///
    /// Every caller of one semaphore should name the same `permits` (a caller with a smaller
    /// count waits until fewer are held). Zero permits is [`LockError::InvalidPermits`](crate::LockError::InvalidPermits);
    /// a backend without semaphores (Redlock) answers [`LockError::Unsupported`](crate::LockError::Unsupported).
    /// A semaphore and a lock on the same key are independent.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
    /// use dlock_runtime::Locker;
    ///
    /// let locker = Locker::memory();
    /// let a = locker.semaphore("exports", 2).acquire().await?;
    /// let b = locker.semaphore("exports", 2).acquire().await?;
    /// assert!(locker.semaphore("exports", 2).try_acquire().await?.is_none());
    /// assert!(b.fencing_token() > a.fencing_token());
    /// a.release().await?;
    /// assert!(locker.semaphore("exports", 2).try_acquire().await?.is_some());
    /// # Ok(()) }
    /// ```
    pub fn semaphore(&self, key: impl IntoLockKey, permits: u32) -> LockRequest<'_> {
        self.request(key, LockKind::Semaphore { permits })
    }

    /// The read-write lock on `key`: [`read`](RwLockRequest::read) or
    /// [`write`](RwLockRequest::write) it.
    ///
    /// Many readers or one writer hold it at once. Waiting is FIFO across both modes, so a
    /// waiting writer blocks readers that arrive after it (a stream of readers cannot starve
    /// writers), and a writer's release wakes every reader queued at the head. That holds for a
    /// writer that waits in line — [`OnFail::Retry`](crate::OnFail::Retry) with fair waiting,
    /// the default: a `try_acquire` (or `on_fail = "reject"`) and a barging waiter
    /// ([`RetryPolicy::fair(false)`](crate::RetryPolicy::fair)) get in only when no reader
    /// holds, which readers that overlap may never allow. Fencing tokens:
    /// a writer's token is greater than the token of every reader or writer that held before
    /// it — a resource that records the highest token it has seen rejects a stale holder of
    /// either mode —, while readers have distinct tokens that only order their arrival (on
    /// etcd a reader's token is drawn when it joins the queue, so of two readers admitted
    /// together the one granted second may carry the lower token; on the other backends each
    /// hold's token is also greater than every token issued on the lock before it). A backend without read-write locks (Redlock) answers
    /// [`LockError::Unsupported`](crate::LockError::Unsupported). A read-write lock and a lock
    /// on the same key are independent.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
    /// use dlock_runtime::Locker;
    ///
    /// let locker = Locker::memory();
    /// let r1 = locker.rw("catalog").read().acquire().await?;
    /// let r2 = locker.rw("catalog").read().acquire().await?; // readers share
    /// assert!(locker.rw("catalog").write().try_acquire().await?.is_none());
    /// r1.release().await?;
    /// r2.release().await?;
    /// let w = locker.rw("catalog").write().acquire().await?; // alone
    /// assert!(locker.rw("catalog").read().try_acquire().await?.is_none());
    /// w.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn rw<K: IntoLockKey>(&self, key: K) -> RwLockRequest<'_, K> {
        RwLockRequest { locker: self, key }
    }
}

/// The read-write lock on one key, from [`Locker::rw`]: pick a mode.
#[must_use = "pick `read()` or `write()`"]
pub struct RwLockRequest<'a, K> {
    locker: &'a Locker,
    key: K,
}

impl<K> fmt::Debug for RwLockRequest<'_, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RwLockRequest").finish_non_exhaustive()
    }
}

impl<'a, K: IntoLockKey> RwLockRequest<'a, K> {
    /// A request for a read hold: shared with other readers, excluded by a writer (and by a
    /// writer waiting ahead of it).
    pub fn read(self) -> LockRequest<'a> {
        self.locker.request(self.key, LockKind::Read)
    }

    /// A request for the write hold: alone.
    pub fn write(self) -> LockRequest<'a> {
        self.locker.request(self.key, LockKind::Write)
    }
}
