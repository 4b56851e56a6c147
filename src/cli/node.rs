//! `dhv-binder node status`: every node running dhv-binder, from the records the agents
//! publish (see [`crate::cluster::nodes`]); a node not seen for a while is shown as stale.

use super::output::{ago, now_unix, table, OutputArgs};
use super::Failure;
use crate::cluster::nodes::{self, Liveness, NodeRecord};
use crate::config::NomadConfig;
use crate::nomad::Client;
use clap::Subcommand;
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// List the nodes whose dhv-binder published a record: pool, agent version, watch
    /// health, plugins, last seen.
    Status {
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
                        },
                    )
                })
                .collect(),
            refused: r.refused,
        }
    }
}

/// The readable `node status`, at `now` (Unix seconds).
pub fn render(list: &[NodeStatus], now: u64) -> String {
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
                    } else if let (Some(n), Some(max)) = (p.attached, p.max_volumes) {
                        format!("{id}({n}/{max} attached)")
                    } else {
                        id.clone()
                    }
                })
                .collect();
            vec![
                r.node_id.chars().take(8).collect(),
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
    let NodeCommand::Status { out } = cmd;
    let client = Client::new(nomad)?;
    let (records, bad) = nodes::list(&client).await?;
    for e in bad {
        eprintln!("warning: {e}");
    }
    let now = now_unix();
    let list: Vec<NodeStatus> = records
        .into_iter()
        .map(|r| NodeStatus::of(r, now))
        .collect();
    out.print(&list, |l| render(l, now))
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
        let s = render(&list, now);
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
        assert_eq!(render(&[], now).lines().count(), 1);
    }
}
