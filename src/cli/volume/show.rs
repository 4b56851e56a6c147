//! `volume list` and `volume status`: what they read (the record, the node records, the
//! placeholders, the allocations) and their readable and JSON forms.

use super::super::output::{
    ago, bytes, kv, millis, plugin_text, plural, short_id, table, OutputArgs,
};
use super::super::records::{read_var, VolumeUser, REGISTERED_ITEM};
use super::super::storage::{self, SnapshotSummary};
use super::super::Failure;
use super::eligibility::{node_name, why_waiting};
use crate::cluster::claims::claim_path;
use crate::cluster::nodes::{self, NodeRecord};
use crate::escape::escape_control;
use crate::nomad::Client;
use crate::volume::{self, VolumeRecord, VolumeState};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

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
    /// Why no node offers the volume: a publish failed with the class "final" (where,
    /// when, the plugin's words); empty when none did.
    pub final_failure: String,
    /// Why a `pending` or `deleting` volume waits (the refusals the agents published, no
    /// node able to serve it), or empty.
    pub waiting: String,
    /// Who holds the single-node claim, from the claim variable: `name (short ID)`, and the
    /// job and allocation there using the volume; empty when no node holds it.
    pub claim_holder: String,
    /// The volume on each node that has it (mounted, a placeholder, an error, a refusal),
    /// from the node records and placeholders.
    pub nodes: Vec<NodeDetail>,
    /// Each node with an agent (or a placeholder): whether it offers the volume to Nomad's
    /// scheduler, and why not ([`super::offering`]).
    pub offered_by: Vec<super::offering::NodeOffer>,
    /// The recent publish, unpublish and fence events of the volume on every node, newest
    /// first (each node publishes its last [`nodes::MAX_NODE_HISTORY`] per volume), then
    /// those of the record itself ([`record_events`]: create or register, snapshots,
    /// expansion, claim); `volume status -verbose` prints them.
    pub history: Vec<HistoryEvent>,
}

/// One volume on one node, for `volume status`.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct NodeDetail {
    #[serde(rename = "NodeID")]
    pub node_id: String,
    pub node_name: String,
    /// The mount's state on the node (`published`, `publishing`, `unpublishing`), else
    /// `waiting` when a publish waits there (see `waiting`), else `not mounted`.
    pub state: String,
    /// When the state began (the node's clock): Unix seconds here, an RFC 3339 string in
    /// `-json`, `null` when unknown.
    #[serde(serialize_with = "super::super::output::ser_rfc3339")]
    pub since: u64,
    /// Where the volume is (or will be) mounted on the node: its placeholder's `HostPath`,
    /// or empty when the node has no placeholder.
    pub target: String,
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
    /// Jobs on the node that mount the volume without the prestart task (the node record's
    /// `ungated`: job, task, allocation, and whether it ended before the publish); left out
    /// of `-json` when empty.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ungated: Vec<String>,
    /// The mount's condition on the node: `healthy`, `inaccessible`, `degraded`,
    /// `data-loss`, or empty before its first reading.
    pub condition: String,
    /// Percent of the mount's filesystem in use (`statfs`), `null` when not read.
    pub used_percent: Option<u8>,
    /// When the volume's last user on the node went away: Unix seconds here, an RFC 3339
    /// string in `-json`, `null` while in use there or never used there.
    #[serde(serialize_with = "super::super::output::ser_rfc3339")]
    pub unused_since: u64,
}

/// One event of a volume on one node, from the node's journal (via its node record).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct HistoryEvent {
    /// When (the node's clock): Unix seconds here, an RFC 3339 string in `-json`.
    #[serde(serialize_with = "super::super::output::ser_rfc3339")]
    pub time: u64,
    #[serde(rename = "NodeID")]
    pub node_id: String,
    pub node_name: String,
    /// `publish`, `unpublish`, `fence` or `unfence` (from a node's journal); `create`,
    /// `register`, `snapshot`, `expand` or `claim` (from the records).
    pub event: String,
    /// The allocation the publish was for; empty for the others.
    #[serde(rename = "AllocID")]
    pub alloc_id: String,
    /// `ok` or `failed`.
    pub outcome: String,
    /// How long the plugin call took, measured by the agent, in milliseconds; 0 when not
    /// measured (fence events).
    pub duration_ms: u64,
    /// What a record event is about (`snapshot 3f2a…`, `to 128.0 MiB`), or empty.
    pub detail: String,
}

