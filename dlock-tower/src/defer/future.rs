//! [`ResponseFuture`] of [`Defer`](super::Defer), and what it does.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use dlock_runtime::{BoxError, LockKey};
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt as _;
use tower_service::Service;

use super::replay::ReplayRequest;
use super::Shared;
use crate::hex::encode as hex;
use crate::key::Extracted;
use crate::{FailMode, MissingKey, Rejection};

/// The response future of [`Defer`](super::Defer).
pub struct ResponseFuture<R, E> {
    inner: Pin<Box<dyn Future<Output = Result<R, E>> + Send>>,
}

impl<R, E> ResponseFuture<R, E> {
    pub(crate) fn new(fut: impl Future<Output = Result<R, E>> + Send + 'static) -> Self {
        ResponseFuture {
            inner: Box::pin(fut),
        }
    }
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

/// One request through the layer: extract the key, take the lock (one attempt), call the
/// service under it — or store the request and answer 202 when the lock is busy.
pub(crate) async fn respond<S, KF, ReqBody, ResBody>(
    extract: KF,
    mut inner: S,
    shared: Arc<Shared>,
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    KF: Future<Output = Extracted<ReqBody>>,
    ReqBody: Body,
    ReqBody::Error: Into<BoxError>,
    ResBody: From<String>,
{
    let (mut request, key) = match extract.await {
        Ok((request, Some(key))) => (request, key),
        Ok((request, None)) => {
            return match shared.missing_key {
                MissingKey::PassThrough => inner.call(request).await,
                _ => Ok(Rejection::missing_key().into_response()),
            }
        }
        Err(rejection) => return Ok(rejection.into_response()),
    };
    let key = match key.to_lock_key() {
        Ok(k) => k,
        Err(e) => return Ok(Rejection::from(e).into_response()),
    };
    match shared
        .locker
        .lock(key.clone())
        .ttl(shared.ttl())
        .name(shared.name)
        .try_acquire()
        .await
    {
        Ok(Some(guard)) => {
            request.extensions_mut().insert(guard.info());
            let call = guard.in_scope(|| inner.call(request));
            let out = dlock_runtime::with_lock(&guard, call).await;
            if let Err(e) = guard.release().await {
                tracing::warn!(
                    error = %shared.locker.trace_error(&e),
                    "dlock-tower: lock not cleanly released after the request"
                );
            }
            out
        }
        Ok(None) => Ok(defer(&shared, key, request).await),
        Err(e) if e.is_unavailable() && shared.fail_mode == FailMode::Open => {
            tracing::warn!(
                error = %shared.locker.trace_error(&e),
                "dlock-tower: lock backend unavailable, failing open: calling the service without a lock"
            );
            inner.call(request).await
        }
        Err(e) => Ok(Rejection::from(e).into_response()),
    }
}

/// Stores the request in the queue and answers `202 Accepted` with the job's status location.
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
    let bytes: Bytes = match limited.collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Rejection::body_too_large(shared.body_limit).into_response()
        }
        Err(e) => return Rejection::unreadable_body(e).into_response(),
    };
    let headers = shared
        .stored_headers(&parts.headers)
        .map(|(name, value)| (name.as_str().to_owned(), hex(value.as_bytes())))
        .collect();
    let job = ReplayRequest::new(
        key.as_str().to_owned(),
        parts.method.as_str().to_owned(),
        crate::uri::original(&parts.uri, &parts.extensions).to_string(),
        headers,
        hex(&bytes),
    );
    match shared
        .queue
        .enqueue(&job, &shared.policy, shared.ttl(), shared.policy.backoff(1))
        .await
    {
        Ok(job_id) => {
            let location = format!("{}/{job_id}", shared.status_path);
            let body = format!(
                "{{\"status\":202,\"title\":\"Accepted\",\"detail\":\"the resource is busy; the request will run when it frees\",\"job_id\":\"{job_id}\",\"status_url\":\"{location}\"}}"
            );
            let mut res = Response::new(R::from(body));
            *res.status_mut() = StatusCode::ACCEPTED;
            // Not the request's outcome: an idempotency layer outside must not store it.
            res.extensions_mut().insert(crate::Deferred::new(job_id));
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
