//! `IdempotencyLayer` over real HTTP (axum on 127.0.0.1:0, hyper-util client) against real
//! `redis-server` processes, plus the in-memory backend for the basic flow. What each
//! test covers, by promise of the layer (see `dlock_tower::idempotency`):
//!
//! 1. methods and identity scope: `keys_are_required_bounded_and_limited_to_covered_methods`,
//!    `identity_scopes_keys_per_user`;
//! 2. first request stored with its fingerprint for the retention period, lock released in
//!    the same step: `retry_after_completion_replays_byte_for_byte`;
//! 3. duplicate while running → 409 + Retry-After:
//!    `twenty_concurrent_duplicates_run_the_handler_once`;
//! 4. replay byte for byte without running the handler: the two above;
//! 5. different fingerprint → 422: `same_key_with_a_different_request_gets_422`;
//! 6. missing / oversized key → 400: `keys_are_required_bounded_and_limited_to_covered_methods`;
//! 7. not stored, key freed: `non_final_statuses_are_not_stored_and_the_retry_runs`,
//!    `oversized_responses_are_delivered_but_not_stored`;
//! 8. storage atomic with the lock, crash and cancel semantics:
//!    `vanished_holder_blocks_until_its_ttl_then_the_retry_runs`,
//!    `cancelled_request_frees_the_key_without_a_record`, `backend_down_fails_closed_or_open`,
//!    `redlock_is_refused_with_a_clear_error`; in memory: `memory_backend_basic_flow`;
//!    the record is stored even when the response future is dropped after the handler
//!    returned: `response_future_dropped_after_the_handler_returned_still_stores_the_record`;
//! 9. stacked with the lock layers: a deferred `202` is not stored and the replay runs the
//!    handler once: `a_deferred_request_is_not_the_keys_outcome_and_its_replay_runs_the_handler_once`;
//!    a lock or defer layer outside is not released while the handler runs:
//!    `a_lock_layer_outside_is_not_released_while_a_given_up_handler_runs`,
//!    `a_defer_layer_outside_is_not_released_while_a_given_up_handler_runs`.
//!
//! Handlers block on signals the test controls (a watch-channel gate, an mpsc "entered"
//! signal), never on sleeps; the only waits on the clock are for a lease to run out, which is
//! the behaviour under test, and they go through the runtime's own waiting.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use dlock_runtime::idempotency::Begin;
use dlock_runtime::{LockInfo, Locker, OnFail, PROBLEM_JSON};
use dlock_tests::http::{client, serve, user_from_header, Chunked, HttpClient, UserId};
use dlock_tests::RedisServer;
use dlock_tower::idempotency::{fingerprint, lock_key, DEFAULT_REPLAY_HEADERS};
use dlock_tower::{FailMode, IdempotencyLayer, MissingIdentity};
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::BodyExt;
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tower::ServiceExt;

const TTL: Duration = Duration::from_secs(30);

/// A generous bound on how long a behaviour may take before the test calls it a hang.
const HANG: Duration = Duration::from_secs(30);

const KEY_HEADER: &str = "idempotency-key";

// ---------------------------------------------------------------------------------------------
// The application: a payments-style endpoint whose behaviour the request chooses.

/// What the handler reports to the test and waits on.
#[derive(Clone)]
struct Ctl {
    calls: Arc<AtomicUsize>,
    entered: mpsc::UnboundedSender<()>,
    gate: watch::Receiver<bool>,
}

struct Harness {
    ctl: Ctl,
    entered: mpsc::UnboundedReceiver<()>,
    open: watch::Sender<bool>,
}

impl Harness {
    fn new() -> Self {
        let (entered_tx, entered) = mpsc::unbounded_channel();
        let (open, gate) = watch::channel(false);
        Harness {
            ctl: Ctl {
                calls: Arc::new(AtomicUsize::new(0)),
                entered: entered_tx,
                gate,
            },
            entered,
            open,
        }
    }

    fn calls(&self) -> usize {
        self.ctl.calls.load(Ordering::SeqCst)
    }

    async fn wait_entered(&mut self) {
        tokio::time::timeout(HANG, self.entered.recv())
            .await
            .expect("the handler was entered")
            .unwrap();
    }

    fn open_gate(&self) {
        self.open.send(true).unwrap();
    }

    /// Serves [`app`] with `layer` over real HTTP; returns a client for it and the server task.
    async fn serve(&self, layer: IdempotencyLayer) -> (Http, JoinHandle<()>) {
        let (addr, server) = serve(app(layer, self.ctl.clone())).await;
        (Http::new(addr), server)
    }
}

/// The handler. Request headers choose what it does:
/// * `x-status: <n>` — answer with that status (default 201);
/// * `x-wait: gate` — signal "entered", then wait for the test's gate; `x-wait: forever` —
///   signal, then never answer;
/// * `x-binary: <n>` — an octet-stream body of `n` bytes covering every byte value;
///   `x-stream: 1` — send it in chunks without a declared length;
/// * `x-encoded: <coding>` — say the body is encoded with it (`Content-Encoding`), as a
///   compression layer inside the idempotency layer would.
///
/// Every response carries headers that are replayed (content-type, location, etag, two links,
/// cache-control) and some that are not (set-cookie, x-request-id).
async fn pay(
    State(ctl): State<Ctl>,
    lock: Option<Extension<LockInfo>>,
    user: Option<Extension<UserId>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let n = ctl.calls.fetch_add(1, Ordering::SeqCst) + 1;
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    match header("x-wait") {
        Some("gate") => {
            ctl.entered.send(()).unwrap();
            let mut gate = ctl.gate.clone();
            gate.wait_for(|open| *open).await.unwrap();
        }
        Some("forever") => {
            ctl.entered.send(()).unwrap();
            std::future::pending::<()>().await;
        }
        _ => {}
    }
    let status = header("x-status").map_or(201, |s| s.parse().unwrap());
    let (content_type, body) = match header("x-binary") {
        Some(len) => {
            let len: usize = len.parse().unwrap();
            let bytes: Vec<u8> = (0..len).map(|i| ((i * 7 + n) % 256) as u8).collect();
            let body = if header("x-stream").is_some() {
                let chunks = bytes.chunks(1000).map(Bytes::copy_from_slice).collect();
                Body::new(Chunked(chunks))
            } else {
                Body::from(bytes)
            };
            ("application/octet-stream", body)
        }
        None => {
            let user = user.map_or("anonymous".to_owned(), |Extension(u)| u.to_string());
            let json = format!(
                "{{\"payment\":{n},\"user\":\"{user}\",\"fencing_token\":{},\"request\":{:?}}}",
                lock.map_or(0, |Extension(l)| l.fencing_token()),
                String::from_utf8_lossy(&body)
            );
            ("application/json", Body::from(json))
        }
    };
    let mut response = Response::builder();
    if let Some(coding) = header("x-encoded") {
        response = response.header("content-encoding", coding);
    }
    response
        .status(status)
        .header(CONTENT_TYPE, content_type)
        .header("location", format!("/payments/{n}"))
        .header("etag", format!("\"p{n}\""))
        .header("link", "</payments>; rel=\"collection\"")
        .header("link", format!("</receipts/{n}>; rel=\"receipt\""))
        .header("cache-control", "no-store")
        .header("set-cookie", format!("session=s{n}; HttpOnly"))
        .header("x-request-id", format!("req-{n}"))
        .body(body)
        .unwrap()
}

