//! One etcd client per member, and requests that go to members that answer.
//!
//! etcd-client balances one channel over all endpoints, picking a *ready* endpoint at random
//! (tonic's balancer reports no load). A frozen member (SIGSTOP, a stuck disk, a half-open
//! partition) keeps its connection open and stays "ready", so a third of the requests to a
//! three-member cluster would hang on it until its HTTP/2 keepalive gives up. Here every member
//! has its own client; [`call`] sends a try to a member not under suspicion, suspects a member
//! that did not answer within [`per_try`] or failed in a way another member may not, and
//! hedges: a try unanswered after `per_try` gets a sibling on another member, and the first
//! answer wins.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use etcd_client::Client;
use futures_util::stream::{FuturesUnordered, StreamExt as _};
use tokio::time::Instant;

use crate::LockError;

/// How long a member that did not answer is passed over (unless every member is).
const SUSPECT_FOR: Duration = Duration::from_secs(2);

/// At most this many tries of one request at once.
const MAX_TRIES: usize = 3;

/// The clients, one per member.
pub(super) struct Pool {
    members: Vec<Client>,
    suspect_until: Mutex<Vec<Option<Instant>>>,
    next: AtomicUsize,
}

impl Pool {
    pub(super) fn new(members: Vec<Client>) -> Self {
        let n = members.len();
        Pool {
            members,
            suspect_until: Mutex::new(vec![None; n]),
            next: AtomicUsize::new(0),
        }
    }

    /// A member to try, round robin over those not under suspicion and not in `busy` (those
    /// this request already waits on); any member when there is none.
    fn pick(&self, busy: &[usize]) -> usize {
        let n = self.members.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let now = Instant::now();
        let suspect = self
            .suspect_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let ok = |i: usize| suspect[i].is_none_or(|t| t <= now);
        (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| ok(i) && !busy.contains(&i))
            .or_else(|| (0..n).map(|k| (start + k) % n).find(|i| !busy.contains(i)))
            .unwrap_or(start % n)
    }

    fn suspect(&self, i: usize) {
        self.suspect_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)[i] = Some(Instant::now() + SUSPECT_FOR);
    }

    fn trust(&self, i: usize) {
        self.suspect_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner)[i] = None;
    }
}

/// How long one try may go unanswered before another starts beside it: a fifth of the
/// command timeout, at least 50 ms.
pub(super) fn per_try(timeout: Duration) -> Duration {
    (timeout / 5).max(Duration::from_millis(50)).min(timeout)
}

/// Runs `request` (made anew for every try, on the client of the member it goes to) within
/// `timeout`, hedged and retried as the [module docs](self) say. Every request the backend
/// makes is safe to repeat (see the backend's docs); an error that says the request itself is
/// wrong (auth, invalid argument) is returned at once.
pub(super) async fn call<T, F: Future<Output = Result<T, etcd_client::Error>>>(
    pool: &Pool,
    timeout: Duration,
    what: &'static str,
    request: impl FnMut(&Client) -> F,
) -> Result<T, LockError> {
    call_tracked(pool, timeout, what, request).await.0
}

/// [`call`], also telling whether the request is *settled*: every try it sent was answered,
/// so none can still land on the server later. A request answered by one try while a hedged
/// sibling was still out, or one that timed out, is not settled (a put in it may yet land).
pub(super) async fn call_tracked<T, F: Future<Output = Result<T, etcd_client::Error>>>(
    pool: &Pool,
    timeout: Duration,
    what: &'static str,
    mut request: impl FnMut(&Client) -> F,
) -> (Result<T, LockError>, bool) {
    let deadline = Instant::now() + timeout;
    let hedge_after = per_try(timeout);
    // (member, started) of the tries in flight.
    let mut pending: Vec<(usize, Instant)> = Vec::with_capacity(1);
    let mut start = |pending: &mut Vec<(usize, Instant)>| {
        let busy: Vec<usize> = pending.iter().map(|p| p.0).collect();
        let i = pool.pick(&busy);
        pending.push((i, Instant::now()));
        // Boxed: a client's request future is large, and every future around this one (up
        // to the backend's boxed future) would otherwise carry it and copy it when moved.
        let fut = Box::pin(request(&pool.members[i]));
        async move { (i, fut.await) }
    };
    // The first try is polled in place; the hedged ones (rare: a member that does not answer)
    // go into a set made when the first of them starts. One timer serves the hedge and the
    // deadline. (What a request costs the client is most of what a lock costs it.)
    let first = start(&mut pending);
    tokio::pin!(first);
    let mut first_live = true;
    let mut hedged = None::<FuturesUnordered<_>>;
    let mut next_try = (Instant::now() + hedge_after).min(deadline);
    let timer = tokio::time::sleep_until(next_try);
    tokio::pin!(timer);
    let mut last: Option<etcd_client::Error> = None;
    // A try that failed may have been applied all the same (a lost answer).
    let mut doubtful = false;
    loop {
        let answered = tokio::select! {
            biased;
            a = &mut first, if first_live => {
                first_live = false;
                Some(a)
            }
            Some(a) = async { hedged.as_mut()?.next().await }, if hedged.as_ref().is_some_and(|h| !h.is_empty()) => {
                Some(a)
            }
            () = &mut timer => None,
        };
        let in_flight = |first_live: bool, hedged: &Option<FuturesUnordered<_>>| {
            first_live || hedged.as_ref().is_some_and(|h| !h.is_empty())
        };
        match answered {
            Some((i, answer)) => {
                pending.retain(|p| p.0 != i);
                let settled = !in_flight(first_live, &hedged) && !doubtful;
                match answer {
                    Ok(v) => {
                        pool.trust(i);
                        return (Ok(v), settled);
                    }
                    Err(e) if !retryable(&e) => {
                        let err = LockError::unavailable(
                            format!("etcd {what} failed"),
                            Some(Box::new(e)),
                        );
                        return (Err(err), settled);
                    }
                    Err(e) => {
                        pool.suspect(i);
                        doubtful = true;
                        last = Some(e);
                        if !in_flight(first_live, &hedged) {
                            next_try = (Instant::now() + Duration::from_millis(10)).min(deadline);
                            timer.as_mut().reset(next_try);
                        }
                    }
                }
            }
            None => {
                let now = Instant::now();
                if now >= deadline {
                    let source = last.map(|e| Box::new(e) as crate::BoxError);
                    let err = LockError::unavailable(
                        format!("etcd {what}: no answer within {timeout:?}"),
                        source,
                    );
                    return (Err(err), false);
                }
                for &(i, at) in &pending {
                    if now - at >= hedge_after {
                        pool.suspect(i);
                    }
                }
                if pending.len() < MAX_TRIES {
                    let fut = start(&mut pending);
                    hedged.get_or_insert_with(FuturesUnordered::new).push(fut);
                }
                next_try = (now + hedge_after).min(deadline);
                timer.as_mut().reset(next_try);
            }
        }
    }
}

/// Whether another try (maybe on another member) may succeed.
fn retryable(e: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        E::TransportError(_) | E::IoError(_) | E::WatchError(_) => true,
        E::GRpcStatus(s) => matches!(
            s.code(),
            Code::Unavailable
                | Code::DeadlineExceeded
                | Code::Unknown
                | Code::Cancelled
                | Code::Aborted
                | Code::ResourceExhausted
        ),
        _ => false,
    }
}
