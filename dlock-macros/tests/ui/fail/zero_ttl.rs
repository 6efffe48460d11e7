// A zero ttl would make the lock expire at once: an error on the value.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "a", ttl = "0s")]
async fn zero() {}

// With a minimum hold longer than the default ttl: the ttl's error alone, not one more about
// the hold against a ttl the user did not write.
#[distributed_lock(key = "b", ttl = "0s", hold_at_least = "45s", on_fail = "skip")]
async fn zero_with_hold() {}

fn main() {}
