//! Support code for `#[distributed_lock]`. Not public API: the attribute's expansion is the
//! only caller, and this module may change in any release. Its surface is listed in
//! `docs/macro-runtime-contract.md`, generated from this file by `tests/contract.rs`
//! (`DLOCK_BLESS=1 cargo test -p dlock-runtime --test contract` after a change here).

use std::future::Future;

pub use crate::key::KeyBuilder;
pub use crate::{LockError, LockKey, Locker, OnFail, RetryPolicy};
pub use ::core::time::Duration;

/// What the attribute asked for.
#[derive(Clone, Debug)]
pub struct Spec {
    ttl: Duration,
    on_fail: OnFail,
    cancel_on_lost: bool,
    message: Option<&'static str>,
}

impl Spec {
    /// `ttl`, reject on contention, ignore loss.
    pub fn new(ttl: Duration) -> Self {
        Spec {
            ttl,
            on_fail: OnFail::Reject,
            cancel_on_lost: false,
            message: None,
        }
    }

    /// `on_fail = "retry"` with deadline `wait`.
    pub fn retry(mut self, wait: Duration) -> Self {
        self.on_fail = OnFail::retry(wait);
        self
    }

    /// `on_fail = "defer"` with `delay` and `max_attempts`.
    pub fn defer(mut self, delay: Duration, max_attempts: u32) -> Self {
        self.on_fail = OnFail::defer(delay, max_attempts);
        self
    }

    /// `on_lost = "cancel"`.
    pub fn cancel_on_lost(mut self) -> Self {
        self.cancel_on_lost = true;
        self
    }

    /// `message = "…"`.
    pub fn message(mut self, detail: &'static str) -> Self {
        self.message = Some(detail);
        self
    }
}

/// `locker = <expr>` accepts a `Locker` or a reference to one.
pub trait IntoLocker {
    /// The locker handle.
    fn into_locker(self) -> Locker;
}

impl IntoLocker for Locker {
    fn into_locker(self) -> Locker {
        self
    }
}

impl IntoLocker for &Locker {
    fn into_locker(self) -> Locker {
        self.clone()
    }
}

impl IntoLocker for &&Locker {
    fn into_locker(self) -> Locker {
        (*self).clone()
    }
}

/// The global default locker, or [`LockError::NoLocker`].
pub fn default_locker() -> Result<Locker, LockError> {
    crate::default_locker().ok_or(LockError::NoLocker)
}

/// Takes the lock, runs `body` with the lock visible to [`current_lock`](crate::current_lock),
/// releases. Re-enters when the current task already holds `key` on the same locker.
pub async fn run<F: Future>(
    locker: Result<Locker, LockError>,
    key: Result<LockKey, LockError>,
    spec: Spec,
    body: F,
) -> Result<F::Output, LockError> {
    let locker = locker?;
    let key = key?;
    if crate::context::held_by_task(locker.id(), &key).is_some() {
        // Re-entrant: this task already holds the lock (an outer locked call), so waiting for
        // it would wait for ourselves.
        return Ok(body.await);
    }
    let guard = locker
        .lock(key)
        .ttl(spec.ttl)
        .on_fail(spec.on_fail)
        .acquire()
        .await
        .map_err(|e| match spec.message {
            Some(m) => e.with_detail(m),
            None => e,
        })?;
    let scoped = crate::context::scope(locker.id(), guard.info(), body);
    let out = if spec.cancel_on_lost {
        tokio::pin!(scoped);
        tokio::select! {
            biased;
            out = &mut scoped => out,
            _ = guard.lost() => {
                // Dropping `scoped` here cancels the body at its current await point.
                return Err(LockError::lost(guard.key()));
            }
        }
    } else {
        scoped.await
    };
    if let Err(e) = guard.release().await {
        tracing::warn!(error = %e, "dlock: lock was not cleanly released after the body finished");
    }
    Ok(out)
}

/// `run` for `on_fail = "defer"`: when the lock is busy, the (not yet polled) body goes to the
/// locker's in-process delay queue and [`LockError::Deferred`] comes back at once. The
/// attribute checks that every argument is `'static + Send`, so the body is too.
pub async fn run_deferrable<F>(
    locker: Result<Locker, LockError>,
    key: Result<LockKey, LockError>,
    spec: Spec,
    body: F,
) -> Result<F::Output, LockError>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let locker = locker?;
    let key = key?;
    if crate::context::held_by_task(locker.id(), &key).is_some() {
        return Ok(body.await);
    }
    locker
        .lock(key)
        .ttl(spec.ttl)
        .on_fail(spec.on_fail)
        .run(body)
        .await
}

/// Turns a [`LockError`] into the function's own `Result` type.
#[diagnostic::on_unimplemented(
    message = "`#[distributed_lock]` cannot return a `LockError` as `{Self}`",
    label = "the error type of this `Result` needs `impl From<dlock_runtime::LockError>`",
    note = "add `impl From<dlock_runtime::LockError> for YourError`, or return a non-`Result` type (it becomes `Result<T, LockError>`)"
)]
pub trait FromLockError {
    /// The conversion.
    fn from_lock_error(err: LockError) -> Self;
}

impl<T, E: From<LockError>> FromLockError for Result<T, E> {
    fn from_lock_error(err: LockError) -> Self {
        Err(E::from(err))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // No unit test in this crate sets the global default locker, so it is unset here.
    #[tokio::test]
    async fn no_default_locker_is_a_typed_error_not_a_panic() {
        let ran = std::sync::atomic::AtomicBool::new(false);
        let err = run(
            default_locker(),
            LockKey::new("k"),
            Spec::new(Duration::from_secs(1)),
            async { ran.store(true, std::sync::atomic::Ordering::SeqCst) },
        )
        .await
        .unwrap_err();
        assert!(err.is_no_locker(), "{err}");
        assert_eq!(err.status(), 500);
        assert!(
            !ran.load(std::sync::atomic::Ordering::SeqCst),
            "body ran without a lock"
        );
    }

    #[tokio::test]
    async fn message_becomes_the_problem_detail() {
        let locker = Locker::memory();
        let _held = locker.lock("m").acquire().await.unwrap();
        let err = run(
            Ok(locker.clone()),
            LockKey::new("m"),
            Spec::new(Duration::from_secs(1)).message("busy, try later"),
            async {},
        )
        .await
        .unwrap_err();
        assert!(
            err.problem_json()
                .contains("\"detail\":\"busy, try later\""),
            "{}",
            err.problem_json()
        );
    }
}
