//! Redis Cluster (`redis+cluster://`): the conformance suite and the cluster's own promises, on
//! a real cluster of 3 masters and 3 replicas started once for this binary
//! (`dlock_tests::redis_cluster::shared`); every test uses keys of its own.

use std::time::{Duration, Instant};

use dlock_runtime::conformance::Store;
use dlock_runtime::{Locker, OnFail};
use dlock_tests::redis_cluster::{self, key_slot, RedisCluster, SlotRange};
use dlock_tests::wait::poll_until;
use redis::AsyncCommands as _;

fn cluster_store() -> ((), Store) {
    let cluster = redis_cluster::shared();
    let url = cluster.lock().unwrap().url();
    let store = Store::new(
        "cluster",
        move |b| {
            let url = url.clone();
            Box::pin(async move { b.connect(&url).await.expect("connect") })
        },
        move |resource| {
            let seeds = cluster.lock().unwrap().urls();
            Box::pin(async move {
                let mut c = redis::cluster::ClusterClient::new(seeds)
                    .unwrap()
                    .get_async_connection()
                    .await
                    .unwrap();
                let n: i64 = redis::cmd("DEL")
                    .arg(&resource)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                assert_eq!(n, 1, "no lock key {resource}");
            })
        },
    );
    ((), store)
}

mod conformance {
    dlock_runtime::conformance_tests!(super::cluster_store);
}

/// How many times each master has run `command` (`INFO commandstats`), masters in creation
/// order.
async fn calls_per_master(command: &str) -> Vec<u64> {
    let mut out = Vec::new();
    for port in master_ports() {
        let mut c = node_conn(port).await;
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut c)
            .await
            .unwrap();
        let prefix = format!("cmdstat_{command}:calls=");
        out.push(
            info.lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .and_then(|r| r.split(',').next())
                .map_or(0, |n| n.parse().unwrap()),
        );
    }
    out
}

/// Locks whose keys fall on different shards all work, each shard keeps its own fencing
/// counters (one per slot, beside the locks of that slot), and tokens still grow per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_spread_over_every_master_with_per_slot_fencing() {
    let url = redis_cluster::shared().lock().unwrap().url();
    let locker = Locker::builder()
        .prefix("spread")
        .connect(&url)
        .await
        .unwrap();
    let mut last = std::collections::HashMap::new();
    for round in 0..2 {
        for i in 0..30 {
            let key = format!("k{i}");
            let g = locker.lock(&key).acquire().await.unwrap();
            if round == 1 {
                assert!(
                    g.fencing_token() > last[&key],
                    "{key}: fencing went backwards"
                );
            }
            last.insert(key, g.fencing_token());
            g.release().await.unwrap();
        }
    }
    for (i, counters) in keys_per_master("spread:{f*}:fence")
        .await
        .iter()
        .enumerate()
    {
        assert!(*counters > 0, "master {i} holds no fencing counter");
    }
}

/// How many keys matching `pattern` each master holds, masters in creation order.
async fn keys_per_master(pattern: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for port in master_ports() {
        let mut c = node_conn(port).await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut c)
            .await
            .unwrap();
        out.push(keys.len());
    }
    out
}

fn master_ports() -> Vec<u16> {
    let cluster = redis_cluster::shared();
    let c = cluster.lock().unwrap();
    c.nodes.iter().take(3).map(|n| n.port()).collect()
}

