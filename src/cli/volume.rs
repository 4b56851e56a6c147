//! `dhv-binder volume create|register|list|status|delete|deregister|keygen`: the
//! cluster-wide volume records in Nomad Variables (see [`crate::volume`]), signed with the
//! operator's key ([`crate::cluster::trust`]).

use super::output::{ago, bytes, kv, plural, short_id, table, OutputArgs};
use super::records::{read_record, read_var, users_of, SigningArgs, VolumeUser, REGISTERED_ITEM};
use super::storage::{self, LocalPlugins, SnapshotCommand, SnapshotSummary};
use super::{Failure, EXIT_CONFIG, EXIT_FAILED, EXIT_TIMEOUT};
use crate::cluster::mounted;
use crate::cluster::nodes::{self, Liveness, NodeRecord};
use crate::cluster::trust::SigningKey;
use crate::config::NomadConfig;
use crate::escape::escape_control;
use crate::nomad::{Client, NomadError};
use crate::volume::{self, VolumeRecord, VolumeState};
use clap::Subcommand;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, Subcommand)]
pub enum VolumeCommand {
    /// Create a deferred volume from an HCL spec (like `nomad volume create`): fails at once
    /// when no live node has the plugin (deferred and healthy) in the spec's node pool. Given
    /// again for an existing volume with a larger `capacity_min`, grows it (plugin capability
    /// "expand"); shrinking or changing anything else is refused.
    Create {
        /// The volume spec (HCL) file, or `-` to read it from standard input.
        spec: PathBuf,
        #[command(flatten)]
        wait: WaitArgs,
        #[command(flatten)]
        local: LocalPlugins,
        #[command(flatten)]
        key: SigningArgs,
    },
    /// Snapshot volumes, list and delete snapshots (like `nomad volume snapshot`).
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// Claims of single-node volumes: `volume claim release` (the operator's override).
    #[command(subcommand)]
    Claim(super::claim::ClaimCommand),
    /// Register a volume that already exists in the storage (like `nomad volume register`):
    /// no plugin `create` runs; the spec's `context { ... }` block is what the plugin's
    /// create would have returned (e.g. `export_path` for the bind plugin), `capacity` its size.
    Register {
        /// The register spec (HCL) file, with a `context { ... }` block and `capacity`, or
        /// `-` to read it from standard input.
        spec: PathBuf,
        #[command(flatten)]
        key: SigningArgs,
    },
    /// Make an operator signing key: writes the private key (mode 0600) and prints the public
    /// key line for each node's --record-keys file (docs/security.md).
    Keygen {
        /// Where to write the private key; refused if it exists.
        out: PathBuf,
    },
    /// List deferred volumes.
    List {
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Show one volume: record, allocations using it.
    Status {
        /// The volume's name, or its ID or a unique prefix of it.
        name: String,
        #[command(flatten)]
        out: OutputArgs,
    },
    /// Delete a volume (the plugin's `delete` destroys its storage); refused while any
    /// allocation uses it, and for registered volumes (use `deregister`).
    Delete {
        /// The volume's name, or its ID or a unique prefix of it.
        name: String,
        #[command(flatten)]
        wait: WaitArgs,
        #[command(flatten)]
        key: SigningArgs,
    },
    /// Set whether new allocations may get a volume: `-availability=active|pause|drain`.
    Update(super::update::UpdateArgs),
    /// Remove a volume's record without calling the plugin's `delete`: the storage stays.
    /// Refused while any allocation uses it.
    Deregister {
        /// The volume's name, or its ID or a unique prefix of it.
        name: String,
    },
}

/// How long a command that changes a volume waits for the agents to act on it.
#[derive(Debug, Clone, clap::Args)]
pub struct WaitArgs {
    /// Return once the record is written, without waiting for the agents.
    #[arg(long)]
    pub detach: bool,
    /// How long to wait for the agents (e.g. `30s`, `5m`); past it the command gives up
    /// with exit 75, saying why no agent acted (the record stays).
    #[arg(long, default_value = DEFAULT_WAIT, value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

impl WaitArgs {
    /// How long to wait; `None` with `-detach`.
    pub fn wait(&self) -> Option<Duration> {
        (!self.detach).then_some(self.timeout)
    }
}

/// Writes a new operator key to `out` (created, mode 0600) and prints its public key line.
fn keygen(out: &Path) -> Result<(), Failure> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    let (key, text) =
        SigningKey::generate().map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)
        .map_err(|e| Failure::new(EXIT_CONFIG, format!("cannot create {}: {e}", out.display())))?;
    f.write_all(text.as_bytes())
        .map_err(|e| Failure::new(EXIT_FAILED, format!("{}: {e}", out.display())))?;
    outln!("{}", key.public_line());
    Ok(())
}

/// What `volume list -json` prints per volume (never the secrets): the fields of Nomad's
/// `HostVolumeStub` (`api/host_volumes.go`) under Nomad's names (`ID`, `PluginID`,
/// `CapacityBytes`, `CreateIndex`...), and dhv-binder's own (`AccessMode`, `Registered`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct VolumeSummary {
    #[serde(rename = "ID")]
    pub id: String,
    pub namespace: String,
    pub name: String,
    #[serde(rename = "PluginID")]
    pub plugin_id: String,
    /// `pending`, `creating`, `ready`, `failed`, `deleting`.
    pub state: String,
    pub capacity_bytes: u64,
    pub node_pool: String,
    /// The first capability's access mode.
    pub access_mode: String,
    pub registered: bool,
    /// The record variable's `CreateIndex` (Nomad's index when it was first written).
    pub create_index: u64,
    /// The record variable's `ModifyIndex`.
    pub modify_index: u64,
    /// `active`, `pause` or `drain` (`volume update -availability`).
    pub availability: String,
}

impl VolumeSummary {
    /// The state, with the availability when it is not `active`: `ready (pause)`.
    fn state_shown(&self) -> String {
        match self.availability.as_str() {
            "active" | "" => self.state.clone(),
            a => format!("{} ({a})", self.state),
        }
    }
}

/// One requested capability in `-json`, as Nomad's `HostVolumeCapability`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct CapabilityOut {
    pub attachment_mode: String,
    pub access_mode: String,
}

impl From<&volume::Capability> for CapabilityOut {
    fn from(c: &volume::Capability) -> Self {
        CapabilityOut {
            attachment_mode: c.attachment_mode.clone(),
            access_mode: c.access_mode.clone(),
        }
    }
}

/// What `volume status -json` prints (never the secrets, only their count): the summary's
/// fields, then Nomad's `RequestedCapabilities`, `Parameters` and `Allocations` (as
/// Nomad's allocation stubs name them: `ID`, `Name`, `NodeID`), then dhv-binder's own.
#[derive(Debug, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct VolumeDetail {
    #[serde(flatten)]
    pub summary: VolumeSummary,
    pub requested_capabilities: Vec<CapabilityOut>,
    pub parameters: BTreeMap<String, String>,
    /// What the plugin's `create` returned as `context` (its own keys).
    pub context: serde_json::Value,
    /// How many secrets the record holds (never their keys or values).
    pub secrets: usize,
    /// The record carries an operator signature (agents verify it; see docs/security.md).
    pub signed: bool,
    /// The node that runs (or ran) the create or delete, as `name (short ID)`, or empty.
    pub worker_node: String,
    pub error: String,
    /// Where the content came from: `snapshot <id>`, `clone of volume <name>`, or empty.
    pub source: String,
    /// A pending or failed storage operation (an expansion), or empty.
    pub operation: String,
    pub allocations: Vec<VolumeUser>,
    /// The volume's snapshots, oldest first.
    pub snapshots: Vec<SnapshotSummary>,
    /// Why a `pending` or `deleting` volume waits (the refusals the agents published, no
    /// node able to serve it), or empty.
    pub waiting: String,
    /// The volume on each node that has it (mounted, a placeholder, an error, a refusal),
    /// from the node records and placeholders.
    pub nodes: Vec<NodeDetail>,
    /// The recent publish, unpublish and fence events of the volume on every node, newest
    /// first (each node publishes its last [`nodes::MAX_NODE_HISTORY`] per volume);
    /// `volume status -verbose` prints them.
    pub history: Vec<HistoryEvent>,
}

