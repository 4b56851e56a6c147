//! The reconcile plan: a pure function from what is known (the node's allocations, the
//! volume records, the journal, the mount table, the plugins present, the calls in flight)
//! to the steps that bring the node to the desired state. No I/O, no clock.
//!
//! Rules (design.md §5):
//! - a volume is published on this node while at least one live allocation here needs it,
//!   once, at its placeholder path; allocations are recorded as its users;
//! - a user record is dropped when its allocation's tasks are finished on this node
//!   ([`crate::nomad::types::Allocation::tasks_finished`]) or the allocation is gone, never
//!   on `DesiredStatus=stop` alone, nor on a server-side `lost` while tasks were running;
//! - a volume is unpublished when no live allocation needs it any more; a volume whose record
//!   vanished (or stopped being usable) while a recorded user's tasks still run and mount its
//!   placeholder is kept published until they finish (an empty or filtered variables list
//!   proves no deletion: `volume delete` refuses a volume in use);
//! - nothing is dropped or unpublished before the view and the volume catalogue are
//!   complete (a partial view proves no absence);
//! - a `published` record whose mount is missing is published again, never trusted;
//! - a record left `publishing`/`unpublishing` (outcome unknown) is resolved by running the
//!   idempotent call again in the direction now desired;
//! - a volume with a call in flight gets no new step (calls on one volume are serialized);
//! - a volume with a single-node access mode is published only while this node holds its
//!   claim ([`crate::cluster::claims`]); a lost claim is unpublished first, whatever else holds;
//!   a fenced one is neither published nor claimed again until a renewal decides;
//! - an allocation an operator's forced unpublish withdrew a volume from
//!   ([`crate::agent::forced`]) neither needs it nor keeps it published.

use crate::agent::view::{requests, View};
use crate::cluster::claims::is_exclusive;
use crate::node::journal::{MountRecord, MountState, UserKey};
use crate::volume::{VolumeKey, VolumeRecord};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

/// Everything the plan is computed from.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    pub view: &'a View,
    /// False until the volume records have been read once.
    pub volumes_loaded: bool,
    /// Why the volume records cannot be read, while they cannot (the reason a volume kept
    /// before they are read in full gives).
    pub records_error: Option<&'a str>,
    pub volumes: &'a crate::cluster::catalog::Catalogue,
    pub mounts: &'a crate::node::journal::Mounts,
    pub users: &'a BTreeSet<UserKey>,
    /// Mount points present in the mount table.
    pub mounted: &'a BTreeSet<PathBuf>,
    /// Plugin IDs present on this node with `deferred_bind = true`.
    pub plugins: &'a BTreeSet<String>,
    /// Volumes with a plugin or claim call in flight.
    pub busy: &'a BTreeSet<VolumeKey>,
    /// This node's claims (single-node access modes).
    pub claims: &'a BTreeMap<VolumeKey, ClaimState>,
    /// Allocations an operator's forced unpublish withdrew each volume from
    /// ([`crate::agent::forced`]): nothing is published for them, and they do not keep
    /// the volume published.
    pub withdrawn: &'a BTreeMap<VolumeKey, BTreeSet<String>>,
}

/// Where this node's claim on a volume stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimState {
    Held,
    /// Not renewed before its lease was about to end: the volume was made unwritable here
    /// ([`crate::node::fence`]); renewals go on. Nothing is published for it until a renewal
    /// succeeds (then it is published again) or finds the lock gone (then it is lost).
    Fenced,
    /// Expired or taken over: the volume must not stay published here.
    Lost,
}

/// One step for the executor.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Step {
    /// Run the plugin's `publish` for the volume (on behalf of `alloc_id`).
    Publish {
        volume: VolumeKey,
        alloc_id: String,
        read_only: bool,
    },
    /// Run the plugin's `unpublish` for the volume.
    Unpublish { volume: VolumeKey },
    /// Record an allocation as a user of a published volume (journal only).
    AddUser(UserKey),
    /// Drop a finished allocation's use of a volume (journal only).
    RemoveUser(UserKey),
    /// Take the cluster-wide claim before publishing a single-node volume.
    AcquireClaim { volume: VolumeKey },
    /// Give back a claim that nothing here uses any more.
    ReleaseClaim { volume: VolumeKey },
}

/// Why a needed step cannot be taken now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    pub volume: VolumeKey,
    pub reason: String,
}

/// The plan: steps to take now and volumes that wait.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    pub steps: Vec<Step>,
    pub waiting: Vec<Waiting>,
}

/// True when a volume is published read-only on the node: reader access modes.
pub fn publish_read_only(volume: &VolumeRecord) -> bool {
    volume.access_mode().ends_with("reader-only")
}

/// What a pass plans: everything, or only the volumes a message could affect.
#[derive(Debug, Clone, Copy)]
pub enum Scope<'a> {
    /// Every volume (the first pass, a relist, a catalogue or plugin set reload).
    All,
    /// Only these volumes. Steps of other volumes are those of the last pass (taken, or
    /// waiting on a retry, which dirties the volume again when it is due).
    Volumes {
        dirty: &'a BTreeSet<VolumeKey>,
        /// Volume → the allocations recorded as its users
        /// ([`crate::node::journal::Journal::users_by_volume`]).
        users: &'a BTreeMap<VolumeKey, Vec<std::sync::Arc<str>>>,
    },
}

/// Computes the plan for every volume. See the module documentation for the rules.
#[cfg(test)]
pub fn plan(i: Inputs<'_>) -> Plan {
    plan_in(i, Scope::All).0
}

