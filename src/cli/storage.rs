//! `dhv-binder volume snapshot create|list|delete` (shaped like `nomad volume snapshot`), and
//! growing a volume with `volume create` on an existing volume (see [`crate::cluster::expansion`]).
//!
//! Where the plugin is installed on the machine the command runs on (`--plugin-dir`, default
//! the agent's), its fingerprint is read first and an operation it does not declare is refused
//! at once, naming the plugin and the missing capability. Elsewhere the agent that takes the
//! operation refuses it the same way, and the command reports that.

use super::output::{bytes, table, OutputArgs};
use super::records::{read_record, SigningArgs};
use super::{Failure, EXIT_CONFIG, EXIT_FAILED, EXIT_TIMEOUT};
use crate::cluster::expansion::{self, ExpansionState, Update};
use crate::cluster::nodes::{Liveness, NodeRecord};
use crate::cluster::snapshot::{self, SnapshotRecord, SNAPSHOT_PREFIX};
use crate::cluster::trust::SigningKey;
use crate::nomad::Client;
use crate::storage::plugin::{Capability, Operation, Runner};
use crate::volume::{VolumeRecord, VolumeSource, VolumeSpec, VolumeState};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `volume snapshot` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum SnapshotCommand {
    /// Snapshot a volume (its plugin must declare "snapshot"). Prints the snapshot ID.
    Create {
        /// The volume to snapshot: its name, or its ID or a unique prefix of it.
        volume: String,
        /// A name for the snapshot, shown by `list`.
        name: Option<String>,
        /// Return once recorded, without waiting for the plugin.
        #[arg(long)]
        detach: bool,
        /// How long to wait for the plugin (e.g. `30s`, `5m`); past it the command gives up
        /// with exit 75 (the request stays).
        #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
        timeout: Duration,
        #[command(flatten)]
        local: LocalPlugins,
        #[command(flatten)]
        key: SigningArgs,
    },
    /// List snapshots (of one volume if named): ID, volume, name, size, creation time, state.
    List {
        /// Only this volume's snapshots (the volume's name); without it, every snapshot in
        /// the namespace.
        volume: Option<String>,
        /// Also ask this plugin, installed on this machine, what its storage holds
        /// (operation `snapshot_list`, capability "snapshot_list"), with the secrets of
        /// `--secrets-file` (or DHV_BINDER_SNAPSHOT_SECRETS).
        #[arg(long)]
        plugin: Option<String>,
        /// File of secrets for the plugin's `snapshot_list` (DHV_SECRETS), one KEY=VALUE per
        /// line. Secrets never go on the command line (other users can read it in /proc).
        #[arg(long = "secrets-file", requires = "plugin")]
        secrets_file: Option<PathBuf>,
        /// The same, from the environment (KEY=VALUE lines).
        #[arg(
            long = "secrets-env",
            env = "DHV_BINDER_SNAPSHOT_SECRETS",
            hide_env_values = true,
            hide = true
        )]
        secrets_env: Option<String>,
        /// A directory the plugin keeps storage under on this machine, as the agent's
        /// `--plugin-root <plugin_id>=<dir>` (DHV_ALLOWED_ROOTS); repeatable.
        #[arg(long = "plugin-root", requires = "plugin")]
        roots: Vec<PathBuf>,
        #[command(flatten)]
        local: LocalPlugins,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Delete a snapshot by ID.
    Delete {
        /// The snapshot's ID, or a unique prefix of it, as `volume snapshot list` shows it.
        snapshot_id: String,
        /// Return once the delete is requested, without waiting for the plugin's
        /// `snapshot_delete` and the record's removal.
        #[arg(long)]
        detach: bool,
        /// How long to wait for the plugin (e.g. `30s`, `5m`); past it the command gives up
        /// with exit 75 (the request stays).
        #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
        timeout: Duration,
        #[command(flatten)]
        key: SigningArgs,
    },
}

