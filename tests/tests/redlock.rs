//! Redlock over 5 real `redis-server` processes: the shared conformance suite, and the quorum
//! under faults (paused, resumed and stopped nodes).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::backend::{RedlockBackend, RedlockOptions};
use dlock_runtime::conformance::Store;
use dlock_runtime::{Locker, OnFail};
use dlock_tests::redis_server::{start_many, RedisServer};

const NODES: usize = 5;

fn urls(servers: &[RedisServer]) -> Vec<String> {
    servers.iter().map(RedisServer::url).collect()
}

async fn redlock(servers: &[RedisServer], builder: dlock_runtime::LockerBuilder) -> Locker {
    redlock_with(servers, builder, Duration::from_millis(100)).await
}

async fn redlock_with(
    servers: &[RedisServer],
    builder: dlock_runtime::LockerBuilder,
    node_timeout: Duration,
) -> Locker {
    let urls = urls(servers);
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let backend =
        RedlockBackend::connect(&refs, RedlockOptions::default().node_timeout(node_timeout))
            .await
            .expect("redlock connect");
    builder.try_build(backend).expect("locker")
}

fn store(servers: &Arc<Vec<RedisServer>>) -> Store {
    let for_lockers = servers.clone();
    let urls = urls(servers);
    Store {
        name: "redlock",
        locker: Box::new(move |b| {
            let servers = for_lockers.clone();
            Box::pin(async move { redlock(&servers, b).await })
        }),
        break_lock: Box::new(move |resource| {
            let urls = urls.clone();
            Box::pin(async move {
                let mut deleted = 0;
                for url in urls {
                    let client = redis::Client::open(url).unwrap();
                    let mut c = client.get_multiplexed_async_connection().await.unwrap();
                    let n: i64 = redis::cmd("DEL")
                        .arg(&resource)
                        .query_async(&mut c)
                        .await
                        .unwrap();
                    deleted += n;
                }
                assert!(deleted >= 3, "lock was on {deleted} nodes only");
            })
        }),
        fifo: false,
        idempotency: false,
        notifications: true,
    }
}

fn redlock_store() -> (Arc<Vec<RedisServer>>, Store) {
    let servers = Arc::new(start_many(NODES));
    let store = store(&servers);
    (servers, store)
}

mod conformance {
    dlock_runtime::conformance_tests!(super::redlock_store);
}

