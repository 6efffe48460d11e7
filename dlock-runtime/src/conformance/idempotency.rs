//! The idempotency storage checks ([`IdempotencyStore`](crate::idempotency::IdempotencyStore)),
//! through the public [`Locker::idempotency`] API.

use std::time::Duration;

use super::{unique_key, Store};
use crate::idempotency::{Begin, Fingerprint, IdempotentOperation};
use crate::Locker;

fn fingerprint(what: &str) -> Fingerprint {
    Fingerprint::builder().field(what).finish()
}

/// `begin` on a locker whose backend may not store records: `None` (after checking that it
/// says so with a typed error) when the store is declared without idempotency.
async fn supported(store: &Store, locker: &Locker) -> bool {
    if store.idempotency {
        assert!(
            locker.supports_idempotency(),
            "[{}] the store says it keeps idempotency records, the backend says no",
            store.name
        );
        return true;
    }
    let err = locker
        .idempotency("conf:unsupported", fingerprint("x"))
        .begin()
        .await
        .expect_err("a backend without idempotency storage must refuse begin");
    assert!(err.is_unavailable(), "[{}] {err}", store.name);
    false
}

async fn run(store: &Store, locker: &Locker, key: &str, fp: &str) -> IdempotentOperation {
    match locker
        .idempotency(key, fingerprint(fp))
        .ttl(Duration::from_secs(10))
        .begin()
        .await
        .expect("begin")
    {
        Begin::Run(op) => op,
        other => panic!("[{}] expected Run for `{key}`, got {other:?}", store.name),
    }
}

/// An attempt of fingerprint `f` whose lease of `ttl` the watchdog does not renew: it runs.
async fn run_unrenewed(
    store: &Store,
    locker: &Locker,
    key: &str,
    ttl: Duration,
) -> IdempotentOperation {
    match locker
        .idempotency(key, fingerprint("f"))
        .ttl(ttl)
        .auto_renew(false)
        .begin()
        .await
        .expect("begin")
    {
        Begin::Run(op) => op,
        other => panic!("[{}] expected Run, got {other:?}", store.name),
    }
}

