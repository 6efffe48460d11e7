//! The Redis backend: one server (or a managed primary), a Sentinel-monitored master, or a
//! Redis Cluster. On one server, and behind Sentinel (to the current master; the sentinels have
//! links of their own), ONE multiplexed RESP3 connection per backend carries both commands and
//! release notifications. A cluster's backend has two connections (redis-rs's cluster client,
//! each with a connection per node): one for commands, one for the subscriptions. Everywhere,
//! `WAIT` (`.replicas(n)`) goes on connections of its own, as it blocks the connection it is
//! sent on (`conn::Dedicated`).
//!
//! * Acquire is one `EVALSHA` (the uncontended path is a single round trip): `SET NX PX`
//!   semantics plus the fencing counter and the fair waiter queue, atomically, on one key per
//!   lock (see [`scripts`]).
//! * Release and extend compare the owner token server side. A release with queued waiters
//!   hands the lock to the first live one in the same script and publishes the grant on the
//!   lock's channel, so that waiter holds the lock before it hears of it; a release nobody
//!   waits for publishes nothing. A barging waiter (`fair(false)`, Redlock) that found the lock
//!   held marks it, and its release publishes an empty notification, which wakes every local
//!   barging waiter of the lock (one wins; the others mark the winner's lock in turn).
//! * Notifications arrive as RESP3 pushes on the same connection (a cluster: on its
//!   subscriptions connection); subscriptions are per lock,
//!   made when the first local waiter of that lock appears and dropped with the last one, and
//!   re-established automatically after a reconnect. Releases published while the connection
//!   was down are missed, so once it is back (and resubscribed) every local waiter is woken to
//!   re-check once instead of sleeping out its fallback timer.
//! * The connection reconnects on its own (redis-rs `ConnectionManager`); every command has a
//!   deadline ([`RedisOptions::command_timeout`]), so a hung server turns into
//!   [`LockError::Unavailable`] instead of a hung handler.
//! * A connection that went silent (a partition, a load balancer or NAT that forgot it: no
//!   reset, no close) is one the `ConnectionManager` keeps, every command timing out, until the
//!   kernel gives up on it — many minutes. So on one server (and Redlock's nodes) a command
//!   that timed out, or was given up before its answer came after waiting at least the lesser of
//!   the command timeout and 100 ms (the [`Locker`](crate::Locker)'s deadline is as long as the
//!   connection's, and often first; a Redlock node's command dropped once the majority answered
//!   is not),
//!   has the connection checked: a `PING` on it within the command timeout, one check however
//!   many commands timed out. Unanswered too, the connection is replaced by a new
//!   one (`conn::ServerLink`), which subscribes again to the channels that still have waiters,
//!   and every waiter is woken to re-check, as after a reconnect above. The command that timed
//!   out is not sent again (it may have run) and fails with [`LockError::Unavailable`]; a
//!   server that is really down stays so. What was written on the replaced connection may
//!   still reach the server once a partition heals (TCP resends it): an attempt that lands so
//!   after its undo ran holds the lock for a token no guard holds until its TTL ends (or
//!   leaves a queue entry until the waiter TTL ends, handed the lock for at most that long).
//!   Bounded by the TTL, never two holders; Redlock, where a late undo could cost a majority,
//!   counts such undos (`redlock::Unsettled`). The other way, what the server wrote to the
//!   replaced connection may reach this client then too, while a command still waiting on it
//!   keeps it open: a grant a release published to a waiter before its last attempt was
//!   answered on the new connection. Taken as a handoff it made a second holder (that lease
//!   had lapsed and the lock was someone else's); a push tells whether its connection is
//!   still the current one (behind Sentinel: by its issuer number), and a grant from one that
//!   is not only wakes the waiter, which asks. Each command only reads which connection is
//!   current (a shared lock's read).
//!
//!   On the current connection too, redis-rs's connection manager (1.8) passes pushes to a
//!   task of its own while an answer goes straight to its caller: a grant read just before
//!   the answer to the waiter's next attempt may reach the waiter after that answer. So a
//!   queued attempt answered "held" also answers the fencing counter it drew, and a grant at
//!   or below it — published before the attempt ran, its lease lapsed by then — only wakes
//!   the waiter (`ReleaseHub::set_floor`).
//! * A cluster's connections (redis-rs's cluster client) run on a task of the runtime they were
//!   made on and never reconnect once it shuts down (an actix-web worker restarting, a set-up
//!   runtime dropped). Each is a `conn::ClusterLink`, made anew on the runtime of its next
//!   use — one reconnect however many callers find it gone; while no node answers, commands
//!   fail with [`LockError::Unavailable`]. A command the dead connection never sent is sent
//!   once more on the new one; one that may have run is not (its answer was lost: a release
//!   run twice would report its own lock lost, a handoff or an idempotency step would answer
//!   differently), and fails with [`LockError::Unavailable`] for the locker to settle as any
//!   lost answer. The subscriptions connection is made again at once, on the fallback thread,
//!   while local waiters exist (no command of theirs may come before the release they wait
//!   for); every new one subscribes again to the channels that still have waiters and wakes
//!   every waiter to re-check, as after a reconnect above.
//! * A cluster node's connection that drops (a master killed, a connection reset) took that
//!   node's subscriptions along, and redis-rs moves them to the shard's new master only once a
//!   command on the subscriptions connection has it read the slot map again. So on such a drop
//!   every channel is taken for unsubscribed and those with local waiters are subscribed again
//!   (`SSUBSCRIBE`, to the channel's current master), round after round until all are — through
//!   a failover — waking the waiters to re-check when one is.
//! * A cluster node's connection that went silent (a frozen master: no reset, no close) is one
//!   redis-rs keeps: it retries a timed-out command on the same node's connection and reads the
//!   slot map again only on an error a node answers (`MOVED`, …) or a dropped connection. So a
//!   timed-out command has the connection ask a node for the cluster's view (at most once a
//!   second), and once that shows a master failed over, send a live master a command for a slot
//!   it does not serve: its `MOVED` has redis-rs read the slot map again, and the frozen
//!   master's slots go to the promoted replica. Until the failover they answer
//!   [`LockError::Unavailable`]; the other shards are not affected.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use redis::aio::ConnectionManagerConfig;

use self::conn::{Conn, ScriptCall};
use redis::{IntoConnectionInfo, ProtocolVersion, PushInfo, PushKind, RedisError, Script};

use super::{
    AcquireArgs, Attempt, Backend, BoxFuture, ExtendItem, OwnerToken, ReleaseHub, WaitMode, Watch,
};
use crate::key::{LockKind, ResourceName};
use crate::LockError;

/// Lua: stops a script, before its first write, while its slot is being migrated away from this
/// node (Redis Cluster, `CLUSTER SETSLOT … MIGRATING`), with `TRYAGAIN`, which the cluster client
/// retries until the slot has moved. Redis (7.0) checks every command a script runs against the
/// slot's state: a key the script empties (the last waiter popped, the last holder removed, a
/// record deleted to be written anew) is then missing on this node, and the next command on it
/// fails with "non local key" — the script stopped half-way, its earlier writes kept (a waiter
/// popped off the queue and never handed the lock; a permit freed and reported lost). A key
/// that never exists (`KEYS[1]:~`, same slot) shows the state: a command on it fails only
/// while the slot migrates. On a stable slot it is one `EXISTS` answering 0, so the
/// uncontended lock paths, which delete nothing they touch again, go without it; and one
/// server or Sentinel, where no slot migrates, never runs it ([`guarded_script`]).
macro_rules! slot_guard {
    () => {
        r#"
if type(redis.pcall('EXISTS', KEYS[1] .. ':~')) == 'table' then
  return redis.error_reply('TRYAGAIN the slot of this key is being migrated')
end
"#
    };
}

/// `text` as a script for a cluster (`cluster`) — with its [`slot_guard!`]s — or for one server
/// or Sentinel, without them (no slot migrates there; each is a command per call).
pub(crate) fn guarded_script(text: &str, cluster: bool) -> Script {
    conn::script(&guarded_text(text, cluster))
}

fn guarded_text(text: &str, cluster: bool) -> std::borrow::Cow<'_, str> {
    if cluster {
        text.into()
    } else {
        text.replace(slot_guard!(), "").into()
    }
}

mod admin;
pub(crate) mod conn;
mod idempotency;
#[cfg(feature = "durable")]
pub(crate) mod job_scripts;
mod kinds;
mod scripts;
#[cfg(feature = "sentinel")]
pub(crate) mod sentinel;

const CHANNEL_SUFFIX: &str = "ch";
/// How many `SUBSCRIBE`s a round that subscribes again to every channel — on a new
/// connection, or Sentinel's new master — has on their way at once over one connection.
pub(super) const SUBSCRIBES_IN_FLIGHT: usize = 128;
const PIPELINE_CHUNK: usize = 512;

/// How often the cluster client retries a command the cluster answered with `TRYAGAIN`,
/// `CLUSTERDOWN`, `MOVED`/`ASK` or a broken connection, and the bounds of its wait before each
/// retry (ms; it doubles from the first). A script on a slot being resharded is told
/// `TRYAGAIN` until the slot's keys are together on one node again, which takes milliseconds
/// per slot; redis-rs's default waits at least 1.28 s per retry, longer than a command's
/// deadline. The waits add up to at most about 0.9 s; the locker's deadline ends them sooner.
#[cfg(feature = "cluster")]
const CLUSTER_RETRIES: u32 = 8;
#[cfg(feature = "cluster")]
const CLUSTER_RETRY_WAIT_MS: (u64, u64) = (5, 160);

/// Connection settings of the Redis backend. Defaults: command timeout 1 s, connect timeout
/// 1 s. Either is at most a day: a longer one (`Duration::MAX` for "no deadline") is taken as
/// a day.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RedisOptions {
    /// Deadline of every command (and of each reconnect attempt's wait).
    pub command_timeout: Duration,
    /// Deadline of establishing a connection.
    pub connect_timeout: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            command_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
        }
    }
}

impl RedisOptions {
    /// Sets [`command_timeout`](RedisOptions::command_timeout).
    pub fn command_timeout(mut self, d: Duration) -> Self {
        self.command_timeout = d;
        self
    }

    /// Sets [`connect_timeout`](RedisOptions::connect_timeout).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// These options with each timeout at most a day (`util::MAX_TIMEOUT`; the fields are
    /// public, so the setters cannot be the place).
    fn bounded(mut self) -> Self {
        self.command_timeout = self.command_timeout.min(crate::util::MAX_TIMEOUT);
        self.connect_timeout = self.connect_timeout.min(crate::util::MAX_TIMEOUT);
        self
    }
}

/// A lock store in one Redis server. Cheap to clone.
///
/// ```no_run
/// # async fn f() -> Result<(), dlock_runtime::LockError> {
/// use dlock_runtime::{backend::{RedisBackend, RedisOptions}, Locker};
///
/// let backend = RedisBackend::connect("redis://127.0.0.1:6379", RedisOptions::default()).await?;
/// let locker = Locker::new(backend);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("options", &self.inner.opts)
            .finish_non_exhaustive()
    }
}

