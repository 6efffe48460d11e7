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
//!
//! # Runtimes
//!
//! A client's channel runs on tasks of the runtime current when it was made: tonic's buffer
//! worker (which owns the balancer) and the HTTP/2 connection. When that runtime shuts down (an
//! actix-web worker restarting, a runtime built for set-up and dropped) while the backend lives
//! on, those tasks are gone for good: every later request fails at once with
//! `Unknown: Service was not ready: transport error`, and every stream on the connection
//! breaks. tonic reconnects a connection to a member that went away, never a channel whose
//! worker is gone. So each client comes with a *sentinel*: a task on the same runtime that
//! never ends and, dropped with that runtime, marks the client dead ([`Conn`]). Before a try
//! is sent, its member's client is read (a shared lock and an atomic load); a dead one is
//! replaced first by a client made on the runtime of the request at hand — one at a time: the
//! callers that find it dead meanwhile wait for that one connect, bounded by their deadline.
//! A member that is merely down is not dead (its channel's tasks live and reconnect): it is
//! suspected and passed over as before, and its requests fail with
//! [`LockError::Unavailable`] when no member answers in time.
//!
//! No request is sent to a client known dead, so the common case (the runtime shut down
//! between two requests) costs one connect and no retry. A try under way when the runtime
//! shuts down fails: if it never left the client (the buffer refused it: the message above)
//! it is repeated on the new client and does not count as possibly applied; if it may have
//! reached etcd (its connection broke under it), it is repeated like any try whose answer was
//! lost — every request the backend makes is safe to repeat (see the backend's docs) — and the
//! call is not *settled* ([`call_tracked`]), so the session registry treats a put in it as one
//! that may still land.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use futures_util::stream::{FuturesUnordered, StreamExt as _};
use tokio::time::Instant;

use crate::LockError;

/// How long a member that did not answer is passed over (unless every member is).
const SUSPECT_FOR: Duration = Duration::from_secs(2);

/// At most this many tries of one request at once.
const MAX_TRIES: usize = 3;

/// The clients, one per member.
pub(super) struct Pool {
    members: Vec<Arc<Member>>,
    suspect_until: Mutex<Vec<Option<Instant>>>,
    next: AtomicUsize,
}

/// One member: its client, and what it takes to make another.
pub(super) struct Member {
    endpoint: String,
    /// With the member's TLS settings and the user, if any (never printed).
    options: ConnectOptions,
    connect_timeout: Duration,
    conn: RwLock<Conn>,
    /// Held while a new client is made: one connect for every caller that found the old one
    /// dead.
    reconnecting: tokio::sync::Mutex<()>,
    /// How many times the client was made anew.
    reconnects: AtomicU64,
    /// A check of the connection ([`Member::check_silent`]) is under way.
    checking: AtomicBool,
}

/// A client, and whether the runtime its channel's tasks run on shut down.
struct Conn {
    client: Client,
    /// Set when the client's runtime shut down, and the channel's tasks (spawned on it by the
    /// same connect) with it.
    dead: Arc<AtomicBool>,
    _sentinel: Option<crate::util::RuntimeWatch>,
}

impl Conn {
    /// `client`, just made on the current runtime, watched by a sentinel on the same runtime
    /// ([`crate::util::on_runtime_shutdown`]).
    fn watched(client: Client) -> Self {
        let dead = Arc::new(AtomicBool::new(false));
        let mark = dead.clone();
        let sentinel =
            crate::util::on_runtime_shutdown(move || mark.store(true, Ordering::Release));
        Conn {
            client,
            dead,
            _sentinel: sentinel,
        }
    }
}

/// The error of a try that could not be sent: no live client within the time left.
fn not_connected(endpoint: &str) -> etcd_client::Error {
    etcd_client::Error::IoError(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("etcd: no new client for {endpoint} in time (its runtime shut down)"),
    ))
}

impl Member {
    /// Connects to the member at `endpoint` (`http[s]://host:port`) on the current runtime.
    pub(super) async fn connect(
        endpoint: String,
        options: ConnectOptions,
        connect_timeout: Duration,
    ) -> Result<Self, etcd_client::Error> {
        let client = Client::connect([endpoint.as_str()], Some(options.clone())).await?;
        Ok(Member {
            endpoint,
            options,
            connect_timeout,
            conn: RwLock::new(Conn::watched(client)),
            reconnecting: tokio::sync::Mutex::new(()),
            reconnects: AtomicU64::new(0),
            checking: AtomicBool::new(false),
        })
    }

