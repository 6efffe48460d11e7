//! Redis behind Sentinel (feature `sentinel`): the master is found through the sentinels, and a
//! failover is followed.
//!
//! **Finding the master.** Every sentinel is asked (`SENTINEL MASTER <name>`, all at once), and
//! the master named under the latest configuration epoch wins: a sentinel that has not heard of
//! a failover yet still names the old master, under an older epoch, and believing the first
//! sentinel that answers (as redis-rs's `Sentinel` does) followed it back to the old master. A
//! node is used only once it says it is a master (`ROLE`). Nor does a check go back to an older
//! epoch than the one followed last: when only a sentinel that missed the failover answers (the
//! others partitioned away, with the old master on its side still taking writes), its view
//! names the old master — followed, this connection took locks there beside the new master's
//! holders. Such a view is followed only when a majority of the sentinels give it (sentinels
//! deployed anew, whose epochs start over).
//!
//! **Following a failover.** The connection to the master is a redis-rs `ConnectionManager`, as on
//! one server. Two things start a failover check (never more than one at a time per connection; one
//! asked for while one runs makes it look again before it ends): a sentinel announcing a failover
//! of this master (`+promoted-slave`, `+switch-master`, to which this backend subscribes on a
//! connection of its own to every sentinel), and a command failing the way a failover makes
//! commands fail — the connection is refused, dropped or times out, or the node answers `READONLY`
//! (a demoted master) or `MASTERDOWN`. The check asks the sentinels for the master again; if they
//! name another node, it connects to it, subscribes there to every release channel this connection
//! had (those whose subscribe the master confirmed and no unsubscribe followed, answered or not,
//! and those being subscribed), switches, and wakes the local waiters to re-check (releases
//! published during the failover never reached them). The failing command itself is reported as
//! unavailable (503): the caller's next attempt goes to the new master. While the sentinels still
//! name the same node, the check retries with backoff until that node answers again or a limit
//! passes; an announcement cuts that wait short (a killed master restarted at once comes back empty
//! at the same address, and the connection, which reconnects by itself, would otherwise have stayed
//! there until the wait ended). A `PING` that gets no answer at all may mean this connection went
//! silent (a partition, a load balancer or NAT that forgot it: no reset, no close, and the manager
//! reconnects only on those) while the master serves: the check then makes a new connection to the
//! same master and switches to it if the master answers there, as it would to a new master.
//!
//! The announcement matters because a failover does not always break the old master's
//! connections: after `SENTINEL FAILOVER`, or when a master frozen past the down-after time
//! wakes, or when a killed master is restarted before the sentinels reconfigure it, the old
//! master says it is a master and takes writes for many seconds (Sentinel demotes a returning
//! master only after several of its INFO periods). A connection that waited for an error kept
//! granting locks there beside the new master's holders. A sentinel connection that drops or
//! comes back also starts a check (an announcement may have been missed), and each is probed
//! every [`KEEPALIVE`] so one that comes back is subscribed again. A sentinel connection whose
//! probe gets no answer in time may have gone silent, which its manager never notices: it is
//! replaced by a new one (subscribed at the next probe), so the sentinels are heard, and asked
//! for the master, again.
//!
//! Each master the connection follows is given an issuer number of its own (`INCR
//! dlock:issuers` on it, distinct from the numbers of the masters before), and every reply and
//! push is tagged with the number of the master it came from (see `super::Issuer`). A master
//! frozen through a failover and woken before it learns it was demoted can still grant locks
//! from a fencing counter the new master also reaches; tokens from the two carry different
//! issuer numbers, so no two grants to this backend share a token.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock, Weak};
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{
    Client, Cmd, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, Pipeline, ProtocolVersion,
    PushInfo, PushKind, RedisError, RedisFuture, RedisResult, Value,
};

use crate::backend::ReleaseHub;
use crate::util::RuntimeWatch;
use crate::LockError;

/// How long a failover check keeps asking the sentinels while they name a master that does not
/// answer (the next failing command starts another).
const CHECK_FOR: Duration = Duration::from_secs(60);

/// How often each sentinel connection is probed (and, if it is down, subscribed again).
const KEEPALIVE: Duration = Duration::from_secs(1);

/// The events a sentinel announces a failover's outcome with: a replica it promoted now says it
/// is a master (from then on the sentinel names it), and the switch of its configuration to it.
const ANNOUNCEMENTS: [&str; 2] = ["+promoted-slave", "+switch-master"];

/// A push handler shared by every connection this backend makes to a master; it is told the
/// issuer number of the master the push came from.
pub(super) type PushFn = Arc<dyn Fn(PushInfo, super::Issuer, bool) + Send + Sync>;

/// Where a switch hands the channels it subscribed on the new master whose last waiter left
/// meanwhile (see [`Switched`]).
pub(super) type StrayFn = Box<dyn Fn(Vec<String>) + Send + Sync>;

/// How many of the issuer numbers of earlier masters a connection keeps clear of.
const ISSUERS_KEPT: usize = 64;

/// The parts of a
/// `redis+sentinel://[user:pass@]s1:p1,s2:p2/<master>[/<db>][?sentinel_username=…&sentinel_password=…]`
/// URL (`rediss+sentinel://` for TLS to the sentinels and the servers).
#[derive(PartialEq, Eq)]
pub(crate) struct SentinelUrl {
    /// One `redis://host:port` (or `rediss://`) URL per sentinel.
    pub(crate) sentinels: Vec<String>,
    /// The name the sentinels monitor the master under.
    pub(crate) master: String,
    /// `redis://[user:pass@]host/<db>` (or `rediss://`): the credentials and database for the
    /// master and its replicas. Its host is a placeholder; the sentinels name the real one.
    pub(crate) server: String,
    /// The sentinels' own user and password (`sentinel_username`, `sentinel_password`,
    /// percent-decoded): a sentinel with `requirepass` or ACL users of its own. Without them
    /// the sentinels are reached without signing in.
    pub(crate) sentinel_auth: Option<(Option<String>, String)>,
}

/// Shows no credentials (the data nodes' are in `server`).
impl std::fmt::Debug for SentinelUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelUrl")
            .field("sentinels", &self.sentinels)
            .field("master", &self.master)
            .field("sentinel_auth", &self.sentinel_auth.is_some())
            .finish_non_exhaustive()
    }
}

