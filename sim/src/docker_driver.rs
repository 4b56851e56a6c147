//! The `docker` task driver: runs a task as a container of a real Docker engine.
//!
//! Models `drivers/docker` (`driver.go` `StartTask` / `createContainerConfig`, `config.go`
//! `TaskConfig`, `handle.go` `Kill`). The engine is the one `DOCKER_HOST` of the nomad-sim
//! process names (`unix:///var/run/docker.sock` when unset), as Nomad's docker plugin uses the
//! environment when its `endpoint` is not configured (`driver.go` `newDockerClient`,
//! `docker.NewClientFromEnv`).
//!
//! Two halves:
//! - In the task runner: [`TaskConfig::parse`] checks the task's `config` block (unknown keys
//!   refused, as Nomad's hclspec does), [`check_engine`] asks the engine (`GET /_ping`, then
//!   `GET /images/<image>/json`: nomad-sim never pulls), and [`DockerSpec`] is written for the
//!   helper.
//! - The helper, `nomad-sim docker-task <spec.json>` ([`run`]), is the task's process: it
//!   creates the container (`docker create`), starts it, copies its logs to the task's log files
//!   (its own stdout/stderr), waits for it and exits with the container's exit code. On the kill
//!   signal the task runner sends, it stops the container the way Nomad's `handle.go` `Kill`
//!   does (the runner gives it [`stop_grace`] beyond `kill_timeout` before it SIGKILLs the
//!   helper, as Nomad's task runner leaves the escalation to the driver's `StopTask`): `docker stop --time <kill_timeout>` when the task sets no
//!   `kill_signal`, otherwise that signal, `kill_timeout` to exit, then SIGKILL. The container is
//!   removed once it has exited (`driver.go` `DestroyTask` with `force`).
//!
//! Container shape (`createContainerConfig`): named `<task>-<alloc ID>`; the shared alloc dir
//! bound at `/alloc`, the task's `local/` at `/local`, `secrets/` at `/secrets`; each
//! `volume_mount` of a host volume a bind mount with `propagation_mode` mapped as Nomad maps it
//! (`private` → `rprivate`, `host-to-task` → `rslave`, `bidirectional` → `rshared`) and
//! read-only when the volume, the group's request or the mount says so. `command` is the first
//! word of the container's command, `args` follow; `entrypoint` replaces the image's. The
//! environment goes through an env file (mode 0600, removed once the container exists), so no
//! value — `NOMAD_TOKEN` included — is on a command line. Stricter than Nomad: every container
//! runs with `--network none` (the simulator offers no network plumbing).

use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// One bind mount into the container.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct DockerMount {
    /// Host path.
    pub source: PathBuf,
    /// Absolute path in the container.
    pub target: String,
    /// Mounted read-only.
    pub read_only: bool,
    /// Docker's bind propagation (`rprivate`, `rslave`, `rshared`).
    pub propagation: String,
}

/// The driver's task config, the subset of Nomad's docker `TaskConfig` nomad-sim runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskConfig {
    /// `image` (required).
    pub image: String,
    /// `command`: the first word of the container's command.
    pub command: Option<String>,
    /// `args`: the rest of the container's command.
    pub args: Vec<String>,
    /// `entrypoint`: replaces the image's entrypoint.
    pub entrypoint: Vec<String>,
    /// `work_dir`.
    pub work_dir: Option<String>,
}

/// Keys of the docker `config` block nomad-sim runs; any other is refused.
const KNOWN_KEYS: &[&str] = &["image", "command", "args", "entrypoint", "work_dir"];

fn strings(v: &serde_json::Value, key: &str) -> Result<Vec<String>, String> {
    match v {
        serde_json::Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| format!("{key}: every element must be a string"))
            })
            .collect(),
        _ => Err(format!("{key}: must be a list of strings")),
    }
}

