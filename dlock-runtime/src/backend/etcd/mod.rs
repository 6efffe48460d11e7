//! The etcd backend (`etcd://`, feature `etcd`): the lock recipe of etcd's own
//! `clientv3/concurrency` mutex, mapped onto the attempt-based [`Backend`] trait, over the
//! [`etcd_client`] crate (gRPC, tonic).
//!
//! # Layout and recipe
//!
//! Every acquisition writes its *own* key under `<prefix>/<resource>/` (the resource string with
//! `%` and `/` percent-encoded, so no lock's keys fall inside another lock's range), attached to
//! a lease. The holder is the key with the lowest create revision under the directory; every
//! other key is a waiter, queued in create-revision order (fair FIFO, [`Backend::fifo`] is
//! `true`).
//!
//! A key on a session (below) is named `<locker>.<slot>`: a random id of the locker (from the
//! OS CSPRNG) and the lowest slot none of the locker's other keys of that lock uses, so the
//! names are reused, as etcd's own recipe reuses its session's lease id. etcd keeps a deleted
//! key's name in its index until the next compaction, and every read of a lock's line walks the
//! names under its directory: one name per acquisition made a lock's reads slower with every
//! acquisition until then. The registry (module `session`) keeps a name for its token until
//! no put sent for that token can still land, so while a token is registered its key's
//! existence is the owner check, as a token-named key's is; the value notes the holder's TTL
//! and the token (`<ttl ms>:<token>`), and every delete of a key on a session (a release's, a
//! keepalive's pruning) compares it, so one that lands late never deletes the name's next
//! key. A key on a lease of its own is named by its token (`<prefix>/<resource>/<token>`).
//!
//! A lock the watchdog renews ([`AcquireArgs::renew`], the default) goes on a **session
//! lease** shared by the locker's locks of its TTL class, kept alive over a keepalive stream
//! (module `session`, where the safety argument is written down):
//!
//! * [`WaitMode::Try`] and [`WaitMode::Barge`]: one transaction that creates the own key on the
//!   session only if no key exists under the lock's prefix (a range compare on create revision
//!   `== 0`), so a try that does not win leaves nothing behind. Barging is the same: with this
//!   recipe there is no "free but queued" state to barge past — the head of the queue *is* the
//!   holder.
//! * [`WaitMode::Queue`]: the same transaction, whose other branch puts the own key on the
//!   waiters' session (unless it is queued already — the key keeps its create revision, so a
//!   waiter keeps its place) and reads the head. A waiter's later attempts are reads. When the
//!   head is the own key, the lock is ours; the key moves to the lock's session only when the
//!   waiter TTL's class differs from the TTL's.
//! * [`release`](Backend::release) and [`abandon`](Backend::abandon): delete the own key if
//!   its value is still the token's (one transaction).
//! * [`expire`](Backend::expire) (a release within a minimum hold): the key moves to a lease of
//!   its own for the rest of the hold, which nothing renews — on its session, a renewal of any
//!   other lock of the class would keep it alive. Its name stays taken until a keepalive's
//!   pruning after the hold deleted it.
//!
//! So an uncontended acquire is one transaction and a release one delete — two Raft writes,
//! like a bare etcd lock — and renewal writes nothing (a keepalive when needed, and one read of
//! the batch's keys as the owner check).
//!
//! A lock taken with `auto_renew(false)`, and an idempotency record's lock, must expire after
//! their own TTL, so they get a lease of their own: [`WaitMode::Queue`] puts the key with a
//! lease of the waiter TTL and reads the head in the same transaction, then moves the key to a
//! lease of the lock's TTL (guarded by the key's create revision); `Try` creates it on a lease
//! of the TTL if the lock is free; [`extend`](Backend::extend) moves the key to a fresh lease
//! (which can also shorten it) and revokes the token's earlier ones. Renewed later by the
//! watchdog's batches ([`extend_many`](Backend::extend_many)), such a key moves onto a lease
//! granted for the batch and shared by its keys, which is never revoked: a re-let (a batch's,
//! an `extend`'s) requires the key not written since its lease was granted (a late re-let of
//! an earlier move must not move it back onto a lease that ends sooner), and the first batch
//! revokes the token's own leases (a late put on one would move it back too).
//!
//! * [`watch`](Backend::watch): a task per local waiter reads its predecessor (the key with the
//!   greatest create revision below its own) and watches only that key's deletion, from the
//!   revision of the read on (no event can fall between the read and the watch; no thundering
//!   herd, no polling). When the predecessor is gone it reads again; when there is none, it is
//!   this waiter's turn and the [`ReleaseHub`] wakes it (also when its own key is gone: its
//!   next attempt queues it anew). A waiter without a key in the line (a barging one) is woken
//!   when any key of the lock is deleted. A task ends when it wakes its waiter; an attempt of a
//!   local waiter that finds the lock held again starts a new one (for its new key, if it
//!   queued anew), and one that takes the lock stops it. The watches of all of a locker's
//!   waiters ride on one gRPC watch stream (module `watches`: one create request per watch,
//!   each with an id the backend picks, cancelled on the server when its waiter is done) —
//!   each used to open a stream of its own, and a member kept a stream per waiting waiter.
//!   A stream that fails takes its watches with it, and their tasks read and watch again on
//!   a new one; a stream on a member that froze is found out by probing it when quiet (a
//!   watch created and cancelled), and given up within the command timeout.
//!
//! Semaphores and read-write locks use the same keys, leases and paths (module `kinds`): a
//! writer's key is marked, and the holders are the ready prefix of the keys in create-revision
//! order instead of the first key alone.
//!
//! # Fencing tokens
//!
//! The fencing token is the holder key's create revision: etcd's revision is one counter for
//! the whole cluster, advanced by every write and agreed by Raft, so tokens are strictly
//! increasing per key *and* across keys, with no clock involved. Like the Redis backend's
//! tokens (a per-key `INCR` counter) they are `u64` and strictly increasing per key; unlike
//! them they are not dense (other writes advance the revision too) and tokens of two different
//! locks are comparable (one cluster-wide order). Tokens of the two backends are not comparable
//! with each other.
//!
//! # Leases and TTLs
//!
//! etcd leases are whole seconds, and the server raises a TTL below its minimum
//! (`1.5 × election timeout`, rounded up to a second) to that minimum; dlock TTLs go down to
//! milliseconds. A session's lease class is the TTL rounded *up* to whole seconds (at least 1)
//! plus one second of headroom, so that one keepalive answers for the acquisitions of the next
//! second; the locker's local lease clock counts the dlock TTL from before the request was
//! sent, and a session is kept alive (a keepalive sent after that instant) whenever etcd's last
//! answer does not cover the TTL from now — so the server's lease always outlives the holder's
//! local one and [`lost`](crate::LockGuard::lost) is never late. The price: a holder that dies
//! keeps the lock until its session lease runs out (the TTL rounded up, plus the second of
//! headroom, plus up to the 500 ms of etcd's expiry sweep); the same for a waiter that dies
//! (its waiter TTL's class). A lock with a lease of its own (not renewed) is held for its TTL
//! rounded up.
//!
//! The sessions are one per lease class, so usually one per locker, each with its own
//! keepalive stream (etcd-client's keepalive stream carries one lease). One expired session
//! loses every lock on it — all of them at once, as they would be lost one by one, since they
//! share the locker's connection and clock. `remaining` (the `Retry-After` others are told) is
//! the session lease's, capped by the holder's TTL, which its key's value notes.
//!
//! # Faults
//!
//! Every request is bounded by the command timeout ([`EtcdOptions::command_timeout`]) and
//! answers [`LockError::Unavailable`] (503) when etcd does not answer in time. Requests carry
//! etcd's *require leader* flag, so a member without a leader (no quorum) refuses at once
//! instead of waiting. The locker keeps one client per member (`pool`): a try goes to a member
//! not under suspicion, and a try unanswered after a fifth of the timeout is hedged on another
//! member — etcd-client's own balancer picks endpoints at random and a frozen member looks
//! ready, so a third of the requests to a three-member cluster would hang on it. A leader
//! change is absorbed by etcd (the new leader renews every lease) and by those retries. A holder
//! cut off from the cluster cannot renew; its local lease clock ends and
//! [`lost`](crate::LockGuard::lost) fires, before the server's lease lets the next holder in.
//! A client whose runtime shut down is replaced (see *Runtimes*). Errors never contain the
//! URL's credentials.
//!
//! **Run an etcd with etcd-io/etcd#16822** (3.4.31, 3.5.13, 3.6.0 and later; Debian 12's
//! 3.4.23 does not have it: [`connect`](EtcdBackend::connect) asks every member for its
//! version in the background and logs a warning naming the members without the fix). Without
//! it, a leader that stalls (a long `fdatasync`, CPU starvation, a VM or process paused) while
//! the others elect a new one still runs its lease clock as leader when it resumes, finds the
//! leases it stopped hearing of expired, and has them revoked through the new leader — leases
//! the new leader kept alive (etcd-io/etcd#15247). A holder's key vanishes while its holder is
//! live: the next waiter is granted the lock, and the first learns of the loss only at its
//! next renewal (a third of the TTL at most). No client can prevent that;
//! fencing tokens keep the older holder's late writes out. The fault harness sees it after
//! freezing the leader, and tells it apart by the thawed member's expired-lease count.
//!
//! Repeating a request is safe: a put of the own key keeps its create revision (and a queued
//! put that lands after its key was admitted and moved onto the lock's lease fails: the
//! waiter leases are revoked first), a re-let and a delete are idempotent (a batch's re-let
//! that finds the key already on its lease answers renewed), a repeated try finds its own key
//! at the head and keeps it, an extra lease expires unused, and a put that lands after its
//! lock was released is a suspect (see
//! *Cancellation*); a repeated idempotency `begin` whose first try took the lock finds its own
//! key at the head and takes that as its answer, and a repeated `complete` whose first try
//! stored the record finds the record on the lease it granted for it and answers "stored" (a
//! hedge's failed compare never undoes what the first try did). A keepalive stream that
//! fails, does not answer within a fifth of the timeout, or had a keepalive cancelled before
//! its answer was read, is reopened on another member. One answer can be ambiguous: a release
//! whose first try was applied but not answered, repeated, answers "not the owner" (reported
//! as a lost lock, after the lock was in fact released).
//!
//! # Runtimes
//!
//! A member's client runs its channel on tasks of the tokio runtime that made it (tonic's
//! buffer worker, which owns the balancer, and the HTTP/2 connection). A locker may outlive
//! that runtime — an actix-web worker restarting, a runtime built for set-up and dropped — and
//! then those tasks are gone for good: every request would fail (`Unknown: Service was not
//! ready`) and every stream on the connection breaks, while tonic only ever reconnects a
//! connection to a member that went away. So every client comes with a sentinel task on its
//! runtime that marks it dead when that runtime drops it, and a request finding its member's
//! client dead first makes a new one on its own runtime — one connect for all the callers that
//! find it dead meanwhile, within their command timeout — and goes on (module `pool`, which
//! also says which requests are repeated). A member that is merely down is not dead: its
//! requests fail with [`LockError::Unavailable`] as before. What ran over the old client comes
//! back over the new one: a session's keepalive stream fails at its next keepalive and is
//! reopened, and the locker's watch stream (whose task runs on the runtime of the watch that
//! opened it) fails, so every waiter's task reads its line again and watches anew, on a stream
//! opened on the runtime at hand — the waiter is woken by a release as before. Revocations
//! running in the background when their runtime shuts down start again on the fallback thread
//! (as the locker's watchdog does).
//!
//! # Cancellation
//!
//! A cancelled acquire may leave a request in flight that lands *after* the locker's
//! [`abandon`](Backend::abandon) deleted the key, which would bring the key back — and on a
//! session lease kept alive for the locker's other locks, it would stay. The session registry
//! (module `session`) knows which puts are unsettled (cancelled, timed out, or answered through
//! a hedge while the first try was still out); such a token stays a suspect after its release,
//! the sessions it used are retired (new acquisitions get a new session), the suspect's key is
//! deleted again before every keepalive of those sessions (by each value its puts may have
//! written: the same token asking again writes a new one), and a retired session is revoked
//! once nothing held or waiting is on it (when a key leaves it, or at the latest by a sweep
//! the acquisitions make every 5 s). For keys on leases of their own, `abandon` revokes
//! the leases the acquisition's attempts used: a put on a revoked lease fails, and revoking
//! deletes whatever key is still on it.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, KeyValue, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse,
};
use tokio::task::AbortHandle;