    /// After a try went unanswered: asks the member's status on its connection within
    /// `limit`; unanswered there, on a new connection too — and if the member answers on that
    /// one, it replaces the old, which had gone silent (a NAT or load balancer that forgot it,
    /// a partition that healed: no reset, no close, every request on it timing out). The
    /// streams on the old one (watches, lease keepalives) break with it and are opened again
    /// on the new one. A member that answers on neither (frozen, down) keeps its connection:
    /// tonic reconnects it when it comes back. Its HTTP/2 pings would find a silent connection
    /// too, but only within `EtcdOptions::keep_alive` and a second (7 s by default) — longer
    /// than a short lease; they cannot be more frequent than etcd allows. One check at a time.
    pub(super) async fn check_silent(self: Arc<Self>, limit: Duration) {
        if self.checking.swap(true, Ordering::AcqRel) {
            return;
        }
        let status = |client: &Client| {
            let mut m = client.maintenance_client();
            async move { m.status().await }
        };
        let on_old = self.with_live(status);
        let silent = match on_old {
            // Dead (its runtime shut down): made anew on its next use anyway.
            None => false,
            Some(asked) => tokio::time::timeout(limit, asked).await.is_err(),
        };
        if silent {
            let connect = Client::connect([self.endpoint.as_str()], Some(self.options.clone()));
            if let Ok(Ok(client)) = tokio::time::timeout(self.connect_timeout, connect).await {
                if let Ok(Ok(_)) = tokio::time::timeout(limit, status(&client)).await {
                    let old = std::mem::replace(
                        &mut *self.conn.write().unwrap_or_else(PoisonError::into_inner),
                        Conn::watched(client),
                    );
                    drop(old);
                    self.reconnects.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        endpoint = %self.endpoint,
                        "etcd: this member's connection went silent; it was replaced"
                    );
                }
            }
        }
        self.checking.store(false, Ordering::Release);
    }

    /// `f` of the client, unless the client is dead (`None`).
    fn with_live<R>(&self, f: impl FnOnce(&Client) -> R) -> Option<R> {
        let conn = self.conn.read().unwrap_or_else(PoisonError::into_inner);
        (!conn.dead.load(Ordering::Acquire)).then(|| f(&conn.client))
    }

    fn is_dead(&self) -> bool {
        self.with_live(|_| ()).is_none()
    }

    /// Has the next request made on a new client, which signs in again: the auth token of
    /// this one is older than the cluster's auth store ([`auth_outdated`]).
    fn sign_in_again(&self) {
        let conn = self.conn.read().unwrap_or_else(PoisonError::into_inner);
        conn.dead.store(true, Ordering::Release);
    }

    /// Replaces a dead client with one made on the current runtime, before `until`: one
    /// connect at a time, and none when another caller's made a live one meanwhile.
    async fn reconnect(&self, until: Instant) -> Result<(), etcd_client::Error> {
        let Ok(_one) = tokio::time::timeout_at(until, self.reconnecting.lock()).await else {
            return Err(not_connected(&self.endpoint));
        };
        if !self.is_dead() {
            return Ok(());
        }
        let until = until.min(Instant::now() + self.connect_timeout);
        let connect = Client::connect([self.endpoint.as_str()], Some(self.options.clone()));
        let client = tokio::time::timeout_at(until, connect)
            .await
            .map_err(|_| not_connected(&self.endpoint))??;
        let old = std::mem::replace(
            &mut *self.conn.write().unwrap_or_else(PoisonError::into_inner),
            Conn::watched(client),
        );
        drop(old);
        self.reconnects.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            endpoint = %self.endpoint,
            "etcd: this member's client was made anew (its runtime shut down, or its auth \
             token was outdated)"
        );
        Ok(())
    }

    /// The request `request` makes on a live client (made anew first if the client is dead).
    async fn open<F>(
        &self,
        until: Instant,
        request: &mut impl FnMut(&Client) -> F,
    ) -> Result<Pin<Box<F>>, etcd_client::Error> {
        // Twice at most: a new client is dead at once only if this runtime is shutting down
        // too (and then this task is about to be dropped).
        for _ in 0..2 {
            // Boxed: a client's request future is large, and every future around this one (up
            // to the backend's boxed future) would otherwise carry it and copy it when moved.
            if let Some(fut) = self.with_live(|c| Box::pin(request(c))) {
                return Ok(fut);
            }
            // Boxed: rare, and large (a connect), it would make every request's future larger.
            Box::pin(self.reconnect(until)).await?;
        }
        Err(not_connected(&self.endpoint))
    }
}

