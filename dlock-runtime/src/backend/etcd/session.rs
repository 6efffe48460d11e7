//! Session leases: the keys of every renewed lock (and every waiter) of a locker sit on a
//! lease shared by all of them — one per *lease class* (the TTL in whole seconds, rounded up,
//! plus one second of headroom) — kept alive over a keepalive stream, the way etcd's own
//! `concurrency.Session` does. An uncontended acquire is then one transaction and a release
//! one delete; renewal costs no Raft write at all.
//!
//! # What keeps the promises
//!
//! * **The server's lease outlives the local one.** A session remembers when the last
//!   keepalive (or grant) that etcd answered was *sent*; its lease lasts at least the class
//!   from then. An acquisition or renewal that needs `ttl` from now sends a keepalive first
//!   unless that bound already covers it; the second of headroom lets one keepalive serve
//!   every acquisition of the following second. A keepalive counts only its own answer: the
//!   stream carries no request ids, so a keepalive cancelled before its answer was read
//!   (a deadline, a `select!`) drops the stream, and the next one opens another — left
//!   behind, that answer would be read by the next keepalive as its own, and a keepalive
//!   that never reached etcd would look answered.
//! * **A key nobody wants is never kept alive.** Every key this locker put on a session is in
//!   the registry, with its role: held, waiting (until its waiter TTL runs out without a new
//!   attempt), being acquired, being released, or unwanted (released with a put of it still
//!   out, a release that failed, or a try that lost). Before every keepalive of a session, the
//!   unwanted keys on it and its waiters past their time are deleted; if that fails, there is
//!   no keepalive, and the lease runs out. A key being released is left to its release's own
//!   delete (deleted by a keepalive first, the release would answer "not the owner"), and a
//!   waiter's key while an attempt of its own is under way (it may be admitted by it); other
//!   attempts of the locker do not hold the deletion up — they are the waiters' session's
//!   keepalives, and a dead waiter first in line would hold the lock up for as long as any
//!   other waiter of its locker kept asking.
//! * **A session is revoked only under no wanted key.** A key's registry entry names every
//!   session a put or move of it may have used *before* the request is sent, and a session is
//!   revoked only when no entry that is not unwanted names it.
//! * **A put that may still land is no orphan.** A put whose fate is unknown — its future was
//!   dropped, its answer timed out, or a hedged sibling was still out when the answer came —
//!   leaves its token *in flight*. When such a token is released or abandoned, it stays in the
//!   registry as a suspect, and the sessions its puts used are *retired*: new acquisitions get
//!   a fresh session, the suspect's key is deleted again before every keepalive of a retired
//!   session, and a retired session is revoked once no held or waiting key is left on it
//!   (revoking deletes whatever landed on it, and a put on a revoked lease fails). A suspect
//!   stays until etcd *answered* the revocation (or a keepalive found the lease gone), not
//!   merely until it was asked: a revocation that fails leaves the lease alive.
//! * **A name is reused only when nothing for its last token can reach it.** A token's key is
//!   named `<locker id>.<slot>` (see [`Sessions::begin_put`]); the slot goes back to the lock's
//!   free slots only when the token's entry goes, which waits for every put of it to be
//!   settled (or its sessions to be gone: expired, or revoked as etcd answered). Every delete
//!   of a registered key — a release's, and a keepalive's pruning, which may be dropped
//!   half-way — deletes it only if its value is still its registration's (every put of one
//!   registration writes the same value, which names the token and the registration), so a
//!   delete that may still land (answered through a hedge while its sibling is out, or timed
//!   out) keeps no name: it cannot touch the key of the name's next token, nor the next key of
//!   the same token (registered again — a semaphore try that was not admitted, a waiter pruned
//!   as past its time — it may get its old name back, always with a new value). A put of an
//!   earlier registration still on its way may land after that, where the name is free, with
//!   the earlier value: a key nobody wants. The entry keeps such values, and prunings delete the
//!   key by any of them, as does the token's next attempt that finds it at its name.
//! * **Loss.** A renewal is a keepalive (when needed) and a read of the batch's keys: a key
//!   that is gone or on another lease, or a session whose lease etcd no longer has, is a lost
//!   lock; an error keeps the watchdog retrying until the local lease clock runs out.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn,
    TxnOp,
};
use tokio::time::Instant;

use super::kinds::{admitted, kvs_at, line_options};
use super::pool::{call, per_try};
use super::{create_revision_at, first_kv, lease_secs, EtcdBackend, Keys};
use crate::backend::{AcquireArgs, Attempt, OwnerToken, WaitMode};
use crate::key::LockKind;
use crate::LockError;

/// A token's entry in the registry: (resource, owner token).
pub(super) type TokenKey = (Arc<str>, OwnerToken);

/// At most this many operations per transaction (etcd's default limit is 128).
const OPS_PER_TXN: usize = 64;

/// An entry remembers at most this many earlier values of its key ([`Entry::stale`]).
const STALE_VALUES_KEPT: usize = 32;

/// Retired sessions left with no wanted key are looked for at most this often, by the
/// acquisitions ([`Sessions::stranded`]).
const SWEEP_EVERY: Duration = Duration::from_secs(5);

/// A revocation of an idle session is tried this many times ([`EtcdBackend::revoke_idle`]).
const REVOKE_TRIES: u32 = 3;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The lease seconds of the session for a lock (or a waiter) of `ttl`.
pub(super) fn session_secs(ttl: Duration) -> i64 {
    lease_secs(ttl).saturating_add(1)
}

/// One session lease.
pub(super) struct Session {
    pub(super) id: i64,
    secs: i64,
    /// When the latest keepalive (or the grant) that etcd answered with the lease alive was
    /// sent: the lease lasts at least `secs` from then.
    fresh_from: Mutex<Instant>,
    /// The keepalive stream (opened by the first keepalive; reopened on another member when
    /// it fails, or when a keepalive was dropped before its answer was read: every answer
    /// read from it is the answer to the keepalive that reads it). A stream of a client whose
    /// runtime shut down fails at its next keepalive, and is reopened over the new client.
    stream: tokio::sync::Mutex<Option<(LeaseKeeper, LeaseKeepAliveStream)>>,
    /// No new key goes on it (a suspect may land on it).
    retired: AtomicBool,
    /// Not to be used or kept alive any more: its revocation was asked for, or etcd no longer
    /// has the lease.
    dead: AtomicBool,
    /// A revocation of it is under way ([`EtcdBackend::revoke_idle`]).
    revoking: AtomicBool,
    /// etcd no longer has the lease: it answered the revocation, or a keepalive found it gone
    /// ([`Sessions::gone`]).
    gone: AtomicBool,
}

impl Session {
    fn covers(&self, need: Duration) -> bool {
        let from = *lock(&self.fresh_from);
        from + Duration::from_secs(self.secs.unsigned_abs()) >= Instant::now() + need
    }

    fn usable(&self) -> bool {
        !self.retired.load(Ordering::Acquire) && !self.dead.load(Ordering::Acquire)
    }
}

/// What a registered key is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// An attempt is on its way.
    Acquiring,
    /// Waiting in the queue until the instant (unless another attempt comes).
    Waiting(Instant),
    /// Held.
    Held,
    /// Released or abandoned, its delete on its way. Not deleted by a keepalive's pruning (the
    /// release would find its key gone and answer "not the owner"), and its session is not
    /// revoked under it, for the same reason.
    Releasing,
    /// Released, abandoned or lost a try: deleted before the next keepalive.
    Unwanted,
    /// Released within a minimum hold: moved to a lease of its own that nothing renews, to
    /// end by itself at the instant. Its name stays taken (a later key of the name would take
    /// its place in the queue) until a pruning after the instant deleted it.
    Ending(Instant),
}

/// Where a token's key goes when it is first registered.
pub(super) struct NewKey<'a> {
    /// `<prefix>/<resource>/`
    pub(super) dir: &'a [u8],
    pub(super) kind: LockKind,
    /// The value its puts write: it names the token ([`super::noted_value`]).
    pub(super) value: String,
}

struct Entry {
    own: Vec<u8>,
    /// The value its puts write, which a pruning's delete compares.
    value: Vec<u8>,
    /// The name's slot among this locker's keys of the resource.
    slot: u32,
    /// The session the key is on (as far as the latest answer says).
    session: Arc<Session>,
    /// Every session a put of this token may have used.
    touched: Vec<Arc<Session>>,
    role: Role,
    /// The key's create revision, once held.
    create: i64,
    /// Puts sent whose fate is unknown.
    in_flight: u32,
    /// Of those, the current registration's (`value`'s): a token's attempts come one at a
    /// time, so every put settled ([`Sessions::end_put`]) is one of the current registration.
    unsettled: u32,
    /// Earlier values of the key — of registrations of this token before `value`'s that left
    /// a put unsettled (the newest [`STALE_VALUES_KEPT`]). Such a
    /// put may land later, where the name is free: a key nobody wants, which a delete
    /// comparing `value` would never match — in the line, it would hold the lock up for as
    /// long as its session lived, and a session that other locks of its class keep alive
    /// lives for as long as they do. Prunings delete it by these values too, and an attempt
    /// of the token that finds it at its name deletes it at once.
    stale: Vec<Vec<u8>>,
    /// Attempts of the token under way that found it registered ([`Sessions::attempting`]):
    /// while one is, its key is not deleted as a waiter past its time.
    attempts: u32,
    /// Set while held by an `expire` (a release within a minimum hold), before its move to a
    /// lease of its own lands: nothing renews the key any more, and if the move never lands
    /// (every try failed or was cut off, and the background retries gave up) a pruning after
    /// this instant deletes it — on its session, which renewals of the class's other locks
    /// keep alive, it would otherwise stay held for the life of the process.
    end_by: Option<Instant>,
}

impl Entry {
    /// The key is on `session` in `role`.
    fn set(&mut self, session: &Arc<Session>, role: Role) {
        self.session = session.clone();
        if !self.touched.iter().any(|t| t.id == session.id) {
            self.touched.push(session.clone());
        }
        self.role = role;
    }

