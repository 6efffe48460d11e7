//! `DistributedLockLayer` against real `redis-server` processes (and one PostgreSQL): mutual
//! exclusion per key, parallelism across keys, release on cancellation, fail-open/fail-closed,
//! the body digest, `LockInfo` in extensions, and composition with axum and a plain hyper +
//! tower stack.
//!
//! Inner services block on signals the test controls (watch channels, barriers), never on
//! sleeps; assertions are about behaviour, not speed.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use dlock_runtime::{LockInfo, Locker, OnFail, PROBLEM_JSON};
use dlock_tests::http::{client, serve, text, Chunked};
use dlock_tests::RedisServer;
use dlock_tower::key::{self, Key};
use dlock_tower::{DistributedLockLayer, FailMode, MissingKey};
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::sync::{mpsc, watch, Barrier};
use tokio::task::JoinSet;
use tower::util::ServiceFn;
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};

const TTL: Duration = Duration::from_secs(30);

/// A generous bound on how long a behaviour may take before the test calls it a hang.
const HANG: Duration = Duration::from_secs(30);

/// A locker whose commands give up after 200 ms, so a stopped or paused server is an error
/// quickly.
async fn fast_fail_locker(server: &RedisServer) -> Locker {
    Locker::builder()
        .command_timeout(Duration::from_millis(200))
        .connect(&server.url())
        .await
        .unwrap()
}

/// A `DeferLayer` keyed by `idempotency-key` over `queue`, retrying every 20–50 ms.
#[cfg(feature = "defer")]
fn defer_layer(
    locker: &Locker,
    queue: dlock_runtime::durable::DurableQueue,
) -> dlock_tower::DeferLayer<key::Header> {
    use dlock_runtime::defer::DeferPolicy;

    let policy =
        DeferPolicy::new(Duration::from_millis(20), 100).max_delay(Duration::from_millis(50));
    dlock_tower::DeferLayer::new(locker.clone(), key::header("idempotency-key"), queue)
        .policy(policy)
}

/// Holds the lock that a request with `idempotency-key: <key>` needs.
async fn hold(locker: &Locker, key: &str) -> dlock_runtime::LockGuard {
    let resource = format!("hdr:idempotency-key:{key}");
    locker.lock(resource).acquire().await.unwrap()
}

/// An inner service that answers "served" and records, per request, whether it came with a
/// lock (`LockInfo` in the extensions).
#[allow(clippy::type_complexity)]
fn served_recording_locks(
    saw_lock: &Arc<Mutex<Vec<bool>>>,
) -> ServiceFn<
    impl Fn(Request<Body>) -> std::future::Ready<Result<Response<Body>, Infallible>> + Clone,
> {
    let saw_lock = saw_lock.clone();
    service_fn(move |req: Request<Body>| {
        saw_lock
            .lock()
            .unwrap()
            .push(req.extensions().get::<LockInfo>().is_some());
        std::future::ready(Ok(Response::new(Body::from("served"))))
    })
}

/// A request without a body, with `headers`.
fn bare(method: Method, uri: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut req = Request::builder().method(method).uri(uri);
    for &(name, value) in headers {
        req = req.header(name, value);
    }
    req.body(Body::empty()).unwrap()
}

fn idem(key: &str) -> Request<Body> {
    bare(Method::POST, "/work", &[("idempotency-key", key)])
}

fn retry_after<B>(res: &Response<B>) -> u64 {
    res.headers()
        .get(RETRY_AFTER)
        .expect("Retry-After")
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

fn assert_problem<B>(res: &Response<B>, status: StatusCode) {
    assert_eq!(res.status(), status);
    assert_eq!(res.headers()[CONTENT_TYPE], PROBLEM_JSON);
}

/// A gate the test opens; handlers wait on it.
fn gate() -> (watch::Sender<bool>, watch::Receiver<bool>) {
    watch::channel(false)
}

async fn wait_open(mut rx: watch::Receiver<bool>) {
    rx.wait_for(|open| *open).await.expect("gate dropped");
}

/// A handler's first step: a request with `x-wait` says it entered, then waits for the gate.
async fn pause_if_asked(
    headers: &http::HeaderMap,
    gate_rx: watch::Receiver<bool>,
    entered: &mpsc::UnboundedSender<()>,
) {
    if headers.contains_key("x-wait") {
        entered.send(()).unwrap();
        wait_open(gate_rx).await;
    }
}

/// 100 concurrent requests with one `Idempotency-Key`, over a real HTTP server: exactly one
/// reaches the handler while it holds the lock; the other 99 get 409 with the holder's
/// remaining lease as `Retry-After` and a problem+json body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_over_http_admits_one_and_rejects_the_rest() {
    let redis = RedisServer::start();
    admits_one_and_rejects_the_rest(redis.locker().await).await;
}

/// The same over the Postgres backend (a throwaway PostgreSQL shared by this test binary).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_over_http_admits_one_and_rejects_the_rest_on_postgres() {
    let port = dlock_tests::postgres_server::shared()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .port();
    let locker = Locker::from_url(&format!("postgres://postgres@127.0.0.1:{port}/postgres"))
        .await
        .expect("connect to postgres");
    admits_one_and_rejects_the_rest(locker).await;
}

async fn admits_one_and_rejects_the_rest(locker: Locker) {
    let entered = Arc::new(AtomicUsize::new(0));
    let (open, gate_rx) = gate();

    let handler = {
        let entered = entered.clone();
        move || {
            let entered = entered.clone();
            let gate_rx = gate_rx.clone();
            async move {
                entered.fetch_add(1, Ordering::SeqCst);
                wait_open(gate_rx).await;
                "done"
            }
        }
    };
    let app = Router::new()
        .route("/work", post(handler))
        .route_layer(DistributedLockLayer::new(locker, key::header("idempotency-key")).ttl(TTL));
    let (addr, server) = serve(app).await;

    let client = client();
    let started = Instant::now();
    let mut requests = JoinSet::new();
    for _ in 0..100 {
        let client = client.clone();
        let req = Request::post(format!("http://{addr}/work"))
            .header("idempotency-key", "order-77")
            .body(Full::new(Bytes::new()))
            .unwrap();
        requests.spawn(async move {
            let res = client.request(req).await.expect("http request");
            let status = res.status();
            let retry = res.headers().get(RETRY_AFTER).cloned();
            let ctype = res.headers().get(CONTENT_TYPE).cloned();
            (status, retry, ctype, text(res).await)
        });
    }

    // The holder cannot finish before the gate opens, so the first 99 answers are the others.
    for _ in 0..99 {
        let (status, retry, ctype, body) = tokio::time::timeout(HANG, requests.join_next())
            .await
            .expect("rejections arrive while the lock is held")
            .unwrap()
            .unwrap();
        assert_eq!(status, StatusCode::CONFLICT, "{body}");
        assert_eq!(ctype.unwrap(), PROBLEM_JSON);
        let secs: u64 = retry.unwrap().to_str().unwrap().parse().unwrap();
        // The holder's lease: at most the TTL, and at least what is left of it since the
        // requests started (the watchdog only ever extends it).
        let elapsed = started.elapsed().as_secs() + 1;
        assert!(secs <= TTL.as_secs(), "Retry-After {secs}");
        assert!(
            secs >= TTL.as_secs().saturating_sub(elapsed),
            "Retry-After {secs}"
        );
        assert!(body.contains("\"status\":409"), "{body}");
        assert!(body.contains("urn:dlock:problem:lock-contended"), "{body}");
        assert!(body.contains(&format!("\"retry_after\":{secs}")), "{body}");
    }
    assert_eq!(entered.load(Ordering::SeqCst), 1);

    open.send(true).unwrap();
    let (status, _, _, body) = requests.join_next().await.unwrap().unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "done");
    assert_eq!(entered.load(Ordering::SeqCst), 1);
    server.abort();
}

