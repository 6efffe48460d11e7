//! The Redis backend against real `redis-server` processes: what it leaves on the server and
//! how it hands a lock over (one key per lock, nothing published when nobody waits, direct
//! handoff to the first waiter, fencing across keys and a lost counter), and under faults: a
//! server that dies mid-hold and comes back, a server that stops answering, nothing listening
//! at all, a cut connection, and a second OS process contending for the same lock.

use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::backend::RedisBackend;
use dlock_runtime::{LockError, Locker, OnFail, RetryPolicy};
use dlock_tests::redis_server::free_port;
use dlock_tests::wait::{
    acknowledged_again, poll_until, refused_at_once, taken_once_back, wait_for, wait_until_free,
    Deadline,
};
use dlock_tests::RedisServer;
use redis::AsyncCommands;

#[path = "observability/capture.rs"]
#[allow(dead_code)]
mod capture;

/// A lease no test here outlives.
const LONG: Duration = Duration::from_secs(30);

fn fast_fail() -> dlock_runtime::LockerBuilder {
    Locker::builder().command_timeout(Duration::from_millis(200))
}

/// A server and a [`fast_fail`] locker on it.
async fn fast_fail_server() -> (RedisServer, Locker) {
    let server = RedisServer::start();
    let locker = fast_fail().connect(&server.url()).await.unwrap();
    (server, locker)
}

/// Awaits `attempt`, which must fail as unavailable in less than `limit`; returns the error.
async fn unavailable_within<T: std::fmt::Debug>(
    limit: Duration,
    attempt: impl std::future::Future<Output = Result<T, LockError>>,
) -> LockError {
    let start = Instant::now();
    let err = attempt.await.unwrap_err();
    let took = start.elapsed();
    assert!(err.is_unavailable(), "{err}");
    assert!(took < limit, "took {took:?}, limit {limit:?}");
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_killed_mid_hold_reports_loss_and_recovers_after_restart() {
    let (mut server, locker) = fast_fail_server().await;
    let ttl = Duration::from_millis(1000);
    let guard = locker
        .lock("fault:restart")
        .ttl(ttl)
        .acquire()
        .await
        .unwrap();

    server.stop();
    let start = Instant::now();
    tokio::time::timeout(ttl + Duration::from_secs(1), guard.lost())
        .await
        .expect("loss reported once renewals fail for a whole lease");
    assert!(!guard.is_held());
    let lost_after = start.elapsed();
    // The local lease ends within a TTL of the stop (the lock was taken before it); the rest
    // is the watchdog's wake-up on a loaded machine.
    assert!(
        lost_after <= ttl + Duration::from_millis(500),
        "{lost_after:?}"
    );
    drop(guard);

    server.restart();
    // The connection comes back on its own; the key was lost with the server's memory.
    let g = taken_once_back(
        &locker,
        "fault:restart",
        Duration::from_secs(10),
        Duration::from_millis(50),
    )
    .await;
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_server_gives_a_typed_error_within_the_deadline() {
    let (mut server, locker) = fast_fail_server().await;
    server.pause();

    for on_fail in [OnFail::Reject, OnFail::retry(Duration::from_secs(30))] {
        // 700 ms: the 200 ms deadline and scheduling slack.
        let acquire = locker.lock("fault:hung").on_fail(on_fail).acquire();
        let err = unavailable_within(Duration::from_millis(700), acquire).await;
        assert_eq!(err.status(), 503);
        assert!(err.retry_after_secs().is_some());
    }

    server.resume();
    let g = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        async || locker.lock("fault:hung").try_acquire().await,
    )
    .await;
    // The abandoned attempts above must not have left the lock held.
    let g = g.expect("lock left held by an abandoned attempt");
    g.release().await.unwrap();
}

/// `RetryPolicy::through_outages`: a waiter keeps waiting while the server is frozen (its
/// attempts queue up unanswered, and run when it thaws) or killed and restarted, and gets the
/// lock once the server answers — one holder, given back by one release. A deadline that passes
/// during the outage is a 503, and what the unanswered attempts took is given back once the
/// server is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_through_outages_rides_out_a_frozen_and_a_restarted_server() {
    let (mut server, locker) = fast_fail_server().await;
    let other = fast_fail().connect(&server.url()).await.unwrap();
    let through = |wait| OnFail::Retry(RetryPolicy::new(wait).through_outages(true));
    for (round, kill) in [(0, false), (1, true)] {
        let key = format!("fault:through:{round}");
        if kill {
            server.stop();
        } else {
            server.pause();
        }
        let mut waiter = tokio::spawn({
            let (locker, key, on_fail) = (locker.clone(), key.clone(), through(LONG));
            async move { locker.lock(&key).ttl(LONG).on_fail(on_fail).acquire().await }
        });
        // Without the opt-in, the same wait ends at the first outage answer.
        let plain = locker
            .lock("fault:through:plain")
            .on_fail(OnFail::retry(LONG));
        unavailable_within(Duration::from_millis(700), plain.acquire()).await;
        // Five command timeouts later the waiter through outages is still waiting.
        let still = tokio::time::timeout(Duration::from_secs(1), &mut waiter).await;
        assert!(
            still.is_err(),
            "round {round}: the waiter gave up: {still:?}"
        );
        if kill {
            server.restart();
        } else {
            server.resume();
        }
        let guard = tokio::time::timeout(Duration::from_secs(15), waiter)
            .await
            .expect("the waiter was not served once the server was back")
            .unwrap()
            .expect("the waiter through outages gave up");
        // The other locker's connection comes back on its own use.
        let answered = async || other.lock(&key).try_acquire().await;
        let taken = poll_until(Duration::from_secs(10), Duration::from_millis(20), answered).await;
        assert!(taken.is_none(), "round {round}: a second owner got in");
        guard.release().await.unwrap();
        let free = other.lock(&key).try_acquire().await.unwrap();
        free.expect("one release did not free the lock")
            .release()
            .await
            .unwrap();
    }

    // A deadline during the outage: 503, not a timeout; the attempts that ran when the server
    // thawed took the lock for the waiter's token, and the undo gives it back.
    server.pause();
    let key = "fault:through:deadline";
    let wait = Duration::from_millis(800);
    let err = locker
        .lock(key)
        .ttl(LONG)
        .on_fail(through(wait))
        .acquire()
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    server.resume();
    let back = Deadline::after(Duration::from_secs(5));
    let why = "the lock the unanswered attempts took was not given back (30 s TTL)";
    wait_until_free(&other, key, &back, Duration::from_millis(20), why).await;
}

