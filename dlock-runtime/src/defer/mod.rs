//! Defer: the third fail strategy. When the lock is busy, put the work aside and run it
//! later — without blocking the caller and, with the durable queue, without losing it.
//!
//! * [`OnFail::Defer`](crate::OnFail::Defer) with a [`DeferPolicy`]: the caller gets
//!   [`LockError::Deferred`](crate::LockError::Deferred) at once, carrying the job id (HTTP
//!   202). When the job's turn comes it makes one attempt at the lock; if the lock is still
//!   busy it is deferred again with exponential backoff and jitter, up to `max_attempts`, and
//!   then moved to the dead-letter set, which can be listed and re-queued. An attempt the lock
//!   backend did not answer ([`LockError::Unavailable`](crate::LockError::Unavailable): an
//!   outage) does not count — the job is tried again at the same pace until the backend is
//!   back — while any other failure (a refusal for good,
//!   [`LockError::Misconfigured`](crate::LockError::Misconfigured), or `Lost`: a grant that
//!   came after its lease, the job's TTL too short for the backend) counts, and the dead letter
//!   says which ([`JobInfo::reason`]).
//! * [`DeferQueue`] — the in-process queue (the default, one per [`Locker`](crate::Locker)),
//!   built on tokio-util's `DelayQueue`. It holds closures and futures, so it serves
//!   `LockRequest::run` and `#[distributed_lock(on_fail = "defer")]`. **It does not survive a
//!   crash or a restart**: jobs live in this process's memory. [`DeferQueue::shutdown`] drains
//!   it and reports every job it held: completed, dropped, or failed during the drain.
//! * The durable queue (`dlock_runtime::durable`, feature `durable`) — typed jobs (serde types)
//!   in Redis, run by a worker that every instance of the service can run. Claims carry a
//!   visibility timeout: a job claimed by a process that dies is run by another instance once
//!   the claim expires (at-least-once). It shares this module's [`QueueLimits`] and
//!   [`JobInfo`].
//!
//! # Bounds
//!
//! Both queues are bounded by [`QueueLimits`]: at most `max_queued` jobs waiting or running
//! (a full queue refuses new work with [`LockError::QueueFull`](crate::LockError::QueueFull),
//! 503 + `Retry-After`, and drops nothing already queued; a dead letter an operator requeues
//! is let in over the bound), and dead letters are kept for
//! `dead_letter_retention` (7 days by default) and at most `max_dead_letters` of them (the
//! oldest go first); after that a dead letter's payload and bookkeeping are deleted. The
//! durable queue also bounds each job: a job whose stored form (its JSON with the policy) is
//! over `max_job_bytes` (4 MiB by default) is refused with
//! [`LockError::JobTooLarge`](crate::LockError::JobTooLarge), 413, and nothing is queued. (The
//! in-process queue holds futures, not bytes: the bound does not apply to it.)
//!
//! In the durable queue, a job that panics is a failed attempt like one that returns an error:
//! the panic is caught and logged with the job's id, and the worker goes on with its other
//! jobs. In the in-process queue, a job is a future, which cannot be polled again once it
//! panicked: the panic is logged (`failed`, with the job's id), the job leaves the queue — a
//! drain reports it failed — and the queue goes on with the others. A job that can
//! never succeed (its stored data is corrupt) returns `durable::PermanentFailure` and is
//! dead-lettered at once, with the reason, which [`JobInfo::reason`] shows.
//!
//! Every step emits a `tracing` event on target `dlock::defer` with the fields `event`
//! (`deferred`, `retried`, `dead_lettered`, `completed`, `failed`, `requeued`, `dropped`, and
//! for the durable queue `abandoned`: a worker stalled past its claim and stopped the job),
//! `queue` (`memory` or `redis`), `job_id`, `key` (redacted unless the locker was built with
//! `trace_plain_keys(true)`; always redacted for the durable queue), `name` and `attempt`;
//! with feature `metrics` each is also counted in `dlock_jobs_total`.

use std::time::Duration;

use crate::key::KeyLog;

