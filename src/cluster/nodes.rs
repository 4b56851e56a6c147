//! Node records: each agent publishes its fingerprint (plugins with version, deferred flag
//! and health; watch health; agent version; last seen) to Nomad Variables, where
//! `dhv-binder plugin status`, `dhv-binder node status` and `volume create` read them.
//!
//! One variable per node, `dhv-binder/nodes/<node-id>` in namespace `default`, holding the
//! record as JSON under the item `record`; only its own agent writes it. The agent rewrites
//! it whenever the record changes and at least every heartbeat; a record whose `last_seen`
//! is older than [`STALE_AFTER`] heartbeats is shown as stale and is not eligible for
//! `volume create`.

use crate::nomad::types::Variable;
use crate::nomad::watch::Health;
use crate::nomad::{Client, NomadError};
use crate::storage::plugin::Fingerprint;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::sync::watch;

/// Variable path prefix of node records.
pub const NODE_PREFIX: &str = "dhv-binder/nodes/";
/// Namespace of node records (nodes belong to no namespace; Nomad's default one holds them).
pub const NODE_NAMESPACE: &str = "default";
/// How often an agent republishes its record when nothing changed.
pub const HEARTBEAT: Duration = Duration::from_secs(30);
/// A record not rewritten for this many of its heartbeats is stale.
pub const STALE_AFTER: u64 = 3;

/// One plugin as a node reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PluginInfo {
    /// From the plugin's `fingerprint`; empty when it failed.
    pub version: String,
    /// The plugin declared `deferred_bind` (dhv-binder serves only those).
    pub deferred_bind: bool,
    /// `fingerprint` succeeded.
    pub healthy: bool,
    /// Why `fingerprint` failed (redacted by the plugin runner).
    pub error: String,
    /// The optional operations the plugin declares (`snapshot`, `clone`, `expand`, ...);
    /// absent in records of agents older than storage operations (unknown, not "none").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Vec<String>>,
    /// The plugin's fingerprint `topology` (bounded there: at most 8 segments); absent when
    /// it reports none. `volume status` matches volumes' `topology_request` against it.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub topology: crate::volume::topology::Segments,
}

/// What one agent publishes about its node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeRecord {
    pub node_id: String,
    pub node_name: String,
    pub node_pool: String,
    /// The dhv-binder version of the agent (`CARGO_PKG_VERSION`).
    pub agent_version: String,
    /// Plugin ID to what the node knows of it.
    pub plugins: BTreeMap<String, PluginInfo>,
    /// The allocation watch: `listing`, `polling`, `streaming` or `disconnected`.
    pub watch: String,
    /// Why the watch is disconnected, when it is.
    pub watch_error: String,
    /// Seconds between rewrites when nothing changes.
    pub heartbeat_secs: u64,
    /// Unix seconds (the agent's clock) of the last write.
    pub last_seen: u64,
    /// The volumes this node has mounted or is working on, `<namespace>/<name>` → what it
    /// knows (from its journal), for `volume status`; at most [`MAX_NODE_VOLUMES`], absent
    /// in records of older agents.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub volumes: BTreeMap<String, NodeVolume>,
    /// Records this agent refuses to act on (unsigned, signed by a key it does not trust,
    /// malformed), `<namespace>/<variable path>` → why; at most [`MAX_NODE_VOLUMES`].
    /// `volume create` and `delete` print them when they give up waiting.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub refused: BTreeMap<String, String>,
    /// The recent publish, unpublish and fence events of this node's volumes (from its
    /// journal since the agent started), `<namespace>/<name>` → events, oldest first: at
    /// most [`MAX_NODE_HISTORY`] per volume and [`MAX_HISTORY_VOLUMES`] volumes (those with
    /// the latest events); absent in records of older agents. `volume status -verbose`
    /// prints them.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub history: BTreeMap<String, Vec<NodeEvent>>,
    /// Per plugin with an attach limit (its fingerprint's `max_volumes` or the agent's
    /// `--max-volumes`): how many of its volumes are attached here and the limit; absent
    /// when no plugin has one. `node status` prints them.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub attach: BTreeMap<String, AttachCount>,
}

/// A plugin's attached volumes on a node and its limit there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AttachCount {
    /// Its volumes with a mount record on the node.
    pub attached: u64,
    /// The node's limit for the plugin.
    pub max_volumes: u32,
}

