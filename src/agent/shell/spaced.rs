//! Work the loop does after a pass that visits every volume of the node: rebuilding the
//! node's record (which its writer then sends whole to Nomad), handing the usage task the
//! journal's volumes, following the Variables that published volumes reference. Each is
//! O(volumes), so doing it after every pass of a burst made the burst O(N · V): at 1,000
//! volumes the usage hand-over alone was a fifth of the agent's CPU, and the node's record
//! was written 151–170 times (docs/scale.md, "Work that visits every volume, after every
//! pass").
//!
//! Each piece is rate-limited as a generic cell rate algorithm: up to [`BURST`] runs at
//! once after a quiet time, then one per [`EVERY`]. A pass that changes what the work reads
//! marks it stale; a stale piece runs at once when the limit allows, else the loop wakes
//! for it when it does. So what an operator or a task waits on (the node's record right
//! after an agent starts or a publish ends, a volume's usage right after it is published)
//! is done at once as before, and only a sustained burst is held to ten runs a second.

use std::time::Duration;
use tokio::time::Instant;

/// How many runs may follow each other at once after a quiet time.
pub(super) const BURST: u32 = 16;

/// One more run per this interval once the burst is spent.
pub(super) const EVERY: Duration = Duration::from_millis(100);

/// One piece of after-pass work and its rate limit.
#[derive(Debug)]
pub(super) struct Spaced {
    /// The limit's theoretical arrival time: runs are allowed from `tat - (BURST-1)·EVERY`;
    /// each run moves it `EVERY` past the later of itself and the run's time.
    tat: Option<Instant>,
    stale: bool,
    /// When the work last ran.
    last: Option<Instant>,
}

impl Spaced {
    /// Work that has never run: stale, and due at once.
    pub(super) fn new() -> Self {
        Self {
            tat: None,
            stale: true,
            last: None,
        }
    }

    /// A pass changed what the work reads.
    pub(super) fn mark(&mut self) {
        self.stale = true;
    }

    /// True when the work last ran longer than `age` ago (or never).
    pub(super) fn older_than(&self, age: Duration, now: Instant) -> bool {
        self.last
            .is_none_or(|t| now.saturating_duration_since(t) >= age)
    }

    /// The earliest time the limit allows a run.
    fn allowed_from(&self) -> Option<Instant> {
        self.tat.map(|tat| {
            let tolerance = EVERY * (BURST - 1);
            tat.checked_sub(tolerance).unwrap_or(tat)
        })
    }

    /// True when the work is to run now: it is stale and the limit allows a run. Counts
    /// it as run at `now`.
    pub(super) fn take(&mut self, now: Instant) -> bool {
        if !self.stale || self.allowed_from().is_some_and(|from| now < from) {
            return false;
        }
        self.stale = false;
        self.last = Some(now);
        self.tat = Some(self.tat.map_or(now, |tat| tat.max(now)) + EVERY);
        true
    }

    /// When stale work held back by the limit is due (the loop wakes then); `None` when
    /// nothing is held back.
    pub(super) fn due(&self) -> Option<Instant> {
        if !self.stale {
            return None;
        }
        self.allowed_from()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_runs_at_once_until_a_burst_spends_the_limit_then_ten_times_a_second() {
        let t0 = Instant::now();
        let mut w = Spaced::new();
        assert!(w.take(t0), "never run: due at once");
        assert!(!w.take(t0), "not stale");
        assert_eq!(w.due(), None);
        // Changes a few at a time, as one allocation's life makes: each followed at once.
        for i in 1..=5 {
            w.mark();
            assert!(w.take(t0 + Duration::from_millis(300 * i)), "change {i}");
        }
        // A burst: passes every millisecond for 2 s.
        let start = t0 + Duration::from_secs(10);
        let mut runs = vec![];
        for i in 0..2000 {
            let now = start + Duration::from_millis(i);
            w.mark();
            if w.take(now) {
                runs.push(now - start);
            }
        }
        let at_once = runs.iter().filter(|d| **d < EVERY).count();
        assert_eq!(at_once, BURST as usize, "the burst's first runs: {runs:?}");
        // Then one per EVERY: 2 s hold about 20 more.
        assert!((18..=21).contains(&(runs.len() - at_once)), "{runs:?}");
        for pair in runs[BURST as usize..].windows(2) {
            assert!(
                pair[1] - pair[0] >= EVERY - Duration::from_millis(1),
                "{runs:?}"
            );
        }
        // The burst's last change is held for the wake the limit allows.
        let due = w.due().expect("the last change is held back");
        assert!(due > start + Duration::from_millis(1999));
        assert!(!w.take(due - Duration::from_millis(1)));
        assert!(w.take(due));
        assert_eq!(w.due(), None);
        // Quiet again: after a while the burst is back.
        let later = due + EVERY * BURST;
        for i in 0..BURST {
            w.mark();
            assert!(w.take(later), "run {i} after the quiet time");
        }
        assert!(w.older_than(Duration::from_secs(5), later + Duration::from_secs(5)));
        assert!(!w.older_than(Duration::from_secs(5), later + Duration::from_secs(4)));
    }
}
