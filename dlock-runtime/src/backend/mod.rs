//! The backend trait and what backends share.
//!
//! A backend stores locks; the [`Locker`](crate::Locker) above it owns everything that is the
//! same for every store: owner tokens, deadlines, waiting and backoff, the renewal watchdog, drop
//! handling and cancel safety. A backend implements a handful of owner-checked primitives:
//!
//! * [`acquire`](Backend::acquire): one atomic attempt that either grants the lock with a new
//!   fencing token or reports the holder's remaining lease. In [`WaitMode::Queue`] a failed
//!   attempt also puts (or keeps) the caller in the key's FIFO waiter queue, with an entry that
//!   expires after the waiter TTL unless refreshed by the next attempt. An attempt by the token
//!   that already holds the lock, in any mode, is granted again — `Acquired`, a fencing token
//!   not below the one before, the lease restarted with the new TTL, still one holder: the
//!   reply to the earlier attempt may have been lost (a timeout, a failover, a lost handoff
//!   notification), and the locker asks again with the same token
//!   ([`RetryPolicy::through_outages`](crate::RetryPolicy::through_outages)).
//! * [`release`](Backend::release), [`extend`](Backend::extend): compare the owner token and act,
//!   atomically, server side.
//! * [`abandon`](Backend::abandon): for a cancelled or abandoned acquire — release if the token
//!   owns the lock and leave the waiter queue; harmless if the token never got anywhere.
//! * [`watch`](Backend::watch) (optional): be told when the lock is released and it is this
//!   waiter's turn — or, with a *direct handoff*, that the release already granted the lock to
//!   this waiter ([`ReleaseHub::hand_over`], [`Watch::take_handoff`]), so it starts without
//!   asking again. The default never fires ([`Watch::never`]); waiters then re-check on their
//!   fallback timer. A backend that hands over grants a lease of
//!   `min(ttl, waiter_ttl)` ([`AcquireArgs`]; the waiter renews it to `ttl`) that ends no
//!   later than the waiter's queue entry would have, so that a waiter that died holds the lock
//!   no longer than its entry would have held up the queue (conformance:
//!   `a_dead_waiters_handoff_ends_with_its_entry`); a
//!   waiter whose notification was lost asks again and is granted the lock it already holds
//!   (above). Hand over only when the news reaches the waiter in order with the answers to its
//!   attempts (Redis: pushes on the connection the attempts use): the locker takes a handoff
//!   that comes after an attempt's answer as made after that attempt, and counts its lease
//!   from that attempt. Where the news of a grant may reach the hub after the answer to a
//!   later attempt although it came first (redis-rs passes pushes to a task of its own), the
//!   backend gives the hub, with that answer, a fencing token that every grant made before
//!   the attempt is at or below and every one made after is above
//!   ([`ReleaseHub::set_floor`]): a grant at or below it only wakes the waiter. Notifications on a connection of their own can come late, after an
//!   attempt that found the handed-over lease lapsed and the lock another's; such a backend
//!   wakes the waiter instead ([`ReleaseHub::notify`]), which asks and is granted what is
//!   already its own (Postgres, and Redis Cluster, whose subscriptions have connections of
//!   their own). With [`listening`](Backend::listening) a backend says a watch would cost no
//!   round trip (another local waiter's subscription): the waiter then watches before its
//!   first attempt and sleeps on that attempt's answer, instead of asking again after watching.
//! * [`idempotency`](Backend::idempotency) (optional): an [`IdempotencyStore`] that keeps
//!   records atomically with the locks.
//! * [`acquire_kind`](Backend::acquire_kind) (optional): semaphores and read-write locks
//!   ([`LockKind`]). See below.
//! * [`admin`](Backend::admin) (optional): an [`AdminStore`] for operators — inspect a lock,
//!   list a namespace's locks, force-release a stuck one.
//!
//! ## Semaphores and read-write locks
//!
//! A semaphore permit and a read or write hold are leases like a lock's: one owner token, a
//! fencing token, a TTL renewed by the watchdog, owner-checked release. Their
//! [`ResourceName`] says which kind it is ([`ResourceName::kind`]) and has a name of its own
//! (`<prefix>:{<key>}:sem`, `…:rw`). The locker sends their first attempt to
//! [`acquire_kind`](Backend::acquire_kind) — default [`LockError::Unsupported`], so a backend
//! that does not implement it refuses rather than hand out a mutex — and everything after it
//! (`release`, `extend`, `extend_many`, `abandon`, `watch`) to the same methods as a lock's:
//! a backend that implements `acquire_kind` dispatches on `resource.kind()` there.
//!
//! The rule every backend keeps, in one model: a name has *holders* (owner token, shared or
//! exclusive, lease) and a FIFO *queue* of waiters (token, shared or exclusive, entry that
//! expires after the waiter TTL). Capacity is [`LockKind::capacity`] (the semaphore's permits,
//! unbounded for a read-write lock); a [`Write`](LockKind::Write) hold is exclusive, every
//! other one shared. Walk the queue from its head, admitting each waiter that fits beside the
//! live holders and the waiters admitted before it (shared: no exclusive holder and fewer than
//! capacity holders; exclusive: no holder at all), and stop at the first that does not fit:
//! those admitted form the *ready prefix*. An attempt in [`WaitMode::Queue`] is granted when
//! the caller is in the ready prefix (a newcomer joins at the tail first); in
//! [`WaitMode::Try`] when it would be admitted after the *whole* queue (it never overtakes a
//! waiter); in [`WaitMode::Barge`] when it fits beside the holders. So a waiting writer blocks
//! readers that arrive after it (writers are not starved), and a semaphore's waiters take
//! permits in arrival order. A release or abandon that frees room wakes exactly the waiters
//! of the new ready prefix (one for a permit, every leading reader after a writer) through
//! [`ReleaseHub::notify`]; there is no direct handoff. Every grant carries a fencing token from
//! the same counter as locks: a writer's token is greater than every token issued on the name
//! before it; readers' and permits' tokens are distinct and order their arrival — drawn at the
//! grant on most backends, at joining the queue on etcd (the key's create revision), where a
//! permit granted after another may carry the lower token.
//!
//! `name`, `acquire`, `release`, `extend` and `abandon` are all a backend must write; the
//! conformance suite (feature `conformance`) checks every promise above against it. A locker
//! takes a backend by value, as `Arc<B>`, `Arc<dyn Backend>` or `Box<dyn Backend>`
//! ([`IntoBackend`]) — there is no forwarding wrapper that could miss a method.
//!
//! Backends in this crate: [`MemoryBackend`] (in-process) and, under feature `redis`,
//! [`RedisBackend`] and [`RedlockBackend`]; under feature `postgres`, [`PostgresBackend`];
//! under feature `etcd`, `EtcdBackend` (module `etcd`); under feature `zookeeper`, `ZkBackend`
//! (module `zookeeper`).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use crate::key::{LockKind, ResourceName};
use crate::LockError;

