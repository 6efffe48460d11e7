//! The inspection capability of a backend, for operators: what a lock looks like in the store,
//! which locks a namespace holds, and freeing a stuck lock by hand. Optional —
//! [`Backend::admin`](super::Backend::admin) returns `None` by default — and read-mostly:
//! [`AdminStore::force_release`] (and its conditional form,
//! [`AdminStore::force_release_held_by`]) is the only write, and the only operation in dlock
//! that frees a lock **without checking its owner token**. It exists for incidents (a holder
//! that hangs on to a lock it will never use); the holder learns at its next renewal (its guard reports
//! [`LockError::Lost`]), and the store's fencing counter is raised so
//! that the next holder's token is above every token issued before — a resource that checks
//! fencing tokens then refuses the old holder's late writes.
//!
//! What is shown never includes a whole owner token (a token is the secret that releases a
//! lock): only its first [`TOKEN_PREFIX_LEN`] hex digits, enough to tell holders apart in a
//! log.

use std::time::Duration;

use super::BoxFuture;
use crate::key::ResourceName;
use crate::LockError;

/// How many hex digits of an owner token inspection shows (of 32: the other 96 bits stay
/// secret).
pub const TOKEN_PREFIX_LEN: usize = 8;

/// The first [`TOKEN_PREFIX_LEN`] characters of an owner token.
pub(crate) fn token_prefix(token: &str) -> String {
    token.chars().take(TOKEN_PREFIX_LEN).collect()
}

/// The encoded key of a resource name `<namespace>:{<key>}` (or `{<key>}`).
pub(crate) fn key_of(name: &str) -> &str {
    let open = name.find('{').map_or(0, |i| i + 1);
    let close = name.rfind('}').filter(|&c| c >= open).unwrap_or(name.len());
    &name[open..close]
}

/// What `list` looks for: `<namespace>:{<key prefix>` (`{<key prefix>` without a namespace).
pub(crate) fn name_prefix(namespace: &str, key_prefix: &str) -> String {
    if namespace.is_empty() {
        format!("{{{key_prefix}")
    } else {
        format!("{namespace}:{{{key_prefix}")
    }
}

/// How many locks of one listed page a store reads at once, at most.
#[cfg(any(feature = "postgres", feature = "etcd", feature = "zookeeper"))]
pub(crate) const PAGE_READS: usize = 8;

/// The active locks among `names`, in their order, read `at_once` at a time by `read` (one
/// after the other, a page of 100 locks took 100 round trips inside the list's one deadline,
/// and a slow store timed the listing out).
#[cfg(any(feature = "postgres", feature = "etcd", feature = "zookeeper"))]
pub(crate) async fn read_active<N, F, Fut>(
    names: impl IntoIterator<Item = N>,
    at_once: usize,
    read: F,
) -> Result<Vec<LockState>, LockError>
where
    F: FnMut(N) -> Fut,
    Fut: std::future::Future<Output = Result<LockState, LockError>>,
{
    use futures_util::stream::{self, StreamExt as _, TryStreamExt as _};
    let states: Vec<LockState> = stream::iter(names)
        .map(read)
        .buffered(at_once.max(1))
        .try_collect()
        .await?;
    Ok(states.into_iter().filter(LockState::is_active).collect())
}

