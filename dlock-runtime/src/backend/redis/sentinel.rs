//! Redis behind Sentinel (feature `sentinel`): the master is found through the sentinels
//! (redis-rs's `Sentinel`, which asks them and checks that the node it names calls itself a
//! master), and a failover is followed.
//!
//! The connection to the master is a redis-rs `ConnectionManager`, as on one server. A command
//! that fails the way a failover makes commands fail — the connection is refused, dropped or
//! times out, or the node answers `READONLY` (a demoted master) or `MASTERDOWN` — starts one
//! background check (never more than one at a time): ask the sentinels for the master again;
//! if they name another node, connect to it, subscribe there to every release channel this
//! connection had, switch, and wake the local waiters to re-check (releases published during
//! the failover never reached them). The failing command itself is reported as unavailable
//! (503): the caller's next attempt goes to the new master. While the sentinels still name the
//! same node, the check retries with backoff until that node answers again or a limit passes.
//!
//! Each master the connection follows is given an issuer number of its own (`INCR
//! dlock:issuers` on it, distinct from the numbers of the masters before), and every reply and
//! push is tagged with the number of the master it came from (see `super::Issuer`). A master
//! frozen through a failover and woken before it learns it was demoted can still grant locks
//! from a fencing counter the new master also reaches; tokens from the two carry different
//! issuer numbers, so no two grants to this backend share a token.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use redis::{
    Client, Cmd, IntoConnectionInfo, Pipeline, ProtocolVersion, PushInfo, RedisError, RedisFuture,
    RedisResult, Value,
};

use crate::backend::ReleaseHub;
use crate::LockError;

/// How long a failover check keeps asking the sentinels while they name a master that does not
/// answer (the next failing command starts another).
const CHECK_FOR: Duration = Duration::from_secs(60);

/// A push handler shared by every connection this backend makes to a master; it is told the
/// issuer number of the master the push came from.
pub(super) type PushFn = Arc<dyn Fn(PushInfo, super::Issuer) + Send + Sync>;

/// How many of the issuer numbers of earlier masters a connection keeps clear of.
const ISSUERS_KEPT: usize = 64;

/// The parts of a `redis+sentinel://[user:pass@]s1:p1,s2:p2/<master>[/<db>]` URL
/// (`rediss+sentinel://` for TLS to the sentinels and the servers).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SentinelUrl {
    /// One `redis://host:port` (or `rediss://`) URL per sentinel.
    pub(crate) sentinels: Vec<String>,
    /// The name the sentinels monitor the master under.
    pub(crate) master: String,
    /// `redis://[user:pass@]host/<db>` (or `rediss://`): the credentials and database for the
    /// master and its replicas. Its host is a placeholder; the sentinels name the real one.
    pub(crate) server: String,
}

impl SentinelUrl {
    /// Parses a `redis+sentinel://` or `rediss+sentinel://` URL.
    pub(crate) fn parse(url: &str) -> Result<Self, LockError> {
        let bad = || {
            LockError::unavailable(
                "invalid redis sentinel url: expected redis+sentinel://[user:pass@]host:port,host:port/<master-name>[/<db>]",
                None,
            )
        };
        let (scheme, rest) = url.split_once("://").ok_or_else(bad)?;
        let scheme = match scheme {
            "redis+sentinel" => "redis",
            "rediss+sentinel" => "rediss",
            _ => return Err(bad()),
        };
        let (auth, hosts, path) = super::conn::split_hosts(rest);
        let path = path.ok_or_else(bad)?;
        let mut path = path.split('/').filter(|p| !p.is_empty());
        let master = path.next().ok_or_else(bad)?.to_owned();
        let db = match path.next() {
            Some(db) => db.parse::<u32>().map_err(|_| bad())?,
            None => 0,
        };
        if path.next().is_some() {
            return Err(bad());
        }
        // The credentials are the servers': the sentinels are reached without.
        let sentinels = super::conn::node_urls(scheme, "", hosts);
        if sentinels.is_empty() {
            return Err(bad());
        }
        Ok(SentinelUrl {
            sentinels,
            master,
            server: format!("{scheme}://{auth}localhost/{db}"),
        })
    }
}

/// A connection to the current master of a Sentinel-monitored group. Cheap to clone.
#[derive(Clone)]
pub(crate) struct SentinelConn {
    shared: Arc<Shared>,
    /// The issuer number of the master the last reply on this handle came from.
    replied: Option<u64>,
}

