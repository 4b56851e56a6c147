//! Work the loop does after a pass that visits every volume of the node: rebuilding the
//! node's record, handing the usage task the journal's volumes, following the Variables
//! that published volumes reference. Each is O(volumes), so doing it after every pass of a
//! burst made the burst O(N · V): at 1,000 volumes the usage hand-over alone was a fifth of
//! the agent's CPU (docs/scale.md, "Bursts: agent CPU and mount table readings"). What
//! these feed is read by people and by timers of seconds (the node's record, written at
//! most once a second; usage readings every `--health-interval`), so a pass marks the work
//! stale and it runs at once if its last run is older than the spacing, else when the
//! spacing has passed: an allocation on a quiet node is followed at once, a burst about
//! once a second.

use std::time::Duration;
use tokio::time::Instant;

/// One piece of after-pass work and when it last ran.
#[derive(Debug)]
pub(super) struct Spaced {
    spacing: Duration,
    last: Option<Instant>,
    stale: bool,
}

impl Spaced {
    /// Work that has never run: stale, and due at once.
    pub(super) fn new(spacing: Duration) -> Self {
        Self {
            spacing,
            last: None,
            stale: true,
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

    /// True when the work is to run now: it is stale and its last run is at least the
    /// spacing old. Counts it as run at `now`.
    pub(super) fn take(&mut self, now: Instant) -> bool {
        if !self.stale || !self.older_than(self.spacing, now) {
            return false;
        }
        self.stale = false;
        self.last = Some(now);
        true
    }

    /// When stale work left for its spacing is due (the loop wakes then); `None` when
    /// nothing is left.
    pub(super) fn due(&self) -> Option<Instant> {
        if !self.stale {
            return None;
        }
        self.last.map(|t| t + self.spacing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_on_a_quiet_node_runs_at_once_and_a_burst_about_once_per_spacing() {
        let s = Duration::from_secs(1);
        let t0 = Instant::now();
        let mut w = Spaced::new(s);
        assert!(w.take(t0), "never run: due at once");
        assert!(!w.take(t0), "not stale");
        assert_eq!(w.due(), None);
        // A burst: passes every 10 ms for 2.5 s.
        let mut runs = vec![];
        for i in 1..=250 {
            let now = t0 + Duration::from_millis(10 * i);
            w.mark();
            if w.take(now) {
                runs.push(now - t0);
            }
        }
        assert_eq!(
            runs,
            [Duration::from_secs(1), Duration::from_secs(2)],
            "once per spacing"
        );
        // The burst's last changes are left for the wake at the spacing's end.
        assert_eq!(w.due(), Some(t0 + Duration::from_secs(3)));
        assert!(!w.take(t0 + Duration::from_millis(2999)));
        assert!(w.take(t0 + Duration::from_secs(3)));
        assert_eq!(w.due(), None);
        // Quiet again: the next change is followed at once.
        w.mark();
        assert!(w.take(t0 + Duration::from_secs(10)));
        assert!(w.older_than(Duration::from_secs(5), t0 + Duration::from_secs(15)));
        assert!(!w.older_than(Duration::from_secs(5), t0 + Duration::from_secs(14)));
    }
}
