// `through_outages` belongs to `on_fail = "retry"` (it keeps the wait going while the backend is
// down) and takes `true` or `false`.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "a", on_fail = "skip", through_outages = true)]
async fn not_retry() {}

#[distributed_lock(key = "b", on_fail = "retry", through_outages = "yes")]
async fn not_a_bool() {}

fn main() {}
