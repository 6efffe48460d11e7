// `on_fail = "skip"` returns "nothing done" for a held lock, which only `()`, `Option<T>`,
// `Result<(), E>` and `Result<Option<T>, E>` can say: a `u32` is an error on the return type.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "job", on_fail = "skip")]
async fn count() -> u32 {
    1
}

fn main() {}
