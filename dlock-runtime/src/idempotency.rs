//! Idempotency records kept with the lock: run an operation once per idempotency key, and
//! answer every later attempt with the stored result.
//!
//! This is the watchdog under `dlock_tower::IdempotencyLayer` (the `Idempotency-Key` HTTP header),
//! usable by hand for any operation whose result fits in bytes.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
//! use dlock_runtime::idempotency::{Begin, Fingerprint};
//! use dlock_runtime::Locker;
//!
//! let locker = Locker::memory();
//! let fingerprint = Fingerprint::builder().field("charge").field("42.00 EUR").finish();
//!
//! // First attempt: we hold the key's lock; run the operation and store its result.
//! let Begin::Run(op) = locker.idempotency("pay:7f3a", fingerprint).begin().await? else {
//!     unreachable!()
//! };
//! // ... charge the card, passing op.fencing_token() to the ledger ...
//! op.complete(b"charge ch_1 created").await?;
//!
//! // A retry gets the stored result; the operation does not run again.
//! match locker.idempotency("pay:7f3a", fingerprint).begin().await? {
//!     Begin::Replay(result) => assert_eq!(result, b"charge ch_1 created"),
//!     _ => unreachable!(),
//! }
//!
//! // The same key with a different request is refused.
//! let other = Fingerprint::builder().field("charge").field("99.00 EUR").finish();
//! assert!(matches!(
//!     locker.idempotency("pay:7f3a", other).begin().await?,
//!     Begin::Mismatch
//! ));
//! # Ok(()) }
//! ```
//!
//! # What happens, atomically
//!
//! Every idempotency key is a lock ([`LockKey`]) like any other — same owner tokens, fencing
//! tokens, lease and watchdog — plus a *record* stored next to it in the same backend (in Redis
//! under the lock's hash tag, in memory under the lock's shard mutex). Each step is one atomic
//! backend operation ([`IdempotencyStore`]):
//!
//! * **begin**: a completed record exists → [`Begin::Replay`] if its fingerprint matches, else
//!   [`Begin::Mismatch`]; else the lock is held → [`Begin::InProgress`] with the holder's
//!   remaining lease (and whether the holder's request had the same fingerprint); else take the
//!   lock (a single attempt that respects a fair waiter queue, like
//!   [`try_acquire`](crate::LockRequest::try_acquire)) and note the fingerprint with it →
//!   [`Begin::Run`].
//! * **complete** ([`IdempotentOperation::complete`]): only if this owner still holds the lock,
//!   store the record (fingerprint + result) with the retention period **and** delete the lock,
//!   and notify the next waiter, in one step.
//! * **abort** ([`IdempotentOperation::abort`], or dropping the operation): owner-checked
//!   release without a record; the next attempt runs the operation again.
//!
//! # Crashes
//!
//! There is no state in which a key blocks forever (other than an operation that never ends,
//! which its lease keeps renewed: bound it with a timeout) or replays a result that was not
//! stored:
//!
//! * **Crash (or lost connection, or a frozen process) while the operation runs, or after it
//!   ran but before `complete` reached the backend**: nothing renews the lease, so the lock
//!   frees after its TTL; no record exists, so the next attempt runs the operation *again*.
//!   The operation's side effects must therefore be safe to repeat: pass the
//!   [fencing token](IdempotentOperation::fencing_token) to the resource you write, so it
//!   rejects a stale holder — a token orders holders, it does not tell a repeat: the retry's
//!   token is larger, and accepted — and make the effect idempotent at the resource (record the
//!   key with the write, or a unique constraint on it). Until the TTL ends, attempts get
//!   [`Begin::InProgress`].
//! * **Crash after `complete` reached the backend**: the record and the lock's deletion are one
//!   step, so the next attempt replays the stored result. A failover of a Redis master before
//!   its replicas had the record loses it (asynchronous replication), and the next attempt runs
//!   again, unless the request asks for [`replicas`](IdempotencyRequest::replicas): then
//!   `complete` answers `Ok` only once that many replicas have it.
//! * **A holder that lost its lock** (lease ran out while the backend was unreachable, and
//!   another attempt took the key) cannot store a record: `complete` is owner-checked and
//!   answers [`LockError::Lost`].
//! * A note of the running request's fingerprint may outlive a crashed or cancelled holder
//!   (until the retention period ends); it is only read while its own holder's lock exists and
//!   is replaced by the next holder, so it never blocks or answers anything.
//!
//! # Backends
//!
//! [`MemoryBackend`](crate::backend::MemoryBackend), the Redis backend (one server, a Cluster,
//! Sentinel), Postgres and etcd store records. Redlock
//! ([`RedlockBackend`](crate::backend::RedlockBackend)) does not (yet): a record would need a
//! majority write that is atomic with the majority's lock release, which independent servers
//! cannot give; nor does ZooKeeper. Either way, [`IdempotencyRequest::begin`] answers
//! [`LockError::Unavailable`] naming the backend, and [`Locker::check_idempotency`] tells you
//! at startup.