struct Inner {
    conn: Conn,
    hub: Arc<ReleaseHub>,
    /// Channels this connection is subscribed to. Held only to read or change the set, never
    /// across a round trip — except by [`resubscribe_all`]'s round over a new connection.
    subscribed: tokio::sync::Mutex<HashSet<String>>,
    /// Channels whose `SUBSCRIBE` was sent but not seen confirmed — it failed, timed out, or
    /// its caller gave up on it (a waiter cancelled while it was on its way, a Redlock node
    /// past the node timeout) — while local waiters of the lock remain: the server may have
    /// run it, and redis-rs, which tracks the subscriptions the server confirms, subscribes
    /// them again whenever it reconnects. Unsubscribed like the subscribed ones when the
    /// lock's last local waiter leaves; changed under the channel's turn or holding
    /// `subscribed` (which `unsubscribe_if_unused` takes to look at both). (Before, such a
    /// subscription stayed for the life of the process: one for every lock whose waiter was
    /// cut off that way.)
    strays: std::sync::Mutex<HashSet<String>>,
    /// Per channel, the turn of its `SUBSCRIBE` or `UNSUBSCRIBE` on its way, held across the
    /// round trip and deciding under it with the hub, so one channel's subscribe and
    /// unsubscribe never overlap (nor reorder), while other channels' go on: a shard that does
    /// not answer (a frozen master) delays only its own channels. An entry lives while its
    /// turn is held or awaited ([`ChannelTurn`]).
    channel_turns: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Goes up (under `subscribed`) whenever the set is emptied for a new connection or a
    /// node's dropped one: a subscription sent before then may have gone to the connection
    /// before, and is sent again rather than noted.
    subs_epoch: AtomicU64,
    acquire: Script,
    release: Script,
    abandon: Script,
    extend: Script,
    raise_fence: Script,
    opts: RedisOptions,
    /// The largest fencing counter value this backend has been granted (see [`Floor::clock`]).
    fence_seen: AtomicU64,
    /// This backend's issuer number (see [`RedisBackend::ISSUER_BITS`]), [`NO_ISSUER`] until
    /// the first operation that may be granted a token has taken one.
    issuer: AtomicU64,
    /// A task is driving the reconnect to wake the waiters (see [`wake_after_reconnect`]).
    recovering: AtomicBool,
    /// A cluster: a task is subscribing again after a node's connection dropped (see
    /// [`resubscribe_after_disconnection`]).
    #[cfg(feature = "cluster")]
    resubscribing: AtomicBool,
    /// A cluster: another node's connection dropped since that task began its last round.
    #[cfg(feature = "cluster")]
    resubscribe_again: AtomicBool,
    /// Connections of their own for `WAIT` (`.replicas(n)`).
    dedicated: conn::Dedicated,
}

/// A `SUBSCRIBE` on its way (see [`Inner::strays`]): dropped unconfirmed, its channel is
/// noted as a stray; confirmed, it is not one any more.
struct Stray<'a> {
    inner: &'a Inner,
    channel: &'a str,
    confirmed: bool,
}

impl<'a> Stray<'a> {
    fn sending(inner: &'a Inner, channel: &'a str) -> Self {
        Stray {
            inner,
            channel,
            confirmed: false,
        }
    }

    fn confirmed(mut self) {
        self.confirmed = true;
    }
}

impl Drop for Stray<'_> {
    fn drop(&mut self) {
        let mut strays = self
            .inner
            .strays
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if self.confirmed {
            strays.remove(self.channel);
        } else {
            strays.insert(self.channel.to_owned());
        }
    }
}

/// A channel's turn ([`Inner::channel_turns`]); its entry goes with the last turn of it.
struct ChannelTurn<'a> {
    turns: &'a std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    channel: &'a str,
    held: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for ChannelTurn<'_> {
    fn drop(&mut self) {
        let mut turns = self.turns.lock().unwrap_or_else(PoisonError::into_inner);
        self.held = None;
        // Others waiting for the turn hold the mutex too: the entry stays for them.
        if turns
            .get(self.channel)
            .is_some_and(|t| Arc::strong_count(t) == 1)
        {
            turns.remove(self.channel);
        }
    }
}

impl Inner {
    /// Waits for `channel`'s turn (see [`Inner::channel_turns`]).
    async fn channel_turn<'a>(&'a self, channel: &'a str) -> ChannelTurn<'a> {
        // Made first: dropped while waiting, the wait (which holds the mutex) goes before it,
        // and the entry with the last of them.
        let mut turn = ChannelTurn {
            turns: &self.channel_turns,
            channel,
            held: None,
        };
        let mutex = self
            .channel_turns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(channel.to_owned())
            .or_default()
            .clone();
        turn.held = Some(mutex.lock_owned().await);
        turn
    }

    /// A `SUBSCRIBE` of `channel` that may have run but is not noted as subscribed (not
    /// answered in time, or its lock's waiters left meanwhile): a stray (see
    /// [`Inner::strays`]), unsubscribed with the lock's last local waiter — at once if none is
    /// left. Called by the tasks that subscribe again on their own and for the channels a
    /// Sentinel switch subscribed for nobody, in the channel's turn or holding `subscribed`.
    fn note_stray(self: &Arc<Self>, channel: &str) {
        self.strays
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(channel.to_owned());
        let resource = channel
            .strip_suffix(CHANNEL_SUFFIX)
            .and_then(|r| r.strip_suffix(':'));
        if let (Some(resource), Ok(rt)) = (resource, tokio::runtime::Handle::try_current()) {
            if !self.hub.has_waiters(resource) {
                rt.spawn(RedisBackend::unsubscribe_if_unused(
                    Arc::downgrade(self),
                    channel.to_owned(),
                    resource.to_owned(),
                ));
            }
        }
    }

    /// [`note_stray`](Inner::note_stray) for each of `channels`, in its turn (spawned on the
    /// current runtime; a no-op without one): the channels a Sentinel switch subscribed on the
    /// new master after their last local waiter left (see `sentinel::Switched`).
    #[cfg(feature = "sentinel")]
    fn note_strays_in_turn(self: &Arc<Self>, channels: Vec<String>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let inner = Arc::downgrade(self);
        rt.spawn(async move {
            let Some(inner) = inner.upgrade() else { return };
            futures_util::future::join_all(channels.iter().map(|channel| {
                let inner = &inner;
                async move {
                    let _turn = inner.channel_turn(channel).await;
                    inner.note_stray(channel);
                }
            }))
            .await;
        });
    }

    /// Whether a `SUBSCRIBE` or `UNSUBSCRIBE` of `channel` is on its way (or waits its turn).
    fn channel_busy(&self, channel: &str) -> bool {
        self.channel_turns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(channel)
    }

    /// The set of channels, emptied for a new connection: what it held.
    fn take_subscribed(&self, subscribed: &mut HashSet<String>) -> Vec<String> {
        self.subs_epoch.fetch_add(1, Ordering::AcqRel);
        subscribed.drain().collect()
    }

    /// Whether a push under issuer number `over` came from the connection commands go to now
    /// (Sentinel: each master followed, and each connection made anew to one when it went
    /// silent, takes a number of its own; one made anew because its runtime shut down keeps
    /// the number, but the old one went with that runtime. Elsewhere `None`, and the
    /// connection tells: `conn::LinkPush`).
    fn is_current(&self, over: Issuer) -> bool {
        match (over, &self.conn) {
            #[cfg(feature = "sentinel")]
            (Some(issuer), Conn::Sentinel(c)) => c.issuer_now() == issuer,
            _ => true,
        }
    }

    /// See [`RedisBackend::granted`].
    fn granted(&self, counter: u64, over: Issuer) -> Result<u64, LockError> {
        if counter > MAX_COUNTER {
            // Not noted as seen: the next floors would carry it on after the counter is fixed.
            return Err(LockError::misconfigured(
                format!(
                    "redis: the fencing counter is at {counter}, past 2^53 - 1: no token issued \
                     from it would be above the ones before (set by hand, or a client clock \
                     centuries ahead)"
                ),
                None,
            ));
        }
        self.fence_seen.fetch_max(counter, Ordering::AcqRel);
        let issuer = over.unwrap_or_else(|| self.issuer.load(Ordering::Acquire));
        debug_assert_ne!(
            issuer, NO_ISSUER,
            "a token granted before the issuer was taken"
        );
        Ok((counter << RedisBackend::ISSUER_BITS)
            | (issuer & ((1 << RedisBackend::ISSUER_BITS) - 1)))
    }
}

/// An acquire script's answer (see `scripts::acquire`): the shared encoding
/// ([`Attempt::from_reply`]), and the fencing counter a queued attempt answered "held" drew.
struct AcquireReply(i64, Option<u64>);

impl redis::FromRedisValue for AcquireReply {
    fn from_redis_value(v: redis::Value) -> Result<Self, redis::ParsingError> {
        match v {
            redis::Value::Array(items) => {
                let mut items = items.into_iter();
                let (Some(reply), Some(counter), None) = (items.next(), items.next(), items.next())
                else {
                    return Err("an acquire answer of other than two items".into());
                };
                Ok(AcquireReply(
                    i64::from_redis_value(reply)?,
                    Some(u64::from_redis_value(counter)?),
                ))
            }
            v => Ok(AcquireReply(i64::from_redis_value(v)?, None)),
        }
    }
}

/// The largest fencing counter a token is issued from: the scripts' numbers are Lua doubles,
/// exact below 2^53, and a token (`counter × 2^ISSUER_BITS + issuer`) must fit a `u64`. (A
/// Redlock token is a node's counter itself: the same bound.)
pub(crate) const MAX_COUNTER: u64 = (1 << 53) - 1;

/// The issuer number of the connection a reply came over, where it differs from the backend's
/// own ([`Inner::issuer`]): behind Sentinel, each master the backend follows is given a number
/// of its own (see `sentinel::Current::issuer`). `None`: the backend's own.
pub(crate) type Issuer = Option<u64>;

/// [`Inner::issuer`] before it is taken.
const NO_ISSUER: u64 = u64::MAX;

/// The key whose `INCR` numbers the backends of one Redis deployment (see
/// [`RedisBackend::ISSUER_BITS`]).
const ISSUERS_KEY: &str = "dlock:issuers";

/// A lower bound an acquire brings for its fencing token.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Floor {
    /// One server or a cluster: the counter is `INCR`ed and raised to this if below. The floor
    /// is above every token this backend has seen and at least its clock, in ms × 1000 (see
    /// [`Floor::clock`]).
    AtLeast(u64),
    /// A Redlock node: the counter takes exactly this (one `SET … GET`) unless it is already
    /// past it, so that the nodes' proposals agree (see `backend::redlock`).
    Exactly(u64),
}

impl Floor {
    /// The floor of a single server's or a cluster's acquire: `max(seen + 1, now in ms × 1000)`.
    /// The counter advances one per acquire, far slower than the clock, so each client raises
    /// it (one extra write) about once per millisecond and otherwise only `INCR`s it. Tokens
    /// are then strictly increasing while the counter lives, whatever the clocks do; and when
    /// the counter is lost or rolled back (a failover to a replica that missed the latest
    /// tokens, a restart without persistence), the floors carry the order on: the lost tokens
    /// are below the clocks of the moment they were issued (plus one per acquire within that
    /// millisecond), the next ones at least the clock after the failover — which takes
    /// seconds — unless the clients' clocks disagree by more than that.
    pub(crate) fn clock(seen: &AtomicU64) -> Floor {
        let now_ms = now_us() / 1000;
        Floor::AtLeast(
            seen.load(Ordering::Acquire)
                .saturating_add(1)
                .max(now_ms.saturating_mul(1000)),
        )
    }

    /// The floor of a Redlock acquire: above every token this backend has seen, at least its
    /// clock in µs, and distinct for concurrent acquires.
    pub(crate) fn exact(seen: &AtomicU64) -> Floor {
        let floor = seen.load(Ordering::Acquire).saturating_add(1).max(now_us());
        let prev = seen.fetch_max(floor, Ordering::AcqRel);
        Floor::Exactly(if prev >= floor {
            seen.fetch_add(1, Ordering::AcqRel) + 1
        } else {
            floor
        })
    }
}

fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// The push handler of a cluster backend's connections, and where it finds the backend (set
/// once the backend exists: the handler is needed to make the connection the backend holds).
#[cfg(feature = "cluster")]
#[allow(clippy::type_complexity)]
fn push_handler(
    hub: &Arc<ReleaseHub>,
    handoff: bool,
) -> (
    Arc<OnceLock<Weak<Inner>>>,
    impl Fn(PushInfo) -> Result<(), redis::aio::SendError> + Send + Sync + 'static,
) {
    let (me, handler) = issued_push_handler(hub, handoff);
    (me, move |push: PushInfo| {
        handler(push, None, true);
        Ok::<(), redis::aio::SendError>(())
    })
}

