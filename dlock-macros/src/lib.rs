//! The `#[distributed_lock]` attribute of [dlock](https://docs.rs/dlock-runtime).
//!
//! Do not depend on this crate directly: use `dlock-runtime`, which re-exports the attribute as
//! `dlock_runtime::distributed_lock` (feature `macros`, on by default) together with everything
//! the generated code calls.
//!
//! The attribute parses and validates its arguments at compile time and emits code that calls
//! only `::dlock_runtime::__private::…` (or `<crate>::__private::…` with `crate = "…"`).

mod attr;
mod errors;
mod expand;
mod function;
mod key_template;
mod output;

use proc_macro::TokenStream;

/// Runs an `async fn` under a distributed lock: at most one call with the same key runs at a
/// time, across every instance of the service that shares the locker.
///
/// ```no_run
/// use dlock_runtime::{distributed_lock, LockError};
///
/// #[distributed_lock(key = "order:<order_id>:pay", ttl = "30s", on_fail = "retry", wait = "5s")]
/// async fn pay(order_id: u64, amount_cents: u64) -> Result<String, LockError> {
///     // Only one `pay` for this order runs at a time.
///     Ok(format!("paid {amount_cents} for order {order_id}"))
/// }
///
/// #[tokio::main(flavor = "current_thread")]
/// async fn main() {
///     dlock_runtime::set_default_locker(dlock_runtime::Locker::memory());
///     println!("{:?}", pay(42, 1999).await);
/// }
/// ```
///
/// The key is built from the arguments, the lock is taken before the body runs (according to
/// `on_fail`), kept alive while the body runs (renewed every `ttl / 3`), and released when the
/// body finishes — or when its future is dropped. Inside the body, the current lock's key and
/// fencing token are reachable through the runtime's task-local lock context.
///
/// # Arguments
///
/// | argument | value | default |
/// |---|---|---|
/// | `key` | the key template, see below | required |
/// | `ttl` | how long the lock lives if its holder stops renewing it; a duration such as `"30s"`, `"500ms"`, `"1m 30s"`, from 10ms to 24h | `"30s"` |
/// | `on_fail` | what to do when another call holds the lock: `"reject"` (fail at once), `"retry"` (wait up to `wait`), `"defer"` (return `LockError::Deferred` — HTTP 202 — at once and run the body later from the locker's in-process delay queue; every argument must be `Send + 'static`) | `"reject"` |
/// | `wait` | with `on_fail = "retry"`: how long to wait for the lock before giving up | `"10s"` |
/// | `through_outages` | with `on_fail = "retry"`: `true` keeps waiting, up to `wait`, while the backend is down (a failover, a restarted server) instead of failing with `LockError::Unavailable` — HTTP 503 — at the first outage answer (`RetryPolicy::through_outages`) | `false` |
/// | `delay`, `max_attempts` | with `on_fail = "defer"`: the delay before the first deferred attempt (doubling, with jitter, after each busy attempt), and how many attempts before the job is dead-lettered | `"1s"`, `5` |
/// | `on_lost` | what to do if the lock is lost while the body runs (renewal failed, lease ran out): `"ignore"` keeps running, `"cancel"` stops the body and returns a lock-lost error; `"cancel"` not with `on_fail = "defer"` (a deferred body runs to its end) | `"ignore"` |
/// | `locker` | any expression giving a `Locker` or `&Locker`, such as `state.locker`; it may use the arguments | the global default locker (`dlock_runtime::set_default_locker`) |
/// | `message` | a human-readable detail for the rejection (shown in the HTTP problem response); with `on_fail = "reject"` or `"retry"` only | — |
/// | `permits` | a semaphore: at most this many calls with the same key run at once (1 or more) | — (a lock) |
/// | `mode` | a read-write lock: `"read"` (shared with other readers) or `"write"` (alone); not with `permits` | — (a lock) |
/// | `crate` | the path of `dlock_runtime`, when it is re-exported under another name | `"::dlock_runtime"` |
/// | `key = [..]` | a list of key templates, `key = ["account:<from>", "account:<to>"]`: every key is locked, all-or-nothing, in a canonical order (deadlock-free whatever order callers name them in) and released together; not with `on_fail = "defer"`; templates must differ, and keys equal at run time are `LockError::InvalidKey` (400) | — |
/// | `on_fail = "skip"` | for scheduled jobs: one attempt; when the lock is held the function returns at once, without running, `()`, `None`, `Ok(())` or `Ok(None)` — only those return types (`()`, `Option<T>`, `Result<(), E>`, `Result<Option<T>, E>`) compile | — |
/// | `hold_at_least` | keep the lock this long after it was taken, even when the body returns sooner (the lease is cut to the rest of it instead of deleting the lock), so an instance whose clock lags does not run the same tick again; at most `ttl` | — |
/// | `fallback` | the path of an `async fn` called instead of returning the error when the lock is not acquired: with every name the parameters bind (`self` first, by value, in order) and then the `LockError`; it returns the function's return type as written (`T` for a non-`Result` `T`), so that type is named, not an `impl Trait`. Not with `skip` or `defer` | — |
///
/// These defaults and the `ttl` range are the runtime's own (a `Locker`'s default TTL,
/// `RetryPolicy::default()`, `DeferPolicy::default()`, `dlock_runtime::MIN_TTL` and `MAX_TTL`):
/// the attribute and the runtime read them from one crate, `dlock-limits`.
///
/// Every misuse is a compile error pointing at the offending token: unknown or duplicate
/// arguments, a bad duration or strategy, `wait` or `through_outages` without
/// `on_fail = "retry"`, a bad key template, a function that is not `async`.
///
/// # Key templates
///
/// A key is literal text with placeholders in angle brackets:
/// `key = "user:<id>:order:<req.order_no>"`.
///
/// - A placeholder names a parameter (`id: u64` gives `<id>`), any name bound by a parameter
///   pattern (`Path(id): Path<u64>` gives `<id>`, `Json(NewOrder { order_no, .. }): Json<NewOrder>`
///   gives `<order_no>`), or `self` in a method.
/// - It may go on with fields and tuple indices: `<req.order_no>`, `<pair.0>`, `<self.tenant>`.
/// - Its value is formatted with `Display`, and encoded so that different values never build
///   the same key.
/// - Two placeholders must be separated by literal text containing `:` (`"<a>:<b>"`, not
///   `"<a><b>"` or `"<a>-<b>"`): the runtime escapes `:` inside values, so the `:` is what keeps
///   `("1", "23")` and `("12", "3")` apart.
/// - The literal text may not contain `{`, `}`, `%`, `#`, whitespace or control characters, which
///   the runtime reserves.
/// - Keys are kept apart *within* a template; a template's keys can meet another template's
///   when one's literal text can be another's value (`"<tenant>:orders"` with `tenant =
///   "admin"` is the key `"admin:orders"`, and `"user:<id>x"` with `id = 1` is `"user:<id>"`
///   with `id = "1x"`). Start every template with a literal segment of its own
///   (`"orders:<tenant>"`), so that request data can only choose among that template's keys.
///
/// The key and the `locker` expression are evaluated before the body starts, when the arguments
/// are still whole.
///
/// # Return types
///
/// - A return type whose last path segment is `Result` (`Result<T, E>`, `io::Result<T>`,
///   `anyhow::Result<T>`) is kept as it is; a lock failure becomes `E` through
///   `From<LockError>`, so `E` must implement `From<dlock_runtime::LockError>`.
/// - Any other return type `T` — including no return type, `impl Trait`, and a `Result` with
///   an `impl Trait` in it (`Result<impl IntoResponse, AppError>`: the lock failure cannot be
///   converted without naming the type) — becomes `Result<T, dlock_runtime::LockError>`. For
///   an axum handler that answers with `AppError`'s response, name the type
///   (`Result<Response, AppError>`).
///
/// - `-> !` (a worker that never returns) becomes `Result<Infallible, dlock_runtime::LockError>`:
///   the lock may be refused, so the function returns after all.
/// - `io::Result<T>` works as any `Result`: `io::Error` implements `From<LockError>`, with the
///   `LockError` inside under a fitting kind (`WouldBlock` for a held lock).
///
/// **The lock covers the body, not what it returns.** It is released when the body's future
/// completes: a returned stream, future or streaming response body (`impl Stream`, `Sse`, a
/// body built from a stream) runs after the release. Do the locked work inside the body, or
/// hold a guard in the stream (`Locker::lock`).
///
/// **Trait methods.** The attribute goes on an implementation (a declaration has no body).
/// The rewritten method's return type must still match the trait's: declare it in the trait
/// as `Result<T, E>` with `E: From<LockError>` (a plain `T` would become
/// `Result<T, LockError>` in the implementation only). `#[async_trait]` rewrites the methods
/// of its impl block before the attribute runs (they are no longer `async fn`); there, have
/// the method call a locked inherent method or free function.
///
/// `?` and early `return`s in the body work as before. No `Send` bound is added: the function's
/// future is `Send` when the body's future and its output are (axum handlers) and works when it
/// is not (actix-web handlers). The output counts, unlike in an unlocked `async fn`: it is kept
/// while the lock is released, so a body returning a type that is not `Send` (a
/// `Box<dyn Error>` without `+ Send + Sync`) makes a future that is not `Send` either.
///
/// # Methods and handlers
///
/// The attribute works on free functions, methods taking `&self` or `&mut self`, generic
/// functions, and web handlers with extractor patterns:
///
/// ```ignore
/// use axum::extract::{Path, State};
/// use dlock_runtime::distributed_lock;
///
/// #[distributed_lock(key = "order:<id>", locker = state.locker, message = "payment in progress")]
/// async fn pay(State(state): State<AppState>, Path(id): Path<u64>) -> impl IntoResponse {
///     // `LockError` implements `IntoResponse` (feature `axum`): 409 Conflict when held.
/// }
///
/// impl Reports {
///     #[distributed_lock(key = "report:<self.tenant>:<day>", ttl = "10m")]
///     async fn build(&self, day: String) -> Result<Report, AppError> { /* … */ }
/// }
/// ```
#[proc_macro_attribute]
pub fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    let item = proc_macro2::TokenStream::from(item);
    match expand::expand(args.into(), item.clone()) {
        Ok(expanded) => expanded.into(),
        Err(error) => {
            // Keep the item as written, so the rest of the crate (and the IDE) still sees it.
            let mut tokens = item;
            tokens.extend(error.into_compile_error());
            tokens.into()
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::attr::short;

    /// The argument table above states the defaults and the ttl range; they must be the values
    /// the attribute applies.
    #[test]
    fn docs_state_the_defaults_and_limits() {
        let docs = include_str!("lib.rs");
        for expected in [
            format!(
                "from {} to {} | `\"{}\"` |",
                short(dlock_limits::MIN_TTL),
                short(dlock_limits::MAX_TTL),
                short(dlock_limits::DEFAULT_TTL)
            ),
            format!(
                "before giving up | `\"{}\"` |",
                short(dlock_limits::DEFAULT_WAIT)
            ),
            format!(
                "dead-lettered | `\"{}\"`, `{}` |",
                short(dlock_limits::DEFAULT_DEFER_DELAY),
                dlock_limits::DEFAULT_DEFER_MAX_ATTEMPTS
            ),
        ] {
            assert!(
                docs.contains(&expected),
                "the docs of `distributed_lock` do not say `{expected}`"
            );
        }
        // Every argument the attribute takes has a row in the table.
        for name in crate::attr::KNOWN.split(", ") {
            let name = name.trim_matches(|c: char| c == '`' || c.is_whitespace() || c == '\\');
            assert!(
                docs.contains(&format!("/// | `{name}`"))
                    || docs.contains(&format!("`, `{name}` |")),
                "the argument table of `distributed_lock` has no row for `{name}`"
            );
        }
    }

    /// The defaults and limits the attribute applies are the runtime's, read from `dlock-limits`.
    /// A copy here would drift silently when the runtime changes, so the macro's own sources
    /// (outside their tests) may not write a duration or a count constant at all.
    #[test]
    fn no_copies_of_runtime_defaults() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut copies = Vec::new();
        let mut files: Vec<_> = std::fs::read_dir(&src)
            .expect("read src/")
            .map(|entry| entry.expect("dir entry").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "rs"))
            .collect();
        files.sort();
        for path in files {
            let text = std::fs::read_to_string(&path).expect("read source");
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            for (n, line) in code.lines().enumerate() {
                let is_copy = ["from_secs(", "from_millis(", "from_micros(", "from_nanos("]
                    .iter()
                    .any(|ctor| line.contains(ctor))
                    || (line.contains("const ")
                        && [": Duration =", ": u32 =", ": u64 ="]
                            .iter()
                            .any(|ty| line.contains(ty)));
                if is_copy {
                    copies.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
                }
            }
        }
        assert!(
            copies.is_empty(),
            "dlock-macros copies values that belong to dlock-limits (use the constant):\n{}",
            copies.join("\n")
        );
    }
}
