//! The conformance suite every backend passes (feature `conformance`): run it on your own
//! [`Backend`](crate::backend::Backend) with one macro call.
//!
//! A backend's test file builds a [`Store`] — a way to make independent [`Locker`]s over the
//! same lock store (as separate service instances would have) and a way to take a lock away
//! behind its holder's back — and calls [`conformance_tests!`](crate::conformance_tests), which
//! generates one `#[test]` per check, or [`run_all`] / the individual checks.
//!
//! ```ignore
//! // tests/conformance.rs of a crate with a backend `MyBackend`
//! // ([dev-dependencies]: dlock-runtime with feature "conformance")
//! use dlock_runtime::conformance::Store;
//!
//! fn store() -> ((), Store) {
//!     let shared = MyBackend::new(/* one store, shared by every locker */);
//!     let for_break = shared.clone();
//!     let store = Store::new(
//!         "mine",
//!         move |builder| {
//!             let shared = shared.clone();
//!             Box::pin(async move { builder.try_build(shared).expect("locker") })
//!         },
//!         move |resource| {
//!             let shared = for_break.clone();
//!             Box::pin(async move { shared.delete_key(&resource).await })
//!         },
//!     );
//!     ((), store)
//! }
//!
//! dlock_runtime::conformance_tests!(store);
//! ```
//!
//! The checks cover locks ([`locks`]: mutual exclusion, owner checks, fencing, watchdog, loss,
//! fair waiting, expiry, cancellation, extend), multi-key locks and the minimum hold
//! ([`multi`]: opposite key orders without deadlock, all-or-nothing, cancel safety,
//! `hold_at_least`), leader election ([`election`]: handover on resign, drop and loss, terms,
//! one leader at a time) and, when the store says the backend stores
//! idempotency records ([`Store::idempotency`]), the idempotency storage ([`idempotency`]: run,
//! replay, mismatch, in progress, abort, expiry, owner checks, fencing), and semaphores and
//! read-write locks ([`kinds`]: at most N permits, no reader beside a writer, FIFO waiting, a
//! waiting writer blocking new readers, dead holders expiring, fencing, watchdog and loss,
//! cancellation) — or, for a store that says it does not offer them ([`Store::kinds`]), their
//! typed refusal.
//!
//! Timing: the checks wait for *events* (a guard reported lost, a waiter counted as queued, a
//! task finishing) and use wall-clock bounds only where time passing is the behaviour under
//! test (leases, expiry, "woken by the release rather than by its backoff").

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::{Locker, LockerBuilder};

pub mod admin;
pub mod election;
pub mod idempotency;
pub mod kinds;
pub mod locks;
pub mod multi;

pub use self::admin::*;
pub use self::election::*;
pub use self::idempotency::*;
pub use self::kinds::*;
pub use self::locks::*;
pub use self::multi::*;

/// A boxed future.
pub type BoxFut<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// How the suite reaches one lock store.
pub struct Store {
    /// Name for messages.
    pub name: &'static str,
    /// A new, independent locker over the shared store, configured from `builder`.
    pub locker: Box<dyn Fn(LockerBuilder) -> BoxFut<Locker> + Send + Sync>,
    /// Deletes the lock named by the resource string (`<prefix>:{<key>}`) whoever holds it.
    pub break_lock: Box<dyn Fn(String) -> BoxFut<()> + Send + Sync>,
    /// Whether the backend serves waiters in strict arrival order. Redlock does not (its
    /// waiters barge, see `dlock_runtime::backend::redlock`); for it the ordering check only
    /// requires that every waiter is served.
    pub fifo: bool,
    /// Whether the backend stores idempotency records
    /// ([`IdempotencyStore`](crate::idempotency::IdempotencyStore)); the idempotency checks
    /// are skipped for one that does not (and assert that it says so).
    pub idempotency: bool,
    /// Whether the backend delivers release notifications ([`Backend::watch`](crate::backend::Backend::watch)).
    /// Without them waiters wake on their fallback timer, and the wake-up check asks only that
    /// the waiter gets the lock on that timer.
    pub notifications: bool,
    /// Whether the backend offers semaphores and read-write locks
    /// ([`Backend::acquire_kind`](crate::backend::Backend::acquire_kind)); for one that does
    /// not, the [`kinds`] checks assert that it refuses them with
    /// [`LockError::Unsupported`](crate::LockError::Unsupported).
    pub kinds: bool,
    /// Whether the backend has the inspection capability ([`AdminStore`](crate::backend::AdminStore));
    /// one without must say so ([`admin`] checks that it answers `Unsupported`).
    pub admin: bool,
    /// How long after its last word a holder or waiter that died, with a lease or queue entry
    /// of the given length, may still block a lock: the length itself (the default) for a
    /// backend that expires to the millisecond; etcd's leases are whole seconds, rounded up,
    /// plus a second of headroom and up to its 500 ms expiry sweep.
    pub lease_bound: fn(Duration) -> Duration,
}