struct Shared {
    master_name: String,
    node: SentinelNodeConnectionInfo,
    sentinel: Arc<tokio::sync::Mutex<Sentinel>>,
    current: RwLock<Current>,
    /// The settings of a connection to a master, without the push handler.
    config: ConnectionManagerConfig,
    /// Where pushes go, told the master's issuer number (none for dedicated connections,
    /// which carry no grants and take no issuer numbers).
    push: Option<PushFn>,
    /// The issuer numbers of the masters followed so far, the latest last.
    issuers: Mutex<Vec<u64>>,
    /// The release channels subscribed through this connection (re-subscribed on a switch).
    channels: Mutex<HashSet<String>>,
    /// A failover check is under way.
    checking: AtomicBool,
    /// Where the local waiters are woken after a switch (none for dedicated connections).
    hub: Option<Weak<ReleaseHub>>,
    connect_timeout: Duration,
    command_timeout: Duration,
}

#[derive(Clone)]
struct Current {
    conn: ConnectionManager,
    /// How to reach the master (for dedicated connections).
    client: Client,
    /// The master's address, as the sentinels named it (`host:port`).
    addr: String,
    /// The issuer number taken on this master (see the module docs).
    issuer: u64,
}

impl SentinelConn {
    /// Asks the sentinels named by `url` for the master and connects to it. Pushes (release
    /// notifications) go to `push`, and the waiters in `hub` are woken after a failover.
    pub(crate) async fn connect(
        url: &SentinelUrl,
        connect_timeout: Duration,
        command_timeout: Duration,
        push: Option<PushFn>,
        hub: Option<Weak<ReleaseHub>>,
    ) -> Result<Self, LockError> {
        // The URL may carry a password: never put it in an error message.
        let invalid = |e: RedisError| {
            LockError::unavailable(format!("invalid redis sentinel url: {:?}", e.kind()), None)
        };
        let server = url
            .server
            .as_str()
            .into_connection_info()
            .map_err(invalid)?;
        let settings = server
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let mut node = SentinelNodeConnectionInfo::default().set_redis_connection_info(settings);
        if url.server.starts_with("rediss://") {
            node = node.set_tls_mode(redis::TlsMode::Secure);
        }
        let sentinel = Sentinel::build(url.sentinels.clone()).map_err(invalid)?;
        let config = manager_config(connect_timeout, command_timeout);
        let mut sentinel = sentinel;
        let limit = connect_timeout + command_timeout;
        let client = lookup(&mut sentinel, &url.master, &node, limit).await?;
        let (mut conn, cell) = connect_to(&client, &config, push.as_ref())?;
        let issuer = super::take_issuer(&mut conn, limit, &[]).await?;
        cell.store(issuer, Ordering::Release);
        let current = Current {
            addr: client.get_connection_info().addr().to_string(),
            conn,
            client,
            issuer,
        };
        Ok(SentinelConn {
            replied: None,
            shared: Arc::new(Shared {
                master_name: url.master.clone(),
                node,
                sentinel: Arc::new(tokio::sync::Mutex::new(sentinel)),
                current: RwLock::new(current),
                config,
                push,
                issuers: Mutex::new(vec![issuer]),
                channels: Mutex::new(HashSet::new()),
                checking: AtomicBool::new(false),
                hub,
                connect_timeout,
                command_timeout,
            }),
        })
    }

    /// Another connection to the same master, with no push handler: for commands that block
    /// their connection (`WAIT`). It shares the look-up through the sentinels and follows a
    /// failover on its own.
    pub(crate) fn dedicated(&self) -> Result<Self, LockError> {
        let s = &self.shared;
        let current = s.current();
        let config = manager_config(s.connect_timeout, s.command_timeout);
        Ok(SentinelConn {
            replied: None,
            shared: Arc::new(Shared {
                master_name: s.master_name.clone(),
                node: s.node.clone(),
                sentinel: s.sentinel.clone(),
                current: RwLock::new(Current {
                    conn: ConnectionManager::new_lazy_with_config(
                        current.client.clone(),
                        config.clone(),
                    )
                    .map_err(|e| super::redis_err("connect", e))?,
                    ..current
                }),
                config,
                push: None,
                issuers: Mutex::new(Vec::new()),
                channels: Mutex::new(HashSet::new()),
                checking: AtomicBool::new(false),
                hub: None,
                connect_timeout: s.connect_timeout,
                command_timeout: s.command_timeout,
            }),
        })
    }