use super::{
    AcquireArgs, Attempt, Backend, BoxFuture, ExtendItem, IdempotencyStore, OwnerToken, ReleaseHub,
    WaitMode, Watch,
};
use crate::key::{LockKind, ResourceName};
use crate::LockError;

mod admin;
mod idempotency;
mod kinds;
mod pool;
mod session;
mod url;
mod watches;

use self::pool::{call, Pool};
use self::session::{Sessions, TokenKey};
use self::watches::Watches;

/// Settings of an [`EtcdBackend`]. Defaults: command and connect timeout 2 s (either at most a
/// day: a longer one is taken as a day), key prefix `dlock`, no user, no TLS files.
#[derive(Clone)]
#[non_exhaustive]
pub struct EtcdOptions {
    command_timeout: Duration,
    connect_timeout: Duration,
    prefix: String,
    user: Option<(String, String)>,
    tls_ca: Option<std::path::PathBuf>,
    tls_identity: Option<(std::path::PathBuf, std::path::PathBuf)>,
    keep_alive: Duration,
}

/// How often an HTTP/2 ping goes to a member while streams are open, by default. etcd refuses
/// pings closer together than its `--grpc-keepalive-min-time` (5 s by default) and, after a
/// few, resets the connection — every watch and lease keepalive stream on it.
const KEEP_ALIVE: Duration = Duration::from_secs(6);

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            command_timeout: Duration::from_secs(2),
            connect_timeout: Duration::from_secs(2),
            prefix: "dlock".to_owned(),
            user: None,
            tls_ca: None,
            tls_identity: None,
            keep_alive: KEEP_ALIVE,
        }
    }
}

impl fmt::Debug for EtcdOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdOptions")
            .field("command_timeout", &self.command_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("prefix", &self.prefix)
            .field("user", &self.user.as_ref().map(|(u, _)| u))
            .field("tls_ca", &self.tls_ca)
            .field("tls_identity", &self.tls_identity.as_ref().map(|(c, _)| c))
            .field("keep_alive", &self.keep_alive)
            .finish_non_exhaustive()
    }
}

impl EtcdOptions {
    /// How often a member is pinged (HTTP/2) while a watch or lease keepalive stream is open to
    /// it; one that does not answer within 1 s is taken for dead, and its streams are opened
    /// again on another member. Default 6 s: a member frozen (or cut off) under a waiter's
    /// watch is left within 7 s — requests, hedged on another member after a fifth of the
    /// command timeout, do not wait for it. Lower it only together with the servers'
    /// `--grpc-keepalive-min-time` (5 s by default): etcd resets a connection that pings more
    /// often, and with it every watch on it (waiters then ask again at each reset, about every
    /// 2 s). Clamped to 100 ms – 1 h.
    pub fn keep_alive(mut self, interval: Duration) -> Self {
        self.keep_alive = interval.clamp(Duration::from_millis(100), Duration::from_secs(3600));
        self
    }

    /// How long one request to etcd may take before it fails with
    /// [`LockError::Unavailable`].
    pub fn command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout.min(crate::util::MAX_TIMEOUT);
        self
    }

    /// How long connecting may take.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout.min(crate::util::MAX_TIMEOUT);
        self
    }

    /// The key prefix under which locks live (default `dlock`).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Authenticates as `user` (etcd's user/password authentication). The password is never
    /// printed, logged or put in an error.
    pub fn user(mut self, user: impl Into<String>, password: impl Into<String>) -> Self {
        self.user = Some((user.into(), password.into()));
        self
    }

    /// The CA certificate (PEM file) that `etcds://` members' certificates must chain to
    /// (required for `etcds://`; feature `etcd-tls`). Each member's certificate is checked for
    /// the host name (or IP address) the URL gives for it.
    pub fn tls_ca_file(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.tls_ca = Some(path.into());
        self
    }

    /// A client certificate and its private key (PEM files), for members that ask for one
    /// (`--client-cert-auth`). Optional; feature `etcd-tls`.
    pub fn tls_client_identity_files(
        mut self,
        cert: impl Into<std::path::PathBuf>,
        key: impl Into<std::path::PathBuf>,
    ) -> Self {
        self.tls_identity = Some((cert.into(), key.into()));
        self
    }
}

