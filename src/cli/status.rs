//! `dhv-binder status`: the local agent's state in a few lines (node, watch health, plugins,
//! pending work, last errors, then one row per volume with its mount state, users, usage
//! and condition).
//!
//! The document is the agent's `GET /v1/status` answer (see [`crate::api`]), snake_case as
//! the local API serves it; [`StatusDoc`] reads the fields the readable form prints and
//! ignores the rest. `-json` and `-t` print the whole answer in Nomad's casing, converted by
//! one rule ([`nomad_json`] with [`SHAPE`]) rather than a mirror of its fields, so a field
//! added to the document appears in `-json` (`NodeID`, `Volumes`, `PublishLatencyMs`; times
//! in RFC 3339) without a change here.

use super::output::{ago, kv, nomad_json, now_unix, plural, table, OutputArgs, Shape};
use super::{Failure, EXIT_FAILED, EXIT_UNAVAILABLE};
use crate::api::client::{call, CallError};
use serde::Deserialize;
use std::collections::BTreeMap;

/// Arguments of `status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub socket: super::NodeSocketArg,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// The status document's objects that are not structs, for [`nomad_json`]: maps keyed by
/// plugin ID (the other maps are keyed by `namespace/name` or allocation ID, which are kept
/// anyway, and are listed so that the rule does not depend on it), and the plugin's own
/// `context` of a mount, which keeps the plugin's keys. A new map keyed by plugin IDs or
/// other plain words, or a new object a plugin returned, needs a line here; any other new
/// field is converted as it is.
pub const SHAPE: Shape<'static> = Shape {
    maps: &[
        "plugins",
        "errors",
        "claims",
        "fenced",
        "frozen",
        "foreign_mounts",
        "holders",
        "rejected_records",
        "unfenced",
        "ungated",
        "mount_health.broken",
        "offers.plugins",
        "offers.cooling_down",
        "offers.constraints",
    ],
    opaque: &["mounts.publish_context"],
};

/// The parts of the agent's status document that the readable form prints. Every field
/// defaults, so an older or newer agent's document still renders.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StatusDoc {
    pub node_id: String,
    pub node_pool: String,
    /// The watcher's health: `{"state": "listing|polling|streaming|disconnected", ...}`.
    pub watch: serde_json::Value,
    pub view: ViewDoc,
    pub volumes: Vec<VolumeDoc>,
    pub mounts: Vec<MountDoc>,
    pub users: Vec<UserDoc>,
    pub waiting: Vec<WaitingDoc>,
    /// Last error per volume (`namespace/name`).
    pub errors: BTreeMap<String, String>,
    /// Plugin ID to `{"version","deferred_bind"}` or `{"error"}`.
    pub plugins: BTreeMap<String, serde_json::Value>,
    pub publish_latency_ms: LatencyDoc,
    pub pending_publish_calls: u64,
    /// Claim state per volume (`namespace/name`).
    pub claims: BTreeMap<String, String>,
    pub mount_health: MountHealthDoc,
    /// Volume records the agent refused (`namespace/path` → reason): unsigned, forged or
    /// malformed; nothing is done for them (docs/security.md).
    pub rejected_records: BTreeMap<String, String>,
    /// Something other than the volume mounted at a volume's target (`namespace/name` →
    /// what was found); never accepted as the volume (docs/architecture.md, fail closed).
    pub foreign_mounts: BTreeMap<String, String>,
    /// Processes still using a volume the plan wants unpublished (`namespace/name` → scan).
    pub holders: BTreeMap<String, UsageDoc>,
    /// Tasks that mount a deferred volume without the prestart gate, by allocation ID.
    pub ungated: BTreeMap<String, Vec<UngatedDoc>>,
    /// Each volume's usage and condition, as last read (`namespace/name` →
    /// `{"usage", "condition", "unused_since", "condition_changes"}`; docs/operations/metrics.md,
    /// "Volume usage, condition and unused time").
    pub volume_usage: BTreeMap<String, VolumeUsageDoc>,
    /// Whether the journal can be written: `{"failing": false}`, or `{"failing": true,
    /// "failing_since": unix s, "error", "failed_writes"}` (docs/operations/storage-failures.md, "The state
    /// directory's filesystem is full").
    pub journal: serde_json::Value,
    /// Volumes a freezing storage operation may hold frozen (`namespace/name` →
    /// `{"operation", "since": unix s, "target", "thaw_error"}`; docs/operations/storage-failures.md, "A
    /// frozen volume").
    pub frozen: BTreeMap<String, FrozenDoc>,
}

/// A published volume's last reading (the agent's `volume_usage` entry).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct VolumeUsageDoc {
    /// `statfs` of its mount; `None` when the mount did not answer or was not read.
    pub usage: Option<BytesDoc>,
    /// `None` before its first reading.
    pub condition: Option<ConditionDoc>,
}

