//! The ZooKeeper backend (`zk://`, feature `zookeeper`): the classic ZooKeeper lock recipe
//! (ephemeral sequential nodes, predecessor watch) mapped onto the attempt-based [`Backend`]
//! trait, over the [`zookeeper_client`] crate.
//!
//! # Layout and recipe
//!
//! Every lock is a directory node `<chroot>/dlock/<resource>` (the resource string
//! percent-encoded to a valid node name), created on first use as a *container* node
//! (ZooKeeper ≥ 3.5.3). A backend deletes a directory it left — by a release or a try that
//! found the lock held — once it has been left alone for a second (not awaited; the server
//! refuses it while any child is left; an undo deletes it at once), so a lock leaves no node
//! behind, and one taken again and again keeps its directory (see `Idle`). The server's own
//! cleanup of empty containers is only the backstop:
//! it runs once a minute, deletes at most 10,000 a minute, and never one that never had a
//! child, which for a lock per order id is far too slow. Every acquisition creates its own
//! **ephemeral sequential** child `<owner token>-<sequence>` (the token in the name is
//! Curator's "protected mode": the node can always be found by its owner, also when the answer
//! to its `create` was lost). The child with the lowest sequence holds the lock; every other
//! child is a waiter, in arrival order (fair FIFO, [`Backend::fifo`] is `true`), and each
//! waiter watches only its predecessor (no herd, no polling).
//!
//! * [`WaitMode::Try`] / [`WaitMode::Barge`]: create the own child (or find the one an earlier
//!   attempt by the same token made: a holder asking again is granted again, its lease
//!   restarted), list the directory; the lowest → `Acquired`; otherwise the own child is
//!   deleted again (a try leaves nothing).
//!   With this recipe there is no "free but queued" state to barge past — the lowest child *is*
//!   the holder — so barging is a try.
//! * [`WaitMode::Queue`]: create the own child once (later attempts find it), list; the
//!   lowest → `Acquired`; otherwise stay queued and watch the predecessor's node.
//! * [`release`](Backend::release): delete the own child (its name holds the secret owner
//!   token, so its existence is the owner check); the directory once left alone (`Idle`).
//!   [`abandon`](Backend::abandon): the same, for a child found by its token if the
//!   `create`'s answer never arrived.
//! * [`watch`](Backend::watch): registers the waiter in the [`ReleaseHub`]; the attempt that
//!   finds it queued sets a ZooKeeper watch on its predecessor's node, and its deletion (or a
//!   session event) wakes exactly that waiter. A data change of the predecessor (its own
//!   refresh) re-arms the watch without waking anyone.
//!
//! # Fencing tokens
//!
//! The fencing token is the holder node's creation zxid (`czxid`): ZooKeeper's transaction id,
//! one counter for the whole ensemble agreed by its atomic broadcast, so tokens are strictly
//! increasing per lock *and* across locks, never rolled back by a leader change, with no clock
//! involved. Not dense (every write advances the zxid), and only comparable with tokens of the
//! same ensemble.
//!
//! # Leases: the session, and a per-lock lease in the node
//!
//! An ephemeral node lives as long as the client's **session**: when the locker's process dies
//! or is cut off, the server expires the session after the negotiated session timeout and
//! deletes every node of it. One session serves one locker (all its locks and waiters), so the
//! session alone cannot give locks their own TTLs — a lock of 300 ms and one of 30 s live and
//! die with the same session, and a guard that stops renewing (leaked, not renewed with
//! `auto_renew(false)`) inside a living process would hold its lock forever. So every node also
//! carries a **lease in its data** (its length in milliseconds), counted from the node's
//! `mtime` — the time the ensemble's leader stamped on the last write to it, so the lease is
//! judged by ZooKeeper's clock, never a client's — and only by **one leader's** clock:
//!
//! * a holder's node carries the lock's TTL; renewal ([`extend`](Backend::extend)) rewrites it
//!   (`setData`, which also restamps `mtime`), and can shorten it;
//! * a queued waiter's node carries the waiter TTL and is rewritten by each of its attempts;
//! * a node whose `mtime + lease` has passed (by the `mtime` of the observer's own write in the
//!   same attempt) is deleted by the next node's owner, with a version check so that a renewal
//!   that got there first wins. A holder that died thus stops blocking others after its TTL, as
//!   on every backend, and its session takes its node away after the session timeout in any
//!   case;
//! * the two `mtime`s are compared only when both writes were made in the same epoch
//!   (`zxid >> 32`, one per leader), so both were stamped by the same leader's wall clock. After
//!   a leader change, a node last written under the old leader is not expired, however old its
//!   `mtime`: the first attempt that reads it in the new epoch writes its data back unchanged
//!   (guarded by its version), which starts its lease again under the new leader, and later
//!   attempts judge it from there. Comparing the clocks of two servers let a new leader whose
//!   clock ran ahead of the old one's end a living holder's lease early by the difference —
//!   with a margin of one millisecond ([`Backend::lease_margin`]), a second holder. A holder
//!   that dies across a leader change thus frees its lock a lease after the first attempt that
//!   reads its node in the new epoch: later than its own lease ended, never earlier. The
//!   holder's local lease clock still counts from its last renewal. What remains assumed is
//!   that one leader's wall clock does not step forward during a lease (see
//!   [`Backend::lease_margin`]);
//! * a node of a living session whose lease ended (a lock released with a minimum hold is left
//!   to its lease, a release that never landed, a guard leaked with renewal off) is deleted by
//!   its own backend a session timeout after its lease ended, at the first write it makes after
//!   that (a sweep runs at most once per session timeout): an ephemeral node has no expiry of
//!   its own, and otherwise one on a lock nobody tries again would stay for the life of the
//!   session.
//!
//! **TTL and the session timeout.** A holder cut off from the ensemble cannot renew, and the
//! leader may expire its session — deleting its node — one session timeout after it last
//! heard of the session. For a client on a follower, that is not the client's last answered
//! request: the follower passes the sessions it served on to the leader only in its answers to
//! the leader's pings, every half tick, so a follower cut off right after answering leaves the
//! leader's last word up to half a tick older. The server's `minSessionTimeout` is at least
//! two ticks, so half a tick is at most a quarter of the session timeout, and the local lease
//! clock of a lock never counts on more than **¾ of the negotiated session timeout**
//! ([`Backend::lease_margin`] is `ttl − ¾ session timeout` for longer TTLs; for shorter ones,
//! the part of the TTL below a millisecond and one more, as leases are whole milliseconds
//! from a `mtime` in whole milliseconds):
//! [`lost`](crate::LockGuard::lost) fires when a disconnect outlives ¾ of the session timeout
//! by the local clock, before the server can let the next holder in. A TTL above twice
//! the session timeout is refused with [`LockError::InvalidTtl`], by an acquire and by an
//! extend alike (the lease then stays as it was; the watchdog renews every third of the
//! local lease, so at most every ¼ of the session timeout); raise the server's `maxSessionTimeout`
//! and [`ZkOptions::session_timeout`] (or `?session_timeout_ms=`) for longer TTLs. The session
//! timeout is what the server grants: between its `minSessionTimeout` (default 2 ticks) and
//! `maxSessionTimeout` (default 20 ticks, 40 s at the default 2 s tick); dlock asks for 30 s by
//! default.
//!
//! # Faults
//!
//! Every call is bounded by the command timeout ([`ZkOptions::command_timeout`]): no quorum,
//! a frozen or dead server answer [`LockError::Unavailable`] (503) in time, never a hang. The
//! client moves to another server of the ensemble by itself while the session lives (a dead
//! connection is found within [`ZkOptions::connection_timeout`]); locks, waiters and watches
//! survive that. When the session expires, its nodes are gone: renewals answer "not the owner"
//! (the guards are lost, if their local lease had not already ended), and the backend opens a
//! new session for the next calls. ZooKeeper applies one session's requests in the order they
//! were sent, so an `abandon` after a cancelled `create` finds the node the `create` made. An
//! `abandon` that gets no answer (no server) leaves the attempt unsettled: the client keeps
//! the `create` and sends it once it has a server, so the backend's one task for such attempts
//! looks the node up again then, and deletes it (it would otherwise hold the lock for a lease nobody counts on, and stay on a
//! lock nobody tries again for the life of the session). An attempt whose `create` was cut off
//! by the command timeout and landed all the same leaves a node the backend does not know of:
//! the token's next attempt keeps the earliest such node of the current session (its place in
//! line, the lock if it is first, with that node's fencing token) and deletes the newer one.
//! Kept, or found by the token after a `create` whose own answer was lost, such a node has
//! its lease written afresh before it counts (it may be an earlier attempt's, with the lease
//! of that attempt's time).
//! One answer can be ambiguous: a release whose `delete` was applied but not answered, sent
//! again, finds the node gone and answers "not the owner" (the guard reports a lost lock,
//! after the lock was in fact released). A node gone by then may as well have been deleted by
//! someone else (its lease ran out, a force release), and reporting that as a clean release
//! would hide a loss.
//!
//! **After an outage.** The client reconnects by itself, but waits twice as long after every round
//! over the servers without an answer (with three servers 0.3, 0.6, 1.2, 2.4, 4.8 s …), so after
//! the whole ensemble was away for `d` it would come back up to about `d / 2` after the ensemble
//! did. So a session found without a server for over a second (by the client's state, or by calls
//! that got no answer within the command timeout: the state can lag), on which every lease this
//! backend granted has run out by the local clock (no guard counts on any of its nodes any more),
//! is given up and a new one opened, which connects as soon as a server answers. Nothing of the old
//! session is taken for one's own after that (its nodes, leases run out, are deleted by the next
//! attempts or with the session), and a call still on the old session when it was given up answers
//! `Unavailable` instead of a lock or a renewal. A session with a live lease is kept, and comes
//! back at the client's own pace: its locks survive an outage only if the client reconnects within
//! their lease (with three servers an outage of 21 s can be followed by 19 s more before the
//! client's next round; moving the session to a new client, which `zookeeper_client` allows, would
//! remove that wait, at the price of an old client that must neither close the session nor keep
//! it).
//!
//! **When a runtime shuts down.** The client runs its session in a task on the runtime it
//! connected on (that of the backend's first caller, or of the call that opened a later
//! session), and every request, answer and watch event passes through that task; the tasks
//! that await its watches and answers in the background run there too. When that runtime shuts
//! down while the backend lives on (an actix-web worker restarting, a runtime built for set-up
//! and dropped), the task goes with it, and the client does not notice: it still says
//! `SyncConnected`, and every call on it fails at once. The session itself lives on at the
//! server, with its nodes, until the session timeout. So a sentinel task beside the session's
//! marks the client gone and wakes every local waiter (their watches went too), and the next
//! call, on whatever runtime it runs, **resumes the same session** on a new client there (by
//! its id and password), has its server sync with the leader, and goes on: locks held and
//! places in queues are kept, renewals go on (the locker's watchdog moves to its fallback
//! thread, `dlock-watchdog`, and renews in time, which is within the session timeout), and
//! waiters watch again and are woken by releases as before. A call that was waiting on the
//! session's task when it went answers `Unavailable` (the locker's own background work tries
//! again), and so do calls while no server answers the resume. A session that expired before
//! anything called (no lock held, or no server reachable for a session timeout) is not
//! resumed: its nodes are gone, a new session is opened, and the renewals of its locks answer
//! "not the owner", so their guards are reported lost. The task that settles unanswered
//! abandons moves to the fallback thread if the runtime it runs on shuts down first.
//!
//! Idempotency records are not stored by this backend ([`Backend::idempotency`] is `None`).
//! Inspection for operators ([`Backend::admin`]) is implemented in `admin.rs`: nodes judged
//! as an attempt judges them, by the ensemble's clock.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::task::AbortHandle;
use zookeeper_client::{Acls, Client, CreateMode, EventType, SessionInfo, SessionState, Stat};