/// The most events per volume a node record keeps in [`NodeRecord::history`].
pub const MAX_NODE_HISTORY: usize = 10;
/// The most volumes with events a node record keeps in [`NodeRecord::history`].
pub const MAX_HISTORY_VOLUMES: usize = 7;

/// One event of a volume on a node, as its agent publishes it (kept short: a node record
/// holds up to [`MAX_NODE_HISTORY`] × [`MAX_HISTORY_VOLUMES`] of them).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeEvent {
    /// Unix seconds (the agent's clock).
    pub time: u64,
    /// `publish`, `unpublish`, `fence` or `unfence`.
    pub event: String,
    /// The allocation a publish was for; empty otherwise.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub alloc_id: String,
    /// The operation succeeded (a fence: the volume was fenced).
    pub ok: bool,
    /// How long the plugin call took, measured by the agent (milliseconds); 0 when not
    /// measured.
    #[serde(skip_serializing_if = "is_zero")]
    pub ms: u64,
    /// What the event is about beyond its name (a forced unpublish: who asked, what was
    /// killed); empty otherwise.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The most entries [`NodeRecord::volumes`] and [`NodeRecord::refused`] hold each (the
/// record is one Nomad variable, 64 KiB at most): past it, the rest are left out.
pub const MAX_NODE_VOLUMES: usize = 64;
/// The most characters of one error or refusal kept in a node record.
pub const MAX_NODE_ERROR: usize = 200;

/// One volume on one node, as its agent publishes it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeVolume {
    /// The mount's state (`publishing`, `published`, `unpublishing`), empty when the node
    /// has no mount of it (an error of a claim or a create is all it knows).
    pub state: String,
    /// Unix seconds (the agent's clock) the state began; 0 when unknown.
    pub since: u64,
    /// The allocations on this node using it (the first 4).
    pub users: Vec<String>,
    /// The last error on this node (the plugin's redacted words), cut to
    /// [`MAX_NODE_ERROR`] characters; empty when the last attempt succeeded.
    pub error: String,
    /// This node's claim on a single-node volume: `held`, `fenced` or `lost`; empty when
    /// it holds none.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub claim: String,
    /// Why a publish of it waits on this node (another node holds its claim, its plugin is
    /// missing, another writer holds it), cut to [`MAX_NODE_ERROR`] characters; empty when
    /// nothing waits.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub waiting: String,
    /// Jobs on this node that mount the volume without the prestart gate
    /// (`crate::agent::gate`): `<job>/<task> (<allocation short ID>)`, with `: ended before
    /// the publish` for one whose allocation ended before the volume was published here;
    /// the first [`MAX_NODE_UNGATED`], each cut to [`MAX_UNGATED_CHARS`] characters, on at
    /// most [`MAX_UNGATED_VOLUMES`] volumes of the record (the agent's status has them all).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ungated: Vec<String>,
    /// Percent of the mount's filesystem in use (bytes, by `statfs`, rounded down: the
    /// record is written again only when it moves by a whole percent); `None` before the
    /// first reading or while the mount does not answer. The full figures are in the
    /// node's metrics (`dhv_binder_volume_stats_*`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub used_percent: Option<u8>,
    /// The mount's condition: `healthy`, or the class of what is wrong (`inaccessible`,
    /// `degraded`, `data-loss`; the words are in the node's log and `dhv-binder status`);
    /// empty before the first reading.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub condition: String,
    /// Unix seconds when the volume's last user on this node went away; `None` while it
    /// is in use here, or when it never was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unused_since: Option<u64>,
}

/// The most ungated jobs a node record names per volume (those whose allocation ended
/// before the publish first), and the most characters of each: the record at every bound
/// stays one variable.
pub const MAX_NODE_UNGATED: usize = 1;
/// See [`MAX_NODE_UNGATED`].
pub const MAX_UNGATED_CHARS: usize = 64;
/// The most volumes of a node record that name their ungated jobs (the first by key).
pub const MAX_UNGATED_VOLUMES: usize = 16;

/// `s` cut to [`MAX_NODE_ERROR`] characters (an ellipsis marks a cut).
fn bounded(s: &str) -> String {
    if s.chars().count() <= MAX_NODE_ERROR {
        return s.to_string();
    }
    let mut cut: String = s.chars().take(MAX_NODE_ERROR - 1).collect();
    cut.push('…');
    cut
}