/// What `etcds://` needs, read from the files [`EtcdOptions`] names.
struct TlsFiles {
    #[cfg_attr(not(feature = "etcd-tls"), allow(dead_code))]
    ca: Vec<u8>,
    #[cfg_attr(not(feature = "etcd-tls"), allow(dead_code))]
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl TlsFiles {
    fn read(opts: &EtcdOptions) -> Result<Self, LockError> {
        if !cfg!(feature = "etcd-tls") {
            return Err(LockError::misconfigured(
                "etcds:// (TLS) needs dlock-runtime's cargo feature `etcd-tls`",
                None,
            ));
        }
        let read = |what: &str, path: &std::path::Path| {
            std::fs::read(path).map_err(|e| {
                LockError::misconfigured(
                    format!("etcd TLS: cannot read the {what} {}", path.display()),
                    Some(Box::new(e)),
                )
            })
        };
        let ca = opts.tls_ca.as_deref().ok_or_else(|| {
            LockError::misconfigured(
                "etcds:// needs the CA certificate that signed the members' certificates \
                 (EtcdOptions::tls_ca_file)",
                None,
            )
        })?;
        let ca = read("CA certificate", ca)?;
        let identity = match &opts.tls_identity {
            Some((cert, key)) => {
                Some((read("client certificate", cert)?, read("client key", key)?))
            }
            None => None,
        };
        Ok(TlsFiles { ca, identity })
    }

    /// TLS settings for the member at `host` (`name:port`): its certificate must name `name`.
    #[cfg(feature = "etcd-tls")]
    fn options(&self, host: &str) -> etcd_client::TlsOptions {
        let name = host.rsplit_once(':').map_or(host, |(n, _)| n);
        let name = name.trim_start_matches('[').trim_end_matches(']');
        let mut tls = etcd_client::TlsOptions::new()
            .ca_certificate(etcd_client::Certificate::from_pem(&self.ca))
            .domain_name(name);
        if let Some((cert, key)) = &self.identity {
            tls = tls.identity(etcd_client::Identity::from_pem(cert, key));
        }
        tls
    }
}

/// Background watch tasks, by (resource, owner token), with the own key each watches for.
type Watchers = super::WatchTasks<(AbortHandle, Vec<u8>)>;

/// The leases an acquisition's attempts put its key on, by (resource, owner token): what
/// [`Backend::abandon`] revokes so that an attempt still in flight cannot put the key back.
/// An entry goes with the acquisition's release, abandon, or `expire` (`forget_expired`).
type Leases = Arc<Mutex<HashMap<(Arc<str>, OwnerToken), Vec<i64>>>>;

/// How many of an acquisition's latest leases are remembered: the one its key is on and those
/// of an attempt that may still be in flight (attempts of one acquisition are sequential). An
/// older one is revoked as it is forgotten (`grant_for`).
const LEASES_KEPT: usize = 3;

/// Locks in etcd. See the [module docs](self) for the recipe, fencing and lease design.
#[derive(Clone)]
pub struct EtcdBackend {
    pool: Arc<Pool>,
    opts: EtcdOptions,
    endpoints: Arc<str>,
    hub: Arc<ReleaseHub>,
    watchers: Watchers,
    /// The one watch stream every local waiter's watch rides on (module `watches`).
    watches: Arc<Watches>,
    leases: Leases,
    sessions: Arc<Sessions>,
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("endpoints", &self.endpoints)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

/// Where one acquisition's key lives.
struct Keys {
    /// `<prefix>/<resource>/`
    dir: Vec<u8>,
    /// The end of the directory's range (`/` → `0`).
    end: Vec<u8>,
    /// `<prefix>/<resource>/<token>`, or on a session `<prefix>/<resource>/<locker>.<slot>`
    /// (a writer's with a marker: module `kinds`).
    own: Vec<u8>,
}

/// A dlock TTL as an etcd lease TTL: whole seconds, rounded up, at least 1.
fn lease_secs(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis().div_ceil(1000).max(1)).unwrap_or(i64::MAX)
}

/// The value of a key on a session: the holder's TTL in milliseconds (it bounds the remaining
/// lease others are told, as the session lease outlives it) and the owner token (which names
/// the acquisition: the key's name is reused).
fn noted_value(ttl: Duration, token: &OwnerToken) -> String {
    let mut digits = [0; 39];
    let ms = crate::util::decimal(ttl.as_millis(), &mut digits);
    let mut value = String::with_capacity(ms.len() + 1 + token.as_str().len());
    value.push_str(ms);
    value.push(':');
    value.push_str(token.as_str());
    value
}

/// What a key's value notes ([`noted_value`]): the holder's TTL and the owner token. Keys
/// on leases of their own note the token alone (or an idempotency fingerprint).
fn noted(value: &[u8]) -> (Option<Duration>, Option<&str>) {
    let Ok(value) = std::str::from_utf8(value) else {
        return (None, None);
    };
    // (A key written before the token was noted has the TTL alone; a key on a session has
    // its registration after the token, `/<n>`.)
    let (ms, token) = match value.split_once(':') {
        Some((ms, token)) => (ms, Some(token.split_once('/').map_or(token, |(t, _)| t))),
        None => (value, None),
    };
    match ms.parse() {
        Ok(ms) => (Some(Duration::from_millis(ms)), token),
        Err(_) => (None, None),
    }
}

/// The create revision of the key the `i`th response read (0: none).
fn create_revision_at(ops: &[TxnOpResponse], i: usize) -> u64 {
    ops.get(i)
        .and_then(first_kv)
        .map_or(0, |kv| kv.create_revision().unsigned_abs())
}

/// The revision the writes of a transaction that wrote got: the create revision of a key it
/// created (etcd gives all of one transaction's writes one revision, and answers with it).
fn written_revision(resp: &etcd_client::TxnResponse) -> u64 {
    resp.header().map_or(0, |h| h.revision().unsigned_abs())
}

fn first_kv(resp: &TxnOpResponse) -> Option<&KeyValue> {
    match resp {
        TxnOpResponse::Get(g) => g.kvs().first(),
        _ => None,
    }
}

/// Of each member's endpoint and version (`None`: it did not tell), the ones whose release
/// revokes live leases ([`revokes_live_leases`]): their distinct versions and their
/// endpoints, each joined with ", ". `None` when no member runs such a release.
fn lease_revoking_members(versions: &[(&str, Option<&str>)]) -> Option<(String, String)> {
    let affected: Vec<(&str, &str)> = versions
        .iter()
        .filter_map(|&(member, version)| {
            let version = version?;
            (revokes_live_leases(version) == Some(true)).then_some((member, version))
        })
        .collect();
    if affected.is_empty() {
        return None;
    }
    let mut distinct: Vec<&str> = affected.iter().map(|a| a.1).collect();
    distinct.sort_unstable();
    distinct.dedup();
    let members: Vec<&str> = affected.iter().map(|a| a.0).collect();
    Some((distinct.join(", "), members.join(", ")))
}

/// Whether an etcd server of `version` revokes leases a stalled leader stopped hearing of
/// (etcd-io/etcd#15247): every release before the fix (etcd-io/etcd#16822) reached 3.4.31,
/// 3.5.13 and 3.6.0. `None` for a version that does not read as `major.minor.patch`.
fn revokes_live_leases(version: &str) -> Option<bool> {
    let mut parts = version.split(['.', '-', '+']).map(str::parse::<u32>);
    let mut next = || parts.next()?.ok();
    let (major, minor, patch) = (next()?, next()?, next()?);
    Some(match (major, minor) {
        (0..=2, _) | (3, 0..=3) => true,
        (3, 4) => patch < 31,
        (3, 5) => patch < 13,
        _ => false,
    })
}

impl EtcdBackend {
    /// Connects to the cluster named by an `etcd://[user:password@]host:port[,host:port…]`
    /// URL (user and password percent-encoded; they override [`EtcdOptions::user`]), or
    /// `etcds://…` for TLS (feature `etcd-tls`, with [`EtcdOptions::tls_ca_file`]).
    pub async fn connect(url: &str, opts: EtcdOptions) -> Result<Self, LockError> {
        let parsed = url::parse(url)?;
        let mut opts = opts;
        if let Some(user) = parsed.user {
            opts.user = Some(user);
        }
        let tls = if parsed.tls {
            Some(TlsFiles::read(&opts)?)
        } else {
            None
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let endpoints: Vec<String> = parsed
            .hosts
            .iter()
            .map(|h| format!("{scheme}://{h}"))
            .collect();
        let shown: Arc<str> = parsed.hosts.join(",").into();
        // No channel-wide request timeout (`with_timeout`): every request goes through
        // `pool::call`, which enforces the command timeout itself (dropping a try that runs
        // out resets its stream, which cancels it on the member as a deadline would), and a
        // second timer and a `grpc-timeout` header per request cost the client 2 % of a lock.
        let mut connect = ConnectOptions::new()
            .with_connect_timeout(opts.connect_timeout)
            // A frozen member's connection is found dead (and left out) within the interval
            // and 1 s (see `EtcdOptions::keep_alive`: etcd resets a connection pinged more
            // often than its minimum, 5 s by default — it was pinged every 500 ms, and every
            // watch died about every 2 s).
            .with_keep_alive(opts.keep_alive, Duration::from_secs(1))
            .with_require_leader(true);
        if let Some((u, p)) = &opts.user {
            // etcd's tokens expire (5 min by default): fetch a new one when one does.
            connect = connect
                .with_user(u.clone(), p.clone())
                .with_auto_token_refresh(true);
        }
        // One client per member (see `pool`): connecting opens nothing yet, except that with
        // a user it authenticates, which a member that is down cannot do — it is left out.
        let connects = endpoints.into_iter().zip(&parsed.hosts).map(|(e, host)| {
            let options = member_options(&connect, tls.as_ref(), host);
            tokio::time::timeout(
                opts.connect_timeout,
                pool::Member::connect(e, options, opts.connect_timeout),
            )
        });
        let mut members = Vec::new();
        let mut failure = None;
        // Whether every member refused for good (a wrong password): no point in retrying.
        let mut refused = true;
        for c in futures_util::future::join_all(connects).await {
            match c {
                Ok(Ok(m)) => members.push(m),
                Ok(Err(e)) => {
                    refused &= pool::refused_for_good(&e);
                    failure = Some(Box::new(e) as crate::BoxError);
                }
                Err(_) => refused = false,
            }
        }
        if members.is_empty() {
            return Err(LockError::backend(
                format!(
                    "etcd: cannot connect to {shown} within {:?}",
                    opts.connect_timeout
                ),
                failure,
                refused,
            ));
        }
        let pool = Arc::new(Pool::new(members));
        let backend = EtcdBackend {
            watches: Arc::new(Watches::new(pool.clone(), opts.command_timeout)),
            pool,
            opts,
            endpoints: shown,
            hub: ReleaseHub::new(),
            watchers: Arc::default(),
            leases: Arc::default(),
            sessions: Arc::default(),
        };
        backend.check_server_version();
        Ok(backend)
    }

    /// Asks every member for its version in the background, and warns when any runs one that
    /// revokes live leases after a leader stall (see the module docs; any member may lead, and
    /// a cluster in a rolling upgrade runs several releases): connecting waits for nothing,
    /// and the lock calls' choice of member is left as it was.
    fn check_server_version(&self) {
        let (pool, timeout) = (self.pool.clone(), self.opts.command_timeout);
        tokio::spawn(async move {
            let answers = pool::ask_each(&pool, timeout, |c| {
                let mut maintenance = c.maintenance_client();
                async move { maintenance.status().await }
            })
            .await;
            let versions: Vec<(&str, Option<&str>)> = answers
                .iter()
                .map(|(member, status)| (*member, status.as_ref().map(|s| s.version())))
                .collect();
            if versions.iter().all(|(_, v)| v.is_none()) {
                tracing::debug!("etcd: no member told its version in time");
            }
            if let Some((version, members)) = lease_revoking_members(&versions) {
                tracing::warn!(
                    members = %members,
                    version = %version,
                    "etcd {version} (on {members}) can revoke live leases after a leader stall \
                     (etcd-io/etcd#15247, fixed in 3.4.31, 3.5.13 and 3.6.0): two holders of \
                     one lock may overlap then, and only fencing tokens keep the older one's \
                     late writes out; upgrade etcd"
                );
            }
        });
    }

    /// Deletes every key of the lock named by `resource` (`<prefix>:{<key>}`): its holder's and
    /// its waiters'. For operators and tests; returns how many keys it deleted.
    pub async fn delete_lock(&self, resource: &str) -> Result<u64, LockError> {
        let dir = self.dir(resource);
        let end = range_end(&dir);
        let resp = self
            .call("delete", |c| {
                let mut kv = c.kv_client();
                let (dir, end) = (dir.clone(), end.clone());
                async move {
                    kv.delete(dir, Some(etcd_client::DeleteOptions::new().with_range(end)))
                        .await
                }
            })
            .await?;
        Ok(u64::try_from(resp.deleted()).unwrap_or(0))
    }

    fn dir(&self, resource: &str) -> Vec<u8> {
        let prefix = self.opts.prefix.as_bytes();
        let mut dir = Vec::with_capacity(prefix.len() + resource.len() + 8);
        dir.extend_from_slice(prefix);
        dir.push(b'/');
        // `%` and `/` are ASCII: they never occur inside a multi-byte character.
        for &b in resource.as_bytes() {
            match b {
                b'%' => dir.extend_from_slice(b"%25"),
                b'/' => dir.extend_from_slice(b"%2F"),
                b => dir.push(b),
            }
        }
        dir.push(b'/');
        dir
    }

    /// The keys of `token`'s acquisition of a lease of its own: its key is named by the token.
    fn keys(&self, resource: &ResourceName, token: &OwnerToken) -> Keys {
        let mut k = self.lock_dir(resource);
        k.own = kinds::own_key(&k.dir, resource, token);
        k
    }

    /// The lock's directory and range, the own key not named yet (a key on a session is named
    /// by the session registry).
    fn lock_dir(&self, resource: &ResourceName) -> Keys {
        let dir = self.dir(resource.as_str());
        let end = range_end(&dir);
        Keys {
            dir,
            end,
            own: Vec::new(),
        }
    }

    /// How many waiters' watch tasks this backend keeps (live ones, and any whose waiter has
    /// not left yet). For tests.
    #[doc(hidden)]
    pub fn watch_tasks(&self) -> usize {
        self.watchers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// How many acquisitions this backend remembers leases of (keys on leases of their own:
    /// [`Leases`]). For tests.
    #[doc(hidden)]
    pub fn remembered_leases(&self) -> usize {
        self.leases
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// How many times a member's client was made anew because the runtime it ran on shut
    /// down (module docs, *Runtimes*). For tests.
    #[doc(hidden)]
    pub fn reconnects(&self) -> u64 {
        self.pool.reconnects()
    }

    async fn call<T, F: Future<Output = Result<T, etcd_client::Error>>>(
        &self,
        what: &'static str,
        request: impl FnMut(&Client) -> F,
    ) -> Result<T, LockError> {
        call(&self.pool, self.opts.command_timeout, what, request).await
    }

    async fn grant(&self, ttl: Duration) -> Result<i64, LockError> {
        let resp = self
            .call("lease grant", |c| {
                let mut lease = c.lease_client();
                async move { lease.grant(lease_secs(ttl), None).await }
            })
            .await?;
        Ok(resp.id())
    }

    /// A lease of `ttl`, and the store's revision when it was granted: a key last written at or
    /// before that revision is on a lease granted before this one.
    async fn grant_at(&self, ttl: Duration) -> Result<(i64, i64), LockError> {
        let resp = self
            .call("lease grant", |c| {
                let mut lease = c.lease_client();
                async move { lease.grant(lease_secs(ttl), None).await }
            })
            .await?;
        let revision = resp.header().map(|h| h.revision());
        let revision = revision.ok_or_else(|| {
            LockError::unavailable("etcd lease grant answered without a revision", None)
        })?;
        Ok((resp.id(), revision))
    }

    async fn txn(&self, txn: Txn) -> Result<etcd_client::TxnResponse, LockError> {
        self.txn_tracked(|| txn.clone()).await.0
    }

    /// The transaction `build` makes (once per try: a try owns its request, and the hot paths
    /// build theirs from borrowed keys rather than build one and copy it), also telling whether
    /// it is settled ([`pool::call_tracked`]): a put in it that may still land must stay
    /// registered.
    async fn txn_tracked(
        &self,
        build: impl Fn() -> Txn,
    ) -> (Result<etcd_client::TxnResponse, LockError>, bool) {
        pool::call_tracked(&self.pool, self.opts.command_timeout, "txn", |c| {
            let mut kv = c.kv_client();
            let txn = build();
            async move { kv.txn(txn).await }
        })
        .await
    }

    /// The remaining lease of the key `kv` (the holder), when it has one: its lease's, and at
    /// most the holder's TTL when the key notes it (a session lease outlives it).
    async fn remaining(&self, kv: Option<&KeyValue>) -> Result<Option<Duration>, LockError> {
        let Some(lease_id) = kv.map(KeyValue::lease).filter(|l| *l != 0) else {
            return Ok(None);
        };
        let noted = kv.and_then(|kv| noted(kv.value()).0);
        let resp = self
            .call("lease time-to-live", |c| {
                let mut lease = c.lease_client();
                async move { lease.time_to_live(lease_id, None).await }
            })
            .await?;
        Ok(u64::try_from(resp.ttl())
            .ok()
            .filter(|s| *s > 0)
            .map(Duration::from_secs)
            .map(|r| noted.map_or(r, |n| r.min(n))))
    }

    /// Moves the own key `own` (of a token not on a session) onto `lease`, granted at store
    /// revision `granted_at`, if it exists and was not written since: a later move wrote it
    /// after that grant, so a try of this one landing late leaves it where that move put it
    /// (not back on a lease granted earlier, which ends sooner). `Ok(false)`: the key is gone.
    /// Written after the grant (a late try of an earlier move, which the next one moves on):
    /// an error. Already on `lease` (a try of this very move): moved.
    async fn relet_since(
        &self,
        own: &[u8],
        lease: i64,
        granted_at: i64,
    ) -> Result<bool, LockError> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(own, CompareOp::Greater, 0),
                Compare::mod_revision(own, CompareOp::Less, granted_at + 1),
            ])
            .and_then([TxnOp::put(
                own,
                "",
                Some(PutOptions::new().with_lease(lease).with_ignore_value()),
            )])
            .or_else([TxnOp::get(own, Some(GetOptions::new().with_keys_only()))]);
        let resp = self.txn(txn).await?;
        if resp.succeeded() {
            return Ok(true);
        }
        match resp.op_responses().first().and_then(first_kv) {
            None => Ok(false),
            // Moved by a try of this very re-let (a hedged sibling, or a repeat after a lost
            // answer).
            Some(kv) if kv.lease() == lease => Ok(true),
            Some(_) => Err(LockError::unavailable(
                "etcd: the key was written after this renewal's lease was granted \
                 (a late try of an earlier renewal); the next renewal moves it",
                None,
            )),
        }
    }

