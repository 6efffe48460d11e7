//! Multi-key locks: [`Locker::lock_all`] takes several keys all-or-nothing, as one
//! [`MultiGuard`].
//!
//! Built on the single-key lock, so it works on every backend — including Redis Cluster keys in
//! different slots, which no one script could take atomically:
//!
//! * **Deadlock-free ordering.** The keys are sorted by their encoded form (the same order in
//!   every process) and taken one after another. Two callers naming `[a, b]` and `[b, a]` both
//!   take `a` first, so neither can hold one key while waiting for a key the other holds.
//! * **All or nothing.** When a key cannot be taken (held with [`OnFail::Reject`], the shared
//!   wait deadline passes with [`OnFail::Retry`], the backend fails), the keys already taken are
//!   released before the error is returned. Dropping the acquire future midway releases them in
//!   the background, and the key in flight is undone as for any acquire.
//! * **Cost.** N keys cost N sequential acquires (N round trips uncontended; on a cluster each
//!   goes to its own slot's master) and N releases, sent together. While it waits for a later
//!   key, a caller holds the earlier ones — the price of ordered locking; the wait deadline
//!   covers the whole set.
//! * **Fencing.** Each key keeps its own fencing token ([`MultiGuard::fencing_token`]).
//! * **Loss.** [`MultiGuard::lost`] resolves when any of the keys is lost.

use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

use crate::{IntoLockKey, LockError, LockGuard, LockInfo, LockKey, Locker, OnFail};

impl Locker {
    /// Starts a request for the locks on all of `keys` at once (see [`MultiLockRequest`]): one
    /// guard over every key, taken all-or-nothing in a canonical order, so callers naming the
    /// same keys in different orders never deadlock.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), dlock_runtime::LockError> {
    /// let locker = dlock_runtime::Locker::memory();
    /// let both = locker.lock_all(["account:7", "account:3"]).acquire().await?;
    /// assert!(locker.lock("account:3").try_acquire().await?.is_none());
    /// assert!(both.fencing_token("account:7").is_some());
    /// both.release().await?;
    /// # Ok(()) }
    /// ```
    pub fn lock_all<I>(&self, keys: I) -> MultiLockRequest<'_>
    where
        I: IntoIterator,
        I::Item: IntoLockKey,
    {
        MultiLockRequest {
            locker: self,
            keys: keys
                .into_iter()
                .map(IntoLockKey::into_lock_key)
                .collect::<Result<Vec<_>, _>>()
                .and_then(canonical),
            ttl: None,
            on_fail: None,
            auto_renew: true,
            hold_at_least: None,
            name: crate::metrics::UNNAMED,
        }
    }
}

/// The keys in canonical order (by encoded key); duplicates and an empty list are
/// [`LockError::InvalidKey`].
pub(crate) fn canonical(mut keys: Vec<LockKey>) -> Result<Vec<LockKey>, LockError> {
    if keys.is_empty() {
        return Err(LockError::invalid_key(
            "a multi-key lock needs at least one key",
        ));
    }
    keys.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    if let Some(pair) = keys.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(LockError::invalid_key(format!(
            "key `{}` appears twice in a multi-key lock",
            pair[0]
        )));
    }
    Ok(keys)
}

/// A request for several locks at once, from [`Locker::lock_all`]. The settings apply to
/// every key; then `acquire` or `try_acquire`.
#[must_use = "a lock request does nothing until acquired"]
pub struct MultiLockRequest<'a> {
    locker: &'a Locker,
    keys: Result<Vec<LockKey>, LockError>,
    ttl: Option<Duration>,
    on_fail: Option<OnFail>,
    auto_renew: bool,
    hold_at_least: Option<Duration>,
    name: &'static str,
}

impl fmt::Debug for MultiLockRequest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MultiLockRequest")
            .field("keys", &self.keys)
            .field("ttl", &self.ttl)
            .field("on_fail", &self.on_fail)
            .field("auto_renew", &self.auto_renew)
            .field("hold_at_least", &self.hold_at_least)
            .field("name", &self.name)
            .finish()
    }
}