use std::fmt;
use std::time::Duration;

use tracing::Instrument as _;

pub use crate::backend::idempotency::{
    BeginArgs, BeginReply, CompleteArgs, Fingerprint, FingerprintBuilder, IdempotencyStore,
};
use crate::lease::{Grant, Lease, Undo};
use crate::util::validate_ttl;
use crate::{IntoLockKey, LockError, LockKey, Locker};

/// How long a completed record is kept by default: 24 hours.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// The longest accepted retention period: 365 days.
pub const MAX_RETENTION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

pub(crate) fn validate_retention(retention: Duration) -> Result<Duration, LockError> {
    let reason = if retention < crate::MIN_TTL {
        format!("retention must be at least {:?}", crate::MIN_TTL)
    } else if retention > MAX_RETENTION {
        format!("retention must be at most {MAX_RETENTION:?}")
    } else {
        return Ok(retention);
    };
    Err(LockError::InvalidTtl {
        ttl: retention,
        reason,
    })
}

fn unsupported(locker: &Locker) -> LockError {
    LockError::unavailable(
        format!(
            "the {} backend does not store idempotency records (supported: memory, redis, postgres, etcd)",
            locker.backend_name()
        ),
        None,
    )
}

impl Locker {
    /// Starts an idempotent operation on `key` (a literal key or a [`LockKey`]) for an attempt
    /// whose request is summed up by `fingerprint`. See the [module docs](self).
    pub fn idempotency(
        &self,
        key: impl IntoLockKey,
        fingerprint: Fingerprint,
    ) -> IdempotencyRequest<'_> {
        IdempotencyRequest {
            locker: self,
            key: key.into_lock_key(),
            fingerprint,
            ttl: None,
            retention: DEFAULT_RETENTION,
            auto_renew: true,
            replicas: None,
            name: crate::metrics::UNNAMED,
        }
    }

    /// Whether this locker's backend stores idempotency records (memory, Redis and Postgres do,
    /// Redlock does not).
    pub fn supports_idempotency(&self) -> bool {
        self.backend().idempotency().is_some()
    }

    /// `Ok(())` when this locker's backend stores idempotency records, else the
    /// [`LockError::Unavailable`] that [`IdempotencyRequest::begin`] would answer, naming the
    /// backend: for a check at startup.
    pub fn check_idempotency(&self) -> Result<(), LockError> {
        if self.supports_idempotency() {
            Ok(())
        } else {
            Err(unsupported(self))
        }
    }
}

/// An idempotent operation about to begin, from [`Locker::idempotency`]. Set options, then
/// [`begin`](IdempotencyRequest::begin).
#[must_use = "an idempotency request does nothing until `begin` is awaited"]
pub struct IdempotencyRequest<'a> {
    locker: &'a Locker,
    key: Result<LockKey, LockError>,
    fingerprint: Fingerprint,
    ttl: Option<Duration>,
    retention: Duration,
    auto_renew: bool,
    replicas: Option<u32>,
    name: &'static str,
}

