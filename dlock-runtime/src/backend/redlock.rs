//! Redlock: one lock over N independent Redis servers, held while a majority agrees.
//!
//! # When to use which backend
//!
//! * **One Redis server** ([`RedisBackend`]) is the right default when the lock is about
//!   *efficiency* — not doing the same work twice, not sending two e-mails. If that server
//!   fails over or restarts, a lock can be granted twice for a moment; the cost is some
//!   duplicated work.
//! * **Redlock** keeps locking through the loss of a minority of servers (1 of 3, 2 of 5), and a
//!   single server's restart does not hand out a second lock as long as the restart rules below
//!   are followed. It is still a lease on wall-clock time across machines: a process that pauses
//!   past its lease (GC, SIGSTOP, a VM migration) can act after its lock has moved on, and clock
//!   jumps on the servers shorten leases. That is Martin Kleppmann's critique, and antirez's
//!   answer is to bound those risks, not to remove them.
//! * **When correctness depends on it** (money moves, a record must never be written by two
//!   owners), use fencing: pass [`LockGuard::fencing_token`](crate::LockGuard::fencing_token) to
//!   the resource and let it reject lower tokens — with any backend. If the resource cannot check
//!   tokens, use a consensus store (etcd, ZooKeeper, a database transaction) instead of a lease.
//!
//! # Algorithm
//!
//! * **Acquire** sends the acquire script to every node at once, each with its own deadline
//!   ([`RedlockOptions::node_timeout`], far below the TTL). It returns as soon as a majority has
//!   granted the lock or a majority can no longer grant it. Node errors and timeouts are "no"
//!   votes. The lock is valid for `TTL − elapsed − drift`, where
//!   `drift = TTL × drift_factor + 2 ms` (`drift_factor` 0.01 by default, as the Redis
//!   documentation suggests); if no validity is left, it counts as a failure. A failed attempt
//!   undoes itself on **every** node, including those that did not answer (their reply may still
//!   come; the undo is queued behind it on the same connection), each bounded by the node timeout.
//!   The attempt answers once the nodes that answered it have answered their undo (nothing is left
//!   on them); the same token's next attempt waits for the others' first: it must not overtake its
//!   undo on a node (the undo would then take back that node's new vote). So while a node is
//!   frozen, a failed attempt still answers in two round trips (a `try_acquire` of a held lock, a
//!   409), and a waiter's next attempt, which comes after a release's notification or a timer,
//!   waits at most what is left of the node timeout. An undo a node did not confirm in that time
//!   may still land later, after a later attempt of the same token was granted there: a connection
//!   that went silent is replaced by a new one, but what was sent on the old one can still arrive
//!   (a partition heals, TCP resends) — and the undo cannot tell the two grants apart. So from then
//!   on that node's "yes" to the same token counts as a failure in the token's acquires and
//!   extensions: the token's lock never rests on a node an old undo may still empty. (Its lock may
//!   still sit there; it is extended and released with the others.) This lasts until the token's
//!   release, or until nothing asked about it for 20 minutes (the kernel stops resending an
//!   unanswered segment after about 15 by default); an undo that failed with the server's answer,
//!   or could not be sent at all, never lands later and counts for nothing. A majority that granted
//!   the lock only after its validity ran out answers `Unavailable` (the nodes are too slow for the
//!   TTL), not "held".
//! * **Extend / renewal** succeeds only if a majority extends within the validity window; the
//!   watchdog uses it, and a guard is lost when a majority can no longer be renewed.
//! * **Release** goes to every node; notifications from any node wake local waiters.
//! * **Waiting** is not FIFO: per-node queues could disagree on who is first and deadlock the
//!   majority, so waiters compete ("barge") on each release notification and on a jittered
//!   backoff, as the Redlock description prescribes.
//! * **Semaphores and read-write locks** are refused with
//!   [`LockError::Unsupported`] (the default of
//!   [`Backend::acquire_kind`]): each node would keep its own holder set, and a majority of
//!   nodes each admitting N holders does not bound the holders to N — several minorities can
//!   each count different holders. Redlock offers no weak version of them.
//!
//! # Fencing tokens
//!
//! Each node keeps **one counter per namespace** (`<prefix>:fence`) that never expires. Each
//! granting node proposes `max(its counter + 1, floor)`, where the client's `floor` is above
//! every token this backend has seen and at least its clock in µs (a hint: counters advance one
//! per acquire, far slower than a µs clock, so usually every node proposes the floor itself);
//! the lock's token is the maximum over the granting majority, and every granting node whose
//! proposal was lower is raised to it before the acquire returns — a second round trip only when
//! the proposals disagree. If fewer than a majority confirm the raise, the acquire undoes itself and
//! fails with [`LockError::Unavailable`] (503): the nodes could not be reached, nobody else
//! holds the lock. Any later majority shares at least one node with the confirming one, and
//! that node's counter only grows, so every later token — for this key or any other in the
//! namespace — is strictly larger. No clock enters that argument: a node whose clock runs ahead
//! only makes tokens jump forward, one whose clock steps back changes nothing, and nothing
//! expires (so `extend` has nothing to refresh, and a key idle for a year still gets a larger
//! token). The counter costs one small key per namespace per node.
//!
//! **The assumption that remains, exactly:** the next granting majority includes at least one
//! node that confirmed the previous token *and still has its counter*. Two majorities always
//! share a node, so this holds while no confirming node loses its data; it can fail if every
//! node the two majorities share lost its counter — restarted without persistence, restored
//! from an old snapshot, flushed, or evicted. The clock term keeps that case mild (an empty
//! node takes the client's floor, at least the client's clock in µs, larger than the tokens
//! of earlier grants unless the client's clock is behind the clocks of the clients that got
//! them), but only keeping the data makes it safe: run the nodes with persistence (below) and
//! with `maxmemory-policy` **`noeviction`** — an `allkeys-*` policy can remove the counter
//! (it has no TTL), and a `volatile-*` policy the lock keys themselves (every one has a TTL),
//! so a node under memory pressure would vote for a second owner of a held lock.
//!
//! # Restarts and persistence
//!
//! Run the nodes with `appendonly yes` and `appendfsync always`, or keep a restarted node out
//! of service for longer than the largest TTL in use (the Redis documentation's "delayed
//! restart"). Otherwise a node that restarts empty can vote for a second owner while the first
//! still holds the lock on the remaining minority.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt as _};

use super::redis::{RedisBackend, RedisOptions};
use super::{
    AcquireArgs, Attempt, Backend, BoxFuture, ExtendItem, OwnerToken, ReleaseHub, WaitMode, Watch,
};
use crate::key::ResourceName;
use crate::LockError;

/// Settings of a [`RedlockBackend`]. Defaults: node timeout 50 ms, drift factor 0.01,
/// connect timeout 1 s.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RedlockOptions {
    /// The deadline of one command on one node. Keep it far below the TTL.
    pub node_timeout: Duration,
    /// Clock drift allowance as a fraction of the TTL (plus 2 ms).
    pub drift_factor: f64,
    /// How long to wait for each node's first connection at startup.
    pub connect_timeout: Duration,
}

