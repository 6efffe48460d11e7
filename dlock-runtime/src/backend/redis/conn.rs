//! The connection under a [`RedisBackend`](super::RedisBackend): one server (redis-rs's
//! reconnecting `ConnectionManager`); under feature `cluster`, a Redis Cluster (redis-rs's
//! cluster client, which routes each command to its slot's master and follows `MOVED`/`ASK`
//! and topology changes); under feature `sentinel`, the master of a Sentinel-monitored group,
//! followed through failovers (`super::sentinel`). One server and Sentinel carry commands and
//! RESP3 pushes on the same connection; a cluster keeps its shard-channel subscriptions on
//! connections of their own (see [`Conn::Cluster`]).
//!
//! Reconnecting: the `ConnectionManager` reconnects by itself when its connection is reset or
//! closed, and Sentinel's connection with it. It does not when the connection goes silent (a
//! partition, a load balancer or NAT that forgot it: no reset, no close): every command then
//! times out, which it does not take for a lost connection, until the kernel gives up on the
//! socket — many minutes. Nor does it when the server turns into a replica (a failover behind
//! one address: the demoted primary keeps its clients). The backend's connection to one server
//! is therefore a [`ServerLink`], which replaces a connection that a command timed out on and
//! that does not answer a `PING` either, and one a write was refused on as a replica
//! (`READONLY`: see [`ServerLink::demoted`]). The cluster client follows a cluster's failovers and
//! lost nodes, but it lives on a task of the runtime it was made on, and once that runtime
//! shuts down it is gone for good: a [`ClusterLink`] makes it anew on the runtime of its next
//! use (see there). What it does not follow by itself is a node gone silent (a frozen master:
//! no reset, no close): it retries a timed-out command on that node's connection and reads the
//! slot map again only on an error a node answers or a dropped connection, so a frozen
//! master's slots would stay unserved (`Unavailable`) until it wakes or the kernel gives up on
//! the connection, even once the cluster has failed it over. A timed-out command therefore has
//! the link check the cluster's view, and make the client read the slot map again once the
//! master was failed over ([`ClusterLink::suspect`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock, Weak};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, Pipeline, PushInfo, RedisFuture, RedisResult, Value};

use crate::LockError;
#[cfg(feature = "cluster")]
use {
    redis::cluster::ClusterClient,
    redis::cluster_async::ClusterConnection,
    redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr},
    redis::RedisError,
    std::collections::{HashMap, HashSet},
};

/// A script the crate runs. Every one is made here (`clippy.toml` forbids `Script::new`
/// elsewhere), so that a cluster connection can send its text where a node lacks it (see
/// [`ClusterLink`]'s `req_packed_command`).
#[allow(clippy::disallowed_methods)]
pub(crate) fn script(text: &str) -> redis::Script {
    let script = redis::Script::new(text);
    #[cfg(feature = "cluster")]
    SCRIPTS
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .entry(script.get_hash().to_owned())
        .or_insert_with(|| text.into());
    script
}

/// The text of every script made by [`script`], by SHA1 (hex).
#[cfg(feature = "cluster")]
static SCRIPTS: std::sync::LazyLock<RwLock<HashMap<String, Arc<str>>>> =
    std::sync::LazyLock::new(Default::default);

/// The text of the script made by [`script`] whose SHA1 (hex) is `sha`.
#[cfg(feature = "cluster")]
pub(super) fn script_body(sha: &str) -> Option<Arc<str>> {
    SCRIPTS
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .get(sha)
        .cloned()
}

/// The start of a call of `script`: `EVALSHA <sha>`, or, `with_body` on a cluster, `EVAL <its
/// text>` (where a node lacks it: see [`ClusterLink`]).
pub(super) fn script_call(script: &redis::Script, with_body: bool) -> Cmd {
    #[cfg(feature = "cluster")]
    if let Some(text) = with_body.then(|| script_body(script.get_hash())).flatten() {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(&*text);
        return cmd;
    }
    let _ = with_body;
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash());
    cmd
}

/// A call of one of the crate's scripts, written straight into its command: `EVALSHA <sha>
/// <number of keys> <keys…> <arguments…>`. (redis-rs's `ScriptInvocation` keeps every key and
/// argument in a buffer of its own and copies them into a new command on every send: about
/// ten allocations for one call of the acquire script, where this makes two.) The number of keys
/// is given first, as Redis reads it; the keys follow, then the arguments.
pub(crate) struct ScriptCall<'s> {
    script: &'s redis::Script,
    cmd: Cmd,
    /// Keys declared and not written yet: must be none before the first argument.
    keys_left: usize,
}

impl<'s> ScriptCall<'s> {
    /// A call of `script` with `keys` keys.
    pub(crate) fn new(script: &'s redis::Script, keys: usize) -> Self {
        // Room for the usual call (`EVALSHA`, the SHA, the count, the keys and up to eight
        // arguments, a few hundred bytes in all), so that writing it does not reallocate.
        let mut cmd = Cmd::with_capacity(3 + keys + 8, 320);
        cmd.arg("EVALSHA").arg(script.get_hash()).arg(keys);
        ScriptCall {
            script,
            cmd,
            keys_left: keys,
        }
    }

    /// Writes the next key.
    pub(crate) fn key(&mut self, key: impl redis::ToRedisArgs) -> &mut Self {
        debug_assert!(
            self.keys_left > 0,
            "a script call given more keys than declared"
        );
        self.keys_left = self.keys_left.saturating_sub(1);
        self.cmd.arg(key);
        self
    }

    /// Writes the next argument (after every key).
    pub(crate) fn arg(&mut self, arg: impl redis::ToRedisArgs) -> &mut Self {
        debug_assert_eq!(self.keys_left, 0, "a script argument before all its keys");
        self.cmd.arg(arg);
        self
    }

    /// Sends the call. A server that lacks the script (`NOSCRIPT`: its first use there, or its
    /// first after a restart or `SCRIPT FLUSH`) is given it (`SCRIPT LOAD`), and the call is
    /// sent once more; on a cluster the link sends the script's text itself (see
    /// [`ClusterLink`]).
    pub(crate) async fn invoke<T: redis::FromRedisValue>(
        &self,
        conn: &mut impl ConnectionLike,
    ) -> RedisResult<T> {
        debug_assert_eq!(self.keys_left, 0, "a script call sent without all its keys");
        match self.cmd.query_async(conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.script.load_async(conn).await?;
                self.cmd.query_async(conn).await
            }
            r => r,
        }
    }

    /// Sends the call and `WAIT <replicas> <wait>` right after it as one pipeline — one write,
    /// on one connection, to one node — and answers the script's answer and how many replicas
    /// have every write made on that connection so far, the script's included. Sent apart,
    /// the `WAIT` could go on another connection than the script (one made anew in between —
    /// a reset, Sentinel's switch to a new master, a cluster's `ASK` sending the script
    /// elsewhere), where it counts no write of the script's and answers at once with the
    /// replicas connected: an acknowledgement of a write no replica had. A server that lacks
    /// the script (`NOSCRIPT`) is given it, or on a cluster sent its text (`EVAL`), and the
    /// pipeline sent once more: the first pipeline's `WAIT` counted nothing new.
    pub(crate) async fn invoke_acknowledged<T: redis::FromRedisValue>(
        &self,
        conn: &mut Conn,
        replicas: u32,
        wait: Duration,
    ) -> RedisResult<(T, i64)> {
        debug_assert_eq!(self.keys_left, 0, "a script call sent without all its keys");
        let no_script = |e: &redis::RedisError| {
            e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        };
        let mut call = self.cmd.clone();
        for resend in [false, true] {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            pipe.add_command(call.clone());
            pipe.cmd("WAIT").arg(replicas).arg(super::millis(wait));
            let replies: Vec<RedisResult<Value>> = pipe.query_async(conn).await?;
            let mut replies = replies.into_iter();
            let (Some(answer), Some(acked)) = (replies.next(), replies.next()) else {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Client,
                    "a script and WAIT pipeline answered short",
                )));
            };
            match answer {
                Err(e) if no_script(&e) && !resend => {
                    if conn.is_cluster() {
                        call = self.with_body().unwrap_or(call);
                    } else {
                        self.script.load_async(conn).await?;
                    }
                }
                answer => {
                    let answer = redis::from_redis_value(answer?)?;
                    return Ok((answer, redis::from_redis_value(acked?)?));
                }
            }
        }
        unreachable!("the loop returns on its second pass")
    }

    /// This call as `EVAL <script's text> …` (for a cluster node that lacks the script), if the
    /// text is known.
    fn with_body(&self) -> Option<Cmd> {
        #[cfg(feature = "cluster")]
        {
            let text = script_body(self.script.get_hash())?;
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(&*text);
            // After `EVALSHA <sha>`: the number of keys, the keys, the arguments.
            for arg in self.cmd.args_iter().skip(2) {
                if let redis::Arg::Simple(bytes) = arg {
                    cmd.arg(bytes);
                }
            }
            Some(cmd)
        }
        #[cfg(not(feature = "cluster"))]
        None
    }
}