/// Requests with different keys are inside the handler at the same time: the handler waits on
/// a barrier that only opens when all of them are in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_keys_run_in_parallel() {
    const N: usize = 8;
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let barrier = Arc::new(Barrier::new(N));
    let svc = ServiceBuilder::new()
        .layer(DistributedLockLayer::new(locker, key::header("idempotency-key")).ttl(TTL))
        .service(service_fn(move |_req: Request<Body>| {
            let barrier = barrier.clone();
            async move {
                barrier.wait().await;
                Ok::<_, Infallible>(Response::new(Body::from("in")))
            }
        }));

    let mut requests = JoinSet::new();
    for i in 0..N {
        requests.spawn(svc.clone().oneshot(idem(&format!("key-{i}"))));
    }
    let all = tokio::time::timeout(HANG, requests.join_all())
        .await
        .expect("all keys get in together");
    for res in all {
        assert_eq!(res.unwrap().status(), StatusCode::OK);
    }
}

/// A request whose future is dropped while the handler runs releases its lock: the next
/// request with that key gets in, well before the TTL would have freed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_request_releases_its_lock() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::new()));
    let (entered_tx, mut entered_rx) = mpsc::unbounded_channel();

    let svc = ServiceBuilder::new()
        .layer(
            DistributedLockLayer::new(locker, key::header("idempotency-key"))
                .ttl(TTL)
                // Waiting (woken by the release) far shorter than the TTL: getting in proves
                // the dropped request released the lock.
                .on_fail(OnFail::retry(Duration::from_secs(5))),
        )
        .service(service_fn({
            let calls = calls.clone();
            let tokens = tokens.clone();
            move |req: Request<Body>| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                let info = req.extensions().get::<LockInfo>().cloned().unwrap();
                tokens.lock().unwrap().push(info.fencing_token());
                let entered_tx = entered_tx.clone();
                async move {
                    if n == 0 {
                        entered_tx.send(()).unwrap();
                        std::future::pending::<()>().await;
                    }
                    Ok::<_, Infallible>(Response::new(Body::from("second")))
                }
            }
        }));

    let first = tokio::spawn(svc.clone().oneshot(idem("cancel-me")));
    entered_rx.recv().await.unwrap();
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());

    let started = Instant::now();
    let res = svc.clone().oneshot(idem("cancel-me")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK, "{}", text(res).await);
    assert!(started.elapsed() < TTL);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let tokens = tokens.lock().unwrap().clone();
    assert!(tokens[1] > tokens[0], "fencing tokens {tokens:?}");
}

/// A handler that panics releases its lock: over a real server, the panic ends its connection's
/// task (the client sees the connection close) and drops the request's future with the guard
/// in it, whose drop releases the lock in the background; the next requests on the key are let
/// in within 5 s (a request may come before that release lands, and be refused), not refused
/// until the 30 s TTL ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_releases_its_lock() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                assert!(n > 0, "the first request's handler panics");
                "second"
            }
        }
    };
    let app = Router::new().route("/work", post(handler)).route_layer(
        DistributedLockLayer::new(locker, key::header("idempotency-key"))
            .ttl(TTL)
            .on_fail(OnFail::Reject),
    );
    let (addr, server) = serve(app).await;
    let client = client();
    let send = || {
        let req = Request::post(format!("http://{addr}/work"))
            .header("idempotency-key", "panics")
            .body(Full::new(Bytes::new()))
            .unwrap();
        tokio::time::timeout(HANG, client.request(req))
    };
    let first = send().await.expect("an answer or a closed connection");
    assert!(first.is_err(), "the panicking handler answered: {first:?}");
    let res = dlock_tests::wait::poll_until(
        Duration::from_secs(5),
        Duration::from_millis(20),
        async || {
            let res = send().await.expect("an answer").expect("http request");
            match res.status() {
                StatusCode::OK => Ok(res),
                StatusCode::CONFLICT => Err("refused: the lock is still held".to_owned()),
                other => panic!("{other}: {}", text(res).await),
            }
        },
    )
    .await;
    assert_eq!(text(res).await, "second");
    server.abort();
}

/// With `cancel_on_lost(true)`, a service that answers with an error releases the lock as the
/// error is returned, not when the caller drops the finished future: another request's lock on
/// the key is taken while that future is still kept. Before, the loss watcher kept the guard
/// alive, and the key stayed locked until the future was dropped (or the TTL ran out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_error_releases_the_lock_with_cancel_on_lost() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let svc = ServiceBuilder::new()
        .layer(
            DistributedLockLayer::new(locker.clone(), key::header("idempotency-key"))
                .ttl(TTL)
                .cancel_on_lost(true),
        )
        .service(service_fn(|_: Request<Body>| async {
            Err::<Response<Body>, _>(std::io::Error::other("the service failed"))
        }));
    let mut svc = svc;
    let ready = svc.ready().await.unwrap();
    let mut answered = std::pin::pin!(ready.call(idem("fails")));
    let err = answered.as_mut().await.expect_err("the service's error");
    assert_eq!(err.to_string(), "the service failed");
    // The finished future is still kept: the lock must be free all the same (woken by its
    // release, long before the 30 s TTL).
    let next = locker
        .lock("hdr:idempotency-key:fails")
        .on_fail(OnFail::retry(Duration::from_secs(5)))
        .acquire()
        .await
        .expect("released when the error was returned");
    next.release().await.unwrap();
    // (`answered`, pinned on this stack, lives to here.)
}

/// With the backend down, fail-closed answers 503 + Retry-After and fail-open calls the
/// service without a lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_down_fails_closed_or_open() {
    let mut redis = RedisServer::start();
    let locker = fast_fail_locker(&redis).await;
    let saw_lock = Arc::new(Mutex::new(Vec::new()));
    let inner = served_recording_locks(&saw_lock);
    let layer = DistributedLockLayer::new(locker, key::header("idempotency-key")).ttl(TTL);
    let closed = ServiceBuilder::new()
        .layer(layer.clone())
        .service(inner.clone());
    let open = ServiceBuilder::new()
        .layer(layer.fail_mode(FailMode::Open))
        .service(inner);

    // Up: both take the lock.
    assert_eq!(
        closed.clone().oneshot(idem("a")).await.unwrap().status(),
        200
    );
    assert_eq!(open.clone().oneshot(idem("b")).await.unwrap().status(), 200);
    assert_eq!(*saw_lock.lock().unwrap(), [true, true]);
    saw_lock.lock().unwrap().clear();

    for down in ["paused", "stopped"] {
        if down == "paused" {
            redis.pause();
        } else {
            redis.resume();
            redis.stop();
        }
        let res = closed.clone().oneshot(idem("c")).await.unwrap();
        assert_problem(&res, StatusCode::SERVICE_UNAVAILABLE);
        assert!(retry_after(&res) >= 1);
        let body = text(res).await;
        assert!(
            body.contains("urn:dlock:problem:lock-backend-unavailable"),
            "{down}: {body}"
        );

        let res = open.clone().oneshot(idem("d")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{down}");
        assert_eq!(text(res).await, "served");
    }
    // Fail-closed never reached the service; fail-open reached it without a lock.
    assert_eq!(*saw_lock.lock().unwrap(), [false, false]);
}

