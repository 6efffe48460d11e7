//! Small pieces every layer uses: the TTL bounds, one hex codec, the two kinds of randomness (secure tokens from
//! the OS, fast jitter), and one exponential backoff.

use std::cell::Cell;
use std::fmt::Write as _;
use std::time::Duration;

use crate::LockError;

// Shared with `#[distributed_lock]` (crate `dlock-limits`), which checks `ttl` against them
// at compile time.
pub use dlock_limits::{MAX_TTL, MIN_TTL};

pub(crate) fn validate_ttl(ttl: Duration) -> Result<Duration, LockError> {
    let reason = if ttl.is_zero() {
        "ttl must not be zero".to_owned()
    } else if ttl < MIN_TTL {
        format!("ttl must be at least {MIN_TTL:?}")
    } else if ttl > MAX_TTL {
        format!("ttl must be at most {MAX_TTL:?}; long work keeps a short lease renewed")
    } else {
        return Ok(ttl);
    };
    Err(LockError::InvalidTtl { ttl, reason })
}

/// Appends `bytes` as lowercase hex.
pub(crate) fn hex_into(out: &mut String, bytes: &[u8]) {
    out.reserve(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
}

/// `bytes` as lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut s = String::new();
    hex_into(&mut s, bytes);
    s
}

/// `N` random bytes from the OS CSPRNG, as hex: owner tokens, job ids, claim tokens.
///
/// # Panics
/// If the operating system cannot provide randomness (never on supported platforms); a lock
/// library must not fall back to a weaker source.
pub(crate) fn secure_token<const N: usize>() -> String {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes).expect("the OS CSPRNG is unavailable");
    hex(&bytes)
}

thread_local! {
    static RNG: Cell<u64> = Cell::new({
        let mut seed = [0u8; 8];
        // Jitter needs no secrecy; a fixed odd seed is a fine fallback.
        if getrandom::fill(&mut seed).is_err() {
            seed = 0x9E37_79B9_7F4A_7C15u64.to_le_bytes();
        }
        u64::from_le_bytes(seed) | 1
    });
}

/// xorshift64*: jitter only, never for tokens.
pub(crate) fn next_random() -> u64 {
    RNG.with(|c| {
        let mut x = c.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        c.set(x);
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    })
}

/// A uniformly random duration in `0..=max`.
pub(crate) fn random_up_to(max: Duration) -> Duration {
    let nanos = max.as_nanos().min(u128::from(u64::MAX)) as u64;
    if nanos == 0 {
        Duration::ZERO
    } else {
        Duration::from_nanos(next_random() % (nanos + 1))
    }
}

/// Where in a backoff step the wait falls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Jitter {
    /// Exactly the step.
    None,
    /// Anywhere in `0..=step` ("full jitter"): spreads waiters out the most.
    Full,
    /// Anywhere in `step/2..=step` ("equal jitter"): never much earlier than the step.
    Equal,
}

/// Step `n` (0-based) of the exponential backoff `base · 2ⁿ`, capped at `max`, with `jitter`.
pub(crate) fn backoff(base: Duration, n: u32, max: Duration, jitter: Jitter) -> Duration {
    let step = base.checked_mul(1u32 << n.min(20)).unwrap_or(max).min(max);
    match jitter {
        Jitter::None => step,
        Jitter::Full => random_up_to(step),
        Jitter::Equal => step / 2 + random_up_to(step - step / 2),
    }
}

/// The message of a caught panic's payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a non-string payload".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_bounds_are_enforced() {
        assert!(validate_ttl(Duration::ZERO).unwrap_err().is_invalid());
        assert!(validate_ttl(Duration::from_millis(9)).is_err());
        assert!(validate_ttl(MIN_TTL).is_ok());
        assert!(validate_ttl(MAX_TTL).is_ok());
        assert!(validate_ttl(MAX_TTL + Duration::from_millis(1)).is_err());
    }

    #[test]
    fn hex_is_lowercase_and_two_digits_per_byte() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa0, 0xff]), "000fa0ff");
        assert_eq!(secure_token::<16>().len(), 32);
        assert_ne!(secure_token::<16>(), secure_token::<16>());
    }

    #[test]
    fn backoff_doubles_to_the_cap_and_jitter_stays_in_its_range() {
        let (base, max) = (Duration::from_millis(10), Duration::from_millis(70));
        let steps: Vec<_> = (0..5)
            .map(|n| backoff(base, n, max, Jitter::None).as_millis())
            .collect();
        assert_eq!(steps, vec![10, 20, 40, 70, 70]);
        assert_eq!(backoff(base, 1000, max, Jitter::None), max);
        for n in 0..200 {
            let step = backoff(base, n % 4, max, Jitter::None);
            assert!(backoff(base, n % 4, max, Jitter::Full) <= step);
            let equal = backoff(base, n % 4, max, Jitter::Equal);
            assert!(equal >= step / 2 && equal <= step, "{equal:?} vs {step:?}");
        }
    }
}