/// The events the records themselves tell of (no node journal has them): the create or
/// register (where it ran, its state), each snapshot (when it was requested), an expansion
/// (requested, running, failed) and who holds the claim. Only snapshots carry a time (the
/// records keep none for the others: `Time` is unknown, `null` in `-json`).
pub fn record_events(
    rec: &VolumeRecord,
    records: &[NodeRecord],
    snapshots: &[SnapshotSummary],
    claim_node: Option<&str>,
) -> Vec<HistoryEvent> {
    let name_of = |id: &str| {
        records
            .iter()
            .find(|r| r.node_id == id)
            .map(|r| r.node_name.clone())
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    let created = match rec.state {
        VolumeState::Ready => "ok",
        VolumeState::Failed => "failed",
        other => other.as_str(),
    };
    out.push(HistoryEvent {
        node_id: rec.worker_node.clone(),
        node_name: name_of(&rec.worker_node),
        event: if rec.registered { "register" } else { "create" }.into(),
        outcome: created.into(),
        detail: if rec.registered {
            "no plugin create".into()
        } else if rec.capacity_bytes > 0 {
            bytes(rec.capacity_bytes)
        } else {
            String::new()
        },
        ..Default::default()
    });
    for s in snapshots {
        out.push(HistoryEvent {
            time: s.created_at,
            event: "snapshot".into(),
            outcome: match s.state.as_str() {
                "ready" => "ok".into(),
                other => other.to_string(),
            },
            detail: format!("{} ({})", short_id(&s.id, false), s.name),
            ..Default::default()
        });
    }
    if let Some(x) = &rec.expansion {
        out.push(HistoryEvent {
            node_id: x.node.clone(),
            node_name: name_of(&x.node),
            event: "expand".into(),
            outcome: x.state.as_str().into(),
            detail: format!("to {}", bytes(x.bytes)),
            ..Default::default()
        });
    }
    if !rec.spec.availability.is_active() {
        out.push(HistoryEvent {
            event: "availability".into(),
            outcome: rec.spec.availability.as_str().into(),
            detail: "set by `volume update -availability`".into(),
            ..Default::default()
        });
    }
    if let Some(f) = &rec.final_failure {
        out.push(HistoryEvent {
            time: f.time,
            node_id: f.node_id.clone(),
            node_name: f.node_name.clone(),
            event: "final-failure".into(),
            outcome: "withheld everywhere".into(),
            detail: f.error.clone(),
            ..Default::default()
        });
    }
    if let Some(node) = claim_node {
        out.push(HistoryEvent {
            node_id: node.to_string(),
            node_name: name_of(node),
            event: "claim".into(),
            outcome: "held".into(),
            ..Default::default()
        });
    }
    out
}

/// Node and record events in one list: newest first, events without a time last.
pub fn merge_events(mut nodes: Vec<HistoryEvent>, records: Vec<HistoryEvent>) -> Vec<HistoryEvent> {
    nodes.extend(records);
    nodes.sort_by_key(|e| (e.time == 0, std::cmp::Reverse(e.time)));
    nodes
}

/// One placeholder (Nomad host volume) of a deferred volume on a node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placeholder {
    pub node_id: String,
    /// The host volume's ID.
    pub id: String,
    /// The host volume's `HostPath`: where the volume is mounted once published.
    pub host_path: String,
    /// Its `State` is `ready` (Nomad may place allocations that request it there).
    pub ready: bool,
}

