//! Who may hold a connection to the local API, and how many: per-caller fairness that one
//! task cannot exhaust, a cap for all callers together, a pool of its own for host root, a
//! share kept for every allocation that has authenticated, a bound on the publish calls one
//! allocation waits in at once, and warnings about refused callers at most one per interval
//! per kind.
//!
//! Before authentication the agent tells callers apart by what a task cannot change: the
//! cgroup of the process that connected ([`CallerKey`], [`crate::node::identity`]). Every
//! process in a Nomad task's cgroup is its allocation's, whatever its UID or mount
//! namespace: a root task that forks children under many UIDs, or makes new mount
//! namespaces, is still one caller. A process in no task cgroup is told apart by its UID,
//! its cgroup and its mount namespace. After authentication the workload identity names the
//! allocation: [`Admission::authenticated`] keeps a share of connections for it that no
//! flood can take, and [`Admission::publish`] bounds its waits.

use crate::node::identity::{NodeCgroups, Whose};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What tells one caller from another before it has authenticated, from the process that
/// connected (the connection's `SO_PEERCRED` pid).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CallerKey {
    /// A process in a task cgroup of this node's Nomad client: its allocation, whatever
    /// its UID and mount namespace.
    Allocation(String),
    /// A process in a docker container's cgroup: the container (its ID).
    Container(String),
    /// Any other process: its UID, cgroup and mount namespace (`None` when they could not
    /// be read, e.g. the process already exited: such callers of one UID share one key).
    Process {
        uid: Option<u32>,
        /// `/proc/<pid>/cgroup`, the cgroup v2 line's path (or the whole file on cgroups
        /// v1).
        cgroup: Option<String>,
        /// `/proc/<pid>/ns/mnt`, e.g. `mnt:[4026531841]`.
        mount_ns: Option<String>,
    },
}

impl CallerKey {
    /// The key of the process `pid` running as `uid`, with this node's task cgroups `node`
    /// (the agent passes [`crate::node::identity::node`]).
    pub fn of(uid: Option<u32>, pid: Option<i32>, node: &NodeCgroups) -> Self {
        let pid = pid.filter(|p| *p > 0);
        let text = pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/cgroup")).ok());
        match text
            .as_deref()
            .map(|t| crate::node::identity::of_cgroup(t, node))
        {
            Some(Whose::Task { alloc_id, .. }) => return Self::Allocation(alloc_id),
            Some(Whose::Container { id }) => return Self::Container(id),
            _ => {}
        }
        let mount_ns = pid
            .and_then(|p| std::fs::read_link(format!("/proc/{p}/ns/mnt")).ok())
            .map(|l| l.to_string_lossy().into_owned());
        Self::Process {
            uid,
            cgroup: text.as_deref().map(cgroup_path),
            mount_ns,
        }
    }
}

impl std::fmt::Display for CallerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let unknown = "unknown";
        match self {
            CallerKey::Allocation(a) => write!(f, "allocation {a}"),
            CallerKey::Container(c) => write!(f, "container {c}"),
            CallerKey::Process {
                uid,
                cgroup,
                mount_ns,
            } => write!(
                f,
                "uid {} cgroup {} {}",
                uid.map(|u| u.to_string()).unwrap_or_else(|| unknown.into()),
                crate::escape::escape_control(cgroup.as_deref().unwrap_or(unknown)),
                mount_ns.as_deref().unwrap_or("mnt:unknown"),
            ),
        }
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

/// What a served connection holds until it ends: its place in the pools (one of host
/// root's, every other caller's, or the share kept for its allocation).
pub struct Ticket {
    _pool: Option<OwnedSemaphorePermit>,
    _kept: Option<Slot<String>>,
    _caller: Option<Slot<CallerKey>>,
}

/// The allocations that have authenticated, most recent last, at most [`KNOWN_MAX`].
type Known = Mutex<VecDeque<String>>;

/// How many authenticated allocations keep a share: the oldest is forgotten beyond (a node
/// runs far fewer allocations at once).
pub const KNOWN_MAX: usize = 4096;

/// The bounds, shared by every connection of one listener.
pub struct Admission {
    others: Arc<Semaphore>,
    root: Arc<Semaphore>,
    per_caller: usize,
    per_allocation: usize,
    kept_per_allocation: usize,
    callers: Counts<CallerKey>,
    allocations: Counts<String>,
    kept: Counts<String>,
    known: Known,
}

impl Admission {
    /// `max_connections` for all callers but host root together, `per_caller` for one
    /// [`CallerKey`], `root_connections` for host root alone, `per_allocation` publish calls
    /// waiting at once for one allocation, and `kept_per_allocation` connections kept for
    /// each allocation that has authenticated, beyond `max_connections` (taken only when
    /// those are all in use).
    pub fn new(
        max_connections: usize,
        per_caller: usize,
        root_connections: usize,
        per_allocation: usize,
        kept_per_allocation: usize,
    ) -> Self {
        Self {
            others: Arc::new(Semaphore::new(max_connections)),
            root: Arc::new(Semaphore::new(root_connections)),
            per_caller,
            per_allocation,
            kept_per_allocation,
            callers: Arc::default(),
            allocations: Arc::default(),
            kept: Arc::default(),
            known: Mutex::default(),
        }
    }

