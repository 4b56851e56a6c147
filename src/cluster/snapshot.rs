//! Snapshots: the cluster-wide record of each snapshot (a Nomad Variable
//! `dhv-binder/snapshots/<snapshot id>` in the source volume's namespace, beside the volume
//! records), the plugin calls that make and remove them, and the environment of a `create`
//! that starts from a snapshot or as a clone of another volume.
//!
//! Shaped like `nomad volume snapshot create|list|delete` (CSI): a snapshot has an ID, a
//! source volume, a size, a creation time and whether it is ready.
//!
//! A snapshot request is signed by the operator's CLI like a volume record
//! ([`crate::cluster::trust::Signed`]): its place (namespace, path, ID) and its source (volume name
//! and ID), name, plugin, secrets and creation time; a delete request carries its own
//! signature, bound to the exact record it deletes (its context and its variable's
//! CreateIndex), as a volume's is. Nodes act only on requests that verify ([`admit`]); a volume created from a
//! snapshot uses it only if it verifies ([`read_source`]).

use crate::cluster::trust::{RecordTrust, Signed};
use crate::cluster::worker::OpError;
use crate::nomad::types::Variable;
use crate::storage::environment::NodeEnv;
use crate::storage::plugin::{self, Operation, Runner, SnapshotResult};
use crate::volume::{self, VolumeRecord, VolumeSource, VolumeState};
use std::collections::BTreeMap;
use std::path::Path;

/// Variable path prefix under which snapshot records live.
pub const SNAPSHOT_PREFIX: &str = "dhv-binder/snapshots/";

/// The variable path of a snapshot's record.
pub fn record_path(id: &str) -> String {
    format!("{SNAPSHOT_PREFIX}{id}")
}

/// The cluster-wide record of one snapshot. Its life uses the volume states: `pending`
/// (requested), `creating` (`worker_node` runs `snapshot_create`), `ready`, `failed`,
/// `deleting` (a node runs `snapshot_delete`, then the record goes).
#[derive(Clone, PartialEq)]
pub struct SnapshotRecord {
    /// UUID chosen at `snapshot create`; passed to plugins as DHV_SNAPSHOT_ID.
    pub id: String,
    /// The operator's name for it (`snapshot create <volume> [name]`), `""` if none.
    pub name: String,
    pub namespace: String,
    /// Source volume's name and ID (the ID stays true after the volume is deleted).
    pub volume: String,
    pub volume_id: String,
    pub plugin_id: String,
    /// The source volume's secrets, copied at request time (the snapshot may outlive the
    /// volume, and `snapshot_delete` needs them). Never printed.
    pub secrets: BTreeMap<String, String>,
    /// The source volume's `secret_ref`s, copied at request time (read at each call, as
    /// the volume's; only the references are stored).
    pub secret_refs: BTreeMap<String, crate::volume::secret_refs::SecretRef>,
    pub state: VolumeState,
    /// What `snapshot_create` returned as `context`.
    pub context: serde_json::Value,
    /// What `snapshot_create` returned as `bytes`.
    pub bytes: u64,
    /// Unix seconds when it was requested.
    pub created_at: u64,
    /// Node running `snapshot_create` or `snapshot_delete` right now; after a
    /// `snapshot_create`, the node that ran it (`volume snapshot create` says which).
    pub worker_node: String,
    /// Last error (redacted).
    pub error: String,
    /// The operator's signature over the request (`crate::cluster::trust`); empty when unsigned.
    pub signature: String,
    /// The operator's signature of the delete request; empty unless `volume snapshot
    /// delete` signed one.
    pub delete_signature: String,
    /// The variable's ModifyIndex, for check-and-set updates.
    pub modify_index: u64,
    /// The variable's CreateIndex (Nomad's, not stored in the items): bound by the delete
    /// signature, so that a signed delete of this record does not verify for a record
    /// written again later under the same ID.
    pub create_index: u64,
}

impl Signed for SnapshotRecord {
    fn place(&self) -> (String, String, String) {
        (
            self.namespace.clone(),
            record_path(&self.id),
            self.id.clone(),
        )
    }
    fn signed_fields(&self) -> Vec<(&'static str, serde_json::Value)> {
        let mut f = vec![
            ("volume", self.volume.clone().into()),
            ("volume_id", self.volume_id.clone().into()),
            ("name", self.name.clone().into()),
            ("plugin_id", self.plugin_id.clone().into()),
            ("secrets", serde_json::json!(self.secrets)),
            ("created_at", self.created_at.into()),
        ];
        // Signed when present (a record without references signs as before).
        if !self.secret_refs.is_empty() {
            f.push(("secret_refs", serde_json::json!(self.secret_refs)));
        }
        f
    }
    /// The context `snapshot_delete` acts on and the variable's CreateIndex, as a volume's
    /// delete binds them: a saved `deleting` record written back later (a new CreateIndex)
    /// or with another context does not verify.
    fn delete_fields(&self) -> Vec<(&'static str, serde_json::Value)> {
        vec![
            ("context", self.context.clone()),
            ("create_index", self.create_index.into()),
        ]
    }
    fn signatures(&self) -> (&str, &str) {
        (&self.signature, &self.delete_signature)
    }
    fn signatures_mut(&mut self) -> (&mut String, &mut String) {
        (&mut self.signature, &mut self.delete_signature)
    }
    fn deleting(&self) -> bool {
        self.state == VolumeState::Deleting
    }
}