/// The placeholders of volume `name` and the allocations Nomad lists on them (with their
/// job and client status). Nomad API: `GET /v1/volumes?type=host`, `GET /v1/volume/host/:id`.
pub async fn placeholders_of(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<(Vec<Placeholder>, Vec<VolumeUser>), Failure> {
    let mut places = Vec::new();
    let mut users = Vec::new();
    for stub in client.list_host_volumes(None, namespace).await? {
        if stub.name != name {
            continue;
        }
        let Some(hv) = client.host_volume(namespace, &stub.id).await? else {
            continue;
        };
        for a in &hv.allocations {
            users.push(VolumeUser {
                alloc_id: a.id.clone(),
                alloc_name: a.name.clone(),
                node_id: hv.node_id.clone(),
                job_id: a.job_id.clone(),
                client_status: a.client_status.clone(),
                host_path: hv.host_path.clone(),
            });
        }
        places.push(Placeholder {
            ready: hv.state == "ready",
            node_id: hv.node_id,
            id: hv.id,
            host_path: hv.host_path,
        });
    }
    Ok((places, users))
}

/// The per-node rows of `volume status`: each node with a mount, an error, a refusal or a
/// placeholder of the volume.
pub fn node_details(
    rec: &VolumeRecord,
    records: &[NodeRecord],
    placeholders: &[Placeholder],
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
                state: if !v.state.is_empty() {
                    v.state
                } else if !v.waiting.is_empty() {
                    "waiting".into()
                } else {
                    "not mounted".into()
                },
                since: v.since,
                allocations: v.users,
                error: v.error,
                refused: refused.to_string(),
                claim: v.claim,
                waiting: v.waiting,
                ungated: v.ungated,
                condition: v.condition,
                used_percent: v.used_percent,
                unused_since: v.unused_since.unwrap_or_default(),
                ..Default::default()
            },
        );
    }
    for p in placeholders {
        let d = out.entry(p.node_id.clone()).or_insert_with(|| NodeDetail {
            node_id: p.node_id.clone(),
            node_name: records
                .iter()
                .find(|r| r.node_id == p.node_id)
                .map(|r| r.node_name.clone())
                .unwrap_or_default(),
            state: "not mounted".into(),
            ..Default::default()
        });
        d.host_volume_id = p.id.clone();
        d.target = p.host_path.clone();
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
                    detail: e.detail.clone(),
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

/// The readable `Recent Events` table of `volume status -verbose`.
pub fn render_history(events: &[HistoryEvent], verbose: bool) -> String {
    let rows: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            let name = if e.node_id.is_empty() {
                "-".into()
            } else if e.node_name.is_empty() {
                short_id(&e.node_id, verbose)
            } else {
                e.node_name.clone()
            };
            vec![
                super::super::output::rfc3339(e.time).unwrap_or_else(|| "-".into()),
                name,
                e.event.clone(),
                if !e.alloc_id.is_empty() {
                    format!("allocation {}", short_id(&e.alloc_id, verbose))
                } else if !e.detail.is_empty() {
                    e.detail.clone()
                } else {
                    "-".into()
                },
                match (e.outcome.as_str(), e.duration_ms) {
                    // A change of condition (the agent's usage task): what it became.
                    _ if e.event == "condition" => if e.outcome == "ok" {
                        "healthy"
                    } else {
                        "abnormal"
                    }
                    .to_string(),
                    (o, 0) => o.to_string(),
                    ("ok", ms) => format!("ok in {}", millis(ms)),
                    (o, ms) => format!("{o} after {}", millis(ms)),
                },
            ]
        })
        .collect();
    table(
        &["Time", "Node", "Event", "Detail", "Outcome"],
        &rows,
        "No recent events on any node",
    )
}
/// A pending or failed expansion for `volume status`: the size in human units, the node by
/// name.
pub fn describe_expansion(x: &volume::Expansion, records: &[NodeRecord]) -> String {
    let mut s = format!("expand to {}: {}", bytes(x.bytes), x.state.as_str());
    if !x.node.is_empty() {
        s.push_str(&format!(" (node {})", node_name(records, &x.node)));
    }
    if !x.error.is_empty() {
        s.push_str(&format!(": {}", plugin_text(&x.error)));
    }
    s
}