/// The push handler of one server's link, which tells whether each push came on the
/// connection commands go on now ([`conn::LinkPush`]).
fn link_push_handler(
    hub: &Arc<ReleaseHub>,
    handoff: bool,
) -> (Arc<OnceLock<Weak<Inner>>>, conn::LinkPush) {
    let (me, handler) = issued_push_handler(hub, handoff);
    (
        me,
        Arc::new(move |push: PushInfo, current: bool| handler(push, None, current)),
    )
}

/// The push handler of a backend's connections, told which issuer number each push is under
/// (Sentinel: see [`Issuer`]) and whether its connection is the one commands go on now, and
/// where it finds the backend (set once the backend exists: the handler is needed to make the
/// connection the backend holds).
#[allow(clippy::type_complexity)]
fn issued_push_handler(
    hub: &Arc<ReleaseHub>,
    handoff: bool,
) -> (
    Arc<OnceLock<Weak<Inner>>>,
    impl Fn(PushInfo, Issuer, bool) + Send + Sync + 'static,
) {
    let push_hub = Arc::downgrade(hub);
    let me: Arc<OnceLock<Weak<Inner>>> = Arc::new(OnceLock::new());
    let push_me = me.clone();
    let handler = move |push: PushInfo, issuer: Issuer, current: bool| {
        on_push(&push_hub, &push_me, handoff, push, issuer, current);
    };
    (me, handler)
}

/// Takes an issuer number (see [`RedisBackend::ISSUER_BITS`]) from the server `conn` reaches:
/// `INCR dlock:issuers` modulo `2^ISSUER_BITS`, again while the number is one of `avoid` (a
/// few times, then a random number outside `avoid`), all within `limit`.
///
/// * A server that refuses the command for good by its ACL (`NOPERM`: a user without that
///   key) gets a random number, unique among `2^ISSUER_BITS` only by chance.
/// * `LOADING`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN` and `READONLY` pass (a restart, a
///   failover, a replica named by mistake stays so): the `INCR` is tried again, a little later
///   each time, until `limit`, and then fails with [`LockError::Unavailable`] — never a random
///   number for the backend's life because the server was loading.
/// * `MOVED`/`ASK`: a node of a Redis Cluster named as one server, which answers for a part of
///   the keys only: [`LockError::Misconfigured`], naming `redis+cluster://`.
/// * Other errors fail as [`redis_err`] types them.
pub(super) async fn take_issuer<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    limit: Duration,
    avoid: &[u64],
) -> Result<u64, LockError> {
    issuers(conn, limit, 1, avoid).await
}

/// What connecting asks (see [`RedisBackend::connect`]): `INCRBY dlock:issuers 0`, answered as
/// [`take_issuer`]'s `INCR` is — a cluster node named as one server (`MOVED`), a replica named
/// by mistake (`READONLY`), a server still loading — without taking a number.
pub(super) async fn check_issuers<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    limit: Duration,
) -> Result<(), LockError> {
    issuers(conn, limit, 0, &[]).await.map(drop)
}

