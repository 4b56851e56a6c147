//! One task of an allocation: directories, environment, driver start, restart policy, kill.
//!
//! Models `client/allocrunner/taskrunner/task_runner.go` (events, states, restarts),
//! `restarts/restarts.go` (restart tracker), `volume_hook.go` (host volume mounts) and the
//! raw_exec / exec drivers.

use crate::clock::{go_duration_string, now_ns, now_rfc3339};
use crate::exec_driver::{BindSpec, ExecSpec};
use crate::structs::{Allocation, Job, Node, Task, TaskEvent, TaskGroup, TaskState};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// How a task run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Exited 0 and is not restarted.
    Success,
    /// Failed terminally.
    Failed,
    /// Killed by the client (stop, sibling failure, shutdown).
    Killed,
    /// Killed for a user-requested restart; the alloc runner starts it again.
    Restarted,
}

/// Kill request sent to a task.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KillRequest {
    /// Reason for the Killing event (e.g. sibling failure) or empty.
    pub reason: String,
    /// Sibling that failed, if any.
    pub failed_sibling: String,
    /// Skip shutdown_delay.
    pub no_delay: bool,
    /// A user-requested restart (`alloc restart`), not a stop.
    pub restart: bool,
}

/// Node facts a task needs (from the client's own config, like Nomad's client node).
#[derive(Debug, Clone)]
pub struct NodeCtx {
    /// This node.
    pub node: Node,
    /// Region.
    pub region: String,
    /// Node data dir (`<data_dir>/<node-name>`).
    pub data_dir: PathBuf,
    /// chroot_env for exec.
    pub chroot_env: Vec<(String, String)>,
    /// Path to the nomad-sim executable (for `exec-task`).
    pub self_exe: PathBuf,
    /// Serves each task's Task API socket (see [`crate::task_api`]).
    pub task_api: Option<crate::task_api::TaskApi>,
    /// The tasks' cgroups (`cgroup_parent`); `None`: tasks run in process groups only.
    pub cgroups: Option<crate::cgroup::TaskCgroups>,
}

/// Shared task-state table of an allocation; every change is reported by `notify`.
pub type SharedStates = Arc<Mutex<BTreeMap<String, TaskState>>>;

/// Appends an event (last 10 kept) and optionally sets the state.
pub fn push_event(states: &SharedStates, task: &str, ev: TaskEvent, state: Option<&str>) {
    let mut st = states.lock().unwrap_or_else(|e| e.into_inner());
    let ts = st.entry(task.to_string()).or_default();
    ts.Events.push(ev);
    if ts.Events.len() > 10 {
        let n = ts.Events.len() - 10;
        ts.Events.drain(..n);
    }
    if let Some(s) = state {
        if s == "running" && ts.StartedAt.is_none() {
            ts.StartedAt = Some(now_rfc3339());
        }
        if s == "dead" && ts.FinishedAt.is_none() {
            ts.FinishedAt = Some(now_rfc3339());
        }
        ts.State = s.into();
    }
}

fn with_state(states: &SharedStates, task: &str, f: impl FnOnce(&mut TaskState)) {
    let mut st = states.lock().unwrap_or_else(|e| e.into_inner());
    f(st.entry(task.to_string()).or_default());
}

fn ev(kind: &str, msg: &str) -> TaskEvent {
    let mut e = TaskEvent::new(kind);
    e.DisplayMessage = msg.into();
    e
}

/// Everything one task runner needs.
pub struct TaskRunner {
    /// The allocation (with Job).
    pub alloc: Allocation,
    /// Its job.
    pub job: Job,
    /// Its group.
    pub group: TaskGroup,
    /// The task.
    pub task: Task,
    /// Node facts.
    pub node: Arc<NodeCtx>,
    /// Alloc dir on the host.
    pub alloc_dir: PathBuf,
    /// Shared task states.
    pub states: SharedStates,
    /// Called after each state change.
    pub notify: Arc<dyn Fn() + Send + Sync>,
    /// Current node view (host volumes) at task start.
    pub node_view: Arc<dyn Fn() -> Option<Node> + Send + Sync>,
    /// False when the runner restarts a task that was set up before (no new Task Setup event).
    pub fresh: bool,
    /// Changes when the node's client agent came back from a restart: a running task runs
    /// its prestart hooks again (`TaskRunner::rerun_prestart_hooks`).
    pub restored: watch::Receiver<u64>,
}

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const ENV_DENYLIST: &[&str] = &[
    "CONSUL_TOKEN",
    "CONSUL_HTTP_TOKEN",
    "VAULT_TOKEN",
    "NOMAD_TOKEN",
    "NOMAD_LICENSE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "GOOGLE_APPLICATION_CREDENTIALS",
];

