//! Redis Cluster (`redis+cluster://`): the conformance suite and the cluster's own promises, on
//! a real cluster of 3 masters and 3 replicas started once for this binary
//! (`dlock_tests::redis_cluster::shared`); every test uses keys of its own.

use std::time::{Duration, Instant};

use dlock_runtime::conformance::Store;
use dlock_runtime::{Locker, OnFail};
use dlock_tests::redis_cluster::{self, key_slot, node_conn, RedisCluster, SlotRange};
use dlock_tests::wait::{poll_until, OnDrop};
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

/// A cluster that refuses for good — a user without the lock keys on every node, a wrong
/// password — answers `Misconfigured` (500), not `Unavailable` (503): a wait through outages
/// ends at once, and connecting with a wrong password fails as such, also with timeouts
/// shorter than the client's sign-in retries take.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_that_refuses_for_good_is_misconfigured() {
    let ports: Vec<u16> = {
        let cluster = redis_cluster::shared();
        let cluster = cluster.lock().unwrap();
        cluster.nodes.iter().map(|n| n.port()).collect()
    };
    // ACLs are not replicated: the user goes on every node.
    for &port in &ports {
        let () = redis::cmd("ACL")
            .arg(&[
                "SETUSER", "confined", "reset", "on", ">pw", "~other:*", "&*", "+@all",
            ])
            .query_async(&mut node_conn(port).await)
            .await
            .unwrap();
    }
    let hosts: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let url = format!("redis+cluster://confined:pw@{}", hosts.join(","));
    let locker = Locker::builder().connect(&url).await.unwrap();
    dlock_tests::wait::refused_at_once(&locker, "cluster:refused").await;

    let wrong = url.replace(":pw@", ":not-the-pw@");
    dlock_tests::wait::refused_at_connect(&wrong, &[1000, 200], &["not-the-pw"]).await;
}

/// A cluster node named as one server (`redis://`, not `redis+cluster://`) is refused at
/// connect as misconfigured, naming the cluster scheme. Before, the node's `MOVED` answer to
/// the issuer number's `INCR` was taken for an ACL's refusal: the locker connected, with a
/// random issuer number, to a server that answers for a third of the keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_named_as_one_server_is_misconfigured() {
    let masters = master_ports();
    let slot = key_slot(masters[0], "dlock:issuers").await;
    let owner = RedisCluster::range_of(masters[0], slot).await.master;
    let other = masters.into_iter().find(|&p| p != owner).unwrap();
    let err = Locker::builder()
        .connect(&format!("redis://127.0.0.1:{other}"))
        .await
        .expect_err("connected to a cluster node as one server");
    assert!(err.is_misconfigured(), "{err}");
    assert!(err.to_string().contains("redis+cluster://"), "{err}");
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

/// Spawns `locker`'s acquire of `key` (TTL `ttl`, waiting by `policy`) and returns it once it
/// waits in the queue.
async fn queued_waiter(
    locker: &Locker,
    key: &str,
    ttl: Duration,
    policy: dlock_runtime::RetryPolicy,
) -> tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, dlock_runtime::LockError>> {
    let before = locker.waiting();
    let (w, key) = (locker.clone(), key.to_owned());
    let wait = tokio::spawn(async move {
        w.lock(&key)
            .ttl(ttl)
            .on_fail(OnFail::Retry(policy))
            .acquire()
            .await
    });
    dlock_tests::wait::wait_for("the waiter to queue", Duration::from_secs(5), async || {
        (locker.waiting() > before).then_some(())
    })
    .await;
    wait
}

/// Releases `held`; the queued `wait` must be handed the lock within `limit` (else fails with
/// `why`), with a larger fencing token; then releases that too.
async fn release_and_hand_over(
    held: dlock_runtime::LockGuard,
    wait: tokio::task::JoinHandle<Result<dlock_runtime::LockGuard, dlock_runtime::LockError>>,
    limit: Duration,
    why: &str,
) {
    let held_token = held.fencing_token();
    held.release().await.unwrap();
    let g = tokio::time::timeout(limit, wait)
        .await
        .expect(why)
        .unwrap()
        .unwrap();
    assert!(g.fencing_token() > held_token);
    g.release().await.unwrap();
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
    release_and_hand_over(held, wait, Duration::from_secs(5), "no handoff").await;
    assert!(calls_per_master("spublish").await.iter().sum::<u64>() > spublish);
    assert_eq!(calls_per_master("publish").await, vec![0, 0, 0]);
}

/// The Redis key `locker` keeps `key`'s lock in.
fn resource_name(locker: &Locker, key: &str) -> String {
    locker
        .resource(dlock_runtime::LockKey::new(key).unwrap())
        .as_str()
        .to_owned()
}

