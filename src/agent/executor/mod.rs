//! The executor: carries out one effect (a plugin call or a Nomad call) and returns its
//! [`Completion`], with the modules' typed errors. It holds no state of its own; the
//! agent's shell runs these as tasks.

use crate::cluster::claims::{self, ClaimError, ClaimSettings};
use crate::node::guard::Guard;
use crate::node::health::Probe;
use crate::node::journal::MountRecord;
use crate::node::mounts;
use crate::nomad::types::Allocation;
use crate::nomad::types::HostVolume;
use crate::nomad::{Client, NomadError};
use crate::storage::environment::{
    create_env, delete_env, publish_env, set_secrets, unpublish_env, NodeEnv,
};
use crate::storage::plugin::Fingerprint;
use crate::storage::plugin::{self, CreateResult, Operation, PluginError, PublishResult, Runner};
use crate::volume::{RecordError, VolumeKey, VolumeRecord, VolumeState};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub mod final_mark;
pub mod storage;

/// The outcome of one effect.
#[derive(Debug)]
pub enum Completion {
    /// `publish` ran; `Ok` carries the plugin's `context` and what it mounted.
    Published {
        volume: VolumeKey,
        result: Result<PublishedMount, StepError>,
        elapsed: Duration,
    },
    /// `unpublish` ran (and the empty target directory was removed).
    Unpublished {
        volume: VolumeKey,
        result: Result<(), StepError>,
    },
    /// Every plugin in the directory, fingerprinted.
    Plugins(BTreeMap<String, Result<Fingerprint, PluginError>>),
    /// The plugin directory could not be read: the plugins known before stand (an I/O error
    /// is never "no plugins").
    PluginsUnreadable { dir: PathBuf, error: std::io::Error },
    /// This node's attributes and meta, as Nomad has them (`None`: Nomad does not know the
    /// node).
    NodeRead(Result<Option<crate::nomad::types::NodeFacts>, NomadError>),
    /// This node's placeholder host volumes (volume → host volume ID).
    PlaceholdersListed(Result<BTreeMap<VolumeKey, ListedPlaceholder>, NomadError>),
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
    /// A claim acquire: the lock ID, and what was fenced at the storage before it counts.
    ClaimAcquired {
        volume: VolumeKey,
        result: Result<claims::Acquired, ClaimError>,
    },
    /// A renewal by the renewal thread ([`crate::agent::renewer`]) of the claim under
    /// `lock_id`, sent at `sent` (the core's clock: the lease counts from here).
    ClaimRenewed {
        volume: VolumeKey,
        lock_id: String,
        sent: std::time::Instant,
        result: Result<(), ClaimError>,
    },
    ClaimReleased {
        volume: VolumeKey,
        result: Result<(), ClaimError>,
    },
    /// A fence was not run: right before it, the renewal thread's evidence showed a
    /// renewal of `lock_id`, sent at `sent`, that succeeded and keeps the lease beyond the
    /// fence moment (nothing was killed or remounted).
    FenceWithdrawn {
        volume: VolumeKey,
        lock_id: String,
        sent: std::time::Instant,
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
    /// A volume was fenced on this node.
    Fenced {
        volume: VolumeKey,
        report: crate::node::fence::FenceReport,
    },
    /// Every process an unpublish of `volume` was refused for has exited
    /// ([`crate::agent::effect::Effect::WatchHolders`]).
    HoldersExited { volume: VolumeKey },
    /// The processes holding `volume` were killed for an operator's forced unpublish
    /// ([`crate::agent::effect::Effect::KillHolders`]).
    HoldersKilled {
        volume: VolumeKey,
        report: crate::node::fence::FenceReport,
    },
    /// A published volume's `refresh` ran ([`refresh`]).
    Refreshed {
        volume: VolumeKey,
        result: Result<(), PluginError>,
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
    /// A "final" publish failure was written into the volume's record
    /// ([`final_mark::mark_final`]); `Err` says why not (retried after a backoff).
    FinalMarked {
        volume: VolumeKey,
        /// The record's ModifyIndex holding the failure; `None`: no record of that volume.
        result: Result<Option<u64>, String>,
    },
    /// A storage operation (snapshot, expansion) ran ([`storage::perform`]).
    Storage {
        op: crate::cluster::worker::OpKey,
        result: Result<(), crate::cluster::worker::OpError>,
        /// What the thaw after a freezing operation (a `snapshot_create` of a volume
        /// mounted here) found; `None` for any other operation.
        thawed: Option<crate::node::freeze::Thawed>,
    },
}

/// What a successful `publish` established.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishedMount {
    /// The plugin's `context`, handed back to `unpublish`.
    pub context: serde_json::Value,
    /// The mount on the target afterwards, from the host's table.
    pub mount: mounts::MountIdentity,
}

/// Why a `publish` or `unpublish` did not leave the node as it should be.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
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
    #[error("{} is occupied by {found}, not by this volume's mount: not publishing over it (unmount it to let the volume be published)", target.display())]
    Occupied {
        target: PathBuf,
        found: mounts::MountIdentity,
    },
    #[error("{} is still in use: {}; not unpublished (the claim is kept, retried)", target.display(), usage.summary(5))]
    InUse {
        target: PathBuf,
        /// Boxed: the scan's lists make it the largest variant by far.
        usage: Box<crate::node::holders::Usage>,
    },
    #[error("cannot check who uses {}: {source}", target.display())]
    Holders {
        target: PathBuf,
        #[source]
        source: crate::node::holders::HoldersError,
    },
    #[error("cannot prepare the placeholder {}: {source}", target.display())]
    Placeholder {
        target: PathBuf,
        #[source]
        source: crate::node::guard::GuardError,
    },
    #[error("cannot read the mount table to check {}: {source}", target.display())]
    MountTable {
        target: PathBuf,
        #[source]
        source: crate::node::mounts::MountsError,
    },
}

