// Parameters under `#[cfg]`: the attribute sees them before `cfg` removes any, so what it
// generates for each parameter (the `Send + 'static` checks of `on_fail = "defer"`) carries the
// same `cfg`. One parameter configured out, one in. `#[cfg_attr]` removes no parameter: it
// goes with `fallback`, which is called with every parameter.

use dlock_runtime::{distributed_lock, LockError, Locker};

#[distributed_lock(key = "job:<id>", on_fail = "defer", locker = locker)]
async fn job(
    locker: Locker,
    #[cfg(any())] tenant: u64,
    #[cfg(all())] region: u8,
    id: u64,
) -> u64 {
    id + u64::from(region)
}

async fn busy(locker: Locker, id: u64, err: LockError) -> u64 {
    let _ = (locker, err);
    id + 1000
}

#[distributed_lock(key = "order:<id>", fallback = busy, locker = locker)]
async fn order(locker: Locker, #[cfg_attr(any(), allow(unused))] id: u64) -> u64 {
    id
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(job(Locker::memory(), 2, 40).await.unwrap(), 42);
    let locker = Locker::memory();
    assert_eq!(order(locker.clone(), 7).await.unwrap(), 7);
    let _held = locker.lock("order:7").acquire().await.unwrap();
    assert_eq!(order(locker.clone(), 7).await.unwrap(), 1007);
}
