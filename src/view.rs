//! The allocations on this node, as the watcher last saw them.
//!
//! The view is `complete` only after a full list of the node's allocations; until then,
//! absence proves nothing and nothing destructive may be planned from it.

use crate::nomad::types::Allocation;
use crate::volume::{VolumeKey, VolumeRecord, VolumeState};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Extra time, beyond an allocation's kill grace, before a vanished allocation counts as
/// gone.
pub const DEPARTURE_MARGIN: Duration = Duration::from_secs(5);

/// This node's allocations by ID.
#[derive(Debug, Default, Clone)]
pub struct View {
    complete: bool,
    index: u64,
    allocs: BTreeMap<String, Allocation>,
    /// Allocations that vanished from Nomad (purge, GC) while their tasks were last seen
    /// running: kept (as live) until the deadline, while the client kills their tasks.
    departing: BTreeMap<String, Instant>,
}

/// One deferred volume an allocation needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub volume: VolumeKey,
    /// The group's `volume { read_only }`.
    pub read_only: bool,
}

impl View {
    /// True once a full list has been applied.
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// The index of the last full list or event applied.
    pub fn index(&self) -> u64 {
        self.index
    }

    /// The allocations.
    pub fn allocs(&self) -> &BTreeMap<String, Allocation> {
        &self.allocs
    }

    /// Replaces everything with a full list taken at `index`, at `now`. Jobs already known
    /// are kept for allocations whose listing lacks one. Allocations missing from the list
    /// whose tasks were last seen running become departing (see [`View::remove_at`]).
    pub fn replace_all_at(&mut self, list: Vec<Allocation>, index: u64, now: Instant) {
        let mut old = std::mem::take(&mut self.allocs);
        for mut a in list {
            self.departing.remove(&a.id);
            if a.job.is_none() {
                a.job = old.remove(&a.id).and_then(|o| o.job);
            } else {
                old.remove(&a.id);
            }
            self.allocs.insert(a.id.clone(), a);
        }
        for (id, a) in old {
            if !a.tasks_finished() {
                let deadline = self
                    .departing
                    .get(&id)
                    .copied()
                    .unwrap_or(now + a.kill_grace() + DEPARTURE_MARGIN);
                self.departing.insert(id.clone(), deadline);
                self.allocs.insert(id, a);
            } else {
                self.departing.remove(&id);
            }
        }
        self.complete = true;
        self.index = index;
    }

    /// Applies one allocation update (an event payload or a fresh read). A payload without
    /// a Job keeps the Job already known. Stale updates (lower ModifyIndex) are ignored.
    pub fn upsert(&mut self, mut a: Allocation) {
        self.departing.remove(&a.id);
        if let Some(old) = self.allocs.get(&a.id) {
            if a.modify_index != 0 && a.modify_index < old.modify_index {
                return;
            }
            if a.job.is_none() {
                a.job = old.job.clone();
            }
        }
        self.index = self.index.max(a.modify_index);
        self.allocs.insert(a.id.clone(), a);
    }

    /// An allocation read back as 404 (garbage-collected or purged: Nomad sends no event),
    /// at `now`. If its tasks were last seen running, the client may still be killing them:
    /// it stays live until its kill grace has passed ([`Allocation::kill_grace`]), then goes.
    pub fn remove_at(&mut self, id: &str, now: Instant) {
        match self.allocs.get(id) {
            Some(a) if !a.tasks_finished() => {
                let deadline = now + a.kill_grace() + DEPARTURE_MARGIN;
                self.departing.entry(id.to_string()).or_insert(deadline);
            }
            _ => {
                self.allocs.remove(id);
                self.departing.remove(id);
            }
        }
    }

    /// Drops departing allocations whose deadline has passed. Returns how many went.
    pub fn expire(&mut self, now: Instant) -> usize {
        let due: Vec<String> = self
            .departing
            .iter()
            .filter(|(_, d)| **d <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &due {
            self.departing.remove(id);
            self.allocs.remove(id);
        }
        due.len()
    }

    /// Number of departing allocations (status output).
    pub fn departing(&self) -> usize {
        self.departing.len()
    }

    /// True when the allocation is known and its tasks may still run on this node.
    pub fn is_live(&self, id: &str) -> bool {
        self.allocs.get(id).is_some_and(|a| !a.tasks_finished())
    }
}

/// The deferred volumes an allocation's group requests: host volumes whose source
/// (with the allocation's `[N]` suffix for `per_alloc`) names a volume record in the
/// allocation's namespace that is created (`ready`, or `deleting` while still in use).
pub fn requests(alloc: &Allocation, volumes: &BTreeMap<VolumeKey, VolumeRecord>) -> Vec<Request> {
    let Some(group) = alloc.group() else {
        return Vec::new();
    };
    let mut out: Vec<Request> = Vec::new();
    for req in group.volumes.values() {
        if req.volume_type != "host" {
            continue;
        }
        let source = if req.per_alloc {
            match alloc.alloc_suffix() {
                Some(sfx) => format!("{}{}", req.source, sfx),
                None => continue,
            }
        } else {
            req.source.clone()
        };
        let key = VolumeKey {
            namespace: alloc.namespace.clone(),
            name: source,
        };
        let usable = volumes
            .get(&key)
            .is_some_and(|v| matches!(v.state, VolumeState::Ready | VolumeState::Deleting));
        if usable {
            match out.iter_mut().find(|r| r.volume == key) {
                // Two aliases of one volume: writable wins.
                Some(r) => r.read_only &= req.read_only,
                None => out.push(Request {
                    volume: key,
                    read_only: req.read_only,
                }),
            }
        }
    }
    out
}