/// An attempt of fingerprint `f` that runs once the key's earlier attempt is gone (within 5 s,
/// else `blocked`): "in progress" until then, and nothing else (no replay).
async fn run_once_free(
    store: &Store,
    locker: &Locker,
    key: &str,
    blocked: &str,
) -> IdempotentOperation {
    let start = std::time::Instant::now();
    loop {
        match locker
            .idempotency(key, fingerprint("f"))
            .ttl(Duration::from_secs(10))
            .begin()
            .await
            .expect("begin")
        {
            Begin::Run(op) => return op,
            Begin::InProgress { .. } => {
                assert!(
                    start.elapsed() < Duration::from_secs(5),
                    "[{}] {blocked}",
                    store.name
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("[{}] expected Run or InProgress, got {other:?}", store.name),
        }
    }
}

/// The first attempt runs; after `complete`, an attempt with the same fingerprint — from another
/// instance — replays the stored bytes exactly, one with another fingerprint is a mismatch, and
/// fencing tokens increase from one run to the next key's run.
pub async fn idempotency_runs_once_then_replays(store: &Store) {
    let (a, b) = store.pair().await;
    if !supported(store, &a).await {
        return;
    }
    let key = unique_key("idem-replay");
    let op = run(store, &a, &key, "POST /pay {1}").await;
    let first_token = op.fencing_token();
    assert_eq!(op.key(), key);
    let record: Vec<u8> = (0..=255u8).chain([0, 0, 255]).collect();
    op.complete(&record).await.expect("complete");
    for _ in 0..2 {
        match b
            .idempotency(key.as_str(), fingerprint("POST /pay {1}"))
            .begin()
            .await
            .expect("begin")
        {
            Begin::Replay(bytes) => assert_eq!(bytes, record, "[{}] replayed bytes", store.name),
            other => panic!("[{}] expected Replay, got {other:?}", store.name),
        }
    }
    match b
        .idempotency(key.as_str(), fingerprint("POST /pay {2}"))
        .begin()
        .await
        .expect("begin")
    {
        Begin::Mismatch => {}
        other => panic!("[{}] expected Mismatch, got {other:?}", store.name),
    }
    // A lock taken on the same store later carries a larger fencing token.
    let next = run(store, &b, &unique_key("idem-replay"), "x").await;
    assert!(
        next.fencing_token() != first_token,
        "[{}] fencing token reused",
        store.name
    );
    next.abort().await.expect("abort");
}

/// While the first attempt runs, another instance's attempt is told it is in progress (with
/// whether its fingerprint matches and a `Retry-After` within the lease); after `abort` the next
/// attempt runs again (no record); a record expires after its retention.
pub async fn idempotency_in_progress_abort_and_expiry(store: &Store) {
    let (a, b) = store.pair().await;
    if !supported(store, &a).await {
        return;
    }
    let key = unique_key("idem-progress");
    let op = run(store, &a, &key, "same").await;
    for (fp, same) in [("same", true), ("other", false)] {
        match b
            .idempotency(key.as_str(), fingerprint(fp))
            .begin()
            .await
            .expect("begin")
        {
            Begin::InProgress {
                retry_after,
                same_fingerprint,
            } => {
                assert_eq!(same_fingerprint, same, "[{}] {fp}", store.name);
                if let Some(r) = retry_after {
                    assert!(r <= Duration::from_secs(10), "[{}] {r:?}", store.name);
                }
            }
            Begin::Mismatch if !same => {}
            other => panic!("[{}] expected InProgress, got {other:?}", store.name),
        }
    }
    op.abort().await.expect("abort");
    // Aborted: no record, the next attempt runs (here with a short retention).
    let retention = Duration::from_millis(300);
    let short = match b
        .idempotency(key.as_str(), fingerprint("same"))
        .retention(retention)
        .begin()
        .await
        .expect("begin")
    {
        Begin::Run(op) => op,
        other => panic!("[{}] expected Run, got {other:?}", store.name),
    };
    short.complete(b"done").await.expect("complete");
    assert!(matches!(
        a.idempotency(key.as_str(), fingerprint("same"))
            .begin()
            .await
            .expect("begin"),
        Begin::Replay(_)
    ));
    // Time passing is the behaviour under test: poll until the record is gone.
    let start = std::time::Instant::now();
    loop {
        match a
            .idempotency(key.as_str(), fingerprint("same"))
            .begin()
            .await
            .expect("begin")
        {
            Begin::Run(op) => {
                assert!(
                    start.elapsed() >= retention - Duration::from_millis(50),
                    "[{}] record gone after {:?}, retention {retention:?}",
                    store.name,
                    start.elapsed()
                );
                op.abort().await.expect("abort");
                break;
            }
            Begin::Replay(_) => {
                assert!(
                    start.elapsed() < retention + Duration::from_secs(5),
                    "[{}] record outlived its retention",
                    store.name
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("[{}] expected Run or Replay, got {other:?}", store.name),
        }
    }
}

/// An attempt whose lock expired (its holder vanished) cannot store a record over the next
/// holder's run: `complete` answers `Lost`, nothing is stored, and the new holder's record is
/// the one replayed.
pub async fn idempotency_complete_is_owner_checked(store: &Store) {
    let (a, b) = store.pair().await;
    if !supported(store, &a).await {
        return;
    }
    let key = unique_key("idem-owner");
    let stale = run_unrenewed(store, &a, &key, Duration::from_millis(200)).await;
    // The lease runs out; another instance's attempt runs.
    let fresh = run_once_free(store, &b, &key, "an expired attempt still blocks the key").await;
    assert!(
        fresh.fencing_token() > stale.fencing_token(),
        "[{}] fencing token went backwards",
        store.name
    );
    let err = stale
        .complete(b"stale")
        .await
        .expect_err("the stale attempt must not store its record");
    assert!(err.is_lost(), "[{}] {err}", store.name);
    fresh.complete(b"fresh").await.expect("complete");
    match a
        .idempotency(key.as_str(), fingerprint("f"))
        .begin()
        .await
        .expect("begin")
    {
        Begin::Replay(bytes) => assert_eq!(bytes, b"fresh", "[{}]", store.name),
        other => panic!("[{}] expected Replay, got {other:?}", store.name),
    }
}

/// A `begin` sent again by the attempt whose lock it took (its first answer was lost: a
/// connection reset, a cluster client sending it once more) is granted again, its lease
/// restarted; another attempt still finds the key in progress. Before, on Redis, the second
/// run answered "in progress" to the key's only request, and the lock it had taken was held by
/// no attempt until its TTL ended.
pub async fn idempotency_a_begin_sent_again_is_granted_again(store: &Store) {
    use crate::backend::idempotency::{BeginArgs, BeginReply};
    use crate::backend::OwnerToken;

    let (a, b) = store.pair().await;
    if !supported(store, &a).await {
        return;
    }
    let key = unique_key("idem-again");
    let resource = a.resource(crate::LockKey::new(&key).unwrap());
    let token = OwnerToken::generate();
    let fp = fingerprint("f");
    let idem = a.backend().idempotency().expect("an idempotency store");
    let args = || BeginArgs {
        resource: &resource,
        token: &token,
        ttl: Duration::from_secs(10),
        fingerprint: &fp,
        retention: Duration::from_secs(60),
        sent: None,
    };
    let first = idem.begin(args()).await.expect("begin");
    assert!(
        matches!(first, BeginReply::Acquired { .. }),
        "[{}] the first begin: {first:?}",
        store.name
    );
    let again = idem.begin(args()).await.expect("begin again");
    assert!(
        matches!(again, BeginReply::Acquired { .. }),
        "[{}] the same attempt's begin, sent again: {again:?}",
        store.name
    );
    match b
        .idempotency(key.as_str(), fingerprint("f"))
        .begin()
        .await
        .expect("begin")
    {
        Begin::InProgress { .. } => {}
        other => panic!(
            "[{}] another attempt: expected InProgress, got {other:?}",
            store.name
        ),
    }
    assert!(
        idem.abort(&resource, &token).await.expect("abort"),
        "[{}] the attempt's lock is its own",
        store.name
    );
}

/// An attempt whose local lease ran out before `complete` stores nothing, whatever the backend
/// still finds (an etcd lease, whole seconds, outlives a 1.5 s local one): `complete` answers
/// `Lost`, and `Lost` means the next attempt runs the operation again — never a replay of a
/// record its caller was told was not stored.
pub async fn idempotency_complete_after_the_local_lease_ran_out_stores_nothing(store: &Store) {
    let (a, b) = store.pair().await;
    if !supported(store, &a).await {
        return;
    }
    let key = unique_key("idem-lapsed");
    let op = run_unrenewed(store, &a, &key, Duration::from_millis(1500)).await;
    tokio::time::timeout(Duration::from_secs(5), op.lost())
        .await
        .unwrap_or_else(|_| panic!("[{}] lost() pending past the lease", store.name));
    let err = op
        .complete(b"late")
        .await
        .expect_err("a completion after the local lease ran out must not be stored");
    assert!(err.is_lost(), "[{}] {err}", store.name);
    // `Replay` here: stored after all.
    let again = run_once_free(store, &b, &key, "the lapsed attempt still blocks the key").await;
    again.abort().await.expect("abort");
}

/// A `begin` on a key whose lock is free but held up by a waiter that died first in line (its
/// holder gone without a release) runs (only a store without a line: Redlock's waiters barge) or
/// answers "in progress" with a `retry_after` by when that waiter's entry ends — never
/// without one, which a `409` would have passed on with no `Retry-After`.
pub async fn idempotency_behind_a_dead_waiter_is_told_when_the_line_may_move(store: &Store) {
    let probe = (store.locker)(Locker::builder()).await;
    if !supported(store, &probe).await {
        return;
    }
    let lock = crate::LockKind::Exclusive;
    let line = super::a_dead_waiter_first(store, lock, lock).await;
    let begun = line
        .locker
        .idempotency(line.key.as_str(), fingerprint("POST /line"))
        .ttl(Duration::from_secs(10))
        .begin()
        .await
        .expect("begin");
    match begun {
        // Only where waiters barge: a FIFO store that runs it let it jump the line.
        Begin::Run(op) if !store.fifo => op.abort().await.expect("abort"),
        Begin::InProgress {
            retry_after: Some(left),
            ..
        } => assert!(
            left <= line.bound,
            "[{}] told {left:?}; the dead waiter's entry ends within {:?}",
            store.name,
            line.bound
        ),
        other => panic!(
            "[{}] a begin behind a dead waiter, nothing held, was told {other:?}",
            store.name
        ),
    }
    line.clear().await;
}
