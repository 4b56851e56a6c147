//! The executor: carries out one step at a time as a spawned task (a plugin call or a Nomad
//! call) and reports a [`Completion`] to the agent's loop. It holds no state of its own.

use crate::claims::{self, ClaimError, ClaimSettings};
use crate::journal::MountRecord;
use crate::mounts;
use crate::nomad::types::{Allocation, HostVolume};
use crate::nomad::{Client, NomadError};
use crate::plugin::{
    self, CreateResult, Fingerprint, Operation, PluginError, PublishResult, Runner,
};
use crate::volume::{VolumeKey, VolumeRecord, VolumeState};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The outcome of one executed step.
#[derive(Debug)]
pub enum Completion {
    Published {
        volume: VolumeKey,
        result: Result<serde_json::Value, String>,
        elapsed: Duration,
    },
    Unpublished {
        volume: VolumeKey,
        result: Result<(), String>,
    },
    Plugins(BTreeMap<String, Result<Fingerprint, String>>),
    PlaceholdersListed(Result<BTreeMap<VolumeKey, String>, String>),
    Placeholder {
        volume: VolumeKey,
        /// `Some(id)` registered, `None` deregistered.
        result: Result<Option<String>, String>,
    },
    Worker {
        volume: VolumeKey,
        result: Result<(), String>,
    },
    ClaimAcquired {
        volume: VolumeKey,
        /// The lock ID, or (held by another node?, message).
        result: Result<String, (bool, String)>,
    },
    ClaimRenewed {
        volume: VolumeKey,
        /// Err((lost?, message)).
        result: Result<(), (bool, String)>,
    },
    ClaimReleased {
        volume: VolumeKey,
        result: Result<(), String>,
    },
    AllocFetched {
        alloc_id: String,
        result: Result<Option<Box<Allocation>>, String>,
    },
}

pub use crate::plugin::{identity_env, node_env, roots_env, NodeEnv};

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

/// Environment of `publish`.
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
    ]);
    env
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
        None => {
            let mut env = node_env(node);
            env.extend([
                ("DHV_NAMESPACE".into(), m.volume.namespace.clone()),
                ("DHV_VOLUME_NAME".into(), m.volume.name.clone()),
                ("DHV_VOLUME_ID".into(), m.volume_id.clone()),
                ("DHV_PARAMETERS".into(), "null".into()),
                ("DHV_SECRETS".into(), "{}".into()),
            ]);
            env
        }
    };
    env.extend([
        (
            "DHV_CONTEXT".into(),
            rec.map(|r| r.context.to_string())
                .unwrap_or_else(|| "null".into()),
        ),
        ("DHV_TARGET_PATH".into(), m.target.display().to_string()),
        ("DHV_READ_ONLY".into(), m.read_only.to_string()),
        ("DHV_PUBLISH_CONTEXT".into(), m.publish_context.to_string()),
    ]);
    env
}

fn secrets_of(rec: Option<&VolumeRecord>) -> BTreeMap<String, String> {
    rec.map(|r| r.secrets.clone()).unwrap_or_default()
}

/// Runs `publish` and checks that the target really is a mount point afterwards.
pub async fn publish(
    runner: Runner,
    node: NodeEnv,
    rec: VolumeRecord,
    target: PathBuf,
    read_only: bool,
    alloc_id: String,
) -> Completion {
    let started = std::time::Instant::now();
    let env = publish_env(&node, &rec, &target, read_only, &alloc_id);
    let result = async {
        let out = runner
            .call(&rec.spec.plugin_id, Operation::Publish, &env, &rec.secrets)
            .await
            .map_err(|e| plugin::redact(&e.to_string(), &rec.secrets))?;
        let res: PublishResult =
            plugin::parse(&rec.spec.plugin_id, Operation::Publish, &out.stdout)
                .map_err(|e| plugin::redact(&e.to_string(), &rec.secrets))?;
        if let Some(p) = &res.path {
            if Path::new(p) != target {
                return Err(format!(
                    "plugin {:?} published at {p}, not at the target {}",
                    rec.spec.plugin_id,
                    target.display()
                ));
            }
        }
        match mounts::mount_count(&target) {
            0 => {
                return Err(format!(
                    "plugin {:?} reported success but {} is not a mount point",
                    rec.spec.plugin_id,
                    target.display()
                ))
            }
            1 => {}
            n => {
                return Err(format!(
                    "plugin {:?} left {n} mounts stacked on {}: a publish must not mount again over its own mount (see docs/plugin-protocol.md, idempotency)",
                    rec.spec.plugin_id,
                    target.display()
                ))
            }
        }
        Ok(res.context)
    }
    .await;
    Completion::Published {
        volume: rec.key(),
        result,
        elapsed: started.elapsed(),
    }
}

