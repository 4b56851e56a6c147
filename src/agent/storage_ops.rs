//! Decides which storage operations this node runs: snapshot creates and deletes, and
//! volume expansions (`crate::cluster::snapshot::step`, `crate::cluster::expansion::step`), where "published
//! here" is this node's journal (a `published` mount record, with its target) and "taken
//! by another node" is the record's `worker_node` / expansion `node` (set by the node that
//! won the check-and-set, or by the CLI to the node where the volume is published). Also:
//! a publish waits while the volume has a pending expansion that its plugin can run
//! (offline growth before the next publish), and a pending `create` the CLI handed to
//! another node (a clone runs where its source is published) is left to that node.
//!
//! A check-and-set lost to another node is expected and logged at debug; other failures
//! wait on the retry table before the next attempt.

use crate::agent::effect::Effect;
use crate::agent::executor::storage::StorageOp;
use crate::agent::retry::{Work, STEP_RETRY};
use crate::cluster::catalog::Catalogue;
use crate::cluster::expansion;
use crate::cluster::snapshot::{self, Snapshots};
use crate::cluster::worker::{OpError, OpKey, Published};
use crate::node::freeze::Thawed;
use crate::node::journal::MountState;
use crate::nomad::retry::Retries;
use crate::storage::plugin::{Capability, Fingerprint};
use crate::volume::{ExpansionState, VolumeKey, VolumeRecord, VolumeState};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Instant;

/// Snapshot records, and the storage operations in flight on this node.
#[derive(Debug, Default)]
pub(crate) struct StorageOps {
    snapshots: Snapshots,
    /// In flight: the operation and the volume it holds busy (none for a snapshot delete).
    running: BTreeMap<OpKey, Option<VolumeKey>>,
    /// The record's ModifyIndex each running operation started from.
    started: BTreeMap<OpKey, u64>,
    /// Finished operations and the ModifyIndex they started from: a record still at that
    /// index is a stale copy (the watch has not brought the write back yet), not new work.
    finished: BTreeMap<OpKey, u64>,
    /// Volumes a freezing operation of this node may hold frozen (for `status` and the
    /// `dhv_binder_volumes_frozen` gauge).
    frozen: BTreeMap<VolumeKey, Frozen>,
}

/// A volume that a storage operation this node started may hold frozen: a
/// `snapshot_create` on a volume published here is handed the mount's target so that it can
/// quiesce it (the ext4 plugin runs `fsfreeze -f` for its copy), and the volume's tasks'
/// writes wait while it is frozen. The entry lasts while the call runs; when the call ends,
/// however it ended, the agent thaws the mount (`node::freeze::thaw`) and the entry goes, unless
/// that thaw failed: then it stays, with the error, until the volume is unpublished here
/// or a later operation's thaw succeeds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Frozen {
    /// Which operation: `snapshot_create of snapshot <id>`.
    pub(crate) operation: String,
    /// When the operation started (Unix seconds).
    pub(crate) since: u64,
    /// Where the volume is mounted on this node.
    pub(crate) target: PathBuf,
    /// Why the agent's thaw after the operation failed (the volume may still be frozen:
    /// `fsfreeze -u <target>` thaws it); `None` while the operation runs.
    pub(crate) thaw_error: Option<String>,
}

/// A plugin this node has, deferred, fingerprinted healthy.
fn fingerprint<'a>(
    plugins: &'a BTreeMap<String, Result<Fingerprint, String>>,
    id: &str,
) -> Option<&'a Fingerprint> {
    plugins
        .get(id)
        .and_then(|r| r.as_ref().ok())
        .filter(|f| f.deferred_bind)
}

/// Where `key` is published as this node's journal says: `None` while a publish or
/// unpublish is under way (decide once it settles).
fn place(
    mounts: &crate::node::journal::Mounts,
    key: &VolumeKey,
) -> Option<(Published, Option<PathBuf>)> {
    match mounts.get(key) {
        None => Some((Published::Nowhere, None)),
        Some(m) if m.state == MountState::Published => {
            Some((Published::Here, Some(m.target.clone())))
        }
        Some(_) => None,
    }
}

/// True when a publish of `rec` must wait: it has a pending expansion (not failed) and the
/// plugin here declares `expand`, so the volume grows offline before it is mounted again.
pub(crate) fn holds_publish(rec: &VolumeRecord, fp: Option<&Fingerprint>) -> bool {
    rec.expansion
        .as_ref()
        .is_some_and(|x| x.state != ExpansionState::Failed)
        && fp.is_some_and(|f| f.supports(Capability::Expand))
}

