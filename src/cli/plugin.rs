//! `dhv-binder plugin check` (the conformance kit) and `dhv-binder plugin status [id]` (which
//! nodes have which plugin, from the node records in [`crate::cluster::nodes`]).

use super::output::{ago, kv, now_unix, table, OutputArgs};
use super::{Failure, EXIT_CONFIG, EXIT_FAILED};
use crate::cluster::nodes::{self, Liveness, NodeRecord};
use crate::config::NomadConfig;
use crate::nomad::Client;
use clap::Subcommand;
use serde::Serialize;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Run a plugin through the protocol in a scratch directory (the conformance kit) and
    /// report each rule with its evidence. Exits 1 if any rule fails. Mounts: run as root.
    Check {
        /// The plugin executable (its file name is the plugin ID).
        executable: PathBuf,
        /// A parameter of the test volume (DHV_PARAMETERS), KEY=VALUE; repeatable.
        #[arg(long = "param", value_parser = key_value)]
        params: Vec<(String, String)>,
        /// File of the test volume's secrets (DHV_SECRETS), one KEY=VALUE per line. Secrets
        /// never go on the command line (other users on the node can read it in /proc).
        #[arg(long = "secrets-file")]
        secrets_file: Option<PathBuf>,
        /// The test volume's secrets, one KEY=VALUE per line, from the environment (the
        /// same format as --secrets-file).
        #[arg(
            long = "secrets-env",
            env = "DHV_BINDER_CHECK_SECRETS",
            hide_env_values = true,
            hide = true
        )]
        secrets_env: Option<String>,
        /// Capacity of the test volume in bytes (DHV_CAPACITY_MIN/MAX_BYTES).
        #[arg(long, default_value_t = 64 << 20)]
        capacity: u64,
        /// Timeout of each call, as the agent's --plugin-timeout.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Scratch directory (default: a new one under the temporary directory, removed after).
        #[arg(long)]
        scratch: Option<PathBuf>,
        /// A directory the plugin may touch on the test node, as the agent's
        /// `--plugin-root <plugin_id>=<dir>` (DHV_ALLOWED_ROOTS), besides the scratch volumes
        /// dir and the absolute paths given as parameters; repeatable.
        #[arg(long = "plugin-root")]
        roots: Vec<PathBuf>,
        /// A directory on the cgroup v2 filesystem the kit makes its scratch cgroups under
        /// (the caller's and the helpers', for the rule `helper outlives the caller`);
        /// default: the cgroup2 mount. They are removed afterwards.
        #[arg(long)]
        cgroup: Option<PathBuf>,
        /// Run only this rule (repeatable), with the steps it needs (fingerprint, one create,
        /// one delete): e.g. `-rule 'symlink race'`. The report does not judge `deferred`.
        #[arg(long = "rule", value_name = "RULE")]
        rules: Vec<String>,
        /// A rule that does not apply to this plugin (repeatable): not run, shown as skipped
        /// in the summary. Any other rule that cannot run with what the kit was given (no
        /// `--param` naming the storage directory, no uid/gid/mode, no http(s) URL) fails.
        #[arg(long = "skip", value_name = "RULE")]
        skip: Vec<String>,
    },
    /// List plugins across the cluster (nodes with each, healthy, deferred), or with an ID,
    /// that plugin on every node (like `nomad plugin status`).
    Status {
        /// A plugin ID; without it, one line per plugin.
        id: Option<String>,
        #[command(flatten)]
        out: OutputArgs,
    },
}

/// Parses `KEY=VALUE` lines (blank lines and `#` comments skipped); `what` names the source
/// in errors (never a value).
fn key_value_lines(text: &str, what: &str) -> Result<Vec<(String, String)>, Failure> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .map(|(n, l)| {
            l.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.to_string()))
                .filter(|(k, _)| !k.is_empty())
                .ok_or_else(|| {
                    Failure::new(
                        EXIT_CONFIG,
                        format!("{what} line {}: expected KEY=VALUE", n + 1),
                    )
                })
        })
        .collect()
}

/// Secrets given off the command line: `KEY=VALUE` lines of `file` (`--secrets-file`), then
/// of `env`, the text of the environment variable named `env_name`.
pub(super) fn secrets_from(
    file: Option<&std::path::Path>,
    env: Option<&str>,
    env_name: &str,
) -> Result<Vec<(String, String)>, Failure> {
    let mut secrets = Vec::new();
    if let Some(f) = file {
        let text = std::fs::read_to_string(f)
            .map_err(|e| Failure::new(EXIT_CONFIG, format!("cannot read {}: {e}", f.display())))?;
        secrets.extend(key_value_lines(&text, &f.display().to_string())?);
    }
    if let Some(text) = env {
        secrets.extend(key_value_lines(text, env_name)?);
    }
    Ok(secrets)
}

/// Parses a `KEY=VALUE` flag value (`--param`).
pub(super) fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))
}

