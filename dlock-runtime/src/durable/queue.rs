//! [`DurableQueue`]: the queue's storage operations, one Lua script each.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManagerConfig;

use crate::backend::redis::conn::{self, Conn, Dedicated, Reconnect, ScriptCall, ServerLink};
use crate::backend::redis::guarded_script;
use redis::{RedisError, Script};

use super::{event, millis, redis_err, Envelope, Job, JobContext, JobStatus, JobsPage, Submitted};
use crate::backend::redis::job_scripts::{
    ACK, CLAIM, DESCRIBE, ENQUEUE, HEARTBEAT, PURGE, REQUEUE, RETRY, WITHDRAW,
};
use crate::defer::{JobInfo, QueueLimits};
use crate::{DeferPolicy, LockError, LockKey, Locker};

/// The visibility timeout's bounds: a shorter one expires claims between heartbeats; a longer
/// one would overflow the worker's deadlines (`Duration::MAX` meaning "never") and gains
/// nothing, since a running job's claim is renewed every third of it. Below three command
/// timeouts (3 s) the queue works, but a claim or heartbeat answered late can outlive it: a
/// claim sent again no longer finds its batch, and a claim renewed late has expired (tests
/// use such short ones; production should not).
const MIN_VISIBILITY: Duration = Duration::from_millis(100);
const MAX_VISIBILITY: Duration = Duration::from_secs(86_400);
/// The longest outcome retention: Redis refuses an expiry past its clock's range, and the
/// acknowledgement that stores the outcome has deleted the job by then.
const MAX_RETENTION: Duration = Duration::from_secs(3650 * 86_400);

/// The longest command timeout a queue takes ([`QueueOptions::command_timeout`]).
const MAX_COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// How [`DurableQueue::connect_options`] connects. Defaults: visibility timeout 30 s, outcome
/// retention 24 h, command timeout 1 s.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueOptions {
    /// How long a claimed job may go without a heartbeat before another worker may run it (at
    /// least 100 ms, at most a day; a running job's worker renews it every third of it). Keep
    /// it at three command timeouts or more: a claim or heartbeat answered late can outlive a
    /// shorter one, and the job is re-queued with an attempt counted.
    pub visibility: Duration,
    /// How long a job's outcome is kept for [`DurableQueue::status`] (at most ten years).
    pub retention: Duration,
    /// How long each command to the queue's Redis may take before it counts as unanswered —
    /// also the connect and `PING` timeouts (more than zero, at most 60 s). Raise it for a
    /// Redis a slow link away, or whose latency spikes past 1 s: an enqueue unanswered in time
    /// is sent again (three tries), then answered `Unavailable`.
    pub command_timeout: Duration,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            visibility: Duration::from_secs(30),
            retention: Duration::from_secs(86_400),
            command_timeout: Duration::from_secs(1),
        }
    }
}

impl QueueOptions {
    /// Sets [`visibility`](QueueOptions::visibility).
    pub fn visibility(mut self, d: Duration) -> Self {
        self.visibility = d;
        self
    }

    /// Sets [`retention`](QueueOptions::retention).
    pub fn retention(mut self, d: Duration) -> Self {
        self.retention = d;
        self
    }

    /// Sets [`command_timeout`](QueueOptions::command_timeout).
    pub fn command_timeout(mut self, d: Duration) -> Self {
        self.command_timeout = d;
        self
    }
}

/// How many times an unanswered enqueue or claim is sent (with the same job id, or claim
/// token).
const RESEND_TRIES: u64 = 3;

/// The most bytes of a job's dead-letter reason or recorded result the queue keeps: a job's
/// error message or result may carry whatever data it had, and is kept with the job's status
/// for the retention period (a reason with the dead letter, for the dead-letter retention).
const MAX_NOTE_BYTES: usize = 4096;

/// `note` cut to [`MAX_NOTE_BYTES`] at a character boundary, ending in `…` when cut.
fn clipped(note: &str) -> std::borrow::Cow<'_, str> {
    if note.len() <= MAX_NOTE_BYTES {
        return note.into();
    }
    let mut cut = MAX_NOTE_BYTES - '…'.len_utf8();
    while !note.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &note[..cut]).into()
}

/// The `ZRANGE` stop index of the first `limit` members (`0` for a `limit` of 0, whose one
/// member the caller drops: `ZRANGE` has no empty range from 0).
fn last_index(limit: usize) -> isize {
    isize::try_from(limit.saturating_sub(1)).unwrap_or(isize::MAX)
}

/// How many jobs one round trip of a listing describes at most (one `DESCRIBE` script call).
const DESCRIBE_BATCH: usize = 500;
/// How much of a stored job a listing reads: the envelope's first field, the lock key (at most
/// 12 KiB encoded, `key::MAX_KEY_INPUT_LEN` × 3). A job's whole copy can be megabytes (a
/// deferred request's body): 500 of them were one reply of up to 2 GiB, which outran the
/// command timeout and held the queue's connection (claims, heartbeats, acks) behind it.
const DESCRIBE_HEAD: usize = 16 * 1024;
/// How many bytes of stored jobs one `DESCRIBE` call may copy on the server to read their
/// starts (a few milliseconds of `memcpy`); a call describes one job at least.
const DESCRIBE_COPY_BUDGET: usize = 32 * 1024 * 1024;

