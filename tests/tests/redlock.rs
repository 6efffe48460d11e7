//! Redlock over 5 real `redis-server` processes: the shared conformance suite, and the quorum
//! under faults (paused, resumed and stopped nodes).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::backend::{RedlockBackend, RedlockOptions};
use dlock_runtime::conformance::Store;
use dlock_runtime::key::ResourceName;
use dlock_runtime::{LockError, Locker, OnFail};
use dlock_tests::redis_server::{redlock_url, start_many, urls, RedisServer};
use dlock_tests::wait::{poll, poll_until, refused_at_once, wait_until_free, Deadline};

const NODES: usize = 5;

/// A Redlock backend over the servers at `urls`.
async fn connect(urls: &[String], opts: RedlockOptions) -> Result<RedlockBackend, LockError> {
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    RedlockBackend::connect(&refs, opts).await
}

async fn redlock(servers: &[RedisServer], builder: dlock_runtime::LockerBuilder) -> Locker {
    redlock_with(servers, builder, Duration::from_millis(100)).await
}

async fn redlock_with(
    servers: &[RedisServer],
    builder: dlock_runtime::LockerBuilder,
    node_timeout: Duration,
) -> Locker {
    let opts = RedlockOptions::default().node_timeout(node_timeout);
    let backend = connect(&urls(servers), opts)
        .await
        .expect("redlock connect");
    builder.try_build(backend).expect("locker")
}

fn redlock_store() -> (Arc<Vec<RedisServer>>, Store) {
    let servers = Arc::new(start_many(NODES));
    let (for_lockers, for_breaking) = (servers.clone(), servers.clone());
    let mut store = Store::new(
        "redlock",
        move |b| {
            let servers = for_lockers.clone();
            Box::pin(async move { redlock(&servers, b).await })
        },
        move |resource| {
            let servers = for_breaking.clone();
            Box::pin(async move {
                // The holder's keys only (the value is its owner token, after a `|` when it
                // carries flags): a holder that got in while the nodes were being visited —
                // the broken one's watchdog gave up its other nodes — keeps its lock. The
                // holder is the token on a majority (a competitor's failed attempt may sit on
                // a node the holder's acquire never reached, until its undo lands).
                let mut seen: Vec<(String, usize)> = Vec::new();
                for s in servers.iter() {
                    let value: Option<String> = s.query(redis::cmd("GET").arg(&resource)).await;
                    let Some(token) = value.and_then(|v| v.rsplit('|').next().map(str::to_owned))
                    else {
                        continue;
                    };
                    match seen.iter_mut().find(|(t, _)| *t == token) {
                        Some((_, n)) => *n += 1,
                        None => seen.push((token, 1)),
                    }
                }
                let holder = seen
                    .into_iter()
                    .find(|(_, n)| *n >= 3)
                    .map(|(t, _)| t)
                    .expect("no token holds the lock on a majority");
                let script = redis::Script::new(
                    "local v = redis.call('GET', KEYS[1]) \
                     if v == ARGV[1] or (v and string.sub(v, -#ARGV[1] - 1) == '|' .. ARGV[1]) \
                     then return redis.call('DEL', KEYS[1]) end return 0",
                );
                let mut deleted = 0;
                for s in servers.iter() {
                    let mut call = script.key(&resource);
                    call.arg(&holder);
                    deleted += call.invoke_async::<i64>(&mut s.conn().await).await.unwrap();
                }
                assert!(deleted >= 3, "lock was on {deleted} nodes only");
            })
        },
    );
    store.fifo = false;
    store.idempotency = false;
    // Redlock refuses semaphores and read-write locks (`backend::redlock`).
    store.kinds = false;
    store.admin = false;
    (servers, store)
}

mod conformance {
    dlock_runtime::conformance_tests!(super::redlock_store);
}

/// Waits (bounded) until no node holds the lock key: commands still queued on a node's
/// connection (a late acquire, then its release or undo) land shortly after the caller returns.
async fn assert_cleared_everywhere(servers: &[RedisServer], resource: &str) {
    let deadline = Deadline::after(Duration::from_secs(2));
    for (i, s) in servers.iter().enumerate() {
        poll(
            &deadline,
            Duration::from_millis(5),
            async || match lock_key_exists(s, resource).await {
                true => Err(format!("lock left on node {i}")),
                false => Ok(()),
            },
        )
        .await;
    }
}

/// Takes `key` (waiting as the locker's default policy says) and releases it.
async fn acquire_and_release(locker: &Locker, key: &str) {
    let g = locker.lock(key).acquire().await.unwrap();
    g.release().await.unwrap();
}

