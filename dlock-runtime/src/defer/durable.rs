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
//! | `dlock:{jobs:<name>}:dead` | zset | job id → time it was dead-lettered |
//! | `dlock:{jobs:<name>}:status:<id>` | string | final outcome, kept for the retention period |
//!
//! # Delivery
//!
//! A worker claims due jobs with one script: expired claims are first put back (the reaper),
//! then up to a batch of due jobs move atomically from `due` to `inflight` with a deadline of
//! now + the visibility timeout, and their attempt counts go up. While a job runs, its worker
//! pushes the deadline forward every third of the timeout. A worker that dies stops doing so;
//! once the deadline passes, the next claim by any instance puts the job back and runs it again.
//!
//! So every job runs **at least once**. It can run twice only if its worker lost contact (died,
//! froze, or was cut off from Redis) for longer than the visibility timeout while running it:
//! that window is the at-least-once window. The job's lock narrows the damage (the two runs do not
//! overlap while the first still holds the lock), and [`JobContext::fencing_token`] lets the job's
//! writes reject the stale run; [`JobContext::attempt`] tells a job it is being retried.
//!
//! A job whose lock is busy, or which returns an error, is put back with the policy's backoff;
//! after `max_attempts` claims it moves to the dead-letter set, where
//! [`DurableQueue::dead_letters`] lists it and [`DurableQueue::requeue`] puts it back.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::{new_job_id, DeferPolicy, JobInfo};
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

struct QueueInner {
    name: String,
    conn: ConnectionManager,
    base: String,
    visibility: Duration,
    retention: Duration,
    command_timeout: Duration,
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
            .finish_non_exhaustive()
    }
}

impl DurableQueue {
    /// Connects to the queue `name` in the Redis at `url`. Defaults: visibility timeout 30 s,
    /// outcome retention 24 h, command timeout 1 s.
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
                command_timeout,
                claim: Script::new(CLAIM),
                retry: Script::new(RETRY),
                ack: Script::new(ACK),
                heartbeat: Script::new(HEARTBEAT),
                requeue: Script::new(REQUEUE),
            }),
        })
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
    /// Returns the job id.
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
        let mut pipe = redis::pipe();
        pipe.atomic()
            .hset(self.key("jobs"), &id, payload)
            .ignore()
            .cmd("EVAL")
            .arg("local t = redis.call('TIME'); redis.call('ZADD', KEYS[1], t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[1]), ARGV[2]) return 1")
            .arg(1)
            .arg(self.key("due"))
            .arg(millis(delay))
            .arg(&id)
            .ignore();
        self.deadline("enqueue", pipe.query_async::<()>(&mut conn))
            .await?;
        let info = JobInfo {
            id: id.clone(),
            key: key.as_str().to_owned(),
            attempts: 0,
        };
        event("deferred", &info);
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

    /// The dead-letter set.
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
            let (payload, attempts): (Option<String>, Option<u32>) = self
                .deadline(
                    "dead letter",
                    redis::pipe()
                        .hget(self.key("jobs"), &id)
                        .hget(self.key("attempts"), &id)
                        .query_async(&mut conn),
                )
                .await?;
            let key = payload
                .and_then(|p| serde_json::from_str::<Envelope>(&p).ok())
                .map(|e| e.key)
                .unwrap_or_default();
            out.push(JobInfo {
                id,
                key,
                attempts: attempts.unwrap_or(0),
            });
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
            .arg(id);
        let n: i64 = self
            .deadline("requeue", inv.invoke_async(&mut conn))
            .await?;
        if n == 1 {
            event(
                "requeued",
                &JobInfo {
                    id: id.to_owned(),
                    key: String::new(),
                    attempts: 0,
                },
            );
        }
        Ok(n == 1)
    }

    async fn claim(&self, batch: usize) -> Result<Vec<(String, String, u32)>, LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = self.inner.claim.prepare_invoke();
        inv.key(self.key("due"))
            .key(self.key("inflight"))
            .key(self.key("attempts"))
            .key(self.key("jobs"))
            .arg(millis(self.inner.visibility))
            .arg(batch);
        let flat: Vec<String> = self.deadline("claim", inv.invoke_async(&mut conn)).await?;
        Ok(flat
            .chunks_exact(3)
            .map(|c| (c[0].clone(), c[1].clone(), c[2].parse().unwrap_or(1)))
            .collect())
    }

    async fn heartbeat(&self, id: &str) -> Result<(), LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = self.inner.heartbeat.prepare_invoke();
        inv.key(self.key("inflight"))
            .arg(millis(self.inner.visibility))
            .arg(id);
        self.deadline("heartbeat", inv.invoke_async::<i64>(&mut conn))
            .await
            .map(|_| ())
    }

    /// Puts a claimed job back after `delay`, or dead-letters it when it used up its attempts.
    /// Returns whether it was dead-lettered.
    async fn retry(&self, id: &str, delay: Duration, max_attempts: u32) -> Result<bool, LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = self.inner.retry.prepare_invoke();
        inv.key(self.key("inflight"))
            .key(self.key("due"))
            .key(self.key("dead"))
            .key(self.key("attempts"))
            .arg(id)
            .arg(millis(delay))
            .arg(max_attempts);
        let dead: i64 = self.deadline("retry", inv.invoke_async(&mut conn)).await?;
        Ok(dead == 1)
    }

    /// Completes a claimed job and records its outcome for the retention period.
    async fn ack(&self, id: &str, result: &str) -> Result<(), LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = self.inner.ack.prepare_invoke();
        inv.key(self.key("inflight"))
            .key(self.key("jobs"))
            .key(self.key("attempts"))
            .key(self.key(&format!("status:{id}")))
            .arg(id)
            .arg(result)
            .arg(millis(self.inner.retention).max(1));
        self.deadline("ack", inv.invoke_async::<i64>(&mut conn))
            .await
            .map(|_| ())
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

