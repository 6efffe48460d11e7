//! [`method_path`]: the method and the URI path.

use std::future::{ready, Ready};

use http::Request;

use super::{combinators, ExtractKey, Extracted, Key};

/// Keys requests by method and URI path (no query): `path:<METHOD>:<path>`. Every request has
/// one. A `HEAD` is keyed as a `GET`: routers answer it with the `GET` handler. The path is the one the client sent — inside axum's `Router::nest`, with the `axum`
/// or the `admin` feature (both read axum's `OriginalUri`; turn one on across all instances at
/// once, as it changes the keys of layers inside a nested router), the whole path, not the
/// nested router's rest — spelled one way per resource, so
/// paths a router hands the same parameters share a lock: `/orders/%34%32` and `/orders/42`,
/// `/users/a%40b` and `/users/a@b`, `/items/中` sent raw and `/items/%E4%B8%AD`. Every escape is
/// decoded and written back one way (the characters a path segment may hold as they are
/// literally, every other byte as `%XX` in upper case); an escaped `/` (`%2F`) is not a
/// separator to a router, so it stays escaped and `/a%2Fb` keeps its own lock (a catch-all
/// route, `/{*rest}`, hands the handler `a/b` for both: key such routes by the parameter,
/// `key::path_params`, feature `axum`). A non-ASCII character counts three bytes per
/// UTF-8 byte against the key's length bound.
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
        let uri = crate::uri::original(request.uri(), request.extensions());
        let key = Key::new("path")
            .value(super::method_of(request.method()))
            .value(&*crate::uri::normalised_path(uri.path()));
        ready(Ok((request, Some(key))))
    }
}