    /// Whether the entry can go: unwanted, and no put of it can still land (none in flight,
    /// or every session one may have used is gone: a put on a lease that is gone fails). A
    /// delete of its name that may still land does not keep it: every delete of a registered
    /// key (a release's, a pruning's) compares the value, which names the token.
    fn done(&self) -> bool {
        self.role == Role::Unwanted && (self.in_flight == 0 || self.touched.is_empty())
    }

    /// Whether a wanted key may be on session `id`: the one it is on, and while a put or move
    /// of it is out (`Acquiring`) or may still land (`in_flight`), every session such a put
    /// named — a queued attempt joins the queue on the waiters' session while `session` names
    /// the holders' one, and a waiter that becomes the holder moves its key to the holders'
    /// session before the registry says so; a revocation of that session in between would
    /// delete the key just put there. A key being released is wanted until its delete lands.
    fn wanted_on(&self, id: i64) -> bool {
        match self.role {
            Role::Unwanted => false,
            // On a lease of its own; a put of it may still land on a session.
            Role::Ending(_) => self.in_flight > 0 && self.touched.iter().any(|t| t.id == id),
            _ if self.session.id == id => true,
            role => {
                (role == Role::Acquiring || self.in_flight > 0)
                    && self.touched.iter().any(|t| t.id == id)
            }
        }
    }
}

/// What [`Sessions::begin_put`] did.
#[derive(Debug, PartialEq, Eq)]
enum Begun {
    /// Registered a put of the key of this name, writing this value.
    Put(Vec<u8>, Vec<u8>),
    /// A session picked was retired or is gone: nothing registered, pick again.
    Stale,
    /// The token is not registered, and no new key was asked for.
    Unknown,
}

/// The registered keys, and per resource the name slots they use.
#[derive(Default)]
struct Registry {
    map: HashMap<TokenKey, Entry, BuildHasherDefault<TokenHasher>>,
    slots: HashMap<Arc<str>, Slots>,
}

/// The slots of one resource in use: the first 64 as bits (no allocation for the common
/// case of a few keys of a lock at once), the rest listed.
#[derive(Default)]
struct Slots {
    low: u64,
    more: Vec<u32>,
}

impl Slots {
    fn take(&mut self) -> u32 {
        if self.low != u64::MAX {
            let slot = self.low.trailing_ones();
            self.low |= 1 << slot;
            return slot;
        }
        let slot = (64..).find(|s| !self.more.contains(s)).unwrap_or(u32::MAX);
        self.more.push(slot);
        slot
    }

    fn free(&mut self, slot: u32) {
        if slot < 64 {
            self.low &= !(1 << slot);
        } else {
            self.more.retain(|s| *s != slot);
        }
    }

    fn is_empty(&self) -> bool {
        self.low == 0 && self.more.is_empty()
    }
}

/// The registry's hasher: FxHash's multiply-rotate over the key's bytes. Every key holds an
/// owner token (128 bits from the OS CSPRNG that no caller knows in advance), so no choice
/// of lock names can make keys collide, and SipHash's protection is not needed on this map;
/// it cost about 1.5 % of the client's work per lock.
#[derive(Default)]
pub(super) struct TokenHasher(u64);

impl Hasher for TokenHasher {
    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0; 8];
            w.copy_from_slice(c);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(K);
        }
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl Registry {
    /// The lowest slot no registered key of `resource` uses, taken.
    fn take_slot(&mut self, resource: &Arc<str>) -> u32 {
        self.slots.entry(resource.clone()).or_default().take()
    }

    fn remove(&mut self, key: &TokenKey) {
        let Some(e) = self.map.remove(key) else {
            return;
        };
        if let Some(used) = self.slots.get_mut(&key.0) {
            used.free(e.slot);
            if used.is_empty() {
                self.slots.remove(&key.0);
            }
        }
    }
}

/// The sessions of one backend and the registry of the keys on them.
pub(super) struct Sessions {
    current: Mutex<HashMap<i64, Arc<Session>>>,
    granting: tokio::sync::Mutex<()>,
    entries: Mutex<Registry>,
    /// This locker's part of its keys' names (random, from the OS CSPRNG): no other locker's
    /// key can have the name of one of its keys.
    instance: String,
    /// Registrations so far: the last part of a key's value ([`Sessions::begin_put`]).
    registrations: AtomicU64,
    /// When the next [`stranded`](Sessions::stranded) sweep is due.
    next_sweep: Mutex<Option<Instant>>,
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions {
            current: Mutex::default(),
            granting: tokio::sync::Mutex::default(),
            entries: Mutex::default(),
            instance: crate::util::secure_token::<16>(),
            registrations: AtomicU64::new(0),
            next_sweep: Mutex::new(None),
        }
    }
}

