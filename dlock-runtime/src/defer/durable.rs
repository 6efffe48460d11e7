//! The durable delay queue: typed jobs in Redis, at-least-once.
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
//! | `dlock:{jobs:<name>}:status:<id>` | string | final outcome, kept for the retention period |
//!
//! # Delivery
//!
//! A worker claims due jobs with one script: expired claims are first put back (the reaper),
//! then up to a batch of due jobs move atomically from `due` to `inflight` with a deadline of
//! now + the visibility timeout, and their attempt counts go up. Every claim gets a fresh
//! random token; the worker's heartbeat, acknowledgement and retry carry it and are refused
//! once the claim is no longer theirs. While a job runs, its worker pushes the deadline forward
//! every third of the timeout. A worker that dies stops doing so; once the deadline passes, the
//! next claim by any instance puts the job back and runs it again — or dead-letters it, when it
//! has used up its `max_attempts` (a job that kills its worker every time ends there too).
//! A worker that was only stalled (frozen, cut off) past the deadline finds its heartbeat
//! refused when it wakes: it stops working on that job, and its acknowledgement or retry, if it
//! gets that far, changes nothing — the job belongs to whoever claimed it next.
//!
//! So every job runs **at least once**. It can run twice only if its worker lost contact (died,
//! froze, or was cut off from Redis) for longer than the visibility timeout while running it:
//! that window is the at-least-once window. The job's lock narrows the damage (the two runs do not
//! overlap while the first still holds the lock), and [`JobContext::fencing_token`] lets the job's
//! writes reject the stale run; [`JobContext::attempt`] tells a job it is being retried.
//!
//! A job whose lock is busy, or which returns an error or panics, is put back with the policy's
//! backoff; after `max_attempts` claims it moves to the dead-letter set, where
//! [`DurableQueue::dead_letters`] lists it (with the reason) and [`DurableQueue::requeue`] puts
//! it back. A job that returns [`PermanentFailure`], or whose stored data does not decode, is
//! dead-lettered at once. Dead letters are deleted after the queue's
//! [`QueueLimits::dead_letter_retention`] (7 days by default); the queue holds at most
//! [`QueueLimits::max_queued`] jobs (see [`DurableQueue::with_limits`]).

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt as _;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{new_job_id, panic_message, DeferPolicy, JobInfo, PermanentFailure, QueueLimits};
use crate::backend::BoxFuture;
use crate::{BoxError, LockError, LockKey, Locker};

/// The error a job returns; the job is retried with backoff, then dead-lettered.
pub type JobError = BoxError;

/// A unit of deferred work that survives restarts: plain data (serde) plus what to do with it.
///
/// ```no_run
/// use dlock_runtime::defer::{Job, JobContext, JobError};
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
    /// [`JobStatus::Completed`]'s `result` for the retention period.
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
struct Envelope {
    #[serde(rename = "type")]
    kind: String,
    data: serde_json::Value,
    key: String,
    max_attempts: u32,
    delay_ms: u64,
    max_delay_ms: u64,
    ttl_ms: u64,
}

impl Envelope {
    fn policy(&self) -> DeferPolicy {
        DeferPolicy::new(Duration::from_millis(self.delay_ms), self.max_attempts)
            .max_delay(Duration::from_millis(self.max_delay_ms))
    }
}