/// `INCRBY dlock:issuers <by>` as [`take_issuer`] describes it.
async fn issuers<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    limit: Duration,
    by: u64,
    avoid: &[u64],
) -> Result<u64, LockError> {
    use redis::{ErrorKind, ServerErrorKind};
    let mask = (1 << RedisBackend::ISSUER_BITS) - 1;
    let deadline = tokio::time::Instant::now() + limit;
    let late = || LockError::unavailable(format!("redis: no answer within {limit:?}"), None);
    let mut pause = Duration::from_millis(5);
    let mut taken_tries = 0;
    while taken_tries < 4 {
        let mut incr = redis::cmd("INCRBY");
        incr.arg(ISSUERS_KEY).arg(by);
        let answer = tokio::time::timeout_at(deadline, incr.query_async::<u64>(conn)).await;
        let e = match answer {
            Ok(Ok(n)) => {
                let taken = n & mask;
                if !avoid.contains(&taken) {
                    return Ok(taken);
                }
                taken_tries += 1;
                continue;
            }
            Ok(Err(e)) => e,
            Err(_) => return Err(late()),
        };
        match e.kind() {
            ErrorKind::Server(ServerErrorKind::NoPerm) => {
                tracing::debug!(error = %e, "redis: the ACL refuses an issuer number; a random one");
                break;
            }
            ErrorKind::Server(ServerErrorKind::Moved | ServerErrorKind::Ask) => {
                return Err(LockError::misconfigured(
                    "redis: this server is a node of a Redis Cluster (it answered MOVED or ASK): \
                     connect with redis+cluster://host:port,host:port",
                    None,
                ));
            }
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly,
            ) => {
                if tokio::time::Instant::now() + pause >= deadline {
                    return Err(LockError::unavailable(
                        format!(
                            "redis: no issuer number within {limit:?}: the server answers {}",
                            e.code().unwrap_or("an error")
                        ),
                        Some(Box::new(e)),
                    ));
                }
                tracing::debug!(error = %e, "redis: no issuer number yet; asking again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            _ => return Err(redis_err("issuer", e)),
        }
    }
    loop {
        let issuer = crate::util::next_random() & mask;
        if !avoid.contains(&issuer) {
            return Ok(issuer);
        }
    }
}

/// Whether a seed of a cluster refuses the sign-in for good (see
/// [`conn::refused_at_sign_in`]), asked of every seed at once: the refusal, if one did.
#[cfg(feature = "cluster")]
async fn refused_by_seeds(urls: &[String], limit: Duration) -> Option<LockError> {
    let asks = urls
        .iter()
        .filter_map(|u| redis::Client::open(u.as_str()).ok())
        .map(|client| async move { conn::refused_at_sign_in(&client, limit).await });
    futures_util::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .next()
}

fn redis_err(what: &str, e: RedisError) -> LockError {
    let permanent = refused_for_good(&e);
    LockError::backend(
        format!("redis {what}: {:?}", e.kind()),
        Some(Box::new(e)),
        permanent,
    )
}

/// Whether Redis refused in a way that retrying does not change ([`LockError::Misconfigured`]):
/// wrong or missing credentials, an ACL that denies the command or the key (`NOPERM`, also
/// from inside a script), or a lock key that holds another type (`WRONGTYPE`: something
/// else writes under this crate's prefix). `READONLY`, `LOADING`, `BUSY`, `OOM`, `TRYAGAIN`,
/// `CLUSTERDOWN`, `MASTERDOWN` and I/O errors pass with a failover, a restart or load, and
/// stay [`LockError::Unavailable`].
pub(crate) fn refused_for_good(e: &RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    let for_good = |code: &str| matches!(code, "NOAUTH" | "WRONGPASS" | "WRONGTYPE" | "NOPERM");
    matches!(
        e.kind(),
        ErrorKind::AuthenticationFailed
            | ErrorKind::InvalidClientConfig
            | ErrorKind::Server(ServerErrorKind::NoPerm)
    ) || e.code().is_some_and(for_good)
        // A pipeline's error (a batch of renewals) has no code of its own: its commands' errors
        // carry them.
        || (e.code().is_none()
            && e.clone()
                .into_server_errors()
                .is_some_and(|errors| errors.iter().any(|(_, s)| for_good(s.code()))))
}

impl RedisBackend {
    /// How long a lock's key outlives a lease that ended without a release: a lock key's
    /// `PTTL` is its lease plus this, so a key whose `PTTL` is at most this is a lapsed lock,
    /// free to take (what tools reading the keys should know; see the key layout in the
    /// module docs of `backend::redis::scripts`).
    pub const LINGER: Duration = scripts::LINGER;

    /// The low bits of a fencing token this backend hands out that name the backend it was
    /// granted to: a token is `counter × 2^ISSUER_BITS + issuer`, where `counter` is what the
    /// scripts issue (see the key layout in `backend::redis::scripts`) and `issuer` is this
    /// backend's number, `INCR dlock:issuers` modulo `2^ISSUER_BITS` when it first needs one —
    /// its first call that may be granted a token, not its connect, so read-only clients take
    /// none (a random number when the server's ACL refuses that command, `NOPERM`). Behind
    /// Sentinel every connection takes one on each master it follows.
    ///
    /// Tokens are ordered by their counter first, so the order they are granted in is their
    /// numeric order as before; the issuer only separates tokens that two masters issued from
    /// the same counter value while both took writes — a Sentinel or cluster master that was
    /// frozen, failed over, and woken, and granted locks before it was demoted. Two backends
    /// then never receive the same token, unless `2^ISSUER_BITS` other backends took a number
    /// between them. Behind Sentinel a backend takes a number on each master it follows,
    /// distinct from the numbers of the masters before, and a token carries the number of the
    /// master that granted it, so one backend's tasks never receive the same token either.
    /// Tokens come from counters below 2^53 (the scripts' numbers are Lua doubles), so a token
    /// fits a `u64`; a counter past that (set by hand, or a client clock centuries ahead)
    /// issues none — the acquire is [`LockError::Misconfigured`] and its lock is undone.
    pub const ISSUER_BITS: u32 = 11;

    /// Connects to `url` (`redis://[user:pass@]host:port[/db]`, or `rediss://` with feature
    /// `tls`). Fails with [`LockError::Unavailable`] if the server does not answer within the
    /// connect and command timeouts, and with [`LockError::Misconfigured`] if it refuses the
    /// sign-in (a wrong password or user) — whatever the timeouts.
    pub async fn connect(url: &str, opts: RedisOptions) -> Result<Self, LockError> {
        let backend = Self::build(url, opts, ReleaseHub::new(), true)?;
        // Establish the connection now, so a wrong URL, a down server, a cluster node or a
        // replica fails at startup (`check_issuers`). The issuer number waits for the first
        // call that may be granted a token: taken here, every read-only client (an operator's
        // `dlock list` every few seconds, a health check) used one up, and after
        // 2^ISSUER_BITS of them two live backends could share a number.
        if let Err(e) = backend.check_issuers().await {
            return Err(backend.refused_at_sign_in(e).await);
        }
        backend.check_eviction_policy().await;
        Ok(backend)
    }

    /// Warns when the server (the master, behind Sentinel) may evict keys under memory
    /// pressure: every lock key has a TTL,
    /// so a `volatile-*` policy evicts held locks (and an `allkeys-*` one the fencing counter
    /// too), and the next locker is granted a lock that is still held. One `CONFIG GET` at
    /// connect; a server that refuses it (an ACL, a managed Redis without `CONFIG`) is not
    /// checked.
    pub(crate) async fn check_eviction_policy(&self) {
        if self.is_cluster() {
            return; // a keyless command reaches one node of many: not a check of the cluster
        }
        let mut conn = self.inner.conn.clone();
        if let Some(policy) =
            conn::evicting_policy(&mut conn, self.inner.opts.command_timeout).await
        {
            tracing::warn!(
                policy = %policy,
                "dlock: this Redis evicts keys under memory pressure (maxmemory-policy \
                 {policy}): every lock key has a TTL, so a held lock can be evicted and \
                 granted to another owner; set `maxmemory-policy noeviction`"
            );
        }
    }

    /// Like [`connect`](RedisBackend::connect) but does not wait for the server: the
    /// connection is made on first use (and retried after). Release notifications are delivered
    /// into `hub`, which several backends may share (Redlock does, across its nodes).
    ///
    /// The connection's task starts on the current tokio runtime: called outside one, this
    /// fails with [`LockError::Unsupported`].
    pub fn connect_lazy(
        url: &str,
        opts: RedisOptions,
        hub: Arc<ReleaseHub>,
    ) -> Result<Self, LockError> {
        Self::build(url, opts, hub, true)
    }

    /// A Redlock node: like [`connect_lazy`](RedisBackend::connect_lazy), but a grant published
    /// by a release only wakes the waiter (one node's grant is not the lock).
    pub(crate) fn redlock_node(
        url: &str,
        opts: RedisOptions,
        hub: Arc<ReleaseHub>,
    ) -> Result<Self, LockError> {
        Self::build(url, opts, hub, false)
    }

    fn build(
        url: &str,
        opts: RedisOptions,
        hub: Arc<ReleaseHub>,
        // Whether a grant published by a release is taken as one (a single server, whose
        // pushes come on the attempts' connection). A Redlock node's grant is one node's
        // vote, so there it only wakes the waiter.
        handoff: bool,
    ) -> Result<Self, LockError> {
        let opts = opts.bounded();
        // The connection manager starts its task at once (`tokio::spawn`), which panics
        // outside a runtime.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(LockError::unsupported(
                "redis",
                "connecting outside a tokio runtime",
            ));
        }
        // The URL may carry a password: never put it in an error message.
        let info = url.into_connection_info().map_err(|e| {
            LockError::misconfigured(format!("invalid redis url: {:?}", e.kind()), None)
        })?;
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let info = info.set_redis_settings(settings);
        let client = redis::Client::open(info).map_err(|e| redis_err("client", e))?;

        let (me, push) = link_push_handler(&hub, handoff);
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(opts.connect_timeout))
            .set_response_timeout(Some(opts.command_timeout))
            .set_number_of_retries(2)
            .set_max_delay(opts.connect_timeout)
            .set_automatic_resubscription();
        let probe = opts.command_timeout;
        let conn = conn::ServerLink::new(client.clone(), config, Some(push), probe)
            .map_err(|e| redis_err("connect", e))?;
        // A silent connection replaced: the new one is subscribed to nothing.
        let me_remade = me.clone();
        conn.on_remade(move || {
            if let (Some(inner), Ok(rt)) = (me_remade.get(), tokio::runtime::Handle::try_current())
            {
                rt.spawn(resubscribe_all(inner.clone()));
            }
        });
        Ok(Self::with_conn(
            Conn::Server(conn),
            opts,
            hub,
            &me,
            conn::Reconnect::Single(Box::new(client)),
        ))
    }

    /// Connects to a Redis Cluster through any of its nodes (`redis://host:port` each, or
    /// `rediss://` with feature `tls`): every command of a lock goes to its slot's master, and
    /// `MOVED`/`ASK` and topology changes are followed by redis-rs's cluster client. Release
    /// notifications use sharded pub/sub (`SSUBSCRIBE`, Redis 7). Fails with
    /// [`LockError::Unavailable`] if no node answers within the connect timeout, and with
    /// [`LockError::Misconfigured`] if a node refuses the sign-in (a wrong password or user).
    #[cfg(feature = "cluster")]
    pub async fn connect_cluster(urls: &[String], opts: RedisOptions) -> Result<Self, LockError> {
        let opts = opts.bounded();
        let hub = ReleaseHub::new();
        // A grant published by a release only wakes the waiter: the pushes come on the
        // subscriptions' own connections, not in order with the answers to the waiter's
        // attempts (see `Backend`'s module docs), so a late one could name a handed-over lease
        // that lapsed before the waiter's last attempt. Woken, the waiter asks and is granted
        // what is already its own.
        let (me, push) = push_handler(&hub, false);
        // The URLs may carry a password: never put them in an error message.
        let invalid = |e: RedisError| {
            LockError::misconfigured(format!("invalid redis cluster urls: {:?}", e.kind()), None)
        };
        let builder = || {
            redis::cluster::ClusterClient::builder(urls.iter().map(String::as_str))
                .use_protocol(ProtocolVersion::RESP3)
                .connection_timeout(opts.connect_timeout)
                .response_timeout(opts.command_timeout)
                .retries(CLUSTER_RETRIES)
                .min_retry_wait(CLUSTER_RETRY_WAIT_MS.0)
                .max_retry_wait(CLUSTER_RETRY_WAIT_MS.1)
                .retry_wait_formula(CLUSTER_RETRY_WAIT_MS.0, 2)
        };
        let client = builder().push_sender(push).build().map_err(invalid)?;
        let limit = opts.connect_timeout + opts.command_timeout;
        let cmds = match conn::ClusterLink::connect(client.clone(), limit).await {
            Ok(cmds) => cmds,
            // The cluster client reports a refused sign-in as an I/O error: ask the seeds.
            Err(e) => return Err(refused_by_seeds(urls, limit).await.unwrap_or(e)),
        };
        let subs = conn::ClusterLink::connect(client, limit).await?;
        let me_subs = me.clone();
        subs.on_event(move |event| {
            if let Some(inner) = me_subs.get() {
                on_subs_event(inner, event);
            }
        });
        let conn = Conn::Cluster { cmds, subs };
        // Dedicated connections (for `WAIT`) carry no pushes.
        let plain = builder().build().map_err(invalid)?;
        let backend = Self::with_conn(
            conn,
            opts,
            hub,
            &me,
            conn::Reconnect::Cluster(Box::new(plain)),
        );
        // Connected (see `connect`: the issuer number waits for the first grant).
        backend.check_issuers().await?;
        Ok(backend)
    }

    /// Connects to the master of a Sentinel-monitored group,
    /// `redis+sentinel://[user:pass@]s1:p1,s2:p2,…/<master-name>[/<db>][?sentinel_username=…&sentinel_password=…]`
    /// (`rediss+sentinel://` with feature `tls`): the sentinels name the master, and the backend
    /// follows a failover to the next one (see [`Locker::from_url`](crate::Locker::from_url) for
    /// what a failover keeps). The userinfo's credentials and the database are the servers'; the
    /// sentinels sign in with `sentinel_password` (and `sentinel_username` for an ACL user,
    /// both percent-encoded) when given, else without credentials. Fails with
    /// [`LockError::Misconfigured`] if every sentinel refuses for good (the sign-in, or a
    /// master name it does not monitor), and with [`LockError::Unavailable`] if no sentinel
    /// names a live master within the connect timeout plus the command timeout.
    #[cfg(feature = "sentinel")]
    pub async fn connect_sentinel(url: &str, opts: RedisOptions) -> Result<Self, LockError> {
        let opts = opts.bounded();
        let parsed = sentinel::SentinelUrl::parse(url)?;
        let hub = ReleaseHub::new();
        let (me, push) = issued_push_handler(&hub, true);
        let push: sentinel::PushFn = Arc::new(push);
        let conn = sentinel::SentinelConn::connect(
            &parsed,
            opts.connect_timeout,
            opts.command_timeout,
            Some(push),
            Some(Arc::downgrade(&hub)),
        )
        .await?;
        // The first master's issuer number, taken by the connection (see [`Issuer`]).
        let first = conn.issuer();
        let me_strays = me.clone();
        conn.on_stray(Box::new(move |channels| {
            if let Some(inner) = me_strays.get().and_then(Weak::upgrade) {
                inner.note_strays_in_turn(channels);
            }
        }));
        let backend = Self::with_conn(
            Conn::Sentinel(conn),
            opts,
            hub,
            &me,
            conn::Reconnect::FromConn,
        );
        backend.inner.issuer.store(first, Ordering::Release);
        backend.check_eviction_policy().await;
        Ok(backend)
    }

    /// The master's address (`host:port`) as the sentinels named it last, when this backend is
    /// behind Sentinel.
    #[cfg(feature = "sentinel")]
    pub fn sentinel_master(&self) -> Option<String> {
        match &self.inner.conn {
            Conn::Sentinel(c) => Some(c.master_addr()),
            _ => None,
        }
    }

    fn with_conn(
        conn: Conn,
        opts: RedisOptions,
        hub: Arc<ReleaseHub>,
        me: &OnceLock<Weak<Inner>>,
        reconnect: conn::Reconnect,
    ) -> Self {
        let cluster = conn.is_cluster();
        let dedicated = conn::Dedicated::new(reconnect, opts.connect_timeout, opts.command_timeout);
        let backend = RedisBackend {
            inner: Arc::new(Inner {
                conn,
                hub,
                subscribed: tokio::sync::Mutex::new(HashSet::new()),
                strays: std::sync::Mutex::new(HashSet::new()),
                channel_turns: std::sync::Mutex::new(HashMap::new()),
                subs_epoch: AtomicU64::new(0),
                acquire: scripts::acquire(cluster),
                release: scripts::release(cluster),
                abandon: scripts::abandon(cluster),
                extend: scripts::extend(),
                raise_fence: scripts::raise_fence(),
                opts,
                fence_seen: AtomicU64::new(0),
                issuer: AtomicU64::new(NO_ISSUER),
                recovering: AtomicBool::new(false),
                #[cfg(feature = "cluster")]
                resubscribing: AtomicBool::new(false),
                #[cfg(feature = "cluster")]
                resubscribe_again: AtomicBool::new(false),
                dedicated,
            }),
        };
        let _ = me.set(Arc::downgrade(&backend.inner));
        backend
    }

    /// The key of the fencing counter `resource` draws from: `<prefix>:fence` on one server;
    /// on a cluster one per slot, `<prefix>:{<tag>}:fence` with a tag of the lock's slot, so
    /// the lock's scripts can reach it.
    pub(crate) fn fence_key<'a>(&self, resource: &'a ResourceName) -> FenceKey<'a> {
        #[cfg(feature = "cluster")]
        let tag = self
            .inner
            .conn
            .is_cluster()
            .then(|| conn::slot_tag(conn::slot(resource.key().as_str())));
        #[cfg(not(feature = "cluster"))]
        let tag = None;
        FenceKey {
            prefix: resource.namespace_prefix(),
            tag,
        }
    }

    /// A call of a lock's `script`: the lock's key, then, on a cluster, the keys the script
    /// derives from it ([`lock_call_with`](Self::lock_call_with)).
    fn lock_call<'s>(&self, script: &'s Script, resource: &ResourceName) -> ScriptCall<'s> {
        self.lock_call_with(script, resource, None, &scripts::QUEUE_SUFFIXES)
    }

    /// A call of `script` on `resource`'s lock: the lock's key, then `extra` (a key of the
    /// script's own), then, on a cluster, the keys the script derives — the slot's fencing
    /// counter and the lock's queue keys, `<lock key>:<suffix>` for each of `queue`.
    ///
    /// Why a cluster needs the derived keys declared: the scripts still derive them (these
    /// `KEYS` are for the cluster's routing), but while a slot is being resharded, Redis
    /// routes a script by its declared keys only. Declaring just the lock's key let a script
    /// that found it missing on the `MIGRATING` source be sent (`ASK`) to the `IMPORTING`
    /// target and create the slot's fencing counter there while the source still had it —
    /// the `MIGRATE` of the counter then failed (`BUSYKEY`) and the reshard stopped half-way
    /// —, and a script running on the source failed ("non local key") on a derived key
    /// already moved or not yet created. With every key declared, a script runs only on a
    /// node that holds all of them, and is told `TRYAGAIN` (retried by the cluster client)
    /// while they are split or missing during the move.
    fn lock_call_with<'s>(
        &self,
        script: &'s Script,
        resource: &ResourceName,
        extra: Option<&str>,
        queue: &[&str],
    ) -> ScriptCall<'s> {
        let derived = if self.is_cluster() {
            1 + queue.len()
        } else {
            0
        };
        let mut call = ScriptCall::new(script, 1 + usize::from(extra.is_some()) + derived);
        call.key(resource.as_str());
        if let Some(extra) = extra {
            call.key(extra);
        }
        if self.is_cluster() {
            call.key(self.fence_key(resource));
            for suffix in queue {
                call.key(resource.with_suffix(suffix));
            }
        }
        call
    }

    /// This client's fencing floor (see [`Floor::clock`]), for scripts that may issue a token.
    pub(crate) fn floor(&self) -> u64 {
        let (Floor::AtLeast(f) | Floor::Exactly(f)) = Floor::clock(&self.inner.fence_seen);
        f
    }

    /// Notes a fencing counter value this backend was granted, and makes it the token it
    /// reports (see [`RedisBackend::ISSUER_BITS`]) with the issuer number of the connection
    /// whose reply granted it (`over`, from [`run_granting`](Self::run_granting)). The
    /// backend's own number was taken before the operation that issued `counter`
    /// ([`RedisBackend::issuer`]). [`LockError::Misconfigured`] for a counter past 2^53 - 1,
    /// from which no token can be issued above the ones before: the lock the script granted is
    /// then undone as any attempt that failed.
    pub(crate) fn granted(&self, counter: u64, over: Issuer) -> Result<u64, LockError> {
        self.inner.granted(counter, over)
    }

    /// This backend's issuer number, taken from the server on first use (one `INCR`).
    /// [`check_issuers`] on this backend's connection (what connecting asks).
    async fn check_issuers(&self) -> Result<(), LockError> {
        let mut conn = self.inner.conn.clone();
        let limit = self.inner.opts.connect_timeout + self.inner.opts.command_timeout;
        check_issuers(&mut conn, limit).await.inspect_err(|_| {
            // Perhaps a timeout on a silent connection (a check is only a `PING`).
            self.inner.conn.timed_out();
        })
    }

    pub(crate) async fn issuer(&self) -> Result<u64, LockError> {
        let issuer = self.inner.issuer.load(Ordering::Acquire);
        if issuer != NO_ISSUER {
            return Ok(issuer);
        }
        let mut conn = self.inner.conn.clone();
        let limit = self.inner.opts.connect_timeout + self.inner.opts.command_timeout;
        let issuer = match take_issuer(&mut conn, limit, &[]).await {
            Ok(issuer) => issuer,
            Err(e) => {
                // Perhaps a timeout on a silent connection (a check is only a `PING`).
                self.inner.conn.timed_out();
                return Err(e);
            }
        };
        Ok(
            match self.inner.issuer.compare_exchange(
                NO_ISSUER,
                issuer,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => issuer,
                Err(first) => first,
            },
        )
    }

    /// Whether this backend talks to a cluster.
    pub(crate) fn is_cluster(&self) -> bool {
        self.inner.conn.is_cluster()
    }

    /// `e`, an answer of this server at connect — or, when `e` is no answer in time and the
    /// server refuses the sign-in for good, that refusal: the manager retries a refused
    /// sign-in like a dropped connection, so with short timeouts its tries outlast the
    /// deadline, and one direct try tells the two apart (`conn::refused_at_sign_in`).
    pub(crate) async fn refused_at_sign_in(&self, e: LockError) -> LockError {
        if !e.is_unavailable() {
            return e;
        }
        let limit = self.inner.opts.connect_timeout + self.inner.opts.command_timeout;
        self.inner.conn.refused_at_sign_in(limit).await.unwrap_or(e)
    }

    /// Round trip to the server (connects first if needed).
    pub async fn ping(&self) -> Result<(), LockError> {
        let mut conn = self.inner.conn.clone();
        let limit = self.inner.opts.connect_timeout + self.inner.opts.command_timeout;
        match tokio::time::timeout(limit, redis::cmd("PING").query_async::<()>(&mut conn)).await {
            Ok(r) => r.map_err(|e| self.failed("ping", e)),
            Err(_) => {
                self.inner.conn.timed_out();
                Err(LockError::unavailable(
                    format!("redis ping timed out after {limit:?}"),
                    None,
                ))
            }
        }
    }

    /// Makes sure this connection is subscribed to `resource`'s release channel. Under the
    /// channel's turn only: a subscription to a shard that does not answer holds up no other
    /// channel's.
    pub(crate) async fn ensure_subscribed(&self, resource: &ResourceName) -> Result<(), LockError> {
        let channel = resource.with_suffix(CHANNEL_SUFFIX);
        let _turn = self.inner.channel_turn(&channel).await;
        loop {
            let epoch = {
                let subscribed = self.inner.subscribed.lock().await;
                // A cluster's subscriptions connection that died with its runtime took its
                // subscriptions along: subscribing makes it anew (and `resubscribe_all` the
                // rest).
                if subscribed.contains(&channel) && self.inner.conn.subscriptions_alive() {
                    return Ok(());
                }
                self.inner.subs_epoch.load(Ordering::Acquire)
            };
            let mut conn = self.inner.conn.clone();
            let stray = Stray::sending(&self.inner, &channel);
            self.deadline("subscribe", conn.subscribe(&channel)).await?;
            let mut subscribed = self.inner.subscribed.lock().await;
            if self.inner.subs_epoch.load(Ordering::Acquire) == epoch {
                // Noted as subscribed before it is no longer a stray: cut off in between
                // (waiting for the set), it would be neither, and stay subscribed for good.
                subscribed.insert(channel.clone());
                stray.confirmed();
                return Ok(());
            }
            // The set was emptied for a new connection meanwhile: this subscription may have
            // gone to the one before (a stray, should redis-rs subscribe it there again). Once
            // more.
        }
    }

    /// Drops the subscription to `resource`'s channel if no local waiter needs it any more
    /// (spawned on the current runtime; a no-op without one).
    pub(crate) fn unsubscribe_later(&self, resource: &str) {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let channel = format!("{resource}:{CHANNEL_SUFFIX}");
            rt.spawn(Self::unsubscribe_if_unused(
                Arc::downgrade(&self.inner),
                channel,
                resource.to_owned(),
            ));
        }
    }

    /// Raises the key's fencing counter to at least `token` (Redlock: every granting node is
    /// raised to the majority's maximum).
    pub(crate) async fn raise_fence(
        &self,
        resource: &ResourceName,
        token: u64,
    ) -> Result<(), LockError> {
        let mut conn = self.inner.conn.clone();
        let mut call = ScriptCall::new(&self.inner.raise_fence, 1);
        call.key(self.fence_key(resource)).arg(token);
        self.deadline("raise fence", call.invoke::<i64>(&mut conn))
            .await
            .map(|_| ())
    }

    /// The connection options in force.
    pub fn options(&self) -> &RedisOptions {
        &self.inner.opts
    }

    /// Awaits a command. Its deadline is the connection's response timeout
    /// ([`RedisOptions::command_timeout`]), which fails a hung command with a timeout error;
    /// the [`Locker`](crate::Locker) adds its own deadline on top, so the hot path needs no
    /// extra timer here.
    async fn deadline<T>(
        &self,
        what: &str,
        fut: impl std::future::Future<Output = Result<T, RedisError>>,
    ) -> Result<T, LockError> {
        self.deadline_on(&self.inner.conn, what, fut).await
    }

    /// [`deadline`](Self::deadline) for a command on `conn` (a connection for `WAIT`): a
    /// timeout there has `conn` checked.
    async fn deadline_on<T>(
        &self,
        conn: &Conn,
        what: &str,
        fut: impl std::future::Future<Output = Result<T, RedisError>>,
    ) -> Result<T, LockError> {
        let mut sent = Sent::new(conn);
        let r = fut.await;
        sent.answered();
        r.map_err(|e| {
            conn.failed(&e);
            redis_err(what, e)
        })
    }

    /// The error of a failed command, after telling the connection (a timeout has the
    /// connection checked: see [`Conn::failed`]).
    fn failed(&self, what: &str, e: RedisError) -> LockError {
        self.inner.conn.failed(&e);
        redis_err(what, e)
    }

    /// Runs a lock script (one that [declares](RedisBackend::lock_call_with) its derived
    /// keys on a cluster). While its slot is `MIGRATING`, Redis (7.0) checks every command a
    /// script runs against the slot's state, and a script that empties a key and then touches
    /// it again fails there with "non local key", its earlier writes kept: every script that
    /// may do so stops before its first write while the slot migrates (`slot_guard!`,
    /// answered `TRYAGAIN`, which the cluster client retries). Should one fail that way all the
    /// same, it is run again, at most twice: a key now missing, the cluster answers `TRYAGAIN`
    /// or `ASK` until the slot has moved, which the cluster client follows.
    async fn run_script<T: redis::FromRedisValue>(
        &self,
        what: &str,
        call: &ScriptCall<'_>,
    ) -> Result<T, LockError> {
        Ok(self.run_granting(what, call).await?.0)
    }

    /// [`run_script`](Self::run_script) for a script that may grant a fencing counter value:
    /// also the issuer number of the connection its reply came over, for
    /// [`granted`](Self::granted).
    async fn run_granting<T: redis::FromRedisValue>(
        &self,
        what: &str,
        call: &ScriptCall<'_>,
    ) -> Result<(T, Issuer), LockError> {
        let mut conn = self.inner.conn.clone();
        let mut again = 2;
        let mut resend = true;
        loop {
            let mut sent = Sent::new(&self.inner.conn);
            let r = call.invoke(&mut conn).await;
            sent.answered();
            match r {
                Err(e)
                    if again > 0
                        && self.is_cluster()
                        && e.to_string().contains("non local key") =>
                {
                    again -= 1;
                }
                // Never sent (a cluster connection whose runtime shut down as it was sent): once
                // more, on the connection made in its place. A script whose answer was lost is
                // not sent again: it may have run (see the module docs).
                Err(e) if resend && conn.never_sent(&e) => resend = false,
                r => return Ok((r.map_err(|e| self.failed(what, e))?, conn.replied_issuer())),
            }
        }
    }

    async fn owner_script(
        &self,
        script: &Script,
        what: &str,
        resource: &ResourceName,
        token: &OwnerToken,
    ) -> Result<i64, LockError> {
        let mut call = self.lock_call(script, resource);
        call.arg(token.as_str())
            .arg(self.fence_key(resource))
            .arg(self.floor());
        self.run_script(what, &call).await
    }

    async fn unsubscribe_if_unused(inner: Weak<Inner>, channel: String, resource: String) {
        let Some(inner) = inner.upgrade() else { return };
        // A waiter that comes meanwhile waits for this turn, and subscribes after it.
        let _turn = inner.channel_turn(&channel).await;
        {
            let mut subscribed = inner.subscribed.lock().await;
            if inner.hub.has_waiters(&resource) {
                return;
            }
            let stray = inner
                .strays
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&channel);
            if !stray && !subscribed.contains(&channel) {
                return;
            }
            // Gone with a cluster's subscriptions connection: no connection is made to drop it.
            if !inner.conn.subscriptions_alive() {
                subscribed.remove(&channel);
                return;
            }
        }
        let mut conn = inner.conn.clone();
        let answered =
            tokio::time::timeout(inner.opts.command_timeout, conn.unsubscribe(&channel)).await;
        // Forgotten whatever the answer: an unsubscribe that failed or timed out may have been
        // run (a server frozen past the timeout runs it when it wakes), and a channel kept here
        // that the server dropped would never be subscribed again — the key's next waiters
        // would sleep through their handoffs. A subscription the server kept only brings a
        // stray notification, which is harmless; the next waiter subscribes again.
        inner.subscribed.lock().await.remove(&channel);
        match answered {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                inner.conn.failed(&e);
                tracing::debug!(error = ?e.kind(), "redis unsubscribe failed");
            }
            Err(_) => {
                inner.conn.timed_out();
                tracing::debug!("redis unsubscribe timed out");
            }
        }
    }
}

