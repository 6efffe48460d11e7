//! Support code for `#[distributed_lock]`. Not public API: the attribute's expansion is the
//! only caller, and this module may change in any release. Its surface is listed in
//! `docs/macro-runtime-contract.md`, generated from this file by `tests/contract.rs`
//! (`DLOCK_BLESS=1 cargo test -p dlock-runtime --test contract` after a change here).

use std::future::Future;

pub use crate::key::KeyBuilder;
use crate::LockKind;
pub use crate::{LockError, LockKey, Locker, OnFail, RetryPolicy};
pub use ::core::time::Duration;

/// What the attribute asked for.
#[derive(Clone, Debug)]
pub struct Spec {
    ttl: Duration,
    on_fail: OnFail,
    cancel_on_lost: bool,
    message: Option<&'static str>,
    hold_at_least: Option<Duration>,
    kind: LockKind,
    name: &'static str,
}

impl Spec {
    /// `ttl`, reject on contention, ignore loss.
    pub fn new(ttl: Duration) -> Self {
        Spec {
            ttl,
            on_fail: OnFail::Reject,
            cancel_on_lost: false,
            message: None,
            hold_at_least: None,
            kind: LockKind::Exclusive,
            name: crate::metrics::UNNAMED,
        }
    }

    /// The key template, as the lock's name in metrics and traces (bounded: never the key).
    pub fn name(mut self, template: &'static str) -> Self {
        self.name = template;
        self
    }

