// `impl Trait` returns cannot be named inside the body, so they are always wrapped:
// `-> impl Display` becomes `-> Result<impl Display, LockError>`, even when the hidden type is a
// `Result`.

use std::fmt::Display;

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "shown:<n>")]
async fn shown(n: u32) -> impl Display {
    n * 2
}

#[distributed_lock(key = "iter:<n>")]
async fn iter(n: u32) -> Box<dyn Iterator<Item = impl Display>> {
    Box::new(0..n)
}

#[distributed_lock(key = "nested:<n>")]
async fn nested(n: u32) -> Result<impl Display, std::fmt::Error> {
    Ok(n)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _previous = dlock_runtime::set_default_locker(dlock_runtime::Locker::memory());
    assert_eq!(shown(2).await.unwrap().to_string(), "4");
    assert_eq!(iter(3).await.unwrap().count(), 3);
    assert_eq!(nested(5).await.unwrap().unwrap().to_string(), "5");
}
