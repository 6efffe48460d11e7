// `on_fail = "defer"` runs the call later, on another task, so every argument must be `Send`
// and `'static`: each argument that is not is an error on that argument.

#![allow(unused_variables)]

use std::rc::Rc;

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "job:<id>", on_fail = "defer", delay = "2s", max_attempts = 5)]
async fn job(id: u64, shared: Rc<u64>, name: &str) {}

fn main() {}
