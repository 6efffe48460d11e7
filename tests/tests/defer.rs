//! The defer strategy: the in-process queue (closures, the attribute) and the durable queue
//! in a real Redis (typed jobs, dead letters, a worker process killed mid-job, a worker that
//! stalls past its claim, jobs that panic or do not decode, the queue's bounds).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::defer::{DeferPolicy, JobInfo, QueueLimits};
use dlock_runtime::durable::{
    DurableQueue, DurableWorker, Job, JobContext, JobError, JobStatus, Submitted,
};
use dlock_runtime::{Locker, OnFail};
use dlock_tests::jobs::{run_in_background, start_queue, RecordJob, StallJob};
use dlock_tests::wait::wait_for;
use dlock_tests::RedisServer;
use redis::AsyncCommands as _;

#[path = "observability/capture.rs"]
#[allow(dead_code)]
mod capture;
use tokio::sync::mpsc;

// ---- in-process queue ------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_key_defers_and_runs_once_the_holder_releases_in_process() {
    let server = RedisServer::start();
    let locker = server.locker().await;
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

/// Defers, on `key`'s busy lock, work that counts its runs in `ran`: the caller's error
/// (`Deferred`, with the job's id).
async fn defer_counting(
    locker: &Locker,
    key: &str,
    on_fail: OnFail,
    ran: &Arc<AtomicUsize>,
) -> dlock_runtime::LockError {
    let r = ran.clone();
    locker
        .lock(key)
        .on_fail(on_fail)
        .run(async move {
            r.fetch_add(1, Ordering::SeqCst);
        })
        .await
        .unwrap_err()
}

#[tokio::test]
async fn in_process_job_past_max_attempts_is_dead_lettered_and_requeued() {
    let locker = Locker::memory();
    let held = locker.lock("k").acquire().await.unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let policy = DeferPolicy::new(Duration::from_millis(5), 3).max_delay(Duration::from_millis(20));
    let err = defer_counting(&locker, "k", OnFail::Defer(policy), &ran).await;
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

/// The in-process queue runs on the runtime of the first deferral. When that runtime shuts
/// down while the locker lives on (an actix-web worker restarting, a runtime built for
/// set-up), the queue moves to the fallback thread with its jobs: the job deferred there runs
/// once its lock is free, and the queue's bound counts it until then. Before, the job was lost
/// (reported dropped by the next deferral).
#[test]
fn jobs_survive_the_runtime_the_queue_started_on() {
    let rt = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    };
    let limits = QueueLimits::default().max_queued(1);
    let first_rt = rt();
    let locker =
        first_rt.block_on(async { Locker::builder().defer_limits(limits).memory().unwrap() });
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    // First attempt 2 s on: the runtime is gone long before, with no attempt in flight.
    let policy = || OnFail::Defer(DeferPolicy::new(Duration::from_secs(2), 3));
    let (held, first) = first_rt.block_on(async {
        let held = locker.lock("k").acquire().await.unwrap();
        let first = locker
            .lock("k")
            .on_fail(policy())
            .run(async move {
                r.fetch_add(1, Ordering::SeqCst);
            })
            .await;
        (held, first.unwrap_err())
    });
    assert!(first.is_deferred(), "{first}");
    drop(first_rt);

    let second_rt = rt();
    second_rt.block_on(async {
        // Still counted: the bound of one refuses another job.
        let second = locker.lock("k").on_fail(policy()).run(async {}).await;
        assert!(second.unwrap_err().is_queue_full());
        held.release().await.unwrap();
        // The job leaves the pending list once its run has ended (its lock released), a
        // moment after its body counted: wait for both.
        wait_for(
            "the job to run and leave the queue",
            Duration::from_secs(10),
            async || {
                (ran.load(Ordering::SeqCst) == 1 && locker.defer_queue().pending().is_empty())
                    .then_some(())
            },
        )
        .await;
    });
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
        let policy = OnFail::defer(Duration::from_secs(60), 100);
        let err = defer_counting(&locker, key, policy, &ran).await;
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

/// A drain tries every job until it has run or its time is up, and a lock that is busy
/// meanwhile does not use up a job's attempts: jobs of one key, started together by the drain,
/// wait for each other. Each busy attempt counted, so with the default five attempts, retried
/// every 10 ms, the jobs waiting for their sibling were dead-lettered and dropped within
/// 50 ms, with most of the drain's time left and the lock free a moment later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_a_busy_lock_without_using_up_its_jobs_attempts() {
    let locker = Locker::memory();
    let held = locker.lock("k").acquire().await.unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    for _ in 0..3 {
        let r = ran.clone();
        let err = locker
            .lock("k")
            .on_fail(OnFail::defer(Duration::from_secs(1), 5))
            .run(async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                r.fetch_add(1, Ordering::SeqCst);
            })
            .await
            .unwrap_err();
        assert!(err.is_deferred(), "{err}");
    }
    held.release().await.unwrap();
    let report = locker.defer_queue().shutdown(Duration::from_secs(10)).await;
    assert_eq!(report.completed, 3, "{report:?}");
    assert!(
        report.dropped.is_empty() && report.failed.is_empty(),
        "{report:?}"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 3);
}

/// A job that ran before the shutdown is not in its report: `completed` counts the jobs the
/// drain ran. Before, it counted every job since the queue started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_ran_before_the_shutdown_is_not_in_its_report() {
    let locker = Locker::memory();
    let held = locker.lock("k").acquire().await.unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let policy = OnFail::defer(Duration::from_millis(10), 100);
    let err = defer_counting(&locker, "k", policy, &ran).await;
    assert!(err.is_deferred(), "{err}");
    held.release().await.unwrap();
    wait_for("the job to run", Duration::from_secs(10), async || {
        (ran.load(Ordering::SeqCst) == 1 && locker.defer_queue().pending().is_empty()).then_some(())
    })
    .await;
    let report = locker.defer_queue().shutdown(Duration::from_secs(1)).await;
    assert_eq!(report, dlock_runtime::defer::ShutdownReport::default());
}

/// `shutdown(Duration::MAX)` — "drain as long as it takes" — drains: the job whose lock is free
/// runs, and the report says so. Before, the deadline overflowed an `Instant`: the queue's task
/// panicked, the report came back empty, and the job ran afterwards on the fallback thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_as_long_as_it_takes_runs_its_jobs_and_reports_them() {
    let locker = Locker::memory();
    let held = locker.lock("k").acquire().await.unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let err = defer_counting(
        &locker,
        "k",
        OnFail::defer(Duration::from_secs(60), 5),
        &ran,
    )
    .await;
    assert!(err.is_deferred(), "{err}");
    held.release().await.unwrap();
    let report = locker.defer_queue().shutdown(Duration::MAX).await;
    assert_eq!(report.completed, 1, "{report:?}");
    assert!(
        report.dropped.is_empty() && report.failed.is_empty(),
        "{report:?}"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

/// A dead-letter retention of `Duration::MAX` keeps dead letters until the count bound drops
/// them, and the queue goes on. Before, the expiry overflowed an `Instant`: the queue's task
/// panicked on every turn (moved to the fallback thread each time, where it panicked again),
/// no other job ran, and `dead_letters()` panicked in the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_retention_as_long_as_it_takes_keeps_them_and_the_queue_runs() {
    let limits = QueueLimits::default().dead_letter_retention(Duration::MAX);
    let locker = Locker::builder().defer_limits(limits).memory().unwrap();
    let _busy = locker.lock("busy").acquire().await.unwrap();
    let err = locker
        .lock("busy")
        .on_fail(OnFail::defer(Duration::from_millis(10), 1))
        .run(async {})
        .await
        .unwrap_err();
    assert!(err.is_deferred(), "{err}");
    wait_for("the dead letter", Duration::from_secs(10), async || {
        (locker.defer_queue().dead_letters().len() == 1).then_some(())
    })
    .await;
    let held = locker.lock("other").acquire().await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let err = locker
        .lock("other")
        .on_fail(OnFail::defer(Duration::from_millis(10), 5))
        .run(async move {
            tx.send(()).unwrap();
        })
        .await
        .unwrap_err();
    assert!(err.is_deferred(), "{err}");
    held.release().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the second job ran")
        .unwrap();
    assert_eq!(locker.defer_queue().dead_letters().len(), 1);
}

/// An attempt the queue was running when the runtime it ran on shut down is cut off: the queue
/// moves to the fallback thread, and its next drain reports that job dropped ("every job the
/// queue held is in exactly one of the three"). It was in no list.
#[test]
fn an_attempt_cut_off_by_its_runtime_is_in_the_next_drains_report() {
    let first_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (started_tx, started) = std::sync::mpsc::channel();
    let (locker, job_id) = first_rt.block_on(async {
        let locker = Locker::memory();
        let held = locker.lock("k").acquire().await.unwrap();
        let err = locker
            .lock("k")
            .on_fail(OnFail::defer(Duration::from_millis(10), 5))
            .run(async move {
                started_tx.send(()).unwrap();
                std::future::pending::<()>().await;
            })
            .await
            .unwrap_err();
        held.release().await.unwrap();
        (locker, err.job_id().unwrap().to_owned())
    });
    started
        .recv_timeout(Duration::from_secs(10))
        .expect("the job's work started");
    first_rt.shutdown_timeout(Duration::from_secs(10));
    let report = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(locker.defer_queue().shutdown(Duration::from_secs(2)));
    assert_eq!(report.completed, 0, "{report:?}");
    assert!(report.failed.is_empty(), "{report:?}");
    let dropped: Vec<&str> = report.dropped.iter().map(|j| j.id.as_str()).collect();
    assert_eq!(dropped, [job_id.as_str()], "{report:?}");
}

