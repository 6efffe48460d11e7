//! The lock checks.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{free_within, unique_key, wait_until, Store};
use crate::{LockError, Locker, OnFail, RetryPolicy};

/// Mutual exclusion: 2 lockers × 8 tasks × 25 rounds of a non-atomic read-modify-write; the
/// counter ends exact and no two tasks are ever inside at once.
pub async fn mutual_exclusion(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("mutex");
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let rounds = 25u64;
    // Without release notifications every hand-over waits for a waiter's timer: keep it short.
    // Through outages: this check is about exclusion, and on a loaded 2-core machine a moment
    // of unavailability is not a failure of it (seen in CI: Redlock's nodes, whose timeout is
    // 100 ms here, each timed out once at the same moment, and the wait ended `Unavailable`).
    let policy = if store.notifications {
        RetryPolicy::new(Duration::from_secs(30))
    } else {
        RetryPolicy::new(Duration::from_secs(30))
            .backoff(Duration::from_millis(1), Duration::from_millis(20))
    }
    .through_outages(true);
    let mut tasks = Vec::new();
    for i in 0..16 {
        let locker = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (key, counter, inside, overlaps, policy) = (
            key.clone(),
            counter.clone(),
            inside.clone(),
            overlaps.clone(),
            policy.clone(),
        );
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let g = locker
                    .lock(&key)
                    .ttl(Duration::from_secs(5))
                    .on_fail(OnFail::Retry(policy.clone()))
                    .acquire()
                    .await
                    .expect("acquire");
                if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                let v = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                counter.store(v + 1, Ordering::SeqCst);
                inside.fetch_sub(1, Ordering::SeqCst);
                g.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "{}: overlaps",
        store.name
    );
    assert_eq!(
        counter.load(Ordering::SeqCst),
        16 * rounds,
        "{}: lost updates",
        store.name
    );
}

/// The holder's local lease clock runs out before the backend lets another owner in: another
/// locker polls for the lock as fast as the backend answers, and when it gets it the first
/// holder must no longer count itself the holder. The TTL has a part below a millisecond, as a
/// computed TTL may: servers that count leases in whole milliseconds drop it.
pub async fn the_local_lease_ends_before_the_lock_frees(store: &Store) {
    let (a, b) = store.pair().await;
    let ttl = Duration::from_micros(300_900);
    for _ in 0..3 {
        let key = unique_key("edge");
        let first = a
            .lock(&key)
            .ttl(ttl)
            .auto_renew(false)
            .acquire()
            .await
            .expect("acquire");
        let start = Instant::now();
        let next = loop {
            if let Some(g) = b.lock(&key).try_acquire().await.expect("try") {
                break g;
            }
            assert!(
                start.elapsed() < ttl + Duration::from_secs(5),
                "{}: the lease never ended",
                store.name
            );
        };
        assert!(
            !first.is_held(),
            "{}: another owner was granted the lock while the holder's lease still ran ({:?} left)",
            store.name,
            first.remaining()
        );
        next.release().await.expect("release");
    }
}

