//! The semaphore and read-write lock checks. A store that does not offer them
//! ([`Store::kinds`] `false`) passes each check by refusing every kind with
//! [`LockError::Unsupported`](crate::LockError::Unsupported) instead.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{assert_freed_at_ttl, kind_free_within, unique_key, wait_until, Store};
use crate::{LockKey, LockKind, Locker, OnFail};

const SEM3: LockKind = LockKind::Semaphore { permits: 3 };

/// Whether the store offers semaphores and read-write locks. When it says it does not, this
/// asserts that every kind is refused with the typed error, by one attempt and by waiting.
async fn offered(store: &Store) -> bool {
    if store.kinds {
        return true;
    }
    let a = (store.locker)(Locker::builder()).await;
    let key = unique_key("unsupported");
    for kind in [SEM3, LockKind::Read, LockKind::Write] {
        let err = a.request(&key, kind).try_acquire().await.unwrap_err();
        assert!(err.is_unsupported(), "{}: {kind:?}: {err}", store.name);
        let err = a
            .request(&key, kind)
            .on_fail(OnFail::retry(Duration::from_secs(1)))
            .acquire()
            .await
            .unwrap_err();
        assert!(err.is_unsupported(), "{}: {kind:?}: {err}", store.name);
        assert_eq!(err.status(), 500);
    }
    false
}

fn wait(store: &Store) -> OnFail {
    let policy = crate::RetryPolicy::new(Duration::from_secs(30));
    // Without release notifications every hand-over waits for a waiter's timer: keep it short.
    OnFail::Retry(if store.notifications {
        policy
    } else {
        policy.backoff(Duration::from_millis(1), Duration::from_millis(20))
    })
}

/// A barging waiter (`fair(false)`: not in the line) of a semaphore is woken when a holder of
/// its backend releases with nobody in line, not by its fallback timer (5 s here). Before, on
/// memory and Redis (one server, Sentinel, Cluster), a release woke only waiters in the line.
pub async fn semaphore_barging_waiter_is_woken_by_a_release(store: &Store) {
    if !offered(store).await {
        return;
    }
    let a = (store.locker)(Locker::builder().waiter_ttl(Duration::from_secs(30))).await;
    let key = unique_key("sem-barge");
    let held = a.semaphore(&key, 1).try_acquire().await.unwrap().unwrap();
    let waiter = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        let policy = crate::RetryPolicy::new(Duration::from_secs(30))
            .backoff(Duration::from_secs(5), Duration::from_secs(5))
            .jitter(false)
            .fair(false);
        async move {
            a.semaphore(&key, 1)
                .on_fail(OnFail::Retry(policy))
                .acquire()
                .await
        }
    });
    wait_until("the barging waiter waits", Duration::from_secs(5), || {
        a.waiting() == 1
    })
    .await;
    held.release().await.unwrap();
    let released = Instant::now();
    let g = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .unwrap_or_else(|_| panic!("{}: the barging waiter never got the permit", store.name))
        .unwrap()
        .unwrap();
    let took = released.elapsed();
    if store.notifications {
        assert!(
            took < Duration::from_millis(2500),
            "{}: the barging waiter was woken {took:?} after the release",
            store.name
        );
    }
    g.release().await.unwrap();
}

/// Two barging waiters of one locker for a permit of a semaphore of one both hear each
/// release: the first release lets one in, and its release the other, long before its timer.
/// Before, on etcd, a waiter whose attempt lost just before the permit was freed watched from a
/// revision read after it, and slept on its timer.
pub async fn semaphore_barging_waiters_hear_each_release(store: &Store) {
    if !offered(store).await {
        return;
    }
    super::locks::barging_pair_hears_each_release(store, "sem-barge2", |l: &Locker, k: &str| {
        l.semaphore(k, 1)
    })
    .await;
}

