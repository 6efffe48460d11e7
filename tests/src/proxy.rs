//! A fault-injecting TCP proxy in front of one server, for fault tests and the torture harness.
//!
//! In the harness, every byte a worker exchanges with a lock server goes through one of these
//! (one proxy per server, running in the coordinator). A test or the coordinator can
//!
//! * add **latency**: each chunk read from either side is forwarded `latency` after it was
//!   read (order preserved, throughput unlimited), so a round trip costs `2 × latency` more;
//! * **cut** every open connection at once (both sockets closed, what a network partition or
//!   a middlebox reset looks like to both ends), and optionally **refuse** new connections for
//!   a while (accepted and closed at once), so clients see their reconnects fail too;
//! * **cut right after the next reply** ([`cut_after_next_reply`](Proxy::cut_after_next_reply),
//!   or the next few: [`cut_after_replies`](Proxy::cut_after_replies)): the next chunk the
//!   server sends is delivered, then every connection is cut and new ones are refused — a
//!   partition that falls exactly between two commands.
//!
//! * **silence** every open connection for good ([`silence`](Proxy::silence)): nothing more is
//!   forwarded on them either way and they stay open — a partition, or a load balancer or NAT
//!   that forgot them, which sends no reset — while new connections are forwarded as usual.
//!
//! * **hold** every open connection ([`hold`](Proxy::hold)): what the client sends on them is
//!   kept, in order, until [`deliver_held`](Proxy::deliver_held) delivers it to the server,
//!   while the server's answers are never delivered — a partition that heals after the client
//!   gave up on the connection, when TCP resends what it had sent. New connections are
//!   forwarded as usual.
//!
//! * **stall** every open connection ([`stall`](Proxy::stall)) until [`heal`](Proxy::heal):
//!   what either side sends on them is kept, in order, and delivered when the partition heals
//!   — TCP's resends, after the client may have given up on the connection and made another.
//!   New connections are forwarded as usual.
//!
//! * **swallow Postgres cancel requests** ([`swallow_cancels`](Proxy::swallow_cancels)): a
//!   connection that opens with a `CancelRequest` is closed without reaching the server — a
//!   cancel that cannot help (a server stalled on I/O) or is lost.
//!
//! * **pause new connections** ([`pause_new`](Proxy::pause_new)) until
//!   [`resume_new`](Proxy::resume_new): a connection made meanwhile is accepted and nothing
//!   it sends reaches the server until then — a server too busy to take connections (its
//!   listen queue full, forking slowly) while the connections it has work.
//!
//! It also counts **connections being made**: open, and not yet answered by the server (for
//! Postgres, from the client's connect to the server's first reply to its startup), and the
//! most there were at once ([`peak_unanswered`](Proxy::peak_unanswered)).
//!
//! * **cut one connection after a reply** ([`cut_after_reply_to`](Proxy::cut_after_reply_to)):
//!   the connection a request went out on is reset right after its answer is delivered.
//!
//! * **retarget** new connections to another server ([`retarget`](Proxy::retarget)), the open
//!   ones staying where they are: a virtual IP or DNS name moved in a failover.
//!
//! When the upstream server is down (restarted), new connections are closed at once, and
//! when the server closes a connection the proxy closes the client side.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tokio::time::Instant;