/// A backend that refuses for good (an ACL without the lock keys) is no outage: fail-closed
/// and fail-open layers both answer 500 (`lock-backend-misconfigured`, no `Retry-After`), and
/// the service is never called — fail-open would have run every request unlocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_refuses_for_good_fails_closed_in_either_mode() {
    let redis = RedisServer::start();
    let url = redis.confined_user_url("confined").await;
    let locker = Locker::builder()
        .command_timeout(Duration::from_millis(300))
        .connect(&url)
        .await
        .unwrap();
    let saw_lock = Arc::new(Mutex::new(Vec::new()));
    let inner = served_recording_locks(&saw_lock);
    let layer = DistributedLockLayer::new(locker, key::header("idempotency-key")).ttl(TTL);
    for mode in [FailMode::Closed, FailMode::Open] {
        let svc = ServiceBuilder::new()
            .layer(layer.clone().fail_mode(mode))
            .service(inner.clone());
        let res = svc.oneshot(idem("refused")).await.unwrap();
        assert_problem(&res, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(res.headers().get("retry-after").is_none(), "{mode:?}");
        let body = text(res).await;
        assert!(
            body.contains("urn:dlock:problem:lock-backend-misconfigured"),
            "{mode:?}: {body}"
        );
    }
    assert!(saw_lock.lock().unwrap().is_empty(), "the service ran");
}