impl MultiLockRequest<'_> {
    /// The lease of each key (see [`LockRequest::ttl`](crate::LockRequest::ttl)).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// What to do when a key is held. [`OnFail::Retry`]'s wait is one deadline for the whole
    /// set; [`OnFail::Defer`] is treated as [`OnFail::Reject`] (there is no work to defer).
    /// Default: the locker's default.
    pub fn on_fail(mut self, on_fail: OnFail) -> Self {
        self.on_fail = Some(on_fail);
        self
    }

    /// Whether the watchdog renews every key while the guard lives (default `true`).
    pub fn auto_renew(mut self, on: bool) -> Self {
        self.auto_renew = on;
        self
    }

    /// A minimum hold for every key (see
    /// [`LockRequest::hold_at_least`](crate::LockRequest::hold_at_least)).
    pub fn hold_at_least(mut self, hold: Duration) -> Self {
        self.hold_at_least = Some(hold);
        self
    }

    /// The name of every key's lock in metrics and traces (see
    /// [`LockRequest::name`](crate::LockRequest::name)).
    pub fn name(mut self, name: &'static str) -> Self {
        self.name = name;
        self
    }

    /// Takes every key, in canonical order, with the request's strategy; all or nothing.
    ///
    /// Errors: [`LockError::InvalidKey`] for an empty list or a key given twice,
    /// [`LockError::Reentrant`] for a key this task already holds, else the error of the first
    /// key that could not be taken (a [`Timeout`](LockError::Timeout) counts the whole wait),
    /// or [`LockError::Lost`] for a key taken early that was lost while a later one was waited
    /// for (its lease ran out without renewal, or a renewal was refused): the others are given
    /// back; a set is never handed out with a key it no longer holds.
    /// Cancel-safe: dropping the future releases whatever it took.
    pub async fn acquire(self) -> Result<MultiGuard, LockError> {
        self.take(false).await
    }

    /// One attempt per key: `Ok(None)` (with nothing left held) when any key is held by
    /// someone else.
    pub async fn try_acquire(self) -> Result<Option<MultiGuard>, LockError> {
        match self.take(true).await {
            Ok(guard) => Ok(Some(guard)),
            Err(LockError::Contended { .. }) => Ok(None),
            Err(err) => Err(err),
        }
    }

    /// Every key in order; `once`: one attempt each (contention is `Contended`).
    async fn take(self, once: bool) -> Result<MultiGuard, LockError> {
        let locker = self.locker;
        // An invalid key list (each key's request counts its own outcome) counts here.
        let keys = self
            .keys
            .inspect_err(|e| locker.labels(self.name).finished(Err(e), Instant::now()))?;
        let on_fail = self
            .on_fail
            .unwrap_or_else(|| locker.default_on_fail().clone());
        let start = Instant::now();
        let mut guards: Vec<LockGuard> = Vec::with_capacity(keys.len());
        for key in keys {
            let mut request = locker
                .lock(key.clone())
                .auto_renew(self.auto_renew)
                .name(self.name);
            if let Some(ttl) = self.ttl {
                request = request.ttl(ttl);
            }
            if let Some(hold) = self.hold_at_least {
                request = request.hold_at_least(hold);
            }
            let outcome = match &on_fail {
                OnFail::Retry(policy) if !once => {
                    // What is left of the wait, maybe nothing: a key still gets one attempt,
                    // as a single lock's wait does, so a free set is taken whatever the wait.
                    let mut policy = policy.clone();
                    policy.wait = policy.wait.saturating_sub(start.elapsed());
                    request.on_fail(OnFail::Retry(policy)).acquire().await
                }
                _ => request.on_fail(OnFail::Reject).acquire().await,
            };
            match outcome {
                Ok(mut guard) => {
                    // The hold starts once every key is taken: a key held until then is
                    // released at once if this future is dropped or a later key fails. (The
                    // request still carries the hold, which it checks against the TTL.)
                    guard.clear_hold();
                    guards.push(guard);
                }
                Err(err) => {
                    // Given back before reporting, so the caller's next move finds them free;
                    // a release that fails goes on in the background.
                    // At once, whatever minimum hold they carry: the work they were taken for
                    // does not run.
                    let _ = futures_util::future::join_all(
                        guards.into_iter().map(LockGuard::give_back),
                    )
                    .await;
                    return Err(match err {
                        LockError::Timeout {
                            key, retry_after, ..
                        } => LockError::timeout(&key, start.elapsed(), retry_after),
                        err => err,
                    });
                }
            }
        }
        // All or nothing: a key taken early may have been lost while later ones were waited
        // for (its lease ran out without renewal, or a renewal was refused).
        if let Some(gone) = guards.iter().find(|g| !g.is_held()) {
            let err = LockError::lost(gone.key());
            let _ =
                futures_util::future::join_all(guards.into_iter().map(LockGuard::give_back)).await;
            return Err(err);
        }
        if let Some(hold) = self.hold_at_least {
            for guard in &mut guards {
                guard.hold_at_least(hold);
            }
        }
        Ok(MultiGuard { guards })
    }
}