/// One snapshot as `volume snapshot list` and `volume status` show it (`-json` prints these,
/// under the names of Nomad's `CSISnapshot`, `api/csi.go`, where it has the field: `ID`,
/// `SizeBytes`, `CreateTime` in Unix seconds as Nomad's, `IsReady`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct SnapshotSummary {
    #[serde(rename = "ID")]
    pub id: String,
    pub namespace: String,
    /// The source volume's name.
    pub volume: String,
    pub name: String,
    /// Size in bytes, as the plugin's `snapshot_create` reported it (0 until ready).
    #[serde(rename = "SizeBytes")]
    pub bytes: u64,
    /// Unix seconds when the snapshot was requested.
    #[serde(rename = "CreateTime")]
    pub created_at: u64,
    #[serde(rename = "IsReady")]
    pub ready: bool,
    /// `pending`, `creating`, `ready`, `failed`, `deleting`.
    pub state: String,
    pub error: String,
}

impl SnapshotSummary {
    /// The summary of a record (never its context or secrets).
    pub fn of(s: &SnapshotRecord) -> Self {
        SnapshotSummary {
            id: s.id.clone(),
            namespace: s.namespace.clone(),
            volume: s.volume.clone(),
            name: s.name.clone(),
            bytes: s.bytes,
            created_at: s.created_at,
            ready: s.state == VolumeState::Ready,
            state: s.state.as_str().into(),
            error: s.error.clone(),
        }
    }
}

/// The readable snapshot table: ID (its first 8 characters unless `verbose`), volume,
/// name, size, creation time, ready.
pub fn render_snapshots(rows: &[SnapshotSummary], verbose: bool) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|s| {
            vec![
                super::output::short_id(&s.id, verbose),
                s.volume.clone(),
                if s.name.is_empty() {
                    "-".into()
                } else {
                    s.name.clone()
                },
                if s.ready { bytes(s.bytes) } else { "-".into() },
                when(s.created_at),
                if s.ready {
                    "true".into()
                } else if s.error.is_empty() {
                    format!("false ({})", s.state)
                } else {
                    format!(
                        "false ({}: {})",
                        s.state,
                        super::output::plugin_text(&s.error)
                    )
                },
            ]
        })
        .collect();
    table(
        &["ID", "Volume", "Name", "Size", "Created", "Ready"],
        &rows,
        "No snapshots",
    )
}

/// `volume status`'s Source line: `snapshot <id>`, `clone of volume <name>`, or empty.
pub fn describe_source(source: &VolumeSource) -> String {
    match source {
        VolumeSource::Empty => String::new(),
        VolumeSource::SnapshotId(id) => format!("snapshot {id}"),
        VolumeSource::CloneId(name) => format!("clone of volume {name}"),
    }
}

/// Where this machine's plugins are, for the early capability check.
#[derive(Debug, Clone, clap::Args)]
pub struct LocalPlugins {
    /// The plugin directory on this machine (the agent's --plugin-dir).
    #[arg(
        long,
        env = "DHV_BINDER_PLUGIN_DIR",
        default_value = "/opt/dhv-binder/plugins"
    )]
    pub plugin_dir: PathBuf,
}

/// Refuses `op` when `plugin_id` is installed here and does not declare it. `Ok` when it
/// does, or when it is not installed here (the agent checks then).
pub async fn precheck(plugin_dir: &Path, plugin_id: &str, cap: Capability) -> Result<(), Failure> {
    let runner = Runner::new(plugin_dir, Duration::from_secs(5));
    if !runner.path_of(plugin_id).is_ok_and(|p| p.is_file()) {
        return Ok(());
    }
    let fp = runner
        .fingerprint(plugin_id)
        .await
        .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
    fp.require_capability(plugin_id, cap)
        .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))
}

