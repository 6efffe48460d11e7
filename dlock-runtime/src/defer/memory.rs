//! The in-process delay queue.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::time::DelayQueue;

use super::{DeferPolicy, JobInfo, QueueLimits};
use crate::backend::BoxFuture;
use crate::key::KeyLog;
use crate::util::panic_message;
use crate::LockError;

/// One piece of deferred work, as the queue sees it: an attempt at the work's lock that runs
/// the work when the lock is free. The queue knows nothing of lockers; the caller that defers
/// the work says how to attempt it.
pub(crate) trait DeferredWork: Send + 'static {
    /// One attempt: `Ok(())` when the work ran, `Err((self, why))` when it did not (its lock
    /// was still busy, or the backend failed), to be tried again later.
    fn attempt(self: Box<Self>) -> BoxFuture<'static, Attempted>;

    /// The work is a dead letter now: it lets go of what would keep its locker alive. Only a
    /// handle of that locker can requeue it ([`DeferQueue::requeue`]), and held, a dead letter
    /// kept a dropped locker — its backend connections, watchdog and this queue's task — alive
    /// for the dead letter's whole retention.
    fn dead(&mut self) {}

    /// The dead letter is requeued: takes hold of its locker again. `false` when it is gone.
    fn revive(&mut self) -> bool {
        true
    }
}

/// How an attempt went: `Err` gives the work back, with why it did not run.
pub(crate) type Attempted = Result<(), (Box<dyn DeferredWork>, NotRun)>;

/// Why an attempt did not run its work.
pub(crate) enum NotRun {
    /// The lock was held by someone else.
    Busy,
    /// Taking the lock failed: an outage (a 503 error, [`LockError::Unavailable`]), which does
    /// not use up an attempt, or anything else ([`LockError::Misconfigured`], …), which does.
    Failed(LockError),
}

/// One deferred piece of work with its bookkeeping.
struct PendingJob {
    info: JobInfo,
    policy: DeferPolicy,
    work: Box<dyn DeferredWork>,
}

enum Cmd {
    Push(PendingJob, Duration),
    Shutdown(Duration, oneshot::Sender<ShutdownReport>),
}

enum Outcome {
    Done(JobInfo),
    NotRun(PendingJob, NotRun),
}

/// What [`DeferQueue::shutdown`] did. Every job the queue held — including one deferred while
/// the shutdown began — is in exactly one of the three.
#[derive(Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Jobs that ran during the drain.
    pub completed: usize,
    /// Jobs that could not run before the drain deadline (their lock stayed busy or its
    /// backend did not answer, or their attempt was still in flight and was cancelled) or sat
    /// in the dead-letter set: they were dropped, and are listed here.
    pub dropped: Vec<JobInfo>,
    /// Jobs whose work panicked during the drain, with the panic in
    /// [`reason`](JobInfo::reason).
    pub failed: Vec<JobInfo>,
}

#[derive(Default)]
struct Shared {
    pending: HashMap<String, JobInfo>,
    /// Dead letters, oldest first, with the time each was dead-lettered.
    dead: VecDeque<(PendingJob, Instant)>,
    closed: bool,
    limits: QueueLimits,
    /// How keys appear in events (the locker's setting).
    key_log: KeyLog,
}

impl Shared {
    /// Deletes dead letters past their retention or beyond the count bound (oldest first).
    /// Returns when the next one expires.
    fn prune_dead(&mut self, now: Instant) -> Option<Instant> {
        let retention = self.limits.dead_letter_retention;
        while let Some((job, at)) = self.dead.front() {
            let expired = now.saturating_duration_since(*at) >= retention;
            if !expired && self.dead.len() <= self.limits.max_dead_letters {
                break;
            }
            event(self.key_log, "dropped", &job.info);
            self.dead.pop_front();
        }
        // (A retention past what the clock can count: kept until the count bound.)
        self.dead
            .front()
            .and_then(|(_, at)| at.checked_add(retention))
    }

    fn push_dead(&mut self, mut job: PendingJob, reason: String) {
        job.info.reason = Some(reason);
        job.work.dead();
        event(self.key_log, "dead_lettered", &job.info);
        self.pending.remove(&job.info.id);
        self.dead.push_back((job, Instant::now()));
        self.prune_dead(Instant::now());
    }
}

