//! [`ResponseFuture`] of [`Idempotency`](super::Idempotency), and the request's lifecycle.

use std::fmt;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use dlock_runtime::idempotency::{Begin, IdempotentOperation};
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame};
use tower_service::Service;

use super::record::{is_storable, StoredResponse};
use super::request::{fingerprint, parse_key, scoped_key};
use super::{MissingIdentity, ResponseBody, Shared};
use crate::{FailMode, MissingKey, Rejection};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The response future of [`Idempotency`](super::Idempotency).
///
/// It owns the key's lock (an [`IdempotentOperation`]) while the inner service runs: dropping
/// it then (a cancelled request) drops the inner service's future and releases the lock in the
/// background **without** a record, so the client's retry runs the handler again. Once the
/// handler has returned, reading the response body and storing the record run in a spawned
/// task that finishes even if this future is dropped.
///
/// A boxed future (like axum's `from_fn`): the steps before and after the inner call (read the
/// body, begin, read the response, complete) are each asynchronous.
pub struct ResponseFuture<B, E>
where
    B: Body,
{
    inner: BoxFuture<Result<Response<ResponseBody<B>>, E>>,
}

impl<B: Body, E> ResponseFuture<B, E> {
    pub(crate) fn new(
        fut: impl Future<Output = Result<Response<ResponseBody<B>>, E>> + Send + 'static,
    ) -> Self {
        ResponseFuture {
            inner: Box::pin(fut),
        }
    }
}

impl<B: Body, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B: Body, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

fn reject<B: Body>(rejection: Rejection) -> Response<ResponseBody<B>> {
    rejection
        .into_response::<String>()
        .map(|body| ResponseBody::full(Bytes::from(body)))
}

fn missing_key(header: &http::HeaderName) -> Rejection {
    Rejection::new(
        StatusCode::BAD_REQUEST,
        "idempotency-key-missing",
        &format!("this operation is idempotent and requires an `{header}` header"),
    )
}

fn identity_missing(status: StatusCode) -> Rejection {
    Rejection::new(
        status,
        "idempotency-identity-missing",
        "this operation's idempotency keys are per client, and the request carries no client \
         identity",
    )
}

fn in_progress(retry_after: Option<Duration>) -> Rejection {
    let d = retry_after.unwrap_or(Duration::from_secs(1));
    let secs = (d.as_secs() + u64::from(d.subsec_nanos() > 0)).max(1);
    Rejection::new(
        StatusCode::CONFLICT,
        "idempotency-request-in-progress",
        "a request with this idempotency key is still being processed; retry later",
    )
    .with_retry_after(secs)
}

fn key_reused() -> Rejection {
    Rejection::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency-key-reused",
        "this idempotency key was used for a different request (method, path or body); \
         use a new key for a new request",
    )
}

/// A stored response encoded with `coding` (for the first request), which the retry does not
/// accept: replayed, it would be bytes the client cannot decode.
fn not_acceptable(coding: &str) -> Rejection {
    Rejection::new(
        StatusCode::NOT_ACCEPTABLE,
        "idempotency-replay-not-acceptable",
        &format!(
            "the stored response to this idempotency key is encoded with `{coding}`, which \
             this request's Accept-Encoding does not accept; retry accepting it"
        ),
    )
}

fn internal(kind: &str, detail: &str) -> Rejection {
    Rejection::new(StatusCode::INTERNAL_SERVER_ERROR, kind, detail)
}

/// Calls `inner` without idempotency (a method the layer does not cover, a request without a
/// key under [`MissingKey::PassThrough`], a failing-open backend).
async fn pass<S, ReqBody, ResBody>(
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body,
{
    let res = inner.call(request).await?;
    Ok(res.map(ResponseBody::inner))
}

/// Reads a request body of at most `limit` bytes.
async fn read_request_body<B: Body>(body: B, limit: usize) -> Result<Bytes, Rejection> {
    if body.size_hint().lower() > limit as u64 {
        return Err(Rejection::body_too_large(limit));
    }
    let mut body = pin!(body);
    let mut buf = BytesMut::new();
    while let Some(frame) = poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let frame = frame.map_err(|_| {
            Rejection::new(
                StatusCode::BAD_REQUEST,
                "body-unreadable",
                "the request body could not be read",
            )
        })?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers are not handed on
        };
        if buf.len().saturating_add(bytes::Buf::remaining(&data)) > limit {
            return Err(Rejection::body_too_large(limit));
        }
        buf.put(data);
    }
    Ok(buf.freeze())
}