/// The same check as [`precheck`] from the node records: refused when every live node that
/// runs the plugin declares its operations and none declares `cap` (so that no record is
/// changed for an operation no node can run).
pub async fn precheck_nodes(
    client: &Client,
    plugin_id: &str,
    cap: Capability,
) -> Result<(), Failure> {
    let (records, _) = crate::cluster::nodes::list(client).await?;
    match crate::cluster::nodes::missing_capability(&records, plugin_id, &cap.to_string(), now()) {
        Some(why) => Err(Failure::new(EXIT_FAILED, why)),
        None => Ok(()),
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn when(secs: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_secs(secs)).to_string()
}

async fn read_snapshot(
    client: &Client,
    ns: &str,
    id: &str,
) -> Result<Option<SnapshotRecord>, Failure> {
    if uuid::Uuid::parse_str(id).is_err() {
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
            return Err(Failure::new(
                EXIT_CONFIG,
                format!(
                    "{id:?} is not a snapshot ID or ID prefix (as `dhv-binder volume snapshot list` shows)"
                ),
            ));
        }
        // A unique prefix names the snapshot, as Nomad accepts ID prefixes.
        let mut found: Vec<SnapshotRecord> = snapshots(client, ns, None)
            .await?
            .into_iter()
            .filter(|s| s.id.starts_with(id))
            .collect();
        return match found.len() {
            0 | 1 => Ok(found.pop()),
            n => Err(Failure::new(
                EXIT_FAILED,
                format!(
                    "ID prefix {id:?} matches {n} snapshots ({}): give more of the ID",
                    found
                        .iter()
                        .map(|s| s.id.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        };
    }
    match client.variable(ns, &snapshot::record_path(id)).await? {
        None => Ok(None),
        Some(var) => SnapshotRecord::from_variable(&var)
            .map(Some)
            .map_err(|e| Failure::new(EXIT_FAILED, e.to_string())),
    }
}

/// Every snapshot record in `ns` (of `volume` if given), oldest first.
pub async fn snapshots(
    client: &Client,
    ns: &str,
    volume: Option<&str>,
) -> Result<Vec<SnapshotRecord>, Failure> {
    let metas = client
        .list_variables(SNAPSHOT_PREFIX, ns, 0, Duration::ZERO)
        .await?
        .value;
    let mut out = Vec::new();
    for m in metas {
        if let Some(var) = client.variable(&m.namespace, &m.path).await? {
            match SnapshotRecord::from_variable(&var) {
                Ok(s) if volume.is_none_or(|v| v == s.volume) => out.push(s),
                Ok(_) => {}
                Err(e) => eprintln!("warning: {e}"),
            }
        }
    }
    out.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    Ok(out)
}

/// Waits until `poll` says the record is finished; exit 75 after `timeout`.
async fn wait<T>(
    what: &str,
    timeout: Duration,
    mut poll: impl AsyncFnMut() -> Result<Option<T>, Failure>,
) -> Result<T, Failure> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(t) = poll().await? {
            return Ok(t);
        }
        if Instant::now() > deadline {
            return Err(Failure::new(
                EXIT_TIMEOUT,
                format!("{what} still pending after {}: is dhv-binder running on a node with the plugin? (`dhv-binder volume snapshot list`, `dhv-binder volume status`; the request stays, `-detach` returns at once)", humantime::format_duration(timeout)),
            ));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Refuses at once a request nodes would refuse: `what` of signed `whom` without the key.
fn unsigned_request(what: &str, whom: &str) -> Failure {
    Failure::new(
        EXIT_CONFIG,
        format!("{what} {whom} needs the operator's signature (agents with --record-keys act only on signed requests): give the operator's key (--signing-key or DHV_BINDER_SIGNING_KEY)"),
    )
}

/// Runs a `volume snapshot` subcommand in namespace `ns`.
pub async fn snapshot_cmd(client: &Client, ns: &str, cmd: SnapshotCommand) -> Result<(), Failure> {
    match cmd {
        SnapshotCommand::Create {
            volume,
            name,
            detach,
            timeout,
            local,
            key,
        } => {
            let key = key.load()?;
            let vol = read_record(client, ns, &volume).await?;
            if vol.state != VolumeState::Ready {
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!(
                        "volume {} is {}: only a ready volume can be snapshotted",
                        vol.key(),
                        vol.state.as_str()
                    ),
                ));
            }
            precheck(&local.plugin_dir, &vol.spec.plugin_id, Capability::Snapshot).await?;
            precheck_nodes(client, &vol.spec.plugin_id, Capability::Snapshot).await?;
            if key.is_none() && !vol.signature.is_empty() {
                return Err(unsigned_request("a snapshot of", &vol.key().to_string()));
            }
            let mut snap = SnapshotRecord::new(&vol, name.as_deref().unwrap_or(""), now());
            let on = place(client, &vol, Capability::Snapshot).await?;
            snap.worker_node = on.node_id.clone();
            // Nodes take the snapshot only if the request verifies: the signature binds its
            // source volume (name and ID), so it cannot be re-pointed at another volume.
            if let Some(k) = &key {
                k.sign(&mut snap);
            }
            crate::cluster::worker::put_cas(client, &snap.to_variable(), 0)
                .await
                .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
            outln!(
                "==> Snapshot {} of volume {} requested, to run on {}",
                snap.id,
                vol.key(),
                on.describe()
            );
            if detach {
                return Ok(());
            }
            let id = snap.id.clone();
            let done = wait("snapshot", timeout, async || {
                Ok(read_snapshot(client, ns, &id)
                    .await?
                    .filter(|s| matches!(s.state, VolumeState::Ready | VolumeState::Failed)))
            })
            .await?;
            if done.state == VolumeState::Failed {
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!("snapshot {} failed: {} (delete it with `dhv-binder volume snapshot delete {}`)", done.id, crate::escape::escape_control(&super::output::plugin_text(&done.error)), done.id),
                ));
            }
            outln!(
                "==> Snapshot {} is ready ({}), taken on node {}",
                done.id,
                bytes(done.bytes),
                node_name(client, &done.worker_node).await
            );
            Ok(())
        }
        SnapshotCommand::List {
            volume,
            plugin,
            secrets_file,
            secrets_env,
            roots,
            local,
            out,
        } => {
            let snaps = snapshots(client, ns, volume.as_deref()).await?;
            let rows: Vec<SnapshotSummary> = snaps.iter().map(SnapshotSummary::of).collect();
            let verbose = out.verbose;
            out.print(&rows, |r| render_snapshots(r, verbose))?;
            if let Some(plugin) = plugin {
                let secrets = super::plugin::secrets_from(
                    secrets_file.as_deref(),
                    secrets_env.as_deref(),
                    "DHV_BINDER_SNAPSHOT_SECRETS",
                )?;
                let roots = roots
                    .iter()
                    .map(|r| format!("{plugin}={}", r.display()))
                    .collect::<Vec<_>>();
                let roots = crate::storage::plugin::allowed_roots(&roots)
                    .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
                let runner = Runner::new(&local.plugin_dir, Duration::from_secs(60))
                    .with_allowed_roots(roots);
                list_from_plugin(&runner, &plugin, secrets.into_iter().collect(), &snaps).await?;
            }
            Ok(())
        }
        SnapshotCommand::Delete {
            snapshot_id,
            detach,
            timeout,
            key,
        } => {
            let key = key.load()?;
            let Some(mut snap) = read_snapshot(client, ns, &snapshot_id).await? else {
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!("snapshot {snapshot_id} does not exist in namespace {ns}"),
                ));
            };
            if matches!(snap.state, VolumeState::Pending | VolumeState::Failed)
                && snap.context.is_null()
            {
                crate::cluster::changes::delete_record(
                    client,
                    ns,
                    &snapshot::record_path(&snap.id),
                    Some(snap.modify_index),
                )
                .await?;
                outln!(
                    "==> Deleted snapshot record {} (the plugin had made nothing)",
                    snap.id
                );
                return Ok(());
            }
            if key.is_none() && !snap.signature.is_empty() {
                return Err(unsigned_request("the delete of snapshot", &snap.id));
            }
            snap.state = VolumeState::Deleting;
            snap.worker_node.clear();
            // Nodes run `snapshot_delete` only with the operator's delete signature.
            if let Some(k) = &key {
                k.sign_delete(&mut snap);
            }
            crate::cluster::worker::put_cas(client, &snap.to_variable(), snap.modify_index)
                .await
                .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
            outln!("==> Delete of snapshot {} requested", snap.id);
            if detach {
                return Ok(());
            }
            let snapshot_id = snap.id.clone();
            wait("snapshot delete", timeout, async || {
                Ok(client
                    .variable(ns, &snapshot::record_path(&snapshot_id))
                    .await?
                    .is_none()
                    .then_some(()))
            })
            .await?;
            outln!("==> Snapshot {snapshot_id} deleted");
            Ok(())
        }
    }
}

