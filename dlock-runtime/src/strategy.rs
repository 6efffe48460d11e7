//! What to do when the lock is held: [`OnFail`], with [`RetryPolicy`] for waiting and
//! [`DeferPolicy`] for deferring; both back off with the one backoff in `util`.

use std::time::Duration;

use crate::util::{backoff, Jitter};

/// What an acquire does when another owner holds the lock.
///
/// The default is [`OnFail::Reject`]: one attempt, then [`LockError::Contended`]
/// (HTTP 409 with `Retry-After`). It suits a person at a form and anti-duplicate-submit;
/// choose [`OnFail::Retry`] for short critical sections that callers should wait for.
///
/// [`LockError::Contended`]: crate::LockError::Contended
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnFail {
    /// Make one attempt; if the lock is held, fail with
    /// [`LockError::Contended`](crate::LockError::Contended) carrying the holder's remaining
    /// lease.
    #[default]
    Reject,
    /// Wait for the lock until the policy's deadline, then fail with
    /// [`LockError::Timeout`](crate::LockError::Timeout). Waiters are served in arrival order
    /// and woken by the release itself; see [`RetryPolicy`]. A backend that is down ends the
    /// wait with [`LockError::Unavailable`](crate::LockError::Unavailable), unless the policy
    /// waits [through outages](RetryPolicy::through_outages).
    Retry(RetryPolicy),
    /// Hand the work to the locker's in-process delay queue and return
    /// [`LockError::Deferred`](crate::LockError::Deferred) (HTTP 202) at once; the queue runs it
    /// when the lock is free. Needs the work: use [`LockRequest::run`](crate::LockRequest::run)
    /// or the attribute (`acquire()` has no work to defer and treats this like `Reject`). See
    /// the `defer` module.
    Defer(DeferPolicy),
}

impl OnFail {
    /// [`OnFail::Retry`] with the default policy and the given deadline.
    ///
    /// ```
    /// # use dlock_runtime::OnFail;
    /// # use std::time::Duration;
    /// let on_fail = OnFail::retry(Duration::from_secs(5));
    /// ```
    pub fn retry(wait: Duration) -> Self {
        OnFail::Retry(RetryPolicy::new(wait))
    }

    /// [`OnFail::Defer`]: first deferred attempt after about `delay` (equal jitter: between
    /// half of it and all of it), at most `max_attempts`.
    pub fn defer(delay: Duration, max_attempts: u32) -> Self {
        OnFail::Defer(DeferPolicy::new(delay, max_attempts))
    }
}

/// How [`OnFail::Retry`] waits.
///
/// A waiter joins the key's FIFO queue (in the backend, so it is fair across processes) and
/// sleeps until the release of the lock names it as the next owner — one notification wakes one
/// waiter. As a fallback for lost notifications and for holders that die without releasing, it
/// also wakes after an exponential backoff with full jitter (`random(0, min(max_backoff,
/// base · 2ⁿ))`), never later than the holder's remaining lease or the waiter queue's refresh
/// interval, and never after the deadline.
///
/// Defaults: `wait` 10 s, `base` 100 ms, `max_backoff` 1 s, full jitter on, fair on, outages
/// end the wait. The base is high on purpose: the release notification is what wakes a waiter;
/// the timer is only the safety net, and a short one makes every queued waiter poll the backend.
///
/// **Outages.** By default a wait ends at the first answer that the backend is down
/// ([`LockError::Unavailable`](crate::LockError::Unavailable), a 503): a service fails fast and
/// its callers retry. [`through_outages`](RetryPolicy::through_outages) makes the wait ride
/// them out instead — a Sentinel failover, a restarted server, a Postgres switchover — up to
/// the same deadline.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// The deadline: how long to wait in total. No attempt starts after it; a backend request
    /// on its way then (each bounded by the locker's command timeout) is answered first, and
    /// a waiter leaves the queue before it reports the timeout — so a backend slow to answer
    /// can stretch a wait past its deadline by up to two command timeouts.
    pub wait: Duration,
    /// First backoff step of the fallback timer (a step is never under 1 ms: a zero backoff
    /// would ask the backend in a busy loop).
    pub base: Duration,
    /// Largest backoff step of the fallback timer.
    pub max_backoff: Duration,
    /// Full jitter on the fallback timer (on by default; off gives deterministic steps).
    pub jitter: bool,
    /// Serve waiters in arrival order (default). `false` lets any waiter take a free lock
    /// ("barging"): lower latency for the releaser's own next request, no fairness.
    pub fair: bool,
    /// Keep waiting while the backend is down, until the deadline
    /// ([`through_outages`](RetryPolicy::through_outages); off by default).
    pub through_outages: bool,
}