use super::{AcquireArgs, Attempt, Backend, BoxFuture, OwnerToken, ReleaseHub, WaitMode, Watch};
use crate::key::ResourceName;
use crate::LockError;

mod admin;
mod url;

type ZkError = zookeeper_client::Error;

/// Settings of a [`ZkBackend`]. Defaults: command timeout 2 s, session timeout 30 s (what the
/// server grants may differ), connection timeout a third of the command timeout (at most 1 s),
/// node prefix `dlock`. The command and connection timeouts are at most a day (a longer one is
/// taken as a day).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ZkOptions {
    command_timeout: Duration,
    session_timeout: Duration,
    connection_timeout: Option<Duration>,
    prefix: String,
}

impl Default for ZkOptions {
    fn default() -> Self {
        ZkOptions {
            command_timeout: Duration::from_secs(2),
            session_timeout: Duration::from_secs(30),
            connection_timeout: None,
            prefix: "dlock".to_owned(),
        }
    }
}

/// The longest session timeout the protocol carries (a signed 32-bit count of ms).
const MAX_SESSION_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

impl ZkOptions {
    /// How long one backend call (and connecting) may take before it fails with
    /// [`LockError::Unavailable`].
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout.min(crate::util::MAX_TIMEOUT);
        self
    }

    /// The session timeout to ask the server for (it grants a value within its
    /// `minSessionTimeout..=maxSessionTimeout`). Bounds the TTLs this backend takes: at most
    /// twice the granted timeout (see the [module docs](self)). Taken as at most 2^31 − 1 ms,
    /// what the protocol carries (the server grants at most its `maxSessionTimeout` anyway; a
    /// longer one made the client library's arithmetic overflow and panic).
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout.min(MAX_SESSION_TIMEOUT);
        self
    }

    /// How long a connection may stay silent before the client gives it up and moves to
    /// another server (keep it well below the command timeout, so a frozen server costs no
    /// more than one call).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = Some(timeout.min(crate::util::MAX_TIMEOUT));
        self
    }

    /// The node under the chroot where locks live (default `dlock`).
    pub fn node_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }
}

/// A [`Conn`] in use.
const LIVE: u8 = 0;
/// A [`Conn`] on a resumed session whose server has not been synced with the leader yet.
const UNSYNCED: u8 = 1;
/// A [`Conn`] whose session task is gone with the runtime it ran on.
const GONE: u8 = 2;
/// A [`Conn`] dropped (its sentinel, disarmed then, marks nothing).
const RETIRED: u8 = 3;

/// A client and the runtime its session's task runs on.
///
/// `zookeeper_client` runs a session in one task, spawned on the runtime current when it
/// connected (tokio's `Handle::current()`), and every request, answer and watch event of the
/// client passes through that task. When that runtime shuts down (an actix-web worker
/// restarting, a runtime built for set-up and dropped), the task is dropped with it and the
/// client does not notice: its state stays what it was (`SyncConnected`), every call fails at
/// once (`UnexpectedError`), and a watch awaited on another runtime panics inside the client (its
/// event channel is gone). The server keeps the session, and every node of it, until the session
/// timeout. So:
///
/// * a sentinel task spawned beside the session's task, on the same runtime, marks the client
///   [`GONE`] when it is dropped with it, and wakes every local waiter (the watches their turns
///   hang on went too), so that they ask again;
/// * the tasks that await the client's events or answers in the background (predecessor
///   watches, the sweep's deletes) run on that runtime too ([`Conn::spawn`]): they end with the
///   session's task instead of panicking on another runtime;
/// * the next call resumes the session ([`Session::revive`]).
struct Conn {
    client: Client,
    rt: Handle,
    /// [`LIVE`], [`UNSYNCED`], [`GONE`] or [`RETIRED`].
    mark: Arc<AtomicU8>,
    _sentinel: Option<crate::util::RuntimeWatch>,
}

impl Conn {
    /// Wraps `client`, connected just now on the current runtime, and starts its sentinel there.
    fn new(client: Client, mark: u8, hub: Weak<ReleaseHub>) -> Self {
        let rt = Handle::current();
        let mark = Arc::new(AtomicU8::new(mark));
        let gone = mark.clone();
        let sentinel = crate::util::on_runtime_shutdown(move || {
            let now_gone = gone
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |m| {
                    (m != RETIRED).then_some(GONE)
                })
                .is_ok();
            if !now_gone {
                return;
            }
            tracing::warn!(
                "zookeeper: the runtime running the session's task shut down; the next call \
                 resumes the session"
            );
            if let Some(hub) = hub.upgrade() {
                hub.notify_all();
            }
        });
        Conn {
            client,
            rt,
            mark,
            _sentinel: sentinel,
        }
    }

    /// Whether the client can serve calls: its task lives and, if it resumed a session, its
    /// server is synced. One atomic load.
    fn ready(&self) -> bool {
        self.mark.load(Ordering::Acquire) == LIVE
    }

    /// Runs `task`, which awaits this client, on the runtime its session's task runs on.
    fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) -> AbortHandle {
        self.rt.spawn(task).abort_handle()
    }
}

impl Deref for Conn {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.mark.store(RETIRED, Ordering::Release);
    }
}

/// How long a session must have been without a server before [`Session::client`] may open
/// another one in its place (when nothing depends on it any more): about the longest pause the
/// reference client (ZooKeeper's Java client) makes between reconnect rounds.
const STUCK_AFTER: Duration = Duration::from_secs(1);

/// The session in use and how to replace it once it expired — or once it has been without a
/// server for a while and carries no lease any more.
///
/// Why the second: the client reconnects by itself, but it waits twice as long after each
/// round over the servers (0.3, 0.6, 1.2, 2.4 s … with three of them, bounded only by the
/// session's expiry), so after an ensemble outage of `d` it may come back about `d / 2` after
/// the ensemble does. A session whose every granted lease has run out (so no guard counts on
/// any of its nodes) is given up for a new one, which connects at once. What keeps that safe:
/// a node of the old session is never taken for one's own afterwards ([`ZkBackend::known`]
/// and [`ZkBackend::find_by_token`] look at the current session's only), and a call that was
/// still on the old client when it was given up answers `Unavailable` rather than report a
/// lock or a renewal on it ([`Session::is_current`], checked after the lease was noted).
///
/// "Without a server" is what the client's state says (`Disconnected`) or what its calls
/// show: calls that got no answer within the command timeout while the client still said
/// `SyncConnected`. Calls are needed because the state can be stale: in about one run in
/// seven of the outage test, the client kept reporting `SyncConnected` through a 10 s outage
/// of every server and for 10 s after (its own reconnect rounds, backed off, brought it back
/// 22 s after the kill), so a check on the state alone never gave it up.
///
/// A client whose task is gone with its runtime ([`Conn`]) is another matter: the session
/// itself lives on at the server, so it is resumed, not given up ([`revive`](Self::revive)).
struct Session {
    client: Mutex<Arc<Conn>>,
    /// Serialises re-connects.
    reconnect: tokio::sync::Mutex<()>,
    /// The granted session timeout, in ms.
    timeout_ms: AtomicU64,
    hosts: String,
    opts: ZkOptions,
    /// What `horizon_ms`, `down_ms` and `unanswered_ms` count from.
    born: Instant,
    /// The latest end of a lease this backend's writes granted (ms since `born`, rounded up),
    /// counted from when their answers arrived: no guard's local lease, counted from before
    /// its request was sent, lasts longer.
    horizon_ms: AtomicU64,
    /// Since when (ms since `born`, plus one) a call found the session without a server; 0
    /// while it has one.
    down_ms: AtomicU64,
    /// Since when (ms since `born`, plus one) calls on the current client get no answer
    /// within the command timeout; 0 once one is answered.
    unanswered_ms: AtomicU64,
    /// Counts replacements: a call that started on a client since replaced does not mark its
    /// successor unanswered.
    generation: AtomicU64,
    /// When (ms since `born`) the next sweep of own nodes is due ([`ZkBackend::sweep`]).
    next_sweep_ms: AtomicU64,
    /// The backend's waiters, woken when a client is gone with its runtime ([`Conn`]).
    hub: Weak<ReleaseHub>,
}

impl Session {
    /// Opens a new session, on the current runtime.
    async fn open(hosts: &str, opts: &ZkOptions) -> Result<Client, LockError> {
        Self::connect(hosts, opts, None).await?.map_err(|e| {
            let permanent = refused_for_good(&e);
            LockError::backend(
                format!("zookeeper: cannot connect to {hosts}"),
                Some(Box::new(e)),
                permanent,
            )
        })
    }

    /// Connects on the current runtime, within the command timeout: to a new session, or with
    /// `resume` to that one (`SessionExpired` once the server ended it). The inner error is the
    /// client's or the server's answer.
    async fn connect(
        hosts: &str,
        opts: &ZkOptions,
        resume: Option<SessionInfo>,
    ) -> Result<Result<Client, ZkError>, LockError> {
        let mut connector = Client::connector()
            .with_session_timeout(opts.session_timeout)
            .with_connection_timeout(
                opts.connection_timeout
                    .unwrap_or_else(|| (opts.command_timeout / 3).min(Duration::from_secs(1))),
            );
        if let Some(session) = resume {
            connector = connector.with_session(session);
        }
        tokio::time::timeout(opts.command_timeout, connector.connect(hosts))
            .await
            .map_err(|_| {
                LockError::unavailable(
                    format!(
                        "zookeeper: no session with {hosts} within {:?}",
                        opts.command_timeout
                    ),
                    None,
                )
            })
    }

    fn new(conn: Conn, hosts: String, opts: ZkOptions, hub: Weak<ReleaseHub>) -> Self {
        Session {
            timeout_ms: AtomicU64::new(millis(conn.session_timeout())),
            client: Mutex::new(Arc::new(conn)),
            reconnect: tokio::sync::Mutex::new(()),
            hosts,
            opts,
            born: Instant::now(),
            horizon_ms: AtomicU64::new(0),
            down_ms: AtomicU64::new(0),
            unanswered_ms: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            next_sweep_ms: AtomicU64::new(0),
            hub,
        }
    }