/// Drives the reconnect (a `PING` through the connection manager, which resubscribes before
/// it answers) while local waiters exist, then wakes every one of them to re-check the lock:
/// a release published while the connection was down never reached them.
async fn wake_after_reconnect(inner: Weak<Inner>) {
    let mut pause = Duration::from_millis(50);
    loop {
        let Some(me) = inner.upgrade() else { return };
        if me.hub.watched() == 0 {
            me.recovering.store(false, Ordering::Release);
            return;
        }
        let mut conn = me.conn.clone();
        let ping = redis::cmd("PING");
        let answer =
            tokio::time::timeout(me.opts.command_timeout, ping.query_async::<()>(&mut conn));
        let answer = answer.await;
        match &answer {
            Ok(Err(e)) => me.conn.failed(e),
            Err(_) => me.conn.timed_out(),
            Ok(Ok(())) => {}
        }
        if let Ok(Ok(())) = answer {
            me.recovering.store(false, Ordering::Release);
            me.hub.notify_all();
            tracing::debug!("redis connection back; local waiters woken to re-check");
            return;
        }
        drop(me);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// Subscribes again to `resource`'s channel while it has local waiters (its subscription was
/// dropped by the server: the slot moved), then wakes the waiters to re-check: releases
/// published meanwhile were missed. A `SUBSCRIBE` that fails (the slot's new master not
/// answering yet) is tried again after a pause (50 ms, doubling to 1 s), the waiters woken
/// again once it lands: given up after one try, the channel stayed unsubscribed for the rest
/// of those waiters' wait, and every release was heard only by their fallback timers.
async fn resubscribe(inner: Weak<Inner>, resource: String) {
    let channel = format!("{resource}:{CHANNEL_SUFFIX}");
    let mut pause = Duration::from_millis(50);
    let mut first = true;
    loop {
        let Some(me) = inner.upgrade() else { return };
        let turn = me.channel_turn(&channel).await;
        let epoch = {
            let mut subscribed = me.subscribed.lock().await;
            if !me.hub.has_waiters(&resource) {
                // No longer subscribed, nor wanted.
                subscribed.remove(&channel);
                return;
            }
            // A later try, and a waiter subscribed it meanwhile (or a new connection's round
            // did): done — the waiters re-check, as releases were missed until then.
            if !first && subscribed.contains(&channel) {
                drop(subscribed);
                drop(turn);
                me.hub.notify_all();
                return;
            }
            me.subs_epoch.load(Ordering::Acquire)
        };
        let mut conn = me.conn.clone();
        let ok = matches!(
            tokio::time::timeout(me.opts.command_timeout, conn.subscribe(&channel)).await,
            Ok(Ok(()))
        );
        let done = {
            let mut subscribed = me.subscribed.lock().await;
            if me.subs_epoch.load(Ordering::Acquire) != epoch {
                // The set was emptied for a new connection meanwhile: this subscription may
                // have gone to the one before. Done if that round subscribed the channel (it
                // was in the set, unless a try here failed); else tried again.
                subscribed.contains(&channel)
            } else if ok {
                subscribed.insert(channel.clone());
                true
            } else {
                // Not taken for subscribed: a waiter that comes meanwhile subscribes itself.
                subscribed.remove(&channel);
                me.note_stray(&channel);
                false
            }
        };
        drop(turn);
        if first || done {
            me.hub.notify_all();
        }
        if done {
            return;
        }
        first = false;
        drop(me);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// What a cluster backend does when its subscriptions connection died with its runtime, or
/// was made anew (see [`conn::LinkEvent`]).
#[cfg(feature = "cluster")]
fn on_subs_event(inner: &Weak<Inner>, event: conn::LinkEvent) {
    let Some(me) = inner.upgrade() else { return };
    match event {
        // Told inside the dying runtime's shutdown: waiters whose channels died with it are
        // deaf until the connection is made again, so it is made now, on the fallback thread
        // (a command made on any other runtime would do the same, but none may come).
        conn::LinkEvent::Gone if me.hub.watched() > 0 => match crate::util::fallback_runtime() {
            Some(rt) => {
                rt.spawn(remake_subscriptions(inner.clone()));
            }
            None => tracing::warn!(
                "dlock could not start its fallback thread; waiters of a cluster whose \
                 runtime shut down re-check on their timers"
            ),
        },
        conn::LinkEvent::Gone => {}
        conn::LinkEvent::Remade => {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(resubscribe_all(inner.clone()));
            }
        }
    }
}

/// Makes a cluster's subscriptions connection again (its runtime shut down) while local waiters
/// exist, pausing between failed attempts; the new connection then subscribes to what is still
/// wanted ([`resubscribe_all`], on `Remade`).
#[cfg(feature = "cluster")]
async fn remake_subscriptions(inner: Weak<Inner>) {
    let mut pause = Duration::from_millis(50);
    loop {
        let Some(me) = inner.upgrade() else { return };
        let Conn::Cluster { subs, .. } = &me.conn else {
            return;
        };
        if me.hub.watched() == 0 {
            return;
        }
        let mut subs = subs.clone();
        match subs.connected().await {
            Ok(()) => return,
            Err(e) => {
                tracing::debug!(error = ?e.kind(), "redis cluster subscriptions: no reconnect yet")
            }
        }
        drop(me);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// A cluster's subscriptions connection was made anew, subscribed to nothing (the one before
/// died with its runtime), or one server's connection replaced (it went silent): subscribes
/// again to the channels of locks that still have local waiters, forgets the others, then
/// wakes every waiter to re-check — releases published while no connection listened were
/// missed.
///
/// A channel whose `SUBSCRIBE` fails while the connection counts as alive (one server's is
/// always: it was replaced because the server did not answer, and may still not) is tried
/// again after a pause (50 ms, doubling to 1 s) for as long as its lock has local waiters.
/// Dropped, it stayed unsubscribed for the rest of those waiters' wait — nothing else
/// subscribes a waiter that has its watch already — and every release was heard only by their
/// fallback timers.
async fn resubscribe_all(inner: Weak<Inner>) {
    use futures_util::StreamExt as _;
    let mut pause = Duration::from_millis(50);
    let mut again: Option<Vec<String>> = None;
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let mut subscribed = strong.subscribed.lock().await;
        let conn = strong.conn.clone();
        let wanted = |channel: &String| {
            channel
                .strip_suffix(CHANNEL_SUFFIX)
                .and_then(|r| r.strip_suffix(':'))
                .is_some_and(|r| strong.hub.has_waiters(r))
        };
        let first = again.is_none();
        let channels: Vec<String> = match again.take() {
            None => strong
                .take_subscribed(&mut subscribed)
                .into_iter()
                .filter(wanted)
                .collect(),
            // A waiter may have subscribed it meanwhile (`ensure_subscribed`).
            Some(failed) => failed
                .into_iter()
                .filter(|c| wanted(c) && !subscribed.contains(c))
                .collect(),
        };
        let (mut failed, mut heard) = (Vec::new(), false);
        // Many at once: one after another, thousands of waited-on locks took a round trip
        // each before any waiter was woken. The first not answered stops the round: the rest
        // would not be answered either.
        let limit = strong.opts.command_timeout;
        let mut confirmed = vec![false; channels.len()];
        // (Owned: a future borrowing the list is not `Send` for every lifetime.)
        let mut answers = futures_util::stream::iter(channels.clone().into_iter().enumerate())
            .map(|(i, channel)| {
                let mut conn = conn.clone();
                async move {
                    let ok = matches!(
                        tokio::time::timeout(limit, conn.subscribe(&channel)).await,
                        Ok(Ok(()))
                    );
                    (i, ok)
                }
            })
            .buffer_unordered(SUBSCRIBES_IN_FLIGHT);
        while let Some((i, ok)) = answers.next().await {
            if !ok {
                break;
            }
            confirmed[i] = true;
        }
        drop(answers);
        let gone = !conn.subscriptions_alive();
        for (channel, confirmed) in channels.into_iter().zip(confirmed) {
            if confirmed {
                subscribed.insert(channel);
                heard = true;
            } else if gone {
                // The connection is gone again: the next one made subscribes to these (and
                // `ensure_subscribed` does not take them for subscribed meanwhile).
                subscribed.insert(channel);
            } else {
                // Not answered, or not sent (the round stopped first): tried again after the
                // pause. One sent may still run.
                strong.note_stray(&channel);
                failed.push(channel);
            }
        }
        drop(subscribed);
        // Waiters re-check once, and again when a channel they missed releases on is heard.
        if first || heard {
            strong.hub.notify_all();
        }
        if failed.is_empty() {
            return;
        }
        again = Some(failed);
        drop(strong);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// A cluster node's connection dropped (a `Disconnection` push; a master killed or cut off):
/// starts [`resubscribe_after_disconnection`], or has the one running do another round.
#[cfg(feature = "cluster")]
fn resubscribe_cluster_soon(inner: &Arc<Inner>) {
    inner.resubscribe_again.store(true, Ordering::Release);
    if inner.resubscribing.swap(true, Ordering::AcqRel) {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            let weak = Arc::downgrade(inner);
            let running = Running(weak.clone(), true);
            rt.spawn(resubscribe_after_disconnection(weak, running));
        }
        Err(_) => inner.resubscribing.store(false, Ordering::Release),
    }
}

/// Clears `resubscribing` when [`resubscribe_after_disconnection`] is dropped before it ends
/// (its runtime shut down, maybe before it first ran): else no drop would be acted on again.
/// Disarmed (`.1`) when the task ends by itself, having cleared it.
#[cfg(feature = "cluster")]
struct Running(Weak<Inner>, bool);

#[cfg(feature = "cluster")]
impl Drop for Running {
    fn drop(&mut self) {
        if let (true, Some(me)) = (self.1, self.0.upgrade()) {
            me.resubscribing.store(false, Ordering::Release);
        }
    }
}

/// After a cluster node's connection dropped: the channels subscribed on that node are
/// subscribed nowhere now, and redis-rs moves a shard's subscriptions to its new master only
/// once a command on the subscriptions connection has it read the slot map again. Which node a
/// channel was on is not known here, so every channel is taken for unsubscribed (a waiter that
/// comes meanwhile subscribes itself), and those of locks with local waiters are subscribed
/// again (`SSUBSCRIBE`, which reaches the channel's current master; one already there stays
/// so), round after round with a growing pause, until all are. Waiters are woken to re-check
/// when a channel is subscribed again (a release published meanwhile was missed) — not on
/// rounds that subscribed nothing new.
///
/// The set of subscribed channels is locked only to take channels from it and to put them back,
/// never across a subscription's round trip: a new waiter, of any shard, subscribes meanwhile
/// without waiting for a round that waits on a node that does not answer.
#[cfg(feature = "cluster")]
async fn resubscribe_after_disconnection(inner: Weak<Inner>, mut running: Running) {
    let mut pending: HashSet<String> = HashSet::new();
    let mut pause = Duration::from_millis(50);
    loop {
        let Some(me) = inner.upgrade() else { return };
        let wanted = |channel: &String| {
            channel
                .strip_suffix(CHANNEL_SUFFIX)
                .and_then(|r| r.strip_suffix(':'))
                .is_some_and(|r| me.hub.has_waiters(r))
        };
        // A drop told since the last round (the first one too): every channel again.
        if me.resubscribe_again.swap(false, Ordering::AcqRel) {
            let mut subscribed = me.subscribed.lock().await;
            pending.extend(me.take_subscribed(&mut subscribed));
        }
        pending.retain(wanted);
        if pending.is_empty() {
            me.resubscribing.store(false, Ordering::Release);
            // A drop told between the check and the store above found the task still running.
            if !me.resubscribe_again.load(Ordering::Acquire)
                || me.resubscribing.swap(true, Ordering::AcqRel)
            {
                running.1 = false;
                return;
            }
            continue;
        }
        let limit = me.opts.command_timeout;
        let inner_ref = &me;
        let asks = pending.drain().map(|channel| {
            let mut conn = inner_ref.conn.clone();
            async move {
                // In the channel's turn, noted before an unsubscribe's answer is in: one that
                // went out first could land after this subscription.
                let turn = inner_ref.channel_turn(&channel).await;
                let epoch = inner_ref.subs_epoch.load(Ordering::Acquire);
                let ok = matches!(
                    tokio::time::timeout(limit, conn.subscribe(&channel)).await,
                    Ok(Ok(()))
                );
                let mut subscribed = inner_ref.subscribed.lock().await;
                let heard = if !ok || inner_ref.subs_epoch.load(Ordering::Acquire) != epoch {
                    // Not answered, or the set was emptied for a new connection meanwhile
                    // (this subscription may have gone to the one before): asked again.
                    inner_ref.note_stray(&channel);
                    false
                } else if wanted(&channel) {
                    subscribed.insert(channel.clone())
                } else {
                    // Its waiters left meanwhile: not kept (a later waiter subscribes), and
                    // dropped again.
                    inner_ref.note_stray(&channel);
                    false
                };
                let again = !ok || inner_ref.subs_epoch.load(Ordering::Acquire) != epoch;
                drop(subscribed);
                drop(turn);
                (channel, again, heard)
            }
        });
        let answers = futures_util::future::join_all(asks).await;
        let mut heard = false;
        for (channel, again, noted) in answers {
            if again {
                pending.insert(channel);
            }
            heard |= noted;
        }
        if heard {
            me.hub.notify_all();
        }
        if pending.is_empty() {
            continue;
        }
        drop(me);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(1));
    }
}

/// A channel the server unsubscribed this connection from (its slot moved away) while its lock
/// had no local waiter: no longer taken for subscribed, unless a waiter came meanwhile (its
/// `SSUBSCRIBE` may be on its way, or done).
async fn forget_unless_waited(inner: Weak<Inner>, resource: String) {
    let Some(inner) = inner.upgrade() else { return };
    let channel = format!("{resource}:{CHANNEL_SUFFIX}");
    let mut subscribed = inner.subscribed.lock().await;
    if !inner.hub.has_waiters(&resource) {
        subscribed.remove(&channel);
    }
}

/// A push that arrived over a connection whose issuer number is `issuer` (see [`Issuer`]).
fn on_push(
    hub: &Weak<ReleaseHub>,
    me: &OnceLock<Weak<Inner>>,
    handoff: bool,
    push: PushInfo,
    issuer: Issuer,
    current: bool,
) {
    let Some(hub) = hub.upgrade() else { return };
    match push.kind {
        PushKind::Message | PushKind::SMessage => {
            let mut data = push.data.into_iter();
            let (Some(channel), Some(payload)) = (data.next(), data.next()) else {
                return;
            };
            let (Ok(channel), Ok(payload)) = (
                redis::from_redis_value::<String>(channel),
                redis::from_redis_value::<String>(payload),
            ) else {
                return;
            };
            let Some(resource) = channel
                .strip_suffix(CHANNEL_SUFFIX)
                .and_then(|r| r.strip_suffix(':'))
            else {
                return;
            };
            // `""`: wake a barging waiter; `<token>:<fence>`: the lock was handed to `<token>`.
            match payload.split_once(':') {
                _ if payload.is_empty() => hub.notify(resource, None),
                Some((token, fence)) => match fence.parse::<u64>() {
                    Ok(fence) if handoff => match me.get().and_then(Weak::upgrade) {
                        // Only from the connection the waiters' attempts are answered on now:
                        // in order with those answers (see `Backend`'s module docs). One
                        // replaced since (gone silent; Sentinel: another master, or the same
                        // one's silent connection) may deliver, once a partition heals, a grant
                        // published before the waiter's last attempt was answered on the new
                        // one — a lease that lapsed, maybe taken by another since. Woken, the
                        // waiter asks, and is granted the lock if it is still its own.
                        Some(inner) if !(current && inner.is_current(issuer)) => {
                            hub.notify(resource, Some(token))
                        }
                        Some(inner) => match inner.granted(fence, issuer) {
                            Ok(fence) => hub.hand_over(resource, token, fence),
                            // No token to hand over: the waiter asks, and is told why.
                            Err(_) => hub.notify(resource, Some(token)),
                        },
                        None => hub.notify(resource, Some(token)),
                    },
                    _ => hub.notify(resource, Some(token)),
                },
                None => hub.notify(resource, Some(&payload)),
            }
        }
        // Also what a cluster node says, unasked, when a slot moves away: it drops the
        // subscriptions to the slot's shard channels. A lock with local waiters still needs its
        // channel, now on the slot's new master.
        PushKind::SUnsubscribe => {
            let resource = push
                .data
                .into_iter()
                .next()
                .and_then(|c| redis::from_redis_value::<String>(c).ok())
                .and_then(|c| {
                    Some(
                        c.strip_suffix(CHANNEL_SUFFIX)?
                            .strip_suffix(':')?
                            .to_owned(),
                    )
                });
            let (Some(resource), Some(inner), Ok(rt)) = (
                resource,
                me.get().and_then(Weak::upgrade),
                tokio::runtime::Handle::try_current(),
            ) else {
                return;
            };
            if hub.has_waiters(&resource) {
                rt.spawn(resubscribe(Arc::downgrade(&inner), resource));
            } else {
                // No longer subscribed: a waiter that comes later must not take the channel
                // for one it listens on (`listening`, `ensure_subscribed`).
                rt.spawn(forget_unless_waited(Arc::downgrade(&inner), resource));
            }
        }
        PushKind::Disconnection => {
            tracing::warn!("redis connection lost; waiters re-check once it is back");
            let Some(inner) = me.get().and_then(Weak::upgrade) else {
                return;
            };
            #[cfg(feature = "cluster")]
            if inner.conn.is_cluster() {
                resubscribe_cluster_soon(&inner);
            }
            if hub.watched() == 0 {
                return;
            }
            if inner.recovering.swap(true, Ordering::AcqRel) {
                return;
            }
            match tokio::runtime::Handle::try_current() {
                // To the end: cut off by its runtime's shutdown, it runs again on the fallback
                // thread (else `recovering` stayed set, and no waiter was woken after a
                // reconnect again).
                Ok(_) => {
                    let weak = Arc::downgrade(&inner);
                    crate::util::spawn_to_the_end(Arc::new(move || {
                        Box::pin(wake_after_reconnect(weak.clone()))
                    }));
                }
                Err(_) => inner.recovering.store(false, Ordering::Release),
            }
        }
        _ => {}
    }
}

impl RedisBackend {
    /// One acquire attempt, its fencing counter at least `floor`, and the issuer number of the
    /// connection its reply came over (see [`granted`](Self::granted)).
    pub(crate) async fn acquire_with_floor(
        &self,
        args: AcquireArgs<'_>,
        floor: Floor,
    ) -> Result<(Attempt, Issuer, Option<u64>), LockError> {
        self.run_acquire(&self.acquire_call(&args, floor)).await
    }

    /// The call of one acquire attempt, its fencing counter at least `floor`. It holds nothing
    /// of this server's but, on a cluster, the lock's slot: Redlock sends one call to each of
    /// its servers.
    pub(crate) fn acquire_call(&self, args: &AcquireArgs<'_>, floor: Floor) -> ScriptCall<'_> {
        let mut call = self.lock_call(&self.inner.acquire, args.resource);
        call.arg(args.token.as_str())
            .arg(scripts::px(args.ttl))
            .arg(self.fence_key(args.resource));
        match floor {
            Floor::AtLeast(f) => call.arg(f),
            // Negated: the script's sign for "exactly".
            Floor::Exactly(f) => call.arg(0i64.saturating_sub_unsigned(f)),
        };
        // A plain try (the uncontended path) stops here: the script's mode defaults to try.
        if args.mode != WaitMode::Try {
            let mode = match args.mode {
                WaitMode::Try => "0",
                WaitMode::Queue => "1",
                WaitMode::Barge => "2",
            };
            call.arg(mode)
                // An entry must not outlive the lock's key (see `scripts::LINGER`).
                .arg(millis(args.waiter_ttl.min(scripts::LINGER)))
                .arg(millis(args.ttl));
        }
        call
    }

    /// Sends an acquire [`call`](Self::acquire_call): the attempt, the issuer number of the
    /// connection its reply came over, and — a queued attempt answered "held" — the fencing
    /// counter it drew (see `scripts::acquire`).
    pub(crate) async fn run_acquire(
        &self,
        call: &ScriptCall<'_>,
    ) -> Result<(Attempt, Issuer, Option<u64>), LockError> {
        let (reply, issuer): (AcquireReply, _) = self.run_granting("acquire", call).await?;
        Ok((Attempt::from_reply(reply.0), issuer, reply.1))
    }

    /// A queued attempt of `token` was answered "held" after drawing `counter`: grants
    /// published before it carry lower tokens, and only wake the waiter if they reach it after
    /// this answer ([`ReleaseHub::set_floor`]).
    fn note_drawn(&self, resource: &ResourceName, token: &OwnerToken, counter: u64) {
        if counter > MAX_COUNTER {
            return;
        }
        // Above every issuer number's token of this counter: a grant's issuer may be another
        // master's (Sentinel); the counter is what orders grants.
        let floor = (counter << RedisBackend::ISSUER_BITS) | ((1 << RedisBackend::ISSUER_BITS) - 1);
        self.inner
            .hub
            .set_floor(resource.as_str(), token.as_str(), floor);
    }
}

impl Backend for RedisBackend {
    fn name(&self) -> &'static str {
        "redis"
    }

    /// The scripts give a lease in whole milliseconds from the server's clock, read in whole
    /// milliseconds: the part of `ttl` below a millisecond, and one more.
    fn lease_margin(&self, ttl: Duration) -> Duration {
        crate::util::whole_ms_margin(ttl, 1)
    }

    fn idempotency(&self) -> Option<&dyn super::IdempotencyStore> {
        Some(self)
    }

    fn acquire_kind<'a>(
        &'a self,
        args: AcquireArgs<'a>,
    ) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(self.acquire_kind_once(args))
    }

    fn admin(&self) -> Option<&dyn super::AdminStore> {
        Some(self)
    }

    fn acquire<'a>(&'a self, args: AcquireArgs<'a>) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(async move {
            self.issuer().await?;
            let seen = &self.inner.fence_seen;
            let (resource, token) = (args.resource, args.token);
            Ok(
                match self.acquire_with_floor(args, Floor::clock(seen)).await? {
                    (Attempt::Acquired { fencing_token }, issuer, _) => Attempt::Acquired {
                        fencing_token: self.granted(fencing_token, issuer)?,
                    },
                    (held, _, drawn) => {
                        if let Some(counter) = drawn {
                            self.note_drawn(resource, token, counter);
                        }
                        held
                    }
                },
            )
        })
    }

    fn release<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            if resource.kind() != LockKind::Exclusive {
                return self.release_kind(resource, token, false).await;
            }
            let n = self
                .owner_script(&self.inner.release, "release", resource, token)
                .await?;
            Ok(n == 1)
        })
    }

    fn extend<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            if resource.kind() != LockKind::Exclusive {
                return self.extend_kind(resource, token, ttl).await;
            }
            let mut call = ScriptCall::new(&self.inner.extend, 1);
            call.key(resource.as_str())
                .arg(token.as_str())
                .arg(scripts::px(ttl));
            let n: i64 = self.run_script("extend", &call).await?;
            Ok(n == 1)
        })
    }

    fn extend_many<'a>(
        &'a self,
        items: &'a [ExtendItem],
    ) -> BoxFuture<'a, Vec<Result<bool, LockError>>> {
        Box::pin(async move {
            #[cfg(feature = "cluster")]
            if self.is_cluster() {
                return self.extend_per_slot(items).await;
            }
            super::extend_in_chunks(items, PIPELINE_CHUNK, |chunk| self.extend_chunk(chunk)).await
        })
    }

    fn abandon<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<(), LockError>> {
        Box::pin(async move {
            if resource.kind() != LockKind::Exclusive {
                return self.release_kind(resource, token, true).await.map(|_| ());
            }
            self.owner_script(&self.inner.abandon, "abandon", resource, token)
                .await
                .map(|_| ())
        })
    }

    fn watch<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move {
            let me = self.clone();
            let on_last: super::OnLastWaiter =
                Box::new(move |resource: &str| me.unsubscribe_later(resource));
            // Register first: a notification that arrives right after SUBSCRIBE is not lost.
            let (watch, _) = self.inner.hub.register(resource, token, Some(on_last));
            self.ensure_subscribed(resource).await?;
            Ok(watch)
        })
    }

    /// Another waiter of this backend watches `resource` and its channel is subscribed now
    /// (not while a `SUBSCRIBE` or `UNSUBSCRIBE` is on its way: then a watch could wait for a
    /// round trip). A release is published by the script that freed the lock, so a watch made
    /// before an attempt misses none after it.
    fn listening(&self, resource: &ResourceName) -> bool {
        if !self.inner.hub.has_waiters(resource.as_str()) {
            return false;
        }
        let channel = resource.with_suffix(CHANNEL_SUFFIX);
        !self.inner.channel_busy(&channel)
            && self
                .inner
                .subscribed
                .try_lock()
                .is_ok_and(|subscribed| subscribed.contains(&channel))
            && self.inner.conn.subscriptions_alive()
    }

    /// Renews the lease and sends `WAIT replicas <¾ of the command timeout>` after it, on a
    /// connection of their own (`WAIT` blocks its connection; on a cluster, to the lock's
    /// master): `WAIT` counts the replicas that have every write made so far, the lock's grant
    /// included.
    fn replicate<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        ttl: Duration,
        replicas: u32,
    ) -> BoxFuture<'a, Result<u32, LockError>> {
        Box::pin(async move {
            let mut renew = ScriptCall::new(&self.inner.extend, 1);
            renew
                .key(resource.as_str())
                .arg(token.as_str())
                .arg(scripts::px(ttl));
            let (owned, acked): (i64, u32) =
                self.run_acknowledged("replicate", &renew, replicas).await?;
            if owned != 1 {
                return Err(LockError::lost(resource.key().as_str()));
            }
            Ok(acked)
        })
    }
}