impl std::fmt::Debug for SnapshotRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotRecord")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("namespace", &self.namespace)
            .field("volume", &self.volume)
            .field("plugin_id", &self.plugin_id)
            .field("secrets", &format!("{} key(s), hidden", self.secrets.len()))
            .field("state", &self.state)
            .field("bytes", &self.bytes)
            .field("worker_node", &self.worker_node)
            .field("error", &self.error)
            .field("signed", &!self.signature.is_empty())
            .finish_non_exhaustive()
    }
}

impl SnapshotRecord {
    /// A new, `pending` snapshot of `vol`, created at `now` (unix seconds).
    pub fn new(vol: &VolumeRecord, name: &str, now: u64) -> Self {
        Self {
            id: uuid::Uuid::new_v4().to_string(),
            name: name.to_string(),
            namespace: vol.spec.namespace.clone(),
            volume: vol.spec.name.clone(),
            volume_id: vol.id.clone(),
            plugin_id: vol.spec.plugin_id.clone(),
            secrets: vol.secrets.clone(),
            secret_refs: vol.spec.secret_refs.clone(),
            state: VolumeState::Pending,
            context: serde_json::Value::Null,
            bytes: 0,
            created_at: now,
            worker_node: String::new(),
            error: String::new(),
            signature: String::new(),
            delete_signature: String::new(),
            modify_index: 0,
            create_index: 0,
        }
    }

    /// The variable that stores this record.
    pub fn to_variable(&self) -> Variable {
        let mut items = BTreeMap::new();
        for (k, v) in [
            ("id", self.id.clone()),
            ("name", self.name.clone()),
            ("volume", self.volume.clone()),
            ("volume_id", self.volume_id.clone()),
            ("plugin_id", self.plugin_id.clone()),
            (
                "secrets",
                serde_json::to_string(&self.secrets).unwrap_or_default(),
            ),
            (
                "secret_refs",
                if self.secret_refs.is_empty() {
                    String::new()
                } else {
                    serde_json::to_string(&self.secret_refs).unwrap_or_default()
                },
            ),
            ("state", self.state.as_str().into()),
            ("context", self.context.to_string()),
            ("bytes", self.bytes.to_string()),
            ("created_at", self.created_at.to_string()),
            ("worker_node", self.worker_node.clone()),
            ("error", self.error.clone()),
            ("signature", self.signature.clone()),
            ("delete_signature", self.delete_signature.clone()),
        ] {
            items.insert(k.to_string(), v);
        }
        Variable {
            namespace: self.namespace.clone(),
            path: record_path(&self.id),
            items,
            ..Default::default()
        }
    }

    /// Reads a record back from its variable, re-validating what it holds.
    pub fn from_variable(var: &Variable) -> Result<Self, volume::RecordError> {
        let err = |reason: String| volume::RecordError {
            path: var.path.clone(),
            reason,
        };
        let item = |k: &str| var.items.get(k).cloned().unwrap_or_default();
        let id = item("id");
        if uuid::Uuid::parse_str(&id).is_err() || var.path != record_path(&id) {
            return Err(err(format!(
                "id {id:?} is not a UUID matching the variable's path"
            )));
        }
        let volume = item("volume");
        volume::validate_identifier("volume", &volume, true).map_err(|e| err(e.to_string()))?;
        let plugin_id = item("plugin_id");
        volume::validate_identifier("plugin_id", &plugin_id, false)
            .map_err(|e| err(e.to_string()))?;
        let (secrets, state, context) = volume::common_items(var)?;
        let secret_refs = match item("secret_refs").as_str() {
            "" => BTreeMap::new(),
            s => serde_json::from_str(s).map_err(|e| err(format!("secret_refs: {e}")))?,
        };
        Ok(Self {
            id,
            name: item("name"),
            namespace: var.namespace.clone(),
            volume,
            volume_id: item("volume_id"),
            plugin_id,
            secrets,
            secret_refs,
            state,
            context,
            bytes: item("bytes").parse().unwrap_or(0),
            created_at: item("created_at").parse().unwrap_or(0),
            worker_node: item("worker_node"),
            error: item("error"),
            signature: item("signature"),
            delete_signature: item("delete_signature"),
            modify_index: var.modify_index,
            create_index: var.create_index,
        })
    }
}

/// Decodes and checks one snapshot variable; `Err` says why no node may act on it (it does
/// not decode, or `trust` refuses it: unsigned, forged, re-pointed at another volume, or a
/// delete request without the operator's delete signature).
pub fn admit(
    var: &Variable,
    trust: &RecordTrust,
) -> Result<SnapshotRecord, crate::cluster::trust::Refusal> {
    crate::cluster::trust::admit(var, trust, SnapshotRecord::from_variable)
}

/// Environment of `snapshot_create`: the source volume's identity, secrets and `DHV_CONTEXT`,
/// plus `DHV_SNAPSHOT_ID`, `DHV_SNAPSHOT_NAME`, and `DHV_TARGET_PATH`: the volume's mounted
/// target on this node when it is published here (so the plugin can quiesce it), else `""`.
pub fn create_env(
    node: &NodeEnv,
    vol: &VolumeRecord,
    snap: &SnapshotRecord,
    target: Option<&Path>,
) -> Vec<(String, String)> {
    let mut env = crate::storage::environment::identity_env(node, vol);
    env.extend([
        ("DHV_CONTEXT".into(), vol.context.to_string()),
        ("DHV_SNAPSHOT_ID".into(), snap.id.clone()),
        ("DHV_SNAPSHOT_NAME".into(), snap.name.clone()),
        (
            "DHV_TARGET_PATH".into(),
            target.map(|t| t.display().to_string()).unwrap_or_default(),
        ),
    ]);
    env
}