/// A server that refuses for good — an ACL that denies every lock key, a wrong password —
/// answers `Misconfigured` (500), not `Unavailable` (503): no outage to ride out, so a wait
/// through outages ends with it at once instead of retrying until its deadline (it did: an
/// ACL mistake held every such request for its whole wait, as a 503 that said "try again").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_for_good_is_misconfigured_and_ends_a_wait_through_outages_at_once() {
    let server = RedisServer::start();
    let url = server.confined_user_url("confined").await;
    let locker = fast_fail().connect(&url).await.unwrap();
    refused_at_once(&locker, "refused:k").await;

    // A wrong password is refused at connect, without the password in the error (within the
    // default timeouts: the client tries to sign in three times before it answers).
    let wrong = url.replace(":pw@", ":not-the-pw@");
    let err = Locker::builder().connect(&wrong).await.unwrap_err();
    assert!(err.is_misconfigured(), "{err}");
    assert!(!format!("{err:?}").contains("not-the-pw"), "{err:?}");
    // Also with timeouts shorter than the client's three sign-in tries take.
    dlock_tests::wait::refused_at_connect(&wrong, &[200, 50], &["not-the-pw"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_server_gives_a_typed_error_within_the_deadline() {
    let (mut server, locker) = fast_fail_server().await;
    server.stop();
    let acquire = locker.lock("fault:stopped").acquire();
    unavailable_within(Duration::from_millis(700), acquire).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_listening_at_connect_is_a_typed_error() {
    let url = format!("redis://127.0.0.1:{}", free_port());
    unavailable_within(Duration::from_secs(3), fast_fail().connect(&url)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn url_password_never_appears_in_errors() {
    let port = free_port();
    let err = fast_fail()
        .connect(&format!("redis://user:s3cr3t-pw@127.0.0.1:{port}"))
        .await
        .unwrap_err();
    let shown = format!("{err} {err:?}");
    assert!(!shown.contains("s3cr3t-pw"), "{shown}");
}

/// Two OS processes (this one and a child) plus tasks in each: zero overlaps, no lost update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_os_process_contends_without_overlap() {
    let server = RedisServer::start();
    let url = server.url();
    let key = "fault:xproc";
    let rounds_child = 30u64;
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dlock-contender"))
        .args([url.as_str(), key, &rounds_child.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn dlock-contender");

    let locker = Locker::from_url(&url).await.unwrap();
    let conn = server.conn().await;
    let overlaps = Arc::new(AtomicU64::new(0));
    let rounds_here = 30u64;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (locker, mut conn, overlaps) = (locker.clone(), conn.clone(), overlaps.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds_here {
                let g = locker
                    .lock(key)
                    .ttl(Duration::from_secs(10))
                    .on_fail(OnFail::retry(Duration::from_secs(60)))
                    .acquire()
                    .await
                    .unwrap();
                let inside: i64 = conn.incr(format!("{key}:inside"), 1).await.unwrap();
                if inside != 1 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                let v: i64 = conn.get(format!("{key}:counter")).await.unwrap_or(0);
                tokio::task::yield_now().await;
                let _: () = conn.set(format!("{key}:counter"), v + 1).await.unwrap();
                let _: i64 = conn.decr(format!("{key}:inside"), 1).await.unwrap();
                g.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let out = child.wait_with_output().await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("overlaps=0"),
        "child saw overlaps: {stdout}"
    );
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "overlaps in this process"
    );
    let mut conn = conn;
    let total: u64 = conn.get(format!("{key}:counter")).await.unwrap();
    assert_eq!(total, 4 * rounds_here + 4 * rounds_child, "lost updates");
}

/// A waiter that fails while the server is frozen (its refresh errors out) must not stay at
/// the head of the queue once the server is back: its undo is retried in the background until
/// it lands, well before its queue entry would have expired on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_cut_off_by_an_outage_leaves_the_queue_when_the_server_is_back() {
    let mut server = RedisServer::start();
    let waiter_ttl = Duration::from_secs(3);
    let builder = || fast_fail().waiter_ttl(waiter_ttl);
    let a = builder().connect(&server.url()).await.unwrap();
    let b = builder().connect(&server.url()).await.unwrap();
    let key = "fault:cut-waiter";
    let held = a.lock(key).ttl(LONG).acquire().await.unwrap();
    let waiter = {
        let b = b.clone();
        tokio::spawn(async move {
            let retry = OnFail::retry(LONG);
            b.lock(key).ttl(LONG).on_fail(retry).acquire().await
        })
    };
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(5),
        async || {
            (b.waiting() != 0)
                .then_some(())
                .ok_or("the waiter never queued")
        },
    )
    .await;
    // The waiter refreshes its place every second; freeze the server across that refresh.
    server.pause();
    let err = waiter.await.unwrap().unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    server.resume();
    let resumed = Deadline::after(Duration::from_millis(1500));
    // The holder's own renewals may have failed while frozen; release whatever is left.
    drop(held);
    // A one-shot attempt respects the queue: it succeeds only once the dead waiter is gone.
    let why = format!("the cut-off waiter still holds the queue (its entry lives {waiter_ttl:?})");
    wait_until_free(&a, key, &resumed, Duration::from_millis(10), &why).await;
}

/// `release()` during an outage returns the error and is not given up: once the server
/// answers again, the background task finishes it, long before the lease would have ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_during_an_outage_is_finished_once_the_server_is_back() {
    let (mut server, locker) = fast_fail_server().await;
    let other = fast_fail().connect(&server.url()).await.unwrap();
    let key = "fault:release-outage";
    let guard = locker.lock(key).ttl(LONG).acquire().await.unwrap();

    server.pause();
    let err = guard.release().await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    server.resume();

    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || {
            match other.lock(key).try_acquire().await {
                Ok(Some(g)) => {
                    g.release().await.unwrap();
                    return Ok(());
                }
                Ok(None) => {}
                Err(e) => assert!(e.is_unavailable(), "{e}"),
            }
            Err("the key is still held after the server came back (30 s TTL)")
        },
    )
    .await;
}

/// Release notifications published while the connection was down are missed; after the
/// reconnect every local waiter re-checks at once instead of sleeping out its fallback timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_recheck_after_a_reconnect() {
    let mut server = RedisServer::start();
    let slow = || {
        fast_fail()
            .waiter_ttl(Duration::from_secs(60))
            .command_timeout(Duration::from_millis(500))
    };
    let holder = slow().connect(&server.url()).await.unwrap();
    let waiter = slow().connect(&server.url()).await.unwrap();
    let counter = waiter.clone();
    let key = "fault:reconnect-wake";
    let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
    let evalsha_before = evalsha_calls(&server).await;
    // Fallback timer 20 s (no jitter) and a 60 s lease, so the waiter's queue refresh is 20 s
    // too: only a wake-up can make this quick.
    let policy = RetryPolicy::new(Duration::from_secs(60))
        .backoff(Duration::from_secs(20), Duration::from_secs(20))
        .jitter(false);
    let wait = tokio::spawn(async move {
        waiter
            .lock(key)
            .ttl(Duration::from_secs(60))
            .on_fail(OnFail::Retry(policy))
            .acquire()
            .await
    });
    // Before the outage: queued, subscribed (counted in `waiting`), and done with the attempt
    // that follows the subscription (its second acquire script call), so it is asleep.
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(5),
        async || {
            let asleep =
                counter.waiting() != 0 && evalsha_calls(&server).await >= evalsha_before + 2;
            asleep.then_some(()).ok_or("never queued")
        },
    )
    .await;
    std::mem::forget(held); // the server's restart takes the lock away
    server.restart();
    let restarted = Instant::now();
    let guard = tokio::time::timeout(Duration::from_secs(8), wait)
        .await
        .expect("the waiter slept through the reconnect")
        .unwrap()
        .unwrap();
    assert!(
        restarted.elapsed() < Duration::from_secs(8),
        "{:?}",
        restarted.elapsed()
    );
    guard.release().await.unwrap();
}

/// An unsubscribe that timed out (the server froze past the command timeout) but that the
/// server ran once it woke leaves the channel counted as unsubscribed: the key's next waiter
/// subscribes again, and hears the release that hands it the lock. Before, the channel stayed
/// in the backend's set while the server had dropped it, and every later waiter of the key
/// slept through its handoffs until its fallback timer.
#[test]
fn a_waiter_after_an_unsubscribe_that_timed_out_is_subscribed() {
    let mut server = RedisServer::start();
    capture::capturing_run(async |captured| {
        let slow = || {
            fast_fail()
                .waiter_ttl(Duration::from_secs(60))
                .command_timeout(Duration::from_millis(300))
        };
        let holder = slow().connect(&server.url()).await.unwrap();
        let waiter = slow().connect(&server.url()).await.unwrap();
        let key = "fault:unsubscribe-timed-out";
        let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
        // Fallback timer 20 s (no jitter): only the release's push makes the second waiter quick.
        let policy = RetryPolicy::new(Duration::from_secs(60))
            .backoff(Duration::from_secs(20), Duration::from_secs(20))
            .jitter(false);
        let spawn_waiter = || {
            let (waiter, policy) = (waiter.clone(), policy.clone());
            tokio::spawn(async move {
                waiter
                    .lock(key)
                    .ttl(LONG)
                    .on_fail(OnFail::Retry(policy))
                    .acquire()
                    .await
            })
        };
        let calls = evalsha_calls(&server).await;
        let first = spawn_waiter();
        asleep(&server, &waiter, calls).await;
        assert_eq!(
            channels(&server).await.len(),
            1,
            "the first waiter subscribed"
        );

        // The first waiter leaves while the server is frozen: its unsubscribe times out. The
        // server wakes before the check's PING does, so the connection is kept.
        server.pause();
        first.abort();
        wait_for(
            "the unsubscribe to time out",
            Duration::from_secs(5),
            async || {
                let given_up = ["redis unsubscribe timed out", "redis unsubscribe failed"]
                    .iter()
                    .any(|e| !captured.events(e).is_empty());
                given_up.then_some(())
            },
        )
        .await;
        server.resume();
        poll_until(
            Duration::from_secs(5),
            Duration::from_millis(5),
            async || {
                let dropped = channels(&server).await.is_empty() && waiter.waiting() == 0;
                dropped
                    .then_some(())
                    .ok_or("the server still has the subscription")
            },
        )
        .await;

        let calls = evalsha_calls(&server).await;
        let second = spawn_waiter();
        asleep(&server, &waiter, calls).await;
        assert_eq!(
            channels(&server).await.len(),
            1,
            "the second waiter is not subscribed: the channel still counted as subscribed"
        );
        held.release().await.unwrap();
        let guard = tokio::time::timeout(Duration::from_secs(5), second)
            .await
            .expect("the second waiter slept through the release")
            .unwrap()
            .unwrap();
        guard.release().await.unwrap();
    });
}

/// The channels the server has subscribers on.
async fn channels(server: &RedisServer) -> Vec<String> {
    server
        .query(redis::cmd("PUBSUB").arg("CHANNELS").arg("*"))
        .await
}

/// Waits until `waiter` has a waiter queued, subscribed (counted in `waiting`) and done with
/// the attempt after its subscription (its second script call since `calls_before`): asleep.
async fn asleep(server: &RedisServer, waiter: &Locker, calls_before: u64) {
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(5),
        async || {
            let asleep = waiter.waiting() != 0 && evalsha_calls(server).await >= calls_before + 2;
            asleep.then_some(()).ok_or("never queued")
        },
    )
    .await;
}

/// A wait for `key` (held by another client) on `waiter` with a lease of `ttl`, through
/// outages — woken while the server does not answer, its attempt fails, and it waits on
/// rather than answering 503 — with a 10 s backoff; spawned, and returned once asleep.
async fn patient_wait(
    server: &RedisServer,
    waiter: &Locker,
    key: &'static str,
    ttl: Duration,
) -> tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, LockError>> {
    let calls_before = evalsha_calls(server).await;
    let policy = RetryPolicy::new(Duration::from_secs(30))
        .backoff(Duration::from_secs(10), Duration::from_secs(10))
        .jitter(false)
        .through_outages(true);
    let wait = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            let retry = OnFail::Retry(policy);
            waiter.lock(key).ttl(ttl).on_fail(retry).acquire().await
        })
    };
    asleep(server, waiter, calls_before).await;
    wait
}

/// How many script calls (`EVALSHA`) the server has run.
async fn evalsha_calls(server: &RedisServer) -> u64 {
    server.calls("evalsha").await
}

