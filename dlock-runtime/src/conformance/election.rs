//! The leader election checks ([`Locker::elect`](crate::Locker::elect)): leadership moves when
//! the leader resigns, when it goes away (its election and locker dropped) and when its lock is
//! lost, with strictly increasing terms and never two leaders at once.

use std::time::Duration;

use futures_util::future::select_all;

use super::{unique_key, Store};
use crate::{Election, LockKey};

/// Far longer than [`LIMIT`]: a handover within it was a release, not an expiry.
const TTL: Duration = Duration::from_secs(20);
/// How long a handover may take (scheduling, a waiter's wake-up, slow CI).
const LIMIT: Duration = Duration::from_secs(10);

/// Waits until one of `candidates` leads; returns its index and term, after checking that no
/// other one leads at that moment.
async fn next_leader(store: &Store, candidates: &[&Election]) -> (usize, u64) {
    let waits = candidates
        .iter()
        .map(|e| Box::pin(e.wait_for_leadership()))
        .collect::<Vec<_>>();
    let (term, at, _) = tokio::time::timeout(LIMIT, select_all(waits))
        .await
        .unwrap_or_else(|_| panic!("{}: nobody leads after {LIMIT:?}", store.name));
    let term = term.unwrap_or_else(|| panic!("{}: a campaign ended", store.name));
    let leading = candidates.iter().filter(|e| e.is_leader()).count();
    assert!(leading <= 1, "{}: {leading} leaders at once", store.name);
    (at, term)
}

/// Three candidates: the first leader resigns, the next one goes away (its election and its
/// locker dropped), the last one leads. Each handover is prompt (a release, not the 20 s
/// expiry), at most one candidate leads at any moment, and every term is greater than the last.
pub async fn election_leadership_moves_on_resign_and_drop(store: &Store) {
    let name = unique_key("elect");
    let mut lockers = Vec::new();
    let mut elections = Vec::new();
    for _ in 0..3 {
        let locker = (store.locker)(crate::Locker::builder()).await;
        elections.push(Some(locker.elect(&name).ttl(TTL).start().expect("start")));
        lockers.push(Some(locker));
    }
    let mut last = 0;
    for round in 0..3 {
        let live: Vec<(usize, &Election)> = elections
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().map(|e| (i, e)))
            .collect();
        let candidates: Vec<&Election> = live.iter().map(|(_, e)| *e).collect();
        let (at, term) = next_leader(store, &candidates).await;
        assert!(term > last, "{}: term {term} after {last}", store.name);
        last = term;
        let leader = live[at].0;
        match round {
            0 => {
                let e = elections[leader].as_ref().unwrap();
                e.resign().await.expect("resign");
                assert!(!e.is_leader());
                elections[leader] = None;
            }
            1 => {
                elections[leader] = None;
                lockers[leader] = None;
            }
            _ => elections[leader]
                .take()
                .unwrap()
                .resign()
                .await
                .expect("resign"),
        }
    }
}

/// A leader whose lock is taken away behind its back is told, and campaigns again: after the
/// next leader resigns, the other candidate leads — whichever of the two won after the loss —
/// with terms increasing throughout.
pub async fn election_recampaigns_after_loss(store: &Store) {
    let (x, y) = store.pair().await;
    let name = unique_key("elect-lost");
    // Renewed every 500 ms: the loss is noticed within a renewal interval.
    let ttl = Duration::from_millis(1500);
    let a = x.elect(&name).ttl(ttl).start().expect("start");
    let t1 = tokio::time::timeout(LIMIT, a.wait_for_leadership())
        .await
        .expect("A leads")
        .expect("campaigning");
    let b = y.elect(&name).ttl(ttl).start().expect("start");
    (store.break_lock)(x.resource(LockKey::new(&name).unwrap()).as_str().to_owned()).await;
    tokio::time::timeout(LIMIT, a.lost())
        .await
        .unwrap_or_else(|_| panic!("{}: the old leader was not told", store.name));
    let both = [&a, &b];
    let (at, t2) = next_leader(store, &both).await;
    assert!(t2 > t1, "{}: {t2} > {t1}", store.name);
    both[at].resign().await.expect("resign");
    let other = both[1 - at];
    let t3 = tokio::time::timeout(LIMIT, other.wait_for_leadership())
        .await
        .unwrap_or_else(|_| panic!("{}: the other candidate never led again", store.name))
        .expect("campaigning");
    assert!(t3 > t2, "{}: {t3} > {t2}", store.name);
    other.resign().await.expect("resign");
}