/// Jobs deferred while a shutdown begins are drained or reported, never lost: every job id a
/// caller was given (202) is in the report, as completed, dropped or failed. A push that
/// passed the "closed?" check just before the shutdown reached the queue task after it, was
/// never looked at, and was in no list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_deferred_while_the_queue_shuts_down_are_all_in_the_report() {
    for round in 0..30 {
        let locker = Locker::memory();
        let _held = locker.lock("busy").acquire().await.unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let pushers: Vec<_> = (0..2)
            .map(|_| {
                let (locker, accepted) = (locker.clone(), accepted.clone());
                tokio::spawn(async move {
                    loop {
                        let err = locker
                            .lock("busy")
                            .on_fail(OnFail::defer(Duration::from_secs(60), 3))
                            .run(async {})
                            .await
                            .unwrap_err();
                        if !err.is_deferred() {
                            // Shut down (or, on a slow machine, full).
                            assert!(err.is_unavailable() || err.is_queue_full(), "{err}");
                            return;
                        }
                        accepted.fetch_add(1, Ordering::SeqCst);
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        wait_for("jobs deferred", Duration::from_secs(5), async || {
            (accepted.load(Ordering::SeqCst) >= 20).then_some(())
        })
        .await;
        let report = locker
            .defer_queue()
            .shutdown(Duration::from_millis(5))
            .await;
        for p in pushers {
            p.await.unwrap();
        }
        let accounted = report.completed + report.dropped.len() + report.failed.len();
        assert_eq!(
            accounted,
            accepted.load(Ordering::SeqCst),
            "round {round}: deferred jobs missing from the report"
        );
        assert!(locker.defer_queue().pending().is_empty());
    }
}

/// A job whose work panics during the drain is in the report's `failed` list, with the panic
/// as its reason (it was in no list: neither completed nor dropped).
#[tokio::test]
async fn a_job_that_panics_during_the_drain_is_reported_failed() {
    let locker = Locker::memory();
    let held = locker.lock("p").acquire().await.unwrap();
    let err = locker
        .lock("p")
        .on_fail(OnFail::defer(Duration::from_secs(60), 3))
        .run(async { panic!("the mail server said no") })
        .await
        .unwrap_err();
    let id = err.job_id().unwrap().to_owned();
    held.release().await.unwrap();
    let report = locker.defer_queue().shutdown(Duration::from_secs(5)).await;
    assert_eq!(report.completed, 0);
    assert!(report.dropped.is_empty(), "{:?}", report.dropped);
    assert_eq!(report.failed.len(), 1, "{report:?}");
    assert_eq!(report.failed[0].id, id);
    let reason = report.failed[0].reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains("panicked") && reason.contains("the mail server said no"),
        "{reason}"
    );
}

/// An in-process job rides out a lock-backend outage: an attempt the backend did not answer
/// (503) does not count, so after more such attempts than the job has it is still pending, and
/// it runs once the backend is back. A refusal for good counts: the job is dead-lettered after
/// its attempts, with the refusal as the reason. Before, both used up attempts and
/// dead-lettered the job as "its lock was still busy".
#[test]
fn in_process_jobs_ride_out_an_outage_and_a_refusal_dead_letters_them() {
    let mut server = RedisServer::start();
    let policy = || {
        OnFail::Defer(
            DeferPolicy::new(Duration::from_millis(5), 2).max_delay(Duration::from_millis(10)),
        )
    };
    let retries = |captured: &capture::Captured, id: &str| {
        captured
            .events("retried")
            .iter()
            .filter(|e| e.field("job_id") == Some(id))
            .count()
    };
    capture::capturing_run(async |captured| {
        let url = server.user_url("app").await;
        let locker = Locker::builder()
            .command_timeout(Duration::from_millis(200))
            .connect(&url)
            .await
            .unwrap();

        // An outage.
        let held = locker.lock("out").acquire().await.unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        let err = defer_counting(&locker, "out", policy(), &ran).await;
        let id = err.job_id().unwrap().to_owned();
        server.stop();
        wait_for(
            "four attempts during the outage",
            Duration::from_secs(20),
            async || (retries(captured, &id) >= 4).then_some(()),
        )
        .await;
        assert!(locker.defer_queue().dead_letters().is_empty());
        let pending = locker.defer_queue().pending();
        assert_eq!(pending.len(), 1);
        assert_eq!(pending[0].attempts, 0, "an outage used up attempts");
        drop(held);
        // Nothing is kept on disk: the restarted server has neither the user nor the lock.
        server.restart();
        server.user_url("app").await;
        wait_for("the job to run", Duration::from_secs(20), async || {
            (ran.load(Ordering::SeqCst) == 1).then_some(())
        })
        .await;

        // A refusal for good: the user loses the lock keys while the job waits.
        let held = locker.lock("refused").acquire().await.unwrap();
        let err = locker
            .lock("refused")
            .on_fail(policy())
            .run(async {})
            .await
            .unwrap_err();
        let id = err.job_id().unwrap().to_owned();
        server.confine("app").await;
        let dead = wait_for(
            "the refused job's dead letter",
            Duration::from_secs(20),
            async || {
                let dead = locker.defer_queue().dead_letters();
                (!dead.is_empty()).then_some(dead)
            },
        )
        .await;
        assert_eq!(dead[0].id, id);
        assert_eq!(dead[0].attempts, 2);
        let reason = dead[0].reason.as_deref().unwrap_or_default();
        assert!(
            reason.contains("could not be taken") && reason.contains("refused"),
            "{reason}"
        );
        drop(held);
    });
}

#[tokio::test]
async fn in_process_queue_is_bounded_and_dead_letters_expire() {
    let limits = QueueLimits::default()
        .max_queued(1)
        .max_dead_letters(1)
        .dead_letter_retention(Duration::from_millis(300));
    let locker = Locker::builder().defer_limits(limits).memory().unwrap();
    let _held = locker.lock("k").acquire().await.unwrap();
    let policy = || OnFail::Defer(DeferPolicy::new(Duration::from_millis(5), 1));
    let defer = || locker.lock("k").on_fail(policy()).run(async {});

    // The queue holds one job: the second is refused with a typed 503, the first is kept.
    let first = defer().await.unwrap_err();
    assert!(first.is_deferred(), "{first}");
    let full = defer().await.unwrap_err();
    assert!(full.is_queue_full(), "{full}");
    assert_eq!(full.status(), 503);
    assert_eq!(full.retry_after_secs(), Some(1));
    let pending = locker.defer_queue().pending();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].id, first.job_id().unwrap());

    // The first is dead-lettered (its lock stays busy), making room for a second, which is
    // dead-lettered too: only the newest dead letter is kept.
    let first_id = first.job_id().unwrap().to_owned();
    wait_for(
        "the first dead letter",
        Duration::from_secs(5),
        async || (locker.defer_queue().dead_letters().len() == 1).then_some(()),
    )
    .await;
    assert!(locker.defer_queue().dead_letters()[0]
        .reason
        .as_deref()
        .is_some_and(|r| r.contains("busy")));
    let second = defer().await.unwrap_err();
    let second_id = second.job_id().unwrap().to_owned();
    wait_for(
        "the second dead letter to replace the first",
        Duration::from_secs(5),
        async || {
            let dead = locker.defer_queue().dead_letters();
            (dead.len() == 1 && dead[0].id == second_id).then_some(())
        },
    )
    .await;
    assert!(!locker.defer_queue().requeue(&first_id), "dropped for good");

    // Past the retention it is deleted too.
    wait_for(
        "dead letters to expire",
        Duration::from_secs(5),
        async || locker.defer_queue().dead_letters().is_empty().then_some(()),
    )
    .await;
    assert!(!locker.defer_queue().requeue(&second_id));
}

// ---- durable queue ---------------------------------------------------------------------

fn record_job(server: &RedisServer, id: u32, lock: &str) -> RecordJob {
    RecordJob {
        id,
        lock: lock.to_owned(),
        record_url: server.url(),
        ..RecordJob::default()
    }
}

/// Enqueues `job` due now, with a 5 s lease for its runs.
async fn enqueue(
    queue: &DurableQueue,
    job: &RecordJob,
    policy: &DeferPolicy,
) -> Result<String, dlock_runtime::LockError> {
    queue
        .enqueue(job, policy, Duration::from_secs(5), Duration::ZERO)
        .await
}

/// A server and the durable queue `name` on it, with that claim visibility timeout and
/// dead-letter retention.
async fn server_and_queue(
    name: &str,
    visibility: Duration,
    retention: Duration,
) -> (RedisServer, DurableQueue) {
    let server = RedisServer::start();
    let queue = DurableQueue::connect_with(&server.url(), name, visibility, retention)
        .await
        .unwrap();
    (server, queue)
}

/// What the `RecordJob`s finished: id → `attempt:fencing token`.
async fn done(server: &RedisServer) -> HashMap<u32, String> {
    server.conn().await.hgetall("done").await.unwrap()
}

/// How many times `RecordJob` `id` started.
async fn runs(server: &RedisServer, id: u32) -> u32 {
    let n: Option<u32> = server.conn().await.hget("runs", id).await.unwrap();
    n.unwrap_or(0)
}

/// Runs `worker` once per poll until `queue` has a dead letter (at most 10 s); returns them.
async fn run_until_dead_letter(
    what: &str,
    worker: &DurableWorker,
    queue: &DurableQueue,
) -> Vec<JobInfo> {
    wait_for(what, Duration::from_secs(10), async || {
        worker.run_once().await.unwrap();
        let d = queue.dead_letters().await.unwrap();
        (!d.is_empty()).then_some(d)
    })
    .await
}

/// Pauses `server`'s writes (scripts included) for `ms` milliseconds (`CLIENT PAUSE … WRITE`).
async fn pause_writes(server: &RedisServer, ms: u64) {
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg("WRITE")
        .query_async(&mut server.conn().await)
        .await
        .unwrap();
}

/// Runs `worker` once per poll until it has claimed `n` jobs (at most 20 s), asserting after
/// each claim that `queue` has no dead letter.
async fn claims_without_dead_letters(
    what: &str,
    worker: &DurableWorker,
    queue: &DurableQueue,
    n: usize,
) {
    let mut claimed = 0;
    wait_for(what, Duration::from_secs(20), async || {
        claimed += worker.run_once().await.unwrap();
        let dead = queue.dead_letters().await.unwrap();
        assert!(dead.is_empty(), "dead-lettered: {dead:?}");
        (claimed >= n).then_some(())
    })
    .await;
}

/// Waits (at most `limit`) until job `id` is no longer running, and asserts that it completed
/// with `result`.
async fn assert_completes(
    what: &str,
    limit: Duration,
    queue: &DurableQueue,
    id: &str,
    result: &str,
) {
    let status = wait_for(what, limit, async || {
        let s = queue.status(id).await.unwrap();
        (s != JobStatus::Running).then_some(s)
    })
    .await;
    assert_eq!(
        status,
        JobStatus::Completed {
            result: Some(result.into())
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_busy_key_defers_and_runs_once_the_holder_releases() {
    let (server, locker, queue) = start_queue("invoices").await;
    let policy =
        DeferPolicy::new(Duration::from_millis(20), 100).max_delay(Duration::from_millis(50));

    let submit = async |id, lock| {
        let job = record_job(&server, id, lock);
        let ttl = Duration::from_secs(5);
        queue.submit(&locker, job, &policy, ttl).await.unwrap()
    };

    // Free: runs now.
    let out = submit(1, "o1").await;
    assert!(matches!(out, Submitted::Ran(Ok(()))), "{out:?}");

    // Busy: queued.
    let held = locker.lock("record:o2").acquire().await.unwrap();
    let out = submit(2, "o2").await;
    let Submitted::Deferred(id) = out else {
        panic!("expected deferral, got {out:?}")
    };
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Queued);

    let worker = DurableWorker::new(queue.clone(), locker.clone())
        .register::<RecordJob>()
        .poll_interval(Duration::from_millis(10));
    let w = run_in_background(worker);
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
    assert_completes(
        "the job to be acknowledged",
        Duration::from_secs(5),
        &queue,
        &id,
        "done 2",
    )
    .await;
    w.stop().await;
    assert!(queue.is_empty().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_job_past_max_attempts_is_dead_lettered_and_can_be_requeued() {
    let (server, locker, queue) = start_queue("dlq").await;
    let policy = DeferPolicy::new(Duration::from_millis(5), 3).max_delay(Duration::from_millis(20));
    let mut job = record_job(&server, 7, "dl");
    job.always_fail = true;
    let id = enqueue(&queue, &job, &policy).await.unwrap();
    let worker = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();
    let dead = run_until_dead_letter("dead letter", &worker, &queue).await;
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
    let dead = run_until_dead_letter("dead letter again", &worker, &queue).await;
    assert_eq!(dead[0].attempts, 3);
}

/// A job's error is kept as its dead letter's reason up to 4 KiB, cut at a character boundary
/// and marked: an error that quotes a large input does not put all of it into Redis. So is the
/// result a finished job records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_failure_reason_or_result_is_kept_cut_to_four_kib() {
    #[derive(serde::Serialize, serde::Deserialize)]
    struct LongResult;
    impl Job for LongResult {
        const NAME: &'static str = "long-result";
        fn lock_key(&self) -> Result<dlock_runtime::LockKey, dlock_runtime::LockError> {
            dlock_runtime::LockKey::new("long-result")
        }
        async fn run(self, ctx: JobContext) -> Result<(), JobError> {
            ctx.set_result("é".repeat(5000));
            Ok(())
        }
    }

    let (server, locker, queue) = start_queue("long-reason").await;
    let policy = DeferPolicy::new(Duration::from_millis(5), 1);
    let job = RecordJob {
        fail_with: Some("é".repeat(5000)),
        ..record_job(&server, 8, "long-reason")
    };
    enqueue(&queue, &job, &policy).await.unwrap();
    let worker = DurableWorker::new(queue.clone(), locker).register::<RecordJob>();
    let dead = run_until_dead_letter("dead letter", &worker, &queue).await;
    let reason = dead[0].reason.as_deref().unwrap_or_default();
    assert!(
        (4090..=4096).contains(&reason.len()),
        "{} bytes kept",
        reason.len()
    );
    assert!(reason.starts_with("the job failed: éé") && reason.ends_with("é…"));

    let id = queue
        .enqueue(&LongResult, &policy, Duration::from_secs(5), Duration::ZERO)
        .await
        .unwrap();
    let worker = worker.register::<LongResult>();
    let result = wait_for("the job to finish", Duration::from_secs(10), async || {
        worker.run_once().await.unwrap();
        match queue.status(&id).await.unwrap() {
            JobStatus::Completed { result } => Some(result.unwrap_or_default()),
            _ => None,
        }
    })
    .await;
    // 4,093 bytes of `é`s cut to a whole character, and the 3 of `…`.
    assert_eq!(result.len(), 4092 + 3, "{} bytes kept", result.len());
    assert!(result.starts_with("éé") && result.ends_with("é…"));
}

/// A listing reads its jobs hundreds a round trip (one script call a batch, not three commands
/// a job), in order across the batches, and can be cut at a limit that still says how many
/// jobs there are in all: 1,201 delayed jobs, more than two batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_listings_read_in_batches_and_are_cut_at_their_limit() {
    let (server, _locker, queue) = start_queue("listing").await;
    let policy = DeferPolicy::new(Duration::ZERO, 1);
    let mut ids = Vec::new();
    for i in 0..1201u32 {
        let job = record_job(&server, i, &format!("l{i}"));
        // Due one second apart: the listing's order is the enqueue order.
        let delay = Duration::from_secs(3600 + u64::from(i));
        let id = queue
            .enqueue(&job, &policy, Duration::from_secs(5), delay)
            .await
            .unwrap();
        ids.push(id);
    }
    let calls = async |command: &str| -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut server.conn().await)
            .await
            .unwrap();
        let field = format!("cmdstat_{command}:calls=");
        info.lines()
            .find_map(|l| l.strip_prefix(field.as_str()))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse().unwrap())
    };
    // The script loaded on the server first (its first call answers NOSCRIPT and is sent again).
    queue.pending_first(1).await.unwrap();
    let scripts = calls("evalsha").await;
    let all = queue.pending().await.unwrap();
    assert_eq!(calls("evalsha").await - scripts, 3, "three batches");
    assert_eq!(all.len(), ids.len());
    for (i, (info, status)) in all.iter().enumerate() {
        assert_eq!(info.id, ids[i], "job {i}");
        assert_eq!(info.key, format!("record:l{i}"), "job {i}");
        assert_eq!(*status, JobStatus::Queued);
    }
    let first = queue.pending_first(1000).await.unwrap();
    assert_eq!((first.jobs.len(), first.total), (1000, 1201));
    assert!(first.truncated());
    assert_eq!(first.jobs[999].0.id, ids[999]);
    assert_eq!(first.jobs[..], all[..1000]);
    let one = queue.pending_first(1).await.unwrap();
    assert_eq!((one.jobs.len(), one.total), (1, 1201));
    assert_eq!(one.jobs[0].0.id, ids[0]);
    let whole = queue.pending_first(5000).await.unwrap();
    assert_eq!((whole.jobs.len(), whole.total), (1201, 1201));
    assert!(!whole.truncated());
    let none = queue.pending_first(0).await.unwrap();
    assert_eq!((none.jobs.len(), none.total), (0, 1201));
    let dead = queue.dead_letters_first(10).await.unwrap();
    assert!(dead.jobs.is_empty() && dead.total == 0 && !dead.truncated());
}

