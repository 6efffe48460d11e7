//! One watch stream per locker: every waiter's watch rides on it.
//!
//! A waiter watches the deletion of the key ahead of it (or of any key of its lock). Each watch
//! used to open a gRPC watch stream of its own, so a locker with a thousand waiters kept a
//! thousand streams open on the member — each a pair of goroutines and buffers on etcd's side.
//! etcd carries any number of watches on one stream, told apart by a watch id, and since 3.4 a
//! client may choose the id itself. So the backend keeps one stream ([`Watches`]) and a task
//! that owns it: a watch is a create request on it with a fresh id, its deletions come back
//! through a channel of its own ([`Watch::deleted`]), and dropping it cancels it on the server.
//!
//! **When the stream fails** (the member went away, lost its leader — requests carry etcd's
//! *require leader* flag —, or its runtime shut down), every watch on it fails at once, as
//! each of their streams would have: each waiter's task reads its line again and watches anew,
//! on a new stream. **A member that freezes** keeps the stream open and says nothing: while
//! watches are on it, a stream that has been quiet for [`super::pool::per_try`] of the command
//! timeout is probed — a second watch of a key one of its watches watches, created and
//! cancelled again, which etcd answers at once (a progress request may go unanswered while a
//! waiter's watch starts past the current revision, etcd-io/etcd#20229) — and one that still
//! says nothing within the command timeout is given up and its member put under suspicion, so
//! the new stream goes to another member. (A watch on a stream of its own on that member
//! waited for its waiter's fallback timer.) **A refused watch** (a permission the user lacks,
//! an auth token the member no longer takes) fails alone — etcd answers creates in order, and
//! from 3.5.5 on answers a refused one with watch id -1, so the task keeps the creates it has
//! not seen answered —, and the stream takes no new watches: the next one opens a stream on a
//! client that signs in again.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{EventType, WatchFilterType, WatchOptions};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::pool::{self, Pool};
use crate::LockError;

/// The deleted keys of one message of a watch, or why the watch ended.
type Deleted = Result<Vec<Vec<u8>>, LockError>;

/// The locker's watch stream, opened on first use and again after it failed.
pub(super) struct Watches {
    pool: Arc<Pool>,
    timeout: Duration,
    current: Mutex<Option<Stream>>,
    /// Held while a stream is opened: the watches that find none meanwhile wait for it.
    opening: tokio::sync::Mutex<()>,
    /// The next watch id (etcd takes 0 and -1 as "pick one"), shared with the streams' tasks
    /// for their probes.
    next_id: Arc<AtomicI64>,
}

/// A handle on the task that owns a stream.
#[derive(Clone)]
struct Stream {
    commands: mpsc::UnboundedSender<Command>,
    /// Set when the stream takes no new watches (it failed, or refused one).
    retired: Arc<AtomicBool>,
}

impl Stream {
    fn usable(&self) -> bool {
        !self.retired.load(Ordering::Acquire) && !self.commands.is_closed()
    }
}

enum Command {
    Create {
        id: i64,
        key: Vec<u8>,
        options: WatchOptions,
        deleted: mpsc::UnboundedSender<Deleted>,
    },
    Cancel(i64),
}

/// One waiter's watch of the deletions of a key (or a range of keys) from a revision on.
/// Dropped, it is cancelled on the server.
pub(super) struct Watch {
    id: i64,
    deleted: mpsc::UnboundedReceiver<Deleted>,
    commands: mpsc::UnboundedSender<Command>,
}

impl Watch {
    /// The keys the next message of the watch says were deleted (at least one); an error
    /// when the watch ended (its stream failed or the server cancelled it).
    pub(super) async fn deleted(&mut self) -> Result<Vec<Vec<u8>>, LockError> {
        match self.deleted.recv().await {
            Some(d) => d,
            None => Err(LockError::unavailable("etcd watch stream ended", None)),
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // Gone with the stream's task: nothing to cancel.
        let _ = self.commands.send(Command::Cancel(self.id));
    }
}

impl Watches {
    pub(super) fn new(pool: Arc<Pool>, timeout: Duration) -> Self {
        Watches {
            pool,
            timeout,
            current: Mutex::new(None),
            opening: tokio::sync::Mutex::new(()),
            next_id: Arc::new(AtomicI64::new(1)),
        }
    }

