//! Who may hold a connection to the local API, and how many: per-caller fairness that one
//! task cannot exhaust, a cap for all callers together, a pool of its own for host root,
//! a bound on the publish calls one allocation waits in at once, and warnings about refused
//! callers at most one per interval per kind.
//!
//! Every task runs as `nobody` (or root in a container), so the peer UID says little about
//! who is calling. Before authentication the agent tells callers apart by what a task cannot
//! leave on its own: its UID, its cgroup (Nomad makes one per task: `nomad.slice/...` on
//! cgroups v2) and its mount namespace (the exec and docker drivers make one per task), read
//! from `/proc/<pid>` of the connecting process ([`CallerKey`]). After authentication the
//! workload identity names the allocation, and [`Admission::publish`] bounds its waits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What tells one caller from another before it has authenticated: the peer UID of its
/// connection, and the cgroup and mount namespace of the process that connected (`None`
/// when they could not be read, e.g. the process already exited: such callers of one UID
/// share one key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallerKey {
    pub uid: Option<u32>,
    /// `/proc/<pid>/cgroup`, the cgroup v2 line's path (or the whole file on cgroups v1).
    pub cgroup: Option<String>,
    /// `/proc/<pid>/ns/mnt`, e.g. `mnt:[4026531841]`.
    pub mount_ns: Option<String>,
}

impl CallerKey {
    /// The key of the process `pid` (the connection's `SO_PEERCRED`) running as `uid`.
    pub fn of(uid: Option<u32>, pid: Option<i32>) -> Self {
        let pid = pid.filter(|p| *p > 0);
        let cgroup = pid
            .and_then(|p| std::fs::read_to_string(format!("/proc/{p}/cgroup")).ok())
            .map(|t| cgroup_path(&t));
        let mount_ns = pid
            .and_then(|p| std::fs::read_link(format!("/proc/{p}/ns/mnt")).ok())
            .map(|l| l.to_string_lossy().into_owned());
        Self {
            uid,
            cgroup,
            mount_ns,
        }
    }
}

impl std::fmt::Display for CallerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let unknown = "unknown";
        write!(
            f,
            "uid {} cgroup {} {}",
            self.uid
                .map(|u| u.to_string())
                .unwrap_or_else(|| unknown.into()),
            crate::escape::escape_control(self.cgroup.as_deref().unwrap_or(unknown)),
            self.mount_ns.as_deref().unwrap_or("mnt:unknown"),
        )
    }
}

/// The cgroup v2 path (`0::<path>`) of a `/proc/<pid>/cgroup` text; on cgroups v1 the whole
/// text (every hierarchy's path), trimmed.
fn cgroup_path(text: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_string)
        .unwrap_or_else(|| text.trim().to_string())
}

/// Why a connection or a call was refused before it was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refused {
    /// Host root already holds its whole pool.
    RootPoolFull,
    /// Every connection for callers other than host root is in use.
    AllInUse,
    /// This caller ([`CallerKey`]) already holds its share.
    CallerOverLimit,
    /// This allocation already waits in as many publish calls as it may.
    AllocationOverLimit,
}

impl Refused {
    /// The words of the warning.
    pub fn what(self) -> &'static str {
        match self {
            Refused::RootPoolFull => "local API: host root's own connections are all in use; closing the new one",
            Refused::AllInUse => "local API: every connection for callers other than host root is in use; closing the new one",
            Refused::CallerOverLimit => "local API: this caller holds as many connections as one caller may; closing the new one",
            Refused::AllocationOverLimit => "local API: this allocation already waits in as many publish calls as it may; refusing one more (429)",
        }
    }
}

/// Warnings that a flood cannot multiply: for each kind, at most one line per interval. The
/// first refusal of a kind is logged at once; those within the interval after it are
/// counted, and the next line (or [`WarnBudget::flush`] once the interval is over) says how
/// many were not logged.
#[derive(Debug)]
pub struct WarnBudget<K> {
    interval: Duration,
    kinds: Mutex<HashMap<K, (Instant, u64)>>,
}

impl<K: std::hash::Hash + Eq + Clone> WarnBudget<K> {
    /// At most one line per kind per `interval`.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            kinds: Mutex::default(),
        }
    }

    /// One more event of `kind` at `now`: `Some(n)` when a line is due now (`n`: the events
    /// of this kind not logged since the last line), `None` when it is only counted.
    pub fn note(&self, kind: K, now: Instant) -> Option<u64> {
        let Ok(mut m) = self.kinds.lock() else {
            return None;
        };
        match m.get_mut(&kind) {
            Some((last, n)) if now.saturating_duration_since(*last) < self.interval => {
                *n += 1;
                None
            }
            Some((last, n)) => {
                *last = now;
                Some(std::mem::take(n))
            }
            None => {
                m.insert(kind, (now, 0));
                Some(0)
            }
        }
    }

    /// The kinds whose interval is over with events not logged: each with its count (taken;
    /// the interval starts again at `now`).
    pub fn flush(&self, now: Instant) -> Vec<(K, u64)> {
        let Ok(mut m) = self.kinds.lock() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (k, (last, n)) in m.iter_mut() {
            if *n > 0 && now.saturating_duration_since(*last) >= self.interval {
                out.push((k.clone(), std::mem::take(n)));
                *last = now;
            }
        }
        out
    }
}

/// Counts per key, released by [`Slot`]'s drop.
type Counts<K> = Arc<Mutex<HashMap<K, usize>>>;

/// One place in a count per key (a caller's connections, an allocation's publish calls),
/// given back when dropped.
pub struct Slot<K: std::hash::Hash + Eq> {
    counts: Counts<K>,
    key: K,
}

