//! The command line: `agent`, `prestart`, `status`, `volume create|list|status|delete`,
//! `plugin check`.
//!
//! Exit codes: 0 success; 1 the operation failed or was refused; 2 usage error (clap);
//! 64 bad configuration or input; 69 Nomad or the local agent could not be reached;
//! 75 timed out (trying again may help).

use crate::api::client::{call, CallError};
use crate::config::{AgentConfig, NomadConfig};
use crate::nomad::{Client, NomadError};
use crate::volume::{self, VolumeRecord, VolumeState};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Prints a line on stdout; a closed pipe (`dhv-binder volume list | head`) ends the
/// process quietly instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        if writeln!(out, $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}

mod storage;
pub use storage::{LocalPlugins, SnapshotCommand};

/// Exit code: the operation failed or was refused.
pub const EXIT_FAILED: i32 = 1;
/// Exit code: bad configuration or input (EX_USAGE).
pub const EXIT_CONFIG: i32 = 64;
/// Exit code: a service could not be reached (EX_UNAVAILABLE).
pub const EXIT_UNAVAILABLE: i32 = 69;
/// Exit code: timed out (EX_TEMPFAIL).
pub const EXIT_TIMEOUT: i32 = 75;

/// dhv-binder: deferred binding for Nomad dynamic host volumes.
#[derive(Debug, Parser)]
#[command(name = "dhv-binder", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub nomad: NomadConfig,
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: the agent variant's size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the per-node daemon (as a Nomad system job on every client node).
    Agent(AgentConfig),
    /// What a job's prestart task runs: waits until this allocation's deferred volumes are published.
    Prestart(PrestartArgs),
    /// Show the local agent's state (as root on the node).
    Status {
        #[arg(
            long,
            env = "DHV_BINDER_SOCKET",
            default_value = "/run/dhv-binder/api.sock"
        )]
        socket: PathBuf,
    },
    /// Create, list, inspect and delete deferred volumes.
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// Volume plugin tools.
    #[command(subcommand)]
    Plugin(PluginCommand),
}

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
        /// A secret of the test volume (DHV_SECRETS), KEY=VALUE; repeatable.
        #[arg(long = "secret", value_parser = key_value)]
        secrets: Vec<(String, String)>,
        /// Capacity of the test volume in bytes (DHV_CAPACITY_MIN/MAX_BYTES).
        #[arg(long, default_value_t = 64 << 20)]
        capacity: u64,
        /// Timeout of each call, as the agent's --plugin-timeout.
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        timeout: Duration,
        /// Scratch directory (default: a new one under the temporary directory, removed after).
        #[arg(long)]
        scratch: Option<PathBuf>,
        /// A storage root of the test node (DHV_ALLOWED_ROOTS), besides the scratch volumes dir and
        /// the absolute paths given as parameters; repeatable.
        #[arg(long = "storage-root")]
        roots: Vec<PathBuf>,
    },
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))
}