impl SentinelUrl {
    /// Parses a `redis+sentinel://` or `rediss+sentinel://` URL.
    pub(crate) fn parse(url: &str) -> Result<Self, LockError> {
        let bad = || {
            LockError::misconfigured(
                "invalid redis sentinel url: expected redis+sentinel://[user:pass@]host:port,host:port/<master-name>[/<db>][?sentinel_username=…&sentinel_password=…]",
                None,
            )
        };
        let (scheme, rest) = url.split_once("://").ok_or_else(bad)?;
        let scheme = match scheme {
            "redis+sentinel" => "redis",
            "rediss+sentinel" => "rediss",
            _ => return Err(bad()),
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
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
        // The URL's credentials are the servers': the sentinels get their own, if any.
        let sentinels = super::conn::node_urls(scheme, "", hosts);
        if sentinels.is_empty() {
            return Err(bad());
        }
        Ok(SentinelUrl {
            sentinels,
            master,
            server: format!("{scheme}://{auth}localhost/{db}"),
            sentinel_auth: sentinel_auth(query)?,
        })
    }
}

/// The sentinels' credentials from the URL's query (`sentinel_username`, `sentinel_password`);
/// any other parameter is refused. Errors name a parameter, never a value.
fn sentinel_auth(query: &str) -> Result<Option<(Option<String>, String)>, LockError> {
    let invalid = |what: String| {
        LockError::misconfigured(format!("invalid redis sentinel url: {what}"), None)
    };
    let (mut user, mut password) = (None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v, named) = match pair.split_once('=') {
            Some((k, v)) => (k, v, true),
            None => (pair, "", false),
        };
        let slot = match k {
            "sentinel_username" => &mut user,
            "sentinel_password" => &mut password,
            // A stray secret (`?hunter2`, `?correcthorse`: a bare word, with no `=`) is not
            // echoed: only a name-like key given a value is.
            _ if named && k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') => {
                return Err(invalid(format!(
                    "unknown parameter `{k}` (known: sentinel_username, sentinel_password)"
                )))
            }
            _ => {
                return Err(invalid(
                    "a parameter that is not sentinel_username or sentinel_password".into(),
                ))
            }
        };
        let v = crate::util::percent_decode(v)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| {
                invalid(format!(
                    "`{k}` is empty, badly percent-encoded or not UTF-8"
                ))
            })?;
        *slot = Some(v);
    }
    match (user, password) {
        (user, Some(password)) => Ok(Some((user, password))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(invalid(
            "sentinel_username needs a sentinel_password".into(),
        )),
    }
}

/// A connection to the current master of a Sentinel-monitored group. Cheap to clone.
#[derive(Clone)]
pub(crate) struct SentinelConn {
    shared: Arc<Shared>,
    /// The issuer number of the master the last reply on this handle came from.
    replied: Option<u64>,
}

/// The sentinels of one group: asked for its master and listened to for its switches. Shared by
/// a connection and the dedicated connections made from it.
struct Sentinels {
    master_name: String,
    /// One connection per sentinel, RESP3: its commands and its subscription to the
    /// [`ANNOUNCEMENTS`] share it.
    conns: Vec<SentinelLink>,
    /// How to reach a data node: the URL's credentials, database and TLS settings, with a
    /// placeholder address.
    node: ConnectionInfo,
    /// The connections that follow this group's master, told of every announced switch.
    followers: Mutex<Vec<Weak<Shared>>>,
    command_timeout: Duration,
}

struct SentinelLink {
    /// How to connect (with the push handler), to make the connection anew.
    client: Client,
    config: ConnectionManagerConfig,
    /// The connection and a watch on the runtime it was made on: redis-rs's manager spawns its
    /// reconnects there, and a reconnect begun there panics when polled on another runtime once
    /// that one shut down (see `conn::ServerLink`).
    conn: RwLock<(ConnectionManager, Option<Arc<RuntimeWatch>>)>,
    /// Subscribed to the [`ANNOUNCEMENTS`], as far as this side knows.
    subscribed: AtomicBool,
}

struct Shared {
    sentinels: Arc<Sentinels>,
    current: RwLock<Current>,
    /// The settings of a connection to a master, without the push handler.
    config: ConnectionManagerConfig,
    /// Where pushes go, told the master's issuer number (none for dedicated connections,
    /// which carry no grants and take no issuer numbers).
    push: Option<PushFn>,
    /// The issuer numbers of the masters followed so far, the latest last.
    issuers: Mutex<Vec<u64>>,
    /// The latest configuration epoch under which the master followed was named: a check does
    /// not go back to a master named under an older one (see the module docs).
    epoch: AtomicU64,
    /// The release channels subscribed, or being subscribed, through this connection
    /// (subscribed again on a switch).
    channels: Channels,
    /// A failover check is under way.
    checking: AtomicBool,
    /// A check was asked for since the running one last asked the sentinels.
    recheck: AtomicBool,
    /// A sentinel announced a failover: the running check stops waiting (on a master that does
    /// not answer, or before its next look-up) and asks the sentinels now.
    announced: Arc<tokio::sync::Notify>,
    /// Where the local waiters are woken after a switch (none for dedicated connections).
    hub: Option<Weak<ReleaseHub>>,
    /// Where a switch hands the channels it subscribed for nobody (see [`Switched`]; unset for
    /// dedicated connections, which subscribe nothing).
    on_stray: OnceLock<StrayFn>,
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
    /// A watch on the runtime `conn` was made on (see [`SentinelLink::conn`]).
    made_on: Option<Arc<RuntimeWatch>>,
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
        let sentinels = Sentinels::connect(url, connect_timeout, command_timeout).await?;
        let limit = connect_timeout + command_timeout;
        let Found { master, .. } = sentinels.lookup(limit).await?;
        let config = manager_config(connect_timeout, command_timeout);
        let client = sentinels.client(&master)?;
        let (mut conn, cell) = connect_to(&client, &config, push.as_ref())?;
        let checked = async {
            ensure_master(&mut conn, limit).await?;
            super::take_issuer(&mut conn, limit, &[]).await
        };
        let issuer = match checked.await {
            Ok(issuer) => issuer,
            // No answer in time may be a sign-in refused over and over (the manager retries).
            Err(e) if e.is_unavailable() => {
                return Err(super::conn::refused_at_sign_in(&client, limit)
                    .await
                    .unwrap_or(e))
            }
            Err(e) => return Err(e),
        };
        cell.store(issuer, Ordering::Release);
        let current = Current {
            addr: master.addr(),
            conn,
            client,
            issuer,
            made_on: watch_runtime(),
        };
        Ok(SentinelConn {
            replied: None,
            shared: Shared::new(
                sentinels,
                current,
                master.epoch,
                config,
                push,
                vec![issuer],
                hub,
                connect_timeout,
                command_timeout,
            ),
        })
    }

    /// Another connection to the same master, with no push handler: for commands that block
    /// their connection (`WAIT`). It shares the sentinels and follows a failover on its own.
    pub(crate) fn dedicated(&self) -> Result<Self, LockError> {
        let s = &self.shared;
        let current = s.current();
        let config = manager_config(s.connect_timeout, s.command_timeout);
        let conn = ConnectionManager::new_lazy_with_config(current.client.clone(), config.clone())
            .map_err(|e| super::redis_err("connect", e))?;
        Ok(SentinelConn {
            replied: None,
            shared: Shared::new(
                s.sentinels.clone(),
                Current {
                    conn,
                    made_on: watch_runtime(),
                    ..current
                },
                s.epoch.load(Ordering::Acquire),
                config,
                None,
                Vec::new(),
                None,
                s.connect_timeout,
                s.command_timeout,
            ),
        })
    }
    /// Subscribes to a release channel on the current master (and remembers it for the next).
    /// Noted before it is sent, so a switch meanwhile subscribes it on the new master too;
    /// forgotten again unless the master confirmed it (or an earlier subscribe did). A
    /// subscribe that failed, or whose caller gave up on it (its deadline), the backend does
    /// not count as subscribed either (it unsubscribes it as a stray with the lock's last
    /// waiter, and the lock's next waiter subscribes again). Kept here, the channel was
    /// subscribed on every master followed from then on, for good.
    pub(super) async fn subscribe(&mut self, channel: &str) -> RedisResult<()> {
        let noted = self.shared.channels.note(channel);
        let r = self.shared.current().conn.subscribe(channel).await;
        if r.is_ok() {
            noted.confirmed();
        }
        self.shared.after(&r);
        r
    }

    /// The reverse of [`subscribe`](SentinelConn::subscribe). The channel is forgotten before
    /// the master is asked, whatever it answers, as the backend forgets it: an unsubscribe that
    /// failed or timed out (a master down or frozen) may have been run, and the lock's next
    /// waiter subscribes again. Kept, it was subscribed on every master followed from then on,
    /// for nobody.
    pub(super) async fn unsubscribe(&mut self, channel: &str) -> RedisResult<()> {
        self.shared.channels.forget(channel);
        let r = self.shared.current().conn.unsubscribe(channel).await;
        self.shared.after(&r);
        r
    }

    /// Where a switch hands the channels it subscribed on the new master after their last
    /// waiter left (see [`Switched`]): the backend unsubscribes them in their turns. Set once.
    pub(super) fn on_stray(&self, f: StrayFn) {
        let _ = self.shared.on_stray.set(f);
    }

    /// A command on this connection got no answer before its caller's deadline: a failover
    /// check, as for a command that failed the way a failover makes it fail.
    pub(super) fn timed_out(&self) {
        self.shared.start_check();
    }

    /// The master's address now (`host:port`), as the sentinels named it.
    pub(crate) fn master_addr(&self) -> String {
        self.shared.current().addr
    }

    /// The issuer number of the master now (see the module docs).
    pub(crate) fn issuer(&self) -> u64 {
        self.shared.current().issuer
    }

    /// The issuer number of the connection commands go to now (read only: unlike
    /// [`issuer`](Self::issuer), never makes a connection anew).
    pub(super) fn issuer_now(&self) -> u64 {
        self.shared
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .issuer
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
                // Whether the connection is the one commands go on now is the backend's to
                // tell, by the issuer number (`RedisBackend`'s push handler).
                push(p, (issuer != u64::MAX).then_some(issuer), true);
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

/// A master as one sentinel sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct View {
    ip: String,
    port: u16,
    /// The configuration epoch of the sentinel's view (raised by every failover).
    epoch: u64,
    /// The sentinel finds the master down (`s_down` or `o_down`).
    down: bool,
}

