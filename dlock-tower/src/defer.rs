//! Defer per request: when a request's lock is busy, answer `202 Accepted` at once and run the
//! request later, when the lock frees — durably, through the runtime's Redis job queue.
//!
//! [`DeferLayer`] takes the request's lock like [`DistributedLockLayer`](crate::DistributedLockLayer)
//! (one attempt). If the lock is free it calls the inner service under the lock. If it is busy it
//! stores the request — method, URI, headers (minus hop-by-hop ones) and body (up to a limit;
//! larger is `413`) — as a job in a [`DurableQueue`] and answers
//!
//! ```text
//! 202 Accepted
//! Location: <status path>/<job id>
//! Content-Type: application/json
//!
//! {"status":202,"title":"Accepted","job_id":"…","status_url":"<status path>/<job id>"}
//! ```
//!
//! A [`replay_worker`] — one per instance, like any [`DurableWorker`] — claims the job when it is
//! due, takes the same lock, and replays the request through the service you give it, which must
//! be the application **without** the `DeferLayer` (the worker already holds the lock; going
//! through the layer again would find it busy). The response status is recorded as the job's
//! result; [`status_response`] serves it (for the queue's retention period) at the status path.
//! A busy lock on replay defers the job again with the policy's backoff, up to its attempts,
//! then dead-letters it. A replay whose response is a 5xx still counts as run: the handler ran,
//! and running it again could repeat its effects.
//!
//! Delivery is at least once (see `dlock_runtime::defer`'s durable queue): a replay can run
//! twice if its worker dies mid-request, so the handler should fence its writes with the
//! [`LockInfo`](dlock_runtime::LockInfo) it finds in the request extensions.
//!
//! Credentials are not stored by default: `Authorization`, `Cookie` and `Proxy-Authorization`
//! are left out of the stored request (so the replay runs without them) unless you opt a header
//! in by name with [`DeferLayer::store_header`] — it then sits in your Redis for as long as the
//! job lives (a dead letter for the queue's dead-letter retention, 7 days by default). List
//! other headers that must not be stored with [`DeferLayer::exclude_header`].
//!
//! The queue is bounded ([`QueueLimits::max_queued`](dlock_runtime::defer::QueueLimits)): when it
//! is full, a busy request gets `503 Service Unavailable` with `Retry-After` (problem type
//! `urn:dlock:problem:defer-queue-full`) and nothing already queued is lost. A stored request
//! that cannot be rebuilt (corrupt data) is dead-lettered at once with the reason.

use std::fmt;
use std::future::Future;
use std::mem;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use dlock_runtime::defer::{
    DeferPolicy, DurableQueue, DurableWorker, Job, JobContext, JobError, JobStatus,
    PermanentFailure,
};
use dlock_runtime::{BoxError, LockError, LockKey, Locker};
use http::{header, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body::Body;
use http_body_util::BodyExt as _;
use serde::{Deserialize, Serialize};
use tower_layer::Layer;
use tower_service::Service;

use crate::key::ExtractKey;
use crate::Rejection;

const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Headers that carry credentials: never stored unless opted in with
/// [`DeferLayer::store_header`].
const CREDENTIALS: [HeaderName; 3] = [
    header::AUTHORIZATION,
    header::COOKIE,
    header::PROXY_AUTHORIZATION,
];

/// Adds [`Defer`] to a service. See the [module docs](self).
pub struct DeferLayer<K> {
    extractor: K,
    shared: Arc<Shared>,
}

struct Shared {
    locker: Locker,
    queue: DurableQueue,
    policy: DeferPolicy,
    ttl: Duration,
    status_path: String,
    body_limit: usize,
    excluded: Vec<HeaderName>,
    stored_credentials: Vec<HeaderName>,
}

impl Shared {
    fn stores(&self, name: &HeaderName) -> bool {
        stores(name, &self.excluded, &self.stored_credentials)
    }
}

/// Whether header `name` goes into a stored request: not hop-by-hop, not excluded, and not a
/// credential unless opted in.
fn stores(name: &HeaderName, excluded: &[HeaderName], opted_in: &[HeaderName]) -> bool {
    !HOP_BY_HOP.contains(&name.as_str())
        && !excluded.contains(name)
        && (!CREDENTIALS.contains(name) || opted_in.contains(name))
}

impl<K: Clone> Clone for DeferLayer<K> {
    fn clone(&self) -> Self {
        DeferLayer {
            extractor: self.extractor.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<K> fmt::Debug for DeferLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeferLayer")
            .field("queue", &self.shared.queue)
            .field("policy", &self.shared.policy)
            .field("status_path", &self.shared.status_path)
            .finish_non_exhaustive()
    }
}

impl<K> DeferLayer<K> {
    /// Locks each request by `extractor`'s key with `locker`; defers busy ones into `queue`.
    /// Defaults: the policy `DeferPolicy::default()`, TTL 30 s, status path `/jobs`, body limit
    /// 1 MiB.
    pub fn new(locker: Locker, extractor: K, queue: DurableQueue) -> Self {
        DeferLayer {
            extractor,
            shared: Arc::new(Shared {
                locker,
                queue,
                policy: DeferPolicy::default(),
                ttl: Duration::from_secs(30),
                status_path: "/jobs".to_owned(),
                body_limit: 1 << 20,
                excluded: Vec::new(),
                stored_credentials: Vec::new(),
            }),
        }
    }

    fn shared_mut(&mut self) -> &mut Shared {
        Arc::get_mut(&mut self.shared).expect("configure the layer before cloning it")
    }

    /// How deferred requests are retried.
    pub fn policy(mut self, policy: DeferPolicy) -> Self {
        self.shared_mut().policy = policy;
        self
    }

    /// The lock's lease (renewed while the request runs).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.shared_mut().ttl = ttl;
        self
    }

    /// Where the status of a job is served (`Location: <path>/<job id>`).
    pub fn status_path(mut self, path: impl Into<String>) -> Self {
        self.shared_mut().status_path = path.into().trim_end_matches('/').to_owned();
        self
    }

    /// The largest request body that is stored for a replay; a larger one gets `413`.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        self.shared_mut().body_limit = bytes;
        self
    }

    /// A request header that is never stored (and so not replayed).
    pub fn exclude_header(mut self, name: HeaderName) -> Self {
        self.shared_mut().excluded.push(name);
        self
    }

    /// Stores (and so replays) a credential header that is left out by default:
    /// `Authorization`, `Cookie` or `Proxy-Authorization`. Its value then sits in the queue's
    /// Redis for as long as the job lives, dead letters included. Other headers are stored
    /// anyway; naming one here has no effect.
    pub fn store_header(mut self, name: HeaderName) -> Self {
        self.shared_mut().stored_credentials.push(name);
        self
    }
}

