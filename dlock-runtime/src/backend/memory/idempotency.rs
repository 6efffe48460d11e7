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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::MemoryBackend;
use crate::backend::idempotency::{BeginArgs, BeginReply, CompleteArgs, IdempotencyStore};
use crate::backend::{BoxFuture, OwnerToken};
use crate::key::ResourceName;
use crate::LockError;

/// The record map of one [`MemoryBackend`].
#[derive(Default)]
pub(super) struct Records {
    inner: Mutex<RecordMap>,
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let map = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Records")
            .field("len", &map.map.len())
            .finish()
    }
}

#[derive(Default)]
struct RecordMap {
    map: HashMap<Arc<str>, Record>,
    sweep_at: usize,
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

impl RecordMap {
    fn get(&mut self, name: &str, now: Instant) -> Option<&Record> {
        if self.map.get(name).is_some_and(|r| r.expires <= now) {
            self.map.remove(name);
        }
        self.map.get(name)
    }

    fn insert(&mut self, name: &str, record: Record, now: Instant) {
        self.map.insert(name.into(), record);
        if self.map.len() > self.sweep_at {
            self.map.retain(|_, r| r.expires > now);
            self.sweep_at = (self.map.len() * 2).max(64);
        }
    }
}

impl Records {
    fn lock(&self) -> std::sync::MutexGuard<'_, RecordMap> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl MemoryBackend {
    fn records(&self) -> &Records {
        &self.inner.idempotency
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
            if !e.queue.is_empty() {
                return BeginReply::Held {
                    remaining: None,
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
                    records.map.remove(name);
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