/// The body digest hands the handler the exact bytes and keys by their SHA-256; a body over
/// the limit (declared or streamed) is answered 413 without calling the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_digest_hands_on_the_body_and_rejects_oversized_ones() {
    use sha2::{Digest, Sha256};
    const LIMIT: usize = 4096;

    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = ServiceBuilder::new()
        .layer(DistributedLockLayer::new(locker, key::body_digest(LIMIT)).ttl(TTL))
        .service(service_fn({
            let calls = calls.clone();
            move |req: Request<Body>| {
                calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    let info = req.extensions().get::<LockInfo>().cloned().unwrap();
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let mut res = Response::new(Body::from(body));
                    res.headers_mut()
                        .insert("x-lock-key", info.key().parse().unwrap());
                    Ok::<_, Infallible>(res)
                }
            }
        }));

    let upload = |body: Body| {
        let req = Request::post("/upload").body(body).unwrap();
        svc.clone().oneshot(req)
    };

    // Every byte value, not UTF-8, exactly at the limit; then the same bytes streamed in chunks
    // without a declared size: same bytes, same key.
    let payload: Vec<u8> = (0..LIMIT).map(|i| (i * 7 % 256) as u8).collect();
    let digest: String = Sha256::digest(&payload)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let chunks: Vec<Bytes> = payload.chunks(1000).map(Bytes::copy_from_slice).collect();
    for body in [Body::from(payload.clone()), Body::new(Chunked(chunks))] {
        let res = upload(body).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let lock_key = format!("body:sha256:{digest}");
        assert_eq!(res.headers()["x-lock-key"], lock_key.as_str());
        assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), payload);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // One byte over: declared size, then streamed.
    let res = upload(Body::from(vec![b'x'; LIMIT + 1])).await.unwrap();
    assert_problem(&res, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(text(res).await.contains("urn:dlock:problem:body-too-large"));

    let chunks = vec![Bytes::from(vec![b'x'; LIMIT]), Bytes::from_static(b"x")];
    let res = upload(Body::new(Chunked(chunks))).await.unwrap();
    assert_problem(&res, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// An axum handler reads the lock's key and fencing token from the request extensions; the
/// key is the authenticated user (put in the extensions by an earlier layer) plus the route.
#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_reads_lock_info_from_extensions() {
    use axum::extract::Extension;
    use dlock_tests::http::{user_from_header, UserId};

    let redis = RedisServer::start();
    let locker = redis.locker().await;

    async fn handler(Extension(lock): Extension<LockInfo>) -> String {
        // The same lock is visible through the task-local context.
        let same = dlock_runtime::current_lock().as_ref() == Some(&lock);
        format!("{} {} {same}", lock.key(), lock.fencing_token())
    }

    let user_and_route = key::extension::<UserId>()
        .label("user")
        .and(key::matched_path());
    let app = Router::new()
        .route("/users/{id}/orders", post(handler))
        .route_layer(DistributedLockLayer::new(locker.clone(), user_and_route).ttl(TTL))
        // The "auth layer": runs first and places the identity in the extensions.
        .layer(tower::util::MapRequestLayer::new(user_from_header::<Body>));

    let call = |user: &str| bare(Method::POST, "/users/42/orders", &[("x-user", user)]);
    let res = app.clone().oneshot(call("7")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body = text(res).await;
    let mut parts = body.split(' ');
    let (key, token, same) = (parts.next().unwrap(), parts.next().unwrap(), parts.next());
    // The route template's braces are percent-encoded by the runtime's key encoding.
    assert_eq!(key, "ext:user:7:route:POST:/users/%7Bid%7D/orders");
    assert_eq!(same, Some("true"), "current_lock() inside the handler");
    let first: u64 = token.parse().unwrap();

    let res = app.clone().oneshot(call("7")).await.unwrap();
    let second: u64 = text(res).await.split(' ').nth(1).unwrap().parse().unwrap();
    assert!(second > first);

    // No identity: 400, the handler is not called.
    let res = app
        .clone()
        .oneshot(bare(Method::POST, "/users/42/orders", &[]))
        .await
        .unwrap();
    assert_problem(&res, StatusCode::BAD_REQUEST);
    assert!(text(res).await.contains("lock-key-missing"));
}

/// An inner service that answers whether its `call` — the synchronous part, before its
/// future is polled, where a plain tower service reads request state — saw the request's lock
/// through `current_lock()` (the same lock as the `LockInfo` in the extensions).
#[allow(clippy::type_complexity)]
fn call_sees_the_lock() -> ServiceFn<
    impl Fn(Request<Body>) -> std::future::Ready<Result<Response<Body>, Infallible>> + Clone,
> {
    service_fn(|req: Request<Body>| {
        let seen = dlock_runtime::current_lock();
        let given = req.extensions().get::<LockInfo>().cloned();
        let same = seen.is_some() && seen == given;
        std::future::ready(Ok(Response::new(Body::from(same.to_string()))))
    })
}

/// A service's `call` sees the lock through `current_lock()` under the lock layer and the
/// defer layer, not only the future it returns: the call ran outside the lock's scope, and a
/// `service_fn` reading `current_lock()` before its `async` block found none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_services_call_sees_the_lock_before_its_future_runs() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let lock = ServiceBuilder::new()
        .layer(DistributedLockLayer::new(locker.clone(), key::header("idempotency-key")).ttl(TTL))
        .service(call_sees_the_lock());
    let res = lock.oneshot(idem("sync-call")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(text(res).await, "true", "the lock layer");
    #[cfg(feature = "defer")]
    {
        let (_redis, locker, queue) = dlock_tests::jobs::start_queue("sync-call").await;
        let deferred = ServiceBuilder::new()
            .layer(defer_layer(&locker, queue))
            .service(call_sees_the_lock());
        let res = deferred.oneshot(idem("sync-call")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(text(res).await, "true", "the defer layer");
    }
}

/// axum path parameters as keys; the same key on two routes excludes across them.
#[cfg(feature = "axum")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_path_params_key_across_routes() {
    use axum::extract::Extension;

    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let (open, gate_rx) = gate();
    let (entered_tx, mut entered_rx) = mpsc::unbounded_channel::<()>();

    let pay = move |Extension(lock): Extension<LockInfo>| {
        let gate_rx = gate_rx.clone();
        let entered_tx = entered_tx.clone();
        async move {
            entered_tx.send(()).unwrap();
            wait_open(gate_rx).await;
            lock.key().to_owned()
        }
    };
    let cancel = |Extension(lock): Extension<LockInfo>| async move { lock.key().to_owned() };
    let app = Router::new()
        .route("/orders/{id}/pay", post(pay))
        .route("/orders/{id}/cancel", post(cancel))
        .route(
            "/all/{a}/{b}",
            get(|Extension(lock): Extension<LockInfo>| async move { lock.key().to_owned() }),
        )
        .route_layer(
            DistributedLockLayer::new(locker, key::path_param("id").or(key::path_params()))
                .ttl(TTL),
        );

    let req = |path: &str| bare(Method::POST, path, &[]);
    let paying = tokio::spawn(app.clone().oneshot(req("/orders/a:b/pay")));
    entered_rx.recv().await.unwrap();

    // Same order, other route: held.
    let res = app
        .clone()
        .oneshot(req("/orders/a:b/cancel"))
        .await
        .unwrap();
    assert_problem(&res, StatusCode::CONFLICT);
    // Another order: free. The `:` in the value is encoded, so it cannot pose as a separator.
    let res = app.clone().oneshot(req("/orders/a/cancel")).await.unwrap();
    assert_eq!(text(res).await, "param:id:a");

    open.send(true).unwrap();
    let res = paying.await.unwrap().unwrap();
    assert_eq!(text(res).await, "param:id:a%3Ab");

    let res = app
        .clone()
        .oneshot(bare(Method::GET, "/all/x%20y/z", &[]))
        .await
        .unwrap();
    assert_eq!(text(res).await, "params:a:x%20y:b:z");
}

/// A query parameter keys its value as the handler's form decoding reads it: over HTTP,
/// `?account=7`, `?account=%37`, `?acc%6Funt=7` and `?x=1&account=7` are one account and one
/// lock (a closure over the raw query, the example the docs gave, made them four locks, and
/// let four requests for one account in at once); `?account=7&account=8` is refused, and
/// another account is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_parameter_keys_its_decoded_value_over_http() {
    use axum::extract::Extension;

    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let (open, gate_rx) = gate();
    let (entered_tx, mut entered_rx) = mpsc::unbounded_channel::<()>();
    let pay = move |Extension(lock): Extension<LockInfo>| {
        let (gate_rx, entered_tx) = (gate_rx.clone(), entered_tx.clone());
        async move {
            entered_tx.send(()).unwrap();
            wait_open(gate_rx).await;
            lock.key().to_owned()
        }
    };
    let app = Router::new()
        .route("/pay", post(pay))
        .route_layer(DistributedLockLayer::new(locker, key::query("account")).ttl(TTL));
    let (addr, server) = serve(app).await;
    let client = client();
    let send = |query: &str| {
        let req = Request::post(format!("http://{addr}/pay?{query}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let client = client.clone();
        async move {
            tokio::time::timeout(HANG, client.request(req))
                .await
                .expect("an answer while the first request holds its lock")
                .expect("http request")
        }
    };
    let paying = tokio::spawn(send("account=7"));
    tokio::time::timeout(HANG, entered_rx.recv())
        .await
        .expect("the first request in the handler");
    for same in ["account=%37", "acc%6Funt=7", "x=1&account=7"] {
        let res = send(same).await;
        assert_problem(&res, StatusCode::CONFLICT);
    }
    let res = send("account=7&account=8").await;
    assert_problem(&res, StatusCode::BAD_REQUEST);
    open.send(true).unwrap();
    let res = send("account=8").await;
    assert_eq!(text(res).await, "query:account:8");
    let res = paying.await.unwrap();
    assert_eq!(text(res).await, "query:account:7");
    server.abort();
}

/// `method_path` keys by the path the client sent: inside axum's `nest` the whole path (the
/// nested router sees only its rest, so every tenant's `/orders` shared one lock), with escaped
/// escapes written one way (`/tenants/%61%40b` reaches tenant `a@b`'s handler, so it must take
/// tenant `a@b`'s lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_path_keys_the_path_as_sent_inside_a_nest_and_undoes_needless_escapes() {
    use axum::extract::Extension;

    let (open, gate_rx) = gate();
    let (entered_tx, mut entered_rx) = mpsc::unbounded_channel::<()>();
    let orders = move |Extension(lock): Extension<LockInfo>, headers: http::HeaderMap| {
        let (gate_rx, entered_tx) = (gate_rx.clone(), entered_tx.clone());
        async move {
            pause_if_asked(&headers, gate_rx, &entered_tx).await;
            lock.key().to_owned()
        }
    };
    let tenant = Router::new()
        .route("/orders", post(orders))
        .route_layer(DistributedLockLayer::new(Locker::memory(), key::method_path()).ttl(TTL));
    let app = Router::new().nest("/tenants/{t}", tenant);

    let req = |path: &str| bare(Method::POST, path, &[]);
    // Tenant `a@中`, sent raw (a `Uri` takes UTF-8 in its path, and so does hyper).
    let waiting = bare(Method::POST, "/tenants/a@中/orders", &[("x-wait", "1")]);
    let first = tokio::spawn(app.clone().oneshot(waiting));
    tokio::time::timeout(HANG, entered_rx.recv())
        .await
        .expect("the first request entered the handler")
        .unwrap();

    // Another tenant: its own lock.
    let res = app.clone().oneshot(req("/tenants/b/orders")).await.unwrap();
    assert_eq!(text(res).await, "path:POST:/tenants/b/orders");
    // Tenant `a@中` spelled with escapes: the router hands the handler the same tenant, so
    // the same (held) lock.
    for spelling in [
        "/tenants/%61@中/orders",
        "/tenants/a%40中/orders",
        "/tenants/a@%E4%B8%AD/orders",
        "/tenants/%61%40%e4%b8%ad/orders",
    ] {
        let res = app.clone().oneshot(req(spelling)).await.unwrap();
        assert_problem(&res, StatusCode::CONFLICT);
    }
    // An escaped `/` is part of the tenant, not a separator: another tenant.
    let res = app
        .clone()
        .oneshot(req("/tenants/a%2F@中/orders"))
        .await
        .unwrap();
    // (The lock key escapes `%` in the values it is built from.)
    assert_eq!(
        text(res).await,
        "path:POST:/tenants/a%252F@%25E4%25B8%25AD/orders"
    );

    open.send(true).unwrap();
    let res = first.await.unwrap().unwrap();
    assert_eq!(
        text(res).await,
        "path:POST:/tenants/a@%25E4%25B8%25AD/orders"
    );
}

/// A `HEAD` takes the lock of the `GET` it is answered by: axum's `get` serves both with one
/// handler, so with `matched_path` or `method_path` keys a `HEAD` while a `GET` of the same
/// resource runs is refused. Keyed by its own method, it ran the locked handler alongside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_request_takes_the_lock_of_the_get_that_answers_it() {
    let (open, gate_rx) = gate();
    let (entered_tx, mut entered_rx) = mpsc::unbounded_channel::<()>();
    let report = move |headers: http::HeaderMap| {
        let (gate_rx, entered_tx) = (gate_rx.clone(), entered_tx.clone());
        async move {
            pause_if_asked(&headers, gate_rx, &entered_tx).await;
            "built"
        }
    };
    for (name, app) in [
        (
            "matched_path",
            Router::new()
                .route("/reports/{month}", get(report.clone()))
                .route_layer(
                    DistributedLockLayer::new(Locker::memory(), key::matched_path()).ttl(TTL),
                ),
        ),
        (
            "method_path",
            Router::new()
                .route("/reports/{month}", get(report.clone()))
                .route_layer(
                    DistributedLockLayer::new(Locker::memory(), key::method_path()).ttl(TTL),
                ),
        ),
    ] {
        open.send(false).unwrap();
        let waiting = bare(Method::GET, "/reports/2026-11", &[("x-wait", "1")]);
        let first = tokio::spawn(app.clone().oneshot(waiting));
        tokio::time::timeout(HANG, entered_rx.recv())
            .await
            .expect("the GET entered the handler")
            .unwrap();
        let head = async || {
            let req = bare(Method::HEAD, "/reports/2026-11", &[]);
            app.clone().oneshot(req).await.unwrap().status()
        };
        assert_eq!(
            head().await,
            StatusCode::CONFLICT,
            "{name}: a HEAD ran alongside"
        );
        open.send(true).unwrap();
        let res = first.await.unwrap().unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{name}");
        assert_eq!(
            head().await,
            StatusCode::OK,
            "{name}: a HEAD once the lock is free"
        );
    }
}

/// Missing, repeated, oversized and forged keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_and_invalid_keys() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let inner = service_fn(|req: Request<Body>| async move {
        let key = req
            .extensions()
            .get::<LockInfo>()
            .map(|l| l.key().to_owned())
            .unwrap_or_else(|| "no lock".to_owned());
        Ok::<_, Infallible>(Response::new(Body::from(key)))
    });
    let layer = DistributedLockLayer::new(locker, key::header("Idempotency-Key")).ttl(TTL);
    let reject = ServiceBuilder::new().layer(layer.clone()).service(inner);
    let pass = ServiceBuilder::new()
        .layer(layer.missing_key(MissingKey::PassThrough))
        .service(inner);

    let no_key = || bare(Method::POST, "/work", &[]);
    let res = reject.clone().oneshot(no_key()).await.unwrap();
    assert_problem(&res, StatusCode::BAD_REQUEST);
    assert!(text(res)
        .await
        .contains("urn:dlock:problem:lock-key-missing"));
    let res = pass.clone().oneshot(no_key()).await.unwrap();
    assert_eq!(text(res).await, "no lock");

    // Oversized value: the runtime's InvalidKey, 400, in both modes.
    let huge = "k".repeat(10_000);
    for svc in [&reject, &pass] {
        let res = svc.clone().oneshot(idem(&huge)).await.unwrap();
        assert_problem(&res, StatusCode::BAD_REQUEST);
        assert!(text(res)
            .await
            .contains("urn:dlock:problem:lock-invalid-key"));
    }

    // The header twice: ambiguous, 400.
    let twice = bare(
        Method::POST,
        "/work",
        &[("idempotency-key", "a"), ("idempotency-key", "b")],
    );
    let res = reject.clone().oneshot(twice).await.unwrap();
    assert_problem(&res, StatusCode::BAD_REQUEST);

    // Separators and braces in the value are encoded, so they cannot forge another key.
    let res = reject.clone().oneshot(idem("a:b {c}")).await.unwrap();
    assert_eq!(text(res).await, "hdr:idempotency-key:a%3Ab%20%7Bc%7D");
}

