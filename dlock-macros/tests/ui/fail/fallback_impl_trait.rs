// With `fallback`, the body and the fallback return the same type; an `impl Trait` return type
// (a type of each function's own) cannot be that type, so it is an error on the return type,
// anywhere in it.

use dlock_runtime::{distributed_lock, LockError};

async fn busy(id: u64, err: LockError) -> impl std::fmt::Display {
    let _ = err;
    id
}

async fn busy_result(id: u64, err: LockError) -> Result<impl std::fmt::Display, LockError> {
    let _ = id;
    Err::<u64, _>(err)
}

#[distributed_lock(key = "order:<id>", fallback = busy)]
async fn opaque(id: u64) -> impl std::fmt::Display {
    id
}

#[distributed_lock(key = "order:<id>", fallback = busy_result)]
async fn opaque_in_result(id: u64) -> Result<impl std::fmt::Display, LockError> {
    Ok::<u64, LockError>(id)
}

fn main() {}