/// One volume on one node, for `volume status`.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct NodeDetail {
    #[serde(rename = "NodeID")]
    pub node_id: String,
    pub node_name: String,
    /// The mount's state on the node (`published`, `publishing`, `unpublishing`), or
    /// `not mounted`.
    pub state: String,
    /// When the state began (the node's clock): Unix seconds here, an RFC 3339 string in
    /// `-json`, `null` when unknown.
    #[serde(serialize_with = "super::output::ser_rfc3339")]
    pub since: u64,
    /// The placeholder's Nomad host volume ID on the node, or empty.
    #[serde(rename = "HostVolumeID")]
    pub host_volume_id: String,
    /// Allocations on the node using the volume (their IDs).
    pub allocations: Vec<String>,
    /// The node's last error for the volume (the plugin's redacted words), or empty.
    pub error: String,
    /// Why the node refuses the volume's record, or empty.
    pub refused: String,
    /// The node's claim on the (single-node) volume: `held`, `fenced`, `lost`, or empty.
    pub claim: String,
    /// Why a publish of the volume waits on the node (e.g. the claim another node holds,
    /// naming its job, allocation and node), or empty.
    pub waiting: String,
}

/// One event of a volume on one node, from the node's journal (via its node record).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct HistoryEvent {
    /// When (the node's clock): Unix seconds here, an RFC 3339 string in `-json`.
    #[serde(serialize_with = "super::output::ser_rfc3339")]
    pub time: u64,
    #[serde(rename = "NodeID")]
    pub node_id: String,
    pub node_name: String,
    /// `publish`, `unpublish`, `fence` or `unfence`.
    pub event: String,
    /// The allocation the publish was for; empty for the others.
    #[serde(rename = "AllocID")]
    pub alloc_id: String,
    /// `ok` or `failed`.
    pub outcome: String,
    /// How long the plugin call took, measured by the agent, in milliseconds; 0 when not
    /// measured (fence events).
    pub duration_ms: u64,
}

/// The per-node rows of `volume status`: each node with a mount, an error, a refusal or a
/// placeholder of the volume.
pub fn node_details(
    rec: &VolumeRecord,
    records: &[NodeRecord],
    placeholders: &[(String, String)],
    users: &[VolumeUser],
) -> Vec<NodeDetail> {
    let key = rec.key().to_string();
    let path = volume::record_path(&rec.spec.name);
    let mut out: BTreeMap<String, NodeDetail> = BTreeMap::new();
    for n in records {
        let v = n.volumes.get(&key);
        let refused = n.refusal(&rec.spec.namespace, &path).unwrap_or_default();
        if v.is_none() && refused.is_empty() {
            continue;
        }
        let v = v.cloned().unwrap_or_default();
        out.insert(
            n.node_id.clone(),
            NodeDetail {
                node_id: n.node_id.clone(),
                node_name: n.node_name.clone(),
                state: if v.state.is_empty() {
                    "not mounted".into()
                } else {
                    v.state
                },
                since: v.since,
                allocations: v.users,
                error: v.error,
                refused: refused.to_string(),
                claim: v.claim,
                waiting: v.waiting,
                ..Default::default()
            },
        );
    }
    for (node_id, hv) in placeholders {
        let d = out.entry(node_id.clone()).or_insert_with(|| NodeDetail {
            node_id: node_id.clone(),
            node_name: records
                .iter()
                .find(|r| &r.node_id == node_id)
                .map(|r| r.node_name.clone())
                .unwrap_or_default(),
            state: "not mounted".into(),
            ..Default::default()
        });
        d.host_volume_id = hv.clone();
    }
    for u in users {
        if let Some(d) = out.get_mut(&u.node_id) {
            if !d.allocations.contains(&u.alloc_id) {
                d.allocations.push(u.alloc_id.clone());
            }
        }
    }
    let mut v: Vec<NodeDetail> = out.into_values().collect();
    v.sort_by(|a, b| (&a.node_name, &a.node_id).cmp(&(&b.node_name, &b.node_id)));
    v
}

/// The recent events of `rec` on every node, from the node records, newest first (events
/// of the same second: by node name, then as the node listed them, latest first).
pub fn history(rec: &VolumeRecord, records: &[NodeRecord]) -> Vec<HistoryEvent> {
    let key = rec.key().to_string();
    let mut out: Vec<(usize, HistoryEvent)> = Vec::new();
    for n in records {
        for (i, e) in n.history.get(&key).into_iter().flatten().enumerate() {
            out.push((
                i,
                HistoryEvent {
                    time: e.time,
                    node_id: n.node_id.clone(),
                    node_name: n.node_name.clone(),
                    event: e.event.clone(),
                    alloc_id: e.alloc_id.clone(),
                    outcome: if e.ok { "ok" } else { "failed" }.into(),
                    duration_ms: e.ms,
                },
            ));
        }
    }
    out.sort_by(|(ia, a), (ib, b)| {
        b.time
            .cmp(&a.time)
            .then_with(|| a.node_name.cmp(&b.node_name))
            .then_with(|| ib.cmp(ia))
    });
    out.into_iter().map(|(_, e)| e).collect()
}

/// A measured duration as the CLI prints it: `132ms` below a second, else `1.2s`.
pub fn millis(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms}ms")
    } else {
        format!("{:.1}s", ms as f64 / 1000.0)
    }
}

/// The readable `Recent Events` table of `volume status -verbose`.
pub fn render_history(events: &[HistoryEvent], verbose: bool) -> String {
    let rows: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            let name = if e.node_name.is_empty() {
                short_id(&e.node_id, verbose)
            } else {
                e.node_name.clone()
            };
            vec![
                super::output::rfc3339(e.time).unwrap_or_else(|| "-".into()),
                name,
                e.event.clone(),
                if e.alloc_id.is_empty() {
                    "-".into()
                } else {
                    short_id(&e.alloc_id, verbose)
                },
                match (e.outcome.as_str(), e.duration_ms) {
                    (o, 0) => o.to_string(),
                    ("ok", ms) => format!("ok in {}", millis(ms)),
                    (o, ms) => format!("{o} after {}", millis(ms)),
                },
            ]
        })
        .collect();
    table(
        &["Time", "Node", "Event", "Allocation", "Outcome"],
        &rows,
        "No recent events on any node",
    )
}

fn summary(r: &VolumeRecord, registered: bool) -> VolumeSummary {
    VolumeSummary {
        id: r.id.clone(),
        namespace: r.spec.namespace.clone(),
        name: r.spec.name.clone(),
        plugin_id: r.spec.plugin_id.clone(),
        state: r.state.as_str().into(),
        capacity_bytes: r.capacity_bytes,
        node_pool: r.spec.node_pool.clone(),
        access_mode: r.access_mode().to_string(),
        registered,
        create_index: r.create_index,
        modify_index: r.modify_index,
        availability: r.spec.availability.as_str().into(),
    }
}