/// True when a pending `create` of `rec` belongs to another node: the CLI named the node
/// where the clone's source is published (`worker_node` of a pending record).
pub(crate) fn create_elsewhere(rec: &VolumeRecord, me: &str) -> bool {
    rec.state == VolumeState::Pending && !rec.worker_node.is_empty() && rec.worker_node != me
}

impl StorageOps {
    /// A fresh copy of the snapshot records.
    pub(crate) fn on_snapshots(&mut self, s: Snapshots) {
        self.snapshots = s;
    }

    /// Number of snapshot records known (for `status`).
    pub(crate) fn snapshot_count(&self) -> usize {
        self.snapshots.len()
    }

    /// The operations in flight (for `status`).
    pub(crate) fn running(&self) -> Vec<String> {
        self.running.keys().map(|k| k.to_string()).collect()
    }

    /// Volumes a freezing operation may hold frozen (for `status` and the metrics).
    pub(crate) fn frozen(&self) -> &BTreeMap<VolumeKey, Frozen> {
        &self.frozen
    }

    fn wants(&self, key: &OpKey, index: u64, retries: &Retries<Work>, now: Instant) -> bool {
        !self.running.contains_key(key)
            && self.finished.get(key) != Some(&index)
            && retries.ready(&Work::Storage(key.clone()), now)
    }

    fn start(&mut self, key: OpKey, index: u64, volume: Option<VolumeKey>) {
        self.started.insert(key.clone(), index);
        self.running.insert(key, volume);
    }