fn redis_err(what: &str, e: RedisError) -> LockError {
    LockError::unavailable(
        format!("job queue {what}: {:?}", e.kind()),
        Some(Box::new(e)),
    )
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A durable delay queue in Redis (see the [module docs](self)). Cheap to clone.
#[derive(Clone)]
pub struct DurableQueue {
    inner: Arc<QueueInner>,
}

#[derive(Clone)]
struct QueueInner {
    name: String,
    conn: ConnectionManager,
    base: String,
    visibility: Duration,
    retention: Duration,
    limits: QueueLimits,
    command_timeout: Duration,
    enqueue: Script,
    claim: Script,
    retry: Script,
    ack: Script,
    heartbeat: Script,
    requeue: Script,
}

impl fmt::Debug for DurableQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DurableQueue")
            .field("name", &self.inner.name)
            .field("visibility", &self.inner.visibility)
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

/// One claimed job, as the claim script hands it out.
struct Claimed {
    id: String,
    payload: String,
    attempt: u32,
    token: String,
}

/// What the retry script did.
#[derive(Debug, PartialEq, Eq)]
enum Retried {
    Requeued,
    DeadLettered,
    /// The claim is not ours any more: nothing changed.
    Stale,
}

impl DurableQueue {
    /// Connects to the queue `name` in the Redis at `url`. Defaults: visibility timeout 30 s,
    /// outcome retention 24 h, command timeout 1 s, [`QueueLimits::default`].
    pub async fn connect(url: &str, name: &str) -> Result<Self, LockError> {
        Self::connect_with(
            url,
            name,
            Duration::from_secs(30),
            Duration::from_secs(86_400),
        )
        .await
    }

    /// Like [`connect`](DurableQueue::connect) with an explicit visibility timeout (how long a
    /// claimed job may go without a heartbeat before another worker may run it) and outcome
    /// retention.
    pub async fn connect_with(
        url: &str,
        name: &str,
        visibility: Duration,
        retention: Duration,
    ) -> Result<Self, LockError> {
        if name.is_empty()
            || name
                .chars()
                .any(|c| matches!(c, '{' | '}') || c.is_whitespace())
        {
            return Err(LockError::invalid_key(
                "queue name must be non-empty, without braces or whitespace",
            ));
        }
        let command_timeout = Duration::from_secs(1);
        let client = redis::Client::open(url).map_err(|e| redis_err("url", e))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(command_timeout))
            .set_response_timeout(Some(command_timeout))
            .set_number_of_retries(2);
        let conn = tokio::time::timeout(
            command_timeout * 2,
            ConnectionManager::new_with_config(client, config),
        )
        .await
        .map_err(|_| LockError::unavailable("job queue connect timed out", None))?
        .map_err(|e| redis_err("connect", e))?;
        Ok(DurableQueue {
            inner: Arc::new(QueueInner {
                name: name.to_owned(),
                conn,
                base: format!("dlock:{{jobs:{name}}}"),
                visibility: visibility.max(Duration::from_millis(100)),
                retention,
                limits: QueueLimits::default(),
                command_timeout,
                enqueue: Script::new(ENQUEUE),
                claim: Script::new(CLAIM),
                retry: Script::new(RETRY),
                ack: Script::new(ACK),
                heartbeat: Script::new(HEARTBEAT),
                requeue: Script::new(REQUEUE),
            }),
        })
    }

    /// This queue with other bounds: the most jobs queued or running, and how long and how
    /// many dead letters are kept. Every instance should use the same limits; each enforces its
    /// own when it enqueues (the bound) or claims (dead-letter clean-up).
    pub fn with_limits(self, limits: QueueLimits) -> Self {
        let mut inner = Arc::unwrap_or_clone(self.inner);
        inner.limits = limits;
        DurableQueue {
            inner: Arc::new(inner),
        }
    }

    /// The queue's bounds.
    pub fn limits(&self) -> &QueueLimits {
        &self.inner.limits
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The visibility timeout.
    pub fn visibility_timeout(&self) -> Duration {
        self.inner.visibility
    }

    fn key(&self, suffix: &str) -> String {
        format!("{}:{suffix}", self.inner.base)
    }

    async fn deadline<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, LockError> {
        match tokio::time::timeout(self.inner.command_timeout, fut).await {
            Ok(r) => r.map_err(|e| redis_err(what, e)),
            Err(_) => Err(LockError::unavailable(
                format!("job queue {what} timed out"),
                None,
            )),
        }
    }

    /// Queues `job` to run after `delay` under `policy` (its lock held with lease `ttl`).
    /// Returns the job id, or [`LockError::QueueFull`] when the queue holds
    /// [`QueueLimits::max_queued`] jobs already.
    pub async fn enqueue<J: Job>(
        &self,
        job: &J,
        policy: &DeferPolicy,
        ttl: Duration,
        delay: Duration,
    ) -> Result<String, LockError> {
        let key = job.lock_key()?;
        let env = Envelope {
            kind: J::NAME.to_owned(),
            data: serde_json::to_value(job).map_err(|e| {
                LockError::unavailable(
                    format!("job {} does not serialize", J::NAME),
                    Some(Box::new(e)),
                )
            })?,
            key: key.as_str().to_owned(),
            max_attempts: policy.max_attempts,
            delay_ms: millis(policy.delay),
            max_delay_ms: millis(policy.max_delay),
            ttl_ms: millis(crate::locker::validate_ttl(ttl)?),
        };
        let payload = serde_json::to_string(&env).expect("an envelope of JSON values serializes");
        self.enqueue_raw(&payload, &key, delay).await
    }

    async fn enqueue_raw(
        &self,
        payload: &str,
        key: &LockKey,
        delay: Duration,
    ) -> Result<String, LockError> {
        let id = new_job_id();
        let mut conn = self.inner.conn.clone();
        let mut inv = self.inner.enqueue.prepare_invoke();
        inv.key(self.key("due"))
            .key(self.key("inflight"))
            .key(self.key("jobs"))
            .arg(&id)
            .arg(payload)
            .arg(millis(delay))
            .arg(self.inner.limits.max_queued);
        let queued: i64 = self
            .deadline("enqueue", inv.invoke_async(&mut conn))
            .await?;
        if queued == 0 {
            tracing::warn!(
                target: "dlock::defer",
                event = "full",
                queue = "redis",
                name = %self.inner.name,
                key = %key.as_str(),
                max_queued = self.inner.limits.max_queued,
            );
            return Err(LockError::queue_full(key.as_str(), &self.inner.name));
        }
        event("deferred", &JobInfo::new(id.clone(), key.as_str(), 0));
        Ok(id)
    }

    /// Runs `job` now if its lock is free; otherwise queues it (first attempt after the
    /// policy's delay) and says so.
    pub async fn submit<J: Job>(
        &self,
        locker: &Locker,
        job: J,
        policy: &DeferPolicy,
        ttl: Duration,
    ) -> Result<Submitted, LockError> {
        let key = job.lock_key()?;
        match locker.lock(key.clone()).ttl(ttl).try_acquire().await? {
            Some(guard) => {
                let ctx = JobContext {
                    job_id: String::new(),
                    attempt: 0,
                    fencing_token: guard.fencing_token(),
                    key: key.as_str().to_owned(),
                    state: None,
                    result: Arc::default(),
                };
                let out = crate::with_lock(&guard, job.run(ctx)).await;
                let _ = guard.release().await;
                Ok(Submitted::Ran(out))
            }
            None => {
                let id = self.enqueue(&job, policy, ttl, policy.backoff(1)).await?;
                Ok(Submitted::Deferred(id))
            }
        }
    }

    /// Where job `id` stands.
    pub async fn status(&self, id: &str) -> Result<JobStatus, LockError> {
        let mut conn = self.inner.conn.clone();
        let (due, inflight, dead, outcome): (
            Option<f64>,
            Option<f64>,
            Option<f64>,
            Option<String>,
        ) = self
            .deadline(
                "status",
                redis::pipe()
                    .zscore(self.key("due"), id)
                    .zscore(self.key("inflight"), id)
                    .zscore(self.key("dead"), id)
                    .get(self.key(&format!("status:{id}")))
                    .query_async(&mut conn),
            )
            .await?;
        Ok(if inflight.is_some() {
            JobStatus::Running
        } else if due.is_some() {
            JobStatus::Queued
        } else if dead.is_some() {
            JobStatus::Dead
        } else if let Some(o) = outcome {
            JobStatus::Completed {
                result: (!o.is_empty()).then_some(o),
            }
        } else {
            JobStatus::Unknown
        })
    }

    /// How many jobs are queued or running.
    pub async fn len(&self) -> Result<usize, LockError> {
        let mut conn = self.inner.conn.clone();
        let (a, b): (usize, usize) = self
            .deadline(
                "len",
                redis::pipe()
                    .zcard(self.key("due"))
                    .zcard(self.key("inflight"))
                    .query_async(&mut conn),
            )
            .await?;
        Ok(a + b)
    }

    /// Whether no job is queued or running.
    pub async fn is_empty(&self) -> Result<bool, LockError> {
        Ok(self.len().await? == 0)
    }

    /// The dead-letter set, oldest first, each with the reason it was dead-lettered.
    pub async fn dead_letters(&self) -> Result<Vec<JobInfo>, LockError> {
        let mut conn = self.inner.conn.clone();
        let ids: Vec<String> = self
            .deadline(
                "dead letters",
                redis::cmd("ZRANGE")
                    .arg(self.key("dead"))
                    .arg(0)
                    .arg(-1)
                    .query_async(&mut conn),
            )
            .await?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let (payload, attempts, reason): (Option<String>, Option<u32>, Option<String>) = self
                .deadline(
                    "dead letter",
                    redis::pipe()
                        .hget(self.key("jobs"), &id)
                        .hget(self.key("attempts"), &id)
                        .hget(self.key("reasons"), &id)
                        .query_async(&mut conn),
                )
                .await?;
            let key = payload
                .and_then(|p| serde_json::from_str::<Envelope>(&p).ok())
                .map(|e| e.key)
                .unwrap_or_default();
            let mut info = JobInfo::new(id, key, attempts.unwrap_or(0));
            info.reason = reason;
            out.push(info);
        }
        Ok(out)
    }

    /// Puts a dead-lettered job back with a fresh attempt budget, due now. `false` if it is not
    /// in the dead-letter set.
    pub async fn requeue(&self, id: &str) -> Result<bool, LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = self.inner.requeue.prepare_invoke();
        inv.key(self.key("dead"))
            .key(self.key("due"))
            .key(self.key("attempts"))
            .key(self.key("reasons"))
            .arg(id);
        let n: i64 = self
            .deadline("requeue", inv.invoke_async(&mut conn))
            .await?;
        if n == 1 {
            event("requeued", &JobInfo::new(id, "", 0));
        }
        Ok(n == 1)
    }

    async fn claim(&self, batch: usize) -> Result<Vec<Claimed>, LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = self.inner.claim.prepare_invoke();
        let limits = &self.inner.limits;
        inv.key(self.key("due"))
            .key(self.key("inflight"))
            .key(self.key("attempts"))
            .key(self.key("jobs"))
            .key(self.key("claims"))
            .key(self.key("dead"))
            .key(self.key("reasons"))
            .arg(millis(self.inner.visibility))
            .arg(batch)
            // Unique per claim call (128 random bits); the script appends the job's position.
            .arg(crate::backend::OwnerToken::generate().as_str())
            .arg(millis(limits.dead_letter_retention))
            .arg(limits.max_dead_letters);
        let flat: Vec<String> = self.deadline("claim", inv.invoke_async(&mut conn)).await?;
        Ok(flat
            .chunks_exact(4)
            .map(|c| Claimed {
                id: c[0].clone(),
                payload: c[1].clone(),
                attempt: c[2].parse().unwrap_or(1),
                token: c[3].clone(),
            })
            .collect())
    }

    /// Pushes the claim's deadline forward; `false` when the claim is no longer this one.
    async fn heartbeat(&self, claim: &Claimed) -> Result<bool, LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = self.inner.heartbeat.prepare_invoke();
        inv.key(self.key("inflight"))
            .key(self.key("claims"))
            .arg(millis(self.inner.visibility))
            .arg(&claim.id)
            .arg(&claim.token);
        let n: i64 = self
            .deadline("heartbeat", inv.invoke_async(&mut conn))
            .await?;
        Ok(n == 1)
    }

    /// Puts a claimed job back after `delay`, or dead-letters it (with `reason`) when it used
    /// up `max_attempts`.
    async fn retry(
        &self,
        claim: &Claimed,
        delay: Duration,
        max_attempts: u32,
        reason: &str,
    ) -> Result<Retried, LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = self.inner.retry.prepare_invoke();
        inv.key(self.key("inflight"))
            .key(self.key("due"))
            .key(self.key("dead"))
            .key(self.key("attempts"))
            .key(self.key("claims"))
            .key(self.key("reasons"))
            .arg(&claim.id)
            .arg(&claim.token)
            .arg(millis(delay))
            .arg(max_attempts)
            .arg(reason);
        let n: i64 = self.deadline("retry", inv.invoke_async(&mut conn)).await?;
        Ok(match n {
            1 => Retried::DeadLettered,
            0 => Retried::Requeued,
            _ => Retried::Stale,
        })
    }

    /// Completes a claimed job and records its outcome for the retention period; `false` when
    /// the claim is no longer this one (nothing changed).
    async fn ack(&self, claim: &Claimed, result: &str) -> Result<bool, LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = self.inner.ack.prepare_invoke();
        inv.key(self.key("inflight"))
            .key(self.key("jobs"))
            .key(self.key("attempts"))
            .key(self.key(&format!("status:{}", claim.id)))
            .key(self.key("claims"))
            .arg(&claim.id)
            .arg(result)
            .arg(millis(self.inner.retention).max(1))
            .arg(&claim.token);
        let n: i64 = self.deadline("ack", inv.invoke_async(&mut conn)).await?;
        Ok(n == 1)
    }
}