/// A job with a megabyte of data (a deferred request near the body limit).
#[derive(serde::Serialize, serde::Deserialize)]
struct Bulky {
    n: u32,
    blob: String,
}

impl Job for Bulky {
    const NAME: &'static str = "bulky";

    fn lock_key(&self) -> Result<dlock_runtime::LockKey, dlock_runtime::LockError> {
        dlock_runtime::LockKey::new(&format!("bulky:{}", self.n))
    }

    async fn run(self, _: JobContext) -> Result<(), JobError> {
        Ok(())
    }
}

/// A listing reads the start of each stored job, where its lock key is, not the whole of it:
/// 40 jobs of 1 MiB each are listed, keys and all, over a connection whose replies Redis cuts
/// off at 4 MiB. It read every job whole — 40 MiB in one reply here; 2 GiB for 500 deferred
/// requests near the body limit, an answer that outran the command timeout and held the
/// queue's connection (claims, heartbeats, acks) behind it. A small job stored by an earlier
/// release, its key after its data, is still listed with its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_reads_only_the_start_of_each_stored_job() {
    let (server, queue) =
        server_and_queue("bulky", Duration::from_secs(30), Duration::from_secs(3600)).await;
    let policy = DeferPolicy::new(Duration::ZERO, 1);
    let mut keys = Vec::new();
    for n in 0..40u32 {
        let job = Bulky {
            n,
            blob: "x".repeat(1 << 20),
        };
        keys.push(job.lock_key().unwrap().as_str().to_owned());
        let delay = Duration::from_secs(3600 + u64::from(n));
        queue
            .enqueue(&job, &policy, Duration::from_secs(5), delay)
            .await
            .unwrap();
    }
    // Behind the queue's back: a job as an earlier release stored it, due last.
    let legacy = br#"{"type":"record","data":{"id":7},"key":"record:legacy","max_attempts":1,"delay_ms":0,"max_delay_ms":0,"ttl_ms":5000}"#;
    let mut conn = server.conn().await;
    let _: () = conn
        .hset("dlock:{jobs:bulky}:jobs", "legacy", &legacy[..])
        .await
        .unwrap();
    let _: () = conn
        .zadd("dlock:{jobs:bulky}:due", "legacy", u64::MAX >> 12)
        .await
        .unwrap();
    keys.push("record:legacy".to_owned());
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("client-output-buffer-limit")
        .arg("normal 4mb 4mb 0")
        .query_async(&mut conn)
        .await
        .unwrap();
    let page = queue.pending_first(100).await.unwrap();
    let listed: Vec<&str> = page.jobs.iter().map(|(j, _)| j.key.as_str()).collect();
    assert_eq!(listed, keys);
}

/// A job that notes each attempt's start (`started:<attempt>`) and runs until the key
/// `release` exists, then notes its end (`finished:<attempt>`).
#[derive(serde::Serialize, serde::Deserialize)]
struct UntilReleased {
    record_url: String,
}

impl Job for UntilReleased {
    const NAME: &'static str = "until-released";

    fn lock_key(&self) -> Result<dlock_runtime::LockKey, dlock_runtime::LockError> {
        dlock_runtime::LockKey::new("until-released")
    }

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let client = redis::Client::open(self.record_url.as_str())?;
        let mut c = client.get_multiplexed_async_connection().await?;
        let _: () = c.set(format!("started:{}", ctx.attempt()), 1).await?;
        while !c.exists::<_, bool>("release").await? {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _: () = c.set(format!("finished:{}", ctx.attempt()), 1).await?;
        Ok(())
    }
}

