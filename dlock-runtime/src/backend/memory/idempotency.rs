//! Idempotency records of the in-process backend.
//!
//! Records live in one map per backend, next to the sharded lock map. Every step runs inside
//! the lock entry's shard mutex (taken by `with_entry`), and takes the record map's mutex only
//! while holding it (always in that order), so "read the record, look at the lock, take the
//! lock, note the fingerprint" and "store the record, release the lock" are each atomic with
//! respect to the lock state, exactly like the Redis scripts.
//!
//! A record is either the note of a running attempt (its fingerprint and owner token, read
//! only while that owner's lock lives) or a completed record (fingerprint and result bytes).
//! Both expire after the retention period; expired entries are dropped when touched and by an
//! amortised sweep.
//!
//! The records of one backend take at most its capacity
//! ([`MemoryBackend::with_idempotency_capacity`], default [`DEFAULT_IDEMPOTENCY_CAPACITY`]):
//! each counts its key, its result and [`RECORD_OVERHEAD`]. A record that takes them over it
//! starts a trim, outside the locks: first the notes of attempts whose lock is gone (the
//! operation was dropped without `complete` or `abort` and its lock released in the
//! background, or its lease ran out) — they are read only while that lock lives, so nothing
//! reads them again —, then the completed records nearest their expiry, down to nine tenths of
//! the capacity (so a full store trims once per tenth of its capacity, not on every record).
//! Notes of attempts that still hold their lock are never dropped; should they alone take the
//! records over the capacity, the next trim waits until another tenth of it has been added.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::MemoryBackend;
use crate::backend::idempotency::{BeginArgs, BeginReply, CompleteArgs, IdempotencyStore};
use crate::backend::{BoxFuture, OwnerToken};
use crate::key::ResourceName;
use crate::LockError;

/// How many bytes the idempotency records of a [`MemoryBackend`] take at most unless set
/// otherwise ([`MemoryBackend::with_idempotency_capacity`]): 64 MiB.
pub const DEFAULT_IDEMPOTENCY_CAPACITY: usize = 64 * 1024 * 1024;

/// What a record counts beside its key and result: the map's slot, the record, the key's and
/// result's allocation headers, an owner token.
const RECORD_OVERHEAD: usize = 160;

/// The record map of one [`MemoryBackend`].
pub(super) struct Records {
    inner: Mutex<RecordMap>,
    capacity: AtomicUsize,
    /// A trim is running (one at a time: two would each drop a tenth of the capacity).
    trimming: AtomicBool,
}

impl Default for Records {
    fn default() -> Self {
        Records {
            inner: Mutex::default(),
            capacity: AtomicUsize::new(DEFAULT_IDEMPOTENCY_CAPACITY),
            trimming: AtomicBool::new(false),
        }
    }
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let map = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Records")
            .field("len", &map.map.len())
            .field("bytes", &map.bytes)
            .field("capacity", &self.capacity.load(Ordering::Relaxed))
            .finish()
    }
}

#[derive(Default)]
struct RecordMap {
    map: HashMap<Arc<str>, Record>,
    sweep_at: usize,
    /// What the records count, [`Record::size`] each.
    bytes: usize,
    /// Over the capacity, no trim before the records count more than this (0: at once).
    trim_at: usize,
}

struct Record {
    fingerprint: [u8; 32],
    state: State,
    expires: Instant,
}

enum State {
    /// The attempt holding `owner`'s lock is running.
    Running { owner: OwnerToken },
    /// The stored result.
    Done { result: Arc<[u8]> },
}

impl Record {
    fn size(&self, name: &str) -> usize {
        let result = match &self.state {
            State::Running { .. } => 0,
            State::Done { result } => result.len(),
        };
        name.len() + result + RECORD_OVERHEAD
    }
}

impl RecordMap {
    fn get(&mut self, name: &str, now: Instant) -> Option<&Record> {
        if self.map.get(name).is_some_and(|r| r.expires <= now) {
            self.remove(name);
        }
        self.map.get(name)
    }

    fn remove(&mut self, name: &str) {
        if let Some((name, r)) = self.map.remove_entry(name) {
            self.bytes -= r.size(&name);
        }
    }

    fn insert(&mut self, name: &str, record: Record, now: Instant) {
        self.bytes += record.size(name);
        if let Some(old) = self.map.insert(name.into(), record) {
            self.bytes -= old.size(name);
        }
        if self.map.len() > self.sweep_at {
            self.sweep(|r| r.expires > now);
            self.sweep_at = (self.map.len() * 2).max(64);
        }
    }

    /// Whether the records take more than `capacity` and a trim is due
    /// ([`MemoryBackend::trim_records`]).
    fn trim_due(&self, capacity: usize) -> bool {
        self.bytes > capacity && self.bytes > self.trim_at
    }

