//! Bounded polling, for state that nothing signals: a key freeing on a server after a fault, a
//! node rejoining a quorum, a queue reaching a state. Where a signal exists (a channel, a
//! `Notify`, a join handle), wait on the signal instead.
//!
//! Every helper checks first, then fails the test if its deadline has passed, then sleeps and
//! checks again: a condition that already holds never sleeps, and a condition that never holds
//! fails the test with the reason the last check gave.
//!
//! ```no_run
//! # async fn demo(locker: dlock_runtime::Locker) {
//! use std::time::Duration;
//! use dlock_tests::wait::{poll_until, wait_until_free, Deadline};
//!
//! // Until an acquire succeeds: at most 5 s, every 20 ms.
//! let guard = poll_until(Duration::from_secs(5), Duration::from_millis(20), async || {
//!     locker.lock("k").acquire().await.map_err(|e| format!("never acquired: {e}"))
//! })
//! .await;
//! guard.release().await.unwrap();
//! // Until the key is free again (taken and released at once).
//! let deadline = Deadline::after(Duration::from_secs(5));
//! wait_until_free(&locker, "k", &deadline, Duration::from_millis(20), "the key stays locked").await;
//! # }
//! ```

use std::fmt::Display;
use std::time::{Duration, Instant};

use dlock_runtime::Locker;

/// A point in time a test must not wait past: the moment it was made plus a limit.
#[derive(Clone, Copy, Debug)]
pub struct Deadline {
    start: Instant,
    limit: Duration,
}

impl Deadline {
    /// `limit` from now.
    pub fn after(limit: Duration) -> Self {
        Deadline {
            start: Instant::now(),
            limit,
        }
    }

    /// The time since the deadline was made.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// Fails the test with `why` (and the time waited) if the deadline has passed.
    ///
    /// # Panics
    /// When `limit` has passed since [`after`](Self::after).
    pub fn check(&self, why: impl Display) {
        let elapsed = self.elapsed();
        assert!(
            elapsed < self.limit,
            "{why} (waited {elapsed:?}, limit {:?})",
            self.limit
        );
    }
}

/// Calls `probe` until it returns `Ok`, and returns that value. After every `Err(why)` it
/// [checks](Deadline::check) `deadline` with `why`, then sleeps `every` (or only yields to the
/// scheduler when `every` is zero). `probe` may panic itself on an answer that must not occur.
///
/// # Panics
/// When the deadline passes while `probe` still answers `Err`.
pub async fn poll<T, E: Display>(
    deadline: &Deadline,
    every: Duration,
    mut probe: impl AsyncFnMut() -> Result<T, E>,
) -> T {
    loop {
        match probe().await {
            Ok(v) => return v,
            Err(why) => deadline.check(why),
        }
        if every.is_zero() {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(every).await;
        }
    }
}

/// [`poll`] with a deadline `limit` from now.
///
/// # Panics
/// When `limit` passes while `probe` still answers `Err`.
pub async fn poll_until<T, E: Display>(
    limit: Duration,
    every: Duration,
    probe: impl AsyncFnMut() -> Result<T, E>,
) -> T {
    poll(&Deadline::after(limit), every, probe).await
}

/// Calls `probe` every 10 ms until it returns `Some`, and returns that value.
///
/// # Panics
/// "timed out waiting for `what`" when `limit` passes first.
pub async fn wait_for<T>(
    what: &str,
    limit: Duration,
    mut probe: impl AsyncFnMut() -> Option<T>,
) -> T {
    poll_until(limit, Duration::from_millis(10), async || {
        probe()
            .await
            .ok_or_else(|| format!("timed out waiting for {what}"))
    })
    .await
}

/// Waits until `locker` can take `key` at once (`try_acquire`), and releases it right away.
/// Busy answers and errors are both "not yet"; `why` says what failed when the deadline
/// passes.
///
/// # Panics
/// When the deadline passes before the key was free, or when the release fails.
pub async fn wait_until_free(
    locker: &Locker,
    key: &str,
    deadline: &Deadline,
    every: Duration,
    why: &str,
) {
    poll(deadline, every, async || {
        match locker.lock(key).try_acquire().await {
            Ok(Some(g)) => {
                g.release().await.unwrap();
                Ok(())
            }
            _ => Err(why),
        }
    })
    .await;
}