/// A response body read to be stored.
enum Collected<B: Body> {
    /// All of it, within the limit.
    Full(Bytes),
    /// Not storable (over the limit, trailers, or a read error): what was read, the frame that
    /// stopped the reading, and the rest.
    Partial {
        prefix: Bytes,
        pending: Option<Result<Frame<Bytes>, B::Error>>,
        rest: Pin<Box<B>>,
    },
}

async fn read_response_body<B: Body<Data = Bytes>>(body: B, limit: usize) -> Collected<B> {
    let mut body = Box::pin(body);
    let mut buf = BytesMut::new();
    loop {
        let frame = poll_fn(|cx| body.as_mut().poll_frame(cx)).await;
        let stop = match frame {
            None => return Collected::Full(buf.freeze()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if buf.len().saturating_add(data.len()) <= limit => {
                    buf.put(data);
                    continue;
                }
                Ok(data) => Ok(Frame::data(data)),
                Err(trailers) => Ok(trailers),
            },
            Some(Err(e)) => Err(e),
        };
        return Collected::Partial {
            prefix: buf.freeze(),
            pending: Some(stop),
            rest: body,
        };
    }
}

/// Releases the key without a record, logging a failure (the TTL then frees it).
async fn abort(op: IdempotentOperation, shared: &Shared) {
    if let Err(err) = op.abort().await {
        tracing::warn!(
            error = %shared.locker.trace_error(&err),
            "dlock-tower: releasing an idempotency key without a record failed"
        );
    }
}

