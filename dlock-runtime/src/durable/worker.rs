//! [`DurableWorker`]: claims, runs and settles jobs.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt as _;

use super::queue::{Claimed, Counted, Retried};
use super::{
    event, DurableQueue, Envelope, Job, JobContext, JobError, JobStatus, PermanentFailure,
};
use crate::backend::BoxFuture;
use crate::defer::JobInfo;
use crate::util::{panic_message, FailureStreak};
use crate::{DeferPolicy, LockError, LockKey, Locker};

/// How often a run of failed claims is logged again while it lasts.
const CLAIM_FAILURE_REPORT_EVERY: Duration = Duration::from_secs(60);

/// The least time a job of a type the worker does not know is put back for: instances that do
/// not know it (an older release, during a rolling deploy) would otherwise claim it and put it
/// back at the pace of its policy — every few milliseconds — for the whole deploy.
const UNKNOWN_TYPE_MIN_DELAY: Duration = Duration::from_secs(1);

/// The shortest [`DurableWorker::poll_interval`].
const MIN_POLL: Duration = Duration::from_millis(10);

/// A decoded job, waiting for its context (with the fencing token of its lock) to run.
type Prepared = Box<dyn FnOnce(JobContext) -> BoxFuture<'static, Result<(), JobError>> + Send>;

/// Decodes a job's data as its type (the type's own `Deserialize`).
type Runner = Arc<dyn Fn(serde_json::Value) -> Result<Prepared, JobError> + Send + Sync>;