impl RedisBackend {
    /// Runs `call` on a connection of its own ([`conn::Dedicated`]: `WAIT` blocks the
    /// connection it is sent on; on a cluster, to the lock's master), with a `WAIT` for
    /// `replicas` replicas right behind it in one pipeline, ¾ of the command timeout at most
    /// ([`ScriptCall::invoke_acknowledged`]: sent apart, the `WAIT` could count another
    /// connection's writes): the script's answer and how many replicas have every write made
    /// so far on that connection — the script's included.
    pub(crate) async fn run_acknowledged<T: redis::FromRedisValue>(
        &self,
        what: &str,
        call: &ScriptCall<'_>,
        replicas: u32,
    ) -> Result<(T, u32), LockError> {
        let mut conn = self.inner.dedicated.get(&self.inner.conn).await?;
        // A timeout has this connection checked, not the backend's own.
        let on = conn.clone();
        let wait = self.inner.opts.command_timeout * 3 / 4;
        let mut sent = Sent::new(&on);
        let mut answered = call
            .invoke_acknowledged::<T>(&mut conn, replicas, wait)
            .await;
        // Never sent (a cluster connection whose runtime shut down as it was sent): once more,
        // on the connection made in its place, as `run_granting` does. One whose answer was
        // lost is not sent again: it may have run.
        if let Err(e) = &answered {
            if conn.never_sent(e) {
                answered = call
                    .invoke_acknowledged::<T>(&mut conn, replicas, wait)
                    .await;
            }
        }
        sent.answered();
        let (answer, acked) = answered.map_err(|e| {
            on.failed(&e);
            redis_err(what, e)
        })?;
        Ok((answer, u32::try_from(acked).unwrap_or(0)))
    }