/// `snapshot list --plugin`: runs the plugin's `snapshot_list` here with the given secrets
/// and lists what the storage holds, marking snapshots that have no record.
async fn list_from_plugin(
    runner: &Runner,
    plugin: &str,
    secrets: BTreeMap<String, String>,
    records: &[SnapshotRecord],
) -> Result<(), Failure> {
    let plugin_dir = runner.plugin_dir();
    let fp = runner
        .fingerprint(plugin)
        .await
        .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
    fp.require(plugin, Operation::SnapshotList)
        .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
    let node = crate::storage::environment::NodeEnv {
        node_id: String::new(),
        node_pool: String::new(),
        volumes_dir: PathBuf::from("/var/lib/dhv-binder/volumes"),
        plugin_dir: plugin_dir.to_path_buf(),
    };
    let out = runner
        .call(
            plugin,
            Operation::SnapshotList,
            &snapshot::list_env(&node, &secrets),
            &secrets,
        )
        .await
        .map_err(|e| {
            Failure::new(
                EXIT_FAILED,
                crate::storage::plugin::redact(&e.to_string(), &secrets),
            )
        })?;
    let listed: crate::storage::plugin::SnapshotListResult =
        crate::storage::plugin::parse(plugin, Operation::SnapshotList, &out.stdout).map_err(
            |e| {
                Failure::new(
                    EXIT_FAILED,
                    crate::storage::plugin::redact(&e.to_string(), &secrets),
                )
            },
        )?;
    outln!("\nHeld by plugin {plugin:?} (snapshot_list)");
    for s in listed.snapshots {
        let known = records.iter().any(|r| r.id == s.id);
        outln!(
            "{:<36}  {:>12}  ready={}{}",
            crate::escape::escape_control(&s.id),
            s.bytes,
            s.ready,
            if known {
                ""
            } else {
                "  (no record: left by a failed or interrupted operation?)"
            }
        );
    }
    Ok(())
}

