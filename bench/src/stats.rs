//! Latency samples and percentiles (nearest rank over sorted samples, no interpolation).

use std::time::Duration;

/// Sorted latency samples, in nanoseconds.
#[derive(Clone, Debug, Default)]
pub(crate) struct Sorted(Vec<u64>);

impl Sorted {
    /// Sorts `ns`.
    pub(crate) fn new(mut ns: Vec<u64>) -> Self {
        ns.sort_unstable();
        Sorted(ns)
    }

    /// Sorts durations.
    pub(crate) fn from_durations(d: impl IntoIterator<Item = Duration>) -> Self {
        Self::new(d.into_iter().map(as_ns).collect())
    }

    /// Both sample sets together.
    pub(crate) fn merge(self, other: Sorted) -> Sorted {
        let mut v = self.0;
        v.extend(other.0);
        Sorted::new(v)
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// The samples, ascending.
    pub(crate) fn ns(&self) -> &[u64] {
        &self.0
    }

    /// Nearest-rank percentile `p` (0–100); zero when empty.
    pub(crate) fn pct(&self, p: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let n = self.0.len();
        let rank = ((p / 100.0) * n as f64).ceil() as usize;
        Duration::from_nanos(self.0[rank.clamp(1, n) - 1])
    }

    pub(crate) fn median(&self) -> Duration {
        self.pct(50.0)
    }

    pub(crate) fn max(&self) -> Duration {
        Duration::from_nanos(self.0.last().copied().unwrap_or(0))
    }
}

pub(crate) fn as_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Microseconds, rounded to 0.1.
pub(crate) fn us(d: Duration) -> f64 {
    round1(d.as_secs_f64() * 1e6)
}

/// Milliseconds, rounded to 0.001.
pub(crate) fn ms(d: Duration) -> f64 {
    round3(d.as_secs_f64() * 1e3)
}

pub(crate) fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// `a / b`, rounded to 0.001; `None` when `b` is zero or either is not finite.
pub(crate) fn ratio(a: f64, b: f64) -> Option<f64> {
    let r = a / b;
    (b != 0.0 && r.is_finite()).then(|| round3(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let s = Sorted::new((1..=100).rev().collect());
        assert_eq!(s.pct(50.0), Duration::from_nanos(50));
        assert_eq!(s.pct(99.0), Duration::from_nanos(99));
        assert_eq!(s.pct(100.0), Duration::from_nanos(100));
        assert_eq!(s.pct(0.0), Duration::from_nanos(1));
        assert_eq!(Sorted::default().pct(50.0), Duration::ZERO);
    }
}
