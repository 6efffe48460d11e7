// The delay queue defers work under one key: a multi-key lock cannot use `on_fail = "defer"`.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = ["a:<x>", "b:<y>"], on_fail = "defer")]
async fn both(x: u64, y: u64) {}

fn main() {}