    /// The operations to start now. `volumes`: the catalogue; `plugins`: this node's
    /// fingerprints; `mounts`: the journal's records; `busy`: volumes with a call in flight
    /// (an operation on a volume marks it busy, so no publish or unpublish runs under it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn drive(
        &mut self,
        volumes: &Catalogue,
        plugins: &BTreeMap<String, Result<Fingerprint, String>>,
        mounts: &crate::node::journal::Mounts,
        busy: &mut BTreeSet<VolumeKey>,
        me: &str,
        node_pool: &str,
        retries: &Retries<Work>,
        now: Instant,
    ) -> Vec<Effect> {
        let in_pool =
            |r: &VolumeRecord| r.spec.node_pool.is_empty() || r.spec.node_pool == node_pool;
        // Forget finished marks whose records are gone or have moved on (bounded by the
        // records).
        let snapshots = &self.snapshots;
        self.finished.retain(|k, i| match k {
            OpKey::Snapshot(id) => snapshots.get(id).is_some_and(|s| s.modify_index == *i),
            OpKey::Expansion(v) => volumes.get(v).is_some_and(|r| r.modify_index == *i),
        });
        // A thaw that failed is reported until the volume is no longer mounted here.
        self.frozen
            .retain(|k, f| f.thaw_error.is_none() || mounts.contains_key(k));
        let mut out = Vec::new();
        let snaps: Vec<_> = self.snapshots.values().cloned().collect();
        for snap in snaps {
            let key = OpKey::Snapshot(snap.id.clone());
            if !self.wants(&key, snap.modify_index, retries, now) {
                continue;
            }
            let fp = fingerprint(plugins, &snap.plugin_id);
            let vkey = VolumeKey {
                namespace: snap.namespace.clone().into(),
                name: snap.volume.clone().into(),
            };
            let vol = volumes
                .get(&vkey)
                .filter(|v| v.id == snap.volume_id && in_pool(v));
            let (published, target) = if snap.state == VolumeState::Deleting {
                (Published::Nowhere, None)
            } else {
                match (vol, place(mounts, &vkey)) {
                    (Some(_), Some(p)) if !busy.contains(&vkey) => p,
                    // The volume is gone, not for this pool, or a call on it is under way.
                    _ => continue,
                }
            };
            match snapshot::step(&snap, me, published, fp) {
                snapshot::Step::None => {}
                snapshot::Step::Create => {
                    let Some(vol) = vol else { continue };
                    if let Some(t) = &target {
                        self.frozen.insert(
                            vkey.clone(),
                            Frozen {
                                operation: format!("snapshot_create of snapshot {}", snap.id),
                                since: crate::node::journal::now_secs(),
                                target: t.clone(),
                                thaw_error: None,
                            },
                        );
                    }
                    self.start(key, snap.modify_index, Some(vkey.clone()));
                    busy.insert(vkey);
                    out.push(Effect::Storage(StorageOp::SnapshotCreate {
                        volume: Box::new(VolumeRecord::clone(vol)),
                        snapshot: Box::new(snap),
                        target,
                    }));
                }
                snapshot::Step::Delete => {
                    self.start(key, snap.modify_index, None);
                    out.push(Effect::Storage(StorageOp::SnapshotDelete(Box::new(snap))));
                }
                snapshot::Step::Refuse(message) => {
                    self.start(key, snap.modify_index, None);
                    out.push(Effect::Storage(StorageOp::SnapshotRefuse {
                        snapshot: Box::new(snap),
                        message,
                    }));
                }
            }
        }
        for vol in volumes
            .values()
            .filter(|v| v.expansion.is_some() && in_pool(v))
        {
            let vkey = vol.key();
            let key = OpKey::Expansion(vkey.clone());
            if busy.contains(&vkey) || !self.wants(&key, vol.modify_index, retries, now) {
                continue;
            }
            let Some((published, target)) = place(mounts, &vkey) else {
                continue;
            };
            let fp = fingerprint(plugins, &vol.spec.plugin_id);
            let op = match expansion::step(vol, me, published, fp) {
                expansion::Step::None => continue,
                expansion::Step::Run { online } => {
                    busy.insert(vkey.clone());
                    self.start(key, vol.modify_index, Some(vkey));
                    StorageOp::Expand {
                        volume: Box::new(VolumeRecord::clone(vol)),
                        target: if online { target } else { None },
                    }
                }
                expansion::Step::Defer => {
                    self.start(key, vol.modify_index, None);
                    StorageOp::ExpandDefer(Box::new(VolumeRecord::clone(vol)))
                }
                expansion::Step::Refuse(message) => {
                    self.start(key, vol.modify_index, None);
                    StorageOp::ExpandRefuse {
                        volume: Box::new(VolumeRecord::clone(vol)),
                        message,
                    }
                }
            };
            out.push(Effect::Storage(op));
        }
        out
    }

    /// An operation finished. Returns the volume it held busy, to release. A lost
    /// check-and-set (another node took it) is logged at debug; any failure waits on the
    /// retry table before this node looks at the record again. `thawed`: what the thaw
    /// after a freezing operation found (`None`: the operation had nothing to thaw); the
    /// volume stays reported frozen only when that thaw failed.
    pub(crate) fn on_done(
        &mut self,
        op: OpKey,
        result: Result<(), OpError>,
        thawed: Option<Thawed>,
        retries: &mut Retries<Work>,
        now: Instant,
    ) -> Option<VolumeKey> {
        let volume = self.running.remove(&op).flatten();
        if let Some(v) = &volume {
            match thawed {
                Some(Thawed::Failed(e)) => {
                    if let Some(f) = self.frozen.get_mut(v) {
                        f.thaw_error = Some(e);
                    }
                }
                Some(_) => {
                    self.frozen.remove(v);
                }
                None => {}
            }
        }
        let index = self.started.remove(&op);
        let work = Work::Storage(op.clone());
        match result {
            Ok(()) => {
                tracing::info!(%op, "storage operation done");
                retries.succeeded(&work);
                if let Some(i) = index {
                    self.finished.insert(op, i);
                }
            }
            Err(e) if e.is_lost() => {
                tracing::debug!(%op, error = %e, "another node took the storage operation first");
                retries.failed(&work, STEP_RETRY, now);
            }
            Err(e) => {
                tracing::warn!(%op, error = %e, "storage operation failed; will retry with backoff");
                retries.failed(&work, STEP_RETRY, now);
            }
        }
        volume
    }
}

#[cfg(test)]
mod tests {
    //! Decisions driven with plain `Instant`s: no tokio, no Nomad, no plugin.
    use super::*;
    use crate::cluster::snapshot::SnapshotRecord;
    use crate::cluster::worker::TakeError;
    use std::time::Duration;

    const ME: &str = "node-1";

    fn volume() -> VolumeRecord {
        let (spec, secrets) = crate::volume::parse_spec(
            "name = \"data\"\nplugin_id = \"ext4\"\ncapacity_min = \"64MiB\"\n",
        )
        .unwrap();
        let mut v = VolumeRecord::new(spec, secrets);
        v.state = VolumeState::Ready;
        v.modify_index = 10;
        v
    }

