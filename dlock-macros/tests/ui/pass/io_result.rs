// `-> std::io::Result<T>` is kept as written: a lock failure becomes an `io::Error` (through
// `From<LockError>`), which keeps the `LockError` inside under a fitting kind.

use dlock_runtime::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "file:<name>", locker = locker)]
async fn write_file(locker: &Locker, name: &str) -> std::io::Result<usize> {
    Ok(name.len())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let locker = Locker::memory();
    assert_eq!(write_file(&locker, "a.txt").await.unwrap(), 5);
    let held = locker.lock("file:a.txt").acquire().await.unwrap();
    let err = write_file(&locker, "a.txt").await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::WouldBlock);
    let inner = err.into_inner().unwrap().downcast::<LockError>().unwrap();
    assert!(inner.is_contended());
    held.release().await.unwrap();
}