/// Environment of `snapshot_delete`: identity from the snapshot record (the volume may be
/// gone), its secrets, `DHV_SNAPSHOT_ID` and `DHV_SNAPSHOT_CONTEXT`.
pub fn delete_env(node: &NodeEnv, snap: &SnapshotRecord) -> Vec<(String, String)> {
    let mut env = crate::storage::environment::node_env(node);
    env.extend([
        ("DHV_NAMESPACE".into(), snap.namespace.clone()),
        ("DHV_VOLUME_NAME".into(), snap.volume.clone()),
        ("DHV_VOLUME_ID".into(), snap.volume_id.clone()),
        (
            "DHV_SECRETS".into(),
            serde_json::to_string(&snap.secrets).unwrap_or_default(),
        ),
        ("DHV_SNAPSHOT_ID".into(), snap.id.clone()),
        ("DHV_SNAPSHOT_CONTEXT".into(), snap.context.to_string()),
    ]);
    env
}

/// Environment of `snapshot_list` (run by `volume snapshot list --plugin` on the node where
/// it is typed): the node's directories and the secrets the caller gave.
pub fn list_env(node: &NodeEnv, secrets: &BTreeMap<String, String>) -> Vec<(String, String)> {
    let mut env = crate::storage::environment::node_env(node);
    env.push((
        "DHV_SECRETS".into(),
        serde_json::to_string(secrets).unwrap_or_default(),
    ));
    env
}

