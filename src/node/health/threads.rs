//! The threads the mount probes run on: started when a probe finds none waiting, kept
//! while they are needed, and ended after a while without work beyond the first few.
//!
//! Tokio's blocking pool started a thread whenever a probe was handed over before the
//! thread of the probe before it was counted idle again (the probe's answer wakes the
//! round before the thread parks): a round of 1,000 probes, 4 at once, started 20 to 26
//! threads every interval, and the C library kept each one's stack after it ended
//! (docs/scale.md, "Memory"). Here a thread counts itself waiting before it answers, and
//! a probe is handed to a waiting thread only when one is counted, so a round runs on as
//! many threads as probes run at once, plus one for each stat that has not returned.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// One probe's work; what it returns sends its answer, which the thread does once it is
/// counted waiting (so the next probe, handed over on that answer, finds it).
pub type Job = Box<dyn FnOnce() -> Answer + Send + 'static>;

/// The sending of one probe's answer.
pub type Answer = Box<dyn FnOnce() + Send + 'static>;

/// A pool of probe threads (named `dhv-probe`). Clones share the threads.
#[derive(Clone)]
pub struct ProbeThreads {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
    /// Threads beyond this many end after `idle_end` without work.
    keep: usize,
    idle_end: Duration,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    /// Threads waiting for work and not yet promised a job: a thread is counted when it
    /// starts waiting and uncounted when a job is handed over (or its wait ends without
    /// one), and only waiting threads take queued jobs, so every queued job has a waiting
    /// thread to run it.
    waiting: usize,
    /// Threads alive.
    threads: usize,
}

impl ProbeThreads {
    /// How long a thread beyond the kept ones waits for work before it ends.
    pub const IDLE_END: Duration = Duration::from_secs(5);

    /// A pool that keeps `keep` threads once started (the probes that may run at once) and
    /// ends the others after [`ProbeThreads::IDLE_END`] idle.
    pub fn new(keep: usize) -> Self {
        Self::with_idle_end(keep, Self::IDLE_END)
    }

    /// [`ProbeThreads::new`] with another idle time (tests).
    fn with_idle_end(keep: usize, idle_end: Duration) -> Self {
        Self {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                work: Condvar::new(),
                keep,
                idle_end,
            }),
        }
    }

    /// Runs `job` on a waiting thread, or on a new one when none waits.
    ///
    /// # Errors
    /// The OS error when no thread waits and a new one cannot be started; `job` is not
    /// run then.
    pub fn run(&self, job: Job) -> std::io::Result<()> {
        let mut st = self.shared.lock();
        if st.waiting > 0 {
            st.waiting -= 1;
            st.jobs.push_back(job);
            drop(st);
            self.shared.work.notify_one();
            return Ok(());
        }
        st.threads += 1;
        drop(st);
        let shared = self.shared.clone();
        let started = std::thread::Builder::new()
            .name("dhv-probe".into())
            .spawn(move || shared.serve(job));
        if let Err(e) = started {
            self.shared.lock().threads -= 1;
            return Err(e);
        }
        Ok(())
    }

    /// Threads alive now (tests).
    #[cfg(test)]
    pub fn threads(&self) -> usize {
        self.shared.lock().threads
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A thread's life: its first job, then whatever is handed to it. After each job it
    /// counts itself waiting, then sends the job's answer. Only waiting threads take jobs
    /// from the queue: a thread that took one after its job, uncounted, would leave the
    /// waiting thread it was handed to counted as busy, and the next probe would start a
    /// thread.
    fn serve(&self, first: Job) {
        let mut answer = run(first);
        let mut st = self.lock();
        loop {
            st.waiting += 1;
            if answer.is_some() {
                drop(st);
                send(answer.take());
                st = self.lock();
            }
            let (guard, _) = self
                .work
                .wait_timeout_while(st, self.idle_end, |s| s.jobs.is_empty())
                .unwrap_or_else(|e| e.into_inner());
            st = guard;
            if let Some(job) = st.jobs.pop_front() {
                // Its hand-over uncounted a waiting thread: this one or another that
                // still waits, in which case this one's count stands for that one.
                drop(st);
                answer = run(job);
                st = self.lock();
                continue;
            }
            st.waiting = st.waiting.saturating_sub(1);
            if st.threads > self.keep {
                st.threads -= 1;
                return;
            }
        }
    }
}

/// Runs a job; a panic in it ends the job, not the thread (its answer is not sent: the
/// probe reports a failed thread).
fn run(job: Job) -> Option<Answer> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).ok()
}

fn send(answer: Option<Answer>) {
    if let Some(a) = answer {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(a));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A probe handed over right after the one before answered runs on that one's
    /// thread: one thread for a thousand probes in a row.
    #[test]
    fn probes_in_a_row_run_on_one_thread() {
        let pool = ProbeThreads::new(4);
        let (tx, rx) = mpsc::channel();
        for _ in 0..1000 {
            let tx = tx.clone();
            pool.run(Box::new(move || {
                Box::new(move || {
                    let _ = tx.send(());
                })
            }))
            .unwrap();
            rx.recv().unwrap();
        }
        assert_eq!(pool.threads(), 1);
    }

    /// A job that does not return holds its thread; the next one gets another, which
    /// ends once it has been idle a while (the first, kept, stays).
    #[test]
    fn a_stuck_job_does_not_hold_up_the_next() {
        let pool = ProbeThreads::with_idle_end(1, Duration::from_millis(50));
        let (release, stuck) = mpsc::channel::<()>();
        pool.run(Box::new(move || {
            let _ = stuck.recv();
            Box::new(|| ())
        }))
        .unwrap();
        let (tx, rx) = mpsc::channel();
        pool.run(Box::new(move || {
            Box::new(move || {
                let _ = tx.send(());
            })
        }))
        .unwrap();
        rx.recv_timeout(Duration::from_secs(5))
            .expect("the second job ran beside the stuck one");
        assert_eq!(pool.threads(), 2);
        drop(release);
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while pool.threads() > 1 && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(pool.threads(), 1, "the extra thread ended once idle");
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(pool.threads(), 1, "the kept thread stays");
    }
}