impl TaskConfig {
    /// Reads a task's `config` block. Errors name the key, as Nomad's config validation does
    /// (`drivers/docker/config.go` `taskConfigSpec`: `image` required, unknown keys refused).
    pub fn parse(config: &serde_json::Map<String, serde_json::Value>) -> Result<Self, String> {
        if let Some(k) = config.keys().find(|k| !KNOWN_KEYS.contains(&k.as_str())) {
            return Err(format!(
                "invalid task config: unsupported argument {k:?} (nomad-sim's docker driver \
                 takes {})",
                KNOWN_KEYS.join(", ")
            ));
        }
        let image = config
            .get("image")
            .and_then(|v| v.as_str())
            .filter(|s| !s.is_empty())
            .ok_or("invalid task config: missing required argument \"image\"")?
            .to_string();
        let text = |k: &str| -> Result<Option<String>, String> {
            match config.get(k) {
                None => Ok(None),
                Some(v) => v
                    .as_str()
                    .map(|s| Some(s.to_string()))
                    .ok_or_else(|| format!("invalid task config: {k} must be a string")),
            }
        };
        Ok(TaskConfig {
            image,
            command: text("command")?,
            args: config
                .get("args")
                .map(|v| strings(v, "args"))
                .transpose()?
                .unwrap_or_default(),
            entrypoint: config
                .get("entrypoint")
                .map(|v| strings(v, "entrypoint"))
                .transpose()?
                .unwrap_or_default(),
            work_dir: text("work_dir")?,
        })
    }
}

/// Maps a `volume_mount`'s `propagation_mode` to Docker's bind propagation
/// (`drivers/docker/driver.go`: `private` or unset → `rprivate`, `host-to-task` → `rslave`,
/// `bidirectional` → `rshared`). Errors on any other value.
pub fn propagation(mode: &str) -> Result<&'static str, String> {
    match mode {
        "" | "private" => Ok("rprivate"),
        "host-to-task" => Ok("rslave"),
        "bidirectional" => Ok("rshared"),
        other => Err(format!("unknown mount propagation mode: {other:?}")),
    }
}

/// What the helper needs, written as JSON (mode 0600) by the task runner.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct DockerSpec {
    /// The engine's address (`unix:///path`), passed to the CLI as `DOCKER_HOST`.
    pub docker_host: String,
    /// Container name, `<task>-<alloc ID>`.
    pub name: String,
    /// Image (must already be in the engine).
    pub image: String,
    /// Entrypoint (empty: the image's).
    pub entrypoint: Vec<String>,
    /// Command: `command` then `args`, or `args` alone.
    pub cmd: Vec<String>,
    /// Working directory, if set.
    pub work_dir: Option<String>,
    /// User (`user` of the task), empty for the image's.
    pub user: String,
    /// Environment.
    pub env: Vec<(String, String)>,
    /// Bind mounts: alloc, local, secrets, then volumes.
    pub mounts: Vec<DockerMount>,
    /// Labels (`com.hashicorp.nomad.*`).
    pub labels: Vec<(String, String)>,
    /// `kill_timeout`, nanoseconds.
    pub kill_timeout_ns: i64,
    /// `kill_signal`, empty when the task sets none.
    pub kill_signal: String,
    /// Where the env file is written (removed once the container exists).
    pub env_file: PathBuf,
}

impl DockerSpec {
    /// The `docker create` arguments (everything but the env file's content).
    pub fn create_args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "create".into(),
            "--pull".into(),
            "never".into(),
            "--name".into(),
            self.name.clone(),
            "--network".into(),
            "none".into(),
            "--env-file".into(),
            self.env_file.display().to_string(),
        ];
        for (k, v) in &self.labels {
            a.push("--label".into());
            a.push(format!("{k}={v}"));
        }
        for m in &self.mounts {
            let mut s = format!(
                "type=bind,source={},target={},bind-propagation={}",
                m.source.display(),
                m.target,
                m.propagation
            );
            if m.read_only {
                s.push_str(",readonly");
            }
            a.push("--mount".into());
            a.push(s);
        }
        if !self.user.is_empty() {
            a.push("--user".into());
            a.push(self.user.clone());
        }
        if let Some(w) = &self.work_dir {
            a.push("--workdir".into());
            a.push(w.clone());
        }
        // The CLI's --entrypoint takes one word; the rest of the entrypoint goes before the
        // command, which gives the container the same argv.
        let mut cmd = Vec::new();
        if let Some((first, rest)) = self.entrypoint.split_first() {
            a.push("--entrypoint".into());
            a.push(first.clone());
            cmd.extend(rest.iter().cloned());
        }
        a.push(self.image.clone());
        cmd.extend(self.cmd.iter().cloned());
        a.extend(cmd);
        a
    }

    /// The env file's content, one `KEY=value` a line. Errors on a value with a newline (the
    /// env file cannot carry it).
    pub fn env_file_content(&self) -> Result<String, String> {
        let mut out = String::new();
        for (k, v) in &self.env {
            if k.contains(['=', '\n']) || v.contains('\n') {
                return Err(format!(
                    "environment variable {k:?}: a name with '=' or a value with a newline \
                     cannot be passed to a container"
                ));
            }
            out.push_str(&format!("{k}={v}\n"));
        }
        Ok(out)
    }
}