/// The in-process delay queue of a [`Locker`](crate::Locker) (see the [module docs](super)).
/// Cheap to clone. Get it with [`Locker::defer_queue`](crate::Locker::defer_queue); jobs go in through
/// [`LockRequest::run`](crate::LockRequest::run) with [`OnFail::Defer`](crate::OnFail::Defer)
/// or `#[distributed_lock(on_fail = "defer")]`.
///
/// Jobs live in memory only: a crash or restart loses them. Use the durable queue when that
/// matters. The queue's task starts on the runtime of the first deferral and moves to dlock's
/// fallback thread, jobs and all, if that runtime shuts down first — and stays there: from
/// then on the deferred work runs on that one thread, which also renews the locks of every
/// watchdog that moved there, so heavy or blocking deferred work can delay renewals. Defer
/// from a runtime that outlives the locker (not a per-worker runtime that restarts, as
/// actix-web's may). The queue is bounded by its [`QueueLimits`] (set with
/// [`LockerBuilder::defer_limits`](crate::LockerBuilder::defer_limits)): a full queue refuses
/// new work with [`LockError::QueueFull`], and dead letters are dropped after their retention
/// or beyond their count bound, oldest first.
#[derive(Clone)]
pub struct DeferQueue {
    inner: Arc<Inner>,
}

struct Inner {
    tx: Mutex<Option<mpsc::UnboundedSender<Cmd>>>,
    shared: Arc<Mutex<Shared>>,
}

impl fmt::Debug for DeferQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeferQueue")
            .field("pending", &self.pending().len())
            .field("dead", &self.dead_letters().len())
            .finish()
    }
}

impl Default for DeferQueue {
    fn default() -> Self {
        Self::new()
    }
}

fn event(key_log: KeyLog, event: &'static str, info: &JobInfo) {
    info.event("memory", event, key_log);
}

impl DeferQueue {
    /// An empty queue with the default [`QueueLimits`]; its task starts on the first job.
    pub fn new() -> Self {
        Self::with_limits(QueueLimits::default())
    }

    /// An empty queue with the given bounds.
    pub fn with_limits(limits: QueueLimits) -> Self {
        DeferQueue {
            inner: Arc::new(Inner {
                tx: Mutex::new(None),
                shared: Arc::new(Mutex::new(Shared {
                    limits,
                    ..Shared::default()
                })),
            }),
        }
    }

    /// Shows keys in events as `key_log` does (the owning locker's setting).
    pub(crate) fn key_log(self, key_log: KeyLog) -> Self {
        self.shared().key_log = key_log;
        self
    }

    /// The queue's bounds.
    pub fn limits(&self) -> QueueLimits {
        self.shared().limits.clone()
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.inner
            .shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `work` to run under the lock `key` after the policy's first delay. Returns the
    /// job id.
    pub(crate) fn push(
        &self,
        key: &str,
        name: &'static str,
        policy: DeferPolicy,
        work: Box<dyn DeferredWork>,
    ) -> Result<String, LockError> {
        // The task first: without a runtime nothing is queued (and nothing counted).
        let tx = self.sender()?;
        let info = JobInfo::new(crate::util::secure_token::<16>(), key, 0).named(name);
        {
            // The bound is checked and the job counted under one lock, so concurrent pushes
            // cannot pass it together.
            let mut shared = self.shared();
            if shared.closed {
                return Err(LockError::unavailable(
                    "the in-process defer queue is shut down",
                    None,
                ));
            }
            if shared.pending.len() >= shared.limits.max_queued {
                tracing::warn!(
                    target: "dlock::defer",
                    event = "full",
                    queue = "memory",
                    key = %shared.key_log.show(key),
                    max_queued = shared.limits.max_queued,
                );
                return Err(LockError::queue_full(key, "memory"));
            }
            // Sent under the lock that `shutdown` closes the queue under: a job accepted here
            // reaches the task before the shutdown does, so the drain tries it (it was lost,
            // and missing from the report, when its push lost that race).
            let first = policy.backoff(1);
            let job = PendingJob {
                info: info.clone(),
                policy,
                work,
            };
            if tx.send(Cmd::Push(job, first)).is_err() {
                return Err(LockError::unavailable("the defer queue task is gone", None));
            }
            shared.pending.insert(info.id.clone(), info.clone());
            event(shared.key_log, "deferred", &info);
        }
        Ok(info.id)
    }

    fn sender(&self) -> Result<mpsc::UnboundedSender<Cmd>, LockError> {
        let mut tx = self.inner.tx.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = tx.as_ref().filter(|t| !t.is_closed()) {
            return Ok(t.clone());
        }
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|_| LockError::unavailable("deferring work needs a tokio runtime", None))?;
        if tx.is_some() {
            // The task is gone with the runtime it ran on (shut down while this locker lived
            // on) and could not move to the fallback thread (see `Task`), and the jobs it held
            // with it: reported dropped, and no longer counted.
            let mut shared = self.shared();
            let key_log = shared.key_log;
            for (_, info) in shared.pending.drain() {
                event(key_log, "dropped", &info);
            }
        }
        let (t, rx) = mpsc::unbounded_channel();
        rt.spawn(run(Task::new(rx, self.inner.shared.clone())));
        *tx = Some(t.clone());
        Ok(t)
    }