    /// The notes of running attempts: record name and owner.
    fn notes(&self) -> Vec<(Arc<str>, OwnerToken)> {
        self.map
            .iter()
            .filter_map(|(name, r)| match &r.state {
                State::Running { owner } => Some((name.clone(), owner.clone())),
                State::Done { .. } => None,
            })
            .collect()
    }

    /// Removes `name`'s record if it is still the note of `owner`'s attempt.
    fn remove_note(&mut self, name: &str, owner: &OwnerToken) {
        if matches!(self.map.get(name), Some(Record { state: State::Running { owner: o }, .. }) if o == owner)
        {
            self.remove(name);
        }
    }

    fn sweep(&mut self, mut keep: impl FnMut(&Record) -> bool) {
        let mut freed = 0;
        self.map.retain(|name, r| {
            let kept = keep(r);
            if !kept {
                freed += r.size(name);
            }
            kept
        });
        self.bytes -= freed;
    }

    /// The expiry and size of every completed record.
    fn done_records(&self) -> Vec<(Instant, usize)> {
        self.map
            .iter()
            .filter(|(_, r)| matches!(r.state, State::Done { .. }))
            .map(|(name, r)| (r.expires, r.size(name)))
            .collect()
    }

    /// Drops the completed records that expire at or before `until`.
    fn evict_until(&mut self, until: Instant) {
        let before = self.map.len();
        self.sweep(|r| !matches!(r.state, State::Done { .. }) || r.expires > until);
        // The records were over their capacity: the completed ones nearest their expiry went.
        tracing::warn!(
            dropped = before - self.map.len(),
            bytes = self.bytes,
            "dlock.idempotency.evicted"
        );
    }
}

/// The expiry up to which completed records (`done`: expiry and size) must go, nearest their
/// expiry first, to free `over` bytes; `None` when there is nothing to free or nothing to drop.
fn eviction_cutoff(mut done: Vec<(Instant, usize)>, mut over: usize) -> Option<Instant> {
    done.sort_unstable_by_key(|&(expires, _)| expires);
    let mut until = None;
    for (expires, size) in done {
        if over == 0 {
            break;
        }
        over = over.saturating_sub(size);
        until = Some(expires);
    }
    until
}

impl Records {
    fn lock(&self) -> std::sync::MutexGuard<'_, RecordMap> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn capacity(&self) -> usize {
        self.capacity.load(Ordering::Relaxed)
    }

    pub(super) fn set_capacity(&self, bytes: usize) {
        self.capacity.store(bytes, Ordering::Relaxed);
    }
}

impl MemoryBackend {
    fn records(&self) -> &Records {
        &self.inner.idempotency
    }

    /// What the idempotency records count now, in bytes.
    #[cfg(test)]
    pub(crate) fn idempotency_bytes(&self) -> usize {
        self.records().lock().bytes
    }

    /// Brings the records back under their capacity, if they are over it and a trim is due:
    /// the notes of attempts whose lock is gone first, then completed records nearest their
    /// expiry, down to nine tenths of the capacity. Takes the locks itself (a lock entry's
    /// shard, then the records): call it holding neither.
    pub(super) fn trim_records(&self) {
        let records = self.records();
        let capacity = records.capacity();
        let notes = {
            let map = records.lock();
            if !map.trim_due(capacity) || records.trimming.swap(true, Ordering::Acquire) {
                return;
            }
            map.notes()
        };
        let _trimming = Trimming(&records.trimming);
        for (name, owner) in notes {
            self.with_entry(&name, |e, now| {
                if !e.live_holder(now).is_some_and(|(t, _)| *t == owner) {
                    records.lock().remove_note(&name, &owner);
                }
            });
        }
        // The completed records are sorted outside the records' mutex (a full store holds
        // some 200,000 of them); one stored meanwhile goes too only if it expires by `until`.
        let done = {
            let map = records.lock();
            let over = map.bytes.saturating_sub(capacity / 10 * 9);
            (map.bytes > capacity).then(|| (map.done_records(), over))
        };
        let until = done.and_then(|(done, over)| eviction_cutoff(done, over));
        let mut map = records.lock();
        if let Some(until) = until {
            map.evict_until(until);
        }
        map.trim_at = if map.bytes > capacity {
            map.bytes + capacity / 10
        } else {
            0
        };
    }
}

/// Clears [`Records::trimming`] when the trim ends.
struct Trimming<'a>(&'a AtomicBool);

impl Drop for Trimming<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

fn expiry(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 60 * 60))
}

