//! Key extractors: which lock a request takes.
//!
//! An extractor implements [`ExtractKey`]: it looks at a request and returns it (possibly
//! rebuilt, see [`body_digest`]) together with the request's [`Key`], or `None` when the
//! request has no key (the layer then passes it through or answers 400, see
//! [`MissingKey`](crate::MissingKey)), or a [`Rejection`] response.
//!
//! | extractor | key | none when |
//! |---|---|---|
//! | [`header("idempotency-key")`](header) | `hdr:idempotency-key:<value>` | the header is absent or empty |
//! | [`query("account")`](query) | `query:account:<value, form-decoded>` | the parameter is absent or empty |
//! | [`method_path()`](method_path) | `path:<METHOD>:<URI path, escapes normalised>` | never |
//! | [`matched_path()`](matched_path) (feature `axum`) | `route:<METHOD>:<route template>` | no axum route matched |
//! | [`path_params()`](path_params) (feature `axum`) | `params:<name>:<value>:…` | no axum route matched |
//! | [`path_param("id")`](path_param) (feature `axum`) | `param:id:<value>` | the route has no such parameter |
//! | [`extension::<T>()`](extension) | `ext:<label>:<value>` | no `T` in the request extensions |
//! | [`body_digest(limit)`](body_digest) | `body:sha256:<hex digest>` | never (413 over the limit) |
//! | [`from_fn(f)`](from_fn) | whatever `f` returns | `f` returns `None` |
//! | any `FnMut(Request<B>) -> impl Future<Output = Extracted<B>>` | whatever it returns | it says so |
//! | [`a.and(b)`](And) | `<a's key>:<b's key>` | either has none |
//! | [`a.or(b)`](Or) | a's key, else b's | both have none |
//!
//! # Keys cannot be forged
//!
//! A [`Key`] is a list of segments joined with `:`. Literal segments come from code (every
//! built-in extractor starts with a fixed literal such as `hdr`); every piece of request data
//! is a *value* segment and goes through the runtime's
//! [`KeyBuilder::value`](dlock_runtime::key::KeyBuilder::value), which percent-encodes `:`
//! (and `%`, `{`, `}`, `#`, whitespace, control characters). A request can therefore never
//! make its key equal to another request's by putting separators in a header or a path
//! parameter. Values longer than
//! [`MAX_KEY_INPUT_LEN`] bytes are not copied; they
//! make the key invalid, which the layer answers with 400 (the runtime's
//! [`LockError::InvalidKey`]).
//!
//! ```
//! use dlock_tower::key::{self, Key};
//!
//! #[derive(Clone)]
//! struct UserId(u64);
//! impl std::fmt::Display for UserId {
//!     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
//!         self.0.fmt(f)
//!     }
//! }
//!
//! // One lock per user and route.
//! let per_user_and_route = key::extension::<UserId>().and(key::method_path());
//!
//! // The idempotency key if there is one, else the tenant header.
//! let idem = key::header("idempotency-key").or(key::header("x-tenant"));
//!
//! // One lock per `?account=` value, decoded as the handler's `Query` decodes it.
//! let by_account = key::query("account");
//!
//! // A synchronous closure: every piece of request data goes into `value`.
//! let by_tenant = key::from_fn(|req: &http::Request<String>| {
//!     let tenant = req.extensions().get::<UserId>()?;
//!     Some(Key::new("tenant").value(tenant))
//! });
//! # let _ = (per_user_and_route, idem, by_account, by_tenant);
//! ```

use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::future::Future;

use dlock_runtime::key::MAX_KEY_INPUT_LEN;
use dlock_runtime::{LockError, LockKey};
use http::Request;

use crate::Rejection;

mod body;
mod combine;
mod extension;
mod func;
mod header;
mod path;
mod query;

#[cfg(feature = "axum")]
mod axum;

pub use body::{body_digest, BodyDigest, BodyDigestFuture};
pub use combine::{And, AndFuture, Or, OrFuture};
pub use extension::{extension, Extension};
pub use func::{from_fn, FromFn};
pub use header::{header, Header};
pub use path::{method_path, MethodPath};
pub use query::{query, Query};

