//! # Payments with the `Idempotency-Key` header
//!
//! Shows `dlock_tower::IdempotencyLayer` on a payments endpoint (axum), without touching the
//! handler's logic:
//! * `POST /payments` with `Idempotency-Key` runs once per key and user. The response is stored
//!   with the key's lock, atomically, for 24 hours; a client that retries (after a timeout, a
//!   dropped connection, a double click) gets the stored response byte for byte with
//!   `Idempotent-Replayed: true`, and the card is charged once.
//! * A duplicate that arrives while the first one is still charging gets `409 Conflict` with
//!   `Retry-After`; the same key with a different payload gets `422`; no key gets `400` — all
//!   `application/problem+json`.
//! * Keys are scoped by the authenticated user (an auth layer puts `UserId` in the request
//!   extensions), so one user can never replay another's payment.
//! * A `5xx` (here: the payment provider is down) is not stored: the retry charges.
//! * The handler passes the lock's fencing token to the ledger, which refuses a stale holder
//!   (a process that crashed mid-charge and came back after its key was taken over).
//!
//! Run it:
//!
//! ```sh
//! cargo run -p dlock-examples --bin payments                 # in-memory records
//! DLOCK_REDIS_URL=redis://127.0.0.1:6379 \
//!   cargo run -p dlock-examples --bin payments               # Redis
//! cargo run -p dlock-examples --bin payments -- --serve      # keep serving on 127.0.0.1:3000
//! ```
//!
//! Without `--serve` it starts the service on a free port, plays a client against it with a
//! real HTTP client, prints every exchange and exits (non-zero if anything was unexpected).

use std::collections::HashMap;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Extension, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use dlock_runtime::{LockInfo, Locker};
use dlock_tower::IdempotencyLayer;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};

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

/// The payment provider's ledger: every charge, and the highest fencing token seen per key
/// (a write with a lower token comes from a holder that lost its lock, and is refused).
#[derive(Default)]
struct Ledger {
    charges: Mutex<Vec<Charge>>,
    fences: Mutex<HashMap<String, u64>>,
}

#[derive(Clone, Debug, Serialize)]
struct Charge {
    id: String,
    user: u64,
    amount_cents: u64,
    currency: String,
}

impl Ledger {
    fn charge(&self, lock: &LockInfo, charge: Charge) -> Result<Charge, &'static str> {
        let mut fences = self.fences.lock().unwrap();
        let seen = fences.entry(lock.key().to_owned()).or_default();
        if lock.fencing_token() < *seen {
            return Err("stale fencing token");
        }
        *seen = lock.fencing_token();
        self.charges.lock().unwrap().push(charge.clone());
        Ok(charge)
    }
}

#[derive(Deserialize)]
struct NewPayment {
    amount_cents: u64,
    currency: String,
}

async fn create_payment(
    State(ledger): State<Arc<Ledger>>,
    Extension(user): Extension<UserId>,
    Extension(lock): Extension<LockInfo>,
    headers: HeaderMap,
    Json(new): Json<NewPayment>,
) -> Response {
    // Talking to the payment provider takes a while.
    tokio::time::sleep(Duration::from_millis(200)).await;
    if headers.contains_key("x-simulate-outage") {
        // A 5xx is not stored: the client's retry (with the same key) runs again.
        return (StatusCode::BAD_GATEWAY, "payment provider unavailable").into_response();
    }
    let id = format!("pay_{}", ledger.charges.lock().unwrap().len() + 1);
    let charge = Charge {
        id: id.clone(),
        user: user.0,
        amount_cents: new.amount_cents,
        currency: new.currency,
    };
    match ledger.charge(&lock, charge) {
        Ok(charge) => (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/payments/{id}"))],
            Json(charge),
        )
            .into_response(),
        Err(why) => (StatusCode::CONFLICT, why).into_response(),
    }
}

