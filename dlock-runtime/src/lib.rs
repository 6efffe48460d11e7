//! # dlock-runtime
//!
//! Distributed locks for Rust services, made a one-line decision: the watchdog under
//! `#[distributed_lock]` and the `dlock-tower` layer, usable by hand.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
//! use std::time::Duration;
//! use dlock_runtime::{Locker, OnFail};
//!
//! // In-process by default; `Locker::from_url("redis://127.0.0.1:6379").await?` for Redis.
//! let locker = Locker::memory();
//!
//! let guard = locker
//!     .lock("report:2026-11")
//!     .ttl(Duration::from_secs(30))
//!     .on_fail(OnFail::retry(Duration::from_secs(5)))
//!     .acquire()
//!     .await?;
//! // ... write, passing guard.fencing_token() to the resource ...
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! ## What you get
//!
//! * **Backends**: [`MemoryBackend`](backend::MemoryBackend) (in-process, the embedded
//!   default) and Redis (`redis://`, feature `redis`, on by default) — one multiplexed RESP3
//!   connection per [`Locker`] for commands *and* release notifications; Redis Cluster
//!   (`redis+cluster://`, feature `cluster`), Redis behind Sentinel (`redis+sentinel://`,
//!   feature `sentinel`; acknowledged locks with [`LockRequest::replicas`]) and Redlock
//!   (`redlock://`).
//! * **Owner-checked everything**: 128-bit owner tokens from the OS CSPRNG; release and extend
//!   compare them atomically server side, so a stale holder never frees or extends the new
//!   owner's lock.
//! * **Fencing tokens** ([`LockGuard::fencing_token`]) strictly increasing per key, also across
//!   expiry.
//! * **Watchdog**: one renewal watchdog per locker extends every held guard at a third of its
//!   local lease (TTL/3, less where a backend's lease margin shortens the local lease) in batches;
//!   [`LockGuard::lost`] fires as soon as a lock is known gone (refused renewal, or the local
//!   lease clock ran out, e.g. after a process freeze).
//! * **Fair waiting** ([`OnFail::Retry`]): waiters queue in the backend in arrival order; a
//!   release hands the lock to the next waiter (Redis: in the same script, no further round
//!   trip) or wakes exactly that waiter; dead waiters' entries expire; a jittered backoff
//!   bounded by the holder's lease is the fallback, so a lost message costs latency, never a
//!   hang.
//! * **Cancel safety**: dropping an `acquire` future or a guard never leaves a lock held
//!   without an owner; drop never blocks a runtime thread.
//! * **Keys** that request data cannot forge into collisions ([`LockKey`]), with one Cluster
//!   hash tag per lock and bounded length.
//! * **Deadlines** on every backend call; a down backend is [`LockError::Unavailable`]
//!   (HTTP 503), never a hang or a panic.
//! * **Leader election** ([`Locker::elect`] → [`Election`]): a campaign on the fair lock that
//!   re-campaigns after loss, with the lock's fencing token as the leader's term.
//! * **HTTP mapping** of [`LockError`] (409 + `Retry-After` + problem+json, 503, …), with
//!   `IntoResponse` (feature `axum`) and `ResponseError` (feature `actix`).
//!
//! ## Features
//!
//! | feature | default | what |
//! |---|---|---|
//! | `macros` | yes | re-exports `#[distributed_lock]` |
//! | `redis` | yes | the Redis and Redlock backends |
//! | `conformance` | no | [`conformance`]: the backend conformance suite, for a `Backend` of your own (`conformance_tests!`) |
//! | `durable` | no | the durable Redis job queue, [`durable::DurableQueue`] (implies `redis`, adds serde) |
//! | `etcd` | no | the etcd backend, `backend::EtcdBackend` (`etcd://`; building it needs `protoc`) |
//! | `zookeeper` | no | the ZooKeeper backend, `backend::ZkBackend` (`zk://`) |
//! | `tls` | no | `rediss://` |
//! | `postgres` | no | the Postgres backend (`postgres://`), `backend::postgres` (tokio-postgres, deadpool-postgres) |
//! | `postgres-tls` | no | TLS for it per the URL's `sslmode` (rustls) |
//! | `axum` | no | `impl IntoResponse for LockError`, and `From<LockError>` for `Response`, `StatusCode` and `(StatusCode, String)` (handlers returning `Result<T, StatusCode>`, …) |
//! | `actix` | no | `impl actix_web::ResponseError for LockError` |
//! | `metrics` | no | [`metrics`]: counters, gauges and histograms through the `metrics` crate facade |

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod admin;
pub mod backend;
#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
mod context;
pub mod defer;
#[cfg(feature = "durable")]
#[cfg_attr(docsrs, doc(cfg(feature = "durable")))]
pub mod durable;
mod election;
mod error;
mod guard;
pub mod idempotency;
pub mod key;
mod lease;
mod locker;
pub mod metrics;
mod multi;
mod strategy;
mod util;
mod watchdog;

#[doc(hidden)]
#[path = "private.rs"]
pub mod __private;

pub use context::{current_lock, held_locks, LockInfo};
pub use election::{Election, ElectionRequest, Leadership};
pub use error::{BoxError, LockError, PROBLEM_JSON};
pub use guard::{with_lock, LockGuard};
pub use key::{LockKey, LockKind};
pub use locker::{
    default_locker, set_default_locker, IntoLockKey, LockRequest, Locker, LockerBuilder,
    RwLockRequest,
};
pub use multi::{with_locks, MultiGuard, MultiLockRequest};
pub use strategy::{DeferPolicy, OnFail, RetryPolicy};
pub use util::{MAX_TTL, MIN_TTL};

#[cfg(feature = "macros")]
pub use dlock_macros::distributed_lock;

/// `Result` with [`LockError`] as the default error.
pub type Result<T, E = LockError> = std::result::Result<T, E>;
