//! Command line: `agent`, `job run|stop|status`, `alloc status|stop|restart`, `node ...`.
//!
//! Job/alloc/node commands talk HTTP to `NOMAD_ADDR` (default http://127.0.0.1:4646) with
//! `NOMAD_TOKEN`, like the nomad CLI. Nomad-style single-dash long flags (`-config`, `-purge`)
//! are accepted. Exit codes: 0 ok, 1 API/runtime error, 64 bad config.

use anyhow::{anyhow, bail, Context};
use clap::{Parser, Subcommand};
use serde_json::{json, Value};
use std::path::PathBuf;

/// nomad-sim: a simulator of the parts of HashiCorp Nomad that dhv-binder relies on.
#[derive(Parser, Debug)]
#[command(name = "nomad-sim", version)]
pub struct Cli {
    /// Command.
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// Top-level commands.
#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Run one server plus the configured client nodes.
    Agent {
        /// Agent config file (HCL).
        #[arg(long = "config")]
        config: PathBuf,
    },
    /// Job commands.
    Job {
        /// Subcommand.
        #[command(subcommand)]
        cmd: JobCmd,
    },
    /// Allocation commands.
    Alloc {
        /// Subcommand.
        #[command(subcommand)]
        cmd: AllocCmd,
    },
    /// Node commands.
    Node {
        /// Subcommand.
        #[command(subcommand)]
        cmd: NodeCmd,
    },
}

/// `job` subcommands.
#[derive(Subcommand, Debug)]
pub enum JobCmd {
    /// Parse a jobspec with the server and register it.
    Run {
        /// Jobspec file.
        file: PathBuf,
    },
    /// Stop a job (optionally purge it).
    Stop {
        /// Purge the job from state.
        #[arg(long)]
        purge: bool,
        /// Namespace.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// Job ID.
        job: String,
    },
    /// Show a job and its allocations.
    Status {
        /// Namespace.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// Job ID.
        job: String,
    },
}

/// `alloc` subcommands.
#[derive(Subcommand, Debug)]
pub enum AllocCmd {
    /// Show an allocation.
    Status {
        /// Alloc ID (or unique prefix).
        id: String,
    },
    /// Stop an allocation (it is rescheduled).
    Stop {
        /// Alloc ID.
        id: String,
    },
    /// Restart tasks of an allocation.
    Restart {
        /// Restart all tasks, prestart ones included.
        #[arg(long = "all-tasks")]
        all_tasks: bool,
        /// Alloc ID.
        id: String,
        /// Task name.
        task: Option<String>,
    },
}

/// `node` subcommands.
#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// List nodes.
    Status,
    /// Drain a node (`-enable`) or cancel the drain (`-disable`).
    Drain {
        /// Enable draining.
        #[arg(long)]
        enable: bool,
        /// Disable draining.
        #[arg(long)]
        disable: bool,
        /// Node ID.
        node: String,
    },
    /// Set scheduling eligibility.
    Eligibility {
        /// Mark eligible.
        #[arg(long)]
        enable: bool,
        /// Mark ineligible.
        #[arg(long)]
        disable: bool,
        /// Node ID.
        node: String,
    },
    /// Sim-only: stop (`-stop`) or resume (`-resume`) a node's heartbeats.
    Heartbeat {
        /// Stop heartbeating (node will be marked down).
        #[arg(long)]
        stop: bool,
        /// Resume heartbeating.
        #[arg(long)]
        resume: bool,
        /// Node ID.
        node: String,
    },
}

const LONG_FLAGS: &[&str] = &[
    "config",
    "purge",
    "namespace",
    "all-tasks",
    "enable",
    "disable",
    "stop",
    "resume",
];

/// Rewrites Nomad-style `-flag` into `--flag` for the known long flags.
pub fn normalize_args(args: impl IntoIterator<Item = String>) -> Vec<String> {
    args.into_iter()
        .map(|a| {
            let bare = a.strip_prefix('-').filter(|r| !r.starts_with('-'));
            match bare {
                Some(rest) if LONG_FLAGS.contains(&rest.split('=').next().unwrap_or("")) => {
                    format!("-{a}")
                }
                _ => a,
            }
        })
        .collect()
}