/// Takes `key` at once (`try_acquire` with `ttl`), or says why not: held, or the backend's
/// error — which must be the typed 503 one (what fault tests poll with [`poll_until`]).
///
/// # Panics
/// When the backend answers an error other than [`LockError::Unavailable`](dlock_runtime::LockError::Unavailable).
pub async fn try_take(
    locker: &Locker,
    key: &str,
    ttl: Duration,
) -> Result<dlock_runtime::LockGuard, String> {
    match locker.lock(key).ttl(ttl).try_acquire().await {
        Ok(Some(g)) => Ok(g),
        Ok(None) => Err(format!("`{key}` is held")),
        Err(e) => {
            assert!(e.is_unavailable(), "{e}");
            Err(e.to_string())
        }
    }
}

/// Takes `key` (`try_acquire`) once the backend is back after a fault, polling every `every`
/// for at most `limit`; each failed attempt must be the typed 503 one.
///
/// # Panics
/// When `key` is held (nobody else may hold it), on another error, or when `limit` passes
/// first.
pub async fn taken_once_back(
    locker: &Locker,
    key: &str,
    limit: Duration,
    every: Duration,
) -> dlock_runtime::LockGuard {
    poll_until(limit, every, async || {
        match locker.lock(key).try_acquire().await {
            Ok(Some(g)) => Ok(g),
            Ok(None) => panic!("nobody holds `{key}`, yet it was busy"),
            Err(e) => {
                assert!(e.is_unavailable(), "{e}");
                Err(format!("`{key}` not back: {e}"))
            }
        }
    })
    .await
}

/// How long it took to take and release `key` with `.replicas(1)` (polled every 20 ms, 10 s at
/// most), where each failed attempt must be the typed 503 one: a replica that does not
/// acknowledge in time, or a connection not back yet.
///
/// # Panics
/// On another error, or when no attempt succeeds within 10 s (the last error in the message,
/// after `label`).
pub async fn acknowledged_acquire(locker: &Locker, key: &str, label: &str) -> Duration {
    let started = Instant::now();
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        async || match locker.lock(key).replicas(1).acquire().await {
            Ok(g) => Ok(g),
            Err(e) => {
                assert!(e.is_unavailable(), "{e}");
                Err(format!("{label}: {e}"))
            }
        },
    )
    .await
    .release()
    .await
    .unwrap();
    started.elapsed()
}

/// `rounds` more [`acknowledged_acquire`]s of `key`, each within `bound`: after a fault, every
/// connection for `WAIT` has been replaced, not only the first one used.
///
/// # Panics
/// As [`acknowledged_acquire`], and when a round takes `bound` or longer.
pub async fn acknowledged_again(locker: &Locker, key: &str, rounds: usize, bound: Duration) {
    for round in 0..rounds {
        let took = acknowledged_acquire(locker, key, "after, again").await;
        assert!(took < bound, "acknowledged acquire {round} took {took:?}");
    }
}

/// Asserts that connecting to `url` (whose password is wrong) fails as `Misconfigured` with
/// each command timeout of `timeouts_ms` — also those shorter than the client's sign-in
/// retries take — and that no text of `secrets` shows in the error.
///
/// # Panics
/// If a connect succeeds or fails otherwise, or the error shows a secret.
pub async fn refused_at_connect(url: &str, timeouts_ms: &[u64], secrets: &[&str]) {
    for &ms in timeouts_ms {
        let err = Locker::builder()
            .command_timeout(Duration::from_millis(ms))
            .connect(url)
            .await
            .expect_err("connected with a wrong password");
        assert!(err.is_misconfigured(), "{ms} ms: {err}");
        let shown = format!("{err} {err:?}");
        for secret in secrets {
            assert!(!shown.contains(secret), "{ms} ms: {shown}");
        }
    }
}

