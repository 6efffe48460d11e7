// `on_fail = "defer"` compiles for arguments that are `'static + Send`, for both a
// non-Result return (wrapped in Result<_, LockError>) and a Result with `E: From<LockError>`,
// and a busy lock really defers: the caller gets `Deferred` and the queue runs the body later.
use dlock_runtime::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "job:<id>", on_fail = "defer", delay = "10ms", max_attempts = 3, locker = locker)]
async fn job(locker: Locker, id: u64, tx: tokio::sync::mpsc::UnboundedSender<u64>) {
    tx.send(id).unwrap();
}

#[derive(Debug)]
struct MyError;

impl From<LockError> for MyError {
    fn from(_: LockError) -> Self {
        MyError
    }
}

#[distributed_lock(key = "job2:<name>", on_fail = "defer", locker = locker)]
async fn job2(locker: Locker, name: String) -> Result<String, MyError> {
    Ok(name)
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let locker = Locker::memory();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        // Free lock: runs now.
        job(locker.clone(), 1, tx.clone()).await.unwrap();
        assert_eq!(rx.recv().await, Some(1));
        // Busy lock: deferred, runs once the holder lets go.
        let held = locker.lock("job:2").acquire().await.unwrap();
        let err = job(locker.clone(), 2, tx.clone()).await.unwrap_err();
        assert!(err.is_deferred());
        drop(held);
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(job2(locker.clone(), "x".into()).await.unwrap(), "x");
    });
}
