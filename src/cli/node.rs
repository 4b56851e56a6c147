//! `dhv-binder node status [node]`: every node running dhv-binder, or one node's agent,
//! plugins (with the operations they declare), volumes and claims, from the records the
//! agents publish (see [`crate::cluster::nodes`]); a node not seen for a while is shown as
//! stale.

use super::output::{ago, kv, now_unix, short_id, table, OutputArgs};
use super::{Failure, EXIT_FAILED};
use crate::cluster::nodes::{self, Liveness, NodeRecord};
use crate::config::NomadConfig;
use crate::nomad::Client;
use clap::Subcommand;
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// List the nodes whose dhv-binder published a record: pool, agent version, watch
    /// health, plugins, last seen. Given a node (name, ID or ID prefix): its agent, its
    /// plugins with the operations they declare, its volumes and claims.
    Status {
        /// One node: its name, or its ID or a unique prefix of it.
        node: Option<String>,
        #[command(flatten)]
        out: OutputArgs,
    },
}

/// One node in `node status -json`: its record under Nomad's names (as Nomad's node stub:
/// `ID`, `Name`, `NodePool`), times as RFC 3339 strings, and what the CLI concluded
/// (`Stale`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct NodeStatus {
    #[serde(rename = "ID")]
    pub node_id: String,
    #[serde(rename = "Name")]
    pub node_name: String,
    pub node_pool: String,
    /// The dhv-binder version of the node's agent.
    pub agent_version: String,
    /// Plugin ID to what the node knows of it.
    pub plugins: BTreeMap<String, PluginOut>,
    /// The allocation watch: `listing`, `polling`, `streaming` or `disconnected`.
    pub watch: String,
    pub watch_error: String,
    pub heartbeat_secs: u64,
    /// The agent's last write (its clock); Unix seconds here, RFC 3339 in `-json`.
    #[serde(serialize_with = "super::output::ser_rfc3339")]
    pub last_seen: u64,
    /// Not rewritten for three heartbeats.
    pub stale: bool,
    /// The volumes the node has mounted or is working on, `<namespace>/<name>` → state.
    pub volumes: BTreeMap<String, NodeVolumeOut>,
    /// Records the node refuses, `<namespace>/<path>` → why.
    pub refused: BTreeMap<String, String>,
}

/// A plugin on a node, in `node status -json`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct PluginOut {
    pub version: String,
    pub deferred_bind: bool,
    pub healthy: bool,
    pub error: String,
    /// The optional operations the plugin declares; `null` when the agent does not say.
    pub capabilities: Option<Vec<String>>,
    /// Its volumes attached on the node, and the node's limit (`null` when unlimited).
    pub attached: Option<u64>,
    pub max_volumes: Option<u32>,
    /// The plugin's fingerprint `topology` (segment → value); empty when it reports none.
    pub topology: crate::volume::topology::Segments,
}

/// A volume on a node, in `node status -json`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct NodeVolumeOut {
    pub state: String,
    #[serde(serialize_with = "super::output::ser_rfc3339")]
    pub since: u64,
    /// Allocation IDs using it (the first 4).
    pub users: Vec<String>,
    pub error: String,
    /// The node's claim on it: `held`, `fenced`, `lost`, or empty.
    pub claim: String,
    /// Why a publish of it waits on the node, or empty.
    pub waiting: String,
}

impl NodeStatus {
    /// The output form of a record, stale or live at `now` (Unix seconds).
    pub fn of(r: NodeRecord, now: u64) -> Self {
        NodeStatus {
            stale: r.liveness(now) == Liveness::Stale,
            node_id: r.node_id,
            node_name: r.node_name,
            node_pool: r.node_pool,
            agent_version: r.agent_version,
            plugins: r
                .plugins
                .into_iter()
                .map(|(id, p)| {
                    let attach = r.attach.get(&id);
                    let out = PluginOut {
                        version: p.version,
                        deferred_bind: p.deferred_bind,
                        healthy: p.healthy,
                        error: p.error,
                        capabilities: p.capabilities,
                        attached: attach.map(|a| a.attached),
                        max_volumes: attach.map(|a| a.max_volumes),
                        topology: p.topology,
                    };
                    (id, out)
                })
                .collect(),
            watch: r.watch,
            watch_error: r.watch_error,
            heartbeat_secs: r.heartbeat_secs,
            last_seen: r.last_seen,
            volumes: r
                .volumes
                .into_iter()
                .map(|(k, v)| {
                    (
                        k,
                        NodeVolumeOut {
                            state: v.state,
                            since: v.since,
                            users: v.users,
                            error: v.error,
                            claim: v.claim,
                            waiting: v.waiting,
                        },
                    )
                })
                .collect(),
            refused: r.refused,
        }
    }
}