async fn lock_key_exists(server: &RedisServer, resource: &str) -> bool {
    server
        .query::<i64>(redis::cmd("EXISTS").arg(resource))
        .await
        == 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_up_acquire_and_release() {
    let servers = start_many(NODES);
    let locker = redlock(&servers, Locker::builder()).await;
    let g = locker.lock("rl:basic").acquire().await.unwrap();
    let resource = locker.resource(dlock_runtime::LockKey::new("rl:basic").unwrap());
    // The acquire returns at the first majority; the other nodes may answer later.
    let mut holding = 0;
    for s in &servers {
        holding += usize::from(lock_key_exists(s, resource.as_str()).await);
    }
    assert!(holding >= 3, "lock on {holding} of 5 nodes");
    // Release returns at the first majority; every node processes it after its acquire (in
    // order on its connection), so all five are clear shortly after.
    g.release().await.unwrap();
    assert_cleared_everywhere(&servers, resource.as_str()).await;
}

/// Nodes that lost their scripts (restarted without persistence, `SCRIPT FLUSH`) are given
/// them again by the call that found them missing, and vote as before: every node here lost
/// them before the acquire and again before the release, so each majority is one of such
/// nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_that_lost_their_scripts_still_vote() {
    let servers = start_many(NODES);
    let locker = redlock(&servers, Locker::builder()).await;
    let resource = locker.resource(dlock_runtime::LockKey::new("rl:flushed").unwrap());
    let flush_all = || async {
        for s in &servers {
            let _: () = s.query(redis::cmd("SCRIPT").arg("FLUSH")).await;
        }
    };
    for round in 0..2 {
        flush_all().await;
        let loads = servers[0].calls("script|load").await;
        let g = locker
            .lock("rl:flushed")
            .try_acquire()
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("round {round}: not acquired"));
        let mut holding = 0;
        for s in &servers {
            holding += usize::from(lock_key_exists(s, resource.as_str()).await);
        }
        assert!(
            holding >= 3,
            "round {round}: the lock on {holding} of 5 nodes"
        );
        flush_all().await;
        g.release().await.unwrap();
        assert_cleared_everywhere(&servers, resource.as_str()).await;
        assert!(
            servers[0].calls("script|load").await > loads,
            "round {round}: the first node was given its scripts again"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_of_five_paused_still_acquires_without_waiting_for_them() {
    let mut servers = start_many(NODES);
    let node_timeout = Duration::from_millis(500);
    let locker = redlock_with(&servers, Locker::builder(), node_timeout).await;
    // Warm the connections so the measurement is the acquire itself.
    acquire_and_release(&locker, "rl:warm").await;
    servers[0].pause();
    servers[3].pause();
    let start = Instant::now();
    let g = locker
        .lock("rl:two-paused")
        .acquire()
        .await
        .expect("majority is up");
    let took = start.elapsed();
    // A majority answers within a round trip; the paused nodes' deadline is not waited for.
    assert!(
        took < node_timeout,
        "took {took:?}, the node deadline is {node_timeout:?}"
    );
    g.release().await.unwrap();
    servers[0].resume();
    servers[3].resume();
}

/// Two lockers over `servers` with `node_timeout`, whose own deadline (5 s) is past it: an
/// attempt waiting for a frozen node ends at the node timeout, not at the locker's.
async fn patient_lockers(servers: &[RedisServer], node_timeout: Duration) -> (Locker, Locker) {
    let opts = RedlockOptions::default().node_timeout(node_timeout);
    let locker = async || {
        let backend = connect(&urls(servers), opts.clone()).await.unwrap();
        Locker::builder()
            .command_timeout(Duration::from_secs(5))
            .try_build(backend)
            .unwrap()
    };
    (locker().await, locker().await)
}

/// A task of `locker` waiting up to `wait` for `key`.
fn wait_in_background(
    locker: &Locker,
    key: &'static str,
    wait: Duration,
) -> tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, LockError>> {
    let locker = locker.clone();
    tokio::spawn(async move {
        locker
            .lock(key)
            .on_fail(OnFail::retry(wait))
            .acquire()
            .await
    })
}

/// A failed attempt does not wait for its undo on a frozen node once a majority confirmed it:
/// a `try_acquire` of a held lock answers "held" in a round trip, not after the node timeout
/// (every failed attempt waited for every node's undo, so while a node was frozen, a 409 took
/// the node timeout). The same token's next attempt does not count the frozen node, whose undo
/// may still land there: a waiter takes the lock from the two nodes that are up once it frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_node_does_not_hold_up_a_held_answer() {
    let mut servers = start_many(3);
    let node_timeout = Duration::from_secs(2);
    let (a, b) = patient_lockers(&servers, node_timeout).await;
    // Its connections are made before the node freezes.
    acquire_and_release(&b, "rl:frozen-held-warm").await;
    let held = a.lock("rl:frozen-held").acquire().await.unwrap();
    servers[2].pause();
    for _ in 0..2 {
        let start = Instant::now();
        let answer = b.lock("rl:frozen-held").try_acquire().await;
        let took = start.elapsed();
        assert!(matches!(answer, Ok(None)), "{answer:?}");
        assert!(
            took < node_timeout,
            "\"held\" was answered after {took:?}: the attempt waited for the frozen node"
        );
    }
    let waiter = wait_in_background(&b, "rl:frozen-held", Duration::from_secs(20));
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(10),
        async || {
            if b.waiting() >= 1 {
                Ok(())
            } else if waiter.is_finished() {
                Err("the waiter ended".to_owned())
            } else {
                Err("not waiting".to_owned())
            }
        },
    )
    .await;
    let token = held.fencing_token();
    held.release().await.unwrap();
    let g = waiter
        .await
        .unwrap()
        .expect("the waiter takes the lock from the live majority");
    assert!(g.fencing_token() > token);
    servers[2].resume();
    g.release().await.unwrap();
}

/// Nodes that refuse for good (an ACL without the lock keys): one of three does not stop the
/// lock (the other two are a majority); when every failed node refused, the answer is
/// `Misconfigured` (500), and a wait through outages ends with it at once instead of
/// retrying until its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_that_refuse_for_good_are_misconfigured_not_an_outage() {
    let servers = start_many(3);
    let mut confined = Vec::new();
    for s in &servers {
        confined.push(s.confined_user_url("confined").await);
    }
    let build = async |urls: &[String]| {
        let backend = connect(urls, RedlockOptions::default())
            .await
            .expect("redlock connect");
        Locker::builder().try_build(backend).expect("locker")
    };
    let one = build(&[confined[0].clone(), servers[1].url(), servers[2].url()]).await;
    acquire_and_release(&one, "rl:refused-by-one").await;

    let all = build(&confined).await;
    refused_at_once(&all, "rl:refused").await;
}