/// Runs the jobs of a [`DurableQueue`]: claims due jobs, takes each job's lock (one attempt),
/// runs it with a heartbeat on its claim, and acknowledges it — or puts it back with backoff.
/// Run one on every instance of the service.
///
/// ```no_run
/// # use dlock_runtime::durable::{DurableQueue, DurableWorker, Job, JobContext, JobError};
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
    unknown_type_grace: Duration,
    job_timeout: Option<Duration>,
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
    /// A worker for `queue` taking locks with `locker`. Defaults: batch 16, idle poll 100 ms,
    /// [unknown-type grace](DurableWorker::unknown_type_grace) 1 h.
    pub fn new(queue: DurableQueue, locker: Locker) -> Self {
        DurableWorker {
            queue,
            locker,
            runners: HashMap::new(),
            state: None,
            batch: 16,
            poll: Duration::from_millis(100),
            unknown_type_grace: Duration::from_secs(3600),
            job_timeout: None,
        }
    }

    /// Teaches the worker job type `J`.
    pub fn register<J: Job>(mut self) -> Self {
        let runner: Runner = Arc::new(|data| {
            let job: J = serde_json::from_value(data).map_err(|e| super::decode_error(&e))?;
            Ok(Box::new(
                move |ctx| -> BoxFuture<'static, Result<(), JobError>> { Box::pin(job.run(ctx)) },
            ))
        });
        self.runners.insert(J::NAME, runner);
        self
    }

    /// Shared state handed to every job ([`JobContext::state`]).
    pub fn state<S: Clone + Send + Sync + 'static>(mut self, state: S) -> Self {
        self.state = Some(Arc::new(state));
        self
    }

    /// How many jobs one claim takes and the worker runs at once (default 16).
    /// [`run_until`](DurableWorker::run_until) claims again as soon as one of them ends, so a
    /// job that runs long holds one of these slots, not the worker.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
    }

    /// How long to wait when no job is due; at least 10 ms (a zero interval claimed from an
    /// empty queue in a busy loop, one script run per answer).
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll = d.max(MIN_POLL);
        self
    }

    /// The longest a job may run (default: no limit). A job still running then is stopped —
    /// its future dropped at its next await, its lock released — and counts as a failed
    /// attempt ("it ran longer than …"), put back with backoff or dead-lettered after its last.
    /// Without a limit, a job that never ends (an upstream call without a timeout) keeps its
    /// claim and its lock alive for good, holds one of the worker's slots, and keeps
    /// [`run_until`](DurableWorker::run_until) from returning at shutdown. A job must not block
    /// its thread (use `tokio::task::spawn_blocking`): the worker's jobs share one task, and a
    /// blocked one stops the heartbeats of the others.
    pub fn job_timeout(mut self, limit: Duration) -> Self {
        self.job_timeout = Some(limit);
        self
    }

    /// How long a job whose type this worker does not [`register`](DurableWorker::register),
    /// or whose data its version of the type cannot decode, may wait for a worker that can run
    /// it (default 1 h).
    ///
    /// During a rolling deploy, an instance of the new release queues a job of a new type (or
    /// of a type whose data changed shape: a new enum variant, a renamed field) and one of the
    /// old release claims it. Such a claim is not an attempt: the job is put back
    /// (after its policy's backoff, at least 1 s), its attempts untouched, for a worker that
    /// knows the type. The first claim that did not know it notes the time in the queue (and
    /// logs a warning); a claim that does not know it once `grace` has passed since
    /// dead-letters the job, with a reason naming the type (and the decode error, without the
    /// values it quoted) — so a type no worker will ever know (a typo, a job type removed
    /// while jobs of it were queued) or data none can decode ends in the dead-letter set, not
    /// in an endless loop, and [`DurableQueue::requeue`] brings it back. A worker that runs
    /// the job clears the note.
    pub fn unknown_type_grace(mut self, grace: Duration) -> Self {
        self.unknown_type_grace = grace;
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

    /// Runs jobs until `shutdown` resolves: up to [`batch`](DurableWorker::batch) at once,
    /// claiming again as soon as one ends (or, with none due, every poll interval). Once
    /// `shutdown` resolves nothing more is claimed, and the jobs running are finished first
    /// (bound them with [`job_timeout`](DurableWorker::job_timeout)).
    ///
    /// A claim that fails (the queue's Redis down, or refusing: a wrong password, an ACL) is
    /// tried again every poll interval; the failure is logged when it starts — `WARN`, or
    /// `ERROR` for a refusal retrying cannot fix ([`LockError::Misconfigured`]) — then at most
    /// once a minute while it lasts (with the count of failed claims), and its end at `INFO`.
    pub async fn run_until(&self, shutdown: impl Future<Output = ()>) {
        use futures_util::StreamExt as _;

        tokio::pin!(shutdown);
        let mut failing = FailureStreak::default();
        let queue = self.queue.name();
        let mut running = futures_util::stream::FuturesUnordered::new();
        let mut stopping = false;
        // When to claim next: at once after a claim that found jobs, else a poll later.
        let mut claim_at = tokio::time::Instant::now();
        loop {
            let free = self.batch.saturating_sub(running.len());
            if !stopping && free > 0 && tokio::time::Instant::now() >= claim_at {
                let claim = self.queue.claim(free);
                tokio::pin!(claim);
                // The jobs running go on (their heartbeats) while the claim is on its way.
                let claimed = loop {
                    tokio::select! {
                        biased;
                        claimed = &mut claim => break claimed,
                        Some(()) = running.next(), if !running.is_empty() => {}
                    }
                };
                let idle = self.claimed(claimed, &mut failing, queue, |c| {
                    running.push(self.process(c));
                });
                let now = tokio::time::Instant::now();
                claim_at = match idle {
                    true => now
                        .checked_add(self.poll)
                        .unwrap_or_else(|| now + crate::util::CENTURY),
                    false => now,
                };
                if futures_util::FutureExt::now_or_never(&mut shutdown).is_some() {
                    stopping = true;
                }
                continue;
            }
            if stopping && running.is_empty() {
                return;
            }
            let slot_free = !stopping && running.len() < self.batch;
            tokio::select! {
                biased;
                _ = &mut shutdown, if !stopping => stopping = true,
                Some(()) = running.next(), if !running.is_empty() => {}
                _ = tokio::time::sleep_until(claim_at), if slot_free => {}
            }
        }
    }

    /// Takes the answer to a claim: each job claimed to `run`, the failure logged; `true` when
    /// nothing was claimed (wait a poll interval before the next claim).
    fn claimed(
        &self,
        claimed: Result<Vec<Claimed>, LockError>,
        failing: &mut FailureStreak,
        queue: &str,
        mut run: impl FnMut(Claimed),
    ) -> bool {
        match claimed {
            Ok(claimed) => {
                if let Some(failures) = failing.succeeded() {
                    tracing::info!(queue = %queue, failures, "dlock job worker: claims work again");
                }
                let idle = claimed.is_empty();
                claimed.into_iter().for_each(&mut run);
                idle
            }
            Err(e) => {
                match failing.failed(CLAIM_FAILURE_REPORT_EVERY) {
                    Some(failures) if e.is_misconfigured() => {
                        tracing::error!(error = %e, queue = %queue, failures, "dlock job worker: the queue refuses the claims; retrying until the configuration is fixed")
                    }
                    Some(failures) => {
                        tracing::warn!(error = %e, queue = %queue, failures, "dlock job worker: claim failed")
                    }
                    None => {
                        tracing::debug!(error = %e, queue = %queue, "dlock job worker: claim failed")
                    }
                }
                true
            }
        }
    }

    /// Puts a claimed job back with backoff (or dead-letters it with `reason` when it used up
    /// its attempts) and says which. [`Counted::Untried`]: the job could not be tried (its lock
    /// backend did not answer), so the claim does not count as an attempt — an outage does not
    /// use up its attempts and dead-letter it — and its retries keep the pace of its current
    /// attempt until the backend answers. [`Counted::UnknownType`]: likewise, but at least
    /// [`UNKNOWN_TYPE_MIN_DELAY`] apart, and dead-lettered once the grace period is over.
    async fn put_back(
        &self,
        claim: &Claimed,
        info: &JobInfo,
        policy: &DeferPolicy,
        reason: &str,
        counted: Counted,
    ) {
        // A counted attempt waits the next attempt's step (`DeferPolicy::backoff` of attempt
        // `n` is the wait before it); an uncounted one keeps its own attempt's pace — at least
        // `OUTAGE_PAUSE` apart: the step never grows, and a delay of zero (or near it) claimed
        // the job in a busy loop for as long as its lock backend was down.
        let delay = match counted {
            Counted::Attempt => policy.backoff(claim.attempt.saturating_add(1)),
            Counted::Untried => policy.backoff(claim.attempt).max(crate::util::OUTAGE_PAUSE),
            Counted::UnknownType(_) => policy.backoff(claim.attempt).max(UNKNOWN_TYPE_MIN_DELAY),
        };
        self.finish_failed(claim, info, delay, policy.max_attempts, reason, counted)
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
        self.finish_failed(claim, info, Duration::ZERO, 0, reason, Counted::Attempt)
            .await;
    }

    /// Runs `step` — an owner-checked step on the job's claim (ack, retry, dead-letter) — until
    /// the queue answers it, for up to the visibility timeout from now (the claim, last
    /// refreshed by a heartbeat before now, expires no later). One failed command (a timeout,
    /// a dropped connection) would otherwise leave the claim to expire: a finished job would
    /// run again, or on its last attempt be dead-lettered as a crash. Each step checks the
    /// claim's token, so one that took effect but whose answer was lost is answered "not this
    /// claim's" the next time, and changes nothing. Answers whether `step` was sent more than
    /// once (such a "not this claim's" answer is then not known to be a takeover).
    async fn settle<T, F: Future<Output = Result<T, LockError>>>(
        &self,
        what: &str,
        claim: &Claimed,
        mut step: impl FnMut() -> F,
    ) -> Result<(T, bool), LockError> {
        let give_up = tokio::time::Instant::now() + self.queue.inner.visibility;
        let mut pause = Duration::from_millis(20);
        let mut repeated = false;
        loop {
            match step().await {
                Ok(v) => return Ok((v, repeated)),
                Err(e) if tokio::time::Instant::now() + pause < give_up => {
                    tracing::debug!(error = %e, job_id = %claim.id, what, "dlock job worker: settling the claim failed; trying again");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                    repeated = true;
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn finish_failed(
        &self,
        claim: &Claimed,
        info: &JobInfo,
        delay: Duration,
        max_attempts: u32,
        reason: &str,
        counted: Counted,
    ) {
        match self
            .settle("retry", claim, || {
                self.queue
                    .retry(claim, delay, max_attempts, reason, counted)
            })
            .await
        {
            Ok((Retried::DeadLettered, _)) => event("dead_lettered", info),
            Ok((Retried::Requeued, _)) => event("retried", info),
            Ok((Retried::FirstUnknown, _)) => {
                tracing::warn!(
                    job_type = %info.name,
                    job_id = %claim.id,
                    grace = ?self.unknown_type_grace,
                    reason,
                    "dlock job worker: this worker cannot run the job (its type, or the shape of its data, is unknown here); putting it back for a worker that can (dead-lettered if none claims it within the grace period)"
                );
                event("retried", info);
            }
            Ok((Retried::Stale, false)) => tracing::warn!(
                job_id = %claim.id,
                "dlock job worker: the job's claim was taken over; leaving it to its new worker"
            ),
            Ok((Retried::Stale, true)) => tracing::warn!(
                job_id = %claim.id,
                "dlock job worker: putting the job back failed, then found its claim gone: the first try landed, or the claim was taken over"
            ),
            Err(e) => {
                tracing::warn!(error = %e, job_id = %claim.id, "dlock job worker: retry failed; the claim will expire")
            }
        }
    }

    async fn process(&self, claim: Claimed) {
        let info = |key: &str| JobInfo::new(claim.id.clone(), key, claim.attempt);
        let decoded = match &claim.payload {
            Ok(payload) => serde_json::from_str(payload).map_err(|e| super::decode_error(&e)),
            Err(e) => Err(format!(
                "it is not UTF-8 (byte {} of {})",
                e.utf8_error().valid_up_to(),
                e.as_bytes().len()
            )),
        };
        let env: Envelope = match decoded {
            Ok(e) => e,
            Err(why) => {
                let reason = format!("the stored job does not decode: {why}");
                self.dead_letter(&claim, &info(""), &reason).await;
                return;
            }
        };
        let policy = env.policy();
        let Some((&name, runner)) = self.runners.get_key_value(env.kind.as_str()) else {
            // Another instance may know this type (a newer release, mid-deploy): put it back
            // for them, without using up an attempt, for up to the grace period.
            tracing::debug!(job_type = %env.kind, job_id = %claim.id, "dlock job worker: unregistered job type");
            let reason = format!(
                "no worker that claimed it knew the job type `{}` within {:?}",
                env.kind, self.unknown_type_grace
            );
            // Its metric's `name` is fixed: the type comes from stored data, and a label per
            // unknown type would grow without bound (the type is in the reason and the log).
            let info = info(&env.key).named(crate::metrics::UNREGISTERED_JOB);
            let counted = Counted::UnknownType(self.unknown_type_grace);
            self.put_back(&claim, &info, &policy, &reason, counted)
                .await;
            return;
        };
        let runner = runner.clone();
        let info = |key: &str| info(key).named(name);
        // The stored key is already encoded: take it as is.
        let key = match LockKey::from_encoded(&env.key) {
            Ok(k) => k,
            Err(e) => {
                let reason = format!("the stored lock key is invalid: {e}");
                self.dead_letter(&claim, &info(&env.key), &reason).await;
                return;
            }
        };
        // Decoded before the lock is taken: data this worker's version of the type cannot read
        // may be a newer version's (a rolling deploy), put back for a worker that can, as a
        // job of an unknown type is — without taking its lock. Decoding runs the type's own
        // `Deserialize`: it may panic too.
        let prepared =
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| runner(env.data))) {
                Ok(Ok(prepared)) => prepared,
                Ok(Err(e)) => {
                    let reason = format!(
                    "no worker that claimed it could decode its data as `{name}` within {:?}: {e}",
                    self.unknown_type_grace
                );
                    let counted = Counted::UnknownType(self.unknown_type_grace);
                    self.put_back(&claim, &info(&env.key), &policy, &reason, counted)
                        .await;
                    return;
                }
                Err(panic) => {
                    let reason = format!("decoding the job panicked: {}", panic_message(&*panic));
                    self.put_back(&claim, &info(&env.key), &policy, &reason, Counted::Attempt)
                        .await;
                    return;
                }
            };
        let ttl = Duration::from_millis(env.ttl_ms);
        let guard = match self
            .locker
            .lock(key)
            .ttl(ttl)
            .name(name)
            .try_acquire()
            .await
        {
            Ok(Some(g)) => g,
            Ok(None) => {
                let reason = format!("its lock was still busy after {} attempts", claim.attempt);
                self.put_back(&claim, &info(&env.key), &policy, &reason, Counted::Attempt)
                    .await;
                return;
            }
            Err(e) => {
                let (counted, reason) = if e.uses_a_job_attempt() {
                    (
                        Counted::Attempt,
                        format!("its lock could not be taken: {e}"),
                    )
                } else {
                    (
                        Counted::Untried,
                        format!("its lock backend did not answer: {e}"),
                    )
                };
                self.put_back(&claim, &info(&env.key), &policy, &reason, counted)
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
        // Making the job's future runs the type's `run` up to its first await: it may panic.
        let run = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| prepared(ctx))) {
            Ok(fut) => fut,
            Err(panic) => {
                let _ = guard.release().await;
                let reason = format!("starting the job panicked: {}", panic_message(&*panic));
                self.put_back(&claim, &info(&env.key), &policy, &reason, Counted::Attempt)
                    .await;
                return;
            }
        };
        // Keep the claim alive while the job runs; stop the job once the claim is taken over,
        // or may be: its deadline on the server is at least the visibility timeout from when
        // the claim, or the latest heartbeat answered, was sent. A worker cut off from the
        // queue (every heartbeat failing, none refused) stops there too: another worker's
        // claim may take the job over from then on, and its run must not overlap this one.
        let visibility = self.queue.inner.visibility;
        let beat = visibility / 3;
        let mut claimed_until = claim.sent + visibility;
        let mut next_beat = claim.sent + beat;
        let beat_once = || async {
            let sent = tokio::time::Instant::now();
            (sent, self.queue.heartbeat(&claim).await)
        };
        let mut heartbeat = std::pin::pin!(futures_util::future::OptionFuture::from(None));
        let mut beating = false;
        let limit = self.job_timeout;
        let overdue = async move {
            match limit {
                Some(limit) => tokio::time::sleep(limit).await,
                None => std::future::pending().await,
            }
        };
        // The job's lock lost (its lease ran out by the lease clock — the worker stalled, the
        // machine slept —, or a renewal found it taken): the job stops. Its claim's clock does
        // not count a suspended machine's sleep (tokio's `Instant`), and another worker may
        // hold the lock and run the job by now; a run that went on beside it was the very
        // overlap the lock is for.
        let lost = guard.lost();
        let outcome = {
            let work = std::panic::AssertUnwindSafe(crate::with_lock(&guard, run)).catch_unwind();
            tokio::pin!(work);
            tokio::pin!(overdue);
            tokio::pin!(lost);
            loop {
                tokio::select! {
                    out = &mut work => break Some(out),
                    () = &mut overdue => {
                        let limit = limit.unwrap_or_default();
                        let stopped: JobError = format!("it ran longer than its {limit:?} limit").into();
                        break Some(Ok(Err(stopped)));
                    }
                    () = &mut lost => {
                        tracing::warn!(
                            job_id = %claim.id,
                            "dlock job worker: the job's lock was lost while it ran; this run stops"
                        );
                        let stopped: JobError = "its lock was lost while it ran".into();
                        break Some(Ok(Err(stopped)));
                    }
                    () = tokio::time::sleep_until(claimed_until) => {
                        tracing::warn!(
                            job_id = %claim.id,
                            "dlock job worker: no heartbeat was answered within the visibility timeout; the job may be another worker's now, so this run stops"
                        );
                        break None;
                    }
                    () = tokio::time::sleep_until(next_beat), if !beating => {
                        heartbeat.set(Some(beat_once()).into());
                        beating = true;
                    }
                    Some((sent, answer)) = &mut heartbeat, if beating => {
                        beating = false;
                        next_beat = tokio::time::Instant::now() + beat;
                        match answer {
                            Ok(true) => claimed_until = claimed_until.max(sent + visibility),
                            Ok(false) => break None,
                            Err(e) => tracing::warn!(error = %e, job_id = %claim.id, "dlock job worker: heartbeat failed"),
                        }
                    }
                }
            }
        };
        let _ = guard.release().await;
        let Some(outcome) = outcome else {
            // This worker stalled past the visibility timeout (or was cut off from the queue
            // for that long), and another took the job over or may.
            event("abandoned", &info(&env.key));
            return;
        };
        match outcome {
            Ok(Ok(())) => {
                let recorded = result
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take()
                    .unwrap_or_default();
                match self
                    .settle("ack", &claim, || self.queue.ack(&claim, &recorded))
                    .await
                {
                    Ok((true, _)) => event("completed", &info(&env.key)),
                    Ok((false, false)) => tracing::warn!(
                        job_id = %claim.id,
                        "dlock job worker: the job ran, but its claim had been taken over; not acknowledged"
                    ),
                    // The ack's first try may have landed with its answer lost — or the
                    // claim expired meanwhile: the job's status tells.
                    Ok((false, true)) => match self.queue.status(&claim.id).await {
                        Ok(JobStatus::Completed { .. }) => event("completed", &info(&env.key)),
                        _ => tracing::warn!(
                            job_id = %claim.id,
                            "dlock job worker: the job ran, but acknowledging it was not answered and its claim is gone; it may run again"
                        ),
                    },
                    Err(e) => {
                        tracing::warn!(error = %e, job_id = %claim.id, "dlock job worker: ack failed until the claim's visibility timeout; the job may run again")
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
                self.put_back(&claim, &info(&env.key), &policy, &reason, Counted::Attempt)
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
                self.put_back(&claim, &info(&env.key), &policy, &reason, Counted::Attempt)
                    .await;
            }
        }
    }
}
