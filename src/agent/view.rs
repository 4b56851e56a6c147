//! The allocations on this node, as the watcher last saw them.
//!
//! The view is `complete` only after a full list of the node's allocations; until then,
//! absence proves nothing and nothing destructive may be planned from it.

use crate::nomad::types::{Allocation, Job, Text};
use crate::volume::{VolumeKey, VolumeState};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Extra time, beyond an allocation's kill grace, before a vanished allocation counts as
/// gone.
pub const DEPARTURE_MARGIN: Duration = Duration::from_secs(5);

/// This node's allocations by ID.
#[derive(Debug, Default, Clone)]
pub struct View {
    complete: bool,
    index: u64,
    /// Boxed: a map node holds eleven entries, so an unboxed `Allocation` (about 340
    /// bytes) would make each half-full node cost kilobytes (docs/scale.md, memory per
    /// allocation).
    allocs: BTreeMap<Arc<str>, Box<Allocation>>,
    /// Allocations that vanished from Nomad (purge, GC) while their tasks were last seen
    /// running: kept (as live) until the deadline, while the client kills their tasks.
    departing: BTreeMap<String, Instant>,
    /// Volume → the allocations whose group names it (whatever the catalogue says),
    /// maintained with every change: the plan finds a volume's allocations without a scan.
    /// Each set is a sorted `Vec` (most volumes have one allocation: a `BTreeSet` would
    /// allocate a node of eleven slots for it).
    needing: BTreeMap<VolumeKey, Vec<Arc<str>>>,
    /// What changed since [`View::take_changes`].
    changes: Changes,
    /// Allocations that left the view finished, with their last ModifyIndex: an older
    /// list or event that still shows them running is stale, never a reason to publish
    /// again. At most [`FINISHED_KEPT`], the oldest dropped first.
    finished: BTreeMap<Arc<str>, u64>,
    /// One reduced Job per (namespace, job, version, group), shared by every allocation
    /// whose reduced Job equals it: the allocations of one job version (a `count` of 1,000
    /// with `per_alloc` volumes) keep one copy, not one each. An entry goes with the last
    /// allocation that shares it.
    jobs: BTreeMap<JobKey, Arc<Job>>,
    /// The node ID the allocations share (all are of this node): one copy, not one per
    /// allocation.
    node: Option<Arc<str>>,
}

/// (namespace, job ID, job version, task group): where [`View`] looks for a Job to share.
type JobKey = (Text, Text, u64, Text);

fn job_key(a: &Allocation) -> Option<JobKey> {
    let j = a.job.as_ref()?;
    Some((
        j.namespace.clone(),
        j.id.clone(),
        j.version,
        a.task_group.clone(),
    ))
}

/// What changed in the view since the last [`View::take_changes`]: the planner replans
/// only these (a relist replans everything).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    /// A full list replaced the view.
    pub relisted: bool,
    /// Allocations added, changed or removed.
    pub allocs: BTreeSet<String>,
    /// Volumes named by those allocations, before and after the change.
    pub volumes: BTreeSet<VolumeKey>,
}