/// Connecting with nodes that refuse the sign-in (a wrong password): when the nodes that did
/// not refuse cannot make a majority, retrying cannot fix it — `Misconfigured` (500), naming no
/// password; while a node that is merely down could still make one, `Unavailable` (503); with a
/// majority answering, the locker works and the refusing node is left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_to_nodes_that_refuse_the_sign_in_is_misconfigured_not_an_outage() {
    let mut servers = start_many(3);
    let mut wrong = Vec::new();
    for s in &servers {
        let url = s.confined_user_url("confined").await;
        wrong.push(url.replace(":pw@", ":not-the-pw@"));
    }
    let right = urls(&servers);
    // Also with a connect timeout shorter than the client's sign-in retries take.
    let short = RedlockOptions::default().connect_timeout(Duration::from_millis(100));
    for (nodes, opts, what) in [
        (
            wrong.clone(),
            RedlockOptions::default(),
            "every node refuses",
        ),
        (wrong.clone(), short, "every node refuses, 100 ms"),
        (
            vec![wrong[0].clone(), wrong[1].clone(), right[2].clone()],
            RedlockOptions::default(),
            "two of three refuse",
        ),
    ] {
        let err = connect(&nodes, opts)
            .await
            .err()
            .unwrap_or_else(|| panic!("{what}: connected"));
        assert!(err.is_misconfigured(), "{what}: {err}");
        let shown = format!("{err} {err:?}");
        assert!(!shown.contains("not-the-pw"), "{what}: {shown}");
        assert!(
            shown.contains("node0") && shown.contains("quorum 2"),
            "{what}: {shown}"
        );
    }

    let one = connect(
        &[wrong[0].clone(), right[1].clone(), right[2].clone()],
        RedlockOptions::default(),
    )
    .await
    .expect("a majority answers");
    let locker = Locker::builder().try_build(one).expect("locker");
    acquire_and_release(&locker, "rl:refused-sign-in").await;

    servers[2].stop();
    let err = connect(
        &[wrong[0].clone(), right[1].clone(), right[2].clone()],
        RedlockOptions::default(),
    )
    .await
    .expect_err("connected without a majority");
    assert!(err.is_unavailable(), "a down node may come back: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_of_five_paused_fails_typed_within_deadline_and_leaves_nothing() {
    let mut servers = start_many(NODES);
    let locker = redlock(
        &servers,
        Locker::builder().command_timeout(Duration::from_secs(2)),
    )
    .await;
    acquire_and_release(&locker, "rl:warm").await;
    for i in [1, 2, 4] {
        servers[i].pause();
    }
    let start = Instant::now();
    let err = locker.lock("rl:three-paused").acquire().await.unwrap_err();
    let took = start.elapsed();
    assert!(err.is_unavailable(), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("node1=failed") && msg.contains("quorum 3"),
        "per-node outcomes: {msg}"
    );
    // The node deadline (100 ms) for the votes + one more for the undo on every node, plus
    // scheduling slack; without per-node deadlines this would hang.
    assert!(took < Duration::from_millis(700), "took {took:?}");
    let resource = locker.resource(dlock_runtime::LockKey::new("rl:three-paused").unwrap());
    for i in [0, 3] {
        assert!(
            !lock_key_exists(&servers[i], resource.as_str()).await,
            "lock left on reachable node {i}"
        );
    }
    for i in [1, 2, 4] {
        servers[i].resume();
    }
    // The paused nodes executed the queued acquire after resuming, then the queued undo:
    // nothing is left anywhere.
    assert_cleared_everywhere(&servers, resource.as_str()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_node_rejoins_the_quorum() {
    let mut servers = start_many(NODES);
    let locker = redlock(&servers, Locker::builder()).await;
    servers[0].pause();
    servers[1].pause();
    acquire_and_release(&locker, "rl:rejoin-a").await;
    servers[0].resume();
    servers[1].resume();
    // Now pause two others: the majority needs node 0 or 1 back.
    servers[2].pause();
    servers[3].pause();
    let g = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || {
            let acquired = locker.lock("rl:rejoin-b").acquire().await;
            acquired.map_err(|e| format!("resumed nodes never rejoined: {e}"))
        },
    )
    .await;
    g.release().await.unwrap();
    servers[2].resume();
    servers[3].resume();
}

/// Two lockers contend while nodes are paused and resumed underneath: never two holders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_holds_through_node_faults() {
    let servers = start_many(NODES);
    let (a, b) = (
        redlock(&servers, Locker::builder()).await,
        redlock(&servers, Locker::builder()).await,
    );
    let servers = std::sync::Mutex::new(servers);
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut tasks = Vec::new();
    for i in 0..8 {
        let l = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (inside, overlaps, done, stop) =
            (inside.clone(), overlaps.clone(), done.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let acquire = l
                    .lock("rl:faults")
                    .ttl(Duration::from_secs(2))
                    .on_fail(OnFail::retry(Duration::from_millis(500)))
                    .acquire();
                let g = tokio::select! {
                    _ = stop.notified() => return,
                    r = acquire => r,
                };
                let Ok(g) = g else { continue };
                if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                done.fetch_add(1, Ordering::SeqCst);
                let _ = g.release().await;
            }
        }));
    }
    for round in 0..6usize {
        let pick = [round % NODES, (round + 2) % NODES];
        {
            let mut s = servers.lock().unwrap();
            for &i in &pick {
                s[i].pause();
            }
        }
        let before = done.load(Ordering::SeqCst);
        poll_until(
            Duration::from_secs(10),
            Duration::from_millis(5),
            async || {
                let progressed = done.load(Ordering::SeqCst) >= before + 10;
                progressed.then_some(()).ok_or("no progress with 3 of 5 up")
            },
        )
        .await;
        let mut s = servers.lock().unwrap();
        for &i in &pick {
            s[i].resume();
        }
    }
    stop.notify_waiters();
    for t in tasks {
        t.abort();
        let _ = t.await;
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    assert!(done.load(Ordering::SeqCst) >= 60);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_url_selects_redlock() {
    let servers = start_many(3);
    let locker = Locker::from_url(&redlock_url(&servers)).await.unwrap();
    assert_eq!(locker.backend_name(), "redlock");
    let g = locker.lock("rl:url").acquire().await.unwrap();
    assert!(locker.lock("rl:url").try_acquire().await.unwrap().is_none());
    g.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_without_a_majority_is_a_typed_error() {
    let mut servers = start_many(3);
    servers[0].stop();
    servers[1].stop();
    let opts = RedlockOptions::default().connect_timeout(Duration::from_millis(300));
    let err = connect(&urls(&servers), opts).await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
}

/// One node that refuses every write at once (a node at `maxmemory` with `noeviction` does the
/// same; here `min-replicas-to-write`), the lock held by another locker: every attempt is
/// "held" (wait), never "unavailable" (503), whichever nodes answer first. The fast failure
/// and one "held" decided the attempt before the third node answered, and the node not
/// waited for was counted as failed: a 503 on most attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_failing_fast_beside_a_holder_is_contention_not_an_outage() {
    let servers = start_many(3);
    let a = redlock(&servers, Locker::builder()).await;
    let b = redlock(&servers, Locker::builder()).await;
    let held = a.lock("rl:fast-fail").acquire().await.unwrap();
    // The grant answers at a quorum: one node may not have it (its write dropped once the
    // quorum answered). That node is the one made to refuse writes, so the two others hold the
    // lock and the release reaches a quorum; had a node holding it refused, the release could
    // not, and a try of `b` could take the node without it meanwhile.
    let resource = a.resource(dlock_runtime::LockKey::new("rl:fast-fail").unwrap());
    let mut refusing = servers.len() - 1;
    for (i, s) in servers.iter().enumerate() {
        if !lock_key_exists(s, resource.as_str()).await {
            refusing = i;
        }
    }
    let _: () = servers[refusing]
        .query(
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("min-replicas-to-write")
                .arg(1),
        )
        .await;
    for i in 0..30 {
        match b.lock("rl:fast-fail").try_acquire().await {
            Ok(None) => {}
            other => panic!("attempt {i}: {other:?}"),
        }
    }
    held.release().await.unwrap();
}

/// A node whose connection hangs (it accepts TCP and never answers) does not hold up a
/// waiter's subscription: the two healthy nodes carry the release notification, and the
/// waiter takes the lock when it frees. The subscription waited for every node, and its
/// deadline ended the wait with a 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_node_does_not_hold_up_a_waiters_subscription() {
    let servers = start_many(2);
    let mute = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut nodes = urls(&servers);
    nodes.push(format!("redis://{}", mute.local_addr().unwrap()));
    let locker = || async {
        let opts = RedlockOptions::default()
            .node_timeout(Duration::from_millis(100))
            .connect_timeout(Duration::from_millis(300));
        let backend = connect(&nodes, opts).await.expect("a majority answers");
        Locker::builder().try_build(backend).unwrap()
    };
    let (a, b) = (locker().await, locker().await);
    let held = a.lock("rl:hung").acquire().await.unwrap();
    let waiter = wait_in_background(&b, "rl:hung", Duration::from_secs(10));
    // Counted as waiting once subscribed (and asked again since).
    let start = Instant::now();
    while b.waiting() == 0 {
        if waiter.is_finished() {
            panic!(
                "the waiter never got to wait: {:?}",
                waiter.await.unwrap().err()
            );
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the waiter never got to wait"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    held.release().await.unwrap();
    let got = waiter.await.unwrap();
    assert!(got.is_ok(), "{:?}", got.err());
    drop(mute);
}

/// Subscribers to `resource`'s release channel on `server`.
async fn subscribers(server: &RedisServer, resource: &str) -> i64 {
    let n: Vec<(String, i64)> = server
        .query(
            redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg(format!("{resource}:ch")),
        )
        .await;
    n.first().map_or(0, |(_, subscribers)| *subscribers)
}

/// A waiter's subscription that a node ran after its caller gave up on it — the node frozen
/// when it was sent, it runs it when it wakes; the waiter cancelled meanwhile (its request's
/// client went away) — is dropped with the lock's last local waiter, like the others. It was
/// not: the backend dropped only the subscriptions it saw confirmed, so a node kept one for
/// every lock whose waiter was cut off that way, for the life of the process (and redis-rs,
/// which tracks what the server confirms, subscribed them again on every new connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_a_node_ran_after_its_waiter_left_is_dropped() {
    let mut servers = start_many(3);
    // A node timeout long enough that the waiter's undo and `SUBSCRIBE` on the frozen node are
    // still on their way when the waiter is cancelled and the node woken, and that the
    // connection check the cut-off `SUBSCRIBE` may start (a `PING` within the node timeout) is
    // answered: the connection stays, and its subscriptions with it.
    let (a, b) = patient_lockers(&servers, Duration::from_secs(2)).await;
    let resource = "dlock:{latesub}";
    // Its connections are made before the node freezes.
    acquire_and_release(&b, "latesub-warm").await;
    let held = a.lock("latesub").acquire().await.unwrap();
    servers[2].pause();
    let waiter = wait_in_background(&b, "latesub", Duration::from_secs(10));
    // Subscribed on the live nodes: its `SUBSCRIBE` to the frozen one is on its way too.
    for server in &servers[..2] {
        poll_until(
            Duration::from_secs(10),
            Duration::from_millis(5),
            async || match subscribers(server, resource).await {
                0 => Err("the waiter has not subscribed"),
                _ => Ok(()),
            },
        )
        .await;
    }
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    servers[2].resume();
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(10),
        async || match servers[2].calls("subscribe").await {
            0 => Err("the frozen node never ran the waiter's SUBSCRIBE"),
            _ => Ok(()),
        },
    )
    .await;
    // The last local waiter is gone: no node keeps the lock's channel, the late one included.
    for (i, server) in servers.iter().enumerate() {
        poll_until(
            Duration::from_secs(5),
            Duration::from_millis(10),
            async || match subscribers(server, resource).await {
                0 => Ok(()),
                n => Err(format!(
                    "node {i} keeps {n} subscribers to a lock nobody waits on"
                )),
            },
        )
        .await;
    }
    held.release().await.unwrap();
}