fn event(event: &'static str, info: &JobInfo) {
    tracing::info!(
        target: "dlock::defer",
        event,
        queue = "redis",
        job_id = %info.id,
        key = %info.key,
        attempt = info.attempts,
    );
}

/// Lua: `now` in ms by the server's clock.
macro_rules! now_ms {
    () => {
        "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
    };
}

/// Enqueue, unless the queue already holds ARGV[4] jobs (due + in flight).
/// KEYS: 1 due, 2 inflight, 3 jobs. ARGV: 1 id, 2 payload, 3 delay ms, 4 max queued.
/// Returns 1 when queued, 0 when full (nothing changed).
const ENQUEUE: &str = concat!(
    r#"
if redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then
  return 0
end
"#,
    now_ms!(),
    r#"
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
return 1
"#
);

/// Claim. First the clean-up: dead letters past their retention (ARGV[4] ms) or beyond the
/// count bound (ARGV[5]) are deleted with their payload and bookkeeping; then expired claims
/// are reaped: dead-lettered when the job used up its attempts, else put back due now. Then up
/// to ARGV[2] due jobs move to `inflight` with deadline now + ARGV[1] ms, their attempt count
/// goes up and each gets the claim token ARGV[3] .. ':' .. position.
/// KEYS: 1 due, 2 inflight, 3 attempts, 4 jobs, 5 claims, 6 dead, 7 reasons.
/// Returns a flat list id, payload, attempt, claim token, ….
const CLAIM: &str = concat!(
    now_ms!(),
    r#"
local function forget(id)
  redis.call('ZREM', KEYS[6], id)
  redis.call('HDEL', KEYS[4], id)
  redis.call('HDEL', KEYS[3], id)
  redis.call('HDEL', KEYS[7], id)
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', now - tonumber(ARGV[4]), 'LIMIT', 0, 1000)) do
  forget(id)
end
local excess = redis.call('ZCARD', KEYS[6]) - tonumber(ARGV[5])
if excess > 0 then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[6], 0, math.min(excess, 1000) - 1)) do
    forget(id)
  end