    /// A caller whose workload identity names `alloc_id` was verified: when its cgroup names
    /// the same allocation (`caller`), the allocation keeps a share of connections from now
    /// on, which callers of other keys cannot take. A token presented from another cgroup
    /// earns nothing.
    pub fn authenticated(&self, alloc_id: &str, caller: &CallerKey) {
        if *caller != CallerKey::Allocation(alloc_id.to_string()) {
            return;
        }
        let Ok(mut known) = self.known.lock() else {
            return;
        };
        if let Some(i) = known.iter().position(|a| a == alloc_id) {
            known.remove(i);
        } else if known.len() >= KNOWN_MAX {
            known.pop_front();
        }
        known.push_back(alloc_id.to_string());
    }

    fn is_known(&self, alloc_id: &str) -> bool {
        self.known
            .lock()
            .is_ok_and(|k| k.iter().any(|a| a == alloc_id))
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
                    _pool: Some(p),
                    _kept: None,
                    _caller: None,
                })
                .map_err(|_| Refused::RootPoolFull);
        }
        let slot =
            take(&self.callers, caller.clone(), self.per_caller).ok_or(Refused::CallerOverLimit)?;
        let (pool, kept) = match self.others.clone().try_acquire_owned() {
            Ok(p) => (Some(p), None),
            Err(_) => match caller {
                CallerKey::Allocation(a) if self.is_known(a) => {
                    let kept = take(&self.kept, a.clone(), self.kept_per_allocation)
                        .ok_or(Refused::AllInUse)?;
                    (None, Some(kept))
                }
                _ => return Err(Refused::AllInUse),
            },
        };
        Ok(Ticket {
            _pool: pool,
            _kept: kept,
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
        CallerKey::Process {
            uid: Some(uid),
            cgroup: Some("/".into()),
            mount_ns: Some(ns.into()),
        }
    }

    const A: &str = "0b9a3c2e-1111-4000-8000-00000000000a";
    const B: &str = "0b9a3c2e-1111-4000-8000-00000000000b";

    #[test]
    fn one_caller_cannot_take_another_callers_or_roots_places() {
        let a = Admission::new(10, 3, 2, 1, 2);
        let flood = key(65534, "mnt:[1]");
        let held: Vec<_> = (0..3)
            .map(|_| a.connection(&flood, false).unwrap())
            .collect();
        assert_eq!(
            a.connection(&flood, false).err(),
            Some(Refused::CallerOverLimit)
        );
        // Same UID, another process outside any task (mount namespace): its own share.
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

    /// Every process of a task's cgroup is its allocation, whatever its UID or mount
    /// namespace; a process elsewhere is its UID, cgroup and namespace.
    #[test]
    fn a_task_cgroup_is_one_caller_whatever_the_uid() {
        let node = NodeCgroups::default();
        let mine = format!("0::/nomad.slice/share.slice/{A}.app.scope\n");
        let w = crate::node::identity::of_cgroup(&mine, &node);
        assert_eq!(w.alloc_id(), Some(A));
        // The process of this test: no task's.
        let me = CallerKey::of(Some(0), Some(std::process::id() as i32), &node);
        assert!(
            matches!(me, CallerKey::Process { uid: Some(0), .. }),
            "{me:?}"
        );
        assert_eq!(
            CallerKey::of(Some(7), None, &node),
            CallerKey::Process {
                uid: Some(7),
                cgroup: None,
                mount_ns: None
            }
        );
    }

    /// An allocation that has authenticated keeps its share when every other place is
    /// taken; one that has not, or a token shown from another cgroup, does not.
    #[test]
    fn an_authenticated_allocation_keeps_a_share_when_the_pool_is_full() {
        let a = Admission::new(4, 4, 1, 1, 2);
        let (ka, kb) = (
            CallerKey::Allocation(A.into()),
            CallerKey::Allocation(B.into()),
        );
        a.authenticated(A, &ka);
        // B's token shown by a process outside B's cgroup earns B nothing.
        a.authenticated(B, &key(0, "mnt:[9]"));
        let flood: Vec<_> = (0..4)
            .map(|i| a.connection(&key(1, &format!("mnt:[{i}]")), false).unwrap())
            .collect();
        assert_eq!(a.connection(&kb, false).err(), Some(Refused::AllInUse));
        let kept: Vec<_> = (0..2).map(|_| a.connection(&ka, false).unwrap()).collect();
        assert_eq!(a.connection(&ka, false).err(), Some(Refused::AllInUse));
        drop(kept);
        assert!(a.connection(&ka, false).is_ok());
        drop(flood);
        assert!(a.connection(&kb, false).is_ok());
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