mod memory;
pub use memory::{MemoryBackend, DEFAULT_IDEMPOTENCY_CAPACITY};

pub mod admin;
pub use self::admin::AdminStore;
pub mod idempotency;
pub use self::idempotency::IdempotencyStore;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "redis")]
pub use self::redis::{RedisBackend, RedisOptions};
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "postgres")]
pub use self::postgres::{PostgresBackend, PostgresOptions};
#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "etcd")]
pub use self::etcd::{EtcdBackend, EtcdOptions};
#[cfg(feature = "zookeeper")]
pub mod zookeeper;
#[cfg(feature = "zookeeper")]
pub use self::zookeeper::{ZkBackend, ZkOptions};
#[cfg(feature = "redis")]
pub mod redlock;
#[cfg(feature = "redis")]
pub use self::redlock::{RedlockBackend, RedlockOptions};

/// A boxed, `Send` future, the return type of [`Backend`] methods.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The secret that identifies one owner (one acquisition) of a lock: 128 bits from the
/// operating system's CSPRNG, hex-encoded. Its `Debug` output is redacted so it never
/// reaches logs.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct OwnerToken(Arc<str>);

impl OwnerToken {
    /// A fresh token from the OS CSPRNG.
    ///
    /// # Panics
    /// If the operating system cannot provide randomness (never on supported platforms);
    /// a lock library must not fall back to a weaker source.
    pub fn generate() -> Self {
        OwnerToken(crate::util::secure_token::<16>().into())
    }

    /// The token as sent to the backend.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OwnerToken(..)")
    }
}

/// How an acquire attempt treats the key's waiter queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitMode {
    /// One attempt; never enqueue. Granted only if the lock is free and nobody is queued.
    Try,
    /// Granted if the lock is free and the caller is first in the queue (or the queue is
    /// empty); otherwise join (or refresh the caller's place in) the queue.
    Queue,
    /// Granted whenever the lock is free, ignoring the queue (unfair, "barging" waiting).
    Barge,
}

/// One acquire attempt's parameters.
#[derive(Debug)]
#[non_exhaustive]
pub struct AcquireArgs<'a> {
    /// The lock.
    pub resource: &'a ResourceName,
    /// This acquisition's owner token (also its waiter id).
    pub token: &'a OwnerToken,
    /// Lease length.
    pub ttl: Duration,
    /// Queue behaviour.
    pub mode: WaitMode,
    /// How long a queue entry lives without being refreshed by another attempt.
    pub waiter_ttl: Duration,
    /// Whether the locker's watchdog will renew the lock while it is held
    /// ([`LockRequest::auto_renew`](crate::LockRequest::auto_renew)). A backend may keep the
    /// locks it renews differently (etcd puts them on a shared session lease); one that is
    /// not renewed must expire after its TTL on its own.
    pub renew: bool,
    /// Where a backend that can tell says whether this attempt was sent (see [`SendMark`]);
    /// `None` where nobody asks (a backend's own per-node attempts, the conformance helpers).
    /// (Only the Postgres backend, and tests, read it.)
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) sent: Option<&'a SendSlot>,
}