static UNIQUE: AtomicU64 = AtomicU64::new(0);

/// A key no other check uses.
pub fn unique_key(what: &str) -> String {
    format!(
        "conf:{what}:{}:{}",
        std::process::id(),
        UNIQUE.fetch_add(1, Ordering::Relaxed)
    )
}

impl Store {
    /// A store with FIFO waiting, idempotency storage and inspection (change the fields for a backend
    /// without them).
    pub fn new(
        name: &'static str,
        locker: impl Fn(LockerBuilder) -> BoxFut<Locker> + Send + Sync + 'static,
        break_lock: impl Fn(String) -> BoxFut<()> + Send + Sync + 'static,
    ) -> Self {
        Store {
            name,
            locker: Box::new(locker),
            break_lock: Box::new(break_lock),
            fifo: true,
            idempotency: true,
            notifications: true,
            kinds: true,
            admin: true,
            lease_bound: |ttl| ttl,
        }
    }

    pub(crate) async fn pair(&self) -> (Locker, Locker) {
        (
            (self.locker)(Locker::builder()).await,
            (self.locker)(Locker::builder()).await,
        )
    }
}

/// The resource a request of `kind` for `key` on `locker` locks (a semaphore's or a
/// read-write lock's is not the lock's of the same key): for [`attempt_as`] and a backend's own
/// tests.
pub fn resource_as(
    locker: &Locker,
    key: crate::LockKey,
    kind: crate::LockKind,
) -> crate::key::ResourceName {
    locker.resource(key).with_kind(kind)
}

/// One acquire attempt by `token` on `resource` (its kind included), straight to `locker`'s
/// backend — what the locker sends, without its deadline, watchdog or undo: for checks, and a
/// backend's own tests, that must ask as a given owner (again after a lost answer, say).
pub async fn attempt_as(
    locker: &Locker,
    resource: &crate::key::ResourceName,
    token: &crate::backend::OwnerToken,
    mode: crate::backend::WaitMode,
    ttl: Duration,
) -> Result<crate::backend::Attempt, crate::LockError> {
    attempt_with(locker, resource, token, mode, ttl, false).await
}

/// [`attempt_as`] for a lock the locker's watchdog would renew
/// ([`AcquireArgs::renew`](crate::backend::AcquireArgs::renew)): a backend may keep it
/// differently (etcd puts it on a session lease shared with the locker's other renewed locks
/// of its TTL class), and nothing renews it unless the caller does.
pub async fn attempt_renewed_as(
    locker: &Locker,
    resource: &crate::key::ResourceName,
    token: &crate::backend::OwnerToken,
    mode: crate::backend::WaitMode,
    ttl: Duration,
) -> Result<crate::backend::Attempt, crate::LockError> {
    attempt_with(locker, resource, token, mode, ttl, true).await
}

