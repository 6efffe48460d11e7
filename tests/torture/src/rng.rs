//! A tiny seeded PRNG (SplitMix64): the fault schedule and every random choice the harness
//! makes come from it, so a run's schedule is reproduced by passing its `--seed` again.

use std::time::Duration;

/// SplitMix64. Not cryptographic; deterministic for a given seed.
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// An independent generator derived from this one's seed and `salt` (same seed and salt,
    /// same stream), without advancing this one.
    pub(crate) fn fork(&self, salt: u64) -> Self {
        let mut r = Rng(self.0 ^ salt.wrapping_mul(0xA076_1D64_78BD_642F));
        r.next_u64();
        r
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`0` when `n == 0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.below(hi - lo + 1)
        }
    }

    /// Uniform duration in `lo..=hi` milliseconds.
    pub(crate) fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.range(lo, hi))
    }

    /// Shuffles `v` in place (Fisher–Yates).
    pub(crate) fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(
            Rng::new(7).fork(1).next_u64(),
            Rng::new(7).fork(2).next_u64()
        );
    }

    #[test]
    fn ranges_are_inclusive_and_bounded() {
        let mut r = Rng::new(1);
        for _ in 0..1000 {
            let x = r.range(3, 5);
            assert!((3..=5).contains(&x));
        }
        assert_eq!(r.range(4, 4), 4);
        assert_eq!(r.below(0), 0);
    }
}
