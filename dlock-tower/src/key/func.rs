//! [`from_fn`]: a synchronous closure as a key extractor.

use std::fmt;
use std::future::{ready, Ready};

use http::Request;

use super::{combinators, ExtractKey, Extracted, Key};

/// A key extractor from a synchronous closure over the request head: `f(&request)` returns the
/// key, or `None` when the request has none. Build the key with [`Key::new`] and put every piece
/// of request data in [`Key::value`].
///
/// For an asynchronous extractor, or one that rejects or rebuilds the request, pass a closure
/// `FnMut(Request<B>) -> impl Future<Output = Extracted<B>>` directly (see [`ExtractKey`]).
///
/// Key on what the handler reads, decoded as it decodes it: a closure over the raw query text
/// gives `?account=7` and `?account=%37` two keys for one account (use [`query`](super::query)
/// for a query parameter).
///
/// ```
/// use dlock_tower::key::{self, Key};
///
/// // One lock per API client, whose id an authentication layer put in the request.
/// #[derive(Clone)]
/// struct ClientId(u64);
///
/// let per_client = key::from_fn(|req: &http::Request<String>| {
///     let ClientId(id) = req.extensions().get::<ClientId>()?;
///     Some(Key::new("client").value(id))
/// });
/// # let _ = per_client;
/// ```
pub fn from_fn<F>(f: F) -> FromFn<F> {
    FromFn { f }
}

/// The extractor of [`from_fn`].
#[derive(Clone, Copy)]
pub struct FromFn<F> {
    f: F,
}

combinators!(FromFn<F>);

impl<F> fmt::Debug for FromFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromFn")
            .field("f", &std::any::type_name::<F>())
            .finish()
    }
}

impl<B, F> ExtractKey<B> for FromFn<F>
where
    F: FnMut(&Request<B>) -> Option<Key>,
{
    type Future = Ready<Extracted<B>>;

    fn extract(&mut self, request: Request<B>) -> Self::Future {
        let key = (self.f)(&request);
        ready(Ok((request, key)))
    }
}