/// One server or a cluster. Cheap to clone.
#[derive(Clone)]
pub(crate) enum Conn {
    /// One server: replaced when it went silent. The backend's own connection, its
    /// connections for `WAIT` and the durable queue's.
    Server(ServerLink),
    /// Commands, and subscriptions (`SSUBSCRIBE`/`SUNSUBSCRIBE`) on connections of their own.
    /// When a slot moves to another master, Redis tells the clients subscribed to its shard
    /// channels with an unsolicited `sunsubscribe` push, which redis-rs (1.8) takes for the
    /// reply of the oldest request in flight on that connection: that request fails and every
    /// reply after it goes to the request behind it (an acquire could get another key's
    /// grant) until the connection is idle. No command ever waits on the subscriptions'
    /// connections, so a moved slot cannot shift a command's reply.
    ///
    /// Each is a [`ClusterLink`]: made anew on the runtime of its next use when the runtime it
    /// ran on shuts down.
    #[cfg(feature = "cluster")]
    Cluster {
        /// Every command.
        cmds: ClusterLink,
        /// `SSUBSCRIBE`/`SUNSUBSCRIBE` only.
        subs: ClusterLink,
    },
    #[cfg(feature = "sentinel")]
    Sentinel(super::sentinel::SentinelConn),
}

impl Conn {
    /// Whether this is a cluster (scripts publish on sharded channels, fencing counters are
    /// per slot, pipelines hold one slot).
    pub(crate) fn is_cluster(&self) -> bool {
        #[cfg(feature = "cluster")]
        if let Conn::Cluster { .. } = self {
            return true;
        }
        false
    }

    /// The issuer number of the connection the last reply on this handle came over, where it
    /// is not the backend's own (see [`Issuer`](super::Issuer)).
    pub(super) fn replied_issuer(&self) -> super::Issuer {
        match self {
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.replied_issuer(),
            _ => None,
        }
    }

    /// Subscribes to a lock's release channel: `SUBSCRIBE` on one server, `SSUBSCRIBE` (routed
    /// to the channel's slot, re-established by the client after a topology change) on a
    /// cluster.
    pub(super) async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Conn::Server(c) => c.conn().subscribe(channel).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster { subs, .. } => subs.ssubscribe(channel).await,
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.subscribe(channel).await,
        }
    }

    /// Whether `e`, the failure of a command sent through this handle, says the command never
    /// reached the server and may be sent again: on a cluster, the connection's driver was
    /// gone with its runtime before the command was handed to it (the next command then makes
    /// a new connection; see [`ClusterLink::never_sent`]). One server and Sentinel reconnect
    /// on their own and never say so.
    pub(super) fn never_sent(&mut self, e: &redis::RedisError) -> bool {
        match self {
            #[cfg(feature = "cluster")]
            Conn::Cluster { cmds, .. } => cmds.never_sent(e),
            _ => {
                let _ = e;
                false
            }
        }
    }

    /// Whether the subscriptions made through this connection still hold, as far as is known:
    /// on a cluster, `false` once the subscriptions connection died with its runtime (its
    /// subscriptions with it) until it is made anew.
    pub(super) fn subscriptions_alive(&self) -> bool {
        match self {
            #[cfg(feature = "cluster")]
            Conn::Cluster { subs, .. } => subs.is_alive(),
            _ => true,
        }
    }

    /// Told the failure of a command sent through this handle: a timeout (no answer within
    /// the command timeout) may mean the connection went silent, which the backend's connection
    /// to one server then checks ([`ServerLink::suspect`]). Sentinel's starts its check on such
    /// a failure by itself; a cluster's reconnects a node's connection that dropped, but not one
    /// that went silent, and checks whether a master was failed over
    /// ([`ClusterLink::suspect`]).
    ///
    /// A write refused because the server is a replica (`READONLY`, `MASTERDOWN`) has one
    /// server's connection replaced ([`ServerLink::demoted`]): behind a name or address that a
    /// failover moved to the promoted replica, a new connection reaches the new primary.
    pub(crate) fn failed(&self, e: &redis::RedisError) {
        if refused_by_a_replica(e) {
            if let Some(c) = self.server() {
                c.demoted();
            }
            return;
        }
        if !e.is_timeout() {
            return;
        }
        match self {
            Conn::Server(c) => c.suspect(),
            #[cfg(feature = "cluster")]
            Conn::Cluster { .. } => self.timed_out(),
            // Sentinel's connection starts its check on such a failure by itself.
            #[allow(unreachable_patterns)]
            _ => {}
        }
    }

    /// The link to one server, if this is one.
    fn server(&self) -> Option<&ServerLink> {
        match self {
            Conn::Server(c) => Some(c),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// One server: whether it refuses the sign-in for good ([`refused_at_sign_in`]); `None`
    /// for other deployments.
    pub(crate) async fn refused_at_sign_in(&self, limit: Duration) -> Option<LockError> {
        refused_at_sign_in(&self.server()?.shared.client, limit).await
    }

    /// Like [`failed`](Conn::failed), for a command cut off by a deadline of the caller's.
    pub(crate) fn timed_out(&self) {
        match self {
            Conn::Server(c) => c.suspect(),
            // A command cut off by the caller's deadline never reached the connection's own
            // failure handling, which starts the check (see `SentinelConn`).
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.timed_out(),
            // Perhaps a frozen master, failed over since (see `ClusterLink::suspect`). Not on
            // the subscriptions' connection, where no command may wait (see `Conn::Cluster`).
            #[cfg(feature = "cluster")]
            Conn::Cluster { cmds, .. } => cmds.suspect(),
        }
    }

    /// A command given up before its answer came, after `waited`: taken for a timeout
    /// ([`timed_out`](Conn::timed_out)) once it waited as long as a check's `PING` may, or
    /// [`CUT_OFF_AFTER`] if less. One dropped sooner says nothing of the connection — a Redlock
    /// node's acquire dropped once the majority answered, a cancelled waiter's attempt — and
    /// costs no `PING` (every Redlock acquire cost one). One server only: Sentinel's check
    /// asks every sentinel, and a cancelled caller is no sign of a failover.
    pub(super) fn cut_off(&self, waited: Duration) {
        if let Some(c) = self.server() {
            if waited >= c.shared.probe.min(CUT_OFF_AFTER) {
                c.suspect();
            }
        }
    }

    /// The reverse of [`subscribe`](Conn::subscribe).
    pub(super) async fn unsubscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self {
            Conn::Server(c) => c.conn().unsubscribe(channel).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster { subs, .. } => subs.sunsubscribe(channel).await,
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.unsubscribe(channel).await,
        }
    }
}

/// How to make another connection to the same store, without a push handler (for
/// [`Dedicated`]).
pub(crate) enum Reconnect {
    /// One server.
    Single(Box<redis::Client>),
    /// A cluster.
    #[cfg(feature = "cluster")]
    Cluster(Box<ClusterClient>),
    /// From the connection itself (Sentinel: `SentinelConn::dedicated`, which follows a
    /// failover on its own).
    #[cfg(feature = "sentinel")]
    FromConn,
}

/// Connections of their own for commands that block their connection (`WAIT`): a few, made on
/// first use and taken in turn. They carry no pushes. The lock backend's `.replicas(n)` and the
/// durable queue's [`with_replicas`](crate::durable::DurableQueue::with_replicas) send their
/// writes and the `WAIT` after them here.
pub(crate) struct Dedicated {
    how: Reconnect,
    connect_timeout: Duration,
    command_timeout: Duration,
    pool: tokio::sync::Mutex<Vec<Conn>>,
    next: std::sync::atomic::AtomicUsize,
}