end
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 1000)
for _, id in ipairs(expired) do
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[5], id)
  local n = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  local payload = redis.call('HGET', KEYS[4], id)
  local ok, env = pcall(cjson.decode, payload or '')
  local max = ok and type(env) == 'table' and tonumber(env['max_attempts']) or 0
  if n >= max then
    redis.call('ZADD', KEYS[6], now, id)
    redis.call('HSET', KEYS[7], id, 'its claim expired ' .. n .. ' times (a worker died, was killed or stalled past the visibility timeout while running it)')
  else
    redis.call('ZADD', KEYS[1], now, id)
  end
end
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for i, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  local payload = redis.call('HGET', KEYS[4], id)
  if payload then
    local n = redis.call('HINCRBY', KEYS[3], id, 1)
    local token = ARGV[3] .. ':' .. i
    redis.call('HSET', KEYS[5], id, token)
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), id)
    table.insert(out, id)
    table.insert(out, payload)
    table.insert(out, tostring(n))
    table.insert(out, token)
  end
end
return out
"#
);

/// Retry, if claim ARGV[2] is still the job's: take it out of `inflight`; dead-letter it with
/// reason ARGV[5] when its attempts reached ARGV[4], else make it due in ARGV[3] ms.
/// KEYS: 1 inflight, 2 due, 3 dead, 4 attempts, 5 claims, 6 reasons.
/// ARGV: 1 id, 2 claim token, 3 delay ms, 4 max attempts, 5 reason.
/// Returns 1 when dead-lettered, 0 when re-queued, -1 when the claim is not this one.
const RETRY: &str = concat!(
    r#"
if redis.call('HGET', KEYS[5], ARGV[1]) ~= ARGV[2] then return -1 end
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
"#,
    now_ms!(),
    r#"
local n = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
if n >= tonumber(ARGV[4]) then
  redis.call('ZADD', KEYS[3], now, ARGV[1])
  redis.call('HSET', KEYS[6], ARGV[1], ARGV[5])
  return 1
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return 0
"#
);

