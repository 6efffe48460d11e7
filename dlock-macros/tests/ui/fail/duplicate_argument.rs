// Every argument may be given once; a repeated one is an error on the repeated name (the same
// error for every argument, since they all go through one helper).

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "a", ttl = "1s", ttl = "2s")]
async fn twice() {}

#[distributed_lock(key = "a", key = "b")]
async fn two_keys() {}

fn main() {}