impl Dedicated {
    /// How many connections the `WAIT`s are spread over.
    const SIZE: usize = 4;

    pub(crate) fn new(
        how: Reconnect,
        connect_timeout: Duration,
        command_timeout: Duration,
    ) -> Self {
        Dedicated {
            how,
            connect_timeout,
            command_timeout,
            pool: tokio::sync::Mutex::new(Vec::new()),
            next: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// The next connection, the pool made first if it is not yet (`main`: the store's own
    /// connection, which Sentinel's are made from).
    pub(crate) async fn get(&self, main: &Conn) -> Result<Conn, LockError> {
        let mut pool = self.pool.lock().await;
        if pool.is_empty() {
            for _ in 0..Self::SIZE {
                pool.push(self.make(main).await?);
            }
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % pool.len();
        Ok(pool[i].clone())
    }

    async fn make(&self, main: &Conn) -> Result<Conn, LockError> {
        match (&self.how, main) {
            // Replaced when it goes silent, like the store's own connection (it carries no
            // subscriptions: nothing to do after).
            (Reconnect::Single(client), _) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(self.connect_timeout))
                    .set_response_timeout(Some(self.command_timeout))
                    .set_number_of_retries(2)
                    .set_max_delay(self.connect_timeout);
                ServerLink::new((**client).clone(), config, None, self.command_timeout)
                    .map(Conn::Server)
                    .map_err(|e| super::redis_err("connect", e))
            }
            #[cfg(feature = "cluster")]
            (Reconnect::Cluster(client), _) => {
                let limit = self.connect_timeout + self.command_timeout;
                let c = ClusterLink::connect((**client).clone(), limit).await?;
                // A dedicated connection never subscribes: `subs` is never used.
                Ok(Conn::Cluster {
                    subs: c.clone(),
                    cmds: c,
                })
            }
            #[cfg(feature = "sentinel")]
            (Reconnect::FromConn, Conn::Sentinel(c)) => Ok(Conn::Sentinel(c.dedicated()?)),
            #[allow(unreachable_patterns)]
            _ => Err(LockError::unsupported("redis", "replica acknowledgement")),
        }
    }
}

/// The server's `maxmemory-policy` when it is one that evicts keys (not `noeviction`): one
/// `CONFIG GET` within `timeout`. `None` too when the server does not say (an ACL or a managed
/// Redis without `CONFIG`, no answer in time): a check, not a condition of use.
pub(crate) async fn evicting_policy(conn: &mut Conn, timeout: Duration) -> Option<String> {
    let mut get = redis::cmd("CONFIG");
    get.arg("GET").arg("maxmemory-policy");
    // A map in RESP3, pairs in RESP2: both read as one.
    let asked = tokio::time::timeout(
        timeout,
        get.query_async::<std::collections::HashMap<String, String>>(conn),
    )
    .await;
    match asked {
        Ok(Ok(mut reply)) => reply
            .remove("maxmemory-policy")
            .filter(|p| p.as_str() != "noeviction"),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "dlock: the eviction policy could not be read (CONFIG GET)");
            None
        }
        Err(_) => {
            tracing::debug!("dlock: the eviction policy could not be read in time (CONFIG GET)");
            None
        }
    }
}

/// `WAIT replicas <wait>` on `conn`, the connection that made the writes it waits for: the
/// number of replicas that have every write this connection made so far. On a cluster it is
/// sent to the master of the slot of hash tag `tag`, on the connection that carried the
/// writes to it. (The durable queue's; the lock backend sends its `WAIT`s with their writes:
/// [`ScriptCall::invoke_acknowledged`].)
#[cfg(feature = "durable")]
pub(crate) async fn wait_replicas(
    conn: &mut Conn,
    tag: &str,
    replicas: u32,
    wait: Duration,
) -> RedisResult<i64> {
    let mut cmd = redis::cmd("WAIT");
    cmd.arg(replicas).arg(super::millis(wait));
    match conn {
        #[cfg(feature = "cluster")]
        Conn::Cluster { cmds, .. } => {
            let to = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                slot(tag),
                SlotAddr::Master,
            )));
            Ok(redis::from_redis_value(cmds.route_command(cmd, to).await?)?)
        }
        _ => {
            let _ = tag;
            cmd.query_async(conn).await
        }
    }
}

/// Connects to the cluster behind `url` (`redis+cluster://[user:pass@]h1:p1,h2:p2`,
/// `rediss+cluster://…`) without release notifications (the durable queue's connection), and
/// how to make [`Dedicated`] ones.
#[cfg(all(feature = "cluster", feature = "durable"))]
pub(crate) async fn connect_cluster(
    url: &str,
    connect_timeout: std::time::Duration,
    command_timeout: std::time::Duration,
) -> Result<(Conn, Reconnect), crate::LockError> {
    let client = redis::cluster::ClusterClient::builder(cluster_urls(url)?)
        .connection_timeout(connect_timeout)
        .response_timeout(command_timeout)
        // As the lock backend's (see `CLUSTER_RETRIES`): redis-rs's default waits at least
        // 1.28 s before retrying a `TRYAGAIN` (a slot being resharded), longer than a
        // command's deadline.
        .retries(super::CLUSTER_RETRIES)
        .min_retry_wait(super::CLUSTER_RETRY_WAIT_MS.0)
        .max_retry_wait(super::CLUSTER_RETRY_WAIT_MS.1)
        .retry_wait_formula(super::CLUSTER_RETRY_WAIT_MS.0, 2)
        .build()
        // The URL may carry a password: never put it in an error message.
        .map_err(|e| {
            crate::LockError::misconfigured(
                format!("invalid redis cluster url: {:?}", e.kind()),
                None,
            )
        })?;
    let cmds = ClusterLink::connect(client.clone(), connect_timeout + command_timeout).await?;
    let conn = Conn::Cluster {
        subs: cmds.clone(),
        cmds,
    };
    Ok((conn, Reconnect::Cluster(Box::new(client))))
}

/// Whether `url` names a cluster (`redis+cluster://`, `rediss+cluster://`).
#[cfg(feature = "durable")]
pub(crate) fn is_cluster_url(url: &str) -> bool {
    url.starts_with("redis+cluster://") || url.starts_with("rediss+cluster://")
}

/// `redis+cluster://[user:pass@]h1:p1,h2:p2/…` → one `redis://[user:pass@]h:p` URL per node
/// (`rediss://` for `rediss+cluster://`).
#[cfg(feature = "cluster")]
pub(crate) fn cluster_urls(url: &str) -> Result<Vec<String>, crate::LockError> {
    let bad = || {
        crate::LockError::misconfigured(
            "invalid redis cluster url: expected redis+cluster://host:port,host:port",
            None,
        )
    };
    let (scheme, rest) = url.split_once("://").ok_or_else(bad)?;
    let scheme = if scheme == "rediss+cluster" {
        "rediss"
    } else {
        "redis"
    };
    let (auth, hosts, _) = split_hosts(rest);
    let urls = node_urls(scheme, &auth, hosts);
    if urls.is_empty() {
        return Err(bad());
    }
    Ok(urls)
}

/// `[user:pass@]h1:p1,h2:p2[/path]` (a multi-host URL after its `://`) → (`"user:pass@"` or
/// `""`, `"h1:p1,h2:p2"`, the path after the first `/`, if any).
#[cfg(any(feature = "cluster", feature = "sentinel"))]
pub(super) fn split_hosts(rest: &str) -> (String, &str, Option<&str>) {
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), rest),
    };
    match hosts.split_once('/') {
        Some((hosts, path)) => (auth, hosts, Some(path)),
        None => (auth, hosts, None),
    }
}

/// One connection to `client`'s server made directly — without a connection manager's
/// retries — and dropped: the error it ends with within `limit` when the server refuses for
/// good (a wrong password or user). A manager retries a refused sign-in like a dropped
/// connection, so with short timeouts its tries outlast the caller's deadline and the refusal
/// looks like a timeout; this tells the two apart, on the failing path only.
pub(super) async fn refused_at_sign_in(
    client: &redis::Client,
    limit: Duration,
) -> Option<LockError> {
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(limit))
        .set_response_timeout(Some(limit));
    let made = client.get_multiplexed_async_connection_with_config(&config);
    let e = tokio::time::timeout(limit, made).await.ok()?.err()?;
    super::refused_for_good(&e).then(|| super::redis_err("connect", e))
}

