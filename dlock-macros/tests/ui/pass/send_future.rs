// The attribute adds no `Send` bound and holds nothing that is not `Send` across an await: the
// function's future is `Send` when its body's is (what axum requires of handlers), with key
// values, a `locker = expr` and a `&self` receiver.

use dlock_runtime::{distributed_lock, Locker};

fn assert_send<T: Send>(_: T) {}

struct Service {
    locker: Locker,
    tenant: String,
}

impl Service {
    #[distributed_lock(key = "svc:<self.tenant>:<id>", locker = self.locker, on_fail = "retry")]
    async fn handle(&self, id: u64, body: Vec<u8>) -> usize {
        tokio::task::yield_now().await;
        body.len() + id as usize
    }
}

#[distributed_lock(key = "free:<name>", on_lost = "cancel")]
async fn free(name: String) -> Result<String, dlock_runtime::LockError> {
    tokio::task::yield_now().await;
    Ok(name)
}

fn main() {
    let service = Service {
        locker: Locker::memory(),
        tenant: "t".to_owned(),
    };
    assert_send(service.handle(1, Vec::new()));
    assert_send(free(String::new()));
}
