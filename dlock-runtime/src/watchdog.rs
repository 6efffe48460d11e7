//! The one background task per [`Locker`](crate::Locker): watchdog renewal and deferred
//! releases.
//!
//! * **Renewal.** Held guards sit in one ordered schedule (`BTreeMap` keyed by due time), not a
//!   task or timer each. The task sleeps until the earliest due time, takes every guard due
//!   within a small batching window (5 ms, or a quarter of a short lease's renewal interval),
//!   and renews them with one [`Backend::extend_many`] call
//!   (pipelined by network backends). A renewal is due every third of the local lease (TTL/3,
//!   less a third of the backend's [lease margin](Backend::lease_margin)). A guard whose extend
//!   answers "not the owner" is lost at once; one whose extend fails keeps trying until its
//!   local lease clock (`last successful renewal + TTL`, measured from when the request was
//!   *sent*) runs out, and is then lost — which also catches a process that was frozen past its
//!   lease: on waking, the lease is checked before anything is sent. The lease clock counts
//!   time the machine spent suspended (`CLOCK_BOOTTIME` on Linux and Android; elsewhere
//!   `Instant`, which stops then), and the task looks at the schedule at least every
//!   [`SUSPEND_CHECK`] while there are guards to renew: timers run on `Instant` and fire late
//!   by the time suspended, so without it a guard woke "held" by a lease the server had let run
//!   out, and told no one until its next renewal was due. A look that finds the lease clock
//!   ahead of the timers' has every `lost` check its lease (a guard whose renewal is on its
//!   way is in no schedule); a `lost` of a guard the watchdog does not renew checks for itself
//!   as often. A minimum hold's end goes to the background release by the lease clock too.
//! * **Releases from `Drop`.** `LockGuard::drop` and the drop of a cancelled acquire cannot
//!   await; they send the owner-checked release (or abandon) to this task over an unbounded
//!   channel, which never blocks the dropping thread. A guard dropped on a thread with no
//!   runtime is released too: the task runs on the fallback thread (below) if it ran nowhere.
//!
//! Release and drop remove the guard from the schedule before the release script runs, and a
//! release (or a dropped guard's shortening within a minimum hold) waits for a renewal already
//! on its way (the guard's turn, below), so no renewal lands after it: a released lock is never
//! renewed, and a release within a minimum hold, which only shortens the lease to the hold's
//! rest, is not undone by a renewal to the full TTL. A dropped guard's plain release does not
//! wait for the turn: a renewal landing after it finds the key gone (renewals are
//! owner-checked and never make a lock). A release that goes to the background counts the
//! hold's rest anew at each try.
//!
//! * **User extends.** A guard's renewals, its user's [`extend`](crate::LockGuard::extend)
//!   calls and its release take turns (one small async mutex per guard, tried — never awaited — by the
//!   watchdog), so a watchdog batch sent with the old TTL can never land after an `extend` and
//!   overwrite it. After `extend(t)` the server's expiry, the local lease end (set exactly, so
//!   it can move *earlier*) and the next renewal (due a third of the local lease of `t` later,
//!   renewing `t`) all follow `t`.
//!
//! The task is spawned lazily on the runtime of the first caller that needs it. The schedule
//! and the command queue live outside the task, and the task does not depend on that runtime
//! outliving the locker: if it shuts down (an actix-web worker restarting, a set-up runtime
//! dropped), the task's `Host` moves it, queue and all, to one process-wide fallback thread
//! (`dlock-watchdog`, started on first need), a renewal batch cut off on its way puts its
//! guards back on the schedule, due at once (`Batch`), and a background release cut off puts
//! its command back on the queue with what is left of its time (`Resend`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Mutex as AsyncMutex, Notify, OwnedMutexGuard};
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, ExtendItem, OwnerToken};
use crate::key::{KeyLog, ResourceName};

/// How long a suspend of the machine may go unnoticed by a guard's [`lost`] and the renewal
/// schedule: the background task looks at the schedule at least this often while guards are
/// in it, and a [`lost`] of a guard the watchdog does not renew checks its lease this often.
///
/// [`lost`]: crate::LockGuard::lost
pub(crate) const SUSPEND_CHECK: Duration = Duration::from_secs(1);

/// How far the lease clock may run ahead of the timers' between two looks of the background
/// task before the task takes it for a suspend of the machine and has each `lost` check its
/// lease again.
const SUSPEND_JUMP: Duration = Duration::from_millis(50);

/// The lease clock, in ns from an arbitrary start: `CLOCK_BOOTTIME` on Linux and Android,
/// which keeps counting while the machine is suspended. `Instant` (`CLOCK_MONOTONIC`) stops
/// then: a laptop's lid closed or a VM hibernated for a minute, a guard woke still "held" by a
/// lease the server had let run out while it slept, and told no one until its next renewal
/// was answered "not the owner". Elsewhere `Instant` (documented).
#[cfg(any(target_os = "linux", target_os = "android"))]
pub(crate) fn lease_clock_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}

/// The lease clock, in ns from an arbitrary start (`Instant`: stops while the machine is
/// suspended on this platform).
#[cfg(not(any(target_os = "linux", target_os = "android")))]
pub(crate) fn lease_clock_ns() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Guards due within this window are renewed in the same batch (a guard whose renewal interval
/// is under four windows joins at most a quarter of its interval early: [`Watchdog::early_ns`]).
const BATCH_WINDOW: Duration = Duration::from_millis(5);
const NOT_SCHEDULED: u64 = u64::MAX;

/// State shared by a [`LockGuard`](crate::LockGuard) and the watchdog.
pub(crate) struct GuardState {
    pub(crate) id: u64,
    pub(crate) resource: ResourceName,
    pub(crate) token: OwnerToken,
    pub(crate) fencing_token: u64,
    ttl_ms: AtomicU64,
    /// End of the local lease, ns since the watchdog's epoch.
    lease_end: AtomicU64,
    /// The due time this guard is scheduled under, or `NOT_SCHEDULED`.
    due: AtomicU64,
    pub(crate) lost: CancellationToken,
    /// Released or dropped: the watchdog must not renew it any more.
    pub(crate) done: AtomicBool,
    /// Whether the watchdog renews this guard.
    auto_renew: bool,
    /// Held while a renewal, an extend or the final step (release) of this guard is on its way
    /// to the backend, so none of them overlap (see the module docs).
    pub(crate) turn: Arc<AsyncMutex<()>>,
    /// Signalled whenever `lease_end` changes, so [`Watchdog::wait_lost`] re-arms its timer.
    lease_changed: Notify,
    /// A minimum hold (`hold_at_least`): until this watchdog time (ns), a lock given up on —
    /// released by its holder, or given back after it was reported lost — keeps its key, with
    /// its lease shortened to what is left of the hold, instead of being deleted. 0: none.
    hold_until_ns: AtomicU64,
    /// The lock's metric labels.
    pub(crate) labels: crate::metrics::Labels,
    /// The loss was counted (`dlock_lost_total`) and logged: once, whoever reports it first.
    loss_counted: AtomicBool,
    /// Since when the lock counts in `dlock_locks_held`, while it does: from its lease's start
    /// to its release, drop or loss, whichever comes first.
    held_since: Mutex<Option<Instant>>,
    /// How the key appears in events.
    key_log: KeyLog,
}

impl GuardState {
    pub(crate) fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms.load(Ordering::Acquire))
    }

    pub(crate) fn lease_end_ns(&self) -> u64 {
        self.lease_end.load(Ordering::Acquire)
    }

    /// Records a successful renewal or extend sent at `sent_ns` with lease `ttl`, of which the
    /// last `margin` is not counted on. The lease end is *set*, not raised: an extend to a
    /// shorter TTL shortens the local lease too. Callers hold the guard's turn, so no other
    /// renewal of this guard is in flight.
    fn renewed(&self, sent_ns: u64, ttl: Duration, margin: Duration) {
        self.set_ttl(ttl);
        self.set_lease_end(lease_end(sent_ns, ttl, margin));
    }

    /// An extend to `ttl` whose outcome is unknown (error, timeout, cancelled): the server may
    /// or may not have applied it, so the local lease ends at the earlier of the two, and `ttl`
    /// is what later renewals use.
    fn extend_unknown(&self, sent_ns: u64, ttl: Duration, margin: Duration) {
        self.set_ttl(ttl);
        let end = lease_end(sent_ns, ttl, margin).min(self.lease_end_ns());
        self.set_lease_end(end);
    }

    /// What is left of the minimum hold at watchdog time `now_ns`, when it is long enough to
    /// be a lease (`util::hold_rest`); `None` once a release may delete the lock.
    pub(crate) fn hold_left(&self, now_ns: u64) -> Option<Duration> {
        let until = self.hold_until_ns.load(Ordering::Acquire);
        crate::util::hold_rest(until.saturating_sub(now_ns))
    }

    pub(crate) fn set_hold_until(&self, until_ns: u64) {
        self.hold_until_ns.store(until_ns, Ordering::Release);
    }

    fn set_ttl(&self, ttl: Duration) {
        self.ttl_ms
            .store(ttl.as_millis().max(1) as u64, Ordering::Release);
    }

    fn set_lease_end(&self, end: u64) {
        self.lease_end.store(end, Ordering::Release);
        self.lease_changed.notify_waiters();
    }

    /// The caller's view of an owner-checked release that the backend answered: `true` → done;
    /// `false` → the lock was no longer this owner's ([`LockError::Lost`]).
    pub(crate) fn settle_release(&self, still_ours: bool) -> Result<(), crate::LockError> {
        if still_ours {
            Ok(())
        } else {
            if !self.loss_counted.swap(true, Ordering::AcqRel) {
                self.labels.lost();
                self.held_until_now();
            }
            self.lost.cancel();
            Err(crate::LockError::lost(self.resource.key().as_str()))
        }
    }

    /// The lock counts in `dlock_locks_held` from now on (its lease began).
    pub(crate) fn held_from_now(&self) {
        let mut since = self
            .held_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if since.is_none() {
            *since = Some(Instant::now());
            self.labels.held(true, None);
        }
    }

    /// The lock no longer counts in `dlock_locks_held` (released, dropped or lost), its hold
    /// time recorded: once, whichever comes first.
    pub(crate) fn held_until_now(&self) {
        let since = self
            .held_since
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(since) = since {
            self.labels.held(false, Some(since.elapsed()));
        }
    }

    pub(crate) fn mark_lost(&self, why: &'static str) {
        // Counted once: the watchdog and a task waiting for the loss may both report it.
        if !self.done.load(Ordering::Acquire) && !self.loss_counted.swap(true, Ordering::AcqRel) {
            self.labels.lost();
            self.held_until_now();
            tracing::warn!(
                key = %self.key_log.show(self.resource.key().as_str()),
                name = self.labels.name,
                backend = self.labels.backend,
                reason = why,
                "dlock.lost"
            );
        }
        self.lost.cancel();
    }
}