/// Why no live node can run `capability` of `plugin_id`, when every live node that serves
/// the plugin says which operations it declares and none declares it; `None` when one does,
/// when a node does not say (an older agent), or when no live node serves the plugin (the
/// caller's own check reports that). `now` in Unix seconds.
pub fn missing_capability(
    records: &[NodeRecord],
    plugin_id: &str,
    capability: &str,
    now: u64,
) -> Option<String> {
    let serving: Vec<&NodeRecord> = records
        .iter()
        .filter(|r| r.can_serve(plugin_id, "", now))
        .collect();
    let mut without = Vec::new();
    for r in &serving {
        match r
            .plugins
            .get(plugin_id)
            .and_then(|p| p.capabilities.as_ref())
        {
            None => return None,
            Some(caps) if caps.iter().any(|c| c == capability) => return None,
            Some(_) => without.push(r.node_name.as_str()),
        }
    }
    if without.is_empty() {
        return None;
    }
    Some(format!(
        "plugin {plugin_id:?} does not declare capability {capability:?} on any node that runs it ({}): nothing was changed",
        without.join(", ")
    ))
}

/// A variable under [`NODE_PREFIX`] that is not a node record.
#[derive(Debug, thiserror::Error)]
#[error("variable {path} is not a dhv-binder node record: {reason}")]
pub struct NodeRecordError {
    pub path: String,
    pub reason: String,
}

/// Whether a record is fresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Rewritten within [`STALE_AFTER`] heartbeats.
    Live,
    /// Not rewritten for that long: the agent is stopped, cut off, or its node is gone.
    Stale,
}

impl NodeRecord {
    /// A record for this node, with no plugins known yet.
    pub fn new(node_id: &str, node_name: &str, node_pool: &str) -> Self {
        Self {
            node_id: node_id.into(),
            node_name: node_name.into(),
            node_pool: node_pool.into(),
            agent_version: env!("CARGO_PKG_VERSION").into(),
            watch: "listing".into(),
            heartbeat_secs: HEARTBEAT.as_secs(),
            ..Default::default()
        }
    }

    /// The variable path of a node's record.
    pub fn path_of(node_id: &str) -> String {
        format!("{NODE_PREFIX}{node_id}")
    }

    /// Replaces the attach counts of the plugins with a limit. True when they changed.
    pub fn set_attach(&mut self, attach: BTreeMap<String, AttachCount>) -> bool {
        let changed = self.attach != attach;
        self.attach = attach;
        changed
    }

    /// Replaces the plugin inventory from the agent's fingerprints. True when it changed.
    pub fn set_plugins(&mut self, plugins: &BTreeMap<String, Result<Fingerprint, String>>) -> bool {
        let next: BTreeMap<String, PluginInfo> = plugins
            .iter()
            .map(|(id, r)| {
                let info = match r {
                    Ok(fp) => PluginInfo {
                        version: fp.version.clone(),
                        deferred_bind: fp.deferred_bind,
                        healthy: true,
                        error: String::new(),
                        capabilities: Some(fp.capabilities.clone()),
                        topology: fp.topology.clone(),
                    },
                    Err(e) => PluginInfo {
                        error: e.clone(),
                        ..Default::default()
                    },
                };
                (id.clone(), info)
            })
            .collect();
        let changed = next != self.plugins;
        self.plugins = next;
        changed
    }

    /// Records the watch health. True when the state or its error changed (counters and
    /// indexes are not part of the record, so progress alone causes no write).
    pub fn set_watch(&mut self, h: &Health) -> bool {
        let (state, error) = match h {
            Health::Listing => ("listing", String::new()),
            Health::Polling { .. } => ("polling", String::new()),
            Health::Streaming { .. } => ("streaming", String::new()),
            Health::Disconnected { reason, .. } => ("disconnected", reason.clone()),
        };
        let changed = self.watch != state || self.watch_error != error;
        self.watch = state.into();
        self.watch_error = error;
        changed
    }