impl IdempotencyStore for MemoryBackend {
    fn begin<'a>(&'a self, args: BeginArgs<'a>) -> BoxFuture<'a, Result<BeginReply, LockError>> {
        let name = args.resource.as_str();
        let reply = self.with_entry(name, |e, now| {
            let mut records = self.records().lock();
            let record = records.get(name, now);
            if let Some(Record {
                fingerprint,
                state: State::Done { result },
                ..
            }) = record
            {
                return if fingerprint == args.fingerprint.as_bytes() {
                    BeginReply::Replay {
                        record: result.to_vec(),
                    }
                } else {
                    BeginReply::Mismatch
                };
            }
            if let Some((holder, _)) = e.live_holder(now).filter(|(h, _)| h == args.token) {
                // This attempt's own lock (its begin sent again): its lease restarts.
                let holder = holder.clone();
                e.holder = Some((holder, expiry(now, args.ttl)));
                return BeginReply::Acquired {
                    fencing_token: e.fence,
                };
            }
            if let Some((holder, exp)) = e.live_holder(now) {
                let same_fingerprint = match record {
                    Some(Record {
                        fingerprint,
                        state: State::Running { owner },
                        ..
                    }) if owner == holder => Some(fingerprint == args.fingerprint.as_bytes()),
                    _ => None,
                };
                return BeginReply::Held {
                    remaining: Some(*exp - now),
                    same_fingerprint,
                };
            }
            // A single attempt that respects the fair queue (`WaitMode::Try`).
            e.prune_queue(now);
            if let Some((_, until)) = e.queue.front() {
                // Free, but the first in line may take it until its entry ends.
                return BeginReply::Held {
                    remaining: Some(*until - now),
                    same_fingerprint: None,
                };
            }
            e.holder = Some((args.token.clone(), expiry(now, args.ttl)));
            records.insert(
                name,
                Record {
                    fingerprint: *args.fingerprint.as_bytes(),
                    state: State::Running {
                        owner: args.token.clone(),
                    },
                    expires: expiry(now, args.retention),
                },
                now,
            );
            e.fence = self.next_fence();
            BeginReply::Acquired {
                fencing_token: e.fence,
            }
        });
        self.trim_records();
        Box::pin(std::future::ready(Ok(reply)))
    }

    fn complete<'a>(&'a self, args: CompleteArgs<'a>) -> BoxFuture<'a, Result<bool, LockError>> {
        let name = args.resource.as_str();
        let (done, next) = self.with_entry(name, |e, now| match e.live_holder(now) {
            Some((t, _)) if t == args.token => {
                e.holder = None;
                self.records().lock().insert(
                    name,
                    Record {
                        fingerprint: *args.fingerprint.as_bytes(),
                        state: State::Done {
                            result: args.record.into(),
                        },
                        expires: expiry(now, args.retention),
                    },
                    now,
                );
                (true, Self::next_waiter(e, now))
            }
            _ => (false, None),
        });
        if done {
            self.inner
                .hub
                .notify(name, next.as_ref().map(OwnerToken::as_str));
            // After the wake-up: the next waiter need not wait for a trim.
            self.trim_records();
        }
        Box::pin(std::future::ready(Ok(done)))
    }

    fn abort<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        let name = resource.as_str();
        let (released, next) = self.with_entry(name, |e, now| match e.live_holder(now) {
            Some((t, _)) if t == token => {
                e.holder = None;
                let mut records = self.records().lock();
                if matches!(
                    records.get(name, now),
                    Some(Record { state: State::Running { owner }, .. }) if owner == token
                ) {
                    records.remove(name);
                }
                (true, Self::next_waiter(e, now))
            }
            _ => (false, None),
        });
        if released {
            self.inner
                .hub
                .notify(name, next.as_ref().map(OwnerToken::as_str));
        }
        Box::pin(std::future::ready(Ok(released)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_count_follows_inserts_replacements_removals_and_sweeps() {
        let now = Instant::now();
        let mut m = RecordMap::default();
        let sum = |m: &RecordMap| m.map.iter().map(|(k, r)| r.size(k)).sum::<usize>();
        let done = |len: usize, expires| Record {
            fingerprint: [0; 32],
            state: State::Done {
                result: vec![0; len].into(),
            },
            expires,
        };
        let later = now + Duration::from_secs(60);
        m.insert("a", done(100, later), now);
        m.insert("b", done(10, now + Duration::from_millis(1)), now);
        m.insert("a", done(1000, later), now);
        assert_eq!(m.bytes, sum(&m));
        assert_eq!(m.bytes, 1000 + 10 + 2 + 2 * RECORD_OVERHEAD);
        m.remove("a");
        assert_eq!(m.bytes, sum(&m));
        m.insert("a", done(7, later), now);
        m.sweep(|r| r.expires > now + Duration::from_secs(1));
        assert_eq!(m.map.len(), 1);
        assert_eq!(m.bytes, sum(&m));
        assert!(m.get("a", later).is_none(), "expired when touched");
        assert_eq!(m.bytes, 0);
    }
}