impl StepError {
    /// What callers off the node see ([`PluginError::report`]: the plugin's redacted,
    /// bounded words for a plugin failure), else the `Display`.
    pub fn report(&self) -> String {
        match self {
            StepError::Plugin(e) => e.report(),
            e => e.to_string(),
        }
    }
}

/// Why a placeholder host volume could not be registered or deregistered.
#[derive(Debug, thiserror::Error)]
pub enum PlaceholderError {
    #[error("cannot create {}: {source}", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: crate::node::guard::GuardError,
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
    /// A delete found the volume still mounted (or possibly mounted) on a node: the plugin's
    /// `delete` did not run; the record says why and the delete is retried.
    #[error("{0}")]
    Mounted(String),
    /// The volume's source (snapshot or clone) cannot be used; the record is failed.
    #[error(transparent)]
    Source(#[from] storage::SourceFailure),
}

/// A plugin error with the volume's secrets taken out of every text it carries.
fn redacted(mut e: PluginError, secrets: &BTreeMap<String, String>) -> PluginError {
    let texts: Vec<&mut String> = match &mut e {
        PluginError::BadOutput { reason, stdout, .. } => vec![reason, stdout],
        PluginError::Failed {
            message, stderr, ..
        } => vec![message, stderr],
        PluginError::TimedOut { stderr, .. } => vec![stderr],
        _ => vec![],
    };
    for t in texts {
        *t = plugin::redact(t, secrets);
    }
    e
}

fn secrets_of(rec: Option<&VolumeRecord>) -> BTreeMap<String, String> {
    rec.map(|r| r.secrets.clone()).unwrap_or_default()
}

/// The host's mount table, read off the async threads.
async fn host_table(target: &Path) -> Result<mounts::MountTable, StepError> {
    tokio::task::spawn_blocking(mounts::MountTable::read)
        .await
        .unwrap_or_else(|e| {
            Err(mounts::MountsError::Read {
                path: mounts::HOST_MOUNTINFO.into(),
                source: std::io::Error::other(e),
            })
        })
        .map_err(|source| StepError::MountTable {
            target: target.to_path_buf(),
            source,
        })
}

/// A `publish` or `unpublish` whose plugin call ended: its outcome is decided by the host's
/// mount table read after the call ([`Called::check`]). The agent's shell has one table
/// read serve every call that ended before the read started, so a burst of N calls reads
/// the table once per wave of calls, not once per call (issue 10).
#[derive(Debug)]
pub enum Called {
    /// `publish` ran (`Ok`: the plugin's `context`), or failed before or in the plugin.
    Publish {
        volume: VolumeKey,
        plugin: String,
        target: PathBuf,
        result: Result<serde_json::Value, StepError>,
        elapsed: Duration,
    },
    /// `unpublish` ran (`Ok`), or was refused or failed.
    Unpublish {
        volume: VolumeKey,
        plugin: String,
        target: PathBuf,
        result: Result<(), StepError>,
        /// Removes the target directory once it is checked to be no mount point.
        release: Option<Guard>,
    },
    /// Any other completion that waits for a table read (storage operations).
    Other(Completion),
}

impl Called {
    /// A successful unpublish of volume `default/<name>` whose target does not exist
    /// (tests of what waits for the mount table reading).
    #[cfg(test)]
    pub(crate) fn unpublished_for_test(name: &str) -> Self {
        Called::Unpublish {
            volume: crate::volume::VolumeKey {
                namespace: "default".into(),
                name: name.into(),
            },
            plugin: "p".into(),
            target: PathBuf::from("/nonexistent/dhv-binder-test").join(name),
            result: Ok(()),
            release: None,
        }
    }