/// Whether an acquire attempt has left this process, for a backend that can tell (Postgres,
/// whose attempt may wait for a pooled connection first) — and the request's word that it has
/// stopped waiting for the attempt, after which an attempt not yet sent is never sent.
///
/// An attempt abandoned unsent then needs no undo. Without this, every acquire that timed out
/// while queued for a connection left an undo that queued for a connection in turn, and one
/// that went out late took a lock nobody waited for: under a burst, a pool's queue grew with
/// work nobody wanted, and live acquires timed out behind it (after an outage, the undos of
/// every refused attempt stalled every key for seconds).
///
/// A backend that does not [`hold`](SendMark::hold) the mark leaves the attempt's fate unknown:
/// the request then undoes it, as it must for anything that may have been sent. It gets the
/// mark from the attempt's [`SendSlot`], which makes none for a backend that never asks.
#[derive(Debug, Default)]
pub(crate) struct SendMark {
    state: std::sync::atomic::AtomicU8,
    sealed: tokio_util::sync::CancellationToken,
}

// Only the Postgres backend holds a mark.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
impl SendMark {
    const UNTRACKED: u8 = 0;
    const UNSENT: u8 = 1;
    const SENT: u8 = 2;
    const SEALED: u8 = 3;

    fn cas(&self, from: u8, to: u8) -> Result<u8, u8> {
        self.state
            .compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst)
    }

    /// The backend tracks the attempt: nothing of it is sent before [`send`](Self::send).
    pub(crate) fn hold(&self) {
        let _ = self.cas(Self::UNTRACKED, Self::UNSENT);
    }

    /// The backend is about to send the attempt: `false` when the request has stopped waiting
    /// for it ([`seal`](Self::seal)), and the attempt must not be sent.
    pub(crate) fn send(&self) -> bool {
        match self.cas(Self::UNSENT, Self::SENT) {
            Ok(_) => true,
            Err(state) => {
                // Unheld, a seal would not stop the send (it would count it as maybe sent).
                debug_assert_ne!(
                    state,
                    Self::UNTRACKED,
                    "a send mark is held before it is sent"
                );
                state != Self::SEALED
            }
        }
    }

    /// The request stops waiting for the attempt: whether it may have been sent. If not, it
    /// never will be.
    pub(crate) fn seal(&self) -> bool {
        let sent = match self.cas(Self::UNSENT, Self::SEALED) {
            Ok(_) => false,
            Err(state) => state != Self::SEALED,
        };
        self.sealed.cancel();
        sent
    }

    /// Resolves once the request has stopped waiting for the attempt.
    pub(crate) async fn sealed(&self) {
        self.sealed.cancelled().await
    }
}

/// Where an attempt's [`SendMark`] is made when its backend asks for one: nothing is allocated
/// for the attempts of a backend that does not.
#[derive(Debug, Default)]
pub(crate) struct SendSlot(std::sync::OnceLock<Arc<SendMark>>);

impl SendSlot {
    /// The attempt's mark, held: nothing of the attempt is sent before [`SendMark::send`].
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn hold(&self) -> Arc<SendMark> {
        let mark = self.0.get_or_init(Arc::default).clone();
        mark.hold();
        mark
    }

    /// The request stops waiting for the attempt: whether it may have been sent (see
    /// [`SendMark::seal`]; an attempt whose backend never held a mark may have been).
    pub(crate) fn seal(&self) -> bool {
        self.0.get().is_none_or(|mark| mark.seal())
    }
}

/// The outcome of one acquire attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Attempt {
    /// The lock is ours.
    Acquired {
        /// Strictly greater than every token issued for this key before.
        fencing_token: u64,
    },
    /// Someone else holds it, or the lock is free but another waiter is ahead in the queue.
    Held {
        /// The holder's remaining lease, when known. When the lock is free but another waiter
        /// is ahead: how long that waiter's turn may last — what its queue entry has left (a
        /// waiter that died holds the line until then) — else `None`. The locker wakes a waiting task no later than this.
        remaining: Option<Duration>,
    },
}

impl Attempt {
    /// The outcome a lock script or function answered in the shared encoding: the fencing
    /// token (> 0) when granted, `-(ms left) - 1` when held (the holder's lease left, or, free
    /// but another waiter first, what that waiter's queue entry has left), `0` when held for an
    /// unknown time (the Redis scripts and the Postgres functions).
    #[cfg(any(feature = "redis", feature = "postgres"))]
    pub(crate) fn from_reply(reply: i64) -> Self {
        match reply {
            1.. => Attempt::Acquired {
                fencing_token: reply.unsigned_abs(),
            },
            0 => Attempt::Held { remaining: None },
            _ => Attempt::Held {
                remaining: Some(Duration::from_millis((-(reply + 1)).unsigned_abs())),
            },
        }
    }
}