fn lease_end(sent_ns: u64, ttl: Duration, margin: Duration) -> u64 {
    sent_ns.saturating_add(ttl.saturating_sub(margin).as_nanos() as u64)
}

/// When the renewal of a lease of `ttl` sent at `sent_ns` is due: after a third of what the
/// local clock counts on (the TTL less the backend's margin), so that two renewals can fail
/// before the local lease ends. A third of the TTL alone would come after the local lease on
/// a backend whose margin is over two thirds of it (ZooKeeper caps the local lease at ¾ of the
/// session timeout: at a TTL of twice the session, the local lease is ⅜ of the TTL).
fn renewal_due(sent_ns: u64, ttl: Duration, margin: Duration) -> u64 {
    sent_ns.saturating_add(ttl.saturating_sub(margin).as_nanos() as u64 / 3)
}

/// A release or abandon to run in the background, retried until it lands or `give_up` has
/// passed (by then the lock and its queue entry have expired on their own).
pub(crate) enum Cmd {
    /// Release `token`'s lock, giving up after the duration.
    Release(ResourceName, OwnerToken, Duration),
    /// Undo whatever an acquire with `token` may have done, giving up after the duration.
    Abandon(ResourceName, OwnerToken, Duration),
    /// Set `token`'s lease to end when the minimum hold ends, at the instant, instead of
    /// releasing (what is left is counted at each try: a retry that lands late does not keep
    /// the lock past the hold); release it once what is left is too short for a lease. Gives
    /// up after the duration. The guard's turn is taken first, so a renewal on its way when
    /// the guard was dropped lands before, not after.
    Expire(
        ResourceName,
        OwnerToken,
        // When the hold ends, by the lease clock ([`lease_clock_ns`]): a retry after a
        // suspend does not keep the lock the time suspended past it.
        u64,
        Duration,
        Arc<AsyncMutex<()>>,
    ),
}

/// Shared between the [`Locker`](crate::Locker) and its background task.
pub(crate) struct Watchdog {
    /// The lease clock's reading when the watchdog was made ([`lease_clock_ns`]).
    epoch: u64,
    /// Time the tests pretend the machine spent suspended: added to the lease clock only.
    #[cfg(test)]
    suspended_ns: AtomicU64,
    /// Looks of the background task that found a guard to renew.
    #[cfg(test)]
    looks_with_guards: AtomicU64,
    /// Told when the background task finds the machine was suspended: every `wait_lost`
    /// checks its lease again.
    resumed: Notify,
    schedule: Mutex<BTreeMap<(u64, u64), Arc<GuardState>>>,
    /// When the background task looks at the schedule next, at the latest (`NOT_SCHEDULED`:
    /// only when woken). Read and written under `schedule`'s mutex. It may be earlier than
    /// the first due time left (that guard was released since): the task then wakes, finds
    /// nothing due and sleeps again, which costs less than a wake-up for every new guard.
    wakes_at: AtomicU64,
    /// Guards taken off the schedule into a renewal batch and not yet put back or settled
    /// (counted in `scheduled`). Added to under `schedule`'s mutex; taken from once a guard
    /// leaves its batch, after it is put back on the schedule if it is.
    in_batch: AtomicUsize,
    wake: Arc<Notify>,
    /// How often a new due time woke the background task.
    #[cfg(test)]
    woken: AtomicU64,
    tx: Mutex<Option<mpsc::UnboundedSender<Cmd>>>,
    backend: Arc<dyn Backend>,
    command_timeout: Duration,
    next_id: AtomicU64,
    /// Successful watchdog renewals, for metrics.
    renewed: AtomicU64,
    /// How keys appear in events.
    key_log: KeyLog,
}

impl Drop for Watchdog {
    /// The locker is gone: its sender of the queue goes first, then the task is woken, to end
    /// once the releases queued or on their way are done.
    fn drop(&mut self) {
        drop(
            self.tx
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        self.wake.notify_one();
    }
}

impl Watchdog {
    pub(crate) fn new(
        backend: Arc<dyn Backend>,
        command_timeout: Duration,
        key_log: KeyLog,
    ) -> Arc<Self> {
        Arc::new(Watchdog {
            epoch: lease_clock_ns(),
            #[cfg(test)]
            suspended_ns: AtomicU64::new(0),
            #[cfg(test)]
            looks_with_guards: AtomicU64::new(0),
            resumed: Notify::new(),
            schedule: Mutex::new(BTreeMap::new()),
            wakes_at: AtomicU64::new(NOT_SCHEDULED),
            in_batch: AtomicUsize::new(0),
            wake: Arc::new(Notify::new()),
            #[cfg(test)]
            woken: AtomicU64::new(0),
            tx: Mutex::new(None),
            backend,
            command_timeout,
            next_id: AtomicU64::new(1),
            renewed: AtomicU64::new(0),
            key_log,
        })
    }

    /// How keys appear in this locker's events.
    pub(crate) fn key_log(&self) -> KeyLog {
        self.key_log
    }

    /// The backend every lock of this watchdog lives in.
    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The lease clock, in ns since this watchdog was made: it counts the time the machine
    /// spent suspended (see [`lease_clock_ns`]).
    pub(crate) fn now_ns(&self) -> u64 {
        let now = lease_clock_ns().saturating_sub(self.epoch);
        #[cfg(test)]
        let now = now + self.suspended_ns.load(Ordering::Relaxed);
        now
    }

    /// The timer instant of lease-clock time `ns`: as far from now as `ns` is from
    /// [`now_ns`](Self::now_ns). Timers run on `Instant`, which stops while the machine is
    /// suspended: one set before a suspend fires that much late (the task looks at the
    /// schedule at least every [`SUSPEND_CHECK`] for that reason).
    pub(crate) fn instant_at(&self, ns: u64) -> tokio::time::Instant {
        let (now_ns, now) = (self.now_ns(), tokio::time::Instant::now());
        if ns >= now_ns {
            now + Duration::from_nanos(ns - now_ns)
        } else {
            now.checked_sub(Duration::from_nanos(now_ns - ns))
                .unwrap_or(now)
        }
    }

    /// The tests' machine suspend: the lease clock jumps by `d`; timers do not see it.
    #[cfg(test)]
    pub(crate) fn suspend_for_test(&self, d: Duration) {
        self.suspended_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// A new guard's state; registered for renewal when `auto_renew`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn register(
        self: &Arc<Self>,
        resource: ResourceName,
        token: OwnerToken,
        fencing_token: u64,
        ttl: Duration,
        lease: Duration,
        sent_ns: u64,
        auto_renew: bool,
        labels: crate::metrics::Labels,
    ) -> Arc<GuardState> {
        let margin = self.backend.lease_margin(lease);
        let state = Arc::new(GuardState {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            resource,
            token,
            fencing_token,
            ttl_ms: AtomicU64::new(ttl.as_millis().max(1) as u64),
            lease_end: AtomicU64::new(lease_end(sent_ns, lease, margin)),
            due: AtomicU64::new(NOT_SCHEDULED),
            lost: CancellationToken::new(),
            done: AtomicBool::new(false),
            auto_renew,
            turn: Arc::new(AsyncMutex::new(())),
            lease_changed: Notify::new(),
            hold_until_ns: AtomicU64::new(0),
            labels,
            loss_counted: AtomicBool::new(false),
            held_since: Mutex::new(None),
            key_log: self.key_log,
        });
        if auto_renew {
            self.schedule_at(&state, renewal_due(sent_ns, lease, margin));
        }
        state
    }

    fn schedule_at(self: &Arc<Self>, state: &Arc<GuardState>, due_ns: u64) {
        let sooner = {
            let mut map = self.schedule.lock().unwrap_or_else(PoisonError::into_inner);
            if state.done.load(Ordering::Acquire) {
                return;
            }
            let old = state.due.swap(due_ns, Ordering::AcqRel);
            if old != NOT_SCHEDULED {
                map.remove(&(old, state.id));
            }
            map.insert((due_ns, state.id), state.clone());
            // Only a due time before the task's next look wakes it. A lock taken after the
            // one before it was released is due later than that one was: no wake-up.
            let sooner = due_ns < self.wakes_at.load(Ordering::Relaxed);
            if sooner {
                self.wakes_at.store(due_ns, Ordering::Relaxed);
            }
            sooner
        };
        self.ensure_running();
        if sooner {
            #[cfg(test)]
            self.woken.fetch_add(1, Ordering::Relaxed);
            self.wake.notify_one();
        }
    }

    /// Takes the guard out of the renewal schedule (release, drop; the guard is `done` by then).
    /// Under the schedule's lock, like [`schedule_at`](Self::schedule_at): outside it, a batch
    /// rescheduling the guard at that moment (it read `done` unset) put it back after this, and
    /// the released guard stayed in the schedule, counted as renewing, until it came due.
    pub(crate) fn unschedule(&self, state: &GuardState) {
        let mut map = self.schedule.lock().unwrap_or_else(PoisonError::into_inner);
        let old = state.due.swap(NOT_SCHEDULED, Ordering::AcqRel);
        if old != NOT_SCHEDULED {
            map.remove(&(old, state.id));
        }
    }

