//! The per-request lock middleware: [`DistributedLockLayer`] and [`DistributedLock`].
//!
//! For each request the middleware
//!
//! 1. finds the request's key with its [`ExtractKey`](crate::key::ExtractKey) extractor;
//! 2. takes the lock on it from its [`Locker`] with the configured TTL
//!    and [`OnFail`] strategy;
//! 3. puts the lock's [`LockInfo`](dlock_runtime::LockInfo) (key, fencing token) in the request
//!    extensions and calls the inner service;
//! 4. when the inner service's response future resolves, releases the lock (awaiting the
//!    release, so a client that sends its next request after reading the response never finds
//!    its own lock still held), then returns the response.
//!
//! The [`LockGuard`](dlock_runtime::LockGuard) lives in the [`ResponseFuture`]: if the request
//! is cancelled (the client disconnects, a timeout layer gives up) the future is dropped and
//! the lock released in the background. While the lock is held the runtime's watchdog renews
//! it, so a slow handler keeps its lock; the TTL is how fast the lock frees if this process
//! dies. If the lock is lost while the handler runs anyway (the backend was unreachable for
//! longer than the TTL), the handler is not interrupted — pass the fencing token from
//! [`LockInfo`](dlock_runtime::LockInfo) to the resource you write so that it can refuse a
//! stale holder — and the failed release is logged at `warn`.
//!
//! In axum, read the lock with `Extension<LockInfo>` (or `Option<Extension<LockInfo>>` behind
//! a layer that may pass requests through without a lock).
//!
//! **With an [`IdempotencyLayer`](crate::IdempotencyLayer)**, put this layer inside it (in
//! axum, `route_layer` this one first): a handler whose client went away then runs to its end
//! with this lock held. Outside it, the idempotency layer sees this lock and runs the handler
//! in the request's future, so a client that goes away cuts the handler off before this lock
//! is released (and the retry runs it again); the handler finds this layer's `LockInfo` in its
//! extensions. See [with the lock and defer layers](crate::idempotency#with-the-lock-and-defer-layers).
//!
//! **Streaming bodies**: the lock covers the inner service's work up to the moment it returns
//! the response *head*. A response body that is produced lazily (a stream) keeps running after
//! the lock is released; do the work that needs the lock before returning the response.
//!
//! # Responses
//!
//! Every failure is a response, never a service error: the service's error type is the inner
//! service's, so `Infallible` stays `Infallible`. See [`Rejection`](crate::Rejection) for the
//! bodies.
//!
//! | outcome | response |
//! |---|---|
//! | lock held by another request (reject, or retry deadline passed) | 409 + `Retry-After` (seconds until the holder's lease ends, rounded up) + `application/problem+json` |
//! | backend unavailable, [`FailMode::Closed`] (default) | 503 + `Retry-After` + problem+json |
//! | backend unavailable, [`FailMode::Open`] | the inner service, without a lock |
//! | no key, [`MissingKey::Reject`] (default) | 400 + problem+json |
//! | no key, [`MissingKey::PassThrough`] | the inner service, without a lock |
//! | invalid key (oversized, empty, …) | 400 + problem+json |
//! | an extractor's own rejection (e.g. body over the limit) | its response (e.g. 413) |
//!
//! # Response body type
//!
//! The middleware answers `Response<ResBody>`, the inner service's own response type, and
//! builds its rejections with `ResBody: From<String>`. axum's `Body`, http-body-util's
//! `Full<Bytes>`, `String` and `Bytes` qualify, so the layer fits axum's `Router::layer` and
//! `route_layer`, and a plain `tower::ServiceBuilder` over a hyper service returning
//! `Full<Bytes>`, without changing any type. A service whose body type has no
//! `From<String>` (a bare stream) can be given one by mapping its body into a type that has,
//! e.g. axum's `Body`.

mod future;
mod layer;
mod service;

use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::{Locker, OnFail};

pub use self::future::ResponseFuture;
pub use self::layer::DistributedLockLayer;
pub use self::service::DistributedLock;

/// What the middleware does when the lock backend is unavailable (unreachable, timing out,
/// failing: [`LockError::Unavailable`](dlock_runtime::LockError::Unavailable)).
///
/// The default is [`FailMode::Closed`]: a lock that cannot be taken is not assumed. A backend
/// that refuses for good ([`LockError::Misconfigured`](dlock_runtime::LockError::Misconfigured):
/// wrong credentials, no permission, a missing schema) is answered `500` in either mode: fail
/// open is for riding out an outage, not for running every request unlocked until someone
/// notices the configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailMode {
    /// Answer `503 Service Unavailable` with `Retry-After` and a problem+json body, without
    /// calling the inner service. The default.
    #[default]
    Closed,
    /// Call the inner service without a lock (logged at `warn`). The request has no
    /// [`LockInfo`](dlock_runtime::LockInfo) in its extensions: a handler behind a fail-open
    /// layer should extract it as optional.
    Open,
}

/// What the middleware does with a request whose extractor finds no key.
///
/// The default is [`MissingKey::Reject`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer `400 Bad Request` with a problem+json body (type
    /// `urn:dlock:problem:lock-key-missing`). The default.
    #[default]
    Reject,
    /// Call the inner service without a lock (e.g. when the `Idempotency-Key` header is
    /// optional). The request has no [`LockInfo`](dlock_runtime::LockInfo) in its extensions.
    PassThrough,
}

/// Configuration shared by the layer and every service and future it makes.
#[derive(Clone, Debug)]
pub(crate) struct Shared {
    pub(crate) locker: Locker,
    pub(crate) ttl: Option<Duration>,
    pub(crate) on_fail: Option<OnFail>,
    pub(crate) fail_mode: FailMode,
    /// The lock's bounded name in metrics and traces.
    pub(crate) name: &'static str,
    pub(crate) missing_key: MissingKey,
    /// `message(..)`: the detail of a contention answer.
    pub(crate) message: Option<std::borrow::Cow<'static, str>>,
    /// `rejection(..)`: builds the answer to a lock error instead of the default.
    pub(crate) rejection: Option<RejectFn>,
    /// `cancel_on_lost(true)`: stop the handler and answer 503 when the lock is lost.
    pub(crate) cancel_on_lost: bool,
}

/// The closure of [`DistributedLockLayer::rejection`].
type RejectClosure = dyn Fn(&dlock_runtime::LockError) -> http::Response<String> + Send + Sync;

/// A custom rejection: the response for a [`LockError`](dlock_runtime::LockError).
#[derive(Clone)]
pub(crate) struct RejectFn(pub(crate) Arc<RejectClosure>);

impl std::fmt::Debug for RejectFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RejectFn(..)")
    }
}

impl Shared {
    pub(crate) fn new(locker: Locker) -> Self {
        Shared {
            locker,
            ttl: None,
            on_fail: None,
            fail_mode: FailMode::default(),
            name: dlock_runtime::metrics::UNNAMED,
            missing_key: MissingKey::default(),
            message: None,
            rejection: None,
            cancel_on_lost: false,
        }
    }

    /// The answer to `err`: with `message` as its detail, through `rejection` when set, else
    /// the default problem+json ([`Rejection`](crate::Rejection)).
    pub(crate) fn reject<B: From<String>>(
        &self,
        err: dlock_runtime::LockError,
    ) -> http::Response<B> {
        let err = match &self.message {
            Some(m) => err.with_detail(m.clone()),
            None => err,
        };
        match &self.rejection {
            Some(f) => (f.0)(&err).map(B::from),
            None => crate::Rejection::from(err).into_response(),
        }
    }
}
