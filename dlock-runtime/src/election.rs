//! Leader election: [`Locker::elect`] campaigns for leadership of a name and keeps doing so.
//!
//! The guarantees are on [`Election`] (the module is private; its docs are the type's).

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{oneshot, watch};

use crate::lease::LeaseProbe;
use crate::util::{backoff, FailureStreak, Jitter};
use crate::{IntoLockKey, LockError, LockKey, Locker, OnFail, RetryPolicy};

/// How long one queued campaign attempt waits before it re-queues (it simply tries again): a
/// day, the longest wait a request takes. A candidate that re-queues goes to the back of the
/// lock's line; every 60 s, as it once was, followers took turns at the back, and the next
/// leader was whoever had re-queued least recently rather than who came first.
const CAMPAIGN_WAIT: Duration = crate::util::MAX_TIMEOUT;
/// The backoff between campaign attempts the backend did not answer.
const ERROR_BACKOFF: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(2));
/// How often a campaign the backend keeps refusing for good says so again at error level.
const REFUSED_REPORT_EVERY: Duration = Duration::from_secs(60);

/// This candidate's role, as published on [`Election::watch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Leadership {
    /// This candidate leads; `term` is the election lock's fencing token for this leadership.
    Leader {
        /// Strictly greater than every earlier term of the election's name.
        term: u64,
    },
    /// Another candidate leads, or nobody does yet: this one is campaigning.
    Follower,
}

impl Leadership {
    /// Whether this is [`Leadership::Leader`].
    pub fn is_leader(&self) -> bool {
        matches!(self, Leadership::Leader { .. })
    }

    /// The term when leading.
    pub fn term(&self) -> Option<u64> {
        match self {
            Leadership::Leader { term } => Some(*term),
            Leadership::Follower => None,
        }
    }
}

impl Locker {
    /// Starts a request to campaign for leadership of `name` (see [`ElectionRequest`] and the
    /// [`Election`] it starts). Every candidate of one election uses the same name; the name
    /// is a lock key, so it shares the key space (and its rules) with [`Locker::lock`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
    /// use std::time::Duration;
    /// let locker = dlock_runtime::Locker::memory();
    /// let election = locker.elect("scheduler").ttl(Duration::from_secs(10)).start()?;
    /// let term = election.wait_for_leadership().await.expect("campaigning");
    /// assert_eq!(election.term(), Some(term)); // pass `term` with every write, as a fencing token
    /// election.resign().await?;
    /// assert!(!election.is_leader());
    /// # Ok(()) }
    /// ```
    pub fn elect(&self, name: impl IntoLockKey) -> ElectionRequest<'_> {
        ElectionRequest {
            locker: self,
            name: name.into_lock_key(),
            ttl: None,
        }
    }
}

/// A request to campaign, from [`Locker::elect`]: set the lease, then
/// [`start`](ElectionRequest::start).
#[must_use = "an election request does nothing until started"]
pub struct ElectionRequest<'a> {
    locker: &'a Locker,
    name: Result<LockKey, LockError>,
    ttl: Option<Duration>,
}

impl fmt::Debug for ElectionRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ElectionRequest")
            .field("name", &self.name)
            .field("ttl", &self.ttl)
            .finish()
    }
}

impl ElectionRequest<'_> {
    /// The leader's lease: how long after a leader dies (or is cut off) another candidate can
    /// lead. Renewed every third of its local lease (TTL/3 on most backends) while leading.
    /// Default: the locker's default TTL.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Starts campaigning in a background task on the current tokio runtime and returns its
    /// handle.
    ///
    /// Errors: [`LockError::InvalidKey`] / [`LockError::InvalidTtl`] for a bad name or TTL,
    /// [`LockError::Unsupported`] when called outside a tokio runtime.
    pub fn start(self) -> Result<Election, LockError> {
        let name = self.name?;
        let ttl = crate::util::validate_ttl(self.ttl.unwrap_or(self.locker.default_ttl()))?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::unsupported(
                self.locker.backend_name(),
                "leader election outside a tokio runtime",
            )
        })?;
        let (tx, rx) = watch::channel(Leadership::Follower);
        let (stop_tx, stop_rx) = oneshot::channel();
        let held = Arc::new(Mutex::new(None));
        let campaign = Campaign {
            locker: self.locker.clone(),
            name: name.clone(),
            ttl,
            held: held.clone(),
            tx,
        };
        let task = runtime.spawn(campaign.run(stop_rx));
        Ok(Election {
            name,
            held,
            rx,
            stop: Mutex::new(Some(stop_tx)),
            task: tokio::sync::Mutex::new(Some(task)),
        })
    }
}

