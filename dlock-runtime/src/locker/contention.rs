//! A small in-process ring of recent contention events: every acquire attempt of this locker
//! that found its lock held (or another waiter ahead) is noted with the key and the time, the
//! oldest forgotten past [`CAPACITY`]. What an ops page shows as "contended over the last
//! minutes" — this process's view, cheap enough to be always on (one short mutex per
//! *contended* attempt; the uncontended path never touches it).

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use crate::LockKey;

/// How many events the ring keeps.
pub(crate) const CAPACITY: usize = 4096;

/// One contended acquire attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ContentionEvent {
    /// The lock's encoded key.
    #[cfg_attr(
        feature = "serde",
        serde(serialize_with = "crate::backend::admin::ser::key")
    )]
    pub key: LockKey,
    /// When the attempt was answered.
    #[cfg_attr(
        feature = "serde",
        serde(
            rename = "at_ms",
            serialize_with = "crate::backend::admin::ser::epoch_ms"
        )
    )]
    pub at: SystemTime,
    /// The holder's remaining lease as the store reported it; when the lock was free but
    /// another waiter was ahead, how long that waiter's turn may last (Redis) or `None`; `None`
    /// when unknown.
    #[cfg_attr(
        feature = "serde",
        serde(
            rename = "remaining_ms",
            serialize_with = "crate::backend::admin::ser::opt_ms"
        )
    )]
    pub remaining: Option<Duration>,
}

#[derive(Debug, Default)]
pub(crate) struct ContentionLog {
    events: Mutex<VecDeque<ContentionEvent>>,
}

impl ContentionLog {
    pub(crate) fn note(&self, key: &LockKey, remaining: Option<Duration>) {
        let mut events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        if events.len() == CAPACITY {
            events.pop_front();
        }
        events.push_back(ContentionEvent {
            key: key.clone(),
            at: SystemTime::now(),
            remaining,
        });
    }

    /// The events of the last `window`, oldest first.
    pub(crate) fn since(&self, window: Duration) -> Vec<ContentionEvent> {
        let from = SystemTime::now()
            .checked_sub(window)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        events.iter().filter(|e| e.at >= from).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_newest_events() {
        let log = ContentionLog::default();
        for i in 0..CAPACITY + 10 {
            log.note(&LockKey::new(&format!("k{i}")).unwrap(), None);
        }
        let all = log.since(Duration::from_secs(3600));
        assert_eq!(all.len(), CAPACITY);
        assert_eq!(all[0].key.as_str(), "k10");
        assert_eq!(
            all.last().unwrap().key.as_str(),
            format!("k{}", CAPACITY + 9)
        );
        assert!(log.since(Duration::ZERO).len() <= 1);
    }
}
