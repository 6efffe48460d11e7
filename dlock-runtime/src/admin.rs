//! Operating dlock: inspect locks, list a namespace's locks, free a stuck lock by hand, and
//! see this process's recent contention — what the `dlock` CLI and `dlock_tower::admin` (the
//! ops page) are built on.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
//! use dlock_runtime::Locker;
//!
//! let locker = Locker::memory();
//! let guard = locker.lock("report:2026-11").acquire().await?;
//! let admin = locker.admin()?;
//! let state = admin.inspect("report:2026-11").await?;
//! let holder = state.holder.expect("held");
//! assert_eq!(holder.fencing_token, Some(guard.fencing_token()));
//! assert_eq!(holder.token_prefix.len(), 8); // never the whole owner token
//!
//! // Frees it whoever holds it, and raises the fencing counter past the holder's token.
//! let freed = admin.force_release("report:2026-11").await?;
//! assert!(freed.was_held && freed.fence.unwrap() > guard.fencing_token());
//! # Ok(()) }
//! ```
//!
//! The capability is the backend's ([`AdminStore`], [`Backend::admin`](crate::backend::Backend::admin)):
//! memory, Redis (one server, Sentinel, a cluster), Postgres, etcd and ZooKeeper have it; Redlock does
//! not (its state is spread over independent servers) and answers
//! [`LockError::Unsupported`].
//!
//! **Force-release skips the owner check** — the only operation in dlock that does — and is
//! meant for incidents. Expose it (and everything here) only behind your own authentication.

use std::time::Duration;

pub use crate::backend::admin::{
    ForceReleased, Holder, LockPage, LockState, Waiter, TOKEN_PREFIX_LEN,
};
use crate::backend::AdminStore;
pub use crate::locker::ContentionEvent;
use crate::locker::IntoLockKey;
use crate::{LockError, LockKey, Locker};

/// The operator's view of a [`Locker`]'s store, from [`Locker::admin`]. Every call is bounded
/// by the locker's command timeout.
#[derive(Clone, Debug)]
pub struct Admin {
    locker: Locker,
}

impl Locker {
    /// The operator's view of this locker's store, or [`LockError::Unsupported`] when the
    /// backend cannot be inspected (Redlock).
    pub fn admin(&self) -> Result<Admin, LockError> {
        match self.backend().admin() {
            Some(_) => Ok(Admin {
                locker: self.clone(),
            }),
            None => Err(LockError::unsupported(self.backend_name(), "inspection")),
        }
    }
}

impl Admin {
    fn store(&self) -> &dyn AdminStore {
        self.locker
            .backend()
            .admin()
            .expect("checked by Locker::admin")
    }

    /// The locker this view belongs to.
    pub fn locker(&self) -> &Locker {
        &self.locker
    }

    /// The lock on `key` (a literal key or a [`LockKey`]): holder (token prefix, fencing token,
    /// lease left), waiters in order, the fencing counter.
    pub async fn inspect(&self, key: impl IntoLockKey) -> Result<LockState, LockError> {
        let resource = self.locker.resource(key.into_lock_key()?);
        self.locker
            .with_deadline("inspect", self.store().inspect(&resource))
            .await
    }

    /// One page (about `limit` locks) of the active locks whose key starts with `key_prefix`
    /// (literal text, encoded like a literal key; `""` for all), from `cursor` (`None` to
    /// start; then the page's [`LockPage::cursor`] until it is `None`).
    pub async fn list(
        &self,
        key_prefix: &str,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<LockPage, LockError> {
        let encoded = if key_prefix.is_empty() {
            String::new()
        } else {
            LockKey::new(key_prefix)?.as_str().to_owned()
        };
        let store = self.store();
        self.locker
            .with_deadline(
                "list",
                store.list(self.locker.prefix(), &encoded, cursor, limit.max(1)),
            )
            .await
    }

    /// Every active lock whose key starts with `key_prefix`, page after page (at most `max`).
    pub async fn list_all(
        &self,
        key_prefix: &str,
        max: usize,
    ) -> Result<Vec<LockState>, LockError> {
        let mut out = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let page = self
                .list(key_prefix, cursor.as_deref(), 100.min(max.max(1)))
                .await?;
            out.extend(page.locks);
            cursor = page.cursor;
            if cursor.is_none() || out.len() >= max {
                out.truncate(max);
                return Ok(out);
            }
        }
    }

    /// Frees the lock on `key` whoever holds it (**no owner check**), raises the fencing
    /// counter and passes the lock to the next waiter. The holder's guard reports
    /// [`LockError::Lost`] at its next renewal.
    pub async fn force_release(&self, key: impl IntoLockKey) -> Result<ForceReleased, LockError> {
        let resource = self.locker.resource(key.into_lock_key()?);
        let out = self
            .locker
            .with_deadline("force release", self.store().force_release(&resource))
            .await?;
        tracing::warn!(
            target: "dlock::admin",
            backend = self.locker.backend_name(),
            was_held = out.was_held,
            "lock force-released by an operator"
        );
        Ok(out)
    }

    /// This process's contended acquire attempts of the last `window` (see
    /// [`Locker::recent_contention`]).
    pub fn recent_contention(&self, window: Duration) -> Vec<ContentionEvent> {
        self.locker.recent_contention(window)
    }
}