/// The readable `volume list`: IDs cut to 8 characters unless `verbose`.
pub fn render_list(vols: &[VolumeSummary], verbose: bool) -> String {
    let rows: Vec<Vec<String>> = vols
        .iter()
        .map(|v| {
            vec![
                short_id(&v.id, verbose),
                v.namespace.clone(),
                v.name.clone(),
                v.plugin_id.clone(),
                if v.capacity_bytes > 0 {
                    bytes(v.capacity_bytes)
                } else {
                    "-".into()
                },
                v.state_shown(),
            ]
        })
        .collect();
    table(
        &["ID", "Namespace", "Name", "Plugin ID", "Capacity", "State"],
        &rows,
        "No volumes",
    )
}

/// The readable `volume status`: allocation and node IDs cut to 8 characters unless
/// `verbose`.
pub fn render_detail(d: &VolumeDetail, verbose: bool) -> String {
    let s = &d.summary;
    let mut rows: Vec<(&str, String)> = vec![
        ("ID", s.id.clone()),
        ("Name", s.name.clone()),
        ("Namespace", s.namespace.clone()),
        ("Plugin ID", s.plugin_id.clone()),
        (
            "State",
            if s.registered {
                format!("{} (registered)", s.state_shown())
            } else {
                s.state_shown()
            },
        ),
        (
            "Capacity",
            if s.capacity_bytes > 0 {
                bytes(s.capacity_bytes)
            } else {
                "-".into()
            },
        ),
        (
            "Node Pool",
            if s.node_pool.is_empty() {
                "(any)".into()
            } else {
                s.node_pool.clone()
            },
        ),
    ];
    for c in &d.requested_capabilities {
        rows.push((
            "Capability",
            format!("{} / {}", c.access_mode, c.attachment_mode),
        ));
    }
    rows.push((
        "Parameters",
        serde_json::to_string(&d.parameters).unwrap_or_default(),
    ));
    rows.push(("Signed", if d.signed { "yes" } else { "no" }.into()));
    rows.push((
        "Secrets",
        format!("{}, not shown", plural(d.secrets as u64, "key", "keys")),
    ));
    if !d.worker_node.is_empty() {
        let label = match s.state.as_str() {
            "creating" | "deleting" => "Worker Node",
            "failed" => "Failed On",
            _ => "Created On",
        };
        rows.push((label, d.worker_node.clone()));
    }
    if !d.error.is_empty() {
        rows.push(("Error", d.error.clone()));
    }
    if !d.waiting.is_empty() {
        rows.push(("Waiting For", d.waiting.clone()));
    }
    if !d.source.is_empty() {
        rows.push(("Source", d.source.clone()));
    }
    if !d.operation.is_empty() {
        rows.push(("Operation", d.operation.clone()));
    }
    let mut out = kv(&rows);
    out.push_str("\nAllocations\n");
    let users: Vec<Vec<String>> = d
        .allocations
        .iter()
        .map(|u| {
            vec![
                short_id(&u.alloc_id, verbose),
                u.alloc_name.clone(),
                short_id(&u.node_id, verbose),
            ]
        })
        .collect();
    out.push_str(&table(
        &["ID", "Name", "Node ID"],
        &users,
        "No allocations use this volume",
    ));
    if !d.nodes.is_empty() {
        out.push_str("\nNodes\n");
        let now = super::output::now_unix();
        let rows: Vec<Vec<String>> = d
            .nodes
            .iter()
            .map(|n| {
                let dash = |s: String| if s.is_empty() { "-".to_string() } else { s };
                vec![
                    dash(n.node_name.clone()),
                    if n.claim.is_empty() {
                        n.state.clone()
                    } else {
                        format!("{} (claim {})", n.state, n.claim)
                    },
                    if n.since == 0 {
                        "-".into()
                    } else {
                        ago(n.since, now)
                    },
                    dash(short_id(&n.host_volume_id, verbose)),
                    dash(
                        n.allocations
                            .iter()
                            .map(|a| short_id(a, verbose))
                            .collect::<Vec<_>>()
                            .join(","),
                    ),
                    dash(if !n.refused.is_empty() {
                        format!("refuses the record: {}", n.refused)
                    } else if n.error.is_empty() && !n.waiting.is_empty() {
                        format!("waiting: {}", n.waiting)
                    } else {
                        n.error.clone()
                    }),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "Node",
                "State",
                "Since",
                "Host Volume",
                "Allocations",
                "Last Error",
            ],
            &rows,
            "",
        ));
    }
    if !d.snapshots.is_empty() {
        out.push_str("\nSnapshots\n");
        out.push_str(&storage::render_snapshots(&d.snapshots));
    }
    if verbose {
        out.push_str("\nRecent Events\n");
        out.push_str(&render_history(&d.history, verbose));
    }
    out
}

async fn refuse_in_use(client: &Client, r: &VolumeRecord) -> Result<(), Failure> {
    let users = users_of(client, &r.spec.namespace, &r.spec.name).await?;
    if users.is_empty() {
        return refuse_mounted(client, r).await;
    }
    let list: Vec<String> = users
        .iter()
        .map(|u| format!("{} ({}, node {})", u.alloc_id, u.alloc_name, u.node_id))
        .collect();
    Err(Failure::new(
        EXIT_FAILED,
        format!(
            "volume {} is in use by allocations: {}; stop them first",
            r.key(),
            list.join(", ")
        ),
    ))
}

/// Delete and deregister on evidence: refused while a node's record shows the volume
/// mounted, publishing or unpublishing, a stale record lists it, or a node holds its claim
/// (`cluster::mounted`). A node's record follows its mounts within a moment, so a volume
/// whose last unpublish has just finished is given up to 5 s to clear.
async fn refuse_mounted(client: &Client, r: &VolumeRecord) -> Result<(), Failure> {
    let key = r.key();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let on = mounted::evidence(client, &key, super::output::now_unix()).await?;
        if on.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Failure::new(EXIT_FAILED, mounted::refusal(&key, &on)));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Why no node can serve a plugin, naming what each node has; `None` when one can.
pub fn no_eligible_node(
    records: &[NodeRecord],
    plugin_id: &str,
    node_pool: &str,
    now: u64,
) -> Option<String> {
    if records
        .iter()
        .any(|r| r.can_serve(plugin_id, node_pool, now))
    {
        return None;
    }
    let pool = if node_pool.is_empty() {
        String::new()
    } else {
        format!(" in node pool {node_pool:?}")
    };
    if records.is_empty() {
        return Some(format!(
            "no dhv-binder agent has published its node record, so no node can run plugin {plugin_id:?}{pool}: is the dhv-binder system job running (see `dhv-binder node status`)?"
        ));
    }
    let seen: Vec<String> = records
        .iter()
        .map(|r| {
            let why = if r.liveness(now) == Liveness::Stale {
                "stale".to_string()
            } else if !node_pool.is_empty() && r.node_pool != node_pool {
                format!("pool {}", r.node_pool)
            } else {
                match r.plugins.get(plugin_id) {
                    None => "no such plugin".into(),
                    Some(p) if !p.healthy => format!("plugin unhealthy: {}", p.error),
                    Some(_) => "plugin is not deferred_bind".into(),
                }
            };
            format!("{} ({why})", r.node_name)
        })
        .collect();
    Some(format!(
        "no live node has a healthy deferred plugin {plugin_id:?}{pool}: {}; install the plugin in the plugin directory of a node{pool} (see `dhv-binder plugin status`)",
        seen.join(", ")
    ))
}