/// How long the task runner waits, beyond `kill_timeout`, for a stopping task's process
/// before it SIGKILLs it: for docker the helper must outlive the engine's own SIGKILL (sent at
/// `kill_timeout`) to remove the container; other drivers get none.
pub fn stop_grace(driver: &str) -> Duration {
    if driver == "docker" {
        Duration::from_secs(10)
    } else {
        Duration::ZERO
    }
}

/// The engine address: `DOCKER_HOST` of this process, else Docker's default socket.
pub fn docker_host() -> String {
    std::env::var("DOCKER_HOST")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unix:///var/run/docker.sock".into())
}

/// One HTTP/1.0 GET over the engine's unix socket; returns (status, body).
fn engine_get(host: &str, path: &str) -> Result<(u16, String), String> {
    let sock = host.strip_prefix("unix://").ok_or_else(|| {
        format!("docker endpoint {host:?}: nomad-sim's docker driver reaches the engine over a unix:// socket only")
    })?;
    let mut s = std::os::unix::net::UnixStream::connect(sock)
        .map_err(|e| format!("failed to connect to the docker daemon at {host}: {e}"))?;
    let t = Some(Duration::from_secs(5));
    s.set_read_timeout(t)
        .and_then(|_| s.set_write_timeout(t))
        .map_err(|e| format!("docker daemon at {host}: {e}"))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: docker\r\n\r\n")
        .map_err(|e| format!("docker daemon at {host}: {e}"))?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)
        .map_err(|e| format!("docker daemon at {host}: reading the answer: {e}"))?;
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("docker daemon at {host}: not an HTTP answer"))?;
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// Whether the engine at `host` answers `GET /_ping` (the driver's fingerprint,
/// `drivers/docker/fingerprint.go`: a driver whose engine does not answer is undetected).
pub fn fingerprint(host: &str) -> Result<(), String> {
    match engine_get(host, "/_ping")? {
        (200, _) => Ok(()),
        (code, body) => Err(format!(
            "docker daemon at {host} answered /_ping with {code}: {}",
            body.trim()
        )),
    }
}

/// The node's `docker` driver entry when the engine answers (`DriverInfo`: detected and
/// healthy), `None` when it does not: Nomad leaves an undetected driver out of the node.
pub fn node_driver(now: &str) -> Option<serde_json::Value> {
    let host = docker_host();
    match fingerprint(&host) {
        Ok(()) => Some(serde_json::json!({"Attributes": {"driver.docker": "true"},
            "Detected": true, "Healthy": true, "HealthDescription": "Healthy", "UpdateTime": now})),
        Err(e) => {
            tracing::info!("docker driver undetected: {e}");
            None
        }
    }
}

/// Checks, before a start, that the engine answers and holds `image`. Errors say what to do.
pub fn check_engine(host: &str, image: &str) -> Result<(), String> {
    fingerprint(host).map_err(|e| {
        format!("{e}; the docker driver needs a running Docker engine: start dockerd and set DOCKER_HOST for nomad-sim")
    })?;
    match engine_get(host, &format!("/images/{image}/json"))? {
        (200, _) => Ok(()),
        (404, _) => Err(format!(
            "Failed to pull `{image}`: the image is not in the engine at {host} and nomad-sim \
             never pulls; build or load it first (docker import / docker load)"
        )),
        (code, body) => Err(format!(
            "docker daemon at {host}: inspecting image {image}: {code} {}",
            body.trim()
        )),
    }
}

