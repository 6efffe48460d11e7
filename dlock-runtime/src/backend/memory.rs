//! The in-process backend: the embedded default.
//!
//! Locks live in a sharded hash map guarded by short, never-awaited mutexes, so the backend is
//! correct under heavy concurrency inside one process and shared by every
//! [`Locker`](crate::Locker) built from the same [`MemoryBackend`] value. It keeps the same
//! semantics as the Redis backend: owner-checked release and extend, leases that expire, a FIFO
//! waiter queue whose entries expire, and release notifications to the next waiter.
//!
//! Fencing tokens come from one counter per backend, `max(previous + 1, wall clock in µs)`,
//! so they increase strictly per key (and across keys), also across expiry, and stay ahead of
//! tokens issued by an earlier process as long as the wall clock does not step back.
//!
//! It does not survive a restart and does not coordinate between processes: use it for one
//! instance, for development, or as the fallback when no Redis URL is configured.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::{AcquireArgs, Attempt, Backend, BoxFuture, OwnerToken, ReleaseHub, WaitMode, Watch};
use crate::key::{LockKind, ResourceName};
use crate::LockError;

mod admin;
mod idempotency;
mod kinds;

pub use idempotency::DEFAULT_IDEMPOTENCY_CAPACITY;

const SHARDS: usize = 64;

/// The in-process lock store. Cheap to clone; clones share the same locks.
///
/// ```
/// use dlock_runtime::{backend::MemoryBackend, Locker};
///
/// let store = MemoryBackend::new();
/// // Two lockers over one store exclude each other, like two instances over one Redis.
/// let a = Locker::new(store.clone());
/// let b = Locker::new(store);
/// # let _ = (a, b);
/// ```
#[derive(Clone, Debug)]
pub struct MemoryBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    fence: AtomicU64,
    hub: Arc<ReleaseHub>,
    idempotency: idempotency::Records,
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<Arc<str>, Entry>,
    sweep_at: usize,
}

#[derive(Debug, Default)]
struct Entry {
    holder: Option<(OwnerToken, Instant)>,
    /// The holder's fencing token.
    fence: u64,
    /// Waiters in arrival order, with the instant their entry expires.
    queue: VecDeque<(OwnerToken, Instant)>,
    /// A semaphore's or read-write lock's holders and waiters (`kinds`).
    shared: kinds::Shared,
}

impl Entry {
    fn live_holder(&self, now: Instant) -> Option<&(OwnerToken, Instant)> {
        self.holder.as_ref().filter(|(_, exp)| *exp > now)
    }

    fn prune_queue(&mut self, now: Instant) {
        while let Some((_, exp)) = self.queue.front() {
            if *exp > now {
                break;
            }
            self.queue.pop_front();
        }
    }

