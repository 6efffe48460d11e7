//! # An actix-web order service protected against double submission
//!
//! The actix-web twin of `orders_axum.rs`: `#[distributed_lock]` on an actix-web handler
//! (whose future is not `Send` — the attribute adds no `Send` bound), with `LockError` turned
//! into `409 Conflict` + `Retry-After` + problem+json by its `actix_web::ResponseError` impl
//! (feature `actix`).
//!
//! ```sh
//! cargo run -p dlock-examples --bin orders-actix                  # in-memory locks
//! DLOCK_REDIS_URL=redis://127.0.0.1:6379 \
//!   cargo run -p dlock-examples --bin orders-actix                # Redis
//! cargo run -p dlock-examples --bin orders-actix -- --serve       # keep serving on 127.0.0.1:3001
//! ```
//!
//! Without `--serve` it fires 10 concurrent duplicate submissions at itself, prints the
//! outcome and exits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actix_web::{web, App, HttpResponse, HttpServer};
use dlock_runtime::{distributed_lock, Locker};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

struct Orders {
    locker: Locker,
    created: AtomicU64,
}

/// One submission per order at a time, across every instance sharing the locker.
#[distributed_lock(
    key = "order:<id>",
    ttl = "10s",
    on_fail = "reject",
    locker = orders.locker,
    message = "this order is already being submitted; try again in a few seconds"
)]
async fn submit(orders: web::Data<Orders>, id: web::Path<u64>) -> HttpResponse {
    let lock = dlock_runtime::current_lock().expect("the attribute holds the lock here");
    // The slow part: reserving stock, charging the card.
    tokio::time::sleep(Duration::from_millis(300)).await;
    orders.created.fetch_add(1, Ordering::SeqCst);
    HttpResponse::Created().body(format!(
        "order {id} created, fencing token {}",
        lock.fencing_token()
    ))
}

#[actix_web::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let locker = match std::env::var("DLOCK_REDIS_URL") {
        Ok(url) => Locker::builder().prefix("dlock-demo").connect(&url).await?,
        Err(_) => Locker::memory(),
    };
    println!("locks: {} backend", locker.backend_name());
    let orders = web::Data::new(Orders {
        locker,
        created: AtomicU64::new(0),
    });
    let serve = std::env::args().any(|a| a == "--serve");
    let data = orders.clone();
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .route("/orders/{id}/submit", web::post().to(submit))
    })
    .workers(2)
    .bind(("127.0.0.1", if serve { 3001 } else { 0 }))?;
    let addr = server.addrs()[0];
    let server = server.run();
    if serve {
        println!("serving on http://{addr} (POST /orders/{{id}}/submit)");
        server.await?;
        return Ok(());
    }
    let handle = server.handle();
    actix_web::rt::spawn(server);

    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("http://{addr}/orders/7/submit");
    println!("10 concurrent POST /orders/7/submit");
    let replies = futures_util::future::join_all((0..10).map(|_| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let res = client
                .request(hyper::Request::post(url).body(Empty::new())?)
                .await?;
            let status = res.status();
            let retry_after = res
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = res.into_body().collect().await?.to_bytes();
            Ok::<_, Box<dyn std::error::Error>>((
                status,
                retry_after,
                String::from_utf8_lossy(&body).into_owned(),
            ))
        }
    }))
    .await;
    let (mut created, mut conflicts) = (0, 0);
    for r in replies {
        let (status, retry_after, body) = r?;
        match &retry_after {
            Some(ra) => println!("  {status} (Retry-After: {ra}s): {body}"),
            None => println!("  {status}: {body}"),
        }
        match status.as_u16() {
            201 => created += 1,
            409 if retry_after.is_some() => conflicts += 1,
            _ => return Err(format!("unexpected answer {status}: {body}").into()),
        }
    }
    let ran = orders.created.load(Ordering::SeqCst);
    println!("handler ran {ran} time(s)");
    handle.stop(true).await;
    if (created, conflicts, ran) != (1, 9, 1) {
        return Err("expected exactly one submission to run and nine 409s".into());
    }
    Ok(())
}