/// Computes the plan for the volumes in `scope`, and how much it visited (allocations,
/// user records, claims and mount records looked at): the planning work of the pass, which
/// for [`Scope::Volumes`] grows with what the message touched, not with the node.
/// For the volumes in scope, the steps are exactly those of [`plan`], in the same order.
pub fn plan_in(i: Inputs<'_>, scope: Scope<'_>) -> (Plan, usize) {
    let mut plan = Plan::default();
    let mut visits = 0usize;
    let complete = i.view.is_complete() && i.volumes_loaded;

    // Live allocations' needs, by volume: (alloc, read_only) in alloc ID order.
    let mut needed: BTreeMap<VolumeKey, Vec<(Arc<str>, bool)>> = BTreeMap::new();
    match scope {
        Scope::All => {
            for (id, alloc) in i.view.allocs() {
                visits += 1;
                if alloc.tasks_finished() {
                    continue;
                }
                for r in requests(alloc, i.volumes) {
                    if withdrawn(i, &r.volume, id) {
                        continue;
                    }
                    needed
                        .entry(r.volume)
                        .or_default()
                        .push((Arc::clone(id), r.read_only));
                }
            }
        }
        Scope::Volumes { dirty, .. } => {
            for key in dirty {
                for id in i.view.needing(key) {
                    visits += 1;
                    let Some(alloc) = i.view.allocs().get(id) else {
                        continue;
                    };
                    if alloc.tasks_finished() {
                        continue;
                    }
                    if let Some(r) = requests(alloc, i.volumes)
                        .into_iter()
                        .find(|r| &r.volume == key && !withdrawn(i, key, id))
                    {
                        needed
                            .entry(r.volume)
                            .or_default()
                            .push((Arc::clone(id), r.read_only));
                    }
                }
            }
        }
    }

    // The user records, claims and mount records in scope, in key order.
    let users: Vec<UserKey> = match scope {
        Scope::All => i.users.iter().cloned().collect(),
        Scope::Volumes { dirty, users } => {
            let mut v: Vec<UserKey> = dirty
                .iter()
                .flat_map(|key| crate::node::journal::users_of(users, key))
                .collect();
            v.sort();
            v
        }
    };
    visits += users.len();
    let claims: Vec<(&VolumeKey, ClaimState)> = match scope {
        Scope::All => i.claims.iter().map(|(k, s)| (k, *s)).collect(),
        Scope::Volumes { dirty, .. } => dirty
            .iter()
            .filter_map(|k| i.claims.get(k).map(|s| (k, *s)))
            .collect(),
    };
    visits += claims.len();
    let mounts: Vec<(&VolumeKey, &MountRecord)> = match scope {
        Scope::All => i.mounts.iter().map(|(k, m)| (k, &**m)).collect(),
        Scope::Volumes { dirty, .. } => dirty
            .iter()
            .filter_map(|k| i.mounts.get_key_value(k).map(|(k, m)| (k, &**m)))
            .collect(),
    };
    visits += mounts.len();

    if complete {
        for u in users {
            if !i.view.is_live(&u.alloc_id) {
                plan.steps.push(Step::RemoveUser(u));
            }
        }
    }

    // Volumes an operator's forced unpublish withdrew from running allocations, which no
    // other allocation here needs: say why they are not published for them.
    for (key, ids) in i.withdrawn {
        if needed.contains_key(key)
            || matches!(scope, Scope::Volumes { dirty, .. } if !dirty.contains(key))
        {
            continue;
        }
        let running: Vec<&str> = ids
            .iter()
            .filter(|id| {
                i.view
                    .allocs()
                    .get(id.as_str())
                    .is_some_and(|a| !a.tasks_finished())
            })
            .map(String::as_str)
            .collect();
        if !running.is_empty() {
            plan.waiting.push(Waiting {
                volume: key.clone(),
                reason: format!(
                    "withdrawn by an operator's forced unpublish (`volume unpublish -force`) from allocation {} on this node: not published again for it while it runs; stop it (`nomad alloc stop`) and its replacement gets the volume",
                    running.join(", ")
                ),
            });
        }
    }

    // A lost claim is unpublished before anything else, even before the view is complete.
    for (key, state) in &claims {
        if *state == ClaimState::Lost && i.mounts.contains_key(key) && !i.busy.contains(key) {
            plan.steps.push(Step::Unpublish {
                volume: (*key).clone(),
            });
        }
    }
    for (key, allocs) in &needed {
        if i.busy.contains(key) {
            continue;
        }
        let Some(volume) = i.volumes.get(key) else {
            continue;
        };
        let claim = i.claims.get(key).copied();
        if claim == Some(ClaimState::Lost) && i.mounts.contains_key(key) {
            continue; // unpublished above first
        }
        if claim == Some(ClaimState::Fenced) {
            plan.waiting.push(Waiting {
                volume: key.clone(),
                reason: "fenced: this node's claim could not be renewed before its lease was about to end (another node may take it then), so the volume was made unwritable here; it is published again once a renewal succeeds, or unpublished if another node has it".into(),
            });
            continue;
        }
        let exclusive = is_exclusive(volume.access_mode());
        let claimed = !exclusive || claim == Some(ClaimState::Held);
        let healthy = i
            .mounts
            .get(key)
            .is_some_and(|m| m.state == MountState::Published && i.mounted.contains(&m.target));
        if healthy {
            let writer = single_writer(i, key, volume, allocs);
            let mut held_back = Vec::new();
            for (alloc_id, read_only) in allocs {
                if let Some(w) = &writer {
                    if !read_only && alloc_id != w {
                        held_back.push(&**alloc_id);
                        continue;
                    }
                }
                let u = UserKey {
                    alloc_id: Arc::clone(alloc_id),
                    volume: key.clone(),
                };
                if !i.users.contains(&u) {
                    plan.steps.push(Step::AddUser(u));
                }
            }
            if let (Some(w), false) = (&writer, held_back.is_empty()) {
                plan.waiting.push(Waiting {
                    volume: key.clone(),
                    reason: writer_holds(i, w, &held_back),
                });
            }
            if !claimed {
                // Published before this agent knew of claims (or the record lost its ID).
                plan.steps.push(Step::AcquireClaim {
                    volume: key.clone(),
                });
            }
        } else if !i.plugins.contains(&volume.spec.plugin_id) {
            plan.waiting.push(Waiting {
                volume: key.clone(),
                reason: format!(
                    "publish waits: plugin {:?} is not present on this node with deferred_bind",
                    volume.spec.plugin_id
                ),
            });
        } else if let Some(reason) = read_only_propagating(i, key, volume, allocs) {
            plan.waiting.push(Waiting {
                volume: key.clone(),
                reason,
            });
        } else if !claimed {
            plan.steps.push(Step::AcquireClaim {
                volume: key.clone(),
            });
        } else {
            plan.steps.push(Step::Publish {
                volume: key.clone(),
                alloc_id: allocs[0].0.to_string(),
                read_only: publish_read_only(volume),
            });
        }
    }

    // A claim nothing here needs any more is given back (an unpublish releases its own).
    for (key, state) in &claims {
        if matches!(*state, ClaimState::Held | ClaimState::Fenced)
            && !needed.contains_key(key)
            && !i.mounts.contains_key(key)
            && !i.busy.contains(key)
        {
            plan.steps.push(Step::ReleaseClaim {
                volume: (*key).clone(),
            });
        }
    }

    if complete {
        for (key, m) in mounts {
            if needed.contains_key(key)
                || i.busy.contains(key)
                || i.claims.get(key) == Some(&ClaimState::Lost)
            {
                continue;
            }
            if let Some(alloc_id) = still_mounted_by(i, scope, key) {
                plan.waiting.push(Waiting {
                    volume: key.clone(),
                    reason: format!(
                        "unpublish waits: its volume record is gone or not usable, but allocation {alloc_id} still runs with it mounted"
                    ),
                });
                continue;
            }
            if i.plugins.contains(&m.plugin_id) {
                plan.steps.push(Step::Unpublish {
                    volume: key.clone(),
                });
            } else {
                plan.waiting.push(Waiting {
                    volume: key.clone(),
                    reason: format!(
                        "pending unpublish: plugin {:?} is not present on this node; it runs when the plugin returns",
                        m.plugin_id
                    ),
                });
            }
        }
    } else {
        // Kept without proof that it is still needed: say why (docs/operations/README.md).
        let unreadable = |e: &str| format!("the volume records cannot be read ({e})");
        let why = match (i.view.is_complete(), i.volumes_loaded, i.records_error) {
            (false, false, Some(e)) => format!("this node's allocations have not been read in full yet and {}", unreadable(e)),
            (false, false, None) => "this node's allocations and the volume records have not been read in full yet".into(),
            (false, true, _) => "this node's allocations have not been listed in full yet (a list or read failed, or the agent just started)".into(),
            (true, _, Some(e)) => unreadable(e),
            _ => "the volume records have not been read in full yet (a read failed, or the agent just started)".into(),
        };
        for (key, _) in mounts {
            if needed.contains_key(key)
                || i.busy.contains(key)
                || i.claims.get(key) == Some(&ClaimState::Lost)
            {
                continue;
            }
            plan.waiting.push(Waiting {
                volume: key.clone(),
                reason: format!("kept published: {why}; nothing is unpublished until they are"),
            });
        }
    }
    (plan, visits)
}

