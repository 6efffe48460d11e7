//! The defer strategy: the in-process queue (closures, the attribute) and the durable queue
//! in a real Redis (typed jobs, dead letters, a worker process killed mid-job).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::defer::{DeferPolicy, DurableQueue, DurableWorker, JobStatus, Submitted};
use dlock_runtime::{Locker, OnFail};
use dlock_tests::jobs::RecordJob;
use dlock_tests::RedisServer;
use redis::AsyncCommands as _;
use tokio::sync::mpsc;

async fn wait_for<T>(what: &str, limit: Duration, mut probe: impl AsyncFnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---- in-process queue ------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_key_defers_and_runs_once_the_holder_releases_in_process() {
    let server = RedisServer::start();
    let locker = Locker::from_url(&server.url()).await.unwrap();
    let held = locker.lock("invoice:1").acquire().await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let err = locker
        .lock("invoice:1")
        .on_fail(OnFail::defer(Duration::from_millis(20), 50))
        .run(async move {
            let token = dlock_runtime::current_lock().unwrap().fencing_token();
            tx.send(token).unwrap();
        })
        .await
        .unwrap_err();
    assert!(err.is_deferred(), "{err}");
    assert_eq!(err.status(), 202);
    let job_id = err.job_id().unwrap().to_owned();
    assert!(locker
        .defer_queue()
        .pending()
        .iter()
        .any(|j| j.id == job_id));
    // Still busy: nothing ran.
    assert!(rx.try_recv().is_err());
    let holder_token = held.fencing_token();
    held.release().await.unwrap();
    let ran_with = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("deferred job ran")
        .unwrap();
    assert!(
        ran_with > holder_token,
        "the job held the lock with a newer token"
    );
    wait_for("the queue to empty", Duration::from_secs(2), async || {
        locker.defer_queue().pending().is_empty().then_some(())
    })
    .await;
}

#[tokio::test]
async fn in_process_job_past_max_attempts_is_dead_lettered_and_requeued() {
    let locker = Locker::memory();
    let held = locker.lock("k").acquire().await.unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let err = locker
        .lock("k")
        .on_fail(OnFail::Defer(
            DeferPolicy::new(Duration::from_millis(5), 3).max_delay(Duration::from_millis(20)),
        ))
        .run(async move {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .await
        .unwrap_err();
    let id = err.job_id().unwrap().to_owned();
    let dead = wait_for("dead letter", Duration::from_secs(5), async || {
        let d = locker.defer_queue().dead_letters();
        (!d.is_empty()).then_some(d)
    })
    .await;
    assert_eq!(dead[0].id, id);
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    held.release().await.unwrap();
    assert!(locker.defer_queue().requeue(&id));
    wait_for("requeued job to run", Duration::from_secs(5), async || {
        (ran.load(Ordering::SeqCst) == 1).then_some(())
    })
    .await;
    assert!(locker.defer_queue().dead_letters().is_empty());
}

#[tokio::test]
async fn shutdown_drains_or_reports_exactly_what_was_dropped() {
    let locker = Locker::memory();
    let ran = Arc::new(AtomicUsize::new(0));
    // One job whose lock frees during the drain, one whose lock never frees.
    let held_a = locker.lock("a").acquire().await.unwrap();
    let _held_b = locker.lock("b").acquire().await.unwrap();
    let mut ids = HashMap::new();
    for key in ["a", "b"] {
        let r = ran.clone();
        let err = locker
            .lock(key)
            .on_fail(OnFail::defer(Duration::from_secs(60), 100))
            .run(async move {
                r.fetch_add(1, Ordering::SeqCst);
            })
            .await
            .unwrap_err();
        ids.insert(key, err.job_id().unwrap().to_owned());
    }
    held_a.release().await.unwrap();
    // Due in 60 s, but a drain tries everything at once.
    let report = locker
        .defer_queue()
        .shutdown(Duration::from_millis(300))
        .await;
    assert_eq!(report.completed, 1);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(report.dropped.len(), 1);
    assert_eq!(report.dropped[0].id, ids["b"]);
    assert_eq!(report.dropped[0].key, "b");
    // Closed: new work is refused with a typed error, not silently dropped.
    let err = locker
        .lock("b")
        .on_fail(OnFail::defer(Duration::from_secs(1), 1))
        .run(async {})
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err}");
}

// ---- durable queue ---------------------------------------------------------------------

fn record_job(server: &RedisServer, id: u32, lock: &str) -> RecordJob {
    RecordJob {
        id,
        lock: lock.to_owned(),
        record_url: server.url(),
        hang_first: false,
        always_fail: false,
    }
}

async fn done(server: &RedisServer) -> HashMap<u32, String> {
    let client = redis::Client::open(server.url()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    c.hgetall("done").await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_busy_key_defers_and_runs_once_the_holder_releases() {
    let server = RedisServer::start();
    let locker = Locker::from_url(&server.url()).await.unwrap();
    let queue = DurableQueue::connect(&server.url(), "invoices")
        .await
        .unwrap();
    let policy =
        DeferPolicy::new(Duration::from_millis(20), 100).max_delay(Duration::from_millis(50));

    // Free: runs now.
    let out = queue
        .submit(
            &locker,
            record_job(&server, 1, "o1"),
            &policy,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert!(matches!(out, Submitted::Ran(Ok(()))), "{out:?}");

    // Busy: queued.
    let held = locker.lock("record:o2").acquire().await.unwrap();
    let out = queue
        .submit(
            &locker,
            record_job(&server, 2, "o2"),
            &policy,
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    let Submitted::Deferred(id) = out else {
        panic!("expected deferral, got {out:?}")
    };
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Queued);

    let worker = DurableWorker::new(queue.clone(), locker.clone())
        .register::<RecordJob>()
        .poll_interval(Duration::from_millis(10));
    let stop = Arc::new(tokio::sync::Notify::new());
    let w = {
        let (worker, stop) = (worker.clone(), stop.clone());
        tokio::spawn(async move { worker.run_until(stop.notified()).await })
    };
    // While the holder holds on, the job bounces but does not run.
    let holder_token = held.fencing_token();
    assert!(!done(&server).await.contains_key(&2));
    held.release().await.unwrap();
    let record = wait_for("job 2 to run", Duration::from_secs(10), async || {
        done(&server).await.remove(&2)
    })
    .await;
    let (attempt, token) = record.split_once(':').unwrap();
    assert!(attempt.parse::<u32>().unwrap() >= 1);
    assert!(
        token.parse::<u64>().unwrap() > holder_token,
        "job ran with a newer fencing token"
    );
    // The job recorded its run from inside; the worker acknowledges right after.
    let status = wait_for(
        "the job to be acknowledged",
        Duration::from_secs(5),
        async || {
            let s = queue.status(&id).await.unwrap();
            (s != JobStatus::Running).then_some(s)
        },
    )
    .await;
    assert_eq!(
        status,
        JobStatus::Completed {
            result: Some("done 2".into())
        }
    );
    stop.notify_one();
    w.await.unwrap();
    assert!(queue.is_empty().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_job_past_max_attempts_is_dead_lettered_and_can_be_requeued() {
    let server = RedisServer::start();
    let locker = Locker::from_url(&server.url()).await.unwrap();
    let queue = DurableQueue::connect(&server.url(), "dlq").await.unwrap();
    let policy = DeferPolicy::new(Duration::from_millis(5), 3).max_delay(Duration::from_millis(20));
    let mut job = record_job(&server, 7, "dl");
    job.always_fail = true;
    let id = queue
        .enqueue(&job, &policy, Duration::from_secs(5), Duration::ZERO)
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();
    let dead = wait_for("dead letter", Duration::from_secs(10), async || {
        worker.run_once().await.unwrap();
        let d = queue.dead_letters().await.unwrap();
        (!d.is_empty()).then_some(d)
    })
    .await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, id);
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(dead[0].key, "record:dl");
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Dead);

    // An operator fixes the cause and re-queues it: it runs.
    assert!(queue.requeue(&id).await.unwrap());
    assert!(
        !queue.requeue(&id).await.unwrap(),
        "not a dead letter any more"
    );
    // The job data still says always_fail; requeue proves the mechanics: it is claimed again
    // with a fresh budget (attempt 1) and dead-lettered again after 3 more attempts.
    let dead = wait_for("dead letter again", Duration::from_secs(10), async || {
        worker.run_once().await.unwrap();
        let d = queue.dead_letters().await.unwrap();
        (!d.is_empty()).then_some(d)
    })
    .await;
    assert_eq!(dead[0].attempts, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_mid_job_loses_nothing() {
    let server = RedisServer::start();
    let url = server.url();
    let visibility = Duration::from_millis(800);
    let queue = DurableQueue::connect_with(&url, "crash", visibility, Duration::from_secs(600))
        .await
        .unwrap();
    let policy = DeferPolicy::new(Duration::from_millis(20), 10);
    let n = 5u32;
    for i in 0..n {
        let mut job = record_job(&server, i, &format!("c{i}"));
        job.hang_first = true;
        // Short lease: the killed worker's locks free soon after it dies.
        queue
            .enqueue(&job, &policy, Duration::from_millis(500), Duration::ZERO)
            .await
            .unwrap();
    }
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlock-job-worker"))
        .args([url.as_str(), "crash", &visibility.as_millis().to_string()])
        .kill_on_drop(true)
        .spawn()
        .expect("spawn dlock-job-worker");
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    wait_for(
        "the child to claim and start every job",
        Duration::from_secs(10),
        async || {
            let started: usize = c.scard("started").await.unwrap();
            (started == n as usize).then_some(())
        },
    )
    .await;
    child.kill().await.unwrap(); // SIGKILL, with all jobs claimed and running
    assert!(done(&server).await.is_empty());

    let locker = Locker::from_url(&url).await.unwrap();
    let worker = DurableWorker::new(queue.clone(), locker)
        .register::<RecordJob>()
        .poll_interval(Duration::from_millis(20));
    let finished = wait_for(
        "another worker to run every job",
        Duration::from_secs(20),
        async || {
            worker.run_once().await.unwrap();
            let d = done(&server).await;
            (d.len() == n as usize).then_some(d)
        },
    )
    .await;
    for i in 0..n {
        let attempt: u32 = finished[&i].split(':').next().unwrap().parse().unwrap();
        assert!(
            attempt >= 2,
            "job {i} ran as attempt {attempt}: it should be a retry after the crash"
        );
    }
    assert!(queue.is_empty().await.unwrap());
    assert!(queue.dead_letters().await.unwrap().is_empty());
}

// ---- the attribute ---------------------------------------------------------------------

#[dlock_runtime::distributed_lock(key = "mail:<user>", on_fail = "defer", delay = "20ms", max_attempts = 50, locker = locker)]
async fn send_mail(locker: Locker, user: u64, sent: mpsc::UnboundedSender<u64>) {
    sent.send(user).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attribute_defers_when_busy() {
    let server = RedisServer::start();
    let locker = Locker::from_url(&server.url()).await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let held = locker.lock("mail:9").acquire().await.unwrap();
    let err = send_mail(locker.clone(), 9, tx.clone()).await.unwrap_err();
    assert!(err.is_deferred(), "{err}");
    assert!(rx.try_recv().is_err());
    held.release().await.unwrap();
    let user = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap();
    assert_eq!(user, Some(9));
}