/// `router` behind an outer layer that drops the request's future once `give_up` says so,
/// answering 504: what a timeout layer (or a client that went away) does.
fn with_give_up(router: Router, give_up: watch::Receiver<bool>) -> Router {
    router.layer(axum::middleware::from_fn(
        move |req: Request<Body>, next: axum::middleware::Next| {
            let mut give_up = give_up.clone();
            async move {
                tokio::select! {
                    res = next.run(req) => res,
                    _ = give_up.wait_for(|g| *g) => {
                        Response::builder().status(StatusCode::GATEWAY_TIMEOUT).body(Body::empty()).unwrap()
                    }
                }
            }
        },
    ))
}

fn app(layer: IdempotencyLayer, ctl: Ctl) -> Router {
    Router::new()
        .route(
            "/payments",
            post(pay).patch(pay).put(pay).get(pay).delete(pay),
        )
        .route("/refunds", post(pay))
        .route_layer(layer)
        // The "auth layer": runs first and places the identity (`x-user`) in the extensions.
        .layer(tower::util::MapRequestLayer::new(user_from_header::<Body>))
        .with_state(ctl)
}

// ---------------------------------------------------------------------------------------------
// The client side.

#[derive(Clone)]
struct Http {
    client: HttpClient,
    addr: SocketAddr,
}

#[derive(Clone, Debug)]
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn replayed(&self) -> bool {
        match self.headers.get("idempotent-replayed") {
            Some(v) => {
                assert_eq!(v, "true");
                true
            }
            None => false,
        }
    }

    fn assert_problem(&self, status: StatusCode, kind: &str) {
        assert_eq!(self.status, status, "{}", self.text());
        assert_eq!(self.headers[CONTENT_TYPE], PROBLEM_JSON);
        let body = self.text();
        assert!(
            body.contains(&format!("\"type\":\"urn:dlock:problem:{kind}\"")),
            "{body}"
        );
        assert!(
            body.contains(&format!("\"status\":{}", status.as_u16())),
            "{body}"
        );
    }

    fn retry_after(&self) -> u64 {
        self.headers[RETRY_AFTER].to_str().unwrap().parse().unwrap()
    }
}

/// A request: method, path, key, body and extra headers.
struct Call {
    method: Method,
    path: &'static str,
    headers: Vec<(&'static str, String)>,
    body: Bytes,
}

fn post_with(key: &str, body: &str) -> Call {
    Call {
        method: Method::POST,
        path: "/payments",
        headers: vec![(KEY_HEADER, key.to_owned())],
        body: Bytes::copy_from_slice(body.as_bytes()),
    }
}

impl Call {
    fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    fn method(mut self, method: Method) -> Self {
        self.method = method;
        self
    }

    fn path(mut self, path: &'static str) -> Self {
        self.path = path;
        self
    }

    fn build<B: From<Bytes>>(self, base: &str) -> Request<B> {
        let mut req = Request::builder()
            .method(self.method)
            .uri(format!("{base}{}", self.path));
        for (name, value) in self.headers {
            req = req.header(name, value);
        }
        req.body(B::from(self.body)).unwrap()
    }
}

impl Http {
    fn new(addr: SocketAddr) -> Self {
        Http {
            client: client(),
            addr,
        }
    }

    /// Sends `call()` until the answer is not `409` (the key in progress), for up to [`HANG`].
    async fn until_not_in_progress(&self, call: impl Fn() -> Call) -> Reply {
        let start = Instant::now();
        loop {
            let reply = self.send(call()).await;
            if reply.status != StatusCode::CONFLICT {
                return reply;
            }
            assert!(start.elapsed() < HANG, "the key stays in progress");
            tokio::task::yield_now().await;
        }
    }

    async fn send(&self, call: Call) -> Reply {
        let req = call.build(&format!("http://{}", self.addr));
        let res = tokio::time::timeout(HANG, self.client.request(req))
            .await
            .expect("response in time")
            .expect("http request");
        let status = res.status();
        let headers = res.headers().clone();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        Reply {
            status,
            headers,
            body,
        }
    }
}

/// Asserts that `replay` is `original` replayed: same status, same body bytes, same
/// replay-safe headers in the same order, the replay marker, and none of the per-response
/// headers.
fn assert_replay_of(replay: &Reply, original: &Reply) {
    assert!(replay.replayed(), "not a replay: {replay:?}");
    assert!(!original.replayed());
    assert_eq!(replay.status, original.status);
    assert_eq!(replay.body, original.body, "body differs");
    for name in DEFAULT_REPLAY_HEADERS {
        let a: Vec<_> = original.headers.get_all(*name).iter().collect();
        let b: Vec<_> = replay.headers.get_all(*name).iter().collect();
        assert_eq!(a, b, "header {name}");
    }
    assert!(original.headers.contains_key("set-cookie"));
    assert!(!replay.headers.contains_key("set-cookie"));
    assert!(!replay.headers.contains_key("x-request-id"));
}

// ---------------------------------------------------------------------------------------------
// The tests.

/// 20 concurrent duplicates over HTTP: the handler runs exactly once; every other answer is a
/// 409 (problem+json, `Retry-After` within the lease) or a byte-identical replay. The handler
/// holds at a gate until 10 answers are in, so both kinds occur; a later retry replays too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_duplicates_run_the_handler_once() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let mut h = Harness::new();
    let layer = IdempotencyLayer::new(locker).ttl(TTL);
    let (http, server) = h.serve(layer).await;

    let mut requests = JoinSet::new();
    for _ in 0..20 {
        let http = http.clone();
        requests.spawn(async move {
            http.send(post_with("pay-20", "{\"amount\":42}").header("x-wait", "gate"))
                .await
        });
    }
    h.wait_entered().await;
    let mut replies = Vec::new();
    // The first request cannot finish before the gate opens: these are all duplicates.
    for _ in 0..10 {
        let reply = requests.join_next().await.unwrap().unwrap();
        reply.assert_problem(StatusCode::CONFLICT, "idempotency-request-in-progress");
        let secs = reply.retry_after();
        assert!((1..=TTL.as_secs()).contains(&secs), "Retry-After {secs}");
        replies.push(reply);
    }
    h.open_gate();
    while let Some(reply) = requests.join_next().await {
        replies.push(reply.unwrap());
    }
    assert_eq!(replies.len(), 20);
    assert_eq!(h.calls(), 1, "the handler ran exactly once");

    let originals: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.replayed())
        .collect();
    assert_eq!(originals.len(), 1, "exactly one original response");
    let original = originals[0].clone();
    assert!(
        original.text().contains("\"payment\":1"),
        "{}",
        original.text()
    );
    let (mut conflicts, mut replays) = (0, 0);
    for reply in &replies {
        if reply.status == StatusCode::CONFLICT {
            reply.assert_problem(StatusCode::CONFLICT, "idempotency-request-in-progress");
            conflicts += 1;
        } else if reply.replayed() {
            assert_replay_of(reply, &original);
            replays += 1;
        }
    }
    assert_eq!(
        conflicts + replays,
        19,
        "{conflicts} conflicts, {replays} replays"
    );
    assert!(conflicts >= 10);

    // A retry after completion replays without running the handler.
    let retry = http.send(post_with("pay-20", "{\"amount\":42}")).await;
    assert_replay_of(&retry, &original);
    assert_eq!(h.calls(), 1);
    server.abort();
}

