//! axum extractors (feature `axum`): the matched route template and path parameters.

use std::borrow::Cow;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{FromRequestParts, MatchedPath as AxumMatchedPath, RawPathParams};
use http::request::Parts;
use http::Request;
use pin_project_lite::pin_project;

use super::{combinators, ExtractKey, Extracted, Key};
use crate::Rejection;

/// Keys requests by method and the axum route template that matched:
/// `route:<METHOD>:<template>`, e.g. `route:POST:/users/{id}/orders` for every user id. A
/// request that matched no route (a fallback, or a layer outside the router) has no key. A
/// `HEAD` is keyed as a `GET`: axum's `get` serves it with the `GET` handler, so it takes that
/// handler's lock.
///
/// axum 0.8 sets the matched path before running both `Router::layer` and
/// `Router::route_layer` middleware; `route_layer` also keeps a 404 a 404 instead of a
/// 400 for a missing key.
///
/// ```
/// use axum::{routing::post, Router};
/// use dlock_runtime::Locker;
/// use dlock_tower::{key, DistributedLockLayer};
///
/// let app: Router = Router::new()
///     .route("/reports/{month}", post(|| async { "built" }))
///     .route_layer(DistributedLockLayer::new(Locker::memory(), key::matched_path()));
/// ```
pub fn matched_path() -> MatchedPath {
    MatchedPath { _priv: () }
}

/// The extractor of [`matched_path`].
#[derive(Clone, Copy, Debug)]
pub struct MatchedPath {
    _priv: (),
}

combinators!(MatchedPath);

impl<B> ExtractKey<B> for MatchedPath {
    type Future = Ready<Extracted<B>>;

    fn extract(&mut self, request: Request<B>) -> Self::Future {
        let key = request.extensions().get::<AxumMatchedPath>().map(|m| {
            Key::new("route")
                .value(super::method_of(request.method()))
                .value(m.as_str())
        });
        ready(Ok((request, key)))
    }
}

/// Keys requests by all the path parameters of the axum route that matched, in route order:
/// `params:<name>:<value>:<name>:<value>…` (percent-decoded values, as axum's
/// [`RawPathParams`] gives them). A route without parameters gives the key `params`; a
/// request that matched no route has no key; a parameter that is not UTF-8 once decoded is
/// answered with 400.
///
/// Different routes with the same parameter names share locks: combine with
/// [`matched_path`] to keep them apart.
///
/// ```
/// use dlock_tower::key;
/// let per_order = key::matched_path().and(key::path_params());
/// # let _ = per_order;
/// ```
pub fn path_params() -> PathParams {
    PathParams { only: None }
}

/// Keys requests by one path parameter of the axum route that matched: `param:<name>:<value>`.
/// A request whose route has no parameter `name` has no key; a value that is not UTF-8 once
/// decoded is answered with 400.
///
/// ```
/// use axum::{routing::post, Router};
/// use dlock_runtime::Locker;
/// use dlock_tower::{key, DistributedLockLayer};
///
/// // `POST /orders/{id}/pay` and `POST /orders/{id}/cancel` exclude each other per order.
/// let app: Router = Router::new()
///     .route("/orders/{id}/pay", post(|| async { "paid" }))
///     .route("/orders/{id}/cancel", post(|| async { "cancelled" }))
///     .route_layer(DistributedLockLayer::new(Locker::memory(), key::path_param("id")));
/// ```
pub fn path_param(name: impl Into<Cow<'static, str>>) -> PathParam {
    PathParam {
        inner: PathParams {
            only: Some(name.into()),
        },
    }
}

/// The extractor of [`path_params`].
#[derive(Clone, Debug)]
pub struct PathParams {
    only: Option<Cow<'static, str>>,
}

/// The extractor of [`path_param`].
#[derive(Clone, Debug)]
pub struct PathParam {
    inner: PathParams,
}

combinators!(PathParams, PathParam);

type ParamsFuture =
    Pin<Box<dyn Future<Output = (Parts, Result<RawPathParams, RawPathParamsRejection>)> + Send>>;

impl<B> ExtractKey<B> for PathParams {
    type Future = PathParamsFuture<B>;

    fn extract(&mut self, request: Request<B>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        PathParamsFuture {
            fut: Box::pin(async move {
                let params = RawPathParams::from_request_parts(&mut parts, &()).await;
                (parts, params)
            }),
            body: Some(body),
            only: self.only.clone(),
        }
    }
}

impl<B> ExtractKey<B> for PathParam {
    type Future = PathParamsFuture<B>;

    fn extract(&mut self, request: Request<B>) -> Self::Future {
        self.inner.extract(request)
    }
}

pin_project! {
    /// The future of [`PathParams`] and [`PathParam`].
    pub struct PathParamsFuture<B> {
        fut: ParamsFuture,
        body: Option<B>,
        only: Option<Cow<'static, str>>,
    }
}

impl<B> Future for PathParamsFuture<B> {
    type Output = Extracted<B>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let (parts, params) = ready!(this.fut.as_mut().poll(cx));
        let body = this
            .body
            .take()
            .expect("PathParamsFuture polled after completion");
        let request = Request::from_parts(parts, body);
        let params = match params {
            Ok(params) => params,
            Err(RawPathParamsRejection::InvalidUtf8InPathParam(e)) => {
                return Poll::Ready(Err(Rejection::invalid_key(&e.body_text())));
            }
            Err(_) => return Poll::Ready(Ok((request, None))),
        };
        let key = match this.only {
            Some(name) => params
                .iter()
                .find(|(n, _)| *n == name.as_ref())
                .map(|(_, value)| Key::new("param").lit(name.clone()).value(value)),
            None => Some(
                params
                    .iter()
                    .fold(Key::new("params"), |k, (n, v)| k.value(n).value(v)),
            ),
        };
        Poll::Ready(Ok((request, key)))
    }
}
