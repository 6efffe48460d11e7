//! A real Redis Cluster for tests: 3 masters and 3 replicas, each a `redis-server` in cluster
//! mode on a free loopback port in its own temporary folder, joined with
//! `redis-cli --cluster create` (Debian's `redis-tools`, installed with the server by
//! `./scripts/test`). Starting one takes a few seconds: start it once per test binary
//! ([`shared`]) and give each test keys of its own.

use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::RedisServer;

/// Cluster node timeout: how long a master may be unreachable before its replica takes over.
pub const NODE_TIMEOUT: Duration = Duration::from_millis(1000);

/// A running cluster. Dropping it stops every node.
#[derive(Debug)]
pub struct RedisCluster {
    /// Masters first (as created), then replicas.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts `masters` masters with `replicas` replicas each and waits until the cluster
    /// reports `cluster_state:ok` on every node.
    ///
    /// # Panics
    /// If a node does not start, `redis-cli` is missing, or the cluster is not ready within 30 s.
    pub fn start(masters: usize, replicas: usize) -> Self {
        Self::start_inner(masters, replicas, false)
    }

    fn start_inner(masters: usize, replicas: usize, owned_by_thread: bool) -> Self {
        let timeout = NODE_TIMEOUT.as_millis().to_string();
        let nodes: Vec<RedisServer> = (0..masters * (1 + replicas))
            .map(|_| {
                let args = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    &timeout,
                    "--cluster-require-full-coverage",
                    "no",
                ];
                if owned_by_thread {
                    RedisServer::start_owned_by_thread(&args)
                } else {
                    RedisServer::start_with(&args)
                }
            })
            .collect();
        let mut create = Command::new("redis-cli");
        create.args(["--cluster", "create"]);
        for n in &nodes {
            create.arg(format!("127.0.0.1:{}", n.port()));
        }
        create.args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"]);
        let out = create.output().unwrap_or_else(|e| {
            panic!(
                "cannot run `redis-cli` ({e}). Install it (`apt-get install redis-tools`) or run \
                 the project's test command, `./scripts/test`, which installs it."
            )
        });
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes };
        cluster.wait_ready(Duration::from_secs(30));
        if replicas > 0 {
            cluster.wait_replicated(Duration::from_secs(30));
        }
        cluster
    }

    /// Waits until every running node reports `cluster_state:ok` and knows every slot.
    ///
    /// # Panics
    /// If that does not happen within `limit`.
    pub fn wait_ready(&self, limit: Duration) {
        self.wait_all("the cluster ready", limit, ready);
    }

    /// Waits until every running replica's link to its master is up and every running master
    /// has a replica (what `CLUSTER SLOTS` then lists).
    ///
    /// # Panics
    /// If that does not happen within `limit`.
    pub fn wait_replicated(&self, limit: Duration) {
        self.wait_all("replicas linked", limit, |port| {
            redis_cli(port, &["info", "replication"]).is_some_and(|i| {
                i.contains("master_link_status:up")
                    || (i.contains("role:master") && !i.contains("connected_slaves:0"))
            })
        });
    }

    /// Polls until `ok` holds for every running node's port. When `limit` passes first, the
    /// panic names the nodes it did not hold for and what each says of the cluster.
    fn wait_all(&self, what: &str, limit: Duration, ok: impl Fn(u16) -> bool) {
        let deadline = Instant::now() + limit;
        while !self
            .nodes
            .iter()
            .filter(|n| n.is_up())
            .all(|n| ok(n.port()))
        {
            if Instant::now() >= deadline {
                let not_ok: Vec<String> = self
                    .nodes
                    .iter()
                    .filter(|n| n.is_up() && !ok(n.port()))
                    .map(|n| describe(n.port()))
                    .collect();
                panic!(
                    "{what}: not within {limit:?}; not so on:\n{}",
                    not_ok.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the master on `port`, which was killed or frozen, has been replaced: every
    /// running node flags it as failed (`fail`, not only suspected) and serves every slot again
    /// (its replica was promoted).
    ///
    /// # Panics
    /// If that does not happen within `limit`.
    pub fn wait_failed_over(&self, port: u16, limit: Duration) {
        let me = format!("127.0.0.1:{port}@");
        self.wait_all("the failover", limit, |p| {
            let flagged = redis_cli(p, &["cluster", "nodes"]).is_some_and(|nodes| {
                nodes.lines().any(|l| {
                    let mut f = l.split_whitespace().skip(1);
                    f.next().is_some_and(|a| a.starts_with(&me))
                        && f.next()
                            .is_some_and(|flags| flags.split(',').any(|x| x == "fail"))
                })
            });
            flagged && ready(p)
        });
    }

    /// The ports of the running nodes that are masters now (`ROLE`), in node order.
    pub fn master_ports(&self) -> Vec<u16> {
        self.running_ports()
            .into_iter()
            .filter(|&p| redis_cli(p, &["role"]).is_some_and(|r| r.starts_with("master")))
            .collect()
    }

    /// The seed URLs of every node (`redis://127.0.0.1:<port>`).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// A cluster connection of its own, for tests that read or change keys behind the
    /// locker's back (commands are routed to their slot's master).
    ///
    /// # Panics
    /// If no node accepts it.
    pub async fn conn(&self) -> redis::cluster_async::ClusterConnection {
        redis::cluster::ClusterClient::new(self.urls())
            .expect("cluster client")
            .get_async_connection()
            .await
            .expect("connect to the cluster")
    }

    /// `redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,…`, for `Locker::from_url`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }
}

/// What the node on `port` says of the cluster: its `CLUSTER INFO` state and slot counts, its
/// replication role and link, and `CLUSTER NODES`.
fn describe(port: u16) -> String {
    let keep = |text: Option<String>, fields: &[&str]| {
        text.map(|t| {
            t.lines()
                .map(str::trim)
                .filter(|l| fields.iter().any(|f| l.starts_with(f)))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|| "no answer".to_owned())
    };
    let info = keep(
        cluster_info(port),
        &[
            "cluster_state",
            "cluster_slots",
            "cluster_known_nodes",
            "cluster_current_epoch",
        ],
    );
    let replication = keep(
        redis_cli(port, &["info", "replication"]),
        &[
            "role",
            "master_port",
            "master_link_status",
            "connected_slaves",
        ],
    );
    let nodes = redis_cli(port, &["cluster", "nodes"]).unwrap_or_default();
    format!("  node {port}: {info}; {replication}\n{}", nodes.trim_end())
}

/// Whether the node on `port` says the cluster is ok and every slot is served.
fn ready(port: u16) -> bool {
    cluster_info(port)
        .is_some_and(|i| i.contains("cluster_state:ok") && i.contains("cluster_slots_ok:16384"))
}

/// `CLUSTER INFO` of the node on `port`, if it answers.
fn cluster_info(port: u16) -> Option<String> {
    redis_cli(port, &["cluster", "info"])
}

/// What `redis-cli -p <port> <args>` prints, if it succeeds.
pub(crate) fn redis_cli(port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The cluster of this test binary (3 masters, 3 replicas), started on first use and kept for
/// the binary's life. Its nodes are started by a thread that lives as long as the process, and
/// the kernel kills them when it ends (`PR_SET_PDEATHSIG`): a static is never dropped.
pub fn shared() -> Arc<Mutex<RedisCluster>> {
    static SHARED: OnceLock<Arc<Mutex<RedisCluster>>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let cluster = crate::redis_server::on_owner_thread("redis-cluster-owner", || {
                RedisCluster::start_inner(3, 1, true)
            });
            Arc::new(Mutex::new(cluster))
        })
        .clone()
}

/// One slot range of `CLUSTER SLOTS`: its master's port and its replicas' ports.
#[derive(Clone, Debug)]
pub struct SlotRange {
    /// First slot.
    pub start: u16,
    /// Last slot (inclusive).
    pub end: u16,
    /// The master's port.
    pub master: u16,
    /// The replicas' ports.
    pub replicas: Vec<u16>,
}

impl RedisCluster {
    /// The slot map as the node on `port` sees it.
    ///
    /// # Panics
    /// If that node does not answer `CLUSTER SLOTS`.
    pub async fn slots_seen_by(port: u16) -> Vec<SlotRange> {
        let mut c = node_conn(port).await;
        let v: redis::Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut c)
            .await
            .expect("CLUSTER SLOTS");
        let redis::Value::Array(ranges) = v else {
            panic!("CLUSTER SLOTS: {v:?}")
        };
        let int = |v: &redis::Value| match v {
            redis::Value::Int(i) => *i as u16,
            other => panic!("CLUSTER SLOTS: not an integer: {other:?}"),
        };
        ranges
            .iter()
            .map(|r| {
                let redis::Value::Array(r) = r else {
                    panic!("CLUSTER SLOTS: {r:?}")
                };
                let port = |node: &redis::Value| match node {
                    redis::Value::Array(n) => int(&n[1]),
                    other => panic!("CLUSTER SLOTS: {other:?}"),
                };
                SlotRange {
                    start: int(&r[0]),
                    end: int(&r[1]),
                    master: port(&r[2]),
                    replicas: r[3..].iter().map(port).collect(),
                }
            })
            .collect()
    }

    /// The range serving `slot`, as the node on `port` sees it.
    pub async fn range_of(port: u16, slot: u16) -> SlotRange {
        Self::slots_seen_by(port)
            .await
            .into_iter()
            .find(|r| (r.start..=r.end).contains(&slot))
            .unwrap_or_else(|| panic!("no node serves slot {slot}"))
    }

    /// The node (index into [`nodes`](RedisCluster::nodes)) listening on `port`.
    pub fn index_of(&self, port: u16) -> usize {
        self.nodes
            .iter()
            .position(|n| n.port() == port)
            .unwrap_or_else(|| panic!("no node on port {port}"))
    }
}

impl crate::redis_server::Failover for RedisCluster {
    fn url(&self) -> String {
        RedisCluster::url(self)
    }

    fn node_ports(&self) -> Vec<u16> {
        self.nodes.iter().map(RedisServer::port).collect()
    }

    fn master_ports(&self) -> Vec<u16> {
        RedisCluster::master_ports(self)
    }

    fn node(&mut self, port: u16) -> &mut RedisServer {
        let i = self.index_of(port);
        &mut self.nodes[i]
    }

    fn wait_failed_over(&self, port: u16, limit: Duration) {
        RedisCluster::wait_failed_over(self, port, limit);
    }

    /// Settled: the same masters, no node suspected or flagged failed by any other, for
    /// 2 × [`NODE_TIMEOUT`] in a row (a replica waits its election delay, up to a second after
    /// its master is flagged failed, before it is promoted).
    fn wait_healthy(&self, limit: Duration) -> Duration {
        self.settle(limit, false).0
    }

    /// [`wait_healthy`](crate::redis_server::Failover::wait_healthy), giving back the slots a
    /// promoted master lost to a Redis defect ([`RedisCluster::wait_ready_reclaiming`]).
    fn wait_healthy_repairing(&self, limit: Duration) -> (Duration, Vec<String>) {
        let (settled, reclaimed) = self.settle(limit, true);
        let repairs = reclaimed
            .into_iter()
            .map(|(port, slots)| {
                format!(
                    "the master on {port} dropped slot(s) {slots:?} that every other node says \
                     are its own, to a node that came back claiming them under an older epoch \
                     (redis/redis#12564, fixed in 7.2.4): given back with CLUSTER ADDSLOTS"
                )
            })
            .collect();
        (settled, repairs)
    }
}

impl RedisCluster {
    /// `wait_healthy`, with [`wait_ready_reclaiming`](RedisCluster::wait_ready_reclaiming) in
    /// place of `wait_ready` when `reclaim`: how long ago it settled, and what was reclaimed.
    fn settle(&self, limit: Duration, reclaim: bool) -> (Duration, Vec<(u16, Vec<u16>)>) {
        let deadline = Instant::now() + limit;
        let settle = NODE_TIMEOUT * 2;
        let mut reclaimed = Vec::new();
        let mut since = (Instant::now(), self.settled_view());
        while since.1.is_none() || since.0.elapsed() < settle {
            assert!(
                Instant::now() < deadline,
                "the cluster did not settle within {limit:?}; its nodes say:\n{}",
                self.running_ports()
                    .into_iter()
                    .map(describe)
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            // At once, not once settled: the slots' keys stall until then.
            if reclaim {
                reclaimed.extend(self.reclaim_orphaned_slots());
            }
            std::thread::sleep(Duration::from_millis(100));
            let now = self.settled_view();
            if now.is_none() || now != since.1 {
                since = (Instant::now(), now);
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if reclaim {
            reclaimed.extend(self.wait_ready_reclaiming(left));
        } else {
            self.wait_ready(left);
        }
        self.wait_replicated(deadline.saturating_duration_since(Instant::now()));
        (since.0.elapsed(), reclaimed)
    }

    /// What every running node says of the cluster (`CLUSTER NODES`: each node's address and
    /// role), if they all say the same and none suspects or flags a node as failed.
    fn settled_view(&self) -> Option<Vec<String>> {
        let mut agreed: Option<Vec<String>> = None;
        for port in self.running_ports() {
            let nodes = redis_cli(port, &["cluster", "nodes"])?;
            let mut view = Vec::new();
            for line in nodes.lines() {
                let mut f = line.split_whitespace().skip(1);
                let (Some(addr), Some(flags)) = (f.next(), f.next()) else {
                    continue;
                };
                let flags: Vec<&str> = flags.split(',').filter(|x| *x != "myself").collect();
                if flags
                    .iter()
                    .any(|x| matches!(*x, "fail" | "fail?" | "handshake"))
                {
                    return None;
                }
                view.push(format!("{addr} {}", flags.join(",")));
            }
            view.sort();
            match &agreed {
                Some(v) if *v != view => return None,
                _ => agreed = Some(view),
            }
        }
        agreed
    }

    /// [`wait_ready`](RedisCluster::wait_ready), except that a master whose own view has lost
    /// slots that every other node still gives it is handed them back with
    /// `CLUSTER ADDSLOTS`, as `redis-cli --cluster fix` would. Returns what was handed back, per
    /// master's port.
    ///
    /// Redis before 7.2.4 (Debian 12 ships 7.0.15) loses slots so (redis/redis#12564). A node
    /// marks a slot "owner not claiming" when a view of the slot's owner comes without it (two
    /// links join each pair of nodes: a view sent before the owner took the slot can arrive
    /// after one that claims it), and the mark then stays, as no later view differs. When
    /// that node is a replica promoted in its owner's place, it keeps the mark, and the old
    /// owner coming back claiming the slot under its older epoch takes it: the promoted master
    /// deletes the slot's keys and, once the old owner turns replica, serves the slot no more.
    /// The other nodes still send its clients there. Nothing but an operator brings it back.
    ///
    /// # Panics
    /// If the cluster is not ready within `limit`.
    pub fn wait_ready_reclaiming(&self, limit: Duration) -> Vec<(u16, Vec<u16>)> {
        let deadline = Instant::now() + limit;
        let mut reclaimed = Vec::new();
        while !self.running_ports().into_iter().all(ready) && Instant::now() < deadline {
            reclaimed.extend(self.reclaim_orphaned_slots());
            std::thread::sleep(Duration::from_millis(50));
        }
        let not_ok: Vec<String> = self
            .running_ports()
            .into_iter()
            .filter(|&p| !ready(p))
            .map(describe)
            .collect();
        assert!(
            not_ok.is_empty(),
            "the cluster ready: not within {limit:?}; not so on:\n{}",
            not_ok.join("\n")
        );
        reclaimed
    }

    /// One look for slots a master has lost from its own view while every other node still
    /// gives them to it, and `CLUSTER ADDSLOTS` of those on that master. Returns what it gave
    /// back.
    fn reclaim_orphaned_slots(&self) -> Vec<(u16, Vec<u16>)> {
        let views: Vec<(u16, String)> = self
            .running_ports()
            .into_iter()
            .filter_map(|p| Some((p, redis_cli(p, &["cluster", "nodes"])?)))
            .collect();
        let mut reclaimed = Vec::new();
        for (port, slots) in orphaned_slots(&views) {
            let mut args = vec!["cluster".to_owned(), "addslots".to_owned()];
            args.extend(slots.iter().map(u16::to_string));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            if redis_cli(port, &args).is_some_and(|r| r.trim() == "OK") {
                reclaimed.push((port, slots));
            }
        }
        reclaimed
    }
}

/// Per master (its port): the slots its own view leaves unassigned although every other
/// node's view gives them to it. `views` holds each running node's port and `CLUSTER NODES`
/// reply.
fn orphaned_slots(views: &[(u16, String)]) -> Vec<(u16, Vec<u16>)> {
    // Each view: whose it is, whether that node is a master, and each slot's owner in it.
    let parsed: Vec<(u16, String, bool, Vec<Option<String>>)> = views
        .iter()
        .filter_map(|(port, nodes)| {
            let mut me = None;
            let mut owners = vec![None; 16384];
            for line in nodes.lines() {
                let f: Vec<&str> = line.split_whitespace().collect();
                let Some(flags) = f.get(2) else { continue };
                if flags.split(',').any(|x| x == "myself") {
                    me = Some((f[0].to_owned(), flags.split(',').any(|x| x == "master")));
                }
                // Slots are `n` or `a-b`; `[n->-id]` and `[n-<-id]` are migrations.
                for range in f.iter().skip(8).filter(|t| !t.starts_with('[')) {
                    let (a, b) = range.split_once('-').unwrap_or((range, range));
                    let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) else {
                        continue;
                    };
                    for owner in owners.iter_mut().take(b + 1).skip(a) {
                        *owner = Some(f[0].to_owned());
                    }
                }
            }
            let (id, master) = me?;
            Some((*port, id, master, owners))
        })
        .collect();
    let mut orphaned = Vec::new();
    for (port, id, master, owners) in &parsed {
        let others: Vec<_> = parsed.iter().filter(|o| o.0 != *port).collect();
        if !master || others.is_empty() {
            continue;
        }
        let slots: Vec<u16> = (0..16384u16)
            .filter(|&s| owners[s as usize].is_none())
            .filter(|&s| others.iter().all(|o| o.3[s as usize].as_ref() == Some(id)))
            .collect();
        if !slots.is_empty() {
            orphaned.push((*port, slots));
        }
    }
    orphaned
}

/// The cluster slot of `key`, as the node on `port` computes it (`CLUSTER KEYSLOT`).
pub async fn key_slot(port: u16, key: &str) -> u16 {
    let mut c = node_conn(port).await;
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(&mut c)
        .await
        .expect("CLUSTER KEYSLOT")
}

/// A connection to one node (not the cluster), for node-level commands (`CLUSTER SETSLOT`,
/// `MIGRATE`, reading one master's keys).
///
/// # Panics
/// If the node does not accept it.
pub async fn node_conn(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("connect to a cluster node")
}

/// The cluster node id of the node on `port` (`CLUSTER MYID`).
///
/// # Panics
/// If that node does not answer.
pub async fn node_id(port: u16) -> String {
    redis::cmd("CLUSTER")
        .arg("MYID")
        .query_async(&mut node_conn(port).await)
        .await
        .expect("CLUSTER MYID")
}

impl RedisCluster {
    /// Moves `slot` from the master on `from` to the master on `to` the way
    /// `redis-cli --cluster reshard` does, by hand: `CLUSTER SETSLOT … IMPORTING` on the target,
    /// `… MIGRATING` on the source, then `MIGRATE … KEYS` of `batch` keys at a time (what
    /// `--cluster-pipeline` sets) until the source has none left in the slot, then
    /// `CLUSTER SETSLOT … NODE` on the target, the source and every other running master; waits
    /// until every running node's slot map shows the new owner. Keys written into the slot on
    /// either side while it moves are what a reshard has to cope with; a `MIGRATE` the target
    /// refuses (`BUSYKEY`: the key was created there while its old copy was still on the
    /// source) is returned as the error, the slot left half-moved, as `redis-cli` leaves it.
    ///
    /// # Panics
    /// If a node does not answer a command other than `MIGRATE`, or the new owner is not
    /// everywhere within 10 s.
    pub async fn move_slot(
        &self,
        slot: u16,
        from: u16,
        to: u16,
        batch: usize,
    ) -> Result<(), String> {
        Self::move_slot_among(&self.running_ports(), slot, from, to, batch).await
    }

    /// The ports of the nodes that answer now.
    pub fn running_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.is_up())
            .map(RedisServer::port)
            .collect()
    }

    /// [`move_slot`](RedisCluster::move_slot) in a cluster whose running nodes listen on
    /// `running` (for callers that share the cluster behind a lock they must not hold across
    /// the move).
    pub async fn move_slot_among(
        running: &[u16],
        slot: u16,
        from: u16,
        to: u16,
        batch: usize,
    ) -> Result<(), String> {
        let (from_id, to_id) = (node_id(from).await, node_id(to).await);
        let setslot = async |port: u16, args: &[&str]| {
            let _: () = redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(args)
                .query_async(&mut node_conn(port).await)
                .await
                .unwrap_or_else(|e| panic!("CLUSTER SETSLOT {slot} {args:?} on {port}: {e}"));
        };
        setslot(to, &["IMPORTING", &from_id]).await;
        setslot(from, &["MIGRATING", &to_id]).await;
        let mut source = node_conn(from).await;
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(batch)
                .query_async(&mut source)
                .await
                .expect("CLUSTER GETKEYSINSLOT");
            if keys.is_empty() {
                break;
            }
            let moved: redis::RedisResult<()> = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(to)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys)
                .query_async(&mut source)
                .await;
            // NOKEY: every key of the batch expired or was deleted since it was listed.
            if let Err(e) = moved.or_else(|e| {
                if e.code() == Some("NOKEY") {
                    Ok(())
                } else {
                    Err(e)
                }
            }) {
                return Err(format!("MIGRATE {keys:?} from {from} to {to}: {e}"));
            }
        }
        setslot(to, &["NODE", &to_id]).await;
        setslot(from, &["NODE", &to_id]).await;
        let masters: std::collections::BTreeSet<u16> = Self::slots_seen_by(to)
            .await
            .iter()
            .map(|r| r.master)
            .collect();
        for port in masters {
            if port != from && port != to {
                setslot(port, &["NODE", &to_id]).await;
            }
        }
        crate::wait::poll_until(
            Duration::from_secs(10),
            Duration::from_millis(20),
            async || {
                for &port in running {
                    let owner = Self::range_of(port, slot).await.master;
                    if owner != to {
                        return Err(format!("node {port} still sees slot {slot} on {owner}"));
                    }
                }
                Ok(())
            },
        )
        .await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::orphaned_slots;

    /// What the promoted master on 33863 said in a fault-harness run on Redis 7.0.15: slot 8579,
    /// moved to 40197 just before 40197 was killed, is nobody's in its own view.
    const PROMOTED: &str = "\
2671 127.0.0.1:33863@43863 myself,master - 0 1796046301000 10 connected 0-448 450-5460
454a 127.0.0.1:40197@50197 slave 2671 0 1796046301208 10 connected
a939 127.0.0.1:36007@46007 slave 8d4e 0 1796046301376 7 connected
17d9 127.0.0.1:45681@55681 slave 34bd 0 1796046301576 8 connected
34bd 127.0.0.1:32919@42919 master - 0 1796046301677 8 connected 449 5461-8578 8580-10922
8d4e 127.0.0.1:35641@45641 master - 0 1796046301677 7 connected 10923-16383
";

    /// Another node's view of the same cluster, which gives 8579 to 33863 still.
    fn other(myself: &str) -> String {
        PROMOTED
            .replace("myself,master", "master")
            .replace(" 0-448 450-5460", " 0-448 450-5460 8579")
            .lines()
            .map(|l| {
                if l.starts_with(myself) {
                    let mut f: Vec<&str> = l.split(' ').collect();
                    let flags = format!("myself,{}", f[2]);
                    f[2] = &flags;
                    f.join(" ")
                } else {
                    l.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn a_slot_every_other_node_gives_to_a_master_that_lost_it_is_orphaned() {
        let views = vec![
            (33863, PROMOTED.to_owned()),
            (32919, other("34bd")),
            (40197, other("454a")),
        ];
        assert_eq!(orphaned_slots(&views), vec![(33863, vec![8579])]);
    }

    #[test]
    fn a_slot_not_every_node_gives_to_the_master_is_not_orphaned() {
        // One node agrees that 8579 is nobody's (or had not heard yet): not ours to decide.
        let views = vec![
            (33863, PROMOTED.to_owned()),
            (32919, other("34bd")),
            (
                40197,
                PROMOTED.replace("myself,master", "master").replace(
                    "454a 127.0.0.1:40197@50197 slave",
                    "454a 127.0.0.1:40197@50197 myself,slave",
                ),
            ),
        ];
        assert_eq!(orphaned_slots(&views), Vec::<(u16, Vec<u16>)>::new());
        // A healthy cluster, or a master alone: nothing.
        let healthy = vec![(32919, other("34bd")), (40197, other("454a"))];
        assert_eq!(orphaned_slots(&healthy), Vec::<(u16, Vec<u16>)>::new());
        assert_eq!(orphaned_slots(&views[..1]), Vec::<(u16, Vec<u16>)>::new());
    }

    #[test]
    fn migrating_and_importing_marks_are_not_slots() {
        let view = PROMOTED.replace(" 0-448 450-5460", " 0-448 450-5460 [8579-<-34bd]");
        let views = vec![(33863, view), (32919, other("34bd"))];
        assert_eq!(orphaned_slots(&views), vec![(33863, vec![8579])]);
    }
}
