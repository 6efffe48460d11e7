// `permits = N` takes a permit of the semaphore on the key, `mode = "read" | "write"` a hold
// of the read-write lock on the key; both combine with the strategies (defer included) and
// expose the hold's kind through `current_lock()`.

use dlock_runtime::{current_lock, distributed_lock, LockKind};

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

#[distributed_lock(key = "catalog:<shop>", mode = "write", on_fail = "defer")]
async fn write_catalog(shop: u32) {
    assert_eq!(current_lock().unwrap().kind(), LockKind::Write);
    let _ = shop;
}

fn main() {
    let _ = (export(1), read_catalog(2), write_catalog(3));
}