/// The lock key of a stored job from the start of its copy (`head`, see [`DESCRIBE_HEAD`]):
/// the envelope's first field — or, for a whole copy, wherever it is (one stored by an earlier
/// release, which wrote the key after the job's data: only a copy that fits in the head is
/// read whole, and a longer one's key is not known to a listing, which shows it empty).
fn key_of(head: Option<&[u8]>) -> String {
    let Some(head) = head else {
        return String::new();
    };
    if let Ok(env) = serde_json::from_slice::<Envelope>(head) {
        return env.key;
    }
    let Some(rest) = head.strip_prefix(br#"{"key":"#) else {
        return String::new();
    };
    // The key's JSON string, and nothing after it.
    serde_json::Deserializer::from_slice(rest)
        .into_iter::<String>()
        .next()
        .and_then(Result::ok)
        .unwrap_or_default()
}

/// A durable delay queue in Redis (see the [module docs](super)). Cheap to clone.
#[derive(Clone)]
pub struct DurableQueue {
    pub(super) inner: Arc<QueueInner>,
}

#[derive(Clone)]
pub(super) struct QueueInner {
    name: String,
    conn: Conn,
    /// Connections of their own for an enqueue and the `WAIT` after it
    /// ([`with_replicas`](DurableQueue::with_replicas)).
    dedicated: Arc<Dedicated>,
    replicas: u32,
    base: String,
    pub(super) visibility: Duration,
    retention: Duration,
    limits: QueueLimits,
    command_timeout: Duration,
    enqueue: Script,
    claim: Script,
    retry: Script,
    ack: Script,
    heartbeat: Script,
    requeue: Script,
    purge: Script,
    withdraw: Script,
    describe: Script,
}

impl fmt::Debug for DurableQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DurableQueue")
            .field("name", &self.inner.name)
            .field("visibility", &self.inner.visibility)
            .field("limits", &self.inner.limits)
            .field("replicas", &self.inner.replicas)
            .finish_non_exhaustive()
    }
}

/// One claimed job, as the claim script hands it out.
pub(super) struct Claimed {
    pub(super) id: String,
    /// The stored envelope; not UTF-8 (a foreign writer, corruption), the error — the job is
    /// dead-lettered as one that does not decode, and its batch-mates run.
    pub(super) payload: Result<String, std::string::FromUtf8Error>,
    pub(super) attempt: u32,
    pub(super) token: String,
    /// When the claim was first sent: its deadline on the server is at least the visibility
    /// timeout from then.
    pub(super) sent: tokio::time::Instant,
}

/// How a claim that is put back counts (the retry script's ARGV[6]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Counted {
    /// As an attempt: the job ran, or its lock was busy.
    Attempt,
    /// Not at all: the job could not be tried (its lock backend did not answer).
    Untried,
    /// Not as an attempt, but against this grace period, counted from the first claim that
    /// did not know the job's type; once it is over, the job is dead-lettered.
    UnknownType(Duration),
}

/// What the retry script did.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Retried {
    Requeued,
    /// Re-queued by the first claim (since the job last ran or was requeued) that did not
    /// know its type: the grace period starts now.
    FirstUnknown,
    DeadLettered,
    /// The claim is not ours any more: nothing changed.
    Stale,
}

impl DurableQueue {
    /// Connects to the queue `name` in the Redis at `url` — one server (`redis://`,
    /// `rediss://`); with feature `cluster`, a Redis Cluster (`redis+cluster://h1:p1,h2:p2`;
    /// all of a queue's keys share one hash tag, so its scripts run on one shard); with feature
    /// `sentinel`, the master of a Sentinel-monitored group
    /// (`redis+sentinel://s1:p1,s2:p2/<master-name>`, followed through a failover). Defaults:
    /// visibility timeout 30 s, outcome retention 24 h, command timeout 1 s,
    /// [`QueueLimits::default`] ([`connect_options`](DurableQueue::connect_options) sets the
    /// first three).
    pub async fn connect(url: &str, name: &str) -> Result<Self, LockError> {
        Self::connect_options(url, name, QueueOptions::default()).await
    }

    /// Like [`connect`](DurableQueue::connect) with an explicit visibility timeout (how long a
    /// claimed job may go without a heartbeat before another worker may run it; at least
    /// 100 ms and at most a day — a running job's worker renews it every third of it; keep it
    /// at 3 s or more: under three of the queue's 1 s command timeouts, a claim or heartbeat
    /// answered late can outlive it, and the job is re-queued with an attempt counted) and
    /// outcome retention (at most ten years). See [`QueueOptions`].
    pub async fn connect_with(
        url: &str,
        name: &str,
        visibility: Duration,
        retention: Duration,
    ) -> Result<Self, LockError> {
        let options = QueueOptions::default()
            .visibility(visibility)
            .retention(retention);
        Self::connect_options(url, name, options).await
    }