/// Runs `plugin check`: prints the conformance report; fails when a rule failed.
pub async fn plugin_cmd(cmd: PluginCommand) -> Result<(), Failure> {
    let PluginCommand::Check {
        executable,
        params,
        secrets,
        capacity,
        timeout,
        scratch,
        roots,
    } = cmd;
    let report = crate::conformance::check(crate::conformance::Options {
        plugin: executable,
        parameters: params.into_iter().collect(),
        secrets: secrets.into_iter().collect(),
        capacity,
        timeout,
        scratch,
        roots,
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

/// Arguments of `prestart`.
#[derive(Debug, clap::Args)]
pub struct PrestartArgs {
    /// The daemon's socket, as mounted into the task.
    #[arg(
        long,
        env = "DHV_BINDER_SOCKET",
        default_value = "/run/dhv-binder/api.sock"
    )]
    pub socket: PathBuf,
    /// The allocation to publish for (Nomad sets NOMAD_ALLOC_ID in every task).
    #[arg(long, env = "NOMAD_ALLOC_ID")]
    pub alloc_id: Option<String>,
    /// How long to wait in total, retrying retryable errors.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

#[derive(Debug, Subcommand)]
pub enum VolumeCommand {
    /// Create a deferred volume from an HCL spec (like `nomad volume create`). Given again
    /// for an existing volume with a larger capacity_min, grows it (plugin capability "expand").
    Create {
        spec: PathBuf,
        /// Return once recorded, without waiting for the plugin's create.
        #[arg(long)]
        detach: bool,
        #[command(flatten)]
        local: LocalPlugins,
    },
    /// Snapshot volumes, list and delete snapshots (like `nomad volume snapshot`).
    #[command(subcommand)]
    Snapshot(SnapshotCommand),
    /// List deferred volumes.
    List,
    /// Show one volume: record, placeholders, allocations using it.
    Status { name: String },
    /// Delete a volume; refused while any allocation uses it.
    Delete {
        name: String,
        #[arg(long)]
        detach: bool,
    },
}

/// A CLI failure with its exit code.
#[derive(Debug)]
pub struct Failure {
    pub code: i32,
    pub message: String,
}

impl Failure {
    fn new(code: i32, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl From<NomadError> for Failure {
    fn from(e: NomadError) -> Self {
        let code = match &e {
            NomadError::Unreachable { .. } | NomadError::NoLeader { .. } => EXIT_UNAVAILABLE,
            NomadError::Config(_) => EXIT_CONFIG,
            _ => EXIT_FAILED,
        };
        Failure::new(code, e.to_string())
    }
}

/// Runs `prestart`: calls the local API, retrying retryable errors until the timeout.
pub async fn prestart(args: PrestartArgs, token: Option<String>) -> Result<(), Failure> {
    let token = match token.filter(|t| !t.is_empty()) {
        Some(t) => t,
        None => {
            let dir = std::env::var("NOMAD_SECRETS_DIR").unwrap_or_else(|_| "/secrets".into());
            std::fs::read_to_string(PathBuf::from(&dir).join("nomad_token"))
                .map(|s| s.trim().to_string())
                .map_err(|_| {
                    Failure::new(
                        EXIT_CONFIG,
                        "no workload identity token: add `identity { env = true }` (or file = true) to the prestart task",
                    )
                })?
        }
    };
    let Some(alloc_id) = args.alloc_id.clone() else {
        return Err(Failure::new(
            EXIT_CONFIG,
            "NOMAD_ALLOC_ID is not set: `dhv-binder prestart` runs inside a Nomad task (the job's prestart task), where Nomad sets it",
        ));
    };
    if !volume::is_alloc_id(&alloc_id) {
        return Err(Failure::new(
            EXIT_CONFIG,
            format!("NOMAD_ALLOC_ID {alloc_id:?} is not an allocation ID"),
        ));
    }
    let deadline = Instant::now() + args.timeout;
    let mut attempt = 0u32;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let uri = format!(
            "/v1/allocations/{}/publish?wait={}s",
            alloc_id,
            left.as_secs().max(1)
        );
        match call(&args.socket, hyper::Method::POST, &uri, Some(&token)).await {
            Ok(v) => {
                let reply: crate::api::PublishReply = serde_json::from_value(v)
                    .map_err(|e| Failure::new(EXIT_FAILED, format!("unexpected answer: {e}")))?;
                if reply.volumes.is_empty() {
                    outln!(
                        "dhv-binder: allocation {} uses no deferred volumes",
                        reply.alloc_id
                    );
                }
                for v in reply.volumes {
                    outln!(
                        "dhv-binder: volume {}/{} published at {}{}",
                        v.namespace,
                        v.name,
                        v.path,
                        if v.read_only { " (read-only)" } else { "" }
                    );
                }
                return Ok(());
            }
            Err(e) if e.is_retryable() && Instant::now() < deadline => {
                eprintln!("dhv-binder: {e}; retrying");
                let d = crate::watch::backoff_delay(
                    Duration::from_millis(500),
                    Duration::from_secs(10),
                    attempt,
                );
                tokio::time::sleep(d.min(deadline.saturating_duration_since(Instant::now()))).await;
                attempt += 1;
            }
            Err(e) => {
                let code = match &e {
                    CallError::Connect { .. } => EXIT_UNAVAILABLE,
                    _ if e.is_retryable() => EXIT_TIMEOUT,
                    _ => EXIT_FAILED,
                };
                return Err(Failure::new(
                    code,
                    format!("dhv-binder: publish failed: {e}"),
                ));
            }
        }
    }
}

/// Runs `status`: prints the local agent's state as JSON.
pub async fn status(socket: PathBuf) -> Result<(), Failure> {
    match call(&socket, hyper::Method::GET, "/v1/status", None).await {
        Ok(v) => {
            outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            Ok(())
        }
        Err(CallError::Connect { path, source }) => Err(Failure::new(
            EXIT_UNAVAILABLE,
            format!(
                "cannot reach dhv-binder at {path}: {source} (is the agent running on this node? pass its socket with --socket or DHV_BINDER_SOCKET)"
            ),
        )),
        Err(e) => Err(Failure::new(EXIT_FAILED, e.to_string())),
    }
}

async fn read_record(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<VolumeRecord, Failure> {
    volume::validate_identifier("name", name, true)
        .map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
    let var = client
        .variable(namespace, &volume::record_path(name))
        .await?
        .ok_or_else(|| {
            Failure::new(
                EXIT_FAILED,
                format!("volume {namespace}/{name} does not exist"),
            )
        })?;
    VolumeRecord::from_variable(&var).map_err(|e| Failure::new(EXIT_FAILED, e.to_string()))
}

/// Allocations using a volume, from its placeholders (Nomad denormalizes each host
/// volume's non-terminal allocations).
async fn users_of(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Vec<(String, String, String)>, Failure> {
    let mut out = Vec::new();
    for stub in client.list_host_volumes(None, namespace).await? {
        if stub.name != name {
            continue;
        }
        if let Some(hv) = client.host_volume(namespace, &stub.id).await? {
            for a in hv.allocations {
                out.push((a.id, a.name, hv.node_id.clone()));
            }
        }
    }
    Ok(out)
}

/// Runs a `volume` subcommand.
pub async fn volume_cmd(nomad: &NomadConfig, cmd: VolumeCommand) -> Result<(), Failure> {
    let client = Client::new(nomad)?;
    let ns = nomad.namespace.as_str();
    match cmd {
        VolumeCommand::Snapshot(cmd) => storage::snapshot_cmd(&client, ns, cmd).await,
        VolumeCommand::Create {
            spec,
            detach,
            local,
        } => {
            let text = std::fs::read_to_string(&spec).map_err(|e| {
                Failure::new(EXIT_CONFIG, format!("cannot read {}: {e}", spec.display()))
            })?;
            let (mut spec, secrets) =
                volume::parse_spec(&text).map_err(|e| Failure::new(EXIT_CONFIG, e.to_string()))?;
            if spec.namespace == "default"
                && ns != "default"
                && ns != "*"
                && !text.contains("namespace")
            {
                spec.namespace = ns.to_string();
            }
            if client
                .variable(&spec.namespace, &volume::record_path(&spec.name))
                .await?
                .is_none()
            {
                storage::check_source(&client, &spec, &local).await?;
            }
            let rec = VolumeRecord::new(spec, secrets);
            match client.put_variable(&rec.to_variable(), Some(0)).await {
                Ok(_) => {}
                Err(NomadError::CasConflict { .. }) => {
                    return storage::create_existing(&client, &rec.spec, detach, &local).await
                }
                Err(e) => return Err(e.into()),
            }
            outln!(
                "==> Created volume record {} (ID {}), plugin {:?}",
                rec.key(),
                rec.id,
                rec.spec.plugin_id
            );
            if detach {
                return Ok(());
            }
            outln!(
                "    Waiting for a node with plugin {:?} to run its create…",
                rec.spec.plugin_id
            );
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let cur = read_record(&client, &rec.spec.namespace, &rec.spec.name).await?;
                match cur.state {
                    VolumeState::Ready => {
                        outln!("==> Volume {} is ready ({} bytes)", cur.key(), cur.capacity_bytes);
                        return Ok(());
                    }
                    VolumeState::Failed => {
                        return Err(Failure::new(
                            EXIT_FAILED,
                            format!("plugin create failed: {} (delete the volume and create it again)", cur.error),
                        ))
                    }
                    _ if Instant::now() > deadline => {
                        return Err(Failure::new(
                            EXIT_TIMEOUT,
                            format!(
                                "volume {} is still {} after 2m: is dhv-binder running on a node with plugin {:?}?",
                                cur.key(),
                                cur.state.as_str(),
                                cur.spec.plugin_id
                            ),
                        ))
                    }
                    _ => tokio::time::sleep(Duration::from_millis(300)).await,
                }
            }
        }
        VolumeCommand::List => {
            let metas = client
                .list_variables(volume::RECORD_PREFIX, ns, 0, Duration::ZERO)
                .await?
                .value;
            outln!(
                "{:<36}  {:<12}  {:<24}  {:<12}  {:<9}",
                "ID",
                "Namespace",
                "Name",
                "Plugin ID",
                "State"
            );
            let mut records = Vec::new();
            for m in metas {
                if let Some(var) = client.variable(&m.namespace, &m.path).await? {
                    match VolumeRecord::from_variable(&var) {
                        Ok(r) => records.push(r),
                        Err(e) => eprintln!("warning: {e}"),
                    }
                }
            }
            records.sort_by_key(|r| r.key());
            for r in records {
                outln!(
                    "{:<36}  {:<12}  {:<24}  {:<12}  {:<9}",
                    r.id,
                    r.spec.namespace,
                    r.spec.name,
                    r.spec.plugin_id,
                    r.state.as_str()
                );
            }
            Ok(())
        }
        VolumeCommand::Status { name } => {
            let r = read_record(&client, ns, &name).await?;
            outln!("ID              = {}", r.id);
            outln!("Name            = {}", r.spec.name);
            outln!("Namespace       = {}", r.spec.namespace);
            outln!("Plugin ID       = {}", r.spec.plugin_id);
            outln!("State           = {}", r.state.as_str());
            outln!("Capacity        = {} bytes", r.capacity_bytes);
            outln!(
                "Node Pool       = {}",
                if r.spec.node_pool.is_empty() {
                    "(any)"
                } else {
                    &r.spec.node_pool
                }
            );
            for c in &r.spec.capabilities {
                outln!(
                    "Capability      = {} / {}",
                    c.access_mode,
                    c.attachment_mode
                );
            }
            outln!(
                "Parameters      = {}",
                serde_json::to_string(&r.spec.parameters).unwrap_or_default()
            );
            outln!("Secrets         = {} key(s), not shown", r.secrets.len());
            if !r.error.is_empty() {
                outln!("Error           = {}", r.error);
            }
            storage::status_lines(&client, &r).await?;
            let users = users_of(&client, ns, &name).await?;
            outln!("\nAllocations");
            if users.is_empty() {
                outln!("No allocations use this volume");
            }
            for (id, aname, node) in users {
                outln!("{id}  {aname}  node {node}");
            }
            Ok(())
        }
        VolumeCommand::Delete { name, detach } => {
            let mut r = read_record(&client, ns, &name).await?;
            let users = users_of(&client, ns, &name).await?;
            if !users.is_empty() {
                let list: Vec<String> = users
                    .iter()
                    .map(|(id, n, node)| format!("{id} ({n}, node {node})"))
                    .collect();
                return Err(Failure::new(
                    EXIT_FAILED,
                    format!(
                        "volume {} is in use by allocations: {}; stop them first",
                        r.key(),
                        list.join(", ")
                    ),
                ));
            }
            if matches!(r.state, VolumeState::Failed | VolumeState::Pending) {
                client
                    .delete_variable(
                        &r.spec.namespace,
                        &volume::record_path(&name),
                        Some(r.modify_index),
                    )
                    .await?;
                outln!(
                    "==> Deleted volume record {} (no storage had been created)",
                    r.key()
                );
                return Ok(());
            }
            r.state = VolumeState::Deleting;
            r.worker_node.clear();
            client
                .put_variable(&r.to_variable(), Some(r.modify_index))
                .await?;
            outln!("==> Delete of {} requested", r.key());
            if detach {
                return Ok(());
            }
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                match client
                    .variable(&r.spec.namespace, &volume::record_path(&name))
                    .await?
                {
                    None => {
                        outln!("==> Volume {} deleted", r.key());
                        return Ok(());
                    }
                    Some(_) if Instant::now() > deadline => {
                        return Err(Failure::new(
                            EXIT_TIMEOUT,
                            "delete still pending after 2m; see `dhv-binder volume status`",
                        ))
                    }
                    Some(_) => tokio::time::sleep(Duration::from_millis(300)).await,
                }
            }
        }
    }
}