impl Sessions {
    /// Registers a put of the token's key on the sessions `on`, unless one of them was retired
    /// or is gone ([`Begun::Stale`]: nothing registered, pick sessions again); returns the key's
    /// name. Checked under the same lock as [`idle_retired`](Self::idle_retired), which
    /// retired sessions are revoked by: a session picked before it was retired is either seen here as retired, or
    /// its put is registered before the revocation looks, which then keeps it
    /// ([`Entry::wanted_on`]: a key not held is `Acquiring` from here on, until its attempt
    /// says where it is). A token not registered yet is registered when `new` says where its
    /// key goes (`Begun::Unknown` otherwise).
    ///
    /// A token registered for the first time gets a name `<instance>.<slot>` under `new.dir`,
    /// with the lowest slot no registered key of the resource uses. A name is free again only
    /// once its entry is gone ([`Entry::done`]), which is never while a put of it may still
    /// land (a suspect stays until its sessions are gone — expired, or revoked as etcd
    /// answered — and a put on a lease that is gone fails), and every delete of it (a
    /// release's, a pruning's) compares the value, which names the token: so no request for a
    /// name's previous token changes the key of the next. (A suspect whose session's
    /// revocation is never answered keeps its name for good.) The names of a resource are as
    /// many as this locker ever had keys of it at once: etcd keeps a deleted name in its index
    /// until the next compaction, and a name per acquisition would make every read of the
    /// lock's line slower with each acquisition until then.
    ///
    /// A token whose entry is still there but ended (unwanted, or being released: a try that
    /// lost while a put of it may still land, a waiter deleted as past its time) is registered
    /// again under the same name with a new value when `new` says where its key goes, and is
    /// not registered otherwise (`Begun::Unknown`): a delete of its earlier key — a pruning's
    /// or a release's, which may land after this put — compares the earlier value and leaves
    /// the new key alone. Registered again with the same value, that late delete deleted the
    /// key the token had just taken the lock with.
    #[must_use]
    fn begin_put(&self, key: &TokenKey, new: Option<&NewKey<'_>>, on: &[&Arc<Session>]) -> Begun {
        let mut reg = lock(&self.entries);
        if on.iter().any(|s| !s.usable()) {
            return Begun::Stale;
        }
        // The value names the registration, not only the token: a token registered again (its
        // entry gone or ended: released, not admitted, pruned) may get the name it had, and a
        // delete of its earlier key that may still land must not match its new one.
        let value_of = |new: &NewKey<'_>| {
            let registration = self.registrations.fetch_add(1, Ordering::Relaxed);
            format!("{}/{registration}", new.value).into_bytes()
        };
        let e = match (reg.map.get_mut(key), new) {
            (Some(e), new) if matches!(e.role, Role::Unwanted | Role::Releasing) => {
                let Some(new) = new else {
                    return Begun::Unknown;
                };
                let old = std::mem::replace(&mut e.value, value_of(new));
                if std::mem::take(&mut e.unsettled) > 0 {
                    if e.stale.len() == STALE_VALUES_KEPT {
                        e.stale.remove(0);
                    }
                    e.stale.push(old);
                }
                e
            }
            (Some(e), _) => e,
            (None, None) => return Begun::Unknown,
            (None, Some(new)) => {
                let slot = reg.take_slot(&key.0);
                let own = super::kinds::slot_key(new.dir, new.kind, &self.instance, slot);
                let value = value_of(new);
                reg.map.entry(key.clone()).or_insert(Entry {
                    own,
                    value,
                    slot,
                    session: on[0].clone(),
                    touched: Vec::new(),
                    role: Role::Acquiring,
                    create: 0,
                    in_flight: 0,
                    unsettled: 0,
                    stale: Vec::new(),
                    attempts: 0,
                    end_by: None,
                })
            }
        };
        if e.role != Role::Held {
            e.role = Role::Acquiring;
        }
        e.in_flight += 1;
        e.unsettled += 1;
        for s in on {
            if !e.touched.iter().any(|t| t.id == s.id) {
                e.touched.push((*s).clone());
            }
        }
        Begun::Put(e.own.clone(), e.value.clone())
    }

    /// The put of [`begin_put`](Self::begin_put) was answered (`settled`: no try of it can
    /// still land) and, when `held` says so, made the key the lock's holder on that session
    /// with that create revision: both in one step, so that the session never looks idle.
    fn end_put(&self, key: &TokenKey, settled: bool, held: Option<(&Arc<Session>, i64)>) {
        if !settled && held.is_none() {
            return;
        }
        if let Some(e) = lock(&self.entries).map.get_mut(key) {
            if settled {
                e.in_flight = e.in_flight.saturating_sub(1);
                e.unsettled = e.unsettled.saturating_sub(1);
            }
            if let Some((session, create)) = held {
                e.set(session, Role::Held);
                e.create = create;
            }
        }
    }

    fn set(&self, key: &TokenKey, session: &Arc<Session>, role: Role) {
        if let Some(e) = lock(&self.entries).map.get_mut(key) {
            e.set(session, role);
        }
    }

    fn set_held(&self, key: &TokenKey, session: &Arc<Session>, create: i64) {
        if let Some(e) = lock(&self.entries).map.get_mut(key) {
            e.set(session, Role::Held);
            e.create = create;
        }
    }

    /// An attempt of the token is under way: until the guard goes, its key is not deleted as a
    /// waiter past its time ([`doomed`](Self::doomed)). A waiter's key does not change when it
    /// becomes the holder, so a deletion decided while the waiter was late and landing after
    /// its next attempt found the key first would delete a held lock. A token not registered
    /// yet needs none: its key is `Acquiring` until its attempt says where it is, and an
    /// attempt that queues it gives it a whole waiter TTL from then.
    fn attempting<'a>(&'a self, key: &'a TokenKey) -> Attempting<'a> {
        if let Some(e) = lock(&self.entries).map.get_mut(key) {
            e.attempts += 1;
        }
        Attempting {
            sessions: self,
            key,
        }
    }

    /// The session and key of a waiting token.
    fn waiting_on(&self, key: &TokenKey) -> Option<(Arc<Session>, Vec<u8>, Vec<u8>)> {
        lock(&self.entries)
            .map
            .get(key)
            .filter(|e| matches!(e.role, Role::Waiting(_)))
            .map(|e| (e.session.clone(), e.own.clone(), e.value.clone()))
    }

    /// A session this token's puts used, by lease id.
    fn touched(&self, key: &TokenKey, lease: i64) -> Option<Arc<Session>> {
        lock(&self.entries)
            .map
            .get(key)
            .and_then(|e| e.touched.iter().find(|s| s.id == lease).cloned())
    }

    /// The session, key name and create revision of a held token.
    fn held(&self, key: &TokenKey) -> Option<(Arc<Session>, Vec<u8>, i64)> {
        lock(&self.entries)
            .map
            .get(key)
            .filter(|e| e.role == Role::Held)
            .map(|e| (e.session.clone(), e.own.clone(), e.create))
    }

    /// An `expire` of the held token's key to `until` is on its way: if it never lands, a
    /// pruning after `until` deletes the key ([`Entry::end_by`]).
    fn ends_by(&self, key: &TokenKey, until: Instant) {
        if let Some(e) = lock(&self.entries).map.get_mut(key) {
            if e.role == Role::Held {
                e.end_by = Some(e.end_by.map_or(until, |u| u.min(until)));
            }
        }
    }

    /// The held token's key is on a lease of its own now, ending at `until`.
    fn ending(&self, key: &TokenKey, until: Instant) {
        if let Some(e) = lock(&self.entries).map.get_mut(key) {
            if e.role == Role::Held {
                e.role = Role::Ending(until);
            }
        }
    }

    /// Whether `kv` is a key an earlier registration of the token put at its name: its value
    /// names the token, and is not the current registration's. Nothing wants it (a token's
    /// registrations come one after another): a put of one that landed late
    /// ([`Entry::stale`]), or a key whose delete failed before the token asked again.
    fn is_stale(&self, key: &TokenKey, kv: &KeyValue) -> bool {
        lock(&self.entries).map.get(key).is_some_and(|e| {
            kv.key() == e.own
                && kv.value() != e.value.as_slice()
                && super::noted(kv.value()).1 == Some(key.1.as_str())
        })
    }

    /// The name of a registered token's key.
    pub(super) fn name_of(&self, key: &TokenKey) -> Option<Vec<u8>> {
        lock(&self.entries).map.get(key).map(|e| e.own.clone())
    }

    fn is_registered(&self, key: &TokenKey) -> bool {
        lock(&self.entries).map.contains_key(key)
    }

    /// Marks the token's key as being released and returns the transaction that deletes it
    /// if its value is still its token's (the name may be a later token's by the time a try
    /// of it lands: one answered through a hedge, or timed out, may land after
    /// [`forget`](Self::forget) freed the name); `forget` or [`unwanted`](Self::unwanted) ends
    /// that. A token with a put in flight becomes a suspect: the sessions it used are retired.
    fn leave(&self, key: &TokenKey) -> Option<Txn> {
        let mut reg = lock(&self.entries);
        let e = reg.map.get_mut(key)?;
        e.role = Role::Releasing;
        if e.in_flight > 0 {
            let mut current = lock(&self.current);
            for s in &e.touched {
                s.retired.store(true, Ordering::Release);
                if current.get(&s.secs).is_some_and(|c| c.id == s.id) {
                    current.remove(&s.secs);
                }
            }
        }
        Some(delete_if_valued(&e.own, &e.value))
    }

    /// The token's key is deleted (or was never put): forgets it unless a put of it may still
    /// land (then it is unwanted: deleted again before keepalives, and its name kept). A try
    /// of the delete still out does not keep it ([`leave`](Self::leave)). Returns the sessions
    /// to look at for revocation: those it used that are retired (usually none; one retired
    /// later expires on its own).
    fn forget(&self, key: &TokenKey) -> Vec<Arc<Session>> {
        let mut reg = lock(&self.entries);
        let Some(e) = reg.map.get_mut(key) else {
            return Vec::new();
        };
        let touched: Vec<Arc<Session>> = e
            .touched
            .iter()
            .filter(|s| s.retired.load(Ordering::Acquire))
            .cloned()
            .collect();
        if matches!(e.role, Role::Releasing | Role::Unwanted) {
            e.role = Role::Unwanted;
            if e.done() {
                reg.remove(key);
            }
        }
        touched
    }

    /// The release of the token's key failed: it goes before the next keepalive of its
    /// session.
    fn unwanted(&self, key: &TokenKey) {
        if let Some(e) = lock(&self.entries).map.get_mut(key) {
            if e.role == Role::Releasing {
                e.role = Role::Unwanted;
            }
        }
    }

    /// Retired sessions of `candidates` that no wanted key is on any more.
    fn idle_retired(&self, candidates: &[Arc<Session>]) -> Vec<Arc<Session>> {
        let reg = lock(&self.entries);
        candidates
            .iter()
            .filter(|s| {
                s.retired.load(Ordering::Acquire)
                    && !s.revoking.load(Ordering::Acquire)
                    && !s.gone.load(Ordering::Acquire)
            })
            .filter(|s| !reg.map.values().any(|e| e.wanted_on(s.id)))
            .cloned()
            .collect()
    }

    /// Retired sessions of `candidates` that no wanted key is on any more, to be revoked:
    /// marked dead at once (nothing goes on them, renews them or revokes them again), while
    /// the suspects that may land on them keep their names until [`gone`](Self::gone) says
    /// etcd answered the revocation — a revocation that fails leaves the lease alive for up
    /// to its class, and a suspect's put landing on it then would move the key of the name's
    /// next token onto that dying lease.
    fn revoking(&self, candidates: &[Arc<Session>]) -> Vec<Arc<Session>> {
        let idle = self.idle_retired(candidates);
        for s in &idle {
            s.revoking.store(true, Ordering::Release);
            self.dying(s);
        }
        idle
    }

    /// When a sweep is due (at most once per `every`): the sessions an unwanted key may be on,
    /// for [`EtcdBackend::revoke_idle`] to revoke those retired ones no wanted key is on. A
    /// retired session is revoked when a key that leaves names it; one whose last wanted key
    /// left another way — a release whose delete failed, a waiter pruned as past its time, a
    /// key moved off the waiters' session to the holders' — or whose revocation failed every
    /// try was left alone for good, and with it the suspects that may land on it: kept in the
    /// registry, their names taken, for the life of the process.
    fn stranded(&self, every: Duration) -> Vec<Arc<Session>> {
        let now = Instant::now();
        {
            let mut next = lock(&self.next_sweep);
            if next.is_some_and(|at| now < at) {
                return Vec::new();
            }
            *next = Some(now + every);
        }
        let reg = lock(&self.entries);
        let mut out: Vec<Arc<Session>> = Vec::new();
        for e in reg.map.values().filter(|e| e.role == Role::Unwanted) {
            for t in &e.touched {
                if !out.iter().any(|o| o.id == t.id) {
                    out.push(t.clone());
                }
            }
        }
        out
    }

    /// The session is not to be used or kept alive any more.
    fn dying(&self, s: &Session) {
        s.dead.store(true, Ordering::Release);
        let mut current = lock(&self.current);
        if current.get(&s.secs).is_some_and(|c| c.id == s.id) {
            current.remove(&s.secs);
        }
    }

    /// The session's lease is gone (expired, or revoked as etcd answered): suspects of it
    /// alone are forgotten.
    fn gone(&self, s: &Session) {
        s.gone.store(true, Ordering::Release);
        self.dying(s);
        let mut reg = lock(&self.entries);
        let mut gone = Vec::new();
        for (k, e) in &mut reg.map {
            if e.role == Role::Unwanted {
                e.touched.retain(|t| t.id != s.id);
                // Forgotten only when no session its key may be on is left: an unwanted key
                // with nothing in flight may still be on another of them (a release whose
                // delete failed or was cut off, its key moved from the waiters' session to
                // the holders'), and its name, freed, would be given to the next token, whose
                // attempt finds the key there and takes it — with its create revision, a
                // fencing token issued twice (the fault harness, etcd, seed 459411213). A
                // pruning deletes such a key (by its value) and forgets it then.
                if e.touched.is_empty() {
                    gone.push(k.clone());
                }
            }
        }
        for k in &gone {
            reg.remove(k);
        }
    }

    /// The keys to delete before a keepalive of `s`, each with the transaction that deletes it
    /// if its value is still its token's: unwanted keys a put may have put on it (by each value
    /// a put of it may have written, [`Entry::stale`]), and its waiters past their time with
    /// no attempt under way ([`attempting`](Self::attempting)).
    /// Such a waiter's registration ends here, before its delete is sent: its next attempt
    /// queues it again, with a value the delete does not match.
    fn doomed(&self, s: &Session, now: Instant) -> Vec<(TokenKey, Txn)> {
        let mut reg = lock(&self.entries);
        for e in reg.map.values_mut() {
            if let Role::Waiting(until) = e.role {
                if until <= now && e.attempts == 0 && e.session.id == s.id {
                    e.role = Role::Unwanted;
                }
            }
        }
        let mut doomed = Vec::new();
        for (k, e) in &reg.map {
            let delete = match e.role {
                Role::Unwanted if e.touched.iter().any(|t| t.id == s.id) => {
                    // Its earlier values too, one after another in one transaction (a
                    // transaction's compares all hold or not: one per value, each the next's
                    // `else`).
                    e.stale
                        .iter()
                        .fold(delete_if_valued(&e.own, &e.value), |then, v| {
                            delete_if_valued(&e.own, v).or_else([TxnOp::txn(then)])
                        })
                }
                // Its own lease ends it; deleted here (on whichever session's pruning comes
                // first) so that its name can be used again.
                Role::Ending(until) if until <= now => delete_if_valued(&e.own, &e.value),
                // Released within a minimum hold whose move never landed: the same.
                Role::Held if e.end_by.is_some_and(|until| until <= now) => {
                    delete_if_valued(&e.own, &e.value)
                }
                _ => continue,
            };
            doomed.push((k.clone(), delete));
        }
        doomed
    }

    /// `doomed` keys were deleted: keys past their end become unwanted, and unwanted keys whose
    /// names nothing can reach any more are forgotten.
    fn pruned(&self, doomed: Vec<(TokenKey, Txn)>, now: Instant) {
        let mut reg = lock(&self.entries);
        for (k, _) in doomed {
            let Some(e) = reg.map.get_mut(&k) else {
                continue;
            };
            let ended = match e.role {
                Role::Ending(until) => until <= now,
                Role::Held => e.end_by.is_some_and(|until| until <= now),
                _ => false,
            };
            if ended {
                e.role = Role::Unwanted;
            }
            if e.done() {
                reg.remove(&k);
            }
        }
    }
}

