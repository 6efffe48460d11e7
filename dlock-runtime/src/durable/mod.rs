//! The durable delay queue (feature `durable`): typed jobs in Redis, at-least-once. The
//! in-process queue and what both share (bounds, dead-letter info) are in `defer`.
//!
//! # Storage
//!
//! One queue `<name>` is a handful of keys sharing the hash tag `{jobs:<name>}`:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `dlock:{jobs:<name>}:due` | zset | job id → due time (ms, server clock) |
//! | `dlock:{jobs:<name>}:jobs` | hash | job id → envelope (JSON: type, data, key, policy) |
//! | `dlock:{jobs:<name>}:attempts` | hash | job id → times claimed |
//! | `dlock:{jobs:<name>}:inflight` | zset | job id → claim deadline (ms) |
//! | `dlock:{jobs:<name>}:claims` | hash | job id → the token of its current claim |
//! | `dlock:{jobs:<name>}:dead` | zset | job id → time it was dead-lettered |
//! | `dlock:{jobs:<name>}:reasons` | hash | job id → why it was dead-lettered |
//! | `dlock:{jobs:<name>}:unknown` | hash | job id → when a claim first did not know its type (ms) |
//! | `dlock:{jobs:<name>}:status:<id>` | string | final outcome, kept for the retention period |
//! | `dlock:{jobs:<name>}:batch:<token>` | list | the ids one claim took, kept for the visibility timeout (a claim sent again after its answer was lost is answered from it) |
//!
//! # Delivery
//!
//! A worker claims due jobs with one script: expired claims are first put back (the reaper),
//! then up to a batch of due jobs move atomically from `due` to `inflight` with a deadline of
//! now + the visibility timeout, and their attempt counts go up. A claim (or an enqueue) that
//! is not answered — the server may have run it — is sent again with the same token (job id),
//! and answered with what the first one did: a lost answer neither leaves a batch claimed by
//! nobody nor queues a job twice. Every claim gets a fresh
//! random token; the worker's heartbeat, acknowledgement and retry carry it and are refused
//! once the claim is no longer theirs. While a job runs, its worker pushes the deadline forward
//! every third of the timeout. A worker that dies stops doing so; once the deadline passes, the
//! next claim by any instance puts the job back and runs it again — or dead-letters it, when it
//! has used up its `max_attempts` (a job that kills its worker every time ends there too).
//! A worker that was only stalled (frozen) past the deadline finds its heartbeat refused when
//! it wakes: it stops working on that job, and its acknowledgement or retry, if it gets that
//! far, changes nothing — the job belongs to whoever claimed it next. A worker cut off from the
//! queue (its heartbeats fail rather than being refused) stops working on the job by its own
//! clock, once the visibility timeout has passed since it sent the claim or the latest
//! heartbeat that was answered: from then on the claim may be another worker's. And a job
//! whose lock is lost while it runs (its lease ran out by the lease clock — the worker froze,
//! or its machine slept, which the claim's clock does not count —, or a renewal found it
//! taken, by a force release say) stops at once, as a failed attempt: another worker may hold
//! the lock and run the job by then.
//!
//! An enqueue counts once the master has the job. A failover to a replica that had not yet
//! received it loses the job; [`DurableQueue::with_replicas`] makes an enqueue count only once
//! that many replicas have it (`WAIT`), withdrawing the job and answering `Unavailable` when
//! fewer confirm in time. Claims, heartbeats, acknowledgements and retries are not waited on:
//! one lost in a failover runs a job again, never loses one.
//!
//! So every job runs **at least once**. It can run twice only if its worker lost contact (died,
//! froze, or was cut off from Redis) for longer than the visibility timeout while running it, or
//! before it could acknowledge it (a failed acknowledgement is sent again for up to the
//! visibility timeout): that window is the at-least-once window. The job's lock narrows the
//! damage (the two runs do not overlap while the first still holds the lock, and the first
//! stops once it knows it lost the lock), and
//! [`JobContext::fencing_token`] lets the job's writes reject the stale run; [`JobContext::attempt`] tells a job it is being retried.
//!
//! A job whose lock is busy, or which returns an error or panics, is put back with the policy's
//! backoff; after `max_attempts` claims it moves to the dead-letter set, where
//! [`DurableQueue::dead_letters`] lists it (with the reason) and [`DurableQueue::requeue`] puts
//! it back. A job that returns [`PermanentFailure`], or whose stored envelope does not decode,
//! is dead-lettered at once. Dead letters are deleted after the queue's
//! [`QueueLimits::dead_letter_retention`] (7 days by default); the queue holds at most
//! [`QueueLimits::max_queued`] jobs (see [`DurableQueue::with_limits`]).
//!
//! A claim whose lock backend did not answer ([`LockError::Unavailable`]: down, failing over) does not
//! count as an attempt: the job was not tried, so it is put back at the pace of its current
//! attempt until the backend answers, and an outage of the lock backend never uses up a job's
//! attempts. One of the *queue's* Redis (often the same server) can: a claim whose job cannot
//! be put back before its visibility timeout ends is re-queued by the reaper, which counts it
//! as an attempt (a claim whose worker died looks the same).
//!
//! Nor does a claim by a worker that does not know the job's type, or cannot decode its data
//! (an older release, mid-deploy): the job is put back (at least 1 s later) for a worker that
//! can run it, until the worker's [`DurableWorker::unknown_type_grace`] (1 h by default) has
//! passed since the first such claim; then it is dead-lettered, naming the type. serde's decode
//! errors in logs and dead-letter reasons do not quote the job's data (a type's own
//! `Error::custom` messages are kept as written).

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::RedisError;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::defer::JobInfo;
use crate::{BoxError, DeferPolicy, LockError, LockKey};

