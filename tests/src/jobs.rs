//! Durable jobs for the defer tests: they record each run in Redis (a separate key space from
//! the queue's), and can be told to hang, fail or panic, as the tests need; a fresh server with
//! a locker and a queue ([`start_queue`]); and [`run_in_background`], a worker running until
//! the test stops it.

use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::durable::{DurableQueue, DurableWorker, Job, JobContext, JobError};
use dlock_runtime::{LockError, LockKey, Locker};
use redis::AsyncCommands as _;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::RedisServer;

/// Records `started`/`done` (and a run count in the hash `runs`) for job `id` in the Redis at
/// `record_url`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RecordJob {
    /// Which job.
    pub id: u32,
    /// The lock it needs: `record:<lock>`.
    pub lock: String,
    /// Where to record runs.
    pub record_url: String,
    /// Hang forever on attempt 1 (the worker running it is about to be killed).
    pub hang_first: bool,
    /// Hang forever on every attempt.
    #[serde(default)]
    pub hang_always: bool,
    /// Fail (return an error) on every attempt.
    pub always_fail: bool,
    /// Fail with this error on every attempt.
    #[serde(default)]
    pub fail_with: Option<String>,
    /// Panic on every attempt.
    #[serde(default)]
    pub panic_always: bool,
    /// Cut the queue's connections as its last act, refusing new ones: the worker's
    /// `Arc<Proxy>` state ([`DurableWorker::state`]) is in front of the queue.
    #[serde(default)]
    pub cut_queue_at_end: bool,
}

impl Job for RecordJob {
    const NAME: &'static str = "record";

    fn lock_key(&self) -> Result<LockKey, LockError> {
        LockKey::builder().lit("record:").value(&self.lock).finish()
    }

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let client = redis::Client::open(self.record_url.as_str())?;
        let mut c = client.get_multiplexed_async_connection().await?;
        let _: () = c.sadd("started", self.id).await?;
        let _: () = c.hincr("runs", self.id, 1).await?;
        if self.hang_always || (self.hang_first && ctx.attempt() == 1) {
            std::future::pending::<()>().await;
        }
        if self.panic_always {
            panic!("job {} panics on purpose", self.id);
        }
        if self.always_fail {
            return Err("this job always fails".into());
        }
        if let Some(error) = self.fail_with {
            return Err(error.into());
        }
        let _: () = c
            .hset(
                "done",
                self.id,
                format!("{}:{}", ctx.attempt(), ctx.fencing_token()),
            )
            .await?;
        ctx.set_result(format!("done {}", self.id));
        if self.cut_queue_at_end {
            ctx.state::<Arc<crate::proxy::Proxy>>()
                .expect("the worker's state is the queue's proxy")
                .cut(true);
        }
        Ok(())
    }
}

/// A job whose first run freezes its worker: attempt 1 blocks the worker's thread for
/// `stall_ms` (as a stopped process or a long GC pause would: no heartbeat, no lock renewal on
/// a current-thread runtime), then works on for `work_ms` and sets `first-finished`. Later
/// attempts set `second-started`, wait until the key `release` exists, and finish with the
/// result `second`. Every run increments `runs`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StallJob {
    /// Where to record runs.
    pub record_url: String,
    /// How long attempt 1 blocks its thread.
    pub stall_ms: u64,
    /// How long attempt 1 works after the stall.
    pub work_ms: u64,
}

impl Job for StallJob {
    const NAME: &'static str = "stall";

    fn lock_key(&self) -> Result<LockKey, LockError> {
        LockKey::new("stall")
    }

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let client = redis::Client::open(self.record_url.as_str())?;
        let mut c = client.get_multiplexed_async_connection().await?;
        let _: () = c.incr("runs", 1).await?;
        if ctx.attempt() == 1 {
            std::thread::sleep(Duration::from_millis(self.stall_ms));
            tokio::time::sleep(Duration::from_millis(self.work_ms)).await;
            let _: () = c.set("first-finished", ctx.attempt()).await?;
            ctx.set_result("first");
            return Ok(());
        }
        let _: () = c.set("second-started", ctx.attempt()).await?;
        while !c.exists::<_, bool>("release").await? {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        ctx.set_result("second");
        Ok(())
    }
}

/// A new server, a locker on it ([`RedisServer::locker`]) and the durable queue `name` on it
/// with the default settings.
///
/// # Panics
/// If the server does not start or a connection fails.
pub async fn start_queue(name: &str) -> (RedisServer, Locker, DurableQueue) {
    let server = RedisServer::start();
    let locker = server.locker().await;
    let queue = DurableQueue::connect(&server.url(), name).await.unwrap();
    (server, locker, queue)
}

/// A [`DurableWorker`] running in a task of its own (`run_until`) until [`stop`](Self::stop).
#[derive(Debug)]
pub struct Running {
    stop: Arc<Notify>,
    task: JoinHandle<()>,
}

/// Spawns `worker.run_until(..)` on the current runtime.
pub fn run_in_background(worker: DurableWorker) -> Running {
    let stop = Arc::new(Notify::new());
    let task = {
        let stop = stop.clone();
        tokio::spawn(async move { worker.run_until(stop.notified()).await })
    };
    Running { stop, task }
}

