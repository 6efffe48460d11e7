use std::fmt;
use std::mem;
use std::sync::Arc;
use std::task::{Context, Poll};

use dlock_runtime::Locker;
use http::{Request, Response};
use tower_service::Service;

use super::{DistributedLockLayer, ResponseFuture, Shared};
use crate::key::ExtractKey;

/// The service of [`DistributedLockLayer`]: takes the request's lock, then calls `S`. See the
/// [module docs](crate::lock).
pub struct DistributedLock<S, K> {
    inner: S,
    extractor: K,
    shared: Arc<Shared>,
}

crate::service_accessors!(DistributedLock<S, K>);

impl<S, K> DistributedLock<S, K> {
    /// Wraps `inner` with the defaults of [`DistributedLockLayer::new`]; use the layer to
    /// change them.
    pub fn new(inner: S, locker: Locker, extractor: K) -> Self {
        Self::from_parts(inner, extractor, Arc::new(Shared::new(locker)))
    }

    pub(crate) fn from_parts(inner: S, extractor: K, shared: Arc<Shared>) -> Self {
        DistributedLock {
            inner,
            extractor,
            shared,
        }
    }

    /// A [`DistributedLockLayer`] (same as [`DistributedLockLayer::new`]).
    pub fn layer(locker: Locker, extractor: K) -> DistributedLockLayer<K> {
        DistributedLockLayer::new(locker, extractor)
    }
}

impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for DistributedLock<S, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    K: ExtractKey<ReqBody>,
    ResBody: From<String>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<K, S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The inner service was driven to readiness: keep that instance for this request and
        // leave a fresh clone behind (tower-service docs, "Be careful when cloning inner
        // services").
        let clone = self.inner.clone();
        let inner = mem::replace(&mut self.inner, clone);
        ResponseFuture::new(self.extractor.extract(request), inner, self.shared.clone())
    }
}

impl<S: Clone, K: Clone> Clone for DistributedLock<S, K> {
    fn clone(&self) -> Self {
        DistributedLock {
            inner: self.inner.clone(),
            extractor: self.extractor.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, K> fmt::Debug for DistributedLock<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistributedLock")
            .field("inner", &self.inner)
            .field("extractor", &std::any::type_name::<K>())
            .field("shared", &self.shared)
            .finish()
    }
}