/// A stale holder (lease expired, lock taken by another) can neither release nor extend the
/// new owner's lock.
pub async fn owner_checked_release_and_extend(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("owner");
    let stale = a
        .lock(&key)
        .ttl(Duration::from_millis(150))
        .auto_renew(false)
        .acquire()
        .await
        .expect("acquire");
    stale.lost().await; // the local lease ran out
    assert!(!stale.is_held());
    // The backend expires it too; b takes it.
    let start = Instant::now();
    let owner = loop {
        if let Some(g) = b
            .lock(&key)
            .ttl(Duration::from_secs(10))
            .try_acquire()
            .await
            .unwrap()
        {
            break g;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let err = stale.extend(Duration::from_secs(10)).await.unwrap_err();
    assert!(
        err.is_lost(),
        "{}: stale extend must fail: {err}",
        store.name
    );
    let err = stale.release().await.unwrap_err();
    assert!(
        err.is_lost(),
        "{}: stale release must fail: {err}",
        store.name
    );
    // The new owner still holds it.
    assert!(
        a.lock(&key).try_acquire().await.unwrap().is_none(),
        "{}: new owner's lock was freed",
        store.name
    );
    assert!(owner.is_held());
    owner.release().await.expect("owner release");
}

/// Fencing tokens increase strictly per key: across owners, lockers, and expiry.
pub async fn fencing_tokens_increase(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("fence");
    let mut last = 0u64;
    for i in 0..20 {
        let l = if i % 2 == 0 { &a } else { &b };
        let g = l.lock(&key).acquire().await.expect("acquire");
        assert!(
            g.fencing_token() > last,
            "{}: token {} after {last}",
            store.name,
            g.fencing_token()
        );
        last = g.fencing_token();
        g.release().await.unwrap();
    }
    // Across expiry: a lease that runs out without release.
    let g = a
        .lock(&key)
        .ttl(Duration::from_millis(50))
        .auto_renew(false)
        .acquire()
        .await
        .unwrap();
    assert!(g.fencing_token() > last);
    last = g.fencing_token();
    g.lost().await;
    std::mem::forget(g);
    let start = Instant::now();
    let g = loop {
        if let Some(g) = b.lock(&key).try_acquire().await.unwrap() {
            break g;
        }
        assert!(start.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!(
        g.fencing_token() > last,
        "{}: token did not increase across expiry",
        store.name
    );
    g.release().await.unwrap();
}

/// The watchdog keeps a lock for at least 5× its TTL.
pub async fn watchdog_holds_past_ttl(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("watchdog");
    let ttl = Duration::from_millis(500);
    let g = a.lock(&key).ttl(ttl).acquire().await.unwrap();
    let start = Instant::now();
    while start.elapsed() < ttl * 6 {
        assert!(
            b.lock(&key).try_acquire().await.unwrap().is_none(),
            "{}: lock lapsed at {:?}",
            store.name,
            start.elapsed()
        );
        assert!(g.is_held());
        tokio::time::sleep(ttl / 4).await;
    }
    assert!(a.renewing() >= 1);
    g.release().await.expect("still ours after 6 TTLs");
    assert_eq!(a.renewing(), 0);
    assert!(b.lock(&key).try_acquire().await.unwrap().is_some());
}

/// A locker built, and first used, on a runtime that then shuts down — an actix-web worker
/// restarting, a runtime built for set-up and dropped — keeps working on the runtime that
/// remains: the lock taken there is renewed on past its TTL (the locker's background task moves
/// to its fallback thread; the backend reconnects whatever lived on the dead runtime), the
/// locker takes and releases new locks, and the old guard's release finds the lock still its
/// own.
pub async fn locker_outlives_its_first_runtime(store: &Store) {
    let key = unique_key("runtime");
    let ttl = Duration::from_millis(600);
    let build = (store.locker)(Locker::builder());
    let (tx, rx) = tokio::sync::oneshot::channel();
    let first_key = key.clone();
    std::thread::spawn(move || {
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let taken = first.block_on(async move {
            let a = build.await;
            let g = a.lock(&first_key).ttl(ttl).acquire().await;
            (a, g)
        });
        // Shut down, with the locker's task and whatever the backend started on it.
        drop(first);
        let _ = tx.send(taken);
    });
    let (a, g) = rx.await.expect("the first runtime's thread");
    let g = g.expect("acquire on the first runtime");
    let b = (store.locker)(Locker::builder()).await;
    let renewed = a.renewals();
    let start = Instant::now();
    while start.elapsed() < ttl * 4 {
        assert!(
            b.lock(&key).try_acquire().await.unwrap().is_none(),
            "{}: the lock lapsed {:?} after its first runtime shut down",
            store.name,
            start.elapsed()
        );
        assert!(g.is_held(), "{}: reported lost", store.name);
        tokio::time::sleep(ttl / 4).await;
    }
    assert!(a.renewals() > renewed, "{}: not renewed", store.name);
    let other = unique_key("runtime-new");
    let g2 = a.lock(&other).ttl(ttl).acquire().await.unwrap_or_else(|e| {
        panic!(
            "{}: a new lock after the runtime shut down: {e}",
            store.name
        )
    });
    g2.release().await.expect("the new lock released");
    g.release()
        .await
        .unwrap_or_else(|e| panic!("{}: the old guard's release: {e}", store.name));
    free_within(&b, &key, Duration::from_secs(2)).await;
}

/// A lock deleted behind the holder's back is reported lost within one renewal interval
/// (TTL/3), long before its local lease would run out.
pub async fn loss_is_reported(store: &Store) {
    let a = (store.locker)(Locker::builder()).await;
    let key = unique_key("loss");
    let ttl = Duration::from_millis(1500);
    let g = a.lock(&key).ttl(ttl).acquire().await.unwrap();
    let resource = a.resource(crate::LockKey::new(&key).unwrap());
    (store.break_lock)(resource.as_str().to_owned()).await;
    let start = Instant::now();
    // One renewal interval (500 ms) plus slack, still well inside the 1.5 s lease.
    tokio::time::timeout(ttl / 3 + Duration::from_millis(500), g.lost())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{}: loss not reported within one renewal interval",
                store.name
            )
        });
    assert!(
        start.elapsed() < ttl,
        "reported by the lease clock, not by renewal"
    );
    assert!(!g.is_held());
}

/// A release wakes a waiter at once, even when its fallback timer alone would take seconds (a
/// backend without notifications: the waiter gets the lock on its timer).
pub async fn release_wakes_waiter(store: &Store) {
    let backoff = if store.notifications {
        Duration::from_secs(10)
    } else {
        Duration::from_millis(200)
    };
    let slow = || Locker::builder().waiter_ttl(Duration::from_secs(60));
    let a = (store.locker)(slow()).await;
    let b = (store.locker)(slow()).await;
    let key = unique_key("wake");
    let held = a
        .lock(&key)
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move {
            let policy = RetryPolicy::new(Duration::from_secs(30))
                .backoff(backoff, backoff)
                .jitter(false);
            let g = b
                .lock(&key)
                .on_fail(OnFail::Retry(policy))
                .acquire()
                .await
                .unwrap();
            let at = Instant::now();
            g.release().await.unwrap();
            at
        })
    };
    wait_until("the waiter is queued", Duration::from_secs(5), || {
        b.waiting() == 1
    })
    .await;
    let released = Instant::now();
    held.release().await.unwrap();
    let got = waiter.await.unwrap();
    let gap = got - released;
    assert!(
        gap < Duration::from_secs(2),
        "{}: waiter woke after {gap:?}, backoff is {backoff:?}",
        store.name
    );
}