/// The readable `node status <node>`: the agent, its plugins with the operations they
/// declare, its volumes with their claims, the records it refuses; IDs cut to 8 characters
/// unless `verbose`. `now` in Unix seconds.
pub fn render_one(n: &NodeStatus, now: u64, verbose: bool) -> String {
    let dash = |s: &str| {
        if s.is_empty() {
            "-".to_string()
        } else {
            s.to_string()
        }
    };
    let mut out = kv(&[
        ("ID", short_id(&n.node_id, verbose)),
        ("Name", n.node_name.clone()),
        ("Node Pool", n.node_pool.clone()),
        ("Agent Version", n.agent_version.clone()),
        (
            "Status",
            if n.stale {
                "stale (no record written for 3 heartbeats: is its agent running?)".into()
            } else if n.watch == "disconnected" {
                format!("disconnected: {}", n.watch_error)
            } else {
                n.watch.clone()
            },
        ),
        (
            "Last Seen",
            match super::output::rfc3339(n.last_seen) {
                Some(t) => format!("{t} ({})", ago(n.last_seen, now)),
                None => "-".into(),
            },
        ),
    ]);
    out.push_str("\nPlugins\n");
    let rows: Vec<Vec<String>> = n
        .plugins
        .iter()
        .map(|(id, p)| {
            vec![
                id.clone(),
                dash(&p.version),
                if p.deferred_bind { "yes" } else { "no" }.into(),
                if p.healthy {
                    "yes".into()
                } else {
                    format!("no: {}", p.error)
                },
                match &p.capabilities {
                    None => "(not reported by this agent)".into(),
                    Some(c) if c.is_empty() => "(none beyond create/publish)".into(),
                    Some(c) => c.join(","),
                },
            ]
        })
        .collect();
    out.push_str(&table(
        &["ID", "Version", "Deferred", "Healthy", "Operations"],
        &rows,
        "No plugins",
    ));
    out.push_str("\nVolumes\n");
    let rows: Vec<Vec<String>> = n
        .volumes
        .iter()
        .map(|(k, v)| {
            vec![
                k.clone(),
                if !v.state.is_empty() {
                    v.state.clone()
                } else if !v.waiting.is_empty() {
                    "waiting".into()
                } else {
                    "not mounted".into()
                },
                match super::output::rfc3339(v.since) {
                    Some(_) => ago(v.since, now),
                    None => "-".into(),
                },
                dash(&v.claim),
                dash(
                    &v.users
                        .iter()
                        .map(|u| short_id(u, verbose))
                        .collect::<Vec<_>>()
                        .join(","),
                ),
                dash(&if !v.waiting.is_empty() {
                    v.waiting.clone()
                } else {
                    super::output::plugin_text(&v.error)
                }),
            ]
        })
        .collect();
    out.push_str(&table(
        &["Volume", "State", "Since", "Claim", "Allocations", "Why"],
        &rows,
        "No volumes on this node",
    ));
    if !n.refused.is_empty() {
        out.push_str("\nRefused Records\n");
        let rows: Vec<Vec<String>> = n
            .refused
            .iter()
            .map(|(k, why)| vec![k.clone(), why.clone()])
            .collect();
        out.push_str(&table(&["Record", "Why"], &rows, ""));
    }
    out
}