/// The undo of an acquire by `token` on `resource`, straight to `locker`'s backend (see
/// [`attempt_as`]): what the locker sends when an acquire is cancelled or gives up.
pub async fn abandon_as(
    locker: &Locker,
    resource: &crate::key::ResourceName,
    token: &crate::backend::OwnerToken,
) -> Result<(), crate::LockError> {
    locker.backend().abandon(resource, token).await
}

/// An extend of `token`'s hold on `resource` to `ttl`, straight to `locker`'s backend (see
/// [`attempt_as`]): what a guard's `extend` sends.
pub async fn extend_as(
    locker: &Locker,
    resource: &crate::key::ResourceName,
    token: &crate::backend::OwnerToken,
    ttl: Duration,
) -> Result<bool, crate::LockError> {
    locker.backend().extend(resource, token, ttl).await
}

/// A batch renewal of `items`, straight to `locker`'s backend (see [`attempt_as`]): what the
/// locker's watchdog sends.
pub async fn extend_many_as(
    locker: &Locker,
    items: &[crate::backend::ExtendItem],
) -> Vec<Result<bool, crate::LockError>> {
    locker.backend().extend_many(items).await
}

async fn attempt_with(
    locker: &Locker,
    resource: &crate::key::ResourceName,
    token: &crate::backend::OwnerToken,
    mode: crate::backend::WaitMode,
    ttl: Duration,
    renew: bool,
) -> Result<crate::backend::Attempt, crate::LockError> {
    let args = crate::backend::AcquireArgs {
        resource,
        token,
        ttl,
        mode,
        waiter_ttl: locker.waiter_ttl_for(ttl),
        renew,
        sent: None,
    };
    let backend = locker.backend();
    match resource.kind() {
        crate::LockKind::Exclusive => backend.acquire(args).await,
        _ => backend.acquire_kind(args).await,
    }
}

/// A lock's line with a waiter that died first in it and nothing held: see
/// [`a_dead_waiter_first`].
pub(crate) struct DeadFirst {
    /// A locker with a waiter TTL of 5 s.
    pub(crate) locker: Locker,
    pub(crate) key: String,
    /// [`Store::lease_bound`] of the waiter TTL: the dead waiter's entry ends within it.
    pub(crate) bound: Duration,
    /// The dead waiter's: `(kind, token)`.
    first: (crate::LockKind, crate::backend::OwnerToken),
}

impl DeadFirst {
    pub(crate) fn resource(&self, kind: crate::LockKind) -> crate::key::ResourceName {
        self.locker
            .resource(crate::LockKey::new(&self.key).expect("key"))
            .with_kind(kind)
    }

    /// Takes the dead waiter out of the line.
    pub(crate) async fn clear(self) {
        let (kind, token) = &self.first;
        let _ = self
            .locker
            .backend()
            .abandon(&self.resource(*kind), token)
            .await;
    }
}

/// A holder of `held` goes without a release (its 300 ms lease lapses; time passing is the
/// behaviour under test) while a waiter for `first` that died is first in line behind it: the
/// lock is free (no handoff) and the line held up until that waiter's entry ends. Both are
/// names of one lock (of one kind, or modes of one read-write lock). Whoever asks next must
/// be let in (only a store without a line: Redlock's waiters barge) or told when the line may move
/// — never "no time", which left it to its backoff with the line free.
pub(crate) async fn a_dead_waiter_first(
    store: &Store,
    held: crate::LockKind,
    first: crate::LockKind,
) -> DeadFirst {
    use crate::backend::{Attempt, OwnerToken, WaitMode};
    let waiter_ttl = Duration::from_secs(5);
    let line = DeadFirst {
        locker: (store.locker)(Locker::builder().waiter_ttl(waiter_ttl)).await,
        key: unique_key("line"),
        bound: (store.lease_bound)(waiter_ttl),
        first: (first, OwnerToken::generate()),
    };
    let short = Duration::from_millis(300);
    let holder = OwnerToken::generate();
    for (kind, token, mode, ttl) in [
        (held, &holder, WaitMode::Try, short),
        (
            first,
            &line.first.1,
            WaitMode::Queue,
            Duration::from_secs(30),
        ),
    ] {
        let out = attempt_as(&line.locker, &line.resource(kind), token, mode, ttl).await;
        let expected = match mode {
            WaitMode::Try => matches!(out, Ok(Attempt::Acquired { .. })),
            _ => matches!(out, Ok(Attempt::Held { .. })),
        };
        assert!(expected, "{}: {mode:?}: {out:?}", store.name);
    }
    tokio::time::sleep((store.lease_bound)(short) + Duration::from_millis(100)).await;
    line
}