/// The slot range (master and replicas, as the node on `seed` sees it) serving `key`'s lock.
async fn range_of_key(locker: &Locker, seed: u16, key: &str) -> SlotRange {
    let name = resource_name(locker, key);
    let slot = key_slot(seed, &name).await;
    // Gossip may list a shard's replica a moment after its link is up.
    poll_until(
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
    .await
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
        let range = range_of_key(locker, seed, &key).await;
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

/// The first lock key `<prefix>:<n>` served by the master on port `master`.
async fn key_on_master(locker: &Locker, seed: u16, prefix: &str, master: u16) -> String {
    for i in 0.. {
        let key = format!("{prefix}:{i}");
        if range_of_key(locker, seed, &key).await.master == master {
            return key;
        }
    }
    unreachable!()
}

/// A cluster of 3 masters with a replica each for a test that kills or freezes a node, a locker
/// on it with `command_timeout`, and a seed node's port.
async fn cluster_of_its_own(command_timeout: Duration) -> (RedisCluster, Locker, u16) {
    let cluster = RedisCluster::start(3, 1);
    let locker = Locker::builder()
        .command_timeout(command_timeout)
        .connect(&cluster.url())
        .await
        .unwrap();
    let seed = cluster.nodes[0].port();
    (cluster, locker, seed)
}

/// A master is killed in the middle of a run, after its replica missed the last lock taken on
/// it. Locks on the other shards keep being renewed and taken, also where a script must be
/// loaded again before the dead shard has failed over; acquiring on the dead shard is a prompt
/// typed error, never a hang; the replica takes over and the shard works again; the holder
/// whose lock did not survive is told through `lost()`, while a lock acquired with
/// `.replicas(1)` on the same shard survives; and the next fencing token for that key is larger
/// than the lost holder's, although the promoted replica's counter is older. (Its own cluster:
/// this test kills a node.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_fails_over_and_the_lost_lock_is_reported() {
    let command_timeout = Duration::from_millis(500);
    let (mut cluster, locker, seed) = cluster_of_its_own(command_timeout).await;
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
    // An acknowledged lock on A's master: the replica has it before acquire returns.
    let acked_key = key_on_master(&locker, seed, "failover-acked", ra.master).await;
    // Its lease outlasts the failover (node timeout + election, the client's slot refresh and a
    // renewal retry: about 6 s on a loaded machine) with room to spare, so only the failover
    // could lose it.
    let acked = locker
        .lock(&acked_key)
        .ttl(Duration::from_secs(20))
        .replicas(1)
        .acquire()
        .await
        .unwrap();
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

    // A has no master, nor can it get one yet (its replica is frozen), when B's master loses
    // its script cache: the scripts are loaded again on B's master alone, so a new lock there
    // and the watchdog's renewal of B (a pipeline) work. (Loading on every node failed both
    // until A's failover.)
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut node_conn(rb.master).await)
        .await
        .unwrap();
    // A renewal of B sent after the flush ends B's lease past `flushed + ttl − 1 ms` (the
    // Redis lease margin at this TTL); one sent before it, which the flush did not test,
    // ends it no later.
    let flushed = Instant::now();
    let on_b = key_on_master(&locker, seed, "failover-b", rb.master).await;
    let g = locker.lock(on_b).ttl(ttl).acquire().await.unwrap();
    g.release().await.unwrap();
    poll_until(ttl, Duration::from_millis(10), async || {
        (Instant::now() + held_b.remaining() > flushed + ttl - Duration::from_millis(1))
            .then_some(())
            .ok_or("B not renewed since the flush")
    })
    .await;
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

    // The acknowledged lock on the dead master's shard survived the failover: the promoted
    // replica has it under its owner (an owner-checked extend and release succeed there).
    assert!(
        acked.is_held(),
        "an acknowledged lock was lost in the failover"
    );
    acked.extend(Duration::from_secs(10)).await.unwrap();
    acked.release().await.unwrap();

    // B, on another master, was renewed all along.
    assert_ne!(rb.master, ra.master);
    assert!(held_b.is_held(), "a lock on a healthy shard was lost");
    held_b.release().await.unwrap();
}

/// A master freezes (SIGSTOP: no reset, no close) and the cluster fails it over to its
/// replica: locks on its slots are taken again on the promoted replica within seconds of the
/// failover, while the old master stays frozen. Before, redis-rs kept sending those slots'
/// commands to the frozen node (it reads the slot map again only on a redirect or a dropped
/// connection), and they answered `Unavailable` until it woke. A lock on another shard works
/// throughout. (Its own cluster: this test freezes a node.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_master_failed_over_is_left_for_its_replica() {
    let command_timeout = Duration::from_millis(500);
    let (mut cluster, locker, seed) = cluster_of_its_own(command_timeout).await;
    let ((a, ra), (b, _)) = keys_on_two_masters(&locker, seed, "frozen").await;
    // Both shards are in use (the scripts loaded, the connections made).
    for key in [&a, &b] {
        let g = locker.lock(key.as_str()).acquire().await.unwrap();
        g.release().await.unwrap();
    }
    let frozen = cluster.index_of(ra.master);
    cluster.nodes[frozen].pause();
    // Commands to the frozen master time out meanwhile (a try every 100 ms).
    let trying = tokio::spawn({
        let (locker, a) = (locker.clone(), a.clone());
        async move {
            loop {
                if let Ok(Some(g)) = locker.lock(a.as_str()).try_acquire().await {
                    g.release().await.unwrap();
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    tokio::task::block_in_place(|| cluster.wait_failed_over(ra.master, Duration::from_secs(30)));
    let failed_over = Instant::now();
    trying.abort();
    let g = poll_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        async || match locker.lock(a.as_str()).try_acquire().await {
            Ok(Some(g)) => Ok(g),
            Ok(None) => Err("held".to_owned()),
            Err(e) => Err(e.to_string()),
        },
    )
    .await;
    eprintln!(
        "the frozen master's slot was served again {:?} after the failover",
        failed_over.elapsed()
    );
    g.release().await.unwrap();
    let other = locker.lock(b.as_str()).try_acquire().await;
    assert!(
        matches!(other, Ok(Some(_))),
        "a lock on another shard: {other:?}"
    );
    cluster.nodes[frozen].resume();
}

/// A waiter queued on a shard whose master is killed hears the release made on the replica
/// promoted in its place: its channel is subscribed again there (the subscription on the dead
/// master died with it), and the handoff reaches it within 3 s — long before its fallback
/// timer (10 s here). Before, the backend still took the channel for subscribed, and redis-rs
/// moved a shard's subscriptions only when a command on the subscriptions connection made it
/// read the slot map again: the waiter heard nothing. (Its own cluster: this test kills a
/// node.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_hears_the_release_on_its_shards_promoted_replica() {
    use dlock_runtime::RetryPolicy;

    let mut cluster = RedisCluster::start(3, 1);
    let seed = cluster.nodes[0].port();
    let ttl = Duration::from_secs(30);
    let connect = async || {
        Locker::builder()
            .prefix("promoted")
            .waiter_ttl(ttl)
            .connect(&cluster.url())
            .await
            .unwrap()
    };
    let (locker, holder) = (connect().await, connect().await);
    let key = "k";
    let range = range_of_key(&locker, seed, key).await;
    // Acknowledged: the lock survives the failover.
    let held = holder
        .lock(key)
        .ttl(ttl)
        .replicas(1)
        .acquire()
        .await
        .unwrap();
    let policy = RetryPolicy::new(Duration::from_secs(60))
        .backoff(Duration::from_secs(20), Duration::from_secs(20))
        .jitter(false)
        .through_outages(true);
    let wait = queued_waiter(&locker, key, ttl, policy).await;
    // The replica has the waiter's queue entry too.
    let offset = async |port: u16, field: &str| {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut node_conn(port).await)
            .await
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix(field))
            .map_or(0, |v| v.trim().parse::<u64>().unwrap())
    };
    let written = offset(range.master, "master_repl_offset:").await;
    let replica = range.replicas[0];
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(10),
        async || {
            (offset(replica, "slave_repl_offset:").await >= written)
                .then_some(())
                .ok_or("the replica is behind")
        },
    )
    .await;

    let master = cluster.index_of(range.master);
    cluster.nodes[master].stop();
    tokio::task::block_in_place(|| {
        cluster.wait_failed_over(range.master, Duration::from_secs(30));
    });
    // The holder's connection reaches the promoted replica.
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || held.extend(ttl).await.map_err(|e| e.to_string()),
    )
    .await;
    release_and_hand_over(
        held,
        wait,
        Duration::from_secs(3),
        "the release on the promoted replica did not reach the waiter",
    )
    .await;
}

