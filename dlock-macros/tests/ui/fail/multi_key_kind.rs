// A semaphore permit or a read-write hold is on one key: a multi-key list with `permits` or
// `mode` is refused (multi-key locks are exclusive locks).

use dlock_runtime::distributed_lock;

#[distributed_lock(key = ["a:<x>", "b:<y>"], permits = 2)]
async fn both(x: u64, y: u64) {}

#[distributed_lock(key = ["a:<x>", "b:<y>"], mode = "read")]
async fn read_both(x: u64, y: u64) {}

fn main() {}