/// Reads a spec file, or standard input for `-` (as `nomad volume create -` does).
fn read_spec_text(path: &Path) -> Result<String, Failure> {
    if path == Path::new("-") {
        use std::io::Read as _;
        let mut text = String::new();
        std::io::stdin()
            .take(volume::MAX_SPEC_BYTES as u64 + 1)
            .read_to_string(&mut text)
            .map_err(|e| {
                Failure::new(EXIT_CONFIG, format!("cannot read the spec from stdin: {e}"))
            })?;
        return Ok(text);
    }
    std::fs::read_to_string(path)
        .map_err(|e| Failure::new(EXIT_CONFIG, format!("cannot read {}: {e}", path.display())))
}

/// How a spec's errors name it: the path as the user gave it, or `<stdin>` for `-`.
fn spec_source(path: &Path) -> String {
    if path == Path::new("-") {
        "<stdin>".into()
    } else {
        path.display().to_string()
    }
}

/// Parses a spec (a register spec with `register`) read from `source` (as
/// [`spec_source`] names it), taking the CLI's namespace when the spec names none. An error
/// names the file and the line: `spec.hcl:7: …`.
fn parse(
    source: &str,
    text: &str,
    ns: &str,
    register: bool,
) -> Result<(volume::VolumeSpec, BTreeMap<String, String>), Failure> {
    let parsed = if register {
        volume::parse_register_spec(text)
    } else {
        volume::parse_spec(text)
    };
    let (mut spec, secrets) =
        parsed.map_err(|e| Failure::new(EXIT_CONFIG, e.located(source, text)))?;
    if spec.namespace == "default" && ns != "default" && ns != "*" && !text.contains("namespace") {
        spec.namespace = ns.to_string();
    }
    Ok((spec, secrets))
}

/// The register-only fields of a spec: `context { ... }` and `capacity`.
#[derive(Debug, Default, serde::Deserialize)]
struct RegisterExtras {
    #[serde(default)]
    context: BTreeMap<String, hcl::Value>,
    capacity: Option<hcl::Value>,
}

/// Reads `context` (as a JSON object of strings and numbers) and `capacity` (bytes, or a
/// size such as `"10GiB"`) from a register spec read from `source`; an error names the file
/// and, for a bad field, its line.
pub fn register_extras(source: &str, text: &str) -> Result<(serde_json::Value, u64), Failure> {
    let at = |field: &str, message: String| {
        let place = match volume::spec_line(text, None, field, None) {
            Some(line) => format!("{source}:{line}"),
            None => source.to_string(),
        };
        Failure::new(EXIT_CONFIG, format!("{place}: {message}"))
    };
    let x: RegisterExtras = hcl::from_str(text).map_err(|e| at("context", e.to_string()))?;
    if x.context.is_empty() {
        return Err(Failure::new(
            EXIT_CONFIG,
            format!("{source}: a register spec needs a `context {{ ... }}` block: what the plugin's create would have returned for this storage (e.g. export_path for the bind plugin; see docs/plugin-protocol.md)"),
        ));
    }
    let context =
        serde_json::to_value(&x.context).map_err(|e| at("context", format!("context: {e}")))?;
    let capacity = match &x.capacity {
        None => 0,
        Some(hcl::Value::Number(n)) => n.as_u64().unwrap_or(0),
        Some(hcl::Value::String(s)) => s
            .trim()
            .parse::<u64>()
            .or_else(|_| s.trim().parse::<bytesize::ByteSize>().map(|b| b.as_u64()))
            .map_err(|_| {
                at(
                    "capacity",
                    format!("capacity {s:?} is not a size (e.g. \"10GiB\")"),
                )
            })?,
        Some(other) => {
            return Err(at(
                "capacity",
                format!("capacity {other} is not a size (e.g. \"10GiB\")"),
            ))
        }
    };
    Ok((context, capacity))
}

async fn put_new(
    client: &Client,
    var: &crate::nomad::types::Variable,
    key: &str,
) -> Result<(), Failure> {
    match crate::cluster::changes::put_record(client, var, Some(0)).await {
        Ok(_) => Ok(()),
        Err(NomadError::CasConflict { .. }) => Err(Failure::new(
            EXIT_FAILED,
            format!("volume {key} already exists"),
        )),
        Err(e) => Err(e.into()),
    }
}

/// How long `volume create` and `volume delete` wait for the agents, unless `-detach`.
pub const DEFAULT_WAIT: &str = "2m";

async fn create(
    client: &Client,
    ns: &str,
    spec: &Path,
    wait: Option<Duration>,
    local: &LocalPlugins,
    key: Option<SigningKey>,
) -> Result<(), Failure> {
    let text = read_spec_text(spec)?;
    let (spec, secrets) = parse(&spec_source(spec), &text, ns, false)?;
    if !client.namespace_exists(&spec.namespace).await? {
        return Err(Failure::new(
            EXIT_FAILED,
            format!(
                "namespace {:?} does not exist in Nomad, which creates none on demand (jobs and host volumes in it would be refused): create it first (`nomad namespace apply {}`) or name another in the spec",
                spec.namespace, spec.namespace
            ),
        ));
    }
    let existing = match client
        .variable(&spec.namespace, &volume::record_path(&spec.name))
        .await?
    {
        Some(_) => Some(read_record(client, &spec.namespace, &spec.name).await?),
        None => None,
    };
    let rerun = match existing {
        Some(cur) if cur.state == VolumeState::Failed => Some(cur),
        Some(cur) if matches!(cur.state, VolumeState::Pending | VolumeState::Creating) => {
            if !matches!(
                crate::cluster::expansion::plan_update(&cur, &spec),
                Ok(crate::cluster::expansion::Update::Unchanged)
            ) {
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!(
                        "volume {} is still being created with another spec: wait for it, or delete it (`dhv-binder volume delete {}`) and create it again",
                        cur.key(),
                        cur.spec.name
                    ),
                ));
            }
            outln!(
                "==> Volume {} is already being created ({})",
                cur.key(),
                cur.state.as_str()
            );
            return match wait {
                None => Ok(()),
                Some(w) => wait_created(client, &cur, w).await,
            };
        }
        Some(_) => {
            return storage::create_existing(client, &spec, wait.is_none(), local, key.as_ref())
                .await
        }
        None => None,
    };
    storage::check_source(client, &spec, local).await?;
    let (records, bad) = nodes::list(client).await?;
    for e in bad {
        eprintln!("warning: {e}");
    }
    if let Some(why) = no_eligible_node(
        &records,
        &spec.plugin_id,
        &spec.node_pool,
        super::output::now_unix(),
    ) {
        return Err(Failure::new(EXIT_FAILED, why));
    }
    let mut rec = VolumeRecord::new(spec, secrets);
    if let Some(old) = &rerun {
        // A failed create made no storage (the plugin said so): the same volume (its ID
        // kept, as Nomad keeps a volume's ID) is created again, with the spec as given now.
        if key.is_none() && !old.signature.is_empty() {
            return Err(Failure::new(
                EXIT_CONFIG,
                format!("volume {} is signed: give the operator's key (--signing-key or DHV_BINDER_SIGNING_KEY) to create it again", old.key()),
            ));
        }
        rec.id = old.id.clone();
        rec.modify_index = old.modify_index;
        outln!(
            "==> Volume {} failed to be created before ({}); running its create again",
            old.key(),
            escape_control(&old.error)
        );
    }
    // A clone is made where its source is mounted, so the plugin can quiesce it (or where
    // its storage is reachable when it is mounted nowhere), by a node of the clone's pool.
    if let Some(on) = storage::source_node(client, &rec.spec).await? {
        let now = super::output::now_unix();
        let serves = |id: &str| {
            records.iter().any(|r| {
                r.node_id == id && r.can_serve(&rec.spec.plugin_id, &rec.spec.node_pool, now)
            })
        };
        if on.node_id.is_empty() || serves(&on.node_id) {
            outln!("==> The clone is made on {}", on.describe());
            rec.worker_node = on.node_id;
        }
    }
    if let Some(k) = &key {
        k.sign(&mut rec);
    }
    rec.check_size()
        .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
    if rerun.is_some() {
        match crate::cluster::changes::put_record(
            client,
            &rec.to_variable(),
            Some(rec.modify_index),
        )
        .await
        {
            Ok(_) => {}
            Err(NomadError::CasConflict { .. }) => {
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!("volume {} changed meanwhile; try again", rec.key()),
                ))
            }
            Err(e) => return Err(e.into()),
        }
    } else {
        put_new(client, &rec.to_variable(), &rec.key().to_string()).await?;
    }
    outln!(
        "==> Created volume record {} (ID {}), plugin {:?}",
        rec.key(),
        rec.id,
        rec.spec.plugin_id
    );
    if let Some(note) = access_mode_note(&rec.spec) {
        outln!("    {note}");
    }
    match wait {
        None => Ok(()),
        Some(w) => {
            outln!(
                "    Waiting for a node with plugin {:?} to run its create…",
                rec.spec.plugin_id
            );
            wait_created(client, &rec, w).await
        }
    }
}