/// The method a key names: a `HEAD` request's is `GET`'s. Routers answer a `HEAD` with the
/// `GET` handler (axum's `get` serves both), so it must take that handler's lock: keyed as
/// `HEAD`, it ran the locked handler alongside a `GET` of the same resource.
fn method_of(request_method: &http::Method) -> &str {
    if request_method == http::Method::HEAD {
        http::Method::GET.as_str()
    } else {
        request_method.as_str()
    }
}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use self::axum::{
    matched_path, path_param, path_params, MatchedPath, PathParam, PathParams, PathParamsFuture,
};

/// What an extractor returns: the request (handed on to the inner service, possibly rebuilt)
/// and its key (`None`: the request has none), or a response to send instead.
pub type Extracted<B> = Result<(Request<B>, Option<Key>), Rejection>;

/// Finds the lock key of a request. See the [module docs](self) for the built-in extractors.
///
/// The extraction is asynchronous and takes the request by value, so an extractor can read
/// (and rebuild) the body; extractors that only look at the head return a ready future.
/// The layer calls it once per request, before taking the lock.
///
/// Implemented for every `FnMut(Request<B>) -> Fut` where `Fut: Future<Output =
/// Extracted<B>>` (like tower-http's `AsyncAuthorizeRequest`); for a synchronous closure over
/// `&Request<B>`, use [`from_fn`].
///
/// ```
/// use dlock_tower::key::{Extracted, Key};
/// use dlock_tower::{DistributedLockLayer, Rejection};
/// use dlock_runtime::Locker;
/// use http::{Request, StatusCode};
///
/// // Lock per tenant, refusing requests whose tenant header is not a number.
/// let layer = DistributedLockLayer::new(Locker::memory(), |req: Request<String>| async move {
///     let Some(tenant) = req.headers().get("x-tenant") else {
///         return Ok((req, None));
///     };
///     let Some(id) = tenant.to_str().ok().and_then(|t| t.parse::<u64>().ok()) else {
///         return Err(Rejection::new(StatusCode::BAD_REQUEST, "bad-tenant", "x-tenant is not a number"));
///     };
///     Ok::<_, Rejection>((req, Some(Key::new("tenant").value(&id))))
/// });
/// # let _ = layer;
/// ```
pub trait ExtractKey<B> {
    /// The future returned by [`extract`](ExtractKey::extract).
    type Future: Future<Output = Extracted<B>>;

    /// Finds the key of `request`, handing the request back.
    fn extract(&mut self, request: Request<B>) -> Self::Future;
}

impl<B, F, Fut> ExtractKey<B> for F
where
    F: FnMut(Request<B>) -> Fut,
    Fut: Future<Output = Extracted<B>>,
{
    type Future = Fut;

    fn extract(&mut self, request: Request<B>) -> Fut {
        self(request)
    }
}

/// The key of one request, before encoding: literal segments (from code) and value segments
/// (request data), joined with `:`.
///
/// Turned into a [`LockKey`] by the runtime's
/// [`KeyBuilder`](dlock_runtime::key::KeyBuilder): literals with `lit`, values with `value`,
/// so a value can never contain the separator.
///
/// ```
/// use dlock_tower::key::Key;
///
/// let a = Key::new("user").value("1:2").value("3");
/// let b = Key::new("user").value("1").value("2:3");
/// assert_eq!(a.to_lock_key().unwrap().as_str(), "user:1%3A2:3");
/// assert_ne!(a.to_lock_key().unwrap(), b.to_lock_key().unwrap());
///
/// let both = Key::new("ext").lit("tenant").value(&7).and(Key::new("route").value("GET"));
/// assert_eq!(both.to_lock_key().unwrap().as_str(), "ext:tenant:7:route:GET");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Key {
    segments: Vec<Segment>,
    /// Bytes of input so far, as the runtime's `KeyBuilder` counts them (separators included).
    raw_len: usize,
    /// A value's `Display` failed before the length limit: its segment holds only what came
    /// before the error, which other values may share (see [`value`](Key::value)).
    cut_short: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Lit(Cow<'static, str>),
    Value(Box<str>),
}