/// An attempt under way ([`Sessions::attempting`]).
struct Attempting<'a> {
    sessions: &'a Sessions,
    key: &'a TokenKey,
}

impl Drop for Attempting<'_> {
    fn drop(&mut self) {
        // A token's attempts come one at a time: an entry registered during this one (none
        // was counted) has none counted.
        if let Some(e) = lock(&self.sessions.entries).map.get_mut(self.key) {
            e.attempts = e.attempts.saturating_sub(1);
        }
    }
}

/// A release under way ([`EtcdBackend::release_registered`]): dropped before its answer, it
/// leaves the key to the next pruning ([`Sessions::unwanted`]).
struct Leaving<'a> {
    sessions: &'a Sessions,
    key: &'a TokenKey,
}

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        self.sessions.unwanted(self.key);
    }
}

/// Whether `kv` is the token's key: at its name `own`, with the value its puts write (a key at
/// the name that another locker's or another registration's request left is not).
fn is_own(kv: &KeyValue, own: &[u8], value: &[u8]) -> bool {
    kv.key() == own && kv.value() == value
}

/// A transaction that deletes the key `own` if its value is still `value` (the token's: the
/// name may be a later token's by the time it lands).
fn delete_if_valued(own: &[u8], value: &[u8]) -> Txn {
    Txn::new()
        .when([Compare::value(own, CompareOp::Equal, value)])
        .and_then([TxnOp::delete(own, None)])
}

impl EtcdBackend {
    /// The usable session of `secs`, alive for at least `need` from now.
    async fn session(&self, secs: i64, need: Duration) -> Result<Arc<Session>, LockError> {
        self.revoke_idle(&self.sessions.stranded(SWEEP_EVERY));
        let cur = lock(&self.sessions.current).get(&secs).cloned();
        if let Some(s) = cur.filter(|s| s.usable()) {
            if self.keep_fresh(&s, need).await? && s.usable() {
                return Ok(s);
            }
        }
        let _granting = self.sessions.granting.lock().await;
        let cur = lock(&self.sessions.current).get(&secs).cloned();
        if let Some(s) = cur.filter(|s| s.usable() && s.covers(need)) {
            return Ok(s);
        }
        let sent = Instant::now();
        let id = self.grant(Duration::from_secs(secs.unsigned_abs())).await?;
        let s = Arc::new(Session {
            id,
            secs,
            fresh_from: Mutex::new(sent),
            stream: tokio::sync::Mutex::new(None),
            retired: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            revoking: AtomicBool::new(false),
            gone: AtomicBool::new(false),
        });
        lock(&self.sessions.current).insert(secs, s.clone());
        Ok(s)
    }

    /// Makes sure etcd keeps `s` for at least `need` from now: nothing when the last keepalive
    /// says so already, else a keepalive. `Ok(false)`: the lease is gone.
    async fn keep_fresh(&self, s: &Arc<Session>, need: Duration) -> Result<bool, LockError> {
        if s.dead.load(Ordering::Acquire) {
            return Ok(false);
        }
        if s.covers(need) {
            return Ok(true);
        }
        let mut stream = s.stream.lock().await;
        // Another caller's keepalive may have landed while this one waited for the stream.
        if s.covers(need) {
            return Ok(true);
        }
        self.prune(s).await?;
        let timeout = self.opts.command_timeout;
        let sent = Instant::now();
        let mut ttl = None;
        // The stream is out of the session while this keepalive's answer is awaited, and goes
        // back only once that answer is read: if this future is dropped before (a deadline, a
        // `select!`), the stream is dropped with it. Left in place, it would hold an answer
        // nobody read, which the next keepalive would take for its own — an answer to an
        // earlier keepalive, counted from the later one's send time, and so on for every
        // keepalive after it: one that never reached etcd (its member frozen) would look
        // answered, and the session fresher than etcd's lease.
        if let Some((mut keeper, mut st)) = stream.take() {
            let once = async {
                keeper.keep_alive().await?;
                st.message().await
            };
            if let Ok(Ok(Some(resp))) = tokio::time::timeout(per_try(timeout), once).await {
                ttl = Some(resp.ttl());
                *stream = Some((keeper, st));
            }
        }
        let ttl = match ttl {
            Some(t) => t,
            None => {
                // No stream (none yet, it failed, or a keepalive dropped half-way took it):
                // open one (hedged over the members); opening sends the first keepalive and
                // waits for its answer.
                let id = s.id;
                let left = timeout
                    .saturating_sub(sent.elapsed())
                    .max(Duration::from_millis(50));
                let opened = call(&self.pool, left, "lease keep-alive", |c| {
                    let mut lease = c.lease_client();
                    async move {
                        match lease.keep_alive(id).await {
                            Ok(pair) => Ok(Some(pair)),
                            // etcd answered TTL 0: no such lease.
                            Err(etcd_client::Error::LeaseKeepAliveError(_)) => Ok(None),
                            Err(e) => Err(e),
                        }
                    }
                })
                .await?;
                match opened {
                    Some(pair) => {
                        *stream = Some(pair);
                        1
                    }
                    None => 0,
                }
            }
        };
        if ttl <= 0 {
            *stream = None;
            drop(stream);
            self.sessions.gone(s);
            return Ok(false);
        }
        let mut from = lock(&s.fresh_from);
        *from = (*from).max(sent);
        Ok(true)
    }

    /// Deletes the keys that must not be kept alive with `s` (see the module docs).
    async fn prune(&self, s: &Session) -> Result<(), LockError> {
        let now = Instant::now();
        let doomed = self.sessions.doomed(s, now);
        if doomed.is_empty() {
            return Ok(());
        }
        for chunk in doomed.chunks(OPS_PER_TXN) {
            let deletes: Vec<TxnOp> = chunk
                .iter()
                .map(|(_, delete)| TxnOp::txn(delete.clone()))
                .collect();
            self.txn(Txn::new().and_then(deletes)).await?;
        }
        self.sessions.pruned(doomed, now);
        Ok(())
    }

    /// Revokes retired sessions of `candidates` that nothing wanted is on any more, in the
    /// background (a lease no one keeps alive runs out anyway; this is sooner). The suspects
    /// on such a session keep their names until etcd answers the revocation
    /// ([`Sessions::revoking`]); one that failed is tried again after the session's class
    /// (by then the lease has run out, unless a leader change renewed it: etcd answers "not
    /// found", which is as good), up to [`REVOKE_TRIES`] times — after that, until a later
    /// sweep ([`Sessions::stranded`]) takes the session up again.
    fn revoke_idle(&self, candidates: &[Arc<Session>]) {
        let idle = self.sessions.revoking(candidates);
        if idle.is_empty() {
            return;
        }
        // Run to the end even if this runtime shuts down first (it moves to the fallback
        // thread): cut off, the suspects on these sessions would keep their names until a
        // sweep.
        let this = self.clone();
        crate::util::spawn_to_the_end(Arc::new(move || {
            let (this, idle) = (this.clone(), idle.clone());
            Box::pin(async move { this.revoke_sessions(&idle).await })
        }));
    }

    /// The work of [`revoke_idle`](Self::revoke_idle): revokes each session, trying again
    /// after its class when that fails.
    async fn revoke_sessions(&self, idle: &[Arc<Session>]) {
        let each = idle.iter().map(|s| async move {
            for tried in 1..=REVOKE_TRIES {
                match self.revoke(vec![s.id]).await {
                    Ok(()) => {
                        self.sessions.gone(s);
                        break;
                    }
                    Err(e) if tried == REVOKE_TRIES => {
                        tracing::debug!(
                            error = %e,
                            "etcd: revoking an unused session failed; a later sweep tries again"
                        );
                    }
                    Err(_) => {
                        tokio::time::sleep(Duration::from_secs(s.secs.unsigned_abs())).await;
                    }
                }
            }
            // A later sweep takes it up again unless it is gone ([`Sessions::stranded`]).
            s.revoking.store(false, Ordering::Release);
        });
        futures_util::future::join_all(each).await;
    }

