//! The inspection checks ([`AdminStore`](crate::backend::AdminStore)), for a backend whose
//! store says it has the capability ([`Store::admin`]); one that does not must answer
//! [`LockError::Unsupported`](crate::LockError::Unsupported) from `Locker::admin`.

use std::time::Duration;

use super::{unique_key, wait_until, Store};
use crate::admin::TOKEN_PREFIX_LEN;
use crate::{LockKey, OnFail, RetryPolicy};

/// `inspect` shows the holder (a token prefix, its fencing token where the store keeps it, the
/// lease left) and the waiters in order; `list` finds the lock by key prefix; `force_release`
/// frees it whoever holds it, raises the fencing counter past the holder's token, passes the
/// lock to the waiter (with a greater token) and leaves the old holder unable to extend.
pub async fn admin_inspect_list_force_release(store: &Store) {
    let (a, b) = store.pair().await;
    let Ok(admin) = b.admin() else {
        let e = b.admin().unwrap_err();
        assert!(
            !store.admin && e.is_unsupported(),
            "{}: admin unavailable: {e}",
            store.name
        );
        return;
    };
    assert!(
        store.admin,
        "{}: has admin but the store says not",
        store.name
    );
    let key = unique_key("admin");
    let holder = a
        .lock(&key)
        .ttl(Duration::from_secs(20))
        .acquire()
        .await
        .expect("acquire");
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move {
            b.lock(&key)
                .ttl(Duration::from_secs(20))
                .on_fail(OnFail::Retry(RetryPolicy::new(Duration::from_secs(20))))
                .acquire()
                .await
        })
    };
    wait_until("the waiter is queued", Duration::from_secs(10), || {
        b.waiting() == 1
    })
    .await;

    let encoded = LockKey::new(&key).unwrap().as_str().to_owned();
    // The waiter's queue entry is written by its first attempt, which may land just after it
    // counts as waiting: read until it shows.
    let mut state = admin.inspect(key.as_str()).await.expect("inspect");
    for _ in 0..200 {
        if !state.waiters.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        state = admin.inspect(key.as_str()).await.expect("inspect");
    }
    assert_eq!(state.key, encoded, "{}", store.name);
    let h = state.holder.clone().expect("a holder");
    assert_eq!(h.token_prefix.len(), TOKEN_PREFIX_LEN, "{}", store.name);
    if let Some(t) = h.fencing_token {
        assert_eq!(t, holder.fencing_token(), "{}: holder's token", store.name);
    }
    assert!(
        h.ttl_left > Duration::ZERO && h.ttl_left <= Duration::from_secs(20),
        "{}: ttl left {:?}",
        store.name,
        h.ttl_left
    );
    assert_eq!(
        state.waiters.len(),
        1,
        "{}: waiters {:?}",
        store.name,
        state
    );
    assert_ne!(state.waiters[0].token_prefix, h.token_prefix);

    let listed = admin
        .list_all(&key[..key.len() - 2], 1000)
        .await
        .expect("list");
    assert!(
        listed
            .iter()
            .any(|s| s.key == encoded && s.holder.is_some()),
        "{}: `{key}` not listed: {listed:?}",
        store.name
    );
    // A page of `limit` 0 asked through the trait (which does not forbid it): an answer, not
    // a panic (Postgres and etcd indexed `limit - 1`).
    let store_admin = b.backend().admin().expect("the admin store");
    let page = store_admin
        .list(b.prefix(), &encoded, None, 0)
        .await
        .expect("a page of limit 0");
    assert!(page.locks.len() <= 1, "{}: {page:?}", store.name);
    let none = admin
        .list_all("conf:no-such-prefix:", 10)
        .await
        .expect("list");
    assert!(none.is_empty(), "{}: {none:?}", store.name);

    let freed = admin
        .force_release(key.as_str())
        .await
        .expect("force release");
    assert!(freed.was_held, "{}", store.name);
    if let Some(f) = freed.fence {
        assert!(
            f > holder.fencing_token(),
            "{}: fence not raised",
            store.name
        );
    }
    let next = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("the waiter gets the lock")
        .expect("task")
        .expect("acquire");
    assert!(
        next.fencing_token() > holder.fencing_token(),
        "{}",
        store.name
    );
    if let Some(f) = freed.fence {
        assert!(
            next.fencing_token() > f,
            "{}: next token below the raised fence",
            store.name
        );
    }
    assert!(
        holder.extend(Duration::from_secs(20)).await.is_err(),
        "{}: the old holder still extends",
        store.name
    );
    next.release().await.expect("release");
    let after = admin.inspect(key.as_str()).await.expect("inspect");
    assert!(!after.is_active(), "{}: {after:?}", store.name);
    let again = admin
        .force_release(key.as_str())
        .await
        .expect("force release");
    assert!(!again.was_held, "{}", store.name);

    // Semaphores and read-write locks are not locks: `list` does not show them as one (a
    // holder and "waiters" that `inspect` and `force_release` of the key then know nothing
    // of). etcd and the memory store listed them.
    if !store.kinds {
        return;
    }
    let kinds = unique_key("admin-kinds");
    let permits: Vec<_> = futures_util::future::join_all(
        (0..3).map(|_| a.semaphore(format!("{kinds}:sem"), 4).acquire()),
    )
    .await
    .into_iter()
    .collect::<Result<_, _>>()
    .expect("three permits");
    let read = a
        .rw(format!("{kinds}:rw"))
        .read()
        .acquire()
        .await
        .expect("a read hold");
    let listed = admin.list_all(&kinds, 1000).await.expect("list");
    assert!(listed.is_empty(), "{}: {listed:?}", store.name);
    for p in permits {
        p.release().await.expect("release");
    }
    read.release().await.expect("release");
}