/// [`a_dead_waiter_first`], then a third owner asks for `behind` in queue mode: let in, or
/// told a time within the bound.
pub(crate) async fn told_when_the_line_may_move(
    store: &Store,
    held: crate::LockKind,
    first: crate::LockKind,
    behind: crate::LockKind,
) {
    use crate::backend::{Attempt, OwnerToken, WaitMode};
    let line = a_dead_waiter_first(store, held, first).await;
    let (resource, token) = (line.resource(behind), OwnerToken::generate());
    let ttl = Duration::from_secs(30);
    match attempt_as(&line.locker, &resource, &token, WaitMode::Queue, ttl).await {
        // Only where waiters barge: a FIFO store that lets it in let it jump the line.
        Ok(Attempt::Acquired { .. }) if !store.fifo => {}
        Ok(Attempt::Held {
            remaining: Some(left),
        }) => assert!(
            left <= line.bound,
            "{}: told {left:?}; the dead waiter's entry ends within {:?}",
            store.name,
            line.bound
        ),
        other => panic!(
            "{}: a waiter behind a dead one, nothing held, was told {other:?}",
            store.name
        ),
    }
    let _ = line.locker.backend().abandon(&resource, &token).await;
    line.clear().await;
}

/// Takes `key` (as `kind`) for a fresh owner token straight through `locker`'s backend, then
/// asks again with the same token in every wait mode, as a retry after a lost reply or a lost
/// handoff notification does: every attempt must be granted, with a fencing token not below
/// the one before. The first grant's lease is 300 ms, the later ones' 30 s; this returns once
/// the first would have run out (so the caller can check the lease was restarted), with the
/// resource and the token, which holds it without renewal.
pub(crate) async fn granted_again(
    store: &Store,
    locker: &Locker,
    key: &str,
    kind: crate::LockKind,
) -> (crate::key::ResourceName, crate::backend::OwnerToken) {
    use crate::backend::{Attempt, OwnerToken, WaitMode};
    let resource = locker
        .resource(crate::LockKey::new(key).expect("key"))
        .with_kind(kind);
    let token = OwnerToken::generate();
    let mut last = 0;
    let short = Duration::from_millis(300);
    for (mode, ttl) in [
        (WaitMode::Try, short),
        (WaitMode::Queue, Duration::from_secs(30)),
        (WaitMode::Barge, Duration::from_secs(30)),
        (WaitMode::Try, Duration::from_secs(30)),
    ] {
        match attempt_as(locker, &resource, &token, mode, ttl).await {
            Ok(Attempt::Acquired { fencing_token }) => {
                assert!(
                    fencing_token >= last,
                    "{}: {kind:?}: asked again ({mode:?}), the fencing token went back from \
                     {last} to {fencing_token}",
                    store.name
                );
                last = fencing_token;
            }
            other => panic!(
                "{}: {kind:?}: the holder asked again ({mode:?}) and got {other:?}",
                store.name
            ),
        }
    }
    tokio::time::sleep(short * 3).await;
    (resource, token)
}

/// Owner-checked release of what [`granted_again`] took.
pub(crate) async fn release_as(
    store: &Store,
    locker: &Locker,
    resource: &crate::key::ResourceName,
    token: &crate::backend::OwnerToken,
) {
    let released = locker.backend().release(resource, token).await;
    assert!(
        matches!(released, Ok(true)),
        "{}: {:?}: the holder's release answered {released:?}",
        store.name,
        resource.kind()
    );
}