/// Runs `unpublish`; success requires the target to be no longer mounted. Then removes the
/// target directory if (and only if) it is empty.
pub async fn unpublish(
    runner: Runner,
    node: NodeEnv,
    m: MountRecord,
    rec: Option<VolumeRecord>,
) -> Completion {
    let env = unpublish_env(&node, &m, rec.as_ref());
    let result = async {
        runner
            .call(
                &m.plugin_id,
                Operation::Unpublish,
                &env,
                &secrets_of(rec.as_ref()),
            )
            .await
            .map_err(|e| plugin::redact(&e.to_string(), &secrets_of(rec.as_ref())))?;
        if mounts::is_mount_point(&m.target) {
            return Err(format!(
                "plugin {:?} reported success but {} is still a mount point",
                m.plugin_id,
                m.target.display()
            ));
        }
        Ok(())
    }
    .await;
    Completion::Unpublished {
        volume: m.volume.clone(),
        result,
    }
}

/// Lists and fingerprints every plugin in the runner's directory.
pub async fn fingerprint_all(runner: Runner) -> Completion {
    let mut out = BTreeMap::new();
    for id in runner.list() {
        let r = runner.fingerprint(&id).await.map_err(|e| e.to_string());
        out.insert(id, r);
    }
    Completion::Plugins(out)
}

/// Finds this node's placeholders: host volumes on the node whose path is under `mount_root`.
pub async fn list_placeholders(client: Client, node_id: String, mount_root: PathBuf) -> Completion {
    let result = async {
        let mut out = BTreeMap::new();
        for stub in client.list_host_volumes(Some(&node_id), "*").await? {
            if stub.node_id != node_id {
                continue;
            }
            if let Some(hv) = client.host_volume(&stub.namespace, &stub.id).await? {
                if Path::new(&hv.host_path).starts_with(&mount_root) {
                    out.insert(
                        VolumeKey {
                            namespace: hv.namespace,
                            name: hv.name,
                        },
                        hv.id,
                    );
                }
            }
        }
        Ok::<_, NomadError>(out)
    }
    .await
    .map_err(|e| e.to_string());
    Completion::PlaceholdersListed(result)
}

/// Registers the placeholder host volume for `rec` on this node, creating its directory.
pub async fn register_placeholder(
    client: Client,
    node: NodeEnv,
    rec: VolumeRecord,
    target: PathBuf,
    existing_id: Option<String>,
) -> Completion {
    let result = async {
        std::fs::create_dir_all(&target)
            .map_err(|e| format!("cannot create {}: {e}", target.display()))?;
        let hv = HostVolume {
            namespace: rec.spec.namespace.clone(),
            id: existing_id.unwrap_or_default(),
            name: rec.spec.name.clone(),
            plugin_id: String::new(),
            node_pool: node.node_pool.clone(),
            node_id: node.node_id.clone(),
            requested_capabilities: rec.placeholder_capabilities(),
            host_path: target.display().to_string(),
            ..Default::default()
        };
        let got = client
            .register_host_volume(&hv)
            .await
            .map_err(|e| e.to_string())?;
        Ok(Some(got.id))
    }
    .await;
    Completion::Placeholder {
        volume: rec.key(),
        result,
    }
}

/// Deregisters a placeholder (refused by Nomad while allocations use it).
pub async fn deregister_placeholder(client: Client, volume: VolumeKey, id: String) -> Completion {
    let result = client
        .delete_host_volume(&volume.namespace, &id)
        .await
        .map(|_| None)
        .map_err(|e| e.to_string());
    Completion::Placeholder { volume, result }
}

/// Fetches one allocation (for a publish call that arrived before its event).
pub async fn fetch_alloc(client: Client, alloc_id: String) -> Completion {
    let result = client
        .allocation(&alloc_id)
        .await
        .map(|a| a.map(Box::new))
        .map_err(|e| e.to_string());
    Completion::AllocFetched { alloc_id, result }
}