impl Running {
    /// Tells the worker to stop and waits until it has.
    ///
    /// # Panics
    /// If the worker's task panicked.
    pub async fn stop(self) {
        self.stop.notify_one();
        self.task.await.unwrap();
    }
}

/// The durable queue end to end on the Redis deployment at `url` (one server, a cluster,
/// Sentinel), with names from `tag` and enqueues waiting for `replicas` replicas: a job whose
/// lock is busy is stored, a worker runs it under its lock once the holder releases — with a
/// larger fencing token —, acknowledges it, and the queue is empty after.
///
/// # Panics
/// If any of that does not happen (within 10 s for the run, 5 s for the acknowledgement).
pub async fn durable_round_trip(url: &str, tag: &str, replicas: u32) {
    use dlock_runtime::durable::{JobStatus, Submitted};
    use dlock_runtime::DeferPolicy;

    let record = RedisServer::start();
    let locker = Locker::from_url(url).await.unwrap();
    let queue = DurableQueue::connect(url, &format!("{tag}-invoices"))
        .await
        .unwrap()
        .with_replicas(replicas);
    let policy =
        DeferPolicy::new(Duration::from_millis(20), 100).max_delay(Duration::from_millis(50));
    let lock = format!("{tag}-o1");
    let job = RecordJob {
        id: 1,
        lock: lock.clone(),
        record_url: record.url(),
        ..RecordJob::default()
    };
    let held = locker
        .lock(format!("record:{lock}"))
        .acquire()
        .await
        .unwrap();
    let Submitted::Deferred(id) = queue
        .submit(&locker, job, &policy, Duration::from_secs(5))
        .await
        .unwrap()
    else {
        panic!("a busy lock defers the job")
    };
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Queued);
    let worker = DurableWorker::new(queue.clone(), locker.clone())
        .register::<RecordJob>()
        .poll_interval(Duration::from_millis(10));
    let w = run_in_background(worker);
    let holder_token = held.fencing_token();
    held.release().await.unwrap();
    let done = crate::wait::wait_for("the job to run", Duration::from_secs(10), async || {
        let mut c = record.conn().await;
        c.hget::<_, _, Option<String>>("done", 1).await.unwrap()
    })
    .await;
    let token: u64 = done.split_once(':').unwrap().1.parse().unwrap();
    assert!(
        token > holder_token,
        "the job ran with a newer fencing token"
    );
    crate::wait::wait_for(
        "the job to be acknowledged",
        Duration::from_secs(5),
        async || {
            let s = queue.status(&id).await.unwrap();
            matches!(s, JobStatus::Completed { .. }).then_some(())
        },
    )
    .await;
    w.stop().await;
    assert!(queue.is_empty().await.unwrap());
}

/// A queue's enqueues wait for its replica (`with_replicas(1)`; the queue is `name`, with no
/// worker): an enqueue returns once the replica has the job (`on_replica(key, id)`: whether the
/// replica's hash `key` holds `id`); while the replica is frozen (`freeze`, undone by `thaw`),
/// an enqueue fails as unavailable and withdraws its job, so the master (`on_master(key)`:
/// the length of its hash `key`) still holds the first job only. An enqueue made while the
/// replica was still catching up may fail as unavailable: it is tried again, for up to 10 s.
///
/// # Panics
/// If any of that does not happen.
pub async fn enqueue_waits_for_the_replica(
    url: &str,
    name: &str,
    on_replica: impl AsyncFn(&str, &str) -> bool,
    freeze: impl FnOnce(),
    thaw: impl FnOnce(),
    on_master: impl AsyncFn(&str) -> i64,
) {
    use dlock_runtime::DeferPolicy;

    let queue = DurableQueue::connect(url, name)
        .await
        .unwrap()
        .with_replicas(1);
    assert_eq!(queue.replicas(), 1);
    let jobs = format!("dlock:{{jobs:{name}}}:jobs");
    let job = RecordJob {
        id: 1,
        lock: format!("{name}-1"),
        ..RecordJob::default()
    };
    let policy = DeferPolicy::new(Duration::from_secs(1), 3);
    let (ttl, delay) = (Duration::from_secs(5), Duration::from_secs(60));
    let id = crate::wait::poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || match queue.enqueue(&job, &policy, ttl, delay).await {
            Ok(id) => Ok(id),
            Err(e) if e.is_unavailable() => Err(e.to_string()),
            Err(e) => panic!("enqueue: {e}"),
        },
    )
    .await;
    assert!(
        on_replica(&jobs, &id).await,
        "an enqueue with_replicas(1) returned before the replica had the job"
    );
    assert_eq!(on_master(&jobs).await, 1);

    freeze();
    let thaw = crate::wait::OnDrop::new(thaw);
    let err = queue.enqueue(&job, &policy, ttl, delay).await;
    let held = on_master(&jobs).await;
    thaw.run();
    let err = err.expect_err("a job no replica confirmed counted as queued");
    assert!(err.is_unavailable(), "{err}");
    assert!(err.to_string().contains("withdrawn"), "{err}");
    assert_eq!(held, 1, "an unconfirmed job was left queued");
}
