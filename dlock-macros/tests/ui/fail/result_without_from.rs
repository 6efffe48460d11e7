// A `Result<T, E>` return type is kept, and a lock failure is converted into `E`, so `E` must
// implement `From<LockError>`; the error points at the return type.

#![allow(unused_variables)]

use dlock_runtime::distributed_lock;

#[derive(Debug)]
struct MyError;

#[distributed_lock(key = "order:<id>")]
async fn pay(id: u64) -> Result<u64, MyError> {
    Ok(id)
}

fn main() {}