    /// Moves the own key onto `lease` if it still exists with `create` revision (0: whatever
    /// its create revision).
    async fn relet_on(&self, own: &[u8], create: i64, lease: i64) -> Result<bool, LockError> {
        Ok(self.txn(relet_txn(own, create, lease)).await?.succeeded())
    }

    /// One transaction: if no key exists under the lock's prefix (nor any key of `also_absent`),
    /// put the own key with `value` on `lease` → `Ok(its create revision)`; else
    /// `Err(responses)` of `otherwise` followed by a read of the head.
    async fn put_if_free(
        &self,
        k: &Keys,
        value: impl Into<Vec<u8>>,
        lease: i64,
        also_absent: Vec<Vec<u8>>,
        mut otherwise: Vec<TxnOp>,
    ) -> Result<Result<u64, Vec<TxnOpResponse>>, LockError> {
        let mut when: Vec<Compare> = also_absent
            .into_iter()
            .map(|key| Compare::create_revision(key, CompareOp::Equal, 0))
            .collect();
        when.push(
            Compare::create_revision(k.dir.clone(), CompareOp::Equal, 0).with_range(k.end.clone()),
        );
        otherwise.push(TxnOp::get(k.dir.clone(), Some(Self::head_options(&k.end))));
        let txn = Txn::new()
            .when(when)
            .and_then([TxnOp::put(
                k.own.clone(),
                value,
                Some(PutOptions::new().with_lease(lease)),
            )])
            .or_else(otherwise);
        let resp = self.txn(txn).await?;
        Ok(if resp.succeeded() {
            Ok(written_revision(&resp))
        } else {
            Err(resp.op_responses())
        })
    }

