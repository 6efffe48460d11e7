//! # An axum order service protected against double submission
//!
//! Shows `#[distributed_lock]` on axum handlers:
//! * `POST /orders/{id}/submit` takes the lock `order:<id>` with `on_fail = "reject"`: a
//!   duplicate submission while the first is running gets `409 Conflict` with `Retry-After` and
//!   a problem+json body carrying the attribute's `message`.
//! * `POST /orders/{id}/ship` takes the same lock with `on_fail = "retry"`: concurrent calls
//!   wait in line (fairly, woken by the release) and run one after another.
//! * Inside, `dlock_runtime::current_lock()` gives the fencing token to pass to storage.
//!
//! Run it (the README's demo command):
//!
//! ```sh
//! cargo run -p dlock-examples --bin orders-axum                 # in-memory locks
//! DLOCK_REDIS_URL=redis://127.0.0.1:6379 \
//!   cargo run -p dlock-examples --bin orders-axum               # Redis
//! DLOCK_REDIS_URL=redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002 \
//!   cargo run -p dlock-examples --bin orders-axum               # a Redis Cluster
//! DLOCK_URL=postgres://app@127.0.0.1:5432/app \
//!   cargo run -p dlock-examples --bin orders-axum               # Postgres
//! cargo run -p dlock-examples --bin orders-axum -- --serve      # keep serving on 127.0.0.1:3000
//! ```
//!
//! Without `--serve` it starts the service on a free port, fires concurrent duplicate requests
//! at itself with a real HTTP client, prints what happened and exits.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use dlock_runtime::{distributed_lock, Locker};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;

#[derive(Clone, Default)]
struct AppState {
    submitted: Arc<AtomicU64>,
    shipped: Arc<AtomicU64>,
}

#[derive(Serialize)]
struct Receipt {
    order: u64,
    action: &'static str,
    fencing_token: u64,
}

/// One submission per order at a time; duplicates are rejected with 409 + Retry-After.
#[distributed_lock(
    key = "order:<id>",
    ttl = "10s",
    on_fail = "reject",
    message = "this order is already being submitted; try again in a few seconds"
)]
async fn submit(State(state): State<AppState>, Path(id): Path<u64>) -> (StatusCode, Json<Receipt>) {
    let lock = dlock_runtime::current_lock().expect("the attribute holds the lock here");
    // The slow part: talking to the payment provider.
    tokio::time::sleep(Duration::from_millis(300)).await;
    state.submitted.fetch_add(1, Ordering::SeqCst);
    let receipt = Receipt {
        order: id,
        action: "submitted",
        fencing_token: lock.fencing_token(),
    };
    (StatusCode::CREATED, Json(receipt))
}

/// Shipping waits in line for the same order lock instead of failing.
#[distributed_lock(key = "order:<id>", ttl = "10s", on_fail = "retry", wait = "5s")]
async fn ship(State(state): State<AppState>, Path(id): Path<u64>) -> Json<Receipt> {
    let lock = dlock_runtime::current_lock().expect("the attribute holds the lock here");
    tokio::time::sleep(Duration::from_millis(20)).await;
    state.shipped.fetch_add(1, Ordering::SeqCst);
    Json(Receipt {
        order: id,
        action: "shipped",
        fencing_token: lock.fencing_token(),
    })
}

