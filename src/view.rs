//! The allocations on this node, as the watcher last saw them.
//!
//! The view is `complete` only after a full list of the node's allocations; until then,
//! absence proves nothing and nothing destructive may be planned from it.

use crate::nomad::types::Allocation;
use crate::volume::{VolumeKey, VolumeRecord, VolumeState};
use std::collections::BTreeMap;

/// This node's allocations by ID.
#[derive(Debug, Default, Clone)]
pub struct View {
    complete: bool,
    index: u64,
    allocs: BTreeMap<String, Allocation>,
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

    /// Replaces everything with a full list taken at `index`. Jobs already known are kept
    /// for allocations whose listing lacks one.
    pub fn replace_all(&mut self, list: Vec<Allocation>, index: u64) {
        let mut old = std::mem::take(&mut self.allocs);
        for mut a in list {
            if a.job.is_none() {
                a.job = old.remove(&a.id).and_then(|o| o.job);
            }
            self.allocs.insert(a.id.clone(), a);
        }
        self.complete = true;
        self.index = index;
    }

    /// Applies one allocation update (an event payload or a fresh read). A payload without
    /// a Job keeps the Job already known. Stale updates (lower ModifyIndex) are ignored.
    pub fn upsert(&mut self, mut a: Allocation) {
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

    /// Forgets an allocation (read back as 404: garbage-collected or purged).
    pub fn remove(&mut self, id: &str) {
        self.allocs.remove(id);
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
