// `wait` is the deadline of `on_fail = "retry"`; with "reject" (given or by default) it would be
// ignored, so it is an error on `wait`. `delay` and `max_attempts` belong to "defer" likewise.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "a", wait = "5s")]
async fn default_reject() {}

#[distributed_lock(key = "b", on_fail = "reject", wait = "5s")]
async fn explicit_reject() {}

#[distributed_lock(key = "c", on_fail = "retry", delay = "1s", max_attempts = 3)]
async fn defer_arguments() {}

fn main() {}
