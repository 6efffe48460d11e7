use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::durable::DurableQueue;
use dlock_runtime::DeferPolicy;
use dlock_runtime::Locker;
use http::HeaderName;
use tower_layer::Layer;

use super::{Defer, Shared};

/// Takes each request's lock, keyed by an [extractor](crate::key); defers the busy ones into a
/// [`DurableQueue`]. See the [module docs](crate::defer).
///
/// ```no_run
/// # async fn f(locker: dlock_runtime::Locker) -> Result<(), dlock_runtime::LockError> {
/// use std::time::Duration;
/// use axum::{routing::post, Router};
/// use dlock_runtime::{durable::DurableQueue, DeferPolicy};
/// use dlock_tower::{key, DeferLayer};
///
/// let queue = DurableQueue::connect("redis://127.0.0.1:6379", "orders").await?;
/// let app: Router = Router::new()
///     .route("/orders", post(|| async { "created" }))
///     .route_layer(
///         DeferLayer::new(locker, key::header("idempotency-key"), queue)
///             .ttl(Duration::from_secs(10))
///             .policy(DeferPolicy::new(Duration::from_secs(1), 10)),
///     );
/// # Ok(()) }
/// ```
#[must_use]
pub struct DeferLayer<K> {
    extractor: K,
    shared: Arc<Shared>,
}

impl<K> DeferLayer<K> {
    /// Locks each request by `extractor`'s key with `locker`; defers busy ones into `queue`.
    /// Defaults: the policy `DeferPolicy::default()`, the locker's default TTL, fail-closed,
    /// 400 for a missing key, status path `/jobs`, body limit 1 MiB, no credentials stored.
    pub fn new(locker: Locker, extractor: K, queue: DurableQueue) -> Self {
        DeferLayer {
            extractor,
            shared: Arc::new(Shared::new(locker, queue)),
        }
    }

    /// How deferred requests are retried. Default: `DeferPolicy::default()` (first retry
    /// after about a second, 5 attempts, then the dead-letter set).
    pub fn policy(mut self, policy: DeferPolicy) -> Self {
        Arc::make_mut(&mut self.shared).policy = policy;
        self
    }

    /// The lease of each request's lock, and of its replay (renewed while it runs). Default:
    /// the locker's default TTL (30 s unless set with `LockerBuilder::default_ttl`).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        Arc::make_mut(&mut self.shared).ttl = Some(ttl);
        self
    }

    crate::layer_common_setters!(
        missing_key: "What a request without a key gets. Default: [`MissingKey::Reject`](crate::MissingKey::Reject) (400); \
            [`MissingKey::PassThrough`](crate::MissingKey::PassThrough) calls the inner service without a lock.",
        fail_mode: "What a request gets when the lock backend is unavailable. Default: \
            [`FailMode::Closed`](crate::FailMode::Closed) (503 + `Retry-After`); [`FailMode::Open`](crate::FailMode::Open) calls the inner \
            service without a lock. A busy lock whose queue is unavailable is always a 503."
    );

    /// Where the status of a job is served (`Location: <path>/<job id>`). Default: `/jobs`.
    pub fn status_path(mut self, path: impl Into<String>) -> Self {
        Arc::make_mut(&mut self.shared).status_path = path.into().trim_end_matches('/').to_owned();
        self
    }

    /// The largest request body that is stored for a replay; a larger one gets `413`.
    /// Default: 1 MiB. The body is stored hex-encoded, with the URI and stored headers (their
    /// values hex-encoded too), so a limit of 2 MiB or more needs the queue's
    /// [`max_job_bytes`](dlock_runtime::defer::QueueLimits::max_job_bytes) (4 MiB) raised to
    /// over twice the limit and the headers, or the larger requests get `413` from the queue.
    pub fn body_limit(mut self, bytes: usize) -> Self {
        Arc::make_mut(&mut self.shared).body_limit = bytes;
        self
    }

    /// A request header that is never stored (and so not replayed).
    pub fn exclude_header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.shared).excluded.push(name);
        self
    }

    /// Stores (and so replays) a credential header that is left out by default: any of the
    /// module's list — `Authorization`, `Cookie`, `Proxy-Authorization`, `X-Api-Key`,
    /// `Api-Key`, `X-Auth-Token`, `X-Access-Token`, `X-Amz-Security-Token`, `X-Goog-Api-Key`,
    /// `X-CSRF-Token`, `X-XSRF-Token`, and the ones authenticating proxies set:
    /// `X-Forwarded-Access-Token`, `X-Auth-Request-Access-Token`, `Cf-Access-Jwt-Assertion`,
    /// `X-Amzn-Oidc-AccessToken`, `X-Amzn-Oidc-Data` — or any header whose name contains
    /// `token`, `secret`, `jwt`, `authorization`, `api-key`, `apikey`, `password`, `cookie`,
    /// `credential`, `session`, `auth-key`, `access-key`, `private-key`, `master-key`,
    /// `subscription-key` or `functions-key` (see [the module docs](crate::defer)). Its value
    /// then sits in the queue's Redis for as long as the job lives, dead letters included.
    /// Other headers are stored anyway (unless [excluded](Self::exclude_header)); naming one
    /// here has no effect.
    pub fn store_header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.shared)
            .stored_credentials
            .push(name);
        self
    }

    /// The queue deferred requests go to.
    pub fn queue(&self) -> &DurableQueue {
        &self.shared.queue
    }

    /// The key extractor.
    pub fn extractor(&self) -> &K {
        &self.extractor
    }
}

impl<S, K: Clone> Layer<S> for DeferLayer<K> {
    type Service = Defer<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        Defer::from_parts(inner, self.extractor.clone(), self.shared.clone())
    }
}

impl<K: Clone> Clone for DeferLayer<K> {
    fn clone(&self) -> Self {
        DeferLayer {
            extractor: self.extractor.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<K> fmt::Debug for DeferLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeferLayer")
            .field("extractor", &std::any::type_name::<K>())
            .field("shared", &self.shared)
            .finish()
    }
}