/// `volume create` for a volume that exists: the same spec again is success; a larger
/// `capacity_min` requests an expansion (and waits for it up to `wait`, unless `None`:
/// `-detach`); anything else, shrinking included, is refused with the reason.
pub async fn create_existing(
    client: &Client,
    spec: &VolumeSpec,
    wait_for: Option<Duration>,
    local: &LocalPlugins,
    key: Option<&SigningKey>,
) -> Result<(), Failure> {
    let mut rec = read_record(client, &spec.namespace, &spec.name).await?;
    match expansion::plan_update(&rec, spec)
        .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?
    {
        Update::Unchanged => {
            outln!(
                "==> Volume {} already exists with this spec ({})",
                rec.key(),
                bytes(rec.capacity_bytes)
            );
            Ok(())
        }
        Update::Grow { from, to } => {
            precheck(&local.plugin_dir, &rec.spec.plugin_id, Capability::Expand).await?;
            precheck_nodes(client, &rec.spec.plugin_id, Capability::Expand).await?;
            // The new size is part of the signed spec: nodes grow a volume only up to it.
            expansion::request(&mut rec, to);
            rec.spec.capacity_max = spec.capacity_max;
            let on = place(client, &rec, Capability::Expand).await?;
            if let Some(x) = rec.expansion.as_mut() {
                x.node = on.node_id.clone();
            }
            match key {
                Some(k) => k.sign(&mut rec),
                None if !rec.signature.is_empty() => {
                    return Err(Failure::new(
                        EXIT_CONFIG,
                        format!("volume {} is signed and growing it changes its spec: give the operator's key (--signing-key or DHV_BINDER_SIGNING_KEY)", rec.key()),
                    ))
                }
                None => {}
            }
            crate::cluster::worker::put_cas(client, &rec.to_variable(), rec.modify_index)
                .await
                .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
            outln!(
                "==> Expansion of volume {} from {} to {} requested, to run on {}",
                rec.key(),
                bytes(from),
                bytes(to),
                on.describe()
            );
            let Some(timeout) = wait_for else {
                return Ok(());
            };
            let key = rec.key();
            let done = wait("expansion", timeout, async || {
                let cur: VolumeRecord = read_record(client, &key.namespace, &key.name).await?;
                Ok(match &cur.expansion {
                    None => Some(Ok(cur.capacity_bytes)),
                    Some(x) if x.state == ExpansionState::Failed => Some(Err(x.error.clone())),
                    Some(x) if x.state == ExpansionState::AtNextPublish => Some(Ok(0)),
                    Some(_) => None,
                })
            })
            .await?;
            match done {
                Ok(0) => {
                    outln!("==> Volume {key} is in use and its plugin cannot grow it online: it grows to {} before its next publish", bytes(to));
                    Ok(())
                }
                Ok(bytes) => {
                    outln!(
                        "==> Volume {key} is now {}, grown on {}",
                        super::output::bytes(bytes),
                        on.describe()
                    );
                    Ok(())
                }
                Err(e) => Err(Failure::new(
                    EXIT_FAILED,
                    format!("expand failed on {}: {} (ask again with the same spec to retry, placed anew; give the size it has, {}, to withdraw it)", on.describe(), crate::escape::escape_control(&super::output::plugin_text(&e)), bytes(from)),
                )),
            }
        }
        Update::Withdraw { pending, to } => {
            expansion::withdraw(&mut rec, to);
            rec.spec.capacity_max = spec.capacity_max;
            match key {
                Some(k) => k.sign(&mut rec),
                None if !rec.signature.is_empty() => {
                    return Err(Failure::new(
                        EXIT_CONFIG,
                        format!("volume {} is signed and withdrawing its growth changes its spec: give the operator's key (--signing-key or DHV_BINDER_SIGNING_KEY)", rec.key()),
                    ))
                }
                None => {}
            }
            crate::cluster::worker::put_cas(client, &rec.to_variable(), rec.modify_index)
                .await
                .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
            outln!(
                "==> Growth of volume {} to {} withdrawn: it stays {}",
                rec.key(),
                bytes(pending),
                bytes(rec.capacity_bytes.max(to))
            );
            Ok(())
        }
    }
}