/// An undo that did not reach enough nodes for the others to make a quorum is not done: it
/// answers `Unavailable`, so the locker keeps retrying it in the background (it answered `Ok`
/// whatever the nodes said, and a grant landing late on a majority stayed to its TTL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undo_that_missed_a_majority_is_not_done() {
    use dlock_runtime::backend::{Backend as _, OwnerToken};
    use dlock_runtime::LockKey;

    let mut servers = start_many(3);
    let opts = RedlockOptions::default().node_timeout(Duration::from_millis(100));
    let backend = connect(&urls(&servers), opts).await.unwrap();
    let locker = Locker::builder().build(backend.clone());
    let resource = locker.resource(LockKey::new("rl:undo").unwrap());
    let token = OwnerToken::generate();
    backend
        .abandon(&resource, &token)
        .await
        .expect("every node undid it");
    servers[0].pause();
    servers[1].pause();
    let err = backend
        .abandon(&resource, &token)
        .await
        .expect_err("undone on one node of three");
    assert!(err.is_unavailable(), "{err}");
    servers[1].resume();
    backend
        .abandon(&resource, &token)
        .await
        .expect("two of three undid it: no majority can be left");
    servers[0].resume();
}

/// An undo a node did not confirm can land after a later attempt of the same token was
/// granted there: sent on a connection that went silent and was replaced, and delivered when
/// the partition heals. It cannot tell the two grants apart and empties the node, so the
/// token's lock must not rest on that node: its "yes" to the same token counts as a failure
/// until the token is done. Counted as a yes, the second attempt took the lock on node 0 and
/// node 1, the late undo emptied node 0, and another owner then took nodes 0 and 2 — two
/// owners at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_undo_cannot_empty_a_node_the_same_tokens_lock_rests_on() {
    use dlock_runtime::backend::{Attempt, Backend as _, OwnerToken, WaitMode};
    use dlock_runtime::conformance::{abandon_as, attempt_as};
    use dlock_runtime::LockKey;
    use dlock_tests::proxy::Proxy;
    use dlock_tests::wait::wait_for;

    let servers = start_many(3);
    let proxy = Proxy::start(servers[0].port()).await.unwrap();
    let nodes = [proxy.url(), servers[1].url(), servers[2].url()];
    let opts = RedlockOptions::default().node_timeout(Duration::from_millis(100));
    let backend = connect(&nodes, opts).await.unwrap();
    let locker = Locker::builder().build(backend.clone());
    let other = redlock_with(&servers, Locker::builder(), Duration::from_millis(100)).await;
    let key = "rl:late-undo";
    let resource = locker.resource(LockKey::new(key).unwrap());
    let ttl = Duration::from_secs(30);
    // Warm up: the scripts are loaded on every node, so each attempt is one command per node.
    acquire_and_release(&locker, key).await;
    acquire_and_release(&other, key).await;
    assert_cleared_everywhere(&servers, resource.as_str()).await;

    // Someone else holds node 1 alone, and node 0's connection is cut off with what is sent
    // on it kept: the first attempt is granted by node 2 only, and undone — on node 0 too,
    // where the undo waits behind the attempt.
    // Held by someone else on one node: a plain key, as a lock's value is its owner's token.
    let held_by_another = |name: &str| {
        redis::cmd("SET")
            .arg(name)
            .arg("someone-else")
            .arg("PX")
            .arg(120_000)
            .clone()
    };
    let someone_else = held_by_another(resource.as_str());
    let _: () = servers[1].query(&someone_else).await;
    let accepted = proxy.accepted();
    assert!(proxy.hold() > 0, "the locker has a connection to node 0");
    let token = OwnerToken::generate();
    let first = attempt_as(&locker, &resource, &token, WaitMode::Try, ttl).await;
    assert!(matches!(first, Ok(Attempt::Held { .. })), "{first:?}");

    // The locker replaces the silent connection (the next command makes the new one). Until a
    // lock held elsewhere on node 1 can be taken on nodes 0 and 2: node 0 answers in time on
    // the new connection (else the attempt below failed on node 0's silence, not its undo).
    let probe = locker.resource(LockKey::new("rl:late-undo:probe").unwrap());
    let _: () = servers[1].query(&held_by_another(probe.as_str())).await;
    poll_until(Duration::from_secs(5), Duration::ZERO, async || {
        let t = OwnerToken::generate();
        let got = attempt_as(&locker, &probe, &t, WaitMode::Try, ttl).await;
        let _ = abandon_as(&locker, &probe, &t).await;
        match got {
            Ok(Attempt::Acquired { .. }) => Ok(()),
            _ => Err(format!(
                "node 0 does not answer on a new connection: {got:?}"
            )),
        }
    })
    .await;
    assert!(proxy.accepted() > accepted, "a new connection to node 0");

    // Node 1 frees, someone else holds node 2: the second attempt can rest on nodes 0 and 1
    // only.
    let _: () = servers[1]
        .query(redis::cmd("DEL").arg(resource.as_str()))
        .await;
    let _: () = servers[2].query(&someone_else).await;
    let second = attempt_as(&locker, &resource, &token, WaitMode::Try, ttl).await;
    let second_held = matches!(second, Ok(Attempt::Acquired { .. }));

    // The partition heals: the first attempt and its undo reach node 0.
    proxy.deliver_held();
    wait_for(
        "the held connection to be delivered and closed",
        Duration::from_secs(5),
        async || (proxy.open() <= 1).then_some(()),
    )
    .await;
    let _: () = servers[2]
        .query(redis::cmd("DEL").arg(resource.as_str()))
        .await;
    // Node 0 ends empty either way: the late undo took back what the late attempt granted
    // (and, counted, the second attempt's grant). Then another owner tries: the lock is free
    // unless the second attempt took it.
    let deadline = Deadline::after(Duration::from_secs(5));
    poll(
        &deadline,
        Duration::from_millis(5),
        async || match lock_key_exists(&servers[0], resource.as_str()).await {
            true => Err("the late undo has not landed on node 0"),
            false => Ok(()),
        },
    )
    .await;
    let got = other.lock(key).ttl(ttl).try_acquire().await.unwrap();
    assert!(
        !(second_held && got.is_some()),
        "two owners: the token's lock rested on node 0, which its late undo emptied"
    );
    assert!(
        matches!(second, Ok(Attempt::Held { .. })),
        "node 0's yes must not count while the undo may land: {second:?}"
    );

    // The token still takes the lock on the nodes its undo cannot reach — once the other
    // owner's release reached every node (it answers once a majority did; the last node's
    // "held" beside node 0's discounted "yes" left the token short of a majority).
    got.expect("the lock was free").release().await.unwrap();
    assert_cleared_everywhere(&servers, resource.as_str()).await;
    let third = attempt_as(&locker, &resource, &token, WaitMode::Try, ttl).await;
    assert!(matches!(third, Ok(Attempt::Acquired { .. })), "{third:?}");
    assert!(backend.release(&resource, &token).await.unwrap());
    assert_cleared_everywhere(&servers, resource.as_str()).await;
}

