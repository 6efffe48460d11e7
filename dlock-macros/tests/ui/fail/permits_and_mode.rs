// Misuse of `permits` (a semaphore) and `mode` (a read-write lock): zero permits, a permit
// count that is not an integer, both arguments at once, and an unknown mode are each one
// error on the offending token.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "a", permits = 0)]
async fn zero_permits() {}

#[distributed_lock(key = "b", permits = "3")]
async fn permits_not_a_number() {}

#[distributed_lock(key = "c", permits = 3, mode = "read")]
async fn permits_with_mode() {}

#[distributed_lock(key = "d", mode = "bogus")]
async fn unknown_mode() {}

fn main() {}