/// A closure extractor (the blanket impl) can reject with its own response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closure_extractor_can_key_and_reject() {
    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let extractor = |req: Request<Body>| async move {
        let tenant = req
            .headers()
            .get("x-tenant")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        match tenant {
            None => Ok((req, None)),
            Some(t) if t.parse::<u32>().is_ok() => {
                Ok((req, Some(Key::new("tenant").value(t.as_str()))))
            }
            Some(_) => Err(dlock_tower::Rejection::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "bad-tenant",
                "x-tenant must be a number",
            )),
        }
    };
    let svc = ServiceBuilder::new()
        .layer(DistributedLockLayer::new(locker, extractor).ttl(TTL))
        .service(service_fn(|req: Request<Body>| async move {
            let key = req.extensions().get::<LockInfo>().unwrap().key().to_owned();
            Ok::<_, Infallible>(Response::new(Body::from(key)))
        }));
    let tenant = |t: &str| bare(Method::GET, "/", &[("x-tenant", t)]);
    let res = svc.clone().oneshot(tenant("12")).await.unwrap();
    assert_eq!(text(res).await, "tenant:12");
    let res = svc.clone().oneshot(tenant("x")).await.unwrap();
    assert_problem(&res, StatusCode::UNPROCESSABLE_ENTITY);
}

