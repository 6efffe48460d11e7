// `permits = N` takes a permit of the semaphore on the key, `mode = "read" | "write"` a hold
// of the read-write lock on the key; both combine with the strategies (defer included) and
// expose the hold's kind through `current_lock()` — in a deferred run too.

use dlock_runtime::{current_lock, distributed_lock, LockKind, Locker};

#[distributed_lock(key = "exports", permits = 3, on_fail = "retry", wait = "2s")]
async fn export(id: u64) -> u64 {
    assert_eq!(
        current_lock().unwrap().kind(),
        LockKind::Semaphore { permits: 3 }
    );
    id
}

#[distributed_lock(key = "catalog:<shop>", mode = "read")]
async fn read_catalog(shop: u32) -> u32 {
    assert_eq!(current_lock().unwrap().kind(), LockKind::Read);
    shop
}

#[distributed_lock(key = "catalog:<shop>", mode = "write", on_fail = "defer", delay = "10ms")]
async fn write_catalog(shop: u32, tx: tokio::sync::mpsc::UnboundedSender<(u32, LockKind)>) {
    tx.send((shop, current_lock().unwrap().kind())).unwrap();
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let locker = Locker::memory();
        let _previous = dlock_runtime::set_default_locker(locker.clone());
        assert_eq!(export(1).await.unwrap(), 1);
        assert_eq!(read_catalog(2).await.unwrap(), 2);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        write_catalog(3, tx.clone()).await.unwrap();
        assert_eq!(rx.recv().await, Some((3, LockKind::Write)));
        // A reader holds the catalog: the write is deferred, and runs as a write once it is
        // free.
        let reading = locker.rw("catalog:4").read().acquire().await.unwrap();
        let err = write_catalog(4, tx.clone()).await.unwrap_err();
        assert!(err.is_deferred(), "{err}");
        reading.release().await.unwrap();
        assert_eq!(rx.recv().await, Some((4, LockKind::Write)));
    });
}