/// An idempotency `begin` whose reply is lost (the server ran it, the connection died) is
/// undone in the background for as long as the request's lease could hold the key — not just
/// the locker's default TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_idempotency_begin_is_undone_within_the_requests_ttl() {
    use dlock_runtime::idempotency::{Begin, Fingerprint};
    use dlock_tests::proxy::Proxy;

    let mut server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await.unwrap();
    // A short default lease and waiter entry: the old give-up horizon of the undo.
    let short = || {
        fast_fail()
            .default_ttl(Duration::from_millis(300))
            .waiter_ttl(Duration::from_millis(300))
    };
    let locker = short().connect(&proxy.url()).await.unwrap();
    let other = short().connect(&server.url()).await.unwrap();
    let key = "fault:idem-dropped-begin";
    let fp = || Fingerprint::builder().field("POST /pay").finish();

    // Scripts loaded, so the begin below is one EVALSHA the server can run later.
    match locker
        .idempotency("fault:warm-up", fp())
        .begin()
        .await
        .unwrap()
    {
        Begin::Run(op) => op.abort().await.unwrap(),
        other => panic!("unexpected {other:?}"),
    }
    // The begin reaches the (paused) server; its caller gives up; the connection dies and
    // stays down, so the background undo fails until the network is back.
    server.pause();
    let begin = locker
        .idempotency(key, fp())
        .ttl(Duration::from_secs(20))
        .begin();
    assert!(
        tokio::time::timeout(Duration::from_millis(100), begin)
            .await
            .is_err(),
        "begin cannot finish while the server is paused"
    );
    proxy.cut(true);
    server.resume(); // runs the begin: the key is locked for 20 s
    assert!(
        matches!(
            other.idempotency(key, fp()).begin().await,
            Ok(Begin::InProgress { .. })
        ),
        "the begin ran on the server"
    );
    // The outage outlasts the locker's default TTL: time passing is the point here.
    tokio::time::sleep(Duration::from_millis(800)).await;
    proxy.allow();

    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || {
            match other.idempotency(key, fp()).begin().await {
                Ok(Begin::Run(op)) => {
                    op.abort().await.unwrap();
                    return Ok(());
                }
                Ok(Begin::InProgress { .. }) => {}
                Ok(other) => panic!("unexpected {other:?}"),
                Err(e) => assert!(e.is_unavailable(), "{e}"),
            }
            Err("the key is still held after the network came back (20 s lease)")
        },
    )
    .await;
}

/// An uncontended lock costs one script call to take and one to give back, leaves nothing on
/// the server but the namespace's fencing counter, and publishes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncontended_locks_leave_no_keys_and_publish_nothing() {
    let server = RedisServer::start();
    let locker = server.locker().await;
    let before = evalsha_calls(&server).await;
    for i in 0..20 {
        let g = locker
            .lock(format!("quiet:{i}"))
            .try_acquire()
            .await
            .unwrap()
            .expect("uncontended");
        g.release().await.unwrap();
    }
    assert_eq!(
        evalsha_calls(&server).await - before,
        40,
        "one script per step"
    );
    assert_eq!(server.calls("publish").await, 0, "nobody waited");
    let mut keys: Vec<String> = server.query(redis::cmd("KEYS").arg("*")).await;
    let mut expected = vec![format!("{}:fence", locker.prefix()), "dlock:issuers".into()];
    keys.sort();
    expected.sort();
    assert_eq!(keys, expected, "the counter and the issuer numbers only");
}

/// A server that lost its scripts (a restart without persistence, a failover, `SCRIPT
/// FLUSH`) answers a script call `NOSCRIPT`: the call loads its script (`SCRIPT LOAD`) and is
/// sent once more — every step of a lock (acquire, extend, release), a semaphore's, and a
/// read-only inspection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_lost_its_scripts_is_given_them_again() {
    let server = RedisServer::start();
    let locker = server.locker().await;
    // Empties the server's script cache; answers how many scripts it had loaded so far.
    let flush = || async {
        let _: () = server.query(redis::cmd("SCRIPT").arg("FLUSH")).await;
        server.calls("script|load").await
    };
    let server = &server;
    let loaded_since = |before: u64| async move { server.calls("script|load").await - before };

    let before = flush().await;
    let guard = locker
        .lock("lost:scripts")
        .try_acquire()
        .await
        .unwrap()
        .expect("acquired after the flush");
    assert_eq!(loaded_since(before).await, 1, "the acquire script loaded");
    let before = flush().await;
    guard.extend(LONG).await.unwrap();
    assert_eq!(loaded_since(before).await, 1, "the extend script loaded");
    let before = flush().await;
    let state = locker
        .admin()
        .unwrap()
        .inspect("lost:scripts")
        .await
        .unwrap();
    assert!(
        state.holder.is_some(),
        "inspected after the flush: {state:?}"
    );
    assert_eq!(loaded_since(before).await, 1, "the inspect script loaded");
    let before = flush().await;
    guard.release().await.unwrap();
    assert_eq!(loaded_since(before).await, 1, "the release script loaded");
    let again = locker.lock("lost:scripts").try_acquire().await.unwrap();
    again
        .expect("released after the flush")
        .release()
        .await
        .unwrap();
    let before = flush().await;
    let permit = locker
        .semaphore("lost:permits", 2)
        .try_acquire()
        .await
        .unwrap()
        .expect("a permit after the flush");
    assert_eq!(
        loaded_since(before).await,
        1,
        "the semaphore's script loaded"
    );
    permit.release().await.unwrap();
}

/// The backoff of a waiter whose own timer cannot fire within a test.
const NEVER: Duration = Duration::from_secs(20);

/// Starts a waiter for `key` on `waiter` that retries every `backoff` (queue refresh: a third
/// of the locker's waiter TTL).
fn spawn_waiter(
    waiter: &Locker,
    key: &'static str,
    (ttl, auto_renew): (Duration, bool),
    backoff: Duration,
) -> tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, LockError>> {
    let policy = RetryPolicy::new(Duration::from_secs(60))
        .backoff(backoff, backoff)
        .jitter(false);
    let w = waiter.clone();
    tokio::spawn(async move {
        w.lock(key)
            .ttl(ttl)
            .auto_renew(auto_renew)
            .on_fail(OnFail::Retry(policy))
            .acquire()
            .await
    })
}

/// [`spawn_waiter`], returning once the waiter is queued and asleep.
async fn queued_waiter(
    server: &RedisServer,
    waiter: &Locker,
    key: &'static str,
    (ttl, auto_renew): (Duration, bool),
    backoff: Duration,
) -> tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, LockError>> {
    let before = evalsha_calls(server).await;
    let wait = spawn_waiter(waiter, key, (ttl, auto_renew), backoff);
    // Queued, subscribed, and done with the attempt that follows the subscription.
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(5),
        async || {
            let asleep = waiter.waiting() != 0 && evalsha_calls(server).await >= before + 2;
            asleep.then_some(()).ok_or("never queued")
        },
    )
    .await;
    wait
}

/// The fencing counter value a token was issued from (see `RedisBackend::ISSUER_BITS`).
fn counter_of(token: u64) -> u64 {
    token >> RedisBackend::ISSUER_BITS
}

/// Sets `locker`'s fencing counter below the token `last` was issued from (what a failover to a
/// replica that missed the latest tokens leaves), then waits until the clock is past that
/// counter's millisecond (a failover takes seconds).
async fn roll_back_counter(server: &RedisServer, locker: &Locker, last: u64) {
    let last = counter_of(last);
    let _: () = server
        .query(
            redis::cmd("SET")
                .arg(format!("{}:fence", locker.prefix()))
                .arg(last - 1_000),
        )
        .await;
    poll_until(
        Duration::from_secs(2),
        Duration::from_millis(1),
        async || {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            (now.as_millis() as u64 * 1000 > last)
                .then_some(())
                .ok_or("same millisecond")
        },
    )
    .await;
}

/// A holder's locker and a waiter's (waiter TTL 60 s: its queue refresh never fires within a
/// test) on `server`.
async fn holder_and_waiter(server: &RedisServer) -> (Locker, Locker) {
    let waiter = Locker::builder()
        .waiter_ttl(Duration::from_secs(60))
        .connect(&server.url())
        .await
        .unwrap();
    (server.locker().await, waiter)
}

/// The fencing counter's value (the counter part of the last token issued).
async fn fence_counter(server: &RedisServer, locker: &Locker) -> u64 {
    server
        .query(redis::cmd("GET").arg(format!("{}:fence", locker.prefix())))
        .await
}

/// A release with a queued waiter grants that waiter the lock in the same script and tells it
/// so: the waiter holds the lock with the token the release issued, without asking again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_hands_the_lock_to_the_queued_waiter_without_another_attempt() {
    let server = RedisServer::start();
    let (holder, waiter) = holder_and_waiter(&server).await;
    let key = "handoff:direct";
    let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
    let wait = queued_waiter(&server, &waiter, key, (LONG, true), NEVER).await;
    let asleep = evalsha_calls(&server).await;
    let held_token = held.fencing_token();
    held.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("the waiter slept through the handoff")
        .unwrap()
        .unwrap();
    assert_eq!(
        evalsha_calls(&server).await,
        asleep + 1,
        "only the release ran a script: the waiter did not ask again"
    );
    assert_eq!(
        counter_of(guard.fencing_token()),
        fence_counter(&server, &waiter).await
    );
    assert!(guard.fencing_token() > held_token);
    guard.release().await.unwrap();
    assert_eq!(server.calls("publish").await, 1, "one grant, nothing else");
}

/// A grant that reaches a waiter after the answer to its next attempt — redis-rs's connection
/// manager passes pushes to a task of its own, so one read just before an answer may reach the
/// waiter after it — is not taken if it was published before that attempt ran: its lease had
/// lapsed by then, and the lock may be another's. Here such a grant (a fencing counter below
/// the one the waiter's attempt drew) is published while another client holds the lock; taken,
/// the waiter had a guard beside that holder. It only wakes the waiter, which asks and waits on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_older_than_the_waiters_last_answer_only_wakes_it() {
    let server = RedisServer::start();
    let (holder, waiter) = holder_and_waiter(&server).await;
    let key = "handoff:late";
    let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
    let old = fence_counter(&server, &holder).await;
    let wait = patient_wait(&server, &waiter, key, LONG).await;
    let lock_key = format!("{}:{{{key}}}", holder.prefix());
    let token: String = server
        .query(redis::cmd("LINDEX").arg(format!("{lock_key}:q")).arg(0))
        .await;
    let calls = evalsha_calls(&server).await;
    let heard: u64 = server
        .query(
            redis::cmd("PUBLISH")
                .arg(format!("{lock_key}:ch"))
                .arg(format!("{token}:{old}")),
        )
        .await;
    assert_eq!(heard, 1, "the waiter's connection is subscribed");
    woken_not_granted(wait, held, async || evalsha_calls(&server).await > calls).await;
}