/// `impl AdminStore for $backend` over its inherent `read_lock(&str)`,
/// `list_locks(namespace, key_prefix, cursor, limit)` and `force(&str, Option<&str>)` (the
/// holder a conditional release requires).
#[cfg(any(feature = "postgres", feature = "etcd", feature = "zookeeper"))]
macro_rules! admin_store_via {
    ($backend:ty) => {
        impl $crate::backend::AdminStore for $backend {
            fn inspect<'a>(
                &'a self,
                resource: &'a $crate::key::ResourceName,
            ) -> $crate::backend::BoxFuture<
                'a,
                Result<$crate::backend::admin::LockState, $crate::LockError>,
            > {
                Box::pin(self.read_lock(resource.as_str()))
            }

            fn list<'a>(
                &'a self,
                namespace: &'a str,
                key_prefix: &'a str,
                cursor: Option<&'a str>,
                limit: usize,
            ) -> $crate::backend::BoxFuture<
                'a,
                Result<$crate::backend::admin::LockPage, $crate::LockError>,
            > {
                Box::pin(self.list_locks(namespace, key_prefix, cursor, limit))
            }

            fn force_release<'a>(
                &'a self,
                resource: &'a $crate::key::ResourceName,
            ) -> $crate::backend::BoxFuture<
                'a,
                Result<$crate::backend::admin::ForceReleased, $crate::LockError>,
            > {
                Box::pin(self.force(resource.as_str(), None))
            }

            fn force_release_held_by<'a>(
                &'a self,
                resource: &'a $crate::key::ResourceName,
                holder: &'a str,
            ) -> $crate::backend::BoxFuture<
                'a,
                Result<$crate::backend::admin::ForceReleased, $crate::LockError>,
            > {
                Box::pin(self.force(resource.as_str(), Some(holder)))
            }
        }
    };
}
#[cfg(any(feature = "postgres", feature = "etcd", feature = "zookeeper"))]
pub(crate) use admin_store_via;

/// A lock as the store has it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct LockState {
    /// The encoded key ([`LockKey::as_str`](crate::LockKey::as_str)), without the namespace.
    pub key: String,
    /// Who holds it, when someone does.
    pub holder: Option<Holder>,
    /// The waiters in the order they will be served (FIFO backends), each with how long its
    /// queue entry lives without being refreshed.
    pub waiters: Vec<Waiter>,
    /// The fencing counter this lock draws from, when the store keeps one apart from the
    /// holder: every token issued from now on is greater. Redis: the namespace's (on a cluster,
    /// the slot's) counter, in the counter's own units — a Redis token is `counter × 2^11 +
    /// the issuer number` (`RedisBackend::ISSUER_BITS`), so compare it with `token >> 11`;
    /// memory: the store's (the same units as its tokens). `None` on Postgres, etcd and ZooKeeper, which
    /// keep the holder's token with the lock.
    pub fence_counter: Option<u64>,
}

impl LockState {
    /// Whether someone holds the lock or waits for it.
    pub fn is_active(&self) -> bool {
        self.holder.is_some() || !self.waiters.is_empty()
    }
}

/// The holder of a lock.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Holder {
    /// The first [`TOKEN_PREFIX_LEN`] hex digits of its owner token.
    pub token_prefix: String,
    /// Its fencing token, when the store keeps it with the lock (memory, Postgres, etcd,
    /// ZooKeeper; the Redis backend does not — see [`LockState::fence_counter`]).
    pub fencing_token: Option<u64>,
    /// What is left of its lease, by the store's clock.
    #[cfg_attr(
        feature = "serde",
        serde(rename = "ttl_left_ms", serialize_with = "ser::ms")
    )]
    pub ttl_left: Duration,
}

/// A queued waiter.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Waiter {
    /// The first [`TOKEN_PREFIX_LEN`] hex digits of its owner token.
    pub token_prefix: String,
    /// How long its queue entry lives unless the waiter refreshes it, when the store says.
    #[cfg_attr(
        feature = "serde",
        serde(rename = "expires_in_ms", serialize_with = "ser::opt_ms")
    )]
    pub expires_in: Option<Duration>,
}

/// One page of [`AdminStore::list`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct LockPage {
    /// Locks held or waited for, in no particular order (a lock may show up on two pages, or
    /// be missed, when it comes and goes during the listing — like Redis `SCAN`).
    pub locks: Vec<LockState>,
    /// Where the next page starts; `None` when the listing is complete.
    pub cursor: Option<String>,
}

