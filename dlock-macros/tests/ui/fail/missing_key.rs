// `key` is required; without it the error points at the attribute.

use dlock_runtime::distributed_lock;

#[distributed_lock(ttl = "30s")]
async fn no_key() {}

#[distributed_lock]
async fn no_arguments() {}

fn main() {}