    /// Like [`connect`](DurableQueue::connect) with [`QueueOptions`]: the visibility timeout,
    /// the outcome retention and the command timeout.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), dlock_runtime::LockError> {
    /// use std::time::Duration;
    /// use dlock_runtime::durable::{DurableQueue, QueueOptions};
    ///
    /// // A Redis in another region: commands may take 3 s before they count as unanswered.
    /// let options = QueueOptions::default()
    ///     .command_timeout(Duration::from_secs(3))
    ///     .visibility(Duration::from_secs(60));
    /// let queue = DurableQueue::connect_options("redis://jobs.example:6379", "orders", options)
    ///     .await?;
    /// # let _ = queue; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`LockError::Misconfigured`] for a command timeout of zero or over 60 s; as
    /// [`connect`](DurableQueue::connect) otherwise.
    pub async fn connect_options(
        url: &str,
        name: &str,
        options: QueueOptions,
    ) -> Result<Self, LockError> {
        let QueueOptions {
            visibility,
            retention,
            command_timeout,
        } = options;
        if command_timeout.is_zero() || command_timeout > MAX_COMMAND_TIMEOUT {
            return Err(LockError::misconfigured(
                format!(
                    "job queue command timeout {command_timeout:?}: must be more than zero \
                     and at most {MAX_COMMAND_TIMEOUT:?}"
                ),
                None,
            ));
        }
        if name.is_empty()
            || name
                .chars()
                .any(|c| matches!(c, '{' | '}') || c.is_whitespace())
        {
            return Err(LockError::invalid_key(
                "queue name must be non-empty, without braces or whitespace",
            ));
        }
        let cluster = conn::is_cluster_url(url);
        let (mut conn, reconnect) = if cluster {
            Self::cluster_conn(url, command_timeout).await?
        } else if url.starts_with("redis+sentinel://") || url.starts_with("rediss+sentinel://") {
            Self::sentinel_conn(url, command_timeout).await?
        } else {
            Self::single_conn(url, command_timeout).await?
        };
        // A keyless command reaches one node of a cluster: not a check of the cluster.
        if !cluster {
            if let Some(policy) = conn::evicting_policy(&mut conn, command_timeout).await {
                tracing::warn!(
                    queue = %name,
                    policy = %policy,
                    "dlock: the job queue's Redis evicts keys under memory pressure \
                     (maxmemory-policy {policy}): queued jobs, their claims and the records \
                     that keep a resent enqueue or claim from repeating can be evicted, and \
                     jobs lost without an error; set `maxmemory-policy noeviction`"
                );
            }
        }
        Ok(DurableQueue {
            inner: Arc::new(QueueInner {
                name: name.to_owned(),
                conn,
                dedicated: Arc::new(Dedicated::new(reconnect, command_timeout, command_timeout)),
                replicas: 0,
                base: format!("dlock:{{jobs:{name}}}"),
                visibility: visibility.clamp(MIN_VISIBILITY, MAX_VISIBILITY),
                retention: retention.min(MAX_RETENTION),
                limits: QueueLimits::default(),
                command_timeout,
                enqueue: guarded_script(ENQUEUE, cluster),
                claim: guarded_script(CLAIM, cluster),
                retry: guarded_script(RETRY, cluster),
                ack: guarded_script(ACK, cluster),
                heartbeat: guarded_script(HEARTBEAT, cluster),
                requeue: guarded_script(REQUEUE, cluster),
                purge: guarded_script(PURGE, cluster),
                withdraw: guarded_script(WITHDRAW, cluster),
                describe: guarded_script(DESCRIBE, cluster),
            }),
        })
    }