async fn node_conn(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Release notifications on a cluster are sharded (`SPUBLISH`, served by the lock's own
/// shard), never broadcast with `PUBLISH`; a queued waiter still gets the lock handed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_uses_sharded_pub_sub() {
    let url = redis_cluster::shared().lock().unwrap().url();
    let holder = Locker::from_url(&url).await.unwrap();
    let waiter = Locker::from_url(&url).await.unwrap();
    let spublish = calls_per_master("spublish").await.iter().sum::<u64>();
    let key = "sharded:handoff";
    let held = holder.lock(key).acquire().await.unwrap();
    let w = waiter.clone();
    let wait = tokio::spawn(async move {
        w.lock(key)
            .on_fail(OnFail::retry(Duration::from_secs(10)))
            .acquire()
            .await
    });
    dlock_tests::wait::poll_until(
        Duration::from_secs(5),
        Duration::from_millis(5),
        async || (waiter.waiting() == 1).then_some(()).ok_or("never queued"),
    )
    .await;
    let held_token = held.fencing_token();
    held.release().await.unwrap();
    let g = tokio::time::timeout(Duration::from_secs(5), wait)
        .await
        .expect("no handoff")
        .unwrap()
        .unwrap();
    assert!(g.fencing_token() > held_token);
    g.release().await.unwrap();
    assert!(calls_per_master("spublish").await.iter().sum::<u64>() > spublish);
    assert_eq!(calls_per_master("publish").await, vec![0, 0, 0]);
}

/// Two of this locker's keys whose slots have different masters, with the map as the node on
/// `seed` sees it: `(key, its range)` for each.
async fn keys_on_two_masters(
    locker: &Locker,
    seed: u16,
    prefix: &str,
) -> ((String, SlotRange), (String, SlotRange)) {
    let mut first: Option<(String, SlotRange)> = None;
    for i in 0.. {
        let key = format!("{prefix}:{i}");
        let name = locker
            .resource(dlock_runtime::LockKey::new(&key).unwrap())
            .as_str()
            .to_owned();
        let slot = key_slot(seed, &name).await;
        // Gossip may list a shard's replica a moment after its link is up.
        let range = poll_until(
            Duration::from_secs(10),
            Duration::from_millis(20),
            async || {
                let r = RedisCluster::range_of(seed, slot).await;
                if r.replicas.is_empty() {
                    Err(format!("slot {slot}: no replica listed yet"))
                } else {
                    Ok(r)
                }
            },
        )
        .await;
        match &first {
            None => first = Some((key, range)),
            Some((_, r)) if r.master != range.master => {
                return (first.unwrap(), (key, range));
            }
            Some(_) => {}
        }
    }
    unreachable!()
}

/// A master is killed in the middle of a run, after its replica missed the last lock taken on
/// it. Locks on the other shards keep being renewed; acquiring on the dead shard is a prompt
/// typed error, never a hang; the replica takes over and the shard works again; the holder
/// whose lock did not survive is told through `lost()`; and the next fencing token for that key
/// is larger than the lost holder's, although the promoted replica's counter is older. (Its own
/// cluster: this test kills a node.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_fails_over_and_the_lost_lock_is_reported() {
    let mut cluster = RedisCluster::start(3, 1);
    let command_timeout = Duration::from_millis(500);
    let locker = Locker::builder()
        .command_timeout(command_timeout)
        .connect(&cluster.url())
        .await
        .unwrap();
    let seed = cluster.nodes[0].port();
    let ((a, ra), (b, rb)) = keys_on_two_masters(&locker, seed, "failover").await;
    let ttl = Duration::from_secs(2);
    let held_b = locker.lock(&b).ttl(ttl).acquire().await.unwrap();
    // A's slot's fencing counter exists, and its replica has it.
    let first = locker.lock(&a).acquire().await.unwrap();
    first.release().await.unwrap();
    let counters: Vec<String> = node_conn(ra.master).await.keys("*:fence").await.unwrap();
    let [counter] = &counters[..] else {
        panic!("one fencing counter on A's master: {counters:?}")
    };
    let on_master: u64 = node_conn(ra.master).await.get(counter).await.unwrap();
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(10),
        async || {
            let mut r = node_conn(ra.replicas[0]).await;
            let (_, v): ((), Option<u64>) = redis::pipe()
                .cmd("READONLY")
                .cmd("GET")
                .arg(counter)
                .query_async(&mut r)
                .await
                .unwrap();
            (v == Some(on_master))
                .then_some(())
                .ok_or("not replicated yet")
        },
    )
    .await;
    // The dying master's replica stops taking the replication stream before A is taken again:
    // that lock, and the counter's advance, exist only on the master that dies.
    let replica = cluster.index_of(ra.replicas[0]);
    cluster.nodes[replica].pause();
    // Frozen, it cannot reconnect; cut its replication link, so nothing more reaches it.
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query_async(&mut node_conn(ra.master).await)
        .await
        .unwrap();
    let held_a = locker.lock(&a).ttl(ttl).acquire().await.unwrap();
    let master = cluster.index_of(ra.master);
    cluster.nodes[master].stop();
    cluster.nodes[replica].resume();

    // While the shard has no master, an acquire there fails fast with a typed error.
    let started = Instant::now();
    if let Err(e) = locker.lock(&a).try_acquire().await {
        assert!(e.is_unavailable(), "{e}");
    }
    assert!(
        started.elapsed() < command_timeout + Duration::from_millis(500),
        "an acquire on a dead shard took {:?}",
        started.elapsed()
    );

    // The holder of A is told.
    tokio::time::timeout(ttl + Duration::from_secs(2), held_a.lost())
        .await
        .expect("the loss of a lock the failover dropped was not reported");

    // The replica takes over: the shard works again, with a larger token for the same key.
    let g = poll_until(
        Duration::from_secs(30),
        Duration::from_millis(100),
        async || match locker.lock(&a).try_acquire().await {
            Ok(Some(g)) => Ok(g),
            Ok(None) => Err("held".to_owned()),
            Err(e) => Err(e.to_string()),
        },
    )
    .await;
    assert!(
        g.fencing_token() > held_a.fencing_token(),
        "fencing went backwards across the failover: {} after {}",
        g.fencing_token(),
        held_a.fencing_token()
    );
    g.release().await.unwrap();

    // B, on another master, was renewed all along.
    assert_ne!(rb.master, ra.master);
    assert!(held_b.is_held(), "a lock on a healthy shard was lost");
    held_b.release().await.unwrap();
}