/// The one allocation that may write `key` on this node when its access mode is
/// `single-node-single-writer` (Nomad 1.10: one writing allocation, even on one node), or
/// `None` for any other mode. The writer already recorded as a user keeps it until its
/// tasks finish on this node (an allocation told to stop whose tasks still run, or one
/// already `failed` while its poststop task runs, keeps it); otherwise the oldest writing
/// allocation (lowest create index, then ID) takes it. Readers are never held back.
fn single_writer(
    i: Inputs<'_>,
    key: &VolumeKey,
    volume: &VolumeRecord,
    allocs: &[(Arc<str>, bool)],
) -> Option<Arc<str>> {
    if volume.access_mode() != SINGLE_WRITER {
        return None;
    }
    let writers = allocs.iter().filter(|(_, ro)| !ro).map(|(id, _)| id);
    if let Some(w) = writers.clone().find(|id| {
        i.users.contains(&UserKey {
            alloc_id: Arc::clone(id),
            volume: key.clone(),
        })
    }) {
        return Some(w.clone());
    }
    writers
        .min_by_key(|id| {
            (
                i.view
                    .allocs()
                    .get(&**id)
                    .map_or(u64::MAX, |a| a.create_index),
                (*id).clone(),
            )
        })
        .cloned()
}

/// The access mode that allows one writing allocation at a time, even on one node.
pub const SINGLE_WRITER: &str = "single-node-single-writer";

/// Why writers of a `single-node-single-writer` volume wait: who holds it (job,
/// allocation, node), for their prestart and status.
/// Why a writer volume is not published here: a task of a live allocation needing it
/// mounts it read-only with `propagation_mode` `host-to-task` or `bidirectional` (issue 44
/// §4). Such a task may be bound to the placeholder before the publish, and the publish
/// would reach it as a copy with the host mount's flags, `rw`: refused while it may run.
fn read_only_propagating(
    i: Inputs<'_>,
    key: &VolumeKey,
    volume: &VolumeRecord,
    allocs: &[(Arc<str>, bool)],
) -> Option<String> {
    if publish_read_only(volume) {
        return None;
    }
    let found: Vec<String> = allocs
        .iter()
        .filter_map(|(id, _)| {
            let alloc = i.view.allocs().get(&**id)?;
            let tasks = crate::agent::gate::read_only_propagating(alloc, key);
            (!tasks.is_empty()).then(|| format!("allocation {id} task(s) {}", tasks.join(", ")))
        })
        .collect();
    if found.is_empty() {
        return None;
    }
    Some(format!(
        "publish refused: {} mount(s) this writer volume read-only with propagation_mode host-to-task or bidirectional, and a publish would reach such a task writable (a mount propagated into it carries the host mount's flags); use propagation_mode \"private\" for a read-only mount, or a reader access mode for the volume",
        found.join("; ")
    ))
}

fn writer_holds(i: Inputs<'_>, writer: &str, waiting: &[&str]) -> String {
    let (job, name, node) = i.view.allocs().get(writer).map_or_else(
        || ("?".to_string(), "?".to_string(), "?".to_string()),
        |a| {
            (
                a.job_id.to_string(),
                a.name.to_string(),
                a.node_id.to_string(),
            )
        },
    );
    format!(
        "single-node-single-writer: allocation {writer} ({name}) of job {job:?} on node {node} writes the volume; allocation {} waits until its tasks finish (one writing allocation at a time, even on one node)",
        waiting.join(", ")
    )
}

/// True when an operator's forced unpublish withdrew `key` from allocation `alloc_id`.
fn withdrawn(i: Inputs<'_>, key: &VolumeKey, alloc_id: &str) -> bool {
    i.withdrawn
        .get(key)
        .is_some_and(|ids| ids.contains(alloc_id))
}