/// Asserts that `locker`'s backend refuses `key` for good: a try is `Misconfigured` (500, no
/// `Retry-After`), and a 30 s wait through outages ends with it at once — within a sixth of
/// its deadline, where a refusal taken for an outage retried until the deadline.
///
/// # Panics
/// If an answer is anything else, or the wait lasts.
pub async fn refused_at_once(locker: &Locker, key: &str) {
    use dlock_runtime::{OnFail, RetryPolicy};
    let err = locker
        .lock(key)
        .try_acquire()
        .await
        .expect_err("a backend that refuses the lock keys granted a lock");
    assert!(err.is_misconfigured(), "{err}");
    assert_eq!(err.status(), 500);
    assert_eq!(err.retry_after_secs(), None);
    let wait = Duration::from_secs(30);
    let start = Instant::now();
    let err = locker
        .lock(key)
        .on_fail(OnFail::Retry(RetryPolicy::new(wait).through_outages(true)))
        .acquire()
        .await
        .expect_err("a backend that refuses the lock keys granted a lock");
    let took = start.elapsed();
    assert!(err.is_misconfigured(), "{err}");
    assert!(
        took < wait / 6,
        "waited {took:?} of its {wait:?} for a refusal"
    );
}

/// Asserts that `locker` takes `key`, refuses it to a second try while held, and releases it:
/// for lockers whose timeouts were given as "never" (`Duration::MAX`), which must work as a
/// day's and not overflow an `Instant`.
///
/// # Panics
/// If any of the three fails.
pub async fn locks_and_holds(locker: &Locker, key: &str) {
    let g = locker.lock(key).acquire().await.unwrap();
    assert!(
        locker.lock(key).try_acquire().await.unwrap().is_none(),
        "`{key}` taken twice"
    );
    g.release().await.unwrap();
}

/// Asserts that a barging waiter (`fair(false)`: not in the line) of `locker` is woken by the
/// holder's release — within 2.5 s of it, where its fallback timer is 5 s (no jitter) — and
/// gets the lock. `locker` should have a waiter TTL of 30 s or more, so that its queue refresh
/// does not come sooner either.
///
/// # Panics
/// If the waiter is late or fails.
pub async fn a_barging_waiter_is_woken_by_a_release(locker: &Locker, key: &str) {
    use dlock_runtime::{OnFail, RetryPolicy};
    let held = locker.lock(key).acquire().await.unwrap();
    let waiter = tokio::spawn({
        let (locker, key) = (locker.clone(), key.to_owned());
        let policy = RetryPolicy::new(Duration::from_secs(30))
            .backoff(Duration::from_secs(5), Duration::from_secs(5))
            .jitter(false)
            .fair(false);
        async move {
            locker
                .lock(&key)
                .on_fail(OnFail::Retry(policy))
                .acquire()
                .await
        }
    });
    wait_for("the waiter", Duration::from_secs(5), async || {
        (locker.waiting() == 1).then_some(())
    })
    .await;
    held.release().await.unwrap();
    let released = Instant::now();
    let g = waiter.await.unwrap().unwrap();
    let took = released.elapsed();
    assert!(
        took < Duration::from_millis(2500),
        "woken {took:?} after the release"
    );
    g.release().await.unwrap();
}

/// Runs a closure when dropped — also when the test panics first — or earlier, at
/// [`run`](Self::run): the undoing of a fault (a frozen node thawed) that the other tests of a
/// binary sharing the server must not inherit from a failed check.
pub struct OnDrop<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> OnDrop<F> {
    /// `f`, run when this is dropped.
    pub fn new(f: F) -> Self {
        OnDrop(Some(f))
    }

    /// Runs it now.
    pub fn run(mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

impl<F: FnOnce()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

/// Releases `held` and answers the guard `waiter` — a task waiting for the same lock — gets:
/// within 2 s of the release (its fallback re-check comes far later: it heard the release's
/// notification).
///
/// # Panics
/// When the waiter has no lock 3 s after the release, or got it after 2 s, or failed.
pub async fn handed_on_release(
    held: dlock_runtime::LockGuard,
    waiter: tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, dlock_runtime::LockError>>,
) -> dlock_runtime::LockGuard {
    let released = Instant::now();
    held.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(3), waiter)
        .await
        .expect("the waiter never heard of the release")
        .unwrap()
        .unwrap();
    let took = released.elapsed();
    assert!(took < Duration::from_secs(2), "woken after {took:?}");
    guard
}