struct Api {
    addr: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Api {
    fn from_env() -> Self {
        Api {
            addr: std::env::var("NOMAD_ADDR").unwrap_or_else(|_| "http://127.0.0.1:4646".into()),
            token: std::env::var("NOMAD_TOKEN").ok().filter(|t| !t.is_empty()),
            http: reqwest::Client::new(),
        }
    }
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let mut req = self.http.request(
            method,
            format!("{}{}", self.addr.trim_end_matches('/'), path),
        );
        if let Some(t) = &self.token {
            req = req.header("X-Nomad-Token", t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("contacting {}", self.addr))?;
        let status = resp.status();
        let text = resp.text().await?;
        if !status.is_success() {
            bail!(
                "Unexpected response code: {} ({})",
                status.as_u16(),
                text.trim()
            );
        }
        if text.trim().is_empty() {
            return Ok(Value::Null);
        }
        Ok(serde_json::from_str(&text)?)
    }
}

fn s(v: &Value, k: &str) -> String {
    v.get(k)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

fn task_summary(a: &Value) -> String {
    a.get("TaskStates")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .map(|(t, st)| {
                    format!(
                        "{t}={}{}",
                        s(st, "State"),
                        if st["Failed"].as_bool() == Some(true) {
                            "(failed)"
                        } else {
                            ""
                        }
                    )
                })
                .collect::<Vec<_>>()
                .join(",")
        })
        .unwrap_or_default()
}