async fn cas_update(client: &Client, rec: &VolumeRecord) -> Result<VolumeRecord, String> {
    let var = client
        .put_variable(&rec.to_variable(), Some(rec.modify_index))
        .await
        .map_err(|e| match e {
            NomadError::CasConflict { .. } => "another node changed the record first".to_string(),
            e => e.to_string(),
        })?;
    VolumeRecord::from_variable(&var).map_err(|e| e.to_string())
}

/// Takes a pending (or our own interrupted) create: claims it in the record with a
/// check-and-set write, runs the plugin's `create`, stores context and state.
pub async fn create(
    client: Client,
    runner: Runner,
    node: NodeEnv,
    mut rec: VolumeRecord,
) -> Completion {
    let key = rec.key();
    let result = async {
        if rec.state == VolumeState::Pending {
            rec.state = VolumeState::Creating;
            rec.worker_node = node.node_id.clone();
            rec = cas_update(&client, &rec).await?;
        }
        let env = create_env(&node, &rec);
        match runner
            .call(&rec.spec.plugin_id, Operation::Create, &env, &rec.secrets)
            .await
            .and_then(|o| {
                plugin::parse::<CreateResult>(&rec.spec.plugin_id, Operation::Create, &o.stdout)
            }) {
            Ok(res) => {
                rec.state = VolumeState::Ready;
                rec.context = res.context;
                rec.capacity_bytes = res.bytes;
                rec.error.clear();
            }
            Err(e @ PluginError::TimedOut { .. }) => {
                return Err(plugin::redact(&e.to_string(), &rec.secrets))
            }
            Err(e) => {
                rec.state = VolumeState::Failed;
                rec.error = plugin::redact(&e.to_string(), &rec.secrets);
            }
        }
        rec.worker_node.clear();
        let failed = rec.state == VolumeState::Failed;
        let msg = rec.error.clone();
        cas_update(&client, &rec).await?;
        if failed {
            Err(msg)
        } else {
            Ok(())
        }
    }
    .await;
    Completion::Worker {
        volume: key,
        result,
    }
}

/// Takes a requested delete: claims it, runs the plugin's `delete`, removes the record.
pub async fn delete(
    client: Client,
    runner: Runner,
    node: NodeEnv,
    mut rec: VolumeRecord,
) -> Completion {
    let key = rec.key();
    let result = async {
        if rec.worker_node != node.node_id {
            rec.worker_node = node.node_id.clone();
            rec = cas_update(&client, &rec).await?;
        }
        let env = delete_env(&node, &rec);
        if let Err(e) = runner
            .call(&rec.spec.plugin_id, Operation::Delete, &env, &rec.secrets)
            .await
        {
            rec.worker_node.clear();
            rec.error = plugin::redact(&e.to_string(), &rec.secrets);
            let _ = cas_update(&client, &rec).await;
            return Err(rec.error.clone());
        }
        client
            .delete_variable(
                &rec.spec.namespace,
                &rec.to_variable().path,
                Some(rec.modify_index),
            )
            .await
            .map_err(|e| e.to_string())
    }
    .await;
    Completion::Worker {
        volume: key,
        result,
    }
}

/// Acquires the claim on a single-node volume.
pub async fn acquire_claim(
    client: Client,
    settings: ClaimSettings,
    node: NodeEnv,
    volume: VolumeKey,
    volume_id: String,
) -> Completion {
    let result = claims::acquire(&client, settings, &volume, &node.node_id, &volume_id)
        .await
        .map_err(|e| (matches!(e, ClaimError::Held { .. }), e.to_string()));
    Completion::ClaimAcquired { volume, result }
}

/// Renews a held claim.
pub async fn renew_claim(client: Client, volume: VolumeKey, lock_id: String) -> Completion {
    let result = claims::renew(&client, &volume, &lock_id)
        .await
        .map_err(|e| (matches!(e, ClaimError::Lost { .. }), e.to_string()));
    Completion::ClaimRenewed { volume, result }
}

/// Releases a claim.
pub async fn release_claim(client: Client, volume: VolumeKey, lock_id: String) -> Completion {
    let result = claims::release(&client, &volume, &lock_id)
        .await
        .map_err(|e| e.to_string());
    Completion::ClaimReleased { volume, result }
}