/// Claim: put back expired claims (the reaper), then move up to ARGV[2] due jobs to `inflight`
/// with deadline now + ARGV[1] ms, counting the attempt.
/// KEYS: 1 due, 2 inflight, 3 attempts, 4 jobs. Returns a flat list id, payload, attempt, ….
const CLAIM: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 1000)
for _, id in ipairs(expired) do
  redis.call('ZREM', KEYS[2], id)
  redis.call('ZADD', KEYS[1], now, id)
end
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, id in ipairs(ids) do
  redis.call('ZREM', KEYS[1], id)
  local payload = redis.call('HGET', KEYS[4], id)
  if payload then
    local n = redis.call('HINCRBY', KEYS[3], id, 1)
    redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), id)
    table.insert(out, id)
    table.insert(out, payload)
    table.insert(out, tostring(n))
  end
end
return out
"#;

/// Retry: take the job out of `inflight`; dead-letter it when its attempts reached ARGV[3],
/// else make it due in ARGV[2] ms.
/// KEYS: 1 inflight, 2 due, 3 dead, 4 attempts. ARGV: 1 id, 2 delay ms, 3 max attempts.
/// Returns 1 when dead-lettered, 0 when re-queued, -1 when the job was not in flight.
const RETRY: &str = r#"
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return -1 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = tonumber(redis.call('HGET', KEYS[4], ARGV[1]) or '0')
if n >= tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[3], now, ARGV[1])
  return 1
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
return 0
"#;

/// Ack: the job is done; drop it and keep its outcome for ARGV[3] ms.
/// KEYS: 1 inflight, 2 jobs, 3 attempts, 4 status key. ARGV: 1 id, 2 outcome, 3 retention ms.
const ACK: &str = r#"
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('SET', KEYS[4], ARGV[2], 'PX', ARGV[3])
return 1
"#;

/// Heartbeat: push a claimed job's deadline to now + ARGV[1] ms, if it is still claimed.
/// KEYS: 1 inflight. ARGV: 1 visibility ms, 2 id. Returns 1 if extended.
const HEARTBEAT: &str = r#"
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[2])
return 1
"#;

