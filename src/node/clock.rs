//! The agent's clock: monotonic time that also counts the time the machine was suspended.
//!
//! Rust's [`Instant`] is `CLOCK_MONOTONIC` on Linux, which stops while the machine (a VM) is
//! suspended: a claim's lease measured on it looks younger than it is after a resume, and the
//! agent would write on a lease another node may already have taken over. `CLOCK_BOOTTIME`
//! counts the suspend. The core takes its `now` as an [`Instant`]; [`BootClock::at`] shifts a
//! monotonic instant forward by the time suspended since the agent started (how much
//! `CLOCK_BOOTTIME − CLOCK_MONOTONIC` has grown), so every timer of the core counts a suspend,
//! the claims' lease and fence among them (docs/architecture.md, "Fencing"). The shell sleeps
//! on the monotonic clock: [`BootClock::monotonic`] maps a moment of the core back.

use nix::time::{clock_gettime, ClockId};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Reads how far `CLOCK_BOOTTIME` is ahead of `CLOCK_MONOTONIC` (the time suspended since
/// boot); `None` when either clock cannot be read.
pub trait SuspendSource: Send + Sync {
    /// The current gap.
    fn gap(&self) -> Option<Duration>;
}

/// The kernel's clocks (`clock_gettime(2)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Kernel;

impl SuspendSource for Kernel {
    fn gap(&self) -> Option<Duration> {
        let boot = Duration::from(clock_gettime(ClockId::CLOCK_BOOTTIME).ok()?);
        let mono = Duration::from(clock_gettime(ClockId::CLOCK_MONOTONIC).ok()?);
        Some(boot.saturating_sub(mono))
    }
}

/// A monotonic clock that counts suspends (see the module documentation). Cheap to clone:
/// clones share what they have seen.
#[derive(Clone)]
pub struct BootClock {
    source: Arc<dyn SuspendSource>,
    /// The gap when the clock was made.
    start: Duration,
    /// The most time suspended seen so far, in nanoseconds (never decreases: the two clocks
    /// are read one after the other, so a reading may be off by microseconds).
    seen: Arc<AtomicU64>,
}

impl std::fmt::Debug for BootClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootClock")
            .field("suspended", &self.seen())
            .finish()
    }
}

impl Default for BootClock {
    fn default() -> Self {
        Self::new(Arc::new(Kernel))
    }
}

impl BootClock {
    /// A clock that reads `source` (the kernel's clocks: [`BootClock::default`]).
    pub fn new(source: Arc<dyn SuspendSource>) -> Self {
        let start = source.gap().unwrap_or_default();
        Self {
            source,
            start,
            seen: Arc::new(AtomicU64::new(0)),
        }
    }

    fn seen(&self) -> Duration {
        Duration::from_nanos(self.seen.load(Ordering::Relaxed))
    }

    /// The time the machine was suspended since this clock was made (read now).
    pub fn suspended(&self) -> Duration {
        if let Some(gap) = self.source.gap() {
            let ns = gap
                .saturating_sub(self.start)
                .as_nanos()
                .min(u64::MAX as u128) as u64;
            self.seen.fetch_max(ns, Ordering::Relaxed);
        }
        self.seen()
    }

    /// `mono` (a reading of the monotonic clock taken now) moved forward by the time
    /// suspended since the clock was made: the core's `now`.
    pub fn at(&self, mono: Instant) -> Instant {
        mono + self.suspended()
    }

    /// A moment of the core's clock as a moment of the monotonic clock (to sleep until it).
    pub fn monotonic(&self, t: Instant) -> Instant {
        t.checked_sub(self.seen()).unwrap_or(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A source whose gap the test sets: a suspend of `d` grows it by `d`.
    struct Fake(Mutex<Duration>);

    impl SuspendSource for Fake {
        fn gap(&self) -> Option<Duration> {
            Some(*self.0.lock().unwrap())
        }
    }

    #[test]
    fn a_suspend_moves_the_clock_forward_by_its_length() {
        let s = Duration::from_secs;
        let fake = Arc::new(Fake(Mutex::new(s(7))));
        let clock = BootClock::new(fake.clone());
        let t = Instant::now();
        assert_eq!(clock.at(t), t, "nothing suspended since the start");
        *fake.0.lock().unwrap() = s(67);
        assert_eq!(clock.at(t), t + s(60), "a 60 s suspend counts");
        assert_eq!(clock.monotonic(t + s(70)), t + s(10));
        // A reading a little lower (the two clocks are read one after the other) never
        // moves the clock back.
        *fake.0.lock().unwrap() = s(66);
        assert_eq!(clock.at(t), t + s(60));
    }

    #[test]
    fn the_kernel_clocks_are_read() {
        let clock = BootClock::default();
        let t = Instant::now();
        assert!(clock.at(t) >= t);
        assert!(
            Kernel.gap().is_some(),
            "CLOCK_BOOTTIME and CLOCK_MONOTONIC readable"
        );
    }
}
