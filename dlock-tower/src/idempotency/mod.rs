//! The `Idempotency-Key` middleware: [`IdempotencyLayer`] and [`Idempotency`].
//!
//! Implements the IETF HTTP APIs working group draft "The Idempotency-Key HTTP Header Field"
//! (draft-ietf-httpapi-idempotency-key-header): a client sends a unique key with a
//! non-idempotent request (`POST`, `PATCH`), and may retry it with the same key after a
//! timeout or a dropped connection without the operation running twice.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use std::convert::Infallible;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::sync::Arc;
//! use bytes::Bytes;
//! use dlock_runtime::Locker;
//! use dlock_tower::IdempotencyLayer;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Full};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//!
//! let charges = Arc::new(AtomicUsize::new(0));
//! let svc = ServiceBuilder::new()
//!     .layer(IdempotencyLayer::new(Locker::memory()))
//!     .service(service_fn({
//!         let charges = charges.clone();
//!         move |_req: Request<Full<Bytes>>| {
//!             let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
//!             async move {
//!                 let res = Response::builder()
//!                     .status(StatusCode::CREATED)
//!                     .header("location", format!("/payments/{n}"))
//!                     .body(Full::new(Bytes::from(format!("payment {n}"))))
//!                     .unwrap();
//!                 Ok::<_, Infallible>(res)
//!             }
//!         }
//!     }));
//!
//! let pay = |amount: &'static str| {
//!     Request::post("/payments")
//!         .header("idempotency-key", "\"8e03978e-40d5-43e8-bc93-6894a57f9324\"")
//!         .body(Full::new(Bytes::from_static(amount.as_bytes())))
//!         .unwrap()
//! };
//!
//! // The first request runs the handler; its response is stored.
//! let first = svc.clone().oneshot(pay("42.00")).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(first.into_body().collect().await.unwrap().to_bytes(), "payment 1");
//!
//! // A retry is answered with the stored response; the handler does not run again.
//! let retry = svc.clone().oneshot(pay("42.00")).await.unwrap();
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["location"], "/payments/1");
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! assert_eq!(retry.into_body().collect().await.unwrap().to_bytes(), "payment 1");
//! assert_eq!(charges.load(Ordering::SeqCst), 1);
//!
//! // The same key with another payload: 422.
//! let other = svc.clone().oneshot(pay("99.00")).await.unwrap();
//! assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
//! assert_eq!(other.headers()["content-type"], "application/problem+json");
//!
//! // No key: 400.
//! let res = svc.oneshot(Request::post("/payments").body(Full::default()).unwrap()).await.unwrap();
//! assert_eq!(res.status(), StatusCode::BAD_REQUEST);
//! # }
//! ```
//!
//! # Lifecycle
//!
//! For a request whose method the layer covers ([`IdempotencyLayer::methods`], default `POST`
//! and `PATCH`; other methods pass through untouched):
//!
//! 1. Read the key from the `Idempotency-Key` header and scope it by the request's identity,
//!    when one is configured ([`IdempotencyLayer::identity`]) and present: lock key
//!    `idem:<identity>:<key>`, else `idem:<key>`.
//! 2. Read the request body (up to [`max_request_body`](IdempotencyLayer::max_request_body))
//!    and compute the request's *fingerprint*: SHA-256 over the method, the path and query,
//!    and the SHA-256 of the body. The path is the one the client sent: inside axum's
//!    `Router::nest` (feature `axum`) the whole path, not the nested router's rest, so one key
//!    sent to `/orders/pay` and then to `/refunds/pay` is `422`, not a replay. The body's data
//!    is handed on to the handler intact; request trailers (rare: chunked uploads that sign
//!    the body in a trailer) are neither handed on nor part of the fingerprint.
//! 3. **Begin**, one atomic step in the backend (see
//!    [`dlock_runtime::idempotency`]): a stored response → replay it (same fingerprint) or
//!    `422` (different); the key's lock is held → `409` (or `422` if the running request has
//!    a different fingerprint); else take the lock — a normal lock with an owner token, a
//!    fencing token and a lease renewed by the watchdog — noting the fingerprint.
//! 4. Call the handler, with the lock's [`LockInfo`](dlock_runtime::LockInfo) (key, fencing
//!    token) visible to [`current_lock`](dlock_runtime::current_lock) and in the request
//!    extensions — unless a lock layer outside put its own there (see
//!    [with the lock and defer layers](#with-the-lock-and-defer-layers)).
//! 5. A storable response (below) is read in full and **completed**, one atomic step: store
//!    the status, the replay-safe headers and the body with the fingerprint for the retention
//!    period (default 24 h) *and* release the lock. A response that is not storable releases
//!    the lock without a record, so the client's retry runs the handler again. Then the
//!    response goes to the client.
//!
//! # Responses
//!
//! Every failure is a response with an RFC 9457 `application/problem+json` body (see
//! [`Rejection`](crate::Rejection)), never a service error: `Infallible` stays `Infallible`.
//!
//! | situation | response | problem `type` (`urn:dlock:problem:…`) |
//! |---|---|---|
//! | method not covered | the handler's, untouched | |
//! | first request with a key | the handler's (stored if storable) | |
//! | same key, earlier response stored, same fingerprint | the stored response + `Idempotent-Replayed: true`; the handler does not run | |
//! | same key, earlier response stored, different fingerprint | `422` | `idempotency-key-reused` |
//! | same key, earlier response stored with a `Content-Encoding` the retry's `Accept-Encoding` does not accept | `406` | `idempotency-replay-not-acceptable` |
//! | same key while the first request runs | `409` + `Retry-After` (the running request's remaining lease, in seconds) | `idempotency-request-in-progress` |
//! | same key while the first request runs, different fingerprint | `422` | `idempotency-key-reused` |
//! | no key, [`MissingKey::Reject`] (default) | `400` | `idempotency-key-missing` |
//! | no key, [`MissingKey::PassThrough`] | the handler's, without idempotency | |
//! | an [`identity`](IdempotencyLayer::identity) is configured and the request has none, [`MissingIdentity::Reject`] (default) | `401` | `idempotency-identity-missing` |
//! | the same, [`MissingIdentity::SharedSpace`] | as if no identity were configured: the shared key space `idem:<key>` | |
//! | key longer than [`max_key_len`](IdempotencyLayer::max_key_len) (default 255 bytes), repeated header, not a valid key | `400` | `idempotency-key-invalid` |
//! | request body over [`max_request_body`](IdempotencyLayer::max_request_body) | `413` | `body-too-large` |
//! | backend unavailable, [`FailMode::Closed`] (default) | `503` + `Retry-After` | `lock-backend-unavailable` |
//! | backend unavailable, [`FailMode::Open`] | the handler's, without idempotency | |
//! | backend refuses for good ([`LockError::Misconfigured`]), either mode | `500` | `lock-backend-misconfigured` |
//!
//! # What is stored and replayed
//!
//! The status, the headers in [`DEFAULT_REPLAY_HEADERS`] (plus any added with
//! [`replay_header`](IdempotencyLayer::replay_header)) in their original order, and the body
//! bytes: a replay is byte for byte the stored body with the same status and headers, plus
//! `Idempotent-Replayed: true`. Never stored: `Set-Cookie`, `Date`, `Age`, `Content-Length`
//! (recomputed) and hop-by-hop fields. The first client gets the handler's response with all
//! its headers.
//!
//! **Compression**: put a compression layer *outside* this one (so it wraps it), and the
//! stored body is the handler's own, encoded for each response — replays included — as that
//! request accepts. A compression layer inside stores the body encoded for the first request:
//! it is replayed only to a retry whose `Accept-Encoding` accepts that coding (RFC 9110; no
//! field accepts any), and a retry that does not gets `406` rather than bytes it cannot decode.
//!
//! Not stored — the key is freed and the client's retry runs the handler again:
//!
//! * every `5xx`, and `1xx`: the server failed; the outcome is not final;
//! * a response marked [`Deferred`](crate::Deferred) — the `202` of a
//!   [`DeferLayer`](crate::DeferLayer) inside this one: the request was queued, not run (see
//!   [deferred requests](#deferred-requests));
//! * `408 Request Timeout`, `425 Too Early`, `429 Too Many Requests`: they say "try again";
//! * `409 Conflict` and `423 Locked`: a conflict with the resource's current state, which the
//!   retry may not meet;
//! * the `4xx` a request gets for one of its header fields, which the fingerprint does not
//!   cover, so the client's corrected retry is the same request: `401` and `407`
//!   (credentials), `406` (`Accept…`), `412` and `428` (`If-Match`…), `415` (`Content-Type`),
//!   `426` (the protocol), `431` (header size);
//! * a response body over [`max_response_body`](IdempotencyLayer::max_response_body) (default
//!   1 MiB), a body with trailers, or one that fails while read: the client still gets it in
//!   full (the layer hands on what it read, then the rest), but nothing is stored. **Set the
//!   limit above your largest response**: a retry of a request whose response was too large to
//!   store runs the handler again;
//! * a response body still not ended after
//!   [`max_response_wait`](IdempotencyLayer::max_response_wait) (default 30 s): the body is
//!   read whole before any of it is sent (it is stored first), so a stream — server-sent
//!   events, a long poll — would keep the client waiting and the key at `409`; after the wait
//!   the client gets what was read, then the rest as it comes, and nothing is stored.
//!
//! Everything else (`2xx`, `3xx`, the other `4xx`) is the request's final outcome and is stored.
//! The draft leaves this choice to the server. The rule here: store what a retry must not
//! change, free what a retry is meant to redo. Some APIs store every response, `5xx` included
//! (Stripe's); here a server error frees the key, because the handler may have failed before
//! any effect, and a stored `500` would keep the client from ever completing the request.
//!
//! Stored records live for the retention, in the locker's backend: Redis and Postgres keep them
//! in the server; the in-memory backend keeps at most its capacity
//! ([`MemoryBackend::with_idempotency_capacity`](dlock_runtime::backend::MemoryBackend::with_idempotency_capacity),
//! 64 MiB by default) and, over it, drops the completed records nearest their expiry first —
//! a retry whose record was dropped runs the handler again, as after the retention.
//!
//! # The key
//!
//! The draft defines `Idempotency-Key` as a Structured Field string
//! (`Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`); the bare form many clients send
//! (`Idempotency-Key: 8e03978e-…`) is accepted too and means the same key. A quoted key's
//! parameters (`"8e03…";v=1`) are ignored, but anything else after it — a second value
//! (`"a", "b"`: two field lines a proxy joined, like a bare `a, b`), text that is not RFC 9651
//! parameters — is a `400`, not the first value. Keys must be printable ASCII and at most [`max_key_len`](IdempotencyLayer::max_key_len) bytes (default
//! [`DEFAULT_MAX_KEY_LEN`], 255, as common APIs use). Without an identity, all clients share one
//! key space: keys must be unguessable (UUIDv4). With
//! [`identity`](IdempotencyLayer::identity), one user's key can never replay, block or probe
//! another user's request. The scope is the identity's text and the locker's
//! [prefix](dlock_runtime::LockerBuilder::prefix), not its type: two layers on one locker
//! whose identity types can print the same text (a `UserId(7)` and an `ApiKeyId(7)`) share
//! a key space — give each its own locker prefix, or an
//! [`identity_fn`](IdempotencyLayer::identity_fn) that marks its kind (`format!("user:{id}")`).
//! (The type is not part of the key so that keys, and the records stored under them, stay the
//! same when a type is renamed or moved.) Keys go through the runtime's collision-free key encoding, so no
//! identity/key pair can forge another's lock key. A request that lacks the identity is refused
//! with `401` ([`MissingIdentity::Reject`]) rather than falling back to the shared key space,
//! where its key could meet another client's — unless you choose
//! [`MissingIdentity::SharedSpace`] (for routes that anonymous clients may also call).
//!
//! # Crashes and cancellation
//!
//! * **The client disconnects** (or a timeout layer outside gives up) **while the handler
//!   runs**, and no lock is held outside this layer (else see the next point): the handler
//!   runs to its end anyway — in a tokio task of its own, started once
//!   the key is taken — and its response is stored, so the client's retry gets `409` while it
//!   runs and then the replay. Cut off between two effects (the card charged, the ledger not
//!   yet written), it would run again from the start on the retry. The task is instrumented
//!   with the request's tracing span; other task-locals of the caller do not reach the
//!   handler. [`cancel_on_disconnect(true)`](IdempotencyLayer::cancel_on_disconnect) restores
//!   tower's usual behaviour: the handler's future is dropped with the response future, the
//!   lock is released in the background without a record, and the retry runs the handler
//!   again. (Without a tokio runtime, the handler always runs in the response future.)
//!   **Layers that bound handlers belong inside this one**: a timeout or a concurrency limit
//!   outside no longer bounds a handler whose client went away (the timeout answers, the
//!   permit is freed, the handler runs on). Inside, a timeout still ends a hung handler — its
//!   error response is not stored, so the key is freed — and a limit still counts it.
//! * **The same with a lock held outside this layer** (a
//!   [`DistributedLockLayer`](crate::DistributedLockLayer) or
//!   [`DeferLayer`](crate::DeferLayer) wrapping it, a replay worker): the handler is cut off
//!   with the outer lock, as with `cancel_on_disconnect(true)`, and the retry runs it again —
//!   see [with the lock and defer layers](#with-the-lock-and-defer-layers).
//! * **The client disconnects after the handler returned** (while the layer reads the response
//!   body or stores the record): storing runs in its own tokio task and finishes anyway, so
//!   the client's retry gets the stored response — the case `Idempotency-Key` exists for.
//! * **The process crashes while the handler runs** (or after it returned but before the
//!   response was stored): nothing renews the key's lease, so the key answers `409` until the
//!   lease ([`ttl`](IdempotencyLayer::ttl), default 30 s) runs out, then the client's retry
//!   runs the handler **again**: no record exists. Make the handler's effects safe to repeat —
//!   pass the fencing token from [`LockInfo`](dlock_runtime::LockInfo) to the resource you
//!   write (it refuses a stale holder; a token orders holders and does not tell a repeat — the
//!   retry's is larger), and make the write idempotent there (record the key with it, or a
//!   unique constraint on the key).
//! * **The process crashes after the response was stored**: storing the record and releasing
//!   the lock are one atomic step, so retries get the replay.
//! * **The lock is lost while the handler runs** (the backend was unreachable for longer than
//!   the lease): the handler is not interrupted, the response reaches the client, but it
//!   cannot be stored (the step is owner-checked) — logged at `warn`.
//!
//! * **The process shuts down on purpose** (a deploy): a handler whose client went away runs
//!   in a task no connection waits for, so a server's graceful shutdown does not wait for it
//!   either, and the runtime's shutdown would cut it off like a crash. Wait for
//!   [`IdempotencyLayer::in_flight`]'s [`drained`](InFlight::drained) after the server
//!   stopped and before the runtime ends:
//!
//!   ```no_run
//!   # use std::future::Future;
//!   # async fn run(
//!   #     app: axum::Router,
//!   #     listener: tokio::net::TcpListener,
//!   #     layer: dlock_tower::IdempotencyLayer,
//!   #     shutdown: impl Future<Output = ()> + Send + 'static, // e.g. SIGTERM
//!   # ) {
//!   let in_flight = layer.in_flight(); // before `layer` goes into the router
//!   axum::serve(listener, app)
//!       .with_graceful_shutdown(shutdown)
//!       .await
//!       .unwrap();
//!   // Every handler the layer started has ended and its response is stored (or its key freed).
//!   let _ = tokio::time::timeout(std::time::Duration::from_secs(30), in_flight.drained()).await;
//!   # }
//!   ```
//!
//! No state blocks a key forever — except a handler that never returns, whose lease the
//! watchdog keeps renewed: bound handlers with a timeout inside the layer — or replays a
//! response that was not stored for that key.
//!
//! # With the lock and defer layers
//!
//! **Put this layer outside them**: in axum, `.route_layer(lock_or_defer_layer)` first, then
//! `.route_layer(idempotency_layer)`. A duplicate is then answered (`409`, the replay, `422`)
//! before it waits for the resource's lock, a handler whose client went away runs to its end
//! *with* the resource's lock (the lock layer's future runs in the handler's task), and a
//! deferred request is handled as below.
//!
//! **A lock layer outside this one** releases its lock when its response future is dropped
//! (the client went away), so the handler must not outlive that future: a handler left
//! running in a task of its own would run beside the next request that takes the lock. When
//! a lock is held outside — the request carries a [`LockInfo`](dlock_runtime::LockInfo) in
//! its extensions, or [`current_lock`](dlock_runtime::current_lock) is `Some` where this
//! layer's future runs (a [`DistributedLockLayer`](crate::DistributedLockLayer), a
//! [`DeferLayer`](crate::DeferLayer), a defer replay worker, a `#[distributed_lock]`
//! function calling the service) — the handler runs in this layer's response future, as with
//! [`cancel_on_disconnect(true)`](IdempotencyLayer::cancel_on_disconnect) whatever that
//! setting: dropped with the outer future, before the outer lock is released; the key is then
//! released without a record and the client's retry runs the handler again. Only the
//! storing of a returned response still runs in a task of its own. The handler finds the
//! outer lock's `LockInfo` in its extensions — the resource's, to fence writes with — while
//! `current_lock()` is the key's lock and [`held_locks`](dlock_runtime::held_locks) lists
//! both, the outer one first. A lock held outside that shows in neither place (a middleware
//! of your own that keeps a guard without [`with_lock`](dlock_runtime::with_lock)) is not
//! seen: put such a layer inside this one.
//!
//! ## Deferred requests
//!
//! A [`DeferLayer`](crate::DeferLayer) inside this one answers a request whose resource is
//! busy with `202 Accepted` and queues it. That `202` carries the
//! [`Deferred`](crate::Deferred) mark and is not stored: the key is released without a
//! record. The replay worker sends the request through the application without the
//! `DeferLayer` — with this layer — so the replay takes the key, runs the handler and stores
//! its response (the job's result is that status). Until then:
//!
//! * a retry while the resource is still busy is deferred again: another job, another
//!   `202`. The jobs run one at a time (they take the resource's lock); the first runs the
//!   handler and the other replays its stored response;
//! * a retry once the resource is free, before the job ran, runs the handler at once and
//!   stores its response; the job then replays it;
//! * a retry while the replay runs gets `409`, then the stored response.
//!
//! The handler runs once per key either way (but for the queue's at-least-once delivery: a
//! replay whose worker died mid-handler runs again, see [`defer`](crate::defer)).
//!
//! **Identity**: the replay carries only what the queue stored — the request's headers
//! without its credentials — and no extensions but the lock. With an
//! [`identity`](IdempotencyLayer::identity), the application the worker replays through must
//! authenticate the replay to the same identity (store the credential header with
//! [`DeferLayer::store_header`](crate::DeferLayer::store_header), or an auth layer of the
//! worker's own that trusts another stored header); the handler needs the identity anyway.
//! Otherwise this layer answers the replay `401` ([`MissingIdentity::Reject`]): the handler
//! does not run and the job is recorded completed with the result `401`. With
//! [`MissingIdentity::SharedSpace`] the replay's key is the unscoped `idem:<key>`, not
//! `idem:<identity>:<key>`, so the client's retry does not find its record and runs the
//! handler a second time.
//!
//! # Backends
//!
//! Records live in the same backend as the lock, atomic with it: Redis (one server, a Cluster
//! or Sentinel; Lua scripts, all keys under the lock's Cluster hash tag; layout in
//! [`dlock_runtime::idempotency`]), Postgres (the `idem` table, one function call a step),
//! etcd (one transaction a step) and the in-memory backend (under the lock's shard mutex).
//! Redlock and ZooKeeper do not store records: [`IdempotencyLayer::new`] panics and
//! [`IdempotencyLayer::try_new`] fails, naming the backend.
//!
//! # Where to put it
//!
//! After authentication (so the identity is in the extensions) and around the handlers that
//! need it, e.g. `Router::route_layer` on the payment routes — outside a lock or defer layer
//! on them ([above](#with-the-lock-and-defer-layers)). The layer reads whole request
//! and response bodies of covered requests into memory (both bounded); do not put it in front
//! of streaming responses. The response body type becomes [`ResponseBody<B>`] around the inner
//! service's `B`, which axum and hyper accept as they accept `B`.

