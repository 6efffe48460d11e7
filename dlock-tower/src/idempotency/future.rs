//! [`ResponseFuture`] of [`Idempotency`](super::Idempotency), and the request's lifecycle.

use std::fmt;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use dlock_runtime::idempotency::{Begin, IdempotentOperation};
use dlock_runtime::LockInfo;
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
/// Once the key is taken, the inner service's future, reading the response body and storing
/// the record run in a spawned task that finishes even if this future is dropped (a client
/// that went away): the retry gets the replay. With
/// [`cancel_on_disconnect(true)`](super::IdempotencyLayer::cancel_on_disconnect), or when a
/// lock is held outside the layer ([why](super#with-the-lock-and-defer-layers)), it owns the
/// key's lock (an [`IdempotentOperation`]) while the inner service runs: dropping it then drops
/// the inner service's future and releases the lock in the background **without** a record,
/// so the client's retry runs the handler again; only the storing runs in a task.
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
async fn read_request_body<B>(body: B, limit: usize) -> Result<Bytes, Rejection>
where
    B: Body,
    B::Error: Into<dlock_runtime::BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(Rejection::body_too_large(limit));
    }
    let mut body = pin!(body);
    let mut buf = BytesMut::new();
    while let Some(frame) = poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let frame = frame.map_err(|e| Rejection::unreadable_body(e.into()))?;
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
    /// Not storable (over the limit, trailers, a read error, or still streaming after the
    /// wait): what was read, the frame that stopped the reading (if one did), and the rest.
    Partial {
        prefix: Bytes,
        pending: Option<Result<Frame<Bytes>, B::Error>>,
        rest: Pin<Box<B>>,
    },
}

/// Reads a response body of at most `limit` bytes that ends within `wait` (counted when a
/// tokio runtime is at hand).
async fn read_response_body<B: Body<Data = Bytes>>(
    body: B,
    limit: usize,
    wait: Duration,
) -> Collected<B> {
    let mut body = Box::pin(body);
    let mut buf = BytesMut::new();
    let deadline = tokio::runtime::Handle::try_current()
        .ok()
        .and_then(|_| tokio::time::Instant::now().checked_add(wait));
    loop {
        let next = poll_fn(|cx| body.as_mut().poll_frame(cx));
        let frame = match deadline {
            Some(at) => match tokio::time::timeout_at(at, next).await {
                Ok(frame) => frame,
                // Still streaming: hand on what was read, and the rest as it comes.
                Err(_) => {
                    return Collected::Partial {
                        prefix: buf.freeze(),
                        pending: None,
                        rest: body,
                    }
                }
            },
            None => next.await,
        };
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
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes>,
    ReqBody::Error: Into<dlock_runtime::BoxError>,
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
            Ok(Some(id)) => Some(id),
            Err(fmt::Error) => {
                return Ok(reject(internal(
                    "idempotency-identity-unformattable",
                    "the request's identity could not be formatted (its Display implementation \
                     returned an error)",
                )))
            }
            Ok(None) => match shared.missing_identity {
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

    // A lock taken outside this layer (a lock or defer layer, a replay worker) shows in the
    // task's scope and in the extensions. It is released when this future is dropped, so the
    // handler must not outlive it; its `LockInfo` is the one the handler fences with.
    let outer_info = request.extensions().get::<LockInfo>().is_some();
    let outer_lock = outer_info || dlock_runtime::current_lock().is_some();
    // The handler runs with the key's lock visible to `current_lock()` (innermost), and in its
    // extensions unless an outer lock's is there.
    if !outer_info {
        request.extensions_mut().insert(op.info());
    }
    let call = op.in_scope(|| inner.call(request));
    let handled = if shared.cancel_on_disconnect || outer_lock {
        // Dropping this future drops the handler's (before an outer lock is released); only
        // the storing is detached. A detached handler would run on after the outer lock was
        // released, beside the next request that takes it, and outside its scope.
        handle(op, call, shared.clone(), true).await?
    } else {
        // Once the key is taken the handler runs to its end, also if this future is dropped
        // (a client that went away): otherwise the client's retry would run it again, from
        // the start, after it was cut off anywhere.
        let handling = handle(op, call, shared.clone(), false);
        match detached(&shared.in_flight, handling).await {
            Some(handled) => handled?,
            None => Err(internal(
                "idempotency-handler-cancelled",
                "the server is shutting down; the request did not finish",
            )),
        }
    };
    Ok(match handled {
        Err(rejection) => reject(rejection),
        Ok(Handled::Unstored(response)) => response.map(ResponseBody::inner),
        Ok(Handled::Read(head, Collected::Full(bytes))) => {
            Response::from_parts(head, ResponseBody::full(bytes))
        }
        Ok(Handled::Read(
            head,
            Collected::Partial {
                prefix,
                pending,
                rest,
            },
        )) => Response::from_parts(head, ResponseBody::chain(prefix, pending, rest)),
    })
}

/// What became of the handler's response.
enum Handled<B: Body> {
    /// Not to be stored (its status, a [`Deferred`](crate::Deferred) mark, or a declared
    /// length over the limit): handed on as is.
    Unstored(Response<B>),
    /// Read (up to the limit) and stored, or not stored with what was read.
    Read(http::response::Parts, Collected<B>),
}

/// Runs the handler's future `call` with the key's lock, then stores its response with the
/// release (or releases without a record). `detach_store`: the storing runs in a task of its
/// own, which finishes even if this future is dropped once the handler has returned.
async fn handle<F, B, E>(
    op: IdempotentOperation,
    call: F,
    shared: Arc<Shared>,
    detach_store: bool,
) -> Result<Result<Handled<B>, Rejection>, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Send + 'static,
{
    let response = {
        let mut call = pin!(call);
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
    // A deferred request's `202` is not its outcome: its replay runs the handler.
    let deferred = head.extensions.get::<crate::Deferred>().is_some();
    if deferred
        || !is_storable(head.status)
        || body.size_hint().lower() > shared.max_response_body as u64
    {
        abort(op, &shared).await;
        return Ok(Ok(Handled::Unstored(Response::from_parts(head, body))));
    }
    let store = finish(op, head, body, shared.clone());
    let stored = if detach_store {
        detached(&shared.in_flight, store).await
    } else {
        Some(store.await)
    };
    Ok(match stored {
        Some((head, collected)) => Ok(Handled::Read(head, collected)),
        None => Err(internal(
            "idempotency-store-cancelled",
            "the server is shutting down; the response could not be stored",
        )),
    })
}

/// Runs `fut` to its end in a tokio task of its own (with the caller's tracing span, counted
/// in `in_flight` until it ends or is dropped), which goes on if this future is dropped;
/// `None` when the runtime shut down first. A panic in `fut` is resumed here. Without a tokio
/// runtime to hand it to, `fut` runs here (and a dropped future then drops it).
async fn detached<T: Send + 'static>(
    in_flight: &super::InFlight,
    fut: impl Future<Output = T> + Send + 'static,
) -> Option<T> {
    use tracing::Instrument as _;
    let ticket = in_flight.enter();
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return Some(fut.await);
    };
    let counted = async move {
        let _ticket = ticket;
        fut.await
    };
    match runtime
        .spawn(counted.instrument(tracing::Span::current()))
        .await
    {
        Ok(out) => Some(out),
        Err(err) if err.is_panic() => std::panic::resume_unwind(err.into_panic()),
        Err(_) => None,
    }
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
    let collected =
        read_response_body(body, shared.max_response_body, shared.max_response_wait).await;
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
