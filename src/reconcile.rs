//! The reconcile plan: a pure function from what is known (the node's allocations, the
//! volume records, the journal, the mount table, the plugins present, the calls in flight)
//! to the steps that bring the node to the desired state. No I/O, no clock.
//!
//! Rules (design.md §5):
//! - a volume is published on this node while at least one live allocation here needs it,
//!   once, at its placeholder path; allocations are recorded as its users;
//! - a user record is dropped when its allocation is client-terminal or gone, never on
//!   `DesiredStatus=stop` alone;
//! - a volume is unpublished when no live allocation needs it any more;
//! - nothing is dropped or unpublished before the view and the volume catalogue are
//!   complete (a partial view proves no absence);
//! - a `published` record whose mount is missing is published again, never trusted;
//! - a record left `publishing`/`unpublishing` (outcome unknown) is resolved by running the
//!   idempotent call again in the direction now desired;
//! - a volume with a call in flight gets no new step (calls on one volume are serialized).

use crate::journal::{MountRecord, MountState, UserKey};
use crate::view::{requests, View};
use crate::volume::{VolumeKey, VolumeRecord};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Everything the plan is computed from.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    pub view: &'a View,
    /// False until the volume records have been read once.
    pub volumes_loaded: bool,
    pub volumes: &'a BTreeMap<VolumeKey, VolumeRecord>,
    pub mounts: &'a BTreeMap<VolumeKey, MountRecord>,
    pub users: &'a BTreeSet<UserKey>,
    /// Mount points present in the mount table.
    pub mounted: &'a BTreeSet<PathBuf>,
    /// Plugin IDs present on this node with `deferred_bind = true`.
    pub plugins: &'a BTreeSet<String>,
    /// Volumes with a plugin call in flight.
    pub busy: &'a BTreeSet<VolumeKey>,
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

/// Computes the plan. See the module documentation for the rules.
pub fn plan(i: Inputs<'_>) -> Plan {
    let mut plan = Plan::default();
    let complete = i.view.is_complete() && i.volumes_loaded;

    // Live allocations' needs, by volume: (alloc, read_only) in alloc ID order.
    let mut needed: BTreeMap<VolumeKey, Vec<(String, bool)>> = BTreeMap::new();
    for (id, alloc) in i.view.allocs() {
        if alloc.is_client_terminal() {
            continue;
        }
        for r in requests(alloc, i.volumes) {
            needed
                .entry(r.volume)
                .or_default()
                .push((id.clone(), r.read_only));
        }
    }

    if complete {
        for u in i.users {
            if !i.view.is_live(&u.alloc_id) {
                plan.steps.push(Step::RemoveUser(u.clone()));
            }
        }
    }

    for (key, allocs) in &needed {
        if i.busy.contains(key) {
            continue;
        }
        let Some(volume) = i.volumes.get(key) else {
            continue;
        };
        let healthy = i
            .mounts
            .get(key)
            .is_some_and(|m| m.state == MountState::Published && i.mounted.contains(&m.target));
        if healthy {
            for (alloc_id, _) in allocs {
                let u = UserKey {
                    alloc_id: alloc_id.clone(),
                    volume: key.clone(),
                };
                if !i.users.contains(&u) {
                    plan.steps.push(Step::AddUser(u));
                }
            }
        } else if i.plugins.contains(&volume.spec.plugin_id) {
            plan.steps.push(Step::Publish {
                volume: key.clone(),
                alloc_id: allocs[0].0.clone(),
                read_only: publish_read_only(volume),
            });
        } else {
            plan.waiting.push(Waiting {
                volume: key.clone(),
                reason: format!(
                    "publish waits: plugin {:?} is not present on this node with deferred_bind",
                    volume.spec.plugin_id
                ),
            });
        }
    }

    if complete {
        for (key, m) in i.mounts {
            if needed.contains_key(key) || i.busy.contains(key) {
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
    }
    plan
}