/// A subscription on its way to a frozen master holds up only its own channel: while the
/// `SUNSUBSCRIBE` of a waiter that left a lock on the frozen shard waits for its answer (up to
/// the 4 s command timeout), a waiter of a lock on another shard subscribes, queues and is
/// handed its lock at once. Before, one mutex over every channel was held across each round
/// trip, and that waiter sat in its subscribe until the frozen shard's timed out. (Its own
/// cluster: this test freezes a node.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_shard_holds_up_no_other_shards_subscriptions() {
    use dlock_runtime::RetryPolicy;

    let command_timeout = Duration::from_secs(4);
    let (mut cluster, holder, seed) = cluster_of_its_own(command_timeout).await;
    let waiter = Locker::builder()
        .command_timeout(command_timeout)
        .connect(&cluster.url())
        .await
        .unwrap();
    let ((a, ra), (b, _)) = keys_on_two_masters(&holder, seed, "subs").await;
    let ttl = Duration::from_secs(30);
    let policy = || {
        RetryPolicy::new(Duration::from_secs(60))
            .backoff(Duration::from_secs(20), Duration::from_secs(20))
            .jitter(false)
    };
    let held_a = holder.lock(a.as_str()).ttl(ttl).acquire().await.unwrap();
    let held_b = holder.lock(b.as_str()).ttl(ttl).acquire().await.unwrap();
    // A waiter of `a` (its channel subscribed on the shard about to freeze) leaves once the
    // shard is frozen: its unsubscribe waits there for an answer that does not come.
    let leaving = queued_waiter(&waiter, &a, ttl, policy()).await;
    let frozen = cluster.index_of(ra.master);
    cluster.nodes[frozen].pause();
    leaving.abort();
    assert!(leaving.await.unwrap_err().is_cancelled());
    let wait = tokio::spawn({
        let (waiter, b) = (waiter.clone(), b.clone());
        async move {
            waiter
                .lock(b.as_str())
                .ttl(ttl)
                .on_fail(OnFail::Retry(policy()))
                .acquire()
                .await
        }
    });
    poll_until(
        Duration::from_secs(2),
        Duration::from_millis(5),
        async || {
            (waiter.waiting() == 1)
                .then_some(())
                .ok_or("the waiter of the other shard is not subscribed and queued yet")
        },
    )
    .await;
    release_and_hand_over(
        held_b,
        wait,
        Duration::from_secs(2),
        "the waiter of the other shard was not handed its lock",
    )
    .await;
    cluster.nodes[frozen].resume();
    drop(held_a);
}

/// `CLUSTER <args>` on the node on `port`; panics on an error reply.
async fn cluster_cmd(port: u16, args: &[&str]) -> redis::Value {
    redis::cmd("CLUSTER")
        .arg(args)
        .query_async(&mut node_conn(port).await)
        .await
        .unwrap_or_else(|e| panic!("CLUSTER {args:?} on {port}: {e}"))
}

/// `CLUSTER NODES` on the node on `port`.
async fn cluster_nodes(port: u16) -> String {
    redis::from_redis_value(cluster_cmd(port, &["NODES"]).await).expect("CLUSTER NODES text")
}

/// The installed `redis-server`'s version, as (major, minor, patch).
fn redis_server_version() -> (u32, u32, u32) {
    let out = std::process::Command::new("redis-server")
        .arg("--version")
        .output()
        .expect("redis-server --version");
    let text = String::from_utf8_lossy(&out.stdout);
    let v = text
        .split_whitespace()
        .find_map(|w| w.strip_prefix("v="))
        .unwrap_or_else(|| panic!("no version in {text:?}"));
    let mut parts = v
        .split('.')
        .map(|p| p.parse::<u32>().expect("a version number"));
    let mut next = || parts.next().unwrap_or(0);
    (next(), next(), next())
}