/// One `<scheme>://<auth><host>` URL per non-empty comma-separated host.
#[cfg(any(feature = "cluster", feature = "sentinel"))]
pub(super) fn node_urls(scheme: &str, auth: &str, hosts: &str) -> Vec<String> {
    hosts
        .split(',')
        .filter(|h| !h.is_empty())
        .map(|h| format!("{scheme}://{auth}{h}"))
        .collect()
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Server(c) => c.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Conn::Cluster { cmds, .. } => cmds.req_packed_command(cmd),
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Server(c) => c.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "cluster")]
            Conn::Cluster { cmds, .. } => cmds.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Server(c) => c.get_db(),
            #[cfg(feature = "cluster")]
            Conn::Cluster { cmds, .. } => cmds.get_db(),
            #[cfg(feature = "sentinel")]
            Conn::Sentinel(c) => c.get_db(),
        }
    }
}

/// See [`Conn::cut_off`].
const CUT_OFF_AFTER: Duration = Duration::from_millis(100);

/// The least time between two replacements of one server's connection for a write a replica
/// refused ([`ServerLink::demoted`]): a server demoted for good behind an address that did not
/// move costs a new connection a second, not one per refused command.
const DEMOTED_RECHECK: Duration = Duration::from_secs(1);

/// Whether `e` is a write refused because the server is a replica (or a replica cut off from
/// its master): `READONLY`, `MASTERDOWN`, or a script's error that wraps `READONLY`.
pub(super) fn refused_by_a_replica(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    matches!(
        e.kind(),
        ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
    ) || e.to_string().contains("READONLY")
}

/// The backend's connection to one server: a redis-rs `ConnectionManager`, replaced when it
/// went silent, or when the runtime it was made on shut down.
///
/// The manager reconnects when its connection is reset or closed, never when it merely stops
/// answering: a command that times out is, to redis-rs (1.8), one to retry on the same
/// connection. A connection a partition, a load balancer or a NAT forgot without a reset stays
/// open until the kernel gives up on it — many minutes of commands that all time out, and of
/// release notifications (pushes on the same connection) that never come, though a new
/// connection would work at once. So a command that timed out, or that its caller gave up
/// before its answer came, has the connection checked ([`suspect`](Self::suspect)): a `PING` on it, within the command timeout, one check at a
/// time however many commands timed out. Unanswered too, the connection is taken for dead and
/// replaced by a new manager made from the same client and settings (its push handler
/// included); the backend is then told ([`on_remade`](Self::on_remade)) to subscribe the new
/// connection to the release channels still wanted and wake every local waiter to re-check.
/// A `PING` that fails otherwise (refused, reset) is left to the manager's own reconnect. The
/// command that timed out is not sent again — it may have run — and fails as unavailable; so
/// do the commands of a server that is really down, on every connection made in its place.
///
/// A manager belongs to the runtime it was made on: it spawns its reconnects there, and a
/// reconnect that runtime began holds that runtime's timers (the back-off between attempts),
/// which panic when polled on another runtime once it shut down — in the caller's task (an
/// actix-web worker restarting, a runtime built for set-up and dropped while the locker lives
/// on). So a watch ([`util::on_runtime_shutdown`](crate::util::on_runtime_shutdown)) goes with
/// each connection, and the first use after its runtime shut down replaces it on the runtime of
/// that use, then has it subscribed again like a silent one's replacement.
///
/// Each command first reads the current connection (a shared `RwLock` read, one atomic load
/// for the watch, and the clone of a manager that cloning the connection always cost), like a
/// [`ClusterLink`]'s. Cheap to clone: a clone shares the connection and takes it at its first
/// command.
pub(crate) struct ServerLink {
    shared: Arc<Server>,
    /// The connection this handle sends on and its generation, taken from [`Server::current`]
    /// at the handle's first command and again when it was replaced.
    conn: Option<(ConnectionManager, u64)>,
}

impl Clone for ServerLink {
    fn clone(&self) -> Self {
        ServerLink {
            shared: self.shared.clone(),
            conn: None,
        }
    }
}

/// Where a [`ServerLink`]'s pushes go, told whether the connection each came on is the one
/// commands are sent on now (`false`: one replaced since, which may still deliver what the
/// server wrote to it before a partition healed — out of order with the answers on the new
/// one, so it must not hand a lock over; see `on_push`).
pub(crate) type LinkPush = Arc<dyn Fn(PushInfo, bool) + Send + Sync>;

struct Server {
    client: redis::Client,
    /// The settings of every connection made, without the push handler.
    config: ConnectionManagerConfig,
    /// Where the pushes of every connection made go ([`LinkPush`]).
    push: Option<LinkPush>,
    /// The generation of the connection commands are sent on now (as in `current`; read by
    /// the push handlers, which must not wait for the lock).
    live: Arc<AtomicU64>,
    /// How long the check's `PING` waits for its answer (the command timeout).
    probe: Duration,
    current: RwLock<ServerConn>,
    /// A check is under way.
    checking: AtomicBool,
    /// When the connection was last replaced for a replica's refusal ([`ServerLink::demoted`]).
    demoted_at: std::sync::Mutex<Option<std::time::Instant>>,
    on_remade: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

/// The connection a [`Server`] sends on now.
struct ServerConn {
    conn: ConnectionManager,
    /// Numbers the connections a link has had.
    generation: u64,
    /// Whether the runtime `conn` was made on shut down (none if made off any runtime).
    made_on: Option<crate::util::RuntimeWatch>,
}

impl ServerConn {
    fn runtime_gone(&self) -> bool {
        self.made_on
            .as_ref()
            .is_some_and(crate::util::RuntimeWatch::is_gone)
    }
}

/// Why a connection is replaced, for the log.
#[derive(Clone, Copy)]
enum Remade {
    Silent,
    RuntimeGone,
    Demoted,
}

impl ServerLink {
    /// A link whose first connection is made on first use (`ConnectionManager`'s lazy
    /// connection); `probe` is how long a check's `PING` waits.
    pub(crate) fn new(
        client: redis::Client,
        config: ConnectionManagerConfig,
        push: Option<LinkPush>,
        probe: Duration,
    ) -> RedisResult<ServerLink> {
        let live = Arc::new(AtomicU64::new(0));
        let conn = ConnectionManager::new_lazy_with_config(
            client.clone(),
            config_for(&config, push.as_ref(), &live, 0),
        )?;
        Ok(ServerLink {
            shared: Arc::new(Server {
                client,
                config,
                push,
                live,
                probe,
                current: RwLock::new(ServerConn {
                    conn,
                    generation: 0,
                    made_on: crate::util::on_runtime_shutdown(|| {}),
                }),
                checking: AtomicBool::new(false),
                demoted_at: std::sync::Mutex::new(None),
                on_remade: OnceLock::new(),
            }),
            conn: None,
        })
    }

    /// Sets what the link calls after it replaced a silent connection, on the runtime the new
    /// one was made on: it is subscribed to nothing (once; later calls are ignored).
    pub(super) fn on_remade(&self, f: impl Fn() + Send + Sync + 'static) {
        let _ = self.shared.on_remade.set(Box::new(f));
    }

    /// The connection to send on: the current one (no await: the hot path), made anew first if
    /// the runtime it was made on shut down.
    fn conn(&mut self) -> &mut ConnectionManager {
        let mut cur = self.shared.read();
        if cur.runtime_gone() && tokio::runtime::Handle::try_current().is_ok() {
            let generation = cur.generation;
            drop(cur);
            remake(&self.shared, generation, Remade::RuntimeGone);
            cur = self.shared.read();
        }
        let conn = match self.conn.take() {
            Some((c, g)) if g == cur.generation => (c, g),
            _ => (cur.conn.clone(), cur.generation),
        };
        drop(cur);
        &mut self.conn.insert(conn).0
    }

