// `on_fail` is one of "reject", "retry", "defer"; anything else is an error on the value that
// lists them (and `on_lost` likewise).

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "a", on_fail = "wait")]
async fn bad_strategy() {}

#[distributed_lock(key = "b", on_lost = "panic")]
async fn bad_on_lost() {}

fn main() {}