    /// A cluster's batch: a cluster pipeline holds one slot, so the renewals are grouped by
    /// slot, one pipeline per slot, at most `CLUSTER_PIPELINES` in flight. (One command per
    /// renewal instead measured 270 renewals/s for 100,000 locks: far too slow.)
    #[cfg(feature = "cluster")]
    async fn extend_per_slot(&self, items: &[ExtendItem]) -> Vec<Result<bool, LockError>> {
        use futures_util::stream::StreamExt as _;
        const CLUSTER_PIPELINES: usize = 64;
        let mut by_slot: std::collections::HashMap<u16, Vec<usize>> =
            std::collections::HashMap::new();
        for (i, item) in items.iter().enumerate() {
            by_slot
                .entry(conn::slot(item.resource.key().as_str()))
                .or_default()
                .push(i);
        }
        let mut out: Vec<Option<Result<bool, LockError>>> =
            (0..items.len()).map(|_| None).collect();
        let mut done = futures_util::stream::iter(by_slot.into_values().flat_map(|group| {
            group
                .chunks(PIPELINE_CHUNK)
                .map(<[usize]>::to_vec)
                .collect::<Vec<_>>()
        }))
        .map(|idx| async move {
            let chunk: Vec<ExtendItem> = idx.iter().map(|&i| items[i].clone()).collect();
            (idx, self.extend_chunk(&chunk).await)
        })
        .buffer_unordered(CLUSTER_PIPELINES);
        while let Some((idx, res)) = done.next().await {
            match res {
                Ok(v) => {
                    for (&i, r) in idx.iter().zip(v) {
                        out[i] = Some(r);
                    }
                }
                Err(e) => {
                    // Each item gets the batch's error, refusal for good or outage alike (a
                    // misconfigured store reported as an outage was retried as one).
                    let (msg, for_good) = (e.to_string(), e.is_misconfigured());
                    for &i in &idx {
                        out[i] = Some(Err(LockError::backend(msg.clone(), None, for_good)));
                    }
                }
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(LockError::unavailable("renewal not sent", None))))
            .collect()
    }

