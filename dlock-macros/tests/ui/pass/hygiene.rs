// Hygiene: the generated code uses absolute paths only, so a module that shadows `Result`,
// `Option`, `Box`, `Ok`, `Err`, `Future`, `Duration`, `core` and the runtime's own item names
// still compiles; its locals are invisible to the body, so the body may use `__dlock_` names and
// shadow `key` freely. A trait in scope whose methods share the key builder's names (and would
// win method lookup: they take `&self`, the builder's take `&mut self`) is not called either.

#![allow(dead_code, non_camel_case_types, clippy::all)]

mod shadowed {
    use ::dlock_runtime::distributed_lock;

    type Result = ();
    type Option = ();
    struct Box;
    struct Ok;
    struct Err;
    trait Future {}
    type Duration = ();
    struct KeyBuilder;
    struct Spec;
    fn default_locker() {}
    fn run() {}
    mod core {}
    mod dlock_runtime {}

    trait Hijack {
        fn lit(&self, _: &str) -> &Self {
            self
        }
        fn value<T: ?Sized>(&self, _: &T) -> &Self {
            self
        }
        fn finish(&self) -> ::core::result::Result<::dlock_runtime::LockKey, ::dlock_runtime::LockError> {
            ::dlock_runtime::LockKey::new("hijacked")
        }
    }
    impl<T: ?Sized> Hijack for T {}

    #[distributed_lock(key = "hygiene:<id>:<__dlock_kb>", ttl = "1s", on_fail = "retry", wait = "1s")]
    pub(crate) async fn locked(id: u32, __dlock_kb: u8) -> u32 {
        let __dlock_key = 1;
        let __dlock_body = 2;
        let key = 3;
        assert_eq!(::dlock_runtime::current_lock().unwrap().key(), "hygiene:1:1");
        id + __dlock_key + __dlock_body + key + u32::from(__dlock_kb)
    }

    #[distributed_lock(key = "hygiene:unit")]
    pub(crate) async fn unit() {}

    pub(crate) async fn call() -> u32 {
        unit().await.unwrap();
        locked(1, 1).await.unwrap()
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let _previous = dlock_runtime::set_default_locker(dlock_runtime::Locker::memory());
    assert_eq!(shadowed::call().await, 8);
}