/// The fault harness's repair of a Redis Cluster defect (redis/redis#12564, fixed in 7.2.4;
/// Debian 12 ships 7.0.15). A replica marks a slot of its master "owner not claiming" when the
/// master's view comes without it, and keeps the mark when the master claims the slot again;
/// promoted, it keeps it still, and the old master coming back claiming the slot under its
/// older epoch takes it. Once that node turns replica, the promoted master serves the slot no
/// more, while every other node sends its clients there: the cluster never gets ready again.
/// `wait_healthy_repairing` gives the slot back at once and says so; on a Redis with the fix
/// there is nothing to give back. (Its own cluster: this test kills a node.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_a_promoted_master_lost_to_its_old_master_is_given_back() {
    use dlock_tests::redis_server::Failover as _;
    let mut cluster = RedisCluster::start(3, 1);
    let a = cluster.nodes[0].port();
    let a_id = redis_cluster::node_id(a).await;
    let mut replica = None;
    for port in cluster.running_ports() {
        if cluster_nodes(port)
            .await
            .lines()
            .any(|l| l.contains(&format!("myself,slave {a_id}")))
        {
            replica = Some(port);
        }
    }
    let r = replica.expect("the master on the first port has a replica");
    let slot = RedisCluster::slots_seen_by(a)
        .await
        .into_iter()
        .find(|range| range.master == a)
        .expect("the first master serves slots")
        .start;
    let slot_arg = slot.to_string();
    // The mark: the master's view without the slot reaches its replica (a PONG received well
    // after the DELSLOTS, so not one already on its way), then the master claims the slot
    // again, as its own last view says it does.
    cluster_cmd(a, &["DELSLOTS", &slot_arg]).await;
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(20),
        async || {
            let nodes = cluster_nodes(r).await;
            let pong: u64 = nodes
                .lines()
                .find(|l| l.starts_with(&a_id))
                .and_then(|l| l.split_whitespace().nth(5)?.parse().ok())
                .ok_or_else(|| format!("no line for the master in {nodes}"))?;
            if pong > since + 100 {
                Ok(())
            } else {
                Err(format!(
                    "the replica has not heard from its master since the DELSLOTS: {nodes}"
                ))
            }
        },
    )
    .await;
    cluster_cmd(a, &["ADDSLOTS", &slot_arg]).await;

    let index = cluster.index_of(a);
    cluster.nodes[index].stop();
    tokio::task::block_in_place(|| cluster.wait_failed_over(a, Duration::from_secs(30)));
    cluster.nodes[index].restart();
    let (_, repairs) =
        tokio::task::block_in_place(|| cluster.wait_healthy_repairing(Duration::from_secs(30)));

    if redis_server_version() < (7, 2, 4) {
        assert_eq!(repairs.len(), 1, "one repair: {repairs:?}");
        assert!(
            repairs[0].contains(&format!("master on {r} dropped slot(s) [{slot}]")),
            "the promoted master's slot is the one given back: {repairs:?}"
        );
    } else {
        assert!(
            repairs.is_empty(),
            "a Redis with the fix loses no slot: {repairs:?}"
        );
    }
    // Served again, by the promoted master, as every node says.
    for port in cluster.running_ports() {
        assert_eq!(
            RedisCluster::range_of(port, slot).await.master,
            r,
            "node {port}"
        );
    }
}

/// The durable queue runs on the cluster (`redis+cluster://`), its enqueues waiting for their
/// shard's replica: see [`dlock_tests::jobs::durable_round_trip`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_queue_runs_on_the_cluster() {
    let url = redis_cluster::shared().lock().unwrap().url();
    dlock_tests::jobs::durable_round_trip(&url, "cluster", 1).await;
}

/// Thaws node `index` of the shared cluster (also from a test that panicked holding its lock).
fn thaw(cluster: &std::sync::Mutex<RedisCluster>, index: usize) {
    cluster
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .nodes[index]
        .resume();
}

/// The slot range serving Redis key `key` (as the first master sees it), once it lists a
/// replica: a node's view of the other shards' replicas may lag behind the cluster's start.
async fn shard_with_replica(key: &str) -> SlotRange {
    let slot = key_slot(master_ports()[0], key).await;
    poll_until(
        Duration::from_secs(10),
        Duration::from_millis(50),
        async || {
            let r = RedisCluster::range_of(master_ports()[0], slot).await;
            (!r.replicas.is_empty())
                .then_some(r)
                .ok_or("no replica listed yet")
        },
    )
    .await
}

/// `with_replicas(1)` on a cluster: an enqueue counts once the queue's shard's replica has the
/// job (the `WAIT` goes to the shard's master, on the connection that carried the enqueue);
/// while that replica is frozen (for less than the node timeout: no failover), an enqueue
/// fails as unavailable and leaves no job behind. See
/// [`dlock_tests::jobs::enqueue_waits_for_the_replica`].
async fn acknowledged_jobs_wait_for_their_shards_replica() {
    let cluster = redis_cluster::shared();
    let url = cluster.lock().unwrap().url();
    let name = "acked-jobs";
    let range = shard_with_replica(&format!("dlock:{{jobs:{name}}}:jobs")).await;
    let replica = cluster.lock().unwrap().index_of(range.replicas[0]);
    dlock_tests::jobs::enqueue_waits_for_the_replica(
        &url,
        name,
        async |jobs, id| {
            let mut r = node_conn(range.replicas[0]).await;
            let (_, has): ((), bool) = redis::pipe()
                .cmd("READONLY")
                .cmd("HEXISTS")
                .arg(jobs)
                .arg(id)
                .query_async(&mut r)
                .await
                .unwrap();
            has
        },
        || cluster.lock().unwrap().nodes[replica].pause(),
        || thaw(&cluster, replica),
        async |jobs| {
            redis::cmd("HLEN")
                .arg(jobs)
                .query_async(&mut node_conn(range.master).await)
                .await
                .unwrap()
        },
    )
    .await;
}

/// `.replicas(1)` on a cluster: the lock counts as taken once its shard's replica has it (a
/// `WAIT` sent to the lock's master on a connection of its own); while that replica cannot
/// acknowledge, the request fails as unavailable and leaves no lock behind, and a lock without
/// `.replicas` is taken although its master must load its scripts again. Then the same for
/// the durable queue's enqueues ([`acknowledged_jobs_wait_for_their_shards_replica`]): one
/// test, so that the two never freeze a replica of the shared cluster at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_locks_and_jobs_wait_for_their_shards_replica() {
    let cluster = redis_cluster::shared();
    let url = cluster.lock().unwrap().url();
    let command_timeout = Duration::from_millis(300);
    let key = "acked-1";
    let resource = format!("acked:{{{key}}}");
    // Connected once the replica is listed: the locker's client knows it.
    let range = shard_with_replica(&resource).await;
    let locker = Locker::builder()
        .prefix("acked")
        .command_timeout(command_timeout)
        .connect(&url)
        .await
        .unwrap();
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
    let thawed = OnDrop::new(|| thaw(&cluster, replica));
    let err = locker.lock(key).replicas(1).acquire().await;
    let on_master: i64 = redis::cmd("EXISTS")
        .arg(&resource)
        .query_async(&mut node_conn(range.master).await)
        .await
        .unwrap();
    // A master that lost its scripts (a restart, a failover: `NOSCRIPT`) gets them again while
    // the replica is frozen: the call is sent once more with the script's text, to that master
    // alone. redis-rs sent `SCRIPT LOAD` to every node, and it timed out on the frozen one.
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut node_conn(range.master).await)
        .await
        .unwrap();
    let plain = locker.lock(key).try_acquire().await;
    thawed.run();
    let plain = plain.expect("a lock whose master had to load its script failed");
    plain.expect("the lock is free").release().await.unwrap();
    let err = err.expect_err("a lock no replica acknowledged counted as taken");
    assert!(err.is_unavailable(), "{err}");
    assert_eq!(on_master, 0, "an unacknowledged lock was not given back");
    acknowledged_jobs_wait_for_their_shards_replica().await;
}