impl View {
    /// From the replies to `SENTINEL MASTER <name>` (a map in RESP3, field/value pairs in
    /// RESP2: the epoch and the flags) and `SENTINEL GET-MASTER-ADDR-BY-NAME <name>` (the
    /// address: while a failover completes it is already the promoted replica's, once that one
    /// says it is a master and the epoch is raised, where `SENTINEL MASTER` still has the old).
    fn parse(master: &Value, addr: &Value) -> Option<View> {
        let fields: HashMap<String, String> = redis::from_redis_value_ref(master).ok()?;
        let (ip, port): (String, u16) = redis::from_redis_value_ref(addr).ok()?;
        let flags = fields.get("flags")?;
        Some(View {
            ip,
            port,
            epoch: fields.get("config-epoch")?.parse().ok()?,
            down: flags.split(',').any(|f| f == "s_down" || f == "o_down"),
        })
    }

    fn addr(&self) -> String {
        format!("{}:{}", self.ip, self.port)
    }
}

/// One sentinel's answer to a look-up.
enum Asked {
    /// It named the master.
    Named(View),
    /// It refused in a way asking again does not change (why, for the error).
    Refused(&'static str),
    /// No answer, or one that named no master: it may answer next time.
    Failed,
}

impl Asked {
    /// Why a sentinel's error is a refusal for good: the sign-in, or a master name it does not
    /// monitor.
    fn refused(e: &RedisError) -> Option<&'static str> {
        if super::refused_for_good(e) {
            Some("it refused the sign-in (a sentinel with a password of its own needs `sentinel_password`, and `sentinel_username` for an ACL user, in the url's query)")
        } else if e.to_string().contains("No such master") {
            // `ERR No such master with that name` (in a pipeline's error: no `detail`).
            Some("it monitors no master of that name")
        } else {
            None
        }
    }
}

/// The master to follow among the sentinels' views: the one named under the latest
/// configuration epoch (a sentinel that missed a failover names the old master under an older
/// one), one that no sentinel at that epoch finds down if there is one (the node is asked
/// whether it is a master before it is used, whatever the sentinels find).
fn pick(views: &[View]) -> Option<&View> {
    let latest = views.iter().map(|v| v.epoch).max()?;
    let mut at_latest = views.iter().filter(|v| v.epoch == latest);
    at_latest
        .clone()
        .find(|v| !v.down)
        .or_else(|| at_latest.next())
}

/// What a look-up found: the master to follow, and whether a majority of all the sentinels
/// named it under that epoch.
struct Found {
    master: View,
    by_majority: bool,
}

impl Found {
    /// The master to follow among `views` ([`pick`]), and whether at least `majority` of them
    /// name it under its epoch.
    fn among(views: &[View], majority: usize) -> Option<Found> {
        let master = pick(views)?;
        let named_by = views
            .iter()
            .filter(|v| (v.epoch, &v.ip, v.port) == (master.epoch, &master.ip, master.port))
            .count();
        Some(Found {
            master: master.clone(),
            by_majority: named_by >= majority,
        })
    }

    /// Whether a check that followed a master named under `followed` (an epoch) may follow
    /// this one: not when it was named under an older epoch by fewer than a majority — a
    /// sentinel that missed the failover followed last (see the module docs).
    fn may_follow(&self, followed: u64) -> bool {
        self.master.epoch >= followed || self.by_majority
    }
}