    fn head_options(end: &[u8]) -> GetOptions {
        GetOptions::new()
            .with_range(end.to_vec())
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1)
    }

    /// A lease for an attempt of `token`, remembered before any request uses it.
    async fn grant_for(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        ttl: Duration,
    ) -> Result<i64, LockError> {
        Ok(self.grant_for_at(resource, token, ttl).await?.0)
    }

    /// [`grant_for`](Self::grant_for), with the store's revision when it was granted
    /// ([`grant_at`](Self::grant_at)).
    async fn grant_for_at(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        ttl: Duration,
    ) -> Result<(i64, i64), LockError> {
        let (id, granted_at) = self.grant_at(ttl).await?;
        let dropped = {
            let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
            let list = leases
                .entry((resource.shared(), token.clone()))
                .or_default();
            list.push(id);
            let over = list.len().saturating_sub(LEASES_KEPT);
            list.drain(..over).collect::<Vec<_>>()
        };
        // A lease no longer remembered is revoked before the attempt goes on: a try of its
        // put still on its way would otherwise land after a later admission and move the key
        // back onto it (the admission revokes only the leases it remembers).
        self.revoke_forgotten(resource, token, dropped).await?;
        Ok((id, granted_at))
    }

    /// Revokes `ids`, leases of `token`'s that are no longer remembered. When that fails they
    /// are remembered again, and the token's next attempt, admission or abandon revokes them:
    /// forgotten, a try of a put on one still on its way could land after a later admission
    /// and move the key back onto a lease that ends within the waiter TTL, and nothing would
    /// revoke it.
    async fn revoke_forgotten(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        ids: Vec<i64>,
    ) -> Result<(), LockError> {
        if ids.is_empty() {
            return Ok(());
        }
        let revoked = self.revoke(ids.clone()).await;
        if revoked.is_err() {
            remember_again(&self.leases, (resource.shared(), token.clone()), &ids);
        }
        revoked
    }

    /// Forgets `token`'s leases and revokes them (deleting whatever key is still on them).
    /// A revoked lease makes a late put on it fail, so no attempt still in flight can bring
    /// the key back.
    async fn revoke_leases(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
    ) -> Result<(), LockError> {
        let ids = self.take_leases(resource, token);
        self.revoke_forgotten(resource, token, ids).await
    }

    /// Revokes every lease of `token`'s but `keep` (a try of a put on one still on its way
    /// fails, and a key one landed already goes with it) and tells whether the own key is
    /// still on `keep`.
    async fn keep_only_on(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        own: &[u8],
        keep: i64,
    ) -> Result<bool, LockError> {
        let others = self.keep_only_lease(resource, token, keep);
        self.revoke_forgotten(resource, token, others).await?;
        let still_on = Txn::new().when([Compare::lease(own.to_vec(), CompareOp::Equal, keep)]);
        Ok(self.txn(still_on).await?.succeeded())
    }

    /// Forgets every lease of `token`'s but `keep`, and returns them.
    fn keep_only_lease(&self, resource: &ResourceName, token: &OwnerToken, keep: i64) -> Vec<i64> {
        let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
        let list = leases
            .entry((resource.shared(), token.clone()))
            .or_default();
        let others = list.iter().copied().filter(|id| *id != keep).collect();
        *list = vec![keep];
        others
    }

    /// After `expire` moved (or failed to move) the key of `token`'s, not on a session, onto a
    /// lease of the rest of its hold: no release or abandon follows for the token, so its
    /// leases are forgotten here, or they would be remembered for the life of the backend.
    /// Moved (`Ok(true)`): only the lease the key now rests on is left (the move revoked the
    /// others, `keep_only_on`), and it must stay to the end of the hold — forgotten, not
    /// revoked; a try of the move landing late puts the key on that same lease. Gone
    /// (`Ok(false)`): no key of the token's is on them, and revoking them makes a put of an
    /// earlier attempt still on its way fail. An error keeps them: the expire is retried in
    /// the background (or ends in a release), and that try revokes this one's leases.
    fn forget_expired(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        ended: &Result<bool, LockError>,
    ) {
        match ended {
            Ok(true) => drop(self.take_leases(resource, token)),
            Ok(false) => self.revoke_later(self.take_leases(resource, token)),
            Err(_) => {}
        }
    }