    fn is_dead(&self, now: Instant) -> bool {
        self.live_holder(now).is_none()
            && self.queue.iter().all(|(_, exp)| *exp <= now)
            && self.shared.is_dead(now)
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryBackend {
    /// An empty store.
    pub fn new() -> Self {
        MemoryBackend {
            inner: Arc::new(Inner {
                shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
                hasher: RandomState::new(),
                fence: AtomicU64::new(0),
                hub: ReleaseHub::new(),
                idempotency: Default::default(),
            }),
        }
    }

    /// Sets how many bytes this store's idempotency records
    /// ([`Locker::idempotency`](crate::Locker::idempotency), `IdempotencyLayer`) take at most
    /// (default [`DEFAULT_IDEMPOTENCY_CAPACITY`], 64 MiB; for every clone of this store). A
    /// record counts its key, its stored response and about 160 bytes. A record that takes
    /// them over it has, first, the notes of attempts that ended without `complete` or `abort`
    /// dropped (an operation dropped: its lock is gone, nothing reads the note again), then
    /// the completed records nearest their expiry, down to nine tenths of the capacity, with a
    /// `WARN` event `dlock.idempotency.evicted`: a retry whose record was dropped runs as a new
    /// request, as after its retention. Attempts that still hold their lock are never
    /// dropped. Size it for the records your retention keeps (requests per second × retention
    /// × response size); Redis and Postgres keep theirs in the server instead.
    ///
    /// ```
    /// use dlock_runtime::backend::MemoryBackend;
    ///
    /// let store = MemoryBackend::new().with_idempotency_capacity(256 * 1024 * 1024);
    /// # let _ = store;
    /// ```
    pub fn with_idempotency_capacity(self, bytes: usize) -> Self {
        self.inner.idempotency.set_capacity(bytes);
        self
    }

    /// How many keys currently have state (a live holder or live waiters); for tests and
    /// metrics.
    pub fn len(&self) -> usize {
        let now = Instant::now();
        self.inner
            .shards
            .iter()
            .map(|s| {
                let s = s.lock().unwrap_or_else(PoisonError::into_inner);
                s.map.values().filter(|e| !e.is_dead(now)).count()
            })
            .sum()
    }

    /// Frees the lock named `resource` (a [`ResourceName`] string such as `dlock:{order:1}`, or
    /// a semaphore's or read-write lock's, `dlock:{pool}:sem`, whose holders all go) whoever
    /// holds it, like `DEL` on the Redis backend: an operator's tool for a stuck lock,
    /// and how tests take a lock away behind its holder's back. The holder learns at its next
    /// renewal. Returns whether a live lock was freed.
    pub fn force_release(&self, resource: &str) -> bool {
        self.with_entry(resource, |e, now| {
            let held = e.live_holder(now).is_some();
            e.holder = None;
            e.shared.force_release(now) || held
        })
    }

    /// `true` when no key has a live holder or waiter.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn with_entry<R>(&self, name: &str, f: impl FnOnce(&mut Entry, Instant) -> R) -> R {
        let shard = &self.inner.shards[(self.inner.hasher.hash_one(name) as usize) % SHARDS];
        let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        let out = match shard.map.get_mut(name) {
            Some(e) => {
                let out = f(e, now);
                if e.is_dead(now) {
                    shard.map.remove(name);
                }
                out
            }
            None => {
                let mut e = Entry::default();
                let out = f(&mut e, now);
                if !e.is_dead(now) {
                    shard.map.insert(name.into(), e);
                    // Amortised sweep of entries whose leases ran out unobserved.
                    if shard.map.len() > shard.sweep_at {
                        shard.map.retain(|_, e| !e.is_dead(now));
                        shard.sweep_at = (shard.map.len() * 2).max(64);
                    }
                }
                out
            }
        };
        out
    }

    fn next_fence(&self) -> u64 {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        let mut cur = self.inner.fence.load(Ordering::Relaxed);
        loop {
            let next = (cur + 1).max(wall);
            match self.inner.fence.compare_exchange_weak(
                cur,
                next,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return next,
                Err(actual) => cur = actual,
            }
        }
    }

    /// After a release or abandon freed the lock: the token of the next live waiter.
    fn next_waiter(entry: &mut Entry, now: Instant) -> Option<OwnerToken> {
        entry.prune_queue(now);
        entry.queue.front().map(|(t, _)| t.clone())
    }

    fn attempt(&self, args: &AcquireArgs<'_>) -> Attempt {
        self.with_entry(args.resource.as_str(), |e, now| {
            e.prune_queue(now);
            if let Some((holder, exp)) = e.live_holder(now) {
                if holder == args.token {
                    // Already ours (an earlier attempt's reply was lost): a fresh grant.
                    e.holder = Some((args.token.clone(), now + args.ttl));
                    e.fence = self.next_fence();
                    return Attempt::Acquired {
                        fencing_token: e.fence,
                    };
                }
                let remaining = *exp - now;
                if args.mode == WaitMode::Queue {
                    enqueue(e, args.token, now + args.waiter_ttl);
                }
                return Attempt::Held {
                    remaining: Some(remaining),
                };
            }
            // Free: the first in line (live, after the prune) may take it until its entry ends.
            let ahead = match e.queue.front() {
                Some((head, until)) if head != args.token && args.mode != WaitMode::Barge => {
                    Some(*until - now)
                }
                _ => None,
            };
            if let Some(left) = ahead {
                if args.mode == WaitMode::Queue {
                    enqueue(e, args.token, now + args.waiter_ttl);
                }
                return Attempt::Held {
                    remaining: Some(left),
                };
            }
            e.queue.retain(|(t, _)| t != args.token);
            e.holder = Some((args.token.clone(), now + args.ttl));
            e.fence = self.next_fence();
            Attempt::Acquired {
                fencing_token: e.fence,
            }
        })
    }
}

fn enqueue(e: &mut Entry, token: &OwnerToken, expires: Instant) {
    match e.queue.iter_mut().find(|(t, _)| t == token) {
        Some(slot) => slot.1 = expires,
        None => e.queue.push_back((token.clone(), expires)),
    }
}

impl Backend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn idempotency(&self) -> Option<&dyn super::IdempotencyStore> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn super::AdminStore> {
        Some(self)
    }

