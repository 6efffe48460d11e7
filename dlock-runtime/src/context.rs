//! The lock held by the current task, for fencing writes from inside a locked function.

use std::future::Future;
use std::sync::Arc;

use crate::{LockKey, LockKind};

/// What a holder knows about its lock: the key and the fencing token to pass to the resource
/// it writes (the resource rejects tokens lower than one it has seen).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LockInfo {
    key: LockKey,
    fencing_token: u64,
    kind: LockKind,
}

impl LockInfo {
    pub(crate) fn new(key: LockKey, fencing_token: u64) -> Self {
        LockInfo {
            key,
            fencing_token,
            kind: LockKind::Exclusive,
        }
    }

    pub(crate) fn with_kind(mut self, kind: LockKind) -> Self {
        self.kind = kind;
        self
    }

    /// What is held: a lock, a semaphore permit, a read or a write hold.
    pub fn kind(&self) -> LockKind {
        self.kind
    }

    /// The (encoded) logical key.
    pub fn key(&self) -> &str {
        self.key.as_str()
    }

    /// The key as a [`LockKey`].
    pub fn lock_key(&self) -> &LockKey {
        &self.key
    }

    /// The fencing token: strictly greater than every token issued for this key before.
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }
}

/// What a held lock's scope knows of its lease: when it is lost. The lease layer implements
/// it; a nested call that re-enters the lock watches it (`on_lost = "cancel"`).
pub(crate) trait LossWatch: Send + Sync {
    /// Resolves when the lock is known to be lost. Cancel-safe.
    fn lost(&self) -> futures_util::future::BoxFuture<'_, ()>;

    /// Whether the lock is still held as far as this process can tell (not reported lost,
    /// the local lease not run out, not released): a nested call re-enters only a held lock.
    fn is_held(&self) -> bool;
}

/// A held lock as the scopes that show it see it: its lease's [`LossWatch`], and the turns of
/// the nested calls that re-enter it ([`Turns`]). Made once per lease ([`watch`]).
pub(crate) struct Shown {
    lease: Box<dyn LossWatch>,
    turns: Turns,
}

impl Shown {
    /// See [`LossWatch::lost`].
    pub(crate) fn lost(&self) -> futures_util::future::BoxFuture<'_, ()> {
        self.lease.lost()
    }

    /// See [`LossWatch::is_held`].
    pub(crate) fn is_held(&self) -> bool {
        self.lease.is_held()
    }
}

/// A held lock's [`Shown`], shared by the scopes that show the lock.
pub(crate) type Watch = Arc<Shown>;

/// The [`Watch`] of a lease.
pub(crate) fn watch(lease: impl LossWatch + 'static) -> Watch {
    Arc::new(Shown {
        lease: Box::new(lease),
        turns: Turns::default(),
    })
}

/// The turns of the nested calls that re-enter one hold, one level deep: a call that re-enters
/// takes a turn for its body's run — alone (a lock, a permit, a write hold), or beside other
/// readers (a read hold) — so that two calls nested side by side in one body (`join!`,
/// `select!`, a `FuturesUnordered`) do not run at once on a key that lets one call at a time
/// run, as two tasks would not. Inside its body, the hold it re-entered has turns of its own,
/// so a call nested in it re-enters without waiting for itself.
pub(crate) type Turns = Arc<tokio::sync::RwLock<()>>;