/// Now, in µs since the epoch: the unit of fencing tokens drawn from a clock.
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Sets a node's fencing counters for `resource` (its per-key counter and its namespace
/// counter, whichever the backend reads) to `value`: what a clock that far ahead proposed.
async fn put_counters(
    c: &mut redis::aio::MultiplexedConnection,
    locker: &Locker,
    resource: &ResourceName,
    value: u64,
) {
    for counter in [
        resource.with_suffix("fence"),
        format!("{}:fence", locker.prefix()),
    ] {
        let _: () = redis::cmd("SET")
            .arg(counter)
            .arg(value)
            .query_async(c)
            .await
            .unwrap();
    }
}

/// Moves a node's key store `by` into the future, as its clock jumping ahead would: every key
/// whose remaining TTL is shorter than `by` is gone. Keys without a TTL stay.
async fn jump_ahead(server: &RedisServer, by: Duration) {
    let mut c = server.conn().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut c)
        .await
        .unwrap();
    for key in keys {
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut c)
            .await
            .unwrap();
        if pttl >= 0 && (pttl as u128) < by.as_millis() {
            let _: i64 = redis::cmd("DEL")
                .arg(&key)
                .query_async(&mut c)
                .await
                .unwrap();
        }
    }
}

/// Fencing tokens stay strictly increasing per key across expiry when one
/// node's clock is ahead. Node 0's token source runs an hour ahead (its counter holds what a
/// clock an hour fast proposes), so the first token comes from it and every granting node is
/// raised to it. Then time passes on the other nodes well beyond the lease and the counters'
/// old retention (TTL + 60 s), and node 0 goes away: the next holder, granted by nodes 1 and 2
/// alone, must still get a larger token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_stays_monotonic_with_a_node_clock_ahead_across_expiry() {
    let mut servers = start_many(3);
    let locker = redlock(&servers, Locker::builder()).await;
    let key = "rl:fence-ahead";
    let resource = locker.resource(dlock_runtime::LockKey::new(key).unwrap());
    let lease = Duration::from_secs(1);
    let ahead = now_us() + 3_600_000_000;
    // Node 0's token source, an hour ahead.
    put_counters(&mut servers[0].conn().await, &locker, &resource, ahead).await;
    // Node 2 does not answer for now, so the granting majority is nodes 0 and 1: the token is
    // node 0's proposal, and node 1 is raised to it.
    servers[2].pause();
    let first = locker.lock(key).ttl(lease).acquire().await.unwrap();
    let t1 = first.fencing_token();
    assert!(
        t1 > ahead,
        "the ahead node's proposal wins: {t1} vs {ahead}"
    );
    first.release().await.unwrap();
    servers[2].resume();
    assert_cleared_everywhere(&servers, resource.as_str()).await;

    for s in &servers[1..] {
        jump_ahead(s, Duration::from_secs(120)).await;
    }
    servers[0].stop();
    let second = locker.lock(key).ttl(lease).acquire().await.unwrap();
    assert!(
        second.fencing_token() > t1,
        "fencing went backwards: {} after {t1}",
        second.fencing_token()
    );
    second.release().await.unwrap();
}