/// One entry of a batched renewal ([`Backend::extend_many`]).
#[derive(Clone, Debug)]
pub struct ExtendItem {
    /// The lock.
    pub resource: ResourceName,
    /// The owner token that must still hold it.
    pub token: OwnerToken,
    /// The new lease length, counted from now.
    pub ttl: Duration,
}

/// A lock store. See the [module docs](self) for the contract; every method must be atomic
/// with respect to the owner check, and must not wait longer than the backend's own command
/// timeout (the [`Locker`](crate::Locker) adds its own deadline on top). A store that did not
/// answer, or failed in a way that can pass, is [`LockError::unavailable`] (503: waits through
/// outages go on, a deferred job keeps its attempts); one that refused in a way retrying does
/// not change is [`LockError::misconfigured`] (500).
pub trait Backend: Send + Sync + 'static {
    /// A short name for logs and errors (`"memory"`, `"redis"`).
    fn name(&self) -> &'static str;

    /// Whether waiting in [`WaitMode::Queue`] is first-in-first-out on this backend. Redlock's
    /// per-node queues could disagree, so it barges instead (and says `false`). Default `true`.
    fn fifo(&self) -> bool {
        true
    }

    /// How much of a granted lease the holder must not count on: clock drift between the
    /// holder and the servers, and a lease the server rounds down or counts from a clock read
    /// in coarse steps (Redis: whole milliseconds). The local lease clock, started when the
    /// request is sent, ends `lease_margin(ttl)` before the TTL, which must be before the
    /// backend lets another owner in (the conformance check
    /// `the_local_lease_ends_before_the_lock_frees`). Default: none.
    fn lease_margin(&self, ttl: Duration) -> Duration {
        let _ = ttl;
        Duration::ZERO
    }

    /// One acquire attempt. An attempt by the token that already holds the lock is granted
    /// again, with the lease restarted (see the [module docs](self)).
    fn acquire<'a>(&'a self, args: AcquireArgs<'a>) -> BoxFuture<'a, Result<Attempt, LockError>>;

    /// Releases the lock if `token` owns it and notifies the next waiter. `Ok(false)` when the
    /// token does not own it (it expired, maybe someone else holds it now).
    fn release<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>>;

    /// Sets the lease to `ttl` from now if `token` owns the lock.
    fn extend<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>>;

    /// Lets the lock end by itself `left` from now if `token` owns it: its last step, after
    /// which nothing renews it (a release before the minimum hold of
    /// [`LockRequest::hold_at_least`](crate::LockRequest::hold_at_least) has passed). Unlike a
    /// renewal, nothing else may keep the lock alive past `left`: a backend whose renewed locks
    /// share a lease kept alive for all of them (etcd's sessions) moves it off that lease.
    /// Default: [`extend`](Backend::extend).
    fn expire<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        left: Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        self.extend(resource, token, left)
    }

    /// Extends many locks in one go (the watchdog's batch): one answer per item, in order. The
    /// default runs [`extend`](Backend::extend) for each item concurrently; network backends
    /// pipeline. A renewal the store refuses on its own (a key of another type) should fail
    /// alone: the watchdog retries a failed renewal until the lock's local lease runs out, and
    /// reports it lost then.
    fn extend_many<'a>(
        &'a self,
        items: &'a [ExtendItem],
    ) -> BoxFuture<'a, Vec<Result<bool, LockError>>> {
        Box::pin(futures_util::future::join_all(
            items
                .iter()
                .map(|i| self.extend(&i.resource, &i.token, i.ttl)),
        ))
    }

    /// Undoes whatever an acquire with `token` may have done: releases the lock if the token
    /// owns it, removes the token from the waiter queue, and notifies the next waiter if that
    /// freed the way. Harmless when the token never reached the backend.
    ///
    /// An `abandon` that fails may be finished later by the backend (ZooKeeper deletes the
    /// token's nodes once it has a server again): do not reuse the token for a new acquire
    /// after a failed `abandon` — draw a new one ([`OwnerToken::generate`]), as the
    /// [`Locker`](crate::Locker) does for every acquisition.
    fn abandon<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<(), LockError>>;

    /// Registers `token` as a local waiter of `resource`. The returned [`Watch`] is notified when
    /// a release names `token` as the next waiter or hands it the lock (or, for barging waiters,
    /// when a release names nobody). When this future completes, no later release can be missed.
    ///
    /// Optional: the default is [`Watch::never`], a watch that is never notified. Waiting
    /// still works then — waiters re-check on their fallback timer (see
    /// [`RetryPolicy`](crate::RetryPolicy)) — it is only slower to hand the lock over.
    fn watch<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        let _ = (resource, token);
        Box::pin(async { Ok(Watch::never()) })
    }

    /// Whether this backend already listens for `resource`'s releases, so that a
    /// [`watch`](Backend::watch) on it costs no round trip to the store (another local waiter's
    /// watch made the subscription). A waiter then watches *before* its first
    /// attempt: an attempt sent once the watch is made misses no release, so the waiter sleeps
    /// on the attempt's answer, instead of watching after it and asking again to catch a
    /// release in between. A hint only: `true` where the watch would cost a round trip makes
    /// a waiter that the first attempt grants the lock pay for a watch it does not use.
    /// Default `false`.
    fn listening(&self, resource: &ResourceName) -> bool {
        let _ = resource;
        false
    }

    /// Where this backend keeps idempotency records, atomically with its locks (an optional
    /// capability, [`IdempotencyStore`]). Default: none — the backend does not support them.
    fn idempotency(&self) -> Option<&dyn IdempotencyStore> {
        None
    }

    /// One acquire attempt of a semaphore permit or a read or write hold
    /// (`args.resource.kind()` is not [`LockKind::Exclusive`]), by the rule in the
    /// [module docs](self#semaphores-and-read-write-locks). A backend that implements it
    /// must also honour the kind in [`release`](Backend::release), [`extend`](Backend::extend),
    /// [`extend_many`](Backend::extend_many) and [`abandon`](Backend::abandon).
    ///
    /// Optional: the default answers [`LockError::Unsupported`] (Redlock keeps it: per-node
    /// holder sets could disagree on who holds a permit).
    fn acquire_kind<'a>(
        &'a self,
        args: AcquireArgs<'a>,
    ) -> BoxFuture<'a, Result<Attempt, LockError>> {
        let what = match args.resource.kind() {
            LockKind::Semaphore { .. } => "semaphores",
            _ => "read-write locks",
        };
        let name = self.name();
        Box::pin(async move { Err(LockError::unsupported(name, what)) })
    }

    /// Inspection and forced release for operators (an optional capability, [`AdminStore`]).
    /// Default: none.
    fn admin(&self) -> Option<&dyn AdminStore> {
        None
    }

    /// Makes sure at least `replicas` replicas of the server hold the lock `token` owns: sets
    /// its lease to `ttl` from now and waits (within the backend's command timeout) until the
    /// replicas acknowledge everything written so far. Answers how many acknowledged, or
    /// [`LockError::Lost`] when `token` no longer owns the lock.
    ///
    /// Optional: the default answers [`LockError::Unsupported`] — a backend without replicas
    /// refuses rather than pretend. The Redis backend (one server, Sentinel, a cluster) uses
    /// `WAIT` ([`LockRequest::replicas`](crate::LockRequest::replicas)).
    fn replicate<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        ttl: Duration,
        replicas: u32,
    ) -> BoxFuture<'a, Result<u32, LockError>> {
        let _ = (resource, token, ttl, replicas);
        let name = self.name();
        Box::pin(async move { Err(LockError::unsupported(name, "replica acknowledgement")) })
    }
}