    /// A command timed out: checks, on a task of this runtime, whether the current connection
    /// still answers, and replaces it if not (see [`ServerLink`]). One check at a time: a
    /// call while one runs does nothing. Without a runtime, nothing.
    pub(super) fn suspect(&self) {
        if self.shared.checking.swap(true, Ordering::AcqRel) {
            return;
        }
        if tokio::runtime::Handle::try_current().is_err() {
            self.shared.checking.store(false, Ordering::Release);
            return;
        }
        // To the end: cut off by its runtime's shutdown, it runs again on the fallback thread
        // (else `checking` stayed set, and no silent connection was replaced again).
        let weak = Arc::downgrade(&self.shared);
        crate::util::spawn_to_the_end(Arc::new(move || Box::pin(check_server(weak.clone()))));
    }
}

impl ServerLink {
    /// A write was refused because the server is a replica: the primary it was failed over,
    /// and the address this link connects to may lead to the promoted one now (a managed
    /// primary's DNS name, a virtual IP, a Kubernetes Service), while this connection stays on
    /// the demoted server, which keeps its clients. redis-rs reconnects only on a lost
    /// connection, and the demoted server answers `PING`, so the connection is replaced here
    /// — at most once per [`DEMOTED_RECHECK`]. The refused command is not sent again (the
    /// caller's error stands); the next one goes on the new connection. Without a runtime,
    /// nothing.
    pub(super) fn demoted(&self) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        {
            let mut at = self
                .shared
                .demoted_at
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let now = std::time::Instant::now();
            if at.is_some_and(|t| now.duration_since(t) < DEMOTED_RECHECK) {
                return;
            }
            *at = Some(now);
        }
        let generation = self.shared.read().generation;
        remake(&self.shared, generation, Remade::Demoted);
    }
}

impl Server {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, ServerConn> {
        self.current.read().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`ServerLink::suspect`]'s check: a `PING` on the current connection; unanswered within the
/// command timeout, a new connection in its place.
async fn check_server(link: Weak<Server>) {
    let Some(server) = link.upgrade() else { return };
    let (mut conn, generation, gone) = {
        let cur = server.read();
        (cur.conn.clone(), cur.generation, cur.runtime_gone())
    };
    // A connection whose runtime shut down is not polled here (see [`ServerLink`]).
    let silent = !gone && {
        let ping = redis::cmd("PING");
        match tokio::time::timeout(server.probe, ping.query_async::<()>(&mut conn)).await {
            Err(_) => true,
            Ok(Err(e)) => e.is_timeout(),
            Ok(Ok(())) => false,
        }
    };
    drop(conn);
    let why = if gone {
        Remade::RuntimeGone
    } else {
        Remade::Silent
    };
    let remade = (gone || silent) && remake_server(&server, generation, why);
    server.checking.store(false, Ordering::Release);
    if remade {
        if let Some(f) = server.on_remade.get() {
            f();
        }
    }
}

/// Replaces connection `generation` of `server` (see [`remake_server`]) and, if it did, tells
/// the backend ([`ServerLink::on_remade`]).
fn remake(server: &Server, generation: u64, why: Remade) {
    if remake_server(server, generation, why) {
        if let Some(f) = server.on_remade.get() {
            f();
        }
    }
}

/// The settings of connection `generation`: `config`, with a push handler that tells `push`
/// whether that connection is still the one commands go on (`live`).
fn config_for(
    config: &ConnectionManagerConfig,
    push: Option<&LinkPush>,
    live: &Arc<AtomicU64>,
    generation: u64,
) -> ConnectionManagerConfig {
    let Some(push) = push else {
        return config.clone();
    };
    let (push, live) = (push.clone(), live.clone());
    config.clone().set_push_sender(move |p: PushInfo| {
        push(p, live.load(Ordering::Acquire) == generation);
        Ok::<(), redis::aio::SendError>(())
    })
}

/// Replaces connection `generation` of `server` by a new one (made on first use, on this
/// runtime). `false`: not replaced (another call did, or no manager could be made).
fn remake_server(server: &Server, generation: u64, why: Remade) -> bool {
    let config = config_for(
        &server.config,
        server.push.as_ref(),
        &server.live,
        generation + 1,
    );
    let conn = match ConnectionManager::new_lazy_with_config(server.client.clone(), config) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = ?e.kind(), "redis: could not replace a silent connection");
            return false;
        }
    };
    let old = {
        let mut cur = server
            .current
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if cur.generation != generation {
            return false;
        }
        // Under the lock: no command goes on the new connection before its pushes count.
        server.live.store(generation + 1, Ordering::Release);
        std::mem::replace(
            &mut *cur,
            ServerConn {
                conn,
                generation: generation + 1,
                made_on: crate::util::on_runtime_shutdown(|| {}),
            },
        )
    };
    // Outside the lock: the last handle of the old connection closes it.
    drop(old);
    match why {
        Remade::Silent => tracing::warn!(
            "redis connection gone silent (no answer to PING); replaced by a new one"
        ),
        Remade::RuntimeGone => tracing::debug!(
            "redis connection made on a runtime that shut down; replaced by a new one"
        ),
        Remade::Demoted => tracing::warn!(
            "redis server refused a write as a replica (READONLY: failed over?); connection \
             replaced by a new one"
        ),
    }
    true
}

impl ConnectionLike for ServerLink {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.conn().req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        self.conn().req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.shared.read().conn.get_db()
    }
}

/// A cluster connection that outlives the runtime it was made on.
///
/// redis-rs's `ClusterConnection` is a handle to a task (its driver) spawned on the runtime
/// current when it was made; when that runtime shuts down (an actix-web worker restarting, a
/// runtime built for set-up and dropped), the driver is dropped with it and every later
/// command fails ("Unable to send command") — the cluster client, unlike the single server's
/// `ConnectionManager`, never reconnects by itself. A link keeps the client, and a small task
/// beside the driver on the same runtime whose end, unasked, says the runtime is gone.
/// Each command first reads the current connection (a shared `RwLock` read and the clone
/// that cloning the connection itself always cost); when its driver is gone, the first caller
/// makes a new connection on its own runtime (the others wait for it: one reconnect however
/// many callers), and the command goes on there.
///
/// Cheap to clone: a clone shares the connection and takes it at its first command.
#[cfg(feature = "cluster")]
pub(crate) struct ClusterLink {
    shared: Arc<Link>,
    /// The connection this handle sends on and its generation, taken from
    /// [`Link::current`] at the handle's first command and again when it was replaced.
    conn: Option<(ClusterConnection, u64)>,
}

#[cfg(feature = "cluster")]
impl Clone for ClusterLink {
    fn clone(&self) -> Self {
        ClusterLink {
            shared: self.shared.clone(),
            conn: None,
        }
    }
}

/// What a [`ClusterLink`] tells the backend (see [`ClusterLink::on_event`]).
#[cfg(feature = "cluster")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LinkEvent {
    /// The runtime running the connection's driver shut down: the connection, and everything
    /// it was subscribed to, is gone. Told from inside that runtime's shutdown.
    Gone,
    /// A new connection replaced one whose driver was gone; it is subscribed to nothing. Told
    /// on the runtime that made it, which runs its driver.
    Remade,
}

#[cfg(feature = "cluster")]
type OnEvent = Box<dyn Fn(LinkEvent) + Send + Sync>;

#[cfg(feature = "cluster")]
struct Link {
    client: ClusterClient,
    /// Deadline of making a connection.
    limit: Duration,
    current: RwLock<Current>,
    /// Held by the one caller making the next connection.
    remaking: tokio::sync::Mutex<()>,
    /// How many attempts to make a connection failed: a caller that waited on an attempt
    /// that failed answers with its failure instead of trying again at once (a cluster that
    /// does not answer costs each caller one connect deadline, not one per caller before it).
    failed: AtomicU64,
    on_event: OnceLock<OnEvent>,
    /// The failover check's state ([`ClusterLink::suspect`]).
    check: std::sync::Mutex<FailoverCheck>,
}

/// How often a link checks, at most, whether a master it may be stuck on was failed over.
#[cfg(feature = "cluster")]
const CHECK_EVERY: Duration = Duration::from_secs(1);