/// A node's counter past 2^53 - 1 (set by hand, or a clock centuries ahead): the nodes'
/// scripts count in doubles, exact only below 2^53, so no token above the ones before can be
/// told. The acquire is a typed `Misconfigured` (500), and the lock the nodes granted is undone
/// on every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fencing_counter_past_the_tokens_range_is_misconfigured_and_takes_no_lock() {
    let mut servers = start_many(3);
    let locker = redlock(&servers, Locker::builder()).await;
    let key = "rl:fence-range";
    let resource = locker.resource(dlock_runtime::LockKey::new(key).unwrap());
    // On every node, so that whichever majority answers first has one past the range.
    for s in &servers {
        put_counters(&mut s.conn().await, &locker, &resource, 1 << 53).await;
    }
    let err = locker.lock(key).acquire().await.unwrap_err();
    assert!(err.is_misconfigured(), "{err}");
    assert_eq!(err.status(), 500);
    assert_cleared_everywhere(&servers, resource.as_str()).await;
    // With node 0 away and the others' counters back in range, they grant it as before.
    for s in &servers[1..] {
        put_counters(&mut s.conn().await, &locker, &resource, now_us()).await;
    }
    servers[0].stop();
    let g = locker.lock(key).acquire().await.unwrap();
    assert!(g.fencing_token() < 1 << 53);
    g.release().await.unwrap();
}

/// A majority grants the lock but fewer than a majority confirm the raised
/// fencing token (the network fails between the two steps): the acquire is a 503
/// (unavailable), not a 409 (someone else holds it), and the lock frees within its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfirmed_fence_raise_is_unavailable_not_contended() {
    use dlock_tests::proxy::Proxy;

    let servers = start_many(3);
    let proxies = [
        Proxy::start(servers[1].port()).await.unwrap(),
        Proxy::start(servers[2].port()).await.unwrap(),
    ];
    let urls = [servers[0].url(), proxies[0].url(), proxies[1].url()];
    let opts = RedlockOptions::default().node_timeout(Duration::from_millis(200));
    let backend = connect(&urls, opts).await.unwrap();
    let locker = Locker::builder().try_build(backend).unwrap();
    let key = "rl:raise-fails";
    let resource = locker.resource(dlock_runtime::LockKey::new(key).unwrap());
    // Warm up: the acquire script is loaded on every node, so the acquire below is one
    // command per node.
    let lease = Duration::from_secs(1);
    let g = locker.lock(key).ttl(lease).acquire().await.unwrap();
    g.release().await.unwrap();
    assert_cleared_everywhere(&servers, resource.as_str()).await;
    // Three different proposals (node 0 highest, node 1 lowest): whichever two nodes grant
    // first, one of them proposes less than the other and must be raised — and node 1 or 2 is
    // always among them.
    let base = now_us() + 3_600_000_000;
    put_counters(
        &mut servers[0].conn().await,
        &locker,
        &resource,
        base + 7_200_000_000,
    )
    .await;
    put_counters(
        &mut servers[2].conn().await,
        &locker,
        &resource,
        base + 3_600_000_000,
    )
    .await;

    // Nodes 1 and 2 answer the acquire, then the network to them fails.
    for p in &proxies {
        p.cut_after_next_reply();
    }
    let err = locker.lock(key).ttl(lease).try_acquire().await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    assert_eq!(err.status(), 503);
    assert!(err.to_string().contains("fencing"), "{err}");

    // The lock it may have left on nodes 1 and 2 ends with its lease.
    for p in &proxies {
        p.allow();
    }
    let deadline = Deadline::after(Duration::from_secs(5));
    let every = Duration::from_millis(20);
    wait_until_free(&locker, key, &deadline, every, "the key stays locked").await;
}