impl fmt::Debug for IdempotencyRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyRequest")
            .field("key", &self.key)
            .field("fingerprint", &self.fingerprint)
            .field("ttl", &self.ttl)
            .field("retention", &self.retention)
            .field("auto_renew", &self.auto_renew)
            .field("replicas", &self.replicas)
            .field("name", &self.name)
            .finish()
    }
}

impl IdempotencyRequest<'_> {
    /// The lease of the key's lock while the operation runs. Default: the locker's default TTL
    /// ([`Locker::default_ttl`]). The watchdog renews it while the operation runs; it is how
    /// long the key stays blocked after this process dies mid-operation.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// How long the completed record is kept. Default: [`DEFAULT_RETENTION`] (24 h); at most
    /// [`MAX_RETENTION`].
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Whether the watchdog renews the lock while the operation runs (default `true`). With
    /// `false` the lock ends after one TTL, completed or not.
    pub fn auto_renew(mut self, on: bool) -> Self {
        self.auto_renew = on;
        self
    }

    /// How many replicas must have the key's lock before the operation runs, and its record
    /// before [`complete`](IdempotentOperation::complete) answers `Ok` (Redis — one server,
    /// Sentinel, a cluster). Default: the locker's
    /// ([`LockerBuilder::replicas`](crate::LockerBuilder::replicas)), 0.
    ///
    /// With `n > 0`, a granted begin is renewed and waited on as a lock with
    /// [`LockRequest::replicas`](crate::LockRequest::replicas) is: when fewer than `n` replicas
    /// acknowledge it in time, the lock is given back and `begin` answers
    /// [`LockError::Unavailable`] (the operation did not run). `complete` stores the record and
    /// releases the lock on a connection of its own and `WAIT`s there: when fewer acknowledge
    /// it, it answers [`LockError::Unavailable`] — the record is on the master, but a failover
    /// before it reached a replica would lose it, and a retry would then run the operation
    /// again. Backends without replicas answer [`LockError::Unsupported`] at a `begin` that
    /// would run the operation (a replay, a mismatch or an attempt in progress is answered as
    /// usual).
    pub fn replicas(mut self, n: u32) -> Self {
        self.replicas = Some(n);
        self
    }

    /// The operation's name in metrics and traces (a bounded name, never the key; see
    /// [`LockRequest::name`](crate::LockRequest::name)). Default:
    /// [`UNNAMED`](crate::metrics::UNNAMED).
    pub fn name(mut self, name: &'static str) -> Self {
        self.name = name;
        self
    }

    /// One atomic step: replay, mismatch, in progress, or the lock for this attempt (see
    /// [`Begin`]).
    ///
    /// [`LockError::Lost`] when the answer came after the lease it granted had run out (a
    /// backend slower than the TTL, a frozen process): the lock is given back, as
    /// [`acquire`](crate::LockRequest::acquire) does, and the next attempt may run.
    ///
    /// Cancel-safe: dropping this future never leaves the key's lock held without an owner.
    pub async fn begin(self) -> Result<Begin, LockError> {
        let labels = self.locker.labels(self.name);
        let begun = self.begin_inner(labels).await;
        if let Ok(begun) = &begun {
            labels.idempotency(match begun {
                Begin::Run(_) => "run",
                Begin::Replay(_) => "replayed",
                Begin::Mismatch => "conflict",
                Begin::InProgress { .. } => "in_progress",
            });
        }
        begun
    }

    async fn begin_inner(self, labels: crate::metrics::Labels) -> Result<Begin, LockError> {
        let locker = self.locker;
        let key = self.key?;
        let ttl = validate_ttl(self.ttl.unwrap_or_else(|| locker.default_ttl()))?;
        let retention = validate_retention(self.retention)?;
        let Some(store) = locker.backend().idempotency() else {
            return Err(unsupported(locker));
        };
        let span = tracing::debug_span!(
            "dlock.idempotency.begin",
            key = %locker.key_log().show(key.as_str()),
            name = labels.name,
            backend = labels.backend,
        );
        let resource = locker.resource(key);
        // The begin may take the key's lock on the server: if this future is dropped before
        // the reply, undo it for as long as that lock could live (the request's TTL).
        // A begin given up on before it was sent (see `backend::SendMark`) has nothing to undo.
        let mut flight = Undo::new(locker.watchdog(), resource, ttl);
        flight.next_attempt();
        let sent = locker.watchdog().now_ns();
        let args = BeginArgs {
            resource: flight.resource(),
            token: flight.token(),
            ttl,
            fingerprint: &self.fingerprint,
            retention,
            sent: flight.slot(),
        };
        let reply = locker
            .with_deadline("idempotency begin", store.begin(args))
            .instrument(span)
            .await?;
        let replicas = self.replicas.unwrap_or_else(|| locker.default_replicas());
        if replicas > 0 && matches!(reply, BeginReply::Acquired { .. }) {
            acknowledged(locker, store, &mut flight, ttl, replicas).await?;
        }
        // The reply is in: nothing is left to undo unless we hold the lock, and then the
        // operation takes over.
        flight.disarm();
        Ok(match reply {
            BeginReply::Acquired { fencing_token } => {
                let grant = Grant {
                    fencing_token,
                    ttl,
                    lease: ttl,
                    sent_ns: sent,
                    auto_renew: self.auto_renew,
                    labels,
                };
                let op = IdempotentOperation {
                    lease: flight.into_lease(grant, locker.id()),
                    locker: locker.clone(),
                    fingerprint: self.fingerprint,
                    retention,
                    replicas,
                };
                if !op.is_held() {
                    // The answer came after the lease it granted had run out (slower than the
                    // TTL, or a frozen process): as with a guard, an operation that does not
                    // hold the key's lock is never handed out — another attempt may already
                    // be running it. Given back, in case the lock is still ours.
                    let key = op.key().to_owned();
                    let _ = op.abort().await;
                    return Err(LockError::lost(&key));
                }
                Begin::Run(op)
            }
            BeginReply::Replay { record } => Begin::Replay(record),
            BeginReply::Mismatch => Begin::Mismatch,
            BeginReply::Held {
                remaining,
                same_fingerprint,
            } => Begin::InProgress {
                retry_after: remaining,
                same_fingerprint: same_fingerprint.unwrap_or(true),
            },
        })
    }
}