fn app(state: AppState) -> Router {
    Router::new()
        .route("/orders/{id}/submit", post(submit))
        .route("/orders/{id}/ship", post(ship))
        .with_state(state)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Any locker URL (`DLOCK_URL`: memory://, redis://, postgres://, …), or a Redis one.
    let url = std::env::var("DLOCK_URL").or_else(|_| std::env::var("DLOCK_REDIS_URL"));
    let locker = match url {
        Ok(url) => Locker::builder().prefix("dlock-demo").connect(&url).await?,
        Err(_) => Locker::memory(),
    };
    println!("locks: {} backend", locker.backend_name());
    dlock_runtime::set_default_locker(locker);

    let state = AppState::default();
    let serve = std::env::args().any(|a| a == "--serve");
    let addr: SocketAddr = if serve {
        ([127, 0, 0, 1], 3000).into()
    } else {
        ([127, 0, 0, 1], 0).into()
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(axum::serve(listener, app(state.clone())).into_future());
    if serve {
        println!("serving on http://{addr} (POST /orders/{{id}}/submit, /orders/{{id}}/ship)");
        server.await??;
        return Ok(());
    }

    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let post = |path: String| {
        let client = client.clone();
        async move {
            let req = hyper::Request::post(format!("http://{addr}{path}")).body(Empty::new())?;
            let res = client.request(req).await?;
            let status = res.status();
            let retry_after = res
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = res.into_body().collect().await?.to_bytes();
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((
                status,
                retry_after,
                String::from_utf8_lossy(&body).into_owned(),
            ))
        }
    };

    // The fencing token of every lock taken, in order: it must only grow.
    let mut last_token = 0;
    let token_of = |body: &str| -> Result<u64, String> {
        body.split("\"fencing_token\":")
            .nth(1)
            .and_then(|t| t.trim_end_matches('}').parse().ok())
            .ok_or_else(|| format!("no fencing token in {body}"))
    };
    for round in 1..=2 {
        println!("\nround {round}: 20 concurrent POST /orders/42/submit");
        let replies =
            futures_util::future::join_all((0..20).map(|_| post("/orders/42/submit".to_owned())))
                .await;
        let mut created = Vec::new();
        let mut conflicts = 0;
        let mut retry_after = None;
        let mut detail = None;
        for r in replies {
            let (status, ra, body) = r.map_err(|e| e.to_string())?;
            match status {
                StatusCode::CREATED => created.push(body),
                StatusCode::CONFLICT => {
                    conflicts += 1;
                    retry_after = ra;
                    detail.get_or_insert(body);
                }
                other => return Err(format!("unexpected status {other}: {body}").into()),
            }
        }
        println!("  created: {} -> {}", created.len(), created.join(", "));
        println!(
            "  409 Conflict: {conflicts} (Retry-After: {}s)",
            retry_after.as_deref().unwrap_or("?")
        );
        if let Some(d) = detail {
            println!("  409 body: {d}");
        }
        if created.len() != 1 || conflicts != 19 {
            return Err("expected exactly one submission to run".into());
        }
        let token = token_of(&created[0])?;
        if token <= last_token {
            return Err(
                format!("the fencing token did not grow: {token} after {last_token}").into(),
            );
        }
        last_token = token;
    }

    println!("\n5 concurrent POST /orders/42/ship (on_fail = \"retry\": they wait in line)");
    let replies =
        futures_util::future::join_all((0..5).map(|_| post("/orders/42/ship".to_owned()))).await;
    let mut shipped = Vec::new();
    for r in replies {
        let (status, _, body) = r.map_err(|e| e.to_string())?;
        if status != StatusCode::OK {
            return Err(format!("every shipment should have run: {status} {body}").into());
        }
        shipped.push((token_of(&body)?, body));
    }
    // In the order they held the lock: one after another, each with a greater token.
    shipped.sort();
    for (token, body) in &shipped {
        println!("  200 OK: {body}");
        if *token <= last_token {
            return Err(
                format!("the fencing token did not grow: {token} after {last_token}").into(),
            );
        }
        last_token = *token;
    }
    let (submitted, shipped) = (
        state.submitted.load(Ordering::SeqCst),
        state.shipped.load(Ordering::SeqCst),
    );
    println!("\nhandlers ran: {submitted} submissions, {shipped} shipments");
    server.abort();
    if (submitted, shipped) != (2, 5) {
        return Err("expected 2 submissions and 5 shipments".into());
    }
    Ok(())
}