    /// The one-key request this spec asks for.
    fn request(self, locker: &Locker, key: LockKey) -> crate::LockRequest<'_> {
        let request = locker
            .request(key, self.kind)
            .ttl(self.ttl)
            .on_fail(self.on_fail)
            .name(self.name);
        match self.hold_at_least {
            Some(hold) => request.hold_at_least(hold),
            None => request,
        }
    }

    /// `permits = n`: a permit of the semaphore on the key instead of the lock.
    pub fn permits(mut self, permits: u32) -> Self {
        self.kind = LockKind::Semaphore { permits };
        self
    }

    /// `mode = "read"`: a read hold of the read-write lock on the key.
    pub fn read(mut self) -> Self {
        self.kind = LockKind::Read;
        self
    }

    /// `mode = "write"`: the write hold of the read-write lock on the key.
    pub fn write(mut self) -> Self {
        self.kind = LockKind::Write;
        self
    }

    /// `hold_at_least = "…"` (checked against the ttl at compile time).
    pub fn hold_at_least(mut self, hold: Duration) -> Self {
        self.hold_at_least = Some(hold);
        self
    }

    /// `on_fail = "retry"` with deadline `wait`.
    pub fn retry(mut self, wait: Duration) -> Self {
        self.on_fail = OnFail::retry(wait);
        self
    }

    /// `through_outages = true`, after [`retry`](Self::retry): the wait goes on while the
    /// backend is down ([`RetryPolicy::through_outages`]).
    pub fn through_outages(mut self) -> Self {
        if let OnFail::Retry(policy) = &mut self.on_fail {
            policy.through_outages = true;
        }
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

/// `locker = <expr>` accepts a `Locker`, a reference to one, or anything that derefs to one
/// (`Arc<Locker>`, a `LazyLock<Locker>`): the expansion calls it on `&(expr)`, and method
/// lookup derefs down to the `&Locker` impl. There is no impl for `Locker` by value: lookup
/// would reach it first through a smart pointer, and moving out of one does not compile.
pub trait IntoLocker {
    /// The locker handle.
    fn into_locker(self) -> Locker;
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
/// releases. Re-enters when the current task already holds `key` on the same locker, in the
/// same kind (or a write hold for a read).
pub async fn run<F: Future>(
    locker: Result<Locker, LockError>,
    key: Result<LockKey, LockError>,
    spec: Spec,
    body: F,
) -> Result<F::Output, LockError> {
    run_all(locker, [key], spec, body).await
}

/// `run` for `key = ["…", …]`: takes every key all-or-nothing in canonical order
/// ([`Locker::lock_all`]), runs `body` with all of them visible to
/// [`held_locks`](crate::held_locks), releases them together. Keys the current task already
/// holds on the same locker are re-entered, the others taken.
pub async fn run_all<K, F>(
    locker: Result<Locker, LockError>,
    keys: K,
    spec: Spec,
    body: F,
) -> Result<F::Output, LockError>
where
    K: IntoIterator<Item = Result<LockKey, LockError>>,
    F: Future,
{
    let held = take(locker, keys, spec).await?;
    run_held(held, body).await
}

/// The locks of one call, taken (or re-entered) before its body exists — what `fallback = …`
/// needs, since the arguments are still the function's when the lock is not acquired.
pub struct Held {
    locker: Locker,
    /// `None`: every key re-entered.
    guard: Option<crate::MultiGuard>,
    cancel_on_lost: bool,
    /// With `cancel_on_lost`: the keys re-entered (an outer call holds them) and their leases,
    /// whose loss cancels this body too.
    reentered: Vec<(LockKey, crate::context::Watch)>,
    /// Every key re-entered, by its lease's watch: moved last in the body's scope, so that
    /// [`current_lock`](crate::current_lock) there is this call's lock.
    shown: Vec<crate::context::Watch>,
    /// The turns taken of the holds re-entered, given back when the body is done.
    _turns: Vec<crate::context::Turn>,
}

/// Takes a turn of a hold a call re-enters ([`Turns`](crate::context::Turns)) as the call's
/// strategy takes a lock: at once or [`LockError::Contended`] (`reject`, `skip`), waiting up
/// to the retry's deadline from `started` ([`LockError::Timeout`]), or waiting (`defer`: the
/// deferred job would wait for the lock too). Alone, unless the call reads.
async fn take_turn(
    turns: crate::context::Turns,
    key: &LockKey,
    spec: &Spec,
    started: tokio::time::Instant,
) -> Result<crate::context::Turn, LockError> {
    use crate::context::Turn;
    let shared = spec.kind == LockKind::Read;
    let now = || -> Option<Turn> {
        if shared {
            turns.clone().try_read_owned().ok().map(Turn::Shared)
        } else {
            turns.clone().try_write_owned().ok().map(Turn::Alone)
        }
    };
    if let Some(turn) = now() {
        return Ok(turn);
    }
    let wait = async {
        if shared {
            Turn::Shared(turns.clone().read_owned().await)
        } else {
            Turn::Alone(turns.clone().write_owned().await)
        }
    };
    match &spec.on_fail {
        OnFail::Reject => Err(LockError::contended(key.as_str(), None)),
        OnFail::Retry(policy) => {
            // `Duration::MAX` ("as long as it takes"): a century, as a lock's wait.
            let deadline = started
                .checked_add(policy.wait)
                .unwrap_or_else(|| started + crate::util::CENTURY);
            tokio::time::timeout_at(deadline, wait)
                .await
                .map_err(|_| LockError::timeout(key.as_str(), started.elapsed(), None))
        }
        OnFail::Defer(_) => Ok(wait.await),
    }
}

/// The first half of [`run_all`]: takes every key the current task does not hold yet (in the
/// spec's kind: a semaphore permit or a read or write hold has one key, the attribute checks).
pub async fn take<K>(
    locker: Result<Locker, LockError>,
    keys: K,
    spec: Spec,
) -> Result<Held, LockError>
where
    K: IntoIterator<Item = Result<LockKey, LockError>>,
{
    let locker = locker?;
    // An invalid key (or the same key twice) counts as an `error` outcome, as a request's
    // does. (No locker: no backend to label it with.)
    let counted = |e: LockError| {
        locker
            .labels(spec.name)
            .finished(Err(&e), std::time::Instant::now());
        e
    };
    let keys = keys
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .map_err(counted)?;
    let keys = crate::multi::canonical(keys).map_err(counted)?;
    // Re-entrant: keys this task already holds (an outer locked call) are not waited for —
    // that would wait for ourselves. A hold that is no longer held (lost, or its lease ran
    // out) is not re-entered: the body would run without the lock, maybe beside its new
    // owner.
    // A call that re-enters takes a turn of the hold it re-enters, so that calls nested side
    // by side take turns as tasks would (see `context::Turns`); in canonical order, like the
    // locks themselves.
    let mut reentered = Vec::new();
    let mut shown = Vec::new();
    let mut turns = Vec::new();
    let mut fresh: Vec<LockKey> = Vec::new();
    let started = tokio::time::Instant::now();
    for key in keys {
        match crate::context::reentered(locker.id(), &key, spec.kind) {
            Some((_, probe, _)) if !probe.is_held() => {
                return Err(counted(LockError::lost(key.as_str())))
            }
            Some((_, probe, of)) => {
                turns.push(take_turn(of, &key, &spec, started).await.map_err(counted)?);
                // The turn may have come after the lock was lost.
                if !probe.is_held() {
                    return Err(counted(LockError::lost(key.as_str())));
                }
                shown.push(probe.clone());
                if spec.cancel_on_lost {
                    reentered.push((key, probe));
                }
            }
            None => fresh.push(key),
        }
    }
    let mut held = Held {
        locker: locker.clone(),
        guard: None,
        cancel_on_lost: spec.cancel_on_lost,
        reentered,
        shown,
        _turns: turns,
    };
    if fresh.is_empty() {
        return Ok(held);
    }
    let message = spec.message;
    let with_message = |e: LockError| match message {
        Some(m) => e.with_detail(m),
        None => e,
    };
    let guard = if spec.kind == LockKind::Exclusive {
        let mut request = locker
            .lock_all(fresh)
            .ttl(spec.ttl)
            .on_fail(spec.on_fail)
            .name(spec.name);
        if let Some(hold) = spec.hold_at_least {
            request = request.hold_at_least(hold);
        }
        request.acquire().await.map_err(with_message)?
    } else {
        let Ok([key]) = <[LockKey; 1]>::try_from(fresh) else {
            return Err(LockError::InvalidKey {
                reason: "a semaphore or read-write lock takes one key".into(),
            });
        };
        let request = spec.request(&locker, key);
        crate::MultiGuard::single(request.acquire().await.map_err(with_message)?)
    };
    held.guard = Some(guard);
    Ok(held)
}

/// The second half of [`run_all`]: runs `body` under the locks of `held`, releases them.
/// With `on_lost = "cancel"`, the body is cancelled when any of its keys is lost — those it
/// took and those it re-entered (an outer call's, whatever that call's `on_lost`).
pub async fn run_held<F: Future>(held: Held, body: F) -> Result<F::Output, LockError> {
    let locker_id = held.locker.id();
    let Some(guard) = held.guard else {
        let body = crate::context::scope_nested(&held.shown, locker_id, Vec::new(), body);
        if held.reentered.is_empty() {
            return Ok(body.await);
        }
        tokio::pin!(body);
        // The loss first: a body woken after its lock was lost takes no further step.
        return tokio::select! {
            biased;
            key = reentered_lost(&held.reentered) => Err(LockError::lost(key.as_str())),
            out = &mut body => Ok(out),
        };
    };
    let scoped = crate::context::scope_nested(&held.shown, locker_id, guard.held(), body);
    let out = if held.cancel_on_lost {
        tokio::pin!(scoped);
        // Dropping `scoped` on a loss cancels the body at its current await point; the loss
        // is looked at first, so a body woken after its lock was lost (a process frozen past
        // its lease) takes no further step.
        tokio::select! {
            biased;
            _ = guard.lost() => return Err(LockError::lost(guard.lost_key())),
            key = reentered_lost(&held.reentered) => return Err(LockError::lost(key.as_str())),
            out = &mut scoped => out,
        }
    } else {
        scoped.await
    };
    if let Err(e) = guard.release().await {
        tracing::warn!(
            error = %held.locker.trace_error(&e),
            "dlock: lock was not cleanly released after the body finished"
        );
    }
    Ok(out)
}

/// Resolves with the key of the first of `reentered` found lost (never, when empty).
async fn reentered_lost(reentered: &[(LockKey, crate::context::Watch)]) -> &LockKey {
    let all = reentered.iter().map(|(key, probe)| {
        Box::pin(async move {
            probe.lost().await;
            key
        })
    });
    match all.len() {
        0 => std::future::pending().await,
        _ => futures_util::future::select_all(all).await.0,
    }
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
    let counted = |e: LockError| {
        locker
            .labels(spec.name)
            .finished(Err(&e), std::time::Instant::now());
        e
    };
    let key = key.map_err(counted)?;
    if let Some((_, probe, turns)) = crate::context::reentered(locker.id(), &key, spec.kind) {
        let _turn = take_turn(turns, &key, &spec, tokio::time::Instant::now())
            .await
            .map_err(counted)?;
        if !probe.is_held() {
            return Err(counted(LockError::lost(key.as_str())));
        }
        return Ok(crate::context::scope_nested(&[probe], locker.id(), Vec::new(), body).await);
    }
    spec.request(&locker, key).run(body).await
}

/// What a call skipped by `on_fail = "skip"` returns: `()`, `None`, or `Ok` of either.
#[diagnostic::on_unimplemented(
    message = "`on_fail = \"skip\"` needs a return type that can say \"skipped\", not `{Self}`",
    label = "a skipped call would have to return a `{Self}` here",
    note = "a skipped call returns `()`, `None`, `Ok(())` or `Ok(None)`: return `()`, `Option<T>`, `Result<(), E>` or `Result<Option<T>, E>`"
)]
pub trait Skipped {
    /// The "nothing done" value.
    fn skipped() -> Self;
}