/// Runs a batched renewal in chunks of `size`, the chunks concurrently; a chunk that fails
/// fails each of its items with the chunk's error. `batch` answers one result per item (a
/// renewal the store refused alone fails alone).
#[cfg(any(feature = "redis", feature = "postgres"))]
pub(crate) async fn extend_in_chunks<'a, F, Fut>(
    items: &'a [ExtendItem],
    size: usize,
    batch: F,
) -> Vec<Result<bool, LockError>>
where
    F: Fn(&'a [ExtendItem]) -> Fut,
    Fut: Future<Output = Result<Vec<Result<bool, LockError>>, LockError>>,
{
    let chunks = items.chunks(size).map(|chunk| {
        let run = batch(chunk);
        async move {
            match run.await {
                Ok(v) => v,
                Err(e) => {
                    // Each item gets the batch's error, refusal for good or outage alike.
                    let (msg, for_good) = (e.to_string(), e.is_misconfigured());
                    (0..chunk.len())
                        .map(|_| Err(LockError::backend(msg.clone(), None, for_good)))
                        .collect()
                }
            }
        }
    });
    futures_util::future::join_all(chunks)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// What a [`Locker`](crate::Locker) can be built over: any [`Backend`] by value, or one already
/// shared as `Arc<B>`, `Arc<dyn Backend>` or `Box<dyn Backend>`.
///
/// The locker keeps an `Arc<dyn Backend>`; these conversions hand it over without wrapping the
/// backend in a forwarding type, so no method (default ones included) can be lost on the way.
pub trait IntoBackend {
    /// The shared backend.
    fn into_backend(self) -> Arc<dyn Backend>;
}

impl<B: Backend> IntoBackend for B {
    fn into_backend(self) -> Arc<dyn Backend> {
        Arc::new(self)
    }
}

impl<B: Backend> IntoBackend for Arc<B> {
    fn into_backend(self) -> Arc<dyn Backend> {
        self
    }
}

impl IntoBackend for Arc<dyn Backend> {
    fn into_backend(self) -> Arc<dyn Backend> {
        self
    }
}

impl IntoBackend for Box<dyn Backend> {
    fn into_backend(self) -> Arc<dyn Backend> {
        Arc::from(self)
    }
}

/// Called with the resource name when its last local waiter unregisters (a network backend
/// unsubscribes then).
pub type OnLastWaiter = Box<dyn Fn(&str) + Send + Sync>;

/// Background watch tasks of a backend's waiters, by (resource, owner token), each with what
/// the backend keeps beside its task.
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
pub(crate) type WatchTasks<V> = Arc<Mutex<HashMap<(Arc<str>, OwnerToken), V>>>;

/// An [`OnLastWaiter`] that aborts the watch tasks of the resource's waiters that are gone.
/// Only those: it runs after the hub let go of its lock, and a waiter that registered since
/// (its task spawned, or being spawned) is waiting again and keeps its task — aborted, it
/// would wake only on its fallback timer.
#[cfg(any(feature = "etcd", feature = "zookeeper"))]
pub(crate) fn abort_gone_watch_tasks<V: Send + 'static>(
    tasks: WatchTasks<V>,
    hub: Arc<ReleaseHub>,
    task: fn(&V) -> &tokio::task::AbortHandle,
) -> OnLastWaiter {
    Box::new(move |res: &str| {
        let mut w = tasks.lock().unwrap_or_else(PoisonError::into_inner);
        w.retain(|(r, t), v| {
            let keep = &**r != res || hub.is_waiting(res, t);
            if !keep {
                task(v).abort();
            }
            keep
        });
    })
}

type WaiterMap = HashMap<Arc<str>, Vec<(OwnerToken, Arc<Slot>)>>;

/// One registered waiter's mailbox.
#[derive(Debug, Default)]
struct Slot {
    notify: Notify,
    /// The fencing token of a lock handed to this waiter by a release (0: none).
    handoff: AtomicU64,
    /// Grants with a fencing token at or below this are older than the waiter's last attempt
    /// ([`ReleaseHub::set_floor`]): they only wake it.
    floor: AtomicU64,
    /// The waiter barges (not in a fair line): a release nobody was queued for wakes it with
    /// every other barging waiter ([`ReleaseHub::notify`]).
    barging: AtomicBool,
}

/// A registered waiter: resolves [`notified`](Watch::notified) when it is this waiter's turn.
/// Dropping it unregisters the waiter.
pub struct Watch {
    slot: Arc<Slot>,
    /// Where it is registered; `None` for [`Watch::never`].
    registration: Option<Registration>,
}

struct Registration {
    hub: Arc<ReleaseHub>,
    resource: Arc<str>,
    token: OwnerToken,
    on_last: Option<OnLastWaiter>,
}

impl Watch {
    /// A watch that is never notified: what a backend without release notifications returns
    /// (the default of [`Backend::watch`]). Waiters then wake on their fallback timer.
    pub fn never() -> Self {
        Watch {
            slot: Arc::new(Slot::default()),
            registration: None,
        }
    }

    /// Waits for a notification. A notification that arrived before this call is not lost.
    pub async fn notified(&self) {
        self.slot.notify.notified().await;
    }

    /// Marks the waiter as barging (see [`ReleaseHub::notify`]).
    pub(crate) fn set_barging(&self) {
        self.slot.barging.store(true, Ordering::Release);
    }

    /// Takes a notification that has arrived and not yet been waited for, without waiting:
    /// `true` when one had (a release woke this waiter while it was not waiting).
    pub(crate) fn take_notification(&self) -> bool {
        use futures_util::FutureExt as _;
        self.slot.notify.notified().now_or_never().is_some()
    }

    /// The fencing token of the lock, if a release handed it to this waiter
    /// ([`ReleaseHub::hand_over`]): the waiter holds it now, without asking again. Taken once.
    pub fn take_handoff(&self) -> Option<u64> {
        match self.slot.handoff.swap(0, Ordering::AcqRel) {
            0 => None,
            t => Some(t),
        }
    }
}

impl fmt::Debug for Watch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watch")
            .field(
                "resource",
                &self.registration.as_ref().map(|r| r.resource.clone()),
            )
            .finish_non_exhaustive()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let Some(r) = &self.registration else {
            return;
        };
        if r.hub.unregister(&r.resource, &r.token) {
            if let Some(on_last) = &r.on_last {
                on_last(&r.resource);
            }
        }
    }
}