/// Four lock keys that share one cluster slot (and so one fencing counter), as the locker names
/// them, and that slot.
async fn keys_of_one_slot(locker: &Locker, seed: u16) -> (Vec<String>, u16) {
    let name = |key: &str| resource_name(locker, key);
    let slot = redis::cluster_routing::Slot::for_key(name("k0"));
    let keys: Vec<String> = (0..)
        .map(|i| format!("k{i}"))
        .filter(|k| redis::cluster_routing::Slot::for_key(name(k)) == slot)
        .take(4)
        .collect();
    let n = key_slot(seed, &name(&keys[0])).await;
    for k in &keys {
        assert_eq!(key_slot(seed, &name(k)).await, n, "{k} is not in slot {n}");
    }
    (keys, n)
}

/// What the lockers of the resharding test record: per key, who is inside its critical section
/// (0: nobody) and the last fencing token granted; what went wrong.
#[derive(Default)]
struct Exclusion {
    inside: [std::sync::atomic::AtomicUsize; 4],
    last_token: std::sync::Mutex<[u64; 4]>,
    sections: std::sync::atomic::AtomicUsize,
    violations: std::sync::Mutex<Vec<String>>,
    errors: std::sync::Mutex<Vec<String>>,
}

impl Exclusion {
    fn violation(&self, what: String) {
        self.violations.lock().unwrap().push(what);
    }

    /// One critical section of task `me` on key `k` under `guard`.
    async fn section(&self, me: usize, k: usize, guard: &dlock_runtime::LockGuard) {
        use std::sync::atomic::Ordering::SeqCst;
        if let Err(other) = self.inside[k].compare_exchange(0, me, SeqCst, SeqCst) {
            self.violation(format!(
                "task {me} entered key {k} while task {other} was inside"
            ));
        }
        {
            let mut last = self.last_token.lock().unwrap();
            let token = guard.fencing_token();
            if token <= last[k] {
                self.violation(format!("key {k}: token {token} after {}", last[k]));
            }
            last[k] = last[k].max(token);
        }
        tokio::time::sleep(Duration::from_millis(1)).await; // the work
        if !guard.is_held() {
            self.violation(format!("task {me} lost key {k} inside its section"));
        }
        if let Err(other) = self.inside[k].compare_exchange(me, 0, SeqCst, SeqCst) {
            self.violation(format!(
                "task {me} left key {k} to find task {other} inside"
            ));
        }
        self.sections.fetch_add(1, SeqCst);
    }
}

/// Resharding in the middle of a contended run: eight tasks on two lockers contend for four
/// keys of one slot (one fencing counter, waiter queues coming and going) while the slot, with
/// its live locks, its counter and its queues, is moved from one master to another and back
/// (`CLUSTER SETSLOT … MIGRATING/IMPORTING`, `MIGRATE` one key at a time, `SETSLOT … NODE`),
/// four times. No two tasks are ever inside one key's section, no holder loses its lock, tokens
/// grow per key, every move really moves the slot and its keys, every task completes its quota
/// within a bound, and no lock is left held. (Its own cluster: it changes the slot map.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_a_slot_with_live_locks_keeps_exclusion_and_finishes() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::Arc;
    const TASKS: usize = 8;
    const QUOTA: usize = 60;
    const MOVES: usize = 4;

    let cluster = RedisCluster::start(3, 0);
    let seed = cluster.nodes[0].port();
    let connect = async || {
        Locker::builder()
            .prefix("reshard")
            .connect(&cluster.url())
            .await
            .unwrap()
    };
    let lockers = [connect().await, connect().await];
    let (keys, slot) = keys_of_one_slot(&lockers[0], seed).await;
    let state = Arc::new(Exclusion::default());
    let moving = Arc::new(AtomicBool::new(true));
    let tasks: Vec<_> = (1..=TASKS)
        .map(|me| {
            let (locker, keys) = (lockers[me % 2].clone(), keys.clone());
            let (state, moving) = (state.clone(), moving.clone());
            tokio::spawn(async move {
                let mut done = 0;
                for i in 0.. {
                    if done >= QUOTA && !moving.load(SeqCst) {
                        break;
                    }
                    let k = (me + i) % keys.len();
                    let lock = locker
                        .lock(&keys[k])
                        .ttl(Duration::from_secs(2))
                        .on_fail(OnFail::retry(Duration::from_secs(10)));
                    match lock.acquire().await {
                        Ok(g) => {
                            state.section(me, k, &g).await;
                            if let Err(e) = g.release().await {
                                state.errors.lock().unwrap().push(format!("release: {e:?}"));
                            }
                            done += 1;
                        }
                        Err(e) => state.errors.lock().unwrap().push(format!("acquire: {e:?}")),
                    }
                }
            })
        })
        .collect();

    let sections = || state.sections.load(SeqCst);
    let progress = async |after: usize, why: &str| {
        dlock_tests::wait::wait_for(why, Duration::from_secs(20), async || {
            (sections() >= after + 100).then_some(())
        })
        .await;
    };
    progress(0, "the run to start").await;
    let mut owner = RedisCluster::range_of(seed, slot).await.master;
    let other = RedisCluster::range_of(seed, (slot + 8192) % 16384)
        .await
        .master;
    assert_ne!(owner, other);
    let home = owner;
    for m in 0..MOVES {
        let to = if owner == home { other } else { home };
        let before = sections();
        cluster
            .move_slot(slot, owner, to, 1)
            .await
            .unwrap_or_else(|e| panic!("move {m} of slot {slot} failed: {e}"));
        assert_eq!(RedisCluster::range_of(seed, slot).await.master, to);
        let count = |port: u16| async move {
            redis::cmd("CLUSTER")
                .arg("COUNTKEYSINSLOT")
                .arg(slot)
                .query_async::<usize>(&mut node_conn(port).await)
                .await
                .unwrap()
        };
        assert_eq!(count(owner).await, 0, "keys of slot {slot} left behind");
        assert!(
            count(to).await > 0,
            "slot {slot} moved without its fencing counter"
        );
        owner = to;
        progress(before, "sections after the move").await;
    }
    moving.store(false, SeqCst);
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("a task did not finish its quota within 30 s of the last move")
            .unwrap();
    }

    let violations = state.violations.lock().unwrap().clone();
    assert!(violations.is_empty(), "exclusion broke: {violations:?}");
    let errors = state.errors.lock().unwrap().clone();
    assert!(errors.is_empty(), "{} errors: {errors:?}", errors.len());
    let fresh = connect().await;
    for k in &keys {
        let g = fresh.lock(k).try_acquire().await.unwrap();
        assert!(g.is_some(), "{k} was left locked");
        g.unwrap().release().await.unwrap();
    }
}