impl<S, K: Clone> Layer<S> for DeferLayer<K> {
    type Service = Defer<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        Defer {
            inner,
            extractor: self.extractor.clone(),
            shared: self.shared.clone(),
        }
    }
}

/// The service of [`DeferLayer`].
pub struct Defer<S, K> {
    inner: S,
    extractor: K,
    shared: Arc<Shared>,
}

impl<S: Clone, K: Clone> Clone for Defer<S, K> {
    fn clone(&self) -> Self {
        Defer {
            inner: self.inner.clone(),
            extractor: self.extractor.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, K> fmt::Debug for Defer<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Defer")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, K> Defer<S, K> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes `self`, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// The response future of [`Defer`].
pub struct ResponseFuture<R, E> {
    inner: Pin<Box<dyn Future<Output = Result<R, E>> + Send>>,
}

impl<R, E> fmt::Debug for ResponseFuture<R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ResponseFuture")
    }
}

impl<R, E> Future for ResponseFuture<R, E> {
    type Output = Result<R, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for Defer<S, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    K: ExtractKey<ReqBody>,
    K::Future: Send + 'static,
    ReqBody: Body + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: From<String> + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<Response<ResBody>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = mem::replace(&mut self.inner, clone);
        let extract = self.extractor.extract(request);
        let shared = self.shared.clone();
        ResponseFuture {
            inner: Box::pin(async move {
                let (mut request, key) = match extract.await {
                    Ok((request, Some(key))) => (request, key),
                    Ok((_, None)) => return Ok(Rejection::missing_key().into_response()),
                    Err(rejection) => return Ok(rejection.into_response()),
                };
                let key = match key.to_lock_key() {
                    Ok(k) => k,
                    Err(e) => return Ok(Rejection::from(e).into_response()),
                };
                match shared
                    .locker
                    .lock(key.clone())
                    .ttl(shared.ttl)
                    .try_acquire()
                    .await
                {
                    Ok(Some(guard)) => {
                        request.extensions_mut().insert(guard.info());
                        let out = dlock_runtime::with_lock(&guard, inner.call(request)).await;
                        if let Err(e) = guard.release().await {
                            tracing::warn!(error = %e, "dlock-tower: lock not cleanly released after the request");
                        }
                        out
                    }
                    Ok(None) => Ok(defer(&shared, key, request).await),
                    Err(e) => Ok(Rejection::from(e).into_response()),
                }
            }),
        }
    }
}