/// Requeue a dead letter with a fresh attempt budget, due now.
/// KEYS: 1 dead, 2 due, 3 attempts. ARGV: 1 id. Returns 1 if it was a dead letter.
const REQUEUE: &str = r#"
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[3], ARGV[1], 0)
redis.call('ZADD', KEYS[2], now, ARGV[1])
return 1
"#;

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
    pub async fn run_once(&self) -> Result<usize, LockError> {
        let claimed = self.queue.claim(self.batch).await?;
        let n = claimed.len();
        futures_util::future::join_all(
            claimed
                .into_iter()
                .map(|(id, payload, attempt)| self.process(id, payload, attempt)),
        )
        .await;
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

    /// Puts a claimed job back with backoff (or dead-letters it) and says which.
    async fn put_back(&self, info: &JobInfo, policy: &DeferPolicy) {
        match self
            .queue
            .retry(&info.id, policy.backoff(info.attempts), policy.max_attempts)
            .await
        {
            Ok(true) => event("dead_lettered", info),
            Ok(false) => event("retried", info),
            Err(e) => {
                tracing::warn!(error = %e, "dlock job worker: retry failed; the claim will expire")
            }
        }
    }

    async fn process(&self, id: String, payload: String, attempt: u32) {
        let info = |key: &str| JobInfo {
            id: id.clone(),
            key: key.to_owned(),
            attempts: attempt,
        };
        let env: Envelope = match serde_json::from_str(&payload) {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(target: "dlock::defer", event = "failed", queue = "redis", job_id = %id, error = %e, "undecodable job");
                let _ = self.queue.retry(&id, Duration::from_secs(60), 0).await;
                return;
            }
        };
        let policy = env.policy();
        let Some(runner) = self.runners.get(env.kind.as_str()).cloned() else {
            // Another instance may know this type: put it back for them.
            tracing::warn!(job_type = %env.kind, job_id = %id, "dlock job worker: unregistered job type");
            let _ = self
                .queue
                .retry(&id, policy.backoff(attempt), policy.max_attempts)
                .await;
            return;
        };
        // The stored key is already encoded: take it as is.
        let key = match LockKey::from_encoded(&env.key) {
            Ok(k) => k,
            Err(e) => {
                tracing::error!(job_id = %id, error = %e, "dlock job worker: bad lock key");
                let _ = self.queue.retry(&id, policy.backoff(attempt), 0).await;
                return;
            }
        };
        let ttl = Duration::from_millis(env.ttl_ms);
        let guard = match self.locker.lock(key).ttl(ttl).try_acquire().await {
            Ok(Some(g)) => g,
            Ok(None) | Err(_) => {
                self.put_back(&info(&env.key), &policy).await;
                return;
            }
        };
        let result = Arc::new(std::sync::Mutex::new(None));
        let ctx = JobContext {
            job_id: id.clone(),
            attempt,
            fencing_token: guard.fencing_token(),
            key: env.key.clone(),
            state: self.state.clone(),
            result: result.clone(),
        };
        let run = match runner(env.data, ctx) {
            Ok(fut) => fut,
            Err(e) => {
                tracing::error!(job_id = %id, error = %e, "dlock job worker: job data does not decode");
                let _ = self.queue.retry(&id, policy.backoff(attempt), 0).await;
                return;
            }
        };
        // Keep the claim alive while the job runs.
        let beat = self.queue.inner.visibility / 3;
        let outcome = {
            let work = crate::with_lock(&guard, run);
            tokio::pin!(work);
            loop {
                tokio::select! {
                    out = &mut work => break out,
                    _ = tokio::time::sleep(beat) => {
                        if let Err(e) = self.queue.heartbeat(&id).await {
                            tracing::warn!(error = %e, job_id = %id, "dlock job worker: heartbeat failed");
                        }
                    }
                }
            }
        };
        let _ = guard.release().await;
        match outcome {
            Ok(()) => {
                let recorded = result
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take()
                    .unwrap_or_default();
                match self.queue.ack(&id, &recorded).await {
                    Ok(()) => event("completed", &info(&env.key)),
                    Err(e) => {
                        tracing::warn!(error = %e, job_id = %id, "dlock job worker: ack failed; the job may run again")
                    }
                }
            }
            Err(e) => {
                tracing::warn!(target: "dlock::defer", event = "failed", queue = "redis", job_id = %id, error = %e);
                self.put_back(&info(&env.key), &policy).await;
            }
        }
    }
}