impl Skipped for () {
    fn skipped() -> Self {}
}

impl<T> Skipped for Option<T> {
    fn skipped() -> Self {
        None
    }
}

impl<T: Skipped, E> Skipped for Result<T, E> {
    fn skipped() -> Self {
        Ok(T::skipped())
    }
}

/// `on_fail = "skip"`: a held lock ([`LockError::Contended`]) becomes `Ok(T::skipped())`;
/// every other outcome is returned as it is.
pub fn skip_held<T: Skipped>(outcome: Result<T, LockError>) -> Result<T, LockError> {
    match outcome {
        Err(LockError::Contended { .. }) => Ok(T::skipped()),
        other => other,
    }
}

/// Turns a [`LockError`] into the function's own `Result` type.
#[diagnostic::on_unimplemented(
    message = "`#[distributed_lock]` cannot return a `LockError` as `{Self}`",
    label = "the error type of this `Result` needs `impl From<dlock_runtime::LockError>`",
    note = "add `impl From<dlock_runtime::LockError> for YourError`, or return a non-`Result` type (it becomes `Result<T, LockError>`); with feature `axum`, `Response`, `StatusCode` and `(StatusCode, String)` are converted already, and for other foreign types (which that impl cannot be written for) wrap them in a type of your own"
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

    /// A call that re-enters a hold whose turn a call beside it has, with a retry that waits
    /// "as long as it takes" (`Duration::MAX`), waits for the turn (its deadline a century
    /// away, not an overflow).
    #[tokio::test]
    async fn a_turn_waited_for_without_end_does_not_overflow() {
        let turns = crate::context::Turns::default();
        let taken = turns.clone().try_write_owned().unwrap();
        let spec = Spec::new(Duration::from_secs(1)).retry(Duration::MAX);
        let key = LockKey::new("k").unwrap();
        let waiting = take_turn(turns, &key, &spec, tokio::time::Instant::now());
        tokio::pin!(waiting);
        assert!(futures_util::poll!(waiting.as_mut()).is_pending());
        drop(taken);
        assert!(waiting.await.is_ok());
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