/// The durable queue's cluster connection retries a command the cluster answered `TRYAGAIN`
/// as promptly as the locker's: while the queue's slot moves (`CLUSTER SETSLOT … MIGRATING`,
/// its keys migrated one at a time), every enqueue — whose new job's status key is on neither
/// side, so the source answers `TRYAGAIN` — is answered within the queue's 1 s command timeout,
/// and none fails. Before, the queue's connection waited redis-rs's default (at least 1.28 s)
/// before its retry, so an enqueue caught by a move waited out its deadline and was sent
/// again. (Its own cluster: it moves a slot.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueues_while_the_queues_slot_moves_are_answered_in_time() {
    use dlock_runtime::durable::DurableQueue;
    use dlock_runtime::DeferPolicy;
    use dlock_tests::jobs::RecordJob;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::{Arc, Mutex};
    const MOVES: usize = 2;

    let cluster = RedisCluster::start(3, 0);
    let seed = cluster.nodes[0].port();
    let queue = DurableQueue::connect(&cluster.url(), "moving-jobs")
        .await
        .unwrap();
    let slot = key_slot(seed, "{jobs:moving-jobs}").await;
    let policy = DeferPolicy::new(Duration::from_millis(20), 3);
    let job = RecordJob {
        lock: "moving".to_owned(),
        ..RecordJob::default()
    };
    // Due in an hour: nothing claims them, and the queue's keys exist on the slot's master.
    async fn enqueue(
        queue: &DurableQueue,
        job: &RecordJob,
        policy: &DeferPolicy,
    ) -> (Duration, Result<String, dlock_runtime::LockError>) {
        let started = Instant::now();
        let r = queue
            .enqueue(
                job,
                policy,
                Duration::from_secs(5),
                Duration::from_secs(3600),
            )
            .await;
        (started.elapsed(), r)
    }
    enqueue(&queue, &job, &policy).await.1.unwrap();
    let moving = Arc::new(AtomicBool::new(true));
    let slowest = Arc::new(Mutex::new(Duration::ZERO));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..3)
        .map(|_| {
            let (queue, job, policy) = (queue.clone(), job.clone(), policy.clone());
            let (moving, slowest, errors) = (moving.clone(), slowest.clone(), errors.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while moving.load(SeqCst) {
                    let (took, r) = enqueue(&queue, &job, &policy).await;
                    let mut s = slowest.lock().unwrap();
                    *s = (*s).max(took);
                    drop(s);
                    if let Err(e) = r {
                        errors.lock().unwrap().push(format!("{e:?}"));
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut owner = RedisCluster::range_of(seed, slot).await.master;
    let other = RedisCluster::range_of(seed, (slot + 8192) % 16384)
        .await
        .master;
    assert_ne!(owner, other);
    let home = owner;
    for m in 0..MOVES {
        let to = if owner == home { other } else { home };
        cluster
            .move_slot(slot, owner, to, 1)
            .await
            .unwrap_or_else(|e| panic!("move {m} of slot {slot} failed: {e}"));
        assert_eq!(RedisCluster::range_of(seed, slot).await.master, to);
        owner = to;
        // Enqueues answered by the new owner before the next move.
        let (took, r) = enqueue(&queue, &job, &policy).await;
        r.unwrap_or_else(|e| panic!("an enqueue after move {m} failed: {e} ({took:?})"));
    }
    moving.store(false, SeqCst);
    let mut enqueued = 0;
    for t in tasks {
        enqueued += t.await.unwrap();
    }
    assert!(enqueued > 0);
    let errors = errors.lock().unwrap().clone();
    assert!(
        errors.is_empty(),
        "{} enqueues failed: {errors:?}",
        errors.len()
    );
    let slowest = *slowest.lock().unwrap();
    assert!(
        slowest < Duration::from_secs(1),
        "an enqueue during a move took {slowest:?}, past the queue's command timeout"
    );
}

/// Keys of this locker (`<prefix>:<i>`), the first in a slot of its own and the rest on the
/// same master in other slots: `(first, its slot, the others, that master)`.
async fn keys_beside(
    locker: &Locker,
    seed: u16,
    prefix: &str,
    others: usize,
) -> (String, u16, Vec<String>, u16) {
    let mut first: Option<(String, u16, u16)> = None;
    let mut rest = Vec::new();
    for i in 0.. {
        let key = format!("{prefix}:{i}");
        let name = resource_name(locker, &key);
        let slot = key_slot(seed, &name).await;
        let master = RedisCluster::range_of(seed, slot).await.master;
        match &first {
            None => first = Some((key, slot, master)),
            Some((_, s, m)) if *m == master && *s != slot => rest.push(key),
            Some(_) => {}
        }
        if rest.len() == others {
            break;
        }
    }
    let (key, slot, master) = first.unwrap();
    (key, slot, rest, master)
}

/// When a slot moves, its old master drops the subscriptions to the slot's shard channels with
/// a `sunsubscribe` push nobody asked for. That must not disturb the commands in flight for the
/// master's other slots (redis-rs takes such a push for the reply of the oldest request on its
/// connection, and every later reply for the request behind it), and the moved lock's waiter
/// must hear of the release after the move: its channel is subscribed again on the new master
/// and the handoff reaches it long before its fallback timer (10 s here). (Its own cluster: it
/// moves a slot.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_slot_neither_shifts_replies_nor_deafens_its_waiters() {
    use dlock_runtime::RetryPolicy;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;

    let cluster = RedisCluster::start(3, 0);
    let seed = cluster.nodes[0].port();
    let ttl = Duration::from_secs(30);
    let locker = Locker::builder()
        .prefix("moved")
        .waiter_ttl(ttl)
        .connect(&cluster.url())
        .await
        .unwrap();
    let holder = Locker::builder()
        .prefix("moved")
        .connect(&cluster.url())
        .await
        .unwrap();
    let (a, slot, busy_keys, from) = keys_beside(&locker, seed, "moved", 4).await;
    let held = holder.lock(&a).ttl(ttl).acquire().await.unwrap();
    let policy = RetryPolicy::new(Duration::from_secs(60))
        .backoff(Duration::from_secs(20), Duration::from_secs(20))
        .jitter(false);
    let wait = queued_waiter(&locker, &a, ttl, policy).await;

    // The waiter's locker keeps commands in flight on the old master's other slots.
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicUsize::new(0));
    let busy: Vec<_> = busy_keys
        .into_iter()
        .map(|key| {
            let (locker, stop, ops) = (locker.clone(), stop.clone(), ops.clone());
            tokio::spawn(async move {
                let mut errors = Vec::new();
                while !stop.load(SeqCst) {
                    match locker.lock(&key).try_acquire().await {
                        Ok(Some(g)) => {
                            if let Err(e) = g.release().await {
                                errors.push(format!("{key} release: {e:?}"));
                            }
                        }
                        Ok(None) => errors.push(format!("{key}: held by nobody, yet busy")),
                        Err(e) => errors.push(format!("{key} acquire: {e:?}")),
                    }
                    ops.fetch_add(1, SeqCst);
                }
                errors
            })
        })
        .collect();
    let to = RedisCluster::range_of(seed, (slot + 8192) % 16384)
        .await
        .master;
    let to = if to == from {
        RedisCluster::range_of(seed, (slot + 5461) % 16384)
            .await
            .master
    } else {
        to
    };
    assert_ne!(to, from);
    let before = ops.load(SeqCst);
    cluster.move_slot(slot, from, to, 10).await.unwrap();
    assert_eq!(RedisCluster::range_of(seed, slot).await.master, to);
    dlock_tests::wait::wait_for(
        "busy traffic after the move",
        Duration::from_secs(10),
        async || (ops.load(SeqCst) >= before + 200).then_some(()),
    )
    .await;
    stop.store(true, SeqCst);
    let mut errors = Vec::new();
    for b in busy {
        errors.extend(b.await.unwrap());
    }
    assert!(
        errors.is_empty(),
        "commands disturbed by the move: {errors:?}"
    );

    // The waiter's channel is subscribed again, on the new master.
    let channel = format!("{}:ch", resource_name(&locker, &a));
    poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || {
            let v: (String, u64) = redis::cmd("PUBSUB")
                .arg("SHARDNUMSUB")
                .arg(&channel)
                .query_async(&mut node_conn(to).await)
                .await
                .unwrap();
            (v.1 == 1)
                .then_some(())
                .ok_or("the waiter's channel is not subscribed on the new master")
        },
    )
    .await;
    release_and_hand_over(
        held,
        wait,
        Duration::from_secs(3),
        "the handoff after the move did not reach the waiter",
    )
    .await;
}

/// A locker built on a runtime that then shuts down (an actix-web worker restarting) loses its
/// cluster connections with it, their subscriptions included. Its waiters must still hear the
/// releases after that: one queued (from another runtime) before the shutdown, whose
/// subscription died with it, and one that starts waiting after it. Each is handed its lock
/// within 3 s of the release, long before its fallback timer (10 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_hear_releases_after_their_lockers_runtime_shut_down() {
    use dlock_runtime::RetryPolicy;

    let url = redis_cluster::shared().lock().unwrap().url();
    let ttl = Duration::from_secs(30);
    let builder = move || {
        let url = url.clone();
        async move {
            Locker::builder()
                .prefix("outlived")
                .waiter_ttl(ttl)
                .connect(&url)
                .await
                .unwrap()
        }
    };
    // The waiters' locker, on a runtime of its own that runs until `shut_down` is sent, then
    // is dropped with every task on it.
    let (built_tx, built) = tokio::sync::oneshot::channel();
    let (shut_down, shut) = tokio::sync::oneshot::channel::<()>();
    let (down_tx, down) = tokio::sync::oneshot::channel();
    let connect = builder();
    std::thread::spawn(move || {
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let locker = first.block_on(connect);
        let _ = built_tx.send(locker);
        first.block_on(async {
            let _ = shut.await;
        });
        drop(first);
        let _ = down_tx.send(());
    });
    let locker = built.await.unwrap();
    let holder = builder().await;
    let policy = RetryPolicy::new(Duration::from_secs(60))
        .backoff(Duration::from_secs(20), Duration::from_secs(20))
        .jitter(false);
    let queue = |key: &'static str| {
        let (locker, policy) = (locker.clone(), policy.clone());
        tokio::spawn(async move {
            locker
                .lock(key)
                .ttl(ttl)
                .on_fail(OnFail::Retry(policy))
                .acquire()
                .await
        })
    };

    let before = holder.lock("before").ttl(ttl).acquire().await.unwrap();
    let queued = queue("before");
    dlock_tests::wait::wait_for("the waiter to queue", Duration::from_secs(5), async || {
        (locker.waiting() == 1).then_some(())
    })
    .await;
    shut_down.send(()).unwrap();
    down.await.unwrap();
    release_and_hand_over(
        before,
        queued,
        Duration::from_secs(3),
        "the waiter queued before the shutdown did not hear the release",
    )
    .await;

    let after = holder.lock("after").ttl(ttl).acquire().await.unwrap();
    let late = queue("after");
    dlock_tests::wait::wait_for(
        "the late waiter to queue",
        Duration::from_secs(5),
        async || (locker.waiting() == 1).then_some(()),
    )
    .await;
    release_and_hand_over(
        after,
        late,
        Duration::from_secs(3),
        "the waiter that started after the shutdown did not hear the release",
    )
    .await;
}