/// Errors of the helper; printed to the task's stderr log, exit code 1.
#[derive(Debug, thiserror::Error)]
pub enum DockerError {
    /// Reading or decoding the spec.
    #[error("reading docker spec: {0}")]
    Spec(String),
    /// A docker CLI call failed.
    #[error("docker {0}: {1}")]
    Cli(String, String),
    /// A local step failed.
    #[error("{0}")]
    Local(String),
}

fn docker(spec: &DockerSpec) -> Command {
    let mut c = Command::new("docker");
    c.env("DOCKER_HOST", &spec.docker_host)
        .stdin(Stdio::null())
        .process_group(0);
    c
}

use std::os::unix::process::CommandExt;

fn call(spec: &DockerSpec, args: &[&str]) -> Result<String, DockerError> {
    let out = docker(spec)
        .args(args)
        .output()
        .map_err(|e| DockerError::Cli(args[0].into(), format!("running docker: {e}")))?;
    if !out.status.success() {
        return Err(DockerError::Cli(
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn kill_set() -> nix::sys::signal::SigSet {
    use nix::sys::signal::{SigSet, Signal};
    let mut s = SigSet::empty();
    for sig in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGQUIT,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
    ] {
        s.add(sig);
    }
    s
}

/// The helper: creates, starts and waits for the container; returns the exit code to exit
/// with (the container's), or an error before the container ran.
pub fn run(spec_path: &Path) -> Result<i32, DockerError> {
    use nix::sys::signal::Signal;
    let raw = std::fs::read(spec_path).map_err(|e| DockerError::Spec(e.to_string()))?;
    let spec: DockerSpec =
        serde_json::from_slice(&raw).map_err(|e| DockerError::Spec(e.to_string()))?;
    // Signals are taken with sigwait on this thread; block them before any thread exists.
    kill_set()
        .thread_block()
        .map_err(|e| DockerError::Local(format!("blocking signals: {e}")))?;
    // A container of an earlier run of this task, if any, goes first (Nomad's
    // `createContainer` purges a container of the same name).
    let _ = call(&spec, &["rm", "--force", &spec.name]);
    let env = spec.env_file_content().map_err(DockerError::Local)?;
    write_private(&spec.env_file, &env)
        .map_err(|e| DockerError::Local(format!("writing env file: {e}")))?;
    let args = spec.create_args();
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let created = call(&spec, &refs);
    let _ = std::fs::remove_file(&spec.env_file);
    let id = created?;
    if let Err(e) = call(&spec, &["start", &id]) {
        let _ = call(&spec, &["rm", "--force", &id]);
        return Err(e);
    }
    // Logs: follow them into this process's stdout/stderr (the task's log files).
    let mut logs = docker(&spec)
        .args(["logs", "--follow", &id])
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| DockerError::Cli("logs".into(), e.to_string()))?;
    let (tx, rx) = std::sync::mpsc::channel::<Result<i32, DockerError>>();
    {
        let spec = spec.clone();
        let id = id.clone();
        std::thread::spawn(move || {
            let code = call(&spec, &["wait", &id]).and_then(|s| {
                s.parse::<i32>()
                    .map_err(|_| DockerError::Cli("wait".into(), format!("exit code {s:?}")))
            });
            let _ = tx.send(code);
            let _ = nix::sys::signal::kill(nix::unistd::getpid(), Signal::SIGUSR1);
        });
    }
    let code = loop {
        let sig = kill_set()
            .wait()
            .map_err(|e| DockerError::Local(format!("sigwait: {e}")))?;
        if sig == Signal::SIGUSR1 {
            if let Ok(c) = rx.try_recv() {
                break c;
            }
            continue;
        }
        break stop(&spec, &id, &rx);
    };
    let _ = logs.wait();
    let _ = call(&spec, &["rm", "--force", &id]);
    code
}

/// Stops the container as `handle.go` `Kill` does; returns its exit code.
fn stop(
    spec: &DockerSpec,
    id: &str,
    rx: &std::sync::mpsc::Receiver<Result<i32, DockerError>>,
) -> Result<i32, DockerError> {
    let kt = Duration::from_nanos(spec.kill_timeout_ns.max(0) as u64);
    if spec.kill_signal.is_empty() {
        let secs = kt.as_secs() + u64::from(kt.subsec_nanos() > 0);
        let _ = call(spec, &["stop", "--time", &secs.to_string(), id]);
    } else {
        let _ = call(spec, &["kill", "--signal", &spec.kill_signal, id]);
        if let Ok(code) = rx.recv_timeout(kt) {
            return code;
        }
        let _ = call(spec, &["kill", id]);
    }
    rx.recv()
        .unwrap_or_else(|_| Err(DockerError::Local("lost the container's wait".into())))
}

fn write_private(path: &Path, content: &str) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(content.as_bytes())
}

/// The container's environment: the task's Nomad variables, meta and `env` block, none of the
/// nomad-sim process's own variables (Nomad's docker driver passes only the task environment).
fn container_env(
    full: std::collections::BTreeMap<String, String>,
    task_env: &std::collections::BTreeMap<String, String>,
) -> Vec<(String, String)> {
    let host: std::collections::BTreeMap<String, String> = std::env::vars().collect();
    full.into_iter()
        .filter(|(k, v)| {
            task_env.contains_key(k)
                || k.starts_with("NOMAD_")
                || (host.get(k) != Some(v) && k != "PATH" && k != "HOME")
        })
        .collect()
}

/// What [`spawn`] needs of the task runner.
pub struct StartCtx<'a> {
    /// The allocation.
    pub alloc: &'a crate::structs::Allocation,
    /// Its job's name.
    pub job_name: &'a str,
    /// The task.
    pub task: &'a crate::structs::Task,
    /// This node's ID.
    pub node_id: &'a str,
    /// The alloc dir on the host.
    pub alloc_dir: &'a Path,
    /// The task dir on the host.
    pub task_dir: PathBuf,
    /// The nomad-sim executable (runs `docker-task`).
    pub self_exe: &'a Path,
    /// The task runner's `${...}` interpolation.
    pub interpolate: &'a dyn Fn(&str) -> String,
}