/// A retry after completion gets the stored response byte for byte (a binary body covering
/// every byte value; status, replay-safe headers in order, repeated `Link` fields) without
/// running the handler; the bare and the Structured-Field-quoted key are the same key. In
/// Redis, completion left a record with the retention period's TTL next to the lock, under
/// the lock's hash tag, and no lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_completion_replays_byte_for_byte() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let h = Harness::new();
    let retention = Duration::from_secs(3600);
    let layer = IdempotencyLayer::new(locker.clone())
        .ttl(TTL)
        .retention(retention);
    let (http, server) = h.serve(layer).await;

    let call = || post_with("binary-1", "{\"amount\":7}").header("x-binary", "4096");
    let original = http.send(call()).await;
    assert_eq!(original.status, StatusCode::CREATED);
    assert_eq!(original.body.len(), 4096);
    assert!(!original.replayed());
    assert_eq!(h.calls(), 1);

    let retry = http.send(call()).await;
    assert_replay_of(&retry, &original);
    assert_eq!(retry.headers.get_all("link").iter().count(), 2);
    assert_eq!(retry.headers["content-length"], "4096");
    // The same key as a Structured Field string.
    let quoted = http
        .send(post_with("\"binary-1\"", "{\"amount\":7}").header("x-binary", "4096"))
        .await;
    assert_replay_of(&quoted, &original);
    assert_eq!(h.calls(), 1, "the handler did not run again");

    // Storage: the record next to the lock, same hash tag, retention as TTL; the lock gone.
    let resource = locker.resource(lock_key(None, "binary-1").unwrap());
    let record = resource.with_suffix("idem");
    assert_eq!(resource.as_str(), "dlock:{idem:binary-1}");
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let exists: i64 = redis::cmd("EXISTS")
        .arg(resource.as_str())
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0, "the lock is released with the completion");
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&record)
        .query_async(&mut conn)
        .await
        .unwrap();
    let retention_ms = retention.as_millis() as i64;
    assert!(
        pttl > retention_ms - 60_000 && pttl <= retention_ms,
        "record TTL {pttl} ms"
    );
    let (fp, tok): (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg(&record)
        .arg("fp")
        .arg("tok")
        .query_async(&mut conn)
        .await
        .unwrap();
    let expected = fingerprint(
        &Method::POST,
        &"/payments".parse().unwrap(),
        b"{\"amount\":7}",
    );
    assert_eq!(fp.as_deref(), Some(expected.to_hex().as_str()));
    assert_eq!(tok, None, "a completed record holds no owner token");
    server.abort();
}

/// The same key with another body, path or method gets 422 after completion — and also while
/// the first request is still running (a different request, not a retry); the handler never
/// runs for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_with_a_different_request_gets_422() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let mut h = Harness::new();
    let layer = IdempotencyLayer::new(locker).ttl(TTL);
    let (http, server) = h.serve(layer).await;

    let first = http.send(post_with("k-422", "{\"amount\":10}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    for call in [
        post_with("k-422", "{\"amount\":11}"),
        post_with("k-422", "{\"amount\":10}").path("/refunds"),
        post_with("k-422", "{\"amount\":10}").method(Method::PATCH),
    ] {
        let reply = http.send(call).await;
        reply.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
    }
    assert_eq!(h.calls(), 1);

    // While running.
    let running = {
        let http = http.clone();
        tokio::spawn(async move {
            http.send(post_with("k-422-running", "{\"amount\":1}").header("x-wait", "gate"))
                .await
        })
    };
    h.wait_entered().await;
    let other = http
        .send(post_with("k-422-running", "{\"amount\":2}"))
        .await;
    other.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
    let dup = http
        .send(post_with("k-422-running", "{\"amount\":1}"))
        .await;
    dup.assert_problem(StatusCode::CONFLICT, "idempotency-request-in-progress");
    h.open_gate();
    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(h.calls(), 2);
    server.abort();
}

/// Inside axum's `nest`, the fingerprint covers the path the client sent: one key sent to
/// `/orders/pay` and then to `/refunds/pay` (each nested router sees only `/pay`) is `422`,
/// not the orders response replayed to the refund.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_on_two_nested_routes_is_a_reuse_not_a_replay() {
    let h = Harness::new();
    let layer = IdempotencyLayer::new(Locker::memory()).ttl(TTL);
    let nested = Router::new()
        .route("/pay", post(pay))
        .route_layer(layer)
        .with_state(h.ctl.clone());
    let app = Router::new()
        .nest("/orders", nested.clone())
        .nest("/refunds", nested);
    let (addr, server) = serve(app).await;
    let http = Http::new(addr);

    let first = http
        .send(post_with("k-nest", "{\"amount\":5}").path("/orders/pay"))
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let refund = http
        .send(post_with("k-nest", "{\"amount\":5}").path("/refunds/pay"))
        .await;
    refund.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
    let retry = http
        .send(post_with("k-nest", "{\"amount\":5}").path("/orders/pay"))
        .await;
    assert_replay_of(&retry, &first);
    assert_eq!(h.calls(), 1);
    server.abort();
}

/// Responses that must not be replayed are not stored and the key is freed: after a 500 (and
/// 503, 429, 409, 408, 425, 401) the retry runs the handler, and the retry's 201 is what is
/// replayed afterwards. A final 4xx (404, 422 from the handler) is stored and replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_final_statuses_are_not_stored_and_the_retry_runs() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let h = Harness::new();
    let layer = IdempotencyLayer::new(locker).ttl(TTL);
    let (http, server) = h.serve(layer).await;

    let mut calls = 0;
    // The 4xx a request gets for one of its headers (outside the fingerprint) are freed too:
    // the client's corrected retry (credentials, `If-Match`, `Content-Type`) must run.
    for status in [
        500u16, 503, 429, 409, 408, 425, 401, 406, 412, 415, 426, 428, 431,
    ] {
        let key = format!("not-stored-{status}");
        let failed = http
            .send(post_with(&key, "{}").header("x-status", status.to_string()))
            .await;
        assert_eq!(failed.status.as_u16(), status);
        assert!(!failed.replayed());
        calls += 1;
        assert_eq!(h.calls(), calls);

        // The retry runs the handler (the `x-status` header is not part of the fingerprint).
        let retry = http.send(post_with(&key, "{}")).await;
        assert_eq!(retry.status, StatusCode::CREATED, "after {status}");
        assert!(!retry.replayed(), "after {status}");
        calls += 1;
        assert_eq!(
            h.calls(),
            calls,
            "after {status}: the retry ran the handler"
        );

        let again = http.send(post_with(&key, "{}")).await;
        assert_replay_of(&again, &retry);
        assert_eq!(h.calls(), calls);
    }

    for status in [404u16, 422] {
        let key = format!("stored-{status}");
        let first = http
            .send(post_with(&key, "{}").header("x-status", status.to_string()))
            .await;
        assert_eq!(first.status.as_u16(), status);
        calls += 1;
        let retry = http.send(post_with(&key, "{}")).await;
        assert_replay_of(&retry, &first);
        assert_eq!(h.calls(), calls, "a final {status} is replayed");
    }
    server.abort();
}

/// A covered method without a key is 400; a key over the limit (and a repeated
/// header) is 400; at the limit it works. GET, PUT and DELETE are not covered by default and
/// run every time; PATCH is covered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_required_bounded_and_limited_to_covered_methods() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let h = Harness::new();
    let layer = IdempotencyLayer::new(locker).ttl(TTL);
    let (http, server) = h.serve(layer).await;

    let missing = http
        .send(Call {
            method: Method::POST,
            path: "/payments",
            headers: vec![],
            body: Bytes::from_static(b"{}"),
        })
        .await;
    missing.assert_problem(StatusCode::BAD_REQUEST, "idempotency-key-missing");

    let too_long = http.send(post_with(&"k".repeat(256), "{}")).await;
    too_long.assert_problem(StatusCode::BAD_REQUEST, "idempotency-key-invalid");
    assert!(too_long.text().contains("255"), "{}", too_long.text());
    let repeated = http
        .send(post_with("a", "{}").header(KEY_HEADER, "b"))
        .await;
    repeated.assert_problem(StatusCode::BAD_REQUEST, "idempotency-key-invalid");
    assert_eq!(h.calls(), 0, "rejections never reach the handler");

    let at_limit = http.send(post_with(&"k".repeat(255), "{}")).await;
    assert_eq!(at_limit.status, StatusCode::CREATED);
    assert_eq!(h.calls(), 1);

    for method in [Method::GET, Method::PUT, Method::DELETE] {
        let before = h.calls();
        for _ in 0..2 {
            let reply = http
                .send(post_with("uncovered", "{}").method(method.clone()))
                .await;
            assert_eq!(reply.status, StatusCode::CREATED, "{method}");
            assert!(!reply.replayed(), "{method}");
        }
        assert_eq!(h.calls(), before + 2, "{method} runs every time");
    }

    let patch = || post_with("patch-1", "{\"op\":\"x\"}").method(Method::PATCH);
    let first = http.send(patch()).await;
    let retry = http.send(patch()).await;
    assert_replay_of(&retry, &first);
    server.abort();
}