impl Key {
    /// A key whose first segment is the literal `prefix` (it names the extractor: `hdr`,
    /// `route`, … for the built-in ones; pick your own for closures). Literal text comes from
    /// code or configuration, never from the request: request data goes in
    /// [`value`](Key::value).
    pub fn new(prefix: impl Into<Cow<'static, str>>) -> Self {
        let prefix = prefix.into();
        Key {
            raw_len: prefix.len(),
            cut_short: false,
            segments: vec![Segment::Lit(prefix)],
        }
    }

    /// Appends a literal segment (kept as written, `:` included; see [`Key::new`]).
    #[must_use]
    pub fn lit(mut self, text: impl Into<Cow<'static, str>>) -> Self {
        let text = text.into();
        self.raw_len += 1 + text.len();
        self.segments.push(Segment::Lit(text));
        self
    }

    /// Appends a value segment: `value`'s `Display` output, encoded so that it cannot contain
    /// the `:` separator. At most [`MAX_KEY_INPUT_LEN`] bytes of key input are copied; longer
    /// input makes [`to_lock_key`](Key::to_lock_key) fail with
    /// [`LockError::InvalidKey`] — as does a `Display` that returns an error: what it wrote
    /// before the error, which another value may write whole, is no key.
    #[must_use]
    pub fn value<T: fmt::Display + ?Sized>(mut self, value: &T) -> Self {
        self.raw_len += 1;
        if self.raw_len > MAX_KEY_INPUT_LEN {
            // Already invalid: copy nothing more.
            return self;
        }
        // Copy just enough to push the total past the limit, never the whole value.
        let cap = MAX_KEY_INPUT_LEN + 1 - self.raw_len;
        let mut out = Bounded {
            out: String::new(),
            cap,
        };
        // Past the limit `Bounded` fails too, and `to_lock_key` reports that as such.
        if write!(out, "{value}").is_err() && out.out.len() < cap {
            self.cut_short = true;
        }
        self.raw_len += out.out.len();
        self.segments.push(Segment::Value(out.out.into_boxed_str()));
        self
    }

    /// Joins two keys: `self`'s segments, then `other`'s (`<self>:<other>`).
    #[must_use]
    pub fn and(mut self, other: Key) -> Self {
        self.raw_len += 1 + other.raw_len;
        self.cut_short |= other.cut_short;
        self.segments.extend(other.segments);
        self
    }

    /// Encodes the key with the runtime's [`KeyBuilder`](dlock_runtime::key::KeyBuilder):
    /// fails with [`LockError::InvalidKey`] if it is
    /// empty or its input is longer than [`MAX_KEY_INPUT_LEN`] bytes.
    pub fn to_lock_key(&self) -> Result<LockKey, LockError> {
        if self.raw_len > MAX_KEY_INPUT_LEN {
            // A value past the limit was not copied (see `value`): the segments alone would
            // not show it, and two keys that differ only there would encode alike.
            return Err(LockError::invalid_key(format!(
                "key input longer than {MAX_KEY_INPUT_LEN} bytes"
            )));
        }
        if self.cut_short {
            return Err(LockError::invalid_key(
                "a key value's Display implementation returned an error",
            ));
        }
        let mut b = LockKey::builder();
        for (i, seg) in self.segments.iter().enumerate() {
            if i > 0 {
                b.lit(":");
            }
            match seg {
                Segment::Lit(text) => b.lit(text),
                Segment::Value(value) => b.value(&**value),
            };
        }
        b.finish()
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        for seg in &self.segments {
            match seg {
                Segment::Lit(t) => list.entry(&format_args!("lit {t:?}")),
                Segment::Value(v) => list.entry(&format_args!("value {v:?}")),
            };
        }
        list.finish()
    }
}

/// A `fmt::Write` that keeps only the first `cap` bytes (rounded up to a char boundary) and
/// then stops the formatting.
struct Bounded {
    out: String,
    cap: usize,
}

impl fmt::Write for Bounded {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = self.cap.saturating_sub(self.out.len());
        if s.len() < room {
            self.out.push_str(s);
            return Ok(());
        }
        let mut cut = room;
        while !s.is_char_boundary(cut) {
            cut += 1;
        }
        self.out.push_str(&s[..cut]);
        Err(fmt::Error)
    }
}

