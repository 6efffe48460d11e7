//! [`method_path`]: the method and the raw URI path.

use std::future::{ready, Ready};

use http::Request;

use super::{combinators, ExtractKey, Extracted, Key};

/// Keys requests by method and raw URI path (as sent, percent-encoding included; no query):
/// `path:<METHOD>:<path>`. Every request has one.
///
/// Behind an axum router, [`matched_path`](crate::key::matched_path) (feature `axum`) keys by
/// the route template instead (`/users/{id}` rather than `/users/42`).
///
/// ```
/// let per_endpoint_and_resource = dlock_tower::key::method_path();
/// # let _ = per_endpoint_and_resource;
/// ```
pub fn method_path() -> MethodPath {
    MethodPath { _priv: () }
}

/// The extractor of [`method_path`].
#[derive(Clone, Copy, Debug)]
pub struct MethodPath {
    _priv: (),
}

combinators!(MethodPath);

impl<B> ExtractKey<B> for MethodPath {
    type Future = Ready<Extracted<B>>;

    fn extract(&mut self, request: Request<B>) -> Self::Future {
        let key = Key::new("path")
            .value(request.method().as_str())
            .value(request.uri().path());
        ready(Ok((request, Some(key))))
    }
}