impl Default for RedlockOptions {
    fn default() -> Self {
        RedlockOptions {
            node_timeout: Duration::from_millis(50),
            drift_factor: 0.01,
            connect_timeout: Duration::from_secs(1),
        }
    }
}

impl RedlockOptions {
    /// Sets [`node_timeout`](RedlockOptions::node_timeout).
    pub fn node_timeout(mut self, d: Duration) -> Self {
        self.node_timeout = d;
        self
    }

    /// Sets [`drift_factor`](RedlockOptions::drift_factor), clamped to 0–0.5 (NaN: 0.5, the
    /// most cautious). `connect` refuses a field set outside that range.
    pub fn drift_factor(mut self, f: f64) -> Self {
        self.drift_factor = if f.is_nan() { 0.5 } else { f.clamp(0.0, 0.5) };
        self
    }

    /// Sets [`connect_timeout`](RedlockOptions::connect_timeout).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }
}

/// A lock store over N independent Redis servers (N odd, 3 or 5 typical). See the
/// [module docs](self) for the guarantees and their limits.
///
/// ```no_run
/// # async fn f() -> Result<(), dlock_runtime::LockError> {
/// use dlock_runtime::Locker;
/// // By URL: every node listed, comma-separated.
/// let locker = Locker::from_url("redlock://10.0.0.1:6379,10.0.0.2:6379,10.0.0.3:6379").await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct RedlockBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    nodes: Vec<RedisBackend>,
    /// The largest fencing token this backend has seen: the next acquire proposes a floor
    /// above it (see `redis::Floor::exact`).
    fence_seen: AtomicU64,
    hub: Arc<ReleaseHub>,
    quorum: usize,
    opts: RedlockOptions,
    /// Undos that may still land on a node (see the module docs).
    unsettled: Unsettled,
    /// The undos of failed attempts on their way, which the same token's next attempt waits
    /// for (see [`RedlockBackend::undo_failed`]).
    undoing: Undoing,
}

/// What one node said.
enum Answer<T> {
    Yes(T),
    No(Option<Duration>),
}

/// One node's vote, after its deadline.
#[derive(Debug)]
enum Vote<T> {
    Yes(T),
    No(Option<Duration>),
    /// The node failed; `true` when it refused for good ([`LockError::Misconfigured`]).
    Failed(String, bool),
}

impl<T> Vote<T> {
    fn failed(e: &LockError) -> Self {
        Vote::Failed(short(e), e.is_misconfigured())
    }
}

impl RedlockBackend {
    /// Connects to every node (`redis://…` URLs). Nodes that are down at startup are retried in
    /// the background and join when they come up; at least a majority must answer now, or this
    /// fails with [`LockError::Unavailable`] — or [`LockError::Misconfigured`] when so many
    /// nodes refused for good (a wrong password) that the others cannot make a majority, and
    /// when no nodes or an invalid URL are given.
    pub async fn connect(urls: &[&str], opts: RedlockOptions) -> Result<Self, LockError> {
        if urls.is_empty() {
            return Err(LockError::misconfigured(
                "redlock needs at least one node",
                None,
            ));
        }
        if !(0.0..=0.5).contains(&opts.drift_factor) {
            // The field is public: NaN or a negative factor would panic in every lease
            // computation (`Duration::mul_f64`), a huge one leave no lease at all.
            return Err(LockError::misconfigured(
                format!(
                    "redlock drift_factor must be within 0 and 0.5, not {}",
                    opts.drift_factor
                ),
                None,
            ));
        }
        if urls.len() % 2 == 0 {
            tracing::warn!(
                nodes = urls.len(),
                "redlock with an even number of nodes tolerates no more failures than one node fewer"
            );
        }
        let hub = ReleaseHub::new();
        let node_opts = RedisOptions::default()
            .command_timeout(opts.node_timeout)
            .connect_timeout(opts.connect_timeout);
        let nodes = urls
            .iter()
            .map(|u| RedisBackend::redlock_node(u, node_opts.clone(), hub.clone()))
            .collect::<Result<Vec<_>, _>>()?;
        let backend = RedlockBackend::over(nodes, hub, opts);
        let ping = |n: &RedisBackend| {
            let n = n.clone();
            let limit = backend.inner.opts.connect_timeout;
            async move {
                match tokio::time::timeout(limit, n.ping()).await {
                    Ok(r) => r,
                    Err(_) => Err(LockError::unavailable("no answer", None)),
                }
            }
        };
        let mut pinged = futures_util::future::join_all(backend.inner.nodes.iter().map(ping)).await;
        if pinged.iter().filter(|r| r.is_ok()).count() < backend.inner.quorum {
            // Too few answered: tell the nodes that refuse the sign-in from those that are down
            // (with short timeouts, a refused sign-in is retried past the deadline).
            pinged = futures_util::future::join_all(backend.inner.nodes.iter().zip(pinged).map(
                |(n, r)| async move {
                    match r {
                        Err(e) => Err(n.refused_at_sign_in(e).await),
                        ok => ok,
                    }
                },
            ))
            .await;
        }
        backend.check_startup(&pinged)?;
        // A node that may evict keys can evict its vote for a held lock: a majority for the
        // next taker with one node less. Each node that answered is checked (one warning each).
        let answered = backend.inner.nodes.iter().zip(&pinged);
        futures_util::future::join_all(
            answered
                .filter(|(_, r)| r.is_ok())
                .map(|(n, _)| n.check_eviction_policy()),
        )
        .await;
        Ok(backend)
    }

    /// A backend over `nodes` (not connected yet), notifying through `hub`.
    fn over(nodes: Vec<RedisBackend>, hub: Arc<ReleaseHub>, opts: RedlockOptions) -> Self {
        RedlockBackend {
            inner: Arc::new(Inner {
                quorum: nodes.len() / 2 + 1,
                nodes,
                fence_seen: AtomicU64::new(0),
                hub,
                opts,
                unsettled: Unsettled::default(),
                undoing: Undoing::default(),
            }),
        }
    }

    /// At least a majority of the nodes must have answered the startup `PING` (`pinged`, per
    /// node). A node that refused for good (a wrong password) is logged; when the nodes that
    /// did not refuse are too few for a majority, retrying cannot help: `Misconfigured`.
    fn check_startup(&self, pinged: &[Result<(), LockError>]) -> Result<(), LockError> {
        let (n, quorum) = (self.inner.nodes.len(), self.inner.quorum);
        let up = pinged.iter().filter(|r| r.is_ok()).count();
        let refused = pinged
            .iter()
            .filter(|r| r.as_ref().is_err_and(LockError::is_misconfigured))
            .count();
        let failed = || {
            pinged
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.as_ref().err().map(|e| format!("node{i}={}", short(e))))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if up >= quorum {
            if refused > 0 {
                tracing::warn!(
                    nodes = %failed(),
                    "redlock: nodes refused at startup (they will go on refusing); the others make a majority"
                );
            }
            return Ok(());
        }
        let message = format!(
            "redlock: only {up} of {n} nodes answered at startup (quorum {quorum}): {}",
            failed()
        );
        Err(LockError::backend(message, None, n - refused < quorum))
    }

