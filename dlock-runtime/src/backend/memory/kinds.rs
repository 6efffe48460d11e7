//! Semaphores and read-write locks of the in-process backend: the rule of
//! [`backend`](crate::backend#semaphores-and-read-write-locks) over a holder list and a FIFO
//! queue per name, inside the name's shard mutex (`with_entry`), like the plain lock.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::MemoryBackend;
use crate::backend::{AcquireArgs, Attempt, OwnerToken, WaitMode};
use crate::key::ResourceName;

/// One holder or waiter: its token, whether it is exclusive (a writer), and when its lease
/// (holder) or entry (waiter) ends.
#[derive(Debug)]
struct Hold {
    token: OwnerToken,
    exclusive: bool,
    until: Instant,
}

/// A semaphore's or read-write lock's state.
#[derive(Debug, Default)]
pub(super) struct Shared {
    holders: Vec<Hold>,
    queue: VecDeque<Hold>,
}

/// Room for one more holder (`exclusive` or shared) beside `held` holders, `writer` of them
/// exclusive, under `capacity`.
fn fits(held: usize, writer: bool, exclusive: bool, capacity: u32) -> bool {
    if exclusive {
        held == 0
    } else {
        !writer && held < capacity as usize
    }
}

impl Shared {
    pub(super) fn is_dead(&self, now: Instant) -> bool {
        self.holders.iter().all(|h| h.until <= now) && self.queue.iter().all(|w| w.until <= now)
    }

    /// Drops every holder (an operator's `force_release`); answers whether one was live.
    pub(super) fn force_release(&mut self, now: Instant) -> bool {
        let live = self.holders.iter().any(|h| h.until > now);
        self.holders.clear();
        live
    }

    fn prune(&mut self, now: Instant) {
        self.holders.retain(|h| h.until > now);
        self.queue.retain(|w| w.until > now);
    }

    /// How many waiters at the head of the queue fit beside the holders and the waiters before
    /// them (the ready prefix), and the holders' count and writer flag after admitting them.
    fn ready(&self, capacity: u32) -> (usize, usize, bool) {
        let mut held = self.holders.len();
        let mut writer = self.holders.iter().any(|h| h.exclusive);
        for (i, w) in self.queue.iter().enumerate() {
            if !fits(held, writer, w.exclusive, capacity) {
                return (i, held, writer);
            }
            held += 1;
            writer |= w.exclusive;
        }
        (self.queue.len(), held, writer)
    }

    /// The tokens of the ready prefix: the waiters a release must wake.
    fn ready_tokens(&self, capacity: u32) -> Vec<OwnerToken> {
        let (n, _, _) = self.ready(capacity);
        self.queue.iter().take(n).map(|w| w.token.clone()).collect()
    }

    /// Until the first holder's lease or queue entry ends: the line may move then (a waiter
    /// ahead that died blocks it until its entry ends). After `prune`.
    fn remaining(&self, now: Instant) -> Option<Duration> {
        (self.holders.iter().chain(&self.queue))
            .map(|h| h.until - now)
            .min()
    }
}

impl MemoryBackend {
    pub(super) fn attempt_kind(&self, args: &AcquireArgs<'_>) -> Attempt {
        let kind = args.resource.kind();
        let (exclusive, capacity) = (kind.is_exclusive(), kind.capacity());
        self.with_entry(args.resource.as_str(), |e, now| {
            let s = &mut e.shared;
            s.prune(now);
            if let Some(h) = s.holders.iter_mut().find(|h| &h.token == args.token) {
                // Already ours (an earlier attempt's reply was lost): a fresh grant.
                h.until = now + args.ttl;
                return Attempt::Acquired {
                    fencing_token: self.next_fence(),
                };
            }
            let granted = match args.mode {
                WaitMode::Barge => {
                    let writer = s.holders.iter().any(|h| h.exclusive);
                    fits(s.holders.len(), writer, exclusive, capacity)
                }
                WaitMode::Try => {
                    let (n, held, writer) = s.ready(capacity);
                    n == s.queue.len() && fits(held, writer, exclusive, capacity)
                }
                _ => {
                    let until = now + args.waiter_ttl;
                    let pos = match s.queue.iter().position(|w| &w.token == args.token) {
                        Some(p) => {
                            s.queue[p].until = until;
                            p
                        }
                        None => {
                            s.queue.push_back(Hold {
                                token: args.token.clone(),
                                exclusive,
                                until,
                            });
                            s.queue.len() - 1
                        }
                    };
                    s.ready(capacity).0 > pos
                }
            };
            if !granted {
                return Attempt::Held {
                    remaining: s.remaining(now),
                };
            }
            s.queue.retain(|w| &w.token != args.token);
            s.holders.push(Hold {
                token: args.token.clone(),
                exclusive,
                until: now + args.ttl,
            });
            Attempt::Acquired {
                fencing_token: self.next_fence(),
            }
        })
    }

    /// Owner-checked release (or, with `abandon`, also leaving the queue); wakes the new ready
    /// prefix when room was made. Answers whether `token` held a live lease.
    pub(super) fn release_kind(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        abandon: bool,
    ) -> bool {
        let capacity = resource.kind().capacity();
        let (held, wake) = self.with_entry(resource.as_str(), |e, now| {
            let s = &mut e.shared;
            s.prune(now);
            let before = (s.holders.len(), s.queue.len());
            s.holders.retain(|h| &h.token != token);
            if abandon {
                s.queue.retain(|w| &w.token != token);
            }
            let held = s.holders.len() != before.0;
            let changed = held || s.queue.len() != before.1;
            (
                held,
                if changed {
                    s.ready_tokens(capacity)
                } else {
                    Vec::new()
                },
            )
        });
        for t in &wake {
            self.inner.hub.notify(resource.as_str(), Some(t.as_str()));
        }
        // Room made and nobody in line: a barging waiter (`fair(false)`, not in the line) is
        // woken to try again, as a lock's release wakes one.
        if held && wake.is_empty() {
            self.inner.hub.notify(resource.as_str(), None);
        }
        held
    }

    pub(super) fn extend_kind(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        ttl: Duration,
    ) -> bool {
        self.with_entry(resource.as_str(), |e, now| {
            match e
                .shared
                .holders
                .iter_mut()
                .find(|h| &h.token == token && h.until > now)
            {
                Some(h) => {
                    h.until = now + ttl;
                    true
                }
                None => false,
            }
        })
    }
}
