//! The metrics dlock records, through the [`metrics`](https://docs.rs/metrics) crate facade
//! (cargo feature `metrics`, off by default): install any exporter (Prometheus, StatsD, …) and
//! they appear. Without the feature nothing is recorded and nothing costs anything; with it and
//! no recorder installed, each record is a call into the facade's no-op recorder.
//!
//! Every metric is labelled by `backend` (the [`Locker::backend_name`](crate::Locker::backend_name):
//! `memory`, `redis`, `redlock`, `postgres`, `etcd`, …) and by `name`, a **bounded** name of the
//! lock — never the key itself, so the number of series is bounded by construction:
//!
//! * `#[distributed_lock]`: the attribute's key template, e.g. `order:<id>`;
//! * by hand: [`LockRequest::name`](crate::LockRequest::name) (a `&'static str`);
//! * tower layers: the layer's `.name(..)`;
//! * durable jobs: the job type's [`NAME`](crate::durable::Job::NAME);
//! * otherwise [`UNNAMED`].
//!
//! | metric | kind | labels | what |
//! |---|---|---|---|
//! | `dlock_acquire_attempts_total` | counter | `backend`, `name` | acquire calls sent to the backend (a waiter makes several) |
//! | `dlock_acquire_total` | counter | `backend`, `name`, `outcome` | requests by outcome: `acquired`, `contended` (held by another, no wait), `timeout` (gave up waiting), `unavailable` (backend down or too slow), `deferred`, `error` (invalid key or TTL, unsupported, a backend that refused for good (`Misconfigured`), defer queue full) |
//! | `dlock_acquire_wait_seconds` | histogram | `backend`, `name` | from the request to holding the lock, for acquired requests |
//! | `dlock_hold_seconds` | histogram | `backend`, `name` | from holding a lock to its release, drop or loss |
//! | `dlock_locks_held` | gauge | `backend`, `name` | locks this process holds now (guards and idempotent operations) |
//! | `dlock_waiters` | gauge | `backend`, `name` | tasks of this process waiting in a lock's queue now |
//! | `dlock_renewals_total` | counter | `backend`, `name` | watchdog renewals that succeeded |
//! | `dlock_renewal_failures_total` | counter | `backend`, `name` | watchdog renewals that failed or timed out (retried until the lease runs out) |
//! | `dlock_lost_total` | counter | `backend`, `name` | held locks reported lost (renewal refused, lease ran out) |
//! | `dlock_handoff_seconds` | histogram | `backend`, `name` | for a waiter woken by a release: from the wake-up to holding the lock (a release that came while the waiter's own attempt was on its way: from that attempt) |
//! | `dlock_jobs_total` | counter | `backend` (`memory` or `redis` queue), `name` (a durable job's type; `unregistered` for a type the worker does not know), `event` | deferred jobs by event: `deferred`, `retried`, `dead_lettered`, `completed`, `requeued`, `dropped`, `abandoned` |
//! | `dlock_idempotency_total` | counter | `backend`, `name`, `outcome` | idempotency begins by outcome: `run` (first attempt), `replayed`, `conflict` (key reused with another payload), `in_progress` |
//!
//! Times are in seconds (`_seconds`). Call [`describe`] once after installing a recorder to
//! give exporters the help texts and units.

/// The `name` label of locks that were not given one.
pub const UNNAMED: &str = "unnamed";

/// The `name` label of a durable job whose type no worker that claimed it registers (a newer
/// release's, or one retired): one label for all of them, the type being stored data.
pub const UNREGISTERED_JOB: &str = "unregistered";

/// Counter: acquire calls sent to the backend.
pub const ACQUIRE_ATTEMPTS: &str = "dlock_acquire_attempts_total";
/// Counter: lock requests by `outcome`.
pub const ACQUIRE: &str = "dlock_acquire_total";
/// Histogram (seconds): request to lock held.
pub const ACQUIRE_WAIT: &str = "dlock_acquire_wait_seconds";
/// Histogram (seconds): lock held to released, dropped or lost.
pub const HOLD: &str = "dlock_hold_seconds";
/// Gauge: locks held by this process.
pub const LOCKS_HELD: &str = "dlock_locks_held";
/// Gauge: tasks of this process waiting for a lock.
pub const WAITERS: &str = "dlock_waiters";
/// Counter: successful watchdog renewals.
pub const RENEWALS: &str = "dlock_renewals_total";
/// Counter: failed watchdog renewals.
pub const RENEWAL_FAILURES: &str = "dlock_renewal_failures_total";
/// Counter: locks reported lost.
pub const LOST: &str = "dlock_lost_total";
/// Histogram (seconds): a waiter's wake-up by a release to holding the lock; for a release
/// that came while the waiter's own attempt was on its way, from that attempt.
pub const HANDOFF: &str = "dlock_handoff_seconds";
/// Counter: deferred jobs by `event`.
pub const JOBS: &str = "dlock_jobs_total";
/// Counter: idempotency begins by `outcome`.
pub const IDEMPOTENCY: &str = "dlock_idempotency_total";