/// A mount's filesystem figures, in bytes (the agent's `node::usage::Usage`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct BytesDoc {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
}

/// A volume's condition (the agent's `node::usage::Condition`, CSI's `VolumeCondition` with
/// a class).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ConditionDoc {
    pub abnormal: bool,
    /// `inaccessible`, `degraded` or `data-loss` when abnormal.
    pub class: Option<String>,
    /// What was found; empty when healthy.
    pub message: String,
}

impl VolumeUsageDoc {
    /// The `Used` cell: `used/capacity` as the Nomad CLI prints a resource's use (`nomad
    /// alloc status`, "Disk"), `-` without a reading.
    fn used_cell(&self) -> String {
        match &self.usage {
            Some(u) => format!(
                "{}/{}",
                crate::cli::output::bytes(u.used_bytes),
                crate::cli::output::bytes(u.capacity_bytes)
            ),
            None => "-".into(),
        }
    }

    /// The `Condition` cell: `healthy`, the class of what is wrong, `-` before a reading.
    fn condition_cell(&self) -> String {
        match &self.condition {
            None => "-".into(),
            Some(c) if !c.abnormal => "healthy".into(),
            Some(c) => c.class.clone().unwrap_or_else(|| "abnormal".into()),
        }
    }
}

/// A volume a freezing operation may hold frozen (the agent's `storage_ops::Frozen`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct FrozenDoc {
    pub operation: String,
    /// Unix seconds.
    pub since: u64,
    pub target: String,
    /// Set when the agent's thaw after the operation failed.
    pub thaw_error: Option<String>,
}

/// A scan of the processes using a volume (the agent's `holders::Usage`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct UsageDoc {
    pub holders: Vec<HolderDoc>,
    pub other_mounts: Vec<String>,
    pub uninspected: Vec<serde_json::Value>,
}

/// One process holding a volume.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct HolderDoc {
    pub pid: u32,
    pub comm: String,
    /// `{"kind": "open_file|cwd|root|exe|mapped|mount", ...}`.
    pub how: serde_json::Value,
    pub alloc_id: Option<String>,
}

impl std::fmt::Display for HolderDoc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} ({})", self.pid, self.comm)?;
        if let Some(a) = &self.alloc_id {
            write!(f, " of allocation {}", short_id(a))?;
        }
        let path = |k: &str| self.how[k].as_str().unwrap_or("?").to_string();
        match self.how["kind"].as_str().unwrap_or("") {
            "open_file" => write!(f, " has {} open", path("path")),
            "cwd" => write!(f, " works in it"),
            "root" => write!(f, " is chrooted in it"),
            "exe" => write!(f, " runs a program from it"),
            "mapped" => write!(f, " maps {}", path("path")),
            "mount" => write!(f, " has it mounted at {}", path("mount_point")),
            other => write!(f, " holds it ({other})"),
        }
    }
}

/// A task mounting a deferred volume without waiting for it (the agent's `gate::Ungated`).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct UngatedDoc {
    pub job: String,
    pub group: String,
    pub task: String,
    pub volume: KeyDoc,
    /// `no_gate` or `starts_with_gate`.
    pub reason: String,
    /// True when the task sees the volume once it is published (its mounts of it propagate);
    /// false: the agent restarts the task onto it then.
    #[serde(default)]
    pub sees_later_mounts: bool,
}

/// The first 8 characters of an ID, as the Nomad CLI prints them.
fn short_id(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

fn holders_cell(u: &UsageDoc, max: usize) -> String {
    let mut parts: Vec<String> = u.holders.iter().take(max).map(|h| h.to_string()).collect();
    if u.holders.len() > max {
        parts.push(format!("{} more", u.holders.len() - max));
    }
    if !u.uninspected.is_empty() {
        parts.push(format!(
            "{} not readable",
            plural(u.uninspected.len() as u64, "process", "processes")
        ));
    }
    parts.extend(
        u.other_mounts
            .iter()
            .map(|p| format!("also mounted at {p}")),
    );
    parts.join("; ")
}

/// The agent's view of its node's allocations.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ViewDoc {
    pub complete: bool,
    pub index: u64,
    pub allocations: u64,
    pub departing: u64,
}

/// A volume record as the agent knows it.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct VolumeDoc {
    pub namespace: String,
    pub name: String,
    pub plugin_id: String,
    pub state: String,
    pub served_here: bool,
}

/// A volume key as serialized by the agent.
#[derive(Debug, Default, Deserialize, Clone, PartialEq, Eq, PartialOrd, Ord)]
#[serde(default)]
pub struct KeyDoc {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for KeyDoc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A journal mount record.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct MountDoc {
    pub volume: KeyDoc,
    pub state: String,
    pub since: u64,
    pub last_error: String,
}

/// One allocation's use of a published volume.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct UserDoc {
    pub alloc_id: String,
    pub volume: KeyDoc,
}