/// How many finished allocations the view remembers (stale-list protection).
pub const FINISHED_KEPT: usize = 4096;

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
    pub fn allocs(&self) -> &BTreeMap<Arc<str>, Box<Allocation>> {
        &self.allocs
    }

    /// Replaces everything with a full list taken at `index`, at `now`. Each Job is reduced to
    /// the allocation's own group ([`Allocation::keep_own_group`]). Jobs already known
    /// are kept for allocations whose listing lacks one. Allocations missing from the list
    /// whose tasks were last seen running become departing (see [`View::remove_at`]).
    ///
    /// A list never brings back what a newer state finished: an allocation listed running
    /// with a lower ModifyIndex than a finished state already known keeps the known one,
    /// and one that left the view finished is not brought back by an older list.
    pub fn replace_all_at(&mut self, list: Vec<Allocation>, index: u64, now: Instant) {
        let mut old = std::mem::take(&mut self.allocs);
        for mut a in list {
            a.keep_own_group();
            if self.is_stale(&a) {
                continue;
            }
            match old.remove(&*a.id) {
                // Back to running from a finished state seen at a newer index: stale.
                Some(o)
                    if a.modify_index != 0
                        && a.modify_index < o.modify_index
                        && o.tasks_finished()
                        && !a.tasks_finished() =>
                {
                    self.allocs.insert(o.id.clone(), o);
                    continue;
                }
                Some(o) if a.job.is_none() => a.job = o.job,
                _ => {}
            }
            self.departing.remove(&*a.id);
            self.share_job(&mut a);
            self.share_node(&mut a);
            self.allocs.insert(a.id.clone(), Box::new(a));
        }
        for (id, a) in old {
            if !a.tasks_finished() {
                let deadline = self
                    .departing
                    .get(&*id)
                    .copied()
                    .unwrap_or(now + a.kill_grace() + DEPARTURE_MARGIN);
                self.departing.insert(id.to_string(), deadline);
                self.allocs.insert(id, a);
            } else {
                self.departing.remove(&*id);
                self.forget_finished(&a);
            }
        }
        self.jobs.retain(|_, j| Arc::strong_count(j) > 1);
        self.complete = true;
        self.index = index;
        self.needing.clear();
        for (id, a) in &self.allocs {
            for key in named_volumes(a) {
                add_sorted(self.needing.entry(key).or_default(), id);
            }
        }
        self.changes.relisted = true;
    }

    /// True when `a` shows tasks running that were already seen finished, at a newer
    /// index: it would bring back (and publish for) an allocation that is done. (Going the
    /// other way, an older state that says finished, is taken: a snapshot restore is the
    /// truth, and no volume is unpublished while a process still uses it, see
    /// `crate::node::holders`.)
    fn is_stale(&self, a: &Allocation) -> bool {
        !a.tasks_finished()
            && self
                .finished
                .get(&*a.id)
                .is_some_and(|i| a.modify_index <= *i)
    }

    /// Remembers that `a` left the view finished (bounded).
    fn forget_finished(&mut self, a: &Allocation) {
        self.finished.insert(a.id.clone(), a.modify_index);
        if self.finished.len() > FINISHED_KEPT {
            if let Some(oldest) = self
                .finished
                .iter()
                .min_by_key(|(_, i)| **i)
                .map(|(id, _)| id.clone())
            {
                self.finished.remove(&oldest);
            }
        }
    }

    /// Applies one allocation update (an event payload or a fresh read). A payload without
    /// a Job keeps the Job already known; a Job is reduced to the allocation's own group. Stale updates (lower ModifyIndex) are ignored.
    pub fn upsert(&mut self, mut a: Allocation) {
        a.keep_own_group();
        if self.is_stale(&a) {
            return;
        }
        self.departing.remove(&*a.id);
        if let Some((id, old)) = self.allocs.get_key_value(&*a.id) {
            if a.modify_index != 0 && a.modify_index < old.modify_index {
                return;
            }
            if a.job.is_none() {
                a.job = old.job.clone();
            }
            // The map keeps its key on an insert: the update takes that copy of the ID.
            a.id = Arc::clone(id);
        }
        self.index = self.index.max(a.modify_index);
        let id = a.id.clone();
        self.touch(&id);
        for key in named_volumes(&a) {
            self.changes.volumes.insert(key.clone());
            add_sorted(self.needing.entry(key).or_default(), &id);
        }
        self.share_job(&mut a);
        self.share_node(&mut a);
        if let Some(old) = self.allocs.insert(id, Box::new(a)) {
            self.release_job(*old);
        }
    }

    /// Gives `a` the Job already kept for its (namespace, job, version, group) when the two
    /// are equal; else keeps `a`'s as the one to share.
    fn share_job(&mut self, a: &mut Allocation) {
        let (Some(key), Some(job)) = (job_key(a), a.job.as_ref()) else {
            return;
        };
        match self.jobs.get(&key) {
            Some(known) if Arc::ptr_eq(known, job) => {}
            Some(known) if **known == **job => a.job = Some(Arc::clone(known)),
            _ => {
                self.jobs.insert(key, Arc::clone(job));
            }
        }
    }

    /// Gives `a` the node ID the view keeps when it is the same; else keeps `a`'s as the
    /// one to share.
    fn share_node(&mut self, a: &mut Allocation) {
        match &self.node {
            Some(n) if **n == *a.node_id => a.node_id = Arc::clone(n),
            _ => self.node = Some(Arc::clone(&a.node_id)),
        }
    }

    /// Drops `a` (an allocation that left the view or was replaced), and its shared Job
    /// with it when no other allocation holds that Job.
    fn release_job(&mut self, a: Allocation) {
        let key = job_key(&a);
        drop(a);
        if let Some(key) = key {
            if self
                .jobs
                .get(&key)
                .is_some_and(|j| Arc::strong_count(j) == 1)
            {
                self.jobs.remove(&key);
            }
        }
    }

    /// Takes what changed since the last call.
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    /// Every volume some allocation of this node names, whether or not a record exists.
    pub fn named_volumes(&self) -> impl Iterator<Item = &VolumeKey> + '_ {
        self.needing.keys()
    }

    /// The IDs of the allocations whose group names `volume` (live or not, usable or
    /// not: the plan checks), in ID order.
    pub fn needing(&self, volume: &VolumeKey) -> impl Iterator<Item = &Arc<str>> + '_ {
        self.needing.get(volume).into_iter().flatten()
    }

    /// Records a change of allocation `id` (its volumes, as they were, are changed too)
    /// and drops it from the index; the caller indexes it again if it stays.
    fn touch(&mut self, id: &str) {
        self.changes.allocs.insert(id.to_string());
        let Some(old) = self.allocs.get(id) else {
            return;
        };
        for key in named_volumes(old) {
            if let Some(ids) = self.needing.get_mut(&key) {
                if let Ok(i) = ids.binary_search_by(|x| (**x).cmp(id)) {
                    ids.remove(i);
                }
                if ids.is_empty() {
                    self.needing.remove(&key);
                }
            }
            self.changes.volumes.insert(key);
        }
    }

    /// Removes allocation `id` from the view and the index.
    fn drop_alloc(&mut self, id: &str) {
        self.touch(id);
        if let Some(a) = self.allocs.remove(id) {
            self.forget_finished(&a);
            self.release_job(*a);
        }
        self.departing.remove(id);
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
            _ => self.drop_alloc(id),
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
            self.drop_alloc(id);
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

/// Adds `id` to a sorted set of allocation IDs, once.
fn add_sorted(ids: &mut Vec<Arc<str>>, id: &Arc<str>) {
    if let Err(i) = ids.binary_search_by(|x| (**x).cmp(id)) {
        if ids.is_empty() {
            ids.reserve_exact(1);
        }
        ids.insert(i, Arc::clone(id));
    }
}

/// The deferred volumes an allocation's group requests: host volumes whose source
/// (with the allocation's `[N]` suffix for `per_alloc`) names a volume record in the
/// allocation's namespace that is created (`ready`, or `deleting` while still in use).
pub fn requests(alloc: &Allocation, volumes: &crate::cluster::catalog::Catalogue) -> Vec<Request> {
    let mut out: Vec<Request> = Vec::new();
    for (key, read_only) in host_sources(alloc) {
        let usable = volumes
            .get(&key)
            .is_some_and(|v| matches!(v.state, VolumeState::Ready | VolumeState::Deleting));
        if usable {
            match out.iter_mut().find(|r| r.volume == key) {
                // Two aliases of one volume: writable wins.
                Some(r) => r.read_only &= read_only,
                None => out.push(Request {
                    volume: key,
                    read_only,
                }),
            }
        }
    }
    out
}

/// The volumes an allocation's group names as host volume sources (with the `[N]` suffix
/// for `per_alloc`), whether or not a record exists: what the view indexes.
pub fn named_volumes(alloc: &Allocation) -> BTreeSet<VolumeKey> {
    host_sources(alloc).map(|(k, _)| k).collect()
}

/// The group's host volume requests as (volume, read_only), one per request.
/// True when `alloc`'s group mounts the host volume named like `key` (whatever its record
/// says now): the allocation's tasks see that placeholder.
pub fn mounts_source(alloc: &Allocation, key: &VolumeKey) -> bool {
    host_sources(alloc).any(|(k, _)| &k == key)
}

fn host_sources(alloc: &Allocation) -> impl Iterator<Item = (VolumeKey, bool)> + '_ {
    alloc
        .group()
        .into_iter()
        .flat_map(|g| g.volumes.values())
        .filter(|req| req.volume_type == "host")
        .filter_map(|req| {
            let name = if req.per_alloc {
                format!("{}{}", req.source, alloc.alloc_suffix()?)
            } else {
                req.source.to_string()
            };
            let key = VolumeKey {
                namespace: alloc.namespace.clone().into(),
                name: name.into(),
            };
            Some((key, req.read_only))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nomad::types::{Job, TaskGroup};

    fn alloc(id: &str, group: &str) -> Allocation {
        let groups = ["cache", "web", "db"].map(|name| TaskGroup {
            name: name.into(),
            ..Default::default()
        });
        Allocation {
            id: id.into(),
            task_group: group.into(),
            modify_index: 1,
            job: Some(std::sync::Arc::new(Job {
                task_groups: groups.to_vec(),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    fn groups_kept(v: &View, id: &str) -> Vec<String> {
        let job = v.allocs()[id].job.as_ref().expect("the Job is kept");
        job.task_groups.iter().map(|g| g.name.to_string()).collect()
    }

    /// Issue 50 (memory): allocations whose reduced Jobs are equal share one; a Job that
    /// differs (another version's group) is not shared, and a shared Job goes with the last
    /// allocation that holds it.
    #[test]
    fn allocations_of_one_job_version_share_its_job() {
        let mut v = View::default();
        v.replace_all_at(
            vec![alloc("a", "web"), alloc("b", "web")],
            1,
            Instant::now(),
        );
        v.upsert(alloc("c", "web"));
        let job = |v: &View, id: &str| v.allocs()[id].job.clone().expect("a Job");
        assert!(Arc::ptr_eq(&job(&v, "a"), &job(&v, "b")));
        assert!(Arc::ptr_eq(&job(&v, "a"), &job(&v, "c")));
        // Same version, but another group: not the same reduced Job.
        v.upsert(alloc("d", "db"));
        assert!(!Arc::ptr_eq(&job(&v, "a"), &job(&v, "d")));
        // Same key, other content (a Job changed without a new version): kept apart.
        let mut other = alloc("e", "web");
        Arc::make_mut(other.job.as_mut().unwrap()).job_type = "batch".into();
        v.upsert(other);
        assert!(!Arc::ptr_eq(&job(&v, "a"), &job(&v, "e")));
        assert_eq!(job(&v, "e").job_type, "batch");
        // Gone with the last allocation that holds it.
        let t = Instant::now();
        v.replace_all_at(vec![], 2, t);
        v.expire(t + Duration::from_secs(3600));
        assert!(v.allocs().is_empty());
        assert!(v.jobs.is_empty(), "{:?}", v.jobs.keys());
    }

    /// Issue 50 (memory): the allocations of the view, all of one node, share one copy of
    /// its ID; and each allocation's ID is one string for the allocation and the map, also
    /// after an update that brought another copy of it.
    #[test]
    fn the_allocations_share_one_node_id_and_each_its_own_id() {
        let on_node = |id: &str| Allocation {
            node_id: format!("node-{}", "1").into(),
            job: None,
            ..alloc(id, "web")
        };
        let mut v = View::default();
        v.replace_all_at(vec![on_node("a"), on_node("b")], 1, Instant::now());
        v.upsert(on_node("c"));
        let node = |id: &str| Arc::clone(&v.allocs()[id].node_id);
        assert_eq!(&*node("a"), "node-1");
        assert!(Arc::ptr_eq(&node("a"), &node("b")));
        assert!(Arc::ptr_eq(&node("a"), &node("c")));
        let (key, a) = v.allocs().get_key_value("c").expect("c is kept");
        assert!(
            Arc::ptr_eq(key, &a.id),
            "the map's key is the allocation's ID"
        );
        let first = Arc::clone(key);
        let mut again = on_node("c");
        again.modify_index = 2;
        assert!(!Arc::ptr_eq(&again.id, &first));
        v.upsert(again);
        let (key, a) = v.allocs().get_key_value("c").expect("c is kept");
        assert_eq!(a.modify_index, 2, "the update is applied");
        assert!(Arc::ptr_eq(key, &first) && Arc::ptr_eq(&a.id, &first));
    }

    /// Issue 10 (memory): the view keeps of each allocation's Job only its own group.
    #[test]
    fn the_view_keeps_only_the_allocations_own_group() {
        let mut v = View::default();
        v.replace_all_at(vec![alloc("a", "web")], 1, Instant::now());
        assert_eq!(groups_kept(&v, "a"), ["web"]);
        v.upsert(alloc("b", "db"));
        assert_eq!(groups_kept(&v, "b"), ["db"]);
        // An event payload without a Job keeps the reduced one.
        v.upsert(Allocation {
            job: None,
            modify_index: 2,
            ..alloc("b", "db")
        });
        assert_eq!(groups_kept(&v, "b"), ["db"]);
    }
}

#[cfg(test)]
mod stale_tests {
    use super::*;

    fn alloc(id: &str, status: &str, index: u64) -> Allocation {
        Allocation {
            id: id.into(),
            client_status: status.into(),
            desired_status: "run".into(),
            modify_index: index,
            ..Allocation::default()
        }
    }

    /// Issue 12 input 8: an older list never undoes what a newer one established.
    #[test]
    fn a_list_that_goes_back_in_time_is_not_applied() {
        let t = Instant::now();
        let mut v = View::default();
        v.replace_all_at(vec![alloc("a", "running", 10)], 10, t);
        v.upsert(alloc("a", "complete", 12));
        // An older list (a stale server) still shows it running.
        v.replace_all_at(vec![alloc("a", "running", 10)], 11, t);
        assert_eq!(v.allocs()["a"].client_status, "complete");
        // Gone from Nomad (garbage-collected), then an old list brings it back running.
        v.replace_all_at(vec![], 13, t);
        assert!(!v.allocs().contains_key("a"));
        v.replace_all_at(vec![alloc("a", "running", 10)], 9, t);
        assert!(
            !v.allocs().contains_key("a"),
            "a finished allocation came back"
        );
        v.upsert(alloc("a", "running", 11));
        assert!(!v.allocs().contains_key("a"));
        // A newer state of it is taken.
        v.upsert(alloc("a", "complete", 14));
        assert!(v.allocs().contains_key("a"));
    }
}