mod body;
mod future;
mod layer;
mod record;
mod request;
mod service;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::idempotency::{Fingerprint, DEFAULT_RETENTION};
use dlock_runtime::{LockError, LockKey, Locker};
use http::header::HeaderName;
use http::{Method, Uri};

use crate::{FailMode, MissingKey};

use std::sync::atomic::{AtomicUsize, Ordering};

pub use self::body::ResponseBody;
pub use self::future::ResponseFuture;
pub use self::layer::IdempotencyLayer;
pub use self::record::DEFAULT_REPLAY_HEADERS;
pub use self::service::Idempotency;

/// The default longest key, in bytes: 255.
pub const DEFAULT_MAX_KEY_LEN: usize = 255;

/// The default largest request body read for the fingerprint: 1 MiB.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;

/// The default largest response body stored: 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BODY: usize = 1024 * 1024;

/// The default longest wait for a response body to end before it is sent on unstored: 30 s.
pub const DEFAULT_MAX_RESPONSE_WAIT: Duration = Duration::from_secs(30);

/// The lock key the layer uses for the idempotency key `key` of a request with `identity`:
/// `idem:<identity>:<key>`, or `idem:<key>` without one, encoded by the runtime so that no
/// identity/key pair collides with another. For looking a key up (or purging it) by hand, and
/// for tests.
///
/// ```
/// use dlock_tower::idempotency::lock_key;
///
/// assert_eq!(lock_key(Some("user-7"), "k1").unwrap().as_str(), "idem:user-7:k1");
/// assert_eq!(lock_key(None, "a:b").unwrap().as_str(), "idem:a%3Ab");
/// ```
pub fn lock_key(identity: Option<&str>, key: &str) -> Result<LockKey, LockError> {
    request::scoped_key(identity, key).to_lock_key()
}