mod queue;
mod worker;

pub use queue::{DurableQueue, QueueOptions};
pub use worker::DurableWorker;

#[cfg(doc)]
use crate::defer::QueueLimits;

/// A job error that retrying cannot fix (corrupt stored data, a request that can never be
/// rebuilt): the worker dead-letters the job at once with this reason instead of spending the
/// rest of its attempts. Return it from [`Job::run`] as
/// `Err(PermanentFailure::new("…").into())`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PermanentFailure {
    reason: String,
}

impl PermanentFailure {
    /// A permanent failure with a reason (kept with the dead letter: no secrets in it).
    pub fn new(reason: impl Into<String>) -> Self {
        PermanentFailure {
            reason: reason.into(),
        }
    }

    /// The reason.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl std::fmt::Display for PermanentFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "permanent failure: {}", self.reason)
    }
}

impl std::error::Error for PermanentFailure {}

/// The error a job returns; the job is retried with backoff, then dead-lettered.
pub type JobError = BoxError;

/// A unit of deferred work that survives restarts: plain data (serde) plus what to do with it.
///
/// ```no_run
/// use dlock_runtime::durable::{Job, JobContext, JobError};
/// use dlock_runtime::{LockError, LockKey};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct SendInvoice { order: u64 }
///
/// impl Job for SendInvoice {
///     const NAME: &'static str = "send-invoice";
///     fn lock_key(&self) -> Result<LockKey, LockError> {
///         LockKey::builder().lit("order:").value(&self.order).finish()
///     }
///     async fn run(self, ctx: JobContext) -> Result<(), JobError> {
///         println!("invoice for {} (attempt {}, token {})", self.order, ctx.attempt(), ctx.fencing_token());
///         Ok(())
///     }
/// }
/// ```
pub trait Job: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// A stable name, stored with each job: the worker finds the job's type by it.
    const NAME: &'static str;

    /// The lock the job must hold while it runs.
    fn lock_key(&self) -> Result<LockKey, LockError>;

    /// Does the work, holding the lock.
    fn run(self, ctx: JobContext) -> impl Future<Output = Result<(), JobError>> + Send;
}

/// What a running job knows about its run.
#[derive(Clone)]
pub struct JobContext {
    job_id: String,
    attempt: u32,
    fencing_token: u64,
    key: String,
    state: Option<Arc<dyn Any + Send + Sync>>,
    result: Arc<std::sync::Mutex<Option<String>>>,
}

impl fmt::Debug for JobContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobContext")
            .field("job_id", &self.job_id)
            .field("attempt", &self.attempt)
            .field("fencing_token", &self.fencing_token)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl JobContext {
    /// The job's id.
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// Which claim of the job this is (1 the first time; higher after a busy lock, an error or
    /// a worker that died).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The fencing token of the lock this run holds.
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    /// The lock key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Records a short outcome (e.g. an HTTP status) that [`DurableQueue::status`] reports as
    /// [`JobStatus::Completed`]'s `result` for the retention period (up to 4 KiB: a longer one
    /// is cut at a character boundary and ends in `…`).
    pub fn set_result(&self, result: impl Into<String>) {
        *self
            .result
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(result.into());
    }

    /// The shared state given to [`DurableWorker::state`], if it has type `S`.
    pub fn state<S: Clone + Send + Sync + 'static>(&self) -> Option<S> {
        self.state.as_ref()?.downcast_ref::<S>().cloned()
    }
}

