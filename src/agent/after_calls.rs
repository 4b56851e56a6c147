//! When the host's mount table is read for plugin calls that finished (issue 10). A
//! publish or unpublish is decided by a reading that starts after the call ended
//! (`executor::Called::check`), and one reading serves every call that finished before
//! it started. A reading costs the kernel's formatting and the agent's parsing of every
//! mount on the node (about 1.3 µs a mount: docs/scale.md), so in a burst, where calls end
//! one after another, a reading per call made the agent's CPU per publish grow with the
//! node.
//!
//! The pace: while other calls are still running (their ends will want a reading too),
//! the next reading starts no sooner than [`PACE`] times the last one's duration after it
//! ended, so readings take at most a quarter of one core whatever the number of mounts,
//! and the calls that end meanwhile share it. A call that ends with no other call running
//! or waiting for a permit (a single allocation, the last call of a burst) is read for at
//! once; any other waits at most three readings' time, however long the calls still
//! running take (a storage operation, a hung plugin up to its timeout).

use crate::agent::executor::Called;
use std::time::{Duration, Instant};

/// How many times its own duration the agent waits after a reading before the next one,
/// while other calls run.
pub(crate) const PACE: u32 = 3;

/// What to do about the finished calls now.
#[derive(Debug)]
pub(crate) enum Next {
    /// Start a reading for these calls.
    Read(Vec<Called>),
    /// Ask again at this time (or when another call ends): [`AfterCalls::due`], which the
    /// shell's timer reads (the time here is what the tests check).
    At(#[cfg_attr(not(test), allow(dead_code))] Instant),
    /// Nothing waits, or a reading runs (its end asks again).
    Nothing,
}

/// The calls waiting for a reading, and what paces the next one.
#[derive(Debug, Default)]
pub(crate) struct AfterCalls {
    waiting: Vec<Called>,
    reading: bool,
    /// Calls started and not yet finished.
    running: usize,
    /// When the last reading ended, and how long it took.
    last: Option<(Instant, Duration)>,
}

impl AfterCalls {
    /// A call was started.
    pub(crate) fn started(&mut self) {
        self.running += 1;
    }

    /// A call ended: it waits for a reading that starts after now.
    pub(crate) fn finished(&mut self, call: Called) {
        self.running = self.running.saturating_sub(1);
        self.waiting.push(call);
    }

    /// The reading started by the last [`Next::Read`] ended at `ended`, taking `took`.
    pub(crate) fn read_done(&mut self, ended: Instant, took: Duration) {
        self.reading = false;
        self.last = Some((ended, took));
    }

    /// A task ended without its report (a panic, which nothing should cause): it may have
    /// been a call, which will never report its end, or the reading, which will never
    /// decide its calls. One call fewer is counted as running and no reading as under
    /// way, so that neither makes the pace wait for ever. Both err towards reading early,
    /// which costs only CPU (a second reading at once is safe: they share one descriptor
    /// under a lock).
    pub(crate) fn task_failed(&mut self) {
        self.running = self.running.saturating_sub(1);
        self.reading = false;
    }

    /// True while a reading runs.
    #[cfg(test)]
    pub(crate) fn reading(&self) -> bool {
        self.reading
    }

    /// Calls still waiting for a reading.
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// When a paced reading is due: calls wait, no reading runs, and other calls still
    /// run after a reading (`None`: nothing waits, or a reading may start at once). The
    /// shell's timer for the reading is this.
    pub(crate) fn due(&self) -> Option<Instant> {
        if self.reading || self.waiting.is_empty() || self.running == 0 {
            return None;
        }
        self.last.map(|(ended, took)| ended + took * PACE)
    }

    /// Whether a reading starts now (see the module's doc for the pace).
    pub(crate) fn next(&mut self, now: Instant) -> Next {
        if self.reading || self.waiting.is_empty() {
            return Next::Nothing;
        }
        if let Some(due) = self.due().filter(|due| now < *due) {
            return Next::At(due);
        }
        self.reading = true;
        Next::Read(std::mem::take(&mut self.waiting))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::executor::Called;

    fn call(name: &str) -> Called {
        Called::unpublished_for_test(name)
    }

    fn read(n: Next) -> usize {
        match n {
            Next::Read(calls) => calls.len(),
            other => panic!("expected a reading, got {other:?}"),
        }
    }

    #[test]
    fn a_call_that_ends_alone_is_read_for_at_once() {
        let t0 = Instant::now();
        let mut a = AfterCalls::default();
        a.started();
        a.finished(call("a"));
        assert_eq!(read(a.next(t0)), 1);
        assert!(matches!(a.next(t0), Next::Nothing), "one reading at a time");
        a.read_done(t0 + Duration::from_millis(1), Duration::from_millis(1));
        // Right after a long reading, with nothing else running: no wait.
        a.started();
        a.finished(call("b"));
        assert_eq!(read(a.next(t0 + Duration::from_millis(1))), 1);
    }

    #[test]
    fn while_calls_run_readings_are_paced_and_shared() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut a = AfterCalls::default();
        for _ in 0..4 {
            a.started();
        }
        a.finished(call("a"));
        // No reading yet to pace by: the first starts at once.
        assert_eq!(read(a.next(t0)), 1);
        a.read_done(t0 + ms(2), ms(2));
        // Two more end while two still run: they wait PACE readings' time, together.
        a.finished(call("b"));
        assert!(matches!(a.next(t0 + ms(3)), Next::At(t) if t == t0 + ms(2) + ms(2) * PACE));
        a.finished(call("c"));
        assert_eq!(a.waiting(), 2);
        assert!(matches!(a.next(t0 + ms(5)), Next::At(_)));
        assert_eq!(read(a.next(t0 + ms(2) + ms(2) * PACE)), 2);
        a.read_done(t0 + ms(9), ms(1));
        // The last running call ends: nothing more is coming, so no wait.
        a.finished(call("d"));
        assert_eq!(read(a.next(t0 + ms(9))), 1);
        assert!(!a.reading() || a.waiting() == 0);
    }

    #[test]
    fn a_failed_task_never_leaves_the_pace_waiting() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut a = AfterCalls::default();
        a.started();
        a.started();
        a.finished(call("a"));
        assert_eq!(read(a.next(t0)), 1);
        // The reading's task fails: the next call's reading is not blocked behind it.
        a.task_failed();
        a.read_done(t0, ms(5));
        // The other call's task failed too (counted above): nothing runs, so a call that
        // ends now is read for at once, not after the pace.
        a.started();
        a.finished(call("b"));
        assert_eq!(read(a.next(t0 + ms(1))), 1);
    }
}