    /// Replaces what the record says of this node's volumes, bounded ([`MAX_NODE_VOLUMES`]
    /// entries, errors cut to [`MAX_NODE_ERROR`]). True when it changed.
    pub fn set_volumes(&mut self, volumes: BTreeMap<String, NodeVolume>) -> bool {
        let mut with_ungated = 0;
        let next: BTreeMap<String, NodeVolume> = volumes
            .into_iter()
            .take(MAX_NODE_VOLUMES)
            .map(|(k, mut v)| {
                v.error = bounded(&v.error);
                // One of the two is shown (`volume status` prints the wait only where
                // there is no error), so the record's size bound counts one of them.
                v.waiting = if v.error.is_empty() {
                    bounded(&v.waiting)
                } else {
                    String::new()
                };
                v.users.truncate(4);
                if !v.ungated.is_empty() {
                    with_ungated += 1;
                }
                v.ungated.truncate(if with_ungated > MAX_UNGATED_VOLUMES {
                    0
                } else {
                    MAX_NODE_UNGATED
                });
                for u in &mut v.ungated {
                    if u.chars().count() > MAX_UNGATED_CHARS {
                        *u = u.chars().take(MAX_UNGATED_CHARS - 1).chain(['…']).collect();
                    }
                }
                (k, v)
            })
            .collect();
        let changed = next != self.volumes;
        self.volumes = next;
        changed
    }

    /// Replaces the refused records, bounded as [`NodeRecord::set_volumes`]. True when
    /// they changed.
    pub fn set_refused(&mut self, refused: &BTreeMap<String, String>) -> bool {
        let next: BTreeMap<String, String> = refused
            .iter()
            .take(MAX_NODE_VOLUMES)
            .map(|(k, v)| {
                // The key names the variable: keep the reason only.
                let why = v
                    .split_once(" is not acted on: ")
                    .map_or(v.as_str(), |(_, r)| r);
                (k.clone(), bounded(why))
            })
            .collect();
        let changed = next != self.refused;
        self.refused = next;
        changed
    }

    /// Replaces the recent events, bounded: the last [`MAX_NODE_HISTORY`] of each volume,
    /// of the [`MAX_HISTORY_VOLUMES`] volumes whose last event is the latest. True when
    /// they changed.
    pub fn set_history(&mut self, history: BTreeMap<String, Vec<NodeEvent>>) -> bool {
        let mut by_latest: Vec<(String, Vec<NodeEvent>)> = history
            .into_iter()
            .filter(|(_, ev)| !ev.is_empty())
            .map(|(k, mut ev)| {
                let cut = ev.len().saturating_sub(MAX_NODE_HISTORY);
                ev.drain(..cut);
                (k, ev)
            })
            .collect();
        by_latest.sort_by_key(|(_, ev)| std::cmp::Reverse(ev.last().map_or(0, |e| e.time)));
        by_latest.truncate(MAX_HISTORY_VOLUMES);
        let next: BTreeMap<String, Vec<NodeEvent>> = by_latest.into_iter().collect();
        let changed = next != self.history;
        self.history = next;
        changed
    }

    /// Why this node refuses the record at `path` in `namespace`, if it does.
    pub fn refusal(&self, namespace: &str, path: &str) -> Option<&str> {
        self.refused
            .get(&format!("{namespace}/{path}"))
            .map(String::as_str)
    }

    /// Live or stale at `now` (Unix seconds).
    pub fn liveness(&self, now: u64) -> Liveness {
        let window = self.heartbeat_secs.max(1) * STALE_AFTER;
        if now.saturating_sub(self.last_seen) > window {
            Liveness::Stale
        } else {
            Liveness::Live
        }
    }

    /// True when this node can serve a volume of `plugin_id` in `node_pool` (empty: any
    /// pool): live, in the pool, and the plugin fingerprinted healthy with `deferred_bind`.
    pub fn can_serve(&self, plugin_id: &str, node_pool: &str, now: u64) -> bool {
        self.liveness(now) == Liveness::Live
            && (node_pool.is_empty() || node_pool == self.node_pool)
            && self
                .plugins
                .get(plugin_id)
                .is_some_and(|p| p.healthy && p.deferred_bind)
    }

    /// The variable that stores this record.
    pub fn to_variable(&self) -> Variable {
        let mut items = BTreeMap::new();
        items.insert(
            "record".into(),
            serde_json::to_string(self).unwrap_or_default(),
        );
        Variable {
            namespace: NODE_NAMESPACE.into(),
            path: Self::path_of(&self.node_id),
            items,
            ..Default::default()
        }
    }

    /// Reads a record back; its node ID must match the path.
    pub fn from_variable(var: &Variable) -> Result<Self, NodeRecordError> {
        let err = |reason: String| NodeRecordError {
            path: var.path.clone(),
            reason,
        };
        let text = var
            .items
            .get("record")
            .ok_or_else(|| err("no `record` item".into()))?;
        let rec: NodeRecord =
            serde_json::from_str(text).map_err(|e| err(format!("record: {e}")))?;
        if var.path != Self::path_of(&rec.node_id) {
            return Err(err(format!(
                "the record names node {:?}, not the one of its path",
                rec.node_id
            )));
        }
        Ok(rec)
    }
}