    fn acquire<'a>(&'a self, args: AcquireArgs<'a>) -> BoxFuture<'a, Result<Attempt, LockError>> {
        let out = self.attempt(&args);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn acquire_kind<'a>(
        &'a self,
        args: AcquireArgs<'a>,
    ) -> BoxFuture<'a, Result<Attempt, LockError>> {
        let out = self.attempt_kind(&args);
        Box::pin(std::future::ready(Ok(out)))
    }

    fn release<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        if resource.kind() != LockKind::Exclusive {
            let released = self.release_kind(resource, token, false);
            return Box::pin(std::future::ready(Ok(released)));
        }
        let (released, next) =
            self.with_entry(resource.as_str(), |e, now| match e.live_holder(now) {
                Some((t, _)) if t == token => {
                    e.holder = None;
                    (true, Self::next_waiter(e, now))
                }
                _ => (false, None),
            });
        if released {
            self.inner
                .hub
                .notify(resource.as_str(), next.as_ref().map(OwnerToken::as_str));
        }
        Box::pin(std::future::ready(Ok(released)))
    }

    fn extend<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        if resource.kind() != LockKind::Exclusive {
            let ok = self.extend_kind(resource, token, ttl);
            return Box::pin(std::future::ready(Ok(ok)));
        }
        let ok = self.with_entry(resource.as_str(), |e, now| {
            match e.holder.as_mut().filter(|(_, exp)| *exp > now) {
                Some((t, exp)) if t == token => {
                    *exp = now + ttl;
                    true
                }
                _ => false,
            }
        });
        Box::pin(std::future::ready(Ok(ok)))
    }

    fn abandon<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<(), LockError>> {
        if resource.kind() != LockKind::Exclusive {
            self.release_kind(resource, token, true);
            return Box::pin(std::future::ready(Ok(())));
        }
        let wake = self.with_entry(resource.as_str(), |e, now| {
            let mut freed = false;
            if matches!(e.live_holder(now), Some((t, _)) if t == token) {
                e.holder = None;
                freed = true;
            }
            let before = e.queue.len();
            e.queue.retain(|(t, _)| t != token);
            let left_queue = e.queue.len() != before;
            if freed || (left_queue && e.live_holder(now).is_none()) {
                Some(Self::next_waiter(e, now))
            } else {
                None
            }
        });
        if let Some(next) = wake {
            self.inner
                .hub
                .notify(resource.as_str(), next.as_ref().map(OwnerToken::as_str));
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn watch<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        let (watch, _) = self.inner.hub.register(resource, token, None);
        Box::pin(std::future::ready(Ok(watch)))
    }
}