    /// The current client; a new session when the current one expired or closed, or is stuck
    /// without a server and carries no lease (see [`Session`]); the same session on a new
    /// client when the client's task is gone with its runtime ([`revive`](Self::revive)).
    async fn client(&self) -> Result<Arc<Conn>, LockError> {
        let c = self.current();
        if c.ready() {
            match c.state() {
                SessionState::SyncConnected => {
                    if self.down_ms.load(Ordering::Relaxed) != 0 {
                        self.down_ms.store(0, Ordering::Relaxed);
                    }
                    if !self.unanswered() {
                        return Ok(c);
                    }
                }
                SessionState::Disconnected if !self.stuck() => return Ok(c),
                s if !s.is_terminated() && s != SessionState::Disconnected => return Ok(c),
                _ => {}
            }
        }
        drop(c);
        let _one = self.reconnect.lock().await;
        let c = self.current();
        if !c.ready() {
            return self.revive(c).await;
        }
        let state = c.state();
        let expired = state.is_terminated();
        let stuck = match state {
            SessionState::Disconnected => self.stuck(),
            SessionState::SyncConnected => self.unanswered(),
            _ => false,
        };
        if !expired && !stuck {
            return Ok(c); // replaced or reconnected meanwhile
        }
        drop(c);
        if expired {
            tracing::warn!("zookeeper: session {state:?}; opening a new one");
        }
        let fresh = Self::open(&self.hosts, &self.opts).await?;
        let fresh = Arc::new(Conn::new(fresh, LIVE, self.hub.clone()));
        let mut slot = self.client.lock().unwrap_or_else(PoisonError::into_inner);
        // Checked again where no lease can be noted unseen (`is_current` takes this lock after
        // noting one): an old session that came back (connected again, or answering again), or
        // was granted a lease meanwhile, is kept (the new one, which has no nodes, closes when
        // dropped); so is one whose task went with its runtime meanwhile, which the next call
        // resumes.
        let back = match slot.state() {
            SessionState::SyncConnected => self.unanswered_ms.load(Ordering::Relaxed) == 0,
            _ => false,
        };
        if !expired && (back || !self.lapsed() || !slot.ready()) {
            return Ok(slot.clone());
        }
        // The old client, dropped by its last user, closes its session when it reaches a
        // server again (or the session expires): its nodes go, unneeded.
        self.install(&mut slot, fresh.clone());
        if !expired {
            tracing::warn!(
                "zookeeper: the session had no server (or no answer) for over {STUCK_AFTER:?} \
                 and no lease on it left; replaced by a new one"
            );
        }
        Ok(fresh)
    }

    /// Brings back, under the reconnect lock, the client in use when it cannot serve calls
    /// ([`Conn::ready`]): syncs the server of a resumed session, or resumes the session of a
    /// client whose task went with its runtime, on the current runtime.
    ///
    /// The server keeps a session whose client went silent until the session timeout, so the
    /// session normally lives on, with every node of it: locks held and places in queues stay
    /// this backend's, and renewals go on. If it expired meanwhile (or expires after the resume,
    /// before its server synced), its nodes are gone: a new session is opened, and the renewals
    /// of its locks answer "not the owner" (their guards are lost), as after any expiry. A
    /// resumed session is used once its server has synced
    /// with the leader: it may lag behind the writes the session made through the old client
    /// (the client library resumes with no zxid and leaves that to a `sync`). Never dropped
    /// unused: the last client of a session closes it when dropped.
    async fn revive(&self, c: Arc<Conn>) -> Result<Arc<Conn>, LockError> {
        let id = c.session_id();
        if c.mark.load(Ordering::Acquire) == UNSYNCED {
            match self.sync(&c).await {
                Ok(()) => return Ok(c),
                // Resumed, then without a server until the session expired (cut off right
                // after the resume answered): it never comes back, and syncing it fails at
                // once, for good. A new one, as when the resume itself finds it expired.
                Err(_) if c.state().is_terminated() => {
                    tracing::warn!(
                        session = %id,
                        "zookeeper: the resumed session expired before its server synced (its \
                         nodes are gone); opening a new one"
                    );
                    let fresh = Arc::new(Conn::new(
                        Self::open(&self.hosts, &self.opts).await?,
                        LIVE,
                        self.hub.clone(),
                    ));
                    drop(c);
                    self.install(
                        &mut self.client.lock().unwrap_or_else(PoisonError::into_inner),
                        fresh.clone(),
                    );
                    return Ok(fresh);
                }
                Err(e) => return Err(e),
            }
        }
        let fresh = match Self::connect(&self.hosts, &self.opts, Some(c.session().clone())).await? {
            Ok(resumed) => {
                tracing::warn!(
                    session = %id,
                    "zookeeper: resumed the session, whose task went with the runtime it ran on"
                );
                Conn::new(resumed, UNSYNCED, self.hub.clone())
            }
            Err(ZkError::SessionExpired) => {
                tracing::warn!(
                    session = %id,
                    "zookeeper: the session, whose task went with the runtime it ran on, \
                     expired meanwhile (its nodes are gone); opening a new one"
                );
                let fresh = Self::open(&self.hosts, &self.opts).await?;
                Conn::new(fresh, LIVE, self.hub.clone())
            }
            Err(e) => {
                return Err(LockError::unavailable(
                    format!("zookeeper: cannot resume the session with {}", self.hosts),
                    Some(Box::new(e)),
                ))
            }
        };
        let fresh = Arc::new(fresh);
        drop(c);
        self.install(
            &mut self.client.lock().unwrap_or_else(PoisonError::into_inner),
            fresh.clone(),
        );
        if !fresh.ready() {
            self.sync(&fresh).await?;
        }
        Ok(fresh)
    }

    /// Syncs the server of `c`, a resumed session, with the leader; `c` is ready then.
    async fn sync(&self, c: &Conn) -> Result<(), LockError> {
        let limit = self.opts.command_timeout;
        match tokio::time::timeout(limit, again(|| c.sync("/"))).await {
            Ok(Ok(())) => {
                let _ =
                    c.mark
                        .compare_exchange(UNSYNCED, LIVE, Ordering::AcqRel, Ordering::Acquire);
                Ok(())
            }
            Ok(Err(e)) => Err(unavailable("sync", e)),
            Err(_) => Err(LockError::unavailable(
                format!("zookeeper sync: no answer within {limit:?}"),
                None,
            )),
        }
    }

    /// Puts `fresh` in `slot` (the client in use), with the counts of the old one reset.
    fn install(&self, slot: &mut Arc<Conn>, fresh: Arc<Conn>) {
        self.timeout_ms
            .store(millis(fresh.session_timeout()), Ordering::Relaxed);
        self.down_ms.store(0, Ordering::Relaxed);
        self.unanswered_ms.store(0, Ordering::Relaxed);
        self.generation.fetch_add(1, Ordering::Relaxed);
        *slot = fresh;
    }

    /// The client in use, brought back first if it cannot serve calls
    /// ([`revive`](Self::revive)); unlike [`client`](Self::client), never a new session for one
    /// that is merely without a server.
    async fn live(&self) -> Result<Arc<Conn>, LockError> {
        let c = self.current();
        if c.ready() {
            return Ok(c);
        }
        drop(c);
        let _one = self.reconnect.lock().await;
        let c = self.current();
        if c.ready() {
            return Ok(c);
        }
        self.revive(c).await
    }

    /// Whether `c`'s session is still the one in use. A call that reports a lock or a renewal
    /// made on `c` checks this after noting the lease ([`granted`](Self::granted)): either the
    /// check sees a replacement, or the replacement sees the lease and does not happen. A
    /// session resumed on a new client ([`revive`](Self::revive)) is the same session.
    fn is_current(&self, c: &Conn) -> bool {
        self.client
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .session_id()
            == c.session_id()
    }