    /// Parses `redlock://host:port,host:port,…` (each part may also be a full `redis://` URL)
    /// and connects.
    pub async fn connect_url(url: &str, opts: RedlockOptions) -> Result<Self, LockError> {
        let rest = url.strip_prefix("redlock://").ok_or_else(|| {
            LockError::misconfigured("redlock url must start with redlock://", None)
        })?;
        let urls: Vec<String> = rest
            .split(',')
            .filter(|p| !p.is_empty())
            .map(|p| {
                if p.contains("://") {
                    p.to_owned()
                } else {
                    format!("redis://{p}")
                }
            })
            .collect();
        let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
        Self::connect(&refs, opts).await
    }

    /// How many nodes must agree.
    pub fn quorum(&self) -> usize {
        self.inner.quorum
    }

    /// How many nodes there are.
    pub fn nodes(&self) -> usize {
        self.inner.nodes.len()
    }

    fn drift(&self, ttl: Duration) -> Duration {
        ttl.mul_f64(self.inner.opts.drift_factor) + Duration::from_millis(2)
    }

    fn describe<T>(&self, what: &str, votes: &[(usize, Vote<T>)]) -> String {
        let mut parts: Vec<String> = votes
            .iter()
            .map(|(i, v)| match v {
                Vote::Yes(_) => format!("node{i}=ok"),
                Vote::No(_) => format!("node{i}=held"),
                Vote::Failed(e, _) => format!("node{i}=failed ({e})"),
            })
            .collect();
        parts.sort();
        format!(
            "redlock {what}: {} of {} nodes agreed, quorum {}: {}",
            votes
                .iter()
                .filter(|(_, v)| matches!(v, Vote::Yes(_)))
                .count(),
            self.inner.nodes.len(),
            self.inner.quorum,
            parts.join(", ")
        )
    }

    /// Runs `op` on every node concurrently and collects the votes — with `stop_early`, only
    /// until they decide the outcome (the remaining nodes' futures are dropped; their commands
    /// are already queued on their connections). The "yes" of a node in `unsettled` counts as
    /// a failure.
    async fn poll<'a, T, F>(
        &'a self,
        op: F,
        stop_early: bool,
        unsettled: Option<&[bool]>,
    ) -> Vec<(usize, Vote<T>)>
    where
        T: Send + 'a,
        F: Fn(&'a RedisBackend) -> BoxFuture<'a, Result<Answer<T>, LockError>>,
    {
        let mut pending: FuturesUnordered<_> = (self.inner.nodes.iter().enumerate())
            .map(|(i, node)| {
                let fut = op(node);
                let limit = self.inner.opts.node_timeout;
                async move { (i, vote(limit, fut).await) }
            })
            .collect();
        let mut count = Count::new(self.inner.nodes.len(), self.inner.quorum);
        while let Some((i, v)) = pending.next().await {
            if count.add(i, discount(i, v, unsettled)) && stop_early {
                break;
            }
        }
        count.votes
    }

    /// Runs an owner-checked yes/no operation on every node and returns as soon as the outcome
    /// is decided (a majority said yes, or said no: [`Count::owner_checked`]), so frozen nodes
    /// are not waited for once it is. The nodes' commands run on one task of their own and finish (or meet their
    /// node deadline) in the background: a release really reaches every node that answers,
    /// even after the caller has its answer or was dropped. (A dropped per-node future might
    /// never send its command.) The "yes" of a node in `unsettled` counts as a failure.
    async fn poll_owner_checked<F, Fut>(
        &self,
        op: F,
        unsettled: Option<&[bool]>,
    ) -> Vec<(usize, Vote<()>)>
    where
        F: Fn(RedisBackend) -> Fut,
        Fut: std::future::Future<Output = Result<bool, LockError>> + Send + 'static,
    {
        let limit = self.inner.opts.node_timeout;
        let mut pending: FuturesUnordered<_> = (self.inner.nodes.iter().enumerate())
            .map(|(i, node)| {
                let fut = op(node.clone());
                let answer = async move {
                    Ok(match fut.await? {
                        true => Answer::Yes(()),
                        false => Answer::No(None),
                    })
                };
                async move { (i, vote(limit, answer).await) }
            })
            .collect();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(vote) = pending.next().await {
                let _ = tx.send(vote);
            }
        });
        let mut count = Count::owner_checked(self.inner.nodes.len(), self.inner.quorum);
        while let Some((i, v)) = rx.recv().await {
            if count.add(i, discount(i, v, unsettled)) {
                break;
            }
        }
        count.votes
    }

    /// A majority said yes (inside the validity window): `true`. Failed nodes make the outcome
    /// unknowable (they might have said yes): `Unavailable`, or `Misconfigured` when every
    /// failed node refused for good. Otherwise a majority said no: `false`.
    fn verdict(
        &self,
        yes: usize,
        (failed, refused): (usize, usize),
        in_window: bool,
        describe: impl FnOnce() -> String,
    ) -> Result<bool, LockError> {
        if yes >= self.inner.quorum && in_window {
            Ok(true)
        } else if yes + failed >= self.inner.quorum && in_window {
            Err(LockError::backend(describe(), None, refused == failed))
        } else {
            Ok(false)
        }
    }

    /// Whether a lock of `ttl` whose attempt started at `start` has validity left, less the
    /// clock drift.
    fn valid_still(&self, ttl: Duration, start: Instant) -> bool {
        ttl.checked_sub(start.elapsed())
            .and_then(|v| v.checked_sub(self.drift(ttl)))
            .is_some_and(|v| !v.is_zero())
    }

    /// Sets `token`'s lease to `ttl` on every node (owner-checked): a renewal (`keep`, whose
    /// majority must answer within the validity it claims) or a last step ([`Backend::expire`]).
    async fn set_lease(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        ttl: Duration,
        keep: bool,
    ) -> Result<bool, LockError> {
        let start = Instant::now();
        let unsettled = self.inner.unsettled.get(resource, token);
        let votes = self
            .poll_owner_checked(
                |n| {
                    let (r, t) = (resource.clone(), token.clone());
                    async move { n.extend(&r, &t, ttl).await }
                },
                unsettled.as_deref(),
            )
            .await;
        let (yes, failed) = tally(&votes);
        let in_window = !keep || start.elapsed() + self.drift(ttl) < ttl;
        let what = if keep { "extend" } else { "expire" };
        self.verdict(yes, failed, in_window, || self.describe(what, &votes))
    }

    /// A majority granted the lock (and confirmed its token), but too late: nobody holds it,
    /// the nodes are slow for this TTL. Not "held by another" (a 409 naming no holder).
    fn too_slow(&self, ttl: Duration, start: Instant) -> LockError {
        LockError::unavailable(
            format!(
                "redlock acquire: a majority granted the lock after {:?}, leaving none of its \
                 {ttl:?} TTL (less {:?} of clock drift): the nodes answer too slowly for this TTL",
                start.elapsed(),
                self.drift(ttl)
            ),
            None,
        )
    }

    /// Undoes `token`'s attempt on every node; answers how many nodes confirmed it. A node
    /// whose answer did not come (a timeout, a connection lost) stays counted in
    /// [`Inner::unsettled`]: the undo may still land there. The undos run on a task of their
    /// own: a caller dropped meanwhile (a deadline) leaves them counted only as long as they
    /// are really on their way.
    async fn undo_everywhere(&self, resource: &ResourceName, token: &OwnerToken) -> usize {
        let key = (resource.clone(), token.clone());
        // Counted up before this returns to its caller: the undo runs on even if the caller is
        // dropped at the await below, and the same token's next attempt (a retry after a cut-off
        // acquire) must count a "yes" from a node it may still land on as a failure. Counted up
        // in the task, a retry polled before the task first ran would take the lock on nodes the
        // undo then empties — a holder without a majority.
        self.inner.unsettled.up(&key, self.inner.nodes.len());
        // Noted as on its way too: a caller cut off at the await below (its deadline) may
        // attempt again with the same token.
        let end = self.inner.undoing.begin(self, &key);
        let me = self.clone();
        tokio::spawn(async move { end.after(me.undo_counted(key, None)).await })
            .await
            .unwrap_or(0)
    }

    /// [`undo_everywhere`](Self::undo_everywhere) for a failed attempt, waiting only for the
    /// undos of the nodes that `answered` the attempt: the others' — nodes frozen, slow, or
    /// not waited for once the outcome was decided — go on, and the same token's next attempt
    /// waits for them first (see [`Undoing`]). Waiting for every node here, a frozen one held
    /// up every failed attempt for the node timeout — a `try_acquire` of a held lock answered
    /// "held" only then — where the next attempt, if any, comes after a release's notification
    /// or a timer, by when those undos have usually ended.
    async fn undo_failed(&self, resource: &ResourceName, token: &OwnerToken, answered: &[bool]) {
        let key = (resource.clone(), token.clone());
        // Counted up, and noted as on its way, before this returns to its caller (see
        // `undo_everywhere`).
        self.inner.unsettled.up(&key, self.inner.nodes.len());
        let end = self.inner.undoing.begin(self, &key);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let me = self.clone();
        tokio::spawn(end.after(me.undo_counted(key, Some(tx))));
        let mut left = answered.iter().filter(|a| **a).count();
        while left > 0 {
            match rx.recv().await {
                Some(i) if answered.get(i) == Some(&true) => left -= 1,
                Some(_) => {}
                None => break,
            }
        }
    }

    /// The undos of an attempt counted up in [`Inner::unsettled`]: sent to every node, each
    /// within the node timeout, and counted down once all have ended; each node's number is
    /// sent to `report` as its undo ends. Answers how many nodes confirmed it.
    async fn undo_counted(
        self,
        key: (ResourceName, OwnerToken),
        report: Option<tokio::sync::mpsc::UnboundedSender<usize>>,
    ) -> usize {
        let limit = self.inner.opts.node_timeout;
        let mut outcomes = vec![Undo::Unknown; self.inner.nodes.len()];
        let mut pending: FuturesUnordered<_> = (self.inner.nodes.iter().enumerate())
            .map(|(i, n)| {
                let key = &key;
                async move {
                    let outcome = match tokio::time::timeout(limit, n.abandon(&key.0, &key.1)).await
                    {
                        Ok(Ok(())) => Undo::Done,
                        Ok(Err(e)) if did_not_run(&e) => Undo::NotRun,
                        _ => Undo::Unknown,
                    };
                    (i, outcome)
                }
            })
            .collect();
        while let Some((i, outcome)) = pending.next().await {
            outcomes[i] = outcome;
            if let Some(report) = &report {
                let _ = report.send(i);
            }
        }
        drop(pending);
        self.inner.unsettled.down(&key, &outcomes);
        outcomes.iter().filter(|u| **u == Undo::Done).count()
    }
}