async fn defer<B, R>(shared: &Shared, key: LockKey, request: Request<B>) -> Response<R>
where
    B: Body,
    B::Error: Into<BoxError>,
    R: From<String>,
{
    let (parts, body) = request.into_parts();
    if body.size_hint().lower() > shared.body_limit as u64 {
        return Rejection::body_too_large(shared.body_limit).into_response();
    }
    let limited = http_body_util::Limited::new(body, shared.body_limit);
    let bytes = match limited.collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Rejection::body_too_large(shared.body_limit).into_response()
        }
        Err(_) => {
            return Rejection::new(
                StatusCode::BAD_REQUEST,
                "body-unreadable",
                "the request body could not be read",
            )
            .into_response()
        }
    };
    let headers = parts
        .headers
        .iter()
        .filter(|(name, _)| shared.stores(name))
        .map(|(name, value)| (name.as_str().to_owned(), hex(value.as_bytes())))
        .collect();
    let job = ReplayRequest {
        key: key.as_str().to_owned(),
        method: parts.method.as_str().to_owned(),
        uri: parts.uri.to_string(),
        headers,
        body: hex(&bytes),
    };
    match shared
        .queue
        .enqueue(&job, &shared.policy, shared.ttl, shared.policy.backoff(1))
        .await
    {
        Ok(job_id) => {
            let location = format!("{}/{job_id}", shared.status_path);
            let body = format!(
                "{{\"status\":202,\"title\":\"Accepted\",\"detail\":\"the resource is busy; the request will run when it frees\",\"job_id\":\"{job_id}\",\"status_url\":\"{location}\"}}"
            );
            let mut res = Response::new(R::from(body));
            *res.status_mut() = StatusCode::ACCEPTED;
            res.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            if let Ok(v) = HeaderValue::from_str(&location) {
                res.headers_mut().insert(header::LOCATION, v);
            }
            res
        }
        Err(e) => Rejection::from(e).into_response(),
    }
}

/// A deferred request, as stored in the queue.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReplayRequest {
    key: String,
    method: String,
    uri: String,
    /// Header name and hex-encoded value.
    headers: Vec<(String, String)>,
    /// Hex-encoded body.
    body: String,
}

impl ReplayRequest {
    /// Rebuilds the request. Stored data that does not decode is a [`PermanentFailure`]:
    /// retrying cannot fix it.
    fn to_request(&self) -> Result<Request<Bytes>, PermanentFailure> {
        let bad = |what: &str, e: &dyn fmt::Display| {
            PermanentFailure::new(format!("the stored request's {what} does not decode: {e}"))
        };
        let body = unhex(&self.body).map_err(|e| bad("body", &e))?;
        let mut req = Request::new(Bytes::from(body));
        *req.method_mut() =
            Method::from_bytes(self.method.as_bytes()).map_err(|e| bad("method", &e))?;
        *req.uri_mut() = self.uri.parse::<Uri>().map_err(|e| bad("URI", &e))?;
        for (name, value) in &self.headers {
            let value = unhex(value).map_err(|e| bad("header value", &e))?;
            req.headers_mut().append(
                HeaderName::from_bytes(name.as_bytes()).map_err(|e| bad("header name", &e))?,
                HeaderValue::from_bytes(&value).map_err(|e| bad("header value", &e))?,
            );
        }
        Ok(req)
    }
}

type ReplayFn = dyn Fn(Request<Bytes>) -> Pin<Box<dyn Future<Output = Result<u16, BoxError>> + Send>>
    + Send
    + Sync;

/// How a [`replay_worker`] calls the application: a type-erased service.
#[derive(Clone)]
pub struct Replayer(Arc<ReplayFn>);

impl fmt::Debug for Replayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Replayer")
    }
}

impl Job for ReplayRequest {
    const NAME: &'static str = "dlock-tower.replay";

    fn lock_key(&self) -> Result<LockKey, LockError> {
        LockKey::from_encoded(&self.key)
    }

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        let replayer = ctx.state::<Replayer>().ok_or(
            "this worker has no replayer: build it with dlock_tower::defer::replay_worker",
        )?;
        let mut request = self.to_request()?;
        request
            .extensions_mut()
            .insert(dlock_runtime::current_lock().ok_or("replayed without its lock")?);
        let status = (replayer.0)(request).await?;
        ctx.set_result(status.to_string());
        Ok(())
    }
}

/// A [`DurableWorker`] that replays the deferred requests of `queue` through `service` — the
/// application *without* the [`DeferLayer`]. Run it on every instance:
/// `tokio::spawn(async move { worker.run_until(shutdown).await })`.
pub fn replay_worker<S, B, R>(queue: DurableQueue, locker: Locker, service: S) -> DurableWorker
where
    S: Service<Request<B>, Response = Response<R>> + Clone + Send + Sync + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: From<Bytes> + Send + 'static,
    R: Send + 'static,
{
    let replay: Arc<ReplayFn> = Arc::new(move |request: Request<Bytes>| {
        let mut service = service.clone();
        Box::pin(async move {
            std::future::poll_fn(|cx| service.poll_ready(cx))
                .await
                .map_err(Into::into)?;
            let response = service
                .call(request.map(B::from))
                .await
                .map_err(Into::into)?;
            Ok(response.status().as_u16())
        })
    });
    DurableWorker::new(queue, locker)
        .state(Replayer(replay))
        .register::<ReplayRequest>()
}