/// Releases `guards` together; the first error, if any.
async fn release_all(guards: Vec<LockGuard>) -> Result<(), LockError> {
    let results = futures_util::future::join_all(guards.into_iter().map(LockGuard::release)).await;
    results.into_iter().collect()
}

/// Several held locks, taken together by [`Locker::lock_all`] and released together.
///
/// Dropping it releases every key in the background, like dropping each
/// [`LockGuard`]. [`lost`](MultiGuard::lost) resolves when any key is lost.
#[must_use = "the locks are released when the guard is dropped"]
pub struct MultiGuard {
    /// In canonical order.
    guards: Vec<LockGuard>,
}

impl fmt::Debug for MultiGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.guards).finish()
    }
}

impl MultiGuard {
    /// One guard of any kind as a set of one (the attribute's semaphores and read-write locks).
    pub(crate) fn single(guard: LockGuard) -> Self {
        MultiGuard {
            guards: vec![guard],
        }
    }

    /// The guard of each key, in canonical order (by encoded key): key, fencing token,
    /// `is_held`, `remaining` per key.
    pub fn guards(&self) -> &[LockGuard] {
        &self.guards
    }

    /// The fencing token of `key` (as given to [`Locker::lock_all`], or encoded), if it is one
    /// of this guard's keys. A key as given comes first: of `lock_all(["a b", "a%20b"])`,
    /// `fencing_token("a%20b")` is the second key's, not the first's (whose encoded form is
    /// `a%20b`).
    pub fn fencing_token(&self, key: &str) -> Option<u64> {
        let find = |encoded: &str| self.guards.iter().find(|g| g.key() == encoded);
        LockKey::new(key)
            .ok()
            .and_then(|given| find(given.as_str()))
            .or_else(|| find(key))
            .map(LockGuard::fencing_token)
    }

    /// Key and fencing token of every lock, in canonical order.
    pub fn infos(&self) -> Vec<LockInfo> {
        self.guards.iter().map(LockGuard::info).collect()
    }

    /// Every lock's info and the watch on its lease, in canonical order (for the task's held
    /// locks).
    pub(crate) fn held(&self) -> Vec<(LockInfo, crate::context::Watch)> {
        self.guards
            .iter()
            .map(|g| (g.info(), g.loss_watch()))
            .collect()
    }

    /// Whether every lock is still held as far as this process can tell.
    pub fn is_held(&self) -> bool {
        self.guards.iter().all(LockGuard::is_held)
    }

    /// Resolves as soon as any of the locks is known to be lost. Cancel-safe.
    pub async fn lost(&self) {
        let all = self.guards.iter().map(|g| Box::pin(g.lost()));
        futures_util::future::select_all(all).await;
    }