/// A node's name from its record, for messages; its ID when it has no record (or `""`).
async fn node_name(client: &Client, node_id: &str) -> String {
    if node_id.is_empty() {
        return "(none)".into();
    }
    match crate::cluster::nodes::list(client).await {
        Ok((records, _)) => records
            .into_iter()
            .find(|r| r.node_id == node_id && !r.node_name.is_empty())
            .map_or_else(|| node_id.to_string(), |r| r.node_name),
        Err(_) => node_id.to_string(),
    }
}

/// Where a storage operation on a volume runs, and why (the CLI says so).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The node's ID, as the request names it (`""`: any node with the plugin takes it).
    pub node_id: String,
    /// The node's name for messages (its ID when its record has none).
    pub node_name: String,
    /// Why that node: `the volume is mounted there`, ...
    pub why: String,
}

impl Placement {
    /// One line for the CLI: `node node-1 (the volume is mounted there)`.
    pub fn describe(&self) -> String {
        if self.node_id.is_empty() {
            format!("any node with the plugin ({})", self.why)
        } else {
            format!("node {} ({})", self.node_name, self.why)
        }
    }
}

/// Decides where an operation on `rec` (namespace/name) runs, from the node records
/// (`dhv-binder/nodes/<id>`, each written by its node's agent from its journal and mount
/// table, [`crate::cluster::nodes`]): the node whose record says the volume is `published`
/// there (mounted: the plugin quiesces or grows it under its users; the first by name of a
/// multi-node volume), or one where a publish or unpublish of it is under way (the agent
/// runs the operation there once it settles). When no node has it: a live node serving the
/// plugin that can reach its storage, the one that last published it, else the one that
/// created it; else any node with the plugin. Never the node of an allocation that only
/// waits for the volume (its placeholder lists it, but nothing is mounted there).
/// `now` in Unix seconds.
pub fn placement(
    records: &[NodeRecord],
    rec: &VolumeRecord,
    cap: Capability,
    now: u64,
) -> Placement {
    let key = rec.key().to_string();
    let name_of = |r: &NodeRecord| {
        if r.node_name.is_empty() {
            r.node_id.clone()
        } else {
            r.node_name.clone()
        }
    };
    let stale = |r: &NodeRecord| {
        if r.liveness(now) == Liveness::Stale {
            "; its agent's node record is stale: the operation waits for that agent"
        } else {
            ""
        }
    };
    for (state, why) in [
        ("published", "the volume is mounted there"),
        ("publishing", "the volume is being published there"),
        ("unpublishing", "the volume is being unpublished there"),
    ] {
        if let Some(r) = records
            .iter()
            .find(|r| r.volumes.get(&key).is_some_and(|v| v.state == state))
        {
            return Placement {
                node_id: r.node_id.clone(),
                node_name: name_of(r),
                why: format!("{why}{}", stale(r)),
            };
        }
    }
    let cap = cap.to_string();
    let can = |r: &NodeRecord| {
        r.can_serve(&rec.spec.plugin_id, &rec.spec.node_pool, now)
            && r.plugins
                .get(&rec.spec.plugin_id)
                .and_then(|p| p.capabilities.as_ref())
                .is_none_or(|c| c.contains(&cap))
    };
    let last_publisher = records
        .iter()
        .filter(|r| can(r))
        .filter_map(|r| {
            let t = r
                .history
                .get(&key)?
                .iter()
                .filter(|e| e.event == "publish" && e.ok)
                .map(|e| e.time)
                .max()?;
            Some((t, r))
        })
        .max_by_key(|(t, _)| *t)
        .map(|(_, r)| r);
    if let Some(r) = last_publisher {
        return Placement {
            node_id: r.node_id.clone(),
            node_name: name_of(r),
            why: "the volume is mounted nowhere; that node published it last".into(),
        };
    }
    if let Some(r) = records
        .iter()
        .find(|r| r.node_id == rec.worker_node && can(r))
    {
        return Placement {
            node_id: r.node_id.clone(),
            node_name: name_of(r),
            why: "the volume is mounted nowhere; that node created it".into(),
        };
    }
    Placement {
        node_id: String::new(),
        node_name: String::new(),
        why: "the volume is mounted nowhere".into(),
    }
}

