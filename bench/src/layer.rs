//! Scenario 5: an axum hello-world with and without `dlock_tower::DistributedLockLayer`
//! (keyed by a header whose value is unique per request, so no two requests contend), both
//! served and driven over real loopback HTTP/1.1 in this process by a hyper-util client.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use dlock_runtime::Locker;
use dlock_tower::{key, DistributedLockLayer};
use http_body_util::{BodyExt as _, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use crate::stats::{round1, round3, us, Sorted};
use crate::{BenchError, Plan};

/// Concurrent client connections of the throughput pass (each sends its requests one after
/// another). The latency pass uses one.
pub(crate) const CONNECTIONS: usize = 8;
const HEADER: &str = "x-bench-key";
const TTL: Duration = Duration::from_secs(10);

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

async fn serve(app: Router) -> Result<SocketAddr, BenchError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(addr)
}

const HELLO: &str = "hello, world";

fn app() -> Router {
    Router::new().route("/", get(|| async { HELLO }))
}

/// The floor of any Redis lock around a handler: the hello-world handler doing a hand-written
/// `SET key token NX PX` before and an `EVALSHA` compare-and-delete after, keyed by the same
/// header, on one shared multiplexed connection.
#[derive(Clone)]
struct RawLock {
    conn: redis::aio::MultiplexedConnection,
    sha: Arc<str>,
    seq: Arc<AtomicU64>,
}

async fn raw_locked(
    State(st): State<RawLock>,
    headers: HeaderMap,
) -> Result<&'static str, StatusCode> {
    let value = headers
        .get(HEADER)
        .and_then(|v| v.to_str().ok())
        .ok_or(StatusCode::BAD_REQUEST)?;
    let key = format!("raw:{value}");
    let token = format!("{:032x}", st.seq.fetch_add(1, Ordering::Relaxed));
    let mut conn = st.conn.clone();
    let set: redis::Value = redis::cmd("SET")
        .arg(&key)
        .arg(&token)
        .arg("NX")
        .arg("PX")
        .arg(TTL.as_millis() as u64)
        .query_async(&mut conn)
        .await
        .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    if !matches!(set, redis::Value::Okay) {
        return Err(StatusCode::CONFLICT);
    }
    let body = HELLO;
    let _: i64 = redis::cmd("EVALSHA")
        .arg(&*st.sha)
        .arg(1)
        .arg(&key)
        .arg(&token)
        .query_async(&mut conn)
        .await
        .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    Ok(body)
}

async fn raw_app(url: &str) -> Result<Router, BenchError> {
    let mut conn = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(crate::clients::RAW_UNLOCK)
        .query_async(&mut conn)
        .await?;
    let st = RawLock {
        conn,
        sha: sha.into(),
        seq: Arc::new(AtomicU64::new(0)),
    };
    Ok(Router::new().route("/", get(raw_locked)).with_state(st))
}

/// One pass: requests over a window.
pub(crate) struct Pass {
    pub(crate) requests: usize,
    pub(crate) secs: f64,
    pub(crate) lat: Sorted,
}

impl Pass {
    fn merge(self, o: Pass) -> Pass {
        Pass {
            requests: self.requests + o.requests,
            secs: self.secs + o.secs,
            lat: self.lat.merge(o.lat),
        }
    }

    pub(crate) fn rps(&self) -> f64 {
        self.requests as f64 / self.secs
    }
}

/// One app: a throughput pass with [`CONNECTIONS`] connections and a latency pass with one.
pub(crate) struct Http {
    pub(crate) load: Pass,
    pub(crate) seq: Pass,
}

impl Http {
    pub(crate) fn to_json(&self) -> Value {
        json!({
            "status": "ok",
            "rps": round1(self.load.rps()),
            "p50_us": us(self.load.lat.median()),
            "p99_us": us(self.load.lat.pct(99.0)),
            "requests": self.load.requests,
            "seconds": round3(self.load.secs),
            "connections": CONNECTIONS,
            "one_connection_rps": round1(self.seq.rps()),
            "one_connection_p50_us": us(self.seq.lat.median()),
            "one_connection_p99_us": us(self.seq.lat.pct(99.0)),
        })
    }
}

async fn drive(
    client: &HttpClient,
    addr: SocketAddr,
    tag: &str,
    connections: usize,
    plan: &Plan,
) -> Result<Pass, BenchError> {
    let start = Instant::now();
    let measure_from = start + plan.warm;
    let end = measure_from + plan.measure;
    let uri: hyper::Uri = format!("http://{addr}/").parse()?;
    let mut tasks = Vec::new();
    for c in 0..connections {
        let client = client.clone();
        let uri = uri.clone();
        let tag = tag.to_owned();
        tasks.push(tokio::spawn(async move {
            let (mut lat, mut last, mut i) = (Vec::new(), measure_from, 0u64);
            loop {
                let t0 = Instant::now();
                if t0 >= end {
                    break;
                }
                let req = hyper::Request::get(uri.clone())
                    .header(HEADER, format!("{tag}-{c}-{i}"))
                    .body(Empty::<Bytes>::new())?;
                i += 1;
                let res = client.request(req).await?;
                let status = res.status();
                res.into_body().collect().await?;
                if status != 200 {
                    return Err(format!("layer scenario: HTTP {status}").into());
                }
                if t0 >= measure_from {
                    let done = Instant::now();
                    lat.push(done - t0);
                    last = done;
                }
            }
            Ok::<_, BenchError>((lat, last))
        }));
    }
    let (mut all, mut last) = (Vec::new(), measure_from);
    for t in tasks {
        let (lat, l) = tokio::time::timeout(plan.warm + plan.measure + Duration::from_secs(60), t)
            .await
            .map_err(|_| "layer scenario: a client did not finish")???;
        all.extend(lat);
        last = last.max(l);
    }
    Ok(Pass {
        requests: all.len(),
        secs: (last - measure_from).as_secs_f64().max(1e-9),
        lat: Sorted::from_durations(all),
    })
}

/// The hello-world app: plain, with a hand-written lock in the handler (`raw`), and with
/// the layer (dlock over `url`).
pub(crate) async fn run(url: &str, plan: &Plan) -> Result<[Http; 3], BenchError> {
    let locker = Locker::from_url(url).await?;
    let plain = serve(app()).await?;
    let raw = serve(raw_app(url).await?).await?;
    let locked =
        serve(app().layer(DistributedLockLayer::new(locker, key::header(HEADER)).ttl(TTL))).await?;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    // The apps alternate, round by round, so that all see the same background load.
    let mut passes: [Option<Pass>; 6] = Default::default();
    for round in 0..plan.rounds {
        let runs = [
            (plain, "plain", CONNECTIONS),
            (raw, "raw", CONNECTIONS),
            (locked, "lock", CONNECTIONS),
            (plain, "plain-seq", 1),
            (raw, "raw-seq", 1),
            (locked, "lock-seq", 1),
        ];
        for (slot, (addr, tag, conns)) in passes.iter_mut().zip(runs) {
            let p = drive(&client, addr, &format!("{tag}-{round}"), conns, plan).await?;
            *slot = Some(match slot.take() {
                Some(prev) => prev.merge(p),
                None => p,
            });
        }
    }
    let [Some(a), Some(b), Some(c), Some(d), Some(e), Some(f)] = passes else {
        return Err("layer scenario: no rounds".into());
    };
    Ok([
        Http { load: a, seq: d },
        Http { load: b, seq: e },
        Http { load: c, seq: f },
    ])
}