    /// An acquire attempt of a lock the watchdog renews (`args.renew`), on session leases.
    pub(super) async fn acquire_renewed(
        &self,
        args: &AcquireArgs<'_>,
    ) -> Result<Attempt, LockError> {
        let key: TokenKey = (args.resource.shared(), args.token.clone());
        // Its key, if queued already, is not deleted as late while this attempt is under way.
        let _attempt = self.sessions.attempting(&key);
        let mut k = self.lock_dir(args.resource);
        let queue = args.mode == WaitMode::Queue;
        let kind = args.resource.kind();
        // A try of a permit or hold that finds the name in use puts its key anyway and reads
        // the line after it (module `kinds`).
        let try_kind = !queue && kind != LockKind::Exclusive;
        if queue {
            if let Some((w, own, value)) = self.sessions.waiting_on(&key) {
                // Already queued: keep the place alive and look at the head (no write).
                k.own = own;
                let until = Instant::now() + args.waiter_ttl;
                self.sessions.set(&key, &w, Role::Waiting(until));
                if self.keep_fresh(&w, args.waiter_ttl).await? {
                    let txn = Txn::new().and_then([
                        TxnOp::get(k.dir.clone(), Some(line_options(kind, &k.end))),
                        TxnOp::get(k.own.clone(), None),
                    ]);
                    let ops = self.txn(txn).await?.op_responses();
                    if create_revision_at(&ops, 1) > 0 {
                        return self.queued(args, &key, &k, &ops, (&w, &value)).await;
                    }
                }
                // The key is gone (deleted, or its lease ran out): queue again, at the back.
            }
        }
        let mut classes = vec![(session_secs(args.ttl), args.ttl)];
        if queue && session_secs(args.waiter_ttl) != classes[0].0 {
            classes.push((session_secs(args.waiter_ttl), args.waiter_ttl));
        }
        let new = NewKey {
            dir: &k.dir,
            kind,
            value: super::noted_value(args.ttl, args.token),
        };
        let (picked, own, value) = self
            .begin_put_on(&key, Some(&new), &classes)
            .await?
            .ok_or_else(|| LockError::unavailable("etcd: a new key was not registered", None))?;
        let hold = picked[0].clone();
        let wait = picked.last().unwrap_or(&hold).clone();
        k.own = own;
        let put_on = |lease: i64| {
            TxnOp::put(
                k.own.clone(),
                value.as_slice(),
                Some(PutOptions::new().with_lease(lease)),
            )
        };
        let build = || {
            let head = TxnOp::get(k.dir.clone(), Some(line_options(kind, &k.end)));
            let otherwise = if try_kind {
                // Where no key has its name, or where its own key is (moved to `hold`, its
                // place kept) — never over a key an earlier registration of the token put: a
                // try of that one landing after the token asked again and was admitted would
                // move the holder's key onto that try's session, which nothing keeps alive.
                let mine = Txn::new()
                    .when([Compare::create_revision(k.own.clone(), CompareOp::Equal, 0)])
                    .and_then([put_on(hold.id)])
                    .or_else([TxnOp::txn(
                        Txn::new()
                            .when([Compare::value(
                                k.own.clone(),
                                CompareOp::Equal,
                                value.as_slice(),
                            )])
                            .and_then([put_on(hold.id)]),
                    )]);
                vec![TxnOp::txn(mine), head, TxnOp::get(k.own.clone(), None)]
            } else if queue {
                // Join the queue on the waiters' session, unless already in it (a put would
                // then move the key to another lease; the create revision, the place, stays).
                let join = Txn::new()
                    .when([Compare::create_revision(k.own.clone(), CompareOp::Equal, 0)])
                    .and_then([put_on(wait.id)]);
                vec![TxnOp::txn(join), head, TxnOp::get(k.own.clone(), None)]
            } else {
                vec![head]
            };
            Txn::new()
                .when(
                    [Compare::create_revision(k.dir.clone(), CompareOp::Equal, 0)
                        .with_range(k.end.clone())],
                )
                .and_then([put_on(hold.id)])
                .or_else(otherwise)
        };
        let (resp, settled) = self.txn_tracked(build).await;
        let won = match &resp {
            Ok(r) if r.succeeded() => Some(i64::try_from(super::written_revision(r)).unwrap_or(0)),
            _ => None,
        };
        self.sessions
            .end_put(&key, settled, won.map(|rev| (&hold, rev)));
        let resp = resp?;
        let ops = resp.op_responses();
        if let Some(rev) = won {
            return Ok(Attempt::Acquired {
                fencing_token: rev.unsigned_abs(),
            });
        }
        if queue {
            return self
                .queued(args, &key, &k, &ops[1..], (&wait, &value))
                .await;
        }
        if try_kind {
            let line = kvs_at(&ops, 1);
            if let Some(own) = kvs_at(&ops, 2).first() {
                if !is_own(own, &k.own, &value) {
                    // Not put: a key an earlier registration of the token put is there.
                    self.delete_stale(&key, own).await;
                } else if admitted(kind, k.dir.len(), line, &k.own) {
                    return self
                        .take_head(args, &key, own.create_revision(), own.lease())
                        .await;
                }
            }
            // Not admitted: the key goes again (a suspect if a put of it may still land).
            if let Some(released) = self.release_registered(&key).await {
                released?;
            }
            return Ok(Attempt::Held {
                remaining: self.remaining(line.first()).await?,
            });
        }
        let head = ops.first().and_then(first_kv);
        if let Some(h) = head.filter(|h| is_own(h, &k.own, &value)) {
            // This token holds the lock already (asking again): restart its lease.
            return self
                .take_head(args, &key, h.create_revision(), h.lease())
                .await;
        }
        let stale = match head {
            Some(h) => self.delete_stale(&key, h).await,
            None => false,
        };
        // A try that lost leaves nothing behind (and if a put of it may still land, it is a
        // suspect from now on).
        self.drop_unput(&key);
        Ok(Attempt::Held {
            remaining: if stale {
                None
            } else {
                self.remaining(head).await?
            },
        })
    }

    /// The rest of a queued attempt, from `ops` = [head, own key] reads; `(wait, value)`: the
    /// waiters' session and the value the token's puts write.
    async fn queued(
        &self,
        args: &AcquireArgs<'_>,
        key: &TokenKey,
        k: &Keys,
        ops: &[etcd_client::TxnOpResponse],
        (wait, value): (&Arc<Session>, &[u8]),
    ) -> Result<Attempt, LockError> {
        let line = kvs_at(ops, 0);
        let head = line.first();
        let own = ops.get(1).and_then(first_kv);
        let Some(own) = own else {
            return Ok(Attempt::Held { remaining: None });
        };
        if !is_own(own, &k.own, value) {
            // A key at the token's name that its puts did not write (the join puts only where
            // no key is): not its place in the line. The registration goes, so a later attempt
            // queues afresh and its waiter, with no key in the line, is woken by the next
            // delete rather than by this key's turn. A key an earlier registration of the
            // token put there is deleted (that delete wakes it); any other is left alone.
            if !self.delete_stale(key, own).await {
                tracing::warn!(
                    backend = "etcd",
                    "a key at a waiter's name was not written by it; it is left alone"
                );
            }
            self.drop_unput(key);
            return Ok(Attempt::Held {
                remaining: self.remaining(head).await?,
            });
        }
        if admitted(args.resource.kind(), k.dir.len(), line, &k.own) {
            return self
                .take_head(args, key, own.create_revision(), own.lease())
                .await;
        }
        let on = self
            .sessions
            .touched(key, own.lease())
            .unwrap_or_else(|| wait.clone());
        let until = Instant::now() + args.waiter_ttl;
        self.sessions.set(key, &on, Role::Waiting(until));
        Ok(Attempt::Held {
            remaining: self.remaining(head).await?,
        })
    }

    /// The token's key is first: the lock is its own. Its key moves to the lock's session
    /// unless it is there already (a waiter of the same class: no write at all).
    async fn take_head(
        &self,
        args: &AcquireArgs<'_>,
        key: &TokenKey,
        create: i64,
        lease: i64,
    ) -> Result<Attempt, LockError> {
        let hold = self.session(session_secs(args.ttl), args.ttl).await?;
        if lease == hold.id {
            self.sessions.set_held(key, &hold, create);
        } else if !self.move_held(key, create, args.ttl).await? {
            return Ok(Attempt::Held { remaining: None });
        }
        Ok(Attempt::Acquired {
            fencing_token: create.unsigned_abs(),
        })
    }

    /// Picks the usable session of each class of `classes` (`(secs, need)`) and registers a put
    /// of the token's key on them. A session another task's release retires (and may revoke
    /// once nothing it knows of is on it) between being picked and the put being registered
    /// is not used: the revocation would delete the key just put (see `Sessions::begin_put`).
    /// `Ok(None)`: the token is not registered and `new` is `None`.
    async fn begin_put_on(
        &self,
        key: &TokenKey,
        new: Option<&NewKey<'_>>,
        classes: &[(i64, Duration)],
    ) -> Result<Option<(Vec<Arc<Session>>, Vec<u8>, Vec<u8>)>, LockError> {
        for _ in 0..16 {
            let mut picked = Vec::with_capacity(classes.len());
            for &(secs, need) in classes {
                picked.push(self.session(secs, need).await?);
            }
            let on: Vec<&Arc<Session>> = picked.iter().collect();
            match self.sessions.begin_put(key, new, &on) {
                Begun::Put(own, value) => return Ok(Some((picked, own, value))),
                Begun::Unknown => return Ok(None),
                Begun::Stale => {}
            }
        }
        Err(LockError::unavailable(
            "etcd: every session picked was retired before it could be used",
            None,
        ))
    }

    /// Moves the registered token's key (of `create` revision) onto the session of `ttl`'s
    /// class, registered there as a put before it is sent, and marks it held there.
    /// `Ok(false)`: the key is gone (or the token no longer registered).
    async fn move_held(
        &self,
        key: &TokenKey,
        create: i64,
        ttl: Duration,
    ) -> Result<bool, LockError> {
        let Some((mut to, own, _)) = self
            .begin_put_on(key, None, &[(session_secs(ttl), ttl)])
            .await?
        else {
            return Ok(false);
        };
        let to = to.remove(0);
        let (resp, settled) = self
            .txn_tracked(|| super::relet_txn(&own, create, to.id))
            .await;
        let moved = resp.map(|r| r.succeeded());
        // Held on `to` as the put is settled: no instant in which `to` looks idle.
        let held = matches!(moved, Ok(true)).then_some((&to, create));
        self.sessions.end_put(key, settled, held);
        moved
    }

    /// Deletes `kv` (if its value is still the one read) when an earlier registration of the
    /// token put it ([`is_stale`](Sessions::is_stale)): a key nobody wants, at the token's
    /// name. Whether it was one; a delete that fails is left to the prunings (which know the
    /// values of late puts) or the next attempt.
    async fn delete_stale(&self, key: &TokenKey, kv: &KeyValue) -> bool {
        if !self.sessions.is_stale(key, kv) {
            return false;
        }
        if let Err(e) = self.txn(delete_if_valued(kv.key(), kv.value())).await {
            tracing::debug!(backend = "etcd", error = %e, "deleting an earlier key of a waiter failed");
        }
        true
    }

    /// Ends the registration of a token none of whose keys is in place (a try that lost, a
    /// name another key holds): no delete is sent, as there is nothing of it to delete (and
    /// if a put of it may still land, it is a suspect from now on).
    fn drop_unput(&self, key: &TokenKey) {
        if self.sessions.leave(key).is_some() {
            let touched = self.sessions.forget(key);
            self.revoke_idle(&touched);
        }
    }

