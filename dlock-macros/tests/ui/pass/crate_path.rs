// `crate = "…"`: the generated code reaches the runtime through a re-export, so a crate that
// renames or wraps `dlock_runtime` can use the attribute.

mod reexport {
    pub use ::dlock_runtime as dlock;
}

use reexport::dlock::{distributed_lock, Locker};

#[distributed_lock(key = "renamed:<id>", crate = "reexport::dlock")]
async fn renamed(id: u32) -> u32 {
    id
}

mod nested {
    #[crate::reexport::dlock::distributed_lock(
        key = "nested:<id>",
        locker = crate::reexport::dlock::Locker::memory(),
        crate = "crate::reexport::dlock"
    )]
    pub(crate) async fn locked(id: u32) -> u32 {
        id
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _previous = reexport::dlock::set_default_locker(Locker::memory());
    assert_eq!(renamed(1).await.unwrap(), 1);
    assert_eq!(nested::locked(2).await.unwrap(), 2);
}
