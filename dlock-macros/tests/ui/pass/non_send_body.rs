// No `Send` bound is added: a body that holds an `Rc` across an await (as actix-web handlers
// may) still compiles and runs on a current-thread runtime.

use std::rc::Rc;

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "local:<id>")]
async fn local(id: u32) -> usize {
    let shared = Rc::new(id);
    tokio::task::yield_now().await;
    Rc::strong_count(&shared)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _previous = dlock_runtime::set_default_locker(dlock_runtime::Locker::memory());
    assert_eq!(local(1).await.unwrap(), 1);
}