/// Why a volume's source cannot be used for its `create` (the volume is marked failed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    #[error("snapshot {0} does not exist in namespace {1}")]
    NoSnapshot(String, String),
    #[error(
        "snapshot {id} is {state}, not ready: wait for it (`dhv-binder volume snapshot list`)"
    )]
    SnapshotNotReady { id: String, state: &'static str },
    #[error("volume {0} to clone does not exist in namespace {1}")]
    NoVolume(String, String),
    #[error("the source's record is refused: {0}")]
    Untrusted(String),
    #[error("volume {name} to clone is {state}, not ready")]
    VolumeNotReady { name: String, state: &'static str },
    #[error("the source uses plugin {source_plugin:?} but the new volume uses {plugin:?}: a snapshot or clone stays with its plugin")]
    OtherPlugin {
        source_plugin: String,
        plugin: String,
    },
}

/// The extra variables of a `create` whose spec names a source:
/// - `snapshot_id`: `DHV_SNAPSHOT_ID` and `DHV_SNAPSHOT_CONTEXT` (what `snapshot_create` returned);
/// - `clone_id`: `DHV_CLONE_ID` (the source volume's UUID), `DHV_CLONE_NAME`,
///   `DHV_CLONE_CONTEXT` (its `create` context) and `DHV_CLONE_TARGET_PATH` (its mounted
///   target on this node if it is published here, so the plugin can quiesce it, else `""`).
///
/// `snapshot` / `clone` are the source records as read from Nomad (`None` = absent).
pub fn source_env(
    rec: &VolumeRecord,
    snapshot: Option<&SnapshotRecord>,
    clone: Option<&VolumeRecord>,
    clone_target: Option<&Path>,
) -> Result<Vec<(String, String)>, SourceError> {
    let same_plugin = |source_plugin: &str| {
        if source_plugin == rec.spec.plugin_id {
            Ok(())
        } else {
            Err(SourceError::OtherPlugin {
                source_plugin: source_plugin.into(),
                plugin: rec.spec.plugin_id.clone(),
            })
        }
    };
    match &rec.spec.source {
        VolumeSource::Empty => Ok(Vec::new()),
        VolumeSource::SnapshotId(id) => {
            let s = snapshot
                .filter(|s| &s.id == id && s.namespace == rec.spec.namespace)
                .ok_or_else(|| SourceError::NoSnapshot(id.clone(), rec.spec.namespace.clone()))?;
            if s.state != VolumeState::Ready {
                return Err(SourceError::SnapshotNotReady {
                    id: id.clone(),
                    state: s.state.as_str(),
                });
            }
            same_plugin(&s.plugin_id)?;
            Ok(vec![
                ("DHV_SNAPSHOT_ID".into(), s.id.clone()),
                ("DHV_SNAPSHOT_CONTEXT".into(), s.context.to_string()),
            ])
        }
        VolumeSource::CloneId(name) => {
            let v = clone
                .filter(|v| &v.spec.name == name && v.spec.namespace == rec.spec.namespace)
                .ok_or_else(|| SourceError::NoVolume(name.clone(), rec.spec.namespace.clone()))?;
            if v.state != VolumeState::Ready {
                return Err(SourceError::VolumeNotReady {
                    name: name.clone(),
                    state: v.state.as_str(),
                });
            }
            same_plugin(&v.spec.plugin_id)?;
            Ok(vec![
                ("DHV_CLONE_ID".into(), v.id.clone()),
                ("DHV_CLONE_NAME".into(), v.spec.name.clone()),
                ("DHV_CLONE_CONTEXT".into(), v.context.to_string()),
                (
                    "DHV_CLONE_TARGET_PATH".into(),
                    clone_target
                        .map(|t| t.display().to_string())
                        .unwrap_or_default(),
                ),
            ])
        }
    }
}

/// The source records a volume's `create` reads, for [`source_env`].
pub type Source = (Option<SnapshotRecord>, Option<VolumeRecord>);

/// Why [`read_source`] has no source to give.
#[derive(Debug, thiserror::Error)]
pub enum ReadSourceError {
    /// Nomad could not be read (retried).
    #[error("{0}")]
    Read(String),
    /// The source's record does not decode or `trust` refuses it (the create fails).
    #[error(transparent)]
    Refused(#[from] SourceError),
}

/// Reads the source a volume's spec names (the snapshot record, or the volume to clone), for
/// [`source_env`]. `(None, None)` for a volume with no source, or a source that is gone. The
/// source is used only if its record verifies with `trust` (a snapshot's signature binds its
/// source volume's name and ID, so a record re-pointed at another volume is refused; a volume
/// to clone is a signed volume record like any other).
pub async fn read_source(
    client: &crate::nomad::Client,
    rec: &VolumeRecord,
    trust: &RecordTrust,
) -> Result<Source, ReadSourceError> {
    let ns = &rec.spec.namespace;
    let path = match &rec.spec.source {
        VolumeSource::Empty => return Ok((None, None)),
        VolumeSource::SnapshotId(id) => record_path(id),
        VolumeSource::CloneId(name) => volume::record_path(name),
    };
    let var = client
        .variable(ns, &path)
        .await
        .map_err(|e| ReadSourceError::Read(e.to_string()))?;
    match var {
        None => Ok((None, None)),
        Some(v) => Ok(admit_source(rec, &v, trust)?),
    }
}

/// The source record in `var` for `rec`'s `create`, if it decodes and verifies.
pub fn admit_source(
    rec: &VolumeRecord,
    var: &Variable,
    trust: &RecordTrust,
) -> Result<Source, SourceError> {
    match &rec.spec.source {
        VolumeSource::Empty => Ok((None, None)),
        VolumeSource::SnapshotId(_) => admit(var, trust)
            .map(|s| (Some(s), None))
            .map_err(|r| SourceError::Untrusted(r.message)),
        VolumeSource::CloneId(_) => crate::cluster::catalog::admit(var, trust)
            .map(|v| (None, Some(v)))
            .map_err(|r| SourceError::Untrusted(r.message)),
    }
}

/// Runs `snapshot_create` and returns the record as it should be written: `ready` with the
/// plugin's context and size, or `failed` with its (redacted) error. A timeout is `Err`:
/// the outcome is unknown and the same node calls again (the operation is idempotent per
/// `DHV_SNAPSHOT_ID`).
pub async fn run_create(
    runner: &Runner,
    node: &NodeEnv,
    vol: &VolumeRecord,
    mut snap: SnapshotRecord,
    target: Option<&Path>,
) -> Result<SnapshotRecord, OpError> {
    let mut env = create_env(node, vol, &snap, target);
    // The volume's referenced secrets, read now (never stored in the snapshot record).
    let secrets = match runner.secrets_for(Operation::SnapshotCreate, vol).await {
        Ok(s) => s,
        Err(e) => {
            return Err(OpError::retried(&e, &vol.secrets)
                .unwrap_or_else(|| OpError::Plugin(plugin::redact(&e.to_string(), &vol.secrets))))
        }
    };
    crate::storage::environment::set_secrets(&mut env, &secrets);
    let out = runner
        .call(&snap.plugin_id, Operation::SnapshotCreate, &env, &secrets)
        .await
        .and_then(|o| {
            plugin::parse::<SnapshotResult>(&snap.plugin_id, Operation::SnapshotCreate, &o.stdout)
        });
    match out {
        Ok(res) => {
            snap.state = VolumeState::Ready;
            snap.context = res.context;
            snap.bytes = res.bytes;
            snap.error.clear();
        }
        Err(e) => {
            if let Some(again) = OpError::retried(&e, &secrets) {
                return Err(again);
            }
            snap.state = VolumeState::Failed;
            snap.error = plugin::redact(&e.to_string(), &secrets);
        }
    }
    // Kept: the node that ran it (a ready or failed snapshot is no node's work any more).
    snap.worker_node = node.node_id.clone();
    Ok(snap)
}

/// Runs `snapshot_delete`. `Ok` means the storage no longer holds the snapshot.
pub async fn run_delete(
    runner: &Runner,
    node: &NodeEnv,
    snap: &SnapshotRecord,
) -> Result<(), OpError> {
    let secrets = runner
        .secrets_of(
            &snap.plugin_id,
            Operation::SnapshotDelete,
            &snap.namespace,
            &snap.secrets,
            &snap.secret_refs,
        )
        .await
        .map_err(|e| {
            OpError::retried(&e, &snap.secrets)
                .unwrap_or_else(|| OpError::Plugin(plugin::redact(&e.to_string(), &snap.secrets)))
        })?;
    let mut env = delete_env(node, snap);
    crate::storage::environment::set_secrets(&mut env, &secrets);
    // Every storage delete is logged at info, naming what it deletes (issue 33).
    let context = plugin::redact(&snap.context.to_string(), &secrets);
    // The same fields before and after the plugin's call.
    let log_delete = |what: &str| {
        tracing::info!(
            snapshot_id = %snap.id,
            snapshot = %snap.name,
            namespace = %snap.namespace,
            volume = %snap.volume,
            volume_id = %snap.volume_id,
            plugin = %snap.plugin_id,
            node = %node.node_id,
            %context,
            "{what}"
        );
    };
    log_delete("deleting the snapshot's storage");
    runner
        .call(&snap.plugin_id, Operation::SnapshotDelete, &env, &secrets)
        .await
        .map_err(|e| OpError::Plugin(plugin::redact(&e.report(), &secrets)))?;
    log_delete("deleted the snapshot's storage");
    Ok(())
}

/// What a node does about one snapshot record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Not this node's (or nothing to do).
    None,
    /// Run `snapshot_create` here ([`create`]).
    Create,
    /// Run `snapshot_delete` here ([`delete`]).
    Delete,
    /// The plugin does not declare `snapshot`: fail the snapshot with this message
    /// ([`refuse`]).
    Refuse(String),
}

/// Decides this node's step for `snap`. `published`: where its source volume is published;
/// `fp`: the plugin's fingerprint on this node (`None` = the plugin is not here). A snapshot
/// is taken where the volume is published (so the plugin can quiesce it), else by any node
/// with the plugin; a delete by any node with the plugin. Both claimed by check-and-set.
pub fn step(
    snap: &SnapshotRecord,
    me: &str,
    published: crate::cluster::worker::Published,
    fp: Option<&crate::storage::plugin::Fingerprint>,
) -> Step {
    use crate::cluster::worker::{runs_here, Published};
    let want = match snap.state {
        VolumeState::Pending => Step::Create,
        VolumeState::Creating if snap.worker_node == me => Step::Create,
        VolumeState::Deleting => Step::Delete,
        _ => return Step::None,
    };
    // Where the volume is published does not matter for a delete.
    let published = if want == Step::Delete {
        Published::Nowhere
    } else {
        published
    };
    if !runs_here(me, &snap.worker_node, published, fp.is_some()) {
        return Step::None;
    }
    match fp.map(|f| f.require(&snap.plugin_id, Operation::SnapshotCreate)) {
        Some(Err(e)) if want == Step::Create => Step::Refuse(e.to_string()),
        _ => want,
    }
}

/// Fails a pending snapshot with `message` (its plugin does not declare `snapshot`).
pub async fn refuse(
    client: &crate::nomad::Client,
    mut snap: SnapshotRecord,
    message: String,
) -> Result<SnapshotRecord, OpError> {
    snap.state = VolumeState::Failed;
    snap.worker_node.clear();
    snap.error = message;
    write(client, &snap).await
}

/// Takes a pending snapshot for this node (check-and-set), runs `snapshot_create` and
/// writes the outcome. Returns the record as written.
pub async fn create(
    client: &crate::nomad::Client,
    runner: &Runner,
    node: &NodeEnv,
    vol: &VolumeRecord,
    mut snap: SnapshotRecord,
    target: Option<&Path>,
) -> Result<SnapshotRecord, OpError> {
    if snap.state == VolumeState::Pending {
        snap.state = VolumeState::Creating;
        snap.worker_node = node.node_id.clone();
        snap = write(client, &snap).await?;
    }
    let done = run_create(runner, node, vol, snap, target).await?;
    write(client, &done).await
}

/// Takes a requested delete (check-and-set), runs `snapshot_delete`, removes the record.
pub async fn delete(
    client: &crate::nomad::Client,
    runner: &Runner,
    node: &NodeEnv,
    mut snap: SnapshotRecord,
) -> Result<(), OpError> {
    if snap.worker_node != node.node_id {
        snap.worker_node = node.node_id.clone();
        snap = write(client, &snap).await?;
    }
    if let Err(e) = run_delete(runner, node, &snap).await {
        snap.worker_node.clear();
        snap.error = e.to_string();
        let _ = write(client, &snap).await;
        return Err(e);
    }
    crate::cluster::changes::delete_record(
        client,
        &snap.namespace,
        &record_path(&snap.id),
        Some(snap.modify_index),
    )
    .await
    .map_err(|e| match e {
        crate::nomad::NomadError::CasConflict { .. } => {
            OpError::Take(crate::cluster::worker::TakeError::Lost {
                path: record_path(&snap.id),
                index: snap.modify_index,
            })
        }
        e => OpError::Take(e.into()),
    })
}

async fn write(
    client: &crate::nomad::Client,
    snap: &SnapshotRecord,
) -> Result<SnapshotRecord, OpError> {
    let var =
        crate::cluster::worker::put_cas(client, &snap.to_variable(), snap.modify_index).await?;
    Ok(SnapshotRecord::from_variable(&var)?)
}

/// Every snapshot record in the cluster, by snapshot ID.
pub type Snapshots = BTreeMap<String, SnapshotRecord>;

/// Follows the snapshot records (`dhv-binder/snapshots/`) as the volume catalogue follows the
/// volume records (`catalog::follow`: one list at start, then the records the change marker
/// names, a full list after a gap and every relist) and sends every record `trust` admits
/// after each change. One that does not decode or that `trust` refuses ([`admit`]) is
/// logged once (per index), listed in `rejected` and left out (never deleted, never acted
/// on). Nomad errors are retried with a backoff of 0.5 s doubling to 30 s.
pub async fn watch(
    client: crate::nomad::Client,
    follow: crate::cluster::catalog::Follow,
    trust: RecordTrust,
    rejected: crate::cluster::catalog::Rejections,
    tx: tokio::sync::mpsc::Sender<Snapshots>,
) {
    let kind = crate::cluster::catalog::Kind {
        prefix: SNAPSHOT_PREFIX,
        admit,
        refused: |namespace, path, reason| {
            use crate::escape::escape_control;
            tracing::warn!(
                namespace = %escape_control(namespace),
                path = %escape_control(path),
                reason = %escape_control(reason),
                "refusing a snapshot record: no snapshot is taken, deleted or restored from it"
            );
        },
    };
    crate::cluster::catalog::follow(client, kind, follow, trust, rejected, snapshots_of, tx).await
}

fn snapshots_of(cache: &crate::cluster::catalog::Cache<SnapshotRecord>) -> Snapshots {
    cache
        .values()
        .filter_map(|(_, r)| r.clone().and_then(Result::ok))
        .map(|r| (r.id.clone(), r))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume() -> VolumeRecord {
        let (spec, secrets) = crate::volume::parse_spec(
            "name = \"data\"\nplugin_id = \"ext4\"\nsecrets { key = \"s3cret\" }",
        )
        .unwrap();
        let mut rec = VolumeRecord::new(spec, secrets);
        rec.state = VolumeState::Ready;
        rec.context = serde_json::json!({"image": "/srv/images/default/x.img"});
        rec
    }

    fn node() -> NodeEnv {
        NodeEnv {
            node_id: "n1".into(),
            node_pool: "default".into(),
            volumes_dir: "/var/lib/dhv-binder/volumes".into(),
            plugin_dir: "/opt/dhv-binder/plugins".into(),
        }
    }

    #[test]
    fn record_round_trips_and_hides_its_secrets() {
        let vol = volume();
        let mut snap = SnapshotRecord::new(&vol, "nightly", 1_700_000_000);
        snap.state = VolumeState::Ready;
        snap.context = serde_json::json!({"image": "/srv/images/default/snapshots/y.img"});
        snap.bytes = 42;
        let mut var = snap.to_variable();
        var.modify_index = 7;
        assert_eq!(var.path, format!("dhv-binder/snapshots/{}", snap.id));
        assert_eq!(var.namespace, "default");
        let back = SnapshotRecord::from_variable(&var).unwrap();
        snap.modify_index = 7;
        assert_eq!(back, snap);
        assert_eq!(back.secrets["key"], "s3cret");
        assert!(!format!("{back:?}").contains("s3cret"));
        // A record whose ID does not match its path is refused.
        var.path = record_path(&uuid::Uuid::new_v4().to_string());
        assert!(SnapshotRecord::from_variable(&var).is_err());
    }

    /// A snapshot keeps its volume's references (for a `snapshot_delete` after the volume is
    /// gone), never their values, and the operator's signature binds them.
    #[test]
    fn a_snapshot_keeps_its_volumes_secret_references_signed() {
        let (spec, secrets) = crate::volume::parse_spec(
            "name = \"data\"\nplugin_id = \"webdav\"\nsecret_ref \"password\" {\n variable = \"dhv-binder-secrets/data\"\n item = \"password\"\n}",
        )
        .unwrap();
        let vol = VolumeRecord::new(spec, secrets);
        let (key, _) = crate::cluster::trust::SigningKey::generate().unwrap();
        let trust =
            crate::cluster::trust::RecordTrust::parse_keys(&key.public_line(), "k").unwrap();
        let mut snap = SnapshotRecord::new(&vol, "", 1_700_000_000);
        key.sign(&mut snap);
        let back = SnapshotRecord::from_variable(&snap.to_variable()).unwrap();
        assert_eq!(back.secret_refs, vol.spec.secret_refs);
        assert_eq!(trust.verify(&back), Ok(()));
        let mut moved = back.clone();
        moved.secret_refs.insert(
            "password".into(),
            crate::volume::secret_refs::SecretRef::Variable {
                path: "dhv-binder-secrets/other".into(),
                item: "password".into(),
            },
        );
        assert!(trust.verify(&moved).is_err());
    }

    fn get<'a>(env: &'a [(String, String)], k: &str) -> &'a str {
        env.iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("{k} missing from {env:?}"))
    }

    #[test]
    fn snapshot_calls_get_identity_secrets_context_and_the_mounted_target() {
        let vol = volume();
        let snap = SnapshotRecord::new(&vol, "nightly", 1);
        let env = create_env(&node(), &vol, &snap, Some(Path::new("/mnt/t")));
        assert_eq!(get(&env, "DHV_SNAPSHOT_ID"), snap.id);
        assert_eq!(get(&env, "DHV_VOLUME_ID"), vol.id);
        assert_eq!(get(&env, "DHV_TARGET_PATH"), "/mnt/t");
        assert_eq!(get(&env, "DHV_SECRETS"), r#"{"key":"s3cret"}"#);
        assert_eq!(get(&env, "DHV_CONTEXT"), vol.context.to_string());
        // The node's roots come from the runner (--plugin-root), never from the call's env.
        assert!(env.iter().all(|(k, _)| k != "DHV_ALLOWED_ROOTS"));
        let env = create_env(&node(), &vol, &snap, None);
        assert_eq!(get(&env, "DHV_TARGET_PATH"), "");
        // Delete works from the snapshot alone (the volume may be gone), with its secrets.
        let env = delete_env(&node(), &snap);
        assert_eq!(get(&env, "DHV_SECRETS"), r#"{"key":"s3cret"}"#);
        assert_eq!(get(&env, "DHV_SNAPSHOT_CONTEXT"), "null");
        assert_eq!(get(&env, "DHV_VOLUME_NAME"), "data");
        let env = list_env(&node(), &BTreeMap::from([("k".into(), "v".into())]));
        assert_eq!(get(&env, "DHV_SECRETS"), r#"{"k":"v"}"#);
    }

    fn keys() -> (crate::cluster::trust::SigningKey, RecordTrust) {
        let (key, _) = crate::cluster::trust::SigningKey::generate().unwrap();
        let trust = RecordTrust::parse_keys(&key.public_line(), "keys").unwrap();
        (key, trust)
    }

    fn stored(snap: &SnapshotRecord) -> Variable {
        let mut var = snap.to_variable();
        var.modify_index = 5;
        var
    }

    #[test]
    fn a_planted_unsigned_or_forged_snapshot_request_is_not_admitted() {
        let (key, trust) = keys();
        let vol = volume();
        let mut snap = SnapshotRecord::new(&vol, "nightly", 1);
        // Unsigned: refused, saying how to sign it; admitted only on a test cluster.
        let e = admit(&stored(&snap), &trust).unwrap_err().message;
        assert!(
            e.contains("not signed") && e.contains("--signing-key"),
            "{e}"
        );
        assert!(admit(&stored(&snap), &RecordTrust::Unverified).is_ok());
        key.sign(&mut snap);
        let ok = admit(&stored(&snap), &trust).unwrap();
        assert_eq!(ok.signature, snap.signature, "the signature round-trips");
        // What nodes write back is not signed.
        let mut done = snap.clone();
        done.state = VolumeState::Ready;
        done.context = serde_json::json!({"image": "/srv/images/default/snapshots/y.img"});
        done.worker_node = "n1".into();
        assert!(admit(&stored(&done), &trust).is_ok());
        // Every field that says what is snapshotted, where, and with what, is bound.
        let tamper: [fn(&mut SnapshotRecord); 7] = [
            |s| s.volume = "other".into(),
            |s| s.volume_id = uuid::Uuid::new_v4().to_string(),
            |s| s.namespace = "other".into(),
            |s| s.name = "other".into(),
            |s| s.plugin_id = "bind".into(),
            |s| {
                s.secrets.insert("key".into(), "other".into());
            },
            |s| s.created_at = 2,
        ];
        for t in tamper {
            let mut bad = snap.clone();
            t(&mut bad);
            let e = admit(&stored(&bad), &trust).unwrap_err().message;
            assert!(e.contains("does not verify"), "{e}");
        }
        // Copied to another ID (its path follows): refused.
        let mut moved = snap.clone();
        moved.id = uuid::Uuid::new_v4().to_string();
        assert!(admit(&stored(&moved), &trust).is_err());
        // A volume record's signature is no snapshot's.
        let mut signed_vol = vol.clone();
        key.sign(&mut signed_vol);
        let mut borrowed = SnapshotRecord::new(&vol, "nightly", 1);
        borrowed.signature = signed_vol.signature.clone();
        assert!(admit(&stored(&borrowed), &trust).is_err());
    }

    #[test]
    fn a_snapshot_delete_needs_the_operators_delete_signature_of_that_snapshot() {
        let (key, trust) = keys();
        let vol = volume();
        let mut snap = SnapshotRecord::new(&vol, "", 1);
        key.sign(&mut snap);
        snap.state = VolumeState::Deleting;
        let e = admit(&stored(&snap), &trust).unwrap_err().message;
        assert!(e.contains("snapshot delete"), "{e}");
        // Neither the request's own signature nor the volume's delete signature will do.
        snap.delete_signature = snap.signature.clone();
        assert!(admit(&stored(&snap), &trust).is_err());
        let mut v = vol.clone();
        key.sign_delete(&mut v);
        snap.delete_signature = v.delete_signature.clone();
        assert!(admit(&stored(&snap), &trust).is_err());
        // Another snapshot's delete signature does not carry over.
        let mut other = SnapshotRecord::new(&vol, "", 1);
        key.sign(&mut other);
        key.sign_delete(&mut other);
        snap.delete_signature = other.delete_signature.clone();
        assert!(admit(&stored(&snap), &trust).is_err());
        key.sign_delete(&mut snap);
        assert!(admit(&stored(&snap), &trust).is_ok());
    }

    /// Issue 44 §11: a delete signature binds the exact snapshot record (its context and its
    /// variable's CreateIndex), as a volume's does: the operator's signed delete of one
    /// record of an ID, written back with another context or as a record made again later
    /// under that ID, is refused.
    #[test]
    fn a_snapshot_delete_signature_binds_the_exact_record() {
        let (key, trust) = keys();
        let vol = volume();
        let mut snap = SnapshotRecord::new(&vol, "", 1);
        key.sign(&mut snap);
        snap.state = VolumeState::Deleting;
        snap.context = serde_json::json!({"snapshot_path": "/srv/exports/default/.snapshots/a"});
        let stored_at = |s: &SnapshotRecord, create_index: u64| {
            let mut var = stored(s);
            var.create_index = create_index;
            var
        };
        snap.create_index = 7;
        key.sign_delete(&mut snap);
        assert!(admit(&stored_at(&snap, 7), &trust).is_ok());
        // The same signed delete with another context: refused.
        let mut other_context = snap.clone();
        other_context.context =
            serde_json::json!({"snapshot_path": "/srv/exports/default/.snapshots/b"});
        let e = admit(&stored_at(&other_context, 7), &trust)
            .unwrap_err()
            .message;
        assert!(e.contains("delete signature"), "{e}");
        // The same signed record written again later (a new CreateIndex): refused.
        assert!(admit(&stored_at(&snap, 90), &trust).is_err());
    }

    #[test]
    fn a_restore_refuses_a_snapshot_re_pointed_at_another_volume_and_an_unsigned_clone() {
        let (key, trust) = keys();
        let src = volume();
        let mut snap = SnapshotRecord::new(&src, "", 1);
        key.sign(&mut snap);
        snap.state = VolumeState::Ready;
        snap.context = serde_json::json!({"image": "/srv/images/default/snapshots/s.img"});
        let (spec, _) = crate::volume::parse_spec(&format!(
            "name = \"restored\"\nplugin_id = \"ext4\"\nsnapshot_id = \"{}\"",
            snap.id
        ))
        .unwrap();
        let rec = VolumeRecord::new(spec.clone(), BTreeMap::new());
        let (s, c) = admit_source(&rec, &stored(&snap), &trust).unwrap();
        assert!(c.is_none());
        assert!(source_env(&rec, s.as_ref(), None, None).is_ok());
        // Re-pointed at another volume (its name and ID): refused, the create fails.
        let mut other = crate::volume::parse_spec("name = \"secret\"\nplugin_id = \"ext4\"")
            .map(|(s, x)| VolumeRecord::new(s, x))
            .unwrap();
        other.state = VolumeState::Ready;
        let mut repointed = snap.clone();
        repointed.volume = other.spec.name.clone();
        repointed.volume_id = other.id.clone();
        match admit_source(&rec, &stored(&repointed), &trust) {
            Err(SourceError::Untrusted(m)) => assert!(m.contains("does not verify"), "{m}"),
            other => panic!("{other:?}"),
        }
        // An unsigned snapshot record: refused the same way.
        let mut unsigned = snap.clone();
        unsigned.signature.clear();
        assert!(matches!(
            admit_source(&rec, &stored(&unsigned), &trust),
            Err(SourceError::Untrusted(_))
        ));
        // A clone names a volume record: used only if it verifies as the catalogue's do.
        let mut spec = spec;
        spec.source = VolumeSource::CloneId("secret".into());
        let clone = VolumeRecord::new(spec, BTreeMap::new());
        let mut var = other.to_variable();
        var.modify_index = 3;
        assert!(matches!(
            admit_source(&clone, &var, &trust),
            Err(SourceError::Untrusted(_))
        ));
        key.sign(&mut other);
        let mut var = other.to_variable();
        var.modify_index = 3;
        let (s, c) = admit_source(&clone, &var, &trust).unwrap();
        assert!(s.is_none());
        assert!(source_env(&clone, None, c.as_ref(), None).is_ok());
    }

    #[test]
    fn taken_where_published_else_anywhere_refused_without_the_capability() {
        use crate::cluster::worker::Published::*;
        let fp = |caps: &[&str]| crate::storage::plugin::Fingerprint {
            version: "1.0.0".into(),
            deferred_bind: true,
            capabilities: caps.iter().map(|c| c.to_string()).collect(),
            ..Default::default()
        };
        let (yes, no) = (fp(&["snapshot"]), fp(&[]));
        let mut snap = SnapshotRecord::new(&volume(), "", 1);
        assert_eq!(step(&snap, "n1", Here, Some(&yes)), Step::Create);
        assert_eq!(step(&snap, "n1", Elsewhere, Some(&yes)), Step::None);
        assert_eq!(step(&snap, "n1", Nowhere, Some(&yes)), Step::Create);
        assert_eq!(step(&snap, "n1", Nowhere, None), Step::None);
        match step(&snap, "n1", Nowhere, Some(&no)) {
            Step::Refuse(m) => assert!(m.contains("\"ext4\"") && m.contains("snapshot"), "{m}"),
            other => panic!("{other:?}"),
        }
        snap.state = VolumeState::Creating;
        snap.worker_node = "n2".into();
        assert_eq!(step(&snap, "n1", Here, Some(&yes)), Step::None);
        assert_eq!(step(&snap, "n2", Here, Some(&yes)), Step::Create);
        snap.state = VolumeState::Ready;
        assert_eq!(step(&snap, "n2", Here, Some(&yes)), Step::None);
        // A delete goes to any node with the plugin, published or not.
        snap.state = VolumeState::Deleting;
        snap.worker_node.clear();
        assert_eq!(step(&snap, "n1", Elsewhere, Some(&yes)), Step::Delete);
        assert_eq!(step(&snap, "n1", Elsewhere, None), Step::None);
    }

    #[test]
    fn create_from_a_source_gets_its_context_or_a_clear_refusal() {
        let src = volume();
        let mut snap = SnapshotRecord::new(&src, "", 1);
        snap.context = serde_json::json!({"image": "/srv/images/default/snapshots/s.img"});
        let (mut spec, _) = crate::volume::parse_spec(&format!(
            "name = \"restored\"\nplugin_id = \"ext4\"\nsnapshot_id = \"{}\"",
            snap.id
        ))
        .unwrap();
        let rec = VolumeRecord::new(spec.clone(), BTreeMap::new());
        assert_eq!(
            source_env(&rec, None, None, None),
            Err(SourceError::NoSnapshot(snap.id.clone(), "default".into()))
        );
        assert!(matches!(
            source_env(&rec, Some(&snap), None, None),
            Err(SourceError::SnapshotNotReady { .. })
        ));
        snap.state = VolumeState::Ready;
        let env = source_env(&rec, Some(&snap), None, None).unwrap();
        assert_eq!(get(&env, "DHV_SNAPSHOT_CONTEXT"), snap.context.to_string());
        let mut other = snap.clone();
        other.plugin_id = "bind".into();
        assert!(matches!(
            source_env(&rec, Some(&other), None, None),
            Err(SourceError::OtherPlugin { .. })
        ));
        spec.source = VolumeSource::CloneId("data".into());
        let rec = VolumeRecord::new(spec, BTreeMap::new());
        let env = source_env(&rec, None, Some(&src), Some(Path::new("/mnt/data"))).unwrap();
        assert_eq!(get(&env, "DHV_CLONE_ID"), src.id);
        assert_eq!(get(&env, "DHV_CLONE_CONTEXT"), src.context.to_string());
        assert_eq!(get(&env, "DHV_CLONE_TARGET_PATH"), "/mnt/data");
        assert_eq!(
            source_env(&rec, None, None, None),
            Err(SourceError::NoVolume("data".into(), "default".into()))
        );
    }
}
