//! Retry timing: exponential backoff with jitter, and one table of retry deadlines keyed by
//! what is retried. Pure: the clock is an [`Instant`] the caller passes in, and the jitter
//! comes from a seeded generator, so tests are deterministic.

use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long to wait after failures: `base * 2^attempt`, capped at `cap`, then ±20 % jitter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// The wait after the first failure.
    pub base: Duration,
    /// The longest wait.
    pub cap: Duration,
}

impl Policy {
    /// The wait before attempt `attempt + 1`, scaled by `jitter` (expected in 0.8..1.2).
    pub fn delay(&self, attempt: u32, jitter: f64) -> Duration {
        let exp = self.base.saturating_mul(1u32 << attempt.min(16));
        exp.min(self.cap).mul_f64(jitter)
    }
}

/// Exponential backoff with ±20 % jitter from the thread's generator: `base * 2^attempt`,
/// capped. For loops outside the agent core (the watcher, the catalogue, the CLI).
pub fn backoff_delay(base: Duration, cap: Duration, attempt: u32) -> Duration {
    Policy { base, cap }.delay(attempt, rand::thread_rng().gen_range(0.8..1.2))
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    attempt: u32,
    not_before: Instant,
}

/// Failed work and when it may be tried again, keyed by what is retried (`K`). Work with
/// no entry is ready; a success forgets the entry.
#[derive(Debug)]
pub struct Retries<K: Ord> {
    entries: BTreeMap<K, Entry>,
    rng: rand::rngs::StdRng,
}

impl<K: Ord + Clone> Retries<K> {
    /// An empty table whose jitter comes from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            entries: BTreeMap::new(),
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        }
    }

    /// True when `key` has not failed, or its wait is over at `now`.
    pub fn ready(&self, key: &K, now: Instant) -> bool {
        self.entries.get(key).is_none_or(|e| e.not_before <= now)
    }

    /// Records a failure of `key` at `now`; returns when it may be tried again.
    pub fn failed(&mut self, key: &K, policy: Policy, now: Instant) -> Instant {
        let attempt = self.entries.get(key).map(|e| e.attempt + 1).unwrap_or(0);
        let jitter = self.rng.gen_range(0.8..1.2);
        let not_before = now + policy.delay(attempt, jitter);
        self.entries.insert(
            key.clone(),
            Entry {
                attempt,
                not_before,
            },
        );
        not_before
    }

    /// Records a success: the next failure starts from the base delay again.
    pub fn succeeded(&mut self, key: &K) {
        self.entries.remove(key);
    }

    /// The earliest retry deadline still ahead of `now`.
    pub fn next_after(&self, now: Instant) -> Option<Instant> {
        self.entries
            .values()
            .map(|e| e.not_before)
            .filter(|t| *t > now)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Policy = Policy {
        base: Duration::from_secs(1),
        cap: Duration::from_secs(60),
    };

    #[test]
    fn delays_double_up_to_the_cap_within_the_jitter() {
        assert_eq!(P.delay(0, 1.0), Duration::from_secs(1));
        assert_eq!(P.delay(3, 1.0), Duration::from_secs(8));
        assert_eq!(P.delay(10, 1.0), Duration::from_secs(60));
        assert_eq!(P.delay(40, 1.0), Duration::from_secs(60));
        assert_eq!(P.delay(0, 0.8), Duration::from_millis(800));
    }

    #[test]
    fn failed_work_waits_and_a_success_resets_it() {
        let t0 = Instant::now();
        let mut r = Retries::new(7);
        assert!(r.ready(&"a", t0));
        let at = r.failed(&"a", P, t0);
        assert!(at >= t0 + Duration::from_millis(800) && at < t0 + Duration::from_millis(1200));
        assert!(!r.ready(&"a", t0));
        assert!(r.ready(&"b", t0), "other keys are not held back");
        assert_eq!(r.next_after(t0), Some(at));
        assert!(r.ready(&"a", at));
        assert_eq!(r.next_after(at), None);
        let again = r.failed(&"a", P, at);
        assert!(
            again >= at + Duration::from_millis(1600),
            "the second wait doubles"
        );
        r.succeeded(&"a");
        assert!(r.ready(&"a", t0));
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let t0 = Instant::now();
        let (mut a, mut b) = (Retries::new(1), Retries::new(1));
        for _ in 0..5 {
            assert_eq!(a.failed(&1, P, t0), b.failed(&1, P, t0));
        }
    }
}
