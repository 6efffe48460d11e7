// Two placeholders must be separated by literal text containing `:`, because the runtime
// escapes `:` inside values: that is what keeps ("1", "23") and ("12", "3") apart.

#![allow(unused_variables)]

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "pair:<a><b>")]
async fn adjacent(a: u32, b: u32) {}

#[distributed_lock(key = "pair:<a>-<b>")]
async fn dash(a: u32, b: u32) {}

fn main() {}