/// Runs a non-agent command.
pub async fn run_client_cmd(cmd: Cmd) -> anyhow::Result<()> {
    let api = Api::from_env();
    use reqwest::Method as M;
    match cmd {
        Cmd::Agent { .. } => unreachable!("agent handled by main"),
        Cmd::Job { cmd } => match cmd {
            JobCmd::Run { file } => {
                let hcl = std::fs::read_to_string(&file)
                    .with_context(|| format!("reading {}", file.display()))?;
                let job = api
                    .call(
                        M::POST,
                        "/v1/jobs/parse",
                        Some(json!({"JobHCL": hcl, "Canonicalize": true})),
                    )
                    .await?;
                let r = api
                    .call(M::PUT, "/v1/jobs", Some(json!({"Job": job})))
                    .await?;
                println!("==> Evaluation ID: {}", s(&r, "EvalID"));
                println!(
                    "    Job {:?} registered (JobModifyIndex {})",
                    s(&job, "ID"),
                    r["JobModifyIndex"]
                );
            }
            JobCmd::Stop {
                purge,
                namespace,
                job,
            } => {
                let r = api
                    .call(
                        M::DELETE,
                        &format!("/v1/job/{job}?namespace={namespace}&purge={purge}"),
                        None,
                    )
                    .await?;
                println!("==> Evaluation ID: {}", s(&r, "EvalID"));
            }
            JobCmd::Status { namespace, job } => {
                let j = api
                    .call(
                        M::GET,
                        &format!("/v1/job/{job}?namespace={namespace}"),
                        None,
                    )
                    .await?;
                println!("ID            = {}", s(&j, "ID"));
                println!("Type          = {}", s(&j, "Type"));
                println!("Namespace     = {}", s(&j, "Namespace"));
                println!("Status        = {}", s(&j, "Status"));
                println!("Version       = {}", j["Version"]);
                println!("\nAllocations");
                println!(
                    "{:<36}  {:<12}  {:<8}  {:<9}  Tasks",
                    "ID", "Node", "Desired", "Status"
                );
                let allocs = api
                    .call(
                        M::GET,
                        &format!("/v1/job/{job}/allocations?namespace={namespace}"),
                        None,
                    )
                    .await?;
                for a in allocs.as_array().into_iter().flatten() {
                    println!(
                        "{:<36}  {:<12}  {:<8}  {:<9}  {}",
                        s(a, "ID"),
                        s(a, "NodeName"),
                        s(a, "DesiredStatus"),
                        s(a, "ClientStatus"),
                        task_summary(a)
                    );
                }
            }
        },
        Cmd::Alloc { cmd } => match cmd {
            AllocCmd::Status { id } => {
                // As `nomad alloc status` (command/alloc_status.go): an ID prefix is resolved
                // through the allocation list; the read itself takes the exact ID.
                let matches = api
                    .call(M::GET, &format!("/v1/allocations?prefix={id}"), None)
                    .await?;
                let ids: Vec<String> = matches
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|a| a["ID"].as_str().map(String::from))
                    .collect();
                let id = match ids.as_slice() {
                    [one] => one.clone(),
                    [] => anyhow::bail!("No allocation(s) with prefix or id {id:?} found"),
                    _ => anyhow::bail!("Prefix matched multiple allocations: {}", ids.join(", ")),
                };
                let a = api
                    .call(M::GET, &format!("/v1/allocation/{id}"), None)
                    .await?;
                println!("ID                  = {}", s(&a, "ID"));
                println!("Name                = {}", s(&a, "Name"));
                println!("Node ID             = {}", s(&a, "NodeID"));
                println!("Node Name           = {}", s(&a, "NodeName"));
                println!("Job ID              = {}", s(&a, "JobID"));
                println!("Desired Status      = {}", s(&a, "DesiredStatus"));
                println!("Desired Description = {}", s(&a, "DesiredDescription"));
                println!("Client Status       = {}", s(&a, "ClientStatus"));
                println!("Client Description  = {}", s(&a, "ClientDescription"));
                for (t, st) in a
                    .get("TaskStates")
                    .and_then(Value::as_object)
                    .into_iter()
                    .flatten()
                {
                    println!(
                        "\nTask {t:?} is {:?} (failed={}, restarts={})",
                        s(st, "State"),
                        st["Failed"],
                        st["Restarts"]
                    );
                    for e in st["Events"].as_array().into_iter().flatten() {
                        println!("  {:<20} {}", s(e, "Type"), s(e, "DisplayMessage"));
                    }
                }
            }
            AllocCmd::Stop { id } => {
                let r = api
                    .call(M::PUT, &format!("/v1/allocation/{id}/stop"), None)
                    .await?;
                println!("==> Evaluation ID: {}", s(&r, "EvalID"));
            }
            AllocCmd::Restart {
                all_tasks,
                id,
                task,
            } => {
                api.call(
                    M::PUT,
                    &format!("/v1/client/allocation/{id}/restart"),
                    Some(json!({"TaskName": task.unwrap_or_default(), "AllTasks": all_tasks})),
                )
                .await?;
                println!("Restarted allocation {id}");
            }
        },
        Cmd::Node { cmd } => match cmd {
            NodeCmd::Status => {
                let nodes = api.call(M::GET, "/v1/nodes", None).await?;
                println!(
                    "{:<36}  {:<10}  {:<8}  {:<10}  Status",
                    "ID", "Name", "Pool", "Eligible"
                );
                for n in nodes.as_array().into_iter().flatten() {
                    println!(
                        "{:<36}  {:<10}  {:<8}  {:<10}  {}",
                        s(n, "ID"),
                        s(n, "Name"),
                        s(n, "NodePool"),
                        s(n, "SchedulingEligibility"),
                        s(n, "Status")
                    );
                }
            }
            NodeCmd::Drain {
                enable,
                disable,
                node,
            } => {
                let spec = match (enable, disable) {
                    (true, false) => {
                        json!({"Deadline": 3_600_000_000_000i64, "IgnoreSystemJobs": false})
                    }
                    (false, true) => Value::Null,
                    _ => return Err(anyhow!("exactly one of -enable or -disable is required")),
                };
                api.call(
                    M::PUT,
                    &format!("/v1/node/{node}/drain"),
                    Some(json!({"DrainSpec": spec, "MarkEligible": disable})),
                )
                .await?;
                println!(
                    "Node {node} drain strategy {}",
                    if enable { "set" } else { "unset" }
                );
            }
            NodeCmd::Eligibility {
                enable,
                disable,
                node,
            } => {
                let e = match (enable, disable) {
                    (true, false) => "eligible",
                    (false, true) => "ineligible",
                    _ => return Err(anyhow!("exactly one of -enable or -disable is required")),
                };
                api.call(
                    M::PUT,
                    &format!("/v1/node/{node}/eligibility"),
                    Some(json!({"Eligibility": e})),
                )
                .await?;
                println!("Node {node} scheduling eligibility set: {e}");
            }
            NodeCmd::Heartbeat { stop, resume, node } => {
                if stop == resume {
                    return Err(anyhow!("exactly one of -stop or -resume is required"));
                }
                api.call(
                    M::PUT,
                    &format!("/v1/sim/node/{node}/heartbeat?stop={stop}"),
                    None,
                )
                .await?;
                println!(
                    "Node {node} heartbeats {}",
                    if stop { "stopped" } else { "resumed" }
                );
            }
        },
    }
    Ok(())
}