/// One plugin across the cluster (`plugin status -json`), under the names of Nomad's plugin
/// stub (`ID`, `NodesHealthy`, `NodesExpected`).
#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "PascalCase")]
pub struct PluginSummary {
    #[serde(rename = "ID")]
    pub id: String,
    /// Versions seen, sorted; more than one during a rollout.
    pub versions: Vec<String>,
    pub deferred_bind: bool,
    /// The optional operations (`snapshot`, `clone`, `expand`, `fence_node`, ...) any node
    /// reports it declares, sorted; `create`, `delete`, `publish` and `unpublish` are
    /// every plugin's.
    pub operations: Vec<String>,
    /// Live nodes where it fingerprinted healthy.
    pub nodes_healthy: usize,
    /// Nodes that report it (live or stale).
    pub nodes_expected: usize,
}

/// One node's copy of a plugin (`plugin status <id> -json`), under Nomad's names (`NodeID`),
/// `LastSeen` as an RFC 3339 string.
#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "PascalCase")]
pub struct PluginOnNode {
    #[serde(rename = "NodeID")]
    pub node_id: String,
    pub node_name: String,
    pub node_pool: String,
    pub version: String,
    pub deferred_bind: bool,
    pub healthy: bool,
    pub error: String,
    pub stale: bool,
    /// The node's last record write (its clock); Unix seconds here, RFC 3339 in `-json`.
    #[serde(serialize_with = "super::output::ser_rfc3339")]
    pub last_seen: u64,
}

/// One line per plugin ID known to any node.
pub fn summarize(records: &[NodeRecord], now: u64) -> Vec<PluginSummary> {
    let mut out: std::collections::BTreeMap<String, PluginSummary> = Default::default();
    for r in records {
        let live = r.liveness(now) == Liveness::Live;
        for (id, p) in &r.plugins {
            let s = out.entry(id.clone()).or_insert_with(|| PluginSummary {
                id: id.clone(),
                versions: Vec::new(),
                deferred_bind: false,
                operations: Vec::new(),
                nodes_healthy: 0,
                nodes_expected: 0,
            });
            s.nodes_expected += 1;
            if live && p.healthy {
                s.nodes_healthy += 1;
            }
            s.deferred_bind |= p.deferred_bind;
            for c in p.capabilities.iter().flatten() {
                if !s.operations.contains(c) {
                    s.operations.push(c.clone());
                    s.operations.sort();
                }
            }
            if !p.version.is_empty() && !s.versions.contains(&p.version) {
                s.versions.push(p.version.clone());
                s.versions.sort();
            }
        }
    }
    out.into_values().collect()
}

/// Every node's copy of plugin `id`.
pub fn on_nodes(records: &[NodeRecord], id: &str, now: u64) -> Vec<PluginOnNode> {
    records
        .iter()
        .filter_map(|r| {
            r.plugins.get(id).map(|p| PluginOnNode {
                node_id: r.node_id.clone(),
                node_name: r.node_name.clone(),
                node_pool: r.node_pool.clone(),
                version: p.version.clone(),
                deferred_bind: p.deferred_bind,
                healthy: p.healthy,
                error: p.error.clone(),
                stale: r.liveness(now) == Liveness::Stale,
                last_seen: r.last_seen,
            })
        })
        .collect()
}

/// The readable `plugin status`.
pub fn render_summary(list: &[PluginSummary]) -> String {
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|p| {
            vec![
                p.id.clone(),
                if p.versions.is_empty() {
                    "-".into()
                } else {
                    p.versions.join(",")
                },
                if p.deferred_bind { "yes" } else { "no" }.into(),
                if p.operations.is_empty() {
                    "-".into()
                } else {
                    p.operations.join(",")
                },
                format!("{}/{}", p.nodes_healthy, p.nodes_expected),
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "Version",
            "Deferred",
            "Operations",
            "Nodes Healthy/Expected",
        ],
        &rows,
        "No plugins reported by any node",
    )
}

/// The readable `plugin status <id>`, at `now` (Unix seconds).
pub fn render_detail(id: &str, nodes: &[PluginOnNode], now: u64) -> String {
    let healthy = nodes.iter().filter(|n| n.healthy && !n.stale).count();
    let mut versions: Vec<&str> = nodes
        .iter()
        .map(|n| n.version.as_str())
        .filter(|v| !v.is_empty())
        .collect();
    versions.sort_unstable();
    versions.dedup();
    let mut s = kv(&[
        ("ID", id.to_string()),
        (
            "Versions",
            if versions.is_empty() {
                "-".into()
            } else {
                versions.join(", ")
            },
        ),
        (
            "Deferred",
            if nodes.iter().any(|n| n.deferred_bind) {
                "yes"
            } else {
                "no"
            }
            .into(),
        ),
        ("Nodes Healthy", healthy.to_string()),
        ("Nodes Expected", nodes.len().to_string()),
    ]);
    s.push_str("\nNodes\n");
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            vec![
                n.node_id.chars().take(8).collect(),
                n.node_name.clone(),
                n.node_pool.clone(),
                if n.version.is_empty() {
                    "-".into()
                } else {
                    n.version.clone()
                },
                if n.deferred_bind { "yes" } else { "no" }.into(),
                if n.stale {
                    "stale".into()
                } else if n.healthy {
                    "healthy".into()
                } else {
                    format!("unhealthy: {}", n.error)
                },
                ago(n.last_seen, now),
            ]
        })
        .collect();
    s.push_str(&table(
        &[
            "Node ID",
            "Name",
            "Pool",
            "Version",
            "Deferred",
            "Health",
            "Last Seen",
        ],
        &rows,
        "No node reports this plugin",
    ));
    s
}