/// Every `EVALSHA` a node runs from now on, as the number of the `rl:one-trip:<n>` lock it
/// names (read from `MONITOR`, so commands of other locks — a warm-up's release still landing —
/// are not counted); an `EVALSHA` that names no lock (a fence raise) counts as [`OTHER`], and
/// one with more than a plain try's arguments as [`LONG`].
struct ScriptCalls(
    tokio::sync::mpsc::UnboundedReceiver<usize>,
    Vec<[u32; 10]>,
    [u32; 2],
);

/// What [`ScriptCalls`] sends for a script call that names no lock.
const OTHER: usize = usize::MAX;
/// What [`ScriptCalls`] sends for a lock's script call with more words than an uncontended
/// try's: the SHA, the key count, the key, and four arguments.
const LONG: usize = usize::MAX - 1;

impl ScriptCalls {
    async fn start(servers: &[RedisServer]) -> Self {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for (node, s) in servers.iter().enumerate() {
            let client = redis::Client::open(s.url()).unwrap();
            let mut monitor = client.get_async_monitor().await.unwrap();
            let tx = tx.clone();
            tokio::spawn(async move {
                use futures_util::StreamExt;
                let mut lines = monitor.on_message::<String>();
                while let Some(line) = lines.next().await {
                    let Some((_, args)) = line.split_once("\"EVALSHA\"") else {
                        continue;
                    };
                    let digit = args
                        .split_once("one-trip:")
                        .and_then(|(_, rest)| rest.chars().next())
                        .and_then(|c| c.to_digit(10));
                    let words = args.split("\" \"").count();
                    let at = match digit {
                        Some(_) if words > 7 => LONG,
                        Some(n) => node * 10 + n as usize,
                        None if args.contains(":{") => continue,
                        None => OTHER,
                    };
                    if tx.send(at).is_err() {
                        return;
                    }
                }
            });
        }
        ScriptCalls(rx, vec![[0; 10]; servers.len()], [0; 2])
    }

    fn count(&mut self, at: usize) {
        match at {
            OTHER => self.2[0] += 1,
            LONG => self.2[1] += 1,
            at => self.1[at / 10][at % 10] += 1,
        }
    }

    /// Reads calls until, for every lock, every node ran at least one (the release reaches
    /// every node) and a majority ran one more (the acquire), or 2 s pass; then the calls per
    /// node and lock, and the calls that named no lock and that were longer than a plain try.
    /// (Waiting only for one call per node stopped early when a node's release of the last lock
    /// was still on its way after its acquire.)
    async fn settle(mut self) -> (Vec<[u32; 10]>, [u32; 2]) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        let nodes = self.1.len();
        // Every node's release, and a majority's acquire.
        let expected_sum = nodes + nodes / 2 + 1;
        let expected = |calls: &[[u32; 10]], lock: usize| {
            let per_node = calls.iter().map(|node| node[lock] as usize);
            calls.iter().all(|node| node[lock] >= 1) && per_node.sum::<usize>() >= expected_sum
        };
        while !(0..10).all(|lock| expected(&self.1, lock)) {
            match tokio::time::timeout_at(deadline, self.0.recv()).await {
                Ok(Some(at)) => self.count(at),
                _ => break,
            }
        }
        while let Ok(at) = self.0.try_recv() {
            self.count(at);
        }
        (self.1, self.2)
    }
}

/// How many `PING`s `server` has answered.
async fn pings(server: &RedisServer) -> u64 {
    let info: String = server.query(redis::cmd("INFO").arg("commandstats")).await;
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_ping:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().expect("a count"))
}

/// Once the client's fencing floor is above the nodes' counters (after the first acquire),
/// every node proposes the same token, so an uncontended acquire is one script call per node —
/// no fence raise — and a release one more; the acquire carries a plain try's four arguments
/// (each costs the server a Lua string). No `PING` either: the last node's acquire, dropped
/// once the majority answered, is not taken for a sign of a silent connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncontended_acquire_is_one_short_round_trip_per_node() {
    let servers = start_many(3);
    let locker = redlock(&servers, Locker::builder()).await;
    let warm = locker.lock("rl:warm").acquire().await.unwrap();
    warm.release().await.unwrap();
    let calls = ScriptCalls::start(&servers).await;
    let mut pinged = Vec::new();
    for s in &servers {
        pinged.push(pings(s).await);
    }
    let mut last = 0;
    for i in 0..10 {
        let g = locker
            .lock(format!("rl:one-trip:{i}"))
            .acquire()
            .await
            .unwrap();
        assert!(g.fencing_token() > last);
        last = g.fencing_token();
        g.release().await.unwrap();
    }
    // Acquire and release return at the majority; the last node's calls may still be landing.
    // A release reaches every node (its per-node commands run as tasks of their own), but an
    // acquire whose majority was already in may drop a node's command before it was sent (a
    // loaded machine): that node then simply never had the lock. So every node ran, per lock,
    // its release and at most one acquire, and a majority (2 of 3) ran the acquire.
    let (calls, [other, long]) = calls.settle().await;
    assert_eq!(other, 0, "fence raises (script calls naming no lock)");
    assert_eq!(
        long, 0,
        "script calls with more than a plain try's arguments"
    );
    for (s, before) in servers.iter().zip(pinged) {
        assert_eq!(pings(s).await, before, "a PING on the hot path");
    }
    for i in 0..10 {
        let per_node: Vec<u32> = calls.iter().map(|node| node[i]).collect();
        assert!(
            per_node.iter().all(|c| (1..=2).contains(c)) && per_node.iter().sum::<u32>() >= 5,
            "lock {i}: an acquire and a release on every node, nothing more: {per_node:?}"
        );
    }
}

