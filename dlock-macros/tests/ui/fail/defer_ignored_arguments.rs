// A deferred body is not cancelled when its lock is lost (it runs to its end, from the queue
// too), and `message` is the detail of a `409` that `defer` and `skip` never answer: both would
// be silently ignored, so they are errors on the argument.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "a:<id>", on_fail = "defer", on_lost = "cancel")]
async fn cancel_deferred(id: u64) {
    let _ = id;
}

#[distributed_lock(key = "b:<id>", on_fail = "defer", message = "busy")]
async fn message_deferred(id: u64) {
    let _ = id;
}

#[distributed_lock(key = "c", on_fail = "skip", message = "busy")]
async fn message_skipped() {}

fn main() {}
