//! The multi-key lock checks ([`Locker::lock_all`](crate::Locker::lock_all)) and the minimum
//! hold of scheduled jobs ([`LockRequest::hold_at_least`](crate::LockRequest::hold_at_least)).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{free_within, unique_key, Store};
use crate::{OnFail, RetryPolicy};

/// Mutual exclusion under contention with opposite key orders: 2 lockers × 8 tasks × 10 rounds,
/// half naming `[a, b]`, half `[b, a]`, each doing a non-atomic read-modify-write of both keys'
/// counters. A deadlock would end in a wait timeout (the test fails); the counters end exact
/// and no two tasks are ever inside at once.
pub async fn multi_key_opposite_orders(store: &Store) {
    let (x, y) = store.pair().await;
    let (a, b) = (unique_key("multi-a"), unique_key("multi-b"));
    let counters = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let rounds = 10u64;
    let policy = RetryPolicy::new(Duration::from_secs(30))
        .backoff(Duration::from_millis(1), Duration::from_millis(20));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let locker = if i % 2 == 0 { x.clone() } else { y.clone() };
        let keys = if i % 4 < 2 {
            [a.clone(), b.clone()]
        } else {
            [b.clone(), a.clone()]
        };
        let (counters, inside, overlaps, policy) = (
            counters.clone(),
            inside.clone(),
            overlaps.clone(),
            policy.clone(),
        );
        tasks.push(tokio::spawn(async move {
            for _ in 0..rounds {
                let g = locker
                    .lock_all(&keys)
                    .ttl(Duration::from_secs(5))
                    .on_fail(OnFail::Retry(policy.clone()))
                    .acquire()
                    .await
                    .expect("acquire both keys");
                if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                let v = [
                    counters[0].load(Ordering::SeqCst),
                    counters[1].load(Ordering::SeqCst),
                ];
                tokio::task::yield_now().await;
                counters[0].store(v[0] + 1, Ordering::SeqCst);
                counters[1].store(v[1] + 1, Ordering::SeqCst);
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
    for c in counters.iter() {
        assert_eq!(
            c.load(Ordering::SeqCst),
            16 * rounds,
            "{}: lost updates",
            store.name
        );
    }
}

/// All or nothing: with one key held elsewhere, `lock_all` takes none (the other key is free
/// right after); a key given twice is a typed error; each key has its own fencing token, and
/// tokens increase per key across acquisitions.
pub async fn multi_key_all_or_nothing(store: &Store) {
    let (x, y) = store.pair().await;
    let (a, b) = (unique_key("aon-a"), unique_key("aon-b"));
    let held = y.lock(&b).acquire().await.expect("hold b");
    assert!(
        x.lock_all([&a, &b])
            .try_acquire()
            .await
            .expect("try")
            .is_none(),
        "{}: took the set while b was held",
        store.name
    );
    let err = x
        .lock_all([&a, &b])
        .on_fail(OnFail::Reject)
        .acquire()
        .await
        .expect_err("b is held");
    assert!(err.is_contended(), "{}: {err}", store.name);
    let a_alone = y.lock(&a).try_acquire().await.expect("try a");
    assert!(
        a_alone.is_some(),
        "{}: `a` left held by a failed set",
        store.name
    );
    a_alone.unwrap().release().await.expect("release a");
    held.release().await.expect("release b");

    let err = x.lock_all([&a, &a]).acquire().await.expect_err("duplicate");
    assert!(err.is_invalid(), "{}: {err}", store.name);

    let first = x.lock_all([&b, &a]).acquire().await.expect("both");
    let tokens = [first.fencing_token(&a), first.fencing_token(&b)];
    assert!(
        tokens.iter().all(Option::is_some),
        "{}: {first:?}",
        store.name
    );
    assert_eq!(first.infos().len(), 2);
    first.release().await.expect("release both");
    let second = y.lock_all([&a, &b]).acquire().await.expect("both again");
    assert!(
        second.fencing_token(&a) > tokens[0],
        "{}: a's token",
        store.name
    );
    assert!(
        second.fencing_token(&b) > tokens[1],
        "{}: b's token",
        store.name
    );
    second.release().await.expect("release both");
}

/// All or nothing also in time: a key the set took first whose lease runs out (no renewal)
/// while `lock_all` waits for the next — another owner takes it meanwhile — is not handed out
/// as held: the set fails with `Lost`, naming that key, and holds nothing.
pub async fn multi_key_lost_while_waiting_fails(store: &Store) {
    let (x, y) = store.pair().await;
    let (a, b) = (unique_key("mlost-a"), unique_key("mlost-b"));
    let held = y.lock(&b).acquire().await.expect("hold b");
    let set = tokio::spawn({
        let (x, a, b) = (x.clone(), a.clone(), b.clone());
        async move {
            x.lock_all([&a, &b])
                .ttl(Duration::from_millis(300))
                .auto_renew(false)
                .on_fail(OnFail::retry(Duration::from_secs(30)))
                .acquire()
                .await
        }
    });
    // The set takes `a` (an attempt that finds it free gives it back at once)...
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{}: the set never took a",
            store.name
        );
        match y.lock(&a).try_acquire().await {
            Ok(None) => break,
            Ok(Some(g)) => g.release().await.expect("release a"),
            Err(e) => assert!(e.is_unavailable(), "{}: {e}", store.name),
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // ...then its lease runs out and another owner takes it.
    let other = loop {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{}: a never lapsed",
            store.name
        );
        match y.lock(&a).try_acquire().await {
            Ok(Some(g)) => break g,
            Ok(None) => {}
            Err(e) => assert!(e.is_unavailable(), "{}: {e}", store.name),
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    held.release().await.expect("release b");
    let err = set
        .await
        .expect("the set's task")
        .expect_err("a set with a key held by another owner was handed out");
    assert!(err.is_lost(), "{}: {err}", store.name);
    assert_eq!(err.key(), Some(a.as_str()), "{}", store.name);
    free_within(&y, &b, Duration::from_secs(3)).await;
    other.release().await.expect("release a");
}

/// Cancel safety: 100 `lock_all` acquires cut at varying points (half of them while a key is
/// held elsewhere, so some are queued waiters) leave both keys free within a short bound —
/// far less than the TTL, so only a clean undo frees them this fast.
pub async fn multi_key_cancel_safety(store: &Store) {
    let (x, y) = store.pair().await;
    let mut cancelled = 0;
    for round in 0..100u64 {
        let (a, b) = (unique_key("mcancel-a"), unique_key("mcancel-b"));
        let holder = if round % 2 == 0 {
            Some(y.lock(&b).acquire().await.expect("hold b"))
        } else {
            None
        };
        let cut = Duration::from_micros((round * 53) % 800);
        let attempt = x
            .lock_all([&a, &b])
            .ttl(Duration::from_secs(30))
            .on_fail(OnFail::retry(Duration::from_secs(5)));
        match tokio::time::timeout(cut, attempt.acquire()).await {
            Ok(Ok(guard)) => drop(guard),
            Ok(Err(e)) => panic!("{}: acquire failed: {e}", store.name),
            Err(_) => cancelled += 1,
        }
        drop(holder);
        free_within(&y, &a, Duration::from_secs(3)).await;
        free_within(&y, &b, Duration::from_secs(3)).await;
    }
    assert!(
        cancelled >= 40,
        "{}: only {cancelled} acquires were cancelled",
        store.name
    );
}

/// A minimum hold keeps a released lock until the hold ends (another owner cannot take it
/// right after the release), then it frees by itself well before the TTL would end it — also
/// while its locker renews another lock whose TTL is about what was left of the hold (on etcd,
/// such a lock's session lease is kept alive for it, and a key left on it stayed held).
pub async fn hold_at_least_keeps_the_lock(store: &Store) {
    let (x, y) = store.pair().await;
    let key = unique_key("hold");
    let hold = Duration::from_millis(1500);
    let renewed = x
        .lock(unique_key("hold-renewed"))
        .ttl(Duration::from_secs(2))
        .acquire()
        .await
        .expect("acquire the renewed lock");
    let taken = Instant::now();
    let guard = x
        .lock(&key)
        .ttl(Duration::from_secs(20))
        .hold_at_least(hold)
        .acquire()
        .await
        .expect("acquire");
    guard.release().await.expect("release within the hold");
    assert!(
        y.lock(&key).try_acquire().await.expect("try").is_none(),
        "{}: the lock was free right after a release within the hold",
        store.name
    );
    // Leases on some backends are whole seconds (etcd): allow that rounding, not the TTL.
    free_within(&y, &key, Duration::from_secs(5)).await;
    assert!(
        taken.elapsed() >= hold,
        "{}: freed before the hold ended ({:?})",
        store.name,
        taken.elapsed()
    );
    assert!(
        y.lock(&key)
            .run_or_skip(async {})
            .await
            .expect("run")
            .is_some(),
        "{}: free after the hold",
        store.name
    );
    if store.kinds {
        // A permit too (the same path on every backend that has kinds).
        let key = unique_key("hold-sem");
        let kind = crate::LockKind::Semaphore { permits: 1 };
        let permit = x
            .request(&key, kind)
            .ttl(Duration::from_secs(20))
            .hold_at_least(hold)
            .acquire()
            .await
            .expect("acquire the permit");
        permit.release().await.expect("release within the hold");
        assert!(
            y.request(&key, kind)
                .try_acquire()
                .await
                .expect("try")
                .is_none(),
            "{}: the permit was free right after a release within the hold",
            store.name
        );
        super::kind_free_within(&y, &key, kind, Duration::from_secs(5)).await;
    }
    assert!(renewed.is_held(), "{}: the renewed lock", store.name);
    renewed.release().await.expect("release the renewed lock");
}