/// The local side of release notifications: resource name → this process's waiters. A
/// backend feeds it release events ([`ReleaseHub::notify`]); it wakes the local waiter an
/// event names, or the barging ones. Shared by the memory, Redis and Postgres backends.
#[derive(Debug, Default)]
pub struct ReleaseHub {
    keys: Mutex<WaiterMap>,
}

impl ReleaseHub {
    /// An empty hub.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Registers a waiter. Returns the [`Watch`] and whether it is the first local waiter of
    /// the resource (a network backend subscribes then). `on_last` runs when the last waiter of
    /// the resource unregisters.
    pub fn register(
        self: &Arc<Self>,
        resource: &ResourceName,
        token: &OwnerToken,
        on_last: Option<OnLastWaiter>,
    ) -> (Watch, bool) {
        let slot = Arc::new(Slot::default());
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let name: Arc<str> = match keys.get_key_value(resource.as_str()) {
            Some((k, _)) => k.clone(),
            None => resource.as_str().into(),
        };
        let list = keys.entry(name.clone()).or_default();
        let first = list.is_empty();
        list.push((token.clone(), slot.clone()));
        drop(keys);
        (
            Watch {
                slot,
                registration: Some(Registration {
                    hub: self.clone(),
                    resource: name,
                    token: token.clone(),
                    on_last,
                }),
            },
            first,
        )
    }

