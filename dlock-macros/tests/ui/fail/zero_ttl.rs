// A zero ttl would make the lock expire at once: an error on the value.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "a", ttl = "0s")]
async fn zero() {}

fn main() {}