    fn current(&self) -> Arc<Conn> {
        self.client
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// Milliseconds since `born`, rounded up, at least 1.
    fn now_ms(&self) -> u64 {
        millis(self.born.elapsed()).saturating_add(1)
    }

    /// Notes a lease of `lease` granted by a write whose answer just arrived.
    fn granted(&self, lease: Duration) {
        let until = self.now_ms().saturating_add(millis(lease));
        self.horizon_ms.fetch_max(until, Ordering::Relaxed);
    }

    /// Whether every lease this session granted has run out (by the local clock, counted
    /// from the answers: no guard counts on any of them).
    fn lapsed(&self) -> bool {
        self.now_ms() > self.horizon_ms.load(Ordering::Relaxed)
    }

    /// Whether a sweep of own nodes is due (one per session timeout at most); the caller that
    /// is told so does it.
    fn sweep_due(&self) -> bool {
        let now = self.now_ms();
        let due = self.next_sweep_ms.load(Ordering::Relaxed);
        now >= due
            && self
                .next_sweep_ms
                .compare_exchange(
                    due,
                    now.saturating_add(millis(self.timeout())),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }

    /// The replacement count, read before a call (see [`no_answer`](Self::no_answer)).
    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// A call started at `generation` got no answer for `waited`: unless the client was
    /// replaced since, this starts the unanswered count, from when the call was made.
    fn no_answer(&self, generation: u64, waited: Duration) {
        if self.generation() == generation {
            let _ = self.unanswered_ms.compare_exchange(
                0,
                self.now_ms().saturating_sub(millis(waited)).max(1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// A call was answered: the session has a server.
    fn answered(&self) {
        if self.unanswered_ms.load(Ordering::Relaxed) != 0 {
            self.unanswered_ms.store(0, Ordering::Relaxed);
        }
    }

    /// Whether calls have gone unanswered for [`STUCK_AFTER`] (the client's state may still say
    /// `SyncConnected`: see [`Session`]) and the session carries no lease any more.
    fn unanswered(&self) -> bool {
        let since = self.unanswered_ms.load(Ordering::Relaxed);
        since != 0 && self.now_ms().saturating_sub(since) >= millis(STUCK_AFTER) && self.lapsed()
    }

    /// Whether the session (found without a server now) has been so for [`STUCK_AFTER`] and
    /// carries no lease any more. The first call to find it so starts the count.
    fn stuck(&self) -> bool {
        let now = self.now_ms();
        let since =
            match self
                .down_ms
                .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return false,
                Err(since) => since,
            };
        now.saturating_sub(since) >= millis(STUCK_AFTER) && self.lapsed()
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Own nodes by (resource, owner token): each acquisition's node this backend made.
type Owned = Arc<Mutex<HashMap<(Arc<str>, OwnerToken), Own>>>;

/// One own node: the session it was made on, its name, and what the last write to it left.
struct Own {
    session: i64,
    name: String,
    /// When the lease that write granted ends (ms since the session's `born`, counted from
    /// when its answer arrived): no guard or waiter counts on the node after that.
    until_ms: u64,
    /// The node's version after that write.
    version: i32,
}

/// Each queued (or barging) waiter's watch task: by lock and owner token, the node it watches,
/// the session it watches on, and the task.
type Watchers = super::WatchTasks<(String, i64, AbortHandle)>;

/// Abandons that got no answer (no server, or no answer in time): each attempt's node
/// directory, by lock and owner token. The `create` of the attempt they undo may still be
/// applied: the client keeps requests while it has no server and sends them when it has one
/// again, so the node can appear after every undo the locker tried, with a fresh lease and no
/// guard. One task per backend ([`ZkBackend::look_again`]) finds such nodes then (moved to
/// the fallback thread if the runtime it runs on shuts down: [`Settler`]); `running` says
/// whether it is at work.
#[derive(Default)]
struct Unsettled {
    attempts: Mutex<HashMap<(Arc<str>, OwnerToken), String>>,
    running: AtomicBool,
}

impl Unsettled {
    fn attempts(&self) -> std::sync::MutexGuard<'_, HashMap<(Arc<str>, OwnerToken), String>> {
        self.attempts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts the task that settles the attempts on `rt`, unless it runs already.
    fn start(self: &Arc<Self>, session: &Arc<Session>, rt: &Handle, on_fallback: bool) {
        if self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        rt.spawn(settle(Settler {
            session: session.clone(),
            unsettled: self.clone(),
            on_fallback,
            done: false,
        }));
    }
}

/// The task that settles unanswered abandons ([`ZkBackend::look_again`]), and what it needs.
/// Dropped before it returned — the runtime running it shut down — it lowers `running` (which
/// would otherwise stay up, so that no attempt noted later started the task again and none was
/// settled any more), and starts the task again on the fallback thread while attempts are left.
struct Settler {
    session: Arc<Session>,
    unsettled: Arc<Unsettled>,
    /// On the fallback runtime, which does not shut down: not moved again.
    on_fallback: bool,
    /// Returned: the flag was lowered, or another task took the attempts over.
    done: bool,
}

impl Drop for Settler {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.unsettled.running.store(false, Ordering::Release);
        if self.on_fallback || self.unsettled.attempts().is_empty() {
            return;
        }
        let Some(rt) = crate::util::fallback_runtime() else {
            tracing::warn!(
                "zookeeper: the task settling unanswered undos went with its runtime; the next \
                 unanswered undo starts it again"
            );
            return;
        };
        tracing::debug!(
            "zookeeper: the task settling unanswered undos moves to the fallback thread"
        );
        self.unsettled.start(&self.session, rt, true);
    }
}

/// The task of [`ZkBackend::look_again`]: waits for the session to have a server, then looks
/// each unsettled attempt's node up and deletes it; ends when none is left.
async fn settle(mut task: Settler) {
    let (session, unsettled) = (task.session.clone(), task.unsettled.clone());
    let limit = session.opts.command_timeout;
    loop {
        let left: Vec<_> = unsettled
            .attempts()
            .iter()
            .map(|(k, dir)| (k.clone(), dir.clone()))
            .collect();
        if left.is_empty() {
            unsettled.running.store(false, Ordering::Release);
            // One noted after the look but before the flag went down is this task's.
            if unsettled.attempts().is_empty() || unsettled.running.swap(true, Ordering::AcqRel) {
                task.done = true;
                return;
            }
            continue;
        }
        // A client whose task went with its runtime is resumed first (its session's nodes are
        // the ones to look for).
        let c = match tokio::time::timeout(limit, session.live()).await {
            Ok(Ok(c)) => c,
            _ => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if c.state().is_terminated() {
            // Every session the attempts were on has ended: their nodes are gone.
            unsettled.attempts().clear();
            continue;
        }
        // The server first catches up with the leader: one this session moved to may not have
        // applied yet a `create` that was on its way to the last one, and its look-up would
        // miss the node.
        let synced = matches!(
            tokio::time::timeout(limit, again(|| c.sync("/"))).await,
            Ok(Ok(()))
        );
        if synced && c.state() == SessionState::SyncConnected {
            for (key, dir) in left {
                let found = tokio::time::timeout(limit, ZkBackend::find_by_token(&c, &dir, &key.1));
                // Settled once no node of the token is left: each attempt of a wait may have
                // left one (their `create`s queued while the session had no server, all
                // applied once it has one), so a node deleted is looked for again.
                let settled = match found.await {
                    Ok(Ok(None)) => true,
                    Ok(Ok(Some((name, _)))) => {
                        let path = format!("{dir}/{name}");
                        let deleted = tokio::time::timeout(limit, c.delete(&path, None));
                        if matches!(deleted.await, Ok(Ok(()) | Err(ZkError::NoNode))) {
                            tracing::debug!(
                                "zookeeper: deleted a node of an attempt whose undo had no \
                                 answer"
                            );
                            send_rmdir(&c, &dir);
                        }
                        false
                    }
                    _ => false,
                };
                if settled {
                    unsettled.attempts().remove(&key);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Lock directories this backend deleted once left alone ([`Idle`], [`send_rmdir`]): a hint for [`ZkBackend::create_own`] to send the
/// directory's `create` with its first try there. A hint is only that — one wrong costs a
/// refused `create` sent along with the child's (waiters were left in the directory), one
/// missing a round trip — so at most [`TIDIED_HINTS`] are kept, and all are dropped when that
/// many are.
#[derive(Default)]
struct Tidied(Mutex<HashSet<String>>);

/// How many [`Tidied`] hints a backend keeps at most.
const TIDIED_HINTS: usize = 1024;

impl Tidied {
    fn dirs(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn note(&self, dir: &str) {
        let mut dirs = self.dirs();
        if dirs.len() >= TIDIED_HINTS {
            dirs.clear();
        }
        dirs.insert(dir.to_owned());
    }

    /// Whether `dir` was noted (the note is used up).
    fn take(&self, dir: &str) -> bool {
        self.dirs().remove(dir)
    }
}

/// Lock directories this backend left, maybe empty (a release, a try that found the lock
/// held), and when it last did: each is deleted ([`send_rmdir`]) once it has been left alone
/// for [`DIR_IDLE`] — at this backend's next release or try after that, and at once for the
/// oldest when more than [`IDLE_DIRS`] are waiting.
///
/// Why not at once, behind the own node's delete: a lock taken again and again (a lock per
/// user, per account, a bench's loop) would then delete and make its directory on every
/// cycle — two more writes through the ensemble's quorum each time, 0.55–0.6× the uncontended
/// pairs a second (`dlock-bench --quick --only zookeeper`: 3,122–3,257 against 4,955–5,708).
/// A key left alone for a second costs one `delete` more, once; a lock per order id is
/// cleaned up a second after its last use. Directories of a backend that makes no release or
/// try anymore are left to the server's cleanup of empty containers, the backstop.
#[derive(Default)]
struct Idle(Mutex<IdleDirs>);

#[derive(Default)]
struct IdleDirs {
    /// When each directory was last left.
    last: HashMap<Arc<str>, Instant>,
    /// Every time one was left, oldest first (a directory left again since has a later entry).
    order: std::collections::VecDeque<(Instant, Arc<str>)>,
}

/// How long a lock directory is left alone before this backend deletes it ([`Idle`]).
const DIR_IDLE: Duration = Duration::from_secs(1);

/// How many left directories [`Idle`] keeps waiting at most.
const IDLE_DIRS: usize = 4096;

impl Idle {
    /// Notes that `dir` was left now; answers the directories to delete now.
    fn left(&self, dir: &str) -> Vec<Arc<str>> {
        let now = Instant::now();
        let mut d = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let dir: Arc<str> = match d.last.get_key_value(dir) {
            Some((known, _)) => known.clone(),
            None => dir.into(),
        };
        d.last.insert(dir.clone(), now);
        d.order.push_back((now, dir));
        let mut out = Vec::new();
        while let Some((at, _)) = d.order.front() {
            if now.duration_since(*at) < DIR_IDLE && d.last.len() <= IDLE_DIRS {
                break;
            }
            let Some((at, dir)) = d.order.pop_front() else {
                break;
            };
            // Only its latest entry counts: one left again since is not idle.
            if d.last.get(&dir) == Some(&at) {
                d.last.remove(&dir);
                out.push(dir);
            }
        }
        out
    }
}

/// Sends a `delete` of the lock directory `dir`, whose last node may have gone, and does not
/// wait for the answer.
///
/// Why: a lock's directory is a container node, which the server deletes by itself once
/// empty, but only every `znode.container.checkIntervalMs` (60 s by default), at most
/// `znode.container.maxPerMinute` (10,000) a minute, and never one that never had a child. A
/// lock per order id at more than about 170 new keys a second left directories piling up
/// without bound, in the ensemble's memory and in every snapshot, and the lock root's listing
/// outgrew `jute.maxbuffer`. The containers stay, as the backstop for a delete that was lost.
///
/// Safe at any time: ZooKeeper refuses it (`NotEmpty`) while any node is left — a holder's, a
/// queued waiter's, a try's —, so it never takes a lock or a place in line from anyone, and a
/// `create` into a directory deleted meanwhile finds it gone and makes it again
/// ([`ZkBackend::create_own`]). `NoNode` when another got there first. Both answers, and any
/// other, are dropped.
///
/// Off the caller's path: the client sends a request when it is called (its documented
/// behaviour; the future only awaits the answer), and the server applies it after the requests
/// the session sent before — an undo's own node's `delete` —, so no round trip is added.
fn send_rmdir(c: &Client, dir: &str) {
    drop(c.delete(dir, None));
}

/// Locks in ZooKeeper. See the [module docs](self) for the recipe, fencing and leases.
#[derive(Clone)]
pub struct ZkBackend {
    session: Arc<Session>,
    /// `<chroot>/<prefix>`.
    base: Arc<str>,
    hub: Arc<ReleaseHub>,
    owned: Owned,
    watchers: Watchers,
    unsettled: Arc<Unsettled>,
    tidied: Arc<Tidied>,
    idle: Arc<Idle>,
}

impl fmt::Debug for ZkBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkBackend")
            .field("hosts", &self.session.hosts)
            .field("base", &self.base)
            .field("session_timeout", &self.session.timeout())
            .finish_non_exhaustive()
    }
}

/// One child of a lock's directory.
#[derive(Clone, Debug)]
struct Child {
    name: String,
    /// Its place in creation order (see [`sorted`]): lower is earlier.
    order: i64,
}

/// The children of a lock directory in creation order (names without a sequence are ignored).
///
/// A sequence is the directory's 32-bit child version when the node was made: past 2^31 − 1
/// creates in one directory (a lock held for weeks while others try it, each try a create)
/// it wraps to negative numbers (`<token>--2147483648`, then up), and ordered as numbers the
/// newest nodes came first — a new attempt found itself at the head while the holder's node
/// was there. The nodes alive at once were all made within far fewer than 2^31 creates, so
/// their signed 32-bit distance from any one of them orders them. (Sequences past the 32-bit
/// range, from a server that counts in 64 bits, are ordered as numbers.)
fn sorted(children: Vec<String>) -> Vec<Child> {
    let mut out: Vec<Child> = children
        .into_iter()
        .filter_map(|name| {
            // Tokens are hex, so the first '-' ends the token; a wrapped sequence has a sign.
            let seq: i64 = name.split_once('-')?.1.parse().ok()?;
            Some(Child { name, order: seq })
        })
        .collect();
    let narrow = |seq: i64| i32::try_from(seq).ok();
    if let Some(pivot) = out.first().and_then(|c| narrow(c.order)) {
        if out.iter().all(|c| narrow(c.order).is_some()) {
            for c in &mut out {
                c.order = i64::from((c.order as i32).wrapping_sub(pivot));
            }
        }
    }
    out.sort_by_key(|c| c.order);
    out
}

/// Whether `name` is a node of `token` (`<token>-<sequence>`).
fn owned_by(name: &str, token: &OwnerToken) -> bool {
    name.strip_prefix(token.as_str())
        .is_some_and(|rest| rest.starts_with('-'))
}

/// A node's lease in ms from its data (a node without one never expires by lease).
fn lease_of(data: &[u8]) -> Option<i64> {
    std::str::from_utf8(data).ok()?.parse().ok()
}

fn lease_data(d: Duration) -> Vec<u8> {
    millis(d).to_string().into_bytes()
}

/// A resource string as one node name: every byte outside a conservative set percent-encoded.
fn node_name(resource: &str) -> String {
    let mut out = String::with_capacity(resource.len());
    for b in resource.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.:{}~=+,;@!*()".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Whether `e` is the loss of a connection (the client moves to another server; the session
/// lives on), after which a request can be sent again.
fn lost_connection(e: &ZkError) -> bool {
    matches!(
        e,
        ZkError::ConnectionLoss | ZkError::Timeout | ZkError::Custom(_)
    )
}

/// Runs `op` until it answers something other than a lost connection (the caller bounds the
/// time). Only for requests that may be repeated: reads, `setData`, `delete` (a repeated delete
/// of a node the first one deleted answers `NoNode`).
async fn again<T, Fut: Future<Output = Result<T, ZkError>>>(
    mut op: impl FnMut() -> Fut,
) -> Result<T, ZkError> {
    let mut pause = Duration::from_millis(10);
    loop {
        match op().await {
            Err(e) if lost_connection(&e) => {
                tracing::debug!(error = %e, "zookeeper: connection lost; sending again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            r => return r,
        }
    }
}

/// What a lock or a renewal on a session given up meanwhile ([`Session`]) answers: its node
/// goes with that session.
fn superseded() -> LockError {
    LockError::unavailable(
        "zookeeper: the session was replaced while the request was on it",
        None,
    )
}

/// Maps a ZooKeeper failure to `Unavailable`, or to `Misconfigured` when the ensemble refused
/// for good ([`refused_for_good`]).
fn unavailable(what: &str, e: ZkError) -> LockError {
    let permanent = refused_for_good(&e);
    LockError::backend(
        format!("zookeeper {what} failed: {e}"),
        Some(Box::new(e)),
        permanent,
    )
}

/// Whether ZooKeeper refused in a way retrying does not change: an ACL on the lock root or
/// a lock's node that denies this client (`NoAuth`), failed authentication (`AuthFailed`),
/// a request the ensemble does not implement, or a client-side argument error. Connection
/// loss, timeouts, an expired or moved session, a read-only server and throttling pass.
fn refused_for_good(e: &ZkError) -> bool {
    matches!(
        e,
        ZkError::NoAuth
            | ZkError::AuthFailed
            | ZkError::InvalidAcl
            | ZkError::Unimplemented
            | ZkError::BadArguments(_)
    )
}

/// The epoch of a zxid: the leader's term the write was made in (its upper 32 bits). One
/// leader proposes every write of an epoch, and stamps each one's `mtime` by its own wall
/// clock; a new leader starts a new epoch.
fn epoch(zxid: i64) -> i64 {
    zxid >> 32
}

/// The ensemble's "now" for expiry checks: the `mtime` of the observer's own write (of this
/// attempt, or an inspection's empty write to the lock root) and the epoch it was made in.
#[derive(Clone, Copy, Debug)]
struct Now {
    mtime: i64,
    epoch: i64,
}

impl Now {
    fn of(stat: &Stat) -> Self {
        Now {
            mtime: stat.mtime,
            epoch: epoch(stat.mzxid),
        }
    }
}

/// A node read for an expiry check: where it is, its lease and its stat.
///
/// A lease is judged only against a "now" of the same epoch as the node's last write
/// (`mzxid`): both `mtime`s were then stamped by one leader's clock. The leaders of two epochs
/// are two machines whose wall clocks differ by whatever NTP left between them (tens of ms are
/// common), while a lease shorter than ¾ of the session timeout has a margin of one
/// millisecond ([`Backend::lease_margin`]): judged across a leader change, a new leader whose
/// clock runs ahead ended a living holder's lease early by the difference, and let a second
/// holder in. A node last written in an earlier epoch is not expired, however old its
/// `mtime`: its lease is started again in the current epoch ([`ZkBackend::restart_stale`])
/// and judged by the current leader's clock from then on. Its holder loses nothing: its own
/// local lease counts from its last answered renewal, before that restart.
struct Seen {
    child: Child,
    lease: Option<i64>,
    stat: Stat,
}

impl Seen {
    /// Whether the node's last write was stamped by the same leader as `now`.
    fn same_clock(&self, now: Now) -> bool {
        epoch(self.stat.mzxid) == now.epoch
    }

    /// Whether its lease has run out by `now`: never across epochs (see [`Seen`]).
    fn expired(&self, now: Now) -> bool {
        self.same_clock(now)
            && self
                .lease
                .is_some_and(|l| self.stat.mtime.saturating_add(l) <= now.mtime)
    }

    /// Its lease left at `now`; for a node of another epoch, its whole lease (the most it has
    /// left once it is started again in the current one).
    fn remaining(&self, now: Now) -> Option<Duration> {
        let l = self.lease?;
        let left = if self.same_clock(now) {
            self.stat.mtime.saturating_add(l).saturating_sub(now.mtime)
        } else {
            l
        };
        Some(Duration::from_millis(left.max(0).unsigned_abs()))
    }

    /// Whether its lease was last written in an epoch before `now`'s: to be started again in
    /// the current one before it can be judged.
    fn stale(&self, now: Now) -> bool {
        self.lease.is_some() && epoch(self.stat.mzxid) < now.epoch
    }
}

impl ZkBackend {
    /// Connects to the ensemble named by a `zk://host:port[,host:port…][/chroot]` URL
    /// (`?session_timeout_ms=N` overrides [`ZkOptions::session_timeout`]), opens a session and
    /// creates the lock root `<chroot>/<prefix>` if missing.
    pub async fn connect(url: &str, opts: ZkOptions) -> Result<Self, LockError> {
        let parsed = url::parse(url)?;
        let mut opts = opts;
        if let Some(t) = parsed.session_timeout {
            opts = opts.session_timeout(t);
        }
        if opts.prefix.is_empty() || opts.prefix.contains('/') {
            return Err(LockError::misconfigured(
                "zookeeper: the node prefix must be one non-empty node name",
                None,
            ));
        }
        let hosts = parsed.hosts.join(",");
        let hub = ReleaseHub::new();
        let client = Conn::new(
            Session::open(&hosts, &opts).await?,
            LIVE,
            Arc::downgrade(&hub),
        );
        let base: Arc<str> = format!("{}/{}", parsed.chroot, opts.prefix).into();
        let dir_opts = CreateMode::Persistent.with_acls(Acls::anyone_all());
        let mkdir = client.mkdir(&base, &dir_opts);
        match tokio::time::timeout(opts.command_timeout, mkdir).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(unavailable("creating the lock root", e)),
            Err(_) => {
                return Err(LockError::unavailable(
                    "zookeeper: creating the lock root timed out",
                    None,
                ))
            }
        }
        let session = Session::new(client, hosts, opts, Arc::downgrade(&hub));
        Ok(ZkBackend {
            session: Arc::new(session),
            base,
            hub,
            owned: Arc::default(),
            watchers: Arc::default(),
            unsettled: Arc::default(),
            tidied: Arc::default(),
            idle: Arc::default(),
        })
    }

    /// The session timeout the server granted.
    pub fn session_timeout(&self) -> Duration {
        self.session.timeout()
    }

    /// The id of the session in use. For tests.
    #[doc(hidden)]
    pub fn session_id(&self) -> i64 {
        self.session.current().session_id().0
    }

    /// Deletes every node of the lock named by `resource` (`<prefix>:{<key>}`): its holder's and
    /// its waiters'. For operators and tests; returns how many nodes it deleted.
    ///
    /// The nodes go from the last in line to the first, the holder's last: deleting the holder
    /// first would let the waiter behind it take the lock (its watch fires) before that
    /// waiter's own node was deleted in turn — a holder whose node then vanishes under it. A
    /// waiter that arrives meanwhile is not in the listing and takes the lock after the holder's
    /// node is gone, as after any release.
    pub async fn delete_lock(&self, resource: &str) -> Result<u64, LockError> {
        let dir = self.dir(resource);
        self.bounded("delete", async {
            let c = self.session.client().await?;
            let children = match again(|| c.list_children(&dir)).await {
                Ok(v) => v,
                Err(ZkError::NoNode) => return Ok(0),
                Err(e) => return Err(unavailable("list", e)),
            };
            let mut n = 0;
            for Child { name, .. } in sorted(children).into_iter().rev() {
                match again(|| c.delete(&format!("{dir}/{name}"), None)).await {
                    Ok(()) => n += 1,
                    Err(ZkError::NoNode) => {}
                    Err(e) => return Err(unavailable("delete", e)),
                }
            }
            send_rmdir(&c, &dir);
            Ok(n)
        })
        .await
    }

    fn dir(&self, resource: &str) -> String {
        format!("{}/{}", self.base, node_name(resource))
    }

    /// Runs `f` within the command timeout.
    async fn bounded<T>(
        &self,
        what: &str,
        f: impl Future<Output = Result<T, LockError>>,
    ) -> Result<T, LockError> {
        let limit = self.session.opts.command_timeout;
        let generation = self.session.generation();
        match tokio::time::timeout(limit, f).await {
            Ok(out) => {
                if out.is_ok() {
                    self.session.answered();
                }
                out
            }
            Err(_) => {
                self.session.no_answer(generation, limit);
                Err(LockError::unavailable(
                    format!("zookeeper {what}: no answer within {limit:?}"),
                    None,
                ))
            }
        }
    }

    /// Refuses a TTL over twice the session timeout (see the module docs), for an acquire
    /// and an extend alike.
    fn check_ttl(&self, ttl: Duration) -> Result<(), LockError> {
        let session = self.session.timeout();
        if ttl > session * 2 {
            return Err(LockError::InvalidTtl {
                ttl,
                reason: format!(
                    "the ZooKeeper backend takes TTLs up to twice its session timeout ({session:?}); raise the server's maxSessionTimeout and the session timeout"
                ),
            });
        }
        Ok(())
    }

    fn key(resource: &ResourceName, token: &OwnerToken) -> (Arc<str>, OwnerToken) {
        (resource.shared(), token.clone())
    }

    /// Notes `name` as `token`'s node on `c`'s session, and what a write to it just left:
    /// `lease` from now, the node at `stat`. Sweeps when a sweep is due ([`sweep`](Self::sweep)).
    fn note(
        &self,
        c: &Arc<Conn>,
        (resource, token): (&ResourceName, &OwnerToken),
        name: &str,
        lease: Duration,
        stat: &Stat,
    ) {
        let (session, version) = (c.session_id().0, stat.version);
        let until_ms = self.session.now_ms().saturating_add(millis(lease));
        let mut owned = self.owned.lock().unwrap_or_else(PoisonError::into_inner);
        match owned.get_mut(&Self::key(resource, token)) {
            Some(own) if own.session == session && own.name == name => {
                own.until_ms = until_ms;
                own.version = version;
            }
            _ => {
                let own = Own {
                    session,
                    name: name.to_owned(),
                    until_ms,
                    version,
                };
                owned.insert(Self::key(resource, token), own);
            }
        }
        drop(owned);
        if self.session.sweep_due() {
            self.sweep(c);
        }
    }

    /// Drops the records of own nodes nothing counts on any more, and deletes those nodes: a
    /// node whose lease ended a session timeout ago or more (a lock released with a minimum
    /// hold is left to its lease; a release that never landed; a guard leaked with renewal
    /// off), which would otherwise stay on the server — and in this map — for as long as the
    /// session lives, unless another attempt on the same lock deleted it. The session timeout
    /// is the margin for the local clock against the ensemble's: every guard's and waiter's
    /// local lease ended before. A delete checks the version of the last write, so a node
    /// written since is left. Records of a session given up ([`Session`]) are dropped without
    /// a delete: their nodes go with it.
    fn sweep(&self, c: &Arc<Conn>) {
        // A call answered on a client replaced meanwhile: the records to keep are the current
        // session's, which this one cannot tell apart from a dead session's. Left to the next.
        if !self.session.is_current(c) {
            return;
        }
        let now = self.session.now_ms();
        let margin = millis(self.session.timeout());
        let session = c.session_id().0;
        let mut stale = Vec::new();
        self.owned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(resource, _), own| {
                let keep = own.session == session && own.until_ms.saturating_add(margin) > now;
                if !keep && own.session == session {
                    let path = format!("{}/{}", self.dir(resource), own.name);
                    stale.push((path, own.version));
                }
                keep
            });
        if stale.is_empty() {
            return;
        }
        tracing::debug!(
            nodes = stale.len(),
            "zookeeper: deleting own nodes whose lease ended"
        );
        let (task_c, limit) = (c.clone(), self.session.opts.command_timeout);
        c.spawn(async move {
            let c = task_c;
            for (path, version) in stale {
                // Gone already, written since, or no answer: left to the next attempt on
                // the lock or to the session's end.
                let deleted = tokio::time::timeout(limit, c.delete(&path, Some(version))).await;
                if let (Ok(Ok(())), Some((dir, _))) = (deleted, path.rsplit_once('/')) {
                    send_rmdir(&c, dir);
                }
            }
        });
    }

    /// How many predecessor watches are set (one per queued waiter of this backend, their
    /// tasks running). For tests.
    #[doc(hidden)]
    pub fn watching(&self) -> usize {
        self.watchers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter(|(_, _, task)| !task.is_finished())
            .count()
    }

    /// Whether the client in use says it has a server. For tests.
    #[doc(hidden)]
    pub fn connected(&self) -> bool {
        self.session.current().state() == SessionState::SyncConnected
    }

    /// How many attempts wait to be settled after an undo that got no answer
    /// ([`look_again`](Self::look_again)). For tests.
    #[doc(hidden)]
    pub fn unsettled(&self) -> usize {
        self.unsettled.attempts().len()
    }

    /// How many own nodes this backend keeps a record of. For tests.
    #[doc(hidden)]
    pub fn own_nodes(&self) -> usize {
        self.owned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// `token`'s node, if it was made on `c`'s session (a node of a session given up is not
    /// one's own any more: [`Session`]).
    fn known(&self, c: &Client, resource: &ResourceName, token: &OwnerToken) -> Option<String> {
        self.owned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&Self::key(resource, token))
            .filter(|own| own.session == c.session_id().0)
            .map(|own| own.name.clone())
    }

    fn forget(&self, resource: &ResourceName, token: &OwnerToken) {
        self.owned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&Self::key(resource, token));
    }

    fn stop_watch(&self, resource: &ResourceName, token: &OwnerToken) {
        let mut w = self.watchers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, _, h)) = w.remove(&Self::key(resource, token)) {
            h.abort();
        }
    }

    /// Notes that this backend left lock directory `dir`, maybe empty, and deletes those left
    /// alone long enough ([`Idle`]); each deleted one is noted as such ([`Tidied`]: this
    /// backend's next `create` there makes it first, in the same round trip).
    fn leave_dir(&self, c: &Client, dir: &str) {
        for idle in self.idle.left(dir) {
            send_rmdir(c, &idle);
            self.tidied.note(&idle);
        }
    }

    /// Creates the own child of `token` in `dir` (and `dir`, as a container node, if missing).
    /// `true` beside its stat when this request made it; `false` when the answer was lost and
    /// a node of the token was found instead — this request's, or one an earlier attempt of
    /// the token made whose answer the command timeout cut off, with the lease of that
    /// attempt's time.
    ///
    /// A missing directory is normal: a backend deletes one it left alone ([`Idle`]), this one
    /// or another. Its `create` and the child's are then sent together, the child's right
    /// behind it without waiting for its answer (the client sends a request when it is called,
    /// and the server applies a session's requests in order): one round trip, not two. From the
    /// first try so when this backend deleted the directory itself ([`Tidied`]).
    async fn create_own(
        &self,
        c: &Client,
        dir: &str,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<(String, Stat, bool), LockError> {
        let path = format!("{dir}/{}-", token.as_str());
        let data = lease_data(lease);
        let opts = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
        let dir_opts = CreateMode::Container.with_acls(Acls::anyone_all());
        let mut mkdir = self.tidied.take(dir);
        loop {
            // Sent in this order: the directory's create (when it is to be made) is applied
            // before the child's.
            let container = mkdir.then(|| c.create(dir, &[], &dir_opts));
            let made = c.create(&path, &data, &opts);
            let (dir_made, made) = match container {
                Some(container) => {
                    let (d, m) = futures_util::future::join(container, made).await;
                    (Some(d), m)
                }
                None => (None, made.await),
            };
            mkdir = false;
            match made {
                Ok((stat, seq)) => {
                    self.session.granted(lease);
                    return Ok((format!("{}-{seq}", token.as_str()), stat, true));
                }
                Err(e) if lost_connection(&e) => {
                    // The create may have been applied: look for the node by its token
                    // (protected mode) before creating another.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    if let Some((name, stat)) = Self::find_by_token(c, dir, token).await? {
                        self.session.granted(lease);
                        return Ok((name, stat, false));
                    }
                }
                Err(ZkError::NoNode) => {
                    // The lock's directory does not exist (first use, the last node to leave
                    // it deleted it, or the server removed the empty container): made with the
                    // next try. Unless it was just tried and the lock root is what is missing.
                    match dir_made {
                        None | Some(Ok(_) | Err(ZkError::NodeExists)) => {}
                        Some(Err(ZkError::NoNode)) => {
                            let opts = CreateMode::Persistent.with_acls(Acls::anyone_all());
                            c.mkdir(&self.base, &opts)
                                .await
                                .map_err(|e| unavailable("creating the lock root", e))?;
                        }
                        Some(Err(e)) if lost_connection(&e) => {}
                        Some(Err(e)) => return Err(unavailable("create", e)),
                    }
                    mkdir = true;
                }
                Err(e) => return Err(unavailable("create", e)),
            }
        }
    }

    /// The node of `token` in `dir` made on `c`'s session, looked up by its name (protected
    /// mode), and its stat. A node of the token on another session (one this backend gave up
    /// when it had no server: [`Session`]) is not it: nothing relies on that one, and its
    /// session takes it away.
    async fn find_by_token(
        c: &Client,
        dir: &str,
        token: &OwnerToken,
    ) -> Result<Option<(String, Stat)>, LockError> {
        let kids = match again(|| c.list_children(dir)).await {
            Ok(k) => k,
            Err(ZkError::NoNode) => return Ok(None),
            Err(e) => return Err(unavailable("getChildren", e)),
        };
        for name in kids.into_iter().filter(|k| owned_by(k, token)) {
            let own = format!("{dir}/{name}");
            match again(|| c.check_stat(&own)).await {
                Ok(Some(stat)) if stat.ephemeral_owner == c.session_id().0 => {
                    return Ok(Some((name, stat)))
                }
                Ok(_) => {}
                Err(e) => return Err(unavailable("exists", e)),
            }
        }
        Ok(None)
    }

    /// Whether the node `name` in `dir` exists and is an ephemeral node of `c`'s session.
    async fn on_this_session(&self, c: &Client, dir: &str, name: &str) -> Result<bool, LockError> {
        let path = format!("{dir}/{name}");
        match again(|| c.check_stat(&path)).await {
            Ok(stat) => Ok(stat.is_some_and(|s| s.ephemeral_owner == c.session_id().0)),
            Err(e) => Err(unavailable("exists", e)),
        }
    }

    /// Sets the lease of `own`'s node `name` in `dir`; `None` when the node is gone.
    async fn set_lease(
        &self,
        c: &Arc<Conn>,
        own: (&ResourceName, &OwnerToken),
        dir: &str,
        name: &str,
        lease: Duration,
    ) -> Result<Option<Stat>, LockError> {
        let path = format!("{dir}/{name}");
        match again(|| c.set_data(&path, &lease_data(lease), None)).await {
            Ok(stat) => {
                self.session.granted(lease);
                self.note(c, own, name, lease, &stat);
                Ok(Some(stat))
            }
            Err(ZkError::NoNode) => Ok(None),
            Err(e) => Err(unavailable("setData", e)),
        }
    }

    /// Reads the children at `idx`; `None` for one that is gone.
    async fn read(c: &Client, dir: &str, kids: &[&Child]) -> Result<Vec<Option<Seen>>, LockError> {
        let reads = kids.iter().map(|k| {
            let path = format!("{dir}/{}", k.name);
            async move {
                match again(|| c.get_data(&path)).await {
                    Ok((data, stat)) => Ok(Some(Seen {
                        child: (*k).clone(),
                        lease: lease_of(&data),
                        stat,
                    })),
                    Err(ZkError::NoNode) => Ok(None),
                    Err(e) => Err(unavailable("getData", e)),
                }
            }
        });
        futures_util::future::try_join_all(reads).await
    }

    /// Starts again, in the current epoch, the lease of every node of `seen` last written in an
    /// epoch before `now`'s ([`Seen::stale`]), so that the current leader's clock judges it
    /// from then on: its data is written back unchanged, guarded by the version read, and the
    /// new stat (`mtime`, `mzxid`) taken for its own. A version that no longer matches means
    /// the node was written meanwhile — renewed by its owner, or started again by another
    /// observer — and it stays as read: not expired, with its whole lease left, until the next
    /// attempt reads it again. A node gone meanwhile becomes `None`.
    ///
    /// The observer's next attempt judges the restarted lease: [`Seen::remaining`] reports it
    /// whole, and a waiter asks again by then (or at its next refresh), so one that died after
    /// a leader change frees its lock a lease after the first attempt that saw it in the new
    /// epoch, never later. The data change wakes no waiter: a predecessor watch re-arms on it.
    async fn restart_stale(
        c: &Client,
        dir: &str,
        seen: &mut [Option<Seen>],
        now: Now,
    ) -> Result<(), LockError> {
        let restarts = seen.iter().enumerate().filter_map(|(i, s)| {
            let s = s.as_ref().filter(|s| s.stale(now))?;
            let path = format!("{dir}/{}", s.child.name);
            let data = s.lease?.to_string().into_bytes();
            let version = s.stat.version;
            Some(async move {
                match again(|| c.set_data(&path, &data, Some(version))).await {
                    Ok(stat) => Ok((i, Some(Some(stat)))),
                    Err(ZkError::BadVersion) => Ok((i, Some(None))),
                    Err(ZkError::NoNode) => Ok((i, None)),
                    Err(e) => Err(unavailable("setData (lease restart)", e)),
                }
            })
        });
        for (i, outcome) in futures_util::future::try_join_all(restarts).await? {
            match outcome {
                Some(Some(stat)) => {
                    if let Some(s) = &mut seen[i] {
                        s.stat = stat;
                    }
                }
                Some(None) => {}
                None => seen[i] = None,
            }
        }
        Ok(())
    }

    /// Deletes an expired node, unless it was renewed since it was read.
    async fn delete_expired(c: &Client, dir: &str, seen: &Seen) -> Result<(), LockError> {
        let path = format!("{dir}/{}", seen.child.name);
        match again(|| c.delete(&path, Some(seen.stat.version))).await {
            Ok(()) | Err(ZkError::NoNode) | Err(ZkError::BadVersion) => Ok(()),
            Err(e) => Err(unavailable("delete", e)),
        }
    }

    async fn attempt(&self, args: &AcquireArgs<'_>) -> Result<Attempt, LockError> {
        let c = self.session.client().await?;
        let dir = self.dir(args.resource.as_str());
        let queue = args.mode == WaitMode::Queue;
        let mine = (args.resource, args.token);
        // The own node; the stat of this attempt's last write to it (its mtime is the
        // ensemble's "now" for expiry checks); whether its lease is the lock's TTL.
        // A node this token already has is kept, in any mode: a holder asking again (the
        // answer to its attempt was lost) keeps its lock. A try or a barge gives it the TTL at
        // once (that write tells the ensemble's "now"); one that is gone is forgotten and a new
        // node made.
        let known = match self.known(&c, args.resource, args.token) {
            Some(name) if !queue => match self.set_lease(&c, mine, &dir, &name, args.ttl).await? {
                Some(stat) => Some((name, Some(stat), true)),
                None => {
                    self.forget(args.resource, args.token);
                    None
                }
            },
            Some(name) => Some((name, None, false)),
            None => None,
        };
        let (mut own, mut stat, mut has_ttl) = match known {
            Some(own) => own,
            None => {
                let (name, stat, made) = self.create_own(&c, &dir, args.token, args.ttl).await?;
                self.note(&c, mine, &name, args.ttl, &stat);
                if made {
                    (name, Some(stat), true)
                } else {
                    // Found by its token after a lost answer: its lease may count from an
                    // earlier attempt's create (cut off by the command timeout, landed all the
                    // same) — granted as it was, the ensemble ended it before this attempt's
                    // local lease, and let another in beside this holder. Written afresh, as a
                    // new node's would be (a waiter's lease when queued, else the lock's).
                    let lease = if queue { args.waiter_ttl } else { args.ttl };
                    match self.set_lease(&c, mine, &dir, &name, lease).await? {
                        Some(stat) => (name, Some(stat), !queue),
                        None => {
                            self.forget(args.resource, args.token);
                            return Ok(Attempt::Held { remaining: None });
                        }
                    }
                }
            }
        };
        let mut own_path = format!("{dir}/{own}");
        // Nodes of this token other than `own`: made by an attempt whose answer was lost and
        // not found since, or left by a delete that failed. Never someone else's (the token
        // is secret); left, they would hold the lock or the queue for this token with nobody
        // knowing.
        let mine_prefix = format!("{}-", args.token.as_str());
        // Expired nodes ahead are deleted and the directory listed again; each round removes
        // the head and the predecessor when they lapsed. Enough rounds for a line of dead
        // waiters (a frozen process's, say): out of rounds, the attempt answers "held, time
        // unknown" with no watch set, and the waiter sleeps until its backoff.
        for _ in 0..CLEARING_ROUNDS {
            let kids = match again(|| c.list_children(&dir)).await {
                Ok(k) => sorted(k),
                Err(ZkError::NoNode) => Vec::new(),
                Err(e) => return Err(unavailable("getChildren", e)),
            };
            let strays: Vec<&Child> = kids
                .iter()
                .filter(|k| k.name != own && k.name.starts_with(&mine_prefix))
                .collect();
            if !strays.is_empty() {
                // The earliest node of this token on this session, ahead of `own`, was made
                // by an attempt whose answer never came (a `create` the command timeout cut
                // off): it keeps its place — it may hold the lock already — and `own` goes.
                let own_at = kids.iter().position(|k| k.name == own);
                let earlier = strays[0];
                let ahead = own_at.is_none_or(|at| kids[at].order > earlier.order);
                if ahead && self.on_this_session(&c, &dir, &earlier.name).await? {
                    match again(|| c.delete(&own_path, None)).await {
                        Ok(()) | Err(ZkError::NoNode) => {}
                        Err(e) => return Err(unavailable("delete", e)),
                    }
                    own.clone_from(&earlier.name);
                    own_path = format!("{dir}/{own}");
                    // Its lease written afresh, as a new node's would be (a waiter's lease
                    // when queued, else the lock's); the write tells the ensemble's "now".
                    let lease = if queue { args.waiter_ttl } else { args.ttl };
                    match self.set_lease(&c, mine, &dir, &own, lease).await? {
                        Some(s) => (stat, has_ttl) = (Some(s), !queue),
                        None => {
                            self.forget(args.resource, args.token);
                            return Ok(Attempt::Held { remaining: None });
                        }
                    }
                    continue;
                }
                for k in strays {
                    let path = format!("{dir}/{}", k.name);
                    match again(|| c.delete(&path, None)).await {
                        Ok(()) | Err(ZkError::NoNode) => {}
                        Err(e) => return Err(unavailable("delete", e)),
                    }
                }
                continue; // look again without them
            }
            let Some(pos) = kids.iter().position(|k| k.name == own) else {
                // The own node is gone (it expired and was deleted, or the session ended).
                self.forget(args.resource, args.token);
                return Ok(Attempt::Held { remaining: None });
            };
            if pos == 0 {
                // Lowest: the lock is ours. A node created by this attempt already carries
                // the TTL; one that waited (or a holder asking again) gets it now.
                let granted = match stat.filter(|_| has_ttl) {
                    Some(stat) => Some(stat),
                    None => self.set_lease(&c, mine, &dir, &own, args.ttl).await?,
                };
                let Some(granted) = granted else {
                    self.forget(args.resource, args.token);
                    return Ok(Attempt::Held { remaining: None });
                };
                self.stop_watch(args.resource, args.token);
                if !self.session.is_current(&c) {
                    return Err(superseded());
                }
                return Ok(Attempt::Acquired {
                    fencing_token: granted.czxid.unsigned_abs(),
                });
            }
            // Queued behind someone: a waiter's node carries the waiter TTL, refreshed by
            // every attempt, and the write tells the ensemble's "now".
            if queue && (has_ttl || stat.is_none()) {
                match self
                    .set_lease(&c, mine, &dir, &own, args.waiter_ttl)
                    .await?
                {
                    Some(s) => {
                        stat = Some(s);
                        has_ttl = false;
                    }
                    None => {
                        self.forget(args.resource, args.token);
                        return Ok(Attempt::Held { remaining: None });
                    }
                }
            }
            // The ensemble's "now": the `mtime` and epoch of this attempt's own last write
            // (there is always one by here; without, nothing would count as expired).
            let now = stat.as_ref().map_or(Now { mtime: 0, epoch: 0 }, Now::of);
            // A try must find every node ahead dead; a queued waiter needs only its
            // predecessor gone (the head is read for the holder's remaining lease).
            let ahead: Vec<&Child> = if queue {
                let mut v = vec![&kids[0]];
                if pos > 1 {
                    v.push(&kids[pos - 1]);
                }
                v
            } else {
                kids[..pos].iter().collect()
            };
            let mut seen = Self::read(&c, &dir, &ahead).await?;
            Self::restart_stale(&c, &dir, &mut seen, now).await?;
            let mut cleared = 0;
            for s in seen.iter().flatten().filter(|s| s.expired(now)) {
                Self::delete_expired(&c, &dir, s).await?;
                cleared += 1;
            }
            let gone = seen.iter().filter(|s| s.is_none()).count();
            let pred_alive = seen
                .last()
                .and_then(Option::as_ref)
                .is_some_and(|s| !s.expired(now));
            let blocked = if queue {
                pred_alive
            } else {
                seen.iter().flatten().any(|s| !s.expired(now))
            };
            if !blocked && (cleared > 0 || gone > 0) {
                continue; // look again: we may be first now
            }
            // Until the first live node ahead ends: the holder's lease, or — the head just
            // found lapsed — the entry of the waiter next in line (one that died holds the
            // line until then).
            let remaining = seen
                .iter()
                .flatten()
                .find(|s| !s.expired(now))
                .and_then(|s| s.remaining(now));
            if !queue {
                // A try leaves nothing behind. Forgotten once deleted: a node whose delete
                // failed is still this token's, found by its next attempt (or its undo).
                match again(|| c.delete(&own_path, None)).await {
                    Ok(()) | Err(ZkError::NoNode) => self.forget(args.resource, args.token),
                    Err(e) => return Err(unavailable("delete", e)),
                }
                // The last of the nodes ahead may go meanwhile, its own attempt to delete the
                // directory refused for this node: left, to be deleted once idle.
                self.leave_dir(&c, &dir);
                // A barging waiter (not in line) is woken when the first live node — the
                // holder's — goes, as a queued one is by its predecessor's.
                if args.mode == WaitMode::Barge {
                    if let Some(first) = seen.iter().flatten().find(|s| !s.expired(now)) {
                        self.watch_predecessor(&c, args, &dir, &first.child.name);
                    }
                }
                return Ok(Attempt::Held { remaining });
            }
            if let Some(pred) = seen.last().and_then(Option::as_ref) {
                self.watch_predecessor(&c, args, &dir, &pred.child.name);
            }
            return Ok(Attempt::Held { remaining });
        }
        Ok(Attempt::Held { remaining: None })
    }

    /// Makes sure a task watches `pred` (the predecessor of `args.token`'s node) and wakes the
    /// waiter when it is deleted.
    fn watch_predecessor(&self, c: &Arc<Conn>, args: &AcquireArgs<'_>, dir: &str, pred: &str) {
        let key = Self::key(args.resource, args.token);
        let mut w = self.watchers.lock().unwrap_or_else(PoisonError::into_inner);
        let session = c.session_id().0;
        if let Some((p, s, h)) = w.get(&key) {
            // A watch on a session given up for a new one (an outage longer than the waiter's
            // lease) hears nothing more: the predecessor's name is the same, the watch is not.
            if p == pred && *s == session && !h.is_finished() {
                return;
            }
            h.abort();
        }
        let (task_c, hub, path) = (c.clone(), self.hub.clone(), format!("{dir}/{pred}"));
        let (resource, token) = key.clone();
        // On the runtime of the session's task: a watch awaited elsewhere panics in the client
        // when that runtime shuts down ([`Conn`]); there it ends with it, and the sentinel wakes
        // the waiter instead.
        let task = c.spawn(async move {
            let c = task_c;
            loop {
                match c.check_and_watch_stat(&path).await {
                    Ok((Some(_), watcher)) => {
                        let event = watcher.changed().await;
                        if event.event_type == EventType::NodeDataChanged {
                            continue; // the predecessor's own refresh: keep waiting
                        }
                    }
                    Ok((None, _)) => {}
                    Err(e) => {
                        tracing::debug!(error = %e, "zookeeper watch failed; the waiter re-checks")
                    }
                }
                hub.notify(&resource, Some(token.as_str()));
                return;
            }
        });
        w.insert(key, (pred.to_owned(), session, task));
    }

    /// The own node's name: remembered, or found by the token (the `create`'s answer may never
    /// have arrived).
    async fn find_own(
        &self,
        c: &Client,
        dir: &str,
        resource: &ResourceName,
        token: &OwnerToken,
    ) -> Result<Option<String>, LockError> {
        if let Some(name) = self.known(c, resource, token) {
            return Ok(Some(name));
        }
        Ok(Self::find_by_token(c, dir, token)
            .await?
            .map(|(name, _)| name))
    }
}

/// An abandon not answered yet: dropped armed, it notes the attempt as unsettled
/// ([`ZkBackend::look_again`]).
struct Unanswered<'a> {
    backend: &'a ZkBackend,
    resource: &'a ResourceName,
    token: &'a OwnerToken,
    armed: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.backend.look_again(self.resource, self.token);
        }
    }
}

impl ZkBackend {
    /// Notes `token`'s attempt on `resource` as unsettled, and starts the backend's task that
    /// settles them unless it runs already (see [`Unsettled`]). The task waits for the session
    /// to have a server, then looks each attempt's node up and deletes it: ZooKeeper applies
    /// a session's requests in the order they were sent, so once a look-up is answered the
    /// `create` has been applied or never will be. An attempt is settled by that answer, by a
    /// later abandon of it that was answered, or by the end of the session it was on (its
    /// nodes go with it: a look-up on a newer session does not find them). The task ends
    /// when none is left.
    fn look_again(&self, resource: &ResourceName, token: &OwnerToken) {
        self.unsettled
            .attempts()
            .insert(Self::key(resource, token), self.dir(resource.as_str()));
        // On the caller's runtime (moved to the fallback thread if that one shuts down first:
        // [`Settler`]); on the fallback thread when the caller is on none (a dropped undo).
        let (rt, on_fallback) = match Handle::try_current() {
            Ok(rt) => (rt, false),
            Err(_) => match crate::util::fallback_runtime() {
                Some(rt) => (rt.clone(), true),
                None => return,
            },
        };
        self.unsettled.start(&self.session, &rt, on_fallback);
    }
}

/// Rounds of an attempt's listing and clearing of lapsed nodes ahead (each clears up to two).
const CLEARING_ROUNDS: usize = 64;

/// The longest local lease a lock of a session of `timeout` counts on: ¾ of it.
fn local_lease_cap(timeout: Duration) -> Duration {
    timeout - timeout / 4
}

impl Backend for ZkBackend {
    fn name(&self) -> &'static str {
        "zookeeper"
    }

    /// A lease is whole milliseconds from a node's `mtime` (the leader's clock, in whole
    /// milliseconds), as on Redis: the part of `ttl` below a millisecond, and one more. And
    /// the local lease never counts on more than ¾ of the session timeout (see the module
    /// docs: the leader may have last heard of the session up to half a tick — at most a
    /// quarter of the session timeout — before the client's last answered request).
    ///
    /// No allowance for clocks: a lease is judged only by the leader that stamped its last
    /// write (never across a leader change: see the [module docs](self)), so the skew between
    /// servers does not count, and — as for the Redis server's clock — that leader's wall
    /// clock is assumed not to step during a lease. A forward step of it (an NTP step, a VM
    /// resumed) ends every lease it judges early by the step while its holder still counts
    /// it, and can let a second holder in; keep the servers' clocks slewed, not stepped, and
    /// check fencing tokens at the resource. A rate error of that clock counts as on Redis:
    /// 100 ppm over a 10 s lease is the whole millisecond of margin that a TTL up to ¾ of the
    /// session timeout has (the request's way to the leader, counted by the holder and not by
    /// the leader, adds to it).
    fn lease_margin(&self, ttl: Duration) -> Duration {
        ttl.saturating_sub(local_lease_cap(self.session.timeout()))
            .max(crate::util::whole_ms_margin(ttl, 1))
    }

    fn admin(&self) -> Option<&dyn super::AdminStore> {
        Some(self)
    }

    fn acquire<'a>(&'a self, args: AcquireArgs<'a>) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(async move {
            self.check_ttl(args.ttl)?;
            self.bounded("acquire", self.attempt(&args)).await
        })
    }

    fn release<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(self.bounded("release", async move {
            self.stop_watch(resource, token);
            let c = self.session.client().await?;
            let dir = self.dir(resource.as_str());
            let Some(name) = self.find_own(&c, &dir, resource, token).await? else {
                return Ok(false);
            };
            let released = match again(|| c.delete(&format!("{dir}/{name}"), None)).await {
                Ok(()) => true,
                Err(ZkError::NoNode) => false,
                Err(e) => return Err(unavailable("delete", e)),
            };
            self.forget(resource, token);
            self.leave_dir(&c, &dir);
            Ok(released)
        }))
    }

    fn extend<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(self.bounded("extend", async move {
            self.check_ttl(ttl)?;
            let c = self.session.client().await?;
            let dir = self.dir(resource.as_str());
            let Some(name) = self.find_own(&c, &dir, resource, token).await? else {
                return Ok(false);
            };
            let renewed = self
                .set_lease(&c, (resource, token), &dir, &name, ttl)
                .await?
                .is_some();
            if renewed && !self.session.is_current(&c) {
                return Err(superseded());
            }
            Ok(renewed)
        }))
    }

