//! Performs the storage operations the agent core decides (`agent/storage_ops.rs`): a
//! snapshot's create, delete or refusal, a volume's expansion, its deferral or refusal, and
//! the source variables of a `create` from a snapshot or a clone. Each returns a typed
//! [`Completion::Storage`].

use super::Completion;
use crate::cluster::expansion;
use crate::cluster::snapshot::{self, SnapshotRecord};
use crate::cluster::trust::RecordTrust;
use crate::cluster::worker::OpKey;
use crate::nomad::Client;
use crate::storage::environment::NodeEnv;
use crate::storage::plugin::{Capability, Runner};
use crate::volume::{VolumeRecord, VolumeSource};
use std::path::{Path, PathBuf};

/// One storage operation for the shell to perform, with what it needs.
#[derive(Debug)]
pub enum StorageOp {
    /// `snapshot_create` of `volume` (taking the record by check-and-set); `target`: where
    /// the volume is mounted on this node, so the plugin can quiesce it.
    SnapshotCreate {
        volume: Box<VolumeRecord>,
        snapshot: Box<SnapshotRecord>,
        target: Option<PathBuf>,
    },
    /// `snapshot_delete`, then the record is removed.
    SnapshotDelete(Box<SnapshotRecord>),
    /// The plugin does not declare `snapshot`: the record is failed with `message`.
    SnapshotRefuse {
        snapshot: Box<SnapshotRecord>,
        message: String,
    },
    /// `expand` of the volume: online at `target` when it is mounted here, else offline.
    Expand {
        volume: Box<VolumeRecord>,
        target: Option<PathBuf>,
    },
    /// Published here and the plugin cannot grow online: grow before the next publish.
    ExpandDefer(Box<VolumeRecord>),
    /// The plugin does not declare `expand`: the expansion is failed with `message`.
    ExpandRefuse {
        volume: Box<VolumeRecord>,
        message: String,
    },
}

impl StorageOp {
    /// The operation's key (what the core tracks as busy and retries).
    pub fn key(&self) -> OpKey {
        match self {
            StorageOp::SnapshotCreate { snapshot, .. }
            | StorageOp::SnapshotRefuse { snapshot, .. } => OpKey::Snapshot(snapshot.id.clone()),
            StorageOp::SnapshotDelete(s) => OpKey::Snapshot(s.id.clone()),
            StorageOp::Expand { volume, .. }
            | StorageOp::ExpandDefer(volume)
            | StorageOp::ExpandRefuse { volume, .. } => OpKey::Expansion(volume.key()),
        }
    }
}

/// Performs `op` and reports it.
pub async fn perform(client: Client, runner: Runner, node: NodeEnv, op: StorageOp) -> Completion {
    let key = op.key();
    let mut thawed = None;
    let result = match op {
        StorageOp::SnapshotCreate {
            volume,
            snapshot,
            target,
        } => {
            let r = snapshot::create(
                &client,
                &runner,
                &node,
                &volume,
                *snapshot,
                target.as_deref(),
            )
            .await
            .map(drop);
            if let Some(t) = &target {
                thawed = Some(thaw_after_snapshot(&volume.key().to_string(), t).await);
            }
            r
        }
        StorageOp::SnapshotDelete(s) => snapshot::delete(&client, &runner, &node, *s).await,
        StorageOp::SnapshotRefuse { snapshot, message } => {
            snapshot::refuse(&client, *snapshot, message)
                .await
                .map(drop)
        }
        StorageOp::Expand { volume, target } => {
            expansion::expand(&client, &runner, &node, *volume, target.as_deref())
                .await
                .map(drop)
        }
        StorageOp::ExpandDefer(v) => expansion::defer(&client, *v, &node.node_id).await.map(drop),
        StorageOp::ExpandRefuse { volume, message } => {
            expansion::refuse(&client, *volume, message).await.map(drop)
        }
    };
    Completion::Storage {
        op: key,
        result,
        thawed,
    }
}

/// The agent started a `snapshot_create` that may have frozen the volume's mount at
/// `target`: once the call has ended, however it ended, the mount is thawed at once. A
/// mount the call left frozen (a plugin killed between its freeze and its thaw) is an error
/// in the agent's log, naming the volume. Returns what the thaw found (the core keeps the
/// volume reported frozen when it failed).
async fn thaw_after_snapshot(volume: &str, target: &Path) -> crate::node::freeze::Thawed {
    use crate::node::freeze::{thaw, Thawed};
    let thawed = thaw(target).await;
    match &thawed {
        Thawed::NotFrozen => {}
        Thawed::WasFrozen => tracing::error!(
            volume,
            target = %target.display(),
            "the volume was left frozen by a snapshot_create call that ended without thawing it (killed or failed part-way); thawed it"
        ),
        Thawed::Failed(error) => tracing::error!(
            volume,
            target = %target.display(),
            %error,
            "cannot make sure the volume is not left frozen after its snapshot_create call: if its tasks' writes hang, run fsfreeze -u on the target"
        ),
    }
    thawed
}

/// Why a `create` from a source cannot run: the record is failed with this text.
#[derive(Debug, thiserror::Error)]
pub enum SourceFailure {
    /// The source is missing, not ready, or of another plugin.
    #[error(transparent)]
    Source(#[from] snapshot::SourceError),
    /// The plugin does not declare `snapshot` or `clone`.
    #[error(transparent)]
    Capability(#[from] crate::storage::plugin::CapabilityError),
    /// The source record could not be read (retried).
    #[error("cannot read the volume's source: {0}")]
    Read(String),
}

/// The extra variables of a `create` whose spec names a source (`DHV_SNAPSHOT_*` or
/// `DHV_CLONE_*`, see [`snapshot::source_env`]); empty for a volume without one. The
/// plugin's capability is checked from its fingerprint; the clone's target is given when
/// the source volume is mounted here (the kernel's mount table says so, under `mount_root`).
/// A source whose record `trust` refuses is a [`SourceFailure::Source`] (the create fails).
pub async fn source_env(
    client: &Client,
    runner: &Runner,
    rec: &VolumeRecord,
    mount_root: &Path,
    trust: &RecordTrust,
) -> Result<Vec<(String, String)>, SourceFailure> {
    let cap = match &rec.spec.source {
        VolumeSource::Empty => return Ok(Vec::new()),
        VolumeSource::SnapshotId(_) => Capability::Snapshot,
        VolumeSource::CloneId(_) => Capability::Clone,
    };
    let fp = runner
        .fingerprint(&rec.spec.plugin_id)
        .await
        .map_err(|e| SourceFailure::Read(e.to_string()))?;
    fp.require_capability(&rec.spec.plugin_id, cap)?;
    let (snap, clone) = snapshot::read_source(client, rec, trust)
        .await
        .map_err(|e| match e {
            snapshot::ReadSourceError::Read(e) => SourceFailure::Read(e),
            snapshot::ReadSourceError::Refused(e) => SourceFailure::Source(e),
        })?;
    let target = clone.as_ref().and_then(|v| {
        let t = mount_root.join(&v.spec.namespace).join(&v.spec.name);
        crate::node::mounts::is_mount_point(&t).then_some(t)
    });
    Ok(snapshot::source_env(
        rec,
        snap.as_ref(),
        clone.as_ref(),
        target.as_deref(),
    )?)
}