/// Ack, if claim ARGV[4] is still the job's: drop the job and keep its outcome for ARGV[3] ms.
/// KEYS: 1 inflight, 2 jobs, 3 attempts, 4 status key, 5 claims.
/// ARGV: 1 id, 2 outcome, 3 retention ms, 4 claim token.
/// Returns 1 when acknowledged, 0 when the claim is not this one.
const ACK: &str = r#"
if redis.call('HGET', KEYS[5], ARGV[1]) ~= ARGV[4] then return 0 end
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('SET', KEYS[4], ARGV[2], 'PX', ARGV[3])
return 1
"#;

/// Heartbeat, if claim ARGV[3] is still the job's: push its deadline to now + ARGV[1] ms.
/// KEYS: 1 inflight, 2 claims. ARGV: 1 visibility ms, 2 id, 3 claim token.
/// Returns 1 if extended, 0 when the claim is not this one.
const HEARTBEAT: &str = concat!(
    r#"
if redis.call('HGET', KEYS[2], ARGV[2]) ~= ARGV[3] then return 0 end
"#,
    now_ms!(),
    r#"
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[2])
return 1
"#
);

/// Requeue a dead letter with a fresh attempt budget, due now.
/// KEYS: 1 dead, 2 due, 3 attempts, 4 reasons. ARGV: 1 id. Returns 1 if it was a dead letter.
const REQUEUE: &str = concat!(
    r#"
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], 0)
"#,
    now_ms!(),
    r#"
