// Free functions: a `Result<T, E>` return keeps its type (E: From<LockError>), a plain `T` and
// no return type become `Result<T, LockError>`, and `?`, early `return` and coercions in the body
// behave as in an unannotated function (the body's output type is fixed before it is checked).

use std::fmt::Display;

use dlock_runtime::{distributed_lock, LockError};

#[derive(Debug)]
enum AppError {
    Lock(LockError),
    Parse(std::num::ParseIntError),
}

impl From<LockError> for AppError {
    fn from(error: LockError) -> Self {
        AppError::Lock(error)
    }
}

impl From<std::num::ParseIntError> for AppError {
    fn from(error: std::num::ParseIntError) -> Self {
        AppError::Parse(error)
    }
}

/// Doc comments and other attributes are kept.
#[distributed_lock(key = "order:<id>", ttl = "30s", on_fail = "reject")]
#[inline]
pub async fn pay(id: u64, amount: &str) -> Result<u64, AppError> {
    if id == 0 {
        return Ok(0);
    }
    let amount: u64 = amount.parse()?;
    Ok(id + amount)
}

#[distributed_lock(key = "order:<id>", on_fail = "retry", wait = "2s", message = "busy")]
async fn std_result(id: u64) -> std::result::Result<(), AppError> {
    let _ = id;
    Ok(())
}

// Waits through a backend outage too (`RetryPolicy::through_outages`).
#[distributed_lock(key = "order:<id>", on_fail = "retry", wait = "2s", through_outages = true)]
async fn through_outages(id: u64) -> u64 {
    id
}

#[distributed_lock(key = "count", on_lost = "cancel")]
async fn count() -> usize {
    42
}

#[distributed_lock(key = "unit:<name>", ttl = "1m 30s")]
async fn unit(name: String) {
    if name.is_empty() {
        return;
    }
    tokio::task::yield_now().await;
}

// The declared type drives coercions, as it did before the attribute.
#[distributed_lock(key = "boxed:<flag>")]
async fn boxed(flag: bool) -> Box<dyn Display> {
    if flag {
        return Box::new("early");
    }
    Box::new(1)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _previous = dlock_runtime::set_default_locker(dlock_runtime::Locker::memory());
    assert_eq!(pay(1, "2").await.unwrap(), 3);
    assert_eq!(pay(0, "2").await.unwrap(), 0);
    assert!(matches!(pay(1, "x").await, Err(AppError::Parse(_))));
    std_result(7).await.unwrap();
    assert_eq!(through_outages(7).await.unwrap(), 7);
    assert_eq!(count().await.unwrap(), 42);
    unit(String::new()).await.unwrap();
    unit("a".to_owned()).await.unwrap();
    assert_eq!(boxed(true).await.unwrap().to_string(), "early");
    assert_eq!(boxed(false).await.unwrap().to_string(), "1");
}