/// The layer composes with axum's `Router::layer` and `route_layer`, and with a plain
/// `tower::ServiceBuilder` over a hyper server (`Request<Incoming>` in, `Full<Bytes>` out),
/// served for real and called with the hyper-util client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn composes_with_axum_and_plain_hyper() {
    use hyper::body::Incoming;
    use hyper_util::service::TowerToHyperService;

    let redis = RedisServer::start();
    let locker = redis.locker().await;
    let layer = DistributedLockLayer::new(locker, key::method_path()).ttl(TTL);

    // axum, both ways.
    let with_layer: Router = Router::new()
        .route("/a", get(|| async { "a" }))
        .layer(layer.clone());
    let with_route_layer: Router = Router::new()
        .route("/b", get(|| async { "b" }))
        .route_layer(layer.clone());
    let res = with_layer
        .oneshot(bare(Method::GET, "/a", &[]))
        .await
        .unwrap();
    assert_eq!(text(res).await, "a");
    let res = with_route_layer
        .clone()
        .oneshot(bare(Method::GET, "/b", &[]));
    assert_eq!(text(res.await.unwrap()).await, "b");
    // route_layer leaves unmatched requests alone: still a 404.
    let res = with_route_layer
        .oneshot(bare(Method::GET, "/nope", &[]))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::NOT_FOUND);

    // Plain hyper + tower.
    let svc = ServiceBuilder::new().layer(layer).service(service_fn(
        |req: Request<Incoming>| async move {
            let lock = req.extensions().get::<LockInfo>().unwrap().key().to_owned();
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(lock))))
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let svc = TowerToHyperService::new(svc.clone());
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    let client = client();
    let res = client
        .request(
            Request::get(format!("http://{addr}/plain/hyper"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(text(res).await, "path:GET:/plain/hyper");
    server.abort();
}

/// The defer path: a busy lock answers 202 with a job id and a status location; the request
/// goes to the durable queue and is replayed through the app when the lock frees; the status
/// lookup reports the replayed response's status.
#[cfg(feature = "defer")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defer_layer_answers_202_and_replays_the_request_when_the_lock_frees() {
    use axum::extract::{Extension, Path};
    use dlock_tests::jobs::{run_in_background, start_queue};
    use dlock_tests::wait::poll_until;
    use dlock_tower::defer::{replay_worker, status_response};

    let (_redis, locker, queue) = start_queue("http-defer").await;
    let (seen_tx, mut seen_rx) = mpsc::unbounded_channel::<(String, u64)>();

    // The application, without the defer layer: this is what the worker replays through.
    let app = Router::new().route(
        "/orders",
        post(move |Extension(lock): Extension<LockInfo>, body: String| {
            let seen = seen_tx.clone();
            async move {
                seen.send((body, lock.fencing_token())).unwrap();
                (StatusCode::CREATED, "created")
            }
        }),
    );
    let q = queue.clone();
    let served = Router::new()
        .route(
            "/jobs/{id}",
            get(move |Path(id): Path<String>| {
                let q = q.clone();
                async move { status_response::<Body>(&q, &id).await }
            }),
        )
        .merge(
            app.clone()
                .layer(defer_layer(&locker, queue.clone()).status_path("/jobs")),
        );
    let (addr, _server) = serve(served).await;
    let client = client();
    let send = |req: http::request::Builder, body: &'static [u8]| {
        let req = req.body(Full::new(Bytes::from_static(body))).unwrap();
        client.request(req)
    };
    let get_status = async |path: &str| {
        let res = send(Request::get(format!("http://{addr}{path}")), b"");
        text(res.await.unwrap()).await
    };
    let order = |key| Request::post(format!("http://{addr}/orders")).header("idempotency-key", key);

    // Someone holds the request's lock.
    let held = hold(&locker, "k1").await;
    let res = send(order("k1"), b"order #1 payload").await.unwrap();
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    let location = res.headers()["location"].to_str().unwrap().to_owned();
    assert!(location.starts_with("/jobs/"), "{location}");
    let body = text(res).await;
    let job_id = location.trim_start_matches("/jobs/").to_owned();
    assert!(body.contains(&format!("\"job_id\":\"{job_id}\"")), "{body}");
    assert!(get_status(&location).await.contains("\"state\":\"queued\""));
    assert!(
        seen_rx.try_recv().is_err(),
        "the handler must not run while the lock is busy"
    );

    // A worker on this instance replays deferred requests through the app.
    let worker = replay_worker::<_, Body, _>(queue.clone(), locker.clone(), app.clone())
        .poll_interval(Duration::from_millis(10));
    let w = run_in_background(worker);
    let holder_token = held.fencing_token();
    held.release().await.unwrap();
    let (body, token) = tokio::time::timeout(Duration::from_secs(10), seen_rx.recv())
        .await
        .expect("replayed")
        .unwrap();
    assert_eq!(body, "order #1 payload", "the exact body is replayed");
    assert!(
        token > holder_token,
        "the replay holds the lock with a newer token"
    );

    let status = poll_until(Duration::from_secs(5), Duration::ZERO, async || {
        let status = get_status(&location).await;
        match status.contains("\"state\":\"completed\"") {
            true => Ok(status),
            false => Err(status),
        }
    })
    .await;
    assert!(status.contains("\"result\":\"201\""), "{status}");
    assert!(get_status("/jobs/0123abcd").await.contains("job-unknown"));

    // A free lock runs the request at once.
    let res = send(order("k2"), b"order #2").await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    w.stop().await;
}

/// A `DeferLayer` inside axum's `nest` stores the path the client sent, so the replay through
/// the whole application reaches the handler (it stored the nested router's rest, `/orders`,
/// which the application answers 404: recorded as the job's result, the work lost).
#[cfg(feature = "defer")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defer_layer_inside_a_nest_replays_to_the_path_the_client_sent() {
    use axum::extract::Extension;
    use dlock_tests::jobs::{run_in_background, start_queue};
    use dlock_tests::wait::poll_until;
    use dlock_tower::defer::replay_worker;

    let (_redis, locker, queue) = start_queue("nested-defer").await;
    let (seen_tx, mut seen_rx) = mpsc::unbounded_channel::<String>();
    let shop = |deferring: bool| {
        let seen = seen_tx.clone();
        let routes = Router::new().route(
            "/orders",
            post(move |Extension(_): Extension<LockInfo>, body: String| {
                let seen = seen.clone();
                async move {
                    seen.send(body).unwrap();
                    (StatusCode::CREATED, "created")
                }
            }),
        );
        let routes = match deferring {
            true => routes.route_layer(defer_layer(&locker, queue.clone())),
            false => routes,
        };
        Router::new().nest("/shop", routes)
    };
    let (addr, _server) = serve(shop(true)).await;

    let held = hold(&locker, "n1").await;
    let req = Request::post(format!("http://{addr}/shop/orders"))
        .header("idempotency-key", "n1")
        .body(Full::new(Bytes::from_static(b"nested order")))
        .unwrap();
    let res = client().request(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    let location = res.headers()["location"].to_str().unwrap().to_owned();
    let job_id = location.rsplit('/').next().unwrap().to_owned();

    // The worker replays through the whole application, without the defer layer.
    let worker = replay_worker::<_, Body, _>(queue.clone(), locker.clone(), shop(false))
        .poll_interval(Duration::from_millis(10));
    let w = run_in_background(worker);
    held.release().await.unwrap();
    let body = tokio::time::timeout(Duration::from_secs(10), seen_rx.recv())
        .await
        .expect("the replay reached the handler")
        .unwrap();
    assert_eq!(body, "nested order");
    let status = poll_until(Duration::from_secs(5), Duration::ZERO, async || match queue
        .status(&job_id)
        .await
        .unwrap()
    {
        dlock_runtime::durable::JobStatus::Completed { result } => Ok(result),
        other => Err(format!("{other:?}")),
    })
    .await;
    assert_eq!(status.as_deref(), Some("201"));
    w.stop().await;
}

