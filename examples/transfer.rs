//! # Money transfer under two locks
//!
//! `key = ["account:<from>", "account:<to>"]` locks both accounts all-or-nothing. Transfers
//! run concurrently in both directions (A→B and B→A): the keys are always taken in the same
//! canonical order, so they cannot deadlock, and no transfer sees a half-done other one — the
//! total is the same at the end. Set `DLOCK_URL` to use a real store.
//!
//! ```sh
//! cargo run -p dlock-examples --bin transfer
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dlock_runtime::{distributed_lock, held_locks, LockError, Locker};

/// The "database": balances in cents, read and written in separate steps (as a real
/// read-modify-write over the network would be).
#[derive(Default)]
struct Ledger(Mutex<HashMap<u64, i64>>);

impl Ledger {
    fn get(&self, account: u64) -> i64 {
        self.0.lock().unwrap().get(&account).copied().unwrap_or(0)
    }
    fn set(&self, account: u64, cents: i64) {
        self.0.lock().unwrap().insert(account, cents);
    }
}

#[derive(Debug)]
enum TransferError {
    Lock(LockError),
    Insufficient,
}

impl From<LockError> for TransferError {
    fn from(e: LockError) -> Self {
        TransferError::Lock(e)
    }
}

#[distributed_lock(
    key = ["account:<from>", "account:<to>"],
    on_fail = "retry",
    wait = "10s",
    locker = locker
)]
async fn transfer(
    locker: &Locker,
    ledger: &Ledger,
    from: u64,
    to: u64,
    cents: i64,
) -> Result<(), TransferError> {
    // One fencing token per account, for a store that checks them.
    let _tokens: Vec<u64> = held_locks().iter().map(|l| l.fencing_token()).collect();
    let (a, b) = (ledger.get(from), ledger.get(to));
    if a < cents {
        return Err(TransferError::Insufficient);
    }
    tokio::task::yield_now().await; // the window where an unlocked transfer would interleave
    ledger.set(from, a - cents);
    ledger.set(to, b + cents);
    Ok(())
}

#[tokio::main]
async fn main() {
    let locker = match std::env::var("DLOCK_URL") {
        Ok(url) => Locker::from_url(&url).await.expect("connect"),
        Err(_) => Locker::memory(),
    };
    let ledger = Arc::new(Ledger::default());
    ledger.set(1, 10_000);
    ledger.set(2, 10_000);
    let mut tasks = Vec::new();
    for i in 0..100u64 {
        let (locker, ledger) = (locker.clone(), ledger.clone());
        let (from, to) = if i % 2 == 0 { (1, 2) } else { (2, 1) };
        tasks.push(tokio::spawn(async move {
            transfer(&locker, &ledger, from, to, 25).await
        }));
    }
    for t in tasks {
        t.await.expect("task").expect("transfer");
    }
    let (a, b) = (ledger.get(1), ledger.get(2));
    println!(
        "account 1: {a}, account 2: {b}, total {} (always 20000)",
        a + b
    );
    assert_eq!(a + b, 20_000);
    // The same account on both sides is a typed error, not a self-deadlock.
    match transfer(&locker, &ledger, 1, 1, 5).await {
        Err(TransferError::Lock(e)) => println!("transfer to itself: {e} (HTTP {})", e.status()),
        other => panic!("expected a lock error, got {other:?}"),
    }
}