    /// A connection to one server, replaced when it goes silent (see
    /// `crate::backend::redis::conn::ServerLink`), connected (and so checked) before it is
    /// returned; and how to make [`Dedicated`] ones.
    async fn single_conn(
        url: &str,
        command_timeout: Duration,
    ) -> Result<(Conn, Reconnect), LockError> {
        let client = redis::Client::open(url).map_err(|e| redis_err("url", e))?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(command_timeout))
            .set_response_timeout(Some(command_timeout))
            .set_number_of_retries(2);
        let mut conn = ServerLink::new(client.clone(), config, None, command_timeout)
            .map(Conn::Server)
            .map_err(|e| redis_err("connect", e))?;
        tokio::time::timeout(
            command_timeout * 2,
            redis::cmd("PING").query_async::<()>(&mut conn),
        )
        .await
        .map_err(|_| LockError::unavailable("job queue connect timed out", None))?
        .map_err(|e| redis_err("connect", e))?;
        Ok((conn, Reconnect::Single(Box::new(client))))
    }

    #[cfg(feature = "cluster")]
    async fn cluster_conn(
        url: &str,
        command_timeout: Duration,
    ) -> Result<(Conn, Reconnect), LockError> {
        conn::connect_cluster(url, command_timeout, command_timeout).await
    }

    #[cfg(not(feature = "cluster"))]
    async fn cluster_conn(
        _url: &str,
        _command_timeout: Duration,
    ) -> Result<(Conn, Reconnect), LockError> {
        Err(LockError::misconfigured(
            "redis+cluster:// needs dlock-runtime's feature `cluster`",
            None,
        ))
    }

    #[cfg(feature = "sentinel")]
    async fn sentinel_conn(
        url: &str,
        command_timeout: Duration,
    ) -> Result<(Conn, Reconnect), LockError> {
        use crate::backend::redis::sentinel::{SentinelConn, SentinelUrl};
        let url = SentinelUrl::parse(url)?;
        let conn =
            SentinelConn::connect(&url, command_timeout, command_timeout, None, None).await?;
        Ok((Conn::Sentinel(conn), Reconnect::FromConn))
    }

    #[cfg(not(feature = "sentinel"))]
    async fn sentinel_conn(
        _url: &str,
        _command_timeout: Duration,
    ) -> Result<(Conn, Reconnect), LockError> {
        Err(LockError::misconfigured(
            "redis+sentinel:// needs dlock-runtime's feature `sentinel`",
            None,
        ))
    }

    /// This queue with other bounds: the most jobs queued or running, the largest job, and how
    /// long and how many dead letters are kept. Every instance should use the same limits;
    /// each enforces its own when it enqueues (the bounds) or claims (dead-letter clean-up).
    pub fn with_limits(self, limits: QueueLimits) -> Self {
        let mut inner = Arc::unwrap_or_clone(self.inner);
        inner.limits = limits;
        DurableQueue {
            inner: Arc::new(inner),
        }
    }

    /// This queue with enqueues that count only once `n` replicas have the job (Redis `WAIT`;
    /// one server with replicas, Sentinel, or a cluster, where the queue's shard's replicas
    /// count). Default 0: the master's answer is enough, and a failover to a replica that had
    /// not yet received the job loses it, although [`enqueue`](Self::enqueue) answered `Ok`.
    ///
    /// With `n > 0`, each enqueue is sent with the `WAIT` after it on a connection of their own
    /// (`WAIT` blocks its connection) and waits up to ¾ of the command timeout (1 s by
    /// default, [`QueueOptions::command_timeout`]) for the
    /// replicas. When fewer answer in time, the job is withdrawn — unless a worker has claimed
    /// it already — and the enqueue fails with [`LockError::Unavailable`]: as for an enqueue
    /// that was not answered, the job may or may not be queued (a failover right then can
    /// bring back a withdrawn job, and a claimed one runs). A queue whose master has fewer
    /// than `n` replicas fails every enqueue so; claims, acknowledgements and retries are not
    /// waited on (one lost in a failover runs a job again, which at-least-once allows, but
    /// never loses one).
    pub fn with_replicas(self, n: u32) -> Self {
        let mut inner = Arc::unwrap_or_clone(self.inner);
        inner.replicas = n;
        DurableQueue {
            inner: Arc::new(inner),
        }
    }

    /// How many replicas must have a job before its enqueue counts
    /// ([`with_replicas`](Self::with_replicas)).
    pub fn replicas(&self) -> u32 {
        self.inner.replicas
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

    /// The command timeout ([`QueueOptions::command_timeout`]).
    pub fn command_timeout(&self) -> Duration {
        self.inner.command_timeout
    }

    fn key(&self, suffix: &str) -> String {
        format!("{}:{suffix}", self.inner.base)
    }

    /// Runs the script invocation `inv` (an enqueue, a claim), sending it again unchanged —
    /// the same job id, the same claim token — up to [`RESEND_TRIES`] times while it is not
    /// answered (a timeout, a dropped connection). The server may have run a try whose answer
    /// was lost, so these scripts answer a resend with what the first try did.
    /// The script runs on `on` (the queue's connection, or a dedicated one).
    async fn invoke_resending<T: redis::FromRedisValue>(
        &self,
        on: &Conn,
        what: &str,
        inv: &ScriptCall<'_>,
    ) -> Result<T, LockError> {
        let mut conn = on.clone();
        let mut tries = 0;
        loop {
            tries += 1;
            match self.deadline_on(on, what, inv.invoke(&mut conn)).await {
                Ok(v) => return Ok(v),
                Err(e) if e.is_unavailable() && tries < RESEND_TRIES => {
                    tracing::debug!(error = %e, what, "dlock job queue: not answered; sending it again");
                    tokio::time::sleep(Duration::from_millis(20 * tries)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn deadline<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, LockError> {
        self.deadline_on(&self.inner.conn, what, fut).await
    }

    /// [`deadline`](Self::deadline) for a command on `conn`.
    async fn deadline_on<T>(
        &self,
        conn: &Conn,
        what: &str,
        fut: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, LockError> {
        // A timeout has the connection checked: one to one server that went silent is
        // replaced (see `Conn::failed`).
        match tokio::time::timeout(self.inner.command_timeout, fut).await {
            Ok(r) => r.map_err(|e| {
                conn.failed(&e);
                redis_err(what, e)
            }),
            Err(_) => {
                conn.timed_out();
                Err(LockError::unavailable(
                    format!("job queue {what} timed out"),
                    None,
                ))
            }
        }
    }

    /// Queues `job` to run after `delay` under `policy` (its lock held with lease `ttl`).
    /// Returns the job id, [`LockError::QueueFull`] when the queue holds
    /// [`QueueLimits::max_queued`] jobs already, or [`LockError::JobTooLarge`] when the job's
    /// stored form is over [`QueueLimits::max_job_bytes`] (then nothing is sent). An enqueue
    /// the queue does not answer (a timeout, a dropped connection) is sent again with the same
    /// job id (three tries in all), which is never queued twice; `Unavailable` means none of
    /// them was answered (the job may or may not be queued).
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
            // A job that does not serialize never will: a 500, not an outage to retry.
            data: serde_json::to_value(job).map_err(|e| {
                LockError::misconfigured(
                    format!("job {} does not serialize", J::NAME),
                    Some(Box::new(e)),
                )
            })?,
            key: key.as_str().to_owned(),
            max_attempts: policy.max_attempts,
            delay_ms: millis(policy.delay),
            max_delay_ms: millis(policy.max_delay),
            ttl_ms: millis(crate::util::validate_ttl(ttl)?),
        };
        let payload = serde_json::to_string(&env).expect("an envelope of JSON values serializes");
        let max = self.inner.limits.max_job_bytes;
        if payload.len() > max {
            tracing::warn!(
                target: "dlock::defer",
                event = "too_large",
                queue = "redis",
                name = %self.inner.name,
                key = %crate::key::KeyLog::default().show(key.as_str()),
                job_type = J::NAME,
                bytes = payload.len(),
                max_job_bytes = max,
            );
            return Err(LockError::job_too_large(
                key.as_str(),
                &self.inner.name,
                payload.len(),
                max,
            ));
        }
        self.enqueue_raw(&payload, &key, J::NAME, delay).await
    }

    async fn enqueue_raw(
        &self,
        payload: &str,
        key: &LockKey,
        name: &'static str,
        delay: Duration,
    ) -> Result<String, LockError> {
        let id = crate::util::secure_token::<16>();
        let mut inv = ScriptCall::new(&self.inner.enqueue, 4);
        inv.key(self.key("due"))
            .key(self.key("inflight"))
            .key(self.key("jobs"))
            .key(self.key(&format!("status:{id}")))
            .arg(&id)
            .arg(payload)
            .arg(millis(delay))
            .arg(self.inner.limits.max_queued);
        // Answered `Unavailable`, the caller would try again with a new id — a second job.
        let on = match self.inner.replicas {
            0 => self.inner.conn.clone(),
            _ => self.inner.dedicated.get(&self.inner.conn).await?,
        };
        let queued: i64 = self.invoke_resending(&on, "enqueue", &inv).await?;
        if queued == 0 {
            tracing::warn!(
                target: "dlock::defer",
                event = "full",
                queue = "redis",
                name = %self.inner.name,
                key = %crate::key::KeyLog::default().show(key.as_str()),
                job_type = name,
                max_queued = self.inner.limits.max_queued,
            );
            return Err(LockError::queue_full(key.as_str(), &self.inner.name));
        }
        if self.inner.replicas > 0 {
            self.replicated(on, &id).await?;
        }
        event(
            "deferred",
            &JobInfo::new(id.clone(), key.as_str(), 0).named(name),
        );
        Ok(id)
    }

    /// Waits until [`replicas`](Self::replicas) replicas have job `id`, just queued over `on`
    /// (the `WAIT` counts the writes of its connection); withdraws the job when they do not.
    async fn replicated(&self, mut on: Conn, id: &str) -> Result<(), LockError> {
        let want = self.inner.replicas;
        let wait = self.inner.command_timeout * 3 / 4;
        let tag = format!("jobs:{}", self.inner.name);
        let conn = on.clone();
        let waited = conn::wait_replicas(&mut on, &tag, want, wait);
        let short = match self.deadline_on(&conn, "wait for replicas", waited).await {
            Ok(acked) if acked >= i64::from(want) => return Ok(()),
            Ok(acked) => format!("{acked} of {want} replicas confirmed it in time"),
            Err(e) => format!("its replicas did not answer ({e})"),
        };
        let mut inv = ScriptCall::new(&self.inner.withdraw, 3);
        inv.key(self.key("due"))
            .key(self.key("jobs"))
            .key(self.key("attempts"))
            .arg(id);
        let outcome = match self
            .deadline("withdraw", inv.invoke(&mut self.inner.conn.clone()))
            .await
        {
            Ok(1) => "not queued (withdrawn)".to_owned(),
            Ok(_) => "a worker claimed it already: it may run, or be lost in a failover".to_owned(),
            Err(e) => format!("its withdrawal failed ({e}): it may be queued"),
        };
        tracing::warn!(
            target: "dlock::defer",
            event = "unreplicated",
            queue = "redis",
            name = %self.inner.name,
            job_id = id,
            replicas = want,
            %outcome,
        );
        Err(LockError::unavailable(
            format!("job queue enqueue: {short}; {outcome}"),
            None,
        ))
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
        match locker
            .lock(key.clone())
            .ttl(ttl)
            .name(J::NAME)
            .try_acquire()
            .await?
        {
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
                // One transaction (the keys share a hash tag): read apart, a job moved from
                // `inflight` back to `due` between the reads was in neither, `Unknown` (404).
                redis::pipe()
                    .atomic()
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
                // One transaction: read apart, a job moving between the sets in between was
                // counted twice or not at all.
                redis::pipe()
                    .atomic()
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

    /// The dead-letter set, oldest first, each with the reason it was dead-lettered. All of
    /// it: see [`dead_letters_first`](Self::dead_letters_first) for a bounded read.
    pub async fn dead_letters(&self) -> Result<Vec<JobInfo>, LockError> {
        Ok(self.dead_letters_first(usize::MAX).await?.jobs)
    }

    /// The first `limit` dead letters (oldest first), and how many there are in all: what a
    /// page or a command shows of a dead-letter set that may hold millions.
    pub async fn dead_letters_first(&self, limit: usize) -> Result<JobsPage<JobInfo>, LockError> {
        let (ids, total) = self.first_ids("dead", limit).await?;
        Ok(JobsPage {
            jobs: self.describe(ids).await?,
            total,
        })
    }

    /// The jobs queued (waiting for their due time) or running (claimed by a worker), due
    /// order first, then claim order: what an operator lists (`dlock jobs list`). All of
    /// them: see [`pending_first`](Self::pending_first) for a bounded read.
    pub async fn pending(&self) -> Result<Vec<(JobInfo, JobStatus)>, LockError> {
        Ok(self.pending_first(usize::MAX).await?.jobs)
    }

    /// The first `limit` jobs of [`pending`](Self::pending), and how many are queued or
    /// running in all.
    pub async fn pending_first(
        &self,
        limit: usize,
    ) -> Result<JobsPage<(JobInfo, JobStatus)>, LockError> {
        // Both sets in one transaction (a job moving from one to the other is listed once).
        let last = last_index(limit);
        let mut conn = self.inner.conn.clone();
        let (mut due, due_total, running, running_total): (Vec<String>, usize, Vec<String>, usize) =
            self.deadline(
                "list",
                redis::pipe()
                    .atomic()
                    .zrange(self.key("due"), 0, last)
                    .zcard(self.key("due"))
                    .zrange(self.key("inflight"), 0, last)
                    .zcard(self.key("inflight"))
                    .query_async(&mut conn),
            )
            .await?;
        due.truncate(limit);
        let running: Vec<String> = running.into_iter().take(limit - due.len()).collect();
        let mut jobs = Vec::with_capacity(due.len() + running.len());
        for (ids, status) in [(due, JobStatus::Queued), (running, JobStatus::Running)] {
            for info in self.describe(ids).await? {
                jobs.push((info, status.clone()));
            }
        }
        Ok(JobsPage {
            jobs,
            total: due_total + running_total,
        })
    }

    /// Deletes dead letters for good: the one with `id`, or all of them (`None`). Answers how
    /// many were deleted. A job that is not a dead letter (queued, running, or requeued since it
    /// was listed) is left as it is.
    pub async fn purge_dead(&self, id: Option<&str>) -> Result<usize, LockError> {
        let ids = match id {
            Some(id) => vec![id.to_owned()],
            None => self.ids("dead").await?,
        };
        let mut purged = 0;
        let mut conn = self.inner.conn.clone();
        for id in ids {
            let mut inv = ScriptCall::new(&self.inner.purge, 5);
            inv.key(self.key("dead"))
                .key(self.key("jobs"))
                .key(self.key("attempts"))
                .key(self.key("reasons"))
                .key(self.key("unknown"))
                .arg(&id);
            let n: i64 = self.deadline("purge", inv.invoke(&mut conn)).await?;
            if n == 1 {
                event("purged", &JobInfo::new(id, "", 0));
                purged += 1;
            }
        }
        Ok(purged)
    }

    /// The ids in the sorted set `set`, lowest score first.
    async fn ids(&self, set: &str) -> Result<Vec<String>, LockError> {
        Ok(self.first_ids(set, usize::MAX).await?.0)
    }

    /// The first `limit` ids in the sorted set `set` (lowest score first), and how many it
    /// holds (one transaction).
    async fn first_ids(&self, set: &str, limit: usize) -> Result<(Vec<String>, usize), LockError> {
        let mut conn = self.inner.conn.clone();
        let (mut ids, total): (Vec<String>, usize) = self
            .deadline(
                "list",
                redis::pipe()
                    .atomic()
                    .zrange(self.key(set), 0, last_index(limit))
                    .zcard(self.key(set))
                    .query_async(&mut conn),
            )
            .await?;
        ids.truncate(limit);
        Ok((ids, total))
    }

    /// Each job's key, attempts and dead-letter reason (if any): up to [`DESCRIBE_BATCH`] jobs
    /// a round trip (each within its own deadline), reading only the start of each stored job
    /// ([`DESCRIBE_HEAD`], within [`DESCRIBE_COPY_BUDGET`] a call).
    async fn describe(&self, ids: Vec<String>) -> Result<Vec<JobInfo>, LockError> {
        let mut conn = self.inner.conn.clone();
        let mut out = Vec::with_capacity(ids.len());
        let mut rest = &ids[..];
        while !rest.is_empty() {
            let batch = &rest[..rest.len().min(DESCRIBE_BATCH)];
            let mut inv = ScriptCall::new(&self.inner.describe, 3);
            inv.key(self.key("jobs"))
                .key(self.key("attempts"))
                .key(self.key("reasons"))
                .arg(DESCRIBE_HEAD)
                .arg(DESCRIBE_COPY_BUDGET);
            for id in batch {
                inv.arg(id);
            }
            // As bytes: a stored job that is not UTF-8 failed the whole listing.
            let flat: Vec<Option<Vec<u8>>> = self
                .deadline("describe jobs", inv.invoke(&mut conn))
                .await?;
            let rows = flat.chunks_exact(3);
            let described = rows.len().min(batch.len());
            if described == 0 {
                return Err(LockError::unavailable(
                    "job queue describe jobs: an empty answer",
                    None,
                ));
            }
            for (id, row) in batch.iter().zip(rows) {
                let attempts = row[1]
                    .as_deref()
                    .and_then(|a| std::str::from_utf8(a).ok()?.parse().ok());
                let mut info =
                    JobInfo::new(id.clone(), key_of(row[0].as_deref()), attempts.unwrap_or(0));
                info.reason = row[2]
                    .as_deref()
                    .map(|r| String::from_utf8_lossy(r).into_owned());
                out.push(info);
            }
            rest = &rest[described..];
        }
        Ok(out)
    }

    /// Puts a dead-lettered job back with a fresh attempt budget, due now. `false` if it is not
    /// in the dead-letter set. An operator's requeue is let in over `max_queued`.
    pub async fn requeue(&self, id: &str) -> Result<bool, LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = ScriptCall::new(&self.inner.requeue, 5);
        inv.key(self.key("dead"))
            .key(self.key("due"))
            .key(self.key("attempts"))
            .key(self.key("reasons"))
            .key(self.key("unknown"))
            .arg(id);
        let n: i64 = self.deadline("requeue", inv.invoke(&mut conn)).await?;
        if n == 1 {
            event("requeued", &JobInfo::new(id, "", 0));
        }
        Ok(n == 1)
    }

    /// Claims up to `batch` due jobs. A claim the queue does not answer (a timeout, a dropped
    /// connection) may have claimed jobs: it is sent again with the same token (three tries
    /// in all), and answered with the jobs it claimed — not left claimed by nobody until their
    /// claims expire, each having used an attempt without running.
    pub(super) async fn claim(&self, batch: usize) -> Result<Vec<Claimed>, LockError> {
        let mut inv = ScriptCall::new(&self.inner.claim, 9);
        let limits = &self.inner.limits;
        // Unique per claim call (128 random bits); the script appends the job's position.
        let token = crate::util::secure_token::<16>();
        inv.key(self.key("due"))
            .key(self.key("inflight"))
            .key(self.key("attempts"))
            .key(self.key("jobs"))
            .key(self.key("claims"))
            .key(self.key("dead"))
            .key(self.key("reasons"))
            .key(self.key("unknown"))
            .key(self.key(&format!("batch:{token}")))
            .arg(millis(self.inner.visibility))
            .arg(batch)
            .arg(&token)
            .arg(millis(limits.dead_letter_retention))
            .arg(limits.max_dead_letters);
        let sent = tokio::time::Instant::now();
        // Read as bytes: one stored envelope that is not UTF-8 failed the whole reply, every
        // time it was resent — the batch claimed, none of it run, until the claims expired.
        let flat: Vec<Vec<u8>> = self
            .invoke_resending(&self.inner.conn, "claim", &inv)
            .await?;
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        Ok(flat
            .chunks_exact(4)
            .map(|c| Claimed {
                id: text(&c[0]),
                payload: String::from_utf8(c[1].clone()),
                attempt: text(&c[2]).parse().unwrap_or(1),
                token: text(&c[3]),
                sent,
            })
            .collect())
    }

    /// Pushes the claim's deadline forward; `false` when the claim is no longer this one.
    pub(super) async fn heartbeat(&self, claim: &Claimed) -> Result<bool, LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = ScriptCall::new(&self.inner.heartbeat, 3);
        inv.key(self.key("inflight"))
            .key(self.key("claims"))
            .key(self.key("unknown"))
            .arg(millis(self.inner.visibility))
            .arg(&claim.id)
            .arg(&claim.token);
        let n: i64 = self.deadline("heartbeat", inv.invoke(&mut conn)).await?;
        Ok(n == 1)
    }

    /// Puts a claimed job back after `delay`, or dead-letters it (with `reason`) when it used
    /// up `max_attempts` (or, for an unknown type, its grace period).
    pub(super) async fn retry(
        &self,
        claim: &Claimed,
        delay: Duration,
        max_attempts: u32,
        reason: &str,
        counted: Counted,
    ) -> Result<Retried, LockError> {
        let (how, grace) = match counted {
            Counted::Attempt => (0, Duration::ZERO),
            Counted::Untried => (1, Duration::ZERO),
            Counted::UnknownType(grace) => (2, grace),
        };
        let mut conn = self.inner.conn.clone();
        let mut inv = ScriptCall::new(&self.inner.retry, 7);
        inv.key(self.key("inflight"))
            .key(self.key("due"))
            .key(self.key("dead"))
            .key(self.key("attempts"))
            .key(self.key("claims"))
            .key(self.key("reasons"))
            .key(self.key("unknown"))
            .arg(&claim.id)
            .arg(&claim.token)
            .arg(millis(delay))
            .arg(max_attempts)
            .arg(&*clipped(reason))
            .arg(how)
            .arg(millis(grace));
        let n: i64 = self.deadline("retry", inv.invoke(&mut conn)).await?;
        Ok(match n {
            1 => Retried::DeadLettered,
            0 => Retried::Requeued,
            2 => Retried::FirstUnknown,
            _ => Retried::Stale,
        })
    }

    /// Completes a claimed job and records its outcome for the retention period; `false` when
    /// the claim is no longer this one (nothing changed).
    pub(super) async fn ack(&self, claim: &Claimed, result: &str) -> Result<bool, LockError> {
        let mut conn = self.inner.conn.clone();
        let mut inv = ScriptCall::new(&self.inner.ack, 6);
        inv.key(self.key("inflight"))
            .key(self.key("jobs"))
            .key(self.key("attempts"))
            .key(self.key(&format!("status:{}", claim.id)))
            .key(self.key("claims"))
            .key(self.key("unknown"))
            .arg(&claim.id)
            .arg(&*clipped(result))
            .arg(millis(self.inner.retention).max(1))
            .arg(&claim.token);
        let n: i64 = self.deadline("ack", inv.invoke(&mut conn)).await?;
        Ok(n == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::{clipped, key_of, MAX_NOTE_BYTES};

    /// A listing's key of a stored job: from the start of a copy the envelope begins with its
    /// key (cut anywhere after the key, escapes and all), from a whole copy of an earlier
    /// release's layout (the key after the data), and empty for what it cannot tell.
    #[test]
    fn a_stored_jobs_key_is_read_from_the_start_of_its_copy() {
        let whole = br#"{"key":"a:\"b\"","type":"t","data":{"x":"key"},"max_attempts":1,"delay_ms":0,"max_delay_ms":0,"ttl_ms":1}"#;
        assert_eq!(key_of(Some(whole)), r#"a:"b""#);
        assert_eq!(key_of(Some(&whole[..20])), r#"a:"b""#);
        let earlier = br#"{"type":"t","data":{"key":"no"},"key":"k:1","max_attempts":1,"delay_ms":0,"max_delay_ms":0,"ttl_ms":1}"#;
        assert_eq!(key_of(Some(earlier)), "k:1");
        assert_eq!(key_of(Some(&earlier[..40])), "");
        assert_eq!(key_of(Some(&whole[..12])), "", "the key itself cut off");
        assert_eq!(key_of(Some(b"\xff\xfe")), "");
        assert_eq!(key_of(None), "");
    }

    #[test]
    fn a_long_note_is_cut_at_a_character_boundary_and_says_so() {
        let short = "x".repeat(MAX_NOTE_BYTES);
        assert_eq!(clipped(&short), short.as_str());
        for pad in 0..4 {
            // `é` is two bytes: some cuts fall inside one.
            let long = format!("{}{}", "x".repeat(pad), "é".repeat(MAX_NOTE_BYTES));
            let cut = clipped(&long);
            assert!(cut.len() <= MAX_NOTE_BYTES, "{pad}: {}", cut.len());
            assert!(cut.len() >= MAX_NOTE_BYTES - 4, "{pad}: {}", cut.len());
            assert!(cut.ends_with('…') && long.starts_with(cut.trim_end_matches('…')));
        }
    }
}
