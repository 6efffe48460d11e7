use std::fmt;
use std::mem;
use std::sync::Arc;
use std::task::{Context, Poll};

use dlock_runtime::BoxError;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::{ResponseFuture, Shared};
use crate::key::ExtractKey;

/// The service of [`DeferLayer`](super::DeferLayer): takes the request's lock and calls `S`,
/// or stores the request for later when the lock is busy. See the [module docs](crate::defer).
pub struct Defer<S, K> {
    inner: S,
    extractor: K,
    shared: Arc<Shared>,
}

crate::service_accessors!(Defer<S, K>);

impl<S, K> Defer<S, K> {
    pub(crate) fn from_parts(inner: S, extractor: K, shared: Arc<Shared>) -> Self {
        Defer {
            inner,
            extractor,
            shared,
        }
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
        // Keep the instance driven to readiness for this request (tower-service docs, "Be
        // careful when cloning inner services").
        let clone = self.inner.clone();
        let inner = mem::replace(&mut self.inner, clone);
        let extract = self.extractor.extract(request);
        ResponseFuture::new(super::future::respond(extract, inner, self.shared.clone()))
    }
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
            .field("extractor", &std::any::type_name::<K>())
            .finish_non_exhaustive()
    }
}