    /// Runs one backend command under the command timeout; a timeout is
    /// [`LockError::Unavailable`](crate::LockError::Unavailable).
    pub(crate) async fn with_deadline<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T, crate::LockError>>,
    ) -> Result<T, crate::LockError> {
        let d = self.command_timeout;
        match tokio::time::timeout(d, fut).await {
            Ok(r) => r,
            Err(_) => Err(crate::LockError::unavailable(
                format!(
                    "{} backend: {what} timed out after {d:?}",
                    self.backend.name()
                ),
                None,
            )),
        }
    }

    /// Whether `state`'s lock is held as far as this process can tell: not reported lost and
    /// the local lease has not run out.
    pub(crate) fn is_held(&self, state: &GuardState) -> bool {
        !state.lost.is_cancelled() && self.now_ns() < state.lease_end_ns()
    }

    /// Resolves when `state`'s lock is lost: reported lost, or its local lease ran out (the
    /// timer follows the lease end when an extend moves it, earlier or later). Cancel-safe.
    pub(crate) async fn wait_lost(&self, state: &GuardState) {
        loop {
            let changed = state.lease_changed.notified();
            tokio::pin!(changed);
            // Registered before the lease end is read: a change after the read wakes us.
            changed.as_mut().enable();
            let end = state.lease_end_ns();
            let resumed = self.resumed.notified();
            tokio::pin!(resumed);
            resumed.as_mut().enable();
            if self.now_ns() >= end {
                state.mark_lost("the local lease ran out");
                return;
            }
            // The timer fires late by the time the machine was suspended. The task, which
            // looks at least every `SUSPEND_CHECK` while a guard is renewed, tells of a
            // suspend (`resumed`); a guard it does not renew looks for itself as often.
            let mut at = self.instant_at(end);
            if !state.auto_renew {
                at = at.min(tokio::time::Instant::now() + SUSPEND_CHECK);
            }
            tokio::select! {
                _ = state.lost.cancelled() => return,
                _ = &mut changed => {}
                _ = &mut resumed => {}
                _ = tokio::time::sleep_until(at) => {
                    if self.now_ns() >= state.lease_end_ns() {
                        state.mark_lost("the local lease ran out");
                        return;
                    }
                }
            }
        }
    }

    /// Sets `state`'s lease to `ttl` from now on the backend (owner-checked) and makes `ttl`
    /// the lease the watchdog renews from now on; waits for a renewal of this guard that is
    /// already on its way. `deadline` wraps the backend call. Cancel-safe: a dropped extend is
    /// treated like one whose outcome is unknown.
    pub(crate) async fn extend(
        self: &Arc<Self>,
        state: &Arc<GuardState>,
        ttl: Duration,
    ) -> Result<(), crate::LockError> {
        let _turn = state.turn.lock().await;
        if state.lost.is_cancelled() {
            return Err(crate::LockError::lost(state.resource.key().as_str()));
        }
        if !self.is_held(state) {
            // The local lease ran out, though nothing awaited `lost()` to say so yet: lost, as a
            // renewal batch and a release would find it. The backend may still keep the lock a
            // margin longer; an extend must not bring it back (the holder may already have been
            // told, by `is_held()`, and run on unprotected).
            state.mark_lost("the local lease ran out before the extend");
            return Err(crate::LockError::lost(state.resource.key().as_str()));
        }
        let sent = self.now_ns();
        let margin = self.backend.lease_margin(ttl);
        // Until the answer is in, the outcome is unknown (also if this future is dropped).
        let mut pending = ExtendInFlight {
            watchdog: self,
            state,
            sent,
            ttl,
            margin,
            armed: true,
        };
        let res = self
            .with_deadline(
                "extend",
                self.backend.extend(&state.resource, &state.token, ttl),
            )
            .await;
        match res {
            // The local lease ran out while the extend was on its way, and the holder was
            // told (`lost()` resolved): the extend does not contradict what the holder was
            // told, and the lock it renewed is given back (owner-checked) rather than kept
            // for the new TTL on behalf of a guard that no longer holds it.
            Ok(true) if state.lost.is_cancelled() => {
                pending.armed = false;
                let _ = self.give_back(state).await;
                Err(crate::LockError::lost(state.resource.key().as_str()))
            }
            Ok(true) => {
                pending.armed = false;
                state.renewed(sent, ttl, margin);
                if state.auto_renew {
                    self.schedule_at(state, renewal_due(sent, ttl, margin));
                }
                Ok(())
            }
            Ok(false) => {
                pending.armed = false;
                state.mark_lost("extend found another owner");
                Err(crate::LockError::lost(state.resource.key().as_str()))
            }
            // Refused as invalid (a TTL this backend cannot take): nothing was sent, so
            // nothing changed — the lease and the TTL the watchdog renews stay as they were.
            Err(e) if e.is_invalid() => {
                pending.armed = false;
                // A renewal batch that came due meanwhile took the guard off the schedule and
                // left it to this extend (it held the guard's turn): put it back.
                if state.auto_renew && state.due.load(Ordering::Acquire) == NOT_SCHEDULED {
                    self.schedule_at(state, self.now_ns());
                }
                Err(e)
            }
            // `pending` settles the unknown outcome on drop.
            Err(e) => Err(e),
        }
    }

    /// Gives back (owner-checked) a lock that a renewal or an extend renewed after its guard
    /// was reported lost: released, or — within a minimum hold — left to end when the hold
    /// ends, as the holder's own release would have left it. The holder was told the lock was
    /// lost, but the hold promises that nobody else takes it before the hold ends. Callers
    /// hold the guard's turn.
    async fn give_back(&self, state: &GuardState) -> Result<bool, crate::LockError> {
        let (resource, token) = (&state.resource, &state.token);
        match state.hold_left(self.now_ns()) {
            Some(left) => {
                let expire = self.backend.expire(resource, token, left);
                self.with_deadline("expire", expire).await
            }
            None => {
                let release = self.backend.release(resource, token);
                self.with_deadline("release", release).await
            }
        }
    }

    /// Successful watchdog renewals so far.
    pub(crate) fn renewals(&self) -> u64 {
        self.renewed.load(Ordering::Relaxed)
    }

    /// How many guards are under renewal: on the schedule, or in a renewal on its way (a
    /// guard put back on the schedule by a renewal that has not ended yet counts twice for
    /// that moment).
    pub(crate) fn scheduled(&self) -> usize {
        let map = self.schedule.lock().unwrap_or_else(PoisonError::into_inner);
        map.len() + self.in_batch.load(Ordering::Acquire)
    }

    /// Runs `cmd` in the background, from a context that cannot await (a drop): a release
    /// (for up to the lease — after it the lock is gone anyway) or the undo of a cancelled or
    /// failed acquire (for up to the longer of the lease and the waiter entry's life, so a
    /// waiter whose connection was cut does not stay at the head of the queue once the backend
    /// is back). Retried through backend errors until it lands or its time is up.
    pub(crate) fn later(self: &Arc<Self>, cmd: Cmd) {
        self.send(cmd);
    }

    fn send(self: &Arc<Self>, cmd: Cmd) {
        if let Some(tx) = self.ensure_running() {
            // The queue lives as long as the watchdog (a task whose runtime shut down hands it
            // to the next), so this fails only while the locker itself is being dropped.
            let _ = tx.send(cmd);
        } else {
            tracing::warn!(
                "dlock could not start a thread to release a dropped lock; its TTL will end it"
            );
        }
    }

    /// The command queue of a live task, spawning the task if needed: on the caller's runtime,
    /// or on the fallback runtime when the caller is on none (a guard dropped on a plain thread).
    fn ensure_running(self: &Arc<Self>) -> Option<mpsc::UnboundedSender<Cmd>> {
        let mut tx = self.tx.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = tx.as_ref().filter(|t| !t.is_closed()) {
            return Some(t.clone());
        }
        let rt = match tokio::runtime::Handle::try_current() {
            Ok(rt) => rt,
            Err(_) => crate::util::fallback_runtime()?.clone(),
        };
        let (t, rx) = mpsc::unbounded_channel();
        rt.spawn(run(Host {
            watchdog: Arc::downgrade(self),
            backend: self.backend.clone(),
            command_timeout: self.command_timeout,
            wake: self.wake.clone(),
            resend: t.clone(),
            rx: Some(rx),
        }));
        *tx = Some(t.clone());
        Some(t)
    }

    /// Removes and returns every guard due by now (plus the batching window), and the next
    /// due time after that, which the task sleeps until (noted in `wakes_at`).
    /// The guards due now (as a batch), when the task looks next at the latest, and whether
    /// any guard is left to renew (scheduled, or in a batch).
    fn take_due(self: &Arc<Self>) -> (Batch, Option<u64>, bool) {
        let now = self.now_ns();
        let limit = now + BATCH_WINDOW.as_nanos() as u64;
        let mut map = self.schedule.lock().unwrap_or_else(PoisonError::into_inner);
        let taken: Vec<(u64, u64)> = map
            .range(..=(limit, u64::MAX))
            .filter(|&(&(due, _), state)| due <= now.saturating_add(self.early_ns(state)))
            .map(|(&key, _)| key)
            .collect();
        let mut due = Vec::with_capacity(taken.len());
        for key in taken {
            if let Some(state) = map.remove(&key) {
                state.due.store(NOT_SCHEDULED, Ordering::Release);
                due.push(state);
            }
        }
        self.in_batch.fetch_add(due.len(), Ordering::AcqRel);
        // With nothing scheduled, the look already planned stays if it is still ahead (the
        // guard due then was released since): the next guard, due later, need not wake the task.
        let next = map.keys().next().map(|&(d, _)| d).or_else(|| {
            let planned = self.wakes_at.load(Ordering::Relaxed);
            (planned != NOT_SCHEDULED && planned > limit).then_some(planned)
        });
        self.wakes_at
            .store(next.unwrap_or(NOT_SCHEDULED), Ordering::Relaxed);
        let guards = !map.is_empty() || self.in_batch.load(Ordering::Acquire) != 0;
        #[cfg(test)]
        if guards {
            self.looks_with_guards.fetch_add(1, Ordering::Relaxed);
        }
        let batch = Batch {
            watchdog: self.clone(),
            guards: due,
            turns: Vec::new(),
            settled: false,
        };
        (batch, next, guards)
    }

