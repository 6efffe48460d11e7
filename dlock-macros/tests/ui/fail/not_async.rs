// The lock is taken and released with `.await`, so only an `async fn` can be locked: the error
// points at the `fn` token. A trait method without a body has nothing to lock.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "a")]
fn sync() {}

#[distributed_lock(key = "b")]
pub const fn constant() {}

trait Job {
    #[distributed_lock(key = "c")]
    async fn run(&self);
}

fn main() {}