/// The term and lease of the current leadership, for [`Election::is_leader`].
type Held = Arc<Mutex<Option<(u64, LeaseProbe)>>>;

/// A campaign for leadership of one name, from [`Locker::elect`].
///
/// It is a background campaign for one lock, the election's name, built on the
/// ordinary lock — so it works on every backend that has locks, with their guarantees:
///
/// * **Campaign.** Candidates wait for the lock in the backend's fair queue
///   ([`OnFail::Retry`]); the one holding it is the leader. At most one candidate holds it at a
///   time (mutual exclusion), and a candidate whose process dies stops leading within the TTL.
/// * **Term.** The leader's term is the lock's fencing token
///   ([`LockGuard::fencing_token`](crate::LockGuard::fencing_token)): strictly greater than
///   every earlier term of the same name. Pass it with every write the leader makes and let the
///   resource refuse a term lower than the highest it has seen — that, not timing, is what
///   stops a deposed leader that has not noticed yet (a paused process) from doing harm.
/// * **Lease.** Leadership is a watchdog-renewed lease. It ends when the lock is lost —
///   renewal refused, or the local lease clock ran out (the backend unreachable, the process
///   frozen) — and the local clock runs out before the backend lets anyone else take the lock
///   (each backend's lease margin), so the old leader is told (through
///   [`lost`](Election::lost), [`is_leader`](Election::is_leader) and the
///   [`watch`](Election::watch) channel) before, or when, a new one can lead.
/// * **Re-campaign.** After a loss the candidate queues for the lock again; backend errors are
///   retried with a jittered backoff (up to 2 s). A failure that is not an outage — a refusal
///   that retrying cannot fix ([`LockError::Misconfigured`]: a wrong password, a user without
///   the lock keys), or a request the backend cannot take (a TTL over ZooKeeper's bound for
///   its session timeout, `replicas(n)` on a backend without replicas) — is an `error` event
///   (`dlock.election: the backend refuses the campaign`, at most once a minute while it
///   lasts; outages are `debug`), and the campaign goes on, so it leads once the
///   configuration is fixed. The campaign ends only with
///   [`resign`](Election::resign) or when the [`Election`] is dropped; both step down (the
///   lock is released, so the next candidate leads at once rather than after the TTL).
///
/// The shape follows etcd's `concurrency.Election` (campaign, resign, observe) and client-go's
/// `leaderelection` (a lease, leadership lost when it cannot be renewed in time).
///
/// Observe it with [`is_leader`](Election::is_leader) / [`term`](Election::term) (exact at the
/// moment of the call, by the local lease clock),
/// [`wait_for_leadership`](Election::wait_for_leadership), [`ended`](Election::ended) and
/// [`lost`](Election::lost), or [`watch`](Election::watch) for every change. Run work only
/// while leading, racing it against the end of *its* term:
///
/// ```
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
/// # let locker = dlock_runtime::Locker::memory();
/// let election = locker.elect("reports").start()?;
/// # let mut rounds = 0;
/// while let Some(term) = election.wait_for_leadership().await {
///     tokio::select! {
///         _ = election.ended(term) => println!("term {term} is over; campaigning again"),
///         _ = async { /* leader-only work, fencing its writes with `term` */ } => {}
///     }
/// #   rounds += 1; if rounds == 2 { election.resign().await?; }
/// }
/// # Ok(()) }
/// ```
///
/// Dropping it resigns in the background: the campaign stops and the lock is released.
pub struct Election {
    name: LockKey,
    held: Held,
    rx: watch::Receiver<Leadership>,
    stop: Mutex<Option<oneshot::Sender<()>>>,
    task: tokio::sync::Mutex<Option<tokio::task::JoinHandle<Result<(), LockError>>>>,
}

impl fmt::Debug for Election {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Election")
            .field("name", &self.name.as_str())
            .field("term", &self.term())
            .finish()
    }
}

impl Election {
    /// The election's name (the encoded lock key).
    pub fn name(&self) -> &str {
        self.name.as_str()
    }