    /// The completion, decided by `table` (the host's table, read after the call ended):
    /// a publish succeeded only when the target is then exactly one mount (whose identity
    /// is returned), an unpublish only when the target is no longer a mount point; then
    /// its empty target directory is removed (rmdir only: data is never deleted). A table
    /// that could not be read fails the call (never "not mounted"). Blocking (the rmdir):
    /// run off the agent's loop.
    pub fn check(self, table: Result<&mounts::MountTable, &mounts::MountsError>) -> Completion {
        let unreadable = |target: &Path, e: &mounts::MountsError| StepError::MountTable {
            target: target.to_path_buf(),
            source: mounts::MountsError::Read {
                path: mounts::HOST_MOUNTINFO.into(),
                source: std::io::Error::other(e.to_string()),
            },
        };
        match self {
            Called::Publish {
                volume,
                plugin,
                target,
                result,
                elapsed,
            } => {
                let result = result.and_then(|context| {
                    let table = table.map_err(|e| unreadable(&target, e))?;
                    match (table.count(&target), table.top_at(&target)) {
                        (0, _) | (_, None) => Err(StepError::NotMounted { plugin, target }),
                        (1, Some(top)) => Ok(PublishedMount {
                            context,
                            mount: top.identity(),
                        }),
                        (count, _) => Err(StepError::Stacked {
                            plugin,
                            count,
                            target,
                        }),
                    }
                });
                Completion::Published {
                    volume,
                    result,
                    elapsed,
                }
            }
            Called::Unpublish {
                volume,
                plugin,
                target,
                result,
                release,
            } => {
                let result = result.and_then(|()| {
                    let table = table.map_err(|e| unreadable(&target, e))?;
                    if table.contains(&target) {
                        return Err(StepError::StillMounted { plugin, target });
                    }
                    // Leave no directory behind, but never delete data: rmdir only.
                    if let Some(guard) = release {
                        let _ = guard.release(&target);
                    }
                    Ok(())
                });
                Completion::Unpublished { volume, result }
            }
            Called::Other(c) => c,
        }
    }
}

/// Creates the target directory (through the placeholder guard), refuses a target that
/// holds something other than what the last publish established (`expected`; the table is
/// read for this only when there is something to compare), and runs `publish`. Whether
/// the target is then exactly one mount is decided by [`Called::check`].
#[allow(clippy::too_many_arguments)]
pub async fn publish(
    runner: Runner,
    node: NodeEnv,
    guard: Guard,
    rec: VolumeRecord,
    target: PathBuf,
    read_only: bool,
    alloc_id: String,
    expected: Option<mounts::MountIdentity>,
) -> Called {
    let started = std::time::Instant::now();
    let plugin_id = rec.spec.plugin_id.clone();
    let result = async {
        guard
            .ensure(&target)
            .map_err(|source| StepError::Placeholder {
                target: target.clone(),
                source,
            })?;
        if let Some(id) = &expected {
            if let Some(top) = host_table(&target).await?.top_at(&target) {
                if !id.is(top) {
                    return Err(StepError::Occupied {
                        found: top.identity(),
                        target: target.clone(),
                    });
                }
            }
        }
        // Referenced secrets are read now: a changed value is used by this call.
        let secrets = runner.secrets_for(Operation::Publish, &rec).await?;
        let mut env = publish_env(&node, &rec, &target, read_only, &alloc_id);
        set_secrets(&mut env, &secrets);
        let out = runner
            .call(&plugin_id, Operation::Publish, &env, &secrets)
            .await
            .map_err(|e| redacted(e, &secrets))?;
        let res: PublishResult =
            plugin::parse_with(&plugin_id, Operation::Publish, &out.stdout, &secrets)?;
        if let Some(p) = &res.path {
            if Path::new(p) != target {
                return Err(StepError::WrongPath {
                    plugin: plugin_id.clone(),
                    path: p.clone(),
                    target: target.clone(),
                });
            }
        }
        Ok(res.context)
    }
    .await;
    Called::Publish {
        volume: rec.key(),
        plugin: plugin_id,
        target,
        result,
        elapsed: started.elapsed(),
    }
}

/// Runs `unpublish` only when no process on the node uses the volume any more
/// ([`crate::node::holders`]: other mount namespaces, open files, working directories...);
/// success requires the target to be no longer mounted ([`Called::check`]). Then removes
/// the target directory if (and only if) it is empty (rmdir fails on a mount point),
/// unless `keep_dir` (a placeholder host volume points at it, and the read-only guard keeps
/// it unwritable).
pub async fn unpublish(
    runner: Runner,
    node: NodeEnv,
    guard: Guard,
    m: MountRecord,
    rec: Option<VolumeRecord>,
    keep_dir: bool,
) -> Called {
    let mut env = unpublish_env(&node, &m, rec.as_ref());
    let result = async {
        let secrets = match &rec {
            Some(r) => runner.secrets_for(Operation::Unpublish, r).await?,
            None => BTreeMap::new(),
        };
        set_secrets(&mut env, &secrets);
        let target = m.target.clone();
        let usage = crate::node::holders::before_unpublish_shared(target)
            .await
            .map_err(|source| StepError::Holders {
                target: m.target.clone(),
                source,
            })?;
        if let Some(usage) = usage.filter(crate::node::holders::Usage::in_use) {
            // Every holder counts, whatever its environment says, but the processes in the
            // cgroups the operator names as other nodes' (several nodes simulated on one
            // host, `--other-node-cgroup`): whose a process is comes from its cgroup.
            let usage = usage.without_other_nodes();
            if usage.in_use() {
                return Err(StepError::InUse {
                    target: m.target.clone(),
                    usage: Box::new(usage),
                });
            }
        }
        runner
            .call(&m.plugin_id, Operation::Unpublish, &env, &secrets)
            .await
            .map_err(|e| redacted(e, &secrets))?;
        Ok(())
    }
    .await;
    Called::Unpublish {
        volume: m.volume.clone(),
        plugin: m.plugin_id.clone(),
        target: m.target.clone(),
        result,
        release: (!keep_dir).then_some(guard),
    }
}

/// Runs the plugin's `refresh` on a volume published here: its secrets read now (every
/// `secret_ref` anew, [`Runner::secrets_for`]) and handed to the plugin with the mount's
/// target, so that the mount carries the current credentials without an unmount.
pub async fn refresh(
    runner: Runner,
    node: NodeEnv,
    rec: VolumeRecord,
    m: MountRecord,
) -> Completion {
    let mut env = crate::storage::environment::refresh_env(&node, &m, &rec);
    let result = async {
        let secrets = runner.secrets_for(Operation::Refresh, &rec).await?;
        set_secrets(&mut env, &secrets);
        runner
            .call(&m.plugin_id, Operation::Refresh, &env, &secrets)
            .await
            .map(drop)
    }
    .await;
    Completion::Refreshed {
        volume: m.volume,
        result,
    }
}

/// Runs the plugin's `fence` for a mount this node is fencing, bounded by
/// [`crate::storage::plugin::FENCE_TIMEOUT`] (the plugin must not wait on the network); the
/// outcome for [`crate::node::fence::FenceReport::plugin`]: `Ok` with the plugin's ID, or
/// the plugin's error (its words redacted, [`PluginError::report`]).
pub async fn plugin_fence(
    runner: Runner,
    node: NodeEnv,
    p: crate::agent::effect::PluginFence,
) -> crate::node::fence::PluginFenced {
    let env = unpublish_env(&node, &p.mount, p.record.as_ref());
    let secrets = secrets_of(p.record.as_ref());
    let r = runner
        .call_within(
            &p.mount.plugin_id,
            Operation::Fence,
            &env,
            &secrets,
            crate::storage::plugin::FENCE_TIMEOUT,
        )
        .await;
    crate::node::fence::PluginFenced {
        plugin: p.mount.plugin_id.clone(),
        error: r.err().map(|e| e.report()),
    }
}

/// Lists and fingerprints every plugin in the runner's directory; with `changed_only` (the
/// periodic rescan), a plugin whose file is unchanged since its last good fingerprint keeps
/// it without an exec ([`Runner::fingerprint_if_changed`]).
pub async fn fingerprint_all(runner: Runner, changed_only: bool) -> Completion {
    let ids = match runner.list() {
        Ok(ids) => ids,
        Err(error) => {
            return Completion::PluginsUnreadable {
                dir: runner.plugin_dir().to_path_buf(),
                error,
            }
        }
    };
    let mut out = BTreeMap::new();
    for id in ids {
        let r = if changed_only {
            runner.fingerprint_if_changed(&id).await
        } else {
            runner.fingerprint(&id).await
        };
        out.insert(id, r);
    }
    Completion::Plugins(out)
}

/// One placeholder as Nomad lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedPlaceholder {
    /// Nomad's host volume ID.
    pub id: String,
    /// False when Nomad reports it `unavailable` (its node no longer fingerprints it).
    pub available: bool,
}