/// Waits (bounded) until no node holds the lock key: commands still queued on a node's
/// connection (a late acquire, then its release or undo) land shortly after the caller returns.
async fn assert_cleared_everywhere(servers: &[RedisServer], resource: &str) {
    let start = Instant::now();
    for (i, s) in servers.iter().enumerate() {
        while lock_key_exists(s, resource).await {
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "lock left on node {i}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

async fn lock_key_exists(server: &RedisServer, resource: &str) -> bool {
    let client = redis::Client::open(server.url()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let n: i64 = redis::cmd("EXISTS")
        .arg(resource)
        .query_async(&mut c)
        .await
        .unwrap();
    n == 1
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_of_five_paused_still_acquires_without_waiting_for_them() {
    let mut servers = start_many(NODES);
    let node_timeout = Duration::from_millis(500);
    let locker = redlock_with(&servers, Locker::builder(), node_timeout).await;
    // Warm the connections so the measurement is the acquire itself.
    locker
        .lock("rl:warm")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_of_five_paused_fails_typed_within_deadline_and_leaves_nothing() {
    let mut servers = start_many(NODES);
    let locker = redlock(
        &servers,
        Locker::builder().command_timeout(Duration::from_secs(2)),
    )
    .await;
    locker
        .lock("rl:warm")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
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
    locker
        .lock("rl:rejoin-a")
        .acquire()
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    servers[0].resume();
    servers[1].resume();
    // Now pause two others: the majority needs node 0 or 1 back.
    servers[2].pause();
    servers[3].pause();
    let start = Instant::now();
    loop {
        match locker.lock("rl:rejoin-b").acquire().await {
            Ok(g) => {
                g.release().await.unwrap();
                break;
            }
            Err(e) => {
                assert!(
                    start.elapsed() < Duration::from_secs(5),
                    "resumed nodes never rejoined: {e}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
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
        let start = Instant::now();
        while done.load(Ordering::SeqCst) < before + 10 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "no progress with 3 of 5 up"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
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
    let url = format!(
        "redlock://{}",
        servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect::<Vec<_>>()
            .join(",")
    );
    let locker = Locker::from_url(&url).await.unwrap();
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
    let urls = urls(&servers);
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let err = RedlockBackend::connect(
        &refs,
        RedlockOptions::default().connect_timeout(Duration::from_millis(300)),
    )
    .await
    .unwrap_err();
    assert!(err.is_unavailable(), "{err}");
}

async fn node(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(server.url()).unwrap();
    client.get_multiplexed_async_connection().await.unwrap()
}

/// Moves a node's key store `by` into the future, as its clock jumping ahead would: every key
/// whose remaining TTL is shorter than `by` is gone. Keys without a TTL stay.
async fn jump_ahead(server: &RedisServer, by: Duration) {
    let mut c = node(server).await;
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

/// Issue 12 item 7: fencing tokens stay strictly increasing per key across expiry when one
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
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let ahead = now_us + 3_600_000_000;
    {
        // Node 0's token source, an hour ahead: its per-key counter and its namespace counter
        // (whichever the backend reads) hold what its clock proposed.
        let mut c = node(&servers[0]).await;
        for counter in [
            resource.with_suffix("fence"),
            format!("{}:fence", locker.prefix()),
        ] {
            let _: () = redis::cmd("SET")
                .arg(counter)
                .arg(ahead)
                .query_async(&mut c)
                .await
                .unwrap();
        }
    }
    let first = locker
        .lock(key)
        .ttl(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    let t1 = first.fencing_token();
    assert!(
        t1 > ahead,
        "the ahead node's proposal wins: {t1} vs {ahead}"
    );
    first.release().await.unwrap();
    assert_cleared_everywhere(&servers, resource.as_str()).await;

    for s in &servers[1..] {
        jump_ahead(s, Duration::from_secs(120)).await;
    }
    servers[0].stop();
    let second = locker
        .lock(key)
        .ttl(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    assert!(
        second.fencing_token() > t1,
        "fencing went backwards: {} after {t1}",
        second.fencing_token()
    );
    second.release().await.unwrap();
}

/// Issue 12 item 8c: a majority grants the lock but fewer than a majority confirm the raised
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
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let backend = RedlockBackend::connect(
        &refs,
        RedlockOptions::default().node_timeout(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    let locker = Locker::builder().try_build(backend).unwrap();
    let key = "rl:raise-fails";
    let resource = locker.resource(dlock_runtime::LockKey::new(key).unwrap());
    // Node 0's counter is ahead, so the token comes from it and nodes 1 and 2 must be raised.
    let mut c = node(&servers[0]).await;
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let counters = [
        resource.with_suffix("fence"),
        format!("{}:fence", locker.prefix()),
    ];
    let mut put_node0_ahead = async |ahead: u64| {
        for counter in &counters {
            let _: () = redis::cmd("SET")
                .arg(counter)
                .arg(ahead)
                .query_async(&mut c)
                .await
                .unwrap();
        }
    };
    // Warm up: every script (the raise included) is loaded on every node, so each step below
    // is one command.
    put_node0_ahead(now_us + 3_600_000_000).await;
    let g = locker
        .lock(key)
        .ttl(Duration::from_secs(1))
        .acquire()
        .await
        .unwrap();
    let t1 = g.fencing_token();
    assert!(t1 > now_us + 3_600_000_000);
    g.release().await.unwrap();
    assert_cleared_everywhere(&servers, resource.as_str()).await;
    put_node0_ahead(t1 + 3_600_000_000).await;

    // Nodes 1 and 2 answer the acquire, then the network to them fails.
    for p in &proxies {
        p.cut_after_next_reply();
    }
    let err = locker
        .lock(key)
        .ttl(Duration::from_secs(1))
        .try_acquire()
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    assert_eq!(err.status(), 503);
    assert!(err.to_string().contains("fencing"), "{err}");

    // The lock it may have left on nodes 1 and 2 ends with its lease.
    for p in &proxies {
        p.allow();
    }
    let start = Instant::now();
    loop {
        if let Ok(Some(g)) = locker.lock(key).try_acquire().await {
            g.release().await.unwrap();
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the key stays locked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