impl Pool {
    pub(super) fn new(members: Vec<Member>) -> Self {
        let n = members.len();
        Pool {
            members: members.into_iter().map(Arc::new).collect(),
            suspect_until: Mutex::new(vec![None; n]),
            next: AtomicUsize::new(0),
        }
    }

    /// How many times a member's client was made anew (its runtime shut down).
    pub(super) fn reconnects(&self) -> u64 {
        self.members
            .iter()
            .map(|m| m.reconnects.load(Ordering::Relaxed))
            .sum()
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

    /// Puts member `i` under suspicion (a try or a stream on it failed or went silent): new
    /// tries go to other members for a while.
    pub(super) fn suspect(&self, i: usize) {
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
    // The first try is polled in place; the hedged ones (rare: a member that does not answer)
    // go into a set made when the first of them starts. One timer serves the hedge and the
    // deadline. (What a request costs the client is most of what a lock costs it.)
    let (i, opened) = open_next(pool, &mut pending, deadline, &mut request).await;
    let first = tried(i, opened);
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
            Some((i, answer, sent)) => {
                pending.retain(|p| p.0 != i);
                let settled = !in_flight(first_live, &hedged) && !doubtful;
                match answer {
                    Ok(v) => {
                        pool.trust(i);
                        return (Ok(v), settled);
                    }
                    Err(e) if !retryable(&e) => {
                        let permanent = refused_for_good(&e);
                        let err = LockError::backend(
                            format!("etcd {what} failed"),
                            Some(Box::new(e)),
                            permanent,
                        );
                        return (Err(err), settled);
                    }
                    Err(e) => {
                        if auth_outdated(&e) {
                            pool.members[i].sign_in_again();
                        }
                        pool.suspect(i);
                        // A request that never left the client cannot have been applied.
                        doubtful |= sent;
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
                        // Its connection may have gone silent: checked aside (once at a time).
                        if let Ok(rt) = tokio::runtime::Handle::try_current() {
                            rt.spawn(pool.members[i].clone().check_silent(timeout));
                        }
                    }
                }
                if pending.len() < MAX_TRIES {
                    let (i, opened) = open_next(pool, &mut pending, deadline, &mut request).await;
                    hedged
                        .get_or_insert_with(FuturesUnordered::new)
                        .push(tried(i, opened));
                }
                next_try = (now + hedge_after).min(deadline);
                timer.as_mut().reset(next_try);
            }
        }
    }
}

/// Runs `request` on every member at once, within `timeout` in all: each member's endpoint
/// with its answer, `None` when it gave none in time. Neither the round robin nor any member's
/// suspicion moves (see [`Pool::pick`]): for a look at the cluster off the lock paths, which
/// must not change where their requests go.
pub(super) async fn ask_each<T, F: Future<Output = Result<T, etcd_client::Error>>>(
    pool: &Pool,
    timeout: Duration,
    request: impl Fn(&Client) -> F,
) -> Vec<(&str, Option<T>)> {
    let until = Instant::now() + timeout;
    let asks = pool.members.iter().map(|member| {
        let mut request = &request;
        async move {
            let answer = tokio::time::timeout_at(until, async {
                member.open(until, &mut request).await.ok()?.await.ok()
            })
            .await
            .ok()
            .flatten();
            (member.endpoint.as_str(), answer)
        }
    });
    futures_util::future::join_all(asks).await
}