/// Two barging waiters (`fair(false)`) of one locker both hear each release: the one the
/// first release lets in holds the lock, and its release lets the other in, long before that
/// one's timer (10 s here). Before, on Redis, a release nobody was queued for woke only the
/// first local waiter; it took the lock with no waiter's flag (nobody had failed against it
/// yet), its release told nobody, and the other slept on its timer.
pub async fn barging_waiters_hear_each_release(store: &Store) {
    barging_pair_hears_each_release(store, "barge", |l: &Locker, k: &str| l.lock(k)).await;
}

/// Two barging waiters of one locker for what `take` asks of a key (a lock, a permit of a
/// semaphore of one), behind a holder: the first release lets one in, and its release the
/// other, within 2 s (their timers: 10 s).
pub(super) async fn barging_pair_hears_each_release(
    store: &Store,
    name: &str,
    take: for<'a> fn(&'a Locker, &str) -> crate::LockRequest<'a>,
) {
    let backoff = if store.notifications {
        Duration::from_secs(10)
    } else {
        Duration::from_millis(200)
    };
    // One locker for the holder and the waiters: a Postgres semaphore's release tells only
    // its own backend's barging waiters (see the backend's docs).
    let b = (store.locker)(Locker::builder().waiter_ttl(Duration::from_secs(60))).await;
    let key = unique_key(name);
    let held = take(&b, &key)
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let (got_tx, mut got) = tokio::sync::mpsc::unbounded_channel();
    let mut waiters = Vec::new();
    for _ in 0..2 {
        let (b, key, got_tx) = (b.clone(), key.clone(), got_tx.clone());
        waiters.push(tokio::spawn(async move {
            let policy = RetryPolicy::new(Duration::from_secs(30))
                .backoff(backoff, backoff)
                .jitter(false)
                .fair(false);
            let g = take(&b, &key)
                .ttl(Duration::from_secs(30))
                .on_fail(OnFail::Retry(policy))
                .acquire()
                .await
                .unwrap();
            got_tx.send((Instant::now(), g)).unwrap();
        }));
    }
    wait_until("both waiters wait", Duration::from_secs(5), || {
        b.waiting() == 2
    })
    .await;
    held.release().await.unwrap();
    let (_, first) = tokio::time::timeout(Duration::from_secs(25), got.recv())
        .await
        .expect("the first release lets a waiter in")
        .unwrap();
    let released = Instant::now();
    first.release().await.unwrap();
    let (at, second) = tokio::time::timeout(Duration::from_secs(25), got.recv())
        .await
        .expect("the second release lets the other waiter in")
        .unwrap();
    let gap = at - released;
    assert!(
        gap < Duration::from_secs(2),
        "{}: the second barging waiter ({name}) got in {gap:?} after the release, backoff is \
         {backoff:?}",
        store.name
    );
    second.release().await.unwrap();
    for w in waiters {
        w.await.unwrap();
    }
}