/// A job whose lock is lost while it runs stops, as a failed attempt, and runs again under
/// the lock taken anew: here an operator force-releases it, and the worker's next renewal
/// finds it gone. The same stop covers a worker whose machine slept past the lease — its
/// claim's clock does not count the sleep, the lease clock does. The run went on without its
/// lock (until its claim was taken over, or for good while its heartbeats were answered), and
/// another worker could hold the lock and run the job beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_lock_is_lost_stops_and_runs_again() {
    let (server, queue) = server_and_queue(
        "lock-lost",
        Duration::from_secs(30),
        Duration::from_secs(60),
    )
    .await;
    let locker = server.locker().await;
    let job = UntilReleased {
        record_url: server.url(),
    };
    let policy = DeferPolicy::new(Duration::from_millis(10), 5);
    let id = queue
        .enqueue(&job, &policy, Duration::from_millis(600), Duration::ZERO)
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), locker.clone())
        .register::<UntilReleased>()
        .poll_interval(Duration::from_millis(10));
    let running = run_in_background(worker);
    let mut c = server.conn().await;
    let set = async |c: &mut redis::aio::MultiplexedConnection, key: &str| {
        c.exists::<_, bool>(key).await.unwrap()
    };
    wait_for("the first run", Duration::from_secs(10), async || {
        set(&mut c, "started:1").await.then_some(())
    })
    .await;
    let released = locker
        .admin()
        .unwrap()
        .force_release("until-released")
        .await
        .unwrap();
    assert!(released.was_held, "{released:?}");
    wait_for("the second run", Duration::from_secs(10), async || {
        set(&mut c, "started:2").await.then_some(())
    })
    .await;
    let _: () = c.set("release", 1).await.unwrap();
    wait_for(
        "the second run to end",
        Duration::from_secs(10),
        async || {
            matches!(
                queue.status(&id).await.unwrap(),
                JobStatus::Completed { .. }
            )
            .then_some(())
        },
    )
    .await;
    assert!(set(&mut c, "finished:2").await);
    assert!(!set(&mut c, "finished:1").await, "the first run went on");
    running.stop().await;
}

/// A job that finished is acknowledged even when the queue's connection fails right then: the
/// worker asks again until the queue answers (within the claim's visibility timeout). Once, it
/// logged the failure and left the claim to expire, so the finished job ran again (or, on its
/// last attempt, was dead-lettered as a crash).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_job_is_acknowledged_through_a_failed_connection() {
    use dlock_tests::proxy::Proxy;
    let server = RedisServer::start();
    let proxy = Arc::new(Proxy::start(server.port()).await.unwrap());
    let queue = DurableQueue::connect_with(
        &proxy.url(),
        "ack",
        Duration::from_secs(5),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let locker = server.locker().await;
    let mut job = record_job(&server, 21, "ack");
    job.cut_queue_at_end = true;
    let policy = DeferPolicy::new(Duration::from_millis(5), 1);
    let id = enqueue(&queue, &job, &policy).await.unwrap();
    let worker = DurableWorker::new(queue.clone(), locker)
        .register::<RecordJob>()
        .state(proxy.clone());
    // The job cuts the queue's connection as it ends; the ack fails while new connections are
    // refused (the connection manager's reconnects count them), then they are let through.
    let reopen = tokio::spawn({
        let proxy = proxy.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(10), async {
                while proxy.refused() < 3 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await
            .expect("reconnects were refused");
            proxy.allow();
        }
    });
    worker.run_once().await.unwrap();
    reopen.await.unwrap();
    // Read within the visibility timeout (no other worker could take the job over by then);
    // the first command on the queue's remade connection may still fail.
    let status = wait_for("the queue to answer", Duration::from_secs(3), async || {
        queue.status(&id).await.ok()
    })
    .await;
    assert_eq!(
        status,
        JobStatus::Completed {
            result: Some("done 21".into())
        },
        "the finished job was not acknowledged"
    );
    assert_eq!(runs(&server, 21).await, 1);
}

/// A queue's Redis a slow link away (700 ms each way: every command takes 1.4 s): with the
/// default 1 s command timeout, nothing gets through — connecting or enqueueing answers
/// `Unavailable` (503), in time — and with `QueueOptions::command_timeout(5 s)` the queue
/// connects, enqueues and reads the job's status. (The command timeout was fixed at 1 s.)
/// A timeout of zero or over 60 s is a typed refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_a_slow_link_away_works_with_a_longer_command_timeout() {
    use dlock_runtime::durable::QueueOptions;
    use dlock_tests::proxy::Proxy;
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await.unwrap();
    proxy.set_latency(Duration::from_millis(700));
    let job = record_job(&server, 31, "slow-link");
    let policy = DeferPolicy::new(Duration::from_millis(5), 1);

    let started = std::time::Instant::now();
    let by_default = match DurableQueue::connect(&proxy.url(), "slow").await {
        Ok(queue) => enqueue(&queue, &job, &policy).await.map(drop),
        Err(e) => Err(e),
    };
    let err = by_default.expect_err("a command of 1.4 s answered within a 1 s timeout");
    assert!(err.is_unavailable(), "{err}");
    assert_eq!(err.status(), 503);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the default queue took {:?} to give up",
        started.elapsed()
    );

    let options = QueueOptions::default().command_timeout(Duration::from_secs(5));
    let queue = DurableQueue::connect_options(&proxy.url(), "slow", options)
        .await
        .unwrap();
    assert_eq!(queue.command_timeout(), Duration::from_secs(5));
    let id = enqueue(&queue, &job, &policy).await.unwrap();
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Queued);

    for bad in [Duration::ZERO, Duration::from_secs(61)] {
        let options = QueueOptions::default().command_timeout(bad);
        let err = DurableQueue::connect_options(&server.url(), "slow", options)
            .await
            .expect_err("a command timeout out of range");
        assert!(err.is_misconfigured(), "{bad:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purging_a_job_that_is_not_a_dead_letter_leaves_it_to_run() {
    let (server, locker, queue) = start_queue("purge").await;
    let policy = DeferPolicy::new(Duration::from_millis(5), 3);
    let job = record_job(&server, 8, "pg");
    let id = enqueue(&queue, &job, &policy).await.unwrap();
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Queued);

    // Named by id while queued, or in a purge of all dead letters: it is none of them.
    assert_eq!(queue.purge_dead(Some(&id)).await.unwrap(), 0);
    assert_eq!(queue.purge_dead(None).await.unwrap(), 0);
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Queued);

    let worker = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();
    worker.run_once().await.unwrap();
    assert_completes(
        "the queued job to run",
        Duration::from_secs(5),
        &queue,
        &id,
        "done 8",
    )
    .await;
    assert!(queue.dead_letters().await.unwrap().is_empty());

    // A dead letter is purged, payload and all.
    let mut job = record_job(&server, 9, "pg");
    job.always_fail = true;
    let dead_id = enqueue(&queue, &job, &policy).await.unwrap();
    run_until_dead_letter("dead letter", &worker, &queue).await;
    assert_eq!(queue.purge_dead(Some(&dead_id)).await.unwrap(), 1);
    assert_eq!(queue.status(&dead_id).await.unwrap(), JobStatus::Unknown);
    assert!(queue.is_empty().await.unwrap());
}

/// A lock backend that is down does not use up a job's attempts: each claim that could not
/// take the job's lock for want of an answer (503) is put back uncounted, so after more such
/// claims than the job has attempts it is still queued, not dead-lettered, and it runs once
/// the backend is back — as attempt 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_backend_outage_does_not_use_up_a_jobs_attempts() {
    let (server, queue) =
        server_and_queue("outage", Duration::from_secs(30), Duration::from_secs(60)).await;
    let mut lock_server = RedisServer::start();
    let locker = Locker::builder()
        .command_timeout(Duration::from_millis(200))
        .connect(&lock_server.url())
        .await
        .unwrap();
    let policy = DeferPolicy::new(Duration::from_millis(5), 2).max_delay(Duration::from_millis(10));
    let job = record_job(&server, 10, "out");
    let id = enqueue(&queue, &job, &policy).await.unwrap();
    let worker = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();

    lock_server.stop();
    // Four claims that reach the job, twice its attempts.
    claims_without_dead_letters("four claims of the job", &worker, &queue, 4).await;
    assert!(queue.dead_letters().await.unwrap().is_empty());
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Queued);
    assert_eq!(runs(&server, 10).await, 0);

    lock_server.restart();
    wait_for("the job to run", Duration::from_secs(20), async || {
        worker.run_once().await.unwrap();
        done(&server).await.remove(&10)
    })
    .await;
    assert_completes("the job", Duration::from_secs(5), &queue, &id, "done 10").await;
    let record = done(&server).await.remove(&10).unwrap();
    assert!(record.starts_with("1:"), "ran as attempt 1: {record}");
}

/// A lock backend that answers every call at once that it is down (503): one that refuses
/// fast (a Redis Cluster without a quorum, a server still loading its data), where a stopped
/// server makes each attempt wait out its connection.
struct Down;

impl dlock_runtime::backend::Backend for Down {
    fn name(&self) -> &'static str {
        "down"
    }
    fn acquire<'a>(
        &'a self,
        _: dlock_runtime::backend::AcquireArgs<'a>,
    ) -> dlock_runtime::backend::BoxFuture<
        'a,
        Result<dlock_runtime::backend::Attempt, dlock_runtime::LockError>,
    > {
        Box::pin(async { Err(dlock_runtime::LockError::unavailable("down", None)) })
    }
    fn release<'a>(
        &'a self,
        _: &'a dlock_runtime::key::ResourceName,
        _: &'a dlock_runtime::backend::OwnerToken,
    ) -> dlock_runtime::backend::BoxFuture<'a, Result<bool, dlock_runtime::LockError>> {
        Box::pin(async { Err(dlock_runtime::LockError::unavailable("down", None)) })
    }
    fn extend<'a>(
        &'a self,
        _: &'a dlock_runtime::key::ResourceName,
        _: &'a dlock_runtime::backend::OwnerToken,
        _: Duration,
    ) -> dlock_runtime::backend::BoxFuture<'a, Result<bool, dlock_runtime::LockError>> {
        Box::pin(async { Err(dlock_runtime::LockError::unavailable("down", None)) })
    }
    fn abandon<'a>(
        &'a self,
        _: &'a dlock_runtime::key::ResourceName,
        _: &'a dlock_runtime::backend::OwnerToken,
    ) -> dlock_runtime::backend::BoxFuture<'a, Result<(), dlock_runtime::LockError>> {
        Box::pin(async { Err(dlock_runtime::LockError::unavailable("down", None)) })
    }
}