/// Per lock and token, the undo of a failed attempt that is on its way
/// ([`RedlockBackend::undo_failed`]): the same token's next attempt waits until it has ended, so
/// it never overtakes the undo on a node (which would then take back that node's new vote). An
/// entry lives while its undo is on its way, at most a node timeout.
#[derive(Debug, Default)]
struct Undoing {
    /// How many entries `map` has: the hot path looks at the map only when some.
    len: AtomicUsize,
    map: Mutex<HashMap<(ResourceName, OwnerToken), tokio::sync::watch::Receiver<()>>>,
}

impl Undoing {
    /// Notes `key`'s undo as on its way, until the returned end is dropped.
    fn begin(&self, backend: &RedlockBackend, key: &(ResourceName, OwnerToken)) -> UndoEnd {
        let (tx, rx) = tokio::sync::watch::channel(());
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        // One an earlier undo of the token left (an attempt cut off while it waited for it, an
        // abandon): this one ends after it too (see `UndoEnd::after`), so waiting for this one
        // waits for both, also where a node's connection was replaced in between.
        let earlier = map.insert(key.clone(), rx.clone());
        self.len.store(map.len(), Ordering::Release);
        UndoEnd {
            backend: backend.clone(),
            key: key.clone(),
            rx,
            earlier,
            _tx: tx,
        }
    }

    /// Waits until no undo of `token`'s attempts on `resource` is on its way.
    async fn wait(&self, resource: &ResourceName, token: &OwnerToken) {
        if self.len.load(Ordering::Acquire) == 0 {
            return;
        }
        let on_its_way = self
            .map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(resource.clone(), token.clone()))
            .cloned();
        if let Some(mut rx) = on_its_way {
            // Nothing is ever sent: the channel closes when the undo has ended.
            let _ = rx.changed().await;
        }
    }
}

/// The end of an undo on its way ([`Undoing::begin`]): dropped, its entry goes, and the
/// attempts waiting for it go on.
struct UndoEnd {
    backend: RedlockBackend,
    key: (ResourceName, OwnerToken),
    rx: tokio::sync::watch::Receiver<()>,
    /// The undo of the token this one replaced in the map, if it was still on its way.
    earlier: Option<tokio::sync::watch::Receiver<()>>,
    _tx: tokio::sync::watch::Sender<()>,
}

impl UndoEnd {
    /// Runs `undo`, then waits for the earlier undo of the token, if any, and ends. Dropped
    /// before (its task cut off: the runtime shut down), it ends all the same: the attempts
    /// waiting for it go on, and the undos counted up stay counted.
    async fn after<T>(mut self, undo: impl std::future::Future<Output = T>) -> T {
        let out = undo.await;
        if let Some(earlier) = &mut self.earlier {
            let _ = earlier.changed().await;
        }
        out
    }
}

impl Drop for UndoEnd {
    fn drop(&mut self) {
        let undoing = &self.backend.inner.undoing;
        let mut map = undoing.map.lock().unwrap_or_else(PoisonError::into_inner);
        // Not a later attempt's entry, which replaced this one.
        if map
            .get(&self.key)
            .is_some_and(|rx| rx.same_channel(&self.rx))
        {
            map.remove(&self.key);
        }
        undoing.len.store(map.len(), Ordering::Release);
    }
}