/// The readable `node status`, at `now` (Unix seconds); IDs cut to 8 characters unless
/// `verbose`.
pub fn render(list: &[NodeStatus], now: u64, verbose: bool) -> String {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|r| {
            let plugins: Vec<String> = r
                .plugins
                .iter()
                .map(|(id, p)| {
                    if !p.healthy {
                        format!("{id}(unhealthy)")
                    } else if !p.deferred_bind {
                        format!("{id}(not deferred)")
                    } else {
                        // The attach count and the topology, when the plugin has them.
                        let mut said = Vec::new();
                        if let (Some(n), Some(max)) = (p.attached, p.max_volumes) {
                            said.push(format!("{n}/{max} attached"));
                        }
                        if !p.topology.is_empty() {
                            said.push(crate::volume::topology::show(&p.topology));
                        }
                        if said.is_empty() {
                            id.clone()
                        } else {
                            format!("{id}({})", said.join(", "))
                        }
                    }
                })
                .collect();
            vec![
                short_id(&r.node_id, verbose),
                r.node_name.clone(),
                r.node_pool.clone(),
                r.agent_version.clone(),
                if r.stale {
                    "stale".into()
                } else if r.watch == "disconnected" {
                    format!("disconnected: {}", r.watch_error)
                } else {
                    r.watch.clone()
                },
                if plugins.is_empty() {
                    "-".into()
                } else {
                    plugins.join(",")
                },
                ago(r.last_seen, now),
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "Name",
            "Pool",
            "Version",
            "Status",
            "Plugins",
            "Last Seen",
        ],
        &rows,
        "No node has published a dhv-binder record (is the system job running?)",
    )
}

/// Runs a `node` subcommand.
pub async fn node_cmd(nomad: &NomadConfig, cmd: NodeCommand) -> Result<(), Failure> {
    let NodeCommand::Status { node, out } = cmd;
    let client = Client::new(nomad)?;
    let (records, bad) = nodes::list(&client).await?;
    for e in bad {
        eprintln!("warning: {e}");
    }
    let now = now_unix();
    let verbose = out.verbose;
    let list: Vec<NodeStatus> = records
        .into_iter()
        .map(|r| NodeStatus::of(r, now))
        .collect();
    let Some(want) = node else {
        return out.print(&list, |l| render(l, now, verbose));
    };
    let mut found: Vec<NodeStatus> = list
        .into_iter()
        .filter(|n| n.node_name == want || n.node_id.starts_with(&want))
        .collect();
    match found.len() {
        1 => {
            let n = found.remove(0);
            out.print(&n, |n| render_one(n, now, verbose))
        }
        0 => Err(Failure::new(
            EXIT_FAILED,
            format!("no dhv-binder node record has the name or ID prefix {want:?} (`dhv-binder node status` lists them)"),
        )),
        _ => Err(Failure::new(
            EXIT_FAILED,
            format!(
                "{want:?} matches {} nodes ({}): give more of the ID",
                found.len(),
                found
                    .iter()
                    .map(|n| format!("{} {}", n.node_name, n.node_id))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_status_shows_each_node_and_marks_stale_ones() {
        let now = 1010;
        let list: Vec<NodeStatus> = crate::cli::plugin::tests::records()
            .into_iter()
            .map(|r| NodeStatus::of(r, now))
            .collect();
        let s = render(&list, now, false);
        let v = env!("CARGO_PKG_VERSION");
        assert_eq!(
            s,
            format!(
                "\
ID        Name    Pool     Version  Status   Plugins              Last Seen
aaaaaaaa  node-1  default  {v}    listing  bind                 10s ago
bbbbbbbb  node-2  gpu      {v}    stale    bind,nfs(unhealthy)  3m30s ago
"
            )
        );
        let j = serde_json::to_value(&list).unwrap();
        assert_eq!(j[1]["Stale"], true);
        assert_eq!(j[0]["Name"], "node-1");
        assert_eq!(j[0]["ID"], "aaaaaaaa-1111-4222-8333-444455556666");
        assert_eq!(j[0]["Plugins"]["bind"]["DeferredBind"], true);
        assert_eq!(j[0]["LastSeen"], "1970-01-01T00:16:40Z");
        assert!(j[0].get("node_name").is_none(), "{j}");
        assert_eq!(render(&[], now, false).lines().count(), 1);
        // Issue 46: -verbose gives full IDs.
        assert!(render(&list, now, true).contains("aaaaaaaa-1111-4222-8333-444455556666  node-1"));
    }
}