impl Sentinels {
    /// A connection to every sentinel of `url`, each subscribed to the [`ANNOUNCEMENTS`] (those
    /// that answer now; the others once they do), and the task that keeps them so.
    async fn connect(
        url: &SentinelUrl,
        connect_timeout: Duration,
        command_timeout: Duration,
    ) -> Result<Arc<Sentinels>, LockError> {
        // The URL may carry a password: never put it in an error message.
        let invalid = |e: RedisError| {
            LockError::misconfigured(format!("invalid redis sentinel url: {:?}", e.kind()), None)
        };
        let resp3 = |info: ConnectionInfo| {
            let settings = info
                .redis_settings()
                .clone()
                .set_protocol(ProtocolVersion::RESP3);
            info.set_redis_settings(settings)
        };
        let node = resp3(
            url.server
                .as_str()
                .into_connection_info()
                .map_err(invalid)?,
        );
        let this: Arc<OnceLock<Weak<Sentinels>>> = Arc::new(OnceLock::new());
        let mut conns = Vec::with_capacity(url.sentinels.len());
        for (i, sentinel) in url.sentinels.iter().enumerate() {
            let mut info = resp3(sentinel.as_str().into_connection_info().map_err(invalid)?);
            if let Some((user, password)) = &url.sentinel_auth {
                let mut settings = info.redis_settings().clone().set_password(password);
                if let Some(user) = user {
                    settings = settings.set_username(user);
                }
                info = info.set_redis_settings(settings);
            }
            let client = Client::open(info).map_err(invalid)?;
            let this = this.clone();
            let config = manager_config(connect_timeout, command_timeout)
                .set_push_sender(move |p: PushInfo| {
                    if let Some(s) = this.get().and_then(Weak::upgrade) {
                        s.pushed(i, &p);
                    }
                    Ok::<(), redis::aio::SendError>(())
                })
                .set_automatic_resubscription();
            let conn = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
                .map_err(|e| super::redis_err("sentinel connect", e))?;
            conns.push(SentinelLink {
                client,
                config,
                conn: RwLock::new((conn, watch_runtime())),
                subscribed: AtomicBool::new(false),
            });
        }
        let sentinels = Arc::new(Sentinels {
            master_name: url.master.clone(),
            conns,
            node,
            followers: Mutex::new(Vec::new()),
            command_timeout,
        });
        let _ = this.set(Arc::downgrade(&sentinels));
        let limit = connect_timeout + command_timeout;
        futures_util::future::join_all(sentinels.conns.iter().map(|l| l.subscribe(limit))).await;
        // To the end: if this runtime shuts down first, it goes on on the fallback thread
        // (else the sentinels' subscriptions were never made again after a drop).
        let weak = Arc::downgrade(&sentinels);
        crate::util::spawn_to_the_end(Arc::new(move || Box::pin(keep_alive(weak.clone()))));
        Ok(sentinels)
    }

    /// A push from sentinel `i`: an announced failover of this master, or the connection dropped
    /// (an announcement may be missed until it is subscribed again): either starts a check.
    fn pushed(&self, i: usize, p: &PushInfo) {
        let switched = match p.kind {
            PushKind::Disconnection => {
                self.conns[i].subscribed.store(false, Ordering::Release);
                true
            }
            PushKind::Message => match p.data.as_slice() {
                [channel, payload] => {
                    let text = |v| redis::from_redis_value_ref::<String>(v).ok();
                    text(channel)
                        .zip(text(payload))
                        .is_some_and(|(c, p)| announces(&c, &p, &self.master_name))
                }
                _ => false,
            },
            _ => false,
        };
        if switched {
            tracing::debug!(
                sentinel = i,
                "redis sentinel: a switch announced or an announcement missed"
            );
            self.alert();
        }
    }

    /// Starts a failover check on every connection that follows this group's master.
    fn alert(&self) {
        let followers: Vec<Arc<Shared>> = {
            let mut followers = self
                .followers
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            followers.retain(|f| f.strong_count() > 0);
            followers.iter().filter_map(Weak::upgrade).collect()
        };
        for f in followers {
            f.announced.notify_one();
            f.start_check();
        }
    }

    /// Asks every sentinel for the master, within `limit`, and picks the one to follow (see
    /// [`pick`]). Once a majority of them named one, the others get a short while more. When
    /// every sentinel refused in a way asking again does not change — the sign-in (a sentinel
    /// with a password of its own, see [`SentinelUrl::sentinel_auth`]) or an unknown master
    /// name — the answer is [`LockError::Misconfigured`]; otherwise, with no master named,
    /// [`LockError::Unavailable`].
    async fn lookup(&self, limit: Duration) -> Result<Found, LockError> {
        let mut asks: FuturesUnordered<_> = self
            .conns
            .iter()
            .map(|l| {
                let mut conn = l.conn();
                let mut ask = redis::pipe();
                ask.cmd("SENTINEL").arg("MASTER").arg(&self.master_name);
                ask.cmd("SENTINEL")
                    .arg("GET-MASTER-ADDR-BY-NAME")
                    .arg(&self.master_name);
                async move {
                    let replies = ask.query_async::<(Value, Value)>(&mut conn);
                    match tokio::time::timeout(limit, replies).await {
                        Ok(Ok((master, addr))) => View::parse(&master, &addr).map_or(Asked::Failed, Asked::Named),
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "redis sentinel: a sentinel did not answer");
                            Asked::refused(&e).map_or(Asked::Failed, Asked::Refused)
                        }
                        Err(_) => Asked::Failed,
                    }
                }
            })
            .collect();
        let majority = self.conns.len() / 2 + 1;
        let grace =
            (self.command_timeout / 5).clamp(Duration::from_millis(10), Duration::from_millis(100));
        let mut views = Vec::with_capacity(self.conns.len());
        let mut refused = Vec::new();
        let mut deadline = tokio::time::Instant::now() + limit;
        while let Ok(Some(asked)) = tokio::time::timeout_at(deadline, asks.next()).await {
            match asked {
                Asked::Named(view) => {
                    views.push(view);
                    if views.len() == majority {
                        deadline = deadline.min(tokio::time::Instant::now() + grace);
                    }
                }
                Asked::Refused(why) => refused.push(why),
                Asked::Failed => {}
            }
        }
        if let Some(found) = Found::among(&views, majority) {
            return Ok(found);
        }
        if refused.len() == self.conns.len() {
            refused.sort_unstable();
            refused.dedup();
            return Err(LockError::misconfigured(
                format!(
                    "redis sentinel: every sentinel refused to name master `{}`: {}",
                    self.master_name,
                    refused.join("; ")
                ),
                None,
            ));
        }
        Err(LockError::unavailable(
            format!("redis sentinel: no sentinel named the master within {limit:?}"),
            None,
        ))
    }

    /// A client for the data node `master` names, with the URL's credentials, database and TLS.
    fn client(&self, master: &View) -> Result<Client, LockError> {
        let addr = match self.node.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host: master.ip.clone(),
                port: master.port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(master.ip.clone(), master.port),
        };
        Client::open(self.node.clone().set_addr(addr)).map_err(|e| super::redis_err("connect", e))
    }
}

impl SentinelLink {
    /// The connection to this sentinel, made anew here (and so unsubscribed) if the runtime it
    /// was made on shut down.
    fn conn(&self) -> ConnectionManager {
        let cur = self.conn.read().unwrap_or_else(PoisonError::into_inner);
        if !gone(&cur.1) || tokio::runtime::Handle::try_current().is_err() {
            return cur.0.clone();
        }
        drop(cur);
        let Ok(conn) =
            ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone())
        else {
            return self
                .conn
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .0
                .clone();
        };
        let mut cur = self.conn.write().unwrap_or_else(PoisonError::into_inner);
        if gone(&cur.1) {
            *cur = (conn, watch_runtime());
            self.subscribed.store(false, Ordering::Release);
        }
        cur.0.clone()
    }

    /// Replaces the connection to this sentinel by a new one (made on first use, on this
    /// runtime; subscribed to nothing): one that a probe got no answer on in time may have gone
    /// silent, and its manager reconnects only on a reset or a close. Without a runtime,
    /// nothing.
    fn replace(&self) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let Ok(conn) =
            ConnectionManager::new_lazy_with_config(self.client.clone(), self.config.clone())
        else {
            return;
        };
        let old = std::mem::replace(
            &mut *self.conn.write().unwrap_or_else(PoisonError::into_inner),
            (conn, watch_runtime()),
        );
        self.subscribed.store(false, Ordering::Release);
        // Outside the lock: the last handle of the old connection closes it.
        drop(old);
        tracing::debug!("redis sentinel: a connection to a sentinel went silent; replaced");
    }

    /// Subscribes to the [`ANNOUNCEMENTS`] (again: a sentinel answers a repeated subscription
    /// alike), within `limit`; whether it did.
    async fn subscribe(&self, limit: Duration) -> bool {
        let mut conn = self.conn();
        // Not replaced when this gets no answer in time: the connection may be one just made
        // (lazily, by this very call), whose connect, sign-in and subscription together can take
        // longer than a command — replaced each time, it would never be subscribed. A
        // connection that answered and then falls silent is replaced by the probe.
        let ok = matches!(
            tokio::time::timeout(limit, conn.subscribe(&ANNOUNCEMENTS[..])).await,
            Ok(Ok(()))
        );
        self.subscribed.store(ok, Ordering::Release);
        ok
    }
}