/// [`super::offering::offers`] with what it needs: the placeholders' states and, for a
/// volume with constraints, each live node's attributes (a node that cannot be read is
/// said so, not skipped).
async fn offered_by(
    client: &Client,
    r: &VolumeRecord,
    records: &[NodeRecord],
    placeholders: &[Placeholder],
) -> Vec<super::offering::NodeOffer> {
    let now = super::super::output::now_unix();
    let ready: BTreeMap<String, bool> = placeholders
        .iter()
        .map(|p| (p.node_id.clone(), p.ready))
        .collect();
    let mut facts = BTreeMap::new();
    if !r.spec.constraints.is_empty() && super::offering::withheld_everywhere(r).is_none() {
        for n in records
            .iter()
            .filter(|n| !ready.get(&n.node_id).copied().unwrap_or(false))
        {
            if let Ok(Some(f)) = client.node_facts(&n.node_id).await {
                facts.insert(n.node_id.clone(), f);
            }
        }
    }
    super::offering::offers(r, records, &ready, &facts, now)
}

/// The readable "Offered By" table of `volume status`.
pub fn render_offers(offers: &[super::offering::NodeOffer], verbose: bool) -> String {
    let rows: Vec<Vec<String>> = offers
        .iter()
        .map(|o| {
            vec![
                if o.node_name.is_empty() {
                    short_id(&o.node_id, verbose)
                } else {
                    o.node_name.clone()
                },
                if o.offered { "yes" } else { "no" }.into(),
                if o.why.is_empty() {
                    "-".into()
                } else {
                    plugin_text(&o.why)
                },
            ]
        })
        .collect();
    table(
        &["Node", "Offers", "Why Not"],
        &rows,
        "No node runs a dhv-binder agent",
    )
}