/// Reads every node record (Nomad API: `GET /v1/vars?prefix=dhv-binder/nodes/`, then
/// `GET /v1/var/:path` each), sorted by node name. Records that do not decode are
/// returned as errors beside the good ones, never dropped silently.
pub async fn list(client: &Client) -> Result<(Vec<NodeRecord>, Vec<NodeRecordError>), NomadError> {
    let metas = client
        .list_variables(NODE_PREFIX, NODE_NAMESPACE, 0, Duration::ZERO)
        .await?
        .value;
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for m in metas {
        if let Some(var) = client.variable(&m.namespace, &m.path).await? {
            match NodeRecord::from_variable(&var) {
                Ok(r) => good.push(r),
                Err(e) => bad.push(e),
            }
        }
    }
    good.sort_by(|a, b| (&a.node_name, &a.node_id).cmp(&(&b.node_name, &b.node_id)));
    Ok((good, bad))
}

/// This host's clock, in Unix seconds (0 before 1970).
pub fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Starts the task that keeps this node's record in Nomad: it writes when the record sent
/// on the returned channel changes (use `send_if_modified` with [`NodeRecord::set_plugins`]
/// and [`NodeRecord::set_watch`]) and every `heartbeat` otherwise. A failed write is tried
/// again (with the latest record) after a backoff of 1 s doubling to `heartbeat`, jitter
/// ±20 %, whatever changes meanwhile; failures are logged at most once a minute with a
/// count, and counted (`dhv_binder_nomad_retries_total{call="node_record"}`). The task ends
/// when the sender is dropped.
pub fn spawn_publisher(
    client: Client,
    mut record: NodeRecord,
    heartbeat: Duration,
) -> (watch::Sender<NodeRecord>, tokio::task::JoinHandle<()>) {
    record.heartbeat_secs = heartbeat.as_secs().max(1);
    let (tx, mut rx) = watch::channel(record);
    let task = tokio::spawn(async move {
        let mut attempt = 0u32;
        let mut failures = crate::nomad::retry::FailureLog::new(
            crate::nomad::retry::Call::NodeRecord,
            crate::nomad::retry::LOG_EVERY,
        );
        loop {
            let mut rec = rx.borrow_and_update().clone();
            rec.last_seen = now_unix();
            match client.put_variable(&rec.to_variable(), None).await {
                Ok(_) => {
                    attempt = 0;
                    tracing::debug!(node_id = %rec.node_id, "node record published")
                }
                Err(e) => {
                    if let Some(failures) = failures.failed(std::time::Instant::now()) {
                        tracing::warn!(node_id = %rec.node_id, error = %e, failures, "cannot publish this node's record; `plugin status` and `volume create` will see it as stale (retrying after a backoff, logged at most once a minute)")
                    }
                    let delay = crate::nomad::retry::backoff_delay(
                        Duration::from_secs(1),
                        heartbeat,
                        attempt,
                    );
                    attempt = attempt.saturating_add(1);
                    if rx.has_changed().is_err() {
                        return;
                    }
                    tokio::time::sleep(delay).await;
                    continue;
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                _ = tokio::time::sleep(heartbeat) => {}
            }
        }
    });
    (tx, task)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> NodeRecord {
        let mut r = NodeRecord::new("n1", "node-1", "default");
        let mut p = BTreeMap::new();
        p.insert(
            "bind".to_string(),
            Ok(Fingerprint {
                version: "0.2.0".into(),
                deferred_bind: true,
                capabilities: Vec::new(),
                ..Default::default()
            }),
        );
        p.insert(
            "plain".to_string(),
            Ok(Fingerprint {
                version: "1".into(),
                deferred_bind: false,
                capabilities: Vec::new(),
                ..Default::default()
            }),
        );
        p.insert("broken".to_string(), Err("exit 3".to_string()));
        assert!(r.set_plugins(&p));
        assert!(!r.set_plugins(&p), "the same inventory is no change");
        r.last_seen = 1000;
        r
    }

    #[test]
    fn eligibility_needs_a_live_node_in_the_pool_with_a_healthy_deferred_plugin() {
        let r = rec();
        assert!(r.can_serve("bind", "", 1010));
        assert!(r.can_serve("bind", "default", 1010));
        assert!(!r.can_serve("bind", "gpu", 1010), "another pool");
        assert!(!r.can_serve("plain", "", 1010), "not deferred");
        assert!(!r.can_serve("broken", "", 1010), "fingerprint failed");
        assert!(!r.can_serve("nfs", "", 1010), "absent");
        assert_eq!(r.liveness(1000 + 90), Liveness::Live);
        assert_eq!(r.liveness(1000 + 91), Liveness::Stale);
        assert!(!r.can_serve("bind", "", 1000 + 91), "stale");
    }

    /// A growth or snapshot the plugin cannot do is refused before the record changes,
    /// from what the nodes that run the plugin declare.
    #[test]
    fn a_capability_no_serving_node_declares_is_named_and_unknown_is_no_refusal() {
        let r = rec();
        let why = missing_capability(std::slice::from_ref(&r), "bind", "expand", 1010)
            .expect("bind declares no capability");
        assert!(
            why.contains("\"expand\"") && why.contains("node-1"),
            "{why}"
        );
        let mut can = r.clone();
        can.node_name = "node-2".into();
        if let Some(p) = can.plugins.get_mut("bind") {
            p.capabilities = Some(vec!["expand".into()]);
        }
        assert_eq!(
            missing_capability(&[r.clone(), can], "bind", "expand", 1010),
            None
        );
        let mut old = r.clone();
        if let Some(p) = old.plugins.get_mut("bind") {
            p.capabilities = None;
        }
        assert_eq!(
            missing_capability(&[old], "bind", "expand", 1010),
            None,
            "unknown"
        );
        assert_eq!(
            missing_capability(&[r], "nfs", "expand", 1010),
            None,
            "not served"
        );
    }

    #[test]
    fn a_record_round_trips_through_its_variable_and_refuses_a_foreign_path() {
        let r = rec();
        let mut var = r.to_variable();
        assert_eq!(var.path, "dhv-binder/nodes/n1");
        assert_eq!(NodeRecord::from_variable(&var).unwrap(), r);
        var.path = "dhv-binder/nodes/n2".into();
        assert!(NodeRecord::from_variable(&var).is_err());
        var.items.clear();
        assert!(NodeRecord::from_variable(&var).is_err());
    }

    #[test]
    fn volumes_and_refusals_are_bounded_and_older_records_still_decode() {
        let mut r = rec();
        let many: BTreeMap<String, NodeVolume> = (0..MAX_NODE_VOLUMES + 50)
            .map(|i| {
                (
                    format!("default/v{i:03}"),
                    NodeVolume {
                        state: "published".into(),
                        since: 5,
                        users: Vec::new(),
                        error: "e".repeat(5000),
                        waiting: "w".repeat(5000),
                        ..Default::default()
                    },
                )
            })
            .collect();
        assert!(r.set_volumes(many.clone()));
        assert!(!r.set_volumes(many), "the same volumes are no change");
        assert_eq!(r.volumes.len(), MAX_NODE_VOLUMES);
        assert!(r
            .volumes
            .values()
            .all(|v| v.error.chars().count() == MAX_NODE_ERROR && v.waiting.is_empty()));
        // Without an error, the wait is kept, bounded the same.
        let mut w = rec();
        w.set_volumes(BTreeMap::from([(
            "default/w".to_string(),
            NodeVolume {
                waiting: "w".repeat(5000),
                ..Default::default()
            },
        )]));
        assert_eq!(
            w.volumes["default/w"].waiting.chars().count(),
            MAX_NODE_ERROR
        );
        let refused = BTreeMap::from([(
            "default/dhv-binder/volumes/x".to_string(),
            "variable dhv-binder/volumes/x in namespace default is not acted on: the record is unsigned".to_string(),
        )]);
        assert!(r.set_refused(&refused));
        assert_eq!(
            r.refusal("default", "dhv-binder/volumes/x"),
            Some("the record is unsigned")
        );
        assert!(r.to_variable().items["record"].len() < 64 * 1024);
        assert_eq!(NodeRecord::from_variable(&r.to_variable()).unwrap(), r);
        // A record written before these fields existed still reads, with none.
        let old = rec();
        let text = serde_json::to_string(&old).unwrap();
        assert!(
            !text.contains("volumes") && !text.contains("refused"),
            "{text}"
        );
        let back: NodeRecord = serde_json::from_str(&text).unwrap();
        assert!(back.volumes.is_empty() && back.refused.is_empty());
    }

    /// A record at every bound (volumes, users, errors, refusals, history) stays within one
    /// Nomad variable (64 KiB); the figure is in docs/records.md ("The node record's size").
    #[test]
    fn a_record_at_every_bound_fits_in_one_variable() {
        let mut r = rec();
        let id = "0b9c6a6e-1111-4222-8333-444455556666";
        let name = |i: usize| format!("namespace-of-length-32-chars-xx/volume-name-{i:03}");
        r.set_volumes(
            (0..MAX_NODE_VOLUMES)
                .map(|i| {
                    (
                        name(i),
                        NodeVolume {
                            state: "unpublishing".into(),
                            since: 1_733_350_000,
                            users: vec![id.to_string(); 4],
                            error: "e".repeat(MAX_NODE_ERROR),
                            claim: "fenced".into(),
                            waiting: "w".repeat(MAX_NODE_ERROR),
                            ungated: vec!["u".repeat(MAX_UNGATED_CHARS + 9); MAX_NODE_UNGATED + 1],
                            used_percent: Some(100),
                            condition: "inaccessible".into(),
                            unused_since: Some(u64::MAX),
                        },
                    )
                })
                .collect(),
        );
        r.set_refused(
            &(0..MAX_NODE_VOLUMES)
                .map(|i| (format!("{}/dhv-binder/volumes/x", name(i)), "r".repeat(500)))
                .collect(),
        );
        let events: Vec<NodeEvent> = (0..MAX_NODE_HISTORY + 5)
            .map(|i| NodeEvent {
                time: 1_733_350_000 + i as u64,
                event: "unpublish".into(),
                alloc_id: id.into(),
                ok: false,
                ms: 123_456,
                detail: String::new(),
            })
            .collect();
        assert!(r.set_history(
            (0..MAX_HISTORY_VOLUMES + 8)
                .map(|i| (name(i), events.clone()))
                .collect()
        ));
        assert_eq!(r.history.len(), MAX_HISTORY_VOLUMES);
        assert!(r.history.values().all(|e| e.len() == MAX_NODE_HISTORY));
        let size = r.to_variable().items["record"].len();
        let history = serde_json::to_string(&r.history).unwrap().len();
        println!("node record at every bound: {size} bytes, {history} of them history");
        assert!(size < 64 * 1024, "{size}");
        assert_eq!(NodeRecord::from_variable(&r.to_variable()).unwrap(), r);
    }

    /// The history keeps each volume's latest events, and the volumes with the latest.
    #[test]
    fn history_keeps_the_latest_events_of_the_latest_volumes() {
        let mut r = rec();
        let ev = |t: u64| NodeEvent {
            time: t,
            event: "publish".into(),
            ok: true,
            ..Default::default()
        };
        let mut h: BTreeMap<String, Vec<NodeEvent>> = (0..MAX_HISTORY_VOLUMES as u64 + 1)
            .map(|i| (format!("default/v{i:02}"), vec![ev(100 + i)]))
            .collect();
        h.insert(
            "default/busy".into(),
            (0..15).map(|t| ev(1000 + t)).collect(),
        );
        h.insert("default/none".into(), Vec::new());
        assert!(r.set_history(h.clone()));
        assert!(!r.set_history(h), "the same history is no change");
        assert_eq!(r.history.len(), MAX_HISTORY_VOLUMES);
        assert!(!r.history.contains_key("default/v00") && !r.history.contains_key("default/v01"));
        assert!(!r.history.contains_key("default/none"));
        let busy = &r.history["default/busy"];
        assert_eq!(busy.len(), MAX_NODE_HISTORY);
        assert_eq!((busy[0].time, busy[9].time), (1005, 1014));
    }

    #[test]
    fn watch_progress_is_no_change_but_a_disconnect_is() {
        let mut r = rec();
        let c = crate::nomad::watch::Counters::default();
        assert!(r.set_watch(&Health::Polling {
            index: 1,
            counters: c.clone()
        }));
        assert!(!r.set_watch(&Health::Polling {
            index: 9,
            counters: c.clone()
        }));
        assert!(r.set_watch(&Health::Disconnected {
            fault: crate::nomad::watch::Fault::Unreachable,
            reason: "connection refused".into(),
            counters: c,
        }));
        assert_eq!(r.watch_error, "connection refused");
    }
}