    fn abandon<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<(), LockError>> {
        // Until this undo is answered (also if it is dropped), the node of the attempt it
        // undoes may still appear: looked for again once the session has a server.
        let mut unanswered = Unanswered {
            backend: self,
            resource,
            token,
            armed: true,
        };
        Box::pin(async move {
            let out = self
                .bounded("abandon", async move {
                    self.stop_watch(resource, token);
                    let c = self.session.client().await?;
                    let dir = self.dir(resource.as_str());
                    // Requests of one session are applied in the order they were sent: a
                    // `create` of a cancelled attempt is applied before this look-up, so its
                    // node is found. Every node of the token goes, not only the one the last
                    // attempt knew: an earlier attempt's `create` whose answer never came (cut
                    // off by the command timeout) left one that keeps its place — the lock,
                    // if it was first — and nothing else would delete it before its lease ran
                    // out. The token names this acquisition only, so each is this undo's. The
                    // server first catches up with the leader: after a move to another server,
                    // a `create` sent to the last one may not be applied on this one yet.
                    if let Err(e) = again(|| c.sync("/")).await {
                        return Err(unavailable("sync", e));
                    }
                    let kids = match again(|| c.list_children(&dir)).await {
                        Ok(kids) => Some(kids),
                        Err(ZkError::NoNode) => None,
                        Err(e) => return Err(unavailable("getChildren", e)),
                    };
                    for name in kids.iter().flatten().filter(|k| owned_by(k, token)) {
                        match again(|| c.delete(&format!("{dir}/{name}"), None)).await {
                            Ok(()) | Err(ZkError::NoNode) => {}
                            Err(e) => return Err(unavailable("delete", e)),
                        }
                    }
                    self.forget(resource, token);
                    // Also when the attempt left no node: one cut off between making the
                    // directory and its own node left the directory empty, and the server
                    // never removes a container that never had a child.
                    if kids.is_some() {
                        send_rmdir(&c, &dir);
                    }
                    Ok(())
                })
                .await;
            if out.is_ok() {
                unanswered.armed = false;
                self.unsettled
                    .attempts
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&Self::key(resource, token));
            }
            drop(unanswered);
            out
        })
    }

    fn watch<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move {
            let on_last =
                super::abort_gone_watch_tasks(self.watchers.clone(), self.hub.clone(), |v| &v.2);
            let (watch, _first) = self.hub.register(resource, token, Some(on_last));
            Ok(watch)
        })
    }
}

