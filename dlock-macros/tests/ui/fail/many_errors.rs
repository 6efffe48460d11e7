// Every problem is reported at once, each on its own token, rather than one per build.

#![allow(unused_variables)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "order:<nope>", ttl = "0s", on_fail = "later", color = "red", message = "")]
fn everything_wrong(id: u32) {}

fn main() {}