/// What a job must request for a volume whose first capability is a multi-node mode:
/// Nomad's host volumes know single-node modes only, so each node's placeholder offers the
/// single-node counterpart, and a job asking for the multi-node mode is never placed.
/// `None` for single-node modes.
pub fn access_mode_note(spec: &volume::VolumeSpec) -> Option<String> {
    let mode = spec.capabilities.first()?.access_mode.as_str();
    let single = match mode {
        "multi-node-multi-writer" => "single-node-multi-writer",
        "multi-node-reader-only" => "single-node-reader-only",
        _ => return None,
    };
    Some(format!(
        "Note: jobs request this {mode} volume with access_mode = \"{single}\" (Nomad's host volumes know single-node modes only: each node's placeholder offers {single}; a job asking for {mode} is never placed). Every node may publish it at once."
    ))
}

/// `id` as `name (id)` from the node records; the ID alone when no record names it.
fn node_name(records: &[NodeRecord], id: &str) -> String {
    records
        .iter()
        .find(|r| r.node_id == id)
        .map(|r| format!("{} ({})", r.node_name, short_id(id, false)))
        .unwrap_or_else(|| id.to_string())
}

/// Why no agent acted on `rec` in time: the refusals nodes published for its record, its
/// missing signature, or no node able to serve it. `None` when nothing explains it.
pub fn why_waiting(rec: &VolumeRecord, records: &[NodeRecord], now: u64) -> Option<String> {
    let path = volume::record_path(&rec.spec.name);
    // Nodes that give the same reason are named together.
    let mut by_reason: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for n in records {
        if let Some(why) = n.refusal(&rec.spec.namespace, &path) {
            by_reason.entry(why).or_default().push(&n.node_name);
        }
    }
    let refusals: Vec<String> = by_reason
        .iter()
        .map(|(why, names)| {
            let verb = if names.len() == 1 {
                "refuses"
            } else {
                "refuse"
            };
            format!("{} {verb} it: {why}", names.join(", "))
        })
        .collect();
    if !refusals.is_empty() {
        return Some(format!(
            "{}; fix that and run the command again",
            refusals.join("; ")
        ));
    }
    if rec.state == VolumeState::Pending || rec.state == VolumeState::Deleting {
        if let Some(why) = no_eligible_node(records, &rec.spec.plugin_id, &rec.spec.node_pool, now)
        {
            return Some(why);
        }
    }
    None
}

/// Waits until a recorded create is done: `Ok` once ready; the plugin's error with the
/// node that ran it once failed; after `wait`, exit 75 with why no agent acted.
async fn wait_created(client: &Client, rec: &VolumeRecord, wait: Duration) -> Result<(), Failure> {
    let mut told = String::new();
    let deadline = Instant::now() + wait;
    let mut records = nodes::list(client).await?.0;
    loop {
        let cur = read_record(client, &rec.spec.namespace, &rec.spec.name).await?;
        if !cur.worker_node.is_empty() && cur.worker_node != told {
            if !records.iter().any(|r| r.node_id == cur.worker_node) {
                records = nodes::list(client).await?.0;
            }
            outln!(
                "    Node {} took the create",
                node_name(&records, &cur.worker_node)
            );
            told = cur.worker_node.clone();
        }
        match cur.state {
            VolumeState::Ready => {
                outln!(
                    "==> Volume {} is ready ({})",
                    cur.key(),
                    bytes(cur.capacity_bytes)
                );
                return Ok(());
            }
            VolumeState::Failed => {
                let on = if cur.worker_node.is_empty() {
                    String::new()
                } else {
                    format!(" on node {}", node_name(&records, &cur.worker_node))
                };
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!(
                        "volume {} failed to be created{on}: {}\nFix the cause and run the same `dhv-binder volume create` again to retry (or `dhv-binder volume delete {}`)",
                        cur.key(),
                        escape_control(&cur.error),
                        cur.spec.name
                    ),
                ));
            }
            _ if Instant::now() > deadline => {
                let records = nodes::list(client).await?.0;
                let why = why_waiting(&cur, &records, super::output::now_unix())
                    .unwrap_or_else(|| {
                        format!(
                            "no agent has reported why: see `dhv-binder plugin status {}` and the agents' logs",
                            cur.spec.plugin_id
                        )
                    });
                return Err(Failure::new(
                    EXIT_TIMEOUT,
                    format!(
                        "volume {} is still {} after {}: {why} (the record stays; `-detach` returns at once)",
                        cur.key(),
                        cur.state.as_str(),
                        humantime::format_duration(wait)
                    ),
                ));
            }
            _ => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}

async fn register(
    client: &Client,
    ns: &str,
    spec: PathBuf,
    key: Option<SigningKey>,
) -> Result<(), Failure> {
    let text = read_spec_text(&spec)?;
    let source = spec_source(&spec);
    let (spec, secrets) = parse(&source, &text, ns, true)?;
    let (context, capacity) = register_extras(&source, &text)?;
    let mut rec = VolumeRecord::new(spec, secrets);
    rec.state = VolumeState::Ready;
    rec.context = context;
    rec.capacity_bytes = capacity;
    // The signature covers the spec, the secrets, the registered mark and this context: the
    // operator's storage path is the one nodes use (docs/security.md).
    rec.registered = true;
    if let Some(k) = &key {
        k.sign(&mut rec);
    }
    rec.check_size()
        .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
    let var = rec.to_variable();
    put_new(client, &var, &rec.key().to_string()).await?;
    outln!(
        "==> Registered volume {} (ID {}), plugin {:?}: ready, no plugin create was run",
        rec.key(),
        rec.id,
        rec.spec.plugin_id
    );
    match nodes::list(client).await {
        Ok((records, _)) => {
            if let Some(why) = no_eligible_node(
                &records,
                &rec.spec.plugin_id,
                &rec.spec.node_pool,
                super::output::now_unix(),
            ) {
                eprintln!("warning: jobs using it cannot start yet: {why}");
            }
        }
        Err(e) => eprintln!("warning: cannot read node records: {e}"),
    }
    Ok(())
}