/// `wait` — a waiter that heard of a grant it must not take while `held` holds the lock —
/// is woken by it and asks again (`asked` turns true), and is not granted; once `held` is
/// released the lock is handed to it, with a greater fencing token.
async fn woken_not_granted(
    mut wait: tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, LockError>>,
    held: dlock_runtime::LockGuard,
    mut asked: impl AsyncFnMut() -> bool,
) {
    wait_for(
        "the waiter woken by the grant, asking again",
        Duration::from_secs(5),
        async || (asked().await || wait.is_finished()).then_some(()),
    )
    .await;
    assert!(
        !wait.is_finished(),
        "the waiter took the grant while another held the lock: {:?}",
        (&mut wait).await.unwrap().map(|g| g.fencing_token())
    );
    let fence = held.fencing_token();
    held.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("the waiter slept through the handoff")
        .unwrap()
        .unwrap();
    assert!(guard.fencing_token() > fence);
    guard.release().await.unwrap();
}

/// A second waiter of the same process on the same lock watches before its first attempt
/// (the lock's channel is subscribed already) and sleeps on that attempt's answer: one script
/// call, not the attempt again that a first waiter sends after subscribing. It misses no
/// release for it: each release hands the lock on, in queue order, with no attempt from
/// either waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_local_waiter_asks_once_and_is_handed_the_lock_in_turn() {
    let server = RedisServer::start();
    let (holder, waiter) = holder_and_waiter(&server).await;
    let key = "handoff:second";
    let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
    let first = queued_waiter(&server, &waiter, key, (LONG, true), NEVER).await;
    let before = evalsha_calls(&server).await;
    let second = spawn_waiter(&waiter, key, (LONG, true), NEVER);
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(5),
        async || (waiter.waiting() == 2).then_some(()).ok_or("not asleep"),
    )
    .await;
    assert_eq!(
        evalsha_calls(&server).await,
        before + 1,
        "the second waiter asked once before it slept"
    );
    held.release().await.unwrap();
    let a = tokio::time::timeout(Duration::from_secs(5), first)
        .await
        .expect("the first waiter slept through the handoff")
        .unwrap()
        .unwrap();
    assert!(!second.is_finished(), "the second waiter jumped the queue");
    let a_token = a.fencing_token();
    a.release().await.unwrap();
    let b = tokio::time::timeout(Duration::from_secs(5), second)
        .await
        .expect("the second waiter slept through the handoff")
        .unwrap()
        .unwrap();
    assert!(b.fencing_token() > a_token);
    assert_eq!(
        evalsha_calls(&server).await,
        before + 3,
        "its attempt, then two releases: neither waiter asked again"
    );
    b.release().await.unwrap();
}

/// A Redis backend that never hears release notifications: a waiter on it misses every
/// handoff and relies on its own timer.
struct Deaf(dlock_runtime::backend::RedisBackend);

impl dlock_runtime::backend::Backend for Deaf {
    fn name(&self) -> &'static str {
        "deaf-redis"
    }
    fn acquire<'a>(
        &'a self,
        args: dlock_runtime::backend::AcquireArgs<'a>,
    ) -> dlock_runtime::backend::BoxFuture<'a, Result<dlock_runtime::backend::Attempt, LockError>>
    {
        self.0.acquire(args)
    }
    fn release<'a>(
        &'a self,
        resource: &'a dlock_runtime::key::ResourceName,
        token: &'a dlock_runtime::backend::OwnerToken,
    ) -> dlock_runtime::backend::BoxFuture<'a, Result<bool, LockError>> {
        self.0.release(resource, token)
    }
    fn extend<'a>(
        &'a self,
        resource: &'a dlock_runtime::key::ResourceName,
        token: &'a dlock_runtime::backend::OwnerToken,
        ttl: Duration,
    ) -> dlock_runtime::backend::BoxFuture<'a, Result<bool, LockError>> {
        self.0.extend(resource, token, ttl)
    }
    fn abandon<'a>(
        &'a self,
        resource: &'a dlock_runtime::key::ResourceName,
        token: &'a dlock_runtime::backend::OwnerToken,
    ) -> dlock_runtime::backend::BoxFuture<'a, Result<(), LockError>> {
        self.0.abandon(resource, token)
    }
}

/// A waiter that misses its handoff notification finds the lock already its own on its next
/// attempt (a fresh grant, with a new fencing token). Meanwhile nobody else gets the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missed_handoff_is_found_on_the_next_attempt() {
    use dlock_runtime::backend::{Backend as _, RedisBackend, RedisOptions};
    let server = RedisServer::start();
    let holder = server.locker().await;
    let other = server.locker().await;
    let deaf = Deaf(
        RedisBackend::connect(&server.url(), RedisOptions::default())
            .await
            .unwrap(),
    );
    assert_eq!(deaf.name(), "deaf-redis");
    let waiter = Locker::builder()
        .waiter_ttl(Duration::from_secs(60))
        .build(deaf);
    let key = "handoff:missed";
    let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
    // The waiter's own timer: every 200 ms.
    let wait = queued_waiter(
        &server,
        &waiter,
        key,
        (LONG, true),
        Duration::from_millis(200),
    )
    .await;
    let held_token = held.fencing_token();
    held.release().await.unwrap();
    assert!(
        other.lock(key).try_acquire().await.unwrap().is_none(),
        "the release handed the lock to the waiter, not to a newcomer"
    );
    let guard = tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("the waiter never found its lock")
        .unwrap()
        .unwrap();
    assert!(guard.fencing_token() > held_token);
    assert!(guard.is_held());
    guard.release().await.unwrap();
    assert!(other.lock(key).try_acquire().await.unwrap().is_some());
}

/// A handed-over lease is at most the waiter TTL (a dead waiter must not block the lock for a
/// whole TTL); a waiter without auto-renewal still gets the lease it asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_over_lock_without_renewal_gets_the_lease_it_asked_for() {
    let server = RedisServer::start();
    let (holder, waiter) = holder_and_waiter(&server).await;
    let key = "handoff:no-renewal";
    let ttl = Duration::from_secs(90);
    let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
    let wait = queued_waiter(&server, &waiter, key, (ttl, false), NEVER).await;
    held.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("the waiter slept through the handoff")
        .unwrap()
        .unwrap();
    let lock_key = waiter
        .resource(dlock_runtime::LockKey::new(key).unwrap())
        .as_str()
        .to_owned();
    let pttl: i64 = server.query(redis::cmd("PTTL").arg(&lock_key)).await;
    // The key's PTTL is the lease plus the backend's 60 s linger: the 60 s handed over, then
    // extended to 90 s.
    assert!(
        pttl > 60_000 + 85_000,
        "lease not extended to the TTL: PTTL {pttl}"
    );
    assert!(
        guard.remaining() > Duration::from_secs(85),
        "{:?}",
        guard.remaining()
    );
    guard.release().await.unwrap();
}

/// A waiter for `key` (held by someone else) that reaches `server` through a proxy, queued: its
/// acquire runs in the returned task and has entered the queue. Cutting the proxy is the
/// waiter's process dying (nothing it sends gets through, its undo included).
async fn queued_through_proxy(
    server: &RedisServer,
    key: &'static str,
    waiter_ttl: Duration,
    policy: RetryPolicy,
) -> (
    dlock_tests::proxy::Proxy,
    tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, LockError>>,
) {
    let proxy = dlock_tests::proxy::Proxy::start(server.port())
        .await
        .unwrap();
    let wait = queued(&proxy.url(), key, waiter_ttl, policy).await;
    (proxy, wait)
}

/// A waiter for `key` (held by someone else) on a [`fast_fail`] locker of its own connected to
/// `url`, queued: its acquire runs in the returned task and has entered the queue.
async fn queued(
    url: &str,
    key: &'static str,
    waiter_ttl: Duration,
    policy: RetryPolicy,
) -> tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, LockError>> {
    let waiter = fast_fail()
        .waiter_ttl(waiter_ttl)
        .connect(url)
        .await
        .unwrap();
    let wait = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            let retry = OnFail::Retry(policy);
            waiter.lock(key).ttl(LONG).on_fail(retry).acquire().await
        })
    };
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(5),
        async || {
            (waiter.waiting() != 0)
                .then_some(())
                .ok_or("the waiter never queued")
        },
    )
    .await;
    wait
}

/// The server's clock, in ms.
async fn server_ms(server: &RedisServer) -> u64 {
    let (secs, micros): (u64, u64) = server.query(&redis::cmd("TIME")).await;
    secs * 1000 + micros / 1000
}

/// The deadline (server ms) of the queue entry of the waiter first in line for `lock_key`.
async fn first_entry_deadline(server: &RedisServer, lock_key: &str) -> u64 {
    let first: Option<String> = server
        .query(redis::cmd("LINDEX").arg(format!("{lock_key}:q")).arg(0))
        .await;
    let first = first.expect("nobody is queued");
    let entry: Option<String> = server
        .query(redis::cmd("HGET").arg(format!("{lock_key}:qw")).arg(&first))
        .await;
    let entry = entry.expect("the first waiter's entry is gone");
    let (deadline, _lease) = entry
        .split_once('|')
        .expect("an entry is `<deadline>|<lease>`");
    deadline.parse().unwrap()
}

