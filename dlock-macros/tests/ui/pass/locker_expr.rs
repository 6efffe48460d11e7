// `locker = <expr>`: any expression giving a `Locker`, a `&Locker` or something that derefs to
// one (`Arc<Locker>`, `LazyLock<Locker>`), evaluated before the body takes ownership of the
// arguments, and without moving out of them (the body still uses `state` after `state.locker`
// chose the locker).

use std::sync::{Arc, LazyLock, OnceLock};

use dlock_runtime::{distributed_lock, Locker};

#[derive(Clone)]
struct AppState {
    locker: Locker,
    name: String,
}

struct State<T>(T);

#[distributed_lock(key = "state:<id>", locker = state.locker)]
async fn field(state: AppState, id: u32) -> String {
    format!("{}:{id}", state.name)
}

#[distributed_lock(key = "extracted:<id>", locker = app.locker)]
async fn extracted(State(app): State<AppState>, id: u32) -> String {
    app.name
}

#[distributed_lock(key = "by-ref:<id>", locker = locker)]
async fn by_ref(locker: &Locker, id: u32) -> u32 {
    let _ = locker;
    id
}

fn global() -> &'static Locker {
    static LOCKER: OnceLock<Locker> = OnceLock::new();
    LOCKER.get_or_init(Locker::memory)
}

#[distributed_lock(key = "call:<id>", locker = global())]
async fn call(id: u32) -> u32 {
    id
}

#[distributed_lock(key = "built:<id>", locker = Locker::memory())]
async fn built(id: u32) -> u32 {
    id
}

struct Shared {
    locker: Arc<Locker>,
}

#[distributed_lock(key = "shared:<id>", locker = app.locker)]
async fn shared(app: &Shared, id: u32) -> u32 {
    id
}

static LAZY: LazyLock<Locker> = LazyLock::new(Locker::memory);

#[distributed_lock(key = "lazy:<id>", locker = LAZY)]
async fn lazy(id: u32) -> u32 {
    id
}

#[distributed_lock(key = "boxed:<id>", locker = boxed)]
async fn boxed(boxed: Box<Locker>, id: u32) -> u32 {
    id
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // No default locker is set: every call here names its own.
    let state = AppState {
        locker: Locker::memory(),
        name: "app".to_owned(),
    };
    assert_eq!(field(state.clone(), 1).await.unwrap(), "app:1");
    assert_eq!(extracted(State(state.clone()), 2).await.unwrap(), "app");
    assert_eq!(by_ref(&state.locker, 3).await.unwrap(), 3);
    assert_eq!(call(4).await.unwrap(), 4);
    assert_eq!(built(5).await.unwrap(), 5);
    let app = Shared {
        locker: Arc::new(Locker::memory()),
    };
    assert_eq!(shared(&app, 6).await.unwrap(), 6);
    assert_eq!(lazy(7).await.unwrap(), 7);
    assert_eq!(boxed(Box::new(Locker::memory()), 8).await.unwrap(), 8);
}