    /// Whether this candidate leads right now: it holds the election's lock and its local
    /// lease has not run out. Turns `false` the moment the lease is lost, even before the
    /// campaign task has seen it.
    pub fn is_leader(&self) -> bool {
        self.term().is_some()
    }

    /// The current term while leading ([`is_leader`](Election::is_leader)), else `None`.
    pub fn term(&self) -> Option<u64> {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.as_ref()
            .filter(|(_, probe)| probe.is_held())
            .map(|(term, _)| *term)
    }

    /// Waits until this candidate leads and returns the term; at once if it leads now.
    /// `None` once the campaign has ended ([`resign`](Election::resign)).
    pub async fn wait_for_leadership(&self) -> Option<u64> {
        let mut rx = self.rx.clone();
        loop {
            let role = *rx.wait_for(Leadership::is_leader).await.ok()?;
            // The lease may have run out since it was published; the campaign will say so.
            match self.term() {
                Some(term) => return Some(term),
                None => {
                    rx.wait_for(|now| *now != role).await.ok()?;
                }
            }
        }
    }

    /// Resolves when this candidate does not lead: at once when it does not lead now, else
    /// when the current term ends — its lock lost (renewal refused, the local lease clock ran
    /// out) or the election resigned. Cancel-safe.
    ///
    /// It follows the term current *when it is called*: a term that ended and was followed by
    /// the next one between [`wait_for_leadership`](Election::wait_for_leadership) and this call
    /// goes unseen. Work tied to one term waits on [`ended`](Election::ended) with that term.
    pub async fn lost(&self) {
        if let Some(term) = self.term() {
            self.ended(term).await;
        }
    }

    /// Resolves when term `term` is over: at once when this candidate does not lead in `term`
    /// now (it never did, or that term ended — even if it leads again in a later one), else
    /// when its lock is lost or the election resigns. Cancel-safe.
    ///
    /// This is the one to race against a term's work: `wait_for_leadership` returned `term`,
    /// and a loss and re-election in between cannot make the work outlive its term.
    pub async fn ended(&self, term: u64) {
        let probe = {
            let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
            held.as_ref()
                .filter(|(t, probe)| *t == term && probe.is_held())
                .map(|(_, probe)| probe.clone())
        };
        let Some(probe) = probe else {
            return;
        };
        let mut rx = self.rx.clone();
        tokio::select! {
            _ = probe.lost() => {}
            // A closed channel (campaign over) is an ended term too.
            _ = rx.wait_for(|now| now.term() != Some(term)) => {}
        }
    }

    /// Every change of this candidate's role, as a [`watch::Receiver`] (starting with the
    /// current one; `tokio_stream::wrappers::WatchStream` makes it a `Stream`). The channel
    /// closes when the campaign ends. Published by the campaign task, so a change reaches it a
    /// task switch after [`is_leader`](Election::is_leader) sees it.
    pub fn watch(&self) -> watch::Receiver<Leadership> {
        self.rx.clone()
    }

    /// Steps down and ends the campaign: stops campaigning, releases the lock when leading
    /// (after [`is_leader`](Election::is_leader) has turned `false`, so the next leader starts
    /// only after this one stopped), and returns once that is done. `Ok(())` also when not
    /// leading; [`LockError::Lost`] when the lease had been lost already; the release's error
    /// when the backend did not answer (it is then retried in the background, and the TTL ends
    /// the lock at the latest). Later calls return `Ok(())`. Cancel-safe: a call dropped
    /// before the campaign ended leaves the next call waiting for it.
    pub async fn resign(&self) -> Result<(), LockError> {
        let stop = self
            .stop
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(stop) = stop {
            let _ = stop.send(());
        }
        let mut task = self.task.lock().await;
        let Some(handle) = task.as_mut() else {
            return Ok(());
        };
        // Kept until the task has ended: a call dropped here leaves the next one waiting for
        // it (taken before, the next call answered `Ok(())` at once, the lock still held).
        let ended = handle.await;
        *task = None;
        ended.unwrap_or_else(|e| {
            Err(LockError::unavailable(
                format!("election `{}`: campaign task ended: {e}", self.name),
                None,
            ))
        })
    }
}

