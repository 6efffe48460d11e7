use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::{Locker, OnFail};
use tower_layer::Layer;

use super::{DistributedLock, Shared};

/// Takes a distributed lock per request, keyed by an [extractor](crate::key), around the
/// inner service. See the [module docs](crate::lock) for what it does and answers.
///
/// The inner service is made ready (`poll_ready`) before the request's key is read and its
/// lock taken, and is called once the lock is held, as tower's contract asks: a slot the inner
/// service reserves when ready (a `ConcurrencyLimit` permit, a `Buffer` slot) is held while the
/// request waits for its lock. With a waiting strategy ([`OnFail::Retry`]), put such limits
/// *outside* this layer, or requests waiting for one busy key take the slots of requests for
/// free keys. (axum's routers are always ready.)
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::post, Router};
/// use dlock_runtime::{Locker, OnFail};
/// use dlock_tower::{key, DistributedLockLayer, MissingKey};
///
/// let locker = Locker::memory();
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { "paid" }))
///     .route_layer(
///         DistributedLockLayer::new(locker, key::header("idempotency-key"))
///             .ttl(Duration::from_secs(10))
///             .on_fail(OnFail::retry(Duration::from_secs(2)))
///             .missing_key(MissingKey::Reject),
///     );
/// ```
#[must_use]
pub struct DistributedLockLayer<K> {
    shared: Arc<Shared>,
    extractor: K,
}

impl<K> DistributedLockLayer<K> {
    /// Locks on `extractor`'s key with `locker`, with the defaults documented on each setter:
    /// the locker's TTL and strategy, fail-closed, 400 for a missing key.
    pub fn new(locker: Locker, extractor: K) -> Self {
        DistributedLockLayer {
            shared: Arc::new(Shared::new(locker)),
            extractor,
        }
    }

    /// The lease of each request's lock. Default: the locker's default TTL (30 s unless set
    /// with `LockerBuilder::default_ttl`).
    ///
    /// The watchdog renews the lock while the request runs, so this is not a limit on how
    /// long a request may take: it is how long the lock outlives a process that dies holding
    /// it, and what a rejected client's `Retry-After` counts down from. Must be within
    /// [`MIN_TTL`](dlock_runtime::MIN_TTL)..=[`MAX_TTL`](dlock_runtime::MAX_TTL); an invalid
    /// TTL makes every request fail with 500.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        Arc::make_mut(&mut self.shared).ttl = Some(ttl);
        self
    }

    /// What a request does when another holds its lock. Default: the locker's default,
    /// [`OnFail::Reject`] unless set with `LockerBuilder::default_on_fail` — answer 409 at
    /// once. [`OnFail::Retry`] waits in line (fairly, woken by the release) up to its deadline,
    /// then answers 409. A deferring strategy needs the work as a closure, which a layer in
    /// front of a service does not have: the runtime treats it like [`OnFail::Reject`] here.
    pub fn on_fail(mut self, on_fail: OnFail) -> Self {
        Arc::make_mut(&mut self.shared).on_fail = Some(on_fail);
        self
    }

    /// The human-readable detail of a contention answer (409), like the attribute's `message`.
    pub fn message(mut self, detail: impl Into<std::borrow::Cow<'static, str>>) -> Self {
        Arc::make_mut(&mut self.shared).message = Some(detail.into());
        self
    }

    /// Builds the answer to a lock error (held by another, timed out, backend down, a key over
    /// the length bound, lost) instead of the default problem+json. The error carries the
    /// [`message`](Self::message) as its detail; [`LockError::status`](dlock_runtime::LockError::status)
    /// and [`retry_after_secs`](dlock_runtime::LockError::retry_after_secs) help keep the
    /// HTTP meaning. Refusals that come before there is a key keep their problem+json
    /// ([`Rejection`](crate::Rejection)): a request without a key (the
    /// [`missing_key`](Self::missing_key) answer) and an extractor's refusal of the request
    /// itself — a repeated or non-UTF-8 header, a non-UTF-8 path parameter, a body that cannot
    /// be read or is over its limit (400, 413).
    ///
    /// ```
    /// # let locker = dlock_runtime::Locker::memory();
    /// use dlock_tower::{key, DistributedLockLayer};
    ///
    /// let layer = DistributedLockLayer::new(locker, key::header("idempotency-key"))
    ///     .rejection(|err: &dlock_runtime::LockError| {
    ///         http::Response::builder()
    ///             .status(err.status())
    ///             .body(format!("busy, try again ({err})"))
    ///             .unwrap()
    ///     });
    /// ```
    pub fn rejection<F>(mut self, f: F) -> Self
    where
        F: Fn(&dlock_runtime::LockError) -> http::Response<String> + Send + Sync + 'static,
    {
        Arc::make_mut(&mut self.shared).rejection = Some(super::RejectFn(Arc::new(f)));
        self
    }

    /// The attribute's `on_lost = "cancel"`: when the request's lock is lost while the handler
    /// runs (renewal refused, lease ran out), the handler's future is dropped at its current
    /// await point and the request is answered `503` ([`LockError::Lost`](dlock_runtime::LockError::Lost),
    /// through [`rejection`](Self::rejection) when set). Default: `false` (the handler runs on).
    pub fn cancel_on_lost(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.shared).cancel_on_lost = on;
        self
    }

    crate::layer_common_setters!(
        missing_key: "What a request without a key gets. Default: [`MissingKey::Reject`](crate::MissingKey::Reject) (400); \
            [`MissingKey::PassThrough`](crate::MissingKey::PassThrough) calls the inner service without a lock.",
        fail_mode: "What a request gets when the lock backend is unavailable. Default: \
            [`FailMode::Closed`](crate::FailMode::Closed) (503 + `Retry-After`); [`FailMode::Open`](crate::FailMode::Open) calls the inner \
            service without a lock (logged at `warn`)."
    );

    /// The key extractor.
    pub fn extractor(&self) -> &K {
        &self.extractor
    }
}

impl<S, K: Clone> Layer<S> for DistributedLockLayer<K> {
    type Service = DistributedLock<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        DistributedLock::from_parts(inner, self.extractor.clone(), self.shared.clone())
    }
}

impl<K: Clone> Clone for DistributedLockLayer<K> {
    fn clone(&self) -> Self {
        DistributedLockLayer {
            shared: self.shared.clone(),
            extractor: self.extractor.clone(),
        }
    }
}

impl<K> fmt::Debug for DistributedLockLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistributedLockLayer")
            .field("locker", &self.shared.locker)
            .field("extractor", &std::any::type_name::<K>())
            .field("ttl", &self.shared.ttl)
            .field("on_fail", &self.shared.on_fail)
            .field("fail_mode", &self.shared.fail_mode)
            .field("missing_key", &self.shared.missing_key)
            .field("message", &self.shared.message)
            .field("cancel_on_lost", &self.shared.cancel_on_lost)
            .finish()
    }
}
