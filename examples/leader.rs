//! # Leader election: background work that runs only on the leader
//!
//! Two "instances" (two lockers over one store, as two processes over one Redis would be)
//! campaign for the same name with `locker.elect(..)`. Each runs a worker that does its
//! periodic job only while its instance leads, and stops the moment leadership is lost. Every
//! write carries the leader's term (the election lock's fencing token), and the store it writes
//! to refuses terms older than the newest it has seen — the fencing that protects you from a
//! leader that was paused and has not noticed yet.
//!
//! The leader resigns a few times (a rolling deploy); each time the other instance takes over
//! and the resigned one rejoins as a candidate. The program exits non-zero if both instances
//! ever lead at the same moment, if nobody leads within 5 s after a resignation, or if a term
//! does not increase. Set `DLOCK_URL` (e.g. `redis://127.0.0.1:6379`) to use a real store.
//!
//! ```sh
//! cargo run -p dlock-examples --bin leader
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock_runtime::{Election, Locker};

const NAME: &str = "leader:report-scheduler";
/// How long after a leader dies (or is cut off) another can lead. Resigning hands over at once.
const TTL: Duration = Duration::from_secs(2);
const INSTANCES: [&str; 2] = ["instance-a", "instance-b"];

/// The resource the leader writes: it accepts a write only from the newest term it has seen.
#[derive(Default)]
struct FencedStore {
    newest_term: Mutex<u64>,
    writes: AtomicU64,
}

impl FencedStore {
    fn write(&self, term: u64) -> bool {
        let mut newest = self.newest_term.lock().unwrap();
        if term < *newest {
            return false;
        }
        *newest = term;
        self.writes.fetch_add(1, Ordering::Relaxed);
        true
    }
}

/// The leader-only background job: waits for leadership, works until it is lost, repeats;
/// returns when the election is over (resigned).
async fn leader_work(instance: &'static str, election: Arc<Election>, store: Arc<FencedStore>) {
    while let Some(term) = election.wait_for_leadership().await {
        println!("{instance}: leading (term {term})");
        let work = async {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                if !store.write(term) {
                    println!("{instance}: the store refused term {term}: a newer leader exists");
                    return;
                }
            }
        };
        tokio::select! {
            _ = election.ended(term) => println!("{instance}: term {term} is over"),
            _ = work => {}
        }
    }
}

/// Starts campaigning for `instance`, with its worker.
fn campaign(instance: &'static str, locker: &Locker, store: &Arc<FencedStore>) -> Arc<Election> {
    let election = Arc::new(
        locker
            .elect(NAME)
            .ttl(TTL)
            .start()
            .expect("start campaigning"),
    );
    tokio::spawn(leader_work(instance, election.clone(), store.clone()));
    election
}

/// Which instance leads, and its term, once one does within `limit`.
async fn wait_for_a_leader(
    elections: &Mutex<Vec<Arc<Election>>>,
    limit: Duration,
) -> Option<(usize, u64)> {
    let start = Instant::now();
    while start.elapsed() < limit {
        let leading = elections
            .lock()
            .unwrap()
            .iter()
            .enumerate()
            .find_map(|(i, e)| e.term().map(|t| (i, t)));
        if leading.is_some() {
            return leading;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    None
}

async fn locker_pair() -> [Locker; 2] {
    match std::env::var("DLOCK_URL") {
        Ok(url) => [
            Locker::from_url(&url).await.expect("connect"),
            Locker::from_url(&url).await.expect("connect"),
        ],
        Err(_) => {
            let store = dlock_runtime::backend::MemoryBackend::new();
            [Locker::new(store.clone()), Locker::new(store)]
        }
    }
}

fn fail(why: String) -> ! {
    eprintln!("FAILED: {why}");
    std::process::exit(1);
}

#[tokio::main]
async fn main() {
    let lockers = locker_pair().await;
    let store = Arc::new(FencedStore::default());
    let elections = Arc::new(Mutex::new(
        (0..2)
            .map(|i| campaign(INSTANCES[i], &lockers[i], &store))
            .collect::<Vec<_>>(),
    ));

    // Never two leaders at once: `is_leader()` is exact by each instance's lease clock.
    let watched = elections.clone();
    tokio::spawn(async move {
        loop {
            let leading = watched
                .lock()
                .unwrap()
                .iter()
                .filter(|e| e.is_leader())
                .count();
            if leading > 1 {
                fail(format!("{leading} instances lead at once"));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });

    let mut last_term = 0;
    for round in 1..=4 {
        let Some((leader, term)) = wait_for_a_leader(&elections, Duration::from_secs(5)).await
        else {
            fail(format!(
                "round {round}: nobody leads 5 s after the last resignation"
            ));
        };
        if term <= last_term {
            fail(format!("term {term} after term {last_term}"));
        }
        last_term = term;
        tokio::time::sleep(Duration::from_millis(450)).await; // let the leader work a little
        let resigning = elections.lock().unwrap()[leader].clone();
        resigning.resign().await.expect("resign");
        println!(
            "{}: resigned term {term}; rejoining as a candidate",
            INSTANCES[leader]
        );
        elections.lock().unwrap()[leader] = campaign(INSTANCES[leader], &lockers[leader], &store);
    }

    let Some((_, term)) = wait_for_a_leader(&elections, Duration::from_secs(5)).await else {
        fail("nobody leads after the last resignation".to_owned());
    };
    if term <= last_term {
        fail(format!("term {term} after term {last_term}"));
    }
    let all = elections.lock().unwrap().clone();
    for election in all {
        election.resign().await.expect("resign");
    }
    println!(
        "ok: one leader at a time through 4 handovers, terms increasing, {} fenced writes",
        store.writes.load(Ordering::Relaxed)
    );
}