#[cfg(feature = "cluster")]
#[derive(Default)]
struct FailoverCheck {
    /// A check is under way.
    running: bool,
    /// When the last one started.
    last: Option<std::time::Instant>,
    /// The nodes failed over (`<id>@<config epoch>`: a node failed over again later, in a
    /// later epoch, is news) when the slot map was last made to be read again, and when.
    handled: HashSet<String>,
    nudged: Option<std::time::Instant>,
}

/// While a node stays failed over and commands keep timing out, the slot map is made to be
/// read again at most this often (the read after a failover may have come from a node that
/// had not learnt of the promotion yet).
#[cfg(feature = "cluster")]
const NUDGE_AGAIN_AFTER: Duration = Duration::from_secs(5);

/// The connection a [`Link`] sends on now.
#[cfg(feature = "cluster")]
struct Current {
    conn: ClusterConnection,
    /// Numbers the connections a link has had.
    generation: u64,
    /// Set off by the shutdown of the runtime the driver runs on ([`watch`]). Dropped (this
    /// connection replaced, or the link dropped), it is disarmed. `None` when no runtime could
    /// be found to run it.
    watch: Option<crate::util::RuntimeWatch>,
    /// A command found the driver gone before its watch task's end was seen.
    dead: AtomicBool,
}

#[cfg(feature = "cluster")]
impl Current {
    fn alive(&self) -> bool {
        !self.dead.load(Ordering::Relaxed) && !self.watch.as_ref().is_some_and(|w| w.is_gone())
    }
}

#[cfg(feature = "cluster")]
impl ClusterLink {
    /// Connects to the cluster `client` names, within `limit`.
    pub(super) async fn connect(
        client: ClusterClient,
        limit: Duration,
    ) -> Result<ClusterLink, crate::LockError> {
        let conn = match tokio::time::timeout(limit, client.get_async_connection()).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                return Err(crate::LockError::unavailable(
                    format!("redis cluster connect: {:?}", e.kind()),
                    Some(Box::new(e)),
                ))
            }
            Err(_) => {
                return Err(crate::LockError::unavailable(
                    format!("redis cluster: no node answered within {limit:?}"),
                    None,
                ))
            }
        };
        let shared = Arc::new_cyclic(|link| Link {
            client,
            limit,
            current: RwLock::new(Current {
                conn,
                generation: 0,
                watch: watch(link.clone(), 0),
                dead: AtomicBool::new(false),
            }),
            remaking: tokio::sync::Mutex::new(()),
            failed: AtomicU64::new(0),
            on_event: OnceLock::new(),
            check: Default::default(),
        });
        Ok(ClusterLink { shared, conn: None })
    }

    /// Sets what the link tells the backend (once; later calls are ignored).
    pub(super) fn on_event(&self, f: impl Fn(LinkEvent) + Send + Sync + 'static) {
        let _ = self.shared.on_event.set(Box::new(f));
    }

    /// Takes the current connection into this handle if it does not hold it yet (no await:
    /// the hot path). `false`: the current connection's driver is gone.
    fn refresh(&mut self) -> bool {
        let cur = self.shared.read();
        if !cur.alive() {
            return false;
        }
        if !matches!(self.conn, Some((_, g)) if g == cur.generation) {
            self.conn = Some((cur.conn.clone(), cur.generation));
        }
        true
    }

    /// The connection to send on: the current one, or, its driver gone, a new one made on
    /// this runtime.
    async fn ready(&mut self) -> RedisResult<&mut ClusterConnection> {
        if !self.refresh() {
            self.conn = Some(self.shared.remake().await?);
        }
        match &mut self.conn {
            Some((c, _)) => Ok(c),
            None => Err(gone_error()),
        }
    }

    /// A command on this link timed out: perhaps its slot's master froze (no reset, no close).
    /// redis-rs retries a timed-out command on the same node's connection, and reads the slot
    /// map again only when a node answers with a redirect or a connection drops, so it would
    /// keep sending that slot's commands to the frozen node after the cluster failed it over
    /// (`Unavailable` until it wakes, or the kernel gives up on the connection). So, in the
    /// background (one check at a time per link, at most one a [`CHECK_EVERY`]), a node is
    /// asked for the cluster's view (`CLUSTER NODES`); when it shows a node failed and serving
    /// no slots (failed over) that the last check did not — or still shows one, and the last
    /// such step is [`NUDGE_AGAIN_AFTER`] old — every live master is sent a command (routed by
    /// a slot of its own, as redis-rs's map knows it) for a slot it does not serve: one
    /// `MOVED` answer makes redis-rs read the slot map again (from the nodes that answer), and
    /// the failed master's slots go to its replica. A check costs up to three small commands;
    /// a failover, one more per master.
    pub(super) fn suspect(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        {
            let mut check = self
                .shared
                .check
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if check.running || check.last.is_some_and(|t| t.elapsed() < CHECK_EVERY) {
                return;
            }
            check.running = true;
            check.last = Some(std::time::Instant::now());
        }
        let link = ClusterLink {
            shared: self.shared.clone(),
            conn: None,
        };
        runtime.spawn(async move {
            /// Ends the check, also when its task is dropped with its runtime.
            struct Done(Arc<Link>);
            impl Drop for Done {
                fn drop(&mut self) {
                    let mut check = self.0.check.lock().unwrap_or_else(PoisonError::into_inner);
                    check.running = false;
                }
            }
            let _done = Done(link.shared.clone());
            link.check_failover().await;
        });
    }

    /// See [`suspect`](Self::suspect).
    async fn check_failover(self) {
        let limit = self.shared.limit;
        // A random node (a frozen one does not answer): three asked at once, the first answer.
        let asks = (0..3).map(|_| {
            let mut link = self.clone();
            Box::pin(async move {
                let cmd = redis::cmd("CLUSTER").arg("NODES").to_owned();
                let to = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
                match tokio::time::timeout(limit, link.route_command(cmd, to)).await {
                    Ok(Ok(v)) => value_text(v).ok_or(()),
                    _ => Err(()),
                }
            })
        });
        let Ok((view, _)) = futures_util::future::select_ok(asks).await else {
            return;
        };
        let view = ClusterView::parse(&view);
        let failed_over = view.failed_over();
        {
            let check = self
                .shared
                .check
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let stale = check
                .nudged
                .is_none_or(|t| t.elapsed() >= NUDGE_AGAIN_AFTER);
            let news = !failed_over.is_subset(&check.handled);
            if !(news || (stale && !failed_over.is_empty())) {
                return;
            }
        }
        // To each live master (by a slot of its own, as the client's slot map routes it: an
        // address from this view may not be one the client knows the node by), a command for
        // a slot another serves: a master the map is right about answers `MOVED`, and one
        // `MOVED` has the client read the slot map again. (One the map still routes to the
        // frozen node gets no answer, within the limit.)
        let nudges = view.nudges().into_iter().map(|(route, key)| {
            let mut link = self.clone();
            Box::pin(async move {
                let cmd = redis::cmd("EXISTS")
                    .arg(format!("{{{}}}", slot_tag(key)))
                    .to_owned();
                let to = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                    route,
                    SlotAddr::Master,
                )));
                match tokio::time::timeout(limit, link.route_command(cmd, to)).await {
                    Ok(Ok(_)) => Ok(()),
                    _ => Err(()),
                }
            })
        });
        if futures_util::future::select_ok(nudges).await.is_ok() {
            tracing::warn!("redis cluster: a master was failed over; the slot map is read again");
            let mut check = self
                .shared
                .check
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            check.handled = failed_over;
            check.nudged = Some(std::time::Instant::now());
        }
    }

    /// Whether the link's connection is live, as far as is known (its runtime has not shut
    /// down, no command found its driver gone).
    pub(super) fn is_alive(&self) -> bool {
        self.shared.read().alive()
    }

    /// Makes sure the link has a live connection (making one on this runtime if needed).
    pub(super) async fn connected(&mut self) -> RedisResult<()> {
        self.ready().await.map(|_| ())
    }

    /// Whether `e`, the failure of a command sent through this handle, says the command never
    /// left this process: the driver's queue was closed, so Redis never saw it and it may be
    /// sent again. The connection is then taken for gone, and the next command makes a new
    /// one. (A command whose answer was lost — "Unable to receive", a timeout — or a pipeline,
    /// which redis-rs fails with a bare broken pipe either way, may have run: `false`.)
    pub(super) fn never_sent(&mut self, e: &RedisError) -> bool {
        if !not_sent(e) {
            return false;
        }
        if let Some((_, generation)) = self.conn.take() {
            let cur = self.shared.read();
            if cur.generation == generation {
                cur.dead.store(true, Ordering::Relaxed);
            }
        }
        true
    }

    /// Sends `cmd` to `routing` (redis-rs's `ClusterConnection::route_command`), once more on
    /// a new connection if the first one's driver was gone before it was sent.
    pub(super) async fn route_command(
        &mut self,
        cmd: Cmd,
        routing: RoutingInfo,
    ) -> RedisResult<Value> {
        match self
            .ready()
            .await?
            .route_command(cmd.clone(), routing.clone())
            .await
        {
            Err(e) if self.never_sent(&e) => self.ready().await?.route_command(cmd, routing).await,
            r => r,
        }
    }

    /// `SSUBSCRIBE`, once more on a new connection if the driver was gone (subscribing twice
    /// is harmless, so a lost answer is retried too).
    pub(super) async fn ssubscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self.ready().await?.ssubscribe(channel).await {
            Err(e) if self.driver_lost(&e) => self.ready().await?.ssubscribe(channel).await,
            r => r,
        }
    }

    /// `SUNSUBSCRIBE`, like [`ssubscribe`](Self::ssubscribe).
    pub(super) async fn sunsubscribe(&mut self, channel: &str) -> RedisResult<()> {
        match self.ready().await?.sunsubscribe(channel).await {
            Err(e) if self.driver_lost(&e) => self.ready().await?.sunsubscribe(channel).await,
            r => r,
        }
    }

    /// Whether `e` is a broken pipe from a connection whose driver is gone (seen or not yet
    /// seen by its watch task): for commands that may run twice.
    fn driver_lost(&mut self, e: &RedisError) -> bool {
        if self.never_sent(e) {
            return true;
        }
        e.is_connection_dropped() && !self.refresh()
    }
}

