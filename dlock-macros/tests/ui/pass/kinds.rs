// The arguments for lock kinds compile and behave: a multi-key list (fencing per key), skip
// for every return type that can say "skipped", `hold_at_least`, and `fallback` with the
// function's bindings (including `self` and pattern bindings) and a `Result` return.
use dlock_runtime::{distributed_lock, LockError, Locker};

#[derive(Debug)]
struct MyError;

impl From<LockError> for MyError {
    fn from(_: LockError) -> Self {
        MyError
    }
}

#[distributed_lock(key = ["account:<from>", "account:<to>"], locker = locker, on_fail = "retry", wait = "1s")]
async fn transfer(locker: &Locker, from: u64, to: u64) -> usize {
    dlock_runtime::held_locks().len()
}

#[distributed_lock(key = "job:<n>", on_fail = "skip", hold_at_least = "20ms", ttl = "1s", locker = locker)]
async fn unit(locker: &Locker, n: u8) {}

#[distributed_lock(key = "job:<n>", on_fail = "skip", locker = locker)]
async fn option(locker: &Locker, n: u8) -> Option<String> {
    Some(n.to_string())
}

#[distributed_lock(key = "job:<n>", on_fail = "skip", locker = locker)]
async fn result(locker: &Locker, n: u8) -> Result<(), MyError> {
    Ok(())
}

struct Service {
    locker: Locker,
}

impl Service {
    async fn busy(&self, id: u64, _extra: u8, _err: LockError) -> Result<String, MyError> {
        Ok(format!("busy {id}"))
    }

    #[distributed_lock(key = "svc:<id>", locker = self.locker, fallback = Self::busy)]
    async fn call(&self, (id, _extra): (u64, u8)) -> Result<String, MyError> {
        Ok(format!("ran {id}"))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let locker = Locker::memory();
    assert_eq!(transfer(&locker, 1, 2).await.unwrap(), 2);
    unit(&locker, 1).await.unwrap();
    assert_eq!(option(&locker, 1).await.unwrap(), None); // held for 20 ms after `unit`
    let held = locker.lock("job:2").acquire().await.unwrap();
    result(&locker, 2).await.unwrap();
    drop(held);
    let service = Service { locker: locker.clone() };
    let held = locker.lock("svc:5").acquire().await.unwrap();
    assert_eq!(service.call((5, 0)).await.unwrap(), "busy 5");
    held.release().await.unwrap();
    assert_eq!(service.call((5, 0)).await.unwrap(), "ran 5");
}