    /// How early a guard may join a batch: the batching window, but at most a quarter of its
    /// renewal interval (a third of its local lease), so that a short lease is not renewed
    /// back to back — at a 10 ms TTL, the window alone would take each renewal as soon as the
    /// last one was answered.
    fn early_ns(&self, state: &GuardState) -> u64 {
        let ttl = state.ttl();
        let interval = ttl.saturating_sub(self.backend.lease_margin(ttl)) / 3;
        (interval / 4).min(BATCH_WINDOW).as_nanos() as u64
    }

    async fn renew(self: Arc<Self>, mut batch: Batch) {
        let now = self.now_ns();
        let mut items = Vec::with_capacity(batch.guards.len());
        let mut turns: Vec<OwnedMutexGuard<()>> = Vec::with_capacity(batch.guards.len());
        let taken = batch.guards.len();
        batch.guards.retain(|g| {
            if g.done.load(Ordering::Acquire) {
                return false;
            }
            if g.lost.is_cancelled() {
                return false;
            }
            // The guard's turn is taken: an extend is on its way, or the batch before this one
            // is still settling (it rescheduled the guard into this batch's window before
            // letting its turns go). Neither reschedules the guard again, so this batch does:
            // shortly, to ask again once the turn is free (an extend's own reschedule, if it
            // lands later, replaces this one).
            let Ok(turn) = g.turn.clone().try_lock_owned() else {
                // Past the lease end, the turn's holder settles the guard (renewed, or lost):
                // rescheduled at a due time already past, it would be taken again at once.
                if now < g.lease_end_ns() {
                    let retry = (g.ttl().as_nanos() as u64 / 10).max(10_000_000);
                    self.schedule_at(g, (now + retry).min(g.lease_end_ns()));
                }
                return false;
            };
            if now >= g.lease_end_ns() {
                g.mark_lost("lease ran out before it could be renewed");
                return false;
            }
            items.push(ExtendItem {
                resource: g.resource.clone(),
                token: g.token.clone(),
                ttl: g.ttl(),
            });
            turns.push(turn);
            true
        });
        batch.turns = turns;
        // Those left out were put back on the schedule or are settled.
        self.in_batch
            .fetch_sub(taken - batch.guards.len(), Ordering::AcqRel);
        if items.is_empty() {
            batch.settled = true;
            return;
        }
        let sent = self.now_ns();
        // A timed-out batch yields no results: every item is retried below.
        let results = tokio::time::timeout(self.command_timeout, self.backend.extend_many(&items))
            .await
            .unwrap_or_default();
        batch.settled = true;
        let live = &batch.guards;
        let renewed = results.iter().filter(|r| matches!(r, Ok(true))).count();
        self.renewed.fetch_add(renewed as u64, Ordering::Relaxed);
        tracing::trace!(batch = items.len(), renewed, "dlock.renew");
        let mut give_back = Vec::new();
        for (i, (g, item)) in live.iter().zip(&items).enumerate() {
            if g.done.load(Ordering::Acquire) {
                continue;
            }
            let ttl_ns = item.ttl.as_nanos() as u64;
            match results.get(i) {
                // Reported lost meanwhile (its local lease ran out while the renewal was on its
                // way): the holder was told, so the lock it renewed is given back (owner-checked,
                // below), as an extend's is — not kept for the new TTL on behalf of a guard
                // that no longer holds it.
                Some(Ok(true)) if g.lost.is_cancelled() => {
                    g.labels.renewal(true);
                    give_back.push((i, item));
                }
                Some(Ok(true)) => {
                    g.labels.renewal(true);
                    let margin = self.backend.lease_margin(item.ttl);
                    g.renewed(sent, item.ttl, margin);
                    self.schedule_at(g, renewal_due(sent, item.ttl, margin));
                }
                Some(Ok(false)) => g.mark_lost("the backend no longer has this owner's lock"),
                // Error or timeout: retry soon, until the local lease runs out.
                _ => {
                    g.labels.renewal(false);
                    let now = self.now_ns();
                    if now >= g.lease_end_ns() {
                        g.mark_lost("renewal failed until the lease ran out");
                    } else {
                        let retry = (ttl_ns / 10).max(10_000_000);
                        self.schedule_at(g, (now + retry).min(g.lease_end_ns()));
                    }
                }
            }
        }
        // The guards settled above let their turns go now; those whose locks are given back
        // keep theirs until the release is answered (an extend of them waits for it). Held
        // through the releases, a renewed guard's next batch found its turn taken until its
        // local lease ended, and neither renewed it nor reported it lost.
        let mut index = 0;
        batch.turns.retain(|_| {
            let keep = give_back.iter().any(|(i, _)| *i == index);
            index += 1;
            keep
        });
        // At once, not one after the other: each within the command timeout.
        futures_util::future::join_all(give_back.iter().map(|(i, _)| self.give_back(&live[*i])))
            .await;
        // Only now (`batch` dropped, its turns with it) may an extend of these guards go ahead.
    }
}

/// Guards taken off the schedule for one renewal, with their turns once taken. Dropped before
/// the backend's answers were in — the runtime running the renewal shut down — it lets the
/// turns go and puts its guards back on the schedule, due at once, for the task's next host:
/// taken off and never put back, they were never renewed again.
struct Batch {
    watchdog: Arc<Watchdog>,
    guards: Vec<Arc<GuardState>>,
    turns: Vec<OwnedMutexGuard<()>>,
    settled: bool,
}

impl Batch {
    fn is_empty(&self) -> bool {
        self.guards.is_empty()
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        let left = self.guards.len();
        if !self.settled {
            self.turns.clear();
            let now = self.watchdog.now_ns();
            for g in self.guards.drain(..) {
                self.watchdog.schedule_at(&g, now);
            }
        }
        // Settled, each was put back on the schedule or is done with.
        self.watchdog.in_batch.fetch_sub(left, Ordering::AcqRel);
    }
}

/// An extend whose answer is not in yet. Dropped armed (error, timeout, or the extend future
/// dropped), it records the unknown outcome and has the watchdog renew soon, with the new TTL.
struct ExtendInFlight<'a> {
    watchdog: &'a Arc<Watchdog>,
    state: &'a Arc<GuardState>,
    sent: u64,
    ttl: Duration,
    margin: Duration,
    armed: bool,
}

impl Drop for ExtendInFlight<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let state = self.state;
        state.extend_unknown(self.sent, self.ttl, self.margin);
        if state.auto_renew {
            let retry = (self.ttl.as_nanos() as u64 / 10).max(10_000_000);
            let due = (self.watchdog.now_ns() + retry).min(state.lease_end_ns());
            self.watchdog.schedule_at(state, due);
        }
    }
}

/// The background task's queue and what it needs. Dropped before the task returned — the
/// runtime running it shut down (an actix worker restarting, a set-up runtime dropped) — while
/// the locker still lives, commands are queued or a background release is on its way, it
/// moves the task, queue and all, to the fallback runtime; renewals and releases go on there.
struct Host {
    watchdog: Weak<Watchdog>,
    backend: Arc<dyn Backend>,
    command_timeout: Duration,
    wake: Arc<Notify>,
    /// The queue's sender that background releases hold, to put their command back if their
    /// runtime shuts down — also once the locker is gone. The task ends when it holds the last
    /// one (no watchdog: the locker is gone; no release on its way) and the queue is empty.
    resend: mpsc::UnboundedSender<Cmd>,
    /// `None` once the task returned.
    rx: Option<mpsc::UnboundedReceiver<Cmd>>,
}

impl Host {
    /// Nothing left to do, nor anyone to send more: only this host holds a sender of the queue
    /// (the watchdog holds one while the locker lives, each background release on its way one),
    /// and the queue is empty.
    fn done(&self, rx: &mpsc::UnboundedReceiver<Cmd>) -> bool {
        self.resend.strong_count() == 1 && rx.is_empty()
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let Some(rx) = self.rx.take() else { return };
        if self.done(&rx) {
            return;
        }
        let Some(rt) = crate::util::fallback_runtime() else {
            tracing::warn!(
                "dlock could not start its fallback thread after the runtime running its \
                 watchdog shut down; locks held are renewed again once one is taken"
            );
            return;
        };
        tracing::debug!("dlock watchdog moves to its fallback thread: its runtime shut down");
        rt.spawn(run(Host {
            watchdog: self.watchdog.clone(),
            backend: self.backend.clone(),
            command_timeout: self.command_timeout,
            wake: self.wake.clone(),
            resend: self.resend.clone(),
            rx: Some(rx),
        }));
    }
}