/// A job whose claims find its lock backend down is put back uncounted — and at least
/// `OUTAGE_PAUSE` (10 ms) later, whatever its delay: its step never grows, and with a delay of
/// zero, a lock backend that refuses at once had the workers claim the job in a busy loop for
/// as long as the outage lasted (hundreds of claims in the window below).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_is_not_claimed_in_a_busy_loop_while_its_lock_backend_is_down() {
    let (server, queue) = server_and_queue(
        "outage-pace",
        Duration::from_secs(30),
        Duration::from_secs(60),
    )
    .await;
    let policy = DeferPolicy::new(Duration::ZERO, 2);
    let id = enqueue(&queue, &record_job(&server, 11, "pace"), &policy)
        .await
        .unwrap();
    let worker =
        DurableWorker::new(queue.clone(), Locker::builder().build(Down)).register::<RecordJob>();
    // Claims as fast as the worker can make them, over a window of time (nothing to wait for:
    // the point is how many claims fit in it).
    let start = std::time::Instant::now();
    let mut claims = 0;
    while start.elapsed() < Duration::from_millis(300) {
        claims += worker.run_once().await.unwrap();
    }
    let took = start.elapsed();
    // 10 ms apart as the server's clock counts them, in whole milliseconds: over 9 ms.
    let most = took.as_millis() / 9 + 1;
    assert!(
        (1..=most).contains(&(claims as u128)),
        "{claims} claims in {took:?} (at most {most})"
    );
    assert!(queue.dead_letters().await.unwrap().is_empty());
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Queued);
    assert_eq!(runs(&server, 11).await, 0);
}

/// A worker asked to poll an empty queue with no interval at all waits 10 ms between claims:
/// it claimed in a busy loop before, one claim script per answer (thousands in the window
/// below), for as long as the queue stayed empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_poll_interval_does_not_claim_in_a_busy_loop() {
    let (server, queue) =
        server_and_queue("idle", Duration::from_secs(30), Duration::from_secs(60)).await;
    let scripts = async || -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut server.conn().await)
            .await
            .unwrap();
        info.lines()
            .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
            .filter_map(|l| {
                l.split("calls=")
                    .nth(1)?
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    };
    let worker = DurableWorker::new(queue, server.locker().await)
        .register::<RecordJob>()
        .poll_interval(Duration::ZERO);
    let before = scripts().await;
    let start = std::time::Instant::now();
    let running = run_in_background(worker);
    // The point is how many claims fit in a window of time: nothing to wait for.
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.stop().await;
    let took = start.elapsed();
    let claims = scripts().await - before;
    let most = u64::try_from(took.as_millis() / 10).unwrap() + 2;
    assert!(
        (1..=most).contains(&claims),
        "{claims} claims of an empty queue in {took:?} (at most {most})"
    );
}

/// A job whose type the claiming worker does not know — a rolling deploy: an instance of the
/// new release queued it, one of the old release claimed it — is put back without using up an
/// attempt, and runs (as attempt 1) once a worker that knows the type claims it. One that no
/// worker knows within the grace period is dead-lettered, naming the type; requeued, it runs.
/// Once, each such claim counted as an attempt: a job of a new type queued mid-deploy was
/// dead-lettered after `max_attempts` claims by old instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_of_a_type_the_worker_does_not_know_waits_for_a_worker_that_does() {
    let (server, locker, queue) = start_queue("deploy").await;
    let noted = async || -> HashMap<String, u64> {
        let mut c = server.conn().await;
        c.hgetall("dlock:{jobs:deploy}:unknown").await.unwrap()
    };
    let policy = DeferPolicy::new(Duration::from_millis(5), 2).max_delay(Duration::from_millis(10));
    let id = enqueue(&queue, &record_job(&server, 20, "deploy"), &policy)
        .await
        .unwrap();
    let old_release = DurableWorker::new(queue.clone(), locker.clone())
        .register::<StallJob>()
        .unknown_type_grace(Duration::from_secs(600));
    claims_without_dead_letters("three claims by the old release", &old_release, &queue, 3).await;
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Queued);
    assert_eq!(runs(&server, 20).await, 0);
    let attempts: Option<u32> = server
        .conn()
        .await
        .hget("dlock:{jobs:deploy}:attempts", &id)
        .await
        .unwrap();
    assert_eq!(attempts, Some(0), "the claims used up no attempt");
    assert!(
        noted().await.contains_key(&id),
        "the first such claim is noted"
    );

    let new_release = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();
    wait_for("the job to run", Duration::from_secs(10), async || {
        new_release.run_once().await.unwrap();
        done(&server).await.remove(&20)
    })
    .await;
    assert_completes("the job", Duration::from_secs(5), &queue, &id, "done 20").await;
    let record = done(&server).await.remove(&20).unwrap();
    assert!(record.starts_with("1:"), "ran as attempt 1: {record}");
    assert!(noted().await.is_empty(), "acknowledging clears the note");

    // A type no worker knows within the grace period: dead-lettered, attempts untouched.
    let old_release = old_release.unknown_type_grace(Duration::from_millis(1500));
    let id = enqueue(&queue, &record_job(&server, 21, "deploy"), &policy)
        .await
        .unwrap();
    let dead = run_until_dead_letter("the unknown type's dead letter", &old_release, &queue).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, id);
    assert_eq!(dead[0].attempts, 0);
    let reason = dead[0].reason.clone().unwrap_or_default();
    assert!(
        reason.contains("`record`") && reason.contains("1.5s"),
        "{reason}"
    );
    assert!(noted().await.is_empty(), "dead-lettering clears the note");
    assert!(queue.requeue(&id).await.unwrap());
    wait_for(
        "the requeued job to run",
        Duration::from_secs(10),
        async || {
            new_release.run_once().await.unwrap();
            done(&server).await.remove(&21)
        },
    )
    .await;
    assert_eq!(runs(&server, 21).await, 1);
}

/// A lock backend that refuses for good (an ACL without the lock keys) is not an outage: each
/// claim counts an attempt and the job is dead-lettered after its attempts, with the reason.
/// Put back uncounted as an outage, it was claimed and put back for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_backend_that_refuses_for_good_dead_letters_the_job_after_its_attempts() {
    let (server, queue) =
        server_and_queue("refused", Duration::from_secs(30), Duration::from_secs(60)).await;
    let lock_server = RedisServer::start();
    let url = lock_server.confined_user_url("confined").await;
    let locker = Locker::builder()
        .command_timeout(Duration::from_millis(200))
        .connect(&url)
        .await
        .unwrap();
    let policy = DeferPolicy::new(Duration::from_millis(5), 2).max_delay(Duration::from_millis(10));
    let job = record_job(&server, 11, "refused");
    let id = enqueue(&queue, &job, &policy).await.unwrap();
    let worker = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();
    let dead = run_until_dead_letter("the refused job's dead letter", &worker, &queue).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, id);
    assert_eq!(dead[0].attempts, 2);
    let reason = dead[0].reason.clone().unwrap_or_default();
    assert!(reason.contains("refused"), "{reason}");
    assert_eq!(runs(&server, 11).await, 0);
}

/// A worker whose claims the queue refuses (its user lost the queue's keys) says so once, at
/// `ERROR`, not once per poll, and goes on polling; once the keys are back it says that claims
/// work again (`INFO`, with the count of refused claims) and runs the jobs.
#[test]
fn a_worker_whose_claims_are_refused_says_so_once_and_recovers() {
    let server = RedisServer::start();
    let ((), captured) = capture::capturing_run(async |_| {
        let url = server.user_url("worker").await;
        let queue = DurableQueue::connect(&url, "refused-claims").await.unwrap();
        let worker = DurableWorker::new(queue, server.locker().await)
            .register::<RecordJob>()
            .poll_interval(Duration::from_millis(10));
        server.confine("worker").await;
        let before = server.error_calls("evalsha").await;
        let running = run_in_background(worker);
        wait_for("ten refused claims", Duration::from_secs(20), async || {
            (server.error_calls("evalsha").await >= before + 10).then_some(())
        })
        .await;
        server.unconfine("worker").await;
        let own = DurableQueue::connect(&server.url(), "refused-claims")
            .await
            .unwrap();
        let policy = DeferPolicy::new(Duration::from_millis(5), 3);
        enqueue(&own, &record_job(&server, 1, "refused-claims"), &policy)
            .await
            .unwrap();
        wait_for("the job to run", Duration::from_secs(20), async || {
            done(&server).await.remove(&1)
        })
        .await;
        running.stop().await;
    });
    let said = |level: tracing::Level| {
        captured
            .all()
            .into_iter()
            .filter(|e| e.kind == capture::Kind::Event && e.level == level)
            .filter(|e| e.name.starts_with("dlock job worker"))
            .collect::<Vec<_>>()
    };
    let errors = said(tracing::Level::ERROR);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].name.contains("refuses the claims"), "{errors:?}");
    assert_eq!(errors[0].field("failures"), Some("1"));
    assert!(
        said(tracing::Level::WARN).is_empty(),
        "{:?}",
        said(tracing::Level::WARN)
    );
    let back = captured.events("dlock job worker: claims work again");
    assert_eq!(back.len(), 1, "{back:?}");
    let failures: u64 = back[0].field("failures").unwrap().parse().unwrap();
    assert!(failures >= 10, "{failures}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_killed_mid_job_loses_nothing() {
    let visibility = Duration::from_millis(800);
    let (server, queue) = server_and_queue("crash", visibility, Duration::from_secs(600)).await;
    let url = server.url();
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
    let mut c = server.conn().await;
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

    let locker = server.locker().await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_job_is_a_failed_attempt_and_the_worker_goes_on() {
    let (server, locker, queue) = start_queue("panics").await;
    let policy = DeferPolicy::new(Duration::from_millis(5), 3).max_delay(Duration::from_millis(10));
    let mut bad = record_job(&server, 1, "p1");
    bad.panic_always = true;
    let bad_id = enqueue(&queue, &bad, &policy).await.unwrap();
    enqueue(&queue, &record_job(&server, 2, "p2"), &policy)
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), locker)
        .register::<RecordJob>()
        .batch(4);
    // One batch holds both: the panic is caught, the other job completes.
    assert_eq!(worker.run_once().await.unwrap(), 2);
    assert!(done(&server).await.contains_key(&2));
    let dead = run_until_dead_letter("the panicking job's dead letter", &worker, &queue).await;
    assert_eq!(dead[0].id, bad_id);
    assert_eq!(dead[0].attempts, 3);
    let reason = dead[0].reason.as_deref().unwrap_or_default();
    assert!(
        reason.contains("panicked") && reason.contains("panics on purpose"),
        "{reason}"
    );
    assert_eq!(runs(&server, 1).await, 3, "one run per attempt, then dead");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reaper_dead_letters_a_job_whose_claims_keep_expiring() {
    let (server, queue) = server_and_queue(
        "reaped",
        Duration::from_millis(200),
        Duration::from_secs(60),
    )
    .await;
    let locker = server.locker().await;
    let policy = DeferPolicy::new(Duration::from_millis(5), 2);
    let mut job = record_job(&server, 1, "r1");
    job.hang_always = true; // as a job that kills its worker every time
    let id = queue
        .enqueue(&job, &policy, Duration::from_millis(300), Duration::ZERO)
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), locker)
        .register::<RecordJob>()
        .poll_interval(Duration::from_millis(10));
    // Two workers die mid-job (their task is gone: no heartbeat, no ack, no retry).
    for attempt in 1..=2 {
        let w = worker.clone();
        let task = tokio::spawn(async move { w.run_until(std::future::pending()).await });
        wait_for("the job to start", Duration::from_secs(10), async || {
            (runs(&server, 1).await == attempt).then_some(())
        })
        .await;
        task.abort();
    }
    // The next claim after the deadline reaps it: dead, not a third run.
    let dead = wait_for(
        "the reaper to dead-letter the job",
        Duration::from_secs(10),
        async || {
            let _ = tokio::time::timeout(Duration::from_millis(100), worker.run_once()).await;
            assert!(
                runs(&server, 1).await <= 2,
                "claimed again past max_attempts"
            );
            let d = queue.dead_letters().await.unwrap();
            (!d.is_empty()).then_some(d)
        },
    )
    .await;
    assert_eq!(dead[0].id, id);
    assert!(
        dead[0]
            .reason
            .as_deref()
            .unwrap_or_default()
            .contains("claim expired"),
        "{:?}",
        dead[0].reason
    );
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Dead);
    assert!(queue.is_empty().await.unwrap());
}