/// The status of deferred request `job_id`, as a response: `200` with
/// `{"job_id":…,"state":"queued"|"running"|"completed"|"dead","result":"<HTTP status>"}`, or
/// `404` when the job is unknown (or its outcome is past retention).
pub async fn status_response<R: From<String>>(queue: &DurableQueue, job_id: &str) -> Response<R> {
    let status = match queue.status(job_id).await {
        Ok(s) => s,
        Err(e) => return Rejection::from(e).into_response(),
    };
    let (state, result) = match status {
        JobStatus::Queued => ("queued", None),
        JobStatus::Running => ("running", None),
        JobStatus::Completed { result } => ("completed", result),
        JobStatus::Dead => ("dead", None),
        _ => {
            return Rejection::new(StatusCode::NOT_FOUND, "job-unknown", "no such job")
                .into_response()
        }
    };
    let result = match result {
        Some(r) => format!(",\"result\":\"{}\"", r.replace(['"', '\\'], "")),
        None => String::new(),
    };
    let id: String = job_id.chars().filter(char::is_ascii_hexdigit).collect();
    let mut res = Response::new(R::from(format!(
        "{{\"job_id\":\"{id}\",\"state\":\"{state}\"{result}}}"
    )));
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    res
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Decodes lowercase or uppercase hex. Works on bytes, so no input can make it panic.
fn unhex(s: &str) -> Result<Vec<u8>, &'static str> {
    fn digit(b: u8) -> Result<u8, &'static str> {
        match b {
            b'0'..=b'9' => Ok(b - b'0'),
            b'a'..=b'f' => Ok(b - b'a' + 10),
            b'A'..=b'F' => Ok(b - b'A' + 10),
            _ => Err("not a hex digit"),
        }
    }
    let bytes = s.as_bytes();
    if bytes.len() % 2 != 0 {
        return Err("odd hex length");
    }
    bytes
        .chunks_exact(2)
        .map(|pair| Ok(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_arbitrary_bytes() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&bytes)).unwrap(), bytes);
        assert!(unhex("abc").is_err());
        assert!(unhex("zz").is_err());
    }

    #[test]
    fn corrupt_hex_is_an_error_never_a_panic() {
        // A multi-byte character across a digit pair used to panic on a str slice.
        for corrupt in ["aéb", "é0", "0é", "\u{1F600}", "+1", "0x", " 1"] {
            assert!(unhex(corrupt).is_err(), "{corrupt:?}");
        }
        let job = ReplayRequest {
            key: "k".into(),
            method: "POST".into(),
            uri: "/".into(),
            headers: vec![("x".into(), "aéb".into())],
            body: String::new(),
        };
        let err = job.to_request().unwrap_err();
        assert!(err.reason().contains("header value"), "{err}");
    }

    #[test]
    fn credentials_are_not_stored_unless_opted_in_by_name() {
        let excluded = [HeaderName::from_static("x-secret")];
        let none: [HeaderName; 0] = [];
        for name in [
            header::AUTHORIZATION,
            header::COOKIE,
            header::PROXY_AUTHORIZATION,
        ] {
            assert!(!stores(&name, &excluded, &none), "{name} stored by default");
        }
        assert!(stores(&header::CONTENT_TYPE, &excluded, &none));
        assert!(!stores(
            &HeaderName::from_static("x-secret"),
            &excluded,
            &none
        ));
        assert!(!stores(&header::CONNECTION, &excluded, &none));
        let opted = [header::AUTHORIZATION];
        assert!(stores(&header::AUTHORIZATION, &excluded, &opted));
        assert!(!stores(&header::COOKIE, &excluded, &opted));
    }

    #[test]
    fn stored_requests_rebuild_exactly() {
        let job = ReplayRequest {
            key: "hdr:idempotency-key:k1".into(),
            method: "POST".into(),
            uri: "/orders?x=1".into(),
            headers: vec![
                ("content-type".into(), hex(b"application/json")),
                ("x-bin".into(), hex(&[0x80, 0xff])),
            ],
            body: hex(b"{\"a\":1}"),
        };
        let req = job.to_request().unwrap();
        assert_eq!(req.method(), Method::POST);
        assert_eq!(req.uri(), "/orders?x=1");
        assert_eq!(req.headers()["content-type"], "application/json");
        assert_eq!(req.headers()["x-bin"].as_bytes(), &[0x80, 0xff]);
        assert_eq!(req.body().as_ref(), b"{\"a\":1}");
        assert_eq!(job.lock_key().unwrap().as_str(), "hdr:idempotency-key:k1");
    }
}