pub(crate) async fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Retries `try_acquire` until it succeeds or `limit` passes; returns how long it took. An
/// attempt the backend did not answer in time (a loaded machine, a slow node) is simply made
/// again: only the deadline fails the check, and any other error.
pub(crate) async fn free_within(locker: &Locker, key: &str, limit: Duration) -> Duration {
    kind_free_within(locker, key, crate::LockKind::Exclusive, limit).await
}

/// [`free_within`] for what `kind` takes on `key` (a permit, a read or write hold).
pub(crate) async fn kind_free_within(
    locker: &Locker,
    key: &str,
    kind: crate::LockKind,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    loop {
        match locker.request(key, kind).try_acquire().await {
            Ok(Some(g)) => {
                if let Err(e) = g.release().await {
                    assert!(e.is_unavailable(), "release: {e}");
                }
                return start.elapsed();
            }
            Ok(None) => {}
            Err(e) => assert!(e.is_unavailable(), "try_acquire: {e}"),
        }
        assert!(
            start.elapsed() < limit,
            "`{key}` ({kind:?}) still held after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// A holder that vanished `waited` ago with lease `ttl` freed in time: not before its TTL
/// (less `early`, how long before `waited` began the lease may have started), and within 2 s
/// of it.
pub(crate) fn assert_freed_at_ttl(store: &Store, waited: Duration, ttl: Duration, early: Duration) {
    assert!(
        waited >= ttl - early,
        "{}: got it before the TTL ended ({waited:?})",
        store.name
    );
    assert!(
        waited < ttl + Duration::from_secs(2),
        "{}: waited {waited:?}",
        store.name
    );
}

/// Runs every check.
pub async fn run_all(store: &Store) {
    idempotency_runs_once_then_replays(store).await;
    idempotency_in_progress_abort_and_expiry(store).await;
    idempotency_complete_is_owner_checked(store).await;
    idempotency_a_begin_sent_again_is_granted_again(store).await;
    idempotency_complete_after_the_local_lease_ran_out_stores_nothing(store).await;
    idempotency_behind_a_dead_waiter_is_told_when_the_line_may_move(store).await;
    mutual_exclusion(store).await;
    owner_checked_release_and_extend(store).await;
    the_local_lease_ends_before_the_lock_frees(store).await;
    fencing_tokens_increase(store).await;
    watchdog_holds_past_ttl(store).await;
    locker_outlives_its_first_runtime(store).await;
    loss_is_reported(store).await;
    release_wakes_waiter(store).await;
    barging_waiters_hear_each_release(store).await;
    waiters_are_served_in_order(store).await;
    dead_waiters_leave_the_queue(store).await;
    a_dead_waiters_handoff_ends_with_its_entry(store).await;
    a_waiter_behind_a_dead_one_is_told_when_the_line_may_move(store).await;
    vanished_holder_expires(store).await;
    drop_releases(store).await;
    reject_and_timeout_errors(store).await;
    cancelled_acquires_leave_no_lock(store).await;
    extend_can_shorten_the_lease(store).await;
    extend_reschedules_the_watchdog(store).await;
    release_after_the_lease_ran_out_is_lost(store).await;
    an_attempt_by_the_holder_is_granted_again(store).await;
    multi_key_opposite_orders(store).await;
    multi_key_all_or_nothing(store).await;
    multi_key_lost_while_waiting_fails(store).await;
    multi_key_cancel_safety(store).await;
    hold_at_least_keeps_the_lock(store).await;
    semaphore_admits_at_most_permits(store).await;
    semaphore_waiters_are_served_in_order(store).await;
    semaphore_barging_waiter_is_woken_by_a_release(store).await;
    semaphore_barging_waiters_hear_each_release(store).await;
    semaphore_dead_holders_expire(store).await;
    rw_readers_share_writers_exclude(store).await;
    rw_waiting_writer_blocks_new_readers(store).await;
    rw_writer_release_admits_leading_readers(store).await;
    kinds_fencing_tokens_increase(store).await;
    kinds_watchdog_loss_and_owner_checks(store).await;
    kinds_cancelled_acquires_leave_nothing(store).await;
    kinds_an_attempt_by_the_holder_is_granted_again(store).await;
    kinds_a_waiter_behind_a_dead_one_is_told_when_the_line_may_move(store).await;
    admin_inspect_list_force_release(store).await;
    admin_force_release_held_by_spares_another_holder(store).await;
    election_leadership_moves_on_resign_and_drop(store).await;
    election_recampaigns_after_loss(store).await;
}

/// Runs `check` on a fresh multi-threaded tokio runtime (2 workers): what each generated test
/// does.
#[doc(hidden)]
pub fn __block_on(check: impl Future<Output = ()>) {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime for the conformance check")
        .block_on(check);
}

/// Generates one `#[test]` per conformance check (each on its own multi-threaded tokio
/// runtime). `$make` is a function returning
/// `(keep_alive, Store)`: whatever must live for the test (e.g. the `RedisServer`s) and the
/// store. Use it inside a module per backend:
///
/// ```ignore
/// mod redis {
///     dlock_runtime::conformance_tests!(super::redis_store);
/// }
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($make:path) => {
        $crate::conformance_tests!(@each $make;
            mutual_exclusion,
            owner_checked_release_and_extend,
            the_local_lease_ends_before_the_lock_frees,
            fencing_tokens_increase,
            watchdog_holds_past_ttl,
            locker_outlives_its_first_runtime,
            loss_is_reported,
            release_wakes_waiter,
            barging_waiters_hear_each_release,
            waiters_are_served_in_order,
            dead_waiters_leave_the_queue,
            a_dead_waiters_handoff_ends_with_its_entry,
            a_waiter_behind_a_dead_one_is_told_when_the_line_may_move,
            vanished_holder_expires,
            drop_releases,
            reject_and_timeout_errors,
            cancelled_acquires_leave_no_lock,
            extend_can_shorten_the_lease,
            extend_reschedules_the_watchdog,
            release_after_the_lease_ran_out_is_lost,
            an_attempt_by_the_holder_is_granted_again,
            multi_key_opposite_orders,
            multi_key_all_or_nothing,
            multi_key_lost_while_waiting_fails,
            multi_key_cancel_safety,
            hold_at_least_keeps_the_lock,
            election_leadership_moves_on_resign_and_drop,
            election_recampaigns_after_loss,
            idempotency_runs_once_then_replays,
            idempotency_in_progress_abort_and_expiry,
            idempotency_complete_is_owner_checked,
            idempotency_a_begin_sent_again_is_granted_again,
            idempotency_complete_after_the_local_lease_ran_out_stores_nothing,
            idempotency_behind_a_dead_waiter_is_told_when_the_line_may_move,
            semaphore_admits_at_most_permits,
            semaphore_waiters_are_served_in_order,
            semaphore_barging_waiter_is_woken_by_a_release,
            semaphore_barging_waiters_hear_each_release,
            semaphore_dead_holders_expire,
            rw_readers_share_writers_exclude,
            rw_waiting_writer_blocks_new_readers,
            rw_writer_release_admits_leading_readers,
            kinds_fencing_tokens_increase,
            kinds_watchdog_loss_and_owner_checks,
            kinds_cancelled_acquires_leave_nothing,
            kinds_an_attempt_by_the_holder_is_granted_again,
            kinds_a_waiter_behind_a_dead_one_is_told_when_the_line_may_move,
            admin_inspect_list_force_release,
            admin_force_release_held_by_spares_another_holder,
        );
    };
    (@each $make:path; $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::__block_on(async {
                    let (_keep_alive, store) = $make();
                    $crate::conformance::$check(&store).await;
                });
            }
        )*
    };
}