/// Deferred requests are stored without credentials unless opted in by name; a full queue
/// answers 503 + `Retry-After` and keeps what it holds, a request over its bound for one job
/// 413 without storing it; a stored request that cannot be
/// rebuilt is dead-lettered at once with the reason.
#[cfg(feature = "defer")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defer_layer_keeps_credentials_out_bounds_the_queue_and_dead_letters_corrupt_jobs() {
    use dlock_runtime::defer::{DeferPolicy, QueueLimits};
    use dlock_runtime::durable::{DurableQueue, Job, JobContext, JobError};
    use dlock_tests::jobs::{run_in_background, start_queue};
    use dlock_tower::defer::replay_worker;
    use http::header::{HeaderMap, AUTHORIZATION, COOKIE};

    let (redis, locker, queue) = start_queue("http-bounded").await;
    let queue = queue.with_limits(QueueLimits::default().max_queued(1));
    let (seen_tx, mut seen_rx) = mpsc::unbounded_channel::<HeaderMap>();
    let app = Router::new().route(
        "/orders",
        post(move |headers: HeaderMap| {
            let seen = seen_tx.clone();
            async move {
                seen.send(headers).unwrap();
                StatusCode::CREATED
            }
        }),
    );
    let layer = || defer_layer(&locker, queue.clone());
    // Two stacks over one queue: the default, and one that opts `Authorization` in.
    // And one whose queue takes jobs of at most 4 KiB: a 3,000-byte body, 6,000 stored.
    let small_jobs = queue
        .clone()
        .with_limits(QueueLimits::default().max_queued(1).max_job_bytes(4096));
    let served = Router::new()
        .merge(app.clone().layer(layer()))
        .route(
            "/opted-in",
            post(|| async { StatusCode::CREATED }).layer(layer().store_header(AUTHORIZATION)),
        )
        .route(
            "/small-jobs",
            post(|| async { StatusCode::CREATED }).layer(defer_layer(&locker, small_jobs)),
        );
    let (addr, _server) = serve(served).await;
    let client = client();
    let send = |path: &'static str, key: &'static str| {
        let client = client.clone();
        async move {
            client
                .request(
                    Request::post(format!("http://{addr}{path}"))
                        .header("idempotency-key", key)
                        .header(AUTHORIZATION, "Bearer s3cret-token")
                        .header(COOKIE, "session=s3cret-cookie")
                        .header("x-api-key", "s3cret-key")
                        .header("x-trace", "t1")
                        .body(Full::default())
                        .unwrap(),
                )
                .await
                .unwrap()
        }
    };
    let stored_payloads = || async {
        let jobs: std::collections::HashMap<String, String> = redis
            .query(redis::cmd("HGETALL").arg("dlock:{jobs:http-bounded}:jobs"))
            .await;
        jobs.into_values().collect::<Vec<_>>().join("\n")
    };
    let hex = |s: &str| s.bytes().map(|b| format!("{b:02x}")).collect::<String>();

    let held = hold(&locker, "k1").await;
    let res = send("/orders", "k1").await;
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    let stored = stored_payloads().await;
    assert!(stored.contains(&hex("t1")), "ordinary headers are stored");
    assert!(
        !stored.contains(&hex("s3cret")),
        "credentials stored: {stored}"
    );

    // The queue holds one job: the next busy request is refused, and nothing is dropped.
    let _held2 = hold(&locker, "k2").await;
    let res = send("/orders", "k2").await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()[RETRY_AFTER], "1");
    assert_eq!(res.headers()[CONTENT_TYPE], PROBLEM_JSON);
    assert!(text(res)
        .await
        .contains("urn:dlock:problem:defer-queue-full"));
    assert_eq!(queue.len().await.unwrap(), 1);

    // A request over the queue's bound for one job (under the layer's body limit) gets 413,
    // before the full queue is asked, and nothing is stored.
    let _held_big = hold(&locker, "k-big").await;
    let res = client
        .request(
            Request::post(format!("http://{addr}/small-jobs"))
                .header("idempotency-key", "k-big")
                .body(Full::from(vec![b'a'; 3000]))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert!(res.headers().get(RETRY_AFTER).is_none());
    assert_eq!(res.headers()[CONTENT_TYPE], PROBLEM_JSON);
    assert!(text(res)
        .await
        .contains("urn:dlock:problem:defer-job-too-large"));
    assert_eq!(queue.len().await.unwrap(), 1);
    assert!(!stored_payloads().await.contains(&"61".repeat(3000)));

    // The replay runs without the credentials it was not allowed to keep.
    let worker = replay_worker::<_, Body, _>(queue.clone(), locker.clone(), app.clone())
        .poll_interval(Duration::from_millis(10));
    let w = run_in_background(worker);
    held.release().await.unwrap();
    let headers = tokio::time::timeout(HANG, seen_rx.recv())
        .await
        .expect("replayed")
        .unwrap();
    assert_eq!(headers["x-trace"], "t1");
    assert!(headers.get(AUTHORIZATION).is_none() && headers.get(COOKIE).is_none());
    w.stop().await;

    // Opted in by name: that header (and only that one) is stored.
    let _held3 = hold(&locker, "k3").await;
    assert_eq!(send("/opted-in", "k3").await.status(), StatusCode::ACCEPTED);
    let stored = stored_payloads().await;
    assert!(stored.contains(&hex("Bearer s3cret-token")));
    assert!(!stored.contains(&hex("session=s3cret-cookie")));

    // A stored request whose hex is corrupt (a multi-byte character across a digit pair):
    // dead-lettered on its first claim, with the reason, and the worker lives on.
    #[derive(serde::Serialize, serde::Deserialize)]
    struct CorruptReplay {
        key: String,
        method: String,
        uri: String,
        headers: Vec<(String, String)>,
        body: String,
    }
    impl Job for CorruptReplay {
        const NAME: &'static str = "dlock-tower.replay";
        fn lock_key(&self) -> Result<dlock_runtime::LockKey, dlock_runtime::LockError> {
            dlock_runtime::LockKey::from_encoded(&self.key)
        }
        async fn run(self, _: JobContext) -> Result<(), JobError> {
            unreachable!("the worker decodes it as a ReplayRequest")
        }
    }
    let corrupt_queue = DurableQueue::connect(&redis.url(), "http-corrupt")
        .await
        .unwrap();
    let id = corrupt_queue
        .enqueue(
            &CorruptReplay {
                key: "hdr:idempotency-key:k9".into(),
                method: "POST".into(),
                uri: "/orders".into(),
                headers: vec![],
                body: "aéb".into(),
            },
            &DeferPolicy::new(Duration::from_millis(5), 5),
            TTL,
            Duration::ZERO,
        )
        .await
        .unwrap();
    let worker = replay_worker::<_, Body, _>(corrupt_queue.clone(), locker.clone(), app);
    assert_eq!(worker.run_once().await.unwrap(), 1);
    let dead = corrupt_queue.dead_letters().await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, id);
    assert_eq!(dead[0].attempts, 1);
    let reason = dead[0].reason.as_deref().unwrap_or_default();
    assert!(reason.contains("body does not decode"), "{reason}");
}

/// `DeferLayer` has the other layers' missing-key and fail-mode setters and defaults: 400 for
/// no key unless `MissingKey::PassThrough`, 503 with the backend down unless `FailMode::Open`.
#[cfg(feature = "defer")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defer_layer_missing_key_and_backend_down_like_the_other_layers() {
    use dlock_runtime::durable::DurableQueue;
    use dlock_tower::DeferLayer;

    let mut lock_redis = RedisServer::start();
    let queue_redis = RedisServer::start();
    let locker = fast_fail_locker(&lock_redis).await;
    let queue = DurableQueue::connect(&queue_redis.url(), "defer-modes")
        .await
        .unwrap();
    let saw_lock = Arc::new(Mutex::new(Vec::new()));
    let inner = served_recording_locks(&saw_lock);
    let layer = DeferLayer::new(locker, key::header("idempotency-key"), queue).ttl(TTL);
    let strict = ServiceBuilder::new()
        .layer(layer.clone())
        .service(inner.clone());
    let lenient = ServiceBuilder::new()
        .layer(
            layer
                .missing_key(MissingKey::PassThrough)
                .fail_mode(FailMode::Open),
        )
        .service(inner);
    let no_key = || bare(Method::POST, "/work", &[]);

    let res = strict.clone().oneshot(no_key()).await.unwrap();
    assert_problem(&res, StatusCode::BAD_REQUEST);
    assert!(text(res).await.contains("lock-key-missing"));
    let res = lenient.clone().oneshot(no_key()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        *saw_lock.lock().unwrap(),
        [false],
        "passed through without a lock"
    );
    assert_eq!(
        strict.clone().oneshot(idem("up")).await.unwrap().status(),
        200
    );
    assert_eq!(saw_lock.lock().unwrap().pop(), Some(true));
    saw_lock.lock().unwrap().clear();

    lock_redis.stop();
    let res = strict.oneshot(idem("down")).await.unwrap();
    assert_problem(&res, StatusCode::SERVICE_UNAVAILABLE);
    assert!(retry_after(&res) >= 1);
    let res = lenient.oneshot(idem("down")).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(text(res).await, "served");
    assert_eq!(
        *saw_lock.lock().unwrap(),
        [false],
        "fail-open ran without a lock"
    );
}

