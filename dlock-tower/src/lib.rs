//! # dlock-tower
//!
//! Per-request distributed locks for any `tower` + `http` stack (axum, hyper, tonic):
//! [`DistributedLockLayer`] takes a [`dlock_runtime`] lock keyed by the request before calling
//! your service, and answers `409 Conflict` with `Retry-After` when another request holds it.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use std::convert::Infallible;
//! use std::time::Duration;
//! use dlock_runtime::{LockInfo, Locker};
//! use dlock_tower::{key, DistributedLockLayer};
//! use http::{Request, Response};
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//!
//! // In-process locks; `Locker::from_url("redis://…").await?` to share them across instances.
//! let locker = Locker::memory();
//! let svc = ServiceBuilder::new()
//!     .layer(
//!         DistributedLockLayer::new(locker.clone(), key::header("idempotency-key"))
//!             .ttl(Duration::from_secs(10)),
//!     )
//!     .service(service_fn(|req: Request<String>| async move {
//!         // The lock's key and fencing token are in the request extensions.
//!         let lock = req.extensions().get::<LockInfo>().unwrap();
//!         Ok::<_, Infallible>(Response::new(format!("fencing token {}", lock.fencing_token())))
//!     }));
//!
//! let request = || {
//!     Request::post("/payments")
//!         .header("idempotency-key", "4f1c")
//!         .body(String::new())
//!         .unwrap()
//! };
//!
//! let res = svc.clone().oneshot(request()).await.unwrap();
//! assert_eq!(res.status(), 200);
//!
//! // While another holder has the lock, the same key is answered 409 + Retry-After.
//! let held = locker.lock("hdr:idempotency-key:4f1c").acquire().await.unwrap();
//! let res = svc.clone().oneshot(request()).await.unwrap();
//! assert_eq!(res.status(), 409);
//! assert!(res.headers().contains_key("retry-after"));
//! assert_eq!(res.headers()["content-type"], "application/problem+json");
//! drop(held);
//!
//! // No key: 400 by default (or pass through, see `MissingKey`).
//! let res = svc.oneshot(Request::new(String::new())).await.unwrap();
//! assert_eq!(res.status(), 400);
//! # }
//! ```
//!
//! ## What you get
//!
//! * [`DistributedLockLayer`] / [`DistributedLock`], laid out like tower's own middleware, with
//!   a TTL, a strategy for a held lock ([`OnFail`](dlock_runtime::OnFail): reject at once, or
//!   wait in line), fail-open or fail-closed ([`FailMode`]) when the backend is down, and a
//!   choice of what a request without a key gets ([`MissingKey`]). See [`lock`] for the
//!   lifecycle and every response.
//! * [Key extractors](key): a header (`Idempotency-Key`), method + path, axum's matched route
//!   and path parameters (feature `axum`), an identity from the request extensions, a bounded
//!   body digest, closures, and `and`/`or` combinations. Request data can never forge a key
//!   that collides with another request's.
//! * The handler reads the lock's [`LockInfo`](dlock_runtime::LockInfo) (key, fencing token)
//!   from the request extensions (`Extension<LockInfo>` in axum).
//! * [`DeferLayer`] (feature `defer`): when a request's lock is busy, `202 Accepted` with a job id and a status
//!   location; the request is stored in the durable Redis queue and replayed through the
//!   application when the lock frees ([`defer`]). The `202` carries the [`Deferred`] mark, so
//!   an [`IdempotencyLayer`] outside does not store it as the key's response.
//! * [`IdempotencyLayer`] / [`Idempotency`]: the `Idempotency-Key` header (IETF draft). The
//!   first request with a key runs and its response is stored atomically with the key's lock;
//!   retries get the stored response byte for byte, a key reused with another payload `422`,
//!   a duplicate while the first runs `409` ([`idempotency`]).
//! * Rejections are responses (409, 503, 400, 413 with `application/problem+json`), so the
//!   service's error type is untouched; the response body type is the inner service's own
//!   (`ResBody: From<String>`), so the layer fits axum's `Router::layer` / `route_layer` and a
//!   plain `tower::ServiceBuilder` over hyper alike.
//!
//! ## Features
//!
//! | feature | default | what |
//! |---|---|---|
//! | `axum` | no | [`key::matched_path`], [`key::path_params`], [`key::path_param`]; the layers read axum's `OriginalUri` inside `Router::nest` |
//! | `admin` | no | `admin::router`: the ops page (axum); also reads `OriginalUri`, like `axum` |
//! | `metrics` | no | the layers' metrics (forwards to `dlock-runtime/metrics`) |
//! | `defer` | no | [`DeferLayer`] and [`defer`] (enables `dlock-runtime/durable`: the Redis job queue) |

#![cfg_attr(docsrs, feature(doc_cfg))]

/// The accessors every middleware service of this crate has (`inner` and `shared.locker`
/// fields), written once: `get_ref`, `get_mut`, `into_inner` and `locker`.
macro_rules! service_accessors {
    ($ty:ident < $inner:ident $(, $g:ident)* >) => {
        impl<$inner $(, $g)*> $ty<$inner $(, $g)*> {
            /// The inner service.
            pub fn get_ref(&self) -> &$inner {
                &self.inner
            }

            /// The inner service, mutably.
            pub fn get_mut(&mut self) -> &mut $inner {
                &mut self.inner
            }

            /// Consumes `self`, returning the inner service.
            pub fn into_inner(self) -> $inner {
                self.inner
            }

            /// The locker.
            pub fn locker(&self) -> &dlock_runtime::Locker {
                &self.shared.locker
            }
        }
    };
}
pub(crate) use service_accessors;

/// The `missing_key`, `fail_mode` and `locker` methods every layer of this crate has (a
/// `shared: Arc<Shared>` field with `missing_key`, `fail_mode` and `locker`), each with the
/// layer's own docs.
macro_rules! layer_common_setters {
    (missing_key: $missing_doc:literal, fail_mode: $fail_doc:literal) => {
        #[doc = $missing_doc]
        pub fn missing_key(mut self, missing: $crate::MissingKey) -> Self {
            std::sync::Arc::make_mut(&mut self.shared).missing_key = missing;
            self
        }

        #[doc = $fail_doc]
        pub fn fail_mode(mut self, mode: $crate::FailMode) -> Self {
            std::sync::Arc::make_mut(&mut self.shared).fail_mode = mode;
            self
        }

        /// The name of this layer's locks in metrics (the `name` label) and traces: a bounded
        /// name such as `"payments"`, never derived from request data, so the number of metric
        /// series stays bounded. Default:
        /// [`UNNAMED`](dlock_runtime::metrics::UNNAMED).
        pub fn name(mut self, name: &'static str) -> Self {
            std::sync::Arc::make_mut(&mut self.shared).name = name;
            self
        }

        /// The locker.
        pub fn locker(&self) -> &dlock_runtime::Locker {
            &self.shared.locker
        }
    };
}
pub(crate) use layer_common_setters;

#[cfg(feature = "admin")]
#[cfg_attr(docsrs, doc(cfg(feature = "admin")))]
pub mod admin;
#[cfg(feature = "defer")]
#[cfg_attr(docsrs, doc(cfg(feature = "defer")))]
pub mod defer;
mod deferred;
mod hex;
pub mod idempotency;
pub mod key;
pub mod lock;
mod rejection;
mod uri;

#[cfg(feature = "defer")]
pub use defer::DeferLayer;
pub use deferred::Deferred;
pub use idempotency::{Idempotency, IdempotencyLayer, MissingIdentity};
pub use lock::{DistributedLock, DistributedLockLayer, FailMode, MissingKey};
pub use rejection::Rejection;