/// A stored job that is not UTF-8 (a foreign writer, corruption) is dead-lettered at once as
/// one that does not decode, and the job claimed with it runs; the dead-letter listing shows
/// it. The claim's answer was read as text: one such job failed the whole answer, every time
/// it was sent again — its batch claimed, none of it run, until the claims expired — and the
/// listing failed too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_job_that_is_not_utf8_is_dead_lettered_and_its_batch_runs() {
    let (server, locker, queue) = start_queue("not-utf8").await;
    let policy = DeferPolicy::new(Duration::from_millis(5), 3);
    let good = enqueue(&queue, &record_job(&server, 21, "utf8"), &policy)
        .await
        .unwrap();
    // Behind the queue's back: an envelope with a byte that is not UTF-8, due now.
    let mut envelope = br#"{"type":"record","key":"utf8","max_attempts":3,"delay_ms":5,"max_delay_ms":5,"ttl_ms":5000,"data":{"id":""#.to_vec();
    envelope.extend_from_slice(b"\xff\"}}");
    let mut conn = server.conn().await;
    let _: () = conn
        .hset("dlock:{jobs:not-utf8}:jobs", "bad", envelope)
        .await
        .unwrap();
    let _: () = conn
        .zadd("dlock:{jobs:not-utf8}:due", "bad", 0)
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();
    assert_eq!(worker.run_once().await.unwrap(), 2);
    assert_completes(
        "the good job to run",
        Duration::from_secs(5),
        &queue,
        &good,
        "done 21",
    )
    .await;
    let dead = queue.dead_letters().await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].id, "bad");
    let reason = dead[0].reason.clone().unwrap_or_default();
    assert!(
        reason.contains("does not decode: it is not UTF-8"),
        "{reason}"
    );
}

/// Same name as `RecordJob`, another shape of data: what an older worker finds after a newer
/// release changed the type's fields (or a corrupted payload). Its id is a string that must
/// never reach a log or a dead-letter reason.
#[derive(serde::Serialize, serde::Deserialize)]
struct NotARecord {
    id: String,
}

impl Job for NotARecord {
    const NAME: &'static str = "record";

    fn lock_key(&self) -> Result<dlock_runtime::LockKey, dlock_runtime::LockError> {
        dlock_runtime::LockKey::new("nonsense")
    }

    async fn run(self, _: JobContext) -> Result<(), JobError> {
        unreachable!("never run: the worker decodes it as a RecordJob")
    }
}

/// Data this worker's version of the job type cannot decode may be a newer release's: the job
/// is put back without using an attempt (decoded before its lock is taken, so a busy lock
/// does not count one either), like a job of an unknown type, and dead-lettered only once the
/// grace period is over — with the decode error, but not the value it quoted. Once,
/// it was dead-lettered at its first claim, and the reason quoted the job's data.
#[test]
fn data_the_worker_cannot_decode_waits_for_the_grace_and_its_reason_quotes_no_value() {
    let secret = "sk_live_do_not_log";
    let (reason, captured) = capture::capturing_run(async |_| {
        let (server, locker, queue) = start_queue("corrupt").await;
        let id = queue
            .enqueue(
                &NotARecord {
                    id: secret.to_owned(),
                },
                &DeferPolicy::new(Duration::from_millis(5), 5),
                Duration::from_secs(5),
                Duration::ZERO,
            )
            .await
            .unwrap();
        let worker = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();
        // Its lock is busy: a worker that took the lock before decoding counted an attempt.
        let held = locker.lock("nonsense").acquire().await.unwrap();
        assert_eq!(worker.run_once().await.unwrap(), 1);
        held.release().await.unwrap();
        assert!(
            queue.dead_letters().await.unwrap().is_empty(),
            "dead-lettered at its first claim"
        );
        assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Queued);
        let attempts: Option<u32> = server
            .conn()
            .await
            .hget("dlock:{jobs:corrupt}:attempts", &id)
            .await
            .unwrap();
        assert_eq!(attempts, Some(0), "the claim used up no attempt");

        let impatient = worker.unknown_type_grace(Duration::ZERO);
        let dead =
            run_until_dead_letter("the undecodable job's dead letter", &impatient, &queue).await;
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].id, id);
        dead[0].reason.clone().unwrap_or_default()
    });
    assert!(
        reason.contains("could decode its data as `record`")
            && reason.contains("invalid type, expected u32"),
        "{reason}"
    );
    assert!(!reason.contains(secret), "{reason}");
    let all = captured.all();
    assert!(
        all.iter().any(|e| e.name.contains("cannot run the job")),
        "the first such claim is logged"
    );
    assert!(
        all.iter()
            .flat_map(|e| e.texts())
            .all(|t| !t.contains(secret)),
        "a log quoted the job's data"
    );
}

/// A queue made with "never" for its timeouts (`Duration::MAX` as the visibility timeout and
/// the outcome retention, and a worker's poll interval) runs and acknowledges its jobs: all are
/// bounded. Once, settling a
/// job overflowed the worker's deadline (a panic), and the acknowledgement asked Redis for an
/// expiry it refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_whose_timeouts_say_never_runs_and_acknowledges_its_jobs() {
    let (server, queue) = server_and_queue("never", Duration::MAX, Duration::MAX).await;
    assert_eq!(queue.visibility_timeout(), Duration::from_secs(86_400));
    let locker = server.locker().await;
    let policy = DeferPolicy::new(Duration::from_millis(5), 3);
    let id = enqueue(&queue, &record_job(&server, 40, "never"), &policy)
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();
    assert_eq!(worker.run_once().await.unwrap(), 1);
    assert_completes("the job", Duration::from_secs(5), &queue, &id, "done 40").await;
    // A worker told to poll "never" runs what it claims, then idles — it panicked there, its
    // next claim's time overflowing an `Instant` — and stops when told.
    let id = enqueue(&queue, &record_job(&server, 41, "never"), &policy)
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), locker)
        .register::<RecordJob>()
        .poll_interval(Duration::MAX);
    let running = run_in_background(worker);
    wait_for("the job to complete", Duration::from_secs(10), async || {
        let status = queue.status(&id).await.unwrap();
        matches!(status, JobStatus::Completed { .. }).then_some(())
    })
    .await;
    // Idle now (nothing left to claim), it waits for its next claim, and stops when told.
    running.stop().await;
}

/// An enqueue whose answer is lost — the server runs it after the client stopped waiting — is
/// sent again with the same id: the caller gets the id, and the queue holds one job. Once, the
/// caller got `Unavailable` for a job that was queued, and its retry queued a second: both
/// ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_whose_answer_was_lost_queues_one_job() {
    let (server, queue) = server_and_queue(
        "lost-answer",
        Duration::from_secs(30),
        Duration::from_secs(60),
    )
    .await;
    let policy = DeferPolicy::new(Duration::from_millis(5), 3);
    // A first job loads the enqueue script: the paused enqueue below runs as sent.
    enqueue(&queue, &record_job(&server, 49, "lost"), &policy)
        .await
        .unwrap();
    // Writes wait 1.5 s on the server: the first try runs then, after the client's 1 s
    // command timeout, and the second try, on the same connection, right after it.
    pause_writes(&server, 1500).await;
    let id = enqueue(&queue, &record_job(&server, 50, "lost"), &policy)
        .await
        .expect("queued: the second try is answered");
    assert_eq!(queue.len().await.unwrap(), 2, "one job each, not three");
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Queued);
}

/// A claim whose answer is lost — the server runs it after the worker stopped waiting — is
/// sent again with the same token and answered with the jobs the first try claimed: they run
/// now, as attempt 1. Once, the worker gave up on the claim (`Unavailable`): its jobs stayed claimed by
/// nobody until their claims expired, each having used an attempt without running — a job on
/// its last attempt was dead-lettered as if its worker had died.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_answer_was_lost_runs_its_jobs() {
    let (server, queue) = server_and_queue(
        "lost-claim",
        Duration::from_secs(30),
        Duration::from_secs(60),
    )
    .await;
    let locker = server.locker().await;
    let worker = DurableWorker::new(queue.clone(), locker).register::<RecordJob>();
    // A first claim (of nothing) loads the claim script: the paused one below runs as sent.
    assert_eq!(worker.run_once().await.unwrap(), 0);
    let policy = DeferPolicy::new(Duration::from_millis(5), 1);
    let id = enqueue(&queue, &record_job(&server, 60, "lost-claim"), &policy)
        .await
        .unwrap();
    // Writes wait 1.5 s on the server: the first try runs then, after the 1 s timeout, and the
    // second try, on the same connection, right after it.
    pause_writes(&server, 1500).await;
    let claimed = worker
        .run_once()
        .await
        .expect("the claim is answered by a second try");
    assert_eq!(claimed, 1);
    assert_completes("the job", Duration::from_secs(5), &queue, &id, "done 60").await;
    let record = done(&server).await.remove(&60).unwrap();
    assert!(record.starts_with("1:"), "ran as attempt 1: {record}");
}

