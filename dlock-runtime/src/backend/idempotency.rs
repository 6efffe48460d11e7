//! The idempotency storage capability of a backend: records stored atomically with the key's
//! lock. Optional — [`Backend::idempotency`](super::Backend::idempotency) returns `None` by
//! default — and independent of the feature built on it (the `idempotency` module), which the
//! backend layer never names.

use std::fmt;
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::{BoxFuture, OwnerToken};
use crate::key::ResourceName;
use crate::LockError;

/// A digest of what an attempt asks for (for HTTP: method, path and body), stored with the
/// record so that a key reused for a *different* request is told apart from a retry.
///
/// SHA-256 over the fields given to [`FingerprintBuilder::field`], each framed by its length,
/// so that `["ab", "c"]` and `["a", "bc"]` differ.
///
/// ```
/// use dlock_runtime::idempotency::Fingerprint;
///
/// let a = Fingerprint::builder().field("POST").field("/payments").field(b"{}").finish();
/// let b = Fingerprint::builder().field("POST").field("/payments").field(b"{}").finish();
/// assert_eq!(a, b);
/// assert_eq!(a.to_hex().len(), 64);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Starts a fingerprint over fields.
    pub fn builder() -> FingerprintBuilder {
        let mut hasher = Sha256::new();
        hasher.update(b"dlock-idempotency-fingerprint-v1\0");
        FingerprintBuilder { hasher }
    }

    /// A fingerprint computed elsewhere (any 32-byte digest).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }

    /// The digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The digest as 64 lowercase hex digits (how backends store it).
    pub fn to_hex(&self) -> String {
        crate::util::hex(&self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Builds a [`Fingerprint`] from length-framed fields.
#[derive(Clone, Debug)]
pub struct FingerprintBuilder {
    hasher: Sha256,
}

impl FingerprintBuilder {
    /// Adds one field (its length, then its bytes).
    pub fn field(&mut self, bytes: impl AsRef<[u8]>) -> &mut Self {
        let bytes = bytes.as_ref();
        self.hasher.update((bytes.len() as u64).to_be_bytes());
        self.hasher.update(bytes);
        self
    }

    /// The fingerprint of the fields added so far.
    pub fn finish(&self) -> Fingerprint {
        Fingerprint(self.hasher.clone().finalize().into())
    }
}

/// One `begin` step's parameters (see [`IdempotencyStore::begin`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct BeginArgs<'a> {
    /// The key's lock.
    pub resource: &'a ResourceName,
    /// The owner token the lock is taken with.
    pub token: &'a OwnerToken,
    /// The lease.
    pub ttl: Duration,
    /// What this attempt asks for.
    pub fingerprint: &'a Fingerprint,
    /// How long the note of the running attempt's fingerprint lives at most.
    pub retention: Duration,
    /// Where a backend that can tell says whether this step was sent (see
    /// [`SendMark`](super::SendMark)).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) sent: Option<&'a super::SendSlot>,
}

/// What a `begin` step found (see [`IdempotencyStore::begin`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BeginReply {
    /// The lock is ours; the attempt runs the operation.
    Acquired {
        /// Strictly greater than every token issued for this key before.
        fencing_token: u64,
    },
    /// A completed record with the same fingerprint: its stored result.
    Replay {
        /// The bytes given to `complete`.
        record: Vec<u8>,
    },
    /// A completed record with a different fingerprint.
    Mismatch,
    /// Another attempt holds the key's lock (or the lock is free but a waiter is ahead).
    Held {
        /// The holder's remaining lease, when known.
        remaining: Option<Duration>,
        /// Whether the holder's attempt had the same fingerprint (`None`: unknown, e.g. the
        /// lock was taken by a plain lock request).
        same_fingerprint: Option<bool>,
    },
}

/// One `complete` step's parameters (see [`IdempotencyStore::complete`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct CompleteArgs<'a> {
    /// The key's lock.
    pub resource: &'a ResourceName,
    /// The owner token that must still hold it.
    pub token: &'a OwnerToken,
    /// The fingerprint stored with the record.
    pub fingerprint: &'a Fingerprint,
    /// The result to store.
    pub record: &'a [u8],
    /// How long the record is kept.
    pub retention: Duration,
    /// How many replicas must have the record before `complete` answers `true` (0: none). A
    /// store whose backend offers replica acknowledgement ([`Backend::replicate`](super::Backend::replicate))
    /// waits for them and, when fewer acknowledge it, answers [`LockError::Unavailable`]: the
    /// record is stored on the primary, and a failover may lose it. The begin step is
    /// acknowledged by the locker itself (`replicate` after the grant); a store whose backend
    /// cannot ([`LockError::Unsupported`]) never gets here with more than 0.
    pub replicas: u32,
}

/// Where a backend keeps idempotency records, next to its locks.
///
/// Every method is one atomic step with respect to the key's lock (the contract is in the
/// `idempotency` module's docs). A backend offers it through
/// [`Backend::idempotency`](super::Backend::idempotency); a backend without it leaves that at
/// its default (`None`) and the locker answers idempotency requests with a typed error.
pub trait IdempotencyStore: Send + Sync {
    /// A completed record → [`BeginReply::Replay`] or [`BeginReply::Mismatch`]; else the lock is
    /// held by another token (or a waiter is ahead) → [`BeginReply::Held`]; else take the lock
    /// with `args.token` for `args.ttl` with a new fencing token, note the fingerprint, and
    /// answer [`BeginReply::Acquired`]. A lock `args.token` holds already (this begin sent
    /// again after its answer was lost) is granted again, its lease restarted.
    fn begin<'a>(&'a self, args: BeginArgs<'a>) -> BoxFuture<'a, Result<BeginReply, LockError>>;

    /// If `args.token` still owns the lock: store the record with the retention period, release
    /// the lock and notify the next waiter, all at once, and answer `true`. Otherwise change
    /// nothing and answer `false`.
    fn complete<'a>(&'a self, args: CompleteArgs<'a>) -> BoxFuture<'a, Result<bool, LockError>>;

    /// If `token` still owns the lock: release it without a record (dropping the note of its
    /// fingerprint) and notify the next waiter; `false` when it did not own the lock.
    fn abort<'a>(
        &'a self,
        resource: &'a ResourceName,
        token: &'a OwnerToken,
    ) -> BoxFuture<'a, Result<bool, LockError>>;
}