/// Starts the task's helper (`nomad-sim docker-task`): checks the config and the engine,
/// writes the spec next to the task dir and spawns the helper with the task's log files as its
/// stdout/stderr. Errors become the task's Driver Failure event.
pub fn spawn(
    tr: StartCtx<'_>,
    env: std::collections::BTreeMap<String, String>,
    binds: Vec<crate::exec_driver::BindSpec>,
) -> Result<tokio::process::Child, String> {
    let cfg = TaskConfig::parse(&tr.task.Config)?;
    let i = |s: &str| (tr.interpolate)(s);
    let image = i(&cfg.image);
    let host = docker_host();
    check_engine(&host, &image)?;
    let mut cmd: Vec<String> = cfg.command.iter().map(|c| i(c)).collect();
    cmd.extend(cfg.args.iter().map(|a| i(a)));
    let td = tr.task_dir.clone();
    let mut mounts = vec![
        (tr.alloc_dir.join("alloc"), "/alloc", false, "private"),
        (td.join("local"), "/local", false, "private"),
        (td.join("secrets"), "/secrets", false, "private"),
    ]
    .into_iter()
    .map(|(source, target, read_only, p)| DockerMount {
        source,
        target: target.into(),
        read_only,
        propagation: p.replace("private", "rprivate"),
    })
    .collect::<Vec<_>>();
    for b in binds {
        mounts.push(DockerMount {
            propagation: propagation(&b.propagation)?.into(),
            source: b.source,
            target: b.destination,
            read_only: b.read_only,
        });
    }
    let a = &tr.alloc;
    let spec = DockerSpec {
        docker_host: host,
        name: format!("{}-{}", tr.task.Name, a.ID),
        image,
        entrypoint: cfg.entrypoint.iter().map(|e| i(e)).collect(),
        cmd,
        work_dir: cfg.work_dir.as_deref().map(i),
        user: tr.task.User.clone(),
        env: container_env(env.clone(), &tr.task.Env.clone().unwrap_or_default()),
        mounts,
        labels: vec![
            ("com.hashicorp.nomad.alloc_id".into(), a.ID.clone()),
            ("com.hashicorp.nomad.job_name".into(), tr.job_name.into()),
            (
                "com.hashicorp.nomad.task_group_name".into(),
                a.TaskGroup.clone(),
            ),
            ("com.hashicorp.nomad.task_name".into(), tr.task.Name.clone()),
            ("com.hashicorp.nomad.node_id".into(), tr.node_id.into()),
        ],
        kill_timeout_ns: tr.task.KillTimeout,
        kill_signal: tr.task.KillSignal.clone(),
        env_file: tr.alloc_dir.join(format!(".{}.docker.env", tr.task.Name)),
    };
    let spec_path = tr.alloc_dir.join(format!(".{}.docker.json", tr.task.Name));
    write_spec(&spec_path, &spec).map_err(|e| format!("writing docker spec: {e}"))?;
    let logs = tr.alloc_dir.join("alloc/logs");
    let open = |suffix: &str| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(logs.join(format!("{}.{suffix}.0", tr.task.Name)))
            .map_err(|e| format!("opening log file: {e}"))
    };
    let mut c = tokio::process::Command::new(tr.self_exe);
    c.arg("docker-task")
        .arg(&spec_path)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .stdin(Stdio::null())
        .stdout(open("stdout")?)
        .stderr(open("stderr")?)
        .process_group(0)
        .kill_on_drop(false);
    c.spawn()
        .map_err(|e| format!("failed to start the docker driver's helper: {e}"))
}