    fn plugins(caps: &[&str]) -> BTreeMap<String, Result<Fingerprint, String>> {
        BTreeMap::from([(
            "ext4".to_string(),
            Ok(Fingerprint {
                version: "1".into(),
                deferred_bind: true,
                capabilities: caps.iter().map(|c| c.to_string()).collect(),
                ..Default::default()
            }),
        )])
    }

    fn catalogue(v: &VolumeRecord) -> Catalogue {
        Catalogue::from([(v.key(), std::sync::Arc::new(v.clone()))])
    }

    fn published(v: &VolumeRecord) -> crate::node::journal::Mounts {
        BTreeMap::from([(
            v.key(),
            std::sync::Arc::new(crate::node::journal::MountRecord {
                volume: v.key(),
                volume_id: v.id.clone(),
                plugin_id: v.spec.plugin_id.clone(),
                state: MountState::Published,
                target: "/m/default/data".into(),
                read_only: false,
                publish_context: Default::default(),
                since: 0,
                last_error: String::new(),
                mount: None,
                claim_id: None,
            }),
        )])
    }

    /// Storage operations that know of `snap` (as the snapshot watch tells them).
    fn ops_knowing(snap: &SnapshotRecord) -> StorageOps {
        let mut s = StorageOps::default();
        s.on_snapshots(Snapshots::from([(snap.id.clone(), snap.clone())]));
        s
    }

    fn snapshot_of(v: &VolumeRecord) -> SnapshotRecord {
        let mut s = SnapshotRecord::new(v, "before", 1);
        s.modify_index = 20;
        s
    }

    /// One planning pass of `s` at `now`, as node ME in pool "default".
    fn pass(
        s: &mut StorageOps,
        v: &VolumeRecord,
        p: &BTreeMap<String, Result<Fingerprint, String>>,
        mounts: &crate::node::journal::Mounts,
        busy: &mut BTreeSet<VolumeKey>,
        retries: &Retries<Work>,
        now: Instant,
    ) -> Vec<Effect> {
        s.drive(&catalogue(v), p, mounts, busy, ME, "default", retries, now)
    }

    fn ops(effects: &[Effect]) -> Vec<&StorageOp> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Storage(op) => Some(op),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_snapshot_of_a_volume_published_here_is_taken_here_with_its_target_and_holds_it_busy() {
        let v = volume();
        let snap = snapshot_of(&v);
        let mut s = ops_knowing(&snap);
        let retries = Retries::new(1);
        let mut busy = BTreeSet::new();
        let now = Instant::now();
        let out = pass(
            &mut s,
            &v,
            &plugins(&["snapshot"]),
            &published(&v),
            &mut busy,
            &retries,
            now,
        );
        match ops(&out)[..] {
            [StorageOp::SnapshotCreate { target, .. }] => {
                assert_eq!(
                    target.as_deref(),
                    Some(std::path::Path::new("/m/default/data"))
                )
            }
            ref other => panic!("{other:?}"),
        }
        assert!(
            busy.contains(&v.key()),
            "no publish/unpublish under a snapshot"
        );
        // While it runs, nothing more is started for it.
        let again = pass(
            &mut s,
            &v,
            &plugins(&["snapshot"]),
            &published(&v),
            &mut BTreeSet::new(),
            &retries,
            now,
        );
        assert!(ops(&again).is_empty(), "{again:?}");
    }