/// Keys are scoped by the identity in the request extensions. Two users with the
/// same key (and body) each run the handler once and each get their own replay. A request
/// without the identity is refused with 401 (it must not fall into a key space shared with
/// others) unless the layer opts into the shared space.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_scopes_keys_per_user() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let h = Harness::new();
    let layer = IdempotencyLayer::new(locker.clone())
        .ttl(TTL)
        .identity::<UserId>();
    let (http, server) = h.serve(layer.clone()).await;

    let as_user = |user: &str| post_with("shared-key", "{\"amount\":5}").header("x-user", user);
    let one = http.send(as_user("1")).await;
    let two = http.send(as_user("2")).await;
    for (reply, who) in [(&one, "1"), (&two, "2")] {
        assert_eq!(reply.status, StatusCode::CREATED);
        assert!(!reply.replayed());
        assert!(
            reply.text().contains(&format!("\"user\":\"{who}\"")),
            "{}",
            reply.text()
        );
    }
    assert_eq!(h.calls(), 2, "one run per identity");
    assert_replay_of(&http.send(as_user("1")).await, &one);
    assert_replay_of(&http.send(as_user("2")).await, &two);

    let anon = http.send(post_with("shared-key", "{\"amount\":5}")).await;
    anon.assert_problem(StatusCode::UNAUTHORIZED, "idempotency-identity-missing");
    assert_eq!(h.calls(), 2, "the handler does not run without an identity");
    server.abort();

    // Opted into the shared space: an anonymous request runs there (and replays there).
    let shared = layer.missing_identity(MissingIdentity::SharedSpace);
    let (http, server) = h.serve(shared).await;
    let anon = http.send(post_with("anon-key", "{\"amount\":5}")).await;
    assert_eq!(anon.status, StatusCode::CREATED);
    assert!(anon.text().contains("\"user\":\"anonymous\""));
    assert_replay_of(
        &http.send(post_with("anon-key", "{\"amount\":5}")).await,
        &anon,
    );
    assert_eq!(h.calls(), 3);
    server.abort();
}

/// Crash mid-handler: an instance that began a key and vanished (no renewal, no
/// release) blocks it with 409 until its lease runs out; no record exists, so the client's
/// retry then runs the handler, and later retries replay that response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanished_holder_blocks_until_its_ttl_then_the_retry_runs() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let h = Harness::new();
    let layer = IdempotencyLayer::new(locker.clone()).ttl(TTL);
    let (http, server) = h.serve(layer).await;

    // The other instance: its own connection, began the same request, then died.
    let crashed = redis.locker().await;
    let key = lock_key(None, "crash-1").unwrap();
    let body = "{\"amount\":99}";
    let fp = fingerprint(
        &Method::POST,
        &"/payments".parse().unwrap(),
        body.as_bytes(),
    );
    // Long enough that the request below surely finds it held on a loaded machine.
    let lease = Duration::from_secs(3);
    let Begin::Run(op) = crashed
        .idempotency(key.clone(), fp)
        .ttl(lease)
        .auto_renew(false)
        .begin()
        .await
        .unwrap()
    else {
        panic!("the crashed instance began first")
    };
    let began = Instant::now();
    std::mem::forget(op); // no renewal, no release: the process is gone

    let blocked = http.send(post_with("crash-1", body)).await;
    blocked.assert_problem(StatusCode::CONFLICT, "idempotency-request-in-progress");
    assert!((1..=3).contains(&blocked.retry_after()));
    assert_eq!(h.calls(), 0);

    // Wait for the key to free the way a waiter does (bounded by the holder's lease).
    let waiter = locker
        .lock(key)
        .on_fail(OnFail::retry(HANG))
        .acquire()
        .await
        .expect("the vanished holder's lock expires");
    assert!(
        began.elapsed() >= lease - Duration::from_millis(50),
        "freed before the lease ended: {:?}",
        began.elapsed()
    );
    waiter.release().await.unwrap();

    let retry = http.send(post_with("crash-1", body)).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed(), "no record existed: the handler ran");
    assert_eq!(h.calls(), 1);
    assert_replay_of(&http.send(post_with("crash-1", body)).await, &retry);
    assert_eq!(h.calls(), 1);
    server.abort();
}

/// A service's `call` (its synchronous part, before its future is polled) sees the key's lock
/// through `current_lock()`, the same lock as the `LockInfo` in the extensions: the call ran
/// outside the lock's scope, and a `service_fn` reading `current_lock()` there found none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_services_call_sees_the_lock_before_its_future_runs() {
    use tower::ServiceBuilder;

    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(Locker::memory()).ttl(TTL))
        .service(tower::service_fn(|req: Request<Body>| {
            let seen = dlock_runtime::current_lock();
            let given = req.extensions().get::<dlock_runtime::LockInfo>().cloned();
            let same = seen.is_some() && seen == given;
            std::future::ready(Ok::<_, Infallible>(Response::new(Body::from(
                same.to_string(),
            ))))
        }));
    let res = svc
        .oneshot(post_with("sync-call", "{}").build::<Body>(""))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"true");
}

/// An identity whose `Display` fails is answered `500` (problem
/// `idempotency-identity-unformattable`) without running the handler — under
/// `MissingIdentity::SharedSpace` too, which must not take it for a request without one.
/// Before, `to_string` panicked inside the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_that_cannot_be_formatted_is_answered_500() {
    use tower::ServiceBuilder;

    #[derive(Clone)]
    struct Unprintable;
    impl std::fmt::Display for Unprintable {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("user-")?;
            Err(std::fmt::Error)
        }
    }
    let calls = Arc::new(AtomicUsize::new(0));
    for missing in [MissingIdentity::Reject, MissingIdentity::SharedSpace] {
        let calls = calls.clone();
        let svc = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::new(Locker::memory())
                    .ttl(TTL)
                    .identity::<Unprintable>()
                    .missing_identity(missing),
            )
            .service(tower::service_fn(move |_: Request<Body>| {
                calls.fetch_add(1, Ordering::SeqCst);
                std::future::ready(Ok::<_, Infallible>(Response::new(Body::from("ran"))))
            }));
        let mut req = post_with("unprintable", "{}").build::<Body>("");
        req.extensions_mut().insert(Unprintable);
        let res = svc.oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = res.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body);
        assert!(
            body.contains("urn:dlock:problem:idempotency-identity-unformattable"),
            "{body}"
        );
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler ran");
}