    fn unregister(&self, resource: &str, token: &OwnerToken) -> bool {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(list) = keys.get_mut(resource) else {
            return false;
        };
        list.retain(|(t, _)| t != token);
        if list.is_empty() {
            keys.remove(resource);
            true
        } else {
            false
        }
    }

    /// A release of `resource` happened. `next` names the waiter whose turn it is (fair
    /// queue); `None` means nobody is queued, and every local barging waiter is woken to try
    /// again (the first local waiter when none is marked barging). Every one, not only the
    /// first: the one that wins takes the lock without a waiter's flag (it failed against
    /// nobody), and its release would tell nobody — the others, asleep on their timers, heard
    /// of it up to a backoff step (about 1 s) late, on every release. Waiters in a fair line
    /// are not woken by it: their turn is named.
    pub fn notify(&self, resource: &str, next: Option<&str>) {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(list) = keys.get(resource) else {
            return;
        };
        match next {
            Some(next) => {
                if let Some((_, n)) = list.iter().find(|(t, _)| t.as_str() == next) {
                    n.notify.notify_one();
                }
            }
            None => {
                let mut barging = list
                    .iter()
                    .filter(|(_, n)| n.barging.load(Ordering::Acquire))
                    .peekable();
                if barging.peek().is_none() {
                    if let Some((_, n)) = list.first() {
                        n.notify.notify_one();
                    }
                }
                for (_, n) in barging {
                    n.notify.notify_one();
                }
            }
        }
    }

    /// A release of `resource` handed the lock to the waiter `token` with `fencing_token`
    /// (direct handoff): that waiter is woken and finds the grant in
    /// [`Watch::take_handoff`]. Nothing happens when `token` is not a local waiter.
    ///
    /// A grant at or below the waiter's [floor](ReleaseHub::set_floor) — published before its
    /// last attempt ran, and heard after that attempt's answer — only wakes it: that lease
    /// lapsed before the attempt found the lock held.
    pub fn hand_over(&self, resource: &str, token: &str, fencing_token: u64) {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(list) = keys.get(resource) else {
            return;
        };
        if let Some((_, n)) = list.iter().find(|(t, _)| t.as_str() == token) {
            if fencing_token > n.floor.load(Ordering::Acquire) {
                n.handoff.store(fencing_token.max(1), Ordering::Release);
            }
            n.notify.notify_one();
        }
    }