async fn list(client: &Client, ns: &str, out: OutputArgs) -> Result<(), Failure> {
    let metas = client
        .list_variables(volume::RECORD_PREFIX, ns, 0, Duration::ZERO)
        .await?
        .value;
    let mut vols = Vec::new();
    for m in metas {
        if let Some(var) = client.variable(&m.namespace, &m.path).await? {
            match VolumeRecord::from_variable(&var) {
                Ok(r) => vols.push(summary(
                    &r,
                    var.items.get(REGISTERED_ITEM).is_some_and(|v| v == "true"),
                )),
                Err(e) => eprintln!("warning: {}", escape_control(&e.to_string())),
            }
        }
    }
    vols.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let verbose = out.verbose;
    out.print(&vols, |v| render_list(v, verbose))
}

async fn status(client: &Client, ns: &str, name: String, out: OutputArgs) -> Result<(), Failure> {
    let (r, registered) = read_var(client, ns, &name).await?;
    // An ID prefix names the volume too: from here on, its name.
    let name = r.spec.name.clone();
    let (records, bad) = nodes::list(client).await?;
    for e in bad {
        eprintln!("warning: {}", escape_control(&e.to_string()));
    }
    let placeholders: Vec<(String, String)> = client
        .list_host_volumes(None, &r.spec.namespace)
        .await?
        .into_iter()
        .filter(|hv| hv.name == r.spec.name)
        .map(|hv| (hv.node_id, hv.id))
        .collect();
    let allocations = users_of(client, ns, &name).await?;
    let waiting = match r.state {
        VolumeState::Pending | VolumeState::Deleting | VolumeState::Creating => {
            why_waiting(&r, &records, super::output::now_unix()).unwrap_or_default()
        }
        _ => String::new(),
    };
    let nodes = node_details(&r, &records, &placeholders, &allocations);
    let d = VolumeDetail {
        summary: summary(&r, registered),
        requested_capabilities: r
            .spec
            .capabilities
            .iter()
            .map(CapabilityOut::from)
            .collect(),
        parameters: r.spec.parameters.clone(),
        context: r.context.clone(),
        secrets: r.secrets.len(),
        signed: !r.signature.is_empty(),
        worker_node: if r.worker_node.is_empty() {
            String::new()
        } else {
            node_name(&records, &r.worker_node)
        },
        error: r.error.clone(),
        source: storage::describe_source(&r.spec.source),
        operation: r
            .expansion
            .as_ref()
            .map(|x| x.describe())
            .unwrap_or_default(),
        allocations,
        snapshots: storage::snapshots(client, &r.spec.namespace, Some(&r.spec.name))
            .await?
            .iter()
            .map(SnapshotSummary::of)
            .collect(),
        waiting,
        history: history(&r, &records),
        nodes,
    };
    let verbose = out.verbose;
    out.print(&d, |d| render_detail(d, verbose))
}

async fn delete(
    client: &Client,
    ns: &str,
    name: String,
    wait: Option<Duration>,
    key: Option<SigningKey>,
) -> Result<(), Failure> {
    let (mut r, registered) = read_var(client, ns, &name).await?;
    // An ID prefix names the volume too: from here on, its name.
    let name = r.spec.name.clone();
    if registered {
        return Err(Failure::new(
            EXIT_FAILED,
            format!(
                "volume {} was registered: dhv-binder did not create its storage and will not delete it; use `dhv-binder volume deregister {name}`",
                r.key()
            ),
        ));
    }
    refuse_in_use(client, &r).await?;
    if matches!(r.state, VolumeState::Failed | VolumeState::Pending) {
        crate::cluster::changes::delete_record(
            client,
            &r.spec.namespace,
            &volume::record_path(&name),
            Some(r.modify_index),
        )
        .await?;
        outln!(
            "==> Deleted volume record {} (no storage had been created)",
            r.key()
        );
        return Ok(());
    }
    r.state = VolumeState::Deleting;
    r.worker_node.clear();
    if let Some(k) = &key {
        k.sign_delete(&mut r);
    }
    crate::cluster::changes::put_record(client, &r.to_variable(), Some(r.modify_index)).await?;
    outln!("==> Delete of {} requested", r.key());
    let Some(wait) = wait else {
        return Ok(());
    };
    let deadline = Instant::now() + wait;
    loop {
        match client
            .variable(&r.spec.namespace, &volume::record_path(&name))
            .await?
        {
            None => {
                outln!("==> Volume {} deleted", r.key());
                return Ok(());
            }
            Some(var) if Instant::now() > deadline => {
                let cur = VolumeRecord::from_variable(&var)
                    .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
                let records = nodes::list(client).await?.0;
                let why = if cur.error.is_empty() {
                    why_waiting(&cur, &records, super::output::now_unix())
                } else {
                    Some(format!("the last attempt failed: {}", escape_control(&cur.error)))
                }
                .unwrap_or_else(|| {
                    format!(
                        "no agent has reported why: see `dhv-binder plugin status {}` and the agents' logs",
                        cur.spec.plugin_id
                    )
                });
                return Err(Failure::new(
                    EXIT_TIMEOUT,
                    format!(
                        "the delete of volume {} is still pending after {}: {why} (the request stays; `dhv-binder volume status {name}` shows it)",
                        cur.key(),
                        humantime::format_duration(wait)
                    ),
                ));
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(300)).await,
        }
    }
}

async fn deregister(client: &Client, ns: &str, name: String) -> Result<(), Failure> {
    let (r, registered) = read_var(client, ns, &name).await?;
    // An ID prefix names the volume too: from here on, its name.
    let name = r.spec.name.clone();
    if matches!(r.state, VolumeState::Creating | VolumeState::Deleting) {
        return Err(Failure::new(
            EXIT_FAILED,
            format!(
                "volume {} is {}: a node is running the plugin on it; wait until it is done",
                r.key(),
                r.state.as_str()
            ),
        ));
    }
    refuse_in_use(client, &r).await?;
    match crate::cluster::changes::delete_record(
        client,
        &r.spec.namespace,
        &volume::record_path(&name),
        Some(r.modify_index),
    )
    .await
    {
        Ok(()) => {}
        Err(NomadError::CasConflict { .. }) => {
            return Err(Failure::new(
                EXIT_FAILED,
                format!("volume {} changed meanwhile; try again", r.key()),
            ))
        }
        Err(e) => return Err(e.into()),
    }
    outln!(
        "==> Deregistered volume {}{}; the storage was left as it is",
        r.key(),
        if registered {
            ""
        } else {
            " (it had been created by the plugin)"
        }
    );
    Ok(())
}