/// Replaces `${...}` runtime variables (Nomad's `taskenv` interpolation); unknown ones stay.
pub fn interpolate(s: &str, env: &BTreeMap<String, String>, node: &Node) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            out.push_str(&rest[start..]);
            return out;
        };
        let key = after[..end].trim();
        let val = if let Some(v) = env.get(key) {
            Some(v.clone())
        } else if let Some(v) = key.strip_prefix("env.") {
            env.get(v).cloned()
        } else {
            match key {
                "node.unique.id" => Some(node.ID.clone()),
                "node.unique.name" => Some(node.Name.clone()),
                "node.datacenter" => Some(node.Datacenter.clone()),
                "node.pool" => Some(node.NodePool.clone()),
                "node.class" => Some(node.NodeClass.clone()),
                "node.region" => env.get("NOMAD_REGION").cloned(),
                _ => key
                    .strip_prefix("attr.")
                    .and_then(|a| node.Attributes.get(a).cloned())
                    .or_else(|| {
                        key.strip_prefix("meta.")
                            .and_then(|m| node.Meta.get(m).cloned())
                    }),
            }
        };
        match val {
            Some(v) => out.push_str(&v),
            None => out.push_str(&rest[start..start + 2 + end + 1]),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

struct RestartTracker {
    policy: crate::structs::RestartPolicy,
    count: i64,
    window_start: tokio::time::Instant,
}

enum Decision {
    Restart(Duration),
    Fail(String),
}

impl RestartTracker {
    fn next(&mut self) -> Decision {
        let now = tokio::time::Instant::now();
        let interval = Duration::from_nanos(self.policy.Interval.max(0) as u64);
        if now.duration_since(self.window_start) > interval {
            self.window_start = now;
            self.count = 0;
        }
        self.count += 1;
        let delay = Duration::from_nanos(self.policy.Delay.max(0) as u64);
        if self.count <= self.policy.Attempts {
            return Decision::Restart(delay);
        }
        if self.policy.Mode == "delay" {
            let remaining = interval.saturating_sub(now.duration_since(self.window_start));
            self.count = 0;
            self.window_start = now + remaining;
            return Decision::Restart(remaining.max(delay));
        }
        Decision::Fail(format!(
            "Exceeded allowed attempts {} in interval {} and mode is \"fail\"",
            self.policy.Attempts,
            go_duration_string(interval)
        ))
    }
}

fn signal_from_name(name: &str) -> Signal {
    let n = if name.is_empty() { "SIGINT" } else { name };
    let n = if n.starts_with("SIG") {
        n.to_string()
    } else {
        format!("SIG{n}")
    };
    n.parse().unwrap_or(Signal::SIGINT)
}

impl TaskRunner {
    fn report(&self) {
        (self.notify)();
    }

    fn task_dir(&self) -> PathBuf {
        self.alloc_dir.join(&self.task.Name)
    }

    fn build_env(&self, exec: bool) -> BTreeMap<String, String> {
        let mut env: BTreeMap<String, String> = std::env::vars()
            .filter(|(k, _)| !ENV_DENYLIST.contains(&k.as_str()) && !k.starts_with("NOMAD_"))
            .collect();
        let td = self.task_dir();
        let (alloc_d, task_d, secrets_d) = if exec {
            (
                "/alloc".to_string(),
                "/local".to_string(),
                "/secrets".to_string(),
            )
        } else {
            (
                self.alloc_dir.join("alloc").display().to_string(),
                td.join("local").display().to_string(),
                td.join("secrets").display().to_string(),
            )
        };
        let a = &self.alloc;
        let node = &self.node.node;
        let pairs = [
            ("NOMAD_ALLOC_DIR", alloc_d),
            ("NOMAD_TASK_DIR", task_d),
            ("NOMAD_SECRETS_DIR", secrets_d),
            ("NOMAD_ALLOC_ID", a.ID.clone()),
            ("NOMAD_SHORT_ALLOC_ID", a.ID.chars().take(8).collect()),
            ("NOMAD_ALLOC_NAME", a.Name.clone()),
            ("NOMAD_ALLOC_INDEX", a.name_index().to_string()),
            ("NOMAD_GROUP_NAME", a.TaskGroup.clone()),
            ("NOMAD_JOB_ID", self.job.ID.clone()),
            ("NOMAD_JOB_NAME", self.job.Name.clone()),
            ("NOMAD_JOB_PARENT_ID", self.job.ParentID.clone()),
            ("NOMAD_TASK_NAME", self.task.Name.clone()),
            ("NOMAD_NAMESPACE", a.Namespace.clone()),
            ("NOMAD_REGION", self.node.region.clone()),
            ("NOMAD_DC", node.Datacenter.clone()),
            ("NOMAD_CPU_LIMIT", self.task.Resources.CPU.to_string()),
            (
                "NOMAD_MEMORY_LIMIT",
                self.task.Resources.MemoryMB.to_string(),
            ),
        ];
        for (k, v) in pairs {
            env.insert(k.into(), v);
        }
        if exec || !env.contains_key("PATH") {
            env.insert("PATH".into(), DEFAULT_PATH.into());
        }
        if exec {
            env.insert("HOME".into(), "/".into());
        }
        for m in [&self.job.Meta, &self.group.Meta, &self.task.Meta]
            .into_iter()
            .flatten()
        {
            for (k, v) in m {
                env.insert(
                    format!("NOMAD_META_{}", k.replace(['.', '-'], "_")),
                    v.clone(),
                );
                env.insert(format!("NOMAD_META_{k}"), v.clone());
            }
        }
        if let Some(id) = &self.task.Identity {
            if id.Env {
                if let Some(tok) = self.alloc.signed_identities.get(&self.task.Name) {
                    env.insert("NOMAD_TOKEN".into(), tok.clone());
                }
            }
        }
        // The group's network ports (`client/taskenv/env.go` `addPorts`, from the
        // allocation's `AllocatedResources.Shared.Ports`).
        let ports = self
            .alloc
            .AllocatedResources
            .as_ref()
            .and_then(|r| r["Shared"]["Ports"].as_array().cloned())
            .unwrap_or_default();
        for p in ports {
            let (Some(l), Some(value)) = (p["Label"].as_str(), p["Value"].as_i64()) else {
                continue;
            };
            let ip = p["HostIP"].as_str().unwrap_or("127.0.0.1");
            let to = p["To"].as_i64().unwrap_or(0);
            let port = if to > 0 { to } else { value }.to_string();
            let addr = format!("{ip}:{value}");
            env.insert(format!("NOMAD_ADDR_{l}"), addr.clone());
            env.insert(format!("NOMAD_HOST_ADDR_{l}"), addr);
            env.insert(format!("NOMAD_IP_{l}"), ip.to_string());
            env.insert(format!("NOMAD_HOST_IP_{l}"), ip.to_string());
            env.insert(format!("NOMAD_PORT_{l}"), port.clone());
            env.insert(format!("NOMAD_ALLOC_PORT_{l}"), port);
            env.insert(format!("NOMAD_HOST_PORT_{l}"), value.to_string());
        }
        let snapshot = env.clone();
        for (k, v) in self.task.Env.iter().flatten() {
            env.insert(k.clone(), interpolate(v, &snapshot, node));
        }
        env
    }

    fn volume_binds(&self, node: &Node) -> Result<Vec<BindSpec>, String> {
        let mut out = Vec::new();
        let vols = self.group.Volumes.clone().unwrap_or_default();
        for vm in self.task.VolumeMounts.iter().flatten() {
            let Some(req) = vols.get(&vm.Volume) else {
                return Err(format!("volume {} not found in group", vm.Volume));
            };
            if req.Type != "host" {
                return Err(format!(
                    "volume type {:?} is not supported by nomad-sim",
                    req.Type
                ));
            }
            let source = req.source_for(&self.alloc.Name);
            let Some(hv) = node.HostVolumes.get(&source) else {
                return Err(format!(
                    "host volume validation error: missing host volumes: [{source}]"
                ));
            };
            out.push(BindSpec {
                source: PathBuf::from(&hv.Path),
                destination: vm.Destination.clone(),
                read_only: hv.ReadOnly || req.ReadOnly || vm.ReadOnly,
                propagation: vm.PropagationMode.clone(),
            });
        }
        Ok(out)
    }

    fn fail_setup(&self, kind: &str, msg: String) -> Outcome {
        let mut e = ev(kind, &msg);
        e.FailsTask = true;
        if kind == "Driver Failure" {
            e.DriverError = msg.clone();
        } else {
            e.SetupError = msg.clone();
        }
        e.Message = msg;
        push_event(&self.states, &self.task.Name, e, None);
        with_state(&self.states, &self.task.Name, |s| s.Failed = true);
        push_event(
            &self.states,
            &self.task.Name,
            ev("Not Restarting", "Error was unrecoverable"),
            Some("dead"),
        );
        self.report();
        Outcome::Failed
    }

    fn prepare_dirs(&self) -> std::io::Result<()> {
        let td = self.task_dir();
        // Usable by the task's user, whoever it is (`nobody` by default): the task dir, local/
        // and secrets/ 0777, tmp/ 1777, all owned by nobody (Nomad: `client/allocdir/task_dir.go`
        // `TaskDir.Build`, `TaskDirs`).
        for (d, mode) in [
            ("", 0o777),
            ("local", 0o777),
            ("secrets", 0o777),
            ("tmp", 0o1777),
        ] {
            alloc_mkdir_all(&td.join(d), mode)?;
        }
        if let Some(id) = &self.task.Identity {
            if id.File {
                if let Some(tok) = self.alloc.signed_identities.get(&self.task.Name) {
                    let p = if id.Filepath.is_empty() {
                        td.join("secrets/nomad_token")
                    } else {
                        td.join(id.Filepath.trim_start_matches('/'))
                    };
                    std::fs::write(p, tok)?;
                }
            }
        }
        Ok(())
    }

    /// The task's cgroup, made with its memory limits, when the node has `cgroup_parent`
    /// (see [`crate::cgroup`]); `None` otherwise.
    fn setup_cgroup(&self) -> Result<Option<PathBuf>, String> {
        let Some(cgroups) = &self.node.cgroups else {
            return Ok(None);
        };
        let r = &self.task.Resources;
        let limits = crate::cgroup::memory_limits(r.MemoryMB, r.MemoryMaxMB);
        cgroups
            .setup(&self.alloc.ID, &self.task.Name, limits)
            .map(Some)
            .map_err(|e| format!("failed to configure cgroup for executor: {e}"))
    }

    /// Kills what is left in the task's cgroup and removes it (the wrangler hook's `Stop`),
    /// when the task runner ends.
    async fn destroy_cgroup(&self) {
        let Some(cgroups) = &self.node.cgroups else {
            return;
        };
        if self.task.Driver == "docker" {
            return;
        }
        let path = cgroups.path(&self.alloc.ID, &self.task.Name);
        // Off the runtime's threads: the wait for the cgroup to empty polls.
        let done = tokio::task::spawn_blocking(move || {
            crate::cgroup::destroy(&path, Duration::from_secs(5))
        })
        .await;
        if let Ok(Err(e)) = done {
            tracing::warn!(task = %self.task.Name, alloc = %self.alloc.ID, error = %e, "removing the task's cgroup");
        }
    }

    /// Whether `command` names an existing file: relative to the task dir when it has a
    /// `/`, otherwise in the task's `PATH` (the sim's own when the task sets none).
    fn resolvable(&self, command: &str, env: &BTreeMap<String, String>) -> bool {
        if command.contains('/') {
            return self.task_dir().join(command).exists();
        }
        let path = env
            .get("PATH")
            .cloned()
            .or_else(|| std::env::var("PATH").ok())
            .unwrap_or_default();
        std::env::split_paths(&path).any(|d| d.join(command).is_file())
    }

    fn spawn(&self, binds: Vec<BindSpec>) -> Result<tokio::process::Child, String> {
        if self.task.Driver == "docker" {
            let env = self.build_env(true);
            let i = |s: &str| interpolate(s, &env, &self.node.node);
            let ctx = crate::docker_driver::StartCtx {
                alloc: &self.alloc,
                job_name: &self.job.Name,
                task: &self.task,
                node_id: &self.node.node.ID,
                alloc_dir: &self.alloc_dir,
                task_dir: self.task_dir(),
                self_exe: &self.node.self_exe,
                interpolate: &i,
            };
            return crate::docker_driver::spawn(ctx, env.clone(), binds);
        }
        let exec = self.task.Driver == "exec";
        let env = self.build_env(exec);
        let cgroup = self.setup_cgroup()?;
        let node = &self.node.node;
        let command = self
            .task
            .Config
            .get("command")
            .and_then(|v| v.as_str())
            .map(|c| interpolate(c, &env, node))
            .ok_or_else(|| "missing command in task config".to_string())?;
        let args: Vec<String> = self
            .task
            .Config
            .get("args")
            .and_then(|v| v.as_array())
            .map(|a| {
                a.iter()
                    .map(|x| interpolate(x.as_str().unwrap_or_default(), &env, node))
                    .collect()
            })
            .unwrap_or_default();
        let logs = self.alloc_dir.join("alloc/logs");
        let open = |suffix: &str| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(logs.join(format!("{}.{suffix}.0", self.task.Name)))
                .map_err(|e| format!("opening log file: {e}"))
        };
        let (stdout, stderr) = (open("stdout")?, open("stderr")?);
        let mut cmd = if exec {
            let spec = ExecSpec {
                root: self.task_dir(),
                alloc_dir: self.alloc_dir.join("alloc"),
                chroot: self.node.chroot_env.clone(),
                volumes: binds,
                command: command.clone(),
                args,
                env: env.into_iter().collect(),
                cgroup: cgroup.clone(),
                // Nomad's exec driver runs a task that sets no user as `nobody`.
                user: if self.task.User.is_empty() {
                    "nobody".into()
                } else {
                    self.task.User.clone()
                },
            };
            let spec_path = self
                .alloc_dir
                .join(format!(".{}.exec.json", self.task.Name));
            std::fs::write(&spec_path, serde_json::to_vec(&spec).unwrap_or_default())
                .map_err(|e| format!("writing exec spec: {e}"))?;
            let mut c = tokio::process::Command::new(&self.node.self_exe);
            c.arg("exec-task").arg(&spec_path).env_clear();
            c
        } else if let Some(cg) = &cgroup {
            // Started in its cgroup by `nomad-sim cgroup-exec`, which execs the command; a
            // command that cannot be found fails the start here, as the executor's does.
            if !self.resolvable(&command, &env) {
                return Err(format!(
                    "failed to launch command with executor: {command}: {}",
                    std::io::Error::from(std::io::ErrorKind::NotFound)
                ));
            }
            let mut c = tokio::process::Command::new(&self.node.self_exe);
            c.arg("cgroup-exec")
                .arg(cg)
                .arg(&command)
                .args(&args)
                .env_clear()
                .envs(&env)
                .current_dir(self.task_dir());
            c
        } else {
            let mut c = tokio::process::Command::new(&command);
            c.args(&args)
                .env_clear()
                .envs(&env)
                .current_dir(self.task_dir());
            c
        };
        cmd.stdin(std::process::Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(false);
        cmd.spawn()
            .map_err(|e| format!("failed to launch command with executor: {command}: {e}"))
    }

    async fn kill(&self, child: &mut tokio::process::Child, req: &KillRequest) {
        let kt = Duration::from_nanos(self.task.KillTimeout.max(0) as u64);
        if !req.no_delay {
            let delay = self
                .task
                .ShutdownDelay
                .max(self.group.ShutdownDelay.unwrap_or(0))
                .max(0);
            if delay > 0 {
                tokio::time::sleep(Duration::from_nanos(delay as u64)).await;
            }
        }
        let mut e = ev(
            "Killing",
            &format!(
                "Sent interrupt. Waiting {} before force killing",
                go_duration_string(kt)
            ),
        );
        e.KillTimeout = kt.as_nanos() as i64;
        e.KillReason = req.reason.clone();
        e.Details
            .insert("kill_timeout".into(), go_duration_string(kt));
        push_event(&self.states, &self.task.Name, e, None);
        self.report();
        let pgid = child.id().map(|p| Pid::from_raw(p as i32));
        if let Some(pg) = pgid {
            let _ = killpg(pg, signal_from_name(&self.task.KillSignal));
        }
        let status = match tokio::time::timeout(
            kt + crate::docker_driver::stop_grace(&self.task.Driver),
            child.wait(),
        )
        .await
        {
            Ok(s) => s.ok(),
            Err(_) => {
                if let Some(pg) = pgid {
                    let _ = killpg(pg, Signal::SIGKILL);
                }
                child.wait().await.ok()
            }
        };
        if let Some(pg) = pgid {
            // Leftover processes of the group die with the task.
            let _ = killpg(pg, Signal::SIGKILL);
        }
        push_event(
            &self.states,
            &self.task.Name,
            terminated_event(status),
            None,
        );
        push_event(
            &self.states,
            &self.task.Name,
            ev("Killed", "Task successfully killed"),
            Some("dead"),
        );
        self.report();
    }

    /// Runs the task to completion. `kill` carries a kill request (Some) once the task must die.
    /// When the runner ends (not for a restart), whatever is left in the task's cgroup is killed
    /// and the cgroup removed.
    pub async fn run(self, kill: watch::Receiver<Option<KillRequest>>) -> Outcome {
        let out = self.run_task(kill).await;
        if out != Outcome::Restarted {
            self.destroy_cgroup().await;
        }
        out
    }

    async fn run_task(&self, mut kill: watch::Receiver<Option<KillRequest>>) -> Outcome {
        let name = self.task.Name.clone();
        let on_success_restart = self.job.Type == "service" || self.job.Type == "system";
        let restarts_on_success = on_success_restart
            && !self.task.is_ephemeral_prestart()
            && !matches!(&self.task.Lifecycle, Some(l) if l.Hook == "poststop");
        let mut tracker = RestartTracker {
            policy: self
                .task
                .RestartPolicy
                .clone()
                .unwrap_or_else(crate::structs::RestartPolicy::service_default),
            count: 0,
            window_start: tokio::time::Instant::now(),
        };
        let mut first = self.fresh;
        let mut restored = self.restored.clone();
        restored.mark_unchanged();
        // The Task API socket, kept across restarts, removed when the runner ends.
        let mut task_api: Option<crate::task_api::Guard> = None;
        loop {
            if let Some(req) = kill.borrow().clone() {
                self.never_started(&req);
                return Outcome::Killed;
            }
            if first {
                let mut e = ev("Task Setup", "Building Task Directory");
                e.Message = "Building Task Directory".into();
                e.Details
                    .insert("message".into(), "Building Task Directory".into());
                push_event(&self.states, &name, e, None);
                self.report();
                if let Err(e) = self.prepare_dirs() {
                    return self.fail_setup(
                        "Setup Failure",
                        format!("failed to build task directory: {e}"),
                    );
                }
            }
            if !first {
                if let Err(e) = self.prepare_dirs() {
                    return self.fail_setup(
                        "Setup Failure",
                        format!("failed to build task directory: {e}"),
                    );
                }
            }
            first = false;
            if task_api.is_none() {
                let secrets = self.task_dir().join("secrets");
                task_api = self.node.task_api.as_ref().and_then(|a| a.serve(&secrets));
            }
            let node_now = (self.node_view)().unwrap_or_else(|| self.node.node.clone());
            let binds = match self.volume_binds(&node_now) {
                Ok(b) => b,
                Err(msg) => return self.fail_setup("Task hook failed", format!("volumes: {msg}")),
            };
            match self.task.Driver.as_str() {
                "exec" | "docker" => {}
                "raw_exec" => {
                    if !binds.is_empty() {
                        return self.fail_setup(
                            "Task hook failed",
                            "volumes: task driver \"raw_exec\" does not support host volumes"
                                .into(),
                        );
                    }
                }
                other => {
                    return self.fail_setup(
                        "Driver Failure",
                        format!(
                        "driver {other:?} is not supported by nomad-sim (only exec, raw_exec and docker)"
                    ),
                    )
                }
            }
            let artifacts = crate::artifact::Artifact::list(&self.task.Artifacts);
            let mut fetched = Ok(());
            if !artifacts.is_empty() {
                push_event(
                    &self.states,
                    &name,
                    ev("Downloading Artifacts", "Client is downloading artifacts"),
                    None,
                );
                self.report();
                let env = self.build_env(self.task.Driver == "exec");
                for mut a in artifacts {
                    a.source = interpolate(&a.source, &env, &node_now);
                    fetched = crate::artifact::fetch(&a, &self.task_dir()).await;
                    if fetched.is_err() {
                        break;
                    }
                }
            }
            let spawned = match fetched {
                Err(msg) => {
                    let mut e = ev("Failed Artifact Download", &msg);
                    e.DownloadError = msg.clone();
                    e.Message = msg;
                    push_event(&self.states, &name, e, None);
                    Err(None)
                }
                Ok(()) => self.spawn(binds).map_err(Some),
            };
            let exit = match spawned {
                Err(None) => None,
                Err(Some(msg)) => {
                    let mut e = ev("Driver Failure", &msg);
                    e.DriverError = msg;
                    push_event(&self.states, &name, e, None);
                    None
                }
                Ok(mut child) => {
                    push_event(
                        &self.states,
                        &name,
                        ev("Started", "Task started by client"),
                        Some("running"),
                    );
                    self.report();
                    let status = loop {
                        let came_back = tokio::select! {
                            s = child.wait() => break Some(s.ok()),
                            _ = kill.wait_for(|k| k.is_some()) => break None,
                            Ok(()) = restored.changed() => true,
                        };
                        if came_back {
                            if let Some(out) = self
                                .rerun_prestart_hooks(&mut child, &mut tracker, &mut kill)
                                .await
                            {
                                return out;
                            }
                        }
                    };
                    match status {
                        Some(s) => Some(s),
                        None => {
                            let req = kill.borrow().clone().unwrap_or_default();
                            if req.restart {
                                self.restart_kill(&mut child).await;
                                return Outcome::Restarted;
                            }
                            self.kill(&mut child, &req).await;
                            return Outcome::Killed;
                        }
                    }
                }
            };
            let success = match &exit {
                Some(Some(s)) => s.success(),
                _ => false,
            };
            if let Some(s) = exit {
                push_event(&self.states, &name, terminated_event(s), None);
            }
            if success && !restarts_on_success {
                push_state(&self.states, &name, "dead");
                self.report();
                return Outcome::Success;
            }
            match tracker.next() {
                Decision::Restart(delay) => {
                    let mut e = ev(
                        "Restarting",
                        &format!("Task restarting in {}", go_duration_string(delay)),
                    );
                    e.RestartReason = "Restart within policy".into();
                    e.StartDelay = delay.as_nanos() as i64;
                    push_event(&self.states, &name, e, Some("pending"));
                    with_state(&self.states, &name, |s| {
                        s.Restarts += 1;
                        s.LastRestart = Some(now_rfc3339());
                    });
                    self.report();
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = kill.wait_for(|k| k.is_some()) => {
                            push_event(&self.states, &name, ev("Killed", "Task successfully killed"), Some("dead"));
                            self.report();
                            return Outcome::Killed;
                        }
                    }
                }
                Decision::Fail(reason) => {
                    let mut e = ev("Not Restarting", &reason);
                    e.RestartReason = reason;
                    e.FailsTask = true;
                    push_event(&self.states, &name, e, None);
                    with_state(&self.states, &name, |s| s.Failed = true);
                    push_state(&self.states, &name, "dead");
                    self.report();
                    return Outcome::Failed;
                }
            }
        }
    }

    /// The group's host volumes this node does not have: Nomad's volume hook checks every
    /// host volume the group requests, mounted by this task or not
    /// (`volume_hook.go` `prepareHostVolumes` → `validateHostVolumes`, a multierror of
    /// "missing <source>").
    fn missing_host_volumes(&self, node: &Node) -> Option<String> {
        let vols = self.group.Volumes.clone().unwrap_or_default();
        let missing: Vec<String> = vols
            .values()
            .filter(|r| r.Type == "host")
            .map(|r| r.source_for(&self.alloc.Name))
            .filter(|src| !node.HostVolumes.contains_key(src))
            .collect();
        if missing.is_empty() {
            return None;
        }
        let mut msg = format!(
            "host volume validation error: {} error{} occurred:\n",
            missing.len(),
            if missing.len() == 1 { "" } else { "s" }
        );
        for m in missing {
            msg.push_str(&format!("\t* missing {m}\n"));
        }
        msg.push('\n');
        Some(msg)
    }

    /// The client agent came back from a restart while this task runs: its prestart hooks
    /// run again on the restored task (`task_runner.go` `Run` → `prestart`; the volume hook
    /// never reports itself done). When the group's host volume did not come back, the
    /// `volumes` hook fails ("Task hook failed", `emitHookError`) with a plain error, which
    /// `prestart` wraps with `structs.WrapRecoverable`: recoverable only if the hook's error
    /// was, and `validateHostVolumes`'s is not. So `SetStartError` gets an unrecoverable error
    /// and the restart tracker gives up at once (`restarts.go` `handleStartError`: "Not
    /// Restarting", "Error was unrecoverable", the task failed), whatever the restart policy;
    /// the process is killed (`Run`: a handle left after the MAIN loop is killed). `None`:
    /// the hooks passed, the task runs on.
    async fn rerun_prestart_hooks(
        &self,
        child: &mut tokio::process::Child,
        _tracker: &mut RestartTracker,
        _kill: &mut watch::Receiver<Option<KillRequest>>,
    ) -> Option<Outcome> {
        let name = self.task.Name.clone();
        let node = (self.node_view)().unwrap_or_else(|| self.node.node.clone());
        let msg = self.missing_host_volumes(&node)?;
        // `emitHookError`: `SetMessage("<hook>: <err>")`, shown as the display message.
        let mut e = ev("Task hook failed", &format!("volumes: {msg}"));
        e.Message = format!("volumes: {msg}");
        push_event(&self.states, &name, e, None);
        self.report();
        let reason = "Error was unrecoverable".to_string();
        let mut e = ev("Not Restarting", &reason);
        e.RestartReason = reason;
        e.FailsTask = true;
        push_event(&self.states, &name, e, None);
        with_state(&self.states, &name, |s| s.Failed = true);
        self.report();
        self.kill(
            child,
            &KillRequest {
                no_delay: true,
                ..Default::default()
            },
        )
        .await;
        Some(Outcome::Failed)
    }

    async fn restart_kill(&self, child: &mut tokio::process::Child) {
        let name = &self.task.Name;
        let mut e = ev("Restart Signaled", "User requested task to restart");
        e.RestartReason = "User requested restart".into();
        push_event(&self.states, name, e, None);
        self.report();
        let kt = Duration::from_nanos(self.task.KillTimeout.max(0) as u64);
        let pgid = child.id().map(|p| Pid::from_raw(p as i32));
        if let Some(pg) = pgid {
            let _ = killpg(pg, signal_from_name(&self.task.KillSignal));
        }
        let status = match tokio::time::timeout(
            kt + crate::docker_driver::stop_grace(&self.task.Driver),
            child.wait(),
        )
        .await
        {
            Ok(s) => s.ok(),
            Err(_) => {
                if let Some(pg) = pgid {
                    let _ = killpg(pg, Signal::SIGKILL);
                }
                child.wait().await.ok()
            }
        };
        if let Some(pg) = pgid {
            let _ = killpg(pg, Signal::SIGKILL);
        }
        push_event(&self.states, name, terminated_event(status), None);
        let mut e = ev("Restarting", "Task restarting in 0s");
        e.RestartReason = "User requested restart".into();
        push_event(&self.states, name, e, Some("pending"));
        with_state(&self.states, name, |s| {
            s.Restarts += 1;
            s.LastRestart = Some(now_rfc3339());
        });
        self.report();
    }

    fn never_started(&self, req: &KillRequest) {
        let name = &self.task.Name;
        if !req.failed_sibling.is_empty() {
            let mut e = ev(
                "Sibling Task Failed",
                &format!("Task's sibling {:?} failed", req.failed_sibling),
            );
            e.FailedSibling = req.failed_sibling.clone();
            push_event(&self.states, name, e, Some("dead"));
        } else {
            push_state(&self.states, name, "dead");
        }
        self.report();
    }
}