    /// Release or abandon of a registered token: `None` when the token is not registered
    /// (not on a session).
    pub(super) async fn release_registered(
        &self,
        key: &TokenKey,
    ) -> Option<Result<bool, LockError>> {
        let delete = self.sessions.leave(key)?;
        // Cut off before the answer (a caller's deadline, a runtime shutting down): the key
        // is left unwanted, as after a failed delete. A `Releasing` key is spared by prunings
        // and keeps its session from being revoked; left so, it would stay for the life of the
        // process on a session that other locks of its class keep alive.
        let cut_off = Leaving {
            sessions: &self.sessions,
            key,
        };
        // The delete compares the value, which names the token: a try of it that lands late
        // (answered through a hedge, or timed out) leaves the name's next key alone, so the
        // name is free once this is answered (`Sessions::begin_put`).
        let deleted = self.txn(delete).await;
        std::mem::forget(cut_off);
        // Deleted or not, the key is unwanted now: if the delete failed, it goes before the
        // next keepalive of its session.
        let touched = match &deleted {
            Ok(_) => self.sessions.forget(key),
            Err(_) => {
                self.sessions.unwanted(key);
                Vec::new()
            }
        };
        self.revoke_idle(&touched);
        // The compare fails when the key is gone (or not this token's): not the owner.
        Some(deleted.map(|r| r.succeeded()))
    }

    /// `expire` of a held registered token: its key moves to a lease of its own of `left`,
    /// which nothing renews — on its session, every other key of the class would keep it alive
    /// (a renewal of any of them is a keepalive of the session), and a lock released within
    /// its minimum hold would stay held for as long as this locker renews another lock of that
    /// class. `None` when the token is not held on a session.
    pub(super) async fn expire_registered(
        &self,
        key: &TokenKey,
        left: Duration,
    ) -> Option<Result<bool, LockError>> {
        let (cur, own, create) = self.sessions.held(key)?;
        let until = Instant::now() + left;
        // Before anything is sent: if no try of the move lands, the key still goes after
        // `until` — and a command timeout more, so that a move still on its way at `until`
        // (a grant and a move, two Raft writes, against a hold's rest of a few milliseconds)
        // does not find the key pruned, and the release reported lost.
        self.sessions
            .ends_by(key, until + self.opts.command_timeout);
        Some(
            async {
                let lease = self.grant(left).await?;
                // A try of it landing late moves the key to the same lease: as good.
                if !self.relet_on(&own, create, lease).await? {
                    // Gone (its session lapsed): not the owner. Its entry goes as a release's
                    // does (its delete compares the value: harmless), or it would keep its name
                    // and its session for good.
                    let _ = self.release_registered(key).await;
                    return Ok(false);
                }
                self.sessions.ending(key, until);
                self.revoke_idle(&[cur]);
                Ok(true)
            }
            .await,
        )
    }

    /// `extend` of a held registered token: `None` when the token is not held on a session.
    pub(super) async fn extend_registered(
        &self,
        key: &TokenKey,
        ttl: Duration,
    ) -> Option<Result<bool, LockError>> {
        let (cur, own, create) = self.sessions.held(key)?;
        Some(
            async {
                let secs = session_secs(ttl);
                if cur.secs == secs && !cur.dead.load(Ordering::Acquire) {
                    if !self.keep_fresh(&cur, ttl).await? {
                        return Ok(false);
                    }
                    return Ok(self.still_on(&[own], cur.id).await?[0]);
                }
                // Another class: move the key to that class's session.
                if !self.move_held(key, create, ttl).await? {
                    return Ok(false);
                }
                self.revoke_idle(&[cur]);
                Ok(true)
            }
            .await,
        )
    }

    /// The watchdog's batch: per session, one keepalive when needed and one read of the keys.
    /// Answers per item `None` for items not held on a session of their TTL's class (renewed
    /// the other way).
    pub(super) async fn extend_many_registered(
        &self,
        items: &[(TokenKey, Duration)],
    ) -> Vec<Option<Result<bool, LockError>>> {
        let mut out: Vec<Option<Result<bool, LockError>>> = items.iter().map(|_| None).collect();
        // Per session: the session, the longest TTL asked for, and (item index, key).
        type Group = (Arc<Session>, Duration, Vec<(usize, Vec<u8>)>);
        let mut groups: HashMap<i64, Group> = HashMap::new();
        for (i, (key, ttl)) in items.iter().enumerate() {
            if let Some((s, own, _)) = self.sessions.held(key) {
                if s.secs == session_secs(*ttl) {
                    let g = groups
                        .entry(s.id)
                        .or_insert_with(|| (s.clone(), Duration::ZERO, Vec::new()));
                    g.1 = g.1.max(*ttl);
                    g.2.push((i, own));
                }
            }
        }
        let runs = groups.into_values().map(|(s, need, members)| async move {
            let owns: Vec<Vec<u8>> = members.iter().map(|(_, o)| o.clone()).collect();
            let (alive, present) =
                futures_util::future::join(self.keep_fresh(&s, need), self.still_on(&owns, s.id))
                    .await;
            let answers: Vec<Result<bool, LockError>> = match (alive, present) {
                (Ok(false), _) => members.iter().map(|_| Ok(false)).collect(),
                (Ok(true), Ok(p)) => p.into_iter().map(Ok).collect(),
                (Err(e), _) | (_, Err(e)) => {
                    let msg = e.to_string();
                    members
                        .iter()
                        .map(|_| Err(LockError::unavailable(msg.clone(), None)))
                        .collect()
                }
            };
            members
                .into_iter()
                .map(|(i, _)| i)
                .zip(answers)
                .collect::<Vec<_>>()
        });
        for (i, answer) in futures_util::future::join_all(runs)
            .await
            .into_iter()
            .flatten()
        {
            out[i] = Some(answer);
        }
        out
    }

    /// Whether each key exists and is on `lease` (one read per chunk, no write).
    async fn still_on(&self, owns: &[Vec<u8>], lease: i64) -> Result<Vec<bool>, LockError> {
        let mut out = Vec::with_capacity(owns.len());
        for chunk in owns.chunks(OPS_PER_TXN) {
            let reads: Vec<TxnOp> = chunk
                .iter()
                .map(|own| TxnOp::get(own.clone(), Some(GetOptions::new().with_keys_only())))
                .collect();
            let ops = self.txn(Txn::new().and_then(reads)).await?.op_responses();
            out.extend(
                (0..chunk.len())
                    .map(|i| ops.get(i).and_then(first_kv).map(KeyValue::lease) == Some(lease)),
            );
        }
        Ok(out)
    }

