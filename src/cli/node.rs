//! `dhv-binder node status`: every node running dhv-binder, from the records the agents
//! publish (see [`crate::cluster::nodes`]); a node not seen for a while is shown as stale.

use super::output::{ago, now_unix, table, OutputArgs};
use super::Failure;
use crate::cluster::nodes::{self, Liveness, NodeRecord};
use crate::config::NomadConfig;
use crate::nomad::Client;
use clap::Subcommand;
use serde::Serialize;

#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// List the nodes whose dhv-binder published a record: pool, agent version, watch
    /// health, plugins, last seen.
    Status {
        #[command(flatten)]
        out: OutputArgs,
    },
}

/// One node in `node status -json`: the record plus what the CLI concluded.
#[derive(Debug, Serialize)]
pub struct NodeStatus {
    #[serde(flatten)]
    pub record: NodeRecord,
    pub stale: bool,
}

/// The readable `node status`, at `now` (Unix seconds).
pub fn render(list: &[NodeStatus], now: u64) -> String {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|n| {
            let r = &n.record;
            let plugins: Vec<String> = r
                .plugins
                .iter()
                .map(|(id, p)| {
                    if !p.healthy {
                        format!("{id}(unhealthy)")
                    } else if !p.deferred_bind {
                        format!("{id}(not deferred)")
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
                if n.stale {
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
        .map(|record| NodeStatus {
            stale: record.liveness(now) == Liveness::Stale,
            record,
        })
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
            .map(|record| NodeStatus {
                stale: record.liveness(now) == Liveness::Stale,
                record,
            })
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
        assert_eq!(j[1]["stale"], true);
        assert_eq!(j[0]["node_name"], "node-1");
        assert_eq!(j[0]["plugins"]["bind"]["deferred_bind"], true);
        assert_eq!(render(&[], now).lines().count(), 1);
    }
}