fn push_state(states: &SharedStates, task: &str, state: &str) {
    let mut st = states.lock().unwrap_or_else(|e| e.into_inner());
    let ts = st.entry(task.to_string()).or_default();
    if state == "dead" && ts.FinishedAt.is_none() {
        ts.FinishedAt = Some(now_rfc3339());
    }
    ts.State = state.into();
}

fn terminated_event(status: Option<std::process::ExitStatus>) -> TaskEvent {
    use std::os::unix::process::ExitStatusExt;
    let (code, sig) = match status {
        Some(s) => (
            s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0)) as i64,
            s.signal().unwrap_or(0) as i64,
        ),
        None => (-1, 0),
    };
    let mut e = TaskEvent::new("Terminated");
    e.ExitCode = code;
    e.Signal = sig;
    e.DisplayMessage = if sig != 0 {
        format!("Exit Code: {code}, Signal: {sig}")
    } else {
        format!("Exit Code: {code}")
    };
    e.Details.insert("exit_code".into(), code.to_string());
    e.Details.insert("signal".into(), sig.to_string());
    e.Details.insert("oom_killed".into(), "false".into());
    e.Time = now_ns();
    e
}

/// Makes directory `path` as Nomad's `allocMkdirAll` does (`client/allocdir/alloc_dir.go`,
/// `dropDirPermissions` in `fs_unix.go`): mode `mode | 0777`, owned by `nobody` when running
/// as root, so a task running as any user can use it.
fn alloc_mkdir_all(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode | 0o777))?;
    if nix::unistd::geteuid().is_root() {
        let nobody = nix::unistd::User::from_name("nobody")
            .ok()
            .flatten()
            .ok_or_else(|| std::io::Error::other("unable to find the nobody user"))?;
        nix::unistd::chown(path, Some(nobody.uid), Some(nobody.gid))?;
    }
    Ok(())
}

/// Creates the alloc dir layout: the shared `alloc/` and its `data`, `logs`, `tmp`, as
/// Nomad's `AllocDir.Build` makes them (`allocMkdirAll`: 0777, owned by nobody).
pub fn build_alloc_dir(alloc_dir: &Path) -> std::io::Result<()> {
    for d in ["alloc", "alloc/data", "alloc/logs", "alloc/tmp"] {
        alloc_mkdir_all(&alloc_dir.join(d), 0o777)?;
    }
    Ok(())
}
