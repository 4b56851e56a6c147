//! `dhv-binder volume orphans --plugin ID`: the orphan report. A plugin installed on this
//! machine is asked what its storage holds (optional operation `list`, capability "list",
//! docs/plugin-protocol.md), once per distinct `parameters` among the plugin's volume
//! records (an export, an image directory, a pool), and the answers are compared with the
//! records: storage that no record names (left by a delete that did not finish, a record
//! removed by hand), and records whose storage is gone (removed behind dhv-binder's back).
//! Nothing is changed.

use super::super::output::{table, OutputArgs};
use super::super::storage::LocalPlugins;
use super::super::{Failure, EXIT_CONFIG, EXIT_FAILED};
use crate::escape::escape_control;
use crate::nomad::Client;
use crate::storage::plugin::{Operation, Runner};
use crate::storage::volume_health::ListResult;
use crate::volume::{self, VolumeRecord, VolumeState};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

/// The arguments of `volume orphans`.
#[derive(Debug, clap::Args)]
pub struct OrphanArgs {
    /// The plugin to ask, installed on this machine (capability "list").
    #[arg(long)]
    pub plugin: String,
    /// File of secrets for the plugin's `list` (DHV_SECRETS), one KEY=VALUE per line.
    /// Secrets never go on the command line (other users can read it in /proc).
    #[arg(long = "secrets-file")]
    pub secrets_file: Option<PathBuf>,
    /// The same, from the environment (KEY=VALUE lines).
    #[arg(
        long = "secrets-env",
        env = "DHV_BINDER_ORPHAN_SECRETS",
        hide_env_values = true,
        hide = true
    )]
    pub secrets_env: Option<String>,
    /// A directory the plugin keeps storage under on this machine, as the agent's
    /// `--plugin-root <plugin_id>=<dir>` (DHV_ALLOWED_ROOTS); repeatable.
    #[arg(long = "plugin-root")]
    pub roots: Vec<PathBuf>,
    #[command(flatten)]
    pub local: LocalPlugins,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// One finding of the orphan report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct Orphan {
    /// `storage-without-record` or `record-without-storage`.
    pub kind: String,
    /// The volume ID (the storage's name for it).
    #[serde(rename = "ID")]
    pub id: String,
    /// The record's namespace and name; empty for storage without a record.
    pub volume: String,
    /// Bytes the storage says it holds (0 when it does not say, or for a record).
    pub bytes: u64,
    /// The parameters the plugin was asked with (JSON).
    pub parameters: String,
}

/// What the records of one parameter set are, and what the plugin listed for it.
pub struct Group<'a> {
    /// The parameters, as JSON.
    pub parameters: String,
    /// The plugin's records with these parameters.
    pub records: Vec<&'a VolumeRecord>,
    /// What `list` answered: ID → bytes.
    pub listed: BTreeMap<String, u64>,
}

/// The findings, from every group and every record of the plugin (`all_ids`: any record's
/// ID, whatever its parameters: storage one of them names is not an orphan). A record
/// whose storage is missing counts only when it is `ready` and was created by dhv-binder (a
/// pending or deleting one may have none yet or any more; a registered one's storage lies
/// where the operator put it).
pub fn findings(groups: &[Group<'_>], all_ids: &BTreeSet<String>) -> Vec<Orphan> {
    let mut out = Vec::new();
    for g in groups {
        for (id, bytes) in &g.listed {
            if !all_ids.contains(id) {
                out.push(Orphan {
                    kind: "storage-without-record".into(),
                    id: id.clone(),
                    volume: String::new(),
                    bytes: *bytes,
                    parameters: g.parameters.clone(),
                });
            }
        }
        for r in &g.records {
            if r.state == VolumeState::Ready && !r.registered && !g.listed.contains_key(&r.id) {
                out.push(Orphan {
                    kind: "record-without-storage".into(),
                    id: r.id.clone(),
                    volume: r.key().to_string(),
                    bytes: 0,
                    parameters: g.parameters.clone(),
                });
            }
        }
    }
    out
}

/// The readable report.
pub fn render(rows: &[Orphan]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|o| {
            vec![
                o.kind.clone(),
                o.id.clone(),
                if o.volume.is_empty() {
                    "-".into()
                } else {
                    o.volume.clone()
                },
                if o.bytes == 0 {
                    "-".into()
                } else {
                    o.bytes.to_string()
                },
                escape_control(&o.parameters),
            ]
        })
        .collect();
    table(
        &["Kind", "ID", "Volume", "Bytes", "Parameters"],
        &rows,
        "No orphans: every volume the storage lists has a record, and every ready record's storage is listed",
    )
}