/// A volume the plan waits on, and why.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct WaitingDoc {
    pub volume: String,
    pub reason: String,
}

/// How long this node's publishes took (the plugin's `publish` and the mount check).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct LatencyDoc {
    pub count: u64,
    /// The upper bound (ms) of the histogram bucket holding the median: a bucket's bound,
    /// not a measured value.
    pub median: Option<u64>,
    /// The last publish, as measured (ms); absent from older agents.
    pub last: Option<u64>,
}

/// Dead mounts found by the probes.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct MountHealthDoc {
    pub broken: BTreeMap<String, BrokenDoc>,
}

/// One dead mount.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct BrokenDoc {
    pub error: String,
    pub action: String,
}

fn watch_line(w: &serde_json::Value) -> String {
    let state = w["state"].as_str().unwrap_or("unknown");
    let c = &w["counters"];
    let mut counters = format!(
        "{}, {}",
        plural(c["relists"].as_u64().unwrap_or(0), "relist", "relists"),
        plural(
            c["reconnects"].as_u64().unwrap_or(0),
            "reconnect",
            "reconnects"
        )
    );
    // What each poll answer costs: the node's whole list (an older agent does not say).
    if let (Some(n), Some(b)) = (c["list_allocations"].as_u64(), c["list_bytes"].as_u64()) {
        counters.push_str(&format!(
            "; last list {}, {}",
            plural(n, "allocation", "allocations"),
            crate::cli::output::bytes(b)
        ));
    }
    match state {
        "polling" | "streaming" => format!(
            "{state} (index {}; {counters})",
            w["index"].as_u64().unwrap_or(0)
        ),
        "disconnected" => format!(
            "disconnected: {} ({}; {counters})",
            w["reason"].as_str().unwrap_or(""),
            w["fault"].as_str().unwrap_or("unknown fault")
        ),
        other => other.to_string(),
    }
}

fn plugin_cell(id: &str, p: &serde_json::Value) -> String {
    if let Some(e) = p["error"].as_str() {
        return format!("{id} (unhealthy: {e})");
    }
    let deferred = if p["deferred_bind"].as_bool() == Some(true) {
        "deferred"
    } else {
        "not deferred"
    };
    format!("{id} {} ({deferred})", p["version"].as_str().unwrap_or("?"))
}