/// Per lock and token, the nodes an undo of the token may still land on, by a count of its
/// undos each node has not answered: counted up before the undos are sent and down as each is
/// answered. Such a node's "yes" to the token counts as a failure (see the module docs).
///
/// An entry goes when its counts are back at zero, or when nothing asked about it for
/// [`UNSETTLED_FOR`] (an undo sent on a connection that has been replaced since stops being
/// resent by the kernel before then: Linux gives up after about 15 minutes by default,
/// `tcp_retries2`), or as the least recently used beyond [`UNSETTLED_MAX`] entries. A token whose
/// attempt found the lock held may never ask again (a `try_acquire`), so entries are not kept
/// until the token's release.
#[derive(Debug, Default)]
struct Unsettled {
    /// How many entries `map` has: the hot path looks at the map only when some.
    len: AtomicUsize,
    map: Mutex<UnsettledMap>,
}

#[derive(Debug, Default)]
struct UnsettledMap {
    entries: HashMap<(ResourceName, OwnerToken), UnsettledEntry>,
    /// The size at which the next insertion sweeps out the entries nothing asked about lately.
    sweep_at: usize,
}

#[derive(Debug)]
struct UnsettledEntry {
    /// Per node: the undos not answered.
    count: Vec<u32>,
    /// When the entry was last counted up or asked about.
    touched: Instant,
}

/// How long an entry of [`Unsettled`] lasts without being asked about.
const UNSETTLED_FOR: Duration = Duration::from_secs(20 * 60);

/// How many entries [`Unsettled`] keeps at most.
const UNSETTLED_MAX: usize = 65_536;

impl Unsettled {
    fn map(&self) -> std::sync::MutexGuard<'_, UnsettledMap> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An undo of `key` goes to each of `nodes` nodes.
    fn up(&self, key: &(ResourceName, OwnerToken), nodes: usize) {
        self.up_at(key, nodes, Instant::now());
    }

    fn up_at(&self, key: &(ResourceName, OwnerToken), nodes: usize, now: Instant) {
        let mut map = self.map();
        let entry = map
            .entries
            .entry(key.clone())
            .or_insert_with(|| UnsettledEntry {
                count: vec![0; nodes],
                touched: now,
            });
        entry
            .count
            .iter_mut()
            .for_each(|c| *c = c.saturating_add(1));
        entry.touched = now;
        if map.entries.len() >= map.sweep_at.min(UNSETTLED_MAX + 1) {
            map.sweep(now);
        }
        self.len.store(map.entries.len(), Ordering::Release);
    }

    /// The undos of `key` went as `outcomes` say (per node): those that ran, or never will,
    /// are no longer counted.
    fn down(&self, key: &(ResourceName, OwnerToken), outcomes: &[Undo]) {
        let mut map = self.map();
        let Some(entry) = map.entries.get_mut(key) else {
            return;
        };
        for (c, undo) in entry.count.iter_mut().zip(outcomes) {
            if *undo != Undo::Unknown {
                *c = c.saturating_sub(1);
            }
        }
        if entry.count.iter().all(|c| *c == 0) {
            map.entries.remove(key);
        }
        self.len.store(map.entries.len(), Ordering::Release);
    }

    /// The nodes an undo of `token` may still land on, if any.
    fn get(&self, resource: &ResourceName, token: &OwnerToken) -> Option<Vec<bool>> {
        self.get_at(resource, token, Instant::now())
    }

    fn get_at(
        &self,
        resource: &ResourceName,
        token: &OwnerToken,
        now: Instant,
    ) -> Option<Vec<bool>> {
        if self.len.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut map = self.map();
        let found = map.get(&(resource.clone(), token.clone()), now);
        self.len.store(map.entries.len(), Ordering::Release);
        found
    }

    /// The nodes an undo may still land on, for each of `items` (one look at the map).
    fn get_many(&self, items: &[ExtendItem]) -> Vec<Option<Vec<bool>>> {
        if self.len.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let now = Instant::now();
        let mut map = self.map();
        let found = items
            .iter()
            .map(|i| map.get(&(i.resource.clone(), i.token.clone()), now))
            .collect();
        self.len.store(map.entries.len(), Ordering::Release);
        found
    }

    /// The token is done with `resource` (released): no attempt of it comes after.
    fn forget(&self, resource: &ResourceName, token: &OwnerToken) {
        if self.len.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut map = self.map();
        map.entries.remove(&(resource.clone(), token.clone()));
        self.len.store(map.entries.len(), Ordering::Release);
    }
}

impl UnsettledMap {
    /// `key`'s nodes an undo may still land on (the entry noted as asked about `now`), if any.
    fn get(&mut self, key: &(ResourceName, OwnerToken), now: Instant) -> Option<Vec<bool>> {
        let entry = self.entries.get_mut(key)?;
        if now.saturating_duration_since(entry.touched) > UNSETTLED_FOR {
            self.entries.remove(key);
            return None;
        }
        entry.touched = now;
        Some(entry.count.iter().map(|c| *c > 0).collect())
    }

    /// Drops the entries nothing asked about for [`UNSETTLED_FOR`]; past [`UNSETTLED_MAX`],
    /// the least recently used down to three quarters of it. The next sweep comes when the map
    /// has doubled, or gone past the maximum.
    fn sweep(&mut self, now: Instant) {
        self.entries
            .retain(|_, e| now.saturating_duration_since(e.touched) <= UNSETTLED_FOR);
        if self.entries.len() > UNSETTLED_MAX {
            let mut touched: Vec<Instant> = self.entries.values().map(|e| e.touched).collect();
            touched.sort_unstable();
            let keep_from = touched[touched.len() - UNSETTLED_MAX / 4 * 3];
            let before = self.entries.len();
            self.entries.retain(|_, e| e.touched >= keep_from);
            tracing::warn!(
                dropped = before - self.entries.len(),
                "redlock: too many tokens with undos on their way; the least recently used are no longer watched"
            );
        }
        self.sweep_at = (self.entries.len() * 2).max(1024);
        debug_assert!(self.entries.len() <= UNSETTLED_MAX);
    }
}

/// How one node's undo went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Undo {
    Done,
    /// It did not run and never will: the server answered with an error, or it could not be
    /// sent (the connection was refused).
    NotRun,
    /// No answer: it may run later.
    Unknown,
}

/// Whether the command that failed with `e` did not run and never will: the server answered
/// it with an error, or the connection was refused (nothing was sent) — not a timeout or a
/// connection lost with the command on it.
fn did_not_run(e: &LockError) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<redis::RedisError>())
        .is_some_and(|e| e.code().is_some() || e.is_connection_refusal())
}

/// Why a node's "yes" did not count: an undo of an earlier attempt by the same token may
/// still land on it.
const UNSETTLED: &str = "an undo of an earlier attempt may still land";

/// Node `i`'s vote, a failure instead of a "yes" when it is in `unsettled`.
fn discount<T>(i: usize, vote: Vote<T>, unsettled: Option<&[bool]>) -> Vote<T> {
    match vote {
        Vote::Yes(_) if unsettled.is_some_and(|u| u.get(i).copied().unwrap_or(false)) => {
            Vote::Failed(UNSETTLED.to_owned(), false)
        }
        vote => vote,
    }
}