/// A turn taken ([`Turns`]): held for the body's run, given back when dropped.
pub(crate) enum Turn {
    Shared(#[allow(dead_code)] tokio::sync::OwnedRwLockReadGuard<()>),
    Alone(#[allow(dead_code)] tokio::sync::OwnedRwLockWriteGuard<()>),
}

/// One lock the task holds: the locker it was taken through, what it is, and a watch on its
/// lease, so that a nested call that re-enters it can be cancelled when it is lost; and the
/// turns of the calls that re-enter it here ([`Turns`]: the lease's own at the level the lock
/// was taken, a call's own inside a call that re-entered it).
#[derive(Clone)]
struct Entry {
    locker_id: u64,
    info: LockInfo,
    probe: Watch,
    turns: Turns,
}

type Held = Arc<Vec<Entry>>;

tokio::task_local! {
    static HELD: Held;
}

/// The innermost lock held by the current task through `#[distributed_lock]` (or
/// [`with_lock`](crate::with_lock)), if any.
///
/// ```
/// # async fn f() {
/// if let Some(lock) = dlock_runtime::current_lock() {
///     println!("writing with fencing token {}", lock.fencing_token());
/// }
/// # }
/// ```
pub fn current_lock() -> Option<LockInfo> {
    HELD.try_with(|h| h.last().map(|e| e.info.clone()))
        .ok()
        .flatten()
}

/// Every lock the current task holds through `#[distributed_lock]` / [`with_lock`](crate::with_lock), outermost
/// first.
pub fn held_locks() -> Vec<LockInfo> {
    HELD.try_with(|h| h.iter().map(|e| e.info.clone()).collect())
        .unwrap_or_default()
}

/// The current task's hold on `key` taken through `locker_id` that covers `kind`, with the
/// watch on its lease, if it has one: the same kind (a lock, a permit of the semaphore, a read
/// or write hold), or a write hold when `kind` is a read.
pub(crate) fn reentered(
    locker_id: u64,
    key: &LockKey,
    kind: LockKind,
) -> Option<(LockInfo, Watch, Turns)> {
    let covers = |held: LockKind| {
        held == kind
            || (held == LockKind::Write && kind == LockKind::Read)
            || matches!(
                (held, kind),
                (LockKind::Semaphore { .. }, LockKind::Semaphore { .. })
            )
    };
    HELD.try_with(|h| {
        h.iter()
            .find(|e| e.locker_id == locker_id && e.info.lock_key() == key && covers(e.info.kind))
            .map(|e| (e.info.clone(), e.probe.clone(), e.turns.clone()))
    })
    .ok()
    .flatten()
}

/// Runs `fut` with `info` (and the watch on its lease, `probe`) added to the task's held locks (what
/// [`current_lock`] returns inside).
pub(crate) fn scope<F: Future>(
    locker_id: u64,
    info: LockInfo,
    probe: Watch,
    fut: F,
) -> impl Future<Output = F::Output> {
    scope_all(locker_id, vec![(info, probe)], fut)
}

/// Runs `fut` with every lock of `held` added to the task's held locks, in order.
pub(crate) fn scope_all<F: Future>(
    locker_id: u64,
    held: Vec<(LockInfo, Watch)>,
    fut: F,
) -> impl Future<Output = F::Output> {
    scope_nested(&[], locker_id, held, fut)
}

/// Runs `fut` with the task's held locks whose watches are among `reentered` (locks a nested
/// call re-enters) moved to the end, each with turns of its own ([`Turns`]: the call took one
/// of the level it re-entered), then every lock of `held` added, in order: inside,
/// [`current_lock`] is the nested call's lock — not the innermost other one — and no lock is
/// listed twice.
pub(crate) fn scope_nested<F: Future>(
    reentered: &[Watch],
    locker_id: u64,
    held: Vec<(LockInfo, Watch)>,
    fut: F,
) -> impl Future<Output = F::Output> {
    let mut all: Vec<Entry> = HELD.try_with(|h| (**h).clone()).unwrap_or_default();
    for probe in reentered {
        if let Some(i) = all.iter().position(|e| Arc::ptr_eq(&e.probe, probe)) {
            let entry = all.remove(i);
            all.push(Entry {
                turns: Turns::default(),
                ..entry
            });
        }
    }
    all.extend(held.into_iter().map(|(info, probe)| Entry {
        locker_id,
        info,
        turns: probe.turns.clone(),
        probe,
    }));
    HELD.scope(Arc::new(all), fut)
}

/// Runs `f` with `info` (and the watch on its lease, `probe`) added to the task's held locks.
pub(crate) fn in_scope<R>(
    locker_id: u64,
    info: LockInfo,
    probe: Watch,
    f: impl FnOnce() -> R,
) -> R {
    let mut all: Vec<Entry> = HELD.try_with(|h| (**h).clone()).unwrap_or_default();
    all.push(Entry {
        locker_id,
        info,
        turns: probe.turns.clone(),
        probe,
    });
    HELD.sync_scope(Arc::new(all), f)
}
