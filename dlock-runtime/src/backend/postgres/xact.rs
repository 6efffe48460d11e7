//! Transaction-scoped locks: `pg_advisory_xact_lock` inside the caller's own transaction.
//!
//! ```no_run
//! # async fn f(client: &mut dlock_runtime::backend::postgres::tokio_postgres::Client)
//! # -> Result<(), Box<dyn std::error::Error>> {
//! use dlock_runtime::backend::postgres::lock_in_transaction;
//! use dlock_runtime::LockKey;
//!
//! let tx = client.transaction().await?;
//! lock_in_transaction(&tx, "dlock", &LockKey::new("order:42")?).await?;
//! tx.execute("UPDATE orders SET state = 'paid' WHERE id = 42", &[]).await?;
//! tx.commit().await?; // the lock is released here, with the writes — or on rollback
//! # Ok(()) }
//! ```
//!
//! The lock lives exactly as long as the transaction: no lease, no renewal, no release call, no
//! owner token. Writes made in that transaction need no fencing token — they commit only if the
//! transaction held the lock until its commit. A crashed client, a terminated session or a
//! rollback frees it at once.
//!
//! **Keys.** Advisory locks take a 64-bit key: [`xact_lock_id`] is the first 8 bytes of the
//! SHA-256 of the lock's resource name (`<prefix>:{<encoded key>}`, the same name a
//! [`Locker`](crate::Locker) with that prefix uses). Two different names share an id with
//! probability about n²/2⁶⁵ among n names in use at once (below 10⁻⁸ for 600 000 names); a
//! collision only makes the two keys take turns — exclusion is never broken. The
//! single-`bigint` key space used here never meets the two-`int4` one of the backend's internal
//! serialisation, but is shared with any advisory locks the application takes itself.
//!
//! **Not the same lock as [`Locker`](crate::Locker)'s**: a transaction-scoped lock and a
//! lease on the same key do not exclude each other. Choose one kind per key.
//!
//! Through PgBouncer in transaction pooling this works (the lock is transaction-level); a
//! session-level advisory lock would not.

use sha2::{Digest, Sha256};
use tokio_postgres::types::Type;
use tokio_postgres::Transaction;

use super::pg_err;
use crate::key::ResourceName;
use crate::{LockError, LockKey};

/// The advisory lock id of `key` under `prefix`: the first 8 bytes (big-endian) of the SHA-256
/// of the resource name `<prefix>:{<key>}`.
///
/// # Errors
/// [`LockError::InvalidKey`] if the prefix is invalid (as for [`LockerBuilder::prefix`](crate::LockerBuilder::prefix)).
pub fn xact_lock_id(prefix: &str, key: &LockKey) -> Result<i64, LockError> {
    crate::key::validate_prefix(prefix)?;
    let name = ResourceName::new(prefix, key.clone());
    let digest = Sha256::digest(name.as_str().as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    Ok(i64::from_be_bytes(first))
}

/// Takes the lock of `key` (under `prefix`) for the rest of `tx`, waiting as long as another
/// transaction holds it (bounded by the session's `lock_timeout` / `statement_timeout`, if
/// set). Released when `tx` commits or rolls back.
///
/// # Errors
/// [`LockError::InvalidKey`] for an invalid prefix; [`LockError::Unavailable`] when the
/// statement fails (connection lost, a timeout set on the session).
pub async fn lock_in_transaction(
    tx: &Transaction<'_>,
    prefix: &str,
    key: &LockKey,
) -> Result<(), LockError> {
    let id = xact_lock_id(prefix, key)?;
    tx.query_typed("SELECT pg_advisory_xact_lock($1)", &[(&id, Type::INT8)])
        .await
        .map_err(|e| pg_err("transaction lock", e))?;
    Ok(())
}

/// Like [`lock_in_transaction`] but never waits: `true` when `tx` holds the lock now, `false`
/// when another transaction does.
///
/// # Errors
/// As [`lock_in_transaction`].
pub async fn try_lock_in_transaction(
    tx: &Transaction<'_>,
    prefix: &str,
    key: &LockKey,
) -> Result<bool, LockError> {
    let id = xact_lock_id(prefix, key)?;
    let rows = tx
        .query_typed("SELECT pg_try_advisory_xact_lock($1)", &[(&id, Type::INT8)])
        .await
        .map_err(|e| pg_err("transaction lock", e))?;
    rows.first()
        .and_then(|r| r.try_get::<_, bool>(0).ok())
        .ok_or_else(|| LockError::unavailable("postgres transaction lock: malformed reply", None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_the_digest_of_the_resource_name() {
        let k = LockKey::new("order:1").unwrap();
        let a = xact_lock_id("dlock", &k).unwrap();
        assert_eq!(a, xact_lock_id("dlock", &k).unwrap());
        assert_ne!(a, xact_lock_id("other", &k).unwrap());
        assert_ne!(
            a,
            xact_lock_id("dlock", &LockKey::new("order:2").unwrap()).unwrap()
        );
        let digest = Sha256::digest(b"dlock:{order:1}");
        assert_eq!(a.to_be_bytes(), digest[..8]);
        assert!(xact_lock_id("bad{", &k).is_err());
    }
}