/// One proxy: listens on a free loopback port, forwards to `upstream`.
#[derive(Debug)]
pub struct Proxy {
    port: u16,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

#[derive(Debug)]
struct Shared {
    /// The loopback port new connections are forwarded to ([`Proxy::retarget`]).
    upstream_port: AtomicU16,
    /// [`Proxy::cut_after_reply_to`]: the bytes to look for in what clients send, and how
    /// many more sightings until the one that arms the cut.
    cut_on: Mutex<Option<(Vec<u8>, u32)>>,
    /// The connection to cut once the server's next chunk on it is delivered (0: none).
    cut_conn: AtomicU64,
    /// The chunk its client sent that armed the cut ([`Proxy::cut_request`]).
    cut_request: Mutex<Vec<u8>>,
    latency_us: AtomicU64,
    refuse: AtomicBool,
    /// Chunks any server is yet to send before every connection is cut (0: no cut coming).
    cut_after_replies: AtomicU64,
    conns: Mutex<HashMap<u64, AbortHandle>>,
    next_id: AtomicU64,
    /// Connections accepted since start (for the report).
    accepted: AtomicU64,
    /// Connections refused since start.
    refused: AtomicU64,
    /// Connections numbered below this one are silent ([`Proxy::silence`]).
    silent_below: AtomicU64,
    /// Connections numbered below this one keep what their client sends until it is delivered
    /// ([`Proxy::hold`]; 0 once delivered)…
    held_below: tokio::sync::watch::Sender<u64>,
    /// … and deliver nothing the server sends.
    muted_below: AtomicU64,
    /// Bytes the held connections' clients sent since [`Proxy::hold`].
    held_bytes: AtomicU64,
    /// What the held connections' clients sent since the last hold, in the order read.
    held_data: Mutex<Vec<u8>>,
    /// Connections numbered below this one keep what either side sends until healed
    /// ([`Proxy::stall`]; 0 once healed).
    stalled_below: tokio::sync::watch::Sender<u64>,
    /// The pause after each held chunk delivered ([`Proxy::deliver_held_spaced`]), µs.
    held_gap_us: AtomicU64,
    /// Close connections that open with a Postgres `CancelRequest` ([`Proxy::swallow_cancels`]).
    swallow_cancels: AtomicBool,
    /// Cancel requests swallowed so far.
    swallowed: AtomicU64,
    /// New connections wait before reaching the server ([`Proxy::pause_new`]).
    new_paused: tokio::sync::watch::Sender<bool>,
    /// Connections open that the server has not answered yet.
    unanswered: AtomicU64,
    /// The most `unanswered` has been since start or the last reset.
    peak_unanswered: AtomicU64,
}

impl Proxy {
    /// Starts a proxy in front of `127.0.0.1:<upstream_port>`.
    pub async fn start(upstream_port: u16) -> io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            upstream_port: AtomicU16::new(upstream_port),
            cut_on: Mutex::new(None),
            cut_conn: AtomicU64::new(0),
            cut_request: Mutex::new(Vec::new()),
            latency_us: AtomicU64::new(0),
            refuse: AtomicBool::new(false),
            cut_after_replies: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            silent_below: AtomicU64::new(0),
            held_below: tokio::sync::watch::Sender::new(0),
            stalled_below: tokio::sync::watch::Sender::new(0),
            muted_below: AtomicU64::new(0),
            held_bytes: AtomicU64::new(0),
            held_data: Mutex::new(Vec::new()),
            held_gap_us: AtomicU64::new(0),
            swallow_cancels: AtomicBool::new(false),
            swallowed: AtomicU64::new(0),
            new_paused: tokio::sync::watch::Sender::new(false),
            unanswered: AtomicU64::new(0),
            peak_unanswered: AtomicU64::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Proxy {
            port,
            shared,
            accept,
        })
    }

    /// Cuts the one connection on which a client sends `needle` for the `nth` time (counting
    /// from 1, over all connections) right after the server's next chunk on it is delivered —
    /// a reset that falls between a request's answer and what its client sends next on that
    /// connection. Other connections, and new ones, are forwarded as usual.
    pub fn cut_after_reply_to(&self, needle: &[u8], nth: u32) {
        *self
            .shared
            .cut_on
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some((needle.to_vec(), nth.max(1)));
    }

    /// What the client sent, in the one read, that armed the last
    /// [`cut_after_reply_to`](Proxy::cut_after_reply_to): the request the cut falls after, and
    /// whatever its client wrote with it.
    pub fn cut_request(&self) -> Vec<u8> {
        self.shared
            .cut_request
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Forwards new connections to `127.0.0.1:<port>` from now on, while the open ones stay on
    /// the server they were made to — what a virtual IP or a DNS name moved to a promoted
    /// replica looks like to a client.
    pub fn retarget(&self, port: u16) {
        self.shared.upstream_port.store(port, Ordering::Release);
    }

    /// `redis://127.0.0.1:<proxy port>`: what workers connect to.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The proxy's port (for URLs of other schemes than `redis://`).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Sets the one-way latency added to every chunk from now on.
    pub fn set_latency(&self, d: Duration) {
        self.shared
            .latency_us
            .store(d.as_micros() as u64, Ordering::Release);
    }

    /// Closes every open connection; with `refuse`, also closes new ones at once until
    /// [`allow`](Proxy::allow).
    pub fn cut(&self, refuse: bool) -> usize {
        self.shared.cut_all(refuse)
    }

    /// Delivers the next chunk any server sends, then cuts every connection and refuses new
    /// ones until [`allow`](Proxy::allow).
    pub fn cut_after_next_reply(&self) {
        self.cut_after_replies(1);
    }

    /// Like [`cut_after_next_reply`](Proxy::cut_after_next_reply), after the next `n` chunks
    /// the servers send (as the proxy reads them: one per answer when the client waits for
    /// each, as a ZooKeeper client does for its session's answer and then its first ping's).
    pub fn cut_after_replies(&self, n: u64) {
        self.shared.cut_after_replies.store(n, Ordering::Release);
    }

    /// Silences every connection open now, for good: what either side sends from now on is
    /// never delivered, and the connections stay open. Connections accepted later are forwarded
    /// as usual. Returns how many were silenced.
    pub fn silence(&self) -> usize {
        let next = self.shared.next_id.load(Ordering::Acquire);
        self.shared.silent_below.store(next, Ordering::Release);
        self.shared
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Holds every connection open now: what their clients send from now on is kept, in
    /// order, until [`deliver_held`](Proxy::deliver_held), and what the server sends on them is
    /// never delivered. Connections accepted later are forwarded as usual. Returns how many
    /// were held.
    pub fn hold(&self) -> usize {
        self.shared.held_bytes.store(0, Ordering::Release);
        self.shared
            .held_data
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        let next = self.shared.next_id.load(Ordering::Acquire);
        self.shared.muted_below.store(next, Ordering::Release);
        self.shared.held_below.send_replace(next);
        self.shared
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// How many bytes the held connections' clients have sent since [`hold`](Proxy::hold)
    /// (kept until [`deliver_held`](Proxy::deliver_held)): what tells a request held from a
    /// ping.
    pub fn held_bytes(&self) -> u64 {
        self.shared.held_bytes.load(Ordering::Acquire)
    }

    /// Whether what the held connections' clients sent since [`hold`](Proxy::hold) holds
    /// `needle` (a key or token a request carries as it is: etcd's gRPC sends keys unencoded):
    /// what tells a request about one key held from others.
    pub fn held_contains(&self, needle: &[u8]) -> bool {
        let data = self
            .shared
            .held_data
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        !needle.is_empty() && data.windows(needle.len()).any(|w| w == needle)
    }

    /// Delivers to the server what the held connections' clients sent ([`hold`](Proxy::hold)),
    /// in order — also on connections their clients closed since, which are then closed.
    pub fn deliver_held(&self) {
        self.shared.held_below.send_replace(0);
    }

    /// [`deliver_held`](Proxy::deliver_held), pausing `gap` after each chunk the client sent
    /// in one write: a request held, and its cancellation sent when the client gave up on it,
    /// reach the server `gap` apart, as over a slow network — the server applies the request
    /// before it hears of the cancellation (delivered back to back, it may drop it).
    pub fn deliver_held_spaced(&self, gap: Duration) {
        let gap = u64::try_from(gap.as_micros()).unwrap_or(u64::MAX);
        self.shared.held_gap_us.store(gap, Ordering::Release);
        self.shared.held_below.send_replace(0);
    }

    /// Stalls every connection open now: what either side sends on them from now on is kept,
    /// in order, until [`heal`](Proxy::heal); they stay open. Connections accepted later are
    /// forwarded as usual. Returns how many were stalled.
    pub fn stall(&self) -> usize {
        let next = self.shared.next_id.load(Ordering::Acquire);
        self.shared.stalled_below.send_replace(next);
        self.open()
    }

    /// Delivers, both ways and in order, what the stalled connections kept
    /// ([`stall`](Proxy::stall)), and forwards them as usual from then on.
    pub fn heal(&self) {
        self.shared.stalled_below.send_replace(0);
    }

    /// Accepts new connections again.
    pub fn allow(&self) {
        self.shared.refuse.store(false, Ordering::Release);
    }

    /// From now on, closes every connection that opens with a Postgres `CancelRequest`
    /// instead of forwarding it (every connection's first 8 bytes are read before the server
    /// is connected: only for clients that speak first, as Postgres clients do).
    pub fn swallow_cancels(&self) {
        self.shared.swallow_cancels.store(true, Ordering::Release);
    }

    /// Postgres cancel requests swallowed so far ([`swallow_cancels`](Proxy::swallow_cancels)).
    pub fn swallowed(&self) -> u64 {
        self.shared.swallowed.load(Ordering::Relaxed)
    }

    /// Connections open now (a held one until what it held was delivered).
    pub fn open(&self) -> usize {
        self.shared
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }

    /// From now on, a new connection is accepted and what it sends is kept from the server
    /// until [`resume_new`](Proxy::resume_new); open connections are forwarded as usual.
    pub fn pause_new(&self) {
        self.shared.new_paused.send_replace(true);
    }

    /// Ends [`pause_new`](Proxy::pause_new): the connections it kept reach the server.
    pub fn resume_new(&self) {
        self.shared.new_paused.send_replace(false);
    }

    /// The most connections there were at once that were open and not yet answered by the
    /// server (being made), since start or [`reset_peak_unanswered`](Proxy::reset_peak_unanswered).
    pub fn peak_unanswered(&self) -> u64 {
        self.shared.peak_unanswered.load(Ordering::Acquire)
    }

    /// Starts [`peak_unanswered`](Proxy::peak_unanswered) again from the connections being made
    /// now.
    pub fn reset_peak_unanswered(&self) {
        let now = self.shared.unanswered.load(Ordering::Acquire);
        self.shared.peak_unanswered.store(now, Ordering::Release);
    }

    /// Connections refused so far (accepted and closed at once, while refusing).
    pub fn refused(&self) -> u64 {
        self.shared.refused.load(Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut(true);
    }
}

impl Shared {
    fn cut_all(&self, refuse: bool) -> usize {
        if refuse {
            self.refuse.store(true, Ordering::Release);
        }
        let conns: Vec<AbortHandle> = self
            .conns
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(_, h)| h)
            .collect();
        for h in &conns {
            h.abort();
        }
        conns.len()
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        };
        if shared.refuse.load(Ordering::Acquire) {
            drop(client);
            shared.refused.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let s = shared.clone();
        // Register under the lock before the task can finish and deregister itself.
        let mut conns = shared.conns.lock().unwrap_or_else(PoisonError::into_inner);
        let task = tokio::spawn(async move {
            let _ = serve(client, &s, id).await;
            s.conns
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&id);
        });
        conns.insert(id, task.abort_handle());
    }
}

/// The first 8 bytes of a Postgres `CancelRequest`: its length (16) and code (80877102).
const PG_CANCEL: [u8; 8] = [0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e];

/// A Postgres `SSLRequest`: its length (8) and code (80877103).
const PG_SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// A connection counted as being made until the server first answers on it, or it ends.
struct Unanswered<'a> {
    shared: &'a Shared,
    answered: AtomicBool,
}

