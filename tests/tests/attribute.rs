//! `#[distributed_lock]` end to end: axum and actix-web handlers over real HTTP servers
//! against a real Redis (and the two axum scenarios on a real PostgreSQL), and plain async fns
//! (re-entrancy, default locker, panics, `?`, waiting through an outage).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_runtime::{current_lock, distributed_lock, LockError, Locker};
use dlock_tests::wait::poll_until;
use dlock_tests::RedisServer;
use futures_util::stream::{FuturesUnordered, StreamExt as _};
use http_body_util::{BodyExt as _, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{mpsc, Notify};

/// One HTTP reply: status, `Retry-After`, content type, body.
#[derive(Debug)]
struct Reply {
    status: u16,
    retry_after: Option<u64>,
    content_type: Option<String>,
    body: String,
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn post(client: &HttpClient, url: &str) -> Reply {
    let req = hyper::Request::post(url).body(Empty::new()).unwrap();
    let res = client.request(req).await.expect("http request");
    let header = |name: &str| {
        res.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (retry_after, content_type) = (header("retry-after"), header("content-type"));
    let status = res.status().as_u16();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        retry_after: retry_after.map(|v| v.parse().expect("Retry-After in seconds")),
        content_type,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// Shared by the handlers of one test.
struct App {
    locker: Locker,
    ran: AtomicUsize,
    inside: AtomicUsize,
    overlaps: AtomicUsize,
    entered: mpsc::UnboundedSender<()>,
    proceed: Notify,
}

fn app(locker: Locker) -> (Arc<App>, mpsc::UnboundedReceiver<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (
        Arc::new(App {
            locker,
            ran: AtomicUsize::new(0),
            inside: AtomicUsize::new(0),
            overlaps: AtomicUsize::new(0),
            entered: tx,
            proceed: Notify::new(),
        }),
        rx,
    )
}

mod axum_app {
    use super::*;
    use axum::extract::{Path, State};
    use axum::routing::post;
    use axum::Router;

    #[distributed_lock(key = "order:<id>", ttl = "30s", on_fail = "reject", locker = app.locker,
        message = "this order is already being submitted")]
    async fn submit(State(app): State<Arc<App>>, Path(id): Path<u64>) -> String {
        app.ran.fetch_add(1, Ordering::SeqCst);
        let _ = app.entered.send(());
        // Hold the lock until the test has seen every duplicate rejected.
        app.proceed.notified().await;
        format!("{id}:{}", current_lock().unwrap().fencing_token())
    }

    #[distributed_lock(key = "order:<id>", ttl = "30s", on_fail = "retry", wait = "60s", locker = app.locker)]
    async fn pay(State(app): State<Arc<App>>, Path(id): Path<u64>) -> String {
        if app.inside.fetch_add(1, Ordering::SeqCst) != 0 {
            app.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        tokio::task::yield_now().await;
        app.ran.fetch_add(1, Ordering::SeqCst);
        app.inside.fetch_sub(1, Ordering::SeqCst);
        format!("{id}:{}", current_lock().unwrap().fencing_token())
    }

    #[distributed_lock(key = "job:<id>", ttl = "600ms", on_lost = "cancel", locker = app.locker)]
    async fn long_job(State(app): State<Arc<App>>, Path(id): Path<u64>) -> String {
        let _ = app.entered.send(());
        app.proceed.notified().await;
        // The side effect that must not happen once the lock is lost.
        app.ran.fetch_add(1, Ordering::SeqCst);
        format!("{id}")
    }

    // The usual axum handler shapes with an error type of axum's: the lock's refusal becomes
    // that error (feature `axum` converts it), not a compile error asking for a `From` impl the
    // orphan rule forbids.
    #[distributed_lock(key = "order:<id>", locker = app.locker)]
    async fn cancel(
        State(app): State<Arc<App>>,
        Path(id): Path<u64>,
    ) -> Result<String, axum::http::StatusCode> {
        Ok(format!("{id}"))
    }

    #[distributed_lock(key = "order:<id>", locker = app.locker)]
    async fn refund(
        State(app): State<Arc<App>>,
        Path(id): Path<u64>,
    ) -> Result<String, axum::response::Response> {
        Ok(format!("{id}"))
    }

    #[distributed_lock(key = "order:<id>", locker = app.locker)]
    async fn ship(
        State(app): State<Arc<App>>,
        Path(id): Path<u64>,
    ) -> Result<String, (axum::http::StatusCode, String)> {
        Ok(format!("{id}"))
    }

    pub(super) async fn serve(app: Arc<App>) -> String {
        let router = Router::new()
            .route("/orders/{id}/cancel", post(cancel))
            .route("/orders/{id}/refund", post(refund))
            .route("/orders/{id}/ship", post(ship))
            .route("/orders/{id}/submit", post(submit))
            .route("/orders/{id}/pay", post(pay))
            .route("/jobs/{id}", post(long_job))
            .with_state(app);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        format!("http://{addr}")
    }
}

/// Fires `n` requests at once; returns the replies in completion order, calling `after(k)`
/// once `k` replies are in.
async fn burst(url: &str, n: usize, mut after: impl FnMut(usize)) -> Vec<Reply> {
    let client = client();
    let mut pending: FuturesUnordered<_> = (0..n).map(|_| post(&client, url)).collect();
    let mut replies = Vec::new();
    while let Some(r) = pending.next().await {
        replies.push(r);
        after(replies.len());
    }
    replies
}

/// Fires 50 duplicates at `url` (see [`burst`]); the handler holding the lock may proceed
/// once the other 49 have been answered.
async fn fifty_duplicates(url: &str, app: &Arc<App>) -> Vec<Reply> {
    burst(url, 50, |k| {
        if k == 49 {
            app.proceed.notify_one();
        }
    })
    .await
}

fn assert_conflict(r: &Reply, detail: Option<&str>) {
    assert_eq!(r.status, 409, "{r:?}");
    let ra = r.retry_after.expect("Retry-After");
    assert!((29..=30).contains(&ra), "Retry-After {ra} for a 30 s lease");
    assert_eq!(r.content_type.as_deref(), Some("application/problem+json"));
    assert!(r.body.contains("\"status\":409"), "{}", r.body);
    if let Some(d) = detail {
        assert!(r.body.contains(d), "{}", r.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_reject_runs_one_of_50_duplicates_and_409s_the_rest() {
    let server = RedisServer::start();
    reject_runs_one_of_50_duplicates(server.locker().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_reject_runs_one_of_50_duplicates_and_409s_the_rest_on_postgres() {
    reject_runs_one_of_50_duplicates(postgres_locker().await).await;
}

/// A locker on the binary's shared PostgreSQL (started on first use).
async fn postgres_locker() -> Locker {
    let port = dlock_tests::postgres_server::shared()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .port();
    Locker::from_url(&format!("postgres://postgres@127.0.0.1:{port}/postgres"))
        .await
        .expect("connect to postgres")
}

async fn reject_runs_one_of_50_duplicates(locker: Locker) {
    let (app, mut entered) = app(locker);
    let base = axum_app::serve(app.clone()).await;
    let url = format!("{base}/orders/7/submit");
    // 49 rejections in while the one holder still waits: then it may finish.
    let replies = fifty_duplicates(&url, &app).await;
    assert_eq!(
        app.ran.load(Ordering::SeqCst),
        1,
        "critical section ran more than once"
    );
    assert!(entered.try_recv().is_ok());
    let ok: Vec<_> = replies.iter().filter(|r| r.status == 200).collect();
    assert_eq!(ok.len(), 1, "{replies:?}");
    assert_eq!(ok[0].body.split(':').next(), Some("7"));
    for r in replies.iter().filter(|r| r.status != 200) {
        assert_conflict(r, Some("this order is already being submitted"));
    }
}

/// Handlers returning axum's own error types — `Result<_, StatusCode>`, `Result<_, Response>`,
/// `Result<_, (StatusCode, String)>` — answer a held lock with 409 over HTTP: the status alone,
/// the whole problem response (`Retry-After` included), and the status with the error's
/// message. Before, they did not compile: the attribute needs `From<LockError>` for the error
/// type, which the orphan rule keeps an application from writing for axum's types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_handlers_with_axums_error_types_answer_409() {
    let (app, _entered) = app(Locker::memory());
    let base = axum_app::serve(app.clone()).await;
    let client = client();
    let held = app.locker.lock("order:5").acquire().await.unwrap();
    let status = post(&client, &format!("{base}/orders/5/cancel")).await;
    assert_eq!(status.status, 409, "{status:?}");
    assert!(status.body.is_empty(), "{status:?}");
    let response = post(&client, &format!("{base}/orders/5/refund")).await;
    assert_conflict(&response, None);
    let with_message = post(&client, &format!("{base}/orders/5/ship")).await;
    assert_eq!(with_message.status, 409, "{with_message:?}");
    assert!(with_message.body.contains("order:5"), "{with_message:?}");
    held.release().await.unwrap();
    for path in ["cancel", "refund", "ship"] {
        let done = post(&client, &format!("{base}/orders/5/{path}")).await;
        assert_eq!((done.status, done.body.as_str()), (200, "5"), "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_retry_runs_all_50_one_at_a_time_with_increasing_tokens() {
    let server = RedisServer::start();
    retry_runs_all_50_one_at_a_time(server.locker().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_retry_runs_all_50_one_at_a_time_with_increasing_tokens_on_postgres() {
    retry_runs_all_50_one_at_a_time(postgres_locker().await).await;
}

async fn retry_runs_all_50_one_at_a_time(locker: Locker) {
    let (app, _entered) = app(locker);
    let base = axum_app::serve(app.clone()).await;
    let url = format!("{base}/orders/9/pay");
    let replies = burst(&url, 50, |_| {}).await;
    assert!(replies.iter().all(|r| r.status == 200), "{replies:?}");
    assert_eq!(app.ran.load(Ordering::SeqCst), 50);
    assert_eq!(
        app.overlaps.load(Ordering::SeqCst),
        0,
        "two handlers inside at once"
    );
    let mut tokens: Vec<u64> = replies
        .iter()
        .map(|r| r.body.split(':').nth(1).unwrap().parse().unwrap())
        .collect();
    tokens.sort_unstable();
    tokens.dedup();
    assert_eq!(tokens.len(), 50, "fencing tokens must be distinct");

    // Sequential calls see strictly increasing tokens.
    let client = client();
    let mut last = 0;
    for _ in 0..5 {
        let r = post(&client, &url).await;
        let t: u64 = r.body.split(':').nth(1).unwrap().parse().unwrap();
        assert!(t > last, "token {t} after {last}");
        last = t;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn axum_on_lost_cancel_stops_the_side_effect() {
    let server = RedisServer::start();
    let (app, mut entered) = app(server.locker().await);
    let base = axum_app::serve(app.clone()).await;
    let client = client();
    let url = format!("{base}/jobs/5");
    let request = tokio::spawn(async move { post(&client, &url).await });
    entered.recv().await.expect("handler entered");

    // Take the lock away behind the handler's back.
    let n: i64 = server.query(redis::cmd("DEL").arg("dlock:{job:5}")).await;
    assert_eq!(n, 1);

    let reply = request.await.unwrap();
    assert_eq!(reply.status, 503, "{reply:?}");
    assert!(reply.body.contains("lock-lost"), "{}", reply.body);
    // The body was dropped at its await point: letting it proceed now runs nothing.
    app.proceed.notify_waiters();
    tokio::task::yield_now().await;
    assert_eq!(
        app.ran.load(Ordering::SeqCst),
        0,
        "side effect ran after the lock was lost"
    );
}

mod actix_app {
    use super::*;
    use actix_web::{web, App as ActixApp, HttpResponse, HttpServer};

    // actix-web handler futures are !Send; the attribute must not require Send.
    #[distributed_lock(key = "order:<id>", ttl = "30s", on_fail = "reject", locker = app.locker)]
    async fn submit(app: web::Data<Arc<App>>, id: web::Path<u64>) -> HttpResponse {
        let not_send = std::rc::Rc::new(());
        app.ran.fetch_add(1, Ordering::SeqCst);
        let _ = app.entered.send(());
        app.proceed.notified().await;
        drop(not_send);
        HttpResponse::Ok().body(format!("{id}:{}", current_lock().unwrap().fencing_token()))
    }

    /// Runs an actix-web server on its own thread and system; returns its base URL.
    pub(super) fn serve(app: Arc<App>) -> String {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let data = web::Data::new(app);
                let server = HttpServer::new(move || {
                    ActixApp::new()
                        .app_data(data.clone())
                        .route("/orders/{id}/submit", web::post().to(submit))
                })
                .workers(1)
                .bind(("127.0.0.1", 0))
                .unwrap();
                tx.send(server.addrs()[0]).unwrap();
                server.run().await.unwrap();
            });
        });
        format!("http://{}", rx.recv().unwrap())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actix_reject_runs_one_of_50_duplicates_and_409s_the_rest() {
    let server = RedisServer::start();
    let (app, _entered) = app(server.locker().await);
    let base = actix_app::serve(app.clone());
    let url = format!("{base}/orders/3/submit");
    let replies = fifty_duplicates(&url, &app).await;
    assert_eq!(app.ran.load(Ordering::SeqCst), 1);
    assert_eq!(
        replies.iter().filter(|r| r.status == 200).count(),
        1,
        "{replies:?}"
    );
    for r in replies.iter().filter(|r| r.status != 200) {
        assert_conflict(r, None);
    }
}

// ---- plain async fns -------------------------------------------------------------------

#[distributed_lock(key = "acct:<id>", on_fail = "reject", locker = locker)]
async fn outer(locker: &Locker, id: u64) -> Result<(u64, u64), LockError> {
    let mine = current_lock().unwrap().fencing_token();
    let nested = inner(locker, id).await?;
    Ok((mine, nested))
}

#[distributed_lock(key = "acct:<id>", on_fail = "retry", wait = "30s", locker = locker)]
async fn inner(locker: &Locker, id: u64) -> u64 {
    current_lock().unwrap().fencing_token()
}

#[tokio::test]
async fn nested_call_with_the_same_key_re_enters() {
    let locker = Locker::memory();
    let start = Instant::now();
    let (outer_token, inner_token) = outer(&locker, 1).await.unwrap();
    // Re-entered: the same lock (no second acquisition), and no wait for ourselves.
    assert_eq!(outer_token, inner_token);
    assert!(start.elapsed() < Duration::from_secs(5));
    // Released once the outer call returned.
    assert!(locker.lock("acct:1").try_acquire().await.unwrap().is_some());
}

/// A locked call keeps its body's state once: a call nested in a locked body adds about its
/// own size to the outer call's future, not a multiple of it. Before, every layer the body
/// passed through (`run`, `run_held`, the task-local scope) kept a copy, about five times the
/// body per level: three nested locked calls made a 540 KB future, which overflowed the 2 MiB
/// stack of a debug build's test thread.
#[test]
fn a_locked_call_keeps_its_body_once() {
    let locker = Locker::memory();
    let inner = std::mem::size_of_val(&inner(&locker, 1));
    let outer = std::mem::size_of_val(&outer(&locker, 1));
    // `outer`'s future: its own taking of the lock (as big as `inner`'s, whose body is
    // trivial) and its body, which holds `inner`'s future.
    assert!(
        outer <= 2 * inner + 1024,
        "outer call {outer} bytes, the call nested in it {inner} bytes"
    );
}

/// What the nested calls below tell the test, and wait for.
struct Gate {
    entered: mpsc::UnboundedSender<()>,
    proceed: Notify,
    ran: AtomicUsize,
}

#[distributed_lock(key = "nest:<id>", ttl = "600ms", locker = locker)]
async fn outer_ignoring_loss(locker: Locker, id: u64, gate: Arc<Gate>) -> Result<(), LockError> {
    inner_cancelled_on_loss(locker, id, gate).await
}

#[distributed_lock(key = "nest:<id>", ttl = "600ms", on_lost = "cancel", locker = locker)]
async fn inner_cancelled_on_loss(locker: Locker, id: u64, gate: Arc<Gate>) {
    let _ = gate.entered.send(());
    gate.proceed.notified().await;
    // The side effect that must not happen once the lock is lost.
    gate.ran.fetch_add(1, Ordering::SeqCst);
}

/// `on_lost = "cancel"` on a call that re-enters a lock an outer call holds (with the default
/// `on_lost`, "ignore"): the inner body is cancelled when that lock is lost all the same. It
/// ran on unwatched before, its side effect after the loss included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_call_cancelled_on_loss_is_cancelled_when_the_lock_it_re_entered_is_lost() {
    let server = RedisServer::start();
    let locker = server.locker().await;
    let (entered, mut inside) = mpsc::unbounded_channel();
    let gate = Arc::new(Gate {
        entered,
        proceed: Notify::new(),
        ran: AtomicUsize::new(0),
    });
    let call = tokio::spawn(outer_ignoring_loss(locker, 7, gate.clone()));
    inside.recv().await.expect("the inner body started");
    // Take the lock away behind both calls' backs.
    let n: i64 = server.query(redis::cmd("DEL").arg("dlock:{nest:7}")).await;
    assert_eq!(n, 1);
    let out = tokio::time::timeout(Duration::from_secs(10), call)
        .await
        .expect("the inner body was not cancelled when the lock was lost")
        .unwrap();
    let err = out.unwrap_err();
    assert!(err.is_lost(), "{err}");
    // The body was dropped at its await point: letting it proceed now runs nothing.
    gate.proceed.notify_waiters();
    tokio::task::yield_now().await;
    assert_eq!(
        gate.ran.load(Ordering::SeqCst),
        0,
        "side effect ran after the loss"
    );
}

#[distributed_lock(key = "gone:<id>", ttl = "600ms", locker = locker)]
async fn outer_that_outlives_its_lock(
    locker: Locker,
    id: u64,
    gate: Arc<Gate>,
) -> Result<Result<(), LockError>, LockError> {
    let _ = gate.entered.send(());
    gate.proceed.notified().await;
    // The renewal finds the lock gone within a third of its 600 ms lease; from then on a
    // by-hand acquire of the key in this task answers `Lost`, not `Reentrant`.
    let key = format!("gone:{id}");
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        match locker.lock(key.as_str()).try_acquire().await {
            Err(e) if e.is_lost() => break,
            other => assert!(Instant::now() < until, "not reported lost: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(inner_after_the_loss(locker, id, gate).await)
}

#[distributed_lock(key = "gone:<id>", ttl = "600ms", locker = locker)]
async fn inner_after_the_loss(locker: Locker, id: u64, gate: Arc<Gate>) {
    // The side effect that must not run without the lock.
    gate.ran.fetch_add(1, Ordering::SeqCst);
}

/// A nested call does not re-enter a lock the outer call has lost: it answers `Lost` and its
/// body does not run (nor does a by-hand acquire of the key inside answer `Reentrant`). Before,
/// the nested body ran with no lock at all — beside the lock's next owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_call_does_not_re_enter_a_lost_lock() {
    let server = RedisServer::start();
    let locker = server.locker().await;
    let (entered, mut inside) = mpsc::unbounded_channel();
    let gate = Arc::new(Gate {
        entered,
        proceed: Notify::new(),
        ran: AtomicUsize::new(0),
    });
    let call = tokio::spawn(outer_that_outlives_its_lock(
        locker.clone(),
        9,
        gate.clone(),
    ));
    inside.recv().await.expect("the outer body started");
    // Take the lock away behind the outer call's back; its next renewal reports it lost.
    let n: i64 = server.query(redis::cmd("DEL").arg("dlock:{gone:9}")).await;
    assert_eq!(n, 1);
    let other = Locker::from_url(&server.url()).await.unwrap();
    let taken = other.lock("gone:9").try_acquire().await.unwrap();
    assert!(taken.is_some(), "another owner takes the freed lock");
    gate.proceed.notify_one();
    let inner = call.await.unwrap().expect("the outer call ran");
    let err = inner.expect_err("the nested call re-entered a lost lock");
    assert!(err.is_lost(), "{err}");
    assert_eq!(gate.ran.load(Ordering::SeqCst), 0, "the nested body ran");
}

#[distributed_lock(key = ["pair:<a>", "pair:<b>"], locker = locker)]
async fn both(locker: &Locker, a: u64, b: u64) -> Result<(String, usize), LockError> {
    one(locker, a).await
}

#[distributed_lock(key = "pair:<id>", locker = locker)]
async fn one(locker: &Locker, id: u64) -> (String, usize) {
    let held = dlock_runtime::held_locks();
    (current_lock().unwrap().key().to_owned(), held.len())
}

/// Inside a nested call that re-enters one of its outer call's locks, `current_lock()` is the
/// nested call's lock, and no lock is listed twice. Before, it was the outer call's innermost
/// other lock (`pair:2` inside `one(1)`): another key, another fencing token.
#[tokio::test]
async fn a_re_entered_lock_is_the_current_lock_of_the_nested_call() {
    let locker = Locker::memory();
    let (key, held) = both(&locker, 1, 2).await.unwrap();
    assert_eq!(key, "pair:1");
    assert_eq!(held, 2, "a lock listed twice");
}

/// How many bodies of the calls nested side by side below run at once, at most.
#[derive(Default)]
struct Sides {
    inside: AtomicUsize,
    most: AtomicUsize,
    ran: AtomicUsize,
}

impl Sides {
    /// A body's run: counted in, then yields a few times (so that `join!` polls the other side
    /// meanwhile); [`out`](Self::out) counts it out.
    async fn run(&self) {
        let now = self.inside.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        for _ in 0..5 {
            tokio::task::yield_now().await;
        }
    }

    fn out(&self) {
        self.inside.fetch_sub(1, Ordering::SeqCst);
        self.ran.fetch_add(1, Ordering::SeqCst);
    }
}

#[distributed_lock(key = "side:<id>", on_fail = "retry", wait = "5s", locker = locker)]
async fn two_sides(locker: &Locker, id: u64, sides: &Sides) -> Result<((), ()), LockError> {
    Ok(tokio::join!(
        async { side(locker, id, sides).await.unwrap() },
        async { side(locker, id, sides).await.unwrap() },
    ))
}

#[distributed_lock(key = "side:<id>", on_fail = "retry", wait = "5s", locker = locker)]
async fn side(locker: &Locker, id: u64, sides: &Sides) {
    sides.run().await;
    // Nested in this side: re-enters at once (it does not wait for its own side).
    let token = deeper(locker, id).await.unwrap();
    assert_eq!(token, current_lock().unwrap().fencing_token());
    sides.out();
}

#[distributed_lock(key = "side:<id>", locker = locker)]
async fn deeper(locker: &Locker, id: u64) -> u64 {
    current_lock().unwrap().fencing_token()
}

/// Two calls nested side by side in one locked body (`join!`) on the key it holds take turns,
/// as two tasks would: one body runs at a time, and a call nested in either re-enters at once.
/// Before, both re-entered the outer call's lock and ran at once — two read-modify-writes of
/// one account interleaved under "its" lock.
#[tokio::test]
async fn calls_nested_side_by_side_take_turns_on_a_re_entered_lock() {
    let locker = Locker::memory();
    let sides = Sides::default();
    two_sides(&locker, 1, &sides).await.unwrap();
    assert_eq!(sides.ran.load(Ordering::SeqCst), 2);
    assert_eq!(
        sides.most.load(Ordering::SeqCst),
        1,
        "the two sides ran at once"
    );
    assert!(locker.lock("side:1").try_acquire().await.unwrap().is_some());
}

type Outcome = Result<(), LockError>;

#[distributed_lock(key = "side:<id>", locker = locker)]
async fn two_rejecting_sides(
    locker: &Locker,
    id: u64,
    sides: &Sides,
) -> Result<(Outcome, Outcome), LockError> {
    Ok(tokio::join!(
        rejecting_side(locker, id, sides),
        rejecting_side(locker, id, sides)
    ))
}

#[distributed_lock(key = "side:<id>", on_fail = "reject", locker = locker)]
async fn rejecting_side(locker: &Locker, id: u64, sides: &Sides) {
    sides.run().await;
    sides.out();
}

/// With `on_fail = "reject"`, the second of two calls nested side by side finds the key's turn
/// taken and is refused (`Contended`), as a call in another task would be.
#[tokio::test]
async fn a_rejecting_call_beside_another_on_a_re_entered_lock_is_refused() {
    let locker = Locker::memory();
    let sides = Sides::default();
    let (first, second) = two_rejecting_sides(&locker, 2, &sides).await.unwrap();
    first.unwrap();
    assert!(second.unwrap_err().is_contended());
    assert_eq!(sides.ran.load(Ordering::SeqCst), 1);
}

#[distributed_lock(key = "rw:<id>", mode = "write", locker = locker)]
async fn writer_of_two_sides(
    locker: &Locker,
    id: u64,
    sides: &Sides,
) -> Result<((), (), ()), LockError> {
    Ok(tokio::join!(
        async { reading_side(locker, id, sides).await.unwrap() },
        async { reading_side(locker, id, sides).await.unwrap() },
        async { writing_side(locker, id, sides).await.unwrap() },
    ))
}

#[distributed_lock(key = "rw:<id>", mode = "read", on_fail = "retry", wait = "5s", locker = locker)]
async fn reading_side(locker: &Locker, id: u64, sides: &Sides) {
    sides.run().await;
    sides.out();
}

#[distributed_lock(key = "rw:<id>", mode = "write", on_fail = "retry", wait = "5s", locker = locker)]
async fn writing_side(locker: &Locker, id: u64, sides: &Sides) {
    sides.run().await;
    sides.out();
}

/// Reads nested side by side in a write hold run together, and a write nested beside them
/// runs alone, as readers and a writer of a read-write lock would in separate tasks.
#[tokio::test]
async fn reads_nested_side_by_side_share_their_turn_and_a_write_beside_them_waits() {
    let locker = Locker::memory();
    let sides = Sides::default();
    writer_of_two_sides(&locker, 3, &sides).await.unwrap();
    assert_eq!(sides.ran.load(Ordering::SeqCst), 3);
    assert_eq!(
        sides.most.load(Ordering::SeqCst),
        2,
        "the two reads did not run together, or the write ran beside them"
    );
}

#[derive(Debug)]
enum AppError {
    Lock(LockError),
    Invalid,
}

impl From<LockError> for AppError {
    fn from(e: LockError) -> Self {
        AppError::Lock(e)
    }
}

#[distributed_lock(key = "validate:<n>", locker = locker)]
async fn validate(locker: &Locker, n: i32) -> Result<i32, AppError> {
    let checked = if n < 0 { Err(AppError::Invalid) } else { Ok(n) };
    let v = checked?; // early exit through `?` must still release the lock
    Ok(v * 2)
}

#[distributed_lock(key = "boom:<n>", ttl = "30s", locker = locker)]
async fn boom(locker: Locker, n: u32) -> u32 {
    if n > 0 {
        panic!("handler panicked");
    }
    n
}

#[tokio::test]
async fn question_mark_and_panics_release_the_lock() {
    let locker = Locker::memory();
    assert!(matches!(
        validate(&locker, -1).await,
        Err(AppError::Invalid)
    ));
    assert!(locker
        .lock("validate:-1")
        .try_acquire()
        .await
        .unwrap()
        .is_some());
    assert_eq!(validate(&locker, 4).await.unwrap(), 8);

    let l = locker.clone();
    let joined = tokio::spawn(async move { boom(l, 1).await }).await;
    assert!(joined.unwrap_err().is_panic());
    // Released in the background by the guard's drop during unwinding: promptly, not after 30 s.
    let _ = poll_until(Duration::from_secs(2), Duration::ZERO, async || {
        let g = locker.lock("boom:1").try_acquire().await.unwrap();
        g.ok_or("panicked holder kept the lock")
    })
    .await;
}

#[tokio::test]
async fn contended_plain_fn_returns_a_typed_error_with_the_key() {
    let locker = Locker::memory();
    let held = locker.lock("validate:5").acquire().await.unwrap();
    match validate(&locker, 5).await {
        Err(AppError::Lock(e)) => {
            assert!(e.is_contended(), "{e}");
            assert_eq!(e.status(), 409);
        }
        other => panic!("expected a lock error, got {other:?}"),
    }
    held.release().await.unwrap();
}

#[distributed_lock(key = "report:<day>", ttl = "5s")]
async fn report_with_default_locker(day: u32) -> u32 {
    day
}

#[tokio::test]
async fn the_default_locker_is_used_when_none_is_given() {
    // The only test in this binary that touches the global default.
    dlock_runtime::set_default_locker(Locker::memory());
    assert_eq!(report_with_default_locker(3).await.unwrap(), 3);
}

// ---- multi-key, scheduled jobs, fallbacks, re-entrancy by hand -------------------------

/// Balances of two accounts, moved by `transfer` with a non-atomic read-modify-write that is
/// only correct under both accounts' locks.
struct Bank {
    balances: [std::sync::atomic::AtomicI64; 2],
    inside: AtomicUsize,
    overlaps: AtomicUsize,
}

#[distributed_lock(
    key = ["account:<from>", "account:<to>"],
    on_fail = "retry",
    wait = "30s",
    locker = locker
)]
async fn transfer(locker: &Locker, bank: &Bank, from: usize, to: usize, amount: i64) -> usize {
    if bank.inside.fetch_add(1, Ordering::SeqCst) != 0 {
        bank.overlaps.fetch_add(1, Ordering::SeqCst);
    }
    let (a, b) = (
        bank.balances[from].load(Ordering::SeqCst),
        bank.balances[to].load(Ordering::SeqCst),
    );
    tokio::task::yield_now().await;
    bank.balances[from].store(a - amount, Ordering::SeqCst);
    bank.balances[to].store(b + amount, Ordering::SeqCst);
    bank.inside.fetch_sub(1, Ordering::SeqCst);
    dlock_runtime::held_locks().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_key_transfers_in_both_directions_neither_deadlock_nor_overlap() {
    let locker = Locker::memory();
    let bank = Arc::new(Bank {
        balances: [1000.into(), 1000.into()],
        inside: AtomicUsize::new(0),
        overlaps: AtomicUsize::new(0),
    });
    let mut tasks = Vec::new();
    for i in 0..40usize {
        let (locker, bank) = (locker.clone(), bank.clone());
        let (from, to) = if i % 2 == 0 { (0, 1) } else { (1, 0) };
        tasks.push(tokio::spawn(async move {
            transfer(&locker, &bank, from, to, 10).await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), 2, "both keys held inside");
    }
    assert_eq!(bank.overlaps.load(Ordering::SeqCst), 0);
    let total: i64 = bank.balances.iter().map(|b| b.load(Ordering::SeqCst)).sum();
    assert_eq!(total, 2000);
    // Released together.
    let both = locker
        .lock_all(["account:0", "account:1"])
        .try_acquire()
        .await;
    assert!(both.unwrap().is_some());
}

#[tokio::test]
async fn multi_key_with_the_same_account_twice_is_a_typed_error() {
    let locker = Locker::memory();
    let bank = Bank {
        balances: [0.into(), 0.into()],
        inside: AtomicUsize::new(0),
        overlaps: AtomicUsize::new(0),
    };
    let err = transfer(&locker, &bank, 1, 1, 5).await.unwrap_err();
    assert!(err.is_invalid(), "{err}");
    assert_eq!(err.status(), 400);
}

#[distributed_lock(key = "tick:<name>", on_fail = "skip", locker = locker)]
async fn tick(locker: &Locker, name: &str, ran: &AtomicUsize) {
    ran.fetch_add(1, Ordering::SeqCst);
}

#[distributed_lock(key = "tick:<name>", on_fail = "skip", locker = locker)]
async fn tick_value(locker: &Locker, name: &str) -> Option<u32> {
    Some(7)
}

#[distributed_lock(key = "tick:<name>", on_fail = "skip", locker = locker)]
async fn tick_result(locker: &Locker, name: &str) -> Result<Option<u32>, AppError> {
    Ok(Some(8))
}

#[tokio::test]
async fn skip_returns_at_once_with_nothing_done_when_the_lock_is_held() {
    let locker = Locker::memory();
    let ran = AtomicUsize::new(0);
    tick(&locker, "a", &ran).await.unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(tick_value(&locker, "a").await.unwrap(), Some(7));
    assert_eq!(tick_result(&locker, "a").await.unwrap(), Some(8));

    let held = locker.lock("tick:a").acquire().await.unwrap();
    tick(&locker, "a", &ran).await.unwrap();
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "ran while another instance held the lock"
    );
    assert_eq!(tick_value(&locker, "a").await.unwrap(), None);
    assert_eq!(tick_result(&locker, "a").await.unwrap(), None);
    held.release().await.unwrap();
}

#[distributed_lock(key = "nightly", ttl = "10s", hold_at_least = "400ms", on_fail = "skip", locker = locker)]
async fn nightly(locker: &Locker, ran: &AtomicUsize) {
    ran.fetch_add(1, Ordering::SeqCst);
}

#[tokio::test]
async fn hold_at_least_keeps_the_lock_after_the_body_returns() {
    let locker = Locker::memory();
    let ran = AtomicUsize::new(0);
    let start = Instant::now();
    nightly(&locker, &ran).await.unwrap();
    // A second instance's tick right after: skipped, the first one's lock is still held.
    nightly(&locker, &ran).await.unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    let _ = poll_until(
        Duration::from_secs(5),
        Duration::from_millis(5),
        async || {
            let g = locker.lock("nightly").try_acquire().await.unwrap();
            g.map(drop).ok_or("still held")
        },
    )
    .await;
    assert!(
        start.elapsed() >= Duration::from_millis(400),
        "{:?}",
        start.elapsed()
    );
}

async fn busy_order(locker: &Locker, id: u64, err: LockError) -> String {
    let _ = locker;
    format!("order {id} is busy ({})", err.status())
}

#[distributed_lock(key = "order:<id>", fallback = busy_order, locker = locker)]
async fn submit_order(locker: &Locker, id: u64) -> String {
    format!("order {id} submitted")
}

async fn busy_result(id: u64, err: LockError) -> Result<String, AppError> {
    Err(AppError::Lock(
        err.with_detail(format!("order {id} is busy")),
    ))
}

#[distributed_lock(key = "order:<id>", fallback = busy_result, locker = LOCKER.get().unwrap())]
async fn submit_result(id: u64) -> Result<String, AppError> {
    Ok(format!("order {id} submitted"))
}

static LOCKER: std::sync::OnceLock<Locker> = std::sync::OnceLock::new();

#[tokio::test]
async fn fallback_answers_with_the_arguments_when_the_lock_is_not_acquired() {
    let locker = Locker::memory();
    assert_eq!(submit_order(&locker, 3).await.unwrap(), "order 3 submitted");
    let held = locker.lock("order:3").acquire().await.unwrap();
    assert_eq!(
        submit_order(&locker, 3).await.unwrap(),
        "order 3 is busy (409)"
    );
    held.release().await.unwrap();

    let locker = LOCKER.get_or_init(Locker::memory);
    let held = locker.lock("order:4").acquire().await.unwrap();
    match submit_result(4).await {
        Err(AppError::Lock(e)) => assert!(e.problem_json().contains("order 4 is busy"), "{e}"),
        other => panic!("expected the fallback's error, got {other:?}"),
    }
    held.release().await.unwrap();
    assert_eq!(submit_result(4).await.unwrap(), "order 4 submitted");
}

#[distributed_lock(key = "acct:<id>", locker = locker)]
async fn by_hand_inside(locker: &Locker, id: u64) -> Result<(), LockError> {
    locker.lock(format!("acct:{id}")).acquire().await.map(drop)
}

#[tokio::test]
async fn a_by_hand_acquire_inside_the_attribute_is_a_typed_error_not_a_deadlock() {
    let locker = Locker::memory();
    let err = tokio::time::timeout(Duration::from_secs(5), by_hand_inside(&locker, 9))
        .await
        .expect("no deadlock")
        .unwrap_err();
    assert!(err.is_reentrant(), "{err}");
}

// ---- semaphores and read-write locks ---------------------------------------------------

#[distributed_lock(key = "export:<shop>", permits = 2, on_fail = "retry", wait = "20s", locker = locker)]
async fn export(locker: &Locker, shop: u32, pair: &tokio::sync::Barrier, inside: &AtomicUsize) {
    assert!(
        inside.fetch_add(1, Ordering::SeqCst) < 2,
        "a third holder of 2 permits"
    );
    // Two holders at once, or this waits forever (the test's timeout fails it).
    pair.wait().await;
    inside.fetch_sub(1, Ordering::SeqCst);
}

/// `permits = 2` on Redis: 8 calls go through two at a time — never three, and always two
/// together (each pair meets at a barrier that a one-at-a-time lock would never open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_let_two_calls_in_at_a_time() {
    let server = RedisServer::start();
    let locker = Locker::from_url(&server.url()).await.unwrap();
    let pair = tokio::sync::Barrier::new(2);
    let inside = AtomicUsize::new(0);
    let calls = (0..8).map(|_| export(&locker, 7, &pair, &inside));
    let all = futures_util::future::join_all(calls);
    let results = tokio::time::timeout(Duration::from_secs(20), all)
        .await
        .expect("the calls did not pair up: the semaphore admitted one at a time");
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

#[distributed_lock(key = "catalog:<shop>", mode = "read", locker = locker)]
async fn read_catalog(locker: &Locker, shop: u32, readers: &tokio::sync::Barrier) -> u64 {
    readers.wait().await;
    current_lock().unwrap().fencing_token()
}

#[distributed_lock(key = "catalog:<shop>", mode = "write", on_fail = "retry", wait = "20s", locker = locker)]
async fn write_catalog(locker: &Locker, shop: u32) -> Result<u64, LockError> {
    let mine = current_lock().unwrap().fencing_token();
    // A read of the same catalog inside the write re-enters rather than waiting for itself.
    let no_readers = tokio::sync::Barrier::new(1);
    let read = read_catalog(locker, shop, &no_readers).await?;
    assert_eq!(read, mine, "the nested read is the write hold itself");
    Ok(mine)
}

/// `mode = "read"` / `"write"` on Redis: three readers hold the catalog at once (they meet at
/// a barrier), the writer after them gets a greater fencing token, and a read nested in the
/// write re-enters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_share_and_the_writer_after_them_fences_above() {
    let server = RedisServer::start();
    let locker = Locker::from_url(&server.url()).await.unwrap();
    let readers = tokio::sync::Barrier::new(3);
    let reads = futures_util::future::join_all((0..3).map(|_| read_catalog(&locker, 1, &readers)));
    let tokens = tokio::time::timeout(Duration::from_secs(20), reads)
        .await
        .expect("three readers could not hold the catalog together");
    let top = tokens.into_iter().map(Result::unwrap).max().unwrap();
    let written = write_catalog(&locker, 1).await.unwrap();
    assert!(
        written > top,
        "writer token {written} not above the readers' {top}"
    );
}

#[distributed_lock(key = "ledger:<id>", on_fail = "retry", wait = "30s", through_outages = true, locker = locker)]
async fn post_through_outages(locker: &Locker, id: u32) -> u64 {
    current_lock().unwrap().fencing_token()
}

#[distributed_lock(key = "ledger:<id>", on_fail = "retry", wait = "30s", locker = locker)]
async fn post_plain(locker: &Locker, id: u32) -> u64 {
    current_lock().unwrap().fencing_token()
}

/// `through_outages = true` on a real Redis that stops answering: the call waits for the
/// server and runs once it is back, where the same call without it answers 503 meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_outages_waits_for_a_frozen_server() {
    let mut server = RedisServer::start();
    let locker = Locker::builder()
        .command_timeout(Duration::from_millis(200))
        .connect(&server.url())
        .await
        .unwrap();
    server.pause();
    let mut through = tokio::spawn({
        let locker = locker.clone();
        async move { post_through_outages(&locker, 1).await }
    });
    let err = post_plain(&locker, 2).await.unwrap_err();
    assert_eq!(err.status(), 503, "{err}");
    let still = tokio::time::timeout(Duration::from_secs(1), &mut through).await;
    assert!(
        still.is_err(),
        "the call gave up during the outage: {still:?}"
    );
    server.resume();
    let token = tokio::time::timeout(Duration::from_secs(15), through)
        .await
        .expect("the call did not run once the server was back")
        .unwrap()
        .expect("the call gave up");
    assert!(token > 0);
}