    /// The clients the stream is opened on (a waiter's reads go there too).
    pub(super) fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Watches the deletions of `key` — of the keys from `key` up to `range_end`, if given —
    /// from revision `from` on: on the locker's stream, opened first if there is none.
    pub(super) async fn watch(
        &self,
        key: &[u8],
        range_end: Option<&[u8]>,
        from: i64,
    ) -> Result<Watch, LockError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut options = WatchOptions::new()
            .with_start_revision(from)
            .with_filters([WatchFilterType::NoPut])
            .with_watch_id(id);
        if let Some(end) = range_end {
            options = options.with_range(end.to_vec());
        }
        let key = key.to_vec();
        let (tx, deleted) = mpsc::unbounded_channel();
        // On the stream there is, unless it went (twice at most: a stream opened just now
        // goes only if its runtime is shutting down, and this task with it).
        for _ in 0..2 {
            if let Some(commands) = self.send_on_current(id, &key, &options, &tx) {
                return Ok(Watch {
                    id,
                    deleted,
                    commands,
                });
            }
            let _one = tokio::time::timeout(self.timeout, self.opening.lock())
                .await
                .map_err(|_| LockError::unavailable("etcd watch: no stream in time", None))?;
            if self.current_stream().is_some() {
                continue; // opened by another watch meanwhile
            }
            // The stream is opened by this watch's create.
            let (member, stream) = pool::open_on_one(&self.pool, self.timeout, "watch", |c| {
                let mut watch = c.watch_client();
                let (key, options) = (key.clone(), options.clone());
                async move { watch.watch(key, Some(options)).await }
            })
            .await?;
            let (commands, requests) = mpsc::unbounded_channel();
            let retired = Arc::new(AtomicBool::new(false));
            let task = Task {
                pool: self.pool.clone(),
                member,
                timeout: self.timeout,
                retired: retired.clone(),
                watching: HashMap::from([(
                    id,
                    Watched {
                        key: key.clone(),
                        deleted: tx,
                    },
                )]),
                unanswered: VecDeque::from([id]),
                next_id: self.next_id.clone(),
            };
            tokio::spawn(task.run(stream, requests));
            *self.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(Stream {
                commands: commands.clone(),
                retired,
            });
            return Ok(Watch {
                id,
                deleted,
                commands,
            });
        }
        Err(LockError::unavailable(
            "etcd watch: its stream went as it was opened",
            None,
        ))
    }

    /// The stream there is, if it takes new watches.
    fn current_stream(&self) -> Option<Stream> {
        let current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        current.as_ref().filter(|s| s.usable()).cloned()
    }

    /// Sends the create of watch `id` to the stream there is: its command sender, or `None`
    /// when there is no stream that takes it.
    fn send_on_current(
        &self,
        id: i64,
        key: &[u8],
        options: &WatchOptions,
        deleted: &mpsc::UnboundedSender<Deleted>,
    ) -> Option<mpsc::UnboundedSender<Command>> {
        let stream = self.current_stream()?;
        let create = Command::Create {
            id,
            key: key.to_vec(),
            options: options.clone(),
            deleted: deleted.clone(),
        };
        stream.commands.send(create).ok()?;
        Some(stream.commands)
    }
}

/// The task that owns a stream: sends its watches' creates and cancels, hands each message's
/// deletions to its watch, and keeps the stream under watch while watches are on it.
struct Task {
    pool: Arc<Pool>,
    member: usize,
    timeout: Duration,
    retired: Arc<AtomicBool>,
    watching: HashMap<i64, Watched>,
    /// The creates sent and not yet answered, oldest first: etcd answers them in order, and
    /// answers a refused one (etcd ≥ 3.5.5) with watch id -1 instead of its own.
    unanswered: VecDeque<i64>,
    next_id: Arc<AtomicI64>,
}

