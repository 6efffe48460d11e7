// `-> !`: a worker that never returns while it holds its lock. The lock may be refused, so the
// rewritten function returns `Result<Infallible, LockError>`.

use std::convert::Infallible;

use dlock_runtime::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "worker:<id>", on_fail = "reject", locker = locker)]
async fn worker(locker: Locker, id: u32, tx: tokio::sync::mpsc::UnboundedSender<u32>) -> ! {
    tx.send(id).unwrap();
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
    }
}

// The same written through a `macro_rules!` that takes the return type as a `ty` fragment:
// the `!` arrives wrapped in an invisible group and is still the never type.
macro_rules! forever {
    ($name:ident -> $ret:ty $body:block) => {
        #[distributed_lock(key = "forever", on_fail = "reject", locker = locker)]
        async fn $name(locker: Locker) -> $ret $body
    };
}

forever!(forwarded -> ! {
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
    }
});

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let locker = Locker::memory();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let held = locker.lock("worker:2").acquire().await.unwrap();
    let refused: Result<Infallible, LockError> = worker(locker.clone(), 2, tx.clone()).await;
    assert!(refused.unwrap_err().is_contended());
    held.release().await.unwrap();
    let running = tokio::spawn(worker(locker.clone(), 1, tx));
    assert_eq!(rx.recv().await, Some(1));
    assert!(locker.lock("worker:1").try_acquire().await.unwrap().is_none());
    running.abort();
    let held = locker.lock("forever").acquire().await.unwrap();
    let refused: Result<Infallible, LockError> = forwarded(locker.clone()).await;
    assert!(refused.unwrap_err().is_contended());
    held.release().await.unwrap();
}