    /// Issue 36, item 4: a volume a freezing snapshot may hold frozen is reported (volume,
    /// since, operation) while the call runs; its thaw ends the report, a failed thaw keeps
    /// it (with the error) until the volume is no longer mounted here.
    #[test]
    fn a_volume_under_a_freezing_snapshot_is_reported_frozen_until_thawed() {
        let v = volume();
        let snap = snapshot_of(&v);
        let key = OpKey::Snapshot(snap.id.clone());
        let mut s = ops_knowing(&snap);
        let mut retries = Retries::new(1);
        let p = plugins(&["snapshot"]);
        let now = Instant::now();
        let out = pass(
            &mut s,
            &v,
            &p,
            &published(&v),
            &mut BTreeSet::new(),
            &retries,
            now,
        );
        assert_eq!(ops(&out).len(), 1);
        let f = s
            .frozen()
            .get(&v.key())
            .expect("reported frozen while the call runs");
        assert_eq!(
            f.operation,
            format!("snapshot_create of snapshot {}", snap.id)
        );
        assert_eq!(f.target, std::path::Path::new("/m/default/data"));
        assert!(f.since > 0 && f.thaw_error.is_none());
        // The call died with the volume frozen; the agent's thaw ended it.
        let died = OpError::Plugin("killed by signal 9".into());
        s.on_done(
            key.clone(),
            Err(died),
            Some(Thawed::WasFrozen),
            &mut retries,
            now,
        );
        assert!(s.frozen().is_empty(), "{:?}", s.frozen());
        // Again, and this time the thaw fails: still reported, with why.
        let later = now + std::time::Duration::from_secs(120);
        let out = pass(
            &mut s,
            &v,
            &p,
            &published(&v),
            &mut BTreeSet::new(),
            &retries,
            later,
        );
        assert_eq!(ops(&out).len(), 1);
        s.on_done(
            key,
            Ok(()),
            Some(Thawed::Failed("fsfreeze: no such file".into())),
            &mut retries,
            later,
        );
        assert_eq!(
            s.frozen()[&v.key()].thaw_error.as_deref(),
            Some("fsfreeze: no such file")
        );
        pass(
            &mut s,
            &v,
            &p,
            &published(&v),
            &mut BTreeSet::new(),
            &retries,
            later,
        );
        assert_eq!(s.frozen().len(), 1, "kept while mounted here");
        pass(
            &mut s,
            &v,
            &p,
            &BTreeMap::new(),
            &mut BTreeSet::new(),
            &retries,
            later,
        );
        assert!(
            s.frozen().is_empty(),
            "gone once the volume is not mounted here"
        );
    }

    #[test]
    fn a_snapshot_taken_by_another_node_or_of_a_volume_in_transition_is_left_alone() {
        let v = volume();
        let mut snap = snapshot_of(&v);
        snap.worker_node = "node-2".into();
        let mut s = ops_knowing(&snap);
        let retries = Retries::new(1);
        let now = Instant::now();
        let p = plugins(&["snapshot"]);
        let none = BTreeMap::new();
        let out = pass(&mut s, &v, &p, &none, &mut BTreeSet::new(), &retries, now);
        assert!(ops(&out).is_empty(), "{out:?}");
        // Ours, but a publish is under way: wait for it to settle.
        snap.worker_node.clear();
        s.on_snapshots(Snapshots::from([(snap.id.clone(), snap)]));
        let mut m = published(&v);
        std::sync::Arc::make_mut(m.values_mut().next().unwrap()).state = MountState::Publishing;
        let out = pass(&mut s, &v, &p, &m, &mut BTreeSet::new(), &retries, now);
        assert!(ops(&out).is_empty(), "{out:?}");
        // Settled, nowhere published: any node with the plugin takes it.
        let out = pass(&mut s, &v, &p, &none, &mut BTreeSet::new(), &retries, now);
        assert!(matches!(
            ops(&out)[..],
            [StorageOp::SnapshotCreate { target: None, .. }]
        ));
    }