/// What [`AdminStore::force_release`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ForceReleased {
    /// Whether a live holder was removed.
    pub was_held: bool,
    /// The fence after the release raised it, in token units (on Redis a token, `counter ×
    /// 2^11 + issuer`, unlike [`LockState::fence_counter`]): the next holder's token is
    /// greater. `None` where the store's counter is not reachable apart from a grant (etcd: the next
    /// holder's revision is above every revision so far by construction; ZooKeeper: likewise
    /// its node's `czxid`).
    pub fence: Option<u64>,
    /// A conditional release ([`AdminStore::force_release_held_by`]) that found the lock held
    /// by another owner: that holder's token prefix. Nothing was released (`was_held` is
    /// `false`, `fence` `None`).
    pub other_holder: Option<String>,
}

impl ForceReleased {
    /// Nothing released: the lock was held by the owner whose token prefix is `holder`, not
    /// the one asked for.
    pub(crate) fn spared(holder: String) -> Self {
        ForceReleased {
            other_holder: Some(holder),
            ..ForceReleased::default()
        }
    }
}

/// Whether `token` (an owner token, or what a store keeps that starts with it) is the owner
/// `holder` names: its first characters.
pub(crate) fn is_holder(token: &str, holder: &str) -> bool {
    !holder.is_empty() && token.starts_with(holder)
}

/// A store's inspection capability (see the [module docs](self)). Every call is bounded by the
/// backend's command timeout.
pub trait AdminStore: Send + Sync {
    /// The lock `resource` as the store has it. A free lock nobody waits for has no holder and
    /// no waiters.
    fn inspect<'a>(
        &'a self,
        resource: &'a ResourceName,
    ) -> BoxFuture<'a, Result<LockState, LockError>>;

    /// The active locks of namespace `namespace` (a locker's prefix) whose encoded key starts
    /// with `key_prefix`, at most about `limit` per page, from `cursor` (`None` to start).
    /// Never blocks the store (Redis: `SCAN`, never `KEYS`).
    fn list<'a>(
        &'a self,
        namespace: &'a str,
        key_prefix: &'a str,
        cursor: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<LockPage, LockError>>;

    /// Frees the lock whoever holds it — **no owner check** — raises the fencing counter, and
    /// hands the lock to (or wakes) the next waiter as a release would.
    fn force_release<'a>(
        &'a self,
        resource: &'a ResourceName,
    ) -> BoxFuture<'a, Result<ForceReleased, LockError>>;

    /// [`force_release`](Self::force_release), only while the lock is held by the owner whose
    /// token starts with `holder` (a token prefix as [`inspect`](Self::inspect) shows it): held
    /// by another, nothing is released and [`ForceReleased::other_holder`] names that one;
    /// free, nothing is released. The check and the release are one step in the store, so a
    /// lock that changed hands after it was inspected is never taken from its new holder. An
    /// empty `holder` names no owner: nothing is released ([`Admin`](crate::admin::Admin)
    /// refuses it before asking). Default: [`LockError::Unsupported`].
    fn force_release_held_by<'a>(
        &'a self,
        resource: &'a ResourceName,
        holder: &'a str,
    ) -> BoxFuture<'a, Result<ForceReleased, LockError>> {
        let _ = (resource, holder);
        Box::pin(std::future::ready(Err(LockError::unsupported(
            "admin",
            "a force release only while a given owner holds the lock",
        ))))
    }
}

/// Durations as milliseconds, times as milliseconds since the Unix epoch.
#[cfg(feature = "serde")]
pub(crate) mod ser {
    use std::time::{Duration, SystemTime};

    pub(crate) fn ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub(crate) fn opt_ms<S: serde::Serializer>(
        d: &Option<Duration>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => ms(d, s),
            None => s.serialize_none(),
        }
    }

    pub(crate) fn key<S: serde::Serializer>(k: &crate::LockKey, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(k.as_str())
    }

    pub(crate) fn epoch_ms<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        ms(
            &t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default(),
            s,
        )
    }
}
