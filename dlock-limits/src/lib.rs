//! The defaults and limits of [dlock](https://docs.rs/dlock-runtime), in one place.
//!
//! `dlock-runtime` applies these values at run time (and re-exports [`MIN_TTL`] and [`MAX_TTL`]
//! as `dlock_runtime::MIN_TTL` / `dlock_runtime::MAX_TTL`); the `#[distributed_lock]` attribute
//! in `dlock-macros` checks its arguments against them and fills in the same defaults at compile
//! time. A proc-macro crate cannot depend on the runtime that re-exports it, so both depend on
//! this crate instead, and no value is written twice.
//!
//! This crate has no dependencies and no code, only constants. Do not depend on it directly:
//! use `dlock-runtime`.
//!
//! ```
//! use core::time::Duration;
//!
//! assert!(dlock_limits::MIN_TTL <= dlock_limits::DEFAULT_TTL);
//! assert!(dlock_limits::DEFAULT_TTL <= dlock_limits::MAX_TTL);
//! assert_eq!(dlock_limits::DEFAULT_WAIT, Duration::from_secs(10));
//! ```

#![no_std]

use core::time::Duration;

/// The shortest lease a lock may have: 10 ms.
pub const MIN_TTL: Duration = Duration::from_millis(10);

/// The longest lease a lock may have: 24 h. Longer work keeps a shorter lease alive with the
/// watchdog. The attribute also caps its `wait` and `delay` arguments at this value.
pub const MAX_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// The lease when none is given: 30 s. It is a `Locker`'s default TTL (unless its builder sets
/// another) and the attribute's default `ttl`.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// How long `on_fail = "retry"` waits for a busy lock when no deadline is given: 10 s. It is
/// `RetryPolicy::default().wait` and the attribute's default `wait`.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(10);

/// The delay before the first deferred attempt of `on_fail = "defer"`: 1 s. It is
/// `DeferPolicy::default().delay` and the attribute's default `delay`.
pub const DEFAULT_DEFER_DELAY: Duration = Duration::from_secs(1);

/// How many deferred attempts `on_fail = "defer"` makes before the job is dead-lettered: 5. It is
/// `DeferPolicy::default().max_attempts` and the attribute's default `max_attempts`.
pub const DEFAULT_DEFER_MAX_ATTEMPTS: u32 = 5;

/// The longest raw input a lock key may have: 4096 bytes of literal text and formatted values,
/// before encoding. Longer input is refused (`LockError::InvalidKey` at run time; the attribute
/// refuses a key whose literal text alone is longer).
pub const MAX_KEY_INPUT_LEN: usize = 4096;

// The defaults lie within the limits.
const _: () = {
    assert!(MIN_TTL.as_nanos() <= DEFAULT_TTL.as_nanos());
    assert!(DEFAULT_TTL.as_nanos() <= MAX_TTL.as_nanos());
    assert!(!DEFAULT_WAIT.is_zero() && DEFAULT_WAIT.as_nanos() <= MAX_TTL.as_nanos());
    assert!(!DEFAULT_DEFER_DELAY.is_zero() && DEFAULT_DEFER_DELAY.as_nanos() <= MAX_TTL.as_nanos());
    assert!(DEFAULT_DEFER_MAX_ATTEMPTS >= 1);
};