/// How many script calls (`EVALSHA`) the node on `port` has run.
async fn evalsha_calls(port: u16) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut node_conn(port).await)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().expect("a count"))
}

/// A release that runs while its slot is being migrated (`CLUSTER SETSLOT … MIGRATING`, the
/// keys still on the source, where the script then runs) hands the lock to its waiter — a
/// lock's, and a semaphore's permit — and reports the release as done. Redis checks each
/// command of a script against the slot's state, and a key the script has just emptied is
/// "non local" there: the lock's release popped its only waiter off the queue and then failed,
/// and its run again on the slot's new master found nobody to hand the lock to and deleted it
/// (a newcomer took it); the semaphore's release removed its holder, failed, and was reported
/// `Lost` (its run again found no holder). The scripts now stop before their first write while
/// their slot migrates (`TRYAGAIN`, retried by the cluster client until the slot has moved).
/// (Its own cluster: it changes the slot map.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_while_its_slot_migrates_still_hands_over() {
    use dlock_runtime::backend::{Attempt, OwnerToken, WaitMode};
    use dlock_runtime::conformance::attempt_as;
    let cluster = RedisCluster::start(3, 0);
    let seed = cluster.nodes[0].port();
    let connect = async || {
        Locker::builder()
            .prefix("mig")
            .command_timeout(Duration::from_secs(5))
            // No waiter refreshes its place (every 20 s) within the test: the only script
            // calls on the slot are the ones it makes.
            .waiter_ttl(Duration::from_secs(60))
            .connect(&cluster.url())
            .await
            .unwrap()
    };
    let (holder, waiter, newcomer) = (connect().await, connect().await, connect().await);
    let ttl = Duration::from_secs(30);
    // Releases `held` (of `key`) while its slot is being moved to another master: the script
    // reaches the source first, then the move completes.
    let release_while_moving = async |key: &str, held: dlock_runtime::LockGuard| {
        let slot = key_slot(seed, &resource_name(&holder, key)).await;
        let from = RedisCluster::range_of(seed, slot).await.master;
        let to = RedisCluster::range_of(seed, (slot + 8192) % 16384)
            .await
            .master;
        assert_ne!(from, to);
        let setslot = async |port: u16, state: &str, node: u16| {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(state)
                .arg(redis_cluster::node_id(node).await)
                .query_async(&mut node_conn(port).await)
                .await
                .unwrap();
        };
        setslot(to, "IMPORTING", from).await;
        setslot(from, "MIGRATING", to).await;
        let calls = evalsha_calls(from).await;
        let release = tokio::spawn(held.release());
        dlock_tests::wait::wait_for(
            "the release to reach the migrating slot",
            Duration::from_secs(5),
            async || (evalsha_calls(from).await > calls).then_some(()),
        )
        .await;
        cluster.move_slot(slot, from, to, 10).await.unwrap();
        release.await.unwrap()
    };

    // A lock, its waiter a queued owner token (a waiter of a locker would also be woken by the
    // loss of its subscription when the slot moves, and could take the freed lock first).
    let key = "handoff";
    let resource = holder.resource(dlock_runtime::LockKey::new(key).unwrap());
    let held = holder.lock(key).ttl(ttl).acquire().await.unwrap();
    let first = held.fencing_token();
    let next = OwnerToken::generate();
    let queued = attempt_as(&waiter, &resource, &next, WaitMode::Queue, ttl)
        .await
        .unwrap();
    assert!(matches!(queued, Attempt::Held { .. }), "{queued:?}");
    release_while_moving(key, held)
        .await
        .unwrap_or_else(|e| panic!("the lock's release failed: {e}"));
    assert!(
        newcomer.lock(key).try_acquire().await.unwrap().is_none(),
        "the release dropped its waiter and left the lock free"
    );
    match attempt_as(&waiter, &resource, &next, WaitMode::Try, ttl).await {
        Ok(Attempt::Acquired { fencing_token }) => assert!(fencing_token > first),
        other => panic!("the waiter does not hold the lock: {other:?}"),
    }
    dlock_runtime::conformance::abandon_as(&waiter, &resource, &next)
        .await
        .unwrap();

    // A semaphore's permit, its waiter a locker's.
    let key = "permits";
    let held = holder.semaphore(key, 1).ttl(ttl).acquire().await.unwrap();
    let queued = tokio::spawn({
        let waiter = waiter.clone();
        async move {
            waiter
                .semaphore(key, 1)
                .ttl(ttl)
                .on_fail(OnFail::retry(Duration::from_secs(30)))
                .acquire()
                .await
        }
    });
    dlock_tests::wait::wait_for("the waiter to queue", Duration::from_secs(5), async || {
        (waiter.waiting() == 1).then_some(())
    })
    .await;
    release_while_moving(key, held)
        .await
        .unwrap_or_else(|e| panic!("the permit's release failed: {e}"));
    let next = tokio::time::timeout(Duration::from_secs(5), queued)
        .await
        .expect("the waiter was not let in")
        .unwrap()
        .unwrap();
    next.release().await.unwrap();
}