/// A request cancelled while the handler runs releases the key without a record (well before
/// the TTL): the next request with the key runs the handler instead of replaying anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_request_frees_the_key_without_a_record() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let mut h = Harness::new();
    let layer = IdempotencyLayer::new(locker.clone())
        .ttl(TTL)
        .cancel_on_disconnect(true);
    let router = app(layer, h.ctl.clone());

    let request = || post_with("cancel-1", "{}").build::<Body>("");
    let first = tokio::spawn(
        router.clone().oneshot(
            post_with("cancel-1", "{}")
                .header("x-wait", "forever")
                .build::<Body>(""),
        ),
    );
    h.wait_entered().await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());

    // The background release notifies waiters: wait for it like a waiter, far below the TTL.
    let started = Instant::now();
    let waiter = locker
        .lock(lock_key(None, "cancel-1").unwrap())
        .on_fail(OnFail::retry(Duration::from_secs(5)))
        .acquire()
        .await
        .expect("the cancelled request released the key");
    assert!(started.elapsed() < TTL);
    waiter.release().await.unwrap();

    let res = router.clone().oneshot(request()).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert!(!res.headers().contains_key("idempotent-replayed"));
    assert_eq!(h.calls(), 2, "the retry ran the handler");
    let res = router.oneshot(request()).await.unwrap();
    assert_eq!(res.headers()["idempotent-replayed"], "true");
    assert_eq!(h.calls(), 2);
}

/// The client goes away (here: a timeout layer outside gives up, answering 504) while the
/// handler runs: the handler runs to its end anyway and its response is stored, so the
/// client's retry gets `409` while it runs, then the replay — the handler ran once. Once,
/// dropping the response future cut the handler off wherever it was (between two effects: the
/// card charged, the ledger not written), and the retry ran it again from the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_given_up_while_its_handler_runs_finishes_and_the_retry_replays_it() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let mut h = Harness::new();
    let (give_up, give_up_rx) = watch::channel(false);
    let app = with_give_up(
        app(IdempotencyLayer::new(locker).ttl(TTL), h.ctl.clone()),
        give_up_rx,
    );
    let (addr, server) = serve(app).await;
    let http = Http::new(addr);

    let first = {
        let http = http.clone();
        tokio::spawn(async move {
            http.send(post_with("given-up", "{\"amount\":5}").header("x-wait", "gate"))
                .await
        })
    };
    h.wait_entered().await;
    give_up.send(true).unwrap();
    assert_eq!(first.await.unwrap().status, StatusCode::GATEWAY_TIMEOUT);
    give_up.send(false).unwrap();

    // The handler still runs: the retry is told so.
    let retry = http.send(post_with("given-up", "{\"amount\":5}")).await;
    retry.assert_problem(StatusCode::CONFLICT, "idempotency-request-in-progress");
    assert_eq!(h.calls(), 1);

    h.open_gate();
    let retry = http
        .until_not_in_progress(|| post_with("given-up", "{\"amount\":5}"))
        .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(retry.replayed(), "the retry must replay, not run again");
    assert!(retry.text().contains("\"payment\":1"), "{}", retry.text());
    assert_eq!(h.calls(), 1, "the handler ran once");
    server.abort();
}

/// A response over the size limit reaches the client in full (declared length, and streamed
/// without one) but is not stored: the retry runs the handler again. A request body over its
/// limit is 413 before the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_responses_are_delivered_but_not_stored() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let h = Harness::new();
    let layer = IdempotencyLayer::new(locker)
        .ttl(TTL)
        .max_response_body(1024)
        .max_request_body(64);
    let (http, server) = h.serve(layer).await;

    let mut calls = 0;
    for stream in [false, true] {
        let key = format!("big-{stream}");
        let call = || {
            let c = post_with(&key, "{}").header("x-binary", "4096");
            if stream {
                c.header("x-stream", "1")
            } else {
                c
            }
        };
        for _ in 0..2 {
            let reply = http.send(call()).await;
            assert_eq!(reply.status, StatusCode::CREATED);
            assert_eq!(reply.body.len(), 4096, "stream={stream}");
            assert!(!reply.replayed());
            calls += 1;
            assert_eq!(
                h.calls(),
                calls,
                "stream={stream}: not stored, the handler ran"
            );
        }
    }
    // Within the limit it is stored.
    let small = || {
        post_with("small", "{}")
            .header("x-binary", "1024")
            .header("x-stream", "1")
    };
    let first = http.send(small()).await;
    assert_replay_of(&http.send(small()).await, &first);

    let too_big = http.send(post_with("big-request", &"x".repeat(65))).await;
    too_big.assert_problem(StatusCode::PAYLOAD_TOO_LARGE, "body-too-large");
    assert_eq!(h.calls(), calls + 1);
    server.abort();
}

/// With Redis down, fail-closed answers 503 + Retry-After and fail-open runs the handler
/// without idempotency.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_down_fails_closed_or_open() {
    let mut redis = RedisServer::start();
    let locker = Locker::builder()
        .command_timeout(Duration::from_millis(200))
        .connect(&redis.url())
        .await
        .unwrap();
    let h = Harness::new();
    let layer = IdempotencyLayer::new(locker).ttl(TTL);
    let (closed, closed_server) = h.serve(layer.clone()).await;
    let (open, open_server) = h.serve(layer.fail_mode(FailMode::Open)).await;

    redis.pause();
    let reply = closed.send(post_with("down-1", "{}")).await;
    reply.assert_problem(StatusCode::SERVICE_UNAVAILABLE, "lock-backend-unavailable");
    assert!(reply.retry_after() >= 1);
    assert_eq!(h.calls(), 0);

    let reply = open.send(post_with("down-2", "{}")).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(h.calls(), 1);
    redis.resume();
    closed_server.abort();
    open_server.abort();
}

/// Redlock does not store idempotency records: building the layer fails with an error naming
/// the backend (and `new` would panic), instead of failing requests later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redlock_is_refused_with_a_clear_error() {
    use dlock_tests::redis_server::{redlock_url, start_many};

    let servers = start_many(3);
    let locker = Locker::from_url(&redlock_url(&servers)).await.unwrap();
    assert!(!locker.supports_idempotency());
    let err = IdempotencyLayer::try_new(locker).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("redlock") && msg.contains("idempotency"),
        "{msg}"
    );
}

/// The in-memory backend, over HTTP: first run, 409 while running, replay, 422, 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_backend_basic_flow() {
    let locker = Locker::memory();
    let mut h = Harness::new();
    let layer = IdempotencyLayer::new(locker).ttl(TTL);
    let (http, server) = h.serve(layer).await;

    let first = {
        let http = http.clone();
        tokio::spawn(async move {
            http.send(post_with("mem-1", "{\"amount\":3}").header("x-wait", "gate"))
                .await
        })
    };
    h.wait_entered().await;
    let dup = http.send(post_with("mem-1", "{\"amount\":3}")).await;
    dup.assert_problem(StatusCode::CONFLICT, "idempotency-request-in-progress");
    h.open_gate();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);

    let retry = http.send(post_with("mem-1", "{\"amount\":3}")).await;
    assert_replay_of(&retry, &first);
    let other = http.send(post_with("mem-1", "{\"amount\":4}")).await;
    other.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused");
    let failed = http
        .send(post_with("mem-2", "{}").header("x-status", "500"))
        .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    let retry = http.send(post_with("mem-2", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(h.calls(), 3);
    server.abort();
}

/// A stored response encoded for the first request (`Content-Encoding: gzip`, from a
/// compression layer inside this one) is replayed only to a retry that accepts that coding (or
/// sends no `Accept-Encoding`); one that does not gets `406` (problem+json), not bytes it
/// cannot decode. The handler runs once.
#[tokio::test]
async fn an_encoded_response_is_replayed_only_where_its_coding_is_accepted() {
    let h = Harness::new();
    let (http, server) = h
        .serve(IdempotencyLayer::new(Locker::memory()).ttl(TTL))
        .await;
    let send = |accept: Option<&'static str>| {
        let mut request = post_with("enc-1", "{}").header("x-encoded", "gzip");
        if let Some(accept) = accept {
            request = request.header("accept-encoding", accept);
        }
        http.send(request)
    };
    let first = send(Some("gzip, br")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.headers["content-encoding"], "gzip");
    for accept in [Some("br;q=0.5, gzip"), None, Some("*")] {
        let retry = send(accept).await;
        assert_replay_of(&retry, &first);
        assert_eq!(retry.headers["content-encoding"], "gzip", "{accept:?}");
    }
    for accept in ["identity", "br", "gzip;q=0, *"] {
        send(Some(accept)).await.assert_problem(
            StatusCode::NOT_ACCEPTABLE,
            "idempotency-replay-not-acceptable",
        );
    }
    assert_eq!(h.calls(), 1);
    server.abort();
}