    /// Subscribes to a release channel on the current master (and remembers it for the next).
    pub(super) async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        self.shared
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(channel.to_owned());
        let r = self.shared.current().conn.subscribe(channel).await;
        self.shared.after(&r);
        r
    }

    /// The reverse of [`subscribe`](SentinelConn::subscribe). The channel is forgotten only
    /// once the master confirmed: the backend counts a channel whose unsubscribe failed (a
    /// master down) as still subscribed and never subscribes it again, so the next master must
    /// get it too. (A channel forgotten here but not there left the lock's waiters without
    /// notifications after every failover: they ran on their fallback timers.)
    pub(super) async fn unsubscribe(&mut self, channel: &str) -> RedisResult<()> {
        let r = self.shared.current().conn.unsubscribe(channel).await;
        if r.is_ok() {
            self.shared
                .channels
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(channel);
        }
        self.shared.after(&r);
        r
    }

    /// The master's address now (`host:port`), as the sentinels named it.
    pub(crate) fn master_addr(&self) -> String {
        self.shared.current().addr
    }

    /// The issuer number of the master now (see the module docs).
    pub(crate) fn issuer(&self) -> u64 {
        self.shared.current().issuer
    }

    /// The issuer number of the master the last reply on this handle came from.
    pub(super) fn replied_issuer(&self) -> super::Issuer {
        self.replied
    }
}

/// A connection to the master `client` names, whose pushes go to `push` tagged with the
/// number in the returned cell (stored once taken: before that the connection has subscribed
/// to nothing, so no push can grant a lock).
fn connect_to(
    client: &Client,
    config: &ConnectionManagerConfig,
    push: Option<&PushFn>,
) -> Result<(ConnectionManager, Arc<AtomicU64>), LockError> {
    let cell = Arc::new(AtomicU64::new(u64::MAX));
    let mut config = config.clone();
    if let Some(push) = push {
        let push = push.clone();
        let issuer = cell.clone();
        config = config
            .set_push_sender(move |p: PushInfo| {
                let issuer = issuer.load(Ordering::Acquire);
                push(p, (issuer != u64::MAX).then_some(issuer));
                Ok::<(), redis::aio::SendError>(())
            })
            .set_automatic_resubscription();
    }
    let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)
        .map_err(|e| super::redis_err("connect", e))?;
    Ok((conn, cell))
}

/// The settings of a connection to a master: the backend's timeouts, two retries.
fn manager_config(connect_timeout: Duration, command_timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect_timeout))
        .set_response_timeout(Some(command_timeout))
        .set_number_of_retries(2)
        .set_max_delay(connect_timeout)
}

/// Asks the sentinels for the master of `name`, within `limit`.
async fn lookup(
    sentinel: &mut Sentinel,
    name: &str,
    node: &SentinelNodeConnectionInfo,
    limit: Duration,
) -> Result<Client, LockError> {
    match tokio::time::timeout(limit, sentinel.async_master_for(name, Some(node))).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(super::redis_err("sentinel: find the master", e)),
        Err(_) => Err(LockError::unavailable(
            format!("redis sentinel: no sentinel named a live master within {limit:?}"),
            None,
        )),
    }
}

/// Whether `e` is how commands fail while a master fails over.
fn failover_like(e: &RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
        )
        // A script that writes on a demoted master fails with READONLY inside its error.
        || e.to_string().contains("READONLY")
}

/// Whether a reply is a demoted (or cut-off) master's refusal.
fn demoted_reply(v: &Value) -> bool {
    use redis::ServerErrorKind;
    match v {
        Value::ServerError(e) => {
            matches!(
                e.kind(),
                Some(ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown)
            ) || e.code() == "READONLY"
                || e.details().is_some_and(|d| d.contains("READONLY"))
        }
        _ => false,
    }
}

/// The replies of a command or a pipeline, for [`Shared::after`].
trait Replies {
    fn any(&self, f: fn(&Value) -> bool) -> bool;
}

impl Replies for () {
    fn any(&self, _: fn(&Value) -> bool) -> bool {
        false
    }
}

impl Replies for Value {
    fn any(&self, f: fn(&Value) -> bool) -> bool {
        f(self)
    }
}

impl Replies for Vec<Value> {
    fn any(&self, f: fn(&Value) -> bool) -> bool {
        self.iter().any(f)
    }
}

