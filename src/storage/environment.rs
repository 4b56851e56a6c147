//! The plugin environment contract: the variables each plugin operation is called with
//! (docs/plugin-protocol.md). Used by the executor for real calls and by the conformance
//! kit (`dhv-binder plugin check`) for its test calls, so both speak the same contract.

use crate::node::journal::MountRecord;
use crate::volume::VolumeRecord;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What every plugin call on a volume is told about this node.
#[derive(Debug, Clone)]
pub struct NodeEnv {
    pub node_id: String,
    pub node_pool: String,
    pub volumes_dir: PathBuf,
    pub plugin_dir: PathBuf,
}

/// The variables about this node every call but `fingerprint` gets: `DHV_VOLUMES_DIR`,
/// `DHV_PLUGIN_DIR`, `DHV_NODE_ID`, `DHV_NODE_POOL`. (`DHV_ALLOWED_ROOTS` is set by the
/// runner from the node's `--plugin-root`s, [`crate::storage::plugin::Runner::with_allowed_roots`].)
pub fn node_env(node: &NodeEnv) -> Vec<(String, String)> {
    vec![
        (
            "DHV_VOLUMES_DIR".into(),
            node.volumes_dir.display().to_string(),
        ),
        (
            "DHV_PLUGIN_DIR".into(),
            node.plugin_dir.display().to_string(),
        ),
        ("DHV_NODE_ID".into(), node.node_id.clone()),
        ("DHV_NODE_POOL".into(), node.node_pool.clone()),
    ]
}

/// The variables every call on a volume gets: the node, then the volume's identity.
fn base_env(
    node: &NodeEnv,
    namespace: &str,
    name: &str,
    id: &str,
    parameters: String,
    secrets: String,
) -> Vec<(String, String)> {
    let mut env = node_env(node);
    env.extend([
        ("DHV_NAMESPACE".into(), namespace.to_string()),
        ("DHV_VOLUME_NAME".into(), name.to_string()),
        ("DHV_VOLUME_ID".into(), id.to_string()),
        ("DHV_PARAMETERS".into(), parameters),
        ("DHV_SECRETS".into(), secrets),
    ]);
    env
}

/// The variables every call on a volume gets: node, volume identity, parameters, secrets,
/// and `DHV_CONTEXT_SIGNED`: `true` when the volume's context is covered by the operator's
/// signature (a registered volume), `false` when a node wrote it (a created volume: plugins
/// must not take a path from it, docs/security.md).
pub fn identity_env(node: &NodeEnv, rec: &VolumeRecord) -> Vec<(String, String)> {
    let s = &rec.spec;
    let parameters = if s.parameters.is_empty() {
        "null".into()
    } else {
        serde_json::to_string(&s.parameters).unwrap_or_default()
    };
    let secrets = serde_json::to_string(&rec.secrets).unwrap_or_default();
    let mut env = base_env(node, &s.namespace, &s.name, &rec.id, parameters, secrets);
    env.push(("DHV_CONTEXT_SIGNED".into(), rec.registered.to_string()));
    env
}

/// Replaces `DHV_SECRETS` in `env` with `secrets` (the record's inline secrets and the
/// referenced ones read for this call, [`crate::storage::plugin::Runner::secrets_for`]).
pub fn set_secrets(env: &mut Vec<(String, String)>, secrets: &BTreeMap<String, String>) {
    env.retain(|(k, _)| k != "DHV_SECRETS");
    env.push((
        "DHV_SECRETS".into(),
        serde_json::to_string(secrets).unwrap_or_default(),
    ));
}

/// Environment of `create` (Nomad's create variables, plus DHV_SECRETS).
pub fn create_env(node: &NodeEnv, rec: &VolumeRecord) -> Vec<(String, String)> {
    let mut env = identity_env(node, rec);
    env.push((
        "DHV_CAPACITY_MIN_BYTES".into(),
        rec.spec.capacity_min.to_string(),
    ));
    env.push((
        "DHV_CAPACITY_MAX_BYTES".into(),
        rec.spec.capacity_max.to_string(),
    ));
    env
}

/// Environment of `delete` (Nomad's delete variables, plus DHV_CONTEXT and DHV_SECRETS).
pub fn delete_env(node: &NodeEnv, rec: &VolumeRecord) -> Vec<(String, String)> {
    let mut env = identity_env(node, rec);
    env.push(("DHV_CREATED_PATH".into(), String::new()));
    env.push(("DHV_CONTEXT".into(), rec.context.to_string()));
    env
}

/// Environment of `publish`: with `DHV_MOUNT_FLAGS`, the flags the published mount must
/// carry (`nosuid,nodev` unless the spec's `mount_options` say otherwise,
/// [`crate::volume::mount_options::MountFlags::to_list`]), and `DHV_FS_TYPE` when the spec names one.
pub fn publish_env(
    node: &NodeEnv,
    rec: &VolumeRecord,
    target: &Path,
    read_only: bool,
    alloc_id: &str,
) -> Vec<(String, String)> {
    let mut env = create_env(node, rec);
    let cap = rec.spec.capabilities.first();
    env.extend([
        ("DHV_CONTEXT".into(), rec.context.to_string()),
        ("DHV_TARGET_PATH".into(), target.display().to_string()),
        ("DHV_READ_ONLY".into(), read_only.to_string()),
        (
            "DHV_ACCESS_MODE".into(),
            cap.map(|c| c.access_mode.clone()).unwrap_or_default(),
        ),
        (
            "DHV_ATTACHMENT_MODE".into(),
            cap.map(|c| c.attachment_mode.clone()).unwrap_or_default(),
        ),
        ("DHV_ALLOC_ID".into(), alloc_id.to_string()),
        (
            "DHV_MOUNT_FLAGS".into(),
            rec.spec.mount_options.flags().to_list(),
        ),
    ]);
    if !rec.spec.mount_options.fs_type.is_empty() {
        env.push(("DHV_FS_TYPE".into(), rec.spec.mount_options.fs_type.clone()));
    }
    env
}

/// Environment of `refresh`: `unpublish`'s (the stored target, the publish's context),
/// with the volume record whose secrets are applied.
pub fn refresh_env(node: &NodeEnv, m: &MountRecord, rec: &VolumeRecord) -> Vec<(String, String)> {
    unpublish_env(node, m, Some(rec))
}

/// Environment of `unpublish`: from the journal record (the stored target, never a
/// recomputed one), plus the volume record when it still exists.
pub fn unpublish_env(
    node: &NodeEnv,
    m: &MountRecord,
    rec: Option<&VolumeRecord>,
) -> Vec<(String, String)> {
    let mut env = match rec {
        Some(r) => identity_env(node, r),
        None => base_env(
            node,
            &m.volume.namespace,
            &m.volume.name,
            &m.volume_id,
            "null".into(),
            "{}".into(),
        ),
    };
    env.extend([
        (
            "DHV_CONTEXT".into(),
            rec.map(|r| r.context.to_string())
                .unwrap_or_else(|| "null".into()),
        ),
        ("DHV_TARGET_PATH".into(), m.target.display().to_string()),
        ("DHV_READ_ONLY".into(), m.read_only.to_string()),
        (
            "DHV_PUBLISH_CONTEXT".into(),
            m.publish_context.value().to_string(),
        ),
    ]);
    env
}