/// A response body that sends its first chunk at once, then signals `reading` and waits for
/// the gate before sending the rest.
struct GatedBody {
    first: Option<Bytes>,
    rest: Pin<Box<dyn std::future::Future<Output = Bytes> + Send>>,
    done: bool,
}

impl http_body::Body for GatedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(first))));
        }
        if self.done {
            return Poll::Ready(None);
        }
        match self.rest.as_mut().poll(cx) {
            Poll::Ready(rest) => {
                self.done = true;
                Poll::Ready(Some(Ok(http_body::Frame::data(rest))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// `/payments` behind `layer`, whose handler counts its calls in `calls` and answers `201` with a
/// [`GatedBody`]: `{"status":"` at once, then (after signalling `reading`) ` payment <n> done"}`
/// once `gate` opens.
fn gated_payments(
    layer: IdempotencyLayer,
    calls: Arc<AtomicUsize>,
    reading: mpsc::UnboundedSender<()>,
    gate: watch::Receiver<bool>,
) -> Router {
    let handler = move || {
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        let (reading, mut gate) = (reading.clone(), gate.clone());
        async move {
            let rest = Box::pin(async move {
                let _ = reading.send(());
                gate.wait_for(|open| *open).await.unwrap();
                Bytes::from(format!(" payment {n} done\"}}"))
            });
            Response::builder()
                .status(StatusCode::CREATED)
                .body(Body::new(GatedBody {
                    first: Some(Bytes::from_static(b"{\"status\":\"")),
                    rest,
                    done: false,
                }))
                .unwrap()
        }
    };
    Router::new()
        .route("/payments", post(handler))
        .route_layer(layer)
}

/// A response body still streaming after `max_response_wait` is sent on as it comes, unstored:
/// the client gets the status and the first chunk without waiting for the end, and the key is
/// freed (a retry runs the handler again, not `409` for as long as the first one streams).
/// Once, the layer read the whole body before sending any of it, with no bound: a streamed
/// response kept its client waiting and its key at `409` for as long as it streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_still_streaming_after_the_wait_is_sent_on_unstored() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let (reading_tx, _reading) = mpsc::unbounded_channel::<()>();
    let (open, gate) = watch::channel(false);
    let layer = IdempotencyLayer::new(locker)
        .ttl(TTL)
        .max_response_wait(Duration::from_millis(200));
    let (addr, server) = serve(gated_payments(layer, calls.clone(), reading_tx, gate)).await;
    let http = Http::new(addr);
    let request = || post_with("streaming", "{\"amount\":3}").build(&format!("http://{addr}"));

    // The body's rest waits for the gate, which stays shut: the status comes anyway.
    let first = tokio::time::timeout(HANG, http.client.request(request()))
        .await
        .expect("the status before the body ended")
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get("idempotent-replayed").is_none());
    // Not stored, the key freed: the retry runs the handler again.
    let second = tokio::time::timeout(HANG, http.client.request(request()))
        .await
        .expect("the retry's status")
        .unwrap();
    assert_eq!(
        second.status(),
        StatusCode::CREATED,
        "not 409 while the first streams"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    open.send(true).unwrap();
    let body = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, "{\"status\":\" payment 1 done\"}");
    server.abort();
}

/// The handler has returned, the layer is reading its body to store it, and
/// the response future is dropped (a timeout layer gives up, the client goes away). Storing
/// the record still finishes: the client's retry is a replay, and the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_future_dropped_after_the_handler_returned_still_stores_the_record() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let (reading_tx, mut reading) = mpsc::unbounded_channel::<()>();
    let (open, gate) = watch::channel(false);
    let (give_up, give_up_rx) = watch::channel(false);

    let app = with_give_up(
        gated_payments(
            IdempotencyLayer::new(locker).ttl(TTL),
            calls.clone(),
            reading_tx,
            gate,
        ),
        give_up_rx,
    );
    let (addr, server) = serve(app).await;
    let http = Http::new(addr);

    let first = {
        let http = http.clone();
        tokio::spawn(async move { http.send(post_with("gone-key", "{\"amount\":9}")).await })
    };
    tokio::time::timeout(HANG, reading.recv())
        .await
        .expect("the layer reads the handler's response body")
        .unwrap();
    give_up.send(true).unwrap();
    assert_eq!(first.await.unwrap().status, StatusCode::GATEWAY_TIMEOUT);
    give_up.send(false).unwrap();
    open.send(true).unwrap();

    // The retry: 409 while the record is being stored, then the stored response.
    let retry = http
        .until_not_in_progress(|| post_with("gone-key", "{\"amount\":9}"))
        .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(retry.replayed(), "the retry must replay, not run again");
    assert_eq!(retry.text(), "{\"status\":\" payment 1 done\"}");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    server.abort();
}

/// A stored `405` is replayed with its `Allow` field, which RFC 9110 requires of it: with the
/// layer on the whole router, a `PATCH` to a `POST`-only route gets axum's `405` with
/// `Allow: POST`, and the retry's replay carries the same field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_405_keeps_its_allow_field() {
    let layer = IdempotencyLayer::new(Locker::memory()).ttl(TTL);
    let app = Router::new()
        .route("/refunds", post(|| async { "refunded" }))
        .layer(layer);
    let (addr, server) = serve(app).await;
    let http = Http::new(addr);
    let call = || {
        post_with("allow-1", "{}")
            .method(Method::PATCH)
            .path("/refunds")
    };
    let first = http.send(call()).await;
    assert_eq!(first.status, StatusCode::METHOD_NOT_ALLOWED);
    let allow = first.headers.get("allow").expect("axum's 405 has `Allow`");
    let retry = http.send(call()).await;
    assert!(retry.replayed(), "a 405 is the request's final outcome");
    assert_eq!(retry.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(
        retry.headers.get("allow"),
        Some(allow),
        "the replay lost `Allow`"
    );
    server.abort();
}

/// A request body that a limit outside the layer cuts off (tower-http's
/// `RequestBodyLimitLayer` wraps bodies of unknown length in `Limited`) is `413`, as the
/// layer's own limit answers, not `400`; the handler does not run and the key stays free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_cut_off_by_an_outer_limit_is_413() {
    let h = Harness::new();
    let layer = IdempotencyLayer::new(Locker::memory()).ttl(TTL);
    let limited = |req: Request<Body>| req.map(|b| Body::new(http_body_util::Limited::new(b, 64)));
    let app = app(layer, h.ctl.clone()).layer(tower::util::MapRequestLayer::new(limited));
    let (addr, server) = serve(app).await;
    let http = Http::new(addr);

    let too_big = http.send(post_with("outer-limit", &"x".repeat(100))).await;
    too_big.assert_problem(StatusCode::PAYLOAD_TOO_LARGE, "body-too-large");
    assert_eq!(h.calls(), 0);
    let small = http.send(post_with("outer-limit", "{}")).await;
    assert_eq!(small.status, StatusCode::CREATED, "{}", small.text());
    assert_eq!(h.calls(), 1);
    server.abort();
}