impl<'a> Unanswered<'a> {
    fn new(shared: &'a Shared) -> Self {
        let now = shared.unanswered.fetch_add(1, Ordering::AcqRel) + 1;
        shared.peak_unanswered.fetch_max(now, Ordering::AcqRel);
        Unanswered {
            shared,
            answered: AtomicBool::new(false),
        }
    }

    fn answered(&self) {
        if !self.answered.swap(true, Ordering::AcqRel) {
            self.shared.unanswered.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        self.answered();
    }
}

async fn serve(mut client: TcpStream, shared: &Shared, id: u64) -> io::Result<()> {
    let unanswered = Unanswered::new(shared);
    let _ = shared
        .new_paused
        .subscribe()
        .wait_for(|paused| !paused)
        .await;
    let mut opening = Vec::new();
    if shared.swallow_cancels.load(Ordering::Acquire) {
        let mut first = [0u8; 8];
        client.read_exact(&mut first).await?;
        if first == PG_SSL_REQUEST {
            // Answered here ("no TLS", as the test servers would): the client goes on in the
            // clear with its startup or its cancel request.
            client.write_all(b"N").await?;
            client.read_exact(&mut first).await?;
        }
        if first == PG_CANCEL {
            shared.swallowed.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        opening.extend_from_slice(&first);
    }
    let mut upstream = tokio::time::timeout(
        Duration::from_secs(1),
        TcpStream::connect(SocketAddr::from((
            [127, 0, 0, 1],
            shared.upstream_port.load(Ordering::Acquire),
        ))),
    )
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "upstream connect"))??;
    upstream.write_all(&opening).await?;
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    // The first direction to end (EOF delivered, or an error) ends the connection: Redis
    // clients and servers do not half-close.
    tokio::select! {
        r = pump(cr, uw, shared, id, None) => r,
        r = pump(ur, cw, shared, id, Some(&unanswered)) => r,
    }
}