/// The fingerprint the layer stores with a request's record: SHA-256 over the method, the path
/// and query, and the SHA-256 of the body, each framed by its length (see
/// [`Fingerprint`]). A request with the same key and another fingerprint is answered `422`.
pub fn fingerprint(method: &Method, uri: &Uri, body: &[u8]) -> Fingerprint {
    request::fingerprint(method, uri, body)
}

/// The handlers (with the storing of their responses) that an [`IdempotencyLayer`] runs in
/// tasks of their own, counted from their start to the end of their storing (or the release
/// of their key): all of them, unless
/// [`cancel_on_disconnect`](IdempotencyLayer::cancel_on_disconnect) or a lock held outside the
/// layer ([why](self#with-the-lock-and-defer-layers)) keeps the handler in the response
/// future — then only the storing. From [`IdempotencyLayer::in_flight`]; clones count the same
/// tasks. See [crashes and cancellation](self#crashes-and-cancellation) for why a shutdown
/// waits for them.
#[derive(Clone, Default)]
pub struct InFlight {
    inner: Arc<InFlightInner>,
}

#[derive(Default)]
struct InFlightInner {
    count: AtomicUsize,
    idle: tokio::sync::Notify,
}

impl InFlight {
    /// How many run now.
    pub fn count(&self) -> usize {
        self.inner.count.load(Ordering::Acquire)
    }