/// The text of a reply (`CLUSTER NODES`: a bulk string, or a verbatim one over RESP3).
#[cfg(feature = "cluster")]
fn value_text(v: Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b).ok(),
        Value::VerbatimString { text, .. } => Some(text),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

/// What a `CLUSTER NODES` answer says, as far as the failover check needs it.
#[cfg(feature = "cluster")]
#[derive(Debug, Default, PartialEq, Eq)]
struct ClusterView {
    /// The nodes flagged failed (`fail`, agreed by the masters; not `fail?`) that serve no
    /// slots — failed over, or replicas — as `<id>@<config epoch>`.
    failed: Vec<String>,
    /// The live masters that serve slots: the first slot of each of their ranges.
    masters: Vec<Vec<u16>>,
}

#[cfg(feature = "cluster")]
impl ClusterView {
    /// Reads `CLUSTER NODES`: one node a line, `<id> <ip:port@cport[,hostname]> <flags>
    /// <master> <ping-sent> <pong-recv> <config-epoch> <link-state> [<slot> …]`.
    fn parse(text: &str) -> ClusterView {
        let mut view = ClusterView::default();
        for line in text.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [id, _, flags, _, _, _, epoch, _, slots @ ..] = &fields[..] else {
                continue;
            };
            let flags: Vec<&str> = flags.split(',').collect();
            let starts: Vec<u16> = slots
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| s.split('-').next()?.parse().ok())
                .collect();
            if flags.contains(&"fail") {
                if starts.is_empty() {
                    view.failed.push(format!("{id}@{epoch}"));
                }
                continue;
            }
            let down = ["fail?", "handshake", "noaddr"];
            let live = flags.contains(&"master") && !flags.iter().any(|f| down.contains(f));
            if live && !starts.is_empty() {
                view.masters.push(starts);
            }
        }
        view
    }

    fn failed_over(&self) -> HashSet<String> {
        self.failed.iter().cloned().collect()
    }

    /// Per live master, a slot of its own and one the next live master serves: a command for
    /// the second, routed by the first, reaches the first (where the client's map is right),
    /// which answers `MOVED`. None with fewer than two live masters.
    fn nudges(&self) -> Vec<(u16, u16)> {
        let n = self.masters.len();
        if n < 2 {
            return Vec::new();
        }
        (0..n)
            .map(|i| (self.masters[i][0], self.masters[(i + 1) % n][0]))
            .collect()
    }
}

/// Whether `e` is redis-rs's (1.8) error for a command its cluster driver's queue refused
/// ("redis_cluster: Unable to send command", a broken pipe): the driver is gone, and the command
/// was never sent. Its error for an answer that never came ("Unable to receive command") and
/// its pipelines' bare broken pipe are not.
#[cfg(feature = "cluster")]
fn not_sent(e: &RedisError) -> bool {
    e.is_io_error() && e.to_string().contains("Unable to send command")
}

#[cfg(feature = "cluster")]
fn gone_error() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "redis cluster: the connection's runtime is gone",
    ))
}

#[cfg(feature = "cluster")]
impl Link {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Current> {
        self.current.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new connection, made on this runtime, in place of one whose driver is gone; the
    /// current one if another caller made it meanwhile, or that caller's failure.
    async fn remake(self: &Arc<Self>) -> RedisResult<(ClusterConnection, u64)> {
        let failed = self.failed.load(Ordering::Acquire);
        let _one = self.remaking.lock().await;
        {
            let cur = self.read();
            if cur.alive() {
                return Ok((cur.conn.clone(), cur.generation));
            }
        }
        if self.failed.load(Ordering::Acquire) != failed {
            return Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "redis cluster: no node answered the reconnect",
            )));
        }
        let conn = match tokio::time::timeout(self.limit, self.client.get_async_connection()).await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                self.failed.fetch_add(1, Ordering::AcqRel);
                return Err(e);
            }
            Err(_) => {
                self.failed.fetch_add(1, Ordering::AcqRel);
                return Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("redis cluster: no node answered within {:?}", self.limit),
                )));
            }
        };
        // Only this caller changes the generation (it holds `remaking`). The watch is spawned
        // before the write lock is taken: on a runtime shutting down, it is dropped at once,
        // and its drop reads `current`.
        let generation = self.read().generation + 1;
        let next = Current {
            conn: conn.clone(),
            generation,
            watch: watch(Arc::downgrade(self), generation),
            dead: AtomicBool::new(false),
        };
        let old = std::mem::replace(
            &mut *self.current.write().unwrap_or_else(PoisonError::into_inner),
            next,
        );
        drop(old);
        tracing::debug!("redis cluster connection made anew: its runtime had shut down");
        if let Some(f) = self.on_event.get() {
            f(LinkEvent::Remade);
        }
        Ok((conn, generation))
    }
}

/// Watches the runtime the driver of connection `generation` of `link` was just spawned on
/// ([`crate::util::on_runtime_shutdown`]): when it shuts down, the driver goes with it — the
/// connection is marked dead (if still current) and the backend told. Without a runtime
/// (redis-rs could not have spawned its driver either), `None`: the connection is taken for
/// alive until a command finds it gone.
#[cfg(feature = "cluster")]
fn watch(link: Weak<Link>, generation: u64) -> Option<crate::util::RuntimeWatch> {
    crate::util::on_runtime_shutdown(move || {
        let Some(link) = link.upgrade() else {
            return;
        };
        {
            let cur = link.read();
            if cur.generation != generation {
                return;
            }
            cur.dead.store(true, Ordering::Relaxed);
        }
        tracing::debug!("redis cluster connection gone with its runtime; made anew on next use");
        if let Some(f) = link.on_event.get() {
            f(LinkEvent::Gone);
        }
    })
}

/// Whether `cmd` is `SCRIPT LOAD`.
#[cfg(feature = "cluster")]
fn is_script_load(cmd: &Cmd) -> bool {
    let mut args = simple_args(cmd);
    args.next()
        .is_some_and(|a| a.eq_ignore_ascii_case(b"SCRIPT"))
        && args.next().is_some_and(|a| a.eq_ignore_ascii_case(b"LOAD"))
}

#[cfg(feature = "cluster")]
fn simple_args(cmd: &Cmd) -> impl Iterator<Item = &[u8]> {
    cmd.args_iter().map(|a| match a {
        redis::Arg::Simple(a) => a,
        _ => b"",
    })
}