/// Whether a message on `channel` announces a failover of the master called `name`:
/// `+switch-master <name> <old-ip> <old-port> <new-ip> <new-port>`, or
/// `+promoted-slave slave <ip>:<port> <ip> <port> @ <name> <master-ip> <master-port>`.
fn announces(channel: &str, payload: &str, name: &str) -> bool {
    let mut words = payload.split(' ');
    match channel {
        "+switch-master" => words.next() == Some(name),
        "+promoted-slave" => words.skip_while(|w| *w != "@").nth(1) == Some(name),
        _ => false,
    }
}

/// Probes every sentinel connection each [`KEEPALIVE`]: one that does not answer is marked
/// unsubscribed — and replaced, when it was subscribed (it had answered) and no answer came in
/// time (see [`SentinelLink::replace`]);
/// one that is unsubscribed is subscribed again, and once it is, the followers check the master
/// (a switch may have been announced while it was away).
async fn keep_alive(sentinels: Weak<Sentinels>) {
    loop {
        tokio::time::sleep(KEEPALIVE).await;
        let Some(s) = sentinels.upgrade() else { return };
        let limit = s.command_timeout;
        let back = futures_util::future::join_all(s.conns.iter().map(|l| async move {
            if l.subscribed.load(Ordering::Acquire) {
                let mut conn = l.conn();
                let ping = redis::cmd("PING");
                match tokio::time::timeout(limit, ping.query_async::<()>(&mut conn)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) if !e.is_timeout() => l.subscribed.store(false, Ordering::Release),
                    _ => l.replace(),
                }
                false
            } else {
                l.subscribe(limit).await
            }
        }))
        .await;
        if back.contains(&true) {
            s.alert();
        }
    }
}

/// Fails unless the node on `conn` says it is a master (`ROLE`): a sentinel may name a node
/// that has not taken the role yet, or has lost it. `ROLE` is in the `@dangerous` category,
/// which hardened ACL users lack (`+@all -@dangerous`, a common default): refused
/// (`NOPERM`), the role is read from `HELLO 3`'s reply instead (`@fast @connection`; this
/// connection speaks RESP3 already, so it changes nothing).
async fn ensure_master(conn: &mut ConnectionManager, limit: Duration) -> Result<(), LockError> {
    let deadline = tokio::time::Instant::now() + limit;
    let timed_out = || LockError::unavailable(format!("redis: no answer within {limit:?}"), None);
    let master =
        match tokio::time::timeout_at(deadline, redis::cmd("ROLE").query_async::<Vec<Value>>(conn))
            .await
        {
            Ok(Ok(r)) => matches!(r.first(), Some(Value::BulkString(b)) if b == b"master"),
            Ok(Err(e)) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm) => {
                let mut hello = redis::cmd("HELLO");
                hello.arg(3);
                match tokio::time::timeout_at(deadline, hello.query_async::<Value>(conn)).await {
                    Ok(Ok(Value::Map(fields))) => fields.iter().any(|(k, v)| {
                        text(k).as_deref() == Some("role") && text(v).as_deref() == Some("master")
                    }),
                    Ok(Ok(_)) => false,
                    Ok(Err(e)) => return Err(super::redis_err("hello", e)),
                    Err(_) => return Err(timed_out()),
                }
            }
            Ok(Err(e)) => return Err(super::redis_err("role", e)),
            Err(_) => return Err(timed_out()),
        };
    if master {
        Ok(())
    } else {
        Err(LockError::unavailable(
            "redis sentinel: the node the sentinels name is not a master (yet)",
            None,
        ))
    }
}

/// A reply's text, if it is one.
fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// A watch on the current runtime, if any (see [`SentinelLink::conn`]).
fn watch_runtime() -> Option<Arc<RuntimeWatch>> {
    crate::util::on_runtime_shutdown(|| {}).map(Arc::new)
}

/// Whether the runtime a watch was set on shut down.
fn gone(watch: &Option<Arc<RuntimeWatch>>) -> bool {
    watch.as_deref().is_some_and(RuntimeWatch::is_gone)
}