/// Runs a `volume` subcommand.
pub async fn volume_cmd(nomad: &NomadConfig, cmd: VolumeCommand) -> Result<(), Failure> {
    let client = Client::new(nomad)?;
    let ns = nomad.namespace.as_str();
    match cmd {
        VolumeCommand::Keygen { out } => keygen(&out),
        VolumeCommand::Create {
            spec,
            wait,
            local,
            key,
        } => create(&client, ns, &spec, wait.wait(), &local, key.load()?).await,
        VolumeCommand::Snapshot(cmd) => storage::snapshot_cmd(&client, ns, cmd).await,
        VolumeCommand::Claim(cmd) => super::claim::claim_cmd(&client, ns, cmd).await,
        VolumeCommand::Register { spec, key } => register(&client, ns, spec, key.load()?).await,
        VolumeCommand::List { out } => list(&client, ns, out).await,
        VolumeCommand::Status { name, out } => status(&client, ns, name, out).await,
        VolumeCommand::Delete { name, wait, key } => {
            delete(&client, ns, name, wait.wait(), key.load()?).await
        }
        VolumeCommand::Deregister { name } => deregister(&client, ns, name).await,
        VolumeCommand::Update(args) => super::update::update(&client, ns, args).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol() -> VolumeSummary {
        VolumeSummary {
            id: "0b9c6a6e-1111-4222-8333-444455556666".into(),
            namespace: "default".into(),
            name: "shared-data".into(),
            plugin_id: "bind".into(),
            state: "ready".into(),
            capacity_bytes: 1 << 30,
            node_pool: String::new(),
            access_mode: "single-node-writer".into(),
            registered: false,
            create_index: 11,
            modify_index: 12,
            availability: "active".into(),
        }
    }

    #[test]
    fn volume_list_is_a_table_with_human_capacity() {
        let s = render_list(&[vol()], true);
        assert_eq!(
            s,
            "ID                                    Namespace  Name         Plugin ID  Capacity  State\n\
             0b9c6a6e-1111-4222-8333-444455556666  default    shared-data  bind       1.0 GiB   ready\n"
        );
        // Short IDs (8 characters) unless -verbose, as Nomad prints them.
        assert_eq!(
            render_list(&[vol()], false),
            "ID        Namespace  Name         Plugin ID  Capacity  State\n\
             0b9c6a6e  default    shared-data  bind       1.0 GiB   ready\n"
        );
        assert_eq!(render_list(&[], false), "No volumes\n");
    }

    /// Issue 37 #6: `-json` uses Nomad's field names (those of `HostVolumeStub`,
    /// `api/host_volumes.go`), and `-t` reads the same JSON.
    #[test]
    fn volume_list_json_has_nomads_keys_and_templates_read_them() {
        let j = serde_json::to_value([vol()]).unwrap();
        let keys: Vec<&str> = j[0]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        assert_eq!(
            keys,
            [
                "ID",
                "Namespace",
                "Name",
                "PluginID",
                "State",
                "CapacityBytes",
                "NodePool",
                "AccessMode",
                "Registered",
                "CreateIndex",
                "ModifyIndex",
                "Availability"
            ]
        );
        assert_eq!(j[0]["CapacityBytes"], 1u64 << 30);
        assert_eq!(j[0]["PluginID"], "bind");
        let mut other = vol();
        other.name = "scratch".into();
        other.plugin_id = "nfs".into();
        other.capacity_bytes = 0;
        other.registered = true;
        let out = OutputArgs {
            template: Some(
                "{{range .}}{{printf \"%.8s\" .ID}} {{.Name | printf \"%-12s\"}}{{.PluginID}}{{if .Registered}} registered{{else}} {{.CapacityBytes}}{{end}}\\n{{end}}"
                    .into(),
            ),
            ..Default::default()
        };
        assert_eq!(
            out.render(&vec![vol(), other], |_| unreachable!()).unwrap(),
            "0b9c6a6e shared-data bind 1073741824\n0b9c6a6e scratch     nfs registered\n"
        );
    }

    #[test]
    fn volume_status_is_a_kv_block_and_an_allocation_table() {
        let d = VolumeDetail {
            summary: VolumeSummary {
                registered: true,
                ..vol()
            },
            requested_capabilities: vec![CapabilityOut {
                access_mode: "single-node-writer".into(),
                attachment_mode: "file-system".into(),
            }],
            parameters: [("export".to_string(), "/srv".to_string())].into(),
            context: serde_json::json!({"export_path": "/srv/x"}),
            secrets: 2,
            signed: true,
            worker_node: String::new(),
            // Plugin and record text is terminal-escaped (issue 13 §5).
            error: "bad\u{1b}[2J\nfake".into(),
            source: String::new(),
            operation: String::new(),
            allocations: vec![VolumeUser {
                alloc_id: "a1".into(),
                alloc_name: "example.app[0]".into(),
                node_id: "n1".into(),
            }],
            snapshots: Vec::new(),
            waiting: String::new(),
            nodes: Vec::new(),
            history: Vec::new(),
        };
        let s = render_detail(&d, false);
        assert_eq!(
            s,
            "\
ID         = 0b9c6a6e-1111-4222-8333-444455556666
Name       = shared-data
Namespace  = default
Plugin ID  = bind
State      = ready (registered)
Capacity   = 1.0 GiB
Node Pool  = (any)
Capability = single-node-writer / file-system
Parameters = {\"export\":\"/srv\"}
Signed     = yes
Secrets    = 2 keys, not shown
Error      = bad\\u{1b}[2J\\u{a}fake

Allocations
ID  Name            Node ID
a1  example.app[0]  n1
"
        );
        let j = serde_json::to_value(&d).unwrap();
        assert_eq!(j["ID"], "0b9c6a6e-1111-4222-8333-444455556666");
        assert_eq!(j["Registered"], true);
        assert_eq!(j["Secrets"], 2);
        assert_eq!(j["Signed"], true);
        assert_eq!(j["PluginID"], "bind");
        assert_eq!(
            j["RequestedCapabilities"][0],
            serde_json::json!({"AttachmentMode": "file-system", "AccessMode": "single-node-writer"})
        );
        assert_eq!(
            j["Allocations"][0],
            serde_json::json!({"ID": "a1", "Name": "example.app[0]", "NodeID": "n1"})
        );
        assert_eq!(j["History"], serde_json::json!([]));
    }

    /// Issue 37 #10: `-verbose` adds the recent events of every node, newest first, from
    /// the node records; `-json` has them with RFC 3339 times.
    #[test]
    fn verbose_status_shows_the_recent_events_of_every_node_newest_first() {
        let rec = VolumeRecord::new(
            volume::parse_spec("name = \"shared-data\"\nplugin_id = \"bind\"\n")
                .unwrap()
                .0,
            BTreeMap::new(),
        );
        let ev = |time: u64, event: &str, alloc: &str, ok: bool, ms: u64| nodes::NodeEvent {
            time,
            event: event.into(),
            alloc_id: alloc.into(),
            ok,
            ms,
        };
        let mut n1 = node("node-1", "default", None, 0);
        n1.history.insert(
            "default/shared-data".into(),
            vec![
                ev(1_733_350_000, "publish", "a1111111-0000", true, 132),
                ev(1_733_350_060, "unpublish", "", true, 0),
            ],
        );
        let mut n2 = node("node-2", "default", None, 0);
        n2.history.insert(
            "default/shared-data".into(),
            vec![ev(1_733_350_030, "publish", "b2222222-0000", false, 2_400)],
        );
        n2.history.insert(
            "default/other".into(),
            vec![ev(1_733_350_099, "fence", "", true, 0)],
        );
        let h = history(&rec, &[n1, n2]);
        assert_eq!(
            render_history(&h, false),
            "\
Time                  Node    Event      Allocation  Outcome
2024-12-04T22:07:40Z  node-1  unpublish  -           ok
2024-12-04T22:07:10Z  node-2  publish    b2222222    failed after 2.4s
2024-12-04T22:06:40Z  node-1  publish    a1111111    ok in 132ms
"
        );
        let j = serde_json::to_value(&h).unwrap();
        assert_eq!(
            j[2],
            serde_json::json!({"Time": "2024-12-04T22:06:40Z", "NodeID": "id-node-1", "NodeName": "node-1", "Event": "publish", "AllocID": "a1111111-0000", "Outcome": "ok", "DurationMs": 132})
        );
        assert_eq!(render_history(&[], false), "No recent events on any node\n");
    }

    /// The per-node rows in `-json`: Nomad-style IDs, `Since` as RFC 3339 (null unknown).
    #[test]
    fn node_rows_in_json_have_nomads_keys_and_rfc3339_times() {
        let n = NodeDetail {
            node_id: "n1".into(),
            node_name: "node-1".into(),
            state: "published".into(),
            since: 1_733_350_000,
            host_volume_id: "hv1".into(),
            allocations: vec!["a1".into()],
            ..Default::default()
        };
        let j = serde_json::to_value([n.clone(), NodeDetail::default()]).unwrap();
        assert_eq!(
            j[0],
            serde_json::json!({"NodeID": "n1", "NodeName": "node-1", "State": "published", "Since": "2024-12-04T22:06:40Z", "HostVolumeID": "hv1", "Allocations": ["a1"], "Error": "", "Refused": "", "Claim": "", "Waiting": ""})
        );
        assert_eq!(j[1]["Since"], serde_json::Value::Null);
    }

    /// Issue 37 #10: per node, the claim it holds and, for a node where a publish waits,
    /// what it waits for (the holder's job, allocation and node), from the node records.
    #[test]
    fn the_nodes_table_shows_the_claim_and_what_a_node_waits_for() {
        let rec = VolumeRecord::new(
            volume::parse_spec("name = \"shared-data\"\nplugin_id = \"bind\"")
                .unwrap()
                .0,
            BTreeMap::new(),
        );
        let mut n1 = NodeRecord::new("id-1", "node-1", "default");
        let mut n2 = NodeRecord::new("id-2", "node-2", "default");
        n1.set_volumes(BTreeMap::from([(
            "default/shared-data".to_string(),
            nodes::NodeVolume {
                state: "published".into(),
                since: 1,
                users: vec!["d5e2d42f-0000-4000-8000-000000000000".into()],
                claim: "held".into(),
                ..Default::default()
            },
        )]));
        let reason = "publish waits for the single-node claim on default/shared-data: held by job shared-data-demo, allocation d5e2d42f on node node-1, which still runs with it";
        n2.set_volumes(BTreeMap::from([(
            "default/shared-data".to_string(),
            nodes::NodeVolume {
                waiting: reason.into(),
                ..Default::default()
            },
        )]));
        let nodes = node_details(&rec, &[n1, n2], &[], &[]);
        assert_eq!(nodes[0].claim, "held");
        assert!(nodes[1].waiting.starts_with("publish waits"), "{nodes:?}");
        let d = VolumeDetail {
            summary: vol(),
            requested_capabilities: Vec::new(),
            parameters: BTreeMap::new(),
            context: serde_json::Value::Null,
            secrets: 0,
            signed: true,
            worker_node: String::new(),
            error: String::new(),
            source: String::new(),
            operation: String::new(),
            allocations: Vec::new(),
            snapshots: Vec::new(),
            waiting: String::new(),
            nodes,
            history: Vec::new(),
        };
        let s = render_detail(&d, false);
        let row = |name: &str| {
            s.lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no {name} row:\n{s}"))
                .to_string()
        };
        assert!(row("node-1").contains("published (claim held)"), "{s}");
        assert!(row("node-2").contains(&format!("waiting: {reason}")), "{s}");
    }

    fn node(name: &str, pool: &str, plugin: Option<(&str, bool)>, seen: u64) -> NodeRecord {
        let mut r = NodeRecord::new(&format!("id-{name}"), name, pool);
        if let Some((id, deferred)) = plugin {
            r.plugins.insert(
                id.into(),
                nodes::PluginInfo {
                    version: "1".into(),
                    deferred_bind: deferred,
                    healthy: true,
                    error: String::new(),
                    capabilities: None,
                },
            );
        }
        r.last_seen = seen;
        r
    }

    #[test]
    fn create_fails_fast_naming_what_each_node_lacks() {
        let now = 10_000;
        let recs = vec![
            node("node-1", "default", Some(("bind", true)), now),
            node("node-2", "gpu", Some(("nfs", true)), now),
            node("node-3", "default", Some(("nfs", false)), now),
            node("node-4", "default", Some(("nfs", true)), now - 1000),
        ];
        assert_eq!(no_eligible_node(&recs, "bind", "", now), None);
        assert_eq!(no_eligible_node(&recs, "nfs", "gpu", now), None);
        let why = no_eligible_node(&recs, "nfs", "default", now).unwrap();
        assert!(why.contains("node-1 (no such plugin)"), "{why}");
        assert!(why.contains("node-2 (pool gpu)"), "{why}");
        assert!(
            why.contains("node-3 (plugin is not deferred_bind)"),
            "{why}"
        );
        assert!(why.contains("node-4 (stale)"), "{why}");
        assert!(why.contains("in node pool \"default\""), "{why}");
        let why = no_eligible_node(&[], "nfs", "", now).unwrap();
        assert!(why.contains("no dhv-binder agent has published"), "{why}");
    }

    /// Issue 37 #12: a multi-node volume says at create which mode jobs request.
    #[test]
    fn a_multi_node_volume_says_which_mode_jobs_request() {
        let spec = |mode: &str| {
            volume::parse_spec(&format!(
                "name = \"v\"\nplugin_id = \"bind\"\ncapability {{\n  access_mode = \"{mode}\"\n}}\n"
            ))
            .unwrap()
            .0
        };
        let note = access_mode_note(&spec("multi-node-multi-writer")).unwrap();
        assert!(
            note.contains("access_mode = \"single-node-multi-writer\""),
            "{note}"
        );
        assert!(access_mode_note(&spec("multi-node-reader-only"))
            .unwrap()
            .contains("\"single-node-reader-only\""));
        assert_eq!(access_mode_note(&spec("single-node-writer")), None);
    }

    #[test]
    fn a_register_spec_needs_a_context_and_reads_its_capacity() {
        let (ctx, cap) = register_extras(
            "r.hcl",
            "name = \"x\"\nplugin_id = \"bind\"\ncapacity = \"2GiB\"\ncontext {\n  export_path = \"/srv/x\"\n}\n",
        )
        .unwrap();
        assert_eq!(ctx, serde_json::json!({"export_path": "/srv/x"}));
        assert_eq!(cap, 2 << 30);
        let e = register_extras("r.hcl", "name = \"x\"\nplugin_id = \"bind\"\n").unwrap_err();
        assert!(e.message.contains("context"), "{}", e.message);
        // Issue 37 #15: a bad field names the file and its line.
        let e = register_extras(
            "r.hcl",
            "name = \"x\"\nplugin_id = \"bind\"\ncontext {\n  export_path = \"/srv/x\"\n}\ncapacity = \"lots\"\n",
        )
        .unwrap_err();
        assert!(
            e.message.starts_with("r.hcl:6: capacity \"lots\""),
            "{}",
            e.message
        );
    }
}