/// Runs a `plugin` subcommand.
pub async fn plugin_cmd(nomad: &NomadConfig, cmd: PluginCommand) -> Result<(), Failure> {
    match cmd {
        PluginCommand::Check {
            executable,
            params,
            secrets_file,
            secrets_env,
            capacity,
            timeout,
            scratch,
            roots,
            cgroup,
            rules,
            skip,
        } => {
            let secrets = secrets_from(
                secrets_file.as_deref(),
                secrets_env.as_deref(),
                "DHV_BINDER_CHECK_SECRETS",
            )?;
            let report = crate::conformance::check(crate::conformance::Options {
                plugin: executable,
                parameters: params.into_iter().collect(),
                secrets: secrets.into_iter().collect(),
                capacity,
                timeout,
                scratch,
                roots,
                cgroup,
                only: rules,
                skip,
            })
            .await
            .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
            print!("{report}");
            if report.passed() {
                Ok(())
            } else {
                Err(Failure::new(
                    EXIT_FAILED,
                    "the plugin does not conform (see the FAIL lines above)",
                ))
            }
        }
        PluginCommand::Status { id, out } => {
            let client = Client::new(nomad)?;
            let (records, bad) = nodes::list(&client).await?;
            for e in bad {
                eprintln!("warning: {e}");
            }
            let now = now_unix();
            match id {
                None => out.print(&summarize(&records, now), |l| render_summary(l)),
                Some(id) => {
                    let list = on_nodes(&records, &id, now);
                    if list.is_empty() && !out.json {
                        return Err(Failure::new(
                            EXIT_FAILED,
                            format!("no node reports plugin {id:?} (see `dhv-binder plugin status` for the plugins nodes have)"),
                        ));
                    }
                    out.print(&list, |l| render_detail(&id, l, now))
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::cluster::nodes::PluginInfo;

    pub(crate) fn records() -> Vec<NodeRecord> {
        let mut a = NodeRecord::new("aaaaaaaa-1111-4222-8333-444455556666", "node-1", "default");
        a.plugins.insert(
            "bind".into(),
            PluginInfo {
                version: "0.2.0".into(),
                deferred_bind: true,
                healthy: true,
                error: String::new(),
                capabilities: None,
                topology: Default::default(),
            },
        );
        a.last_seen = 1000;
        let mut b = NodeRecord::new("bbbbbbbb-1111-4222-8333-444455556666", "node-2", "gpu");
        b.plugins.insert(
            "bind".into(),
            PluginInfo {
                version: "0.1.0".into(),
                deferred_bind: true,
                healthy: true,
                error: String::new(),
                capabilities: None,
                topology: Default::default(),
            },
        );
        b.plugins.insert(
            "nfs".into(),
            PluginInfo {
                error: "fingerprint: exit 2".into(),
                ..Default::default()
            },
        );
        b.last_seen = 800;
        vec![a, b]
    }

    #[test]
    fn plugin_status_lists_each_plugin_with_healthy_over_expected_nodes() {
        let l = summarize(&records(), 1010);
        let s = render_summary(&l);
        assert_eq!(
            s,
            "\
ID    Version      Deferred  Operations  Nodes Healthy/Expected
bind  0.1.0,0.2.0  yes       -           1/2
nfs   -            no        -           0/1
"
        );
        let j = serde_json::to_value(&l).unwrap();
        assert_eq!(j[0]["ID"], "bind");
        assert_eq!(j[0]["NodesHealthy"], 1);
        assert_eq!(render_summary(&[]), "No plugins reported by any node\n");
    }

    #[test]
    fn plugin_status_of_one_plugin_shows_every_node_and_stale_ones_as_such() {
        let now = 1010;
        let l = on_nodes(&records(), "bind", now);
        let s = render_detail("bind", &l, now);
        assert_eq!(
            s,
            "\
ID             = bind
Versions       = 0.1.0, 0.2.0
Deferred       = yes
Nodes Healthy  = 1
Nodes Expected = 2

Nodes
Node ID   Name    Pool     Version  Deferred  Health   Last Seen
aaaaaaaa  node-1  default  0.2.0    yes       healthy  10s ago
bbbbbbbb  node-2  gpu      0.1.0    yes       stale    3m30s ago
"
        );
        let j = serde_json::to_value(&l).unwrap();
        assert_eq!(j[1]["Stale"], true);
        assert_eq!(j[1]["NodeID"], "bbbbbbbb-1111-4222-8333-444455556666");
        assert_eq!(j[1]["LastSeen"], "1970-01-01T00:13:20Z");
    }
}