    fn take_leases(&self, resource: &ResourceName, token: &OwnerToken) -> Vec<i64> {
        self.leases
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(resource.shared(), token.clone()))
            .unwrap_or_default()
    }

    /// Revokes leases nothing needs any more in the background (a lease no key is on
    /// would expire anyway; this only frees it early).
    fn revoke_later(&self, ids: Vec<i64>) {
        if ids.is_empty() {
            return;
        }
        let this = self.clone();
        crate::util::spawn_to_the_end(Arc::new(move || {
            let (this, ids) = (this.clone(), ids.clone());
            Box::pin(async move {
                if let Err(e) = this.revoke(ids).await {
                    tracing::debug!(error = %e, "etcd: revoking unused leases failed; they expire");
                }
            })
        }));
    }

    async fn revoke(&self, ids: Vec<i64>) -> Result<(), LockError> {
        let revokes = ids.into_iter().map(|id| {
            self.call("lease revoke", move |c| {
                let mut lease = c.lease_client();
                async move {
                    match lease.revoke(id).await {
                        // Expired or revoked already: nothing can use it.
                        Err(etcd_client::Error::GRpcStatus(st))
                            if st.code() == tonic::Code::NotFound =>
                        {
                            Ok(())
                        }
                        r => r.map(drop),
                    }
                }
            })
        });
        futures_util::future::try_join_all(revokes).await.map(drop)
    }

    /// Renews locks that are not on a session (idempotency records, locks taken before
    /// renewal was asked for): one lease per distinct TTL for the whole batch, and the keys
    /// moved onto it ([`relet_batch`](Self::relet_batch)).
    async fn relet_many(&self, items: &[ExtendItem]) -> Vec<Result<bool, LockError>> {
        // One lease per distinct TTL for the whole batch.
        let mut secs: Vec<i64> = items.iter().map(|i| lease_secs(i.ttl)).collect();
        secs.sort_unstable();
        secs.dedup();
        let grants = futures_util::future::join_all(
            secs.iter()
                .map(|s| self.grant_at(Duration::from_secs(s.unsigned_abs()))),
        )
        .await;
        // A failed grant fails every item of its TTL (by message: `LockError` is not `Clone`).
        let leases: HashMap<i64, Result<(i64, i64), String>> = secs
            .into_iter()
            .zip(grants.into_iter().map(|g| g.map_err(|e| e.to_string())))
            .collect();
        futures_util::future::join_all(items.iter().map(|i| {
            let lease = leases.get(&lease_secs(i.ttl)).cloned();
            async move {
                match lease {
                    Some(Ok(lease)) => self.relet_batch(&i.resource, &i.token, lease).await,
                    Some(Err(e)) => Err(LockError::unavailable(e, None)),
                    None => Err(LockError::unavailable("etcd lease grant missing", None)),
                }
            }
        }))
        .await
    }

    /// Moves the own key of `token`'s (not on a session) onto a batch's `lease`, granted at
    /// store revision `granted_at`. Two kinds of late try must not move it back afterwards,
    /// onto a lease granted earlier, which ends before the one the holder was told of:
    ///
    /// * a re-let of an earlier batch (a hedged try, or one cut off by the batch's deadline):
    ///   each re-let requires that the key was not written since its lease was granted — a
    ///   later move wrote it after that, so the earlier one fails. When this one fails so
    ///   while the key exists (an earlier one landed after this lease was granted), it is an
    ///   error, and the next renewal, on a lease granted after that write, moves it;
    /// * a put on one of the token's own leases (an attempt's, an `extend`'s, an idempotency
    ///   `begin`'s): those are revoked once the key is off them, and the key is checked to be
    ///   on `lease` still (a put that landed in between went with its lease: not held).
    ///
    /// A batch lease is shared by the batch's keys: it is never remembered for a token, and
    /// never revoked.
    async fn relet_batch(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        (lease, granted_at): (i64, i64),
    ) -> Result<bool, LockError> {
        let own = self.keys(resource, token).own;
        if !self.relet_since(&own, lease, granted_at).await? {
            return Ok(false);
        }
        let key = token_key(resource, token);
        let mine = self
            .leases
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .cloned()
            .unwrap_or_default();
        if mine.is_empty() {
            return Ok(true);
        }
        // Still remembered until revoked: a renewal cut off before that revokes them next time
        // (or the release does).
        self.revoke(mine.clone()).await?;
        {
            let mut leases = self.leases.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(list) = leases.get_mut(&key) {
                list.retain(|id| !mine.contains(id));
                if list.is_empty() {
                    leases.remove(&key);
                }
            }
        }
        let still_on = Txn::new().when([Compare::lease(own, CompareOp::Equal, lease)]);
        Ok(self.txn(still_on).await?.succeeded())
    }

    /// The store's revision now (one read), for a watch of a waiter with no key in the line:
    /// its task watches deletions from after it, so a release made once this answered is not
    /// missed however late the task reads. `None` if it could not be read (the task's own read
    /// counts then; the waiter's timer covers the gap).
    async fn revision_now(&self, resource: &ResourceName) -> Option<i64> {
        let dir = self.lock_dir(resource).dir;
        let read = self
            .call("get", |c| {
                let mut kv = c.kv_client();
                let dir = dir.clone();
                async move { kv.get(dir, Some(GetOptions::new().with_count_only())).await }
            })
            .await;
        read.ok()?.header().map(|h| h.revision())
    }

    /// Starts the watch task of the local waiter `token` ([`watch_turn`]), replacing one that
    /// runs. The task takes itself out of the books before it wakes the waiter, so that an
    /// attempt the waiter then makes finds it gone (see [`rewatch`](Self::rewatch)). `floor`:
    /// a revision read before the caller returns ([`revision_now`](Self::revision_now)) — a
    /// waiter with no key in the line is woken by deletions after it.
    fn spawn_watch(&self, resource: &ResourceName, token: &OwnerToken, floor: Option<i64>) {
        let k = match self.sessions.name_of(&token_key(resource, token)) {
            Some(own) => Keys {
                own,
                ..self.lock_dir(resource)
            },
            None => self.keys(resource, token),
        };
        let name = resource.shared();
        let own = k.own.clone();
        let turn = watch_turn(
            self.watches.clone(),
            self.hub.clone(),
            (name.clone(), token.clone()),
            k,
            self.opts.command_timeout,
            resource.kind(),
            floor,
        );
        let entry = (name, token.clone());
        let (watchers, hub) = (self.watchers.clone(), self.hub.clone());
        // Inserted under the same lock, so the entry is there before the task can look for it.
        let mut w = self.watchers.lock().unwrap_or_else(PoisonError::into_inner);
        let task = tokio::spawn({
            let entry = entry.clone();
            async move {
                turn.await;
                {
                    let mut w = watchers.lock().unwrap_or_else(PoisonError::into_inner);
                    if w.get(&entry)
                        .is_some_and(|(h, _)| h.id() == tokio::task::id())
                    {
                        w.remove(&entry);
                    }
                }
                hub.notify(&entry.0, Some(entry.1.as_str()));
            }
        });
        if let Some((old, _)) = w.insert(entry, (task.abort_handle(), own)) {
            old.abort();
        }
    }

    /// After an attempt of `token` found the lock held: a local waiter whose watch task ended
    /// — it was woken, and is not first after all: another barging waiter took the lock, or its
    /// key was gone and it queued again at the back — or watches a key it no longer has gets
    /// a new one, watching for its next turn (else it would wake only on its fallback timer
    /// from then on). A barging waiter's (no key in the line) watches deletions from a
    /// revision read before the attempt answers: a release between this attempt and the
    /// task's first read wakes it.
    async fn rewatch(&self, resource: &ResourceName, token: &OwnerToken, barging: bool) {
        if !self.hub.is_waiting(resource.as_str(), token) {
            return;
        }
        let own = self
            .sessions
            .name_of(&token_key(resource, token))
            .unwrap_or_else(|| self.keys(resource, token).own);
        let watched = self
            .watchers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&token_key(resource, token))
            .is_some_and(|(_, watched)| *watched == own);
        if !watched {
            let floor = match barging {
                true => self.revision_now(resource).await,
                false => None,
            };
            self.spawn_watch(resource, token, floor);
        }
    }

    fn stop_watch(&self, resource: &ResourceName, token: &OwnerToken) {
        let mut w = self.watchers.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((h, _)) = w.remove(&(resource.shared(), token.clone())) {
            h.abort();
        }
    }

    /// One transaction: put the own key (value: the token) on `lease`, then read the line
    /// ([`kinds::line_options`]) and the own key.
    async fn put_and_read_line(
        &self,
        k: &Keys,
        args: &AcquireArgs<'_>,
        lease: i64,
    ) -> Result<Vec<TxnOpResponse>, LockError> {
        let line = kinds::line_options(args.resource.kind(), &k.end);
        let txn = Txn::new().and_then([
            TxnOp::put(
                k.own.clone(),
                args.token.as_str(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::get(k.dir.clone(), Some(line)),
            TxnOp::get(k.own.clone(), None),
        ]);
        Ok(self.txn(txn).await?.op_responses())
    }

    async fn acquire_queued(&self, args: &AcquireArgs<'_>) -> Result<Attempt, LockError> {
        let k = self.keys(args.resource, args.token);
        let lease = self
            .grant_for(args.resource, args.token, args.waiter_ttl)
            .await?;
        let kind = args.resource.kind();
        let ops = self.put_and_read_line(&k, args, lease).await?;
        let line = kinds::kvs_at(&ops, 1);
        let head = line.first();
        let own_rev = i64::try_from(create_revision_at(&ops, 2)).unwrap_or(0);
        if own_rev > 0 && kinds::admitted(kind, k.dir.len(), line, &k.own) {
            let lease = self.grant_for(args.resource, args.token, args.ttl).await?;
            if !self.relet_on(&k.own, own_rev, lease).await? {
                return Ok(Attempt::Held { remaining: None });
            }
            // A try of this acquisition's puts still on its way (a hedged try's first one, an
            // attempt that timed out) would land after the relet and move the key back onto
            // its waiter lease: it would expire within the waiter TTL, and the next waiter get
            // the lock while this one holds it. So revoke the waiter leases first — a put on a
            // revoked lease fails, and one that landed before the revoke goes with it — then
            // check that the key is still on the lock's lease.
            let waiter_leases = self.keep_only_lease(args.resource, args.token, lease);
            self.revoke_forgotten(args.resource, args.token, waiter_leases)
                .await?;
            let still_on = Txn::new().when([
                Compare::create_revision(k.own.clone(), CompareOp::Equal, own_rev),
                Compare::lease(k.own.clone(), CompareOp::Equal, lease),
            ]);
            if self.txn(still_on).await?.succeeded() {
                return Ok(Attempt::Acquired {
                    fencing_token: own_rev.unsigned_abs(),
                });
            }
            return Ok(Attempt::Held { remaining: None });
        }
        Ok(Attempt::Held {
            remaining: self.remaining(head).await?,
        })
    }

    async fn acquire_if_free(&self, args: &AcquireArgs<'_>) -> Result<Attempt, LockError> {
        let k = self.keys(args.resource, args.token);
        let lease = self.grant_for(args.resource, args.token, args.ttl).await?;
        let ops = match self
            .put_if_free(&k, args.token.as_str(), lease, vec![], vec![])
            .await?
        {
            Ok(fencing_token) => return Ok(Attempt::Acquired { fencing_token }),
            Err(ops) => ops,
        };
        let head = ops.first().and_then(first_kv);
        if let Some(h) = head.filter(|h| h.key() == k.own.as_slice()) {
            // This token already holds the lock (asking again): restart its lease.
            let rev = h.create_revision();
            if self.relet_on(&k.own, rev, lease).await? {
                return Ok(Attempt::Acquired {
                    fencing_token: rev.unsigned_abs(),
                });
            }
            return Ok(Attempt::Held { remaining: None });
        }
        // Nothing of this token is on the lease: a try that did not win leaves nothing.
        self.revoke_later(self.take_leases(args.resource, args.token));
        Ok(Attempt::Held {
            remaining: self.remaining(head).await?,
        })
    }
}

/// Remembers `ids` among the leases of `key`'s acquisition again, before those it has (older
/// first, as they were), each once.
fn remember_again(leases: &Leases, key: (Arc<str>, OwnerToken), ids: &[i64]) {
    let mut leases = leases.lock().unwrap_or_else(PoisonError::into_inner);
    let list = leases.entry(key).or_default();
    let kept = std::mem::take(list);
    list.extend(ids.iter().copied().filter(|id| !kept.contains(id)));
    list.extend(kept);
}

/// A transaction that moves the key `own` onto `lease` (value kept) if it exists with `create`
/// revision (0: whatever its create revision).
fn relet_txn(own: &[u8], create: i64, lease: i64) -> Txn {
    let guard = if create == 0 {
        Compare::create_revision(own, CompareOp::Greater, 0)
    } else {
        Compare::create_revision(own, CompareOp::Equal, create)
    };
    Txn::new().when([guard]).and_then([TxnOp::put(
        own,
        "",
        Some(PutOptions::new().with_lease(lease).with_ignore_value()),
    )])
}

/// The connect options for the member at `host`: `base`, with TLS for that host's name.
fn member_options(base: &ConnectOptions, tls: Option<&TlsFiles>, host: &str) -> ConnectOptions {
    #[cfg(feature = "etcd-tls")]
    if let Some(tls) = tls {
        return base.clone().with_tls(tls.options(host));
    }
    let _ = (tls, host);
    base.clone()
}

/// A token's key in the session registry.
fn token_key(resource: &ResourceName, token: &OwnerToken) -> TokenKey {
    (resource.shared(), token.clone())
}

/// The end of the range of keys starting with `dir` (which ends in `/`).
fn range_end(dir: &[u8]) -> Vec<u8> {
    let mut end = dir.to_vec();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    end
}

/// What a waiter's watch found.
enum Turn {
    /// Its turn, or its key is gone (deleted, or its lease ran out: its next attempt queues
    /// it anew): wake it.
    Now,
    /// The waiter has had no key in the line since its watch began — it barges — as of this
    /// revision: wake it when a key of the lock is deleted after it.
    NoKey(i64),
    /// The key ahead was deleted: look again.
    Again,
}

/// One waiter's watch loop: returns when the waiter is to be woken — no key precedes `own` (a
/// lock), `own` fits beside the keys ahead of it (a permit or hold, `kinds::wait_admitted`),
/// or, when the waiter has no key in the line, a key of the lock was deleted. A backend error
/// wakes the waiter too (its attempt may find the lock free) while the loop goes on.
async fn watch_turn(
    watches: Arc<Watches>,
    hub: Arc<ReleaseHub>,
    (resource, token): (Arc<str>, OwnerToken),
    k: Keys,
    timeout: Duration,
    kind: LockKind,
    mut floor: Option<i64>,
) {
    let pool = watches.pool();
    let mut backoff = Duration::from_millis(20);
    // The own key's create revision, read once: it never changes while the key lives.
    let mut own_rev = None;
    loop {
        let turn = match kind {
            LockKind::Exclusive => {
                wait_predecessor(pool, &watches, &k, &mut own_rev, timeout).await
            }
            kind => kinds::wait_admitted(pool, &watches, kind, &k, timeout).await,
        };
        let first_floor = floor.take();
        let woken = match turn {
            Ok(Turn::Now) => return,
            Ok(Turn::NoKey(revision)) => {
                // From the revision read before the waiter was told it waits, if earlier (only
                // on the first turn: a later one follows the task's own reads).
                let from = first_floor.map_or(revision, |f| f.min(revision));
                deleted_after(&watches, &k, from).await
            }
            Ok(Turn::Again) => {
                backoff = Duration::from_millis(20);
                continue;
            }
            Err(e) => Err(e),
        };
        match woken {
            Ok(()) => return,
            Err(e) => {
                tracing::debug!(error = %e, "etcd watch failed; the waiter re-checks");
                // The waiter re-checks (its attempt may find the lock free) while we retry.
                hub.notify(&resource, Some(token.as_str()));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// Returns once a key of the lock of `k` is deleted after `revision` (a release, a lease that
/// ran out, a waiter that left).
async fn deleted_after(watches: &Watches, k: &Keys, revision: i64) -> Result<(), LockError> {
    let mut watch = watches.watch(&k.dir, Some(&k.end), revision + 1).await?;
    watch.deleted().await.map(drop)
}

/// The create revision of the own key of `k` — `Err` when the key is gone, with the revision
/// of the read and whether the lock had no key at all then (one transaction).
async fn own_revision(
    pool: &Pool,
    k: &Keys,
    timeout: Duration,
) -> Result<Result<i64, NoOwnKey>, LockError> {
    let txn = Txn::new().and_then([
        TxnOp::get(k.own.clone(), Some(GetOptions::new().with_keys_only())),
        TxnOp::get(
            k.dir.clone(),
            Some(
                GetOptions::new()
                    .with_range(k.end.clone())
                    .with_count_only(),
            ),
        ),
    ]);
    let resp = call(pool, timeout, "txn", |c| {
        let mut kv = c.kv_client();
        let txn = txn.clone();
        async move { kv.txn(txn).await }
    })
    .await?;
    let read = resp.header().map_or(0, |h| h.revision());
    let ops = resp.op_responses();
    if let Some(own) = kinds::kvs_at(&ops, 0).first() {
        return Ok(Ok(own.create_revision()));
    }
    let free = match ops.get(1) {
        Some(TxnOpResponse::Get(r)) => r.count() == 0,
        _ => false,
    };
    Ok(Err(NoOwnKey { read, free }))
}

/// What [`own_revision`] read when the own key was gone.
pub(super) struct NoOwnKey {
    /// The revision of the read.
    pub(super) read: i64,
    /// The lock had no key at all: it was free.
    pub(super) free: bool,
}

/// Reads the predecessor of the own key of `k`: [`Turn::Now`] when there is none or the own
/// key is gone, [`Turn::NoKey`] when this watch never saw the own key, [`Turn::Again`] once
/// the predecessor was deleted.
/// The own key's create revision is read the first time into `own_rev`; after that one
/// transaction reads the own key and its predecessor together (a handoff costs the woken
/// waiter's watch one round trip), and a changed revision (the key was deleted and put again)
/// is read anew.
async fn wait_predecessor(
    pool: &Pool,
    watches: &Watches,
    k: &Keys,
    own_rev: &mut Option<i64>,
    timeout: Duration,
) -> Result<Turn, LockError> {
    let predecessor = |rev: i64| {
        GetOptions::new()
            .with_range(k.end.clone())
            .with_max_create_revision(rev - 1)
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1)
            .with_keys_only()
    };
    let (pred_key, header_rev) = loop {
        let Some(rev) = *own_rev else {
            match own_revision(pool, k, timeout).await? {
                Ok(rev) => *own_rev = Some(rev),
                // A waiter with no key in the line that finds the lock free is woken at once:
                // the release came between its attempt and this read (or the floor its watch
                // was given), and a watch from the read on would wait for the next one.
                Err(NoOwnKey { free: true, .. }) => return Ok(Turn::Now),
                Err(NoOwnKey { read, .. }) => return Ok(Turn::NoKey(read)),
            }
            continue;
        };
        let txn = Txn::new().and_then([
            TxnOp::get(k.own.clone(), Some(GetOptions::new().with_keys_only())),
            TxnOp::get(k.dir.clone(), Some(predecessor(rev))),
        ]);
        let resp = call(pool, timeout, "txn", |c| {
            let mut kv = c.kv_client();
            let txn = txn.clone();
            async move { kv.txn(txn).await }
        })
        .await?;
        let header_rev = resp.header().map_or(0, |h| h.revision());
        let ops = resp.op_responses();
        match kinds::kvs_at(&ops, 0)
            .first()
            .map(KeyValue::create_revision)
        {
            None => return Ok(Turn::Now),
            Some(now) if now != rev => *own_rev = Some(now),
            Some(_) => {
                let Some(pred) = kinds::kvs_at(&ops, 1).first() else {
                    return Ok(Turn::Now);
                };
                break (pred.key().to_vec(), header_rev);
            }
        }
    };
    let mut watch = watches.watch(&pred_key, None, header_rev + 1).await?;
    watch.deleted().await?;
    Ok(Turn::Again)
}

impl Backend for EtcdBackend {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn acquire<'a>(&'a self, args: AcquireArgs<'a>) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(async move {
            let attempt = match args.mode {
                _ if args.renew => self.acquire_renewed(&args).await,
                WaitMode::Queue => self.acquire_queued(&args).await,
                _ if args.resource.kind() != LockKind::Exclusive => {
                    self.acquire_kind_if_free(&args).await
                }
                _ => self.acquire_if_free(&args).await,
            };
            match &attempt {
                Ok(Attempt::Acquired { .. }) => self.stop_watch(args.resource, args.token),
                Ok(Attempt::Held { .. }) => {
                    let barging = args.mode == WaitMode::Barge;
                    self.rewatch(args.resource, args.token, barging).await;
                }
                _ => {}
            }
            attempt
        })
    }

    /// Permits and read or write holds take the lock's paths, which read the line by the
    /// kind's rule (module `kinds`).
    fn acquire_kind<'a>(
        &'a self,
        args: AcquireArgs<'a>,
    ) -> BoxFuture<'a, Result<Attempt, LockError>> {
        self.acquire(args)
    }

    fn release<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            if let Some(released) = self.release_registered(&token_key(resource, token)).await {
                return released;
            }
            let k = self.keys(resource, token);
            let txn = Txn::new()
                .when([Compare::create_revision(
                    k.own.clone(),
                    CompareOp::Greater,
                    0,
                )])
                .and_then([TxnOp::delete(k.own, None)]);
            let released = self.txn(txn).await?.succeeded();
            self.revoke_later(self.take_leases(resource, token));
            Ok(released)
        })
    }

    fn extend<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let key = token_key(resource, token);
            if let Some(extended) = self.extend_registered(&key, ttl).await {
                return extended;
            }
            if self.registered(&key) {
                // On a session but not held (a release is on its way): not the owner.
                return Ok(false);
            }
            // Not on a session (`auto_renew(false)`): onto a lease of its own, remembered,
            // and the token's earlier ones revoked — a try of the acquire's put (or relet)
            // still on its way would otherwise land after this and move the key back onto
            // the acquire's lease, which ends at the old TTL.
            let k = self.keys(resource, token);
            let (lease, granted_at) = self.grant_for_at(resource, token, ttl).await?;
            // Guarded as a batch's re-let is: a try of this move landing after a later move
            // (a batch's, whose lease is never revoked) must not move the key back.
            if !self.relet_since(&k.own, lease, granted_at).await? {
                self.revoke_later(vec![lease]);
                return Ok(false);
            }
            self.keep_only_on(resource, token, &k.own, lease).await
        })
    }

    fn expire<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        left: Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            if let Some(ended) = self
                .expire_registered(&token_key(resource, token), left)
                .await
            {
                return ended;
            }
            // Not on a session (`auto_renew(false)`: on a lease of its own already).
            let ended = self.extend(resource, token, left).await;
            self.forget_expired(resource, token, &ended);
            ended
        })
    }

    fn extend_many<'a>(
        &'a self,
        items: &'a [ExtendItem],
    ) -> BoxFuture<'a, Vec<Result<bool, LockError>>> {
        Box::pin(async move {
            let keyed: Vec<(TokenKey, Duration)> = items
                .iter()
                .map(|i| (token_key(&i.resource, &i.token), i.ttl))
                .collect();
            let on_sessions = self.extend_many_registered(&keyed).await;
            let (mut done, mut rest) = (Vec::new(), Vec::new());
            for ((item, key), answer) in items.iter().zip(&keyed).zip(on_sessions) {
                match answer {
                    Some(a) => done.push(Some(a)),
                    None if self.registered(&key.0) => {
                        // On a session of another class (or not held): one by one.
                        done.push(Some(
                            self.extend(&item.resource, &item.token, item.ttl).await,
                        ));
                    }
                    None => {
                        done.push(None);
                        rest.push(item.clone());
                    }
                }
            }
            let mut relet = self.relet_many(&rest).await.into_iter();
            done.into_iter()
                .map(|d| {
                    d.or_else(|| relet.next()).unwrap_or_else(|| {
                        Err(LockError::unavailable("etcd renewal missing", None))
                    })
                })
                .collect()
        })
    }

    fn abandon<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<(), LockError>> {
        Box::pin(async move {
            self.stop_watch(resource, token);
            if let Some(released) = self.release_registered(&token_key(resource, token)).await {
                return released.map(drop);
            }
            // First the leases, so that an attempt still in flight cannot put the key back;
            // then the key, in case it is on a lease this locker never saw.
            self.revoke_leases(resource, token).await?;
            let k = self.keys(resource, token);
            self.call("delete", |c| {
                let mut kv = c.kv_client();
                let own = k.own.clone();
                async move { kv.delete(own, None).await }
            })
            .await?;
            Ok(())
        })
    }
    fn idempotency(&self) -> Option<&dyn IdempotencyStore> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn super::AdminStore> {
        Some(self)
    }

    fn watch<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move {
            let on_last =
                super::abort_gone_watch_tasks(self.watchers.clone(), self.hub.clone(), |v| &v.0);
            let (watch, _first) = self.hub.register(resource, token, Some(on_last));
            // The task reads the line once it runs, after this returned: a waiter with no key
            // in it (barging) would miss a release made before that read.
            let floor = self.revision_now(resource).await;
            self.spawn_watch(resource, token, floor);
            Ok(watch)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Leases an attempt forgot (over [`LEASES_KEPT`], or the waiter leases an admission
    /// drops) whose revocation failed are remembered again, the oldest first and each once:
    /// the token's next attempt drains them first and revokes them again, and an admission
    /// or abandon takes them with the rest. Forgotten, a late put on one could move an admitted
    /// key back onto a waiter lease, and nothing would revoke it.
    #[test]
    fn leases_whose_revocation_failed_are_remembered_again() {
        let leases = Leases::default();
        let key = (Arc::<str>::from("r"), OwnerToken::generate());
        leases.lock().unwrap().insert(key.clone(), vec![4, 5]);
        remember_again(&leases, key.clone(), &[1, 2, 4]);
        assert_eq!(leases.lock().unwrap()[&key], [1, 2, 4, 5]);
        let other = (Arc::<str>::from("r"), OwnerToken::generate());
        remember_again(&leases, other.clone(), &[7]);
        assert_eq!(leases.lock().unwrap()[&other], [7]);
    }

    #[test]
    fn releases_before_the_lease_revoke_fix_are_told_apart() {
        for old in [
            "3.4.23",
            "3.4.30",
            "3.5.0",
            "3.5.12",
            "3.3.27",
            "2.3.8",
            "3.5.12-rc.0",
        ] {
            assert_eq!(revokes_live_leases(old), Some(true), "{old}");
        }
        for fixed in [
            "3.4.31",
            "3.4.37",
            "3.5.13",
            "3.5.21",
            "3.6.0",
            "3.6.4",
            "4.0.0+git",
        ] {
            assert_eq!(revokes_live_leases(fixed), Some(false), "{fixed}");
        }
        for unknown in ["", "3", "3.5", "v3.5.1", "not a version"] {
            assert_eq!(revokes_live_leases(unknown), None, "{unknown}");
        }
    }

    #[test]
    fn every_member_on_a_release_that_revokes_live_leases_is_named() {
        let (a, b, c) = ("http://a:2379", "http://b:2379", "http://c:2379");
        // A rolling upgrade: one member left on an old release, one silent.
        assert_eq!(
            lease_revoking_members(&[(a, Some("3.5.17")), (b, Some("3.4.23")), (c, None)]),
            Some(("3.4.23".to_owned(), b.to_owned()))
        );
        assert_eq!(
            lease_revoking_members(&[(a, Some("3.4.23")), (b, Some("3.5.9")), (c, Some("3.4.23"))]),
            Some(("3.4.23, 3.5.9".to_owned(), format!("{a}, {b}, {c}")))
        );
        assert_eq!(
            lease_revoking_members(&[(a, Some("3.6.0")), (b, Some("3.5.13")), (c, Some("x"))]),
            None
        );
        assert_eq!(lease_revoking_members(&[(a, None)]), None);
    }

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        assert_eq!(lease_secs(Duration::from_millis(10)), 1);
        assert_eq!(lease_secs(Duration::from_millis(1000)), 1);
        assert_eq!(lease_secs(Duration::from_millis(1001)), 2);
        assert_eq!(lease_secs(Duration::from_secs(20)), 20);
    }

    #[test]
    fn a_value_notes_the_ttl_and_the_token() {
        let token = OwnerToken::generate();
        let value = noted_value(Duration::from_millis(1500), &token);
        assert_eq!(
            noted(value.as_bytes()),
            (Some(Duration::from_millis(1500)), Some(token.as_str()))
        );
        let registered = format!("{value}/7");
        assert_eq!(
            noted(registered.as_bytes()),
            (Some(Duration::from_millis(1500)), Some(token.as_str()))
        );
        assert_eq!(noted(b"30000"), (Some(Duration::from_secs(30)), None));
        assert_eq!(noted(b"fp:abc"), (None, None));
        assert_eq!(noted(token.as_str().as_bytes()), (None, None));
    }

    #[test]
    fn range_end_bumps_the_slash() {
        assert_eq!(range_end(b"dlock/a/"), b"dlock/a0".to_vec());
    }
}