/// Whether `e` is how commands fail while a master fails over.
fn failover_like(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        // A script that writes on a demoted master fails with READONLY inside its error.
        || super::conn::refused_by_a_replica(e)
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
    /// A connection that follows the master of `sentinels` (and is told of their switches).
    #[allow(clippy::too_many_arguments)]
    fn new(
        sentinels: Arc<Sentinels>,
        current: Current,
        epoch: u64,
        config: ConnectionManagerConfig,
        push: Option<PushFn>,
        issuers: Vec<u64>,
        hub: Option<Weak<ReleaseHub>>,
        connect_timeout: Duration,
        command_timeout: Duration,
    ) -> Arc<Shared> {
        let shared = Arc::new(Shared {
            sentinels: sentinels.clone(),
            current: RwLock::new(current),
            config,
            push,
            issuers: Mutex::new(issuers),
            epoch: AtomicU64::new(epoch),
            channels: Channels::default(),
            checking: AtomicBool::new(false),
            recheck: AtomicBool::new(false),
            announced: Arc::new(tokio::sync::Notify::new()),
            hub,
            on_stray: OnceLock::new(),
            connect_timeout,
            command_timeout,
        });
        sentinels
            .followers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::downgrade(&shared));
        shared
    }

    /// The release channels subscribed through this connection.
    fn channels(&self) -> Vec<String> {
        self.channels.all()
    }

    /// The connection to the master now, made anew first if the runtime it was made on shut
    /// down (see [`remade_here`](Shared::remade_here)).
    fn current(&self) -> Current {
        let cur = self
            .current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if gone(&cur.made_on) && tokio::runtime::Handle::try_current().is_ok() {
            return self.remade_here(cur);
        }
        cur
    }

    /// Replaces `old`, a connection made on a runtime that shut down, by a new one to the same
    /// master, made on this runtime, with the same issuer number (the master is the same);
    /// then, on a task, subscribes it to every release channel and wakes the local waiters
    /// (releases published meanwhile reached no one).
    fn remade_here(&self, old: Current) -> Current {
        let Ok((conn, cell)) = connect_to(&old.client, &self.config, self.push.as_ref()) else {
            return old;
        };
        cell.store(old.issuer, Ordering::Release);
        let mut cur = self.current.write().unwrap_or_else(PoisonError::into_inner);
        if !gone(&cur.made_on) {
            // Made anew by another caller (or switched) meanwhile.
            return cur.clone();
        }
        *cur = Current {
            conn,
            made_on: watch_runtime(),
            ..old
        };
        let new = cur.clone();
        drop(cur);
        let channels = self.channels();
        let hub = self.hub.clone();
        let (mut conn, limit) = (new.conn.clone(), self.command_timeout);
        tokio::spawn(async move {
            for channel in &channels {
                let _ = tokio::time::timeout(limit, conn.subscribe(channel)).await;
            }
            if let Some(hub) = hub.as_ref().and_then(Weak::upgrade) {
                hub.notify_all();
            }
        });
        tracing::debug!(master = %new.addr, "redis sentinel: connection made on a runtime that shut down; replaced");
        new
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
        if failed {
            self.start_check();
        }
    }

    /// Starts a failover check, or has the running one ask the sentinels once more before it
    /// ends (what it learnt may be older than the reason for this call).
    fn start_check(self: &Arc<Self>) {
        self.recheck.store(true, Ordering::Release);
        if self.checking.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            // To the end: a check cut off by its runtime's shutdown runs again on the fallback
            // thread (else `checking` stayed set, and no failover was followed again).
            Ok(_) => {
                let weak = Arc::downgrade(self);
                crate::util::spawn_to_the_end(Arc::new(move || Box::pin(check(weak.clone()))));
            }
            Err(_) => self.checking.store(false, Ordering::Release),
        }
    }

    /// Whether the master the sentinels still name answers on the connection `current`. A
    /// `PING` that gets no answer at all within the command timeout may mean the connection went
    /// silent (a partition, a load balancer or NAT that forgot it: no reset, no close, so the
    /// manager never reconnects and every command times out until the kernel gives up on the
    /// socket, many minutes) while the master serves new connections: a new connection to the
    /// same master is tried, and switched to if the master answers on it (subscribed to every
    /// release channel, the waiters woken, as after a failover). A master that is down or
    /// frozen answers on neither; the check goes on.
    async fn same_master(&self, current: &Current, master: &View) -> bool {
        let mut conn = current.conn.clone();
        let ping = redis::cmd("PING");
        match tokio::time::timeout(self.command_timeout, ping.query_async::<()>(&mut conn)).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) if !e.is_timeout() => false,
            _ => {
                drop(conn);
                let switched = match self.sentinels.client(master) {
                    Ok(client) => self.switch_to(client, master.addr()).await,
                    Err(e) => Err(e),
                };
                if let Err(e) = &switched {
                    tracing::debug!(error = %e, "redis sentinel: the master does not answer");
                }
                switched.is_ok()
            }
        }
    }

    /// Connects to the master `client` names, checks it is one, re-subscribes there, switches
    /// to it and wakes the local waiters.
    async fn switch_to(&self, client: Client, addr: String) -> Result<(), LockError> {
        let (mut conn, cell) = connect_to(&client, &self.config, self.push.as_ref())?;
        ensure_master(&mut conn, self.command_timeout).await?;
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
        let channels = self.channels();
        let mut subscribing = subscribe_each(&conn, &channels, self.command_timeout);
        while let Some(answer) = subscribing.next().await {
            answer
                .map_err(|_| LockError::unavailable("redis subscribe timed out", None))?
                .map_err(|e| super::redis_err("subscribe", e))?;
        }
        drop(subscribing);
        let late_conn = conn.clone();
        let old = std::mem::replace(
            &mut *self.current.write().unwrap_or_else(PoisonError::into_inner),
            Current {
                conn,
                client,
                addr: addr.clone(),
                issuer,
                made_on: watch_runtime(),
            },
        );
        // Switched. What follows is done even when this call is cut short in the late
        // subscriptions below (a check's `same_master` gives way to a new announcement): the
        // issuer is noted at once, and the waiters are woken when this call ends either way —
        // cut short, it skipped both, and the waiters slept on their timers.
        if self.push.is_some() {
            let mut issuers = self.issuers.lock().unwrap_or_else(PoisonError::into_inner);
            issuers.push(issuer);
            if issuers.len() > ISSUERS_KEPT {
                issuers.remove(0);
            }
        }
        if old.addr == addr {
            tracing::warn!(master = %addr, "redis sentinel: the connection to the master went silent (no answer to PING); replaced by a new one");
        } else {
            tracing::warn!(from = %old.addr, to = %addr, "redis sentinel: following the master");
        }
        let _wake = WakeOnDrop(self.hub.as_ref().and_then(Weak::upgrade));
        // When this call ends, or is cut short: what this switch subscribed here for nobody
        // goes to the backend.
        let mut switched = Switched {
            shared: self,
            subscribed: channels,
        };
        // A waiter that subscribed while the channels above were being subscribed did so on
        // the connection this one replaces (it read `current` before the swap; its channel was
        // noted after `channels` was read): subscribed here too, or it would hear no release
        // on the new master. One that read `current` after the swap is subscribed twice,
        // which is harmless.
        let before: HashSet<&String> = switched.subscribed.iter().collect();
        let late: Vec<String> = self
            .channels()
            .into_iter()
            .filter(|c| !before.contains(c))
            .collect();
        switched.subscribed.extend(late.iter().cloned());
        let mut subscribing = subscribe_each(&late_conn, &late, self.command_timeout);
        while let Some(answer) = subscribing.next().await {
            match answer {
                Ok(Ok(())) => {}
                // Its waiters are woken below and attempt again; they run on their timers
                // until the next switch subscribes it.
                Ok(Err(e)) => {
                    tracing::debug!(error = ?e.kind(), "redis sentinel: subscribing a channel noted during the switch failed");
                }
                Err(_) => {
                    tracing::debug!(
                        "redis sentinel: subscribing a channel noted during the switch timed out"
                    );
                }
            }
        }
        Ok(())
    }
}

/// The channels a switch subscribed on the new master, from the moment it switched. One that
/// is no longer noted when the switch ends (or is cut short) lost its last waiter meanwhile:
/// the waiter's `UNSUBSCRIBE` went to the old master, or reached the new connection before the
/// switch's `SUBSCRIBE`, so the new master keeps a subscription nobody needs, and its
/// notifications, until the next switch. Handed to the backend ([`SentinelConn::on_stray`]),
/// which unsubscribes each in the channel's turn — or, should a waiter of the lock have come
/// meanwhile, with that lock's last waiter. (Forgetting it here instead would race a new
/// waiter's `SUBSCRIBE`, which holds the backend's turn, not this connection's.) An extra
/// `UNSUBSCRIBE` of a channel the new master already dropped is harmless.
struct Switched<'a> {
    shared: &'a Shared,
    subscribed: Vec<String>,
}