fn app(locker: Locker, ledger: Arc<Ledger>) -> Router {
    // Layers added later run first: authentication, then idempotency, then the handler.
    Router::new()
        .route("/payments", post(create_payment))
        .route_layer(
            IdempotencyLayer::new(locker)
                .identity::<UserId>()
                .ttl(Duration::from_secs(30))
                .retention(Duration::from_secs(24 * 60 * 60)),
        )
        .route_layer(middleware::map_request(authenticate))
        .with_state(ledger)
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

struct Reply {
    status: StatusCode,
    replayed: bool,
    retry_after: Option<String>,
    body: String,
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let locker = match std::env::var("DLOCK_REDIS_URL") {
        Ok(url) => Locker::builder().prefix("dlock-demo").connect(&url).await?,
        Err(_) => Locker::memory(),
    };
    println!("idempotency records: {} backend", locker.backend_name());
    let ledger = Arc::new(Ledger::default());

    let serve = std::env::args().any(|a| a == "--serve");
    let addr: SocketAddr = if serve {
        ([127, 0, 0, 1], 3000).into()
    } else {
        ([127, 0, 0, 1], 0).into()
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(axum::serve(listener, app(locker, ledger.clone())).into_future());
    if serve {
        println!("serving on http://{addr} (POST /payments, Authorization: Bearer user-<n>)");
        server.await??;
        return Ok(());
    }

    // A key per run, so that runs against a shared Redis do not replay each other.
    let run = std::process::id();
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let pay = |user: u64, key: Option<String>, body: &'static str, outage: bool| {
        let client = client.clone();
        let mut req = hyper::Request::post(format!("http://{addr}/payments"))
            .header(header::AUTHORIZATION, format!("Bearer user-{user}"))
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        if outage {
            req = req.header("x-simulate-outage", "1");
        }
        async move {
            let res = client
                .request(req.body(Full::new(Bytes::from(body)))?)
                .await?;
            let status = res.status();
            let replayed = res.headers().contains_key("idempotent-replayed");
            let retry_after = res
                .headers()
                .get(header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = res.into_body().collect().await?.to_bytes();
            Ok::<_, BoxError>(Reply {
                status,
                replayed,
                retry_after,
                body: String::from_utf8_lossy(&body).into_owned(),
            })
        }
    };
    let show = |what: &str, r: &Reply| {
        let mut notes = String::new();
        if r.replayed {
            notes.push_str(" [Idempotent-Replayed]");
        }
        if let Some(s) = &r.retry_after {
            notes.push_str(&format!(" [Retry-After: {s}s]"));
        }
        println!("  {what}: {}{notes} {}", r.status, r.body);
    };
    let key = |name: &str| Some(format!("{name}-{run}"));
    let order = "{\"amount_cents\":4200,\"currency\":\"EUR\"}";

    println!("\n5 concurrent POST /payments, same user, same Idempotency-Key (a double click)");
    let replies =
        futures_util::future::try_join_all((0..5).map(|_| pay(1, key("checkout-7"), order, false)))
            .await?;
    for (i, r) in replies.iter().enumerate() {
        show(&format!("request {}", i + 1), r);
    }
    let created: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status == StatusCode::CREATED && !r.replayed)
        .collect();
    let [first] = created[..] else {
        return Err("expected exactly one payment to run".into());
    };
    let original = first.body.clone();
    // The others arrived while it ran (409) or after it was stored (an identical replay).
    let others_ok = replies.iter().all(|r| {
        r.status == StatusCode::CONFLICT
            || (r.status == StatusCode::CREATED && (!r.replayed || r.body == original))
    });
    if !others_ok {
        return Err("expected the other requests to get 409 or the replay".into());
    }

    println!("\nthe client retries after a timeout, same key and payload");
    let r = pay(1, key("checkout-7"), order, false).await?;
    show("retry", &r);
    if !(r.status == StatusCode::CREATED && r.replayed && r.body == original) {
        return Err("expected the stored response, replayed".into());
    }

    println!("\nthe same key with a different amount");
    let r = pay(
        1,
        key("checkout-7"),
        "{\"amount_cents\":9900,\"currency\":\"EUR\"}",
        false,
    )
    .await?;
    show("request", &r);
    if r.status != StatusCode::UNPROCESSABLE_ENTITY {
        return Err("expected 422 for a reused key".into());
    }

    println!("\nno Idempotency-Key");
    let r = pay(1, None, order, false).await?;
    show("request", &r);
    if r.status != StatusCode::BAD_REQUEST {
        return Err("expected 400 for a missing key".into());
    }

    println!("\nanother user happens to send the same key: their own payment");
    let r = pay(2, key("checkout-7"), order, false).await?;
    show("user 2", &r);
    if r.status != StatusCode::CREATED || r.replayed {
        return Err("expected a new payment for user 2".into());
    }

    println!("\nthe provider is down (502, not stored), the client retries with the same key");
    let r = pay(1, key("checkout-8"), order, true).await?;
    show("attempt 1", &r);
    let r2 = pay(1, key("checkout-8"), order, false).await?;
    show("attempt 2", &r2);
    let r3 = pay(1, key("checkout-8"), order, false).await?;
    show("attempt 3", &r3);
    if r.status != StatusCode::BAD_GATEWAY
        || r2.status != StatusCode::CREATED
        || r2.replayed
        || !r3.replayed
    {
        return Err("expected 502, then a payment, then its replay".into());
    }

    let charges = ledger.charges.lock().unwrap().clone();
    println!("\nthe ledger: {} charges", charges.len());
    for c in &charges {
        println!("  {c:?}");
    }
    if charges.len() != 3 {
        return Err("expected exactly three charges".into());
    }
    server.abort();
    Ok(())
}