async fn run(mut host: Host) {
    // The lease clock and the timers' clock at the last look: the lease clock ahead by more
    // than `SUSPEND_JUMP` since is a suspend of the machine.
    let mut last_look: Option<(u64, tokio::time::Instant)> = None;
    loop {
        let next = match host.watchdog.upgrade() {
            Some(e) => {
                let (due, next, guards) = e.take_due();
                let look = (e.now_ns(), tokio::time::Instant::now());
                if let Some((ns, at)) = last_look {
                    let timers = look.1.saturating_duration_since(at).as_nanos() as u64;
                    if look.0.saturating_sub(ns) > timers + SUSPEND_JUMP.as_nanos() as u64 {
                        // Each `lost` checks its lease again (a renewal on its way may take
                        // up to the command timeout to settle the guard).
                        e.resumed.notify_waiters();
                    }
                }
                last_look = Some(look);
                if !due.is_empty() {
                    tokio::spawn(e.clone().renew(due));
                }
                // At least every `SUSPEND_CHECK` while there are guards to renew: after a
                // suspend, their renewals are due by the lease clock long before the timer
                // says so, and those past their lease are reported lost (before anything is
                // sent).
                let cap = guards.then(|| look.1 + SUSPEND_CHECK);
                match (next.map(|ns| e.instant_at(ns)), cap) {
                    (Some(at), Some(cap)) => Some(at.min(cap)),
                    (at, cap) => at.or(cap),
                }
            }
            // The locker is gone; only queued releases remain to be sent.
            None => None,
        };
        let sleep = async {
            match next {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        // Checked before each wait: the watchdog's drop and the end of the last background
        // release wake the task (after letting go of their senders).
        if host.rx.as_ref().is_none_or(|rx| host.done(rx)) {
            host.rx = None;
            return;
        }
        let Some(rx) = host.rx.as_mut() else { return };
        tokio::select! {
            cmd = rx.recv() => {
                // `None` cannot come while the host holds a sender.
                let Some(cmd) = cmd else {
                    host.rx = None;
                    return;
                };
                tokio::spawn(background_release(
                    host.backend.clone(),
                    host.command_timeout,
                    Resend {
                        cmd: Some(cmd),
                        tx: Some(host.resend.clone()),
                        start: tokio::time::Instant::now(),
                        wake: host.wake.clone(),
                    },
                ));
            }
            _ = host.wake.notified() => {}
            _ = sleep => {}
        }
    }
}

/// A command a background release is working on. Dropped unfinished — its runtime shut down —
/// it goes back on the queue, with what is left of its time, for the task's next host. Done
/// either way, the last one on its way wakes a host whose locker is gone, to end.
struct Resend {
    cmd: Option<Cmd>,
    tx: Option<mpsc::UnboundedSender<Cmd>>,
    start: tokio::time::Instant,
    wake: Arc<Notify>,
}

impl Drop for Resend {
    fn drop(&mut self) {
        let Some(tx) = self.tx.take() else { return };
        // This one and the host's: no watchdog, no other release on its way.
        let last = tx.strong_count() == 2;
        self.put_back(tx);
        if last {
            self.wake.notify_one();
        }
    }
}

impl Resend {
    fn put_back(&mut self, tx: mpsc::UnboundedSender<Cmd>) {
        let Some(cmd) = self.cmd.take() else { return };
        let spent = self.start.elapsed();
        let cmd = match cmd {
            Cmd::Release(r, t, give_up) => Cmd::Release(r, t, give_up.saturating_sub(spent)),
            Cmd::Abandon(r, t, give_up) => Cmd::Abandon(r, t, give_up.saturating_sub(spent)),
            Cmd::Expire(r, t, until, give_up, turn) => {
                Cmd::Expire(r, t, until, give_up.saturating_sub(spent), turn)
            }
        };
        if !cmd.give_up().is_zero() {
            let _ = tx.send(cmd);
        }
    }
}

impl Cmd {
    fn give_up(&self) -> Duration {
        match self {
            Cmd::Release(.., give_up) | Cmd::Abandon(.., give_up) | Cmd::Expire(.., give_up, _) => {
                *give_up
            }
        }
    }
}

async fn background_release(backend: Arc<dyn Backend>, command_timeout: Duration, mut job: Resend) {
    let Some(cmd) = job.cmd.as_ref() else { return };
    let start = job.start;
    let _turn = match cmd {
        Cmd::Expire(.., turn) => Some(turn.clone().lock_owned().await),
        _ => None,
    };
    let give_up = cmd.give_up();
    let mut pause = Duration::from_millis(20);
    loop {
        let (op, res) = match cmd {
            Cmd::Release(r, t, _) => (
                "release",
                tokio::time::timeout(command_timeout, async {
                    backend.release(r, t).await.map(|_| ())
                })
                .await,
            ),
            Cmd::Abandon(r, t, _) => (
                "abandon",
                tokio::time::timeout(command_timeout, backend.abandon(r, t)).await,
            ),
            Cmd::Expire(r, t, until, ..) => {
                let left = crate::util::hold_rest(until.saturating_sub(lease_clock_ns()));
                (
                    "expire",
                    tokio::time::timeout(command_timeout, async {
                        match left {
                            Some(left) => backend.expire(r, t, left).await.map(|_| ()),
                            None => backend.release(r, t).await.map(|_| ()),
                        }
                    })
                    .await,
                )
            }
        };
        let error = match res {
            Ok(Ok(())) => {
                tracing::trace!(op, "dlock background release");
                break;
            }
            // A refusal retrying cannot fix (an ACL without the lock keys, a role without the
            // schema's privileges) is refused the same way until someone changes the backend:
            // retried to the end of the lease, every request refused that way (each one's
            // undo) left a task sending one a second, for as long as the TTL.
            Ok(Err(err)) if err.is_misconfigured() => {
                tracing::debug!(op, error = %err, "dlock background release refused for good; the TTL ends the lock");
                break;
            }
            Ok(Err(err)) => err.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        if start.elapsed() + pause >= give_up {
            tracing::debug!(op, error = %error, "dlock background release gave up; the TTL ends the lock");
            break;
        }
        tracing::trace!(op, error = %error, "dlock background release failed; retrying");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
    // Done (landed or given up): nothing to put back.
    job.cmd = None;
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::backend::{AcquireArgs, Attempt, BoxFuture, MemoryBackend};
    use crate::{LockError, Locker};

    /// The memory backend with test hooks: a log of every lease length an `extend` applied
    /// (in order), the watchdog's batches held at a gate (`gated`: signalled on arrival, let go
    /// by the gate, signalled again once applied), extends that fail while `down` is set, and
    /// batches answered `late` after they were applied.
    #[derive(Default)]
    struct Hooked {
        inner: MemoryBackend,
        gated: Option<Gated>,
        applied: Arc<Mutex<Vec<Duration>>>,
        down: Arc<AtomicBool>,
        late: Duration,
        /// Signalled as each batch arrives, and as each release has been applied.
        batch_arrived: Arc<Notify>,
        released: Arc<Notify>,
        /// An extend to this TTL is refused as invalid, once let go.
        refuse: Option<Refuse>,
        /// The lease margin, in percent of the TTL.
        margin_pct: u32,
        /// The first release signals this and never answers.
        stall_first_release: Option<Arc<Notify>>,
        stalled: AtomicBool,
        /// Signalled as each `expire` (a release within a minimum hold) has been applied.
        expired: Arc<Notify>,
    }

    /// An extend to `ttl` signals `entered`, waits for `go`, and is refused as invalid — or,
    /// with `accept`, answered renewed (a backend whose clock says the lock is still held).
    #[derive(Clone)]
    struct Refuse {
        ttl: Duration,
        entered: Arc<Notify>,
        go: Arc<Notify>,
        accept: bool,
    }

    #[derive(Clone, Default)]
    struct Gated {
        arrived: Arc<Notify>,
        gate: Arc<Notify>,
        applied_batch: Arc<Notify>,
    }

    impl Backend for Hooked {
        fn name(&self) -> &'static str {
            "hooked"
        }
        fn lease_margin(&self, ttl: Duration) -> Duration {
            ttl * self.margin_pct / 100
        }
        fn acquire<'a>(&'a self, a: AcquireArgs<'a>) -> BoxFuture<'a, Result<Attempt, LockError>> {
            self.inner.acquire(a)
        }
        fn release<'a>(
            &'a self,
            r: &'a ResourceName,
            t: &'a OwnerToken,
        ) -> BoxFuture<'a, Result<bool, LockError>> {
            Box::pin(async move {
                if let Some(entered) = &self.stall_first_release {
                    if !self.stalled.swap(true, Ordering::SeqCst) {
                        entered.notify_one();
                        std::future::pending::<()>().await;
                    }
                }
                let out = self.inner.release(r, t).await;
                self.released.notify_one();
                out
            })
        }
        fn extend<'a>(
            &'a self,
            r: &'a ResourceName,
            t: &'a OwnerToken,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<bool, LockError>> {
            Box::pin(async move {
                if self.down.load(Ordering::SeqCst) {
                    return Err(LockError::unavailable("down", None));
                }
                if let Some(refuse) = self.refuse.as_ref().filter(|f| f.ttl == ttl) {
                    refuse.entered.notify_one();
                    refuse.go.notified().await;
                    if refuse.accept {
                        return Ok(true);
                    }
                    return Err(LockError::InvalidTtl {
                        ttl,
                        reason: "refused by the test".into(),
                    });
                }
                let out = self.inner.extend(r, t, ttl).await;
                self.applied.lock().unwrap().push(ttl);
                out
            })
        }
        fn expire<'a>(
            &'a self,
            r: &'a ResourceName,
            t: &'a OwnerToken,
            left: Duration,
        ) -> BoxFuture<'a, Result<bool, LockError>> {
            Box::pin(async move {
                let out = self.extend(r, t, left).await;
                self.expired.notify_one();
                out
            })
        }
        fn extend_many<'a>(
            &'a self,
            items: &'a [ExtendItem],
        ) -> BoxFuture<'a, Vec<Result<bool, LockError>>> {
            Box::pin(async move {
                self.batch_arrived.notify_one();
                if let Some(g) = &self.gated {
                    g.arrived.notify_one();
                    g.gate.notified().await;
                }
                let mut out = Vec::new();
                for i in items {
                    out.push(self.extend(&i.resource, &i.token, i.ttl).await);
                }
                if let Some(g) = &self.gated {
                    g.applied_batch.notify_one();
                }
                tokio::time::sleep(self.late).await;
                out
            })
        }
        fn abandon<'a>(
            &'a self,
            r: &'a ResourceName,
            t: &'a OwnerToken,
        ) -> BoxFuture<'a, Result<(), LockError>> {
            self.inner.abandon(r, t)
        }
    }

    /// A suspend of the machine past a guard's lease (the lease clock jumps; timers, on
    /// `Instant`, do not) is a loss at once on waking: `is_held` says no, and `lost` resolves
    /// within `SUSPEND_CHECK` — for a renewed guard (the task's look at the schedule) and one
    /// the watchdog does not renew (its own check) alike. With timers alone both waited for
    /// the time suspended to pass again: the renewed guard until its renewal, due 10 s on,
    /// and the other for the rest of its 30 s lease.
    #[tokio::test]
    async fn a_suspend_past_the_lease_is_a_loss_on_waking() {
        let locker = Locker::memory();
        for (key, renew) in [("renewed", true), ("not-renewed", false)] {
            let guard = locker
                .lock(key)
                .ttl(Duration::from_secs(30))
                .auto_renew(renew)
                .acquire()
                .await
                .unwrap();
            if renew {
                until_looked_at(locker.watchdog()).await;
            }
            let lost = guard.lost();
            tokio::pin!(lost);
            assert!(futures_util::poll!(&mut lost).is_pending(), "{key}");
            // `lost` waits on its timer (and, not renewed, its own look).
            tokio::task::yield_now().await;
            locker.watchdog().suspend_for_test(Duration::from_secs(60));
            assert!(
                !guard.is_held(),
                "{key}: held after a suspend past its lease"
            );
            assert_eq!(guard.remaining(), Duration::ZERO, "{key}");
            tokio::time::timeout(SUSPEND_CHECK * 3, lost)
                .await
                .unwrap_or_else(|_| panic!("{key}: not lost within 3 s of waking"));
        }
    }

    /// A suspend shorter than what is left of the lease loses nothing: the renewal, due by the
    /// lease clock, is sent on waking and renews the lock.
    #[tokio::test]
    async fn a_suspend_within_the_lease_renews_on_waking() {
        let backend = Hooked::default();
        let (arrived, applied) = (backend.batch_arrived.clone(), backend.applied.clone());
        let locker = Locker::builder().build(backend);
        let guard = locker
            .lock("k")
            .ttl(Duration::from_secs(30))
            .acquire()
            .await
            .unwrap();
        // The task sleeps until its next look before the machine does.
        until_looked_at(locker.watchdog()).await;
        locker.watchdog().suspend_for_test(Duration::from_secs(15));
        assert!(guard.is_held());
        tokio::time::timeout(SUSPEND_CHECK * 3, arrived.notified())
            .await
            .expect("a renewal within 3 s of waking");
        // Signalled as the batch arrived: its answer settles the guard on the task's turn.
        guard.extend(Duration::from_secs(30)).await.unwrap();
        assert_eq!(
            applied.lock().unwrap().len(),
            2,
            "the renewal, then the extend"
        );
        assert!(guard.is_held());
        assert!(
            guard.remaining() > Duration::from_secs(20),
            "{:?}",
            guard.remaining()
        );
        guard.release().await.unwrap();
    }

    /// A suspend while a renewal is on its way — its answer may take up to the command
    /// timeout, here 30 s — is a loss within `SUSPEND_CHECK` of waking all the same: the task
    /// tells every `lost` to check its lease. Before, `lost` waited for its timer, the rest of
    /// the 9 s lease (and the guard is in no schedule while its batch is out).
    #[tokio::test]
    async fn a_suspend_during_a_renewal_is_a_loss_on_waking() {
        let gated = Gated::default();
        let locker = Locker::builder()
            .command_timeout(Duration::from_secs(30))
            .build(Hooked {
                gated: Some(gated.clone()),
                ..Hooked::default()
            });
        let guard = locker
            .lock("k")
            .ttl(Duration::from_secs(9))
            .acquire()
            .await
            .unwrap();
        // The first renewal (due 3 s on) arrives and waits at the gate.
        tokio::time::timeout(Duration::from_secs(10), gated.arrived.notified())
            .await
            .expect("a renewal");
        until_looked_at(locker.watchdog()).await;
        let lost = guard.lost();
        tokio::pin!(lost);
        assert!(futures_util::poll!(&mut lost).is_pending());
        tokio::task::yield_now().await;
        locker.watchdog().suspend_for_test(Duration::from_secs(60));
        assert!(!guard.is_held());
        tokio::time::timeout(SUSPEND_CHECK * 3, lost)
            .await
            .expect("not lost within 3 s of waking");
        gated.gate.notify_one();
    }

    /// Waits (at most 5 s) until the watchdog's task has looked at its schedule again with a
    /// guard in it: it then sleeps on a timer set before the test's suspend.
    async fn until_looked_at(watchdog: &Watchdog) {
        let before = watchdog.looks_with_guards.load(Ordering::Relaxed);
        tokio::time::timeout(Duration::from_secs(5), async {
            while watchdog.looks_with_guards.load(Ordering::Relaxed) == before {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the watchdog's task looked at its schedule");
    }

    /// Renewals come every third of the local lease, not of the TTL: with a margin of 70 %
    /// (the local lease 0.9 s of a 3 s TTL) a renewal at TTL/3 came after the local lease
    /// had ended, and the guard was lost with the backend up.
    #[tokio::test]
    async fn renewals_come_within_a_local_lease_shortened_by_the_margin() {
        let locker = Locker::builder()
            .command_timeout(Duration::from_secs(10))
            .build(Hooked {
                margin_pct: 70,
                ..Hooked::default()
            });
        let guard = locker
            .lock("k")
            .ttl(Duration::from_secs(3))
            .acquire()
            .await
            .unwrap();
        let lost = tokio::time::timeout(Duration::from_millis(1500), guard.lost()).await;
        assert!(lost.is_err(), "lost with the backend up");
        assert!(guard.is_held());
        assert!(locker.renewals() >= 2, "{} renewals", locker.renewals());
        guard.release().await.unwrap();
    }

    /// A short lease is renewed every third of it, not back to back: the 5 ms batching window
    /// took each renewal of a 12 ms lease (due 4 ms after the last one was sent) as soon as
    /// the last one was answered. Over 300 ms, renewals every 4 ms — at most a quarter of that
    /// early, 3 ms — are 100 at most (fewer on a busy machine: renewals only come late); back
    /// to back, they were 264 here.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_short_lease_is_not_renewed_back_to_back() {
        let locker = Locker::builder()
            .command_timeout(Duration::from_secs(10))
            .build(Hooked::default());
        let guard = locker
            .lock("k")
            .ttl(Duration::from_millis(12))
            .acquire()
            .await
            .unwrap();
        let before = locker.renewals();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let renewals = locker.renewals() - before;
        assert!(
            renewals <= 100,
            "{renewals} renewals of a 12 ms lease in 300 ms (one every 3 ms is 100)"
        );
        drop(guard);
    }

    /// A locker over a [`Hooked`] backend whose batches wait at a gate, with the gate and the
    /// log of applied leases.
    /// Waits (at most 5 s) until `state` is no longer due at `first_due`: the batch due then
    /// has taken it off the schedule (and put it back, or not).
    async fn until_rescheduled(state: &GuardState, first_due: u64) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while state.due.load(Ordering::Acquire) == first_due {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the batch came due");
    }

    /// A locker whose extends to 7 s are held at a gate ([`Refuse`]), then refused — or, with
    /// `accept`, answered renewed.
    /// The third value is signalled as each release has been applied.
    fn refusing_locker(accept: bool) -> (Locker, Refuse, Arc<Notify>) {
        let refuse = Refuse {
            ttl: Duration::from_secs(7),
            entered: Arc::new(Notify::new()),
            go: Arc::new(Notify::new()),
            accept,
        };
        let backend = Hooked {
            refuse: Some(refuse.clone()),
            ..Hooked::default()
        };
        let released = backend.released.clone();
        let locker = Locker::builder()
            .command_timeout(Duration::from_secs(10))
            .build(backend);
        (locker, refuse, released)
    }

    fn gated_locker() -> (Locker, Gated, Arc<Mutex<Vec<Duration>>>) {
        let gated = Gated::default();
        let backend = Hooked {
            gated: Some(gated.clone()),
            ..Hooked::default()
        };
        let applied = backend.applied.clone();
        let locker = Locker::builder()
            .command_timeout(Duration::from_secs(10))
            .build(backend);
        (locker, gated, applied)
    }

    /// A locker over a [`Hooked`] backend, with its signal for each renewal batch's arrival.
    fn hooked_locker() -> (Locker, Arc<Notify>) {
        let backend = Hooked::default();
        let arrived = backend.batch_arrived.clone();
        let locker = Locker::builder()
            .command_timeout(Duration::from_secs(10))
            .build(backend);
        (locker, arrived)
    }

    /// Waits (at most 5 s) until the watchdog's task plans its next look at `due`.
    async fn until_planned(watchdog: &Watchdog, due: u64) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while watchdog.wakes_at.load(Ordering::Relaxed) != due {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the watchdog's task looked at the schedule");
    }

    /// Locks taken one after another, each released before the next, wake the watchdog's task
    /// once: each is due later than the one before, which the task sleeps until. It used to
    /// wake for every lock (an empty schedule took any due time as the earliest), a task
    /// switch per lock.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn locks_taken_one_after_another_wake_the_watchdog_once() {
        let (locker, _) = hooked_locker();
        let watchdog = locker.watchdog().clone();
        let ttl = Duration::from_secs(30);
        let first = locker.lock("one-by-one").ttl(ttl).acquire().await.unwrap();
        until_planned(&watchdog, first.lease().state().due.load(Ordering::Acquire)).await;
        first.release().await.unwrap();
        for _ in 0..49 {
            let guard = locker.lock("one-by-one").ttl(ttl).acquire().await.unwrap();
            guard.release().await.unwrap();
        }
        assert_eq!(watchdog.woken.load(Ordering::Relaxed), 1);
    }

    /// A guard due after a released one's due time, which the task sleeps until, is renewed:
    /// the task wakes then, finds nothing due, and sleeps until the guard's due time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_guard_due_after_the_planned_look_is_renewed() {
        let (locker, arrived) = hooked_locker();
        let watchdog = locker.watchdog().clone();
        let first = locker
            .lock("after")
            .ttl(Duration::from_millis(300))
            .acquire()
            .await
            .unwrap();
        let first_due = first.lease().state().due.load(Ordering::Acquire);
        until_planned(&watchdog, first_due).await;
        first.release().await.unwrap();
        let guard = locker
            .lock("after")
            .ttl(Duration::from_millis(900))
            .acquire()
            .await
            .unwrap();
        let due = guard.lease().state().due.load(Ordering::Acquire);
        assert!(due > first_due);
        assert_eq!(watchdog.woken.load(Ordering::Relaxed), 1);
        tokio::time::timeout(Duration::from_secs(5), arrived.notified())
            .await
            .expect("the guard's renewal came");
        until_rescheduled(guard.lease().state(), NOT_SCHEDULED).await;
        assert!(guard.is_held());
        assert_eq!(watchdog.renewals(), 1);
    }

    /// An extend refused as invalid leaves the renewals as they were, also when a renewal
    /// batch came due while it was on its way (the batch left the guard to the extend, off the
    /// schedule, and nothing put it back: the lease ran out mid-work).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_extend_refused_while_a_batch_came_due_keeps_the_renewals() {
        let (locker, refuse, _) = refusing_locker(false);
        let ttl = Duration::from_millis(300);
        let guard = Arc::new(locker.lock("refused").ttl(ttl).acquire().await.unwrap());
        let first_due = guard.lease().state().due.load(Ordering::Acquire);
        let extend = tokio::spawn({
            let guard = guard.clone();
            async move { guard.extend(Duration::from_secs(7)).await }
        });
        refuse.entered.notified().await;
        // The batch due at TTL/3 finds the guard's turn taken by the extend.
        until_rescheduled(guard.lease().state(), first_due).await;
        refuse.go.notify_one();
        let err = extend.await.unwrap().unwrap_err();
        assert!(err.is_invalid(), "{err}");
        assert!(
            tokio::time::timeout(ttl * 4, guard.lost()).await.is_err(),
            "the lease ran out: nothing renewed it"
        );
        assert!(guard.is_held());
    }

    /// An extend answered "renewed" after the local lease ran out and `lost()` resolved
    /// answers `Lost`, like `lost()` did, schedules no renewal, and gives the renewed lock back. Once, it answered `Ok`: the
    /// holder was told both that the lock was gone and that it was extended.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_extend_answered_after_the_loss_was_reported_is_lost() {
        let (locker, refuse, released) = refusing_locker(true);
        let guard = Arc::new(
            locker
                .lock("late-extend")
                .ttl(Duration::from_millis(200))
                .auto_renew(false)
                .acquire()
                .await
                .unwrap(),
        );
        let extend = tokio::spawn({
            let guard = guard.clone();
            async move { guard.extend(Duration::from_secs(7)).await }
        });
        refuse.entered.notified().await;
        tokio::time::timeout(Duration::from_secs(5), guard.lost())
            .await
            .expect("the local lease ran out");
        refuse.go.notify_one();
        let err = extend.await.unwrap().unwrap_err();
        assert!(err.is_lost(), "{err}");
        assert!(!guard.is_held());
        assert_eq!(locker.renewing(), 0, "a lost guard is not renewed");
        tokio::time::timeout(Duration::from_secs(5), released.notified())
            .await
            .expect("the lock the late extend renewed is given back, not kept for its TTL");
    }

    /// An extend after the local lease ran out is `Lost`, also when nothing awaited `lost()`
    /// (so the loss was not reported yet) and the backend still keeps the lock (its lease is a
    /// margin longer): the guard stays lost. Before, it sent the extend, and the backend's
    /// "renewed" made `is_held()` true again — after it had answered false, and where a release
    /// would have answered `Lost`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_extend_after_the_local_lease_ran_out_is_lost() {
        let backend = Hooked {
            margin_pct: 50,
            ..Hooked::default()
        };
        let locker = Locker::builder()
            .command_timeout(Duration::from_secs(10))
            .build(backend);
        let guard = locker
            .lock("ran-out")
            .ttl(Duration::from_millis(600))
            .auto_renew(false)
            .acquire()
            .await
            .unwrap();
        // No signal short of `lost()`, which would report the loss: look until the local lease
        // (300 ms) has run out; the backend keeps the lock until 600 ms.
        tokio::time::timeout(Duration::from_secs(5), async {
            while guard.is_held() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the local lease ran out");
        let err = guard.extend(Duration::from_secs(5)).await.unwrap_err();
        assert!(err.is_lost(), "{err}");
        assert!(!guard.is_held(), "the extend brought the lease back");
        tokio::time::timeout(Duration::from_secs(1), guard.lost())
            .await
            .expect("lost() resolves");
    }

    /// A renewal batch that finds a guard's turn taken (an extend on its way, or the batch
    /// before still settling) keeps the guard on the schedule and asks again shortly. Once, it
    /// dropped the guard, trusting the turn's holder to reschedule it — but a batch that had
    /// already rescheduled it (into the next batch's window: a renewal answered late) did not
    /// again, and the lease ran out under a live holder.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_that_finds_the_turn_taken_keeps_the_guard_scheduled() {
        let locker = Locker::builder()
            .command_timeout(Duration::from_secs(10))
            .build(Hooked::default());
        let ttl = Duration::from_millis(600);
        let guard = locker.lock("turn").ttl(ttl).acquire().await.unwrap();
        let state = guard.lease().state();
        let first_due = state.due.load(Ordering::Acquire);
        assert_ne!(first_due, NOT_SCHEDULED);
        let turn = state.turn.clone().lock_owned().await;
        // The batch due at TTL/3 comes and finds the turn taken.
        until_rescheduled(state, first_due).await;
        drop(turn);
        assert!(
            tokio::time::timeout(ttl * 4, guard.lost()).await.is_err(),
            "the lease ran out: nothing renewed it"
        );
        assert!(guard.is_held());
    }

    /// A batch that finds a guard's turn taken once its lease has ended leaves the guard to
    /// the turn's holder, off the schedule. Rescheduled at its lease end — a due time already
    /// past — it would be taken again at once, and again, in a busy loop for as long as the
    /// turn stayed taken.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_turn_taken_past_the_lease_end_is_not_asked_for_in_a_loop() {
        let (locker, _) = hooked_locker();
        let watchdog = locker.watchdog().clone();
        let guard = locker
            .lock("turn-past-end")
            .ttl(Duration::from_millis(300))
            .acquire()
            .await
            .unwrap();
        let state = guard.lease().state();
        let first_due = state.due.load(Ordering::Acquire);
        let turn = state.turn.clone().lock_owned().await;
        until_rescheduled(state, first_due).await;
        tokio::time::timeout(Duration::from_secs(5), async {
            while guard.is_held() || state.due.load(Ordering::Acquire) != NOT_SCHEDULED {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the lease ended and the guard left the schedule");
        // Not a synchronisation: a window in which a busy loop would wake the task thousands
        // of times.
        let woken = watchdog.woken.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(watchdog.woken.load(Ordering::Relaxed), woken);
        assert_eq!(state.due.load(Ordering::Acquire), NOT_SCHEDULED);
        drop(turn);
    }

    /// A guard whose renewal is on its way is still counted as renewed
    /// ([`Locker::renewing`](crate::Locker::renewing)). Off the schedule while its batch was
    /// out, it counted for nothing: of 100,000 held locks the bench saw 83,603 "renewing".
    #[tokio::test(flavor = "current_thread")]
    async fn a_guard_whose_renewal_is_on_its_way_counts_as_renewing() {
        let (locker, gated, _) = gated_locker();
        let guard = locker
            .lock("counted")
            .ttl(Duration::from_millis(600))
            .acquire()
            .await
            .unwrap();
        assert_eq!(locker.renewing(), 1);
        // The first batch (due at TTL/3) is on its way.
        gated.arrived.notified().await;
        assert_eq!(locker.renewing(), 1, "the guard in the batch on its way");
        gated.gate.notify_one();
        gated.applied_batch.notified().await;
        assert_eq!(locker.renewing(), 1, "the guard back on the schedule");
        guard.release().await.unwrap();
        assert_eq!(locker.renewing(), 0);
    }

    /// A watchdog batch sent with the old TTL that lands after the user's `extend` must not
    /// overwrite it: the extend waits for the batch, and every lease applied after the extend
    /// returned is the extended one.
    #[tokio::test(flavor = "current_thread")]
    async fn watchdog_batch_in_flight_cannot_overwrite_an_extend() {
        let (locker, gated, applied) = gated_locker();
        let (arrived, gate, applied_batch) = (&gated.arrived, &gated.gate, &gated.applied_batch);
        let short = Duration::from_millis(600);
        let long = Duration::from_secs(30);
        let guard = Arc::new(locker.lock("race").ttl(short).acquire().await.unwrap());
        // The watchdog's first batch (due at TTL/3) is now on its way with the old TTL.
        arrived.notified().await;
        let extend = tokio::spawn({
            let guard = guard.clone();
            async move { guard.extend(long).await }
        });
        // On this single-threaded runtime, let the extend run as far as it can: an in-memory
        // extend needs no I/O, so unless something holds it back it has landed by now.
        for _ in 0..32 {
            tokio::task::yield_now().await;
        }
        gate.notify_one();
        applied_batch.notified().await;
        extend.await.unwrap().unwrap();
        let log = applied.lock().unwrap().clone();
        assert_eq!(
            log.last(),
            Some(&long),
            "a renewal with the old TTL landed after the extend: {log:?}"
        );
        assert!(guard.remaining() > short, "{:?}", guard.remaining());
        assert_eq!(
            guard.lease().state().ttl(),
            long,
            "the watchdog renews the new TTL"
        );
    }

    /// A release within a minimum hold only shortens the lease to the hold's rest; a watchdog
    /// batch on its way with the full TTL must land before it, not after (it put the full TTL
    /// back: the lock stayed a whole TTL past the hold).
    #[tokio::test(flavor = "current_thread")]
    async fn a_renewal_in_flight_cannot_undo_a_release_within_a_minimum_hold() {
        let (locker, gated, applied) = gated_locker();
        let (arrived, gate, applied_batch) = (&gated.arrived, &gated.gate, &gated.applied_batch);
        let ttl = Duration::from_millis(900);
        let guard = locker
            .lock("held")
            .ttl(ttl)
            .hold_at_least(Duration::from_millis(600))
            .acquire()
            .await
            .unwrap();
        // The watchdog's first batch (due at TTL/3) is now on its way with the full TTL.
        arrived.notified().await;
        let release = tokio::spawn(guard.release());
        // Let the release run as far as it can (an in-memory extend needs no I/O).
        for _ in 0..32 {
            tokio::task::yield_now().await;
        }
        gate.notify_one();
        applied_batch.notified().await;
        release.await.unwrap().unwrap();
        let log = applied.lock().unwrap().clone();
        let last = *log.last().unwrap();
        assert!(
            last < ttl && last >= crate::MIN_TTL,
            "the last lease applied is not the hold's rest: {log:?}"
        );
    }

    /// A dropped guard's hold goes to the background; a retry that lands late sets the lease
    /// to what is left of the hold then, not to what was left at the drop (which kept the lock
    /// that long past the retry, beyond the hold's end).
    #[tokio::test]
    async fn a_late_background_retry_keeps_the_lock_no_longer_than_the_hold() {
        let backend = Arc::new(Hooked::default());
        let down = backend.down.clone();
        let locker = Locker::builder().build(backend.clone());
        let hold = Duration::from_secs(1);
        let taken = Instant::now();
        let guard = locker
            .lock("h")
            .ttl(Duration::from_secs(10))
            .auto_renew(false)
            .hold_at_least(hold)
            .acquire()
            .await
            .unwrap();
        down.store(true, Ordering::SeqCst);
        drop(guard);
        // Down past most of the hold: the retries back off (20, 40, 80 … ms), and the first
        // to land comes after the hold ended.
        tokio::time::sleep(Duration::from_millis(700)).await;
        down.store(false, Ordering::SeqCst);
        let other = Locker::builder().build(backend);
        let freed = loop {
            if let Some(g) = other.lock("h").try_acquire().await.unwrap() {
                break (taken.elapsed(), g);
            }
            assert!(
                taken.elapsed() < Duration::from_secs(8),
                "not free by 8 s: the background release gave up, or kept the lock"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert!(
            freed.0 >= hold,
            "freed before the hold ended: {:?}",
            freed.0
        );
        assert!(
            freed.0 < hold + Duration::from_millis(900),
            "freed {:?} after the grant, well past the {hold:?} hold",
            freed.0
        );
    }

    /// A renewal answered after the local lease ran out (the guard was reported lost) does
    /// not put the guard back on the schedule, and gives back the lock it renewed: the holder
    /// was told it lost the lock, so nobody waits a new TTL for it (the renewed key was kept
    /// for its TTL, while the guard lived; an extend answered late already gave it back).
    #[tokio::test]
    async fn a_guard_reported_lost_is_not_renewed_by_a_late_answer() {
        let backend = Arc::new(Hooked {
            late: Duration::from_millis(250),
            ..Hooked::default()
        });
        let locker = Locker::builder().build(backend.clone());
        let guard = locker
            .lock("late")
            .ttl(Duration::from_millis(300))
            .acquire()
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), guard.lost())
            .await
            .expect("the local lease ran out while the first renewal was unanswered");
        // The late answer lands, and the lock it renewed is given back at once.
        tokio::time::timeout(Duration::from_secs(5), backend.released.notified())
            .await
            .expect("the lock the late renewal renewed is given back");
        let other = Locker::builder().build(backend);
        let freed = other
            .lock("late")
            .try_acquire()
            .await
            .unwrap()
            .expect("given back, the lock is free");
        assert!(!guard.is_held());
        drop(freed);
    }

    /// A release made while the lock is held, with a renewal on its way that the backend applied
    /// but answers only after the local lease's end (a slow backend): the release waits for that
    /// answer (so no renewal lands after it), and the lock was this owner's all along —
    /// released, `Ok`. It answered `Lost`: whether the lease held was judged after that wait,
    /// and the late renewal's answer was not counted (the guard was already settling); for an
    /// idempotent operation's `complete`, nothing was stored and the next attempt ran the
    /// operation again.
    #[tokio::test]
    async fn a_release_while_held_is_not_lost_to_a_renewal_answered_late() {
        // The renewal due at 300 ms is applied then, and answered at 1,000 ms: after the
        // 900 ms local lease, before the 1,200 ms lease it gave the lock.
        let backend = Arc::new(Hooked {
            late: Duration::from_millis(700),
            ..Hooked::default()
        });
        let locker = Locker::builder().build(backend.clone());
        let guard = locker
            .lock("late-answer")
            .ttl(Duration::from_millis(900))
            .acquire()
            .await
            .unwrap();
        backend.batch_arrived.notified().await;
        assert!(guard.is_held());
        let released = guard.release().await;
        assert!(released.is_ok(), "{released:?}");
    }

    /// A lock given back after its guard was reported lost keeps its minimum hold: the give-back
    /// only shortens the lease to what is left of the hold, as the holder's own release would.
    /// Before, the give-back deleted it, and another owner took the lock before the hold ended
    /// (a job meant to run once per hold ran twice).
    #[tokio::test]
    async fn a_lock_given_back_after_a_loss_keeps_its_minimum_hold() {
        // The local lease is 40 % of the TTL (800 ms); the renewal due at 267 ms is answered
        // 700 ms later, after the loss was reported, and the lock it renewed is given back
        // about a second before the hold ends.
        let backend = Arc::new(Hooked {
            late: Duration::from_millis(700),
            margin_pct: 60,
            ..Hooked::default()
        });
        let locker = Locker::builder().build(backend.clone());
        let hold = Duration::from_secs(2);
        let taken = Instant::now();
        let guard = locker
            .lock("held")
            .ttl(hold)
            .hold_at_least(hold)
            .acquire()
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), guard.lost())
            .await
            .expect("the local lease ran out while the first renewal was unanswered");
        tokio::time::timeout(Duration::from_secs(5), backend.expired.notified())
            .await
            .expect("the lock the late renewal renewed is left to end with the hold");
        assert!(taken.elapsed() < hold, "the test ran past the hold");
        let other = Locker::builder().build(backend.clone());
        let early = other.lock("held").try_acquire().await.unwrap();
        assert!(early.is_none(), "taken by another owner within the hold");
        // Once the hold ends, the lock is free.
        let next = other
            .lock("held")
            .on_fail(crate::OnFail::retry(Duration::from_secs(5)))
            .acquire()
            .await
            .expect("free once the hold ends");
        assert!(taken.elapsed() >= hold, "freed before the hold ended");
        drop((guard, next));
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    /// The watchdog runs on the runtime of the first caller. When that runtime shuts down (an
    /// actix worker restarting, a set-up runtime dropped) with a renewal on its way, the task
    /// moves to the fallback thread: the lock is renewed on past its TTL, and the guard dropped
    /// afterwards, on a thread with no runtime, is released at once. Before, the renewal on its
    /// way was dropped with its guard off the schedule: nothing renewed the lock again.
    #[test]
    fn renewals_go_on_after_the_runtime_running_the_watchdog_shuts_down() {
        let backend = Arc::new(Hooked {
            late: Duration::from_millis(300),
            ..Hooked::default()
        });
        let (arrived, applied) = (backend.batch_arrived.clone(), backend.applied.clone());
        let released = backend.released.clone();
        let locker = Locker::builder().build(backend.clone());
        let ttl = Duration::from_millis(1500);
        let first = runtime();
        let other = runtime();
        let guard = first
            .block_on(locker.lock("moved").ttl(ttl).acquire())
            .unwrap();
        // The first renewal (due at TTL/3) is applied and now waits 300 ms for its answer.
        other.block_on(arrived.notified());
        drop(first);
        let before = applied.lock().unwrap().len();
        // Four renewals more, 500 ms apart: past the lease of the last renewal answered.
        let renewed_on = other.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), async {
                while applied.lock().unwrap().len() < before + 4 {
                    arrived.notified().await;
                }
            })
            .await
        });
        assert!(
            renewed_on.is_ok(),
            "not renewed after the runtime shut down: {} renewals applied",
            applied.lock().unwrap().len()
        );
        assert!(guard.is_held());
        let rival = Locker::builder().build(backend);
        let taken = other.block_on(rival.lock("moved").try_acquire()).unwrap();
        assert!(taken.is_none(), "the lock lapsed while its guard was held");
        drop(guard);
        other
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(5), released.notified()).await
            })
            .expect("the guard dropped off any runtime was not released");
        let taken = other.block_on(rival.lock("moved").try_acquire()).unwrap();
        assert!(taken.is_some(), "released, yet not free");
    }

    /// A background release cut off by its runtime shutting down is sent again from the
    /// fallback thread also when the locker was dropped before the guard. Before, with the
    /// locker (and so the watchdog) gone, the release on its way held no sender of the queue
    /// to put itself back with, the task ended with it, and the lock stayed taken until its
    /// TTL.
    #[test]
    fn a_release_cut_off_after_the_locker_is_gone_is_sent_again() {
        let entered = Arc::new(Notify::new());
        let backend = Arc::new(Hooked {
            stall_first_release: Some(entered.clone()),
            ..Hooked::default()
        });
        let released = backend.released.clone();
        let locker = Locker::builder().build(backend.clone());
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let guard = first
            .block_on(
                locker
                    .lock("cut")
                    .ttl(Duration::from_secs(60))
                    .auto_renew(false)
                    .acquire(),
            )
            .unwrap();
        first.block_on(async {
            drop(locker);
            drop(guard);
            entered.notified().await;
        });
        // The release is on its way (and never answers) when its runtime shuts down.
        drop(first);
        let other = runtime();
        other
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(5), released.notified()).await
            })
            .expect("the release cut off with its runtime was not sent again");
        let rival = Locker::builder().build(backend);
        let taken = other.block_on(rival.lock("cut").try_acquire()).unwrap();
        assert!(taken.is_some(), "released, yet not free");
    }

    /// A guard dropped on a thread with no runtime, before the watchdog ever ran (no renewal:
    /// nothing started it), is released at once on the fallback thread; its lock stayed taken
    /// until its TTL.
    #[test]
    fn a_guard_dropped_off_any_runtime_is_released() {
        let backend = Arc::new(Hooked::default());
        let released = backend.released.clone();
        let locker = Locker::builder().build(backend);
        let rt = runtime();
        let guard = rt
            .block_on(
                locker
                    .lock("plain")
                    .ttl(Duration::from_secs(60))
                    .auto_renew(false)
                    .acquire(),
            )
            .unwrap();
        drop(guard);
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), released.notified()).await
        })
        .expect("the guard dropped off any runtime was not released");
        let again = rt.block_on(locker.lock("plain").try_acquire()).unwrap();
        assert!(again.is_some(), "released, yet not free");
    }
}