/// The background task of one [`Election`]. Dropped without returning — the runtime it ran on
/// shut down — it stops leading in the open: no term, `Follower` published, and the channel
/// closes (its guard, dropped with it, is released in the background). Before, the term stayed
/// set: `is_leader` said `true` while the next candidate led.
struct Campaign {
    locker: Locker,
    name: LockKey,
    ttl: Duration,
    held: Held,
    tx: watch::Sender<Leadership>,
}

impl Campaign {
    /// Campaigns until `stop` fires (resign) or its sender is dropped (the election dropped).
    async fn run(self, mut stop: oneshot::Receiver<()>) -> Result<(), LockError> {
        let mut failures = 0u32;
        let mut refused = FailureStreak::default();
        loop {
            let acquire = self
                .locker
                .lock(self.name.clone())
                .ttl(self.ttl)
                .on_fail(OnFail::Retry(RetryPolicy::new(CAMPAIGN_WAIT)))
                .acquire();
            let attempt = tokio::select! {
                biased;
                _ = &mut stop => return Ok(()),
                attempt = acquire => attempt,
            };
            let guard = match attempt {
                Ok(guard) => guard,
                Err(e) if e.is_timeout() => continue,
                Err(e) => {
                    let (name, error) = (
                        self.locker.trace_key(self.name.as_str()),
                        self.locker.trace_error(&e),
                    );
                    if e.status() == 503 {
                        tracing::debug!(election = %name, error = %error, "dlock.election: campaign attempt failed");
                    } else if let Some(attempts) = refused.failed(REFUSED_REPORT_EVERY) {
                        tracing::error!(election = %name, error = %error, attempts, "dlock.election: the backend refuses the campaign; retrying until the configuration is fixed");
                    }
                    let pause = backoff(ERROR_BACKOFF.0, failures, ERROR_BACKOFF.1, Jitter::Equal);
                    failures = failures.saturating_add(1);
                    tokio::select! {
                        biased;
                        _ = &mut stop => return Ok(()),
                        _ = tokio::time::sleep(pause) => continue,
                    }
                }
            };
            failures = 0;
            refused.succeeded();
            let term = guard.fencing_token();
            self.set(Some((term, guard.probe())));
            let name = self.locker.trace_key(self.name.as_str());
            tracing::info!(election = %name, term, "dlock.election: leading");
            tokio::select! {
                biased;
                _ = &mut stop => {
                    // Not leading any more before anyone else can be.
                    self.set(None);
                    return guard.release().await;
                }
                _ = guard.lost() => {
                    self.set(None);
                    tracing::warn!(election = %name, term, "dlock.election: leadership lost; campaigning again");
                }
            }
        }
    }

    fn set(&self, held: Option<(u64, LeaseProbe)>) {
        let role = match &held {
            Some((term, _)) => Leadership::Leader { term: *term },
            None => Leadership::Follower,
        };
        // The term is changed inside the channel's update: whoever reads the new term
        // (`ended`) then waits on the channel and finds it saying so already, and does not
        // take the older role for the term's end. The channel is taken first, the term's mutex
        // second, as a reader does who holds a borrow of the role and asks `is_leader`:
        // taken the other way round, each waited for the other for good.
        self.tx.send_modify(|now| {
            *self.held.lock().unwrap_or_else(PoisonError::into_inner) = held;
            *now = role;
        });
    }
}

