//! # Per-request locks with the tower layer
//!
//! Shows `dlock_tower::DistributedLockLayer` on an axum router, without touching the handlers:
//! * `POST /reports/{month}` is locked per *user and route*: the key is the authenticated user
//!   (put in the request extensions by an auth layer) plus the matched route template, so one
//!   user builds one report at a time, while other users are not held up.
//! * `POST /payments` is locked per `Idempotency-Key` header: a retried or double-clicked
//!   payment is answered `409 Conflict` with `Retry-After` and a problem+json body while the
//!   first one runs, and a request without the header gets `400`.
//! * Handlers read the lock's key and fencing token from the request extensions
//!   (`Extension<LockInfo>`).
//!
//! Run it:
//!
//! ```sh
//! cargo run -p dlock-examples --bin tower-layer                 # in-memory locks
//! DLOCK_REDIS_URL=redis://127.0.0.1:6379 \
//!   cargo run -p dlock-examples --bin tower-layer               # Redis
//! cargo run -p dlock-examples --bin tower-layer -- --serve      # keep serving on 127.0.0.1:3000
//! ```
//!
//! Without `--serve` it starts the service on a free port, fires concurrent duplicate requests
//! at itself with a real HTTP client, prints what happened and exits.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::{Extension, Path, Request};
use axum::http::{header, StatusCode};
use axum::middleware;
use axum::routing::post;
use axum::Router;
use dlock_runtime::{LockInfo, Locker};
use dlock_tower::{key, DistributedLockLayer};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// The authenticated user, as an auth layer would place it in the request extensions.
#[derive(Clone, Debug)]
struct UserId(u64);

impl std::fmt::Display for UserId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A stand-in for real authentication: `Authorization: Bearer user-<n>`.
async fn authenticate(mut req: Request) -> Result<Request, StatusCode> {
    let user = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer user-"))
        .and_then(|n| n.parse().ok())
        .ok_or(StatusCode::UNAUTHORIZED)?;
    req.extensions_mut().insert(UserId(user));
    Ok(req)
}

async fn build_report(
    Path(month): Path<String>,
    Extension(user): Extension<UserId>,
    Extension(lock): Extension<LockInfo>,
) -> String {
    // The slow part: crunching numbers. Pass the fencing token to whatever you write.
    tokio::time::sleep(Duration::from_millis(300)).await;
    format!(
        "report {month} for user {user} (lock {}, fencing token {})",
        lock.key(),
        lock.fencing_token()
    )
}

async fn pay(Extension(lock): Extension<LockInfo>) -> (StatusCode, String) {
    // The slow part: talking to the payment provider.
    tokio::time::sleep(Duration::from_millis(300)).await;
    (
        StatusCode::CREATED,
        format!("paid (fencing token {})", lock.fencing_token()),
    )
}

fn app(locker: Locker) -> Router {
    let ttl = Duration::from_secs(30);
    // Layers added later run first: authentication, then the lock, then the handler.
    let reports = Router::new()
        .route("/reports/{month}", post(build_report))
        .route_layer(
            DistributedLockLayer::new(
                locker.clone(),
                key::extension::<UserId>()
                    .label("user")
                    .and(key::matched_path()),
            )
            .ttl(ttl),
        )
        .route_layer(middleware::map_request(authenticate));
    let payments = Router::new()
        .route("/payments", post(pay))
        .route_layer(DistributedLockLayer::new(locker, key::header("idempotency-key")).ttl(ttl));
    reports.merge(payments)
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Reply {
    status: StatusCode,
    retry_after: Option<String>,
    body: String,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let locker = match std::env::var("DLOCK_REDIS_URL") {
        Ok(url) => Locker::builder().prefix("dlock-demo").connect(&url).await?,
        Err(_) => Locker::memory(),
    };
    println!("locks: {} backend", locker.backend_name());

    let serve = std::env::args().any(|a| a == "--serve");
    let addr: SocketAddr = if serve {
        ([127, 0, 0, 1], 3000).into()
    } else {
        ([127, 0, 0, 1], 0).into()
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(axum::serve(listener, app(locker)).into_future());
    if serve {
        println!("serving on http://{addr} (POST /reports/{{month}}, POST /payments)");
        server.await??;
        return Ok(());
    }

    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let post = |path: &str, headers: &[(&'static str, &str)]| {
        let client = client.clone();
        let mut req = hyper::Request::post(format!("http://{addr}{path}"));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        async move {
            let res = client.request(req.body(Empty::new())?).await?;
            let status = res.status();
            let retry_after = res
                .headers()
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = res.into_body().collect().await?.to_bytes();
            Ok::<_, BoxError>(Reply {
                status,
                retry_after,
                body: String::from_utf8_lossy(&body).into_owned(),
            })
        }
    };
    let show = |what: &str, r: &Reply| {
        let retry = r
            .retry_after
            .as_deref()
            .map(|s| format!(" (Retry-After: {s}s)"))
            .unwrap_or_default();
        println!("  {what}: {}{retry} {}", r.status, r.body);
    };

    println!("\n4 concurrent POST /payments with the same Idempotency-Key");
    let replies = futures_util::future::try_join_all(
        (0..4).map(|_| post("/payments", &[("idempotency-key", "pay-4711")])),
    )
    .await?;
    for (i, r) in replies.iter().enumerate() {
        show(&format!("request {}", i + 1), r);
    }
    let paid = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED)
        .count();
    let conflicts = replies
        .iter()
        .filter(|r| r.status == StatusCode::CONFLICT)
        .count();
    if paid != 1 || conflicts != 3 {
        return Err("expected exactly one payment to run and three 409s".into());
    }

    println!("\nPOST /payments without an Idempotency-Key");
    let r = post("/payments", &[]).await?;
    show("request", &r);
    if r.status != StatusCode::BAD_REQUEST {
        return Err("expected 400 for a missing key".into());
    }

    println!("\nconcurrent report builds: user 1 asks for two months at once, user 2 for one");
    let (a, b, c) = tokio::try_join!(
        post("/reports/2026-10", &[("authorization", "Bearer user-1")]),
        post("/reports/2026-11", &[("authorization", "Bearer user-1")]),
        post("/reports/2026-10", &[("authorization", "Bearer user-2")]),
    )?;
    show("user 1, 2026-10", &a);
    show("user 1, 2026-11", &b);
    show("user 2, 2026-10", &c);
    let user1_ok = [&a, &b]
        .iter()
        .filter(|r| r.status == StatusCode::OK)
        .count();
    if user1_ok != 1 || c.status != StatusCode::OK {
        return Err("expected one build for user 1 and one for user 2".into());
    }

    server.abort();
    Ok(())
}