impl Drop for Switched<'_> {
    fn drop(&mut self) {
        let Some(report) = self.shared.on_stray.get() else {
            return;
        };
        let noted: HashSet<String> = self.shared.channels().into_iter().collect();
        let strays: Vec<String> = self
            .subscribed
            .drain(..)
            .filter(|c| !noted.contains(c))
            .collect();
        if !strays.is_empty() {
            tracing::debug!(
                channels = strays.len(),
                "redis sentinel: a switch subscribed channels whose last waiter left meanwhile"
            );
            report(strays);
        }
    }
}

/// Subscribes `conn` to each of `channels`, each within `limit`, with up to
/// [`SUBSCRIBES_IN_FLIGHT`](super::SUBSCRIBES_IN_FLIGHT) on their way at once over the one connection; yields each answer as
/// it comes (dropped, it stops the rest). One after another, a switch took a round trip per
/// channel — and the commands sent meanwhile still went to the old master, and failed.
fn subscribe_each<'a>(
    conn: &'a ConnectionManager,
    channels: &'a [String],
    limit: Duration,
) -> impl futures_util::Stream<Item = Result<RedisResult<()>, tokio::time::error::Elapsed>> + 'a {
    futures_util::stream::iter(channels)
        .map(move |channel| {
            let mut conn = conn.clone();
            async move { tokio::time::timeout(limit, conn.subscribe(channel)).await }
        })
        .buffer_unordered(super::SUBSCRIBES_IN_FLIGHT)
}

/// The release channels subscribed, or being subscribed, through one [`SentinelConn`]: what a
/// switch subscribes on the new master.
#[derive(Default)]
struct Channels(Mutex<HashMap<String, Noted>>);

/// What is known of one channel's subscriptions.
#[derive(Default)]
struct Noted {
    /// Subscribes of it under way.
    pending: u32,
    /// A subscribe of it was confirmed since it was last forgotten.
    confirmed: bool,
}

impl Channels {
    fn all(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }

    /// Notes `channel` for a subscribe under way. Dropped without
    /// [`confirmed`](Subscribing::confirmed) (the subscribe failed, or was given up), it is
    /// forgotten again — unless another subscribe of it is still under way or was confirmed.
    fn note(&self, channel: &str) -> Subscribing<'_> {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        all.entry(channel.to_owned()).or_default().pending += 1;
        Subscribing {
            channels: self,
            channel: channel.to_owned(),
            confirmed: false,
        }
    }

    fn forget(&self, channel: &str) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(channel);
    }

    /// One subscribe of `channel` ended, `confirmed` or not.
    fn ended(&self, channel: &str, confirmed: bool) {
        let mut all = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        // Forgotten meanwhile (unsubscribed): a confirmation came last, and stands.
        let noted = all.entry(channel.to_owned()).or_insert(Noted {
            pending: 1,
            confirmed: false,
        });
        noted.pending = noted.pending.saturating_sub(1);
        noted.confirmed |= confirmed;
        if noted.pending == 0 && !noted.confirmed {
            all.remove(channel);
        }
    }
}

/// A subscribe under way (see [`Channels::note`]).
struct Subscribing<'a> {
    channels: &'a Channels,
    channel: String,
    confirmed: bool,
}

impl Subscribing<'_> {
    fn confirmed(mut self) {
        self.confirmed = true;
    }
}

impl Drop for Subscribing<'_> {
    fn drop(&mut self) {
        self.channels.ended(&self.channel, self.confirmed);
    }
}

/// Wakes every local waiter of the hub when dropped: they attempt again (after a switch, on
/// the new master).
struct WakeOnDrop(Option<Arc<ReleaseHub>>);

impl Drop for WakeOnDrop {
    fn drop(&mut self) {
        if let Some(hub) = &self.0 {
            hub.notify_all();
        }
    }
}

