//! The executor: carries out one effect (a plugin call or a Nomad call) and returns its
//! [`Completion`], with the modules' typed errors. It holds no state of its own; the
//! agent's shell runs these as tasks.

use crate::claims::{self, ClaimError, ClaimSettings};
use crate::environment::{create_env, delete_env, publish_env, unpublish_env, NodeEnv};
use crate::health::Probe;
use crate::journal::MountRecord;
use crate::mounts;
use crate::nomad::types::Allocation;
use crate::nomad::types::HostVolume;
use crate::nomad::{Client, NomadError};
use crate::plugin::Fingerprint;
use crate::plugin::{self, CreateResult, Operation, PluginError, PublishResult, Runner};
use crate::volume::{RecordError, VolumeKey, VolumeRecord, VolumeState};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub mod storage;

/// The outcome of one effect.
#[derive(Debug)]
pub enum Completion {
    /// `publish` ran; `Ok` carries the plugin's `context`.
    Published {
        volume: VolumeKey,
        result: Result<serde_json::Value, StepError>,
        elapsed: Duration,
    },
    /// `unpublish` ran (and the empty target directory was removed).
    Unpublished {
        volume: VolumeKey,
        result: Result<(), StepError>,
    },
    /// Every plugin in the directory, fingerprinted.
    Plugins(BTreeMap<String, Result<Fingerprint, PluginError>>),
    /// This node's placeholder host volumes (volume → host volume ID).
    PlaceholdersListed(Result<BTreeMap<VolumeKey, String>, NomadError>),
    /// A placeholder was registered (`Some(id)`) or deregistered (`None`).
    Placeholder {
        volume: VolumeKey,
        result: Result<Option<String>, PlaceholderError>,
    },
    /// A volume create or delete ran.
    Worker {
        volume: VolumeKey,
        result: Result<(), WorkerError>,
    },
    /// A claim acquire: the lock ID.
    ClaimAcquired {
        volume: VolumeKey,
        result: Result<String, ClaimError>,
    },
    ClaimRenewed {
        volume: VolumeKey,
        result: Result<(), ClaimError>,
    },
    ClaimReleased {
        volume: VolumeKey,
        result: Result<(), ClaimError>,
    },
    /// One allocation read from Nomad (`None`: it does not exist).
    AllocFetched {
        alloc_id: String,
        result: Result<Option<Box<Allocation>>, NomadError>,
    },
    /// A published mount was probed.
    Probed {
        volume: VolumeKey,
        target: PathBuf,
        probe: Probe,
    },
    /// A dead mount was detached (lazy unmount).
    Detached {
        volume: VolumeKey,
        result: Result<(), nix::Error>,
    },
    /// An allocation was restarted onto a republished mount.
    Restarted {
        volume: VolumeKey,
        alloc_id: String,
        result: Result<(), NomadError>,
    },
    /// A storage operation (snapshot, expansion) ran ([`storage::perform`]).
    Storage {
        op: crate::worker::OpKey,
        result: Result<(), crate::worker::OpError>,
    },
}