/// `cancel_on_lost(true)` over real HTTP: the request's lock is taken away behind the holder's
/// back (its key deleted in Redis), the watchdog's next renewal is refused, the handler's
/// future is dropped mid-await (its drop guard reports it) and the client gets 503
/// `lock-lost`; the handler never reaches its side effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_on_lost_stops_the_handler_and_answers_503() {
    use dlock_runtime::LockKey;

    struct Dropped(Option<mpsc::UnboundedSender<()>>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            if let Some(tx) = self.0.take() {
                let _ = tx.send(());
            }
        }
    }

    let server = RedisServer::start();
    let locker = Locker::from_url(&server.url()).await.unwrap();
    let (entered_tx, mut entered_rx) = mpsc::unbounded_channel::<()>();
    let (dropped_tx, mut dropped_rx) = mpsc::unbounded_channel::<()>();
    let side_effects = Arc::new(AtomicUsize::new(0));
    let (never_tx, never_rx) = watch::channel(false);
    let effects = side_effects.clone();
    let app = Router::new()
        .route(
            "/work",
            post(move || {
                let (entered, dropped, effects) =
                    (entered_tx.clone(), dropped_tx.clone(), effects.clone());
                let gate = never_rx.clone();
                async move {
                    let _guard = Dropped(Some(dropped));
                    entered.send(()).unwrap();
                    wait_open(gate).await; // only a cancellation ends this
                    effects.fetch_add(1, Ordering::SeqCst);
                    "done"
                }
            }),
        )
        .layer(
            DistributedLockLayer::new(locker.clone(), key::header("idempotency-key"))
                .ttl(Duration::from_millis(300))
                .cancel_on_lost(true),
        );
    let (addr, _serving) = serve(app).await;
    let client = client();
    let request = client.request(
        Request::post(format!("http://{addr}/work"))
            .header("idempotency-key", "job-1")
            .body(Full::new(Bytes::new()))
            .unwrap(),
    );
    let response = tokio::spawn(request);
    entered_rx.recv().await.expect("handler entered");
    let resource = locker.resource(LockKey::new("hdr:idempotency-key:job-1").unwrap());
    let deleted: i64 = server
        .query(::redis::cmd("DEL").arg(resource.as_str()))
        .await;
    assert_eq!(deleted, 1, "the request's lock key");

    let res = tokio::time::timeout(HANG, response)
        .await
        .expect("answered")
        .unwrap()
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(text(res).await.contains("lock-lost"));
    tokio::time::timeout(HANG, dropped_rx.recv())
        .await
        .expect("the handler's future was dropped");
    drop(never_tx);
    assert_eq!(side_effects.load(Ordering::SeqCst), 0);
}

/// `message` and `rejection` over real HTTP: a busy key answers through the closure, with the
/// message as the error's detail; without `rejection` the default problem+json carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_rejection_and_message() {
    let server = RedisServer::start();
    let locker = Locker::from_url(&server.url()).await.unwrap();
    let handler = post(|| async { "served" });
    let custom = Router::new().route("/custom", handler.clone()).layer(
        DistributedLockLayer::new(locker.clone(), key::header("idempotency-key"))
            .message("this order is being submitted")
            .rejection(|err: &dlock_runtime::LockError| {
                Response::builder()
                    .status(429)
                    .header("x-lock-status", err.status())
                    .body(format!("custom: {}", err.problem_json()))
                    .unwrap()
            }),
    );
    let plain = Router::new().route("/plain", handler).layer(
        DistributedLockLayer::new(locker.clone(), key::header("idempotency-key"))
            .message("this order is being submitted"),
    );
    let (addr, _serving) = serve(custom.merge(plain)).await;
    let client = client();
    let send = |path: &str| {
        client.request(
            Request::post(format!("http://{addr}{path}"))
                .header("idempotency-key", "k9")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
    };
    let held = hold(&locker, "k9").await;
    let res = send("/custom").await.unwrap();
    assert_eq!(res.status().as_u16(), 429);
    assert_eq!(res.headers()["x-lock-status"], "409");
    let body = text(res).await;
    assert!(body.starts_with("custom: "), "{body}");
    assert!(body.contains("this order is being submitted"), "{body}");
    let res = send("/plain").await.unwrap();
    assert_eq!(res.status(), StatusCode::CONFLICT);
    assert_eq!(res.headers()[CONTENT_TYPE], PROBLEM_JSON);
    assert!(text(res).await.contains("this order is being submitted"));
    held.release().await.unwrap();
    let res = send("/custom").await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

/// The body limits: a body the `DeferLayer` would store over its `body_limit` is `413`,
/// declared or streamed, and so is one a limit outside the layer cuts off (tower-http's
/// `RequestBodyLimitLayer` wraps bodies of unknown length in `Limited`) — never `400`; a body
/// within both is deferred (`202`). The body digest key answers a cut-off body `413` too.
#[cfg(feature = "defer")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_a_limit_inside_or_outside_are_413() {
    use dlock_tests::jobs::start_queue;

    let (_redis, locker, queue) = start_queue("http-defer-limits").await;
    let _held = hold(&locker, "k1").await;
    // A body limit of 32 bytes outside, on requests that ask for it.
    let outer = |req: Request<Body>| match req.headers().contains_key("x-outer") {
        true => req.map(|b| Body::new(http_body_util::Limited::new(b, 32))),
        false => req,
    };
    let app = Router::new()
        .route("/orders", post(|| async { "created" }))
        .route_layer(defer_layer(&locker, queue.clone()).body_limit(64))
        .layer(tower::util::MapRequestLayer::new(outer));
    let order = |body: Body, outer: bool| {
        let mut req = Request::post("/orders").header("idempotency-key", "k1");
        if outer {
            req = req.header("x-outer", "1");
        }
        app.clone().oneshot(req.body(body).unwrap())
    };
    let sixty = || Body::new(Chunked(vec![Bytes::from(vec![b'x'; 20]); 3]));
    // Within the limits: deferred.
    assert_eq!(
        order(sixty(), false).await.unwrap().status(),
        StatusCode::ACCEPTED
    );
    // Over the layer's own 64 bytes (declared, streamed); over the outer 32 bytes.
    for (body, outer) in [
        (Body::from(vec![b'x'; 100]), false),
        (
            Body::new(Chunked(vec![Bytes::from(vec![b'x'; 50]); 2])),
            false,
        ),
        (sixty(), true),
    ] {
        let res = order(body, outer).await.unwrap();
        assert_problem(&res, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(text(res).await.contains("urn:dlock:problem:body-too-large"));
    }

    let digest = ServiceBuilder::new()
        .map_request(outer)
        .layer(DistributedLockLayer::new(locker, key::body_digest(64)).ttl(TTL))
        .service(service_fn(|_: Request<Body>| async {
            Ok::<_, Infallible>(Response::new(Body::from("digested")))
        }));
    let req = Request::post("/digest").header("x-outer", "1");
    let res = digest.oneshot(req.body(sixty()).unwrap()).await.unwrap();
    assert_problem(&res, StatusCode::PAYLOAD_TOO_LARGE);
}