/// Waiters are served in arrival order, across lockers (for non-FIFO backends: all are served).
pub async fn waiters_are_served_in_order(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("fifo");
    let holder = a.lock(&key).acquire().await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..6usize {
        let l = if i % 2 == 0 { b.clone() } else { a.clone() };
        let (key, order) = (key.clone(), order.clone());
        tasks.push(tokio::spawn(async move {
            let g = l
                .lock(&key)
                .on_fail(OnFail::retry(Duration::from_secs(30)))
                .acquire()
                .await
                .unwrap();
            order.lock().unwrap().push(i);
            g.release().await.unwrap();
        }));
        let n = i + 1;
        wait_until("the waiter is queued", Duration::from_secs(5), || {
            a.waiting() + b.waiting() == n
        })
        .await;
    }
    holder.release().await.unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    let mut order = order.lock().unwrap().clone();
    if !store.fifo {
        order.sort_unstable();
    }
    assert_eq!(order, vec![0, 1, 2, 3, 4, 5], "{}: not FIFO", store.name);
}

/// A waiter that gives up (its future dropped) leaves the queue at once; one that dies
/// without a word (its future leaked) stops holding up the queue after the waiter TTL.
pub async fn dead_waiters_leave_the_queue(store: &Store) {
    let with_waiter_ttl = |d| Locker::builder().waiter_ttl(d);
    // Part 1 uses a long waiter TTL: only a prompt cleanup explains a prompt handover.
    let a = (store.locker)(with_waiter_ttl(Duration::from_secs(5))).await;
    let b = (store.locker)(with_waiter_ttl(Duration::from_secs(5))).await;
    let key = unique_key("deadwaiter");
    let retry = || OnFail::Retry(RetryPolicy::new(Duration::from_secs(30)));

    // 1. Cancelled waiter.
    let holder = a.lock(&key).acquire().await.unwrap();
    let cancelled = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { b.lock(&key).on_fail(retry()).acquire().await.map(drop) })
    };
    wait_until("first waiter queued", Duration::from_secs(5), || {
        b.waiting() == 1
    })
    .await;
    let second = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move {
            let g = a.lock(&key).on_fail(retry()).acquire().await.unwrap();
            let at = Instant::now();
            g.release().await.unwrap();
            at
        })
    };
    wait_until("second waiter queued", Duration::from_secs(5), || {
        a.waiting() == 1
    })
    .await;
    cancelled.abort();
    assert!(cancelled.await.unwrap_err().is_cancelled());
    let released = Instant::now();
    holder.release().await.unwrap();
    let got = second.await.unwrap();
    assert!(
        got - released < Duration::from_secs(2),
        "{}: cancelled waiter held up the queue for {:?} (its entry lives 5 s)",
        store.name,
        got - released
    );

    // Part 2 uses a short waiter TTL, so a dead waiter's entry expires quickly.
    let a = (store.locker)(with_waiter_ttl(Duration::from_millis(300))).await;
    let b = (store.locker)(with_waiter_ttl(Duration::from_millis(300))).await;
    // 2. A waiter that vanishes without cleanup (its future is leaked, as in a crash).
    let holder = a.lock(&key).acquire().await.unwrap();
    leak_a_queued_waiter(&b, &key).await;
    let next = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move {
            let g = a.lock(&key).on_fail(retry()).acquire().await.unwrap();
            g.release().await.unwrap();
        })
    };
    wait_until("next waiter queued", Duration::from_secs(5), || {
        a.waiting() == 1
    })
    .await;
    holder.release().await.unwrap();
    tokio::time::timeout(Duration::from_secs(3), next)
        .await
        .unwrap_or_else(|_| panic!("{}: dead waiter blocked the queue", store.name))
        .unwrap();
}

