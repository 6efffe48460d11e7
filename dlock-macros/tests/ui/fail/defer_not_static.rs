// `on_fail = "defer"` runs the call later, so a borrowed argument (here `&str` and `&self`) is
// an error on that argument: it does not live for `'static`. (rustc reports these lifetime
// errors only once the function has no `Send` errors; see defer_not_send.rs.)

#![allow(unused_variables)]

use dlock_runtime::distributed_lock;

struct Queue;

impl Queue {
    #[distributed_lock(key = "job:<name>", on_fail = "defer")]
    async fn job(&self, name: &str) {}
}

fn main() {}