    /// Sets every lease to `ttl` from now (see [`LockGuard::extend`]); the first error.
    pub async fn extend(&self, ttl: Duration) -> Result<(), LockError> {
        let results =
            futures_util::future::join_all(self.guards.iter().map(|g| g.extend(ttl))).await;
        results.into_iter().collect()
    }

    /// Releases every lock together (see [`LockGuard::release`]): `Ok(())` when all were still
    /// ours, else the first error — every key is released (or handed to the background) either
    /// way.
    pub async fn release(self) -> Result<(), LockError> {
        release_all(self.guards).await
    }

    /// The key of a lock that is no longer held (the first key if all are).
    pub(crate) fn lost_key(&self) -> &str {
        let lost = self.guards.iter().find(|g| !g.is_held());
        lost.unwrap_or(&self.guards[0]).key()
    }

    pub(crate) fn locker_id(&self) -> u64 {
        self.guards.first().map_or(0, LockGuard::locker_id)
    }
}

/// Runs `fut` with every lock of `guard` visible to [`held_locks`](crate::held_locks) (and
/// [`current_lock`](crate::current_lock): the last key in canonical order), so nested
/// `#[distributed_lock]` calls on any of the keys re-enter.
pub fn with_locks<'g, F: Future + 'g>(
    guard: &'g MultiGuard,
    fut: F,
) -> impl Future<Output = F::Output> + 'g {
    crate::context::scope_all(guard.locker_id(), guard.held(), fut)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn empty_and_duplicate_key_lists_are_typed_errors() {
        let locker = Locker::memory();
        let none: [&str; 0] = [];
        let err = locker.lock_all(none).acquire().await.unwrap_err();
        assert!(err.is_invalid(), "{err}");
        let err = locker
            .lock_all(["a", "b", "a"])
            .acquire()
            .await
            .unwrap_err();
        assert!(err.to_string().contains("appears twice"), "{err}");
        // Nothing was taken.
        assert!(locker.lock("a").try_acquire().await.unwrap().is_some());
    }

    #[tokio::test]
    async fn a_timeout_counts_the_whole_wait_and_gives_back_what_was_taken() {
        let locker = Locker::memory();
        let held = locker.lock("z").acquire().await.unwrap();
        let err = locker
            .lock_all(["a", "z"])
            .on_fail(OnFail::retry(Duration::from_millis(50)))
            .acquire()
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert!(locker.lock("a").try_acquire().await.unwrap().is_some());
        held.release().await.unwrap();
    }

    /// A key of the set is asked for once even when the wait is spent by the time its turn
    /// comes, as a single lock with that policy is: a set nobody holds is taken, not refused
    /// with a timeout on a key it never asked for.
    #[tokio::test]
    async fn a_free_set_is_taken_whatever_is_left_of_the_wait() {
        let locker = Locker::memory();
        let one = locker
            .lock("x")
            .on_fail(OnFail::retry(Duration::ZERO))
            .acquire()
            .await;
        one.unwrap().release().await.unwrap();
        let all = locker
            .lock_all(["a", "b"])
            .on_fail(OnFail::retry(Duration::ZERO))
            .acquire()
            .await;
        all.unwrap().release().await.unwrap();
        // Held, the set is still refused with a timeout once its one attempt finds it so.
        let held = locker.lock("b").acquire().await.unwrap();
        let err = locker
            .lock_all(["a", "b"])
            .on_fail(OnFail::retry(Duration::ZERO))
            .acquire()
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        held.release().await.unwrap();
    }

    #[tokio::test]
    async fn lost_resolves_when_any_key_is_lost() {
        let locker = Locker::memory();
        let both = locker
            .lock_all(["a", "b"])
            .ttl(Duration::from_millis(50))
            .auto_renew(false)
            .acquire()
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), both.lost())
            .await
            .expect("lost within the lease");
        assert!(!both.is_held());
    }

    #[tokio::test]
    async fn with_locks_makes_every_key_visible_and_reentrant() {
        let locker = Locker::memory();
        let both = locker.lock_all(["b", "a"]).acquire().await.unwrap();
        with_locks(&both, async {
            let keys: Vec<String> = crate::held_locks()
                .iter()
                .map(|i| i.key().to_owned())
                .collect();
            assert_eq!(keys, ["a", "b"]);
            let err = locker.lock("a").acquire().await.unwrap_err();
            assert!(err.is_reentrant(), "{err}");
            assert_eq!(err.status(), 500);
        })
        .await;
        both.release().await.unwrap();
    }

    /// A failed whole gives back the keys it took at once, minimum hold or not: the work the
    /// hold protects never ran (with the hold, each key stayed locked by nobody until it ended).
    #[tokio::test]
    async fn a_failed_whole_gives_back_its_keys_at_once_whatever_the_hold() {
        let locker = Locker::memory();
        let held = locker.lock("z").acquire().await.unwrap();
        let out = locker
            .lock_all(["a", "z"])
            .ttl(Duration::from_secs(10))
            .hold_at_least(Duration::from_secs(5))
            .try_acquire()
            .await
            .unwrap();
        assert!(out.is_none());
        assert!(
            locker.lock("a").try_acquire().await.unwrap().is_some(),
            "`a` was kept for the hold"
        );
        held.release().await.unwrap();
    }

    /// A key as given is found before another key's encoded form that reads the same.
    #[tokio::test]
    async fn fencing_token_finds_a_key_as_given_first() {
        let locker = Locker::memory();
        let both = locker.lock_all(["a b", "a%20b"]).acquire().await.unwrap();
        let token_of = |encoded: &str| {
            both.guards()
                .iter()
                .find(|g| g.key() == encoded)
                .map(LockGuard::fencing_token)
        };
        let (spaced, escaped) = (token_of("a%20b"), token_of("a%2520b"));
        assert!(spaced.is_some() && escaped.is_some() && spaced != escaped);
        assert_eq!(both.fencing_token("a b"), spaced);
        assert_eq!(both.fencing_token("a%20b"), escaped);
        assert_eq!(
            both.fencing_token("a%2520b"),
            escaped,
            "an encoded key is found too"
        );
        assert_eq!(both.fencing_token("c"), None);
        both.release().await.unwrap();
    }

    /// An acquire dropped midway — `a` taken, waiting for `z` — releases `a` at once, minimum
    /// hold or not (it kept `a` locked by nobody until the hold ended), and a whole that was
    /// taken keeps its hold.
    #[tokio::test]
    async fn a_dropped_acquire_gives_back_its_keys_at_once_whatever_the_hold() {
        let locker = Locker::memory();
        let held = locker.lock("z").acquire().await.unwrap();
        let hold = Duration::from_secs(5);
        let mut acquire = Box::pin(
            locker
                .lock_all(["a", "z"])
                .ttl(Duration::from_secs(10))
                .hold_at_least(hold)
                .on_fail(crate::OnFail::retry(Duration::from_secs(10)))
                .acquire(),
        );
        tokio::select! {
            _ = &mut acquire => panic!("`z` is held"),
            _ = async { while locker.waiting() == 0 { tokio::task::yield_now().await } } => {}
        }
        drop(acquire);
        let again = tokio::time::timeout(Duration::from_secs(2), async {
            loop {
                if let Some(g) = locker.lock("a").try_acquire().await.unwrap() {
                    break g;
                }
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("`a` was kept for the hold");
        again.release().await.unwrap();
        held.release().await.unwrap();

        let both = locker
            .lock_all(["a", "z"])
            .ttl(Duration::from_secs(10))
            .hold_at_least(hold)
            .acquire()
            .await
            .unwrap();
        both.release().await.unwrap();
        assert!(
            locker.lock("a").try_acquire().await.unwrap().is_none(),
            "a whole that was taken keeps its hold"
        );
    }
}