/// Implements `and`/`or` on an extractor type.
macro_rules! combinators {
    ($($ty:ident $(<$($g:ident),*>)?),* $(,)?) => {$(
        impl $(<$($g),*>)? $ty $(<$($g),*>)? {
            /// Both keys joined with `:` (see [`And`](crate::key::And)); none if either has
            /// none.
            pub fn and<E>(self, other: E) -> $crate::key::And<Self, E> {
                $crate::key::And::new(self, other)
            }

            /// This key, or `other`'s when this one has none (see [`Or`](crate::key::Or)).
            pub fn or<E>(self, other: E) -> $crate::key::Or<Self, E> {
                $crate::key::Or::new(self, other)
            }
        }
    )*};
}
pub(crate) use combinators;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_cannot_forge_separators() {
        let a = Key::new("hdr").lit("x").value("a:b").to_lock_key().unwrap();
        let b = Key::new("hdr")
            .lit("x")
            .value("a")
            .value("b")
            .to_lock_key()
            .unwrap();
        assert_ne!(a, b);
        assert_eq!(a.as_str(), "hdr:x:a%3Ab");
        assert_eq!(b.as_str(), "hdr:x:a:b");
    }

    #[test]
    fn oversized_values_are_bounded_and_invalid() {
        let huge = "é".repeat(1 << 20);
        let k = Key::new("hdr").value(huge.as_str());
        let Segment::Value(v) = &k.segments[1] else {
            panic!()
        };
        assert!(v.len() <= MAX_KEY_INPUT_LEN + 2, "{}", v.len());
        let err = k.to_lock_key().unwrap_err();
        assert!(err.is_invalid(), "{err}");
        assert_eq!(err.status(), 400);
        // More values after an oversized one copy nothing.
        let k = k.value("more");
        assert!(k.to_lock_key().is_err());
    }

    #[test]
    fn keys_at_the_limit_are_accepted() {
        let prefix_len = "v".len() + 1;
        let ok = "x".repeat(MAX_KEY_INPUT_LEN - prefix_len);
        assert!(Key::new("v").value(ok.as_str()).to_lock_key().is_ok());
        let over = "x".repeat(MAX_KEY_INPUT_LEN - prefix_len + 1);
        assert!(Key::new("v").value(over.as_str()).to_lock_key().is_err());
    }

    #[test]
    fn a_value_past_a_key_at_the_limit_makes_it_invalid_not_alike() {
        let full = "x".repeat(MAX_KEY_INPUT_LEN - "v".len() - 1);
        let at_limit = Key::new("v").value(full.as_str());
        assert!(at_limit.to_lock_key().is_ok());
        for more in ["a", "b", ""] {
            let err = at_limit.clone().value(more).to_lock_key().unwrap_err();
            assert!(err.is_invalid(), "{err}");
            assert_eq!(err.status(), 400);
        }
        let joined = at_limit.clone().and(Key::new("w"));
        assert!(joined.to_lock_key().unwrap_err().is_invalid());
        let lit = at_limit.lit("z");
        assert!(lit.to_lock_key().unwrap_err().is_invalid());
    }

    /// A `Display` that fails part-way wrote only a prefix, which another value may write
    /// whole: the key is invalid, not that value's. Before, `"ab"` then an error made the
    /// same key as `"ab"`.
    #[test]
    fn a_value_whose_display_fails_makes_the_key_invalid_not_alike() {
        struct Fails;
        impl fmt::Display for Fails {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("ab")?;
                Err(fmt::Error)
            }
        }
        assert!(Key::new("v").value("ab").to_lock_key().is_ok());
        let err = Key::new("v").value(&Fails).to_lock_key().unwrap_err();
        assert!(err.is_invalid(), "{err}");
        assert_eq!(err.status(), 400);
        assert!(err.to_string().contains("Display"), "{err}");
        // Joined, or followed by more values, it still is.
        let joined = Key::new("w").and(Key::new("v").value(&Fails)).value("c");
        assert!(joined.to_lock_key().unwrap_err().is_invalid());
    }

    #[test]
    fn and_joins_with_a_separator() {
        let k = Key::new("a").value("1").and(Key::new("b").value("2"));
        assert_eq!(k.to_lock_key().unwrap().as_str(), "a:1:b:2");
    }
}