/// A watch on the stream: the key it watches (from), and where its deletions go.
struct Watched {
    key: Vec<u8>,
    deleted: mpsc::UnboundedSender<Deleted>,
}

impl Task {
    async fn run(
        mut self,
        stream: etcd_client::WatchStream,
        mut commands: mpsc::UnboundedReceiver<Command>,
    ) {
        let (mut requests, mut responses) = stream.split();
        let quiet = pool::per_try(self.timeout);
        let mut heard = Instant::now();
        // When a quiet stream was probed, until something comes. A probe is a second watch of
        // a watched key, cancelled once created: etcd answers a create at once, where it may
        // hold back the answer to a progress request (etcd-io/etcd#20229: while a watch on the
        // stream starts past the current revision, as a waiter's does until the next write).
        let mut asked: Option<Instant> = None;
        let mut tick = tokio::time::interval(quiet);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let why = loop {
            tokio::select! {
                command = commands.recv() => {
                    let Some(command) = command else {
                        // The backend and every watch are gone.
                        return;
                    };
                    let sent = match command {
                        Command::Create { id, key, options, deleted } => {
                            self.watching.insert(
                                id,
                                Watched {
                                    key: key.clone(),
                                    deleted,
                                },
                            );
                            // The first watch after a quiet spell: is the stream still there?
                            if asked.is_none() && heard.elapsed() >= quiet {
                                asked = Some(Instant::now());
                                if let Err(e) = self.probe(&mut requests).await {
                                    break e;
                                }
                            }
                            self.unanswered.push_back(id);
                            self.within(requests.watch(key, Some(options))).await
                        }
                        Command::Cancel(id) => match self.watching.remove(&id) {
                            Some(_) => self.within(requests.cancel(id)).await,
                            None => Ok(()),
                        },
                    };
                    if let Err(e) = sent {
                        break e;
                    }
                }
                message = responses.message() => match message {
                    Ok(Some(m)) => {
                        heard = Instant::now();
                        asked = None;
                        if let Some(probe) = self.deliver(&m) {
                            // A probe's answer: its watch goes again.
                            if let Err(e) = self.within(requests.cancel(probe)).await {
                                break e;
                            }
                        }
                    }
                    Ok(None) => break "the stream ended".to_owned(),
                    Err(e) => break format!("the stream failed: {e}"),
                },
                _ = tick.tick() => {
                    if self.watching.is_empty() {
                        asked = None;
                        continue;
                    }
                    match asked {
                        Some(at) if at.elapsed() >= self.timeout => {
                            self.pool.suspect(self.member);
                            break format!("the member said nothing for {:?}", self.timeout);
                        }
                        Some(_) => {}
                        None if heard.elapsed() >= quiet => {
                            asked = Some(Instant::now());
                            if let Err(e) = self.probe(&mut requests).await {
                                break e;
                            }
                        }
                        None => {}
                    }
                }
            }
        };
        self.retired.store(true, Ordering::Release);
        tracing::debug!(reason = %why, watches = self.watching.len(), "etcd watch stream given up");
        for (_, watched) in self.watching.drain() {
            let _ = watched.deleted.send(Err(LockError::unavailable(
                format!("etcd watch stream: {why}"),
                None,
            )));
        }
    }

