//! The stored request, its replay by a [`DurableWorker`], and the status lookup.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use dlock_runtime::durable::{
    DurableQueue, DurableWorker, Job, JobContext, JobError, JobStatus, PermanentFailure,
};
use dlock_runtime::{BoxError, LockError, LockKey, Locker};
use http::{header, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use serde::{Deserialize, Serialize};
use tower_service::Service;

use crate::Rejection;

#[cfg(doc)]
use super::DeferLayer;

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
    pub(crate) fn new(
        key: String,
        method: String,
        uri: String,
        headers: Vec<(String, String)>,
        body: String,
    ) -> Self {
        ReplayRequest {
            key,
            method,
            uri,
            headers,
            body,
        }
    }

    /// Rebuilds the request. Stored data that does not decode is a [`PermanentFailure`]:
    /// retrying cannot fix it.
    fn to_request(&self) -> Result<Request<Bytes>, PermanentFailure> {
        let bad = |what: &str, e: &dyn fmt::Display| {
            PermanentFailure::new(format!("the stored request's {what} does not decode: {e}"))
        };
        let body = crate::hex::decode(&self.body).map_err(|e| bad("body", &e))?;
        let mut req = Request::new(Bytes::from(body));
        *req.method_mut() =
            Method::from_bytes(self.method.as_bytes()).map_err(|e| bad("method", &e))?;
        *req.uri_mut() = self.uri.parse::<Uri>().map_err(|e| bad("URI", &e))?;
        for (name, value) in &self.headers {
            let value = crate::hex::decode(value).map_err(|e| bad("header value", &e))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_request_with_corrupt_hex_is_a_permanent_failure() {
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
    fn stored_requests_rebuild_exactly() {
        let job = ReplayRequest {
            key: "hdr:idempotency-key:k1".into(),
            method: "POST".into(),
            uri: "/orders?x=1".into(),
            headers: vec![
                (
                    "content-type".into(),
                    crate::hex::encode(b"application/json"),
                ),
                ("x-bin".into(), crate::hex::encode(&[0x80, 0xff])),
            ],
            body: crate::hex::encode(b"{\"a\":1}"),
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