/// The list row of a record.
pub fn summary(r: &VolumeRecord, registered: bool) -> VolumeSummary {
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
            // What the create asked for and the plugin reported: not a measure of the
            // storage or of its usage.
            "Requested Size",
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
        rows.push(("Error", plugin_text(&d.error)));
    }
    if !d.final_failure.is_empty() {
        rows.push(("Final Failure", plugin_text(&d.final_failure)));
    }
    if !d.waiting.is_empty() {
        rows.push(("Waiting For", d.waiting.clone()));
    }
    let now = super::super::output::now_unix();
    let mounted: Vec<String> = d
        .nodes
        .iter()
        .filter(|n| n.state == "published")
        .map(|n| {
            let mut s = if n.node_name.is_empty() {
                short_id(&n.node_id, verbose)
            } else {
                n.node_name.clone()
            };
            if !n.target.is_empty() {
                s.push_str(&format!(" at {}", n.target));
            }
            if let Some(t) = super::super::output::rfc3339(n.since) {
                s.push_str(&format!(" since {t} ({})", ago(n.since, now)));
            }
            s
        })
        .collect();
    rows.push((
        "Mounted On",
        if mounted.is_empty() {
            "no node".into()
        } else {
            mounted.join("; ")
        },
    ));
    if !d.claim_holder.is_empty() {
        rows.push(("Claim Holder", d.claim_holder.clone()));
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
            let dash = |s: &str| {
                if s.is_empty() {
                    "-".to_string()
                } else {
                    s.to_string()
                }
            };
            vec![
                short_id(&u.alloc_id, verbose),
                u.alloc_name.clone(),
                dash(&u.job_id),
                short_id(&u.node_id, verbose),
                dash(&u.client_status),
            ]
        })
        .collect();
    out.push_str(&table(
        &["ID", "Name", "Job", "Node ID", "Status"],
        &users,
        "No allocations use this volume",
    ));
    if !d.nodes.is_empty() {
        out.push_str("\nNodes\n");
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
                    dash(n.target.clone()),
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
                    } else if !n.waiting.is_empty() {
                        n.waiting.clone()
                    } else if !n.error.is_empty() {
                        format!("last error: {}", plugin_text(&n.error))
                    } else {
                        String::new()
                    }),
                ]
            })
            .collect();
        // Usage and condition columns once an agent reports them (a mount it read);
        // unused-since wherever a node says when the volume's last user there went away,
        // mounted or not, and nothing where it is in use.
        let health = d.nodes.iter().any(|n| !n.condition.is_empty());
        let unused = |n: &NodeDetail| n.allocations.is_empty() && n.unused_since != 0;
        let unused_column = d.nodes.iter().any(unused);
        let mut head = vec![
            "Node",
            "State",
            "Since",
            "Target",
            "Host Volume",
            "Allocations",
            "Why",
        ];
        let mut rows = rows;
        if health {
            head.extend(["Used", "Condition"]);
            for (r, n) in rows.iter_mut().zip(&d.nodes) {
                r.push(n.used_percent.map_or("-".into(), |p| format!("{p}%")));
                r.push(if n.condition.is_empty() {
                    "-".into()
                } else {
                    n.condition.clone()
                });
            }
        }
        if unused_column {
            head.push("Unused Since");
            for (r, n) in rows.iter_mut().zip(&d.nodes) {
                r.push(if unused(n) {
                    ago(n.unused_since, now)
                } else {
                    "-".into()
                });
            }
        }
        out.push_str(&table(&head, &rows, ""));
        let ungated: Vec<Vec<String>> = d
            .nodes
            .iter()
            .flat_map(|n| {
                n.ungated
                    .iter()
                    .map(|u| vec![n.node_name.clone(), u.clone()])
            })
            .collect();
        if !ungated.is_empty() {
            out.push_str("\nUngated Jobs (mount it without the prestart task)\n");
            out.push_str(&table(&["Node", "Job/Task (Allocation)"], &ungated, ""));
        }
    }
    if !d.offered_by.is_empty() {
        out.push_str("\nOffered By\n");
        out.push_str(&render_offers(&d.offered_by, verbose));
    }
    if !d.snapshots.is_empty() {
        out.push_str("\nSnapshots\n");
        out.push_str(&storage::render_snapshots(&d.snapshots, verbose));
    }
    if verbose {
        out.push_str("\nRecent Events\n");
        out.push_str(&render_history(&d.history, verbose));
    }
    out
}
/// `volume list`: every record in the namespace (`*`: all).
pub async fn list(
    client: &Client,
    ns: &str,
    unused: Option<Duration>,
    out: OutputArgs,
) -> Result<(), Failure> {
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
    if let Some(d) = unused {
        let (records, _) = nodes::list(client).await?;
        let now = super::super::output::now_unix();
        let idle = |v: &VolumeSummary| {
            super::super::unused::idle(
                &records,
                &volume::VolumeKey {
                    namespace: v.namespace.clone().into(),
                    name: v.name.clone().into(),
                },
            )
        };
        vols.retain(|v| super::super::unused::idle_for(idle(v), d.as_secs(), now));
        let rows: Vec<_> = vols
            .iter()
            .map(|v| {
                (
                    v.namespace.clone(),
                    v.name.clone(),
                    v.plugin_id.clone(),
                    idle(v),
                )
            })
            .collect();
        return out.print(&vols, |_| super::super::unused::render(&rows, now));
    }
    let verbose = out.verbose;
    out.print(&vols, |v| render_list(v, verbose))
}
/// `volume status`: one volume, by name or ID prefix.
pub async fn status(
    client: &Client,
    ns: &str,
    name: String,
    out: OutputArgs,
) -> Result<(), Failure> {
    let (r, registered) = read_var(client, ns, &name).await?;
    // An ID prefix names the volume too: from here on, its name.
    let name = r.spec.name.clone();
    let (records, bad) = nodes::list(client).await?;
    for e in bad {
        eprintln!("warning: {}", escape_control(&e.to_string()));
    }
    let (placeholders, allocations) = placeholders_of(client, &r.spec.namespace, &name).await?;
    // The claim variable keeps the last holder's node in its items after a release (the
    // hand-over's evidence); only a lock on it means a node holds the claim now.
    let claim = client
        .variable(&r.spec.namespace, &claim_path(&name))
        .await?;
    let locked = claim
        .as_ref()
        .is_some_and(|v| v.lock.as_ref().is_some_and(|l| !l.id.is_empty()));
    let claim_node = claim.and_then(|v| v.items.get("node_id").cloned());
    let claim_holder = claim_node
        .as_deref()
        .filter(|_| locked)
        .map(|n| {
            let mut s = node_name(&records, n);
            let users: Vec<String> = allocations
                .iter()
                .filter(|u| u.node_id == n)
                .map(|u| {
                    format!(
                        "job {}, allocation {} ({})",
                        u.job_id,
                        short_id(&u.alloc_id, out.verbose),
                        u.client_status
                    )
                })
                .collect();
            if !users.is_empty() {
                s.push_str(&format!(": {}", users.join("; ")));
            }
            s
        })
        .unwrap_or_default();
    let snapshots: Vec<SnapshotSummary> =
        storage::snapshots(client, &r.spec.namespace, Some(&r.spec.name))
            .await?
            .iter()
            .map(SnapshotSummary::of)
            .collect();
    let waiting = match r.state {
        VolumeState::Pending | VolumeState::Deleting | VolumeState::Creating => {
            why_waiting(&r, &records, super::super::output::now_unix()).unwrap_or_default()
        }
        _ => String::new(),
    };
    let nodes = node_details(&r, &records, &placeholders, &allocations);
    let offered_by = offered_by(client, &r, &records, &placeholders).await;
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
            .map(|x| describe_expansion(x, &records))
            .unwrap_or_default(),
        allocations,
        history: merge_events(
            history(&r, &records),
            record_events(
                &r,
                &records,
                &snapshots,
                claim_node.as_deref().filter(|_| locked),
            ),
        ),
        snapshots,
        final_failure: r
            .final_failure
            .as_ref()
            .map(|f| f.reason())
            .unwrap_or_default(),
        waiting,
        claim_holder,
        nodes,
        offered_by,
    };
    let verbose = out.verbose;
    out.print(&d, |d| render_detail(d, verbose))
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
                job_id: "example".into(),
                client_status: "running".into(),
                host_path: "/srv/hv".into(),
            }],
            snapshots: Vec::new(),
            final_failure: String::new(),
            offered_by: Vec::new(),
            waiting: String::new(),
            claim_holder: "node-1 (n1): job example, allocation a1 (running)".into(),
            nodes: Vec::new(),
            history: Vec::new(),
        };
        let s = render_detail(&d, false);
        assert_eq!(
            s,
            "\
ID             = 0b9c6a6e-1111-4222-8333-444455556666
Name           = shared-data
Namespace      = default
Plugin ID      = bind
State          = ready (registered)
Requested Size = 1.0 GiB
Node Pool      = (any)
Capability     = single-node-writer / file-system
Parameters     = {\"export\":\"/srv\"}
Signed         = yes
Secrets        = 2 keys, not shown
Error          = bad\\u{1b}[2J; fake
Mounted On     = no node
Claim Holder   = node-1 (n1): job example, allocation a1 (running)

Allocations
ID  Name            Job      Node ID  Status
a1  example.app[0]  example  n1       running
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
            serde_json::json!({"ID": "a1", "Name": "example.app[0]", "NodeID": "n1", "JobID": "example", "ClientStatus": "running", "HostPath": "/srv/hv"})
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
            detail: String::new(),
        };
        let mut n1 = NodeRecord::new("id-node-1", "node-1", "default");
        n1.history.insert(
            "default/shared-data".into(),
            vec![
                ev(1_733_350_000, "publish", "a1111111-0000", true, 132),
                ev(1_733_350_060, "unpublish", "", true, 0),
            ],
        );
        let mut n2 = NodeRecord::new("id-node-2", "node-2", "default");
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
Time                  Node    Event      Detail               Outcome
2024-12-04T22:07:40Z  node-1  unpublish  -                    ok
2024-12-04T22:07:10Z  node-2  publish    allocation b2222222  failed after 2.4s
2024-12-04T22:06:40Z  node-1  publish    allocation a1111111  ok in 132ms
"
        );
        let j = serde_json::to_value(&h).unwrap();
        assert_eq!(
            j[2],
            serde_json::json!({"Time": "2024-12-04T22:06:40Z", "NodeID": "id-node-1", "NodeName": "node-1", "Event": "publish", "AllocID": "a1111111-0000", "Outcome": "ok", "DurationMs": 132, "Detail": ""})
        );
        // Issue 46 #7: the record's own events (create, snapshot, expansion, claim) beside
        // the nodes': timed ones in order, the rest last.
        let mut rec = rec;
        rec.state = VolumeState::Ready;
        rec.capacity_bytes = 64 << 20;
        rec.worker_node = "id-node-1".into();
        rec.expansion = Some(volume::Expansion::requested(128 << 20));
        let snap = SnapshotSummary {
            id: "5a5a5a5a-0000".into(),
            namespace: "default".into(),
            volume: "shared-data".into(),
            name: "nightly".into(),
            bytes: 1,
            created_at: 1_733_350_045,
            ready: true,
            state: "ready".into(),
            error: String::new(),
        };
        let n1 = NodeRecord::new("id-node-1", "node-1", "default");
        let all = merge_events(h, record_events(&rec, &[n1], &[snap], Some("id-node-1")));
        assert_eq!(
            render_history(&all, false),
            "\
Time                  Node    Event      Detail               Outcome
2024-12-04T22:07:40Z  node-1  unpublish  -                    ok
2024-12-04T22:07:25Z  -       snapshot   5a5a5a5a (nightly)   ok
2024-12-04T22:07:10Z  node-2  publish    allocation b2222222  failed after 2.4s
2024-12-04T22:06:40Z  node-1  publish    allocation a1111111  ok in 132ms
-                     node-1  create     64.0 MiB             ok
-                     -       expand     to 128.0 MiB         requested
-                     node-1  claim      -                    held
"
        );
        assert_eq!(render_history(&[], false), "No recent events on any node\n");
    }

    /// Issue 47: a change of condition on a node is an event of `-verbose`, with its class
    /// and what it became.
    #[test]
    fn a_change_of_condition_shows_its_class_and_what_it_became() {
        let rec = VolumeRecord::new(
            volume::parse_spec("name = \"shared-data\"\nplugin_id = \"bind\"\n")
                .unwrap()
                .0,
            BTreeMap::new(),
        );
        let ev = |time: u64, detail: &str, ok: bool| nodes::NodeEvent {
            time,
            event: "condition".into(),
            ok,
            detail: detail.into(),
            ..Default::default()
        };
        let mut n1 = NodeRecord::new("id-node-1", "node-1", "default");
        n1.history.insert(
            "default/shared-data".into(),
            vec![
                ev(1_733_350_000, "data-loss", false),
                ev(1_733_350_060, "healthy", true),
            ],
        );
        assert_eq!(
            render_history(&history(&rec, &[n1]), false),
            "\
Time                  Node    Event      Detail     Outcome
2024-12-04T22:07:40Z  node-1  condition  healthy    healthy
2024-12-04T22:06:40Z  node-1  condition  data-loss  abnormal
"
        );
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
            serde_json::json!({"NodeID": "n1", "NodeName": "node-1", "State": "published", "Since": "2024-12-04T22:06:40Z", "Target": "", "HostVolumeID": "hv1", "Allocations": ["a1"], "Error": "", "Refused": "", "Claim": "", "Waiting": "", "Condition": "", "UsedPercent": null, "UnusedSince": null})
        );
        assert_eq!(j[1]["Since"], serde_json::Value::Null);
    }

    /// `Unused Since` is shown wherever a node says when the volume's last user there
    /// went away, mounted or not (a node whose mount was read also shows `Used` and
    /// `Condition`), and says nothing for a node where it is in use.
    #[test]
    fn unused_since_is_shown_for_an_unused_volume_mounted_or_not_and_not_while_in_use() {
        let rec = VolumeRecord::new(
            volume::parse_spec("name = \"shared-data\"\nplugin_id = \"bind\"")
                .unwrap()
                .0,
            BTreeMap::new(),
        );
        let now = super::super::super::output::now_unix();
        let mut n1 = NodeRecord::new("id-1", "node-1", "default");
        let mut n2 = NodeRecord::new("id-2", "node-2", "default");
        // node-1 unpublished it 90 s ago (no mount read: no condition); node-2 uses it.
        n1.set_volumes(BTreeMap::from([(
            "default/shared-data".to_string(),
            nodes::NodeVolume {
                unused_since: Some(now - 90),
                ..Default::default()
            },
        )]));
        let in_use = nodes::NodeVolume {
            state: "published".into(),
            since: now - 30,
            users: vec!["d5e2d42f-0000-4000-8000-000000000000".into()],
            ..Default::default()
        };
        n2.set_volumes(BTreeMap::from([(
            "default/shared-data".to_string(),
            in_use.clone(),
        )]));
        let detail = |nodes| VolumeDetail {
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
            final_failure: String::new(),
            offered_by: Vec::new(),
            waiting: String::new(),
            claim_holder: String::new(),
            nodes,
            history: Vec::new(),
        };
        let s = render_detail(
            &detail(node_details(&rec, &[n1.clone(), n2.clone()], &[], &[])),
            false,
        );
        let row = |s: &str, name: &str| {
            s.lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no {name} row:\n{s}"))
                .to_string()
        };
        assert!(s.contains("  Why  Unused Since\n"), "{s}");
        assert!(!s.contains("Condition"), "{s}");
        assert!(row(&s, "node-1").ends_with("  1m30s ago"), "{s}");
        assert!(row(&s, "node-2").ends_with("  -"), "{s}");
        // Mounted, unused, its mount read: usage, condition and unused-since.
        n1.set_volumes(BTreeMap::from([(
            "default/shared-data".to_string(),
            nodes::NodeVolume {
                state: "published".into(),
                since: now - 300,
                condition: "healthy".into(),
                used_percent: Some(7),
                unused_since: Some(now - 90),
                ..Default::default()
            },
        )]));
        let s = render_detail(
            &detail(node_details(&rec, &[n1.clone(), n2.clone()], &[], &[])),
            false,
        );
        assert!(s.contains("  Why  Used  Condition  Unused Since\n"), "{s}");
        assert!(
            row(&s, "node-1").ends_with("  7%    healthy    1m30s ago"),
            "{s}"
        );
        // In use on every node that has it: nothing to say.
        n1.set_volumes(BTreeMap::from([(
            "default/shared-data".to_string(),
            in_use,
        )]));
        let s = render_detail(&detail(node_details(&rec, &[n1, n2], &[], &[])), false);
        assert!(!s.contains("Unused Since"), "{s}");
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
            final_failure: String::new(),
            offered_by: Vec::new(),
            waiting: String::new(),
            claim_holder: String::new(),
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
        // Issue 46: a node where a publish waits says `waiting` (not `not mounted`), and
        // the reason stands in the `Why` column, not as an error.
        assert!(
            row("node-2").starts_with("node-2  waiting ") && row("node-2").ends_with(reason),
            "{s}"
        );
        assert!(s.contains("  Why\n"), "{s}");
        assert!(!s.contains("Last Error"), "{s}");
        assert!(
            s.contains("Mounted On     = node-1 since 1970-01-01T00:00:01Z"),
            "{s}"
        );
    }
}