/// Opens a stream with `request` on one member, within `timeout`: one try at a time, each on
/// a member picked as [`call`] picks them and given [`per_try`] (a stream is not hedged: two
/// would both stay open). Answers the member's number with the stream, so that its holder can
/// put the member under suspicion when the stream goes silent ([`Pool::suspect`]).
pub(super) async fn open_on_one<T, F: Future<Output = Result<T, etcd_client::Error>>>(
    pool: &Pool,
    timeout: Duration,
    what: &'static str,
    mut request: impl FnMut(&Client) -> F,
) -> Result<(usize, T), LockError> {
    let deadline = Instant::now() + timeout;
    let mut last: Option<etcd_client::Error> = None;
    loop {
        let i = pool.pick(&[]);
        let until = (Instant::now() + per_try(timeout)).min(deadline);
        let opened = tokio::time::timeout_at(until, async {
            pool.members[i].open(until, &mut request).await?.await
        })
        .await;
        match opened {
            Ok(Ok(stream)) => {
                pool.trust(i);
                return Ok((i, stream));
            }
            Ok(Err(e)) if !retryable(&e) => {
                let permanent = refused_for_good(&e);
                return Err(LockError::backend(
                    format!("etcd {what} failed"),
                    Some(Box::new(e)),
                    permanent,
                ));
            }
            Ok(Err(e)) => {
                if auth_outdated(&e) {
                    pool.members[i].sign_in_again();
                }
                pool.suspect(i);
                last = Some(e);
            }
            Err(_) => pool.suspect(i),
        }
        let now = Instant::now();
        if now >= deadline {
            let source = last.map(|e| Box::new(e) as crate::BoxError);
            return Err(LockError::unavailable(
                format!("etcd {what}: no member opened it within {timeout:?}"),
                source,
            ));
        }
        // Every member failing at once (none up): not a busy loop until the deadline.
        tokio::time::sleep_until((now + Duration::from_millis(10)).min(deadline)).await;
    }
}

/// Picks the member of a new try (see [`Pool::pick`]) and makes its request on the member's
/// live client, connecting anew first if the client's runtime shut down; the try counts in
/// `pending` from then on. An `Err`: no live client could be made before `until`.
async fn open_next<F>(
    pool: &Pool,
    pending: &mut Vec<(usize, Instant)>,
    until: Instant,
    request: &mut impl FnMut(&Client) -> F,
) -> (usize, Result<Pin<Box<F>>, etcd_client::Error>) {
    let busy: Vec<usize> = pending.iter().map(|p| p.0).collect();
    let i = pool.pick(&busy);
    let opened = pool.members[i].open(until, request).await;
    pending.push((i, Instant::now()));
    (i, opened)
}

/// A try: the member's answer, and whether the request may have reached etcd (not when it
/// was never made, nor when the channel refused it: [`unsent`]).
async fn tried<T, F: Future<Output = Result<T, etcd_client::Error>>>(
    i: usize,
    opened: Result<Pin<Box<F>>, etcd_client::Error>,
) -> (usize, Result<T, etcd_client::Error>, bool) {
    match opened {
        Ok(fut) => {
            let answer = fut.await;
            let sent = !matches!(&answer, Err(e) if unsent(e));
            (i, answer, sent)
        }
        Err(e) => (i, Err(e), false),
    }
}

/// Whether a request failed before it was handed to the connection: the generated gRPC client
/// asks the channel whether it is ready first and answers this when it is not — with
/// etcd-client's balanced channel (whose balancer never fails: it waits for an endpoint),
/// only when the channel's buffer worker is gone, i.e. its runtime shut down.
fn unsent(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::Unknown && s.message().starts_with("Service was not ready"))
}

/// Whether etcd refused the request's auth token as older than its auth store (any user or
/// role change in the cluster makes it so): etcd's own client signs in again and retries;
/// etcd-client signs in again only on `Unauthenticated`. A try on a new client (which signs
/// in again) succeeds; a simple token is checked against the current store on each request,
/// so a plain retry does too.
fn auth_outdated(e: &etcd_client::Error) -> bool {
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if s.code() == tonic::Code::InvalidArgument
            && s.message().contains("revision of auth store is old"))
}