/// Whether a reply says `NOSCRIPT` (redis-rs hands a server's error over as a value).
#[cfg(feature = "cluster")]
fn is_noscript(v: &Value) -> bool {
    matches!(v, Value::ServerError(e) if e.kind() == Some(redis::ServerErrorKind::NoScript))
}

/// `cmd`, a script call (`EVALSHA <sha> …`) of a script made by [`script`], as `EVAL <its
/// text> …`.
#[cfg(feature = "cluster")]
fn with_body(cmd: &Cmd) -> Option<Cmd> {
    let mut args = simple_args(cmd);
    if !args.next()?.eq_ignore_ascii_case(b"EVALSHA") {
        return None;
    }
    let mut eval = redis::cmd("EVAL");
    eval.arg(&*script_body(std::str::from_utf8(args.next()?).ok()?)?);
    for a in args {
        eval.arg(a);
    }
    Some(eval)
}

#[cfg(feature = "cluster")]
impl ConnectionLike for ClusterLink {
    /// A script call that finds its script missing on its node (`NOSCRIPT`: the script's
    /// first use there, or its first after a failover, a restart or `SCRIPT FLUSH`) is sent
    /// once more with the script's text (`EVAL`), which also caches it there. redis-rs
    /// instead sends `SCRIPT LOAD` to every node, replicas too, and fails it unless all answer:
    /// one node that did not (a frozen or cut-off replica, another shard's master dead and not
    /// yet failed over) failed every lock, on any shard, whose master had to load a script.
    /// `EVAL` is routed like the call, redirects included (a slot being resharded: the node
    /// that answered `NOSCRIPT` may be the slot's next master). A `SCRIPT LOAD` still sent (a
    /// script not made by [`script`]) goes to the masters only: scripts run nowhere else.
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        if is_script_load(cmd) {
            use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy};
            let to = RoutingInfo::MultiNode((
                MultipleNodeRoutingInfo::AllMasters,
                Some(ResponsePolicy::AllSucceeded),
            ));
            return Box::pin(async move { self.route_command(cmd.clone(), to).await });
        }
        let live = self.refresh();
        Box::pin(async move {
            let r = match (&mut self.conn, live) {
                (Some((c, _)), true) => c.req_packed_command(cmd).await,
                (None, true) => Err(gone_error()),
                (_, false) => self.ready().await?.req_packed_command(cmd).await,
            };
            match r {
                Ok(v) if is_noscript(&v) => match with_body(cmd) {
                    Some(eval) => self.ready().await?.req_packed_command(&eval).await,
                    None => Ok(v),
                },
                r => r,
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        if !self.refresh() {
            return Box::pin(async move {
                self.ready()
                    .await?
                    .req_packed_commands(pipeline, offset, count)
                    .await
            });
        }
        match &mut self.conn {
            Some((c, _)) => c.req_packed_commands(pipeline, offset, count),
            None => Box::pin(async { Err(gone_error()) }),
        }
    }

    fn get_db(&self) -> i64 {
        0
    }
}

/// The cluster slot of a lock: CRC16 (XMODEM) of its hash tag — the encoded key, which holds no
/// braces — modulo 16384, as Redis Cluster computes it.
#[cfg(feature = "cluster")]
pub(super) fn slot(tag: &str) -> u16 {
    let mut crc: u16 = 0;
    for &b in tag.as_bytes() {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// For every slot, a short hash tag that falls into it (`f<n>`): a cluster keeps one fencing
/// counter per slot, `<prefix>:{<tag>}:fence`, which its scripts can reach beside any lock of
/// the slot. The counter moves with its slot when the slot is resharded.
#[cfg(feature = "cluster")]
pub(super) fn slot_tag(of: u16) -> &'static str {
    use std::sync::LazyLock;
    static TAGS: LazyLock<Vec<String>> = LazyLock::new(|| {
        let mut tags = vec![String::new(); 16384];
        let mut missing = 16384usize;
        let mut n = 0u32;
        while missing > 0 {
            let tag = format!("f{n}");
            let t = &mut tags[usize::from(slot(&tag))];
            if t.is_empty() {
                *t = tag;
                missing -= 1;
            }
            n += 1;
        }
        tags
    });
    &TAGS[usize::from(of)]
}

#[cfg(all(test, feature = "cluster"))]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls_keep_credentials_and_scheme_per_node() {
        assert_eq!(
            cluster_urls("redis+cluster://u:p@a:1,b:2/").unwrap(),
            vec!["redis://u:p@a:1", "redis://u:p@b:2"]
        );
        assert_eq!(
            cluster_urls("rediss+cluster://a:1").unwrap(),
            vec!["rediss://a:1"]
        );
        assert!(cluster_urls("redis+cluster://").is_err());
    }

    #[test]
    fn a_script_call_is_resent_with_its_text_and_its_arguments() {
        let text = "return {KEYS[1], ARGV[1], 'with_body test'}";
        let s = script(text);
        let mut call = script_call(&s, false);
        call.arg(1).arg("k").arg("a");
        let packed = |c: &Cmd| String::from_utf8(c.get_packed_command()).unwrap();
        let mut expected = redis::cmd("EVAL");
        expected.arg(text).arg(1).arg("k").arg("a");
        assert_eq!(packed(&with_body(&call).unwrap()), packed(&expected));
        let mut pipelined = script_call(&s, true);
        pipelined.arg(1).arg("k").arg("a");
        assert_eq!(packed(&pipelined), packed(&expected));
        // Not a script call, or a script not made by `script`: left to redis-rs.
        assert!(with_body(redis::cmd("GET").arg("k")).is_none());
        let mut unknown = redis::cmd("EVALSHA");
        unknown.arg("0".repeat(40)).arg(0);
        assert!(with_body(&unknown).is_none());
    }

    #[test]
    fn only_a_command_the_driver_refused_counts_as_never_sent() {
        let io = |kind, text: &str| RedisError::from(std::io::Error::new(kind, text.to_owned()));
        let pipe = std::io::ErrorKind::BrokenPipe;
        // redis-rs 1.8's own texts (`cluster_async::ClusterConnection::route_command`).
        assert!(not_sent(&io(pipe, "redis_cluster: Unable to send command")));
        assert!(!not_sent(&io(
            pipe,
            "redis_cluster: Unable to receive command"
        )));
        // A pipeline's, either way.
        assert!(!not_sent(&RedisError::from(std::io::Error::from(pipe))));
    }

    #[test]
    fn slots_match_redis_and_every_slot_has_a_tag() {
        // Values from the Redis Cluster specification's reference implementation.
        assert_eq!(slot("123456789"), 0x31C3); // the CRC16 check value, below 16384
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("user:1000"), 1649);
        for s in [0u16, 1, 8000, 16383] {
            assert_eq!(slot(slot_tag(s)), s);
        }
    }

    /// The failover check reads `CLUSTER NODES` (the format of its documentation, host names
    /// included): a master flagged `fail` that serves no slots was failed over; one only
    /// suspected (`fail?`), or still serving its slots (the failover not done), was not; the
    /// command that makes the client read the slot map again goes to each live master (routed
    /// by a slot of its own), for a slot another serves.
    #[test]
    fn the_failover_check_reads_the_cluster_view() {
        let nodes = "\
07c3 127.0.0.1:30004@31004,h4 slave e7d1 0 1426238317239 4 connected
67ed 127.0.0.1:30002@31002,h2 master - 0 1426238316232 2 connected 5461-10922
292f 127.0.0.1:30003@31003 master,fail? - 0 1426238318243 3 connected 10923-16383
aaaa 127.0.0.1:30001@31001 master,fail - 1426238316232 1426238316232 1 disconnected
e7d1 127.0.0.1:30007@31007 myself,master - 0 0 7 connected 0-100 [101->-67ed] 102-5460
bbbb 127.0.0.1:30009@31009 master,fail - 0 0 9 disconnected 16000
";
        let view = ClusterView::parse(nodes);
        assert_eq!(view.failed, ["aaaa@1"]);
        assert_eq!(view.masters, [vec![5461], vec![0, 102]]);
        assert_eq!(view.nudges(), [(5461, 0), (0, 5461)]);
        assert!(ClusterView::parse("").nudges().is_empty());
    }
}