impl Shared {
    fn current(&self) -> Current {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Starts a failover check after a command failed the way a failover makes it fail: an
    /// error of the connection, or a reply that is one of the errors a demoted master gives
    /// (redis-rs hands server errors back as replies, `Value::ServerError`, and a master that
    /// was frozen, failed over and woken as a replica keeps the connection up and answers every
    /// write with `READONLY`).
    fn after<T: Replies>(self: &Arc<Self>, r: &RedisResult<T>) {
        let failed = match r {
            Err(e) => failover_like(e),
            Ok(replies) => replies.any(demoted_reply),
        };
        if !failed || self.checking.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(check(Arc::downgrade(self)));
            }
            Err(_) => self.checking.store(false, Ordering::Release),
        }
    }

    /// Connects to the master `client` names, re-subscribes there, switches to it and wakes the
    /// local waiters.
    async fn switch_to(&self, client: Client) -> Result<(), LockError> {
        let addr = client.get_connection_info().addr().to_string();
        let (mut conn, cell) = connect_to(&client, &self.config, self.push.as_ref())?;
        let issuer = if self.push.is_some() {
            let avoid = self
                .issuers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            let issuer = super::take_issuer(&mut conn, self.command_timeout, &avoid).await?;
            cell.store(issuer, Ordering::Release);
            issuer
        } else {
            self.current().issuer
        };
        let channels: Vec<String> = self
            .channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect();
        for channel in &channels {
            tokio::time::timeout(self.command_timeout, conn.subscribe(channel))
                .await
                .map_err(|_| LockError::unavailable("redis subscribe timed out", None))?
                .map_err(|e| super::redis_err("subscribe", e))?;
        }
        let old = std::mem::replace(
            &mut *self.current.write().unwrap_or_else(PoisonError::into_inner),
            Current {
                conn,
                client,
                addr: addr.clone(),
                issuer,
            },
        );
        if self.push.is_some() {
            let mut issuers = self.issuers.lock().unwrap_or_else(PoisonError::into_inner);
            issuers.push(issuer);
            if issuers.len() > ISSUERS_KEPT {
                issuers.remove(0);
            }
        }
        tracing::warn!(from = %old.addr, to = %addr, "redis sentinel: following the master");
        if let Some(hub) = self.hub.as_ref().and_then(Weak::upgrade) {
            hub.notify_all();
        }
        Ok(())
    }
}

/// The failover check (see the module docs).
async fn check(shared: Weak<Shared>) {
    let mut pause = Duration::from_millis(50);
    let started = tokio::time::Instant::now();
    loop {
        let Some(s) = shared.upgrade() else { return };
        let found = {
            let mut sentinel = s.sentinel.lock().await;
            let limit = s.connect_timeout + s.command_timeout;
            lookup(&mut sentinel, &s.master_name, &s.node, limit).await
        };
        let current = s.current();
        let done = match found {
            Ok(client) if client.get_connection_info().addr().to_string() != current.addr => {
                match s.switch_to(client).await {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::debug!(error = %e, "redis sentinel: the new master did not answer yet");
                        false
                    }
                }
            }
            // The same master: done once it answers.
            Ok(_) => {
                let mut conn = current.conn.clone();
                let ping = redis::cmd("PING");
                matches!(
                    tokio::time::timeout(s.command_timeout, ping.query_async::<()>(&mut conn))
                        .await,
                    Ok(Ok(()))
                )
            }
            Err(e) => {
                tracing::debug!(error = %e, "redis sentinel: look-up failed");
                false
            }
        };
        if done || started.elapsed() >= CHECK_FOR {
            s.checking.store(false, Ordering::Release);
            return;
        }
        // Ask again soon: the caller's next attempt should find the new master well within one
        // command timeout of the sentinels' switch (one look-up: a few round trips).
        let most =
            (s.command_timeout / 5).clamp(Duration::from_millis(10), Duration::from_millis(200));
        drop(s);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(most);
    }
}

impl ConnectionLike for SentinelConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let Current {
            mut conn, issuer, ..
        } = self.shared.current();
        Box::pin(async move {
            let r = conn.req_packed_command(cmd).await;
            self.replied = Some(issuer);
            self.shared.after(&r);
            r
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let Current {
            mut conn, issuer, ..
        } = self.shared.current();
        Box::pin(async move {
            let r = conn.req_packed_commands(pipeline, offset, count).await;
            self.replied = Some(issuer);
            self.shared.after(&r);
            r
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.current().conn.get_db()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_the_sentinels_the_master_and_the_servers_credentials() {
        assert_eq!(
            SentinelUrl::parse("redis+sentinel://u:p@a:1,b:2/mymaster/3").unwrap(),
            SentinelUrl {
                sentinels: vec!["redis://a:1".into(), "redis://b:2".into()],
                master: "mymaster".into(),
                server: "redis://u:p@localhost/3".into(),
            }
        );
        let tls = SentinelUrl::parse("rediss+sentinel://a:1/m").unwrap();
        assert_eq!(tls.sentinels, vec!["rediss://a:1"]);
        assert_eq!(tls.server, "rediss://localhost/0");
        for bad in [
            "redis+sentinel://a:1",
            "redis+sentinel://a:1/",
            "redis+sentinel:///m",
            "redis+sentinel://a:1/m/x",
            "redis+sentinel://a:1/m/0/extra",
            "redis://a:1/m",
        ] {
            let e = SentinelUrl::parse(bad).unwrap_err();
            assert!(e.is_unavailable(), "{bad}: {e}");
        }
        // A password never reaches the error.
        let e = SentinelUrl::parse("redis+sentinel://u:secret@a:1").unwrap_err();
        assert!(!e.to_string().contains("secret"));
    }
}
