//! The allocations of this node that wait for a single-node claim another node holds, and
//! since when. Each allocation is counted once, when its wait begins
//! (`dhv_binder_claim_waits_total`: the acquire is retried many times meanwhile, and none of
//! those retries is a new wait); the current waits and the oldest one's age are gauges
//! (`dhv_binder_claim_waiters`, `dhv_binder_claim_wait_oldest_seconds`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// Current claim waits by allocation, and how many began since the agent started.
#[derive(Debug, Default)]
pub(crate) struct ClaimWaits {
    since: BTreeMap<String, Instant>,
    begun: u64,
}

impl ClaimWaits {
    /// The allocations waiting now are `waiting`: those not waiting before begin at `now`
    /// (and are counted), those no longer in it end.
    pub(crate) fn update(&mut self, waiting: BTreeSet<String>, now: Instant) {
        self.since.retain(|id, _| waiting.contains(id));
        for id in waiting {
            self.since.entry(id).or_insert_with(|| {
                self.begun += 1;
                now
            });
        }
    }

    /// Waits begun since the agent started (each allocation once per wait).
    pub(crate) fn begun(&self) -> u64 {
        self.begun
    }

    /// Allocations waiting now.
    pub(crate) fn current(&self) -> usize {
        self.since.len()
    }

    /// When the oldest current wait began.
    pub(crate) fn oldest(&self) -> Option<Instant> {
        self.since.values().min().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ids(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// Issue 46 #6: a wait is counted once however often the acquire is retried; a second
    /// allocation waiting is a second wait; a wait that ended and begins again is counted
    /// again; the oldest current wait gives the age.
    #[test]
    fn each_waiting_allocation_is_counted_once_and_the_oldest_wait_is_known() {
        let t0 = Instant::now();
        let mut w = ClaimWaits::default();
        w.update(ids(&["a"]), t0);
        for s in 1..10 {
            w.update(ids(&["a"]), t0 + Duration::from_secs(s));
        }
        assert_eq!((w.begun(), w.current(), w.oldest()), (1, 1, Some(t0)));
        w.update(ids(&["a", "b"]), t0 + Duration::from_secs(20));
        assert_eq!((w.begun(), w.current(), w.oldest()), (2, 2, Some(t0)));
        w.update(ids(&["b"]), t0 + Duration::from_secs(21));
        assert_eq!(
            (w.begun(), w.current(), w.oldest()),
            (2, 1, Some(t0 + Duration::from_secs(20)))
        );
        w.update(ids(&[]), t0 + Duration::from_secs(22));
        assert_eq!((w.current(), w.oldest()), (0, None));
        w.update(ids(&["b"]), t0 + Duration::from_secs(23));
        assert_eq!(w.begun(), 3);
    }
}