redis.call('ZADD', KEYS[2], now, ARGV[1])
return 1
"#
);

type Runner = Arc<
    dyn Fn(
            serde_json::Value,
            JobContext,
        ) -> Result<BoxFuture<'static, Result<(), JobError>>, JobError>
        + Send
        + Sync,
>;

/// Runs the jobs of a [`DurableQueue`]: claims due jobs, takes each job's lock (one attempt),
/// runs it with a heartbeat on its claim, and acknowledges it — or puts it back with backoff.
/// Run one on every instance of the service.
///
/// ```no_run
/// # use dlock_runtime::defer::{DurableQueue, DurableWorker, Job, JobContext, JobError};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct SendInvoice;
/// # impl Job for SendInvoice { const NAME: &'static str = "x";
/// #   fn lock_key(&self) -> Result<dlock_runtime::LockKey, dlock_runtime::LockError> { dlock_runtime::LockKey::new("x") }
/// #   async fn run(self, _: JobContext) -> Result<(), JobError> { Ok(()) } }
/// # async fn f(queue: DurableQueue, locker: dlock_runtime::Locker) {
/// let worker = DurableWorker::new(queue, locker).register::<SendInvoice>();
/// let stop = std::sync::Arc::new(tokio::sync::Notify::new());
/// // ... call `stop.notify_one()` on shutdown (e.g. from a signal handler) ...
/// worker.run_until(stop.notified()).await;
/// # }
/// ```
#[derive(Clone)]
pub struct DurableWorker {
    queue: DurableQueue,
    locker: Locker,
    runners: HashMap<&'static str, Runner>,
    state: Option<Arc<dyn Any + Send + Sync>>,
    batch: usize,
    poll: Duration,
}

