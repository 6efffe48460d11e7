// A placeholder that names neither a parameter nor a pattern-bound name is an error on the key
// literal that lists the names that are available; `<self.…>` outside a method is one too.

#![allow(unused_variables)]

use dlock_runtime::distributed_lock;

struct Path<T>(T);

#[distributed_lock(key = "order:<order_id>")]
async fn pay(Path(id): Path<u64>, amount: u64) {}

#[distributed_lock(key = "tenant:<self.tenant>")]
async fn no_self(tenant: String) {}

#[distributed_lock(key = "report:<day>")]
async fn no_params() {}

fn main() {}