    /// Jobs waiting for their next attempt.
    pub fn pending(&self) -> Vec<JobInfo> {
        self.shared().pending.values().cloned().collect()
    }

    /// Jobs that used up their attempts, oldest first, within the queue's dead-letter bounds.
    pub fn dead_letters(&self) -> Vec<JobInfo> {
        let mut shared = self.shared();
        shared.prune_dead(Instant::now());
        shared.dead.iter().map(|(j, _)| j.info.clone()).collect()
    }

    /// Moves a dead-lettered job back into the queue with a fresh attempt budget; `false` if
    /// no such dead letter exists (or the queue is shut down). An operator's requeue is let in
    /// over `max_queued`.
    pub fn requeue(&self, job_id: &str) -> bool {
        let Ok(tx) = self.sender() else { return false };
        let mut shared = self.shared();
        if shared.closed {
            return false;
        }
        shared.prune_dead(Instant::now());
        let Some(pos) = shared.dead.iter().position(|(j, _)| j.info.id == job_id) else {
            return false;
        };
        let Some((mut job, at)) = shared.dead.remove(pos) else {
            return false;
        };
        if !job.work.revive() {
            shared.dead.insert(pos, (job, at));
            return false;
        }
        job.info.attempts = 0;
        job.info.reason = None;
        let info = job.info.clone();
        let first = job.policy.backoff(1);
        // Under the lock, as in `push`: ahead of a shutdown that closes the queue.
        if let Err(mpsc::error::SendError(cmd)) = tx.send(Cmd::Push(job, first)) {
            if let Cmd::Push(mut job, _) = cmd {
                job.work.dead();
                shared.dead.insert(pos, (job, at));
            }
            return false;
        }
        event(shared.key_log, "requeued", &info);
        shared.pending.insert(info.id.clone(), info);
        true
    }

    /// Stops accepting jobs and drains: every pending job is tried at once (and retried with a
    /// short step) until it has run or `within` has passed; a lock busy meanwhile uses up none
    /// of a job's attempts. Jobs still pending then, and
    /// dead letters, are dropped and listed in the report ([`ShutdownReport::dropped`]); a job
    /// whose work panicked during the drain is listed in [`ShutdownReport::failed`].
    pub async fn shutdown(&self, within: Duration) -> ShutdownReport {
        self.shared().closed = true;
        let tx = self
            .inner
            .tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let mut report = match tx {
            Some(tx) => {
                let (reply, rx) = oneshot::channel();
                if tx.send(Cmd::Shutdown(within, reply)).is_ok() {
                    rx.await.unwrap_or_default()
                } else {
                    ShutdownReport::default()
                }
            }
            None => ShutdownReport::default(),
        };
        let mut shared = self.shared();
        let key_log = shared.key_log;
        for (job, _) in shared.dead.drain(..) {
            event(key_log, "dropped", &job.info);
            report.dropped.push(job.info);
        }
        shared.pending.clear();
        report
    }
}

async fn attempt(job: PendingJob) -> Outcome {
    let PendingJob { info, policy, work } = job;
    match work.attempt().await {
        Ok(()) => Outcome::Done(info),
        Err((work, why)) => Outcome::NotRun(PendingJob { info, policy, work }, why),
    }
}

/// What a panicked (or aborted) attempt says about itself.
fn failure(e: tokio::task::JoinError) -> String {
    if e.is_panic() {
        format!("the job panicked: {}", panic_message(&*e.into_panic()))
    } else {
        e.to_string()
    }
}

/// The queue task's state. Dropped while the task runs — the runtime running it shut down (an
/// actix-web worker restarting, a runtime built for set-up) while the queue lives on — it moves
/// the queue to the fallback runtime: the command queue, every waiting job with what is left
/// of its delay, and a drain under way. Only attempts in flight when the runtime shut down are
/// lost (their work was cut off with it): they are reported `dropped`. Before, every job went.
struct Task {
    /// `None` once the task returned.
    rx: Option<mpsc::UnboundedReceiver<Cmd>>,
    shared: Arc<Mutex<Shared>>,
    /// Jobs to queue first, with their delays (from the task this one took over from).
    carried: Vec<(PendingJob, Duration)>,
    queue: DelayQueue<PendingJob>,
    running: JoinSet<Outcome>,
    /// Which job each running attempt belongs to: to account for a panicking one, and for one
    /// still in flight when a drain runs out of time.
    running_ids: HashMap<tokio::task::Id, JobInfo>,
    draining: Option<(Instant, oneshot::Sender<ShutdownReport>)>,
    completed: usize,
    /// Jobs that panicked during the drain.
    failed: Vec<JobInfo>,
    /// Attempts of the drain cut off by the runtime it ran on shutting down (reported dropped).
    cut_off: Vec<JobInfo>,
}