/// [`placement`] from the node records read now.
async fn place(client: &Client, rec: &VolumeRecord, cap: Capability) -> Result<Placement, Failure> {
    let (records, _) = crate::cluster::nodes::list(client).await?;
    Ok(placement(&records, rec, cap, now()))
}

/// For a clone: where it is made, from where its source is ([`placement`]); `None` for a
/// volume without a clone source.
pub async fn source_node(client: &Client, spec: &VolumeSpec) -> Result<Option<Placement>, Failure> {
    match &spec.source {
        VolumeSource::CloneId(name) => {
            let source = read_record(client, &spec.namespace, name).await?;
            Ok(Some(place(client, &source, Capability::Clone).await?))
        }
        _ => Ok(None),
    }
}

/// Before a new volume with a source is recorded: the source exists in the namespace, and
/// the plugin (when installed here) declares "snapshot" or "clone".
pub async fn check_source(
    client: &Client,
    spec: &VolumeSpec,
    local: &LocalPlugins,
) -> Result<(), Failure> {
    match &spec.source {
        VolumeSource::Empty => Ok(()),
        VolumeSource::SnapshotId(id) => {
            let s = read_snapshot(client, &spec.namespace, id)
                .await?
                .ok_or_else(|| {
                    Failure::new(
                        EXIT_FAILED,
                        format!(
                            "snapshot {id} does not exist in namespace {}",
                            spec.namespace
                        ),
                    )
                })?;
            if s.state != VolumeState::Ready {
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!("snapshot {id} is {}, not ready", s.state.as_str()),
                ));
            }
            precheck(&local.plugin_dir, &spec.plugin_id, Capability::Snapshot).await?;
            precheck_nodes(client, &spec.plugin_id, Capability::Snapshot).await
        }
        VolumeSource::CloneId(name) => {
            let v = read_record(client, &spec.namespace, name).await?;
            if v.spec.plugin_id != spec.plugin_id {
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!(
                        "volume {} uses plugin {:?}, not {:?}: a clone stays with its plugin",
                        v.key(),
                        v.spec.plugin_id,
                        spec.plugin_id
                    ),
                ));
            }
            precheck(&local.plugin_dir, &spec.plugin_id, Capability::Clone).await?;
            precheck_nodes(client, &spec.plugin_id, Capability::Clone).await
        }
    }
}

