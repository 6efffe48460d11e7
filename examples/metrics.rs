//! # dlock's metrics, scraped by Prometheus
//!
//! With the `metrics` feature of `dlock-runtime` (and of `dlock-tower` for the layers), dlock
//! records its metrics through the `metrics` crate facade; any exporter shows them. Here the
//! Prometheus exporter (`metrics-exporter-prometheus`, without its own HTTP listener) renders
//! them on an axum route, `GET /metrics`:
//! * `dlock_acquire_total{backend,name,outcome}` — lock requests by outcome;
//! * `dlock_locks_held`, `dlock_waiters` — gauges; `dlock_hold_seconds`,
//!   `dlock_acquire_wait_seconds`, `dlock_handoff_seconds` — summaries;
//! * and the rest listed in `dlock_runtime::metrics`, all labelled by backend and by a bounded
//!   name (here `report`: `LockRequest::name`), never by the key.
//!
//! ```sh
//! cargo run -p dlock-examples --bin metrics                 # in-memory locks
//! DLOCK_URL=redis://127.0.0.1:6379 cargo run -p dlock-examples --bin metrics
//! cargo run -p dlock-examples --bin metrics -- --serve      # keep serving on 127.0.0.1:9000/metrics
//! ```
//!
//! Without `--serve` it takes a few locks (free, busy, waited for), scrapes its own
//! `/metrics` over HTTP, prints the dlock lines and exits — non-zero if a value is not what the
//! run must have produced.

use std::collections::BTreeMap;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use dlock_runtime::{Locker, OnFail};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The service's metrics endpoint; mount it where your Prometheus scrapes.
fn app(metrics: PrometheusHandle) -> Router {
    Router::new().route(
        "/metrics",
        get(move || std::future::ready(metrics.render())),
    )
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // Install the exporter's recorder once, at startup, then describe dlock's metrics to it.
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)?;
    dlock_runtime::metrics::describe();

    let locker = match std::env::var("DLOCK_URL") {
        Ok(url) => Locker::builder().prefix("dlock-demo").connect(&url).await?,
        Err(_) => Locker::memory(),
    };
    let backend = locker.backend_name();
    println!("locks: {backend} backend");

    let serve = std::env::args().any(|a| a == "--serve");
    let addr: SocketAddr = if serve {
        ([127, 0, 0, 1], 9000).into()
    } else {
        ([127, 0, 0, 1], 0).into()
    };
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(axum::serve(listener, app(handle)).into_future());

    // Three reports built one after another.
    for month in ["2026-09", "2026-10", "2026-11"] {
        let guard = locker
            .lock(format!("report:{month}"))
            .name("report")
            .acquire()
            .await?;
        guard.release().await?;
    }
    // Two requests that find a report being built, and one that waits for it.
    let held = locker
        .lock("report:2026-12")
        .name("report")
        .acquire()
        .await?;
    assert!(locker
        .lock("report:2026-12")
        .name("report")
        .try_acquire()
        .await?
        .is_none());
    assert!(locker
        .lock("report:2026-12")
        .name("report")
        .acquire()
        .await
        .is_err());
    let waiter = tokio::spawn({
        let locker = locker.clone();
        async move {
            let guard = locker
                .lock("report:2026-12")
                .name("report")
                .on_fail(OnFail::retry(Duration::from_secs(10)))
                .acquire()
                .await?;
            guard.release().await
        }
    });
    while locker.waiting() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    held.release().await?;
    waiter.await??;

    if serve {
        println!("serving on http://{addr}/metrics");
        server.await??;
        return Ok(());
    }

    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let res = client
        .request(hyper::Request::get(format!("http://{addr}/metrics")).body(Empty::new())?)
        .await?;
    let status = res.status();
    let text = String::from_utf8(res.into_body().collect().await?.to_bytes().to_vec())?;
    println!("GET /metrics: {status}");
    for line in text.lines().filter(|l| l.contains("dlock_")) {
        println!("  {line}");
    }

    let samples = parse(&text);
    let value = |name: &str, extra: &[(&str, &str)]| -> f64 {
        let mut labels = vec![("backend", backend), ("name", "report")];
        labels.extend_from_slice(extra);
        let labels: BTreeMap<String, String> = labels
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        samples
            .get(&(name.to_owned(), labels))
            .copied()
            .unwrap_or(f64::NAN)
    };
    let expected = [
        ("dlock_acquire_total", vec![("outcome", "acquired")], 5.0),
        ("dlock_acquire_total", vec![("outcome", "contended")], 2.0),
        ("dlock_locks_held", vec![], 0.0),
        ("dlock_waiters", vec![], 0.0),
        ("dlock_hold_seconds_count", vec![], 5.0),
        ("dlock_acquire_wait_seconds_count", vec![], 5.0),
        ("dlock_handoff_seconds_count", vec![], 1.0),
    ];
    let mut wrong = Vec::new();
    for (name, labels, want) in expected {
        let got = value(name, &labels);
        if got != want {
            wrong.push(format!("{name}{labels:?}: {got}, expected {want}"));
        }
    }
    if !status.is_success() || !text.contains("# HELP dlock_acquire_total") || !wrong.is_empty() {
        return Err(format!("unexpected metrics: {wrong:?}").into());
    }
    println!("all dlock metrics as expected");
    server.abort();
    Ok(())
}

/// The samples of a Prometheus text exposition: `(name, labels) → value`.
fn parse(text: &str) -> BTreeMap<(String, BTreeMap<String, String>), f64> {
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (name, labels) = match series.split_once('{') {
            Some((name, rest)) => (name, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let labels = labels
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.trim_matches('"').to_owned()))
            .collect();
        if let Ok(v) = value.parse() {
            out.insert((name.to_owned(), labels), v);
        }
    }
    out
}