/// A waiter that rides out an outage keeps its place in the queue: after a refused attempt it
/// asks again within its refresh interval (a third of its waiter TTL) whatever its backoff, so
/// its entry — which lives a waiter TTL from its last attempt that got through — is refreshed
/// once the server is reachable, and the next release hands the lock to it, not to the waiter
/// behind. (It slept its backoff, here 10 s: its entry lapsed, the release passed it over,
/// and a lock handed to it meanwhile would have stayed unused until its lease ended.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_through_outages_keeps_its_place_in_the_queue() {
    let server = RedisServer::start();
    let holder = server.locker().await;
    let waiter_ttl = Duration::from_secs(3);
    let refresh = waiter_ttl / 3;
    let key = "queue:outage-keeps-place";
    let lock_key = holder
        .resource(dlock_runtime::LockKey::new(key).unwrap())
        .as_str()
        .to_owned();
    let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
    let patient = RetryPolicy::new(LONG)
        .backoff(Duration::from_secs(10), Duration::from_secs(10))
        .jitter(false)
        .through_outages(true);
    let (proxy, first) = queued_through_proxy(&server, key, waiter_ttl, patient).await;
    // The second waiter reaches the server directly.
    let second = queued(&server.url(), key, waiter_ttl, RetryPolicy::new(LONG)).await;

    proxy.cut(true);
    // Nothing of the first waiter's gets through from here: its entry's deadline stands, and
    // its last refresh was a waiter TTL before it. Its next attempt is due a refresh interval
    // after that one and is refused (or times out: 200 ms); let the outage outlast it.
    let cut_deadline = first_entry_deadline(&server, &lock_key).await;
    let last_refresh = cut_deadline - waiter_ttl.as_millis() as u64;
    let refused_by = last_refresh + (refresh + Duration::from_millis(400)).as_millis() as u64;
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        async || {
            (server_ms(&server).await >= refused_by)
                .then_some(())
                .ok_or("the server's clock stands still".to_owned())
        },
    )
    .await;
    assert!(!first.is_finished(), "the wait through outages ended");
    proxy.allow();
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        async || {
            let now = server_ms(&server).await;
            let deadline = first_entry_deadline(&server, &lock_key).await;
            if deadline > cut_deadline {
                Ok(())
            } else if now >= cut_deadline {
                Err(format!(
                    "the first waiter's entry lapsed before it asked again (the server has let \
                     it through for {} ms)",
                    now - refused_by
                ))
            } else {
                Err("not refreshed yet".to_owned())
            }
        },
    )
    .await;
    held.release().await.unwrap();
    let guard = first
        .await
        .unwrap()
        .expect("the first waiter was handed the lock");
    assert!(!second.is_finished(), "the second waiter got the lock too");
    guard.release().await.unwrap();
    second.await.unwrap().unwrap().release().await.unwrap();
}

/// A lock handed to a waiter that died ends no later than the dead waiter's queue entry would
/// have: a crashed process holds up a lock at most the longer of the TTL and the waiter TTL,
/// not a waiter TTL more after a release that came just before its entry lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_handed_to_a_dead_waiter_ends_when_its_entry_would_have() {
    let server = RedisServer::start();
    let holder = server.locker().await;
    let waiter_ttl = Duration::from_secs(2);
    let key = "handoff:dead-waiter";
    let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
    let (proxy, wait) =
        queued_through_proxy(&server, key, waiter_ttl, RetryPolicy::new(LONG)).await;
    proxy.cut(true);
    let died = Instant::now();
    // Its entry lapses within the waiter TTL of its last refresh; release most of the way there.
    tokio::time::sleep(waiter_ttl / 2).await;
    held.release().await.unwrap();
    let lock_key = holder
        .resource(dlock_runtime::LockKey::new(key).unwrap())
        .as_str()
        .to_owned();
    // At most what the entry had left when the PTTL was read (a few ms of slack: the server
    // counts whole milliseconds).
    let entry_left = waiter_ttl.saturating_sub(died.elapsed()).as_millis() as i64 + 5;
    let pttl: i64 = server.query(redis::cmd("PTTL").arg(&lock_key)).await;
    let left_ms = pttl - RedisBackend::LINGER.as_millis() as i64;
    assert!(
        (0..=entry_left).contains(&left_ms),
        "the dead waiter was handed a lease of {left_ms} ms; its entry had at most {entry_left} ms left"
    );
    wait.abort();
}

/// A lock whose holder's lease lapsed while another waiter is first in line is that waiter's
/// to take until its queue entry lapses. An attempt behind it is told how long that is — it was
/// told nothing — so a waiter behind the entry of a process that froze or died wakes when the
/// entry lapses instead of on its own next refresh (up to a third of its waiter TTL later), and
/// a refused request's `Retry-After` says when to come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_behind_a_dead_waiter_is_told_when_its_entry_lapses() {
    let server = RedisServer::start();
    let holder = server.locker().await;
    let waiter_ttl = Duration::from_secs(3);
    let key = "queue:dead-first";
    let lease = Duration::from_millis(300);
    // Held, never renewed and never released: its lease lapses.
    let held = holder
        .lock(key)
        .ttl(lease)
        .auto_renew(false)
        .acquire()
        .await
        .unwrap();
    let queued = Instant::now();
    // The first waiter; cutting its proxy is its process dying.
    let (proxy, wait) =
        queued_through_proxy(&server, key, waiter_ttl, RetryPolicy::new(LONG)).await;
    proxy.cut(true);
    let lock_key = holder
        .resource(dlock_runtime::LockKey::new(key).unwrap())
        .as_str()
        .to_owned();
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        async || {
            let pttl: i64 = server.query(redis::cmd("PTTL").arg(&lock_key)).await;
            (pttl <= RedisBackend::LINGER.as_millis() as i64)
                .then_some(())
                .ok_or(format!("the lease has not lapsed: PTTL {pttl} ms"))
        },
    )
    .await;
    let refused = holder
        .lock(key)
        .acquire()
        .await
        .expect_err("the lock went past the waiter first in line");
    assert!(refused.is_contended(), "{refused}");
    // The entry lives `waiter_ttl` from the first waiter's last attempt, which came after
    // `queued`: at least what is left of that, give or take the server's whole milliseconds.
    let entry_left = waiter_ttl.saturating_sub(queued.elapsed());
    let told = refused
        .retry_after()
        .unwrap_or_else(|| panic!("no hint in {refused:?}"));
    assert!(
        told > lease && told + Duration::from_millis(20) >= entry_left && told <= waiter_ttl,
        "told {told:?}; the first waiter's entry had at least {entry_left:?} left"
    );
    drop(held);
    wait.abort();
}

/// Fencing tokens come from one counter per namespace: they grow across keys, and when the
/// counter is lost (a restart without persistence, here a `FLUSHALL`) or rolled back (a failover
/// to a lagging replica, here a `SET` to a lower value) the next token still exceeds every
/// earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_grow_across_keys_and_a_lost_counter() {
    let server = RedisServer::start();
    let locker = server.locker().await;
    let mut last = 0;
    for key in ["fence:a", "fence:b", "fence:a"] {
        let g = locker.lock(key).acquire().await.unwrap();
        assert!(
            g.fencing_token() > last,
            "{key}: {} after {last}",
            g.fencing_token()
        );
        last = g.fencing_token();
        g.release().await.unwrap();
    }
    let _: () = server.query(&redis::cmd("FLUSHALL")).await;
    let g = locker.lock("fence:a").acquire().await.unwrap();
    assert!(
        g.fencing_token() > last,
        "{} after {last}",
        g.fencing_token()
    );
    last = g.fencing_token();
    g.release().await.unwrap();
    // A counter rolled back (a failover to a replica that missed the latest tokens), seen by
    // another client: the floor of its clock keeps the order.
    roll_back_counter(&server, &locker, last).await;
    let other = server.locker().await;
    let g = other.lock("fence:a").acquire().await.unwrap();
    assert!(
        g.fencing_token() > last,
        "{} after {last}",
        g.fencing_token()
    );
    g.release().await.unwrap();
}

/// A fencing counter past 2^53 - 1 (set by hand, or a client clock centuries ahead) issues no
/// token above the ones before: a token is `counter × 2^ISSUER_BITS + issuer` in a `u64`, and
/// the scripts count in doubles. Every token saturated to `u64::MAX` before — the same token
/// again and again. Now the acquire is a typed `Misconfigured` (500), the lock its script took
/// is undone, and once the counter is put back the next token is above every one before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fencing_counter_past_the_tokens_range_is_misconfigured_and_takes_no_lock() {
    let server = RedisServer::start();
    let locker = server.locker().await;
    let g = locker.lock("range").acquire().await.unwrap();
    let last = g.fencing_token();
    g.release().await.unwrap();
    let fence = format!("{}:fence", locker.prefix());
    let _: () = server
        .query(redis::cmd("SET").arg(&fence).arg(1u64 << 53))
        .await;
    let lock_key = format!("{}:{{range}}", locker.prefix());
    // Refused each time (the counter is not taken for seen), its lock undone each time.
    for _ in 0..2 {
        let err = locker.lock("range").acquire().await.unwrap_err();
        assert!(err.is_misconfigured(), "{err}");
        assert_eq!(err.status(), 500);
        poll_until(
            Duration::from_secs(5),
            Duration::from_millis(5),
            async || {
                let n: i64 = server.query(redis::cmd("EXISTS").arg(&lock_key)).await;
                (n == 0)
                    .then_some(())
                    .ok_or("the refused acquire's lock is still there")
            },
        )
        .await;
    }
    let _: () = server
        .query(redis::cmd("SET").arg(&fence).arg(counter_of(last)))
        .await;
    let g = locker.lock("range").acquire().await.unwrap();
    assert!(
        g.fencing_token() > last,
        "{} after {last}",
        g.fencing_token()
    );
    g.release().await.unwrap();
}

/// Two masters that both take writes for a moment (a Sentinel master frozen past the
/// down-after time, failed over, and woken before it is demoted) issue from the same counter
/// value: the clients that hold them still get different fencing tokens, because a token names
/// the backend it was granted to (`RedisBackend::ISSUER_BITS`), and their order is still the
/// counter's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_masters_issuing_from_one_counter_value_never_grant_the_same_token() {
    let (old, new) = (RedisServer::start(), RedisServer::start());
    // The state both masters share at the split: the issuer numbers taken so far and the
    // counter (far above the clients' clock floors, so both masters issue `counter + 1`).
    let on_old = old.locker().await;
    // Its issuer number is taken by its first grant, not by its connect.
    let warm = on_old.lock("warm").acquire().await.unwrap();
    warm.release().await.unwrap();
    let issued: u64 = old.query(redis::cmd("GET").arg("dlock:issuers")).await;
    let _: () = new
        .query(redis::cmd("SET").arg("dlock:issuers").arg(issued))
        .await;
    let on_new = new.locker().await;
    let counter = now_millis() * 1000 + 1_000_000_000;
    for (server, locker) in [(&old, &on_old), (&new, &on_new)] {
        let _: () = server
            .query(
                redis::cmd("SET")
                    .arg(format!("{}:fence", locker.prefix()))
                    .arg(counter),
            )
            .await;
    }
    let a = on_old.lock("split").ttl(LONG).acquire().await.unwrap();
    let b = on_new.lock("split").ttl(LONG).acquire().await.unwrap();
    assert_eq!(
        (counter_of(a.fencing_token()), counter_of(b.fencing_token())),
        (counter + 1, counter + 1),
        "both masters issued from the same counter value"
    );
    assert_ne!(a.fencing_token(), b.fencing_token());
    // The order is still the counter's: the next token on either master is above both.
    let both = a.fencing_token().max(b.fencing_token());
    a.release().await.unwrap();
    let next = on_old.lock("split").ttl(LONG).acquire().await.unwrap();
    assert!(next.fencing_token() > both);
    next.release().await.unwrap();
    b.release().await.unwrap();
}