mod memory;
pub(crate) use memory::{Attempted, DeferredWork, NotRun};
pub use memory::{DeferQueue, ShutdownReport};

pub use crate::strategy::DeferPolicy;

/// What a queue knows about one job.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobInfo {
    /// The job id returned to the caller (also in [`LockError::Deferred`](crate::LockError::Deferred)).
    pub id: String,
    /// The lock key the job needs.
    pub key: String,
    /// Deferred attempts made so far.
    pub attempts: u32,
    /// For a dead letter: why it was dead-lettered (lock still busy, the job's last error or
    /// panic, a claim that kept expiring, undecodable data).
    pub reason: Option<String>,
    /// The job's bounded name in metrics and events: the request's
    /// [`name`](crate::LockRequest::name), or a durable job's type.
    pub(crate) name: std::borrow::Cow<'static, str>,
}

impl JobInfo {
    /// Emits the `tracing` event `event` for this job (see the [module docs](self)), with the
    /// key as `key_log` shows it, and counts it in `dlock_jobs_total`.
    pub(crate) fn event(&self, queue: &'static str, event: &'static str, key_log: KeyLog) {
        crate::metrics::job(queue, &self.name, event);
        tracing::info!(
            target: "dlock::defer",
            event,
            queue,
            job_id = %self.id,
            key = %key_log.show(&self.key),
            name = %self.name,
            attempt = self.attempts,
        );
    }

    pub(crate) fn new(id: impl Into<String>, key: impl Into<String>, attempts: u32) -> Self {
        JobInfo {
            id: id.into(),
            key: key.into(),
            attempts,
            reason: None,
            name: crate::metrics::UNNAMED.into(),
        }
    }

    /// The job's bounded name (see [`crate::metrics`]).
    pub(crate) fn named(mut self, name: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        self.name = name.into();
        self
    }
}

/// The bounds of a defer queue (see the [module docs](self#bounds)). Defaults: 100 000 queued
/// jobs, dead letters kept 7 days, at most 10 000 of them, and (in the durable queue) jobs of
/// at most 4 MiB.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueLimits {
    /// The most jobs waiting or running at once; deferring more answers
    /// [`LockError::QueueFull`](crate::LockError::QueueFull).
    pub max_queued: usize,
    /// How long a dead letter is kept before its payload and bookkeeping are deleted.
    pub dead_letter_retention: Duration,
    /// The most dead letters kept; beyond it the oldest are deleted.
    pub max_dead_letters: usize,
    /// The largest job the durable queue takes, in bytes of its stored form (the job's JSON
    /// and its policy); a larger one answers
    /// [`LockError::JobTooLarge`](crate::LockError::JobTooLarge) (413) and is not queued. The
    /// default, 4 MiB, holds a `dlock_tower::DeferLayer` request at its default body limit
    /// (1 MiB, stored hex-encoded) with its headers. Not used by the in-process queue.
    pub max_job_bytes: usize,
}

impl Default for QueueLimits {
    fn default() -> Self {
        QueueLimits {
            max_queued: 100_000,
            dead_letter_retention: Duration::from_secs(7 * 24 * 3600),
            max_dead_letters: 10_000,
            max_job_bytes: 4 << 20,
        }
    }
}

impl QueueLimits {
    /// Sets [`max_queued`](QueueLimits::max_queued) (at least 1).
    pub fn max_queued(mut self, n: usize) -> Self {
        self.max_queued = n.max(1);
        self
    }

    /// Sets [`dead_letter_retention`](QueueLimits::dead_letter_retention).
    pub fn dead_letter_retention(mut self, d: Duration) -> Self {
        self.dead_letter_retention = d;
        self
    }

    /// Sets [`max_dead_letters`](QueueLimits::max_dead_letters).
    pub fn max_dead_letters(mut self, n: usize) -> Self {
        self.max_dead_letters = n;
        self
    }

    /// Sets [`max_job_bytes`](QueueLimits::max_job_bytes) (at least 1).
    pub fn max_job_bytes(mut self, bytes: usize) -> Self {
        self.max_job_bytes = bytes.max(1);
        self
    }
}
