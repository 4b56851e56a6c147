//! `dhv-binder alloc status <alloc-id>`: why one allocation's prestart waits or failed, per
//! deferred volume it requests, from what the node that serves it publishes in its node
//! record (the mount's state, what a publish waits for, the last error, a refused record),
//! next to Nomad's view of the allocation and its tasks.
//!
//! Nomad API: `GET /v1/allocation/:id`, `GET /v1/node/:id/allocations` (to find a short ID
//! on the nodes that run dhv-binder), `GET /v1/var/:path`.

use super::output::{short_id, table, OutputArgs};
use super::{Failure, EXIT_FAILED};
use crate::cluster::nodes::{self, NodeRecord};
use crate::config::NomadConfig;
use crate::nomad::types::Allocation;
use crate::nomad::Client;
use crate::volume;
use clap::Subcommand;
use serde::Serialize;
use std::time::Duration;

/// `alloc ...`.
#[derive(Debug, Subcommand)]
pub enum AllocCommand {
    /// Why an allocation's prestart waits or failed: per deferred volume it requests, the
    /// state of the volume on the allocation's node and what the node's agent reports
    /// (a claim another node holds, a missing plugin, the plugin's last error).
    Status {
        /// The allocation's ID, or a unique prefix of it (looked up on the nodes that run
        /// dhv-binder).
        alloc: String,
        #[command(flatten)]
        out: OutputArgs,
    },
}

/// What `alloc status -json` prints.
#[derive(Debug, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct AllocDetail {
    #[serde(rename = "ID")]
    pub id: String,
    pub name: String,
    pub namespace: String,
    #[serde(rename = "JobID")]
    pub job_id: String,
    #[serde(rename = "NodeID")]
    pub node_id: String,
    pub node_name: String,
    pub client_status: String,
    /// Task name → its state (`pending`, `running`, `dead`, `dead (failed)`).
    pub tasks: Vec<(String, String)>,
    pub volumes: Vec<AllocVolume>,
}

/// One deferred volume an allocation requests, as its node reports it.
#[derive(Debug, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct AllocVolume {
    /// `<namespace>/<name>`.
    pub volume: String,
    /// The mount's state on the node, `waiting`, `not mounted`, or `no record` when the
    /// node's agent published none.
    pub state: String,
    /// Why: what the publish waits for, the last error, a refusal of the record; empty when
    /// nothing is wrong.
    pub why: String,
}

/// The volumes `a` requests and what `record` (its node's) says of each; a volume without a
/// dhv-binder record (`has_record` false) is not deferred and is left out.
pub fn volumes_of(
    a: &Allocation,
    record: Option<&NodeRecord>,
    has_record: &dyn Fn(&str) -> bool,
) -> Vec<AllocVolume> {
    let Some(g) = a.group() else {
        return Vec::new();
    };
    let mut names: Vec<&str> = g
        .volumes
        .values()
        .filter(|r| r.volume_type == "host")
        .map(|r| r.source.as_str())
        .filter(|s| has_record(s))
        .collect();
    names.sort_unstable();
    names.dedup();
    names
        .into_iter()
        .map(|name| {
            let key = format!("{}/{name}", a.namespace);
            let Some(n) = record else {
                return AllocVolume {
                    volume: key,
                    state: "no record".into(),
                    why: "the node's dhv-binder published no record: is the system job running there (`dhv-binder node status`)?".into(),
                };
            };
            let refused = n
                .refusal(&a.namespace, &volume::record_path(name))
                .unwrap_or_default();
            let v = n.volumes.get(&key).cloned().unwrap_or_default();
            AllocVolume {
                state: if !v.state.is_empty() {
                    v.state
                } else if !v.waiting.is_empty() {
                    "waiting".into()
                } else {
                    "not mounted".into()
                },
                why: if !refused.is_empty() {
                    format!("the node refuses the volume's record: {refused}")
                } else if !v.waiting.is_empty() {
                    v.waiting
                } else if !v.error.is_empty() {
                    format!("last error: {}", super::output::plugin_text(&v.error))
                } else {
                    String::new()
                },
                volume: key,
            }
        })
        .collect()
}