/// Starts a waiter for `key` on `locker` (which has no other waiter), polls it until it is
/// queued, then forgets it — no drop, no cleanup, as in a crash — and returns when it was seen
/// queued: after its last attempt, which set its entry's expiry.
async fn leak_a_queued_waiter(locker: &Locker, key: &str) -> Instant {
    let vanished = locker.clone();
    let vkey = key.to_owned();
    let mut leaked = Box::pin(async move {
        vanished
            .lock(&vkey)
            .on_fail(OnFail::retry(Duration::from_secs(30)))
            .acquire()
            .await
            .map(drop)
    });
    let start = Instant::now();
    while locker.waiting() == 0 {
        std::future::poll_fn(|cx| {
            assert!(leaked.as_mut().poll(cx).is_pending());
            std::task::Poll::Ready(())
        })
        .await;
        assert!(start.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let queued = Instant::now();
    std::mem::forget(leaked);
    queued
}

/// A lock that a release hands to a waiter that died (first in line, its entry not yet
/// expired) is held for it no longer than its queue entry would have lived — a waiter TTL from
/// its last attempt ([`Store::lease_bound`] of it) — not a waiter TTL from the handoff: a
/// crashed waiter blocks a lock at most the longer of the TTL and the waiter TTL.
pub async fn a_dead_waiters_handoff_ends_with_its_entry(store: &Store) {
    let waiter_ttl = Duration::from_secs(1);
    let make = || (store.locker)(Locker::builder().waiter_ttl(waiter_ttl));
    let (a, b, c) = (make().await, make().await, make().await);
    let key = unique_key("deadhandoff");
    let holder = a
        .lock(&key)
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    let queued = leak_a_queued_waiter(&b, &key).await;
    let next = {
        let (c, key) = (c.clone(), key.clone());
        tokio::spawn(async move {
            let g = c
                .lock(&key)
                .on_fail(OnFail::retry(Duration::from_secs(10)))
                .acquire()
                .await
                .unwrap();
            let at = Instant::now();
            g.release().await.unwrap();
            at
        })
    };
    wait_until("the live waiter queued", Duration::from_secs(5), || {
        c.waiting() == 1
    })
    .await;
    // Most of the dead waiter's entry has gone by (time passing is what is under test): the
    // release hands it the lock with under a third of a waiter TTL left on its entry.
    tokio::time::sleep_until((queued + waiter_ttl * 7 / 10).into()).await;
    holder.release().await.unwrap();
    let got = next.await.unwrap();
    let bound = (store.lease_bound)(waiter_ttl) + Duration::from_millis(400);
    assert!(
        got - queued < bound,
        "{}: the lock was handed to a dead waiter and freed {:?} after its last attempt \
         (its entry lived {waiter_ttl:?}; bound {bound:?})",
        store.name,
        got - queued
    );
}

/// A waiter behind one that died first in line, the lock free (its holder gone without a
/// release, so no handoff), is let in or told when the line may move: when the dead waiter's
/// entry ends (see `told_when_the_line_may_move`).
pub async fn a_waiter_behind_a_dead_one_is_told_when_the_line_may_move(store: &Store) {
    let lock = crate::LockKind::Exclusive;
    super::told_when_the_line_may_move(store, lock, lock, lock).await;
}

/// A holder that vanishes without releasing stops blocking others after its TTL.
pub async fn vanished_holder_expires(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("vanish");
    let ttl = Duration::from_millis(300);
    let g = a
        .lock(&key)
        .ttl(ttl)
        .auto_renew(false)
        .acquire()
        .await
        .unwrap();
    let taken = Instant::now();
    std::mem::forget(g); // no release, no drop
    let g = b
        .lock(&key)
        .on_fail(OnFail::retry(Duration::from_secs(10)))
        .acquire()
        .await
        .expect("acquire after expiry");
    super::assert_freed_at_ttl(store, taken.elapsed(), ttl, Duration::from_millis(50));
    g.release().await.unwrap();
}

/// Dropping a guard releases the lock in the background, promptly.
pub async fn drop_releases(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("drop");
    let g = a
        .lock(&key)
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .unwrap();
    drop(g);
    free_within(&b, &key, Duration::from_secs(2)).await;
    assert_eq!(a.renewing(), 0);
}

/// Reject reports the holder's remaining lease; retry gives up at its deadline.
pub async fn reject_and_timeout_errors(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("errors");
    let g = a
        .lock(&key)
        .ttl(Duration::from_secs(20))
        .acquire()
        .await
        .unwrap();
    let err = b.lock(&key).acquire().await.unwrap_err();
    assert!(matches!(err, LockError::Contended { .. }), "{err}");
    let ra = err.retry_after().expect("remaining lease");
    assert!(
        ra > Duration::from_secs(15) && ra <= Duration::from_secs(20),
        "{ra:?}"
    );
    assert_eq!(err.status(), 409);
    let start = Instant::now();
    let err = b
        .lock(&key)
        .on_fail(OnFail::retry(Duration::from_millis(300)))
        .acquire()
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert_eq!(b.waiting(), 0);
    g.release().await.unwrap();
    // The timed-out waiter left the queue: a one-shot attempt gets the free lock.
    assert!(b.lock(&key).try_acquire().await.unwrap().is_some());
}

/// Cancelling acquires at many points never leaves the lock held without a guard, nor a
/// waiter entry that holds up the queue.
pub async fn cancelled_acquires_leave_no_lock(store: &Store) {
    let (a, b) = store.pair().await;
    let mut cancelled = 0;
    for round in 0..200u64 {
        let key = unique_key("cancel");
        // Contended half the time, so cancellation also hits queued waiters.
        let holder = if round % 2 == 0 {
            Some(b.lock(&key).acquire().await.unwrap())
        } else {
            None
        };
        let cut = Duration::from_micros((round * 37) % 400);
        let attempt = a
            .lock(&key)
            .ttl(Duration::from_secs(30))
            .on_fail(OnFail::retry(Duration::from_secs(5)));
        match tokio::time::timeout(cut, attempt.acquire()).await {
            Ok(Ok(guard)) => drop(guard),
            Ok(Err(e)) => panic!("{}: acquire failed: {e}", store.name),
            Err(_) => cancelled += 1,
        }
        drop(holder);
        // Far less than the 30 s TTL and the 5 s waiter TTL: only a clean undo frees it this fast.
        free_within(&b, &key, Duration::from_secs(3)).await;
    }
    assert!(
        cancelled >= 100,
        "{}: only {cancelled} acquires were cancelled",
        store.name
    );
}

/// `extend` to a shorter lease is followed locally as well as by the backend: without renewal,
/// the guard stops claiming the lock when the new lease ends (`remaining`, `is_held`, `lost`),
/// and another owner can then take it.
pub async fn extend_can_shorten_the_lease(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("shorten");
    let g = a
        .lock(&key)
        .ttl(Duration::from_secs(30))
        .auto_renew(false)
        .acquire()
        .await
        .expect("acquire");
    let short = Duration::from_millis(300);
    g.extend(short).await.expect("extend");
    assert!(
        g.remaining() <= short,
        "{}: local lease not shortened: {:?} left",
        store.name,
        g.remaining()
    );
    tokio::time::timeout(Duration::from_secs(3), g.lost())
        .await
        .unwrap_or_else(|_| panic!("{}: lost() pending past the shortened lease", store.name));
    assert!(!g.is_held(), "{}", store.name);
    free_within(&b, &key, Duration::from_secs(5)).await;
}

/// With the watchdog on, `extend` to a shorter lease reschedules renewal to the new TTL: the
/// lock stays held through many of the new leases, and the local lease never claims more
/// than the new TTL.
pub async fn extend_reschedules_the_watchdog(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("reschedule");
    let g = a
        .lock(&key)
        .ttl(Duration::from_secs(30))
        .acquire()
        .await
        .expect("acquire");
    let short = Duration::from_millis(400);
    g.extend(short).await.expect("extend");
    let start = Instant::now();
    while start.elapsed() < short * 6 {
        assert!(
            b.lock(&key).try_acquire().await.unwrap().is_none(),
            "{}: lock lapsed at {:?}: the watchdog kept the old schedule",
            store.name,
            start.elapsed()
        );
        assert!(g.is_held(), "{}", store.name);
        assert!(
            g.remaining() <= short,
            "{}: {:?}",
            store.name,
            g.remaining()
        );
        tokio::time::sleep(short / 4).await;
    }
    g.release()
        .await
        .expect("still ours after 6 shortened leases");
}

/// A release after the lease ran out is reported lost even when nobody took the lock in
/// between (a backend may still find it this owner's): the holder was told it was lost, and
/// ran unprotected. The release still frees the lock.
pub async fn release_after_the_lease_ran_out_is_lost(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("lapsed");
    let g = a
        .lock(&key)
        .ttl(Duration::from_millis(150))
        .auto_renew(false)
        .acquire()
        .await
        .expect("acquire");
    tokio::time::timeout(Duration::from_secs(3), g.lost())
        .await
        .unwrap_or_else(|_| panic!("{}: lost() pending past the lease", store.name));
    let err = g.release().await.unwrap_err();
    assert!(
        err.is_lost(),
        "{}: release after the lease must report the loss: {err}",
        store.name
    );
    free_within(&b, &key, Duration::from_secs(5)).await;
}

/// An attempt by the token that already holds the lock is granted it again, in every wait
/// mode: its earlier attempt's reply may have been lost (a timeout, a failover) or a release's
/// handoff notification may have been. The grant restarts the lease (it outlives the first,
/// short one), its fencing token is not below the first, and there is still one holder:
/// another owner is refused, and one release frees the lock. `RetryPolicy::through_outages`
/// and lost handoffs rely on it.
pub async fn an_attempt_by_the_holder_is_granted_again(store: &Store) {
    let (a, b) = store.pair().await;
    let key = unique_key("again");
    let (resource, token) = super::granted_again(store, &a, &key, crate::LockKind::Exclusive).await;
    assert!(
        b.lock(&key).try_acquire().await.unwrap().is_none(),
        "{}: the lease was not restarted by the holder's second grant, or another owner got in",
        store.name
    );
    super::release_as(store, &a, &resource, &token).await;
    let g = b.lock(&key).try_acquire().await.unwrap();
    assert!(
        g.is_some(),
        "{}: one release did not free the lock",
        store.name
    );
}
