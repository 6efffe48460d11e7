//! # A background job consumer that defers instead of blocking
//!
//! Events for the same account must not be processed at the same time, but a consumer should
//! not sit waiting for a busy account either: with `on_fail = "defer"` the event is put aside
//! and processed when the account's lock frees.
//!
//! * Without `DLOCK_REDIS_URL`: the in-process queue. `#[distributed_lock(on_fail = "defer")]`
//!   on the handler; busy accounts' events are deferred to the locker's in-process delay queue;
//!   at the end the queue is shut down gracefully and reports anything it had to drop. (That
//!   queue lives in memory: a crash loses what is in it.)
//! * With `DLOCK_REDIS_URL`: the durable queue. Events are typed jobs (`Job`, serde) submitted
//!   to a `DurableQueue` in Redis and run by a `DurableWorker` (run one on every instance); a
//!   worker that dies mid-job has its jobs run by another after the visibility timeout.
//!
//! ```sh
//! cargo run -p dlock-examples --bin jobs                                         # in-process
//! DLOCK_REDIS_URL=redis://127.0.0.1:6379 cargo run -p dlock-examples --bin jobs  # durable
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_runtime::durable::{DurableQueue, DurableWorker, Job, JobContext, JobError, Submitted};
use dlock_runtime::DeferPolicy;
use dlock_runtime::{distributed_lock, LockError, LockKey, Locker};
use serde::{Deserialize, Serialize};

static PROCESSED: AtomicU64 = AtomicU64::new(0);

/// In-process flavour: the attribute defers the call itself when the account is busy.
#[distributed_lock(
    key = "account:<account>",
    ttl = "10s",
    on_fail = "defer",
    delay = "50ms",
    max_attempts = 20,
    locker = locker
)]
async fn apply_event(locker: Locker, account: u32, event: u32) {
    // Simulated work on the account (a ledger write fenced with the token).
    let token = dlock_runtime::current_lock()
        .map(|l| l.fencing_token())
        .unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(30)).await;
    PROCESSED.fetch_add(1, Ordering::SeqCst);
    println!("  account {account}: event {event} applied (fencing token {token})");
}

/// Durable flavour: the same work as a typed job.
#[derive(Serialize, Deserialize)]
struct ApplyEvent {
    account: u32,
    event: u32,
}

impl Job for ApplyEvent {
    const NAME: &'static str = "apply-event";

    fn lock_key(&self) -> Result<LockKey, LockError> {
        LockKey::builder()
            .lit("account:")
            .value(&self.account)
            .finish()
    }

    async fn run(self, ctx: JobContext) -> Result<(), JobError> {
        tokio::time::sleep(Duration::from_millis(30)).await;
        PROCESSED.fetch_add(1, Ordering::SeqCst);
        println!(
            "  account {}: event {} applied (attempt {}, fencing token {})",
            self.account,
            self.event,
            ctx.attempt(),
            ctx.fencing_token()
        );
        Ok(())
    }
}

const EVENTS: u32 = 12;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    match std::env::var("DLOCK_REDIS_URL") {
        Ok(url) => durable(&url).await,
        Err(_) => in_process().await,
    }
}

async fn in_process() -> Result<(), Box<dyn std::error::Error>> {
    let locker = Locker::memory();
    println!("in-process queue: {EVENTS} events for 3 accounts arrive at once");
    let outcomes =
        futures_util::future::join_all((0..EVENTS).map(|e| apply_event(locker.clone(), e % 3, e)))
            .await;
    let deferred = outcomes
        .iter()
        .filter(|o| matches!(o, Err(e) if e.is_deferred()))
        .count();
    println!(
        "processed at once: {}, deferred: {deferred}",
        EVENTS as usize - deferred
    );
    // Graceful shutdown: drain what is left (it runs as the accounts free up).
    let report = locker.defer_queue().shutdown(Duration::from_secs(10)).await;
    println!(
        "shutdown: drained {} deferred events, dropped {:?}",
        report.completed, report.dropped
    );
    let total = PROCESSED.load(Ordering::SeqCst);
    println!("total applied: {total} of {EVENTS}");
    if total != u64::from(EVENTS) || deferred == 0 || !report.dropped.is_empty() {
        return Err(
            "expected busy accounts' events deferred, then all applied, none dropped".into(),
        );
    }
    Ok(())
}

async fn durable(url: &str) -> Result<(), Box<dyn std::error::Error>> {
    let locker = Locker::builder().prefix("dlock-demo").connect(url).await?;
    let queue = DurableQueue::connect(url, "dlock-demo-events").await?;
    let policy = DeferPolicy::new(Duration::from_millis(50), 20);
    let worker = DurableWorker::new(queue.clone(), locker.clone())
        .register::<ApplyEvent>()
        .poll_interval(Duration::from_millis(20));
    let stop = Arc::new(tokio::sync::Notify::new());
    let running = {
        let (worker, stop) = (worker.clone(), stop.clone());
        tokio::spawn(async move { worker.run_until(stop.notified()).await })
    };
    println!("durable queue in Redis: {EVENTS} events for 3 accounts arrive at once");
    let outcomes = futures_util::future::join_all((0..EVENTS).map(|e| {
        let (queue, locker, policy) = (queue.clone(), locker.clone(), policy.clone());
        async move {
            queue
                .submit(
                    &locker,
                    ApplyEvent {
                        account: e % 3,
                        event: e,
                    },
                    &policy,
                    Duration::from_secs(10),
                )
                .await
        }
    }))
    .await;
    let mut deferred = Vec::new();
    for o in outcomes {
        if let Submitted::Deferred(id) = o? {
            deferred.push(id);
        }
    }
    println!(
        "processed at once: {}, deferred: {}",
        EVENTS as usize - deferred.len(),
        deferred.len()
    );
    let start = std::time::Instant::now();
    while !queue.is_empty().await? {
        if start.elapsed() > Duration::from_secs(20) {
            return Err("the worker did not drain the queue".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for id in deferred.iter().take(3) {
        println!("  job {id}: {:?}", queue.status(id).await?);
    }
    stop.notify_one();
    running.await?;
    println!("dead letters: {}", queue.dead_letters().await?.len());
    let total = PROCESSED.load(Ordering::SeqCst);
    println!("total applied: {total} of {EVENTS}");
    if total != u64::from(EVENTS) {
        return Err("some events were not applied".into());
    }
    Ok(())
}