/// Whether another try (maybe on another member) may succeed.
fn retryable(e: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    use tonic::Code;
    if auth_outdated(e) {
        return true;
    }
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

/// Whether etcd refused in a way retrying does not change ([`LockError::Misconfigured`]): the
/// user lacks a permission on the lock keys (`PermissionDenied`), the request or its
/// credentials are invalid (`InvalidArgument`: a wrong password, a request without a user
/// on a cluster with auth enabled, a limit exceeded), or credentials were given to a cluster
/// without auth (`FailedPrecondition`, "authentication is not enabled"). An expired auth token
/// (`Unauthenticated`) is renewed by signing in again, and one older than the auth store
/// ([`auth_outdated`]) by a new client: both stay `Unavailable`.
pub(super) fn refused_for_good(e: &etcd_client::Error) -> bool {
    use tonic::Code;
    matches!(e, etcd_client::Error::GRpcStatus(s)
        if matches!(s.code(), Code::PermissionDenied | Code::InvalidArgument)
            && !auth_outdated(e)
        || s.code() == Code::FailedPrecondition
            && s.message().contains("authentication is not enabled"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An auth token older than the auth store (a user or role changed anywhere in the
    /// cluster) is worth another try, on a client that signs in again — not a refusal for
    /// good (a 500 for every request until a JWT token expired); credentials given to a
    /// cluster without auth are one, not an outage retried for ever.
    #[test]
    fn auth_refusals_are_told_apart() {
        let status =
            |code, msg: &str| etcd_client::Error::GRpcStatus(tonic::Status::new(code, msg));
        let old = status(
            tonic::Code::InvalidArgument,
            "etcdserver: revision of auth store is old",
        );
        assert!(auth_outdated(&old));
        assert!(retryable(&old));
        assert!(!refused_for_good(&old));
        let not_enabled = status(
            tonic::Code::FailedPrecondition,
            "etcdserver: authentication is not enabled",
        );
        assert!(refused_for_good(&not_enabled));
        assert!(!retryable(&not_enabled));
        let wrong_password = status(
            tonic::Code::InvalidArgument,
            "etcdserver: authentication failed, invalid user ID or password",
        );
        assert!(refused_for_good(&wrong_password));
        assert!(!retryable(&wrong_password));
        let denied = status(
            tonic::Code::PermissionDenied,
            "etcdserver: permission denied",
        );
        assert!(refused_for_good(&denied));
        let other_precondition = status(tonic::Code::FailedPrecondition, "etcdserver: not capable");
        assert!(!refused_for_good(&other_precondition));
    }

    /// A member at a port nothing listens on: connecting (no user) opens nothing yet.
    fn nowhere() -> String {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        format!("http://127.0.0.1:{port}")
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn get(
        c: &Client,
    ) -> impl Future<Output = Result<etcd_client::GetResponse, etcd_client::Error>> {
        let mut kv = c.kv_client();
        async move { kv.get("k", None).await }
    }

    /// A member's client made on a runtime that shut down is dead: a request on it fails at
    /// once, refused by its channel (never sent). Many callers on another runtime then make one
    /// new client between them, which is live.
    #[test]
    fn a_client_whose_runtime_shut_down_is_made_anew_once() {
        let first = runtime();
        let member = Arc::new(
            first
                .block_on(Member::connect(
                    nowhere(),
                    ConnectOptions::new(),
                    Duration::from_secs(1),
                ))
                .unwrap(),
        );
        assert!(!member.is_dead());
        drop(first);
        assert!(member.is_dead(), "its runtime shut down");
        runtime().block_on(async {
            let dead = member.conn.read().unwrap().client.clone();
            let err = get(&dead).await.expect_err("a request on a dead channel");
            assert!(unsent(&err), "{err:?}");
            let until = Instant::now() + Duration::from_secs(1);
            let opens = (0..16).map(|_| {
                let member = member.clone();
                tokio::spawn(async move { member.open(until, &mut get).await.map(drop) })
            });
            for opened in futures_util::future::join_all(opens).await {
                opened.unwrap().unwrap();
            }
            assert!(!member.is_dead());
            assert_eq!(member.reconnects.load(Ordering::Relaxed), 1);
        });
    }

    /// A member that is down is not dead: its channel lives (tonic connects again when asked),
    /// a request fails as the member's refusal — a try worth repeating, not one the channel
    /// refused — and no new client is made.
    #[test]
    fn a_member_that_is_down_is_not_dead() {
        runtime().block_on(async {
            let member = Member::connect(nowhere(), ConnectOptions::new(), Duration::from_secs(1))
                .await
                .unwrap();
            let until = Instant::now() + Duration::from_millis(300);
            let request = member.open(until, &mut get).await.unwrap();
            match tokio::time::timeout_at(until, request).await {
                // Refused by the member (`Unavailable: tcp connect error`), or waiting for it.
                Ok(Err(e)) => assert!(!unsent(&e) && retryable(&e), "{e:?}"),
                Ok(Ok(_)) => panic!("an answer from nowhere"),
                Err(_) => {}
            }
            assert!(!member.is_dead());
            assert_eq!(member.reconnects.load(Ordering::Relaxed), 0);
        });
    }
}