impl Task {
    fn new(rx: mpsc::UnboundedReceiver<Cmd>, shared: Arc<Mutex<Shared>>) -> Task {
        Task {
            rx: Some(rx),
            shared,
            carried: Vec::new(),
            queue: DelayQueue::new(),
            running: JoinSet::new(),
            running_ids: HashMap::new(),
            draining: None,
            completed: 0,
            failed: Vec::new(),
            cut_off: Vec::new(),
        }
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        let Some(rx) = self.rx.take() else { return };
        let mut shared = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        let key_log = shared.key_log;
        for (_, info) in self.running_ids.drain() {
            shared.pending.remove(&info.id);
            event(key_log, "dropped", &info);
            self.cut_off.push(info);
        }
        let now = Instant::now();
        let mut jobs = std::mem::take(&mut self.carried);
        while let Some(key) = self.queue.peek() {
            let job = self.queue.remove(&key);
            let left = job.deadline().saturating_duration_since(now);
            jobs.push((job.into_inner(), left));
        }
        if std::thread::panicking() {
            // The task itself panicked (a defect): taken elsewhere, it would panic again, and
            // again, on the thread every locker shares. Its jobs are dropped, and reported so
            // to a drain waiting for them.
            // (The attempts in flight were told `dropped` above.)
            let mut dropped = std::mem::take(&mut self.cut_off);
            for (job, _) in jobs {
                shared.pending.remove(&job.info.id);
                event(key_log, "dropped", &job.info);
                dropped.push(job.info);
            }
            drop(shared);
            tracing::error!(
                target: "dlock::defer",
                queue = "memory",
                jobs = dropped.len(),
                "the in-process queue's task panicked; its jobs are dropped"
            );
            if let Some((_, reply)) = self.draining.take() {
                let _ = reply.send(ShutdownReport {
                    completed: self.completed,
                    dropped,
                    failed: std::mem::take(&mut self.failed),
                });
            }
            return;
        }
        drop(shared);
        let Some(rt) = crate::util::fallback_runtime() else {
            // Dropped here; the next push finds the task gone and reports them.
            return;
        };
        tracing::debug!(
            target: "dlock::defer",
            queue = "memory",
            jobs = jobs.len(),
            "the queue task moves to the fallback thread: its runtime shut down"
        );
        let mut next = Task::new(rx, self.shared.clone());
        next.carried = jobs;
        next.draining = self.draining.take();
        next.completed = self.completed;
        next.failed = std::mem::take(&mut self.failed);
        next.cut_off = std::mem::take(&mut self.cut_off);
        rt.spawn(run(next));
    }
}