/// The least step of a wait's fallback timer.
const MIN_RETRY_STEP: Duration = Duration::from_millis(1);

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy::new(dlock_limits::DEFAULT_WAIT)
    }
}

impl RetryPolicy {
    /// The default policy with deadline `wait`.
    pub fn new(wait: Duration) -> Self {
        RetryPolicy {
            wait,
            base: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            jitter: true,
            fair: true,
            through_outages: false,
        }
    }

    /// Sets the fallback backoff's first and largest step.
    pub fn backoff(mut self, base: Duration, max_backoff: Duration) -> Self {
        self.base = base;
        self.max_backoff = max_backoff.max(base);
        self
    }

    /// Turns full jitter on the fallback timer on or off.
    pub fn jitter(mut self, on: bool) -> Self {
        self.jitter = on;
        self
    }

    /// Fair (FIFO, the default) or barging waiting.
    pub fn fair(mut self, on: bool) -> Self {
        self.fair = on;
        self
    }

    /// Keep waiting through outages (`true`), or end the wait at the first
    /// [`LockError::Unavailable`](crate::LockError::Unavailable) (`false`, the default).
    ///
    /// With it on, an attempt the backend did not answer — connection refused, timed out,
    /// failed over — is made again after the fallback backoff (at least 10 ms, and never later
    /// than the waiter queue's refresh interval, a third of the waiter TTL: a fair waiter keeps
    /// its place through an outage shorter than its queue entry's life, and is not handed locks
    /// it sleeps through; a release notification that reaches it ends the pause at once), by
    /// the same owner token, until the deadline. Such an attempt may
    /// still have taken the lock; the next one by the same token is granted it (every backend
    /// answers an attempt by the lock's own holder with a fresh grant), so nothing is held twice
    /// and nothing is left held. The rest of taking a lock goes on too:
    /// * a grant its replicas did not acknowledge in time
    ///   ([`LockRequest::replicas`](crate::LockRequest::replicas)), or that was gone by then
    ///   (a master that failed over), is given back and asked for again — a fair waiter
    ///   leaves the queue with it and joins again at its end;
    /// * a lock handed over with a short lease that could not be extended to its TTL (without
    ///   auto-renewal) is released and asked for again with a new owner token.
    ///
    /// A deadline that passes during the outage ends the wait with the last `Unavailable` error
    /// (503): whether the lock was free is not known. A refusal that retrying cannot fix — a
    /// wrong password, a Redis ACL, a Postgres grant, an etcd role or a ZooKeeper ACL without
    /// the lock keys, a missing schema — is no outage: it ends the wait at once with
    /// [`LockError::Misconfigured`](crate::LockError::Misconfigured) (500). With
    /// `Duration::MAX` the wait lasts as long as the outage does.
    ///
    /// ```
    /// # use dlock_runtime::{OnFail, RetryPolicy};
    /// # use std::time::Duration;
    /// // Wait up to 30 s for the lock, through a failover if one comes.
    /// let on_fail = OnFail::Retry(RetryPolicy::new(Duration::from_secs(30)).through_outages(true));
    /// ```
    pub fn through_outages(mut self, on: bool) -> Self {
        self.through_outages = on;
        self
    }

    /// The fallback sleep before attempt number `n` (0-based).
    pub(crate) fn backoff_step(&self, n: u32) -> Duration {
        let jitter = if self.jitter {
            Jitter::Full
        } else {
            Jitter::None
        };
        backoff(self.base, n, self.max_backoff, jitter).max(MIN_RETRY_STEP)
    }
}

/// How deferred work is retried. Defaults: first delay 1 s, 5 attempts, backoff capped at
/// 5 minutes.
///
/// Attempt `n` (1-based, counting the caller's own first try as attempt 0) waits
/// `delay · 2ⁿ⁻¹` with "equal jitter" (a random point in the upper half of the step), capped at
/// `max_delay` (and at a year).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeferPolicy {
    /// The first backoff step: the first deferred attempt waits between half of it and all of
    /// it.
    pub delay: Duration,
    /// How many deferred attempts before the job is dead-lettered.
    pub max_attempts: u32,
    /// Largest backoff step (default: 5 minutes, or `delay` when that is longer).
    pub max_delay: Duration,
}

impl Default for DeferPolicy {
    fn default() -> Self {
        DeferPolicy::new(
            dlock_limits::DEFAULT_DEFER_DELAY,
            dlock_limits::DEFAULT_DEFER_MAX_ATTEMPTS,
        )
    }
}