/// A worker that runs a job clears its unknown-type note (with its heartbeat), so if that
/// worker dies and an old release claims the job again, the grace period starts afresh. Once,
/// the note of the first claim stayed: the old release's next claim found the grace long over
/// and dead-lettered a job a worker that knew its type had been running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_a_worker_ran_gets_a_fresh_grace_for_an_unknown_type() {
    let (server, queue) =
        server_and_queue("fresh", Duration::from_millis(300), Duration::from_secs(60)).await;
    let locker = server.locker().await;
    let noted = async || -> HashMap<String, u64> {
        let mut c = server.conn().await;
        c.hgetall("dlock:{jobs:fresh}:unknown").await.unwrap()
    };
    let policy = DeferPolicy::new(Duration::from_millis(5), 5).max_delay(Duration::from_millis(10));
    let mut job = record_job(&server, 30, "fresh");
    job.hang_first = true;
    let id = enqueue(&queue, &job, &policy).await.unwrap();
    let grace = Duration::from_millis(800);
    let old_release = DurableWorker::new(queue.clone(), locker.clone())
        .register::<StallJob>()
        .unknown_type_grace(grace);
    let noted_at = std::time::Instant::now();
    assert_eq!(old_release.run_once().await.unwrap(), 1);
    assert!(noted().await.contains_key(&id));

    // The new release claims it (once it is due again) and runs it: its attempt hangs.
    let new_release = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();
    let running = tokio::spawn(async move {
        while new_release.run_once().await.unwrap() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    wait_for(
        "the new release to run the job and clear the note",
        Duration::from_secs(10),
        async || (runs(&server, 30).await == 1 && noted().await.is_empty()).then_some(()),
    )
    .await;
    // The worker dies mid-job; its claim expires.
    running.abort();
    assert!(noted_at.elapsed() > grace, "the first note's grace is over");
    let mut claimed = 0;
    wait_for(
        "the old release to claim it again",
        Duration::from_secs(10),
        async || {
            claimed += old_release.run_once().await.unwrap();
            (claimed > 0).then_some(())
        },
    )
    .await;
    assert!(
        queue.dead_letters().await.unwrap().is_empty(),
        "dead-lettered by a note from before it ran"
    );
    assert!(noted().await.contains_key(&id), "a fresh note");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_worker_cannot_ack_a_job_taken_over_and_stops_working_on_it() {
    let visibility = Duration::from_millis(300);
    let (server, queue) = server_and_queue("stalls", visibility, Duration::from_secs(60)).await;
    let url = server.url();
    let job = StallJob {
        record_url: url.clone(),
        stall_ms: 1500,
        work_ms: 2000,
    };
    let id = queue
        .enqueue(
            &job,
            &DeferPolicy::new(Duration::from_millis(10), 20).max_delay(Duration::from_millis(50)),
            Duration::from_millis(300),
            Duration::ZERO,
        )
        .await
        .unwrap();

    // Worker A: its own current-thread runtime, so the stall freezes all of it (heartbeats and
    // lock renewal included), as a stopped process would be.
    let (a_url, a_done) = (url.clone(), tokio::sync::oneshot::channel::<()>());
    let (a_tx, a_rx) = a_done;
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let queue =
                DurableQueue::connect_with(&a_url, "stalls", visibility, Duration::from_secs(60))
                    .await
                    .unwrap();
            let locker = Locker::from_url(&a_url).await.unwrap();
            let worker = DurableWorker::new(queue, locker).register::<StallJob>();
            assert_eq!(worker.run_once().await.unwrap(), 1);
        });
        let _ = a_tx.send(());
    });
    let mut c = server.conn().await;
    wait_for(
        "worker A to start the job",
        Duration::from_secs(10),
        async || (c.get::<_, Option<u32>>("runs").await.unwrap() == Some(1)).then_some(()),
    )
    .await;

    // Worker B takes the job over once A's claim expires, and is still running it when A wakes.
    let locker = server.locker().await;
    let b = DurableWorker::new(queue.clone(), locker)
        .register::<StallJob>()
        .poll_interval(Duration::from_millis(10));
    let b_task = run_in_background(b);
    wait_for(
        "worker B to take the job over",
        Duration::from_secs(10),
        async || c.get::<_, Option<u32>>("second-started").await.unwrap(),
    )
    .await;
    tokio::time::timeout(Duration::from_secs(10), a_rx)
        .await
        .expect("worker A to give up the job")
        .expect("worker A's thread panicked");
    // A found its heartbeat refused and stopped: it never finished its run, and its claim
    // token could not complete (or re-queue) B's claim.
    assert_eq!(
        c.get::<_, Option<u32>>("first-finished").await.unwrap(),
        None
    );
    assert_eq!(queue.status(&id).await.unwrap(), JobStatus::Running);

    let _: () = c.set("release", 1).await.unwrap();
    assert_completes(
        "B to complete the job",
        Duration::from_secs(10),
        &queue,
        &id,
        "second",
    )
    .await;
    assert_eq!(c.get::<_, u32>("runs").await.unwrap(), 2, "no third run");
    b_task.stop().await;
    assert!(queue.is_empty().await.unwrap());
}

/// A worker cut off from the queue's Redis — its heartbeats fail, none is refused — stops
/// working on its job once the claim may be another worker's (the visibility timeout since the
/// claim, or the latest heartbeat answered, was sent), and gives the job's lock back. Before,
/// only a refused heartbeat stopped it: cut off, it worked on for as long as the cut lasted,
/// keeping the job's lock (renewed through the lock backend it could still reach), so the
/// worker that took the job over found the lock busy until the job was dead-lettered as
/// "lock still busy" — while the first run went on — or, with the lock lost, ran it alongside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_from_the_queue_stops_its_job_when_the_claim_may_be_taken_over() {
    use dlock_tests::proxy::Proxy;
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await.unwrap();
    let visibility = Duration::from_millis(600);
    let queue =
        DurableQueue::connect_with(&proxy.url(), "cut-off", visibility, Duration::from_secs(60))
            .await
            .unwrap();
    let locker = server.locker().await;
    let mut job = record_job(&server, 41, "cut-off");
    job.hang_always = true;
    enqueue(&queue, &job, &DeferPolicy::new(Duration::from_millis(5), 3))
        .await
        .unwrap();
    let worker = DurableWorker::new(queue, locker.clone()).register::<RecordJob>();
    let run = tokio::spawn(async move { worker.run_once().await });
    wait_for("the job to start", Duration::from_secs(10), async || {
        (runs(&server, 41).await == 1).then_some(())
    })
    .await;
    proxy.cut(true);
    // The job hangs for good: only the worker's giving it up ends `run_once`.
    let ran = tokio::time::timeout(visibility * 5, run)
        .await
        .expect("the cut-off worker worked on past its claim's visibility timeout")
        .unwrap();
    assert_eq!(ran.unwrap(), 1);
    let lock = locker
        .lock("record:cut-off")
        .ttl(Duration::from_secs(5))
        .try_acquire()
        .await
        .unwrap();
    assert!(lock.is_some(), "the job's lock was not given back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_refuses_new_jobs_and_loses_none() {
    let (server, locker, queue) = start_queue("bounded").await;
    let queue = queue.with_limits(QueueLimits::default().max_queued(2));
    let policy = DeferPolicy::new(Duration::from_millis(5), 5);
    let ttl = Duration::from_secs(5);
    for i in 1..=2 {
        enqueue(&queue, &record_job(&server, i, &format!("b{i}")), &policy)
            .await
            .unwrap();
    }
    let err = enqueue(&queue, &record_job(&server, 3, "b3"), &policy)
        .await
        .unwrap_err();
    assert!(err.is_queue_full(), "{err}");
    assert_eq!(err.status(), 503);
    assert_eq!(err.retry_after_secs(), Some(1));
    assert_eq!(queue.len().await.unwrap(), 2);
    // `submit` with a busy lock answers the same way.
    let _held = locker.lock("record:b4").acquire().await.unwrap();
    let err = queue
        .submit(&locker, record_job(&server, 4, "b4"), &policy, ttl)
        .await
        .unwrap_err();
    assert!(err.is_queue_full(), "{err}");

    let worker = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();
    wait_for(
        "both queued jobs to run",
        Duration::from_secs(10),
        async || {
            worker.run_once().await.unwrap();
            let d = done(&server).await;
            (d.contains_key(&1) && d.contains_key(&2)).then_some(())
        },
    )
    .await;
    // Room again.
    enqueue(&queue, &record_job(&server, 3, "b3"), &policy)
        .await
        .unwrap();
}