/// Forwards `from` to `to`, each chunk delayed by the latency in force when it was read.
/// `unanswered`: `from` is the server, and its first byte answers the connection.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    id: u64,
    unanswered: Option<&Unanswered<'_>>,
) -> io::Result<()> {
    let from_server = unanswered.is_some();
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>, bool)>();
    let reader = async move {
        loop {
            let mut buf = vec![0u8; 16 * 1024];
            let n = match from.read(&mut buf).await {
                Ok(n) => n,
                // A held connection's client went away: what it sent is still delivered.
                Err(_) if !from_server && id < *shared.held_below.borrow() => 0,
                Err(e) => return Err(e),
            };
            if n == 0 {
                return Ok::<(), io::Error>(());
            }
            if let Some(u) = unanswered {
                u.answered();
            }
            buf.truncate(n);
            if !from_server {
                let mut cut_on = shared.cut_on.lock().unwrap_or_else(PoisonError::into_inner);
                if let Some((needle, left)) = cut_on.as_mut() {
                    if buf.windows(needle.len()).any(|w| w == needle.as_slice()) {
                        *left -= 1;
                        if *left == 0 {
                            *cut_on = None;
                            *shared
                                .cut_request
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner) = buf.clone();
                            shared.cut_conn.store(id, Ordering::Release);
                        }
                    }
                }
            }
            let held = !from_server && id < *shared.held_below.borrow();
            if held {
                shared.held_bytes.fetch_add(n as u64, Ordering::AcqRel);
                shared
                    .held_data
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .extend_from_slice(&buf);
            }
            let delay = Duration::from_micros(shared.latency_us.load(Ordering::Acquire));
            if tx.send((Instant::now() + delay, buf, held)).is_err() {
                return Ok(());
            }
        }
    };
    let writer = async {
        let mut held = shared.held_below.subscribe();
        let mut stalled = shared.stalled_below.subscribe();
        while let Some((due, buf, was_held)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            let muted = from_server && id < shared.muted_below.load(Ordering::Acquire);
            if muted || id < shared.silent_below.load(Ordering::Acquire) {
                // Silenced: held open, nothing more delivered (not even a close).
                std::future::pending::<()>().await;
            }
            // Stalled: kept until healed.
            let _ = stalled.wait_for(|below| id >= *below).await;
            let mut gap = Duration::ZERO;
            if !from_server {
                // Held: kept until delivered.
                let _ = held.wait_for(|below| id >= *below).await;
                if was_held {
                    gap = Duration::from_micros(shared.held_gap_us.load(Ordering::Acquire));
                }
            }
            to.write_all(&buf).await?;
            if !gap.is_zero() {
                to.flush().await?;
                tokio::time::sleep(gap).await;
            }
            let last = from_server
                && shared.cut_after_replies.fetch_update(
                    Ordering::AcqRel,
                    Ordering::Acquire,
                    |n| n.checked_sub(1),
                ) == Ok(1);
            if last {
                to.flush().await?;
                shared.cut_all(true);
            }
            if from_server
                && shared
                    .cut_conn
                    .compare_exchange(id, 0, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
            {
                // Ends this connection (both sides) at once: see `cut_after_reply_to`.
                to.flush().await?;
                return Err(io::Error::other("cut after a reply"));
            }
        }
        to.shutdown().await
    };
    tokio::try_join!(reader, writer).map(|_| ())
}