    /// Resolves once none runs: every handler the layer started has ended and its response is
    /// stored (or its key freed). A handler started meanwhile is waited for too, so stop the
    /// server first; bound the wait with a timeout of your own (a hung handler never ends).
    pub async fn drained(&self) {
        loop {
            let idle = self.inner.idle.notified();
            let mut idle = std::pin::pin!(idle);
            idle.as_mut().enable();
            if self.count() == 0 {
                return;
            }
            idle.await;
        }
    }

    /// Counts one task until the returned ticket is dropped.
    pub(crate) fn enter(&self) -> InFlightTicket {
        self.inner.count.fetch_add(1, Ordering::AcqRel);
        InFlightTicket(self.inner.clone())
    }
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("count", &self.count())
            .finish()
    }
}

/// One counted task of an [`InFlight`]; dropping it (the task ended, or was dropped with its
/// runtime) uncounts it.
pub(crate) struct InFlightTicket(Arc<InFlightInner>);

impl Drop for InFlightTicket {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// A request's identity: `Ok(None)` when it has none, `Err` when it has one that could not be
/// formatted (its `Display` failed).
type Identity =
    Arc<dyn Fn(&http::Extensions) -> Result<Option<String>, std::fmt::Error> + Send + Sync>;

/// What the layer does with a request that lacks the configured
/// [`identity`](IdempotencyLayer::identity) (no effect without one).
///
/// The default is [`MissingIdentity::Reject`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MissingIdentity {
    /// Answer `401 Unauthorized` with a problem+json body (type
    /// `urn:dlock:problem:idempotency-identity-missing`), without calling the handler. The
    /// default: a request outside every user's key space must not share one with others.
    #[default]
    Reject,
    /// Answer this status instead of `401` (e.g. `403`), same body.
    RejectWith(http::StatusCode),
    /// Use the shared, unscoped key space `idem:<key>`, as if no identity were configured.
    /// Keys there must be unguessable (UUIDv4): every client without an identity shares it.
    SharedSpace,
}