/// A job is refused when its stored form is over `max_job_bytes` — one byte over, not at it —
/// with a 413 that names the sizes, by `enqueue` and by `submit` alike, and nothing is queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_over_the_byte_bound_is_refused_and_nothing_is_queued() {
    let (server, locker, queue) = start_queue("sized").await;
    let policy = DeferPolicy::new(Duration::from_millis(5), 5);
    let job = |id| RecordJob {
        fail_with: Some("x".repeat(2000)),
        ..record_job(&server, id, "sized")
    };
    // Under the default bound it is queued; its stored form is the size the bound counts.
    let id = enqueue(&queue, &job(1), &policy).await.unwrap();
    let stored: String = server
        .conn()
        .await
        .hget("dlock:{jobs:sized}:jobs", &id)
        .await
        .unwrap();
    let size = stored.len();
    assert!(size > 2000, "{size}");

    let at = queue
        .clone()
        .with_limits(QueueLimits::default().max_job_bytes(size));
    enqueue(&at, &job(2), &policy).await.unwrap();
    assert_eq!(queue.len().await.unwrap(), 2);

    let under = queue.with_limits(QueueLimits::default().max_job_bytes(size - 1));
    let err = enqueue(&under, &job(3), &policy).await.unwrap_err();
    assert!(err.is_job_too_large(), "{err}");
    assert_eq!(err.status(), 413);
    assert_eq!(err.retry_after_secs(), None);
    assert_eq!(err.key(), Some("record:sized"));
    let text = err.to_string();
    assert!(
        text.contains(&format!("{size} bytes")) && text.contains(&format!("{} bytes", size - 1)),
        "{text}"
    );
    assert!(err
        .problem_json()
        .contains("urn:dlock:problem:defer-job-too-large"));
    // `submit` with a busy lock answers the same way.
    let _held = locker.lock("record:sized").acquire().await.unwrap();
    let err = under
        .submit(&locker, job(4), &policy, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(err.is_job_too_large(), "{err}");
    assert_eq!(under.len().await.unwrap(), 2, "a refused job was queued");
    let stored: HashMap<String, String> = server
        .conn()
        .await
        .hgetall("dlock:{jobs:sized}:jobs")
        .await
        .unwrap();
    assert_eq!(stored.len(), 2, "a refused job's payload was stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_deleted_after_retention_and_beyond_the_bound() {
    let (server, locker, queue) = start_queue("dlr").await;
    let retention = Duration::from_millis(500);
    let queue = queue.with_limits(
        QueueLimits::default()
            .dead_letter_retention(retention)
            .max_dead_letters(2),
    );
    let policy = DeferPolicy::new(Duration::from_millis(5), 1);
    let worker = DurableWorker::new(queue.clone(), locker).register::<RecordJob>();
    let mut ids = Vec::new();
    for i in 1..=3 {
        let mut job = record_job(&server, i, &format!("d{i}"));
        job.always_fail = true;
        ids.push(enqueue(&queue, &job, &policy).await.unwrap());
        assert_eq!(worker.run_once().await.unwrap(), 1);
    }
    // Three dead letters, bound 2: the next claim deletes the oldest.
    worker.run_once().await.unwrap();
    let dead: Vec<String> = queue
        .dead_letters()
        .await
        .unwrap()
        .into_iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(dead, ids[1..].to_vec());
    assert_eq!(queue.status(&ids[0]).await.unwrap(), JobStatus::Unknown);
    let reason = queue.dead_letters().await.unwrap()[0].reason.clone();
    assert!(
        reason
            .as_deref()
            .unwrap_or_default()
            .contains("always fails"),
        "{reason:?}"
    );

    // Past the retention, the rest go, payload and bookkeeping included.
    wait_for(
        "dead letters to expire",
        Duration::from_secs(10),
        async || {
            worker.run_once().await.unwrap();
            queue.dead_letters().await.unwrap().is_empty().then_some(())
        },
    )
    .await;
    let mut c = server.conn().await;
    for hash in ["jobs", "attempts", "reasons", "claims"] {
        let n: usize = c.hlen(format!("dlock:{{jobs:dlr}}:{hash}")).await.unwrap();
        assert_eq!(n, 0, "{hash} still holds entries");
    }
    assert_eq!(queue.status(&ids[2]).await.unwrap(), JobStatus::Unknown);
}

// ---- the attribute ---------------------------------------------------------------------

#[dlock_runtime::distributed_lock(key = "mail:<user>", on_fail = "defer", delay = "20ms", max_attempts = 50, locker = locker)]
async fn send_mail(locker: Locker, user: u64, sent: mpsc::UnboundedSender<u64>) {
    sent.send(user).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attribute_defers_when_busy() {
    let server = RedisServer::start();
    let locker = server.locker().await;
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

/// The durable queue's connection to one server is replaced when it goes silent (a partition,
/// a load balancer or NAT that forgot it: no reset, no close): a command that timed out has it
/// checked with a `PING`, and it is made anew if that gets no answer either. Before, every
/// queue command — enqueues, workers' claims and heartbeats — timed out until the kernel gave
/// up on the socket, many minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_queue_connection_gone_silent_is_replaced() {
    use dlock_tests::proxy::Proxy;
    use dlock_tests::wait::poll_until;
    use std::time::Instant;
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await.unwrap();
    let queue = DurableQueue::connect(&proxy.url(), "silent").await.unwrap();
    assert_eq!(queue.len().await.unwrap(), 0);

    proxy.silence();
    let err = queue
        .len()
        .await
        .expect_err("a command on a silent connection succeeded");
    assert!(err.is_unavailable(), "{err}");
    let silenced = Instant::now();
    poll_until(
        Duration::from_secs(15),
        Duration::from_millis(20),
        async || match queue.len().await {
            Ok(n) => Ok(n),
            Err(e) => {
                assert!(e.is_unavailable(), "{e}");
                Err(format!("still on the silent connection: {e}"))
            }
        },
    )
    .await;
    // The queue's 1 s command timeout: the check's `PING`, then the next command.
    let took = silenced.elapsed();
    assert!(took < Duration::from_secs(4), "back after {took:?}");
}

/// `with_replicas(1)` on one server with a replica: an enqueue counts once the replica has the
/// job (a `WAIT` after it, on the connection that carried it); while the replica is frozen, an
/// enqueue fails as unavailable and leaves no job behind. Before, an enqueue counted once the
/// master had the job, and a failover to a replica that had not received it lost a job that
/// `enqueue` had answered `Ok`. See [`dlock_tests::jobs::enqueue_waits_for_the_replica`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_enqueue_with_replicas_counts_once_the_replica_has_the_job() {
    let master = RedisServer::start();
    let port = master.port().to_string();
    let replica = std::cell::RefCell::new(RedisServer::start_with(&[
        "--replicaof",
        "127.0.0.1",
        &port,
    ]));
    let replica_port = replica.borrow().port();
    dlock_tests::jobs::enqueue_waits_for_the_replica(
        &master.url(),
        "acked",
        async |jobs, id| {
            let mut c = redis::Client::open(format!("redis://127.0.0.1:{replica_port}"))
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            c.hexists(jobs, id).await.unwrap()
        },
        || replica.borrow_mut().pause(),
        || replica.borrow_mut().resume(),
        async |jobs| master.conn().await.hlen(jobs).await.unwrap(),
    )
    .await;
}

/// A job that never ends (an upstream call without a timeout) holds one of the worker's slots,
/// not the worker: a job enqueued after it runs and completes while it hangs. Before, the
/// worker ran a batch to its end before it claimed again, so nothing else ever ran on that
/// instance. With `job_timeout`, the hung job is stopped and counts as a failed attempt
/// (dead-lettered after its last, with the reason), and the worker's shutdown returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_never_ends_holds_a_slot_not_the_worker() {
    use dlock_tests::jobs::run_in_background;

    let (server, locker, queue) = start_queue("hung").await;
    let policy = DeferPolicy::new(Duration::from_millis(20), 1);
    let ttl = Duration::from_secs(5);
    let mut hung = record_job(&server, 1, "h1");
    hung.hang_always = true;
    let hung_id = queue
        .enqueue(&hung, &policy, ttl, Duration::ZERO)
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), locker.clone())
        .register::<RecordJob>()
        .poll_interval(Duration::from_millis(10))
        .job_timeout(Duration::from_secs(3));
    let running = run_in_background(worker);
    wait_for(
        "the hung job to start",
        Duration::from_secs(10),
        async || (queue.status(&hung_id).await.unwrap() == JobStatus::Running).then_some(()),
    )
    .await;
    let next = queue
        .enqueue(&record_job(&server, 2, "h2"), &policy, ttl, Duration::ZERO)
        .await
        .unwrap();
    let done = wait_for(
        "a job enqueued while another hangs to complete",
        Duration::from_secs(2),
        async || match queue.status(&next).await.unwrap() {
            s @ JobStatus::Completed { .. } => Some(s),
            _ => None,
        },
    )
    .await;
    assert_eq!(
        done,
        JobStatus::Completed {
            result: Some("done 2".into())
        }
    );
    assert_eq!(
        queue.status(&hung_id).await.unwrap(),
        JobStatus::Running,
        "still within its limit"
    );
    // Past its limit: stopped, and (its one attempt used) dead-lettered with the reason.
    let dead = wait_for(
        "the hung job stopped",
        Duration::from_secs(10),
        async || {
            let dead = queue.dead_letters().await.unwrap();
            dead.into_iter().find(|j| j.id == hung_id)
        },
    )
    .await;
    let reason = dead.reason.unwrap_or_default();
    assert!(reason.contains("ran longer than its 3s limit"), "{reason}");
    tokio::time::timeout(Duration::from_secs(5), running.stop())
        .await
        .expect("the worker stops");
    // Its lock was released with it.
    let lock = locker.lock("record:h1").try_acquire().await.unwrap();
    assert!(lock.is_some(), "the stopped job's lock is still held");
}

/// A durable job put back after a busy attempt waits the next attempt's step, as
/// `DeferPolicy` documents and the in-process queue does ("attempt n waits delay · 2ⁿ⁻¹", with
/// equal jitter): after attempt 1, between 10 and 20 s for a 10 s delay. Before, it waited
/// attempt 1's step again (5–10 s), every step half the documented one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_retry_waits_the_next_attempts_step() {
    let (server, locker, queue) = start_queue("steps").await;
    let policy = DeferPolicy::new(Duration::from_secs(10), 3);
    let _held = locker.lock("record:s1").acquire().await.unwrap();
    let id = queue
        .enqueue(
            &record_job(&server, 1, "s1"),
            &policy,
            Duration::from_secs(5),
            Duration::ZERO,
        )
        .await
        .unwrap();
    let worker = DurableWorker::new(queue.clone(), locker.clone()).register::<RecordJob>();
    assert_eq!(
        worker.run_once().await.unwrap(),
        1,
        "claimed, its lock busy"
    );
    let due_ms: f64 = server
        .query(redis::cmd("ZSCORE").arg("dlock:{jobs:steps}:due").arg(&id))
        .await;
    let (secs, micros): (u64, u64) = server.query(&redis::cmd("TIME")).await;
    let now_ms = (secs * 1000 + micros / 1000) as f64;
    let wait = Duration::from_millis((due_ms - now_ms).max(0.0) as u64);
    assert!(
        wait >= Duration::from_millis(9_900) && wait <= Duration::from_secs(20),
        "put back for {wait:?} after attempt 1 of a 10 s policy"
    );
}

/// A job whose data does not serialize (serde_json refuses a map with non-string keys) is
/// refused as what it is — a 500 no retry changes — not as an outage (503 with `Retry-After`)
/// that callers and HTTP clients would retry for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_does_not_serialize_is_not_an_outage() {
    use dlock_runtime::durable::{Job, JobContext, JobError};
    use std::collections::HashMap;

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Unserializable {
        by_pair: HashMap<(u8, u8), u8>,
    }
    impl Job for Unserializable {
        const NAME: &'static str = "unserializable";
        fn lock_key(&self) -> Result<dlock_runtime::LockKey, dlock_runtime::LockError> {
            dlock_runtime::LockKey::new("unserializable")
        }
        async fn run(self, _: JobContext) -> Result<(), JobError> {
            Ok(())
        }
    }

    let (_server, _locker, queue) = start_queue("unserializable").await;
    let job = Unserializable {
        by_pair: HashMap::from([((1, 2), 3)]),
    };
    let policy = DeferPolicy::new(Duration::from_secs(1), 3);
    let err = queue
        .enqueue(&job, &policy, Duration::from_secs(5), Duration::ZERO)
        .await
        .expect_err("a job serde_json cannot write was queued");
    assert!(err.is_misconfigured(), "{err}");
    assert_eq!(err.status(), 500);
}