impl fmt::Debug for DurableWorker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DurableWorker")
            .field("queue", &self.queue)
            .field("jobs", &self.runners.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl DurableWorker {
    /// A worker for `queue` taking locks with `locker`. Defaults: batch 16, idle poll 100 ms.
    pub fn new(queue: DurableQueue, locker: Locker) -> Self {
        DurableWorker {
            queue,
            locker,
            runners: HashMap::new(),
            state: None,
            batch: 16,
            poll: Duration::from_millis(100),
        }
    }

    /// Teaches the worker job type `J`.
    pub fn register<J: Job>(mut self) -> Self {
        let runner: Runner = Arc::new(|data, ctx| {
            let job: J = serde_json::from_value(data)?;
            Ok(Box::pin(job.run(ctx)))
        });
        self.runners.insert(J::NAME, runner);
        self
    }

    /// Shared state handed to every job ([`JobContext::state`]).
    pub fn state<S: Clone + Send + Sync + 'static>(mut self, state: S) -> Self {
        self.state = Some(Arc::new(state));
        self
    }

    /// How many jobs one claim takes (and runs concurrently).
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }

    /// How long to wait when no job is due.
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll = d;
        self
    }

    /// Claims one batch and runs it to the end. Returns how many jobs were claimed.
    ///
    /// A job that panics does not take the batch (or the worker) down: the panic is caught,
    /// logged with the job's id, and counts as a failed attempt.
    pub async fn run_once(&self) -> Result<usize, LockError> {
        let claimed = self.queue.claim(self.batch).await?;
        let n = claimed.len();
        futures_util::future::join_all(claimed.into_iter().map(|c| self.process(c))).await;
        Ok(n)
    }

    /// Runs batches until `shutdown` resolves; the batch in progress is finished first.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        loop {
            let idle = match self.run_once().await {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) => {
                    tracing::warn!(error = %e, queue = %self.queue.name(), "dlock job worker: claim failed");
                    true
                }
            };
            if idle {
                tokio::select! {
                    _ = &mut shutdown => return,
                    _ = tokio::time::sleep(self.poll) => {}
                }
            } else if futures_util::FutureExt::now_or_never(&mut shutdown).is_some() {
                return;
            }
        }
    }

    /// Puts a claimed job back with backoff (or dead-letters it with `reason` when it used up
    /// its attempts) and says which.
    async fn put_back(&self, claim: &Claimed, info: &JobInfo, policy: &DeferPolicy, reason: &str) {
        self.finish_failed(
            claim,
            info,
            policy.backoff(claim.attempt),
            policy.max_attempts,
            reason,
        )
        .await;
    }

    /// Dead-letters a claimed job at once, with `reason`.
    async fn dead_letter(&self, claim: &Claimed, info: &JobInfo, reason: &str) {
        tracing::error!(
            target: "dlock::defer",
            event = "failed",
            queue = "redis",
            job_id = %claim.id,
            reason,
            "dlock job worker: the job cannot run; dead-lettering it"
        );
        self.finish_failed(claim, info, Duration::ZERO, 0, reason)
            .await;
    }

    async fn finish_failed(
        &self,
        claim: &Claimed,
        info: &JobInfo,
        delay: Duration,
        max_attempts: u32,
        reason: &str,
    ) {
        match self.queue.retry(claim, delay, max_attempts, reason).await {
            Ok(Retried::DeadLettered) => event("dead_lettered", info),
            Ok(Retried::Requeued) => event("retried", info),
            Ok(Retried::Stale) => tracing::warn!(
                job_id = %claim.id,
                "dlock job worker: the job's claim was taken over; leaving it to its new worker"
            ),
            Err(e) => {
                tracing::warn!(error = %e, job_id = %claim.id, "dlock job worker: retry failed; the claim will expire")
            }
        }
    }

    async fn process(&self, claim: Claimed) {
        let info = |key: &str| JobInfo::new(claim.id.clone(), key, claim.attempt);
        let env: Envelope = match serde_json::from_str(&claim.payload) {
            Ok(e) => e,
            Err(e) => {
                let reason = format!("the stored job does not decode: {e}");
                self.dead_letter(&claim, &info(""), &reason).await;
                return;
            }
        };
        let policy = env.policy();
        let Some(runner) = self.runners.get(env.kind.as_str()).cloned() else {
            // Another instance may know this type: put it back for them.
            tracing::warn!(job_type = %env.kind, job_id = %claim.id, "dlock job worker: unregistered job type");
            let reason = format!("no worker knows the job type `{}`", env.kind);
            self.put_back(&claim, &info(&env.key), &policy, &reason)
                .await;
            return;
        };
        // The stored key is already encoded: take it as is.
        let key = match LockKey::from_encoded(&env.key) {
            Ok(k) => k,
            Err(e) => {
                let reason = format!("the stored lock key is invalid: {e}");
                self.dead_letter(&claim, &info(&env.key), &reason).await;
                return;
            }
        };
        let ttl = Duration::from_millis(env.ttl_ms);
        let guard = match self.locker.lock(key).ttl(ttl).try_acquire().await {
            Ok(Some(g)) => g,
            Ok(None) => {
                let reason = format!("its lock was still busy after {} attempts", claim.attempt);
                self.put_back(&claim, &info(&env.key), &policy, &reason)
                    .await;
                return;
            }
            Err(e) => {
                let reason = format!("its lock could not be taken: {e}");
                self.put_back(&claim, &info(&env.key), &policy, &reason)
                    .await;
                return;
            }
        };
        let result = Arc::new(std::sync::Mutex::new(None));
        let ctx = JobContext {
            job_id: claim.id.clone(),
            attempt: claim.attempt,
            fencing_token: guard.fencing_token(),
            key: env.key.clone(),
            state: self.state.clone(),
            result: result.clone(),
        };
        // Decoding runs the job type's own `Deserialize`: it may panic too.
        let run = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            runner(env.data, ctx)
        })) {
            Ok(Ok(fut)) => fut,
            Ok(Err(e)) => {
                let _ = guard.release().await;
                let reason = format!("the job's data does not decode: {e}");
                self.dead_letter(&claim, &info(&env.key), &reason).await;
                return;
            }
            Err(panic) => {
                let _ = guard.release().await;
                let reason = format!("decoding the job panicked: {}", panic_message(&*panic));
                self.put_back(&claim, &info(&env.key), &policy, &reason)
                    .await;
                return;
            }
        };
        // Keep the claim alive while the job runs; stop the job if the claim is taken over.
        let beat = self.queue.inner.visibility / 3;
        let outcome = {
            let work = std::panic::AssertUnwindSafe(crate::with_lock(&guard, run)).catch_unwind();
            tokio::pin!(work);
            loop {
                tokio::select! {
                    out = &mut work => break Some(out),
                    _ = tokio::time::sleep(beat) => match self.queue.heartbeat(&claim).await {
                        Ok(true) => {}
                        Ok(false) => break None,
                        Err(e) => tracing::warn!(error = %e, job_id = %claim.id, "dlock job worker: heartbeat failed"),
                    },
                }
            }
        };
        let _ = guard.release().await;
        let Some(outcome) = outcome else {
            tracing::warn!(
                target: "dlock::defer",
                event = "abandoned",
                queue = "redis",
                job_id = %claim.id,
                attempt = claim.attempt,
                "dlock job worker: the job's claim expired and was taken over (this worker \
                 stalled past the visibility timeout); stopped working on it"
            );
            return;
        };
        match outcome {
            Ok(Ok(())) => {
                let recorded = result
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take()
                    .unwrap_or_default();
                match self.queue.ack(&claim, &recorded).await {
                    Ok(true) => event("completed", &info(&env.key)),
                    Ok(false) => tracing::warn!(
                        job_id = %claim.id,
                        "dlock job worker: the job ran, but its claim had been taken over; not acknowledged"
                    ),
                    Err(e) => {
                        tracing::warn!(error = %e, job_id = %claim.id, "dlock job worker: ack failed; the job may run again")
                    }
                }
            }
            Ok(Err(e)) => {
                if let Some(permanent) = e.downcast_ref::<PermanentFailure>() {
                    self.dead_letter(&claim, &info(&env.key), permanent.reason())
                        .await;
                    return;
                }
                tracing::warn!(target: "dlock::defer", event = "failed", queue = "redis", job_id = %claim.id, error = %e);
                let reason = format!("the job failed: {e}");
                self.put_back(&claim, &info(&env.key), &policy, &reason)
                    .await;
            }
            Err(panic) => {
                let message = panic_message(&*panic);
                tracing::error!(
                    target: "dlock::defer",
                    event = "failed",
                    queue = "redis",
                    job_id = %claim.id,
                    attempt = claim.attempt,
                    panic = %message,
                    "dlock job worker: the job panicked"
                );
                let reason = format!("the job panicked: {message}");
                self.put_back(&claim, &info(&env.key), &policy, &reason)
                    .await;
            }
        }
    }
}