/// The readable `alloc status`; IDs cut to 8 characters unless `verbose`.
pub fn render(d: &AllocDetail, verbose: bool) -> String {
    let mut out = super::output::kv(&[
        ("ID", short_id(&d.id, verbose)),
        ("Name", d.name.clone()),
        ("Job", d.job_id.clone()),
        (
            "Node",
            format!("{} ({})", d.node_name, short_id(&d.node_id, verbose)),
        ),
        ("Client Status", d.client_status.clone()),
    ]);
    out.push_str("\nTasks\n");
    let rows: Vec<Vec<String>> = d
        .tasks
        .iter()
        .map(|(t, s)| vec![t.clone(), s.clone()])
        .collect();
    out.push_str(&table(&["Task", "State"], &rows, "No task has started"));
    out.push_str("\nDeferred Volumes\n");
    let rows: Vec<Vec<String>> = d
        .volumes
        .iter()
        .map(|v| {
            vec![
                v.volume.clone(),
                v.state.clone(),
                if v.why.is_empty() {
                    "-".into()
                } else {
                    v.why.clone()
                },
            ]
        })
        .collect();
    out.push_str(&table(
        &["Volume", "State On Its Node", "Why"],
        &rows,
        "The allocation requests no dhv-binder volume",
    ));
    out
}

/// The allocation `id` names: read directly when it is a full ID, else found by prefix
/// among the allocations of the nodes that run dhv-binder.
async fn find(client: &Client, id: &str, records: &[NodeRecord]) -> Result<Allocation, Failure> {
    if volume::is_alloc_id(id) {
        return client
            .allocation(id)
            .await?
            .ok_or_else(|| Failure::new(EXIT_FAILED, format!("Nomad has no allocation {id}")));
    }
    let mut found: Vec<Allocation> = Vec::new();
    for r in records {
        let (allocs, _) = client
            .node_allocations(&r.node_id, 0, Duration::ZERO)
            .await?;
        found.extend(allocs.value.into_iter().filter(|a| a.id.starts_with(id)));
    }
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(Failure::new(
            EXIT_FAILED,
            format!("no allocation on a node running dhv-binder has the ID prefix {id:?}: give the full ID"),
        )),
        n => Err(Failure::new(
            EXIT_FAILED,
            format!("the ID prefix {id:?} matches {n} allocations: give more of the ID"),
        )),
    }
}

/// Runs an `alloc` subcommand.
pub async fn alloc_cmd(nomad: &NomadConfig, cmd: AllocCommand) -> Result<(), Failure> {
    let AllocCommand::Status { alloc, out } = cmd;
    let client = Client::new(nomad)?;
    let (records, bad) = nodes::list(&client).await?;
    for e in bad {
        eprintln!("warning: {e}");
    }
    let a = find(&client, &alloc, &records).await?;
    let record = records.iter().find(|r| *r.node_id == *a.node_id);
    let mut deferred = std::collections::BTreeSet::new();
    if let Some(g) = a.group() {
        for r in g.volumes.values().filter(|r| r.volume_type == "host") {
            if client
                .variable(&a.namespace, &volume::record_path(&r.source))
                .await?
                .is_some()
            {
                deferred.insert(r.source.clone());
            }
        }
    }
    let volumes = volumes_of(&a, record, &|s| deferred.contains(s));
    let mut tasks: Vec<(String, String)> = a
        .task_states
        .iter()
        .map(|(t, s)| {
            (
                t.to_string(),
                if s.failed {
                    format!("{} (failed)", s.state)
                } else {
                    s.state.to_string()
                },
            )
        })
        .collect();
    tasks.sort();
    let d = AllocDetail {
        node_name: record.map(|r| r.node_name.clone()).unwrap_or_default(),
        id: a.id.to_string(),
        name: a.name.into(),
        namespace: a.namespace.into(),
        job_id: a.job_id.into(),
        node_id: a.node_id.to_string(),
        client_status: a.client_status.into(),
        tasks,
        volumes,
    };
    let verbose = out.verbose;
    out.print(&d, |d| render(d, verbose))
}
