//! # A scheduled job on every instance, run by one of them per tick (ShedLock's use case)
//!
//! Two "instances" (two lockers over one store, as two processes over one Redis would be) each
//! run the same job on their own tokio interval. `on_fail = "skip"` makes the instance that
//! finds the lock taken return at once, and `hold_at_least` keeps the lock for most of the
//! period after the job returns, so an instance whose clock lags a little does not run the
//! same tick again. Set `DLOCK_URL` (e.g. `redis://127.0.0.1:6379`) to share a real store.
//!
//! ```sh
//! cargo run -p dlock-examples --bin scheduled
//! ```

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::{distributed_lock, Locker};

/// How often each instance fires the job.
const PERIOD: Duration = Duration::from_millis(500);

#[distributed_lock(
    key = "job:cleanup",
    ttl = "5s",
    on_fail = "skip",           // another instance runs this tick: return `Ok(())` at once
    hold_at_least = "400ms",    // keep the lock most of the period, even after a quick job
    locker = locker
)]
async fn cleanup(locker: &Locker, instance: &str, runs: &AtomicU32) {
    let token = dlock_runtime::current_lock().map(|l| l.fencing_token());
    runs.fetch_add(1, Ordering::SeqCst);
    println!("{instance}: cleaning up (fencing token {token:?})");
}

async fn instance(name: &'static str, locker: Locker, runs: Arc<AtomicU32>, ticks: u32) {
    let mut interval = tokio::time::interval(PERIOD);
    for _ in 0..ticks {
        interval.tick().await;
        if let Err(e) = cleanup(&locker, name, &runs).await {
            eprintln!("{name}: lock error: {e}");
        }
    }
}

async fn locker_pair() -> (Locker, Locker) {
    match std::env::var("DLOCK_URL") {
        Ok(url) => (
            Locker::from_url(&url).await.expect("connect"),
            Locker::from_url(&url).await.expect("connect"),
        ),
        Err(_) => {
            let store = dlock_runtime::backend::MemoryBackend::new();
            (Locker::new(store.clone()), Locker::new(store))
        }
    }
}

#[tokio::main]
async fn main() {
    let (a, b) = locker_pair().await;
    let runs = Arc::new(AtomicU32::new(0));
    let ticks = 6;
    tokio::join!(
        instance("instance-a", a, runs.clone(), ticks),
        instance("instance-b", b, runs.clone(), ticks),
    );
    let runs = runs.load(Ordering::SeqCst);
    println!("{runs} runs for {ticks} ticks of two instances (one per tick)");
}