    /// Whether the token has a key on a session (renewed the session way).
    pub(super) fn registered(&self, key: &TokenKey) -> bool {
        self.sessions.is_registered(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(id: i64) -> Arc<Session> {
        Arc::new(Session {
            id,
            secs: 6,
            fresh_from: Mutex::new(Instant::now()),
            stream: tokio::sync::Mutex::new(None),
            retired: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            revoking: AtomicBool::new(false),
            gone: AtomicBool::new(false),
        })
    }

    /// Registers a put of `key`'s key (of lock `r`) on `on`, which must be usable.
    fn put(reg: &Sessions, key: &TokenKey, on: &[&Arc<Session>]) -> Vec<u8> {
        let new = NewKey {
            dir: b"dlock/r/",
            kind: LockKind::Exclusive,
            value: super::super::noted_value(Duration::from_secs(1), &key.1),
        };
        match reg.begin_put(key, Some(&new), on) {
            Begun::Put(own, _) => own,
            other => panic!("not registered: {other:?}"),
        }
    }

    fn token() -> TokenKey {
        (Arc::from("r"), OwnerToken::generate())
    }

    /// Where an exclusive lock `r`'s new key goes, with the value `1000:t`.
    fn exclusive_key() -> NewKey<'static> {
        NewKey {
            dir: b"dlock/r/",
            kind: LockKind::Exclusive,
            value: "1000:t".to_owned(),
        }
    }

    /// A new token's key, held on `s`.
    fn held_on(reg: &Sessions, s: &Arc<Session>) -> TokenKey {
        let key = token();
        put(reg, &key, &[s]);
        reg.set_held(&key, s, 7);
        reg.end_put(&key, true, None);
        key
    }

    /// A new token's key, queued on `wait` and being moved to `hold` (its move registered, not
    /// answered yet); with the name its first put got.
    fn moving(reg: &Sessions, wait: &Arc<Session>, hold: &Arc<Session>) -> (TokenKey, Vec<u8>) {
        let key = token();
        let name = put(reg, &key, &[wait]);
        reg.end_put(&key, true, None);
        reg.set(
            &key,
            wait,
            Role::Waiting(Instant::now() + Duration::from_secs(5)),
        );
        put(reg, &key, &[hold]);
        (key, name)
    }

    fn idle(reg: &Sessions, s: &Arc<Session>) -> bool {
        s.retired.store(true, Ordering::Release);
        !reg.idle_retired(std::slice::from_ref(s)).is_empty()
    }

    /// A waiter admitted to the lock moves its key from the waiters' session to the holders'
    /// one. Another task's suspect may retire the holders' session meanwhile, and its release
    /// revokes a retired session nothing wanted is on: the move, registered before it is sent,
    /// keeps the session (else the revocation deletes the lock just taken: a `Lost` release).
    #[test]
    fn a_session_a_waiter_moves_its_key_to_is_wanted_from_before_the_move() {
        let reg = Sessions::default();
        let (wait, hold) = (session(1), session(2));
        let (key, _) = moving(&reg, &wait, &hold);
        assert!(!idle(&reg, &hold), "the move may have landed on it");
        reg.set_held(&key, &hold, 7);
        reg.end_put(&key, true, None);
        assert!(!idle(&reg, &hold), "held on it");
        assert!(
            idle(&reg, &wait),
            "nothing is on the waiters' session any more"
        );
        reg.leave(&key);
        reg.forget(&key);
        assert!(idle(&reg, &hold), "released: nothing is on it");
    }

    /// A release marks its key and then deletes it. A keepalive's pruning in between must not
    /// delete it first (the release would then be answered "not the owner": a `Lost` error
    /// for a lock that was held), nor a revocation of its session; a release that failed
    /// leaves the key to the next keepalive.
    #[test]
    fn a_key_being_released_is_deleted_by_its_release_alone() {
        let reg = Sessions::default();
        let s = session(1);
        let key = held_on(&reg, &s);
        assert!(reg.leave(&key).is_some());
        assert!(
            reg.doomed(&s, Instant::now()).is_empty(),
            "not pruned while its delete is on its way"
        );
        assert!(
            !idle(&reg, &s),
            "not revoked while its delete is on its way"
        );
        reg.unwanted(&key);
        let doomed = reg.doomed(&s, Instant::now());
        assert_eq!(
            doomed.len(),
            1,
            "a failed release leaves it to the next keepalive"
        );
        reg.pruned(doomed, Instant::now());
        assert!(!reg.is_registered(&key));
        assert!(idle(&reg, &s));
    }

    /// A release within a minimum hold (`expire`) marks its key before anything is sent: if
    /// the move to a lease of its own never lands, the key stays (its hold is on) until a
    /// pruning after the hold deletes it; its session is not revoked under it meanwhile.
    #[test]
    fn a_key_whose_expire_never_landed_goes_after_its_hold() {
        let reg = Sessions::default();
        let s = session(1);
        let key = held_on(&reg, &s);
        let now = Instant::now();
        let until = now + Duration::from_secs(1);
        reg.ends_by(&key, until);
        assert!(reg.doomed(&s, now).is_empty(), "deleted within its hold");
        assert!(!idle(&reg, &s), "its session revoked within its hold");
        let doomed = reg.doomed(&s, until);
        assert_eq!(doomed.len(), 1, "kept after its hold");
        reg.pruned(doomed, until);
        assert!(!reg.is_registered(&key));
        assert!(idle(&reg, &s));
    }

    /// A key whose release failed (or was cut off) is unwanted but still there, on the
    /// holders' session; the waiters' session it was first put on then goes (expired or
    /// revoked). Its entry must stay — its name taken — until a pruning deleted the key:
    /// forgotten then, its name went to the next token, whose attempt took the key left
    /// there, and its fencing token, a second time.
    #[test]
    fn an_unwanted_key_keeps_its_name_while_a_session_it_may_be_on_lives() {
        let reg = Sessions::default();
        let (wait, hold) = (session(1), session(2));
        let (key, first) = moving(&reg, &wait, &hold);
        reg.set_held(&key, &hold, 7);
        reg.end_put(&key, true, None);
        assert!(reg.leave(&key).is_some());
        reg.unwanted(&key);
        reg.gone(&wait);
        assert!(
            reg.is_registered(&key),
            "forgotten while its key may be on a live session"
        );
        let next = token();
        assert_ne!(put(&reg, &next, &[&hold]), first, "its name was given away");
        let doomed = reg.doomed(&hold, Instant::now());
        assert_eq!(doomed.len(), 1, "left to the holders' session's pruning");
        reg.pruned(doomed, Instant::now());
        assert!(!reg.is_registered(&key));
    }

    /// A release cut off before its answer leaves its key to the next keepalive, as a failed
    /// one does.
    #[test]
    fn a_release_cut_off_before_its_answer_leaves_its_key_to_the_next_keepalive() {
        let reg = Sessions::default();
        let s = session(1);
        let key = held_on(&reg, &s);
        assert!(reg.leave(&key).is_some());
        drop(Leaving {
            sessions: &reg,
            key: &key,
        });
        let doomed = reg.doomed(&s, Instant::now());
        assert_eq!(doomed.len(), 1, "spared by prunings for good");
        reg.pruned(doomed, Instant::now());
        assert!(!reg.is_registered(&key));
    }

    /// The same for a held key moved to another class's session (an `extend` to another TTL):
    /// while the move is out, both sessions may hold the key.
    #[test]
    fn a_held_key_being_moved_keeps_both_sessions() {
        let reg = Sessions::default();
        let (from, to) = (session(1), session(2));
        let key = token();
        put(&reg, &key, &[&from]);
        reg.set_held(&key, &from, 7);
        reg.end_put(&key, true, None);
        put(&reg, &key, &[&to]);
        assert!(!idle(&reg, &to), "the move may have landed on it");
        from.retired.store(true, Ordering::Release);
        assert!(
            reg.idle_retired(std::slice::from_ref(&from)).is_empty(),
            "still on it until the move lands"
        );
    }

    /// A lock released within its minimum hold is on a lease of its own until the hold ends:
    /// its session is no longer kept for it, but its name stays taken (a later key of the name
    /// would inherit its place at the head of the queue) until a pruning after the hold's end
    /// deleted it.
    #[test]
    fn a_key_ending_on_its_own_lease_keeps_its_name_until_pruned_after_its_end() {
        let reg = Sessions::default();
        let s = session(1);
        let (a, b) = (token(), token());
        let first = put(&reg, &a, &[&s]);
        reg.set_held(&a, &s, 7);
        reg.end_put(&a, true, None);
        let now = Instant::now();
        let until = now + Duration::from_secs(2);
        reg.ending(&a, until);
        assert!(reg.held(&a).is_none(), "not renewed any more");
        assert!(idle(&reg, &s), "its session is not kept for it");
        let s2 = session(2);
        assert_ne!(put(&reg, &b, &[&s2]), first, "the name stays taken");
        reg.end_put(&b, true, None);
        assert!(reg.doomed(&s2, now).is_empty(), "not before the hold ends");
        let doomed = reg.doomed(&s2, until);
        assert_eq!(doomed.len(), 1, "deleted by the first pruning after it");
        reg.pruned(doomed, until);
        assert!(!reg.is_registered(&a), "then forgotten: its name is free");
    }

    /// A token's key is named by the locker and a slot, the lowest its keys of the lock do not
    /// use: a name is reused once its token's entry is gone, never while its token may still
    /// put it (a suspect keeps its slot until its sessions are gone), and each token's value
    /// is its own, so a late delete of the previous token's leaves the new key alone.
    #[test]
    fn names_are_reused_once_free_and_never_while_a_put_may_land() {
        let reg = Sessions::default();
        let s = session(1);
        let release = |key: &TokenKey| {
            reg.leave(key);
            reg.forget(key);
        };
        let (a, b, c, d, e) = (token(), token(), token(), token(), token());
        let first = put(&reg, &a, &[&s]);
        assert!(first.ends_with(b".0"), "{first:?}");
        assert!(first.starts_with(b"dlock/r/"));
        reg.end_put(&a, true, None);
        release(&a);
        assert!(!reg.is_registered(&a));

        let again = put(&reg, &b, &[&s]);
        assert_eq!(again, first, "a free name is reused");
        let beside = put(&reg, &c, &[&s]);
        reg.end_put(&c, true, None);
        assert!(beside.ends_with(b".1"), "a name in use is not shared");

        // `b`'s put may still land: released, it stays a suspect and keeps its name (and its
        // session is retired: new keys go on another).
        release(&b);
        assert!(reg.is_registered(&b));
        let s2 = session(2);
        let next = put(&reg, &d, &[&s2]);
        assert!(next.ends_with(b".2"), "{next:?}");
        // Its session is gone (a put on it fails now): the name is free.
        reg.gone(&s);
        assert!(!reg.is_registered(&b));
        assert_eq!(put(&reg, &e, &[&s2]), first);
    }

    /// A release whose delete was answered through a hedge (a sibling try still out) or timed
    /// out frees its name all the same — the delete compares the token's value, so a late try
    /// of it cannot touch the next token's key — and is not deleted again before every later
    /// keepalive of its session: kept, it was one more delete before each keepalive for as long
    /// as the session lived, for every such release (all of them, in a cluster slower than a
    /// fifth of the command timeout), and its name was never reused.
    #[test]
    fn a_release_whose_delete_may_still_land_frees_its_name() {
        let reg = Sessions::default();
        let s = session(1);
        let held = |key: &TokenKey| {
            let own = put(&reg, key, &[&s]);
            reg.set_held(key, &s, 7);
            reg.end_put(key, true, None);
            own
        };
        let (a, b, c) = (token(), token(), token());
        let first = held(&a);
        assert!(reg.leave(&a).is_some());
        // Its delete was answered, a hedged try of it still out.
        reg.forget(&a);
        assert!(!reg.is_registered(&a), "kept for a delete that compares");
        assert!(
            reg.doomed(&s, Instant::now()).is_empty(),
            "deleted again before a keepalive"
        );
        assert_eq!(held(&b), first, "the name is free");

        // A delete that timed out: the key may still be there, so it goes before the next
        // keepalive, and then the name is free.
        assert!(reg.leave(&b).is_some());
        reg.unwanted(&b);
        let doomed = reg.doomed(&s, Instant::now());
        assert_eq!(doomed.len(), 1);
        reg.pruned(doomed, Instant::now());
        assert!(!reg.is_registered(&b));
        assert!(reg.doomed(&s, Instant::now()).is_empty());
        assert_eq!(held(&c), first);
    }

    /// The same token registered again (its entry gone: a semaphore try that was not
    /// admitted, a release, a pruning) gets its old name back, so the delete of its earlier key
    /// — which may still land: answered through a hedge, or timed out — must not match the new
    /// key's value. Before, every registration of a token wrote the same value, and that late
    /// delete deleted the key the token had just been admitted with while it held it.
    #[test]
    fn a_token_registered_again_writes_a_value_its_earlier_delete_does_not_match() {
        let reg = Sessions::default();
        let s = session(1);
        let new = exclusive_key();
        let key = token();
        let Begun::Put(first, first_value) = reg.begin_put(&key, Some(&new), &[&s]) else {
            panic!("not registered");
        };
        reg.end_put(&key, true, None);
        let late_delete = reg.leave(&key).expect("registered");
        reg.forget(&key);
        assert!(!reg.is_registered(&key));
        let Begun::Put(again, again_value) = reg.begin_put(&key, Some(&new), &[&s]) else {
            panic!("not registered");
        };
        assert_eq!(again, first, "the name is reused");
        assert_ne!(again_value, first_value, "the value names the registration");
        assert_eq!(
            format!("{late_delete:?}"),
            format!("{:?}", delete_if_valued(&first, &first_value)),
            "the earlier delete compares the earlier value"
        );
        // Every put of one registration writes the same value.
        reg.end_put(&key, true, None);
        let Begun::Put(_, same) = reg.begin_put(&key, None, &[&s]) else {
            panic!("not registered");
        };
        assert_eq!(same, again_value);
    }

    /// A waiter past its time is deleted before a keepalive of its session however many other
    /// attempts of the locker are under way (they are that session's keepalives), but not while
    /// an attempt of its own is (it may be admitted by it); deleted, its registration ends at
    /// once, so its next attempt finds itself no longer waiting and queues again.
    #[test]
    fn a_late_waiter_is_deleted_unless_an_attempt_of_its_own_is_under_way() {
        let reg = Sessions::default();
        let s = session(1);
        let now = Instant::now();
        let (late, other) = (token(), token());
        put(&reg, &late, &[&s]);
        reg.end_put(&late, true, None);
        reg.set(&late, &s, Role::Waiting(now));
        put(&reg, &other, &[&s]);
        reg.end_put(&other, true, None);
        reg.set(&other, &s, Role::Waiting(now + Duration::from_secs(5)));
        let own = reg.attempting(&late);
        let others = reg.attempting(&other);
        assert!(
            reg.doomed(&s, now).is_empty(),
            "deleted while an attempt of its own is under way"
        );
        drop(own);
        let doomed = reg.doomed(&s, now);
        assert_eq!(doomed.len(), 1, "held up by another waiter's attempt");
        assert_eq!(doomed[0].0, late);
        assert!(
            reg.waiting_on(&late).is_none(),
            "still waiting once its delete was decided"
        );
        reg.pruned(doomed, now);
        assert!(!reg.is_registered(&late));
        drop(others);
        assert!(reg.waiting_on(&other).is_some());
    }

    /// A token whose registration ended while its entry stays (a try that lost with a put of
    /// it still out; a waiter whose deletion as past its time is on its way) and that asks
    /// again is registered again with a new value: the earlier delete, which may land after the
    /// new put, must not match the key the token has just taken the lock with. Only an attempt
    /// (which says where a new key goes) registers it again.
    #[test]
    fn a_token_asking_again_after_its_registration_ended_writes_a_new_value() {
        let reg = Sessions::default();
        let s = session(1);
        let new = exclusive_key();
        let key = token();
        let Begun::Put(name, first) = reg.begin_put(&key, Some(&new), &[&s]) else {
            panic!("not registered");
        };
        // The put's fate is unknown, and the try lost: a suspect.
        assert!(reg.leave(&key).is_some());
        reg.forget(&key);
        assert!(reg.is_registered(&key));
        let doomed = reg.doomed(&s, Instant::now());
        assert_eq!(doomed.len(), 1);
        assert_eq!(reg.begin_put(&key, None, &[&session(2)]), Begun::Unknown);
        let Begun::Put(again, second) = reg.begin_put(&key, Some(&new), &[&session(2)]) else {
            panic!("not registered again");
        };
        assert_eq!(again, name, "its name is kept");
        assert_ne!(
            second, first,
            "registered again with the value the late delete compares"
        );
        assert_eq!(
            format!("{:?}", doomed[0].1),
            format!("{:?}", delete_if_valued(&name, &first)),
        );
        // Asking again while registered (not ended) keeps the value.
        let Begun::Put(_, same) = reg.begin_put(&key, Some(&new), &[&session(2)]) else {
            panic!("not registered");
        };
        assert_eq!(same, second);
    }

    /// A retired session whose last wanted key left some way that revokes nothing (here: its
    /// holder's key marked unwanted, as a release whose delete failed leaves it), or whose
    /// revocation failed every try, is found by the next sweep — at most one per period — and
    /// revoked then; one being revoked, or gone, is not.
    #[test]
    fn a_sweep_finds_retired_sessions_left_with_no_wanted_key() {
        let reg = Sessions::default();
        let s = session(1);
        let holder = held_on(&reg, &s);
        // A suspect on the same session: its put's fate unknown, its try lost.
        let suspect = token();
        put(&reg, &suspect, &[&s]);
        assert!(reg.leave(&suspect).is_some());
        reg.forget(&suspect);
        assert!(
            s.retired.load(Ordering::Acquire),
            "a suspect retires its sessions"
        );
        let every = Duration::from_secs(60);
        let found = reg.stranded(every);
        assert_eq!(found.iter().map(|f| f.id).collect::<Vec<_>>(), [1]);
        assert!(reg.revoking(&found).is_empty(), "the holder's key is on it");
        assert!(reg.leave(&holder).is_some());
        reg.unwanted(&holder);
        assert!(reg.stranded(every).is_empty(), "one sweep per period");
        *lock(&reg.next_sweep) = None;
        let found = reg.stranded(every);
        assert_eq!(reg.revoking(&found).len(), 1, "left with no wanted key");
        assert!(
            reg.revoking(&found).is_empty(),
            "its revocation is under way"
        );
        // Every try failed.
        s.revoking.store(false, Ordering::Release);
        assert_eq!(reg.revoking(&found).len(), 1, "taken up again");
        reg.gone(&s);
        s.revoking.store(false, Ordering::Release);
        *lock(&reg.next_sweep) = None;
        let found = reg.stranded(every);
        assert!(reg.revoking(&found).is_empty(), "gone");
        assert!(
            !reg.is_registered(&suspect),
            "the suspect goes with its session"
        );
    }

    /// A token registered again while a put of its earlier registration is in flight: that put
    /// may land where the name is free, with the earlier value. Once the token leaves, its
    /// prunings delete the key by either value (one after the other, in one transaction) —
    /// however many registrations whose puts were all answered came in between: only a
    /// registration that left a put unsettled leaves its value behind.
    #[test]
    fn a_pruning_deletes_a_key_by_every_value_a_put_of_it_may_have_written() {
        let reg = Sessions::default();
        let s = session(1);
        let new = exclusive_key();
        let key = token();
        let Begun::Put(name, first) = reg.begin_put(&key, Some(&new), &[&s]) else {
            panic!("not registered");
        };
        assert!(reg.leave(&key).is_some());
        reg.forget(&key);
        let mut last = Vec::new();
        for i in 0..STALE_VALUES_KEPT + 2 {
            // (The sessions it used are retired as it leaves: a suspect may land on them.)
            let fresh = session(2 + i as i64);
            let Begun::Put(_, value) = reg.begin_put(&key, Some(&new), &[&fresh]) else {
                panic!("not registered again");
            };
            reg.end_put(&key, true, None);
            assert!(reg.leave(&key).is_some());
            reg.forget(&key);
            last = value;
        }
        let doomed = reg.doomed(&s, Instant::now());
        assert_eq!(doomed.len(), 1);
        let either =
            delete_if_valued(&name, &first).or_else([TxnOp::txn(delete_if_valued(&name, &last))]);
        assert_eq!(format!("{:?}", doomed[0].1), format!("{either:?}"));
    }

    /// An idle retired session is revoked in the background. Until etcd answers the
    /// revocation, a suspect on it keeps its name: a revocation that fails leaves the lease
    /// alive (up to its class), and the suspect's put landing on it then — a try of a permit
    /// or hold puts its name whether or not a key has it — would move the name's next key
    /// (another token's, held on another session) onto the dying lease, whose end deletes it
    /// while its holder believes it holds.
    #[test]
    fn a_suspects_name_is_kept_until_its_sessions_revocation_is_answered() {
        let reg = Sessions::default();
        let s = session(1);
        let (t, t2, t3) = (token(), token(), token());
        // `t`'s put is on its way (unanswered) when it is released: a suspect, `s` retired.
        let name = put(&reg, &t, &[&s]);
        assert!(reg.leave(&t).is_some());
        reg.forget(&t);
        assert!(reg.is_registered(&t));
        assert!(s.retired.load(Ordering::Acquire));
        // Nothing wanted is on `s`: its revocation is sent.
        let revoking = reg.revoking(std::slice::from_ref(&s));
        assert_eq!(revoking.len(), 1);
        assert!(!s.usable());
        assert!(
            reg.revoking(std::slice::from_ref(&s)).is_empty(),
            "revoked once"
        );
        let s2 = session(2);
        let other = put(&reg, &t2, &[&s2]);
        assert_ne!(
            other, name,
            "reused while the suspect's put may land on a live lease"
        );
        assert!(reg.is_registered(&t));
        // etcd answered: the lease is gone, and a put on it fails.
        reg.gone(&s);
        assert!(!reg.is_registered(&t));
        assert_eq!(put(&reg, &t3, &[&s2]), name);
    }

    /// A lock's slots: the lowest free one is taken, past the first 64 too, and a freed one
    /// is taken again first.
    #[test]
    fn slots_take_the_lowest_free_one() {
        let mut slots = Slots::default();
        let taken: Vec<u32> = (0..70).map(|_| slots.take()).collect();
        assert_eq!(taken, (0..70).collect::<Vec<_>>());
        slots.free(65);
        slots.free(3);
        assert_eq!((slots.take(), slots.take()), (3, 65));
        for s in 0..70 {
            slots.free(s);
        }
        assert!(slots.is_empty());
        assert_eq!(slots.take(), 0);
    }

    /// Slots are per lock, a writer's key carries the marker, and an unregistered token is
    /// not registered by a put that does not say where its key goes.
    #[test]
    fn slots_are_per_lock_and_names_follow_the_kind() {
        let reg = Sessions::default();
        let s = session(1);
        let mine = put(&reg, &token(), &[&s]);
        let other: TokenKey = (Arc::from("other"), OwnerToken::generate());
        let new = NewKey {
            dir: b"dlock/other/",
            kind: LockKind::Write,
            value: "1000:x".to_owned(),
        };
        let Begun::Put(writer, _) = reg.begin_put(&other, Some(&new), &[&s]) else {
            panic!("not registered");
        };
        let name = String::from_utf8(writer).unwrap();
        assert_eq!(
            name,
            format!("dlock/other/w.{}.0", reg.instance),
            "its own slot 0, marked"
        );
        assert!(mine.ends_with(b".0"));
        assert_eq!(reg.begin_put(&token(), None, &[&s]), Begun::Unknown);
        s.retired.store(true, Ordering::Release);
        assert_eq!(reg.begin_put(&token(), Some(&new), &[&s]), Begun::Stale);
    }
}