    /// One pipeline of renewals: each renewal's own answer — a key that makes its script fail
    /// (`WRONGTYPE`: something else wrote at a lock's name) fails its own renewal, not the
    /// others of the pipeline (which ran; their locks would have been reported lost when their
    /// local leases ran out, renewal after renewal failing with the bad key's error). The
    /// pipeline's own failure (no answer, a connection lost) fails them all.
    async fn extend_chunk(
        &self,
        chunk: &[ExtendItem],
    ) -> Result<Vec<Result<bool, LockError>>, LockError> {
        type Replies = Vec<redis::RedisResult<i64>>;
        let no_script =
            |e: &RedisError| e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript);
        let build = |with_body: bool| {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for item in chunk {
                // A semaphore's or read-write lock's lease is its holder's score, not a `PX`.
                let (script, lease) = match item.resource.kind() {
                    LockKind::Exclusive => (&self.inner.extend, scripts::px(item.ttl)),
                    _ => (kinds::extend_script(), millis(item.ttl)),
                };
                pipe.add_command(conn::script_call(script, with_body))
                    .arg(1)
                    .arg(item.resource.as_str())
                    .arg(item.token.as_str())
                    .arg(lease);
            }
            pipe
        };
        let each = |replies: Replies| {
            replies
                .into_iter()
                .map(|r| match r {
                    Ok(n) => Ok(n == 1),
                    Err(e) => Err(self.failed("extend", e)),
                })
                .collect()
        };
        let mut conn = self.inner.conn.clone();
        let mut sent = Sent::new(&self.inner.conn);
        let first = tokio::time::timeout(
            self.inner.opts.command_timeout,
            build(false).query_async::<Replies>(&mut conn),
        )
        .await;
        sent.answered();
        let lost_scripts = match &first {
            Ok(Ok(v)) => v.iter().any(|r| r.as_ref().is_err_and(no_script)),
            Ok(Err(e)) => no_script(e),
            Err(_) => false,
        };
        match first {
            Err(_) => {
                self.inner.conn.timed_out();
                Err(LockError::unavailable("redis extend timed out", None))
            }
            Ok(_) if lost_scripts => {
                // The server lost its script cache (a restart, a failover, `SCRIPT FLUSH`; a
                // renewal that ran is harmless to run again). On a cluster, once more with the
                // scripts' text (`EVAL`), which reaches the very node that lacks them, the
                // slot's next master mid-reshard included (see `conn::ClusterLink`); on one
                // server, load them and retry once.
                if self.is_cluster() {
                    return self
                        .deadline("extend", build(true).query_async::<Replies>(&mut conn))
                        .await
                        .map(each);
                }
                for script in [&self.inner.extend, kinds::extend_script()] {
                    self.deadline("script load", script.load_async(&mut conn))
                        .await?;
                }
                self.deadline("extend", build(false).query_async::<Replies>(&mut conn))
                    .await
                    .map(each)
            }
            Ok(Ok(v)) => Ok(each(v)),
            Ok(Err(e)) => Err(self.failed("extend", e)),
        }
    }
}

/// A command on its way: dropped before its answer (or failure) came after waiting long enough
/// — cut off by a deadline of the caller's, which the [`Locker`](crate::Locker)'s is, the same
/// length as the connection's own and often first — it has the connection checked as a timeout
/// does ([`Conn::cut_off`]: a `PING` on one server, at most one at a time). No allocation: a
/// clock read and a flag on the stack.
struct Sent<'a> {
    conn: &'a Conn,
    started: Instant,
    answered: bool,
}

impl<'a> Sent<'a> {
    fn new(conn: &'a Conn) -> Self {
        Sent {
            conn,
            started: Instant::now(),
            answered: false,
        }
    }

    fn answered(&mut self) {
        self.answered = true;
    }
}

impl Drop for Sent<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.conn.cut_off(self.started.elapsed());
        }
    }
}

/// The key of a fencing counter ([`RedisBackend::fence_key`]): `<prefix>fence`, or on a
/// cluster `<prefix>{<slot tag>}:fence`. Written straight into a command, with no `String` of
/// its own.
pub(crate) struct FenceKey<'a> {
    /// The lock's prefix, up to the `{` that opens its encoded key.
    prefix: &'a str,
    /// A tag of the lock's slot, on a cluster.
    tag: Option<&'static str>,
}

impl std::fmt::Display for FenceKey<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.prefix)?;
        if let Some(tag) = self.tag {
            write!(f, "{{{tag}}}:")?;
        }
        f.write_str("fence")
    }
}

impl redis::ToRedisArgs for FenceKey<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        out.write_arg_fmt(self);
    }
}

impl redis::ToSingleRedisArg for FenceKey<'_> {}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The slot guard is in a cluster's scripts only: one server or Sentinel, where no slot
    /// migrates, does not pay its command on every call (the lock's acquire script differs
    /// between the two; the guard alone leaves nothing on one server).
    #[test]
    fn only_a_clusters_scripts_guard_their_slot() {
        let text = concat!("local a = 1\n", slot_guard!(), "return a\n");
        assert_eq!(guarded_text(text, true), text);
        assert_eq!(guarded_text(text, false), "local a = 1\nreturn a\n");
        assert_ne!(
            scripts::acquire(true).get_hash(),
            scripts::acquire(false).get_hash()
        );
        assert_eq!(
            guarded_script(scripts::SLOT_GUARD, false).get_hash(),
            conn::script("").get_hash()
        );
    }

    /// The connection manager's task needs a runtime: made outside one, a lazy backend is a
    /// typed error, not a panic in `tokio::spawn`.
    #[test]
    fn connecting_lazily_outside_a_tokio_runtime_is_unsupported() {
        let err = RedisBackend::connect_lazy(
            "redis://127.0.0.1:1",
            RedisOptions::default(),
            ReleaseHub::new(),
        )
        .unwrap_err();
        assert!(err.is_unsupported(), "{err}");
        assert!(err.to_string().contains("tokio runtime"), "{err}");
    }
}
