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

type Held = Arc<Vec<(u64, LockInfo)>>;

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
    HELD.try_with(|h| h.last().map(|(_, i)| i.clone()))
        .ok()
        .flatten()
}

/// Every lock the current task holds through `#[distributed_lock]` / [`with_lock`](crate::with_lock), outermost
/// first.
pub fn held_locks() -> Vec<LockInfo> {
    HELD.try_with(|h| h.iter().map(|(_, i)| i.clone()).collect())
        .unwrap_or_default()
}

/// The current task's hold on `key` taken through `locker_id` that covers `kind`, if it has
/// one: the same kind (a lock, a permit of the semaphore, a read or write hold), or a write
/// hold when `kind` is a read.
pub(crate) fn held_by_task(locker_id: u64, key: &LockKey, kind: LockKind) -> Option<LockInfo> {
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
            .find(|(l, i)| *l == locker_id && i.lock_key() == key && covers(i.kind))
            .map(|(_, i)| i.clone())
    })
    .ok()
    .flatten()
}

/// Runs `fut` with `info` added to the task's held locks (what [`current_lock`] returns inside).
pub(crate) fn scope<F: Future>(
    locker_id: u64,
    info: LockInfo,
    fut: F,
) -> impl Future<Output = F::Output> {
    scope_all(locker_id, vec![info], fut)
}

/// Runs `fut` with every lock of `infos` added to the task's held locks, in order.
pub(crate) fn scope_all<F: Future>(
    locker_id: u64,
    infos: Vec<LockInfo>,
    fut: F,
) -> impl Future<Output = F::Output> {
    let mut held: Vec<(u64, LockInfo)> = HELD.try_with(|h| (**h).clone()).unwrap_or_default();
    held.extend(infos.into_iter().map(|info| (locker_id, info)));
    HELD.scope(Arc::new(held), fut)
}

/// Polls `fut` once with `info` added to the task's held locks.
pub(crate) fn poll_scoped<F: Future + ?Sized>(
    locker_id: u64,
    info: &LockInfo,
    fut: std::pin::Pin<&mut F>,
    cx: &mut std::task::Context<'_>,
) -> std::task::Poll<F::Output> {
    let mut held: Vec<(u64, LockInfo)> = HELD.try_with(|h| (**h).clone()).unwrap_or_default();
    held.push((locker_id, info.clone()));
    HELD.sync_scope(Arc::new(held), || fut.poll(cx))
}