/// Where a job stands.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum JobStatus {
    /// Waiting for its due time.
    Queued,
    /// Claimed by a worker.
    Running,
    /// Ran to completion; `result` is what the job (or the layer) recorded, if anything.
    Completed {
        /// Free-form outcome, e.g. an HTTP status.
        result: Option<String>,
    },
    /// Used up its attempts; in the dead-letter set.
    Dead,
    /// No such job, or its outcome is past the retention period.
    Unknown,
}

/// The first jobs of a listing, and how many there are in all
/// ([`DurableQueue::dead_letters_first`], [`DurableQueue::pending_first`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct JobsPage<T> {
    /// The jobs read, in the listing's order.
    pub jobs: Vec<T>,
    /// How many jobs the listing holds: more than `jobs.len()` when it was cut at the limit.
    pub total: usize,
}

impl<T> JobsPage<T> {
    /// Whether the listing holds more jobs than were read.
    pub fn truncated(&self) -> bool {
        self.total > self.jobs.len()
    }
}

/// What [`DurableQueue::submit`] did.
#[derive(Debug)]
#[non_exhaustive]
pub enum Submitted {
    /// The lock was free: the job ran now, with this result.
    Ran(Result<(), JobError>),
    /// The lock was busy: the job was queued under this id.
    Deferred(String),
}

#[derive(Serialize, Deserialize)]
pub(crate) struct Envelope {
    /// First: a listing reads only the start of a stored job (module `queue`, `describe`).
    key: String,
    #[serde(rename = "type")]
    kind: String,
    data: serde_json::Value,
    max_attempts: u32,
    delay_ms: u64,
    max_delay_ms: u64,
    ttl_ms: u64,
}

impl Envelope {
    pub(crate) fn policy(&self) -> DeferPolicy {
        DeferPolicy::new(Duration::from_millis(self.delay_ms), self.max_attempts)
            .max_delay(Duration::from_millis(self.max_delay_ms))
    }
}

pub(crate) fn redis_err(what: &str, e: RedisError) -> LockError {
    let permanent = crate::backend::redis::refused_for_good(&e);
    LockError::backend(
        format!("job queue {what}: {:?}", e.kind()),
        Some(Box::new(e)),
        permanent,
    )
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub(crate) fn event(event: &'static str, info: &JobInfo) {
    info.event("redis", event, crate::key::KeyLog::default());
}

/// A decode error's message without the values it quotes. serde's data errors name the
/// offending value (`invalid type: string "sk_live_…", expected u64`), and a job's data may hold
/// secrets, which must not reach the logs or the stored dead-letter reasons; what the job type
/// expected (and where, in the stored envelope) is kept.
pub(crate) fn decode_error(e: &serde_json::Error) -> String {
    const QUOTING: [&str; 4] = [
        "invalid type",
        "invalid value",
        "invalid length",
        "unknown variant",
    ];
    let msg = e.to_string();
    match QUOTING.iter().find(|p| msg.starts_with(**p)) {
        // The last one: a quoted value may hold the words too.
        Some(p) => match msg.rfind(", expected ") {
            Some(i) => format!("{p}{}", &msg[i..]),
            None => (*p).to_owned(),
        },
        None => msg,
    }
}

#[cfg(test)]
mod tests {
    use super::decode_error;

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    enum Currency {
        Eur,
        Usd,
    }

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Payment {
        id: u64,
        currency: Currency,
    }

    fn error(json: &str) -> String {
        decode_error(&serde_json::from_str::<Payment>(json).unwrap_err())
    }

    #[test]
    fn decode_errors_keep_what_was_expected_and_drop_the_values() {
        let wrong_type = error(r#"{"id": "sk_live_secret", "currency": "Eur"}"#);
        assert!(!wrong_type.contains("sk_live"), "{wrong_type}");
        assert!(
            wrong_type.starts_with("invalid type, expected u64"),
            "{wrong_type}"
        );
        let variant = error(r#"{"id": 1, "currency": "sk_live_secret"}"#);
        assert!(!variant.contains("sk_live"), "{variant}");
        assert!(variant.contains("expected `Eur` or `Usd`"), "{variant}");
        let tricky = error(r#"{"id": "x, expected sk_live_secret", "currency": "Eur"}"#);
        assert!(!tricky.contains("sk_live"), "{tricky}");
        let missing = error(r#"{"id": 1}"#);
        assert!(missing.starts_with("missing field `currency`"), "{missing}");
        let value = decode_error(&serde_json::from_str::<u8>("1000").unwrap_err());
        assert!(!value.contains("1000"), "{value}");
    }
}