/// A drift factor outside 0–0.5 set on the public field (NaN, negative, huge) is refused at
/// connect: it panicked in every lease computation (`Duration::mul_f64`). The setter clamps,
/// NaN to the most cautious 0.5.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drift_factor_out_of_range_is_misconfigured_not_a_panic() {
    let servers = start_many(1);
    for bad in [f64::NAN, -0.1, 2.0, f64::INFINITY] {
        let mut opts = RedlockOptions::default();
        opts.drift_factor = bad;
        let err = connect(&urls(&servers), opts)
            .await
            .err()
            .unwrap_or_else(|| panic!("{bad}: connected"));
        assert!(err.is_misconfigured(), "{bad}: {err}");
    }
    assert_eq!(
        RedlockOptions::default()
            .drift_factor(f64::NAN)
            .drift_factor,
        0.5
    );
    assert_eq!(
        RedlockOptions::default().drift_factor(-1.0).drift_factor,
        0.0
    );
}

/// A majority that grants the lock only after its validity ran out (the nodes answer slower
/// than the TTL allows) is a 503: nobody holds the lock. It was answered "held" — a 409
/// naming no holder — and the lock was left to its TTL on the nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_majority_granting_after_the_validity_is_unavailable_not_held() {
    let servers = start_many(3);
    let (proxies, _backend, locker) = behind_proxies(&servers, Duration::from_millis(500)).await;
    // A round trip takes 60 ms; the TTL is 50 ms.
    let (latency, ttl) = (Duration::from_millis(30), Duration::from_millis(50));
    too_slow_and_undone(&proxies, &locker, "rl:late", latency, ttl).await;
}

/// Three nodes behind proxies (the acquire script loaded through them), and a locker over them.
async fn behind_proxies(
    servers: &[RedisServer],
    node_timeout: Duration,
) -> (Vec<dlock_tests::proxy::Proxy>, RedlockBackend, Locker) {
    let mut proxies = Vec::new();
    for s in servers {
        proxies.push(dlock_tests::proxy::Proxy::start(s.port()).await.unwrap());
    }
    let urls: Vec<String> = proxies.iter().map(dlock_tests::proxy::Proxy::url).collect();
    let opts = RedlockOptions::default().node_timeout(node_timeout);
    let backend = connect(&urls, opts).await.unwrap();
    let locker = Locker::builder().try_build(backend.clone()).unwrap();
    let g = locker.lock("rl:warm-up").acquire().await.unwrap();
    g.release().await.unwrap();
    (proxies, backend, locker)
}

/// With every node `latency` away (each way), a try of `key` for `ttl` is a 503 — granted, but
/// too late for its validity — and undone on every node: free at once afterwards.
async fn too_slow_and_undone(
    proxies: &[dlock_tests::proxy::Proxy],
    locker: &Locker,
    key: &str,
    latency: Duration,
    ttl: Duration,
) {
    for p in proxies {
        p.set_latency(latency);
    }
    let err = locker
        .lock(key)
        .ttl(ttl)
        .try_acquire()
        .await
        .expect_err("granted after its validity: no lock, and not held by another");
    assert!(err.is_unavailable(), "{err}");
    assert!(err.to_string().contains("too slowly"), "{err}");
    for p in proxies {
        p.set_latency(Duration::ZERO);
    }
    assert!(locker.lock(key).try_acquire().await.unwrap().is_some());
}

/// A majority grants the lock in time, but their tokens differ and the raise of the lower
/// ones — a second round trip — ends after the validity: a 503, undone everywhere. It was
/// answered "acquired", and the guard started with its lease already over: work run under a
/// lock the nodes may have let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_raise_ending_after_the_validity_is_unavailable_not_held() {
    let servers = start_many(3);
    let (proxies, _backend, locker) = behind_proxies(&servers, Duration::from_millis(500)).await;
    let key = "rl:late-raise";
    let resource = locker.resource(dlock_runtime::LockKey::new(key).unwrap());
    // Three different proposals: whichever two nodes grant, one is raised.
    let base = now_us() + 3_600_000_000;
    for (i, s) in servers.iter().enumerate() {
        let ahead = base + i as u64 * 3_600_000_000;
        put_counters(&mut s.conn().await, &locker, &resource, ahead).await;
    }
    // The grant takes one round trip (80 ms) of the 150 ms TTL, with 4 ms of drift; the raise
    // takes another.
    let (latency, ttl) = (Duration::from_millis(40), Duration::from_millis(150));
    too_slow_and_undone(&proxies, &locker, key, latency, ttl).await;
}

/// A lock's last step (a release before its minimum hold ends) sets a rest shorter than the
/// nodes' round trip: the lock is ours, and lets go by itself when the rest ends. It was
/// answered "not ours" — a guard's release reported the lock lost — because the validity an
/// extend claims had run out before the answers came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_last_step_shorter_than_the_round_trip_is_not_a_loss() {
    use dlock_runtime::backend::{Attempt, Backend, OwnerToken, WaitMode};
    use dlock_runtime::conformance::attempt_as;

    let servers = start_many(3);
    let (proxies, backend, locker) = behind_proxies(&servers, Duration::from_millis(500)).await;
    let key = "rl:short-rest";
    let resource = locker.resource(dlock_runtime::LockKey::new(key).unwrap());
    let token = OwnerToken::generate();
    let ttl = Duration::from_secs(10);
    let got = attempt_as(&locker, &resource, &token, WaitMode::Try, ttl).await;
    assert!(matches!(got, Ok(Attempt::Acquired { .. })), "{got:?}");
    for p in &proxies {
        p.set_latency(Duration::from_millis(20));
    }
    // A 40 ms round trip for a 20 ms rest.
    let kept = backend
        .expire(&resource, &token, Duration::from_millis(20))
        .await;
    assert!(matches!(kept, Ok(true)), "{kept:?}");
    for p in &proxies {
        p.set_latency(Duration::ZERO);
    }
    let deadline = Deadline::after(Duration::from_secs(5));
    let every = Duration::from_millis(10);
    wait_until_free(&locker, key, &deadline, every, "the rest ends by itself").await;
}