/// Waits until `replicas` replicas have the lock a begin just took (renewed, then `WAIT`, as
/// [`LockRequest::replicas`](crate::LockRequest::replicas) does). When fewer acknowledge it,
/// or the backend cannot tell, the lock and the attempt's note are given back — at once, or
/// by the armed undo in the background — and the error is returned: the operation does not run.
async fn acknowledged(
    locker: &Locker,
    store: &dyn crate::backend::IdempotencyStore,
    flight: &mut Undo<'_>,
    ttl: Duration,
    replicas: u32,
) -> Result<(), LockError> {
    let asked = locker
        .backend()
        .replicate(flight.resource(), flight.token(), ttl, replicas);
    let err = match locker.with_deadline("replicate", asked).await {
        Ok(acked) if acked >= replicas => return Ok(()),
        Ok(acked) => LockError::unavailable(
            format!(
                "idempotency key `{}` reached {acked} of the {replicas} replicas asked for in time",
                flight.resource().key()
            ),
            None,
        ),
        Err(e) => e,
    };
    let undo = store.abort(flight.resource(), flight.token());
    if locker
        .with_deadline("idempotency abort", undo)
        .await
        .is_ok()
    {
        flight.disarm();
    }
    Err(err)
}

/// The outcome of [`IdempotencyRequest::begin`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Begin {
    /// No record: this attempt holds the key's lock. Run the operation, then
    /// [`complete`](IdempotentOperation::complete) it with its result, or
    /// [`abort`](IdempotentOperation::abort) it to let the next attempt run again.
    Run(IdempotentOperation),
    /// A completed record with the same fingerprint: the result given to `complete`. Do not
    /// run the operation.
    Replay(Vec<u8>),
    /// A completed record with a different fingerprint: the key was reused for another
    /// request.
    Mismatch,
    /// Another attempt with this key is running.
    InProgress {
        /// The running attempt's remaining lease, when known (an upper bound on how long the
        /// key stays blocked if that attempt's process died).
        retry_after: Option<Duration>,
        /// Whether the running attempt has the same fingerprint (`true` when unknown).
        same_fingerprint: bool,
    },
}

