// A multi-key lock names each key once: a repeated template is an error on the repeat, and an
// empty list is an error on the list.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = ["account:<from>", "account:<to>", "account:<from>"])]
async fn transfer(from: u64, to: u64) {}

#[distributed_lock(key = [])]
async fn nothing() {}

fn main() {}
