//! [`ResponseFuture`] of [`DistributedLock`](super::DistributedLock).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use dlock_runtime::{LockError, LockGuard, LockKey};
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::{FailMode, MissingKey, Shared};
use crate::key::ExtractKey;
use crate::Rejection;

type AcquireFuture = Pin<Box<dyn Future<Output = Result<LockGuard, LockError>> + Send>>;
type ReleaseFuture = Pin<Box<dyn Future<Output = Result<(), LockError>> + Send>>;
type LostFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

pin_project! {
    /// The response future of [`DistributedLock`](super::DistributedLock): extracts the key,
    /// takes the lock, calls the inner service, releases the lock.
    ///
    /// It owns the [`LockGuard`] while the inner service runs: dropping this future (a
    /// cancelled request) drops the inner service's future first, then the guard, which
    /// releases the lock in the background.
    pub struct ResponseFuture<K, S, ReqBody>
    where
        K: ExtractKey<ReqBody>,
        S: Service<Request<ReqBody>>,
    {
        // Declared before `guard`: on drop, the handler stops before the lock is released.
        #[pin]
        state: State<K::Future, S::Future, ReqBody, S::Response>,
        guard: Option<Arc<LockGuard>>,
        // With `cancel_on_lost`: resolves when the guard's lock is lost (holds a clone of it).
        lost: Option<LostFuture>,
        inner: Option<S>,
        shared: Arc<Shared>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<KF, SF, ReqBody, Res> {
        Extract { #[pin] fut: KF },
        Acquire { fut: AcquireFuture, request: Option<Request<ReqBody>> },
        Call { #[pin] fut: SF },
        Release { fut: ReleaseFuture, response: Option<Res> },
        Done,
    }
}

impl<K, S, ReqBody> ResponseFuture<K, S, ReqBody>
where
    K: ExtractKey<ReqBody>,
    S: Service<Request<ReqBody>>,
{
    pub(crate) fn new(extract: K::Future, inner: S, shared: Arc<Shared>) -> Self {
        ResponseFuture {
            state: State::Extract { fut: extract },
            guard: None,
            lost: None,
            inner: Some(inner),
            shared,
        }
    }
}

fn acquire(shared: &Arc<Shared>, key: LockKey) -> AcquireFuture {
    let shared = shared.clone();
    Box::pin(async move {
        let mut request = shared.locker.lock(key).name(shared.name);
        if let Some(ttl) = shared.ttl {
            request = request.ttl(ttl);
        }
        if let Some(on_fail) = &shared.on_fail {
            request = request.on_fail(on_fail.clone());
        }
        request.acquire().await
    })
}

impl<K, S, ReqBody, ResBody> Future for ResponseFuture<K, S, ReqBody>
where
    K: ExtractKey<ReqBody>,
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: From<String>,
{
    type Output = Result<Response<ResBody>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            // Each arm either returns or moves to the next state; a request goes on to
            // `call` with `request`.
            let request = match this.state.as_mut().project() {
                StateProj::Extract { fut } => {
                    let (request, key) = match ready!(fut.poll(cx)) {
                        Ok(found) => found,
                        Err(rejection) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(rejection.into_response()));
                        }
                    };
                    match key.map(|k| k.to_lock_key()) {
                        Some(Ok(key)) => {
                            let fut = acquire(this.shared, key);
                            this.state.set(State::Acquire {
                                fut,
                                request: Some(request),
                            });
                            continue;
                        }
                        Some(Err(err)) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(this.shared.reject(err)));
                        }
                        None => match this.shared.missing_key {
                            MissingKey::PassThrough => request,
                            MissingKey::Reject => {
                                this.state.set(State::Done);
                                return Poll::Ready(Ok(Rejection::missing_key().into_response()));
                            }
                        },
                    }
                }
                StateProj::Acquire { fut, request } => {
                    let acquired = ready!(fut.as_mut().poll(cx));
                    let mut request = request.take().expect("polled after completion");
                    match acquired {
                        Ok(guard) => {
                            request.extensions_mut().insert(guard.info());
                            let guard = Arc::new(guard);
                            if this.shared.cancel_on_lost {
                                let watched = guard.clone();
                                *this.lost = Some(Box::pin(async move { watched.lost().await }));
                            }
                            *this.guard = Some(guard);
                            request
                        }
                        Err(err)
                            if err.is_unavailable() && this.shared.fail_mode == FailMode::Open =>
                        {
                            tracing::warn!(
                                error = %this.shared.locker.trace_error(&err),
                                "dlock-tower: lock backend unavailable, failing open: \
                                 calling the service without a lock"
                            );
                            request
                        }
                        Err(err) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(this.shared.reject(err)));
                        }
                    }
                }
                StateProj::Call { fut } => {
                    if let Some(lost) = this.lost.as_mut() {
                        if lost.as_mut().poll(cx).is_ready() {
                            // Dropping the handler's future here cancels it at its current
                            // await point; the lost lock needs no release.
                            this.lost.take();
                            this.state.set(State::Done);
                            let key = this.guard.take().map(|g| g.key().to_owned());
                            let err = LockError::lost(key.as_deref().unwrap_or_default());
                            return Poll::Ready(Ok(this.shared.reject(err)));
                        }
                    }
                    // With the lock visible to `current_lock()` inside the handler (and nested
                    // `#[distributed_lock]` calls on the same key re-entering).
                    let polled = match this.guard.as_ref() {
                        Some(guard) => guard.poll_scoped(fut, cx),
                        None => fut.poll(cx),
                    };
                    let response = match ready!(polled) {
                        Ok(response) => response,
                        Err(err) => {
                            this.state.set(State::Done);
                            // Dropping the guard releases the lock in the background — once
                            // the loss watcher, which holds the other reference, goes first.
                            this.lost.take();
                            this.guard.take();
                            return Poll::Ready(Err(err));
                        }
                    };
                    // The loss watcher holds the other reference to the guard.
                    this.lost.take();
                    match this.guard.take().and_then(|g| Arc::try_unwrap(g).ok()) {
                        Some(guard) => {
                            this.state.set(State::Release {
                                fut: Box::pin(guard.release()),
                                response: Some(response),
                            });
                            continue;
                        }
                        None => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(response));
                        }
                    }
                }
                StateProj::Release { fut, response } => {
                    if let Err(err) = ready!(fut.as_mut().poll(cx)) {
                        // The work is done and answered; a lock that expired (or a backend
                        // that went away) meanwhile is worth a log line, not a failed request.
                        tracing::warn!(
                            error = %this.shared.locker.trace_error(&err),
                            "dlock-tower: releasing the request's lock failed"
                        );
                    }
                    let response = response.take().expect("polled after completion");
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(response));
                }
                StateProj::Done => panic!("dlock_tower ResponseFuture polled after completion"),
            };
            let mut inner = this.inner.take().expect("polled after completion");
            // The service's `call` (its synchronous part) sees the lock too.
            let fut = match this.guard.as_ref() {
                Some(guard) => guard.in_scope(|| inner.call(request)),
                None => inner.call(request),
            };
            this.state.set(State::Call { fut });
        }
    }
}

impl<K, S, ReqBody> fmt::Debug for ResponseFuture<K, S, ReqBody>
where
    K: ExtractKey<ReqBody>,
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Extract { .. } => "extracting key",
            State::Acquire { .. } => "acquiring lock",
            State::Call { .. } => "calling service",
            State::Release { .. } => "releasing lock",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("guard", &self.guard)
            .finish_non_exhaustive()
    }
}