/// Writes the helper's spec (mode 0600: it carries the task's environment).
pub fn write_spec(path: &Path, spec: &DockerSpec) -> std::io::Result<()> {
    write_private(
        path,
        &serde_json::to_string(spec).map_err(std::io::Error::other)?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn config_requires_image_and_refuses_unknown_keys() {
        let m = |v: serde_json::Value| v.as_object().cloned().unwrap();
        assert!(TaskConfig::parse(&m(json!({"command": "x"})))
            .unwrap_err()
            .contains("\"image\""));
        assert!(
            TaskConfig::parse(&m(json!({"image": "i", "privileged": true})))
                .unwrap_err()
                .contains("\"privileged\"")
        );
        let c = TaskConfig::parse(&m(json!({"image": "i", "args": ["a"]}))).unwrap();
        assert_eq!(c.args, vec!["a".to_string()]);
    }

    #[test]
    fn propagation_modes_map_as_nomad_does() {
        assert_eq!(propagation("").unwrap(), "rprivate");
        assert_eq!(propagation("private").unwrap(), "rprivate");
        assert_eq!(propagation("host-to-task").unwrap(), "rslave");
        assert_eq!(propagation("bidirectional").unwrap(), "rshared");
        assert!(propagation("slave").is_err());
    }

    #[test]
    fn entrypoint_words_after_the_first_precede_the_command() {
        let s = DockerSpec {
            docker_host: "unix:///x".into(),
            name: "t-a".into(),
            image: "img".into(),
            entrypoint: vec!["/bin/sh".into(), "-c".into()],
            cmd: vec!["echo hi".into()],
            work_dir: None,
            user: String::new(),
            env: vec![("A".into(), "b".into())],
            mounts: vec![],
            labels: vec![],
            kill_timeout_ns: 0,
            kill_signal: String::new(),
            env_file: "/e".into(),
        };
        let a = s.create_args();
        let tail: Vec<&str> = a.iter().rev().take(4).rev().map(String::as_str).collect();
        assert_eq!(tail, ["/bin/sh", "img", "-c", "echo hi"]);
        assert!(!a.iter().any(|x| x.contains("A=b")), "env not on argv");
        let mut bad = s.clone();
        bad.env = vec![("A".into(), "x\ny".into())];
        assert!(bad.env_file_content().is_err());
    }
}