    /// Sends a request on the stream, within the command timeout (a frozen member's HTTP/2
    /// window fills up, and the send would wait for good).
    async fn within(
        &self,
        send: impl std::future::Future<Output = Result<(), etcd_client::Error>>,
    ) -> Result<(), String> {
        match tokio::time::timeout(self.timeout, send).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!("a request could not be sent: {e}")),
            Err(_) => {
                self.pool.suspect(self.member);
                Err(format!("a request was not taken within {:?}", self.timeout))
            }
        }
    }

    /// Sends a probe: a create of a second watch, from now on, of a key one of the stream's
    /// watches watches (one the user may read, whatever its permissions), which etcd answers at
    /// once (the answer is cancelled when it comes, see [`deliver`](Self::deliver)). Nothing to
    /// probe without a watch.
    async fn probe(
        &mut self,
        requests: &mut etcd_client::WatchRequestSender,
    ) -> Result<(), String> {
        let Some(key) = self.watching.values().next().map(|w| w.key.clone()) else {
            return Ok(());
        };
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.unanswered.push_back(id);
        let options = WatchOptions::new()
            .with_filters([WatchFilterType::NoPut])
            .with_watch_id(id);
        self.within(requests.watch(key, Some(options))).await
    }

    /// Hands the deletions of message `m` to its watch, or ends the watch the server
    /// cancelled. Answers the id of a probe's watch that was created (to be cancelled).
    fn deliver(&mut self, m: &etcd_client::WatchResponse) -> Option<i64> {
        let mut id = m.watch_id();
        if m.created() {
            id = answered(&mut self.unanswered, id)?;
            if !m.canceled() && !self.watching.contains_key(&id) {
                // A probe's (or a watch whose waiter left meanwhile: cancelling it twice is
                // harmless).
                return Some(id);
            }
        }
        if m.canceled() {
            let reason = m.cancel_reason();
            if !reason.is_empty() {
                // Refused (a permission, an auth token): new watches go to a new stream, on
                // a client that signs in again if need be.
                self.retired.store(true, Ordering::Release);
            }
            if let Some(watched) = self.watching.remove(&id) {
                let why = match (reason, m.compact_revision()) {
                    ("", c) if c > 0 => format!("compacted up to revision {c}"),
                    ("", _) => "cancelled".to_owned(),
                    (r, _) => r.to_owned(),
                };
                let _ = watched.deleted.send(Err(LockError::unavailable(
                    format!("etcd watch ended: {why}"),
                    None,
                )));
            }
            return None;
        }
        let keys: Vec<Vec<u8>> = m
            .events()
            .iter()
            .filter(|e| e.event_type() == EventType::Delete)
            .filter_map(|e| e.kv().map(|kv| kv.key().to_vec()))
            .collect();
        if keys.is_empty() {
            return None;
        }
        if let Some(watched) = self.watching.get(&id) {
            // A watch dropped meanwhile is cancelled by its own drop.
            let _ = watched.deleted.send(Ok(keys));
        }
        None
    }
}

/// The create a `created` answer with watch id `id` answers, taken off `unanswered` (oldest
/// first): its own, or — an id below 0, a refusal from etcd ≥ 3.5.5 — the oldest.
fn answered(unanswered: &mut VecDeque<i64>, id: i64) -> Option<i64> {
    if id < 0 {
        return unanswered.pop_front();
    }
    unanswered.retain(|u| *u != id);
    Some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// etcd answers a stream's creates in order, a refused one (from 3.5.5 on) with id -1: the
    /// refusal is the oldest unanswered create's, so its waiter is told (it was left waiting,
    /// its watch never answered, the -1 matching no watch).
    #[test]
    fn a_refused_create_is_the_oldest_unanswered_one() {
        let mut unanswered = VecDeque::from([4, 5, 6]);
        assert_eq!(answered(&mut unanswered, 4), Some(4));
        assert_eq!(answered(&mut unanswered, -1), Some(5));
        assert_eq!(answered(&mut unanswered, 6), Some(6));
        assert!(unanswered.is_empty());
        assert_eq!(answered(&mut unanswered, -1), None);
        // An answer out of the expected order (never seen) takes only its own.
        let mut unanswered = VecDeque::from([7, 8]);
        assert_eq!(answered(&mut unanswered, 8), Some(8));
        assert_eq!(answered(&mut unanswered, -1), Some(7));
    }
}