/// A recorded user of `key` whose tasks may still run on this node and whose group still
/// mounts the volume's placeholder. Visits the volume's users only (the scope's index), or
/// every user record in a full pass.
fn still_mounted_by(i: Inputs<'_>, scope: Scope<'_>, key: &VolumeKey) -> Option<String> {
    let live = |alloc_id: &str| {
        if withdrawn(i, key, alloc_id) {
            return None;
        }
        i.view
            .allocs()
            .get(alloc_id)
            .filter(|a| !a.tasks_finished() && crate::agent::view::mounts_source(a, key))
            .map(|_| alloc_id.to_string())
    };
    match scope {
        Scope::Volumes { users, .. } => {
            users.get(key).into_iter().flatten().find_map(|id| live(id))
        }
        Scope::All => i
            .users
            .iter()
            .filter(|u| &u.volume == key)
            .find_map(|u| live(&u.alloc_id)),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! Pure tests of the plan over design.md §5, with small fixture builders.
    use super::*;
    use crate::nomad::types::{Allocation, Job, TaskGroup, VolumeRequest};
    use crate::volume::{Capability, VolumeSpec, VolumeState};

    const NODE: &str = "node-1";

    pub(crate) fn key(name: &str) -> VolumeKey {
        VolumeKey {
            namespace: "default".into(),
            name: name.into(),
        }
    }

    pub(crate) fn volume(name: &str, mode: &str) -> VolumeRecord {
        let mut r = VolumeRecord::new(
            VolumeSpec {
                name: name.into(),
                namespace: "default".into(),
                plugin_id: "bind".into(),
                capacity_min: 0,
                capacity_max: 0,
                node_pool: String::new(),
                capabilities: vec![Capability {
                    access_mode: mode.into(),
                    attachment_mode: "file-system".into(),
                }],
                parameters: Default::default(),
                source: Default::default(),
                mount_options: Default::default(),
                secret_refs: Default::default(),
                constraints: Vec::new(),
                topology_request: Default::default(),
                availability: Default::default(),
            },
            Default::default(),
        );
        r.state = VolumeState::Ready;
        r
    }

    pub(crate) fn alloc(id: &str, sources: &[&str], client: &str, desired: &str) -> Allocation {
        let volumes = sources
            .iter()
            .map(|s| {
                (
                    format!("v-{s}").into(),
                    VolumeRequest {
                        name: format!("v-{s}").into(),
                        volume_type: "host".into(),
                        source: (*s).into(),
                        ..Default::default()
                    },
                )
            })
            .collect();
        Allocation {
            id: id.into(),
            namespace: "default".into(),
            name: "job.g[0]".into(),
            node_id: NODE.into(),
            job_id: "job".into(),
            task_group: "g".into(),
            job: Some(std::sync::Arc::new(Job {
                id: "job".into(),
                namespace: "default".into(),
                job_type: "service".into(),
                version: 0,
                task_groups: vec![TaskGroup {
                    name: "g".into(),
                    volumes,
                    tasks: vec![],
                    ..Default::default()
                }],
            })),
            client_status: client.into(),
            desired_status: desired.into(),
            ..Default::default()
        }
    }

    /// Everything the planner reads, owned, with an `apply` that simulates success.
    struct World {
        view: View,
        volumes: crate::cluster::catalog::Catalogue,
        mounts: crate::node::journal::Mounts,
        users: BTreeSet<UserKey>,
        mounted: BTreeSet<PathBuf>,
        plugins: BTreeSet<String>,
        busy: BTreeSet<VolumeKey>,
        claims: BTreeMap<VolumeKey, ClaimState>,
        /// The records not read (after a restart) and why: `None` when they were read.
        records_unread: Option<Option<String>>,
        withdrawn: BTreeMap<VolumeKey, BTreeSet<String>>,
        publishes: usize,
        unpublishes: usize,
    }

    impl World {
        fn new(vols: &[VolumeRecord], allocs: Vec<Allocation>) -> Self {
            let mut view = View::default();
            view.replace_all_at(allocs, 10, std::time::Instant::now());
            Self {
                view,
                volumes: vols
                    .iter()
                    .map(|v| (v.key(), std::sync::Arc::new(v.clone())))
                    .collect(),
                mounts: BTreeMap::new(),
                users: BTreeSet::new(),
                mounted: BTreeSet::new(),
                plugins: BTreeSet::from(["bind".to_string()]),
                busy: BTreeSet::new(),
                claims: BTreeMap::new(),
                records_unread: None,
                withdrawn: BTreeMap::new(),
                publishes: 0,
                unpublishes: 0,
            }
        }

        fn plan(&self) -> Plan {
            plan(Inputs {
                view: &self.view,
                volumes_loaded: self.records_unread.is_none(),
                records_error: self.records_unread.as_ref().and_then(Option::as_deref),
                volumes: &self.volumes,
                mounts: &self.mounts,
                users: &self.users,
                mounted: &self.mounted,
                plugins: &self.plugins,
                busy: &self.busy,
                claims: &self.claims,
                withdrawn: &self.withdrawn,
            })
        }

        fn target(k: &VolumeKey) -> PathBuf {
            PathBuf::from(format!("/mnt/{}/{}", k.namespace, k.name))
        }

        /// Plans and applies until nothing is left to do; every plugin call succeeds.
        fn settle(&mut self) {
            for _ in 0..10 {
                let p = self.plan();
                if p.steps.is_empty() {
                    return;
                }
                for s in p.steps {
                    match s {
                        Step::Publish {
                            volume, read_only, ..
                        } => {
                            self.publishes += 1;
                            let t = Self::target(&volume);
                            self.mounted.insert(t.clone());
                            self.mounts.insert(
                                volume.clone(),
                                std::sync::Arc::new(MountRecord {
                                    volume_id: self.volumes[&volume].id.clone(),
                                    volume,
                                    plugin_id: "bind".into(),
                                    state: MountState::Published,
                                    target: t,
                                    read_only,
                                    publish_context: Default::default(),
                                    since: 0,
                                    last_error: String::new(),
                                    claim_id: None,
                                    mount: None,
                                }),
                            );
                        }
                        Step::Unpublish { volume } => {
                            self.unpublishes += 1;
                            let m = self.mounts.remove(&volume).unwrap();
                            self.mounted.remove(&m.target);
                            self.claims.remove(&volume);
                        }
                        Step::AcquireClaim { volume } => {
                            self.claims.insert(volume, ClaimState::Held);
                        }
                        Step::ReleaseClaim { volume } => {
                            self.claims.remove(&volume);
                        }
                        Step::AddUser(u) => {
                            self.users.insert(u);
                        }
                        Step::RemoveUser(u) => {
                            self.users.remove(&u);
                        }
                    }
                }
            }
            panic!("plan did not converge");
        }

        fn update(&mut self, a: Allocation) {
            self.view.upsert(a);
        }
    }

    const A1: &str = "00000000-0000-4000-8000-000000000001";
    const A2: &str = "00000000-0000-4000-8000-000000000002";

    /// §5 row 1: an allocation placed on the node that uses deferred V gets V published
    /// once, and is recorded as V's user (which is what answers its prestart call).
    #[test]
    fn row1_placed_alloc_gets_its_volume_published() {
        let v = volume("data", "single-node-writer");
        let mut w = World::new(&[v], vec![alloc(A1, &["data"], "pending", "run")]);
        // A single-node volume: the claim first, then the publish.
        assert_eq!(
            w.plan().steps,
            vec![Step::AcquireClaim {
                volume: key("data")
            }]
        );
        w.claims.insert(key("data"), ClaimState::Held);
        assert_eq!(
            w.plan().steps,
            vec![Step::Publish {
                volume: key("data"),
                alloc_id: A1.into(),
                read_only: false
            }]
        );
        w.settle();
        assert_eq!(w.publishes, 1);
        assert!(w.users.contains(&UserKey {
            alloc_id: A1.into(),
            volume: key("data")
        }));
        // Planning again after applying the plan yields nothing.
        assert_eq!(w.plan(), Plan::default());
    }

    /// `single-node-single-writer` (issue 31): of two writing allocations on this node,
    /// the older one is the volume's user; the other waits, its reason naming the holder
    /// (allocation, job, node), while the holder is told to stop but its tasks still run,
    /// and becomes the user only once they finished. A reader is never held back.
    #[test]
    fn single_node_single_writer_admits_one_writing_allocation() {
        const A3: &str = "00000000-0000-4000-8000-000000000003";
        let v = volume("data", SINGLE_WRITER);
        let mut a1 = alloc(A1, &["data"], "running", "run");
        a1.create_index = 5;
        let mut a2 = alloc(A2, &["data"], "pending", "run");
        a2.create_index = 6;
        a2.name = "job.g[1]".into();
        let mut a3 = alloc(A3, &["data"], "pending", "run");
        for g in &mut std::sync::Arc::make_mut(a3.job.as_mut().unwrap()).task_groups {
            for (_, r) in g.volumes.iter_mut() {
                r.read_only = true;
            }
        }
        let mut w = World::new(&[v], vec![a2.clone(), a1.clone(), a3]);
        w.claims.insert(key("data"), ClaimState::Held);
        w.settle();
        let user = |id: &str| UserKey {
            alloc_id: id.into(),
            volume: key("data"),
        };
        assert!(w.users.contains(&user(A1)));
        assert!(!w.users.contains(&user(A2)), "two writers on one node");
        assert!(w.users.contains(&user(A3)), "a reader is not held back");
        let waiting = w.plan().waiting;
        assert_eq!(waiting.len(), 1, "{waiting:?}");
        for part in [A1, "job.g[0]", "\"job\"", NODE, A2] {
            assert!(waiting[0].reason.contains(part), "{part}: {waiting:?}");
        }
        // Told to stop, tasks still running (a rolling update): the holder keeps it.
        let mut stopping = a1.clone();
        stopping.desired_status = "stop".into();
        w.update(stopping.clone());
        w.settle();
        assert!(w.users.contains(&user(A1)) && !w.users.contains(&user(A2)));
        // Its tasks finished: the waiting writer takes it, in the same pass.
        stopping.client_status = "complete".into();
        w.update(stopping);
        w.settle();
        assert!(!w.users.contains(&user(A1)));
        assert!(w.users.contains(&user(A2)));
        assert!(w.plan().waiting.is_empty());
        assert_eq!(
            w.publishes, 1,
            "published once, never unpublished between writers"
        );
    }

    /// A volume that is not a deferred volume record, or a CSI volume, is left alone.
    #[test]
    fn row1_unknown_sources_are_not_published() {
        let mut w = World::new(
            &[volume("data", "single-node-writer")],
            vec![alloc(A1, &["other"], "pending", "run")],
        );
        w.settle();
        assert_eq!(w.publishes, 0);
    }

    /// §5 row 2: a task restarting inside the allocation changes task states only: no
    /// unpublish, no second publish.
    #[test]
    fn row2_task_restart_changes_nothing() {
        let mut w = World::new(
            &[volume("data", "single-node-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        let mut a = alloc(A1, &["data"], "pending", "run");
        a.modify_index = 20; // between the restart's "dead" and "running" the client may report pending
        w.update(a);
        w.settle();
        let mut a = alloc(A1, &["data"], "running", "run");
        a.modify_index = 21;
        w.update(a);
        w.settle();
        assert_eq!((w.publishes, w.unpublishes), (1, 0));
    }

    /// §5 row 3 (and B01): DesiredStatus=stop while tasks still run does not unpublish;
    /// ClientStatus complete does, once.
    #[test]
    fn row3_unpublish_waits_for_client_terminal() {
        let mut w = World::new(
            &[volume("data", "single-node-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        let mut a = alloc(A1, &["data"], "running", "stop");
        a.modify_index = 30;
        w.update(a);
        w.settle();
        assert_eq!(w.unpublishes, 0, "unpublished on DesiredStatus=stop alone");
        let mut a = alloc(A1, &["data"], "complete", "stop");
        a.modify_index = 31;
        w.update(a);
        w.settle();
        assert_eq!(w.unpublishes, 1);
        assert!(w.users.is_empty());
        assert!(w.mounts.is_empty());
    }

    /// An operator's forced unpublish withdraws the volume from a running allocation: it is
    /// unpublished under it (its user record no longer keeps it), and not published again
    /// for it while it runs; a new allocation gets it as usual.
    #[test]
    fn a_withdrawn_allocation_neither_needs_nor_keeps_the_volume() {
        let mut w = World::new(
            &[volume("data", "single-node-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        assert_eq!(w.publishes, 1);
        w.withdrawn
            .insert(key("data"), BTreeSet::from([A1.to_string()]));
        w.settle();
        assert_eq!(
            w.unpublishes, 1,
            "unpublished under the withdrawn allocation"
        );
        assert!(w.mounts.is_empty());
        let p = w.plan();
        assert!(
            p.waiting
                .iter()
                .any(|x| x.volume == key("data") && x.reason.contains("forced unpublish")),
            "says why it is not published for it: {:?}",
            p.waiting
        );
        assert_eq!(w.publishes, 1, "not published again for it");
        w.update(alloc(A2, &["data"], "running", "run"));
        w.settle();
        assert_eq!(w.publishes, 2, "a new allocation publishes it");
    }

    /// A record that vanishes (a filtered or empty variables list, a planted deletion)
    /// proves no deletion while a recorded user still runs with the placeholder mounted:
    /// the volume stays published, says why, and goes once the user's tasks finish.
    #[test]
    fn a_vanished_record_does_not_unpublish_under_a_running_user() {
        let mut w = World::new(
            &[volume("data", "single-node-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        assert_eq!(w.publishes, 1);
        w.volumes.clear();
        let p = w.plan();
        assert!(p.steps.is_empty(), "{:?}", p.steps);
        assert!(
            p.waiting.iter().any(|x| x.volume == key("data")
                && x.reason.contains("record is gone")
                && x.reason.contains(A1)),
            "{:?}",
            p.waiting
        );
        w.settle();
        assert_eq!(w.unpublishes, 0);
        let mut a = alloc(A1, &["data"], "complete", "stop");
        a.modify_index = 30;
        w.update(a);
        w.settle();
        assert_eq!(w.unpublishes, 1);
    }

    /// A user whose group no longer mounts the volume (its job changed) does not keep a
    /// volume without a record.
    #[test]
    fn a_vanished_record_with_no_user_mounting_it_is_unpublished() {
        let mut w = World::new(
            &[volume("data", "single-node-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        w.volumes.clear();
        let mut a = alloc(A1, &[], "running", "run");
        a.modify_index = 30;
        w.update(a);
        w.settle();
        assert_eq!(w.unpublishes, 1);
    }

    /// §5 row 5 (and B06): two live allocations share one publish; the volume is
    /// unpublished only after the last one ends.
    #[test]
    fn row5_two_allocs_share_one_publish() {
        let mut w = World::new(
            &[volume("data", "single-node-multi-writer")],
            vec![
                alloc(A1, &["data"], "running", "run"),
                alloc(A2, &["data"], "running", "run"),
            ],
        );
        w.settle();
        assert_eq!(w.publishes, 1);
        assert_eq!(w.users.len(), 2);
        let mut a = alloc(A2, &["data"], "complete", "stop");
        a.modify_index = 40;
        w.update(a);
        w.settle();
        assert_eq!(
            w.unpublishes, 0,
            "unpublished while A1 still uses the volume"
        );
        assert_eq!(w.users.len(), 1);
        assert!(w.mounted.contains(&World::target(&key("data"))));
        let mut a = alloc(A1, &["data"], "failed", "run");
        a.modify_index = 41;
        w.update(a);
        w.settle();
        assert_eq!(w.unpublishes, 1);
    }

    /// Nothing destructive before the view is complete: a journal entry whose allocation
    /// is not (yet) known is kept until a full list proves it gone.
    #[test]
    fn nothing_destructive_before_the_first_full_list() {
        let v = volume("data", "single-node-writer");
        let mut w = World::new(&[v], vec![]);
        w.view = View::default();
        w.mounts.insert(
            key("data"),
            std::sync::Arc::new(MountRecord {
                volume: key("data"),
                volume_id: "x".into(),
                plugin_id: "bind".into(),
                state: MountState::Published,
                target: World::target(&key("data")),
                read_only: false,
                publish_context: Default::default(),
                since: 0,
                last_error: String::new(),
                claim_id: None,
                mount: None,
            }),
        );
        w.users.insert(UserKey {
            alloc_id: A1.into(),
            volume: key("data"),
        });
        let p = w.plan();
        assert!(p.steps.is_empty(), "{p:?}");
        assert!(
            matches!(&p.waiting[..], [x] if x.reason.starts_with("kept published:")),
            "{p:?}"
        );
        w.view.replace_all_at(vec![], 50, std::time::Instant::now());
        w.settle();
        assert_eq!(w.unpublishes, 1);
        assert!(w.users.is_empty());
    }

    /// A published record whose mount is gone (reboot) is published again.
    #[test]
    fn published_record_without_mount_is_republished() {
        let mut w = World::new(
            &[volume("data", "single-node-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        w.mounted.clear();
        w.settle();
        assert_eq!(w.publishes, 2);
    }

    /// A volume with a call in flight gets no new step; a missing plugin makes the step wait.
    #[test]
    fn busy_volumes_and_missing_plugins_wait() {
        let mut w = World::new(
            &[volume("data", "single-node-writer")],
            vec![alloc(A1, &["data"], "pending", "run")],
        );
        w.busy.insert(key("data"));
        assert!(w.plan().steps.is_empty());
        w.busy.clear();
        w.plugins.clear();
        let p = w.plan();
        assert!(p.steps.is_empty());
        assert_eq!(p.waiting.len(), 1);
    }

    /// Reader access modes are published read-only.
    #[test]
    fn reader_modes_publish_read_only() {
        let mut w = World::new(
            &[volume("data", "multi-node-reader-only")],
            vec![alloc(A1, &["data"], "pending", "run")],
        );
        assert!(matches!(
            w.plan().steps[0],
            Step::Publish {
                read_only: true,
                ..
            }
        ));
        w.settle();
    }

    /// Issue 44 §4: a writer volume is not published while a task of an allocation needing
    /// it mounts it read-only with host-to-task propagation (the publish would reach that
    /// task writable); a private read-only mount, or a reader access mode, is published.
    #[test]
    fn a_read_only_host_to_task_mount_of_a_writer_volume_is_refused() {
        use crate::nomad::types::{Task, VolumeMount};
        let with_task = |mode: &str, group_ro: bool, mount_ro: bool, prop: &str| {
            let mut a = alloc(A1, &["data"], "pending", "run");
            let g = &mut std::sync::Arc::make_mut(a.job.as_mut().unwrap()).task_groups[0];
            g.volumes.get_mut("v-data").unwrap().read_only = group_ro;
            g.tasks.push(Task {
                name: "app".into(),
                volume_mounts: vec![VolumeMount {
                    volume: "v-data".into(),
                    destination: "/data".into(),
                    read_only: mount_ro,
                    propagation_mode: prop.into(),
                }],
                ..Default::default()
            });
            World::new(&[volume("data", mode)], vec![a]).plan()
        };
        for (group_ro, mount_ro, prop) in [
            (true, false, "host-to-task"),
            (false, true, "host-to-task"),
            (true, true, "bidirectional"),
        ] {
            let p = with_task("multi-node-multi-writer", group_ro, mount_ro, prop);
            assert!(p.steps.is_empty(), "{p:?}");
            assert!(
                p.waiting[0].reason.contains("publish refused")
                    && p.waiting[0].reason.contains("task(s) app"),
                "{p:?}"
            );
        }
        let p = with_task("single-node-writer", true, false, "host-to-task");
        assert!(p.steps.is_empty() && p.waiting.len() == 1, "{p:?}");
        // Allowed: private propagation, a writable mount, or a reader volume.
        for (mode, group_ro, prop) in [
            ("multi-node-multi-writer", true, "private"),
            ("multi-node-multi-writer", false, "host-to-task"),
            ("multi-node-reader-only", true, "host-to-task"),
        ] {
            let p = with_task(mode, group_ro, false, prop);
            assert!(
                matches!(p.steps[..], [Step::Publish { .. }]),
                "{mode} {group_ro} {prop}: {p:?}"
            );
        }
    }

    /// Multi-node modes need no claim: publish directly.
    #[test]
    fn multi_node_modes_publish_without_a_claim() {
        let w = World::new(
            &[volume("data", "multi-node-multi-writer")],
            vec![alloc(A1, &["data"], "pending", "run")],
        );
        assert!(matches!(w.plan().steps[..], [Step::Publish { .. }]));
    }

    /// §5 row 8 / B20: a claim found lost is unpublished first, even while the allocation
    /// still wants the volume and even before the view is complete; then it is claimed again
    /// (and waits for the other holder) before any new publish.
    #[test]
    fn b20_lost_claim_is_unpublished_before_anything_else() {
        let mut w = World::new(
            &[volume("data", "single-node-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        assert_eq!(w.publishes, 1);
        w.claims.insert(key("data"), ClaimState::Lost);
        w.view = View::default(); // a restart: nothing listed yet
        assert_eq!(
            w.plan().steps,
            vec![Step::Unpublish {
                volume: key("data")
            }]
        );
        w.view.replace_all_at(
            vec![alloc(A1, &["data"], "running", "run")],
            60,
            std::time::Instant::now(),
        );
        let p = w.plan();
        assert_eq!(
            p.steps[0],
            Step::Unpublish {
                volume: key("data")
            }
        );
        assert!(!p.steps.iter().any(|s| matches!(s, Step::Publish { .. })));
        w.settle();
        assert_eq!(w.unpublishes, 1);
        // settle re-acquired (the fake always succeeds) and published again.
        assert_eq!(w.publishes, 2);
    }

    /// A claim taken for an allocation that went away before its publish is released.
    #[test]
    fn unused_claims_are_released() {
        let mut w = World::new(&[volume("data", "single-node-writer")], vec![]);
        w.claims.insert(key("data"), ClaimState::Held);
        assert_eq!(
            w.plan().steps,
            vec![Step::ReleaseClaim {
                volume: key("data")
            }]
        );
    }

    /// §5 row 6: per_alloc sources `V[N]` are distinct volumes, picked by the allocation's index.
    #[test]
    fn row6_per_alloc_volumes_are_distinct() {
        let mut a0 = alloc(A1, &["data"], "pending", "run");
        a0.name = "job.g[0]".into();
        let mut a1 = alloc(A2, &["data"], "pending", "run");
        a1.name = "job.g[1]".into();
        for a in [&mut a0, &mut a1] {
            let g = &mut std::sync::Arc::make_mut(a.job.as_mut().unwrap()).task_groups[0];
            g.volumes.get_mut("v-data").unwrap().per_alloc = true;
        }
        let mut w = World::new(
            &[
                volume("data[0]", "multi-node-multi-writer"),
                volume("data[1]", "multi-node-multi-writer"),
            ],
            vec![a0, a1],
        );
        w.settle();
        assert_eq!(w.publishes, 2);
        assert!(w.users.contains(&UserKey {
            alloc_id: A1.into(),
            volume: key("data[0]")
        }));
        assert!(w.users.contains(&UserKey {
            alloc_id: A2.into(),
            volume: key("data[1]")
        }));
    }

    /// B05: a failed allocation's own record does not keep the volume: users excluding it
    /// are zero, so exactly one unpublish follows, with DesiredStatus still `run`.
    #[test]
    fn b05_failed_alloc_releases_its_volume() {
        let mut w = World::new(
            &[volume("data", "single-node-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        let mut a = alloc(A1, &["data"], "failed", "run");
        a.modify_index = 70;
        w.update(a);
        w.settle();
        assert_eq!(w.unpublishes, 1);
        assert!(
            w.claims.is_empty(),
            "the claim must be free for a replacement"
        );
    }

    /// B08: a publish that never succeeded leaves no user record, so the allocation going
    /// terminal causes no unpublish of the volume another allocation still uses.
    #[test]
    fn b08_failed_publish_leaves_no_record() {
        let mut w = World::new(
            &[volume("data", "single-node-multi-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        // A2 arrives; the volume is already published, so A2 becomes a user only through
        // AddUser. Simulate A2's prestart failing before that: A2 goes terminal at once.
        let mut a2 = alloc(A2, &["data"], "failed", "stop");
        a2.modify_index = 80;
        w.update(a2);
        w.settle();
        assert_eq!((w.publishes, w.unpublishes), (1, 0));
        assert_eq!(w.users.len(), 1);
        assert!(w.mounted.contains(&World::target(&key("data"))));
    }

    /// B25: the same volume name in two namespaces is two volumes with two targets.
    #[test]
    fn b25_same_name_in_two_namespaces_is_two_volumes() {
        let mut other = volume("data", "multi-node-multi-writer");
        other.spec.namespace = "team-b".into();
        let mut a2 = alloc(A2, &["data"], "running", "run");
        a2.namespace = "team-b".into();
        let mut w = World::new(
            &[volume("data", "multi-node-multi-writer"), other],
            vec![alloc(A1, &["data"], "running", "run"), a2],
        );
        w.settle();
        assert_eq!(w.publishes, 2);
        let targets: BTreeSet<_> = w.mounts.values().map(|m| m.target.clone()).collect();
        assert_eq!(targets.len(), 2);
        let mut a1 = alloc(A1, &["data"], "complete", "stop");
        a1.modify_index = 90;
        w.update(a1);
        w.settle();
        assert_eq!(w.unpublishes, 1);
        assert!(w.mounts.keys().any(|k| k.namespace == "team-b".into()));
    }

    /// Property: for every sequence of allocation states, after settling, (a) planning again
    /// yields nothing, and (b) no volume needed by a live allocation is unpublished.
    #[test]
    fn property_settled_plans_are_empty_and_never_unpublish_in_use() {
        let statuses = ["pending", "running", "complete", "failed", "lost"];
        let desired = ["run", "stop"];
        let mut seed = 12345u64;
        let mut next = |n: usize| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as usize) % n
        };
        for _ in 0..300 {
            let mut w = World::new(
                &[
                    volume("a", "single-node-writer"),
                    volume("b", "multi-node-multi-writer"),
                ],
                vec![],
            );
            let ids = [A1, A2];
            let mut idx = 100;
            for _ in 0..8 {
                idx += 1;
                let id = ids[next(2)];
                let srcs: &[&str] = if next(2) == 0 { &["a"] } else { &["a", "b"] };
                let mut a = alloc(id, srcs, statuses[next(5)], desired[next(2)]);
                a.modify_index = idx;
                w.update(a);
                let before: BTreeSet<VolumeKey> = w.mounts.keys().cloned().collect();
                let p = w.plan();
                for s in &p.steps {
                    if let Step::Unpublish { volume } = s {
                        let in_use = w.view.allocs().values().any(|a| {
                            !a.tasks_finished()
                                && requests(a, &w.volumes).iter().any(|r| &r.volume == volume)
                        });
                        assert!(!in_use, "unpublish of {volume} while in use");
                        assert!(before.contains(volume));
                    }
                }
                w.settle();
                assert_eq!(w.plan(), Plan::default());
            }
        }
    }

    /// nomad-facts.md §7: a server-side `lost` (node stopped heartbeating) with tasks last
    /// seen running does not unpublish: on a partitioned node they may still write. Once
    /// the client reports the tasks dead, it does.
    #[test]
    fn lost_with_running_tasks_keeps_the_volume_until_tasks_are_dead() {
        use crate::nomad::types::TaskState;
        let mut w = World::new(
            &[volume("data", "multi-node-multi-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        let mut a = alloc(A1, &["data"], "lost", "stop");
        a.modify_index = 100;
        a.task_states.insert(
            "app".into(),
            TaskState {
                state: "running".into(),
                ..Default::default()
            },
        );
        w.update(a.clone());
        w.settle();
        assert_eq!(w.unpublishes, 0);
        a.modify_index = 101;
        a.task_states.insert(
            "app".into(),
            TaskState {
                state: "dead".into(),
                ..Default::default()
            },
        );
        w.update(a);
        w.settle();
        assert_eq!(w.unpublishes, 1);
    }

    /// B15 / §5 row 11: an allocation purged or garbage-collected (no event, gone from the
    /// list) while its tasks were last seen running keeps its volume through its kill
    /// grace (the client may still be killing it), then the volume is unpublished once.
    #[test]
    fn a_volume_kept_with_an_incomplete_picture_says_why() {
        let mut w = World::new(
            &[volume("data", "multi-node-multi-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        assert_eq!(w.publishes, 1);
        // After a restart, before the allocations are listed in full.
        w.view = View::default();
        let p = w.plan();
        assert!(p.steps.iter().all(|s| !matches!(s, Step::Unpublish { .. })));
        assert!(
            p.waiting.iter().any(|x| x.volume == key("data")
                && x.reason.starts_with(
                    "kept published: this node's allocations have not been listed in full"
                )),
            "{:?}",
            p.waiting
        );
    }

    /// Issue 46: after a restart while Nomad refuses the list of volume records (a 403),
    /// the volume is kept, and the reason names the refusal (not "the agent just started").
    #[test]
    fn a_volume_kept_while_the_records_cannot_be_read_says_why() {
        let mut w = World::new(
            &[volume("data", "multi-node-multi-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        assert_eq!(w.publishes, 1);
        w.volumes.clear();
        let refused = "HTTP 403 Permission denied: list variables (GET /v1/vars)";
        w.records_unread = Some(Some(refused.into()));
        let p = w.plan();
        assert!(p.steps.iter().all(|s| !matches!(s, Step::Unpublish { .. })));
        let why = p
            .waiting
            .iter()
            .find(|x| x.volume == key("data"))
            .map(|x| x.reason.as_str())
            .unwrap_or_default();
        assert!(
            why.starts_with("kept published: the volume records cannot be read (")
                && why.contains(refused),
            "{why:?}"
        );
    }

    #[test]
    fn b15_vanished_alloc_is_unpublished_after_its_kill_grace() {
        use std::time::{Duration, Instant};
        let mut w = World::new(
            &[volume("data", "multi-node-multi-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        let t0 = Instant::now();
        w.view.replace_all_at(vec![], 200, t0);
        w.settle();
        assert_eq!(
            w.unpublishes, 0,
            "unpublished while the tasks may still run"
        );
        w.view.expire(t0 + Duration::from_secs(4));
        w.settle();
        assert_eq!(w.unpublishes, 0);
        // Default kill timeout 5 s + margin 5 s.
        assert_eq!(w.view.expire(t0 + Duration::from_secs(11)), 1);
        w.settle();
        assert_eq!(w.unpublishes, 1);
        // A finished allocation that vanishes goes at once.
        let mut w = World::new(
            &[volume("data", "multi-node-multi-writer")],
            vec![alloc(A1, &["data"], "running", "run")],
        );
        w.settle();
        let mut a = alloc(A1, &["data"], "complete", "stop");
        a.modify_index = 300;
        w.update(a);
        w.view.remove_at(A1, t0);
        w.settle();
        assert_eq!(w.unpublishes, 1);
    }
}