fn now_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A release that hands the lock over issues the next token with the releasing client's
/// floor: after the counter was rolled back (a failover to a lagging replica), the waiter's
/// token still exceeds the holder's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_after_a_rolled_back_counter_still_raises_the_token() {
    let server = RedisServer::start();
    let (holder, waiter) = holder_and_waiter(&server).await;
    let key = "handoff:rollback";
    let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
    let wait = queued_waiter(&server, &waiter, key, (LONG, true), NEVER).await;
    let held_token = held.fencing_token();
    roll_back_counter(&server, &holder, held_token).await;
    held.release().await.unwrap();
    let guard = tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("the waiter slept through the handoff")
        .unwrap()
        .unwrap();
    assert!(
        guard.fencing_token() > held_token,
        "{} after {held_token}",
        guard.fencing_token()
    );
    guard.release().await.unwrap();
}

/// Leader election under a partition: the leader's connection is cut (and reconnects refused)
/// past its TTL. It is told it lost — `lost()` resolves and `is_leader()` is already `false` —
/// before the other candidate, on a healthy connection, leads with a greater term; once the
/// partition heals the old leader campaigns again and leads after the new one resigns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_leader_is_told_before_the_next_one_leads_and_campaigns_again() {
    use dlock_tests::proxy::Proxy;

    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await.unwrap();
    let cut_off = fast_fail().connect(&proxy.url()).await.unwrap();
    let healthy = fast_fail().connect(&server.url()).await.unwrap();
    let ttl = Duration::from_secs(1);
    let limit = Duration::from_secs(10);
    let name = "fault:elect";

    let a = cut_off.elect(name).ttl(ttl).start().unwrap();
    let t1 = tokio::time::timeout(limit, a.wait_for_leadership())
        .await
        .expect("A leads")
        .expect("campaigning");
    let b = healthy.elect(name).ttl(ttl).start().unwrap();
    poll_until(limit, Duration::from_millis(5), async || {
        (healthy.waiting() == 1)
            .then_some(())
            .ok_or("B not queued yet")
    })
    .await;

    proxy.cut(true);
    let cut_at = Instant::now();
    let a_told = async {
        tokio::time::timeout(limit, a.lost()).await.expect("A told");
        Instant::now()
    };
    let b_leads = async {
        let t2 = tokio::time::timeout(limit, b.wait_for_leadership())
            .await
            .expect("B leads")
            .expect("campaigning");
        // The old leader already knows, by its own lease clock.
        assert!(!a.is_leader(), "two leaders at once");
        (t2, Instant::now())
    };
    let (a_told_at, (t2, b_led_at)) = tokio::join!(a_told, b_leads);
    assert!(t2 > t1, "terms increase: {t2} > {t1}");
    assert!(a_told_at <= b_led_at, "A told after B led");
    // B had to wait for A's lease to run out on the server: no release came through the cut.
    assert!(b_led_at - cut_at >= ttl / 2, "{:?}", b_led_at - cut_at);

    proxy.allow();
    // A campaigns again once it can reach the server: it queues behind B…
    poll_until(limit, Duration::from_millis(5), async || {
        (cut_off.waiting() == 1)
            .then_some(())
            .ok_or("A not queued again")
    })
    .await;
    // …and leads when B steps down.
    b.resign().await.unwrap();
    let t3 = tokio::time::timeout(limit, a.wait_for_leadership())
        .await
        .expect("A leads again")
        .expect("campaigning");
    assert!(t3 > t2, "{t3} > {t2}");
    a.resign().await.unwrap();
}

/// A connection that went silent — a partition, a load balancer or NAT that forgot it: no reset,
/// no close, so the kernel keeps it for many minutes — is replaced once a command times out on
/// it: a new connection works at once, and the locker takes locks again within a few command
/// timeouts instead of failing every command as unavailable until the kernel gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_gone_silent_is_replaced() {
    use dlock_tests::proxy::Proxy;
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await.unwrap();
    let locker = fast_fail().connect(&proxy.url()).await.unwrap();
    let key = "silent:replaced";
    let g = locker.lock(key).try_acquire().await.unwrap().expect("free");
    g.release().await.unwrap();

    // Silent: what is read from now on is held, not forwarded, and the connection stays open.
    proxy.set_latency(Duration::from_secs(3600));
    unavailable_within(Duration::from_secs(1), locker.lock(key).try_acquire()).await;
    // New connections work again; the silent one stays stuck.
    proxy.set_latency(Duration::ZERO);
    let lifted = Instant::now();
    let g = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        async || match locker.lock(key).try_acquire().await {
            Ok(Some(g)) => Ok(g),
            Ok(None) => {
                panic!("nobody holds {key}: the timed-out attempt never reached the server")
            }
            Err(e) => {
                assert!(e.is_unavailable(), "{e}");
                Err(format!("still on the silent connection: {e}"))
            }
        },
    )
    .await;
    let took = lifted.elapsed();
    // A few 200 ms command timeouts: the check's PING, the new connection, the next attempt.
    assert!(took < Duration::from_millis(1500), "back after {took:?}");
    g.release().await.unwrap();
}

/// A failover behind one address (a managed primary's DNS name, a virtual IP, a Kubernetes
/// Service): the old primary is demoted to a replica and keeps its clients' connections, the
/// address now leads to the promoted one. The first write refused with `READONLY` has the
/// connection replaced, so locks are taken on the new primary at once. Before, the connection
/// stayed on the demoted server (it answers `PING`, so it never looked silent) and every lock
/// call failed as unavailable until the connection happened to drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_demoted_behind_its_address_is_left_for_the_promoted_one() {
    use dlock_tests::proxy::Proxy;
    let (old, new) = (RedisServer::start(), RedisServer::start());
    let replicate = |of: Option<u16>| {
        let mut cmd = redis::cmd("REPLICAOF");
        match of {
            Some(port) => cmd.arg("127.0.0.1").arg(port),
            None => cmd.arg("NO").arg("ONE"),
        };
        cmd
    };
    let proxy = Proxy::start(old.port()).await.unwrap();
    let locker = fast_fail().connect(&proxy.url()).await.unwrap();
    let key = "demoted:primary";
    let g = locker.lock(key).try_acquire().await.unwrap().expect("free");
    g.release().await.unwrap();

    // The failover: `new` leads, `old` follows it, and the address moves to `new`. The
    // locker's connection stays open, on `old`.
    let _: () = new.query(&replicate(None)).await;
    let _: () = old.query(&replicate(Some(new.port()))).await;
    proxy.retarget(new.port());
    let refused = locker.lock(key).try_acquire().await.unwrap_err();
    assert!(refused.is_unavailable(), "{refused}");
    let g = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        async || match locker.lock(key).try_acquire().await {
            Ok(Some(g)) => Ok(g),
            Ok(None) => panic!("nobody holds {key}"),
            Err(e) => Err(format!("still on the demoted server: {e}")),
        },
    )
    .await;
    // On the promoted server, under its own fencing counter: a lock there, none on `old`.
    let on_new: Vec<String> = new.query(redis::cmd("KEYS").arg("*demoted*")).await;
    assert!(!on_new.is_empty(), "the lock is not on the promoted server");
    g.release().await.unwrap();
}

/// A waiter queued before its connection went silent hears of the release that hands it the
/// lock once the connection was replaced: the new connection subscribes again to the channels
/// that still have waiters. Its fallback timer (10 s) would take far longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_hears_a_release_after_its_silent_connection_is_replaced() {
    hears_the_release_after_a_silent_connection(false, 1).await;
}

/// The same for the waiters of 300 locks: the new connection subscribes again to every one of
/// their channels, and each waiter hears its release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_of_many_locks_hear_their_releases_after_their_silent_connection_is_replaced() {
    hears_the_release_after_a_silent_connection(false, 300).await;
}

/// The same when the server still does not answer the connection made in its place: the
/// subscription is tried again until it is answered. Before, a `SUBSCRIBE` that timed out on
/// the new connection dropped the channel, and the waiter heard no release for the rest of its
/// wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_hears_a_release_after_an_outage_outlasting_its_connections_replacement() {
    hears_the_release_after_a_silent_connection(true, 1).await;
}