/// `IdempotencyLayer::in_flight` counts a handler whose client went away until its response
/// is stored, and `drained` resolves only then: a shutdown that waits for it cuts no handler
/// off, and the retry (after it) gets the replay at once, never `409`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_drains_once_a_given_up_handlers_response_is_stored() {
    use std::future::Future as _;

    let mut h = Harness::new();
    let locker = Locker::memory();
    let layer = IdempotencyLayer::new(locker.clone()).ttl(TTL);
    let in_flight = layer.in_flight();
    let (give_up, give_up_rx) = watch::channel(false);
    let (addr, server) = serve(with_give_up(app(layer, h.ctl.clone()), give_up_rx)).await;
    let http = Http::new(addr);
    assert_eq!(in_flight.count(), 0);
    in_flight.drained().await; // nothing runs: at once

    let first = {
        let http = http.clone();
        tokio::spawn(async move {
            http.send(post_with("drain-1", "{}").header("x-wait", "gate"))
                .await
        })
    };
    h.wait_entered().await;
    give_up.send(true).unwrap();
    assert_eq!(first.await.unwrap().status, StatusCode::GATEWAY_TIMEOUT);
    server.abort(); // the server stopped: no connection waits for the handler any more

    assert_eq!(in_flight.count(), 1, "the given-up handler still runs");
    let mut drained = Box::pin(in_flight.drained());
    let mut cx = Context::from_waker(std::task::Waker::noop());
    assert!(
        drained.as_mut().poll(&mut cx).is_pending(),
        "drained while a handler runs"
    );
    h.open_gate();
    tokio::time::timeout(HANG, drained)
        .await
        .expect("drained once the handler ended");
    assert_eq!(in_flight.count(), 0);

    // Everything is stored by now: the next instance's first answer to the retry is the
    // replay, not `409`.
    let (addr, server) = serve(app(IdempotencyLayer::new(locker), h.ctl.clone())).await;
    let retry = Http::new(addr).send(post_with("drain-1", "{}")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(retry.replayed());
    assert_eq!(h.calls(), 1);
    server.abort();
}

// ---------------------------------------------------------------------------------------------
// Stacked with the lock layers.

/// An `IdempotencyLayer` outside a `DeferLayer` (the app's `.route_layer(defer)
/// .route_layer(idempotency)`): a request whose resource is busy is answered `202` and queued,
/// and that `202` is not the key's stored outcome — the replay, through the app without the
/// defer layer (the idempotency layer and its identity still in it), runs the handler once,
/// with the resource's lock in its extensions, and stores its real response, which the
/// client's retry then gets. A retry while the job waits is deferred again, not answered with
/// a stored `202`; its job replays the first one's stored response. Once, the `202` was stored
/// as the key's response: the replay was answered with it, the handler never ran, and the job
/// was recorded completed with the result "202".
#[cfg(feature = "defer")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferred_request_is_not_the_keys_outcome_and_its_replay_runs_the_handler_once() {
    use dlock_runtime::defer::DeferPolicy;
    use dlock_runtime::durable::JobStatus;
    use dlock_tests::jobs::{run_in_background, start_queue};
    use dlock_tests::wait::poll_until;
    use dlock_tower::defer::replay_worker;
    use dlock_tower::{key, DeferLayer};

    const ACCOUNT_LOCK: &str = "hdr:x-account:acct-1";
    let (_redis, locker, queue) = start_queue("idempotent-defer").await;
    let calls = Arc::new(AtomicUsize::new(0));
    let (seen_tx, mut seen_rx) = mpsc::unbounded_channel::<(String, Option<String>)>();
    let policy =
        DeferPolicy::new(Duration::from_millis(20), 100).max_delay(Duration::from_millis(50));
    let idempotency = IdempotencyLayer::new(locker.clone())
        .ttl(TTL)
        .identity::<UserId>();
    // The app; the worker replays through it without the defer layer.
    let app = |deferring: bool| {
        let (calls, seen) = (calls.clone(), seen_tx.clone());
        let routes = Router::new().route(
            "/orders",
            post(move |lock: Option<Extension<LockInfo>>, body: String| {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                seen.send((body, lock.map(|Extension(l)| l.key().to_owned())))
                    .unwrap();
                async move { (StatusCode::CREATED, format!("order {n}")) }
            }),
        );
        let routes = match deferring {
            true => routes.route_layer(
                DeferLayer::new(locker.clone(), key::header("x-account"), queue.clone())
                    .policy(policy.clone()),
            ),
            false => routes,
        };
        routes
            .route_layer(idempotency.clone())
            .layer(tower::util::MapRequestLayer::new(user_from_header::<Body>))
    };
    let (addr, server) = serve(app(true)).await;
    let http = Http::new(addr);
    let order = |key: &str, body: &str| {
        post_with(key, body)
            .path("/orders")
            .header("x-account", "acct-1")
            .header("x-user", "7")
    };
    let job_of = |reply: &Reply| {
        assert_eq!(reply.status, StatusCode::ACCEPTED, "{}", reply.text());
        assert!(
            !reply.replayed(),
            "a stored 202 was replayed: {}",
            reply.text()
        );
        let location = reply.headers["location"].to_str().unwrap();
        location.rsplit('/').next().unwrap().to_owned()
    };

    // The account is busy: both orders are deferred, and the retry of the second is deferred
    // again (its key holds no record).
    let held = locker.lock(ACCOUNT_LOCK).acquire().await.unwrap();
    let once = job_of(&http.send(order("k-once", "order #1")).await);
    let retried = job_of(&http.send(order("k-retried", "order #2")).await);
    let retry = http.send(order("k-retried", "order #2")).await;
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the account is busy");

    let worker = replay_worker::<_, Body, _>(queue.clone(), locker.clone(), app(false))
        .poll_interval(Duration::from_millis(10));
    let w = run_in_background(worker);
    held.release().await.unwrap();
    let result = async |job: &str| {
        poll_until(
            Duration::from_secs(10),
            Duration::ZERO,
            async || match queue.status(job).await.unwrap() {
                JobStatus::Completed { result } => Ok(result),
                other => Err(format!("{other:?}")),
            },
        )
        .await
    };
    // The jobs for one account run one at a time, in either order.
    let results = [result(&once).await, result(&retried).await];
    assert_eq!(
        (results, calls.load(Ordering::SeqCst)),
        ([Some("201".to_owned()), Some("201".to_owned())], 2),
        "the replays of the deferred requests must run the handler, once per key (job \
         results, handler calls)"
    );
    // The retry while the job waited was another job, which ran the handler or (when it ran
    // second) replayed the stored response.
    let again = job_of(&retry);
    assert_ne!(again, retried);
    assert_eq!(result(&again).await.as_deref(), Some("201"));
    assert_eq!(calls.load(Ordering::SeqCst), 2, "each order ran once");
    // One of the retried key's two jobs ran the handler, the other replayed its response.
    let mut seen: Vec<_> = std::iter::from_fn(|| seen_rx.try_recv().ok()).collect();
    seen.sort();
    let account = Some(ACCOUNT_LOCK.to_owned());
    assert_eq!(
        seen,
        [
            ("order #1".to_owned(), account.clone()),
            ("order #2".to_owned(), account)
        ],
        "the replayed handler sees the resource's lock, not the idempotency key's"
    );

    // The clients' retries now get the stored responses.
    let mut texts = Vec::new();
    for (key, body) in [("k-once", "order #1"), ("k-retried", "order #2")] {
        let reply = http.send(order(key, body)).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{}", reply.text());
        assert!(reply.replayed());
        texts.push(reply.text());
    }
    texts.sort();
    assert_eq!(texts, ["order 1", "order 2"]);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    w.stop().await;
    server.abort();
}