/// Configuration shared by the layer and every service and future it makes.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) locker: Locker,
    pub(crate) methods: Vec<Method>,
    pub(crate) header: HeaderName,
    pub(crate) max_key_len: usize,
    pub(crate) identity: Option<Identity>,
    pub(crate) missing_identity: MissingIdentity,
    pub(crate) ttl: Option<Duration>,
    pub(crate) retention: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) max_response_wait: Duration,
    pub(crate) replay_headers: Vec<HeaderName>,
    /// The lock's bounded name in metrics and traces.
    pub(crate) name: &'static str,
    pub(crate) missing_key: MissingKey,
    pub(crate) fail_mode: FailMode,
    /// Dropping the response future cancels the handler (else it runs to its end in a task
    /// of its own).
    pub(crate) cancel_on_disconnect: bool,
    /// The tasks the layer started (shared by every clone of the configuration).
    pub(crate) in_flight: InFlight,
}

impl Shared {
    pub(crate) fn new(locker: Locker) -> Self {
        Shared {
            locker,
            methods: vec![Method::POST, Method::PATCH],
            header: HeaderName::from_static("idempotency-key"),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            identity: None,
            missing_identity: MissingIdentity::default(),
            ttl: None,
            retention: DEFAULT_RETENTION,
            max_request_body: DEFAULT_MAX_REQUEST_BODY,
            max_response_body: DEFAULT_MAX_RESPONSE_BODY,
            max_response_wait: DEFAULT_MAX_RESPONSE_WAIT,
            replay_headers: DEFAULT_REPLAY_HEADERS
                .iter()
                .map(|h| HeaderName::from_static(h))
                .collect(),
            name: dlock_runtime::metrics::UNNAMED,
            missing_key: MissingKey::default(),
            fail_mode: FailMode::default(),
            cancel_on_disconnect: false,
            in_flight: InFlight::default(),
        }
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("locker", &self.locker)
            .field("methods", &self.methods)
            .field("header", &self.header)
            .field("max_key_len", &self.max_key_len)
            .field("identity", &self.identity.is_some())
            .field("missing_identity", &self.missing_identity)
            .field("ttl", &self.ttl)
            .field("retention", &self.retention)
            .field("max_request_body", &self.max_request_body)
            .field("max_response_body", &self.max_response_body)
            .field("max_response_wait", &self.max_response_wait)
            .field("replay_headers", &self.replay_headers)
            .field("missing_key", &self.missing_key)
            .field("fail_mode", &self.fail_mode)
            .field("cancel_on_disconnect", &self.cancel_on_disconnect)
            .field("in_flight", &self.in_flight)
            .finish()
    }
}