impl Drop for Campaign {
    fn drop(&mut self) {
        if self.tx.borrow().is_leader() {
            self.set(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MemoryBackend;

    /// Two candidates' lockers over one store, as two instances would have.
    fn pair() -> (Locker, Locker) {
        let store = MemoryBackend::new();
        (Locker::new(store.clone()), Locker::new(store))
    }

    /// Far longer than any test here: a handover within [`LIMIT`] was a release, not an expiry.
    const TTL: Duration = Duration::from_secs(30);
    const LIMIT: Duration = Duration::from_secs(10);

    async fn leads(e: &Election) -> u64 {
        tokio::time::timeout(LIMIT, e.wait_for_leadership())
            .await
            .expect("leads in time")
            .expect("campaigning")
    }

    async fn queued(locker: &Locker) {
        tokio::time::timeout(LIMIT, async {
            while locker.waiting() == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the candidate queues for the lock");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn resign_hands_leadership_over_with_a_greater_term() {
        let (x, y) = pair();
        let a = x.elect("el:resign").ttl(TTL).start().unwrap();
        let t1 = leads(&a).await;
        assert_eq!((a.is_leader(), a.term()), (true, Some(t1)));
        assert_eq!(*a.watch().borrow(), Leadership::Leader { term: t1 });
        let b = y.elect("el:resign").ttl(TTL).start().unwrap();
        queued(&y).await;
        assert_eq!(*b.watch().borrow(), Leadership::Follower);
        assert!(!b.is_leader());
        b.lost().await; // not leading: resolves at once

        let mut a_role = a.watch();
        let b_leads = async {
            let t2 = leads(&b).await;
            // The old leader stopped leading before the new one started.
            assert!(!a.is_leader());
            t2
        };
        let (resigned, t2) = tokio::join!(a.resign(), b_leads);
        resigned.unwrap();
        assert!(t2 > t1, "terms increase: {t2} > {t1}");
        // Not leading: resolves at once.
        a.lost().await;
        // The last role published is Follower; the channel closes with the campaign.
        assert_eq!(*a_role.borrow_and_update(), Leadership::Follower);
        assert!(a_role.changed().await.is_err());
        assert_eq!(a.wait_for_leadership().await, None, "campaign over");
        assert_eq!(b.term(), Some(t2));
        b.resign().await.unwrap();
        b.resign().await.unwrap(); // again: nothing to do
    }

    /// A `resign` dropped before the campaign task ended (a shutdown deadline): the next call
    /// still waits for the task, so that when it returns the lock is released. It returned
    /// `Ok(())` at once, the lock still held, the task still on its way.
    #[tokio::test(flavor = "current_thread")]
    async fn a_resign_after_a_dropped_one_returns_once_the_lock_is_released() {
        use futures_util::FutureExt;
        let (x, y) = pair();
        let a = x.elect("el:resign-dropped").ttl(TTL).start().unwrap();
        leads(&a).await;
        // Polled once, then dropped: the campaign task has been told to stop, not run since.
        assert!(a.resign().now_or_never().is_none());
        a.resign().await.unwrap();
        assert!(!a.is_leader());
        let next = y.lock("el:resign-dropped").try_acquire().await.unwrap();
        assert!(next.is_some(), "released when resign returned");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropping_the_leaders_election_hands_leadership_over() {
        let (x, y) = pair();
        let a = x.elect("el:drop").ttl(TTL).start().unwrap();
        let t1 = leads(&a).await;
        let b = y.elect("el:drop").ttl(TTL).start().unwrap();
        queued(&y).await;
        drop(a);
        drop(x);
        let t2 = leads(&b).await;
        assert!(t2 > t1, "{t2} > {t1}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_leader_campaigns_again() {
        let store = MemoryBackend::new();
        let (x, y) = (Locker::new(store.clone()), Locker::new(store.clone()));
        // Renewed every 100 ms: the stolen lock is noticed at the next renewal.
        let ttl = Duration::from_millis(300);
        let a = x.elect("el:lost").ttl(ttl).start().unwrap();
        let t1 = leads(&a).await;
        let b = y.elect("el:lost").ttl(ttl).start().unwrap();
        queued(&y).await;
        // Taken away behind A's back: B gets it, A's renewal finds another owner.
        assert!(store.force_release(x.resource(LockKey::new("el:lost").unwrap()).as_str()));
        tokio::time::timeout(LIMIT, a.lost()).await.expect("A told");
        let t2 = leads(&b).await;
        assert!(t2 > t1, "{t2} > {t1}");
        // A queued again: it leads once B steps down.
        queued(&x).await;
        b.resign().await.unwrap();
        let t3 = leads(&a).await;
        assert!(t3 > t2, "{t3} > {t2}");
        a.resign().await.unwrap();
    }

    /// Work racing `ended(t1)` ends with t1 even when the candidate lost t1 and leads again in
    /// t2 before the race starts; `lost()` called then would follow t2.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ended_follows_the_term_it_is_given_not_the_current_one() {
        use futures_util::FutureExt;
        let store = MemoryBackend::new();
        let x = Locker::new(store.clone());
        let ttl = Duration::from_millis(300);
        let a = x.elect("el:ended").ttl(ttl).start().unwrap();
        let t1 = leads(&a).await;
        assert!(a.ended(t1).now_or_never().is_none(), "t1 is current");
        assert!(store.force_release(x.resource(LockKey::new("el:ended").unwrap()).as_str()));
        tokio::time::timeout(LIMIT, a.ended(t1))
            .await
            .expect("t1 ends");
        // Alone, A leads again at once, in a later term.
        let t2 = leads(&a).await;
        assert!(t2 > t1, "{t2} > {t1}");
        assert!(a.ended(t1).now_or_never().is_some(), "t1 stays over");
        assert!(a.ended(t2).now_or_never().is_none(), "t2 is current");
        assert!(a.lost().now_or_never().is_none(), "lost() follows t2");
        let ends = a.ended(t2);
        let (resigned, ()) = tokio::join!(a.resign(), ends);
        resigned.unwrap();
        assert!(a.ended(t2).now_or_never().is_some());
    }

    /// A change of role published while a reader holds a borrow of the role channel
    /// ([`Election::watch`]) and asks the term ([`Election::is_leader`]): the campaign took
    /// the term's mutex, then waited for the channel the borrow held, while the reader waited
    /// for the mutex — both for good.
    #[test]
    fn a_change_published_while_the_role_is_borrowed_leaves_the_term_readable() {
        let (tx, rx) = watch::channel(Leadership::Leader { term: 1 });
        let held: Held = Arc::new(Mutex::new(None));
        let campaign = Campaign {
            locker: Locker::memory(),
            name: LockKey::new("el:borrow").unwrap(),
            ttl: TTL,
            held: held.clone(),
            tx,
        };
        let borrowed = rx.borrow();
        let publisher = std::thread::spawn(move || campaign.set(None));
        // The publisher waits for the borrow (before: holding the term's mutex, which shows).
        let until = std::time::Instant::now() + Duration::from_millis(200);
        while held.try_lock().is_ok() && std::time::Instant::now() < until {
            std::thread::yield_now();
        }
        // What `is_leader` does, on a thread of its own so that a stuck one can be told.
        let (answered_tx, answered) = std::sync::mpsc::channel();
        let reader = held.clone();
        std::thread::spawn(move || {
            let leads = reader.lock().unwrap().is_some();
            answered_tx.send(leads).unwrap();
        });
        let answer = answered.recv_timeout(Duration::from_secs(5));
        drop(borrowed);
        publisher.join().unwrap();
        assert!(
            answer.is_ok(),
            "the term could not be read while a borrowed role was being changed"
        );
        assert_eq!(*rx.borrow(), Leadership::Follower);
    }

    #[test]
    fn bad_input_and_no_runtime_are_typed_errors() {
        let locker = Locker::memory();
        assert!(locker.elect("").start().unwrap_err().is_invalid());
        let err = locker
            .elect("el:ttl")
            .ttl(Duration::ZERO)
            .start()
            .unwrap_err();
        assert!(err.is_invalid(), "{err}");
        let err = locker.elect("el:no-runtime").start().unwrap_err();
        assert!(err.is_unsupported(), "{err}");
        assert!(err.to_string().contains("tokio runtime"), "{err}");
    }

    /// A campaign runs on the runtime the election was started on and ends with it, in the
    /// open: the lock is released (the other candidate leads with a greater term long before
    /// the TTL), `is_leader` is `false`, the watch channel closes and `resign` answers
    /// `Unavailable`.
    #[test]
    fn a_campaign_ends_with_its_runtime() {
        let rt = || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap()
        };
        let (x, y) = pair();
        let first = rt();
        let (a, t1) = first.block_on(async {
            let a = x.elect("el:runtime").ttl(TTL).start().unwrap();
            let t1 = leads(&a).await;
            (a, t1)
        });
        let mut role = a.watch();
        drop(first);
        let other = rt();
        other.block_on(async {
            assert!(!a.is_leader());
            assert_eq!(a.term(), None);
            // `Follower` is published, then the channel closes.
            while role.changed().await.is_ok() {}
            assert_eq!(*role.borrow(), Leadership::Follower);
            let err = a.resign().await.unwrap_err();
            assert!(err.is_unavailable(), "{err}");
            let b = y.elect("el:runtime").ttl(TTL).start().unwrap();
            let t2 = leads(&b).await;
            assert!(t2 > t1);
        });
    }
}