    #[test]
    fn a_plugin_without_snapshot_gets_the_snapshot_refused_naming_the_capability() {
        let v = volume();
        let snap = snapshot_of(&v);
        let mut s = StorageOps::default();
        s.on_snapshots(Snapshots::from([(snap.id.clone(), snap)]));
        let out = pass(
            &mut s,
            &v,
            &plugins(&[]),
            &BTreeMap::new(),
            &mut BTreeSet::new(),
            &Retries::new(1),
            Instant::now(),
        );
        match ops(&out)[..] {
            [StorageOp::SnapshotRefuse { message, .. }] => {
                assert!(
                    message.contains("snapshot") && message.contains("ext4"),
                    "{message}"
                )
            }
            ref other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_lost_check_and_set_waits_before_looking_again_and_a_finished_one_ignores_the_stale_copy() {
        let v = volume();
        let snap = snapshot_of(&v);
        let key = OpKey::Snapshot(snap.id.clone());
        let mut s = ops_knowing(&snap);
        let mut retries = Retries::new(1);
        let p = plugins(&["snapshot"]);
        let none = BTreeMap::new();
        let t0 = Instant::now();
        let mut busy = BTreeSet::new();
        let out = pass(&mut s, &v, &p, &none, &mut busy, &retries, t0);
        assert_eq!(ops(&out).len(), 1);
        let lost = OpError::Take(TakeError::Lost {
            path: snapshot::record_path(&snap.id),
            index: 20,
        });
        assert_eq!(
            s.on_done(key.clone(), Err(lost), None, &mut retries, t0),
            Some(v.key())
        );
        let out = pass(&mut s, &v, &p, &none, &mut BTreeSet::new(), &retries, t0);
        assert!(ops(&out).is_empty(), "backing off: {out:?}");
        let later = t0 + Duration::from_secs(120);
        let out = pass(&mut s, &v, &p, &none, &mut BTreeSet::new(), &retries, later);
        assert_eq!(ops(&out).len(), 1, "tried again after the backoff");
        // It succeeds; the watch still shows the old copy: not started again.
        s.on_done(key.clone(), Ok(()), None, &mut retries, later);
        let out = pass(&mut s, &v, &p, &none, &mut BTreeSet::new(), &retries, later);
        assert!(ops(&out).is_empty(), "stale copy: {out:?}");
    }

    #[test]
    fn an_expansion_is_deferred_while_published_here_without_online_growth_then_run_offline() {
        let mut v = volume();
        crate::cluster::expansion::request(&mut v, 128 << 20);
        let p = plugins(&["expand"]);
        let mut s = StorageOps::default();
        let retries = Retries::new(1);
        let now = Instant::now();
        let out = pass(
            &mut s,
            &v,
            &p,
            &published(&v),
            &mut BTreeSet::new(),
            &retries,
            now,
        );
        assert!(
            matches!(ops(&out)[..], [StorageOp::ExpandDefer(_)]),
            "{out:?}"
        );
        // Deferred and unpublished: the next publish waits, and the expansion runs offline.
        let mut s = StorageOps::default();
        v.expansion.as_mut().unwrap().state = ExpansionState::AtNextPublish;
        assert!(holds_publish(&v, fingerprint(&p, "ext4")));
        let mut busy = BTreeSet::new();
        let out = pass(&mut s, &v, &p, &BTreeMap::new(), &mut busy, &retries, now);
        assert!(
            matches!(ops(&out)[..], [StorageOp::Expand { target: None, .. }]),
            "{out:?}"
        );
        assert!(busy.contains(&v.key()));
        // Deferred by another node (it had it mounted): that node grows it, not this one.
        let mut s2 = StorageOps::default();
        let mut theirs = v.clone();
        theirs.expansion.as_mut().unwrap().node = "node-2".into();
        let out = pass(
            &mut s2,
            &theirs,
            &p,
            &BTreeMap::new(),
            &mut BTreeSet::new(),
            &retries,
            now,
        );
        assert!(ops(&out).is_empty(), "{out:?}");
        assert!(holds_publish(&theirs, fingerprint(&p, "ext4")));
        // Online-capable and published here: grown in place at the target.
        let mut s = StorageOps::default();
        crate::cluster::expansion::request(&mut v, 128 << 20);
        let online = plugins(&["expand", "expand_online"]);
        let out = pass(
            &mut s,
            &v,
            &online,
            &published(&v),
            &mut BTreeSet::new(),
            &retries,
            now,
        );
        assert!(
            matches!(
                ops(&out)[..],
                [StorageOp::Expand {
                    target: Some(_),
                    ..
                }]
            ),
            "{out:?}"
        );
    }

    #[test]
    fn a_publish_waits_only_for_an_expansion_the_plugin_can_run() {
        let mut v = volume();
        assert!(!holds_publish(
            &v,
            fingerprint(&plugins(&["expand"]), "ext4")
        ));
        crate::cluster::expansion::request(&mut v, 128 << 20);
        assert!(holds_publish(
            &v,
            fingerprint(&plugins(&["expand"]), "ext4")
        ));
        assert!(!holds_publish(&v, fingerprint(&plugins(&[]), "ext4")));
        v.expansion.as_mut().unwrap().state = ExpansionState::Failed;
        assert!(!holds_publish(
            &v,
            fingerprint(&plugins(&["expand"]), "ext4")
        ));
    }

    #[test]
    fn a_pending_clone_handed_to_another_node_is_left_to_it() {
        let mut v = volume();
        v.state = VolumeState::Pending;
        assert!(!create_elsewhere(&v, ME));
        v.worker_node = "node-2".into();
        assert!(create_elsewhere(&v, ME));
        assert!(!create_elsewhere(&v, "node-2"));
        v.state = VolumeState::Creating;
        assert!(
            !create_elsewhere(&v, ME),
            "only a pending record carries the hint"
        );
    }
}
