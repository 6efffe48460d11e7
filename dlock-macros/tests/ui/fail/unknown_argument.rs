// A misspelled or unknown argument is an error on its name that lists the known arguments.

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "a", tll = "30s")]
async fn typo() {}

fn main() {}