/// Finds this node's placeholders: host volumes on the node whose path is under `mount_root`.
/// Only the volumes of `namespaces` (those this node serves) are read by ID: Nomad lists
/// every namespace's host volumes to a token that may read those of any one
/// (`nomad/host_volume_endpoint.go` `HostVolume.List` checks the request's namespace `*`),
/// and reading another team's by ID is refused (403), which must not stop this node's
/// placeholders. No namespace: nothing to list, and Nomad is not asked.
/// The directory of each is made again (through the guard) if it is missing: after an
/// upgrade that placed the guard, they live in its backing directory.
pub async fn list_placeholders(
    client: Client,
    node_id: String,
    guard: Guard,
    namespaces: BTreeSet<String>,
) -> Completion {
    let mount_root = guard.root().to_path_buf();
    let result = async {
        let mut out = BTreeMap::new();
        if namespaces.is_empty() {
            return Ok(out);
        }
        for stub in client.list_host_volumes(Some(&node_id), "*").await? {
            if stub.node_id != node_id || !namespaces.contains(&stub.namespace) {
                continue;
            }
            if let Some(hv) = client.host_volume(&stub.namespace, &stub.id).await? {
                if Path::new(&hv.host_path).starts_with(&mount_root) {
                    if let Err(e) = guard.ensure(Path::new(&hv.host_path)) {
                        tracing::warn!(host_path = %hv.host_path, error = %e, "cannot make a placeholder's directory");
                    }
                    out.insert(
                        VolumeKey {
                            namespace: hv.namespace.into(),
                            name: hv.name.into(),
                        },
                        ListedPlaceholder {
                            id: hv.id,
                            available: hv.state != "unavailable",
                        },
                    );
                }
            }
        }
        Ok::<_, NomadError>(out)
    }
    .await;
    Completion::PlaceholdersListed(result)
}

