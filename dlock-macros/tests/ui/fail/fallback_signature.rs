// `fallback` is called with the function's bindings then the `LockError`, and returns the
// function's return type: a fallback that misses an argument or returns another type is an
// error on the `fallback` path; `fallback` with `skip` never applies.

use dlock_runtime::{distributed_lock, LockError};

async fn busy_wrong_arity(err: LockError) -> String {
    err.to_string()
}

async fn busy_wrong_type(id: u64, err: LockError) -> u32 {
    let _ = (id, err);
    0
}

#[distributed_lock(key = "order:<id>", fallback = busy_wrong_arity)]
async fn arity(id: u64) -> String {
    id.to_string()
}

#[distributed_lock(key = "order:<id>", fallback = busy_wrong_type)]
async fn wrong_type(id: u64) -> String {
    id.to_string()
}

#[distributed_lock(key = "order:<id>", on_fail = "skip", fallback = busy_wrong_type)]
async fn with_skip(id: u64) {}

fn main() {}