/// The failover check (see the module docs).
async fn check(shared: Weak<Shared>) {
    let mut pause = Duration::from_millis(50);
    let mut started = tokio::time::Instant::now();
    loop {
        let Some(s) = shared.upgrade() else { return };
        s.recheck.store(false, Ordering::Release);
        // Look again at once (an announcement cut the wait short).
        let mut now = false;
        let found = s
            .sentinels
            .lookup(s.connect_timeout + s.command_timeout)
            .await;
        let current = s.current();
        let followed = s.epoch.load(Ordering::Acquire);
        let done = match found {
            // Another master, named under an older epoch than the one followed, by too few
            // sentinels to count: a sentinel that missed the failover. Asked again, as for no
            // answer. (The master followed, named under an older epoch by a sentinel that lags,
            // is still the same master.)
            Ok(found) if found.master.addr() != current.addr && !found.may_follow(followed) => {
                tracing::debug!(
                    named = %found.master.addr(),
                    epoch = found.master.epoch,
                    followed,
                    "redis sentinel: a master named under an older epoch than the one followed is not followed back"
                );
                false
            }
            Ok(Found { master, .. }) if master.addr() != current.addr => {
                let switched = match s.sentinels.client(&master) {
                    Ok(client) => s.switch_to(client, master.addr()).await,
                    Err(e) => Err(e),
                };
                match switched {
                    Ok(()) => {
                        s.epoch.store(master.epoch, Ordering::Release);
                        true
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "redis sentinel: the new master did not answer yet");
                        false
                    }
                }
            }
            // The same master: done once it answers, unless a failover is announced first
            // (the old master may come back, empty, at the same address: a killed one
            // restarted; waiting for it to answer then kept the connection there).
            Ok(Found { master, .. }) => {
                // Its epoch may have been raised since it was followed (a promoted replica is
                // named before the epoch is: see `View::parse`).
                s.epoch.fetch_max(master.epoch, Ordering::AcqRel);
                tokio::select! {
                    answers = s.same_master(&current, &master) => answers,
                    () = s.announced.notified() => {
                        now = true;
                        false
                    }
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "redis sentinel: look-up failed");
                false
            }
        };
        // Asked for again meanwhile (a switch announced after the look-up): look again now.
        if done && s.recheck.load(Ordering::Acquire) {
            continue;
        }
        if done || started.elapsed() >= CHECK_FOR {
            s.checking.store(false, Ordering::Release);
            // A call that found the check still running left it to this one: it goes on as a
            // new check.
            if !s.recheck.load(Ordering::Acquire) || s.checking.swap(true, Ordering::AcqRel) {
                return;
            }
            started = tokio::time::Instant::now();
            pause = Duration::from_millis(50);
        }
        // Ask again soon: the caller's next attempt should find the new master well within one
        // command timeout of the sentinels' switch (one look-up: a few round trips).
        if now {
            continue;
        }
        let most =
            (s.command_timeout / 5).clamp(Duration::from_millis(10), Duration::from_millis(200));
        let announced = s.announced.clone();
        drop(s);
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = announced.notified() => {}
        }
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

    /// A switch subscribes on the new master what `Channels` holds. A subscribe that failed, or
    /// that its caller gave up on (dropped at its deadline), is forgotten: the backend does not
    /// count it, and kept it was subscribed on every master followed, for good. One confirmed
    /// stays while a later subscribe of it fails; an unsubscribe forgets it whatever it answers.
    #[test]
    fn only_confirmed_subscriptions_are_remembered_for_the_next_master() {
        let channels = Channels::default();
        let held = |c: &Channels| {
            let mut all = c.all();
            all.sort();
            all
        };
        // Noted while under way: a switch meanwhile subscribes it on the new master too.
        let failed = channels.note("a");
        assert_eq!(held(&channels), ["a"]);
        drop(failed);
        assert!(
            held(&channels).is_empty(),
            "a failed subscribe is forgotten"
        );

        channels.note("b").confirmed();
        assert_eq!(held(&channels), ["b"]);
        drop(channels.note("b"));
        assert_eq!(held(&channels), ["b"], "a confirmed one stays");

        // Two under way at once (a resubscription round and a waiter's): the one that fails
        // does not take back the one that is confirmed, whichever ends first.
        let (first, second) = (channels.note("c"), channels.note("c"));
        drop(first);
        assert_eq!(held(&channels), ["b", "c"], "still under way");
        second.confirmed();
        let (first, second) = (channels.note("d"), channels.note("d"));
        first.confirmed();
        drop(second);
        assert_eq!(held(&channels), ["b", "c", "d"]);

        channels.forget("b");
        assert_eq!(held(&channels), ["c", "d"]);
        // Unsubscribed while a subscribe was under way: that subscribe's answer decides.
        let late = channels.note("c");
        channels.forget("c");
        drop(late);
        assert_eq!(held(&channels), ["d"]);
        let late = channels.note("d");
        channels.forget("d");
        late.confirmed();
        assert_eq!(held(&channels), ["d"]);
    }

    #[test]
    fn urls_name_the_sentinels_the_master_and_the_servers_credentials() {
        assert_eq!(
            SentinelUrl::parse("redis+sentinel://u:p@a:1,b:2/mymaster/3").unwrap(),
            SentinelUrl {
                sentinels: vec!["redis://a:1".into(), "redis://b:2".into()],
                master: "mymaster".into(),
                server: "redis://u:p@localhost/3".into(),
                sentinel_auth: None,
            }
        );
        // The sentinels' own credentials, percent-decoded; the servers' stay in the userinfo.
        let with = |q: &str| SentinelUrl::parse(&format!("redis+sentinel://u:p@a:1/m/2?{q}"));
        let auth = with("sentinel_password=s%40cret%2F1").unwrap();
        assert_eq!(auth.sentinel_auth, Some((None, "s@cret/1".into())));
        assert_eq!(auth.server, "redis://u:p@localhost/2");
        assert_eq!(auth.sentinels, vec!["redis://a:1"]);
        let auth = with("sentinel_username=watch&sentinel_password=pw").unwrap();
        assert_eq!(
            auth.sentinel_auth,
            Some((Some("watch".into()), "pw".into()))
        );
        assert!(!format!("{auth:?}").contains("pw"), "{auth:?}");
        for bad in [
            "sentinel_username=watch",
            "sentinel_password=",
            "sentinel_password=%zz",
            "sentinel_pasword=hunter2",
            "hunter2",
            "correcthorse",
        ] {
            let e = with(bad).unwrap_err();
            assert!(e.is_misconfigured(), "{bad}: {e}");
            assert!(!e.to_string().contains("hunter2"), "{bad}: {e}");
            assert!(!e.to_string().contains("correcthorse"), "{bad}: {e}");
        }
        assert!(with("sentinel_pasword=x")
            .unwrap_err()
            .to_string()
            .contains("unknown parameter `sentinel_pasword`"));
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
            assert!(e.is_misconfigured(), "{bad}: {e}");
        }
        // A password never reaches the error.
        let e = SentinelUrl::parse("redis+sentinel://u:secret@a:1").unwrap_err();
        assert!(!e.to_string().contains("secret"));
    }

    fn view(port: u16, epoch: u64, down: bool) -> View {
        View {
            ip: "127.0.0.1".into(),
            port,
            epoch,
            down,
        }
    }

    /// A sentinel that missed a failover names the old master under an older epoch, whatever
    /// the order of the answers; at the latest epoch, a sentinel that finds the master down is
    /// believed only when all do.
    #[test]
    fn the_master_named_under_the_latest_epoch_is_followed() {
        let (old, new) = (view(1, 3, false), view(2, 4, false));
        assert_eq!(pick(&[old.clone(), new.clone(), old.clone()]), Some(&new));
        assert_eq!(pick(&[new.clone(), old.clone()]), Some(&new));
        let down = view(2, 4, true);
        assert_eq!(pick(&[down.clone(), old.clone(), new.clone()]), Some(&new));
        assert_eq!(pick(&[down.clone(), old.clone()]), Some(&down));
        assert_eq!(pick(&[]), None);
    }

    /// After a failover to the master named under epoch 4, a check does not follow the old
    /// master back when only a sentinel that missed the failover names it (epoch 3) — the
    /// others partitioned away — but does when a majority of the three do (sentinels deployed
    /// anew, their epochs started over), and follows any master named under epoch 4 or later.
    #[test]
    fn an_older_epoch_is_followed_back_only_by_a_majority() {
        let (old, new) = (view(1, 3, false), view(2, 4, false));
        let followed = 4;
        let stale = Found::among(std::slice::from_ref(&old), 2).unwrap();
        assert_eq!(stale.master, old);
        assert!(!stale.may_follow(followed));
        let reset = Found::among(&[old.clone(), old.clone()], 2).unwrap();
        assert!(reset.may_follow(followed));
        assert!(Found::among(std::slice::from_ref(&new), 2)
            .unwrap()
            .may_follow(followed));
        assert!(Found::among(&[view(3, 5, false)], 2)
            .unwrap()
            .may_follow(followed));
        // A majority is of the master named, under its epoch: two different answers are not.
        let split = Found::among(&[old.clone(), view(3, 3, false)], 2).unwrap();
        assert!(!split.by_majority);
    }

    /// The replies of a sentinel, as RESP3 gives them, and the failover announcements of this
    /// master (not another's).
    #[test]
    fn sentinel_replies_and_announcements_are_read() {
        let s = |t: &str| Value::BulkString(t.as_bytes().to_vec());
        let master = Value::Map(vec![
            (s("name"), s("m")),
            (s("ip"), s("10.0.0.1")),
            (s("port"), s("6379")),
            (s("flags"), s("master,s_down")),
            (s("config-epoch"), s("7")),
        ]);
        let addr = Value::Array(vec![s("10.0.0.2"), s("6380")]);
        assert_eq!(
            View::parse(&master, &addr),
            Some(View {
                ip: "10.0.0.2".into(),
                port: 6380,
                epoch: 7,
                down: true,
            })
        );
        assert_eq!(View::parse(&Value::Nil, &addr), None);
        assert!(announces(
            "+switch-master",
            "m 10.0.0.1 6379 10.0.0.2 6380",
            "m"
        ));
        assert!(!announces(
            "+switch-master",
            "mm 10.0.0.1 6379 10.0.0.2 6380",
            "m"
        ));
        let promoted = "slave 10.0.0.2:6380 10.0.0.2 6380 @ m 10.0.0.1 6379";
        assert!(announces("+promoted-slave", promoted, "m"));
        assert!(!announces("+promoted-slave", promoted, "other"));
        assert!(!announces("+sdown", promoted, "m"));
    }
}