impl DeferPolicy {
    /// About `delay` before the first deferred attempt (between half of it and all of it),
    /// `max_attempts` attempts in all. The cap on the steps starts at 5 minutes, or at
    /// `delay` when that is longer (before, a `delay` over 5 minutes was cut to 5 minutes).
    pub fn new(delay: Duration, max_attempts: u32) -> Self {
        DeferPolicy {
            delay,
            max_attempts: max_attempts.max(1),
            max_delay: delay.max(Duration::from_secs(300)),
        }
    }

    /// Caps the backoff step.
    pub fn max_delay(mut self, d: Duration) -> Self {
        self.max_delay = d;
        self
    }

    /// The wait before deferred attempt `attempt` (1-based); at least a millisecond, whatever
    /// the `delay` (zero included): a job is not tried in a busy loop.
    pub fn backoff(&self, attempt: u32) -> Duration {
        backoff(
            self.delay,
            attempt.saturating_sub(1),
            self.max_delay,
            Jitter::Equal,
        )
        .max(MIN_RETRY_STEP)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps as long as a `Duration` holds neither panic (the jitter's `% (step + 1)`
    /// overflowed) nor reach past a year (the defer queues' timer wheels refuse deadlines past
    /// about two years).
    #[test]
    fn huge_steps_are_capped_and_never_panic() {
        let retry = RetryPolicy::new(Duration::from_secs(1)).backoff(Duration::MAX, Duration::MAX);
        for n in [0, 1, 40] {
            assert!(retry.backoff_step(n) <= crate::util::MAX_BACKOFF_STEP);
        }
        let defer = DeferPolicy::new(Duration::MAX, 3).max_delay(Duration::MAX);
        for attempt in [1, 2, 3] {
            let step = defer.backoff(attempt);
            assert!(step <= crate::util::MAX_BACKOFF_STEP, "{step:?}");
            assert!(step >= crate::util::MAX_BACKOFF_STEP / 2, "{step:?}");
        }
        for _ in 0..100 {
            let _ = crate::util::random_up_to(Duration::MAX);
        }
    }

    /// The first deferred attempt waits about `delay` — between half of it and all of it —
    /// also when `delay` is over the default 5-minute cap.
    #[test]
    fn the_first_deferred_attempt_waits_about_its_delay() {
        for delay in [Duration::from_secs(2), Duration::from_secs(600)] {
            let policy = DeferPolicy::new(delay, 3);
            for _ in 0..50 {
                let first = policy.backoff(1);
                assert!(
                    first >= delay / 2 && first <= delay,
                    "{first:?} for {delay:?}"
                );
            }
        }
    }

    #[test]
    fn backoff_grows_to_the_cap_without_jitter() {
        let p = RetryPolicy::new(Duration::from_secs(1))
            .backoff(Duration::from_millis(10), Duration::from_millis(70))
            .jitter(false);
        let steps: Vec<_> = (0..5).map(|n| p.backoff_step(n).as_millis()).collect();
        assert_eq!(steps, vec![10, 20, 40, 70, 70]);
        assert_eq!(p.backoff_step(1000).as_millis(), 70);
    }

    /// A zero backoff would have a waiter whose notification does not come ask the backend in
    /// a busy loop (and a deferred job with a zero delay be tried in one).
    #[test]
    fn a_zero_backoff_still_waits_a_millisecond() {
        for jitter in [true, false] {
            let p = RetryPolicy::new(Duration::from_secs(1))
                .backoff(Duration::ZERO, Duration::ZERO)
                .jitter(jitter);
            for n in 0..50 {
                assert_eq!(p.backoff_step(n), Duration::from_millis(1));
            }
        }
        // Nor a deferred job: a zero delay tried it in a busy loop while its lock was held.
        let defer = DeferPolicy::new(Duration::ZERO, 3);
        for attempt in 1..50 {
            assert_eq!(defer.backoff(attempt), Duration::from_millis(1));
        }
    }

    #[test]
    fn full_jitter_stays_within_the_step() {
        let p = RetryPolicy::new(Duration::from_secs(1))
            .backoff(Duration::from_millis(10), Duration::from_millis(80));
        for n in 0..200 {
            let cap = Duration::from_millis(10 * (1 << (n % 4))).min(Duration::from_millis(80));
            assert!(p.backoff_step(n % 4) <= cap);
        }
    }

    #[test]
    fn backoff_doubles_with_jitter_in_the_upper_half_and_is_capped() {
        let p =
            DeferPolicy::new(Duration::from_millis(100), 5).max_delay(Duration::from_millis(500));
        for (attempt, step) in [(1u32, 100u64), (2, 200), (3, 400), (4, 500), (9, 500)] {
            for _ in 0..50 {
                let b = p.backoff(attempt).as_millis() as u64;
                assert!(
                    b >= step / 2 && b <= step,
                    "attempt {attempt}: {b} ms vs step {step}"
                );
            }
        }
    }
}