/// A node's answer as a vote, within `limit`.
async fn vote<T>(
    limit: Duration,
    answer: impl std::future::Future<Output = Result<Answer<T>, LockError>>,
) -> Vote<T> {
    match tokio::time::timeout(limit, answer).await {
        Ok(Ok(Answer::Yes(v))) => Vote::Yes(v),
        Ok(Ok(Answer::No(remaining))) => Vote::No(remaining),
        Ok(Err(e)) => Vote::failed(&e),
        Err(_) => Vote::Failed("timeout".to_owned(), false),
    }
}

/// The votes in so far, and whether they decide the outcome.
struct Count<T> {
    votes: Vec<(usize, Vote<T>)>,
    yes: usize,
    /// No votes and failures.
    no: usize,
    /// No votes alone.
    said_no: usize,
    nodes: usize,
    quorum: usize,
    /// Whether a failure counts against a majority of yes ([`Count::owner_checked`]: not).
    failures_decide: bool,
}

impl<T> Count<T> {
    /// An acquire's count: decided once a majority said yes or can no longer say yes (a
    /// failed node is not a yes; the attempt fails either way and is undone everywhere).
    fn new(nodes: usize, quorum: usize) -> Self {
        Count {
            votes: Vec::with_capacity(nodes),
            yes: 0,
            no: 0,
            said_no: 0,
            nodes,
            quorum,
            failures_decide: true,
        }
    }

    /// An owner-checked operation's count (release, extend): decided once a majority said yes,
    /// or said no. A failed node may hold the lock, so it decides nothing: counted against
    /// the yes, a node failing fast beside one "no" made the answer "not the owner" — a lock
    /// reported lost — whenever the node that would have said yes answered third.
    fn owner_checked(nodes: usize, quorum: usize) -> Self {
        Count {
            failures_decide: false,
            ..Count::new(nodes, quorum)
        }
    }

    /// Counts node `i`'s vote; `true` once the votes decide the outcome.
    fn add(&mut self, i: usize, vote: Vote<T>) -> bool {
        match vote {
            Vote::Yes(_) => self.yes += 1,
            Vote::No(_) => {
                self.no += 1;
                self.said_no += 1;
            }
            Vote::Failed(..) => self.no += 1,
        }
        self.votes.push((i, vote));
        let against = if self.failures_decide {
            self.no
        } else {
            self.said_no
        };
        self.yes >= self.quorum || against > self.nodes - self.quorum
    }
}

/// (yes votes, (failed nodes, nodes of those that refused for good)).
fn tally<T>(votes: &[(usize, Vote<T>)]) -> (usize, (usize, usize)) {
    let yes = votes
        .iter()
        .filter(|(_, v)| matches!(v, Vote::Yes(_)))
        .count();
    (yes, failures(votes))
}

/// (failed nodes, nodes of those that refused for good).
fn failures<T>(votes: &[(usize, Vote<T>)]) -> (usize, usize) {
    votes.iter().fold((0, 0), |(f, r), (_, v)| match v {
        Vote::Failed(_, refused) => (f + 1, r + usize::from(*refused)),
        _ => (f, r),
    })
}

fn short(e: &LockError) -> String {
    match e {
        LockError::Unavailable { message, .. } | LockError::Misconfigured { message, .. } => {
            message.clone()
        }
        other => other.to_string(),
    }
}