impl From<crate::cluster::worker::TakeError> for Failure {
    fn from(e: crate::cluster::worker::TakeError) -> Self {
        match e {
            crate::cluster::worker::TakeError::Nomad(n) => n.into(),
            lost => Failure::new(EXIT_FAILED, lost.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, state: Option<&str>) -> NodeRecord {
        let mut r = NodeRecord::new(id, &format!("name-{id}"), "default");
        r.last_seen = 1000;
        r.plugins.insert(
            "ext4".into(),
            crate::cluster::nodes::PluginInfo {
                version: "1".into(),
                deferred_bind: true,
                healthy: true,
                capabilities: Some(vec!["snapshot".into(), "expand".into()]),
                ..Default::default()
            },
        );
        if let Some(s) = state {
            r.volumes.insert(
                "default/data".into(),
                crate::cluster::nodes::NodeVolume {
                    state: s.into(),
                    ..Default::default()
                },
            );
        }
        r
    }

    /// Issue 46 #1: the node whose record says the volume is mounted runs the operation,
    /// whatever the order of the records (a node that only waits for the claim lists the
    /// waiting allocation on its placeholder, but has nothing mounted); when no node has it
    /// mounted, the node that published it last, else the one that created it, else any.
    #[test]
    fn an_operation_runs_where_the_volume_is_mounted_else_where_its_storage_was() {
        let (spec, _) = crate::volume::parse_spec("name = \"data\"\nplugin_id = \"ext4\"").unwrap();
        let mut rec = VolumeRecord::new(spec, BTreeMap::new());
        rec.worker_node = "c".into();
        let mut waiting = node("a", None);
        waiting.volumes.insert(
            "default/data".into(),
            crate::cluster::nodes::NodeVolume {
                waiting: "the single-node claim is held by node name-b".into(),
                ..Default::default()
            },
        );
        for records in [
            vec![
                waiting.clone(),
                node("b", Some("published")),
                node("c", None),
            ],
            vec![
                node("c", None),
                node("b", Some("published")),
                waiting.clone(),
            ],
        ] {
            let p = placement(&records, &rec, Capability::Snapshot, 1010);
            assert_eq!(p.node_id, "b", "{p:?}");
            assert_eq!(p.describe(), "node name-b (the volume is mounted there)");
        }
        // Mounted nowhere: the last publisher that can run it, else the creator, else any.
        let mut last = node("a", None);
        last.history.insert(
            "default/data".into(),
            vec![crate::cluster::nodes::NodeEvent {
                time: 900,
                event: "publish".into(),
                ok: true,
                ..Default::default()
            }],
        );
        let p = placement(
            &[last.clone(), node("c", None)],
            &rec,
            Capability::Expand,
            1010,
        );
        assert_eq!(p.node_id, "a", "{p:?}");
        let p = placement(
            &[node("a", None), node("c", None)],
            &rec,
            Capability::Expand,
            1010,
        );
        assert_eq!(p.node_id, "c", "{p:?}");
        assert!(p.describe().contains("created it"), "{p:?}");
        // The creator is stale: any node with the plugin takes it.
        let mut gone = node("c", None);
        gone.last_seen = 0;
        let p = placement(&[node("a", None), gone], &rec, Capability::Expand, 1010);
        assert_eq!(p.node_id, "", "{p:?}");
        // Mounted on a node whose agent is stale: still there (not torn elsewhere), said so.
        let mut stale = node("b", Some("published"));
        stale.last_seen = 0;
        let p = placement(&[node("a", None), stale], &rec, Capability::Snapshot, 1010);
        assert_eq!(p.node_id, "b");
        assert!(p.why.contains("stale"), "{p:?}");
    }

    #[tokio::test]
    async fn an_undeclared_operation_is_refused_naming_plugin_and_capability() {
        let plugins = Path::new(env!("CARGO_MANIFEST_DIR")).join("plugins");
        let e = precheck(&plugins, "webdav", Capability::Snapshot)
            .await
            .unwrap_err();
        assert_eq!(e.code, EXIT_FAILED);
        assert!(
            e.message.contains("\"webdav\"") && e.message.contains("snapshot"),
            "{}",
            e.message
        );
        let e = precheck(&plugins, "bind", Capability::Expand)
            .await
            .unwrap_err();
        assert!(
            e.message.contains("\"bind\"") && e.message.contains("expand"),
            "{}",
            e.message
        );
        precheck(&plugins, "bind", Capability::Clone).await.unwrap();
        precheck(&plugins, "ext4", Capability::Snapshot)
            .await
            .unwrap();
        // A plugin not installed here is left to the agent.
        precheck(&plugins, "not-here", Capability::Snapshot)
            .await
            .unwrap();
    }
}