/// What a [`guarded`] handler reports.
#[derive(Debug)]
enum Step {
    /// Request `key` entered, with `lock` in its extensions and `held` visible to
    /// `held_locks()`.
    Entered {
        key: String,
        lock: Option<String>,
        held: Vec<String>,
    },
    /// Request `key`'s handler ended: `finished`, or dropped where it waited.
    Left { key: String, finished: bool },
}

#[derive(Clone)]
struct Guarded {
    active: Arc<AtomicUsize>,
    max: Arc<AtomicUsize>,
    steps: mpsc::UnboundedSender<Step>,
    gate: watch::Receiver<bool>,
}

/// Counts the handlers inside at once (`max`), reports entering and leaving (also when
/// dropped), and waits for the gate.
async fn guarded(
    State(g): State<Guarded>,
    lock: Option<Extension<LockInfo>>,
    headers: HeaderMap,
) -> StatusCode {
    struct Leaving(Guarded, String, bool);
    impl Drop for Leaving {
        fn drop(&mut self) {
            self.0.active.fetch_sub(1, Ordering::SeqCst);
            let key = std::mem::take(&mut self.1);
            let _ = self.0.steps.send(Step::Left {
                key,
                finished: self.2,
            });
        }
    }
    let key = headers[KEY_HEADER].to_str().unwrap().to_owned();
    let inside = g.active.fetch_add(1, Ordering::SeqCst) + 1;
    g.max.fetch_max(inside, Ordering::SeqCst);
    let mut leaving = Leaving(g.clone(), key.clone(), false);
    let held = dlock_runtime::held_locks();
    g.steps
        .send(Step::Entered {
            key,
            lock: lock.map(|Extension(l)| l.key().to_owned()),
            held: held.iter().map(|l| l.key().to_owned()).collect(),
        })
        .unwrap();
    // (A gate dropped: the test is over.)
    let _ = g.gate.clone().wait_for(|open| *open).await;
    leaving.2 = true;
    StatusCode::CREATED
}

/// The client of request `a` hangs up while its handler runs under the lock `outer_key` of a
/// layer `stack` puts outside the idempotency layer; request `b` for the same lock (another
/// idempotency key) must not run its handler until `a`'s has ended.
async fn an_outer_lock_covers_the_handler_until_it_ends(
    stack: impl FnOnce(Router<Guarded>) -> Router<Guarded>,
    locker: &Locker,
    outer_key: &str,
) {
    use tokio::io::AsyncWriteExt as _;

    let (open, gate) = watch::channel(false);
    let (steps_tx, mut steps) = mpsc::unbounded_channel();
    let g = Guarded {
        active: Arc::new(AtomicUsize::new(0)),
        max: Arc::new(AtomicUsize::new(0)),
        steps: steps_tx,
        gate,
    };
    let app = stack(Router::new().route("/work", post(guarded))).with_state(g.clone());
    let (addr, server) = serve(app).await;
    let http = Http::new(addr);
    let work = |key: &str| {
        post_with(key, "")
            .path("/work")
            .header("x-account", "acct-1")
    };
    let mut next = async || {
        tokio::time::timeout(HANG, steps.recv())
            .await
            .expect("a handler step in time")
            .unwrap()
    };

    // `a`, on a connection of its own, hangs up once its handler runs.
    let mut a = tokio::net::TcpStream::connect(addr).await.unwrap();
    a.write_all(
        b"POST /work HTTP/1.1\r\nhost: test\r\nidempotency-key: a\r\nx-account: acct-1\r\n\
          content-length: 0\r\n\r\n",
    )
    .await
    .unwrap();
    let entered_a = next().await;
    assert!(
        matches!(&entered_a, Step::Entered { key, .. } if key == "a"),
        "{entered_a:?}"
    );
    drop(a);

    // Once the outer lock is free, `b` takes it.
    dlock_tests::wait::poll_until(HANG, Duration::from_millis(5), async || {
        match locker.lock(outer_key).try_acquire().await.unwrap() {
            Some(guard) => {
                guard.release().await.unwrap();
                Ok(())
            }
            None => Err("the outer lock is still held"),
        }
    })
    .await;
    let b = {
        let http = http.clone();
        let call = work("b");
        tokio::spawn(async move { http.send(call).await })
    };
    let mut before_b = Vec::new();
    loop {
        match next().await {
            Step::Entered { key, .. } if key == "b" => break,
            step => before_b.push(step),
        }
    }
    assert_eq!(
        g.max.load(Ordering::SeqCst),
        1,
        "b's handler ran while a's did, under one lock; before b: {before_b:?}"
    );
    assert!(
        matches!(&before_b[..], [Step::Left { key, finished: false }] if key == "a"),
        "a's handler was cut off with its outer lock: {before_b:?}"
    );
    open.send(true).unwrap();
    assert_eq!(b.await.unwrap().status, StatusCode::CREATED);
    let Step::Entered { lock, held, .. } = entered_a else {
        unreachable!()
    };
    assert_eq!(
        lock.as_deref(),
        Some(outer_key),
        "the handler sees the outer lock's LockInfo"
    );
    let idem = lock_key(None, "a").unwrap();
    assert_eq!(
        held,
        [outer_key, idem.as_str()],
        "held_locks(): the outer lock, then the key's"
    );

    // `a`'s key was released without a record: the client's retry runs the handler.
    let retry = http.send(work("a")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.text());
    assert!(!retry.replayed());
    server.abort();
}

/// A `DistributedLockLayer` outside the idempotency layer keeps its mutual exclusion when a
/// client goes away: the handler runs in the request's future (as with
/// `cancel_on_disconnect(true)`), so it is cut off before the outer lock is released, and the
/// next request for the lock waits for it; the handler sees the outer lock's `LockInfo` and
/// both locks in `held_locks()`. Once, the idempotency layer ran the handler in a task of its
/// own: the outer lock was released at the hang-up while the handler ran on, the next request
/// ran beside it (two inside at once), and the handler saw the idempotency key's `LockInfo`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_layer_outside_is_not_released_while_a_given_up_handler_runs() {
    use dlock_tower::{key, DistributedLockLayer};

    let locker = Locker::memory();
    let l = locker.clone();
    let stack = move |routes: Router<Guarded>| {
        routes
            .route_layer(IdempotencyLayer::new(l.clone()).ttl(TTL))
            .route_layer(
                DistributedLockLayer::new(l, key::header("x-account"))
                    .ttl(TTL)
                    .on_fail(OnFail::retry(HANG)),
            )
    };
    an_outer_lock_covers_the_handler_until_it_ends(stack, &locker, "hdr:x-account:acct-1").await;
}

/// The same with a `DeferLayer` outside the idempotency layer.
#[cfg(feature = "defer")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_defer_layer_outside_is_not_released_while_a_given_up_handler_runs() {
    use dlock_tower::{key, DeferLayer};

    let (_redis, locker, queue) = dlock_tests::jobs::start_queue("outer-defer").await;
    let l = locker.clone();
    let stack = move |routes: Router<Guarded>| {
        routes
            .route_layer(IdempotencyLayer::new(l.clone()).ttl(TTL))
            .route_layer(DeferLayer::new(l, key::header("x-account"), queue))
    };
    an_outer_lock_covers_the_handler_until_it_ends(stack, &locker, "hdr:x-account:acct-1").await;
}