/// Why a `publish` or `unpublish` did not leave the node as it should be.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("cannot create {}: {source}", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error("plugin {plugin:?} published at {path}, not at the target {}", target.display())]
    WrongPath {
        plugin: String,
        path: String,
        target: PathBuf,
    },
    #[error("plugin {plugin:?} reported success but {} is not a mount point", target.display())]
    NotMounted { plugin: String, target: PathBuf },
    #[error("plugin {plugin:?} left {count} mounts stacked on {}: a publish must not mount again over its own mount (see docs/plugin-protocol.md, idempotency)", target.display())]
    Stacked {
        plugin: String,
        count: usize,
        target: PathBuf,
    },
    #[error("plugin {plugin:?} reported success but {} is still a mount point", target.display())]
    StillMounted { plugin: String, target: PathBuf },
    #[error("cannot read the mount table to check {}: {source}", target.display())]
    MountTable {
        target: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Why a placeholder host volume could not be registered or deregistered.
#[derive(Debug, thiserror::Error)]
pub enum PlaceholderError {
    #[error("cannot create {}: {source}", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Nomad(#[from] NomadError),
}

/// Why a volume create or delete did not finish.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Another node's check-and-set write came first: it does the work.
    #[error("another node changed the record first")]
    TakenByOther,
    #[error(transparent)]
    Nomad(#[from] NomadError),
    #[error(transparent)]
    Record(#[from] RecordError),
    /// The plugin failed; the record says so (state `failed`, or its error for a delete).
    #[error(transparent)]
    Plugin(#[from] PluginError),
    /// The volume's source (snapshot or clone) cannot be used; the record is failed.
    #[error(transparent)]
    Source(#[from] storage::SourceFailure),
}

/// A plugin error with the volume's secrets taken out of every text it carries.
fn redacted(e: PluginError, secrets: &BTreeMap<String, String>) -> PluginError {
    let r = |t: String| plugin::redact(&t, secrets);
    match e {
        PluginError::BadOutput {
            plugin,
            op,
            reason,
            stdout,
        } => PluginError::BadOutput {
            plugin,
            op,
            reason: r(reason),
            stdout: r(stdout),
        },
        PluginError::Failed {
            plugin,
            op,
            status,
            message,
            stderr,
        } => PluginError::Failed {
            plugin,
            op,
            status,
            message: r(message),
            stderr: r(stderr),
        },
        PluginError::TimedOut {
            plugin,
            op,
            after,
            stderr,
        } => PluginError::TimedOut {
            plugin,
            op,
            after,
            stderr: r(stderr),
        },
        other => other,
    }
}

fn secrets_of(rec: Option<&VolumeRecord>) -> BTreeMap<String, String> {
    rec.map(|r| r.secrets.clone()).unwrap_or_default()
}

/// Creates the target directory, runs `publish`, and checks that the target really is one
/// mount point afterwards.
pub async fn publish(
    runner: Runner,
    node: NodeEnv,
    rec: VolumeRecord,
    target: PathBuf,
    read_only: bool,
    alloc_id: String,
) -> Completion {
    let started = std::time::Instant::now();
    let result = async {
        std::fs::create_dir_all(&target).map_err(|source| StepError::Dir {
            path: target.clone(),
            source,
        })?;
        let env = publish_env(&node, &rec, &target, read_only, &alloc_id);
        let plugin_id = &rec.spec.plugin_id;
        let out = runner
            .call(plugin_id, Operation::Publish, &env, &rec.secrets)
            .await
            .map_err(|e| redacted(e, &rec.secrets))?;
        let res: PublishResult = plugin::parse(plugin_id, Operation::Publish, &out.stdout)
            .map_err(|e| redacted(e, &rec.secrets))?;
        if let Some(p) = &res.path {
            if Path::new(p) != target {
                return Err(StepError::WrongPath {
                    plugin: plugin_id.clone(),
                    path: p.clone(),
                    target,
                });
            }
        }
        let table = mounts::MountTable::read().map_err(|source| StepError::MountTable {
            target: target.clone(),
            source,
        })?;
        match table.count(&target) {
            0 => Err(StepError::NotMounted {
                plugin: plugin_id.clone(),
                target,
            }),
            1 => Ok(res.context),
            count => Err(StepError::Stacked {
                plugin: plugin_id.clone(),
                count,
                target,
            }),
        }
    }
    .await;
    Completion::Published {
        volume: rec.key(),
        result,
        elapsed: started.elapsed(),
    }
}

/// Runs `unpublish`; success requires the target to be no longer mounted. Then removes the
/// target directory if (and only if) it is empty, and makes it again when `keep_dir` (a
/// placeholder host volume points at it).
pub async fn unpublish(
    runner: Runner,
    node: NodeEnv,
    m: MountRecord,
    rec: Option<VolumeRecord>,
    keep_dir: bool,
) -> Completion {
    let env = unpublish_env(&node, &m, rec.as_ref());
    let secrets = secrets_of(rec.as_ref());
    let result = async {
        runner
            .call(&m.plugin_id, Operation::Unpublish, &env, &secrets)
            .await
            .map_err(|e| redacted(e, &secrets))?;
        let table = mounts::MountTable::read().map_err(|source| StepError::MountTable {
            target: m.target.clone(),
            source,
        })?;
        if table.contains(&m.target) {
            return Err(StepError::StillMounted {
                plugin: m.plugin_id.clone(),
                target: m.target.clone(),
            });
        }
        // Leave no directory behind, but never delete data: rmdir only.
        let _ = std::fs::remove_dir(&m.target);
        if keep_dir {
            let _ = std::fs::create_dir_all(&m.target);
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
        let r = runner.fingerprint(&id).await;
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
    .await;
    Completion::PlaceholdersListed(result)
}

/// Registers the placeholder host volume for `rec` on this node, creating its directory.
pub async fn register_placeholder(
    client: Client,
    node: NodeEnv,
    rec: VolumeRecord,
    target: PathBuf,
) -> Completion {
    let result = async {
        std::fs::create_dir_all(&target).map_err(|source| PlaceholderError::Dir {
            path: target.clone(),
            source,
        })?;
        let hv = HostVolume {
            namespace: rec.spec.namespace.clone(),
            id: String::new(),
            name: rec.spec.name.clone(),
            plugin_id: String::new(),
            node_pool: node.node_pool.clone(),
            node_id: node.node_id.clone(),
            requested_capabilities: rec.placeholder_capabilities(),
            host_path: target.display().to_string(),
            ..Default::default()
        };
        let got = client.register_host_volume(&hv).await?;
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
        .map_err(PlaceholderError::from);
    Completion::Placeholder { volume, result }
}

/// Fetches one allocation (for a publish call that arrived before its event).
pub async fn fetch_alloc(client: Client, alloc_id: String) -> Completion {
    let result = client.allocation(&alloc_id).await.map(|a| a.map(Box::new));
    Completion::AllocFetched { alloc_id, result }
}

/// Restarts an allocation's running tasks (onto a republished mount).
pub async fn restart_alloc(client: Client, volume: VolumeKey, alloc_id: String) -> Completion {
    let result = client.restart_allocation(&alloc_id, false).await;
    Completion::Restarted {
        volume,
        alloc_id,
        result,
    }
}

async fn cas_update(client: &Client, rec: &VolumeRecord) -> Result<VolumeRecord, WorkerError> {
    let var = client
        .put_variable(&rec.to_variable(), Some(rec.modify_index))
        .await
        .map_err(|e| match e {
            NomadError::CasConflict { .. } => WorkerError::TakenByOther,
            e => WorkerError::Nomad(e),
        })?;
    Ok(VolumeRecord::from_variable(&var)?)
}

/// Takes a pending (or our own interrupted) create: claims it in the record with a
/// check-and-set write, runs the plugin's `create`, stores context and state.
pub async fn create(
    client: Client,
    runner: Runner,
    node: NodeEnv,
    mut rec: VolumeRecord,
    mount_root: PathBuf,
) -> Completion {
    let key = rec.key();
    let result = async {
        if rec.state == VolumeState::Pending {
            rec.state = VolumeState::Creating;
            rec.worker_node = node.node_id.clone();
            rec = cas_update(&client, &rec).await?;
        }
        let mut env = create_env(&node, &rec);
        match storage::source_env(&client, &runner, &rec, &mount_root).await {
            Ok(extra) => env.extend(extra),
            Err(e @ storage::SourceFailure::Read(_)) => return Err(e.into()),
            Err(e) => {
                // A missing, unready or foreign source, or a plugin without the
                // capability: the volume cannot be made as asked.
                rec.state = VolumeState::Failed;
                rec.error = e.to_string();
                cas_update(&client, &rec).await?;
                return Err(e.into());
            }
        }
        let mut failure = None;
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
                return Err(WorkerError::Plugin(redacted(e, &rec.secrets)))
            }
            Err(e) => {
                let e = redacted(e, &rec.secrets);
                rec.state = VolumeState::Failed;
                rec.error = e.to_string();
                failure = Some(e);
            }
        }
        // worker_node stays: it names the node that ran the create (`volume create` prints
        // it; `volume delete` clears it before asking for the delete).
        cas_update(&client, &rec).await?;
        match failure {
            Some(e) => Err(WorkerError::Plugin(e)),
            None => Ok(()),
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
            let e = redacted(e, &rec.secrets);
            rec.worker_node.clear();
            rec.error = e.to_string();
            let _ = cas_update(&client, &rec).await;
            return Err(WorkerError::Plugin(e));
        }
        client
            .delete_variable(
                &rec.spec.namespace,
                &rec.to_variable().path,
                Some(rec.modify_index),
            )
            .await?;
        Ok(())
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
    node_id: String,
    volume: VolumeKey,
    volume_id: String,
) -> Completion {
    let result = claims::acquire(&client, settings, &volume, &node_id, &volume_id).await;
    Completion::ClaimAcquired { volume, result }
}

/// Renews a held claim.
pub async fn renew_claim(client: Client, volume: VolumeKey, lock_id: String) -> Completion {
    let result = claims::renew(&client, &volume, &lock_id).await;
    Completion::ClaimRenewed { volume, result }
}

/// Releases a claim.
pub async fn release_claim(client: Client, volume: VolumeKey, lock_id: String) -> Completion {
    let result: Result<(), ClaimError> = claims::release(&client, &volume, &lock_id).await;
    Completion::ClaimReleased { volume, result }
}