/// A semaphore of 3 admits 3 holders across lockers and refuses a 4th until one releases;
/// under contention (2 lockers × 6 tasks × 10 rounds) never more than 3 are inside.
pub async fn semaphore_admits_at_most_permits(store: &Store) {
    if !offered(store).await {
        return;
    }
    let (a, b) = store.pair().await;
    let key = unique_key("sem");
    let g1 = a.semaphore(&key, 3).try_acquire().await.unwrap().unwrap();
    let g2 = b.semaphore(&key, 3).try_acquire().await.unwrap().unwrap();
    let g3 = a.semaphore(&key, 3).try_acquire().await.unwrap().unwrap();
    assert_eq!(g2.kind(), SEM3);
    assert!(
        a.semaphore(&key, 3).try_acquire().await.unwrap().is_none()
            && b.semaphore(&key, 3).try_acquire().await.unwrap().is_none(),
        "{}: a 4th permit of 3 was granted",
        store.name
    );
    // A lock on the same key is another thing.
    let lock = a.lock(&key).try_acquire().await.unwrap();
    assert!(
        lock.is_some(),
        "{}: the semaphore blocked the lock",
        store.name
    );
    g2.release().await.unwrap();
    let g4 = b.semaphore(&key, 3).try_acquire().await.unwrap();
    assert!(
        g4.is_some(),
        "{}: a released permit stayed taken",
        store.name
    );
    drop((g1, g3, g4, lock));

    let key = unique_key("sem-contended");
    let inside = Arc::new(AtomicUsize::new(0));
    let over = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..12 {
        let locker = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (key, inside, over, on_fail) = (key.clone(), inside.clone(), over.clone(), wait(store));
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let g = locker
                    .semaphore(&key, 3)
                    .ttl(Duration::from_secs(5))
                    .on_fail(on_fail.clone())
                    .acquire()
                    .await
                    .expect("acquire");
                if inside.fetch_add(1, Ordering::SeqCst) >= 3 {
                    over.fetch_add(1, Ordering::SeqCst);
                }
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                g.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(
        over.load(Ordering::SeqCst),
        0,
        "{}: more than 3 holders",
        store.name
    );
}

/// Waiters for a semaphore's permit get it in arrival order, whichever locker they use.
pub async fn semaphore_waiters_are_served_in_order(store: &Store) {
    if !offered(store).await {
        return;
    }
    let (a, b) = store.pair().await;
    let key = unique_key("sem-fifo");
    let h1 = a.semaphore(&key, 2).acquire().await.unwrap();
    let h2 = a.semaphore(&key, 2).acquire().await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..4usize {
        let l = if i % 2 == 0 { b.clone() } else { a.clone() };
        let (key, order, on_fail) = (key.clone(), order.clone(), wait(store));
        tasks.push(tokio::spawn(async move {
            let g = l
                .semaphore(&key, 2)
                .on_fail(on_fail)
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
    // One permit goes round the waiters, the other stays held: one at a time, in order.
    h1.release().await.unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        order.lock().unwrap().clone(),
        vec![0, 1, 2, 3],
        "{}: permits not handed out in arrival order",
        store.name
    );
    h2.release().await.unwrap();
}

/// Permits whose holders died (no release, no renewal) free within their TTL.
pub async fn semaphore_dead_holders_expire(store: &Store) {
    if !offered(store).await {
        return;
    }
    let (a, b) = store.pair().await;
    let key = unique_key("sem-dead");
    let ttl = Duration::from_millis(300);
    for _ in 0..2 {
        let g = a
            .semaphore(&key, 2)
            .ttl(ttl)
            .auto_renew(false)
            .acquire()
            .await
            .unwrap();
        std::mem::forget(g); // no release, no drop
    }
    let taken = Instant::now();
    let g = b
        .semaphore(&key, 2)
        .on_fail(OnFail::retry(Duration::from_secs(10)))
        .acquire()
        .await
        .expect("acquire after expiry");
    // The first permit's lease began up to one acquire before `taken`.
    assert_freed_at_ttl(store, taken.elapsed(), ttl, Duration::from_millis(100));
    g.release().await.unwrap();
}

/// Readers share, a writer is alone; under contention (2 lockers × 6 tasks × 10 rounds, one
/// write in five) no writer is ever inside with anyone.
pub async fn rw_readers_share_writers_exclude(store: &Store) {
    if !offered(store).await {
        return;
    }
    let (a, b) = store.pair().await;
    let key = unique_key("rw");
    let r1 = a.rw(&key).read().try_acquire().await.unwrap().unwrap();
    let r2 = b.rw(&key).read().try_acquire().await.unwrap();
    assert!(r2.is_some(), "{}: a second reader was refused", store.name);
    assert!(
        b.rw(&key).write().try_acquire().await.unwrap().is_none(),
        "{}: a writer got in beside readers",
        store.name
    );
    drop((r1, r2));
    let w = loop {
        // The readers' drops release in the background.
        if let Some(w) = b.rw(&key).write().try_acquire().await.unwrap() {
            break w;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    assert_eq!(w.kind(), LockKind::Write);
    assert!(
        a.rw(&key).read().try_acquire().await.unwrap().is_none()
            && a.rw(&key).write().try_acquire().await.unwrap().is_none(),
        "{}: someone got in beside a writer",
        store.name
    );
    w.release().await.unwrap();

    let key = unique_key("rw-contended");
    // (readers, writers) inside, and the violations seen.
    let inside = Arc::new(Mutex::new((0usize, 0usize)));
    let bad = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..12usize {
        let locker = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (key, inside, bad, on_fail) = (key.clone(), inside.clone(), bad.clone(), wait(store));
        tasks.push(tokio::spawn(async move {
            for round in 0..10usize {
                let write = (i + round) % 5 == 0;
                let rw = locker.rw(&key);
                let req = if write { rw.write() } else { rw.read() };
                let g = req
                    .ttl(Duration::from_secs(5))
                    .on_fail(on_fail.clone())
                    .acquire()
                    .await
                    .expect("acquire");
                {
                    let mut s = inside.lock().unwrap();
                    if s.1 > 0 || (write && s.0 > 0) {
                        bad.fetch_add(1, Ordering::SeqCst);
                    }
                    if write {
                        s.1 += 1;
                    } else {
                        s.0 += 1;
                    }
                }
                tokio::task::yield_now().await;
                {
                    let mut s = inside.lock().unwrap();
                    if write {
                        s.1 -= 1;
                    } else {
                        s.0 -= 1;
                    }
                }
                g.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(
        bad.load(Ordering::SeqCst),
        0,
        "{}: a writer shared the lock",
        store.name
    );
}

/// A waiting writer blocks readers that arrive after it (no writer starvation): they neither
/// get in by one attempt nor overtake it while waiting. Fencing tokens follow the order.
pub async fn rw_waiting_writer_blocks_new_readers(store: &Store) {
    if !offered(store).await {
        return;
    }
    let (a, b) = store.pair().await;
    let key = unique_key("rw-writer-first");
    let r1 = a.rw(&key).read().acquire().await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let writer = tokio::spawn({
        let (b, key, order, on_fail) = (b.clone(), key.clone(), order.clone(), wait(store));
        async move {
            let w = b.rw(&key).write().on_fail(on_fail).acquire().await.unwrap();
            order.lock().unwrap().push(("write", w.fencing_token()));
            w.release().await.unwrap();
        }
    });
    wait_until("the writer is queued", Duration::from_secs(5), || {
        b.waiting() == 1
    })
    .await;
    assert!(
        a.rw(&key).read().try_acquire().await.unwrap().is_none(),
        "{}: a new reader got in ahead of a waiting writer",
        store.name
    );
    let reader = tokio::spawn({
        let (a, key, order, on_fail) = (a.clone(), key.clone(), order.clone(), wait(store));
        async move {
            let r = a.rw(&key).read().on_fail(on_fail).acquire().await.unwrap();
            order.lock().unwrap().push(("read", r.fencing_token()));
            r.release().await.unwrap();
        }
    });
    wait_until("the reader is queued", Duration::from_secs(5), || {
        a.waiting() == 1
    })
    .await;
    let first = r1.fencing_token();
    r1.release().await.unwrap();
    writer.await.unwrap();
    reader.await.unwrap();
    let order = order.lock().unwrap().clone();
    assert_eq!(
        order.iter().map(|(m, _)| *m).collect::<Vec<_>>(),
        ["write", "read"],
        "{}: the writer was overtaken",
        store.name
    );
    assert!(
        first < order[0].1 && order[0].1 < order[1].1,
        "{}: fencing tokens out of order: {first}, {order:?}",
        store.name
    );
}

/// A writer's release lets in every reader queued at the head together (not one by one), and
/// a writer queued behind them waits until they are all gone.
pub async fn rw_writer_release_admits_leading_readers(store: &Store) {
    if !offered(store).await {
        return;
    }
    let (a, b) = store.pair().await;
    let key = unique_key("rw-batch");
    let w = a.rw(&key).write().acquire().await.unwrap();
    let together = Arc::new(tokio::sync::Barrier::new(4));
    let mut readers = Vec::new();
    for i in 0..3usize {
        let l = if i % 2 == 0 { b.clone() } else { a.clone() };
        let (key, together, on_fail) = (key.clone(), together.clone(), wait(store));
        readers.push(tokio::spawn(async move {
            let r = l.rw(&key).read().on_fail(on_fail).acquire().await.unwrap();
            together.wait().await;
            r
        }));
        let n = i + 1;
        wait_until("the reader is queued", Duration::from_secs(5), || {
            a.waiting() + b.waiting() == n
        })
        .await;
    }
    let writer = tokio::spawn({
        let (b, key, on_fail) = (b.clone(), key.clone(), wait(store));
        async move { b.rw(&key).write().on_fail(on_fail).acquire().await.unwrap() }
    });
    wait_until(
        "the second writer is queued",
        Duration::from_secs(5),
        || a.waiting() + b.waiting() == 4,
    )
    .await;
    w.release().await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), together.wait())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{}: the queued readers were not let in together",
                store.name
            )
        });
    let mut held = Vec::new();
    for r in readers {
        held.push(r.await.unwrap());
    }
    assert!(
        !writer.is_finished(),
        "{}: a writer got in beside readers",
        store.name
    );
    for r in held {
        r.release().await.unwrap();
    }
    let w2 = writer.await.unwrap();
    w2.release().await.unwrap();
}

/// Fencing tokens of permits, reads and writes increase strictly per name, across expiry too;
/// a writer's token is above every token issued before it.
pub async fn kinds_fencing_tokens_increase(store: &Store) {
    if !offered(store).await {
        return;
    }
    let (a, b) = store.pair().await;
    let key = unique_key("kinds-fence");
    let mut last = 0;
    for i in 0..6 {
        let l = if i % 2 == 0 { &a } else { &b };
        let g = l
            .semaphore(&key, 2)
            .on_fail(OnFail::retry(Duration::from_secs(10)))
            .acquire()
            .await
            .unwrap();
        assert!(g.fencing_token() > last, "{}: permit token", store.name);
        last = g.fencing_token();
        if i % 3 == 0 {
            g.release().await.unwrap();
        } else {
            drop(g); // released in the background
        }
    }
    let r1 = a.rw(&key).read().acquire().await.unwrap();
    let r2 = b.rw(&key).read().acquire().await.unwrap();
    assert!(r2.fencing_token() > r1.fencing_token());
    let top = r2.fencing_token();
    r1.release().await.unwrap();
    r2.release().await.unwrap();
    let stale = a
        .rw(&key)
        .write()
        .ttl(Duration::from_millis(200))
        .auto_renew(false)
        .acquire()
        .await
        .unwrap();
    assert!(stale.fencing_token() > top, "{}: writer token", store.name);
    let top = stale.fencing_token();
    stale.lost().await;
    std::mem::forget(stale); // expires rather than being released
    let w = b
        .rw(&key)
        .write()
        .on_fail(OnFail::retry(Duration::from_secs(10)))
        .acquire()
        .await
        .unwrap();
    assert!(
        w.fencing_token() > top,
        "{}: writer token after expiry",
        store.name
    );
    w.release().await.unwrap();
}

/// The watchdog keeps a permit past its TTL; a permit taken away behind its holder's back is
/// reported lost within a renewal interval; a stale holder can neither extend nor release a
/// permit that is someone else's now.
pub async fn kinds_watchdog_loss_and_owner_checks(store: &Store) {
    if !offered(store).await {
        return;
    }
    let (a, b) = store.pair().await;
    let key = unique_key("kinds-watchdog");
    let kind = LockKind::Semaphore { permits: 1 };
    let ttl = Duration::from_millis(300);
    let g = a.semaphore(&key, 1).ttl(ttl).acquire().await.unwrap();
    tokio::time::sleep(ttl * 3).await; // time passing is the behaviour under test
    assert!(
        g.is_held(),
        "{}: the watchdog let the permit go",
        store.name
    );
    assert!(b.semaphore(&key, 1).try_acquire().await.unwrap().is_none());
    g.release().await.unwrap();

    let ttl = Duration::from_millis(1500);
    let g = a.rw(&key).write().ttl(ttl).acquire().await.unwrap();
    let resource = a
        .resource(LockKey::new(&key).unwrap())
        .with_kind(LockKind::Write);
    (store.break_lock)(resource.as_str().to_owned()).await;
    let start = Instant::now();
    tokio::time::timeout(ttl / 3 + Duration::from_millis(500), g.lost())
        .await
        .unwrap_or_else(|_| panic!("{}: loss not reported by renewal", store.name));
    assert!(start.elapsed() < ttl);

    let stale = a
        .request(&key, kind)
        .ttl(Duration::from_millis(150))
        .auto_renew(false)
        .acquire()
        .await
        .unwrap();
    stale.lost().await;
    let owner = b
        .request(&key, kind)
        .on_fail(OnFail::retry(Duration::from_secs(5)))
        .acquire()
        .await
        .unwrap();
    assert!(stale
        .extend(Duration::from_secs(10))
        .await
        .unwrap_err()
        .is_lost());
    assert!(stale.release().await.unwrap_err().is_lost());
    assert!(
        a.request(&key, kind).try_acquire().await.unwrap().is_none(),
        "{}: a stale release freed the new owner's permit",
        store.name
    );
    owner.release().await.unwrap();
}

/// A reader behind a writer that died in line, with no holder left (the reader before it gone
/// without a release), is let in or told when the line may move: when the writer's queue
/// entry ends (see `told_when_the_line_may_move`).
pub async fn kinds_a_waiter_behind_a_dead_one_is_told_when_the_line_may_move(store: &Store) {
    if offered(store).await {
        super::told_when_the_line_may_move(store, LockKind::Read, LockKind::Write, LockKind::Read)
            .await;
    }
}

/// Acquires of permits and write holds cancelled at random points (queued or in flight)
/// leave nothing held: the name frees far sooner than any TTL.
pub async fn kinds_cancelled_acquires_leave_nothing(store: &Store) {
    if !offered(store).await {
        return;
    }
    let (a, b) = store.pair().await;
    let mut cancelled = 0;
    for round in 0..120u64 {
        let key = unique_key("kinds-cancel");
        let kind = if round % 4 < 2 {
            LockKind::Semaphore { permits: 1 }
        } else {
            LockKind::Write
        };
        let holder = if round % 2 == 0 {
            Some(b.request(&key, kind).acquire().await.unwrap())
        } else {
            None
        };
        let cut = Duration::from_micros((round * 37) % 400);
        let attempt = a
            .request(&key, kind)
            .ttl(Duration::from_secs(30))
            .on_fail(OnFail::retry(Duration::from_secs(5)));
        match tokio::time::timeout(cut, attempt.acquire()).await {
            Ok(Ok(guard)) => drop(guard),
            Ok(Err(e)) => panic!("{}: acquire failed: {e}", store.name),
            Err(_) => cancelled += 1,
        }
        drop(holder);
        kind_free_within(&b, &key, kind, Duration::from_secs(3)).await;
    }
    assert!(
        cancelled >= 60,
        "{}: only {cancelled} acquires were cancelled",
        store.name
    );
}

/// [`an_attempt_by_the_holder_is_granted_again`](super::an_attempt_by_the_holder_is_granted_again)
/// for a permit and for read and write holds: the holder asking again keeps exactly one hold
/// (a semaphore of 2 still has one permit for another owner, and only one), with its lease
/// restarted; one release gives it back.
pub async fn kinds_an_attempt_by_the_holder_is_granted_again(store: &Store) {
    if !offered(store).await {
        return;
    }
    let (a, b) = store.pair().await;
    let sem2 = LockKind::Semaphore { permits: 2 };
    // What another owner can take beside the hold, and what it cannot.
    for (kind, beside, not_beside) in [
        (sem2, Some(sem2), sem2),
        (LockKind::Read, Some(LockKind::Read), LockKind::Write),
        (LockKind::Write, None, LockKind::Read),
    ] {
        let key = unique_key("kind-again");
        let (resource, token) = super::granted_again(store, &a, &key, kind).await;
        let other = match beside {
            Some(beside) => {
                let g = b.request(&key, beside).try_acquire().await.unwrap();
                assert!(
                    g.is_some(),
                    "{}: {kind:?}: no room beside the holder",
                    store.name
                );
                g
            }
            None => None,
        };
        assert!(
            b.request(&key, not_beside)
                .try_acquire()
                .await
                .unwrap()
                .is_none(),
            "{}: {kind:?}: {not_beside:?} got in beside the holder: its lease was not \
             restarted, or it lost its hold",
            store.name
        );
        super::release_as(store, &a, &resource, &token).await;
        if let Some(g) = other {
            g.release().await.unwrap();
        }
        kind_free_within(&b, &key, not_beside, Duration::from_secs(2)).await;
    }
}