/// `volume orphans`: the records of `args.plugin` in `ns` (`*`: every namespace), the
/// plugin's `list` per parameter set (storage it places in another namespace is left out),
/// and the findings.
pub async fn orphans(client: &Client, ns: &str, args: OrphanArgs) -> Result<(), Failure> {
    let plugin = args.plugin.as_str();
    let secrets: BTreeMap<String, String> = super::super::plugin::secrets_from(
        args.secrets_file.as_deref(),
        args.secrets_env.as_deref(),
        "DHV_BINDER_ORPHAN_SECRETS",
    )?
    .into_iter()
    .collect();
    let roots: Vec<String> = args
        .roots
        .iter()
        .map(|r| format!("{plugin}={}", r.display()))
        .collect();
    let roots = crate::storage::plugin::allowed_roots(&roots)
        .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
    let runner =
        Runner::new(&args.local.plugin_dir, Duration::from_secs(60)).with_allowed_roots(roots);
    let fp = runner
        .fingerprint(plugin)
        .await
        .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
    fp.require(plugin, Operation::List)
        .map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))?;
    let mut records = Vec::new();
    let metas = client
        .list_variables(volume::RECORD_PREFIX, ns, 0, Duration::ZERO)
        .await?
        .value;
    for m in metas {
        if let Some(var) = client.variable(&m.namespace, &m.path).await? {
            match VolumeRecord::from_variable(&var) {
                Ok(r) if r.spec.plugin_id == plugin => records.push(r),
                Ok(_) => {}
                Err(e) => eprintln!("warning: {}", escape_control(&e.to_string())),
            }
        }
    }
    let all_ids: BTreeSet<String> = records.iter().map(|r| r.id.clone()).collect();
    let mut by_parameters: BTreeMap<String, Vec<&VolumeRecord>> = BTreeMap::new();
    for r in &records {
        let p = serde_json::to_string(&r.spec.parameters).unwrap_or_default();
        by_parameters.entry(p).or_default().push(r);
    }
    let node = crate::storage::environment::NodeEnv {
        node_id: String::new(),
        node_pool: String::new(),
        volumes_dir: PathBuf::from("/var/lib/dhv-binder/volumes"),
        plugin_dir: args.local.plugin_dir.clone(),
    };
    let mut groups = Vec::new();
    for (parameters, records) in by_parameters {
        let mut env = crate::storage::environment::node_env(&node);
        env.push(("DHV_PARAMETERS".into(), parameters.clone()));
        crate::storage::environment::set_secrets(&mut env, &secrets);
        let failed = |e: crate::storage::plugin::PluginError| {
            Failure::new(
                EXIT_FAILED,
                crate::storage::plugin::redact(&e.report(), &secrets),
            )
        };
        let out = runner
            .call(plugin, Operation::List, &env, &secrets)
            .await
            .map_err(failed)?;
        let listed: ListResult =
            crate::storage::protocol::parse_with(plugin, Operation::List, &out.stdout, &secrets)
                .map_err(failed)?;
        listed.ids().map_err(|e| {
            Failure::new(
                EXIT_FAILED,
                format!("plugin {plugin:?} list with parameters {parameters}: {e}"),
            )
        })?;
        groups.push(Group {
            parameters,
            records,
            // Storage of another namespace than the records read is not this report's.
            listed: listed
                .volumes
                .into_iter()
                .filter(|v| ns == "*" || v.namespace.is_empty() || v.namespace == ns)
                .map(|v| (v.id, v.bytes))
                .collect(),
        });
    }
    let rows = findings(&groups, &all_ids);
    args.out.print(&rows, |r| render(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(name: &str, id: &str, state: VolumeState, registered: bool) -> VolumeRecord {
        let mut r = VolumeRecord::new(
            volume::parse_spec(&format!("name = \"{name}\"\nplugin_id = \"bind\"\n"))
                .unwrap()
                .0,
            BTreeMap::new(),
        );
        r.id = id.into();
        r.state = state;
        r.registered = registered;
        r
    }

    /// Storage no record names, and ready records the storage does not list; pending,
    /// deleting and registered records, and storage another group's record names, are
    /// not orphans.
    #[test]
    fn the_report_names_storage_without_records_and_records_without_storage() {
        let ready = rec("a", "id-a", VolumeState::Ready, false);
        let gone = rec("b", "id-b", VolumeState::Ready, false);
        let pending = rec("c", "id-c", VolumeState::Pending, false);
        let registered = rec("d", "id-d", VolumeState::Ready, true);
        let elsewhere = rec("e", "id-e", VolumeState::Ready, false);
        let all: BTreeSet<String> = ["id-a", "id-b", "id-c", "id-d", "id-e"]
            .map(String::from)
            .into();
        let groups = [Group {
            parameters: r#"{"export":"/srv/x"}"#.into(),
            records: vec![&ready, &gone, &pending, &registered],
            listed: BTreeMap::from([
                ("id-a".to_string(), 1),
                ("id-e".to_string(), 0),
                ("left-behind".to_string(), 4096),
            ]),
        }];
        let _ = &elsewhere;
        let f = findings(&groups, &all);
        let seen: Vec<(&str, &str, &str)> = f
            .iter()
            .map(|o| (o.kind.as_str(), o.id.as_str(), o.volume.as_str()))
            .collect();
        assert_eq!(
            seen,
            vec![
                ("storage-without-record", "left-behind", ""),
                ("record-without-storage", "id-b", "default/b"),
            ]
        );
        let text = render(&f);
        assert!(
            text.contains("left-behind") && text.contains("4096"),
            "{text}"
        );
        assert!(render(&[]).starts_with("No orphans"));
    }
}
