// Generic functions: type and lifetime parameters, `impl Trait` arguments and where clauses are
// kept; placeholders of a generic type need only `Display`.

use std::fmt::Display;

use dlock_runtime::distributed_lock;

#[distributed_lock(key = "item:<id>:<label>")]
async fn generic<'a, T, L>(id: T, label: &'a L, extra: impl Into<String>) -> (T, String)
where
    T: Display + Clone,
    L: Display + ?Sized,
{
    (id.clone(), format!("{label}{}", extra.into()))
}

#[distributed_lock(key = "borrowed:<text>")]
async fn borrowed<'a>(text: &'a str) -> &'a str {
    &text[1..]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _previous = dlock_runtime::set_default_locker(dlock_runtime::Locker::memory());
    let (id, text) = generic(7u8, "x", "y").await.unwrap();
    assert_eq!((id, text.as_str()), (7, "xy"));
    assert_eq!(borrowed("abc").await.unwrap(), "bc");
}