impl<K: std::hash::Hash + Eq> Drop for Slot<K> {
    fn drop(&mut self) {
        if let Ok(mut m) = self.counts.lock() {
            if let Some(n) = m.get_mut(&self.key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    m.remove(&self.key);
                }
            }
        }
    }
}

/// Takes a place for `key` if it holds fewer than `max`.
fn take<K: std::hash::Hash + Eq + Clone>(
    counts: &Counts<K>,
    key: K,
    max: usize,
) -> Option<Slot<K>> {
    let mut m = counts.lock().ok()?;
    let n = m.entry(key.clone()).or_insert(0);
    if *n >= max {
        return None;
    }
    *n += 1;
    Some(Slot {
        counts: counts.clone(),
        key,
    })
}

/// What a served connection holds until it ends: its place in the pools.
pub struct Ticket {
    _pool: OwnedSemaphorePermit,
    _caller: Option<Slot<CallerKey>>,
}

/// The bounds, shared by every connection of one listener.
pub struct Admission {
    others: Arc<Semaphore>,
    root: Arc<Semaphore>,
    per_caller: usize,
    per_allocation: usize,
    callers: Counts<CallerKey>,
    allocations: Counts<String>,
}

impl Admission {
    /// `max_connections` for all callers but host root together, `per_caller` for one
    /// [`CallerKey`], `root_connections` for host root alone, `per_allocation` publish calls
    /// waiting at once for one allocation.
    pub fn new(
        max_connections: usize,
        per_caller: usize,
        root_connections: usize,
        per_allocation: usize,
    ) -> Self {
        Self {
            others: Arc::new(Semaphore::new(max_connections)),
            root: Arc::new(Semaphore::new(root_connections)),
            per_caller,
            per_allocation,
            callers: Arc::default(),
            allocations: Arc::default(),
        }
    }

    /// A new connection from `caller`; `host_root` when it is root in the agent's own
    /// mount namespace (its pool is its own, so no task can take it).
    pub fn connection(&self, caller: &CallerKey, host_root: bool) -> Result<Ticket, Refused> {
        if host_root {
            return self
                .root
                .clone()
                .try_acquire_owned()
                .map(|p| Ticket {
                    _pool: p,
                    _caller: None,
                })
                .map_err(|_| Refused::RootPoolFull);
        }
        let pool = self
            .others
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refused::AllInUse)?;
        let slot =
            take(&self.callers, caller.clone(), self.per_caller).ok_or(Refused::CallerOverLimit)?;
        Ok(Ticket {
            _pool: pool,
            _caller: Some(slot),
        })
    }

    /// An authenticated publish call for `alloc_id`: held while it waits.
    pub fn publish(&self, alloc_id: &str) -> Result<Slot<String>, Refused> {
        take(&self.allocations, alloc_id.to_string(), self.per_allocation)
            .ok_or(Refused::AllocationOverLimit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(uid: u32, ns: &str) -> CallerKey {
        CallerKey {
            uid: Some(uid),
            cgroup: Some("/".into()),
            mount_ns: Some(ns.into()),
        }
    }

    #[test]
    fn one_caller_cannot_take_another_callers_or_roots_places() {
        let a = Admission::new(10, 3, 2, 1);
        let flood = key(65534, "mnt:[1]");
        let held: Vec<_> = (0..3)
            .map(|_| a.connection(&flood, false).unwrap())
            .collect();
        assert_eq!(
            a.connection(&flood, false).err(),
            Some(Refused::CallerOverLimit)
        );
        // Same UID, another task (mount namespace): its own share.
        let other = a.connection(&key(65534, "mnt:[2]"), false).unwrap();
        let r1 = a.connection(&key(0, "mnt:[0]"), true).unwrap();
        let _r2 = a.connection(&key(0, "mnt:[0]"), true).unwrap();
        assert_eq!(
            a.connection(&key(0, "mnt:[0]"), true).err(),
            Some(Refused::RootPoolFull)
        );
        drop(r1);
        assert!(a.connection(&key(0, "mnt:[0]"), true).is_ok());
        drop(held);
        drop(other);
        assert!(a.connection(&flood, false).is_ok());
        // The overall cap.
        let many: Vec<_> = (0..10)
            .map(|i| a.connection(&key(1, &format!("mnt:[{i}]")), false).unwrap())
            .collect();
        assert_eq!(
            a.connection(&key(2, "mnt:[x]"), false).err(),
            Some(Refused::AllInUse)
        );
        drop(many);
        let p = a.publish("alloc").unwrap();
        assert_eq!(a.publish("alloc").err(), Some(Refused::AllocationOverLimit));
        assert!(a.publish("other").is_ok());
        drop(p);
        assert!(a.publish("alloc").is_ok());
    }

    #[test]
    fn warnings_are_one_per_interval_per_kind_with_the_count() {
        let b = WarnBudget::new(Duration::from_secs(10));
        let t = Instant::now();
        assert_eq!(b.note("a", t), Some(0));
        assert_eq!(b.note("b", t), Some(0));
        for i in 1..=500 {
            assert_eq!(b.note("a", t + Duration::from_millis(i)), None);
        }
        assert!(b.flush(t + Duration::from_secs(5)).is_empty());
        assert_eq!(b.flush(t + Duration::from_secs(10)), vec![("a", 500)]);
        assert_eq!(b.note("a", t + Duration::from_secs(11)), None);
        assert_eq!(b.note("a", t + Duration::from_secs(20)), Some(1));
    }

    #[test]
    fn the_cgroup_v2_path_is_read_from_its_line() {
        assert_eq!(
            cgroup_path("0::/nomad.slice/a.b.scope\n"),
            "/nomad.slice/a.b.scope"
        );
        assert_eq!(
            cgroup_path("12:pids:/x\n1:name=systemd:/y\n"),
            "12:pids:/x\n1:name=systemd:/y"
        );
    }
}