/// The waiters of `locks` locks — their connection goes silent and is replaced (with
/// `outlasting`, the new connection is made and its subscription times out before the outage
/// ends); then the holder releases each.
async fn hears_the_release_after_a_silent_connection(outlasting: bool, locks: usize) {
    use dlock_tests::proxy::Proxy;
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await.unwrap();
    let holder = server.locker().await;
    let waiter = fast_fail()
        .waiter_ttl(Duration::from_secs(60))
        .connect(&proxy.url())
        .await
        .unwrap();
    let mut waits = Vec::with_capacity(locks);
    for i in 0..locks {
        let key: &'static str = Box::leak(format!("silent:waiter-{i}").into_boxed_str());
        let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
        waits.push((held, patient_wait(&server, &waiter, key, LONG).await));
    }

    proxy.set_latency(Duration::from_secs(3600));
    let other = "silent:other";
    let connections = proxy.accepted();
    unavailable_within(Duration::from_secs(1), waiter.lock(other).try_acquire()).await;
    if outlasting {
        wait_for(
            "the replacement connection",
            Duration::from_secs(5),
            async || (proxy.accepted() > connections).then_some(()),
        )
        .await;
        // Its subscription's 200 ms timeout runs out while the outage lasts: nothing outside
        // the locker tells when, so three of them.
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    proxy.set_latency(Duration::ZERO);
    let g = poll_until(
        Duration::from_secs(3),
        Duration::from_millis(20),
        async || waiter.lock(other).try_acquire().await,
    )
    .await;
    g.expect("nobody holds the other lock")
        .release()
        .await
        .unwrap();

    for (held, wait) in waits {
        let guard = dlock_tests::wait::handed_on_release(held, wait).await;
        guard.release().await.unwrap();
    }
}

/// A grant published to a waiter over a connection that was replaced since is not taken as
/// the lock: the waiter's connection stalls (a partition: nothing either way, no reset), the
/// holder releases and the server hands the lock to it, publishing the grant on that
/// connection; the handed lease lapses and another client takes the lock; the waiter's
/// connection is replaced, and on the new one the waiter asks and is told "held". Then the
/// partition heals and the old connection — kept open by redis-rs until the answers to the
/// commands that timed out on it come — delivers the grant. It is news of a lease long lapsed,
/// out of order with the answers on the new connection: taken as a handoff, the waiter got a
/// guard (with the older fencing token) while the other client held the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_heard_on_a_replaced_connection_does_not_make_a_second_holder() {
    use dlock_tests::proxy::Proxy;
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await.unwrap();
    let (holder, other) = (server.locker().await, server.locker().await);
    let waiter = Locker::builder()
        .command_timeout(Duration::from_millis(500))
        .waiter_ttl(Duration::from_secs(60))
        .connect(&proxy.url())
        .await
        .unwrap();
    let key = "replaced:grant";
    let held = holder.lock(key).ttl(LONG).acquire().await.unwrap();
    let mut wait = patient_wait(&server, &waiter, key, Duration::from_secs(1)).await;

    assert_eq!(
        proxy.stall(),
        1,
        "one connection, for commands and the channel"
    );
    held.release().await.unwrap();
    // The lease handed to the waiter (its 1 s TTL) lapses; the other client takes the lock.
    let taken = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        async || match other.lock(key).ttl(LONG).try_acquire().await {
            Ok(Some(g)) => Ok(g),
            Ok(None) => Err("still handed to the waiter"),
            Err(e) => panic!("{e}"),
        },
    )
    .await;
    assert_eq!(
        proxy.accepted(),
        1,
        "the waiter's connection replaced too early"
    );

    // The waiter's client keeps using its connection: commands time out on it, it is found
    // silent and replaced, and the last commands sent on it keep it open for a while.
    let load = {
        let waiter = waiter.clone();
        tokio::spawn(async move {
            for i in 0.. {
                let waiter = waiter.clone();
                tokio::spawn(async move {
                    if let Ok(Some(g)) = waiter
                        .lock(format!("replaced:load:{i}"))
                        .try_acquire()
                        .await
                    {
                        let _ = g.release().await;
                    }
                });
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    wait_for(
        "the waiter's connection replaced",
        Duration::from_secs(5),
        async || (proxy.accepted() >= 2).then_some(()),
    )
    .await;
    load.abort();
    // On the new connection the waiter asks (woken with every local waiter), is told "held"
    // and queued again.
    let queue = format!("dlock:{{{key}}}:q");
    wait_for(
        "the waiter queued again on its new connection",
        Duration::from_secs(5),
        async || {
            let len: u64 = server.query(redis::cmd("LLEN").arg(&queue)).await;
            (len == 1).then_some(())
        },
    )
    .await;
    assert!(!wait.is_finished(), "{:?}", (&mut wait).await);

    // The partition heals: the old connection, still open, delivers the grant. Woken by it
    // (its own timer is 10 s off), the waiter asks again: its queue entry is refreshed.
    let entries = format!("dlock:{{{key}}}:qw");
    let entry: Vec<String> = server.query(redis::cmd("HGETALL").arg(&entries)).await;
    proxy.heal();
    woken_not_granted(wait, taken, async || {
        let now: Vec<String> = server.query(redis::cmd("HGETALL").arg(&entries)).await;
        now != entry
    })
    .await;
}

/// The connections of their own that `.replicas(1)` sends `WAIT` on are replaced when they go
/// silent, like the locker's own connection: each is checked (a `PING`) once a renewal timed
/// out on it, and made anew if that gets no answer either. Before, they were plain managers,
/// and a timeout on one had the locker's own connection checked instead: every acknowledged
/// acquire that went to a silent one failed as unavailable until the kernel gave up on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_for_wait_gone_silent_are_replaced() {
    use dlock_tests::proxy::Proxy;
    let master = RedisServer::start();
    let port = master.port().to_string();
    let _replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let proxy = Proxy::start(master.port()).await.unwrap();
    let locker = fast_fail().connect(&proxy.url()).await.unwrap();
    let acked = async |label: &str| {
        dlock_tests::wait::acknowledged_acquire(&locker, "silent:acked", label).await
    };
    // The replica in sync, and every connection for `WAIT` made and used.
    for _ in 0..8 {
        acked("before").await;
    }

    proxy.silence();
    unavailable_within(
        Duration::from_secs(1),
        locker.lock("silent:acked").replicas(1).acquire(),
    )
    .await;
    acked("after").await;
    acknowledged_again(&locker, "silent:acked", 8, Duration::from_secs(3)).await;
}

/// `.replicas(1)` counts a replica only for the write it waits for: the `WAIT` goes out with
/// that write, in one write on its connection, before the write's answer — nothing can come
/// between them. Before, it was sent apart, after the answer, and could go on a connection
/// made in place of the first (a reset in between, Sentinel's switch, a cluster's `ASK`),
/// where it counted no write and answered at once with the replicas connected: a lock "on 1
/// replica" that no replica had. Here the connection is reset right after the write's answer
/// while the only replica is frozen (it acknowledges nothing), and the acquire fails every
/// time — the pipeline lost its second answer. (On the old code it failed as well: redis-rs
/// sent the late `WAIT` on the reset connection, not a new one; the write's own request is
/// what tells the two apart.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_never_counts_for_a_write_on_another_connection() {
    use dlock_tests::proxy::Proxy;
    let master = RedisServer::start();
    let port = master.port().to_string();
    let mut replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let proxy = Proxy::start(master.port()).await.unwrap();
    let locker = fast_fail().connect(&proxy.url()).await.unwrap();
    // The replica in sync, and every connection for `WAIT` made and used.
    for _ in 0..8 {
        dlock_tests::wait::acknowledged_acquire(&locker, "cut:warm", "before").await;
    }
    replica.pause();
    for round in 0..8 {
        let key = format!("cut:acked:{round}:");
        // The key's first sighting is the acquire on the locker's own connection; its second,
        // the acknowledged write on a connection for `WAIT`, which is reset after its answer.
        proxy.cut_after_reply_to(key.as_bytes(), 2);
        let acquired = locker.lock(&key).replicas(1).acquire().await;
        assert!(
            acquired.is_err(),
            "round {round}: acknowledged by one replica, which is frozen"
        );
        let request = proxy.cut_request();
        let with = |needle: &[u8]| request.windows(needle.len()).any(|w| w == needle);
        assert!(
            with(b"EVALSHA") && with(b"WAIT"),
            "round {round}: the write and its WAIT left apart: {:?}",
            String::from_utf8_lossy(&request)
        );
    }
    replica.resume();
}

/// A reconnect that redis-rs's connection manager began on a runtime that then shut down holds
/// that runtime's timers (its back-off between connection attempts): polled on another runtime
/// — by the next command, in a request handler — it panicked ("A Tokio 1.x context was found,
/// but it is being shutdown"). The manager also spawns its reconnects on the runtime it was made
/// on, which is gone. A connection made on a runtime that shut down is now replaced on its next
/// use, on the runtime of that use: the first command there succeeds (before, even without a
/// reconnect under way, it failed with 503: the manager's driver had died with the runtime).
#[test]
fn a_connection_whose_runtime_shut_down_mid_reconnect_is_replaced() {
    let mut server = RedisServer::start();
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let locker = first.block_on(async {
        let locker = fast_fail().connect(&server.url()).await.unwrap();
        let g = locker.lock("rt:reconnect").try_acquire().await.unwrap();
        g.expect("free").release().await.unwrap();
        locker
    });
    server.stop();
    first.block_on(async {
        // The connection is found gone: the manager starts reconnecting on this runtime, and
        // each refused attempt backs off (100 ms and more) on one of its timers.
        let err = locker.lock("rt:reconnect").try_acquire().await.unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        tokio::time::sleep(Duration::from_millis(30)).await;
    });
    drop(first);
    server.restart();

    let second = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let locker = locker.clone();
        let attempt = tokio::spawn(async move {
            let g = locker.lock("rt:reconnect").try_acquire().await;
            g.map(|g| g.map(|g| g.fencing_token()))
        })
        .await;
        match attempt {
            Ok(Ok(Some(_))) => {}
            Ok(other) => panic!("the first lock on the new runtime: {other:?}"),
            Err(e) => panic!("the first lock on the new runtime panicked: {e}"),
        }
    });
}

/// A grant whose answer comes after the lease it granted ran out — a round trip slower than the
/// TTL — is not handed out: `acquire` answers `Lost` (and gives the lock back), and the next
/// owner takes the key. Once, such a guard was returned already not holding the lock
/// (`is_held() == false`), and a caller that did not check did its work unprotected; a
/// `lock_all` did the same with a key lost while it waited for the next
/// (`conformance::multi_key_lost_while_waiting_fails`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_answered_after_its_lease_ran_out_is_not_handed_out() {
    use dlock_tests::proxy::Proxy;
    let server = RedisServer::start();
    let proxy = Proxy::start(server.port()).await.unwrap();
    let locker = Locker::builder()
        .command_timeout(Duration::from_secs(2))
        .connect(&proxy.url())
        .await
        .unwrap();
    proxy.set_latency(Duration::from_millis(60));
    let err = locker
        .lock("slow:k")
        .ttl(Duration::from_millis(50))
        .on_fail(OnFail::Reject)
        .acquire()
        .await
        .expect_err("a guard whose lease ran out before it was handed out");
    assert!(err.is_lost(), "{err}");
    assert_eq!(err.key(), Some("slow:k"));
    proxy.set_latency(Duration::ZERO);
    let next = server.locker().await;
    let g = next
        .lock("slow:k")
        .on_fail(OnFail::retry(Duration::from_secs(5)))
        .acquire()
        .await
        .expect("the key is free for the next owner");
    assert!(g.is_held());
    g.release().await.unwrap();
}