    /// The waiter `token` of `resource` had an attempt answered "held" that drew `floor` from
    /// the fencing counter (as a fencing token: any grant published before that attempt ran
    /// carries a token at or below it). A grant at or below it, noted or still to come, is
    /// older than the answer — heard late, its lease had lapsed when the attempt ran, and the
    /// lock may be another's — and only wakes the waiter. For a backend whose notifications
    /// may reach the hub after the answer to a later request on the same connection
    /// (redis-rs's connection manager passes pushes to a task of its own).
    pub fn set_floor(&self, resource: &str, token: &str, floor: u64) {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(list) = keys.get(resource) else {
            return;
        };
        if let Some((_, n)) = list.iter().find(|(t, _)| t.as_str() == token) {
            n.floor.fetch_max(floor, Ordering::AcqRel);
            let _ = n
                .handoff
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |noted| {
                    (noted != 0 && noted <= floor).then_some(0)
                });
        }
    }

    /// Wakes every local waiter once, to re-check the lock. The Redis backend calls it when its
    /// connection is back after an outage, during which release notifications were missed.
    pub fn notify_all(&self) {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        for list in keys.values() {
            for (_, n) in list {
                n.notify.notify_one();
            }
        }
    }

    /// Whether `token` is a local waiter of `resource` (registered, its [`Watch`] alive).
    pub fn is_waiting(&self, resource: &str, token: &OwnerToken) -> bool {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(resource)
            .is_some_and(|list| list.iter().any(|(t, _)| t == token))
    }

    /// Whether `resource` has local waiters.
    pub fn has_waiters(&self, resource: &str) -> bool {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(resource)
    }

    /// How many resources have local waiters.
    pub fn watched(&self) -> usize {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LockKey;

    /// A grant at or below a waiter's floor — noted before the floor was set, or heard after —
    /// only wakes it; one above is taken.
    #[tokio::test]
    async fn a_grant_at_or_below_the_floor_only_wakes_the_waiter() {
        use futures_util::FutureExt as _;
        let hub = ReleaseHub::new();
        let res = ResourceName::new("p", LockKey::new("k").unwrap());
        let token = OwnerToken::generate();
        let (watch, _) = hub.register(&res, &token, None);
        let (r, t) = (res.as_str(), token.as_str());
        hub.hand_over(r, t, 100);
        hub.set_floor(r, t, 150);
        assert_eq!(watch.take_handoff(), None, "noted before the floor");
        assert!(watch.notified().now_or_never().is_some());
        hub.hand_over(r, t, 150);
        assert_eq!(watch.take_handoff(), None, "heard after the floor");
        assert!(
            watch.notified().now_or_never().is_some(),
            "woken all the same"
        );
        hub.set_floor(r, t, 120);
        hub.hand_over(r, t, 140);
        assert_eq!(watch.take_handoff(), None, "a floor never goes down");
        hub.hand_over(r, t, 151);
        assert_eq!(watch.take_handoff(), Some(151));
    }

    /// The last waiter of a resource leaves; before its `on_last` runs, a new waiter
    /// registers and spawns its watch task. `on_last` aborts the task of the waiter that left,
    /// never the new one's (aborted, the new waiter would wake only on its fallback timer).
    #[cfg(any(feature = "etcd", feature = "zookeeper"))]
    #[tokio::test]
    async fn the_last_waiters_cleanup_spares_a_waiter_that_came_since() {
        let hub = ReleaseHub::new();
        let tasks: WatchTasks<tokio::task::AbortHandle> = Arc::default();
        let res = ResourceName::new("p", LockKey::new("k").unwrap());
        let (gone, new) = (OwnerToken::generate(), OwnerToken::generate());
        let on_last = abort_gone_watch_tasks(tasks.clone(), hub.clone(), |h| h);
        let pending = || tokio::spawn(std::future::pending::<()>());
        let (gone_task, new_task) = (pending(), pending());
        let (_watch, _) = hub.register(&res, &new, None);
        {
            let mut w = tasks.lock().unwrap();
            w.insert((res.shared(), gone.clone()), gone_task.abort_handle());
            w.insert((res.shared(), new.clone()), new_task.abort_handle());
        }
        on_last(res.as_str());
        assert!(gone_task.await.unwrap_err().is_cancelled());
        tokio::task::yield_now().await;
        assert!(!new_task.is_finished());
        let left: Vec<_> = tasks
            .lock()
            .unwrap()
            .keys()
            .map(|(_, t)| t.clone())
            .collect();
        assert_eq!(left, [new]);
    }

    #[tokio::test]
    async fn a_send_mark_sealed_before_the_send_keeps_the_attempt_unsent() {
        // A backend that never says it tracks the attempt: maybe sent.
        let untracked = SendMark::default();
        assert!(untracked.seal(), "an untracked attempt may have been sent");
        assert!(
            SendSlot::default().seal(),
            "an attempt without a mark may have been sent"
        );
        let slot = SendSlot::default();
        let mark = slot.hold();
        assert!(!slot.seal(), "a held slot seals its mark");
        assert!(!mark.send());
        // Sealed while held back: never sent, and the backend is told.
        let held = SendMark::default();
        held.hold();
        assert!(!held.seal());
        held.sealed().await;
        assert!(!held.send(), "an attempt sealed unsent must not be sent");
        assert!(!held.seal(), "sealing again changes nothing");
        // Sent, then sealed: it may have reached the backend.
        let sent = SendMark::default();
        sent.hold();
        assert!(sent.send());
        assert!(sent.seal());
    }

    #[test]
    fn owner_tokens_are_random_and_redacted() {
        let a = OwnerToken::generate();
        let b = OwnerToken::generate();
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 32);
        assert_eq!(format!("{a:?}"), "OwnerToken(..)");
    }

    #[test]
    fn hub_wakes_exactly_the_named_waiter() {
        let hub = ReleaseHub::new();
        let res = ResourceName::new("p", LockKey::new("k").unwrap());
        let (t1, t2) = (OwnerToken::generate(), OwnerToken::generate());
        let (w1, first) = hub.register(&res, &t1, None);
        assert!(first);
        let (w2, first) = hub.register(&res, &t2, None);
        assert!(!first);
        hub.notify(res.as_str(), Some(t2.as_str()));
        // w2 holds a stored permit, w1 none: polling once tells them apart without timing.
        use futures_util::FutureExt as _;
        assert!(w2.notified().now_or_never().is_some(), "named waiter woken");
        assert!(
            w1.notified().now_or_never().is_none(),
            "other waiter must stay asleep"
        );
        drop(w1);
        drop(w2);
        assert_eq!(hub.watched(), 0);
    }
}