/// A running idempotent operation: holds the key's lock (renewed by the locker's watchdog)
/// until [`complete`](IdempotentOperation::complete), [`abort`](IdempotentOperation::abort)
/// or drop.
///
/// It is the same lease as a [`LockGuard`](crate::LockGuard) — same watchdog, local lease
/// clock, loss detection and cancel safety — that ends differently: `complete` replaces the
/// release with one step that stores the record and releases together. Dropping it releases
/// the lock in the background without a record (like dropping a guard), so the next attempt
/// runs the operation again.
#[must_use = "the key's lock is released without a record when the operation is dropped"]
pub struct IdempotentOperation {
    lease: Lease,
    locker: Locker,
    fingerprint: Fingerprint,
    retention: Duration,
    /// How many replicas must have the record (see [`IdempotencyRequest::replicas`]).
    replicas: u32,
}

impl fmt::Debug for IdempotentOperation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentOperation")
            .field("key", &self.key())
            .field("fencing_token", &self.fencing_token())
            .field("fingerprint", &self.fingerprint)
            .field("held", &self.is_held())
            .finish()
    }
}

crate::lease::lease_handle_methods!(IdempotentOperation);

impl IdempotentOperation {
    /// The fingerprint the record will be stored with.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    /// Stores `record` as the key's result for the retention period and releases the lock, in
    /// one atomic step. Later attempts with the same fingerprint get [`Begin::Replay`] with
    /// these bytes.
    ///
    /// [`LockError::Lost`] when the lock was no longer ours (nothing is stored; the next
    /// attempt runs the operation again). [`LockError::Unavailable`] when the backend did not
    /// answer: the record may or may not be stored; if it is not, the lock is released in the
    /// background (or ends with its TTL) and the next attempt runs again.
    ///
    /// Cancel-safe: dropping this future releases the lock in the background; whether the
    /// record was stored then depends on whether the step reached the backend.
    pub async fn complete(self, record: &[u8]) -> Result<(), LockError> {
        let Some(store) = self.locker.backend().idempotency() else {
            return Err(unsupported(&self.locker));
        };
        let args = CompleteArgs {
            resource: self.lease.resource(),
            token: self.lease.token(),
            fingerprint: &self.fingerprint,
            record,
            retention: self.retention,
            replicas: self.replicas,
        };
        // An unknown outcome (`Err`) hands an owner-checked release to the background,
        // harmless if the record was stored (the lock is gone then). A local lease that ran
        // out before the step stores nothing: the answer is `Lost` whatever the backend says,
        // and `Lost` means the next attempt runs the operation again — a record stored by a
        // backend that still found the lock ours (an etcd lease, whole seconds, outlives the
        // local one) would be replayed for an operation its caller was told had not finished.
        let (resource, token) = (self.lease.resource(), self.lease.token());
        self.lease
            .settle("idempotency complete", |held| {
                if held {
                    store.complete(args)
                } else {
                    store.abort(resource, token)
                }
            })
            .instrument(self.lease.span("dlock.idempotency.complete"))
            .await
    }

