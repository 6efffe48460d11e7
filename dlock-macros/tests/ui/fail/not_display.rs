// Placeholder values are formatted with `Display`; a type without it fails to compile, and
// rustc's error points at the key literal that interpolates it.

#![allow(unused_variables)]

use dlock_runtime::distributed_lock;

struct OrderId(u64);

#[distributed_lock(key = "order:<id>")]
async fn pay(id: OrderId) {}

fn main() {}
