//! Redis Cluster (`redis+cluster://`): the conformance suite and the cluster's own promises, on
//! a real cluster of 3 masters and 3 replicas started once for this binary
//! (`dlock_tests::redis_cluster::shared`); every test uses keys of its own.

use std::time::Duration;

use dlock_runtime::conformance::Store;
use dlock_runtime::{Locker, OnFail};
use dlock_tests::redis_cluster;

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