/// A renewal batch that a master refuses for good (a lock's key holds another type:
/// `WRONGTYPE`) answers `Misconfigured` for its locks, as on one server. It answered
/// `Unavailable`: an outage, where the store had refused for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_batch_refused_for_good_is_misconfigured() {
    use dlock_runtime::backend::{
        Backend as _, ExtendItem, OwnerToken, RedisBackend, RedisOptions,
    };
    let seeds = redis_cluster::shared().lock().unwrap().urls();
    let backend = RedisBackend::connect_cluster(&seeds, RedisOptions::default())
        .await
        .unwrap();
    let locker = Locker::builder().build(backend.clone());
    let resource = locker.resource(dlock_runtime::LockKey::new("renew:wrongtype").unwrap());
    let mut c = redis::cluster::ClusterClient::new(seeds)
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    let _: () = c.rpush(resource.as_str(), "not a lock").await.unwrap();
    let items = [ExtendItem {
        resource: resource.clone(),
        token: OwnerToken::generate(),
        ttl: Duration::from_secs(5),
    }];
    let out = backend.extend_many(&items).await;
    let _: () = c.del(resource.as_str()).await.unwrap();
    match &out[..] {
        [Err(e)] => assert!(e.is_misconfigured(), "{e}"),
        other => panic!("{other:?}"),
    }
}