/// A lock node's `Stat` as a test reads it: made at zxid `zxid`, written last at `mtime`.
#[cfg(test)]
pub(super) fn stat_at(zxid: i64, mtime: i64) -> Stat {
    Stat {
        czxid: zxid,
        mzxid: zxid,
        pzxid: zxid,
        ctime: mtime,
        mtime,
        version: 0,
        cversion: 0,
        aversion: 0,
        ephemeral_owner: 1,
        data_length: 3,
        num_children: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_sort_by_sequence_and_owner_names_match_exactly() {
        let kids = sorted(vec![
            "b-0000000010".into(),
            "a-0000000002".into(),
            "junk".into(),
            "c-0000000009".into(),
        ]);
        let names: Vec<_> = kids.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["a-0000000002", "c-0000000009", "b-0000000010"]);
        let t = OwnerToken::generate();
        assert!(owned_by(&format!("{}-0000000001", t.as_str()), &t));
        assert!(!owned_by(&format!("{}x-0000000001", t.as_str()), &t));
    }

    /// A session timeout past what the protocol carries is taken as the longest it carries
    /// (the server grants at most its own maximum); `Duration::MAX` made the client library
    /// panic on overflow inside `connect`.
    #[test]
    fn session_timeouts_are_bounded_by_the_protocol() {
        let opts = ZkOptions::default().session_timeout(Duration::MAX);
        assert_eq!(opts.session_timeout, MAX_SESSION_TIMEOUT);
        let opts = ZkOptions::default().session_timeout(Duration::from_secs(4));
        assert_eq!(opts.session_timeout, Duration::from_secs(4));
    }

    /// Past 2^31 − 1 creates in a directory the sequence wraps to negative numbers, formatted
    /// with their sign: the nodes made after the wrap come after those made before it. Before,
    /// the sign was read as the name's separator and `b--2147483648` sorted as 2147483648,
    /// ahead of every later node, so a new attempt found itself first while the holder's node
    /// (made before the wrap) was there.
    #[test]
    fn children_made_after_the_sequence_wrapped_come_after_those_before() {
        let kids = sorted(vec![
            "c--2147483647".into(),
            "a-2147483646".into(),
            "d--000000005".into(),
            "b--2147483648".into(),
            "z-2147483647".into(),
        ]);
        let names: Vec<_> = kids.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "a-2147483646",
                "z-2147483647",
                "b--2147483648",
                "c--2147483647",
                "d--000000005"
            ]
        );
        // 64-bit sequences are ordered as numbers.
        let kids = sorted(vec!["b-00000000003000000000".into(), "a-0000000001".into()]);
        assert_eq!(kids[0].name, "a-0000000001");
    }

    #[test]
    fn resources_become_single_node_names() {
        assert_eq!(node_name("dlock:{a/b c%}"), "dlock:{a%2Fb%20c%25}");
        assert_eq!(node_name("p:{é}"), "p:{%C3%A9}");
    }

    #[test]
    fn leases_expire_by_the_servers_mtime() {
        let stat = Stat {
            ctime: 0,
            ..stat_at(1, 1_000)
        };
        let seen = Seen {
            child: Child {
                name: "x-1".into(),
                order: 1,
            },
            lease: lease_of(b"300"),
            stat,
        };
        let at = |mtime| Now { mtime, epoch: 0 };
        assert!(!seen.expired(at(1_299)));
        assert!(seen.expired(at(1_300)));
        assert_eq!(seen.remaining(at(1_100)), Some(Duration::from_millis(200)));
        assert!(!seen.stale(at(1_300)));
        assert_eq!(lease_of(b"x"), None);
    }

    /// A lease is judged only by the leader that stamped it: a node last written in an earlier
    /// epoch (under another leader, with another wall clock) is not expired however far the
    /// new leader's `mtime` is past its own, has its whole lease left, and is to be started
    /// again; one written in a later epoch than the observer's write is not judged either.
    /// Before, a new leader whose clock ran ahead ended a living holder's lease early.
    #[test]
    fn leases_are_not_judged_across_epochs() {
        let in_epoch = |epoch: i64, mtime: i64| Seen {
            child: Child {
                name: "x-1".into(),
                order: 1,
            },
            lease: lease_of(b"300"),
            stat: stat_at((epoch << 32) | 7, mtime),
        };
        let now = Now {
            mtime: 10_000,
            epoch: 2,
        };
        let old = in_epoch(1, 1_000);
        assert!(!old.expired(now), "judged by two leaders' clocks");
        assert!(old.stale(now));
        assert_eq!(old.remaining(now), Some(Duration::from_millis(300)));
        let newer = in_epoch(3, 1_000);
        assert!(!newer.expired(now) && !newer.stale(now));
        let same = in_epoch(2, 9_700);
        assert!(same.expired(now) && !same.stale(now));
        assert_eq!(Now::of(&stat_at((2 << 32) | 9, 5)).epoch, 2);
        // A node without a lease lives with its session: nothing to start again.
        let no_lease = Seen {
            lease: None,
            ..in_epoch(1, 1_000)
        };
        assert!(!no_lease.stale(now) && !no_lease.expired(now));
    }
}
