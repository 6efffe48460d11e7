use std::fmt;
use std::mem;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use dlock_runtime::{LockError, Locker};
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::{future, IdempotencyLayer, ResponseBody, ResponseFuture, Shared};

/// The service of [`IdempotencyLayer`]: runs the first request of each idempotency key, stores
/// its response, and replays it to retries. See the [module docs](crate::idempotency).
pub struct Idempotency<S> {
    inner: S,
    shared: Arc<Shared>,
}

crate::service_accessors!(Idempotency<S>);

impl<S> Idempotency<S> {
    /// Wraps `inner` with the defaults of [`IdempotencyLayer::new`]; use the layer to change
    /// them.
    ///
    /// # Panics
    /// Like [`IdempotencyLayer::new`], if the locker's backend does not store idempotency
    /// records.
    pub fn new(inner: S, locker: Locker) -> Self {
        IdempotencyLayer::new(locker).layer_service(inner)
    }

    /// Like [`new`](Idempotency::new), with an error instead of a panic.
    pub fn try_new(inner: S, locker: Locker) -> Result<Self, LockError> {
        Ok(IdempotencyLayer::try_new(locker)?.layer_service(inner))
    }

    pub(crate) fn from_parts(inner: S, shared: Arc<Shared>) -> Self {
        Idempotency { inner, shared }
    }

    /// An [`IdempotencyLayer`] (same as [`IdempotencyLayer::new`]).
    pub fn layer(locker: Locker) -> IdempotencyLayer {
        IdempotencyLayer::new(locker)
    }
}

impl IdempotencyLayer {
    fn layer_service<S>(&self, inner: S) -> Idempotency<S> {
        tower_layer::Layer::layer(self, inner)
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<dlock_runtime::BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // Keep the instance that was driven to readiness for this request and leave a clone
        // behind (tower-service docs, "Be careful when cloning inner services").
        let clone = self.inner.clone();
        let inner = mem::replace(&mut self.inner, clone);
        ResponseFuture::new(future::run(self.shared.clone(), inner, request))
    }
}

impl<S: Clone> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("shared", &self.shared)
            .finish()
    }
}
