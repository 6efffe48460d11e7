// Parameters under `#[cfg]`: the attribute sees them before `cfg` removes any, so what it
// generates for each parameter (the `Send + 'static` checks of `on_fail = "defer"`) carries the
// same `cfg`. One parameter configured out, one in.

use dlock_runtime::{distributed_lock, Locker};

#[distributed_lock(key = "job:<id>", on_fail = "defer", locker = locker)]
async fn job(
    locker: Locker,
    #[cfg(any())] tenant: u64,
    #[cfg(all())] region: u8,
    id: u64,
) -> u64 {
    id + u64::from(region)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    assert_eq!(job(Locker::memory(), 2, 40).await.unwrap(), 42);
}