async fn run(mut task: Task) {
    for (job, delay) in std::mem::take(&mut task.carried) {
        task.queue.insert(job, delay);
    }
    let shared = task.shared.clone();
    let lock = || shared.lock().unwrap_or_else(PoisonError::into_inner);
    let key_log = lock().key_log;
    let Task {
        rx,
        queue,
        running,
        running_ids,
        draining,
        completed,
        failed,
        cut_off,
        ..
    } = &mut task;
    let Some(rx) = rx.as_mut() else { return };
    let finished = loop {
        if let Some((deadline, _)) = &draining {
            let deadline = *deadline;
            if queue.is_empty() && running.is_empty() || Instant::now() >= deadline {
                let (_, reply) = draining.take().expect("draining");
                // Attempts a runtime shutdown cut off on their way (told `dropped` then).
                let mut dropped = std::mem::take(cut_off);
                let told = dropped.len();
                // Attempts that finished but were not looked at yet.
                while let Some(done) = running.try_join_next_with_id() {
                    match done {
                        Ok((task, Outcome::Done(info))) => {
                            running_ids.remove(&task);
                            *completed += 1;
                            event(key_log, "completed", &info);
                        }
                        Ok((task, Outcome::NotRun(job, _))) => {
                            running_ids.remove(&task);
                            dropped.push(job.info);
                        }
                        Err(e) => {
                            if let Some(mut info) = running_ids.remove(&e.id()) {
                                info.reason = Some(failure(e));
                                failed.push(info);
                            }
                        }
                    }
                }
                // Attempts still in flight are cancelled (their work, if it started, is cut
                // short): they are dropped too.
                dropped.extend(running_ids.drain().map(|(_, info)| info));
                while let Some(key) = queue.peek() {
                    dropped.push(queue.remove(&key).into_inner().info);
                }
                lock().pending.clear();
                for info in &dropped[told..] {
                    event(key_log, "dropped", info);
                }
                let _ = reply.send(ShutdownReport {
                    completed: *completed,
                    dropped,
                    failed: std::mem::take(failed),
                });
                running.abort_all();
                break true;
            }
        }
        let deadline = draining.as_ref().map(|(d, _)| *d);
        let next_dead_expiry = lock().prune_dead(Instant::now());
        tokio::select! {
            cmd = rx.recv(), if draining.is_none() => match cmd {
                Some(Cmd::Push(job, delay)) => {
                    queue.insert(job, delay);
                }
                Some(Cmd::Shutdown(within, reply)) => {
                    // Everything pending becomes due now.
                    let mut all = Vec::new();
                    while let Some(key) = queue.peek() {
                        all.push(queue.remove(&key).into_inner());
                    }
                    for job in all {
                        queue.insert(job, Duration::ZERO);
                    }
                    let now = Instant::now();
                    let until = now
                        .checked_add(within)
                        .unwrap_or_else(|| now + crate::util::CENTURY);
                    *draining = Some((until, reply));
                }
                None => break true,
            },
            Some(expired) = futures_util::future::poll_fn(|cx| queue.poll_expired(cx)), if !queue.is_empty() => {
                let job = expired.into_inner();
                let info = job.info.clone();
                let handle = running.spawn(attempt(job));
                running_ids.insert(handle.id(), info);
            }
            Some(done) = running.join_next_with_id(), if !running.is_empty() => match done {
                Ok((task, Outcome::Done(info))) => {
                    running_ids.remove(&task);
                    lock().pending.remove(&info.id);
                    // The report counts the jobs the drain ran, as `failed` does.
                    if draining.is_some() {
                        *completed += 1;
                    }
                    event(key_log, "completed", &info);
                }
                Ok((task, Outcome::NotRun(mut job, why))) => {
                    running_ids.remove(&task);
                    // An outage does not use up an attempt, as in the durable queue: the job
                    // is tried again at the pace of its current attempt. Nor does a busy lock
                    // during a drain, which tries every job until it has run or its time is up:
                    // counted, jobs of one key that the drain started together (retried every
                    // 10 ms) used up their attempts within 50 ms while a sibling held the lock,
                    // and were dropped with most of the drain's time left.
                    let counted = match &why {
                        NotRun::Busy => draining.is_none(),
                        NotRun::Failed(e) => e.uses_a_job_attempt(),
                    };
                    job.info.attempts += u32::from(counted);
                    if counted && job.info.attempts >= job.policy.max_attempts {
                        let reason = match why {
                            NotRun::Busy => format!("its lock was still busy after {} attempts", job.info.attempts),
                            NotRun::Failed(e) => format!("its lock could not be taken: {e}"),
                        };
                        lock().push_dead(job, reason);
                    } else {
                        let wait = if draining.is_some() {
                            Duration::from_millis(10)
                        } else {
                            let step = job.policy.backoff(job.info.attempts + 1);
                            // Uncounted, the step never grows: a delay of zero (or near it)
                            // asked the backend in a busy loop for as long as it was down.
                            if counted { step } else { step.max(crate::util::OUTAGE_PAUSE) }
                        };
                        lock().pending.insert(job.info.id.clone(), job.info.clone());
                        event(key_log, "retried", &job.info);
                        queue.insert(job, wait);
                    }
                }
                Err(e) => {
                    // The work panicked (or was aborted); its future is gone, it cannot be retried.
                    let mut info = running_ids.remove(&e.id()).unwrap_or_else(|| JobInfo::new("", "", 0));
                    lock().pending.remove(&info.id);
                    let error = failure(e);
                    tracing::error!(target: "dlock::defer", event = "failed", queue = "memory", job_id = %info.id, error = %error);
                    if draining.is_some() {
                        info.reason = Some(error);
                        failed.push(info);
                    }
                }
            },
            _ = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => {}
            // Dead letters past their retention are deleted on time, even in a quiet queue.
            _ = async {
                match next_dead_expiry {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    };
    if finished {
        task.rx = None;
    }
}
