// A `#[cfg]` parameter: `fallback` is called with every parameter, and which ones exist would
// depend on the configuration — an error on the `#[cfg]`.

use dlock_runtime::{distributed_lock, LockError};

async fn busy(id: u64, err: LockError) -> String {
    let _ = (id, err);
    String::new()
}

#[distributed_lock(key = "order:<id>", fallback = busy)]
async fn order(#[cfg(any())] tenant: u64, id: u64) -> String {
    id.to_string()
}

fn main() {}