/// The readable form of a status document, at `now` (Unix seconds).
pub fn render(doc: &StatusDoc, now: u64) -> String {
    let mut rows: Vec<(&str, String)> = vec![
        ("Node ID", doc.node_id.clone()),
        (
            "Node Pool",
            if doc.node_pool.is_empty() {
                "default".into()
            } else {
                doc.node_pool.clone()
            },
        ),
        ("Watch", watch_line(&doc.watch)),
        (
            "Allocations",
            format!(
                "{} on this node, {} departing ({})",
                doc.view.allocations,
                doc.view.departing,
                if doc.view.complete {
                    "view complete"
                } else {
                    "view incomplete: nothing is unpublished until the next full list"
                }
            ),
        ),
        (
            "Plugins",
            if doc.plugins.is_empty() {
                "none found".into()
            } else {
                doc.plugins
                    .iter()
                    .map(|(id, p)| plugin_cell(id, p))
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        ),
        (
            "Pending",
            format!(
                "{} waiting, {} waiting",
                plural(doc.pending_publish_calls, "publish call", "publish calls"),
                plural(doc.waiting.len() as u64, "volume", "volumes")
            ),
        ),
        ("Publish Wait", {
            let l = &doc.publish_latency_ms;
            let over = plural(l.count, "publish", "publishes");
            match (l.last, l.median) {
                (Some(last), Some(m)) => format!(
                    "last {}, median ≤ {} over {over}",
                    super::output::millis(last),
                    super::output::millis(m)
                ),
                (None, Some(m)) => format!("median ≤ {} over {over}", super::output::millis(m)),
                (_, None) => "no publishes yet".into(),
            }
        }),
        ("Broken Mounts", doc.mount_health.broken.len().to_string()),
    ];
    if doc.journal["failing"] == true {
        rows.push((
            "Journal",
            format!(
                "cannot be written for {}s ({} failed writes): {}; new publishes and unpublishes wait until it can (free space in the state directory)",
                now.saturating_sub(doc.journal["failing_since"].as_u64().unwrap_or(now)),
                doc.journal["failed_writes"].as_u64().unwrap_or(0),
                doc.journal["error"].as_str().unwrap_or("unknown error"),
            ),
        ));
    }
    for (k, f) in &doc.frozen {
        rows.push((
            "Frozen",
            match &f.thaw_error {
                None => format!(
                    "{k}: by {} for {}s (its tasks' writes wait until it is thawed; the agent thaws it when the call ends)",
                    f.operation,
                    now.saturating_sub(f.since)
                ),
                Some(e) => format!(
                    "{k}: left by {} {}s ago, and the agent's thaw failed: {e}; run fsfreeze -u {}",
                    f.operation,
                    now.saturating_sub(f.since),
                    f.target
                ),
            },
        ));
    }
    for w in &doc.waiting {
        rows.push(("Waiting", format!("{}: {}", w.volume, w.reason)));
    }
    for (k, e) in &doc.errors {
        rows.push(("Last Error", format!("{k}: {e}")));
    }
    for (k, why) in &doc.rejected_records {
        rows.push(("Refused Record", format!("{k}: {why}")));
    }
    for (k, why) in &doc.foreign_mounts {
        rows.push(("Foreign Mount", format!("{k}: {why}")));
    }
    for (k, u) in &doc.holders {
        rows.push(("In Use", format!("{k}: {}", holders_cell(u, 3))));
    }
    for (alloc, tasks) in &doc.ungated {
        for t in tasks {
            let why = match t.reason.as_str() {
                "starts_with_gate" => "it is a prestart task and starts with the gate",
                _ => "its group has no prestart gate",
            };
            let then = if t.sees_later_mounts {
                "it sees the volume once published (its mount propagates)"
            } else {
                "it is restarted onto the volume once published"
            };
            rows.push((
                "Ungated Task",
                format!(
                    "allocation {} job {:?} group {:?} task {:?} mounts {} before it is published: {why}; {then}",
                    short_id(alloc),
                    t.job,
                    t.group,
                    t.task,
                    t.volume
                ),
            ));
        }
    }
    let mut s = kv(&rows);
    s.push_str("\nVolumes\n");
    let mut keys: Vec<String> = doc
        .volumes
        .iter()
        .map(|v| format!("{}/{}", v.namespace, v.name))
        .collect();
    for m in &doc.mounts {
        let k = m.volume.to_string();
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.sort();
    let table_rows: Vec<Vec<String>> = keys
        .iter()
        .map(|k| {
            let v = doc
                .volumes
                .iter()
                .find(|v| format!("{}/{}", v.namespace, v.name) == *k);
            let m = doc.mounts.iter().find(|m| m.volume.to_string() == *k);
            let users = doc
                .users
                .iter()
                .filter(|u| u.volume.to_string() == *k)
                .count();
            let mount = match (m, doc.mount_health.broken.get(k)) {
                (_, Some(b)) => format!("dead ({})", b.action),
                (Some(m), None) => format!("{} {}", m.state, ago(m.since, now)),
                (None, None) => "-".into(),
            };
            let usage = doc.volume_usage.get(k);
            // A dead mount's error, else the last publish error, else what an abnormal
            // condition found.
            let error = doc
                .mount_health
                .broken
                .get(k)
                .map(|b| b.error.clone())
                .or_else(|| m.map(|m| m.last_error.clone()).filter(|e| !e.is_empty()))
                .or_else(|| {
                    usage
                        .and_then(|u| u.condition.as_ref())
                        .filter(|c| c.abnormal)
                        .map(|c| c.message.clone())
                })
                .unwrap_or_default();
            vec![
                k.clone(),
                v.map(|v| v.plugin_id.clone()).unwrap_or_default(),
                v.map(|v| v.state.clone())
                    .unwrap_or_else(|| "(no record)".into()),
                match v {
                    Some(v) if v.served_here => "yes".into(),
                    Some(_) => "no".into(),
                    None => "-".into(),
                },
                mount,
                users.to_string(),
                usage.map_or_else(|| "-".into(), VolumeUsageDoc::used_cell),
                usage.map_or_else(|| "-".into(), VolumeUsageDoc::condition_cell),
                doc.claims.get(k).cloned().unwrap_or_else(|| "-".into()),
                error,
            ]
        })
        .collect();
    s.push_str(&table(
        &[
            "Volume",
            "Plugin",
            "State",
            "Here",
            "Mount",
            "Users",
            "Used",
            "Condition",
            "Claim",
            "Error",
        ],
        &table_rows,
        "No volumes",
    ));
    s
}

/// What `status` says when the agent's socket cannot be opened: a permission error says it
/// is one (the agent may well be running), anything else asks whether the agent runs.
fn connect_failure(path: &str, source: &std::io::Error) -> Failure {
    if source.kind() == std::io::ErrorKind::PermissionDenied {
        return Failure::new(
            EXIT_FAILED,
            format!(
                "permission denied opening dhv-binder's socket {path}: this user may not open it or its directory; run as root (sudo dhv-binder status) or pass a socket you can open with --socket or DHV_BINDER_SOCKET"
            ),
        );
    }
    Failure::new(
        EXIT_UNAVAILABLE,
        format!(
            "cannot reach dhv-binder at {path}: {source} (is the agent running on this node? pass its socket with --socket or DHV_BINDER_SOCKET)"
        ),
    )
}

/// Runs `status`: asks the local agent and prints its state.
pub async fn status(args: StatusArgs) -> Result<(), Failure> {
    let v = match call(&args.socket.path, hyper::Method::GET, "/v1/status", None).await {
        Ok(v) => v,
        Err(CallError::Connect { path, source }) => return Err(connect_failure(&path, &source)),
        Err(e) => return Err(Failure::new(EXIT_FAILED, e.to_string())),
    };
    args.out.print(&nomad_json(&v, &SHAPE), |_| {
        let doc: StatusDoc = serde_json::from_value(v.clone()).unwrap_or_default();
        render(&doc, now_unix())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_permission_error_on_the_socket_says_it_is_one() {
        let denied = std::io::Error::from(std::io::ErrorKind::PermissionDenied);
        let f = connect_failure("/run/dhv-binder/api.sock", &denied);
        assert_eq!(f.code, EXIT_FAILED);
        assert!(
            f.message.starts_with(
                "permission denied opening dhv-binder's socket /run/dhv-binder/api.sock"
            ),
            "{}",
            f.message
        );
        assert!(
            f.message.contains("sudo dhv-binder status"),
            "{}",
            f.message
        );
        assert!(!f.message.contains("is the agent running"), "{}", f.message);
        let gone = std::io::Error::from(std::io::ErrorKind::NotFound);
        let f = connect_failure("/run/dhv-binder/api.sock", &gone);
        assert_eq!(f.code, EXIT_UNAVAILABLE);
        assert!(
            f.message.contains("is the agent running on this node?"),
            "{}",
            f.message
        );
    }

    fn doc() -> serde_json::Value {
        serde_json::json!({
            "node_id": "5a1d0b8e-0000-4000-8000-000000000001",
            "node_pool": "default",
            "watch": {"state": "polling", "index": 42, "counters": {"relists": 3, "reconnects": 1, "list_allocations": 57, "list_bytes": 421_888}},
            "view": {"complete": true, "index": 42, "allocations": 2, "departing": 0},
            "volumes": [
                {"namespace": "default", "name": "shared-data", "id": "x", "plugin_id": "bind", "state": "ready", "served_here": true},
                {"namespace": "default", "name": "scratch", "id": "y", "plugin_id": "nfs", "state": "ready", "served_here": false}
            ],
            "mounts": [{"volume": {"namespace": "default", "name": "shared-data"}, "volume_id": "x", "plugin_id": "bind", "state": "published", "target": "/t", "read_only": false, "since": 988}],
            "users": [{"alloc_id": "a", "volume": {"namespace": "default", "name": "shared-data"}}],
            "waiting": [{"volume": "default/scratch", "reason": "plugin nfs is not installed on this node"}],
            "errors": {"default/scratch": "publish failed: exit 1"},
            "plugins": {"bind": {"version": "0.2.0", "deferred_bind": true}, "nfs": {"error": "fingerprint timed out"}},
            "publish_latency_ms": {"count": 3, "median": 200, "last": 132},
            "pending_publish_calls": 1,
            "claims": {"default/shared-data": "held"},
            "mount_health": {"interval_ms": 10000, "broken": {}, "recovered": []},
            "rejected_records": {"default/dhv-binder/volumes/evil": "the record is not signed"},
            "foreign_mounts": {"default/other": "tmpfs from \"none\" is mounted at the target, not the volume"},
            "holders": {"default/shared-data": {"holders": [
                {"pid": 41, "comm": "sleep", "how": {"kind": "open_file", "fd": 3, "path": "/t/f"}, "alloc_id": "0b9a3c2e-1111-4000-8000-000000000002"},
                {"pid": 42, "comm": "sh", "how": {"kind": "cwd"}}
            ], "other_mounts": [], "uninspected": []}},
            "ungated": {"7d1c9e00-2222-4000-8000-000000000003": [
                {"job": "web", "group": "g", "task": "main", "volume": {"namespace": "default", "name": "shared-data"}, "reason": "no_gate"}
            ]},
            "volume_usage": {
                "default/shared-data": {
                    "usage": {"capacity_bytes": 1_073_741_824u64, "used_bytes": 8192, "available_bytes": 1_073_733_632u64, "inodes": 65536, "inodes_used": 3, "inodes_free": 65533},
                    "condition": {"abnormal": false},
                    "condition_changes": [{"time": 988, "condition": {"abnormal": false}}]
                },
                "default/scratch": {"unused_since": 900}
            }
        })
    }

    #[test]
    fn readable_status_shows_node_watch_pending_errors_and_each_volume() {
        let d: StatusDoc = serde_json::from_value(doc()).unwrap();
        let s = render(&d, 1000);
        let expected = "\
Node ID        = 5a1d0b8e-0000-4000-8000-000000000001
Node Pool      = default
Watch          = polling (index 42; 3 relists, 1 reconnect; last list 57 allocations, 412.0 KiB)
Allocations    = 2 on this node, 0 departing (view complete)
Plugins        = bind 0.2.0 (deferred), nfs (unhealthy: fingerprint timed out)
Pending        = 1 publish call waiting, 1 volume waiting
Publish Wait   = last 132ms, median ≤ 200ms over 3 publishes
Broken Mounts  = 0
Waiting        = default/scratch: plugin nfs is not installed on this node
Last Error     = default/scratch: publish failed: exit 1
Refused Record = default/dhv-binder/volumes/evil: the record is not signed
Foreign Mount  = default/other: tmpfs from \"none\" is mounted at the target, not the volume
In Use         = default/shared-data: pid 41 (sleep) of allocation 0b9a3c2e has /t/f open; pid 42 (sh) works in it
Ungated Task   = allocation 7d1c9e00 job \"web\" group \"g\" task \"main\" mounts default/shared-data before it is published: its group has no prestart gate; it is restarted onto the volume once published

Volumes
Volume               Plugin  State  Here  Mount              Users  Used             Condition  Claim  Error
default/scratch      nfs     ready  no    -                  0      -                -          -
default/shared-data  bind    ready  yes   published 12s ago  1      8.0 KiB/1.0 GiB  healthy    held
";
        assert_eq!(s, expected, "got:\n{s}");
    }

    /// An abnormal volume's condition is its class, and what was found stands in `Error`
    /// (a mount that does not answer has no usage).
    #[test]
    fn an_abnormal_volume_shows_its_class_and_what_was_found() {
        let mut v = doc();
        v["volume_usage"]["default/shared-data"] = serde_json::json!({
            "usage": null,
            "condition": {"abnormal": true, "class": "inaccessible", "message": "statfs did not answer within 10s"}
        });
        let s = render(&serde_json::from_value(v).unwrap(), 1000);
        let row = s
            .lines()
            .find(|l| l.starts_with("default/shared-data"))
            .unwrap_or_else(|| panic!("no row:\n{s}"));
        assert_eq!(
            row,
            "default/shared-data  bind    ready  yes   published 12s ago  1      -     inaccessible  held   statfs did not answer within 10s",
            "{s}"
        );
    }

    /// Issue 37 #15: the publish time printed is the last one as measured; the median is
    /// said to be a bucket's bound (an older agent sends no measured value).
    #[test]
    fn the_publish_wait_is_the_measured_last_one_and_the_median_a_bound() {
        let mut v = doc();
        v["publish_latency_ms"] = serde_json::json!({"count": 1, "median": 2000, "last": 1234});
        let s = render(&serde_json::from_value(v.clone()).unwrap(), 1000);
        assert!(
            s.contains("Publish Wait   = last 1.2s, median ≤ 2.0s over 1 publish\n"),
            "{s}"
        );
        v["publish_latency_ms"] = serde_json::json!({"count": 1, "median": 2000});
        let s = render(&serde_json::from_value(v.clone()).unwrap(), 1000);
        assert!(
            s.contains("Publish Wait   = median ≤ 2.0s over 1 publish\n"),
            "{s}"
        );
        v["publish_latency_ms"] = serde_json::json!({"count": 0, "median": null, "last": null});
        let s = render(&serde_json::from_value(v).unwrap(), 1000);
        assert!(s.contains("Publish Wait   = no publishes yet\n"), "{s}");
    }

    #[test]
    fn a_journal_that_cannot_be_written_is_a_row() {
        let mut v = doc();
        v["journal"] = serde_json::json!({"failing": true, "failing_since": 940, "error": "No space left on device (os error 28)", "failed_writes": 61});
        let s = render(&serde_json::from_value(v).unwrap(), 1000);
        assert!(
            s.contains("Journal        = cannot be written for 60s (61 failed writes): No space left on device (os error 28); new publishes"),
            "{s}"
        );
        let s = render(&serde_json::from_value(doc()).unwrap(), 1000);
        assert!(!s.contains("Journal"), "{s}");
    }

    #[test]
    fn a_frozen_volume_is_a_row_naming_the_operation_and_since_when() {
        let mut v = doc();
        v["frozen"] = serde_json::json!({"default/shared-data": {"operation": "snapshot_create of snapshot s1", "since": 988, "target": "/m/default/shared-data", "thaw_error": null}});
        let s = render(&serde_json::from_value(v.clone()).unwrap(), 1000);
        assert!(
            s.contains(
                "Frozen         = default/shared-data: by snapshot_create of snapshot s1 for 12s"
            ),
            "{s}"
        );
        v["frozen"]["default/shared-data"]["thaw_error"] = "fsfreeze: not found".into();
        let s = render(&serde_json::from_value(v).unwrap(), 1000);
        assert!(
            s.contains("thaw failed: fsfreeze: not found; run fsfreeze -u /m/default/shared-data"),
            "{s}"
        );
        let s = render(&serde_json::from_value(doc()).unwrap(), 1000);
        assert!(!s.contains("Frozen"), "{s}");
    }

    /// Every field the agent's document has today (core/status.rs, shell.rs), with a
    /// value in each map and list.
    fn full_doc() -> serde_json::Value {
        let mut v = doc();
        v["watch"] = serde_json::json!({"state": "streaming", "index": 42, "counters": {
            "relists": 3, "reconnects": 1, "frames": 9, "skipped_other_nodes": 2, "stale_frames": 0,
            "bad_lines": 0, "index_resets": 0, "auth_failures": 0, "list_allocations": 57, "list_bytes": 421_888}});
        v["volumes"][0]["placeholder_id"] = "9d2e0f00-3333-4000-8000-000000000004".into();
        v["volumes"][1]["placeholder_id"] = serde_json::Value::Null;
        v["mounts"][0]["publish_context"] =
            serde_json::json!({"dev_path": "/dev/loop3", "lun_id": 1});
        v["mounts"][0]["last_error"] = "".into();
        v["mounts"][0]["claim_id"] = "c-1".into();
        v["mounts"][0]["mount"] = serde_json::json!({"dev": {"major": 0, "minor": 57}, "root": "/", "fs_type": "tmpfs", "source": "/srv"});
        v["mounts"][0]["since"] = 1_733_350_200.into();
        v["fenced"] = serde_json::json!({"default/shared-data": {"since": 1_733_350_200, "target": "/t", "lease_left_ms": 1500,
            "fence": {"target": "/t", "nothing_mounted": false, "read_only": true, "stopped": [{"pid": 41, "comm": "sleep", "how": {"kind": "cwd"}}], "errors": [], "plugin": {"plugin": "bind"}}}});
        v["mount_health"] = serde_json::json!({"interval_ms": 10000,
            "broken": {"default/scratch": {"target": "/s", "error": "ENOTCONN", "since": 1_733_350_200, "action": "hung", "allocations": ["a"]}},
            "recovered": [{"volume": "default/old", "target": "/o", "error": "ENOTCONN", "since": 0}]});
        v["storage_ops"] = serde_json::json!({"snapshots": 2, "running": ["snapshot s1"]});
        v["frozen"] = serde_json::json!({"default/shared-data": {"operation": "snapshot_create of snapshot s1", "since": 1_733_350_200, "target": "/t", "thaw_error": null}});
        v["holders"]["default/shared-data"]["other_mounts"] = serde_json::json!(["/elsewhere"]);
        v["holders"]["default/shared-data"]["uninspected"] =
            serde_json::json!([{"pid": 7, "comm": "x", "what": "fd", "error": "EACCES"}]);
        v["unfenced"] =
            serde_json::json!({"7d1c9e00-2222-4000-8000-000000000003": "set kill_timeout"});
        v["journal"] = serde_json::json!({"failing": true, "failing_since": 1_733_350_200, "error": "ENOSPC", "failed_writes": 3});
        v["ungated"]["7d1c9e00-2222-4000-8000-000000000003"][0]["sees_later_mounts"] = false.into();
        v
    }

    /// Issue 37 #6: `-json` is the whole document in Nomad's casing (fields PascalCase with
    /// `ID`, times RFC 3339), map keys and the plugin's context as the agent has them.
    #[test]
    fn json_status_is_the_agents_document_in_nomads_casing() {
        let got = nomad_json(&full_doc(), &SHAPE);
        let t = "2024-12-04T22:10:00Z";
        let want = serde_json::json!({
            "NodeID": "5a1d0b8e-0000-4000-8000-000000000001",
            "NodePool": "default",
            "Watch": {"State": "streaming", "Index": 42, "Counters": {
                "Relists": 3, "Reconnects": 1, "Frames": 9, "SkippedOtherNodes": 2, "StaleFrames": 0,
                "BadLines": 0, "IndexResets": 0, "AuthFailures": 0, "ListAllocations": 57, "ListBytes": 421_888}},
            "View": {"Complete": true, "Index": 42, "Allocations": 2, "Departing": 0},
            "Volumes": [
                {"Namespace": "default", "Name": "shared-data", "ID": "x", "PluginID": "bind", "State": "ready", "ServedHere": true, "PlaceholderID": "9d2e0f00-3333-4000-8000-000000000004"},
                {"Namespace": "default", "Name": "scratch", "ID": "y", "PluginID": "nfs", "State": "ready", "ServedHere": false, "PlaceholderID": null}
            ],
            "Mounts": [{"Volume": {"Namespace": "default", "Name": "shared-data"}, "VolumeID": "x", "PluginID": "bind", "State": "published", "Target": "/t", "ReadOnly": false, "Since": t,
                "PublishContext": {"dev_path": "/dev/loop3", "lun_id": 1}, "LastError": "", "ClaimID": "c-1",
                "Mount": {"Dev": {"Major": 0, "Minor": 57}, "Root": "/", "FSType": "tmpfs", "Source": "/srv"}}],
            "Users": [{"AllocID": "a", "Volume": {"Namespace": "default", "Name": "shared-data"}}],
            "Waiting": [{"Volume": "default/scratch", "Reason": "plugin nfs is not installed on this node"}],
            "Errors": {"default/scratch": "publish failed: exit 1"},
            "Plugins": {"bind": {"Version": "0.2.0", "DeferredBind": true}, "nfs": {"Error": "fingerprint timed out"}},
            "PublishLatencyMs": {"Count": 3, "Median": 200, "Last": 132},
            "PendingPublishCalls": 1,
            "Claims": {"default/shared-data": "held"},
            "Fenced": {"default/shared-data": {"Since": t, "Target": "/t", "LeaseLeftMs": 1500,
                "Fence": {"Target": "/t", "NothingMounted": false, "ReadOnly": true, "Stopped": [{"Pid": 41, "Comm": "sleep", "How": {"Kind": "cwd"}}], "Errors": [], "Plugin": {"Plugin": "bind"}}}},
            "MountHealth": {"IntervalMs": 10000,
                "Broken": {"default/scratch": {"Target": "/s", "Error": "ENOTCONN", "Since": t, "Action": "hung", "Allocations": ["a"]}},
                "Recovered": [{"Volume": "default/old", "Target": "/o", "Error": "ENOTCONN", "Since": null}]},
            "StorageOps": {"Snapshots": 2, "Running": ["snapshot s1"]},
            "Frozen": {"default/shared-data": {"Operation": "snapshot_create of snapshot s1", "Since": t, "Target": "/t", "ThawError": null}},
            "RejectedRecords": {"default/dhv-binder/volumes/evil": "the record is not signed"},
            "ForeignMounts": {"default/other": "tmpfs from \"none\" is mounted at the target, not the volume"},
            "Holders": {"default/shared-data": {"Holders": [
                {"Pid": 41, "Comm": "sleep", "How": {"Kind": "open_file", "Fd": 3, "Path": "/t/f"}, "AllocID": "0b9a3c2e-1111-4000-8000-000000000002"},
                {"Pid": 42, "Comm": "sh", "How": {"Kind": "cwd"}}
            ], "OtherMounts": ["/elsewhere"], "Uninspected": [{"Pid": 7, "Comm": "x", "What": "fd", "Error": "EACCES"}]}},
            "Unfenced": {"7d1c9e00-2222-4000-8000-000000000003": "set kill_timeout"},
            "Journal": {"Failing": true, "FailingSince": t, "Error": "ENOSPC", "FailedWrites": 3},
            "Ungated": {"7d1c9e00-2222-4000-8000-000000000003": [
                {"Job": "web", "Group": "g", "Task": "main", "Volume": {"Namespace": "default", "Name": "shared-data"}, "Reason": "no_gate", "SeesLaterMounts": false}
            ]},
            "VolumeUsage": {
                "default/shared-data": {
                    "Usage": {"CapacityBytes": 1_073_741_824u64, "UsedBytes": 8192, "AvailableBytes": 1_073_733_632u64, "Inodes": 65536, "InodesUsed": 3, "InodesFree": 65533},
                    "Condition": {"Abnormal": false},
                    "ConditionChanges": [{"Time": "1970-01-01T00:16:28Z", "Condition": {"Abnormal": false}}]
                },
                "default/scratch": {"UnusedSince": "1970-01-01T00:15:00Z"}
            }
        });
        assert_eq!(
            got,
            want,
            "got:\n{}",
            serde_json::to_string_pretty(&got).unwrap()
        );
        // `-json` prints it, and `-t` reads the same keys.
        let o = OutputArgs {
            json: true,
            ..Default::default()
        };
        let s = o.render(&got, |_| unreachable!()).unwrap();
        assert_eq!(serde_json::from_str::<serde_json::Value>(&s).unwrap(), want);
        let o = OutputArgs {
            template: Some("{{.NodeID}}{{range .Volumes}} {{.Name}}={{.PluginID}}{{end}} {{.Plugins.bind.Version}}".into()),
            ..Default::default()
        };
        assert_eq!(
            o.render(&got, |_| unreachable!()).unwrap(),
            "5a1d0b8e-0000-4000-8000-000000000001 shared-data=bind scratch=nfs 0.2.0\n"
        );
    }

    #[test]
    fn a_disconnected_watch_says_why() {
        let w = serde_json::json!({"state": "disconnected", "fault": "auth-failed", "reason": "token expired", "counters": {"relists": 1, "reconnects": 4}});
        assert_eq!(
            watch_line(&w),
            "disconnected: token expired (auth-failed; 1 relist, 4 reconnects)"
        );
    }
}