impl Backend for RedlockBackend {
    fn name(&self) -> &'static str {
        "redlock"
    }

    fn lease_margin(&self, ttl: Duration) -> Duration {
        self.drift(ttl)
    }

    fn fifo(&self) -> bool {
        false
    }

    fn acquire<'a>(&'a self, args: AcquireArgs<'a>) -> BoxFuture<'a, Result<Attempt, LockError>> {
        Box::pin(async move {
            // After the undo of this token's last attempt, if it is still on its way.
            self.inner.undoing.wait(args.resource, args.token).await;
            let start = Instant::now();
            // Per-node FIFO queues could disagree on who is first: barge instead.
            let mode = match args.mode {
                WaitMode::Try => WaitMode::Try,
                _ => WaitMode::Barge,
            };
            let (resource, token, ttl) = (args.resource, args.token, args.ttl);
            let floor = super::redis::Floor::exact(&self.inner.fence_seen);
            // One call for every node: the nodes are single servers, so it names nothing of one
            // node's (`connect` made at least one).
            let call = self.inner.nodes[0].acquire_call(
                &AcquireArgs {
                    mode,
                    sent: None,
                    ..args
                },
                floor,
            );
            let call = &call;
            let unsettled = self.inner.unsettled.get(resource, token);
            let votes = self
                .poll(
                    |node| {
                        Box::pin(async move {
                            Ok(match node.run_acquire(call).await?.0 {
                                Attempt::Acquired { fencing_token } => Answer::Yes(fencing_token),
                                Attempt::Held { remaining } => Answer::No(remaining),
                            })
                        })
                    },
                    true,
                    unsettled.as_deref(),
                )
                .await;
            let granted: Vec<(usize, u64)> = votes
                .iter()
                .filter_map(|(i, v)| match v {
                    Vote::Yes(t) => Some((*i, *t)),
                    _ => None,
                })
                .collect();
            if granted.len() >= self.inner.quorum && self.valid_still(ttl, start) {
                // Raise every granting node to the majority's maximum, so that any later
                // majority (which shares a node with this one) issues a larger token.
                let max = granted.iter().map(|(_, t)| *t).max().unwrap_or(0);
                if max > super::redis::MAX_COUNTER {
                    // Past what the nodes' scripts count exactly: no token above the ones
                    // before can be told. Not noted as seen (the floors would carry it on).
                    self.undo_everywhere(resource, token).await;
                    return Err(LockError::misconfigured(
                        format!(
                            "redlock: a node's fencing counter is at {max}, past 2^53 - 1: no \
                             token issued from it would be above the ones before"
                        ),
                        None,
                    ));
                }
                self.inner.fence_seen.fetch_max(max, Ordering::AcqRel);
                let raised = futures_util::future::join_all(granted.iter().map(|&(i, t)| {
                    let node = &self.inner.nodes[i];
                    async move {
                        t == max
                            || matches!(
                                tokio::time::timeout(
                                    self.inner.opts.node_timeout,
                                    node.raise_fence(resource, max)
                                )
                                .await,
                                Ok(Ok(()))
                            )
                    }
                }))
                .await
                .into_iter()
                .filter(|ok| *ok)
                .count();
                // The raise is a second round trip: the validity may have run out meanwhile
                // (slow nodes, a short TTL). Granted then, the guard would start with its
                // lease over — work run under a lock the nodes may already have let go.
                if raised >= self.inner.quorum && self.valid_still(ttl, start) {
                    return Ok(Attempt::Acquired { fencing_token: max });
                }
                self.undo_everywhere(resource, token).await;
                if raised >= self.inner.quorum {
                    return Err(self.too_slow(ttl, start));
                }
                // A majority granted the lock but its token is not on a majority: the outcome
                // is not "someone else holds it" but "the nodes could not be reached".
                tracing::warn!(raised, "redlock: fencing token not confirmed by a majority");
                return Err(LockError::unavailable(
                    format!(
                        "redlock acquire: the fencing token was confirmed by {raised} of {} nodes, quorum {}",
                        self.inner.nodes.len(),
                        self.inner.quorum
                    ),
                    None,
                ));
            }
            // Failed: undo on every node, answered or not (waiting for those that answered).
            let mut answered = vec![false; self.inner.nodes.len()];
            for (i, v) in &votes {
                answered[*i] = !matches!(v, Vote::Failed(..));
            }
            self.undo_failed(resource, token, &answered).await;
            if granted.len() >= self.inner.quorum {
                // A majority granted it, but too late: nobody holds it, the nodes are slow
                // for this TTL. Not "held by another" (a 409 naming no holder).
                return Err(self.too_slow(ttl, start));
            }
            // Unavailable when the nodes that failed are too many for a majority, whatever
            // the others say; otherwise someone holds it. The nodes not waited for (the
            // outcome was decided without them) are neither: counted as failures, the answer
            // hung on which nodes answered first — one node failing fast beside a "held" made
            // every contended attempt a 503 (a minority down must not fail the lock).
            let (failed, refused) = failures(&votes);
            if failed > self.inner.nodes.len() - self.inner.quorum {
                return Err(LockError::backend(
                    self.describe("acquire", &votes),
                    None,
                    refused == failed,
                ));
            }
            let remaining = votes
                .iter()
                .filter_map(|(_, v)| match v {
                    Vote::No(Some(r)) => Some(*r),
                    _ => None,
                })
                .min();
            Ok(Attempt::Held { remaining })
        })
    }

    fn release<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            // Every node's answer counts: an undo landing late can only delete what this
            // release deleted.
            let votes = self
                .poll_owner_checked(
                    |n| {
                        let (r, t) = (resource.clone(), token.clone());
                        async move { n.release(&r, &t).await }
                    },
                    None,
                )
                .await;
            // Released: no attempt of the token comes after.
            self.inner.unsettled.forget(resource, token);
            let (yes, failed) = tally(&votes);
            // In the window by definition: a release has no validity to keep.
            self.verdict(yes, failed, true, || self.describe("release", &votes))
        })
    }

    fn extend<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(self.set_lease(resource, token, ttl, true))
    }

    fn expire<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
        left: Duration,
    ) -> BoxFuture<'a, Result<bool, LockError>> {
        // The lock's last step: the nodes let it go by themselves `left` from their answers.
        // No validity is claimed past it, so a rest shorter than the round trip (a release
        // just before a minimum hold ends) is no loss: a majority said the lock was ours.
        Box::pin(self.set_lease(resource, token, left, false))
    }

    fn extend_many<'a>(
        &'a self,
        items: &'a [ExtendItem],
    ) -> BoxFuture<'a, Vec<Result<bool, LockError>>> {
        Box::pin(async move {
            let start = Instant::now();
            // One pipelined batch per node, all nodes at once.
            let per_node = futures_util::future::join_all(self.inner.nodes.iter().map(|n| async {
                match tokio::time::timeout(self.inner.opts.node_timeout, n.extend_many(items)).await
                {
                    Ok(v) => v,
                    Err(_) => (0..items.len())
                        .map(|_| Err(LockError::unavailable("timeout", None)))
                        .collect(),
                }
            }))
            .await;
            let elapsed = start.elapsed();
            let unsettled = self.inner.unsettled.get_many(items);
            (0..items.len())
                .map(|i| {
                    // Each node's answer for item `i`: `Some(true)` yes, `Some(false)` no,
                    // `None` failed (an error, or the "yes" of a node an undo may still reach).
                    let unsettled = unsettled.get(i).and_then(Option::as_ref);
                    let answers = per_node.iter().enumerate().map(|(n, r)| match r.get(i) {
                        Some(Ok(true)) => Some(true).filter(|_| !unsettled.is_some_and(|u| u[n])),
                        Some(Ok(false)) => Some(false),
                        _ => None,
                    });
                    let yes = answers.clone().filter(|a| *a == Some(true)).count();
                    let failed = answers.filter(Option::is_none).count();
                    let refused = per_node
                        .iter()
                        .filter(|r| matches!(r.get(i), Some(Err(e)) if e.is_misconfigured()))
                        .count();
                    let in_window = elapsed + self.drift(items[i].ttl) < items[i].ttl;
                    self.verdict(yes, (failed, refused), in_window, || {
                        format!(
                            "redlock extend: {yes} of {} nodes agreed, {failed} failed",
                            self.inner.nodes.len()
                        )
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
            // A grant that lands late on nodes the undo did not reach blocks the others only
            // when they are too many for the rest to make a quorum: then the undo is not done,
            // and the locker retries it in the background.
            // The entry in `unsettled` stays while an undo may still land: a caller may use
            // the token again after an abandon (the trait does not forbid it).
            let undone = self.undo_everywhere(resource, token).await;
            let n = self.inner.nodes.len();
            if n - undone > n - self.inner.quorum {
                return Err(LockError::unavailable(
                    format!(
                        "redlock abandon: undone on {undone} of {n} nodes, quorum {}",
                        self.inner.quorum
                    ),
                    None,
                ));
            }
            Ok(())
        })
    }

    fn watch<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<Watch, LockError>> {
        Box::pin(async move {
            let me = self.clone();
            let on_last: super::OnLastWaiter = Box::new(move |resource: &str| {
                for n in &me.inner.nodes {
                    n.unsubscribe_later(resource);
                }
            });
            let (watch, _) = self.inner.hub.register(resource, token, Some(on_last));
            // Notifications from any node will do; a node that cannot subscribe now is skipped
            // (the fallback timer covers it) — within the node timeout, like every node call:
            // a node whose connection hangs must not hold up the wait.
            let limit = self.inner.opts.node_timeout;
            let ok = futures_util::future::join_all(
                self.inner
                    .nodes
                    .iter()
                    .map(|n| tokio::time::timeout(limit, n.ensure_subscribed(resource))),
            )
            .await
            .into_iter()
            .filter(|r| matches!(r, Ok(Ok(()))))
            .count();
            if ok == 0 {
                return Err(LockError::unavailable(
                    "redlock: no node accepted the release subscription",
                    None,
                ));
            }
            Ok(watch)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts `votes` (`y` yes, `n` no, `f` failed) over 5 nodes; answers after which vote the
    /// count was decided, if any.
    fn decided_after(votes: &str) -> Option<usize> {
        decided(Count::new(5, 3), votes)
    }

    fn decided(mut count: Count<()>, votes: &str) -> Option<usize> {
        votes.chars().enumerate().find_map(|(i, c)| {
            let vote = match c {
                'y' => Vote::Yes(()),
                'n' => Vote::No(None),
                _ => Vote::Failed("down".to_owned(), false),
            };
            count.add(i, vote).then_some(i + 1)
        })
    }

    /// An undo's caller dropped at its first await (an acquire cut off by the locker's
    /// deadline): the undo runs on, and its nodes count as unsettled already — before the task
    /// sending it first ran — so that a retry with the same token, polled first, cannot count a
    /// "yes" the undo may then take back.
    #[tokio::test(flavor = "current_thread")]
    async fn an_undo_counts_its_nodes_unsettled_before_its_caller_can_go_on() {
        use futures_util::FutureExt;
        let hub = ReleaseHub::new();
        let nodes = (0..3)
            .map(|_| {
                // Nothing listens there: the undo, when it runs, fails on every node.
                RedisBackend::redlock_node(
                    "redis://127.0.0.1:1",
                    RedisOptions::default(),
                    hub.clone(),
                )
                .unwrap()
            })
            .collect();
        let backend = RedlockBackend::over(nodes, hub, RedlockOptions::default());
        let (resource, token) = key(1);
        assert!(
            backend
                .undo_everywhere(&resource, &token)
                .now_or_never()
                .is_none(),
            "the undo waits for its nodes"
        );
        assert_eq!(
            backend.inner.unsettled.get(&resource, &token),
            Some(vec![true; 3]),
            "counted before the task sending the undo first ran"
        );
    }

    fn key(n: usize) -> (ResourceName, OwnerToken) {
        let key = crate::LockKey::new(&format!("k{n}")).unwrap();
        (ResourceName::new("t", key), OwnerToken::generate())
    }

    /// The undos that may still land: counted up before they go out and down as each node
    /// answers. A node whose answer did not come stays unsettled — its "yes" to the same token
    /// counts as a failure — until the token is released; an entry whose counts are back at
    /// zero is gone, and a late count down after the release re-creates nothing.
    #[test]
    fn an_unanswered_undo_leaves_its_node_unsettled_until_the_token_is_done() {
        use Undo::{Done, NotRun, Unknown};
        let unsettled = Unsettled::default();
        let (k, other) = (key(1), key(2));
        assert_eq!(unsettled.get(&k.0, &k.1), None);

        // Two undos out; each node answers the first, node 1 not the second.
        unsettled.up(&k, 3);
        unsettled.up(&k, 3);
        unsettled.down(&k, &[Done, NotRun, Done]);
        unsettled.down(&k, &[Done, Unknown, NotRun]);
        let nodes = unsettled.get(&k.0, &k.1);
        assert_eq!(nodes.as_deref(), Some(&[false, true, false][..]));
        assert_eq!(unsettled.get(&k.0, &other.1), None, "per token");
        assert_eq!(unsettled.get(&other.0, &k.1), None, "per lock");
        let votes: Vec<Vote<()>> = (0..3)
            .map(|i| discount(i, Vote::Yes(()), nodes.as_deref()))
            .collect();
        assert!(matches!(
            votes[..],
            [Vote::Yes(()), Vote::Failed(..), Vote::Yes(())]
        ));
        assert!(matches!(
            discount(1, Vote::<()>::No(None), nodes.as_deref()),
            Vote::No(None)
        ));

        // Released: forgotten; an undo still on its way then counts down nothing.
        unsettled.up(&k, 3);
        unsettled.forget(&k.0, &k.1);
        assert_eq!(unsettled.get(&k.0, &k.1), None);
        unsettled.down(&k, &[Done, Done, Done]);
        assert!(unsettled.map().entries.is_empty());
        assert_eq!(unsettled.len.load(Ordering::Acquire), 0);

        // Every undo answered: nothing kept.
        unsettled.up(&k, 3);
        unsettled.down(&k, &[Done, NotRun, Done]);
        assert!(unsettled.map().entries.is_empty());
    }

    /// Entries do not pile up: one nothing asked about for `UNSETTLED_FOR` is gone (a token
    /// whose attempt found the lock held may never ask again), and past `UNSETTLED_MAX` the
    /// least recently used go.
    #[test]
    fn unsettled_entries_are_bounded_in_time_and_number() {
        let unsettled = Unsettled::default();
        let start = Instant::now();
        let (old, fresh) = (key(1), key(2));
        unsettled.up_at(&old, 3, start);
        unsettled.up_at(&fresh, 3, start);
        let later = start + UNSETTLED_FOR;
        assert!(
            unsettled.get_at(&fresh.0, &fresh.1, later).is_some(),
            "asked: kept"
        );
        let past = later + Duration::from_secs(1);
        assert_eq!(unsettled.get_at(&old.0, &old.1, past), None);
        assert!(unsettled.get_at(&fresh.0, &fresh.1, past).is_some());

        let keys: Vec<_> = (0..UNSETTLED_MAX + 1).map(|n| key(n + 10)).collect();
        for (n, k) in keys.iter().enumerate() {
            unsettled.up_at(k, 3, past + Duration::from_micros(n as u64));
        }
        let left = unsettled.map().entries.len();
        assert!(left <= UNSETTLED_MAX, "{left}");
        let newest = &keys[UNSETTLED_MAX];
        let at = past + Duration::from_secs(1);
        assert!(unsettled.get_at(&newest.0, &newest.1, at).is_some());
        assert_eq!(
            unsettled.get_at(&keys[0].0, &keys[0].1, at),
            None,
            "least recently used"
        );
    }

    /// An undo that failed with the server's answer, or could not be sent, did not run and
    /// never will; a timeout or a lost connection may have sent it.
    #[test]
    fn an_undo_refused_or_never_sent_is_settled() {
        let io = |kind| {
            let e = redis::RedisError::from(std::io::Error::new(kind, "x"));
            LockError::unavailable("redis abandon", Some(Box::new(e)))
        };
        assert!(did_not_run(&io(std::io::ErrorKind::ConnectionRefused)));
        assert!(!did_not_run(&io(std::io::ErrorKind::TimedOut)));
        assert!(!did_not_run(&io(std::io::ErrorKind::BrokenPipe)));
        assert!(!did_not_run(&LockError::unavailable("timeout", None)));
    }

    #[test]
    fn a_count_is_decided_by_a_majority_either_way_and_not_before() {
        assert_eq!(decided_after("yyy"), Some(3), "a majority said yes");
        assert_eq!(decided_after("ynyny"), Some(5));
        assert_eq!(
            decided_after("nnn"),
            Some(3),
            "a majority can no longer say yes"
        );
        assert_eq!(decided_after("yfnf"), Some(4), "failures count against");
        assert_eq!(decided_after("yynn"), None, "the fifth node decides");
    }

    /// An owner-checked count (release, extend) is decided by a majority of yes or of no: a
    /// failed node may hold the lock. Over 3 nodes, "failed, no" waits for the third node,
    /// whose yes makes the outcome unknowable (an outage, tried again) rather than "not the
    /// owner" (a lock reported lost while a majority may hold it).
    #[test]
    fn an_owner_checked_count_is_not_decided_by_failures() {
        let over_3 = |votes| decided(Count::owner_checked(3, 2), votes);
        assert_eq!(over_3("fn"), None, "the third node decides");
        assert_eq!(over_3("fny"), None);
        assert_eq!(over_3("fnn"), Some(3), "a majority said no");
        assert_eq!(over_3("yy"), Some(2), "a majority said yes");
        assert_eq!(over_3("ff"), None);
        assert_eq!(decided(Count::new(3, 2), "fn"), Some(2), "an acquire's is");
    }
}
