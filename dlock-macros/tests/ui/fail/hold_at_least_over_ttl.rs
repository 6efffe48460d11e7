// `hold_at_least` keeps a lock after the body returns, which only its lease can do: longer than
// the `ttl` is an error on the value; zero is an error too.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "job", ttl = "10s", hold_at_least = "30s", on_fail = "skip")]
async fn job() {}

#[distributed_lock(key = "job2", hold_at_least = "0s")]
async fn job2() {}

fn main() {}