/// The durable queue runs on the cluster (`redis+cluster://`): see
/// [`dlock_tests::jobs::durable_round_trip`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_queue_runs_on_the_cluster() {
    let url = redis_cluster::shared().lock().unwrap().url();
    dlock_tests::jobs::durable_round_trip(&url, "cluster").await;
}

/// `.replicas(1)` on a cluster: the lock counts as taken once its shard's replica has it (a
/// `WAIT` sent to the lock's master on a connection of its own); while that replica cannot
/// acknowledge, the request fails as unavailable and leaves no lock behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_locks_wait_for_their_shards_replica() {
    let cluster = redis_cluster::shared();
    let url = cluster.lock().unwrap().url();
    let command_timeout = Duration::from_millis(300);
    let locker = Locker::builder()
        .prefix("acked")
        .command_timeout(command_timeout)
        .connect(&url)
        .await
        .unwrap();
    let key = "acked-1";
    let resource = format!("acked:{{{key}}}");
    let slot = key_slot(master_ports()[0], &resource).await;
    // A node's view of the other shards' replicas may lag behind the cluster's start.
    let range = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || {
            let r = RedisCluster::range_of(master_ports()[0], slot).await;
            (!r.replicas.is_empty())
                .then_some(r)
                .ok_or("no replica listed yet")
        },
    )
    .await;
    let g = locker.lock(key).replicas(1).acquire().await.unwrap();
    let mut r = node_conn(range.replicas[0]).await;
    let (_, owner): ((), Option<String>) = redis::pipe()
        .cmd("READONLY")
        .cmd("GET")
        .arg(&resource)
        .query_async(&mut r)
        .await
        .unwrap();
    assert!(
        owner.is_some(),
        "the shard's replica does not have an acknowledged lock"
    );
    g.release().await.unwrap();

    // The replica stops acknowledging (frozen for less than the node timeout: no failover).
    let replica = cluster.lock().unwrap().index_of(range.replicas[0]);
    cluster.lock().unwrap().nodes[replica].pause();
    let err = locker.lock(key).replicas(1).acquire().await;
    let on_master: i64 = redis::cmd("EXISTS")
        .arg(&resource)
        .query_async(&mut node_conn(range.master).await)
        .await
        .unwrap();
    cluster.lock().unwrap().nodes[replica].resume();
    let err = err.expect_err("a lock no replica acknowledged counted as taken");
    assert!(err.is_unavailable(), "{err}");
    assert_eq!(on_master, 0, "an unacknowledged lock was not given back");
}