/// Reads this node's attributes and meta.
pub async fn read_node(client: Client, node_id: String) -> Completion {
    Completion::NodeRead(client.node_facts(&node_id).await)
}

/// Registers the placeholder host volume for `rec` on this node, creating its directory
/// (`id`: an existing placeholder registered again).
pub async fn register_placeholder(
    client: Client,
    node: NodeEnv,
    guard: Guard,
    rec: VolumeRecord,
    target: PathBuf,
    id: Option<String>,
) -> Completion {
    let result = async {
        guard
            .ensure(&target)
            .map_err(|source| PlaceholderError::Dir {
                path: target.clone(),
                source,
            })?;
        let hv = HostVolume {
            namespace: rec.spec.namespace.clone(),
            id: id.unwrap_or_default(),
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
pub async fn restart_alloc(
    client: Client,
    volume: VolumeKey,
    alloc_id: String,
    task: Option<String>,
    all_tasks: bool,
) -> Completion {
    let result = client
        .restart_allocation(&alloc_id, task.as_deref().unwrap_or(""), all_tasks)
        .await;
    Completion::Restarted {
        volume,
        alloc_id,
        result,
    }
}

async fn cas_update(client: &Client, rec: &VolumeRecord) -> Result<VolumeRecord, WorkerError> {
    let var =
        crate::cluster::changes::put_record(client, &rec.to_variable(), Some(rec.modify_index))
            .await
            .map_err(|e| match e {
                NomadError::CasConflict { .. } => WorkerError::TakenByOther,
                e => WorkerError::Nomad(e),
            })?;
    Ok(VolumeRecord::from_variable(&var)?)
}

/// Takes a pending (or our own interrupted) create: claims it in the record with a
/// check-and-set write, runs the plugin's `create`, stores context and state. A source
/// (snapshot or volume to clone) is used only if its record verifies with `trust`.
pub async fn create(
    client: Client,
    runner: Runner,
    node: NodeEnv,
    mut rec: VolumeRecord,
    mount_root: PathBuf,
    trust: crate::cluster::trust::RecordTrust,
) -> Completion {
    let key = rec.key();
    let result = async {
        if rec.state == VolumeState::Pending {
            rec.state = VolumeState::Creating;
            rec.worker_node = node.node_id.clone();
            rec = cas_update(&client, &rec).await?;
        }
        let mut env = create_env(&node, &rec);
        match storage::source_env(&client, &runner, &rec, &mount_root, &trust).await {
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
        // Referenced secrets, read now; never stored in `rec` (written back below).
        let secrets = match runner.secrets_for(Operation::Create, &rec).await {
            Ok(s) => s,
            Err(e) => {
                // A secret that cannot be read: the volume cannot be made as asked, and
                // `volume create` says which reference and what to do (run it again after).
                rec.state = VolumeState::Failed;
                rec.error = e.report();
                cas_update(&client, &rec).await?;
                return Err(WorkerError::Plugin(e));
            }
        };
        set_secrets(&mut env, &secrets);
        match runner
            .call(&rec.spec.plugin_id, Operation::Create, &env, &secrets)
            .await
            .and_then(|o| {
                plugin::parse_with::<CreateResult>(
                    &rec.spec.plugin_id,
                    Operation::Create,
                    &o.stdout,
                    &secrets,
                )
            }) {
            Ok(res) => {
                rec.state = VolumeState::Ready;
                rec.context = res.context;
                rec.capacity_bytes = res.bytes;
                rec.error.clear();
                if let Err(e) = rec.check_size() {
                    // Nomad would refuse the record (and every retry of it): the create
                    // fails, saying why; the context is not kept.
                    rec.state = VolumeState::Failed;
                    rec.context = serde_json::Value::Null;
                    rec.error = e.to_string();
                    failure = Some(PluginError::BadOutput {
                        plugin: rec.spec.plugin_id.clone(),
                        op: Operation::Create,
                        reason: e.to_string(),
                        stdout: String::new(),
                    });
                }
            }
            Err(e @ PluginError::TimedOut { .. }) => {
                return Err(WorkerError::Plugin(redacted(e, &secrets)))
            }
            Err(e) => {
                let e = redacted(e, &secrets);
                rec.state = VolumeState::Failed;
                // The plugin's redacted, bounded words reach `volume create` and `status`.
                rec.error = e.report();
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
        // No delete under a live mount: checked again here, just before the plugin runs
        // (the request may predate a mount, or come from an older CLI).
        let on =
            crate::cluster::mounted::evidence(&client, &key, crate::cluster::nodes::now_unix())
                .await?;
        if !on.is_empty() {
            let why = crate::cluster::mounted::refusal(&key, &on);
            rec.worker_node.clear();
            rec.error = format!("the delete waits: {why}");
            let _ = cas_update(&client, &rec).await;
            return Err(WorkerError::Mounted(why));
        }
        let secrets = runner
            .secrets_for(Operation::Delete, &rec)
            .await
            .map_err(WorkerError::Plugin)?;
        let mut env = delete_env(&node, &rec);
        set_secrets(&mut env, &secrets);
        // Every storage delete is logged at info, naming what it deletes (issue 33).
        let context = crate::storage::plugin::redact(&rec.context.to_string(), &secrets);
        // The same fields before and after the plugin's call.
        let log_delete = |what: &str| {
            tracing::info!(
                volume = %key,
                volume_id = %rec.id,
                namespace = %rec.spec.namespace,
                plugin = %rec.spec.plugin_id,
                node = %node.node_id,
                %context,
                "{what}"
            );
        };
        log_delete("deleting the volume's storage");
        if let Err(e) = runner
            .call(&rec.spec.plugin_id, Operation::Delete, &env, &secrets)
            .await
        {
            let e = redacted(e, &secrets);
            rec.worker_node.clear();
            rec.error = e.report();
            let _ = cas_update(&client, &rec).await;
            return Err(WorkerError::Plugin(e));
        }
        log_delete("deleted the volume's storage");
        crate::cluster::changes::delete_record(
            &client,
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

/// Acquires the claim on a single-node volume. With `fencing` (the plugin runner and the
/// volume's record, when its plugin declares `fence_node`), a take-over then runs the plugin's `fence_node` for each
/// node the claim lists as fenced (the previous holder among them) and, when this node was
/// fenced itself, `unfence_node` for this node, all before the claim counts as taken (so
/// before the publish; docs/plugin-protocol.md, "fence_node and unfence_node"). A failed call
/// gives the claim back ([`ClaimError::StorageFence`]; the next acquire finds the list in the
/// claim and calls again).
pub async fn acquire_claim(
    client: Client,
    trust: crate::cluster::trust::RecordTrust,
    settings: ClaimSettings,
    node: NodeEnv,
    volume: VolumeKey,
    volume_id: String,
    fencing: Option<(Runner, Box<VolumeRecord>)>,
) -> Completion {
    let result = claims::acquire(
        &client,
        &trust,
        settings,
        &volume,
        &node.node_id,
        &volume_id,
        fencing.is_some(),
    )
    .await;
    let result = match (result, fencing) {
        (Ok(acq), Some((runner, rec))) if !acq.fence.is_empty() || acq.unfence => {
            match fence_at_storage(&runner, &node, &rec, &acq).await {
                Ok(()) => Ok(acq),
                Err(e) => {
                    if let Err(r) = claims::release(&client, &volume, &acq.lock_id).await {
                        tracing::warn!(%volume, error = %r, "cannot give back the claim after the failed storage-side fence; it lapses with its TTL");
                    }
                    Err(e)
                }
            }
        }
        (r, _) => r,
    };
    Completion::ClaimAcquired { volume, result }
}

/// The plugin's `fence_node` for each node in `acq.fence`, then `unfence_node` for this node
/// when `acq.unfence`, each with `DHV_FENCED_NODE_ID` (environment as for `delete`).
async fn fence_at_storage(
    runner: &Runner,
    node: &NodeEnv,
    rec: &VolumeRecord,
    acq: &claims::Acquired,
) -> Result<(), ClaimError> {
    let calls = acq
        .fence
        .iter()
        .map(|n| (Operation::FenceNode, n.as_str()))
        .chain(
            acq.unfence
                .then_some((Operation::UnfenceNode, node.node_id.as_str())),
        );
    for (op, fenced) in calls {
        let volume = rec.key();
        let secrets = runner
            .secrets_for(op, rec)
            .await
            .map_err(|e| ClaimError::StorageFence {
                volume: volume.clone(),
                op: op.as_str(),
                node: fenced.to_string(),
                error: e.report(),
            })?;
        let mut env = delete_env(node, rec);
        set_secrets(&mut env, &secrets);
        env.push(("DHV_FENCED_NODE_ID".into(), fenced.to_string()));
        match runner.call(&rec.spec.plugin_id, op, &env, &secrets).await {
            // A take-over is worth a warning; restoring this node's own access is not (a
            // failed call is an error, below).
            Ok(_) => match op {
                Operation::FenceNode => {
                    tracing::warn!(%volume, node = %fenced, plugin = %rec.spec.plugin_id, "took the volume over: the old holder's access is revoked at the storage (plugin fence_node) before the publish here")
                }
                _ if acq.was_fenced => {
                    tracing::info!(%volume, node = %fenced, plugin = %rec.spec.plugin_id, "this node's access to the volume is restored at the storage (plugin unfence_node): it was fenced, and holds the claim again")
                }
                _ => {
                    tracing::debug!(%volume, node = %fenced, plugin = %rec.spec.plugin_id, "plugin unfence_node for this node, which held the claim last: nothing says it was fenced; the call makes sure")
                }
            },
            Err(e) => {
                let e = redacted(e, &secrets);
                tracing::error!(%volume, node = %fenced, plugin = %rec.spec.plugin_id, error = %e.report(), "storage-side {op} failed; the volume is not published here until it succeeds (retried)");
                return Err(ClaimError::StorageFence {
                    volume,
                    op: op.as_str(),
                    node: fenced.to_string(),
                    error: e.report(),
                });
            }
        }
    }
    Ok(())
}

/// Releases a claim.
pub async fn release_claim(client: Client, volume: VolumeKey, lock_id: String) -> Completion {
    let result: Result<(), ClaimError> = claims::release(&client, &volume, &lock_id).await;
    Completion::ClaimReleased { volume, result }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::mounts::{MountIdentity, MountTable, MountsError};

    fn key() -> VolumeKey {
        VolumeKey {
            namespace: "default".into(),
            name: "v".into(),
        }
    }

    fn published(target: &Path) -> Called {
        Called::Publish {
            volume: key(),
            plugin: "p".into(),
            target: target.to_path_buf(),
            result: Ok(serde_json::json!({"k": 1})),
            elapsed: Duration::ZERO,
        }
    }

    fn unpublished(target: &Path, release: Option<Guard>) -> Called {
        Called::Unpublish {
            volume: key(),
            plugin: "p".into(),
            target: target.to_path_buf(),
            result: Ok(()),
            release,
        }
    }

    fn unreadable() -> MountsError {
        MountsError::Read {
            path: mounts::HOST_MOUNTINFO.into(),
            source: std::io::Error::from_raw_os_error(nix::libc::EIO),
        }
    }

    /// Issue 10 moved the kernel check of a publish out of the call, into the shared table
    /// read after it: "published" still means exactly one mount at the target, by the table.
    #[test]
    fn a_publish_is_decided_by_the_table_read_after_it() {
        let t = PathBuf::from("/srv/dhv/default/v");
        let one = MountTable::from_points([t.clone()]);
        match published(&t).check(Ok(&one)) {
            Completion::Published { result: Ok(p), .. } => {
                assert_eq!(p.mount, MountIdentity::of_point(&t));
                assert_eq!(p.context, serde_json::json!({"k": 1}));
            }
            other => panic!("expected a publish with its mount, got {other:?}"),
        }
        let none = MountTable::from_points([PathBuf::from("/elsewhere")]);
        assert!(matches!(
            published(&t).check(Ok(&none)),
            Completion::Published {
                result: Err(StepError::NotMounted { .. }),
                ..
            }
        ));
        let two = MountTable::from_points([t.clone(), t.clone()]);
        assert!(matches!(
            published(&t).check(Ok(&two)),
            Completion::Published {
                result: Err(StepError::Stacked { count: 2, .. }),
                ..
            }
        ));
        assert!(
            matches!(
                published(&t).check(Err(&unreadable())),
                Completion::Published {
                    result: Err(StepError::MountTable { .. }),
                    ..
                }
            ),
            "an unreadable table fails the publish, never passes it"
        );
        let failed = Called::Publish {
            volume: key(),
            plugin: "p".into(),
            target: t.clone(),
            result: Err(StepError::NotMounted {
                plugin: "p".into(),
                target: t.clone(),
            }),
            elapsed: Duration::ZERO,
        };
        assert!(
            matches!(
                failed.check(Ok(&one)),
                Completion::Published {
                    result: Err(StepError::NotMounted { .. }),
                    ..
                }
            ),
            "a failed call stays failed whatever the table shows"
        );
    }

    #[test]
    fn an_unpublish_is_decided_by_the_table_and_removes_only_an_unmounted_empty_target() {
        let dir = tempfile::tempdir().expect("temp dir");
        let guard = Guard::new(dir.path());
        // Outside the guarded tree the guard removes the target itself.
        let target = dir.path().join("t");
        std::fs::create_dir(&target).expect("target");
        let still = MountTable::from_points([target.clone()]);
        assert!(matches!(
            unpublished(&target, Some(guard.clone())).check(Ok(&still)),
            Completion::Unpublished {
                result: Err(StepError::StillMounted { .. }),
                ..
            }
        ));
        assert!(target.exists(), "a target still mounted is not removed");
        assert!(matches!(
            unpublished(&target, Some(guard.clone())).check(Err(&unreadable())),
            Completion::Unpublished {
                result: Err(StepError::MountTable { .. }),
                ..
            }
        ));
        assert!(target.exists(), "nothing is removed without a reading");
        let empty = MountTable::from_points([]);
        assert!(matches!(
            unpublished(&target, None).check(Ok(&empty)),
            Completion::Unpublished { result: Ok(()), .. }
        ));
        assert!(target.exists(), "keep_dir keeps the directory");
        std::fs::write(target.join("data"), "kept").expect("write");
        assert!(matches!(
            unpublished(&target, Some(guard.clone())).check(Ok(&empty)),
            Completion::Unpublished { result: Ok(()), .. }
        ));
        assert!(
            target.join("data").exists(),
            "rmdir only: data is never deleted"
        );
        std::fs::remove_file(target.join("data")).expect("remove");
        let _ = unpublished(&target, Some(guard)).check(Ok(&empty));
        assert!(!target.exists(), "an empty unmounted target is removed");
    }

    /// A log line written by the test's subscriber.
    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A node taking back a claim it held last calls `unfence_node` as a precaution: no
    /// warning, nothing was fenced (a clean re-publish on the same node warned "access
    /// restored"). A node that was fenced has its access restored at INFO; only a take-over
    /// (`fence_node`) warns.
    #[tokio::test]
    async fn an_unfence_of_a_node_nothing_fenced_is_no_warning() {
        let dir = tempfile::tempdir().expect("temp dir");
        let plugins = dir.path().join("plugins");
        std::fs::create_dir(&plugins).expect("plugin dir");
        let plugin = plugins.join("fencer");
        std::fs::write(&plugin, "#!/bin/sh\necho '{}'\n").expect("plugin");
        std::fs::set_permissions(&plugin, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
        let runner = Runner::new(&plugins, Duration::from_secs(20));
        let node = NodeEnv {
            node_id: "node-1".into(),
            node_pool: "default".into(),
            volumes_dir: dir.path().join("volumes"),
            plugin_dir: plugins.clone(),
        };
        let rec = VolumeRecord::new(
            crate::volume::parse_spec("name = \"d\"\nplugin_id = \"fencer\"\n")
                .expect("spec")
                .0,
            BTreeMap::new(),
        );
        let log = Captured::default();
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || writer.clone())
            .finish();
        let _log = tracing::subscriber::set_default(subscriber);
        let text = || String::from_utf8_lossy(&log.0.lock().unwrap()).to_string();
        let acquired = |fence: Vec<String>, unfence, was_fenced| claims::Acquired {
            lock_id: "l".into(),
            index: 1,
            fence,
            unfence,
            was_fenced,
        };
        // The last holder again: a precaution, said at DEBUG (not logged here).
        fence_at_storage(&runner, &node, &rec, &acquired(vec![], true, false))
            .await
            .expect("unfence");
        assert_eq!(text(), "", "a precautionary unfence logged");
        // This node was fenced: its access restored, at INFO.
        fence_at_storage(&runner, &node, &rec, &acquired(vec![], true, true))
            .await
            .expect("unfence");
        let t = text();
        assert!(
            t.contains(" INFO ") && t.contains("restored") && !t.contains("WARN"),
            "{t}"
        );
        // A take-over: a warning.
        fence_at_storage(
            &runner,
            &node,
            &rec,
            &acquired(vec!["node-2".into()], false, false),
        )
        .await
        .expect("fence");
        assert!(
            text().contains(" WARN ") && text().contains("took the volume over"),
            "{}",
            text()
        );
    }
}
