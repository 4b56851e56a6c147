//! Retry timing: exponential backoff with jitter, and one table of retry deadlines keyed by
//! what is retried. Pure: the clock is an [`Instant`] the caller passes in, and the jitter
//! comes from a seeded generator, so tests are deterministic.
//!
//! Every loop that calls Nomad and tries a failed call again names itself with a [`Call`]
//! and keeps a [`FailureLog`]: its failures are counted (`dhv_binder_nomad_retries_total`,
//! [`Call::retries`]) and a run of them is logged at most once per [`LOG_EVERY`], with how
//! many failures the line stands for.

use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The loops that call Nomad and retry a failed call after a backoff (docs/operations/README.md,
/// "Retries against Nomad"). Each failure is counted in
/// `dhv_binder_nomad_retries_total{call="<name>"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Call {
    /// Waiting for the local Nomad agent at start (`GET /v1/agent/self`).
    AgentSelf,
    /// The allocation watch (this node's allocation list, or the event stream).
    AllocationWatch,
    /// The volume and snapshot record watches (`GET /v1/vars`, `GET /v1/var/:path`).
    RecordWatch,
    /// The record change marker's blocking read (`dhv-binder/records-changed`).
    ChangeMarker,
    /// This node's record (`PUT /v1/var/dhv-binder/nodes/<node-id>`).
    NodeRecord,
    /// The listing of this node's placeholder host volumes (`GET /v1/volumes?type=host`,
    /// `GET /v1/volume/host/:id`).
    PlaceholderList,
    /// Registering or deregistering a placeholder host volume.
    PlaceholderChange,
    /// Restarting an allocation onto a republished mount
    /// (`PUT /v1/client/allocation/:id/restart`).
    AllocationRestart,
}

const CALLS: usize = 8;
static RETRIES: [AtomicU64; CALLS] = [const { AtomicU64::new(0) }; CALLS];

impl Call {
    /// Every call, in metric order.
    pub const ALL: [Call; CALLS] = [
        Call::AgentSelf,
        Call::AllocationWatch,
        Call::RecordWatch,
        Call::ChangeMarker,
        Call::NodeRecord,
        Call::PlaceholderList,
        Call::PlaceholderChange,
        Call::AllocationRestart,
    ];

    /// The metric's `call` label.
    pub fn name(self) -> &'static str {
        match self {
            Call::AgentSelf => "agent_self",
            Call::AllocationWatch => "allocation_watch",
            Call::RecordWatch => "record_watch",
            Call::ChangeMarker => "change_marker",
            Call::NodeRecord => "node_record",
            Call::PlaceholderList => "placeholder_list",
            Call::PlaceholderChange => "placeholder_change",
            Call::AllocationRestart => "allocation_restart",
        }
    }

    /// Failures of this call counted in this process so far.
    pub fn retries(self) -> u64 {
        RETRIES[self as usize].load(Ordering::Relaxed)
    }

    /// Counts one failure of this call.
    pub fn count(self) {
        RETRIES[self as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// How often a run of failures of one call is logged, at most.
pub const LOG_EVERY: Duration = Duration::from_secs(60);

/// The log lines of a run of failures of one [`Call`]: the first failure is logged at once,
/// later ones at most once per `every`, each line standing for the failures since the one
/// before; every failure is counted ([`Call::count`]). Pure: the clock is passed in.
#[derive(Debug, Clone)]
pub struct FailureLog {
    call: Call,
    every: Duration,
    last: Option<Instant>,
    unlogged: u64,
    run: u64,
}

impl FailureLog {
    /// A log of `call`'s failures, one line per `every` at most.
    pub fn new(call: Call, every: Duration) -> Self {
        Self {
            call,
            every,
            last: None,
            unlogged: 0,
            run: 0,
        }
    }

    /// A failure at `now`: counted; `Some(n)` when a line is due, `n` the failures it stands
    /// for (this one included), `None` when it is left to a later line.
    pub fn failed(&mut self, now: Instant) -> Option<u64> {
        self.call.count();
        self.run += 1;
        self.unlogged += 1;
        let due = self
            .last
            .is_none_or(|t| now.saturating_duration_since(t) >= self.every);
        if !due {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.unlogged))
    }

    /// A success: the run is over. Returns how many failures it had (0: none), for a
    /// "recovered" line; the next failure is logged at once.
    pub fn succeeded(&mut self) -> u64 {
        self.last = None;
        self.unlogged = 0;
        std::mem::take(&mut self.run)
    }
}

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

    /// Makes failed `key` due at `at` if it was due later (evidence that its cause is
    /// gone); the next failure's delay still grows from the last one. No entry: nothing.
    pub fn due_at(&mut self, key: &K, at: Instant) {
        if let Some(e) = self.entries.get_mut(key) {
            e.not_before = e.not_before.min(at);
        }
    }

    /// Records a success: the next failure starts from the base delay again.
    pub fn succeeded(&mut self, key: &K) {
        self.entries.remove(key);
    }

    /// True when a retry's deadline fell in `(after, now]`: work that was waiting then may
    /// be tried now.
    pub fn came_due(&self, after: Instant, now: Instant) -> bool {
        self.entries
            .values()
            .any(|e| e.not_before > after && e.not_before <= now)
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
    fn a_deadline_came_due_only_within_its_window() {
        let t0 = Instant::now();
        let mut r: Retries<&str> = Retries::new(1);
        let at = r.failed(&"x", P, t0);
        assert!(!r.came_due(t0, at - Duration::from_millis(1)), "not yet");
        assert!(r.came_due(t0, at), "due at its deadline");
        assert!(
            !r.came_due(at, at + Duration::from_secs(5)),
            "already seen due"
        );
    }

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

    /// Issue 45 #2: a run of failures is logged once per interval, each line with the count
    /// it stands for, and every failure is counted; a success starts afresh.
    #[test]
    fn a_run_of_failures_is_logged_once_per_interval_with_its_count() {
        let t0 = Instant::now();
        let before = Call::AgentSelf.retries();
        let mut log = FailureLog::new(Call::AgentSelf, Duration::from_secs(60));
        let lines: Vec<(u64, u64)> = (0..120u64)
            .filter_map(|s| log.failed(t0 + Duration::from_secs(s)).map(|n| (s, n)))
            .collect();
        assert_eq!(lines, vec![(0, 1), (60, 60)]);
        assert!(Call::AgentSelf.retries() >= before + 120);
        assert_eq!(log.succeeded(), 120);
        assert_eq!(log.failed(t0 + Duration::from_secs(121)), Some(1));
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