/// The whole lifecycle of one request (see the [module docs](super)).
pub(crate) async fn run<S, ReqBody, ResBody>(
    shared: Arc<Shared>,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: Body + From<Bytes>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    if !shared.methods.contains(request.method()) {
        return pass(inner, request).await;
    }
    let key = match parse_key(request.headers(), &shared.header, shared.max_key_len) {
        Ok(Some(key)) => key,
        Ok(None) => {
            return match shared.missing_key {
                MissingKey::PassThrough => pass(inner, request).await,
                _ => Ok(reject(missing_key(&shared.header))),
            }
        }
        Err(rejection) => return Ok(reject(rejection)),
    };
    let identity = match shared.identity.as_ref() {
        None => None,
        Some(identity) => match identity(request.extensions()) {
            Some(id) => Some(id),
            None => match shared.missing_identity {
                MissingIdentity::SharedSpace => None,
                MissingIdentity::RejectWith(status) => return Ok(reject(identity_missing(status))),
                _ => return Ok(reject(identity_missing(StatusCode::UNAUTHORIZED))),
            },
        },
    };
    let lock_key = match scoped_key(identity.as_deref(), &key).to_lock_key() {
        Ok(k) => k,
        Err(err) => return Ok(reject(Rejection::from(err))),
    };

    let (parts, body) = request.into_parts();
    let body = match read_request_body(body, shared.max_request_body).await {
        Ok(bytes) => bytes,
        Err(rejection) => return Ok(reject(rejection)),
    };
    let uri = crate::uri::original(&parts.uri, &parts.extensions);
    let fingerprint = fingerprint(&parts.method, uri, &body);
    let mut request = Request::from_parts(parts, ReqBody::from(body));

    let mut begin = shared
        .locker
        .idempotency(lock_key, fingerprint)
        .retention(shared.retention)
        .name(shared.name);
    if let Some(ttl) = shared.ttl {
        begin = begin.ttl(ttl);
    }
    let op = match begin.begin().await {
        Ok(Begin::Run(op)) => op,
        Ok(Begin::Replay(record)) => {
            return Ok(match StoredResponse::decode(record) {
                Some(stored) => match stored.unacceptable_coding(request.headers()) {
                    Some(coding) => reject(not_acceptable(&coding)),
                    None => stored.into_response(),
                },
                None => {
                    tracing::error!("dlock-tower: a stored idempotency record is unreadable");
                    reject(internal(
                        "idempotency-record-unreadable",
                        "the stored response for this idempotency key cannot be read",
                    ))
                }
            });
        }
        Ok(Begin::InProgress {
            same_fingerprint: false,
            ..
        })
        | Ok(Begin::Mismatch) => return Ok(reject(key_reused())),
        Ok(Begin::InProgress { retry_after, .. }) => return Ok(reject(in_progress(retry_after))),
        Ok(_) => {
            return Ok(reject(internal(
                "idempotency-unexpected",
                "the idempotency store answered something this layer does not know",
            )))
        }
        Err(err) if err.is_unavailable() && shared.fail_mode == FailMode::Open => {
            tracing::warn!(
                error = %shared.locker.trace_error(&err),
                "dlock-tower: idempotency store unavailable, failing open: \
                 calling the service without idempotency"
            );
            return pass(inner, request).await;
        }
        Err(err) => return Ok(reject(Rejection::from(err))),
    };

    // The handler runs with the lock visible in its extensions and to `current_lock()`.
    request.extensions_mut().insert(op.info());
    let response = {
        let mut call = pin!(inner.call(request));
        poll_fn(|cx| op.poll_scoped(call.as_mut(), cx)).await
    };
    let response = match response {
        Ok(response) => response,
        Err(err) => {
            abort(op, &shared).await;
            return Err(err);
        }
    };

    let (head, body) = response.into_parts();
    if !is_storable(head.status) || body.size_hint().lower() > shared.max_response_body as u64 {
        abort(op, &shared).await;
        return Ok(Response::from_parts(head, ResponseBody::inner(body)));
    }
    // The handler has produced its response: from here on, storing it must finish even if
    // this future is dropped (a timeout layer gives up, the client goes away) — otherwise the
    // client's retry would run the handler again. So the rest runs in its own task, which this
    // future only waits for.
    let store = finish(op, head, body, shared.clone());
    let (head, answer) = match tokio::runtime::Handle::try_current() {
        Ok(runtime) => match runtime.spawn(store).await {
            Ok(done) => done,
            Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
            Err(_) => {
                return Ok(reject(internal(
                    "idempotency-store-cancelled",
                    "the server is shutting down; the response could not be stored",
                )))
            }
        },
        // No tokio runtime to hand the work to: do it here (a dropped future then stores
        // nothing, and the retry runs again).
        Err(_) => store.await,
    };
    Ok(match answer {
        Collected::Full(bytes) => Response::from_parts(head, ResponseBody::full(bytes)),
        Collected::Partial {
            prefix,
            pending,
            rest,
        } => Response::from_parts(head, ResponseBody::chain(prefix, pending, rest)),
    })
}

/// Reads the response body (up to the limit) and stores the record with the release — or
/// releases without a record when the body is not storable.
async fn finish<B>(
    op: IdempotentOperation,
    head: http::response::Parts,
    body: B,
    shared: Arc<Shared>,
) -> (http::response::Parts, Collected<B>)
where
    B: Body<Data = Bytes>,
{
    let collected = read_response_body(body, shared.max_response_body).await;
    match &collected {
        Collected::Full(bytes) => {
            let stored = StoredResponse::capture(&head, &shared.replay_headers, bytes.clone());
            if let Err(err) = op.complete(&stored.encode()).await {
                // The client still gets its response; without a record, a retry runs again.
                tracing::warn!(
                    error = %shared.locker.trace_error(&err),
                    "dlock-tower: storing the idempotent response failed"
                );
            }
        }
        Collected::Partial { .. } => abort(op, &shared).await,
    }
    (head, collected)
}