/// Gives the installed recorder the help text and unit of every dlock metric (exporters show
/// them, e.g. Prometheus' `# HELP` lines). Call it after installing the recorder.
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub fn describe() {
    use ::metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(ACQUIRE_ATTEMPTS, "Acquire calls sent to the lock backend.");
    describe_counter!(ACQUIRE, "Lock requests by outcome.");
    describe_histogram!(
        ACQUIRE_WAIT,
        Unit::Seconds,
        "From a lock request to holding the lock."
    );
    describe_histogram!(
        HOLD,
        Unit::Seconds,
        "From holding a lock to its release, drop or loss."
    );
    describe_gauge!(LOCKS_HELD, "Locks this process holds.");
    describe_gauge!(WAITERS, "Tasks of this process waiting for a lock.");
    describe_counter!(RENEWALS, "Successful watchdog renewals.");
    describe_counter!(RENEWAL_FAILURES, "Failed or timed-out watchdog renewals.");
    describe_counter!(LOST, "Held locks reported lost.");
    describe_histogram!(
        HANDOFF,
        Unit::Seconds,
        "From a waiter's wake-up by a release to holding the lock."
    );
    describe_counter!(JOBS, "Deferred jobs by event.");
    describe_counter!(IDEMPOTENCY, "Idempotency begins by outcome.");
}

/// The labels every lock metric carries.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Labels {
    pub(crate) backend: &'static str,
    pub(crate) name: &'static str,
}

// Each recording function compiles to nothing without the feature.
#[cfg(feature = "metrics")]
macro_rules! lock_labels {
    ($l:expr $(, $k:literal => $v:expr)*) => {
        [("backend", $l.backend), ("name", $l.name) $(, ($k, $v))*]
    };
}

impl Labels {
    pub(crate) fn new(backend: &'static str, name: &'static str) -> Self {
        Labels { backend, name }
    }

    /// One acquire call sent to the backend.
    #[inline]
    pub(crate) fn attempt(self) {
        #[cfg(feature = "metrics")]
        ::metrics::counter!(ACQUIRE_ATTEMPTS, &lock_labels!(self)).increment(1);
    }

    /// A request's outcome (one of the `outcome` values in the [module docs](self)).
    #[cfg(feature = "metrics")]
    fn outcome(self, outcome: &'static str) {
        ::metrics::counter!(ACQUIRE, &lock_labels!(self, "outcome" => outcome)).increment(1);
    }

    /// The outcome of a lock request started at `since`: `Ok(true)` acquired (its wait is
    /// recorded), `Ok(false)` held by another, or the error it ended with.
    #[inline]
    pub(crate) fn finished(
        self,
        result: Result<bool, &crate::LockError>,
        since: std::time::Instant,
    ) {
        #[cfg(feature = "metrics")]
        {
            let outcome = match result {
                Ok(true) => {
                    ::metrics::histogram!(ACQUIRE_WAIT, &lock_labels!(self))
                        .record(since.elapsed().as_secs_f64());
                    "acquired"
                }
                Ok(false) => "contended",
                Err(e) if e.is_timeout() => "timeout",
                Err(e) if e.is_contended() => "contended",
                Err(e) if e.is_deferred() => "deferred",
                Err(e) if e.is_unavailable() => "unavailable",
                Err(_) => "error",
            };
            self.outcome(outcome);
        }
        #[cfg(not(feature = "metrics"))]
        let _ = (result, since);
    }

    /// A lock is held from now on (`+1`) or no longer (`-1`, with how long it was held).
    #[inline]
    pub(crate) fn held(self, up: bool, held_for: Option<std::time::Duration>) {
        #[cfg(feature = "metrics")]
        {
            let gauge = ::metrics::gauge!(LOCKS_HELD, &lock_labels!(self));
            if up {
                gauge.increment(1.0);
            } else {
                gauge.decrement(1.0);
            }
            if let Some(d) = held_for {
                ::metrics::histogram!(HOLD, &lock_labels!(self)).record(d.as_secs_f64());
            }
        }
        #[cfg(not(feature = "metrics"))]
        let _ = (up, held_for);
    }

    /// A task starts (`true`) or stops waiting in a lock's queue.
    #[inline]
    pub(crate) fn waiting(self, up: bool) {
        #[cfg(feature = "metrics")]
        {
            let gauge = ::metrics::gauge!(WAITERS, &lock_labels!(self));
            if up {
                gauge.increment(1.0);
            } else {
                gauge.decrement(1.0);
            }
        }
        #[cfg(not(feature = "metrics"))]
        let _ = up;
    }

    /// A watchdog renewal succeeded (`true`) or failed.
    #[inline]
    pub(crate) fn renewal(self, ok: bool) {
        #[cfg(feature = "metrics")]
        ::metrics::counter!(
            if ok { RENEWALS } else { RENEWAL_FAILURES },
            &lock_labels!(self)
        )
        .increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = ok;
    }

    /// A held lock was reported lost.
    #[inline]
    pub(crate) fn lost(self) {
        #[cfg(feature = "metrics")]
        ::metrics::counter!(LOST, &lock_labels!(self)).increment(1);
    }

    /// A waiter woken by a release holds the lock, `d` after the wake-up.
    #[inline]
    pub(crate) fn handoff(self, d: std::time::Duration) {
        #[cfg(feature = "metrics")]
        ::metrics::histogram!(HANDOFF, &lock_labels!(self)).record(d.as_secs_f64());
        #[cfg(not(feature = "metrics"))]
        let _ = d;
    }

    /// An idempotency begin's outcome.
    #[inline]
    pub(crate) fn idempotency(self, outcome: &'static str) {
        #[cfg(feature = "metrics")]
        ::metrics::counter!(IDEMPOTENCY, &lock_labels!(self, "outcome" => outcome)).increment(1);
        #[cfg(not(feature = "metrics"))]
        let _ = outcome;
    }
}

/// A deferred job's `event` in queue `backend` (`memory` or `redis`), for the job named `name`.
#[inline]
pub(crate) fn job(backend: &'static str, name: &str, event: &'static str) {
    #[cfg(feature = "metrics")]
    ::metrics::counter!(
        JOBS,
        "backend" => backend,
        "name" => name.to_owned(),
        "event" => event
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (backend, name, event);
}