    /// Releases the lock without storing a record: the next attempt runs the operation again.
    /// [`LockError::Lost`] when the lock was no longer ours.
    ///
    /// Cancel-safe, like [`complete`](IdempotentOperation::complete).
    pub async fn abort(self) -> Result<(), LockError> {
        let Some(store) = self.locker.backend().idempotency() else {
            return Err(unsupported(&self.locker));
        };
        self.lease
            .settle("idempotency abort", |_| {
                store.abort(self.lease.resource(), self.lease.token())
            })
            .instrument(self.lease.span("dlock.idempotency.abort"))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(fields: &[&[u8]]) -> Fingerprint {
        let mut b = Fingerprint::builder();
        for f in fields {
            b.field(f);
        }
        b.finish()
    }

    #[test]
    fn fingerprint_fields_are_framed() {
        assert_ne!(fp(&[b"ab", b"c"]), fp(&[b"a", b"bc"]));
        assert_ne!(fp(&[b"abc"]), fp(&[b"abc", b""]));
        assert_ne!(fp(&[]), fp(&[b""]));
        assert_eq!(fp(&[b"a", b"b"]), fp(&[b"a", b"b"]));
    }

    #[test]
    fn fingerprint_hex_is_64_lowercase_digits() {
        let f = fp(&[b"POST", b"/payments", b"{}"]);
        let hex = f.to_hex();
        assert_eq!(hex.len(), 64);
        assert!(hex
            .chars()
            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)));
        assert_eq!(f.to_string(), hex);
        assert_eq!(Fingerprint::from_bytes(*f.as_bytes()), f);
    }

    #[test]
    fn retention_bounds_are_enforced() {
        assert!(validate_retention(Duration::ZERO).unwrap_err().is_invalid());
        assert!(validate_retention(DEFAULT_RETENTION).is_ok());
        assert!(validate_retention(MAX_RETENTION + Duration::from_secs(1)).is_err());
    }

    #[tokio::test]
    async fn memory_flow_run_replay_mismatch_in_progress() {
        let locker = Locker::memory();
        let a = fp(&[b"a"]);
        let b = fp(&[b"b"]);
        let Begin::Run(op) = locker.idempotency("k", a).begin().await.unwrap() else {
            panic!("first attempt runs")
        };
        match locker.idempotency("k", a).begin().await.unwrap() {
            Begin::InProgress {
                retry_after: Some(_),
                same_fingerprint: true,
            } => {}
            other => panic!("{other:?}"),
        }
        match locker.idempotency("k", b).begin().await.unwrap() {
            Begin::InProgress {
                same_fingerprint: false,
                ..
            } => {}
            other => panic!("{other:?}"),
        }
        op.complete(b"result").await.unwrap();
        match locker.idempotency("k", a).begin().await.unwrap() {
            Begin::Replay(r) => assert_eq!(r, b"result"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            locker.idempotency("k", b).begin().await.unwrap(),
            Begin::Mismatch
        ));
        // The lock itself is free after completion.
        assert!(locker.lock("k").try_acquire().await.unwrap().is_some());
    }

    #[tokio::test]
    async fn abort_and_drop_free_the_key_without_a_record() {
        let locker = Locker::memory();
        let a = fp(&[b"a"]);
        let Begin::Run(op) = locker.idempotency("k", a).begin().await.unwrap() else {
            panic!()
        };
        op.abort().await.unwrap();
        let Begin::Run(op) = locker.idempotency("k", a).begin().await.unwrap() else {
            panic!("aborted key runs again")
        };
        let first = op.fencing_token();
        drop(op);
        // The background release runs on this runtime: wait for it through a fair waiter.
        let guard = locker
            .lock("k")
            .on_fail(crate::OnFail::retry(Duration::from_secs(5)))
            .acquire()
            .await
            .unwrap();
        guard.release().await.unwrap();
        let Begin::Run(op) = locker.idempotency("k", a).begin().await.unwrap() else {
            panic!("dropped key runs again")
        };
        assert!(op.fencing_token() > first);
        op.complete(b"x").await.unwrap();
    }

    /// The in-memory backend, whose `begin` answers `slow` late (after it ran).
    struct SlowBegin {
        inner: crate::backend::MemoryBackend,
        slow: Duration,
    }

    impl crate::backend::Backend for SlowBegin {
        fn name(&self) -> &'static str {
            "slow-begin"
        }

        fn acquire<'a>(
            &'a self,
            args: crate::backend::AcquireArgs<'a>,
        ) -> crate::backend::BoxFuture<'a, Result<crate::backend::Attempt, LockError>> {
            self.inner.acquire(args)
        }

        fn release<'a>(
            &'a self,
            resource: &'a crate::key::ResourceName,
            token: &'a crate::backend::OwnerToken,
        ) -> crate::backend::BoxFuture<'a, Result<bool, LockError>> {
            self.inner.release(resource, token)
        }

        fn extend<'a>(
            &'a self,
            resource: &'a crate::key::ResourceName,
            token: &'a crate::backend::OwnerToken,
            ttl: Duration,
        ) -> crate::backend::BoxFuture<'a, Result<bool, LockError>> {
            self.inner.extend(resource, token, ttl)
        }

        fn abandon<'a>(
            &'a self,
            resource: &'a crate::key::ResourceName,
            token: &'a crate::backend::OwnerToken,
        ) -> crate::backend::BoxFuture<'a, Result<(), LockError>> {
            self.inner.abandon(resource, token)
        }

        fn idempotency(&self) -> Option<&dyn crate::backend::IdempotencyStore> {
            Some(self)
        }
    }

    impl crate::backend::IdempotencyStore for SlowBegin {
        fn begin<'a>(
            &'a self,
            args: crate::backend::idempotency::BeginArgs<'a>,
        ) -> crate::backend::BoxFuture<'a, Result<crate::backend::idempotency::BeginReply, LockError>>
        {
            Box::pin(async move {
                let reply = self.inner.begin(args).await;
                tokio::time::sleep(self.slow).await;
                reply
            })
        }

        fn complete<'a>(
            &'a self,
            args: crate::backend::idempotency::CompleteArgs<'a>,
        ) -> crate::backend::BoxFuture<'a, Result<bool, LockError>> {
            self.inner.complete(args)
        }

        fn abort<'a>(
            &'a self,
            resource: &'a crate::key::ResourceName,
            token: &'a crate::backend::OwnerToken,
        ) -> crate::backend::BoxFuture<'a, Result<bool, LockError>> {
            self.inner.abort(resource, token)
        }
    }

    /// A `begin` whose answer came after the lease it granted had run out is `Lost`, and the
    /// lock is given back: it handed out an operation that did not hold the key's lock (as
    /// `acquire` never hands out such a guard), and a second attempt, begun once the first's
    /// lease was over, ran the operation beside it.
    #[tokio::test]
    async fn a_begin_answered_after_its_lease_ran_out_is_lost_and_gives_the_lock_back() {
        let backend = SlowBegin {
            inner: crate::backend::MemoryBackend::new(),
            slow: Duration::from_millis(60),
        };
        let locker = Locker::builder()
            .command_timeout(Duration::from_secs(5))
            .build(backend);
        let a = fp(&[b"a"]);
        let begin = || {
            locker
                .idempotency("k", a)
                .ttl(Duration::from_millis(20))
                .begin()
        };
        let err = begin().await.unwrap_err();
        assert!(err.is_lost(), "{err:?}");
        // No record was stored: the next attempt is asked to run too (and is late again).
        assert!(begin().await.unwrap_err().is_lost());
        // An answer in time runs as before.
        let fast = Locker::builder().build(SlowBegin {
            inner: crate::backend::MemoryBackend::new(),
            slow: Duration::ZERO,
        });
        let Begin::Run(op) = fast.idempotency("k", a).begin().await.unwrap() else {
            panic!("an answer in time runs the operation")
        };
        assert!(op.is_held());
        op.complete(b"done").await.unwrap();
    }

    /// The note of the attempt running on `key` (begun with a fingerprint other than `[8; 32]`)
    /// is still there: a request with another fingerprint is told it differs (without the
    /// note the store could not tell, and would answer `true`).
    async fn assert_note_kept(locker: &Locker, key: &str) {
        match locker
            .idempotency(key.to_owned(), Fingerprint::from_bytes([8; 32]))
            .begin()
            .await
            .unwrap()
        {
            Begin::InProgress {
                same_fingerprint, ..
            } => assert!(!same_fingerprint, "the running attempt's note was dropped"),
            other => panic!("the running attempt: {other:?}"),
        }
    }

    /// Filled over its capacity, the in-memory store drops the completed records nearest their expiry —
    /// the newest records still replay, the oldest run again — and keeps a running attempt
    /// begun before them all.
    #[tokio::test]
    async fn records_over_capacity_drop_those_nearest_their_expiry_first() {
        const CAPACITY: usize = 16 * 1024;
        let locker =
            Locker::new(crate::backend::MemoryBackend::new().with_idempotency_capacity(CAPACITY));
        let fp = Fingerprint::from_bytes([7; 32]);
        let result = vec![b'r'; 1024];
        let Begin::Run(running) = locker.idempotency("running", fp).begin().await.unwrap() else {
            panic!("a first attempt runs")
        };
        let retention = |i: u64| Duration::from_secs(60 + i);
        for i in 0..40 {
            let begin = locker
                .idempotency(format!("k{i}"), fp)
                .retention(retention(i));
            let Begin::Run(op) = begin.begin().await.unwrap() else {
                panic!("k{i} runs")
            };
            op.complete(&result).await.unwrap();
        }
        let mut replayed = Vec::new();
        let mut ran_again = Vec::new();
        for i in (0..40).rev() {
            match locker
                .idempotency(format!("k{i}"), fp)
                .begin()
                .await
                .unwrap()
            {
                Begin::Replay(r) => {
                    assert_eq!(r, result);
                    replayed.push(i);
                }
                Begin::Run(op) => {
                    op.abort().await.unwrap();
                    ran_again.push(i);
                }
                other => panic!("k{i}: {other:?}"),
            }
        }
        let kept = replayed.len();
        assert_eq!(replayed, (40 - kept..40).rev().collect::<Vec<_>>());
        assert!(
            (10..=CAPACITY / 1024).contains(&kept),
            "{kept} records of 1 KiB kept within {CAPACITY} bytes"
        );
        assert!(ran_again.contains(&0));
        assert_note_kept(&locker, "running").await;
        running.complete(b"done").await.unwrap();
        match locker.idempotency("running", fp).begin().await.unwrap() {
            Begin::Replay(r) => assert_eq!(r, b"done"),
            other => panic!("the running attempt's record: {other:?}"),
        }
    }

    /// Notes left by attempts that ended without `complete` or `abort` — their operations
    /// dropped, their locks released in the background — are garbage, not running attempts:
    /// over the capacity they go first, before any completed record. Once, kept for their
    /// whole retention and never dropped, they filled the store, and every record completed
    /// after that was dropped as soon as it was stored (its retry ran the handler again).
    #[tokio::test]
    async fn notes_of_dropped_attempts_go_before_completed_records() {
        const CAPACITY: usize = 16 * 1024;
        let backend = crate::backend::MemoryBackend::new().with_idempotency_capacity(CAPACITY);
        let locker = Locker::new(backend.clone());
        let fp = Fingerprint::from_bytes([7; 32]);
        let Begin::Run(running) = locker.idempotency("running", fp).begin().await.unwrap() else {
            panic!("a first attempt runs")
        };
        // 200 notes of about 170 bytes: twice the capacity.
        for i in 0..200 {
            let Begin::Run(op) = locker
                .idempotency(format!("d{i}"), fp)
                .begin()
                .await
                .unwrap()
            else {
                panic!("d{i} runs")
            };
            drop(op);
        }
        // The dropped attempts' locks are released by the locker's background task, on this
        // runtime.
        for _ in 0..10_000 {
            if backend.len() == 1 {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert_eq!(
            backend.len(),
            1,
            "the dropped attempts' locks were not released"
        );
        let Begin::Run(op) = locker.idempotency("done", fp).begin().await.unwrap() else {
            panic!("a first attempt runs")
        };
        op.complete(&[b'r'; 1024]).await.unwrap();
        match locker.idempotency("done", fp).begin().await.unwrap() {
            Begin::Replay(r) => assert_eq!(r, [b'r'; 1024]),
            other => panic!("the record just completed: {other:?}"),
        }
        let bytes = backend.idempotency_bytes();
        assert!(bytes <= CAPACITY, "{bytes} bytes kept, capacity {CAPACITY}");
        assert_note_kept(&locker, "running").await;
        running.complete(b"done").await.unwrap();
    }
}