/// `force_release_held_by` releases only while the owner it names holds the lock: after the
/// lock changed hands (its holder released it and another took it), a release naming the
/// holder an operator saw leaves the new one its lock and names it; naming the new holder (its
/// token prefix as `inspect` shows it) releases the lock; a free lock is left alone; a holder
/// that is not hex is refused.
pub async fn admin_force_release_held_by_spares_another_holder(store: &Store) {
    let (a, b) = store.pair().await;
    let Ok(admin) = b.admin() else {
        return; // `admin_inspect_list_force_release` checks that the store says so
    };
    let key = unique_key("admin-held-by");
    let ttl = Duration::from_secs(20);
    let shown = async || {
        let state = admin.inspect(key.as_str()).await.expect("inspect");
        state.holder.expect("a holder").token_prefix
    };
    let first = a.lock(&key).ttl(ttl).acquire().await.expect("acquire");
    let seen = shown().await;
    first.release().await.expect("release");
    let second = b.lock(&key).ttl(ttl).acquire().await.expect("acquire");
    let now = shown().await;
    assert_ne!(seen, now, "{}: two owners, one token prefix", store.name);

    let spared = admin
        .force_release_held_by(key.as_str(), &seen)
        .await
        .expect("force release");
    assert!(!spared.was_held, "{}: {spared:?}", store.name);
    assert_eq!(spared.fence, None, "{}", store.name);
    assert_eq!(
        spared.other_holder.as_deref(),
        Some(now.as_str()),
        "{}",
        store.name
    );
    // Asked of the store directly, an empty holder names nobody: nothing is released.
    let nobody = admin
        .store()
        .force_release_held_by(&b.resource(LockKey::new(&key).expect("key")), "")
        .await
        .expect("force release");
    assert!(!nobody.was_held, "{}: {nobody:?}", store.name);
    assert_eq!(
        nobody.other_holder.as_deref(),
        Some(now.as_str()),
        "{}",
        store.name
    );
    assert!(
        second.extend(ttl).await.is_ok(),
        "{}: the new holder lost its lock",
        store.name
    );

    let freed = admin
        .force_release_held_by(key.as_str(), &now.to_ascii_uppercase())
        .await
        .expect("force release");
    assert!(freed.was_held, "{}: {freed:?}", store.name);
    assert_eq!(freed.other_holder, None, "{}", store.name);
    assert!(
        second.extend(ttl).await.is_err(),
        "{}: the holder named still extends",
        store.name
    );
    let free = admin
        .force_release_held_by(key.as_str(), &now)
        .await
        .expect("force release");
    assert!(
        !free.was_held && free.other_holder.is_none(),
        "{}: {free:?}",
        store.name
    );
    for bad in ["", "xyz", &"a".repeat(33)] {
        let err = admin
            .force_release_held_by(key.as_str(), bad)
            .await
            .expect_err("not a token prefix");
        assert!(err.is_misconfigured(), "{}: {bad:?}: {err}", store.name);
    }
}
