//! [`header`]: the value of a request header.

use std::future::{ready, Ready};

use http::header::HeaderName;
use http::Request;

use super::{combinators, ExtractKey, Extracted, Key};
use crate::Rejection;

/// Keys requests by the value of the header `name` (case-insensitive), e.g.
/// `Idempotency-Key`: the key is `hdr:<lowercase name>:<value>`.
///
/// * absent or empty header: no key;
/// * the header given more than once, or a value that is not UTF-8: 400
///   (`lock-invalid-key`), since which one to lock on would be ambiguous;
/// * a value longer than the key input limit: 400 (`lock-invalid-key`).
///
/// ```
/// let idempotency = dlock_tower::key::header("Idempotency-Key");
/// # let _ = idempotency;
/// ```
///
/// # Panics
/// If `name` is not a valid header name.
pub fn header<N>(name: N) -> Header
where
    N: TryInto<HeaderName>,
    N::Error: std::fmt::Debug,
{
    let name = name
        .try_into()
        .unwrap_or_else(|e| panic!("dlock_tower::key::header: invalid header name: {e:?}"));
    Header { name }
}

/// The extractor of [`header`].
#[derive(Clone, Debug)]
pub struct Header {
    name: HeaderName,
}

combinators!(Header);

impl Header {
    /// The header's name.
    pub fn name(&self) -> &HeaderName {
        &self.name
    }

    fn key<B>(&self, request: &Request<B>) -> Result<Option<Key>, Rejection> {
        let mut values = request.headers().get_all(&self.name).iter();
        let Some(value) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(Rejection::invalid_key(&format!(
                "header `{}` is given more than once",
                self.name
            )));
        }
        if value.is_empty() {
            return Ok(None);
        }
        let Ok(text) = std::str::from_utf8(value.as_bytes()) else {
            return Err(Rejection::invalid_key(&format!(
                "header `{}` is not valid UTF-8",
                self.name
            )));
        };
        Ok(Some(
            Key::new("hdr")
                .lit(self.name.as_str().to_owned())
                .value(text),
        ))
    }
}

impl<B> ExtractKey<B> for Header {
    type Future = Ready<Extracted<B>>;

    fn extract(&mut self, request: Request<B>) -> Self::Future {
        ready(self.key(&request).map(|key| (request, key)))
    }
}