/// On a server holding many keys besides the locks, one page of a listing looks at a bounded
/// number of keys and answers with a cursor to go on from (before, it scanned the whole
/// keyspace under one command deadline, which timed out with no cursor on a big server);
/// following the cursor finds the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_page_looks_at_a_bounded_number_of_keys() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    for batch in 0..100 {
        let pairs: Vec<(String, u8)> = (0..1000)
            .map(|i| (format!("other:{batch}:{i}"), 0))
            .collect();
        let _: () = conn.mset(&pairs).await.unwrap();
    }
    let locker = redis.locker().await;
    let held = locker.lock("listed").acquire().await.unwrap();
    let admin = locker.admin().unwrap();
    let first = admin.list("", None, 10).await.expect("a page");
    assert!(
        first.cursor.is_some(),
        "one page scanned all 100,000 keys: {first:?}"
    );
    let all = admin.list_all("", 10).await.unwrap();
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0].key, "listed");
    held.release().await.unwrap();
}

/// Keys another program wrote under the locks' namespace do not break a listing or pass for
/// locks: a name that is not UTF-8 (it failed every page, and the ops page answered 503 while
/// Redis was up), a key of another type (`WRONGTYPE` for the read: the same), and a string
/// with no expiry, which the acquire and force-release scripts count as free (an acquire takes
/// its place) — it was listed as held, its value's first characters shown as an owner token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_keys_under_the_namespace_neither_break_a_listing_nor_pass_for_locks() {
    let redis = RedisServer::start();
    let mut conn = redis.conn().await;
    let _: () = redis::cmd("SET")
        .arg(&b"dlock:{\xff}"[..])
        .arg("x")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = conn.hset("dlock:{a-hash}", "f", "v").await.unwrap();
    let _: () = conn
        .set("dlock:{forever}", "0123456789abcdef")
        .await
        .unwrap();
    let locker = redis.locker().await;
    let held = locker.lock("listed").acquire().await.unwrap();
    let admin = locker.admin().unwrap();
    let all = admin.list_all("", 100).await.expect("a listing");
    let keys: Vec<&str> = all.iter().map(|l| l.key.as_str()).collect();
    assert_eq!(keys, ["listed"], "{all:?}");
    let forever = admin.inspect("forever").await.unwrap();
    assert!(forever.holder.is_none(), "{forever:?}");
    let g = locker
        .lock("forever")
        .try_acquire()
        .await
        .unwrap()
        .expect("a key with no expiry is no lock");
    g.release().await.unwrap();
    held.release().await.unwrap();
}

/// Timeouts given as `Duration::MAX` ("no deadline") are taken as a day: the backend adds its
/// connect and command timeouts (and scales the command timeout for a replica wait), which
/// overflowed — a panic at connect. Through `RedisOptions`, the locker's builder and Redlock's
/// node timeout alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_past_a_day_are_a_day_not_a_panic() {
    use dlock_runtime::backend::{RedisOptions, RedlockBackend, RedlockOptions};
    let server = RedisServer::start();
    let url = server.url();
    let opts = RedisOptions::default()
        .command_timeout(Duration::MAX)
        .connect_timeout(Duration::MAX);
    let lockers = [
        Locker::builder().build(RedisBackend::connect(&url, opts).await.unwrap()),
        Locker::builder()
            .command_timeout(Duration::MAX)
            .connect(&url)
            .await
            .unwrap(),
        Locker::builder().build(
            RedlockBackend::connect(
                &[&url],
                RedlockOptions::default()
                    .node_timeout(Duration::MAX)
                    .connect_timeout(Duration::MAX),
            )
            .await
            .unwrap(),
        ),
    ];
    for (i, locker) in lockers.iter().enumerate() {
        dlock_tests::wait::locks_and_holds(locker, &format!("forever:{i}")).await;
    }
}

/// A renewal batch the server refuses for good (a lock's key holds another type: `WRONGTYPE`)
/// answers `Misconfigured` for its locks, as a single renewal does. A pipeline's error carries
/// no code of its own, and the batch answered `Unavailable`: an outage, where the store had
/// refused for good.
///
/// And only for the bad key's lock: the locks renewed in the same pipeline (the watchdog's
/// renewals due within a few ms of each other go in one) are renewed. Before, one bad key
/// failed the whole pipeline — every lock of it was retried as the pipeline until its local
/// lease ran out and reported lost, though each renewal of it had run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_batch_refused_for_good_is_misconfigured_for_the_bad_key_alone() {
    use dlock_runtime::backend::{
        Attempt, Backend as _, ExtendItem, OwnerToken, RedisOptions, WaitMode,
    };
    use dlock_runtime::conformance::attempt_as;
    let server = RedisServer::start();
    let backend = RedisBackend::connect(&server.url(), RedisOptions::default())
        .await
        .unwrap();
    let locker = Locker::builder().build(backend.clone());
    let resource = |key: &str| locker.resource(dlock_runtime::LockKey::new(key).unwrap());
    let bad = resource("renew:wrongtype");
    let _: () = server
        .conn()
        .await
        .rpush(bad.as_str(), "not a lock")
        .await
        .unwrap();
    let ttl = Duration::from_secs(5);
    let mut items = Vec::new();
    for key in ["renew:a", "renew:b"] {
        let (resource, token) = (resource(key), OwnerToken::generate());
        let taken = attempt_as(&locker, &resource, &token, WaitMode::Try, ttl)
            .await
            .unwrap();
        assert!(matches!(taken, Attempt::Acquired { .. }), "{taken:?}");
        items.push(ExtendItem {
            resource,
            token,
            ttl: Duration::from_secs(30),
        });
    }
    items.insert(
        1,
        ExtendItem {
            resource: bad,
            token: OwnerToken::generate(),
            ttl,
        },
    );
    let out = backend.extend_many(&items).await;
    assert!(
        matches!(&out[..], [Ok(true), Err(e), Ok(true)] if e.is_misconfigured()),
        "{out:?}"
    );
    // Taken for 5 s, renewed for 30 (a lock's key outlives its lease by a minute).
    let mut conn = server.conn().await;
    for item in [&items[0], &items[2]] {
        let left: i64 = conn.pttl(item.resource.as_str()).await.unwrap();
        assert!(
            left > 80_000,
            "{} not renewed: {left} ms left",
            item.resource.as_str()
        );
    }
}

/// `IdempotencyRequest::replicas(1)` (here from `LockerBuilder::replicas`) on one server with
/// a replica: an operation runs once the replica has its lock, and `complete` answers `Ok`
/// once the replica has the record. While the replica is frozen, a begin fails as unavailable
/// and leaves no lock behind (the operation does not run), and a `complete` answers unavailable
/// — the record is on the master only, and a failover could lose it. Before, `replicas` was
/// ignored by idempotency: a record a failover lost was run again on the next retry (a second
/// charge).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_with_replicas_counts_once_the_replica_has_the_lock_and_the_record() {
    use dlock_runtime::idempotency::{Begin, Fingerprint, IdempotentOperation};
    use dlock_runtime::LockKey;

    let master = RedisServer::start();
    let port = master.port().to_string();
    let mut replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    // `WAIT`s ¾ of it: room for a loaded machine's replica to answer.
    let locker = Locker::builder()
        .command_timeout(Duration::from_secs(2))
        .replicas(1)
        .connect(&master.url())
        .await
        .unwrap();
    let fingerprint = Fingerprint::builder().field("charge").finish();
    let resource = |key: &str| {
        locker
            .resource(LockKey::new(key).unwrap())
            .as_str()
            .to_owned()
    };
    // Until the replica has synced, a begin is not acknowledged: asked again.
    let run = async |key: &str| -> IdempotentOperation {
        let deadline = Deadline::after(Duration::from_secs(10));
        loop {
            match locker.idempotency(key, fingerprint).begin().await {
                Ok(Begin::Run(op)) => return op,
                Err(e) if e.is_unavailable() => deadline.check(format!("never acknowledged: {e}")),
                other => panic!("begin: {other:?}"),
            }
        }
    };
    let op = run("acked").await;
    let on_replica: Option<String> = replica.conn().await.get(resource("acked")).await.unwrap();
    assert!(
        on_replica.is_some(),
        "the operation ran before the replica had its lock"
    );
    op.complete(b"charged")
        .await
        .expect("an acknowledged record");
    let record: Option<Vec<u8>> = replica
        .conn()
        .await
        .hget(format!("{}:idem", resource("acked")), "res")
        .await
        .unwrap();
    assert_eq!(
        record.as_deref(),
        Some(&b"charged"[..]),
        "complete answered Ok before the replica had the record"
    );

    // Frozen: nothing is acknowledged any more.
    let op = run("later").await;
    replica.pause();
    let err = locker
        .idempotency("unacked", fingerprint)
        .begin()
        .await
        .expect_err("an operation ran whose lock no replica had");
    assert!(err.is_unavailable(), "{err}");
    let left: Option<String> = master.conn().await.get(resource("unacked")).await.unwrap();
    assert_eq!(
        left, None,
        "the unacknowledged begin's lock was not given back"
    );
    let err = op
        .complete(b"charged")
        .await
        .expect_err("complete answered Ok for a record no replica had");
    assert!(err.is_unavailable(), "{err}");
    let stored: Option<Vec<u8>> = master
        .conn()
        .await
        .hget(format!("{}:idem", resource("later")), "res")
        .await
        .unwrap();
    assert_eq!(
        stored.as_deref(),
        Some(&b"charged"[..]),
        "the master has it"
    );
    replica.resume();
}
