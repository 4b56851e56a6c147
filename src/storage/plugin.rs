//! The plugin runner: Nomad's dynamic host volume plugin contract, extended with
//! `publish` and `unpublish` for deferred binding (docs/plugin-protocol.md).
//!
//! A plugin is an executable `<plugin_dir>/<plugin_id>`, called with the operation as
//! `argv[1]` and in `DHV_OPERATION`, an environment of `DHV_*` variables only (no PATH, as
//! Nomad does), stdin from /dev/null, stdout parsed as JSON, stderr kept for errors. It runs
//! in its own process group; past the timeout the group gets SIGTERM, then SIGKILL.

pub use super::process::Leftover;
use super::process::{
    describe, describe_leftover, group_members, holders_of_pipe, kill_group, pipe_inode,
    process_group, read_output,
};
pub use super::protocol::{
    parse, parse_with, Capability, CapabilityError, CreateResult, ExpandResult, Fingerprint,
    ListedSnapshot, Operation, PluginError, PublishResult, SnapshotListResult, SnapshotResult,
    EXIT_TEMPORARY, FENCE_TIMEOUT, FINGERPRINT_TIMEOUT, REPORT_LIMIT,
};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

const STDOUT_LIMIT: usize = 1 << 20;
const STDERR_TAIL: usize = 2048;

pub use crate::escape::escape_control;

/// Told of every finished plugin call: the plugin ID, the operation, the error (`None`:
/// it succeeded) and how long it ran. The agent times its calls with it for the metrics.
pub type CallObserver =
    std::sync::Arc<dyn Fn(&str, Operation, Option<&PluginError>, Duration) + Send + Sync>;

/// What became of processes a plugin call left behind when it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeftoverFate {
    /// Killed: in the call's process group, or (any operation but `publish` and
    /// `unpublish`, which may start a long-lived helper) outside it but still holding the
    /// call's stdout or stderr.
    Killed,
    /// Left running: a `publish` or `unpublish` helper outside the call's process group
    /// still holding its output (named in the log; docs/plugin-protocol.md "Helpers").
    Left,
}

impl LeftoverFate {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            LeftoverFate::Killed => "killed",
            LeftoverFate::Left => "left",
        }
    }
}

/// Told of the processes one plugin call left behind: plugin ID, operation, what became of
/// them and how many. The agent counts them in a metric.
pub type LeftoverObserver =
    std::sync::Arc<dyn Fn(&str, Operation, LeftoverFate, usize) + Send + Sync>;

/// Runs plugins from one directory.
#[derive(Clone)]
pub struct Runner {
    plugin_dir: PathBuf,
    timeout: Duration,
    /// Per plugin ID: the node-configured roots passed as `DHV_ALLOWED_ROOTS`.
    allowed_roots: BTreeMap<String, String>,
    observer: Option<CallObserver>,
    leftover_observer: Option<LeftoverObserver>,
    /// The last good fingerprint of each plugin, with its file as it was just before that
    /// run ([`Runner::fingerprint_if_changed`]); shared by the runner's clones.
    fingerprints: std::sync::Arc<std::sync::Mutex<BTreeMap<String, (PluginFile, Fingerprint)>>>,
    /// The node's helper cgroups: `publish` and `unpublish` get their volume's as
    /// `DHV_HELPER_CGROUP`, and an `unpublish` succeeds once that cgroup is empty.
    helpers: Option<crate::node::helpers::HelperCgroups>,
    /// A cgroup every call starts in (the conformance kit's stand-in for the daemon's), and
    /// the dhv-binder executable that puts it there (`helper run`).
    caller_cgroup: Option<(PathBuf, PathBuf)>,
    /// The dhv-binder executable plugins call for `dhv-binder helper` (`DHV_BINDER`).
    dhv_binder: Option<PathBuf>,
    /// Where referenced secrets are read ([`Runner::secrets_for`]); `None`: none are.
    secrets: Option<super::secrets::SecretSource>,
}

/// What tells one plugin file from another, or from itself changed: the file's device and
/// inode (a file replaced by a new one, `mv` or a package upgrade), size, modification and
/// change times in ns (written in place, `chmod`, `chown`, a new link) and mode, of the
/// file the plugin's path resolves to (a symlink moved to another target is another file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PluginFile {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    mode: u32,
}

impl PluginFile {
    fn of(path: &Path) -> std::io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path)?;
        Ok(Self {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
            mode: m.mode(),
        })
    }
}

impl std::fmt::Debug for Runner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("plugin_dir", &self.plugin_dir)
            .field("timeout", &self.timeout)
            .field("observed", &self.observer.is_some())
            .field("allowed_roots", &self.allowed_roots)
            .finish()
    }
}

/// A `--plugin-root` setting that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RootError {
    #[error("--plugin-root {0:?} is not `<plugin_id>=<absolute directory>`")]
    Malformed(String),
    #[error("--plugin-root {0:?}: the directory does not exist or is not a directory")]
    Missing(String),
    #[error(
        "--plugin-root {0:?}: a root may not contain ':' (DHV_ALLOWED_ROOTS is ':'-separated)"
    )]
    Colon(String),
}

/// Parses `--plugin-root` settings (`<plugin_id>=<dir>`, repeatable) into each plugin's
/// `DHV_ALLOWED_ROOTS` value: canonical absolute directories joined by `:`.
pub fn allowed_roots(settings: &[String]) -> Result<BTreeMap<String, String>, RootError> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for s in settings {
        let (id, dir) = s
            .split_once('=')
            .filter(|(id, d)| {
                crate::volume::validate_identifier("plugin_id", id, false).is_ok()
                    && d.starts_with('/')
            })
            .ok_or_else(|| RootError::Malformed(s.clone()))?;
        let canon = std::fs::canonicalize(dir)
            .ok()
            .filter(|p| p.is_dir())
            .ok_or_else(|| RootError::Missing(s.clone()))?;
        let canon = canon
            .to_str()
            .ok_or_else(|| RootError::Malformed(s.clone()))?;
        if canon.contains(':') {
            return Err(RootError::Colon(s.clone()));
        }
        out.entry(id.to_string())
            .or_default()
            .push(canon.to_string());
    }
    Ok(out.into_iter().map(|(k, v)| (k, v.join(":"))).collect())
}

/// The successful output of one call.
#[derive(Debug, Clone)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: String,
    pub elapsed: Duration,
    /// Processes outside the call's process group (a `setsid` helper) that still held the
    /// call's stdout or stderr when the plugin exited; the call did not wait for them. They
    /// were killed, except after `publish` and `unpublish` ([`LeftoverFate`]).
    pub leftover: Vec<Leftover>,
}

pub use super::redact::{redact, sanitize_tail};

/// Why a plugin file may not be run as root: not a regular file, not owned by root (or the
/// agent's own user), or writable by group or others. `None` when it is safe.
pub fn unsafe_reason(meta: &std::fs::Metadata) -> Option<String> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mode = meta.permissions().mode();
    let me = nix::unistd::geteuid().as_raw();
    if !meta.is_file() {
        Some("it is not a regular file".into())
    } else if meta.uid() != 0 && meta.uid() != me {
        Some(format!(
            "it is owned by uid {}, not root: whoever owns it could run code as root (chown root it)",
            meta.uid()
        ))
    } else if mode & 0o022 != 0 {
        Some(format!(
            "mode {:o} lets group or others rewrite it and run code as root (chmod go-w it)",
            mode & 0o7777
        ))
    } else {
        None
    }
}

impl Runner {
    /// A runner for `plugin_dir`, killing calls after `timeout`.
    pub fn new(plugin_dir: &Path, timeout: Duration) -> Self {
        Self {
            plugin_dir: plugin_dir.to_path_buf(),
            timeout,
            allowed_roots: BTreeMap::new(),
            observer: None,
            leftover_observer: None,
            fingerprints: Default::default(),
            helpers: None,
            caller_cgroup: None,
            dhv_binder: dhv_binder_exe().map(Path::to_path_buf),
            secrets: None,
        }
    }

    /// The same runner, reading the secrets volumes reference from `source`
    /// ([`Runner::secrets_for`]).
    pub fn with_secret_source(mut self, source: super::secrets::SecretSource) -> Self {
        self.secrets = Some(source);
        self
    }

    /// The secrets of `rec` for a call of `op`: its inline ones and every `secret_ref` read
    /// now ([`super::secrets::SecretSource::resolve`]), for the call's `DHV_SECRETS`
    /// ([`super::environment::set_secrets`]) and redaction; never to be stored. A reference
    /// that cannot be read is [`PluginError::Secret`] (the plugin is not called).
    pub async fn secrets_for(
        &self,
        op: Operation,
        rec: &crate::volume::VolumeRecord,
    ) -> Result<BTreeMap<String, String>, PluginError> {
        self.secrets_of(
            &rec.spec.plugin_id,
            op,
            &rec.spec.namespace,
            &rec.secrets,
            &rec.spec.secret_refs,
        )
        .await
    }

    /// [`Runner::secrets_for`] from the parts: a call of `plugin`'s `op` with the `inline`
    /// secrets and the references `refs`, variables read in `namespace` (a snapshot record
    /// keeps its volume's, for a `snapshot_delete` after the volume is gone).
    pub async fn secrets_of(
        &self,
        plugin: &str,
        op: Operation,
        namespace: &str,
        inline: &BTreeMap<String, String>,
        refs: &BTreeMap<String, crate::volume::secret_refs::SecretRef>,
    ) -> Result<BTreeMap<String, String>, PluginError> {
        if refs.is_empty() {
            return Ok(inline.clone());
        }
        let failed = |source| PluginError::Secret {
            plugin: plugin.to_string(),
            op,
            source: Box::new(source),
        };
        match &self.secrets {
            Some(s) => s
                .resolve_refs(namespace, inline, refs)
                .await
                .map_err(failed),
            None => Err(failed(super::secrets::SecretError::NoSource)),
        }
    }

    /// The same runner, giving plugins `dhv_binder` as `DHV_BINDER` (the executable they
    /// call for `dhv-binder helper`) instead of [`dhv_binder_exe`]'s answer: for a program
    /// that runs plugins in-process and is not dhv-binder itself (a test binary).
    pub fn with_dhv_binder(mut self, dhv_binder: &Path) -> Self {
        self.dhv_binder = Some(dhv_binder.to_path_buf());
        self
    }

    /// The same runner, giving `publish` and `unpublish` the volume's helper cgroup
    /// (`DHV_HELPER_CGROUP`, made before `publish`), and making an `unpublish` succeed only
    /// once the helpers in it have exited (waited for up to the call timeout), when the
    /// cgroup is removed (docs/plugin-protocol.md, "Helpers").
    pub fn with_helpers(mut self, helpers: crate::node::helpers::HelperCgroups) -> Self {
        self.helpers = Some(helpers);
        self
    }

    /// The same runner, starting every call in the cgroup `cgroup` (a directory on the
    /// cgroup2 filesystem) through `<dhv_binder> helper run` (the executable, usually
    /// `std::env::current_exe()`); a call that cannot enter it fails.
    pub fn in_cgroup(mut self, cgroup: &Path, dhv_binder: &Path) -> Self {
        self.caller_cgroup = Some((cgroup.to_path_buf(), dhv_binder.to_path_buf()));
        self
    }

    /// The helper cgroup of the volume a `publish` or `unpublish` call is about (from its
    /// `DHV_NAMESPACE`, `DHV_VOLUME_NAME`, `DHV_VOLUME_ID`); `None` for other operations or
    /// without helper cgroups.
    fn helper_cgroup(&self, op: Operation, env: &[(String, String)]) -> Option<(String, PathBuf)> {
        let h = self.helpers.as_ref()?;
        if !matches!(
            op,
            Operation::Publish | Operation::Unpublish | Operation::Refresh
        ) {
            return None;
        }
        let get = |k: &str| {
            env.iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.as_str())
                .unwrap_or_default()
        };
        let (ns, name, id) = (
            get("DHV_NAMESPACE"),
            get("DHV_VOLUME_NAME"),
            get("DHV_VOLUME_ID"),
        );
        Some((format!("{ns}/{name}"), h.path_of(ns, name, id)))
    }

    /// The same runner, telling `observer` of every `fingerprint` and `call` it finishes.
    pub fn observed(mut self, observer: CallObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    /// The same runner, telling `observer` of the processes each call left behind.
    pub fn on_leftovers(mut self, observer: LeftoverObserver) -> Self {
        self.leftover_observer = Some(observer);
        self
    }

    /// Kills and counts what a call left behind once it ended (its plugin process `pid`
    /// exited or was killed): every process still in its process group, then, unless `op`
    /// may start a long-lived helper, the processes outside it that still hold the call's
    /// output (`holders`); `killed` are those the caller killed already (a timed-out
    /// call's group). Returns the holders left running.
    fn clean_up_after(
        &self,
        plugin_id: &str,
        op: Operation,
        pid: Option<u32>,
        holders: Vec<Leftover>,
        mut killed: Vec<Leftover>,
    ) -> Vec<Leftover> {
        use nix::sys::signal::{kill, killpg, Signal};
        use nix::unistd::Pid;
        // Signal 0 first: a scan of /proc only when something of the group is left.
        if let Some(pg) = pid.map(|p| Pid::from_raw(p as i32)) {
            if killpg(pg, None).is_ok() {
                killed.extend(group_members(pg.as_raw()));
                let _ = killpg(pg, Signal::SIGKILL);
            }
        }
        let helpers_allowed = matches!(op, Operation::Publish | Operation::Unpublish);
        let (left, kill_now): (Vec<_>, Vec<_>) = holders.into_iter().partition(|_| helpers_allowed);
        for l in kill_now {
            // A `setsid` child leads a group of its own: kill that group with it.
            if process_group(l.pid) == Some(l.pid) {
                let _ = killpg(Pid::from_raw(l.pid), Signal::SIGKILL);
            } else {
                let _ = kill(Pid::from_raw(l.pid), Signal::SIGKILL);
            }
            killed.push(l);
        }
        if !killed.is_empty() {
            tracing::warn!(
                plugin = plugin_id,
                %op,
                processes = %describe_leftover(&killed),
                "plugin {op} left processes behind; killed them (a plugin must not leave processes behind, except a publish helper outside the call's process group and in DHV_HELPER_CGROUP: docs/plugin-protocol.md#calling-convention)"
            );
        }
        if let Some(o) = &self.leftover_observer {
            if !killed.is_empty() {
                o(plugin_id, op, LeftoverFate::Killed, killed.len());
            }
            if !left.is_empty() {
                o(plugin_id, op, LeftoverFate::Left, left.len());
            }
        }
        left
    }

    fn observe<T>(&self, plugin_id: &str, op: Operation, r: &Result<T, PluginError>, t: Instant) {
        if let Some(o) = &self.observer {
            o(plugin_id, op, r.as_ref().err(), t.elapsed());
        }
    }

    /// Sets the node-configured roots each plugin may touch (from [`allowed_roots`]); every
    /// call of such a plugin gets them as `DHV_ALLOWED_ROOTS`, overriding anything else.
    pub fn with_allowed_roots(mut self, roots: BTreeMap<String, String>) -> Self {
        self.allowed_roots = roots;
        self
    }

    /// The plugin directory.
    pub fn plugin_dir(&self) -> &Path {
        &self.plugin_dir
    }

    /// The executable for `plugin_id`, after validating the ID (no path traversal).
    pub fn path_of(&self, plugin_id: &str) -> Result<PathBuf, PluginError> {
        if crate::volume::validate_identifier("plugin_id", plugin_id, false).is_err() {
            return Err(PluginError::BadId(plugin_id.to_string()));
        }
        Ok(self.plugin_dir.join(plugin_id))
    }

    /// Lists the plugin IDs present (executable regular files with valid names). A missing
    /// directory has no plugins; any other read error is an error, never "no plugins".
    pub fn list(&self) -> std::io::Result<Vec<String>> {
        use std::os::unix::fs::PermissionsExt;
        let rd = match std::fs::read_dir(&self.plugin_dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut ids = Vec::new();
        for e in rd {
            let e = e?;
            let Ok(name) = e.file_name().into_string() else {
                continue;
            };
            if crate::volume::validate_identifier("plugin_id", &name, false).is_err() {
                continue;
            }
            match std::fs::metadata(e.path()) {
                Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => ids.push(name),
                Ok(_) => {}
                // Removed between the listing and the stat.
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => return Err(err),
            }
        }
        ids.sort();
        Ok(ids)
    }

    /// Runs `fingerprint`, and remembers a good answer with the plugin's file as it was
    /// just before the run (a change during the run is seen by the next
    /// [`Runner::fingerprint_if_changed`]).
    pub async fn fingerprint(&self, plugin_id: &str) -> Result<Fingerprint, PluginError> {
        self.fingerprint_of(plugin_id, self.file_of(plugin_id))
            .await
    }

    /// [`Runner::fingerprint`] with the plugin's file as it was read before the run.
    async fn fingerprint_of(
        &self,
        plugin_id: &str,
        file: Option<PluginFile>,
    ) -> Result<Fingerprint, PluginError> {
        let started = Instant::now();
        let r = self.fingerprint_unobserved(plugin_id).await;
        self.observe(plugin_id, Operation::Fingerprint, &r, started);
        let mut known = self.fingerprints.lock().unwrap_or_else(|e| e.into_inner());
        match (&r, file) {
            (Ok(fp), Some(file)) => {
                known.insert(plugin_id.to_string(), (file, fp.clone()));
            }
            _ => {
                known.remove(plugin_id);
            }
        }
        r
    }

    /// The periodic rescan's fingerprint: the one remembered from the last good run when
    /// the plugin's file is the same file, unchanged, since (`PluginFile`); else (a new
    /// plugin, a changed file, a file that cannot be read now, a last run that failed)
    /// [`Runner::fingerprint`]. Nomad fingerprints plugins only at its start and on
    /// SIGHUP (`Periodic() → false`, client/fingerprint/dynamic_host_volumes.go); running
    /// every plugin again on every rescan would exec each one forever while nothing changes.
    pub async fn fingerprint_if_changed(
        &self,
        plugin_id: &str,
    ) -> Result<Fingerprint, PluginError> {
        let now = self.file_of(plugin_id);
        let kept = {
            let known = self.fingerprints.lock().unwrap_or_else(|e| e.into_inner());
            match (known.get(plugin_id), now) {
                (Some((file, fp)), Some(now)) if *file == now => Some(fp.clone()),
                _ => None,
            }
        };
        match kept {
            Some(fp) => Ok(fp),
            None => self.fingerprint_of(plugin_id, now).await,
        }
    }

    /// The plugin's file as it is now ([`PluginFile`]); `None` when it cannot be read.
    fn file_of(&self, plugin_id: &str) -> Option<PluginFile> {
        self.path_of(plugin_id)
            .ok()
            .and_then(|p| PluginFile::of(&p).ok())
    }

    async fn fingerprint_unobserved(&self, plugin_id: &str) -> Result<Fingerprint, PluginError> {
        let out = self
            .run(
                plugin_id,
                Operation::Fingerprint,
                &[],
                &BTreeMap::new(),
                FINGERPRINT_TIMEOUT,
            )
            .await?;
        let fp: Fingerprint = parse(plugin_id, Operation::Fingerprint, &out.stdout)?;
        if fp.version.trim().is_empty() {
            return Err(PluginError::BadOutput {
                plugin: plugin_id.into(),
                op: Operation::Fingerprint,
                reason: "\"version\" is empty".into(),
                stdout: escape_control(&String::from_utf8_lossy(&out.stdout)),
            });
        }
        if let Err(e) = crate::volume::topology::check_segments(&fp.topology) {
            return Err(PluginError::BadOutput {
                plugin: plugin_id.into(),
                op: Operation::Fingerprint,
                reason: format!("\"topology\": {e}"),
                stdout: escape_control(&String::from_utf8_lossy(&out.stdout)),
            });
        }
        Ok(fp)
    }

    /// Runs an operation with `env` (DHV_OPERATION is added), the default timeout and
    /// `secrets` redacted from anything kept. Returns stdout on exit status 0.
    pub async fn call(
        &self,
        plugin_id: &str,
        op: Operation,
        env: &[(String, String)],
        secrets: &BTreeMap<String, String>,
    ) -> Result<Output, PluginError> {
        let started = Instant::now();
        let r = self
            .call_in_helper_cgroup(plugin_id, op, env, secrets)
            .await;
        self.observe(plugin_id, op, &r, started);
        r
    }

    /// [`Runner::call`] bounded by `timeout` instead of the runner's own (`fence` runs with
    /// [`FENCE_TIMEOUT`]); never in a helper cgroup.
    pub async fn call_within(
        &self,
        plugin_id: &str,
        op: Operation,
        env: &[(String, String)],
        secrets: &BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<Output, PluginError> {
        let started = Instant::now();
        let r = self.run(plugin_id, op, env, secrets, timeout).await;
        self.observe(plugin_id, op, &r, started);
        r
    }

    async fn call_in_helper_cgroup(
        &self,
        plugin_id: &str,
        op: Operation,
        env: &[(String, String)],
        secrets: &BTreeMap<String, String>,
    ) -> Result<Output, PluginError> {
        let Some((volume, cgroup)) = self.helper_cgroup(op, env) else {
            return self.run(plugin_id, op, env, secrets, self.timeout).await;
        };
        let helper_error = |source| PluginError::Helper {
            plugin: plugin_id.into(),
            op,
            source,
        };
        if op == Operation::Publish {
            if let Some(h) = &self.helpers {
                h.make(&cgroup).map_err(helper_error)?;
            }
        }
        let mut env = env.to_vec();
        env.retain(|(k, _)| k != "DHV_HELPER_CGROUP");
        env.push(("DHV_HELPER_CGROUP".into(), cgroup.display().to_string()));
        let out = self.run(plugin_id, op, &env, secrets, self.timeout).await?;
        if op == Operation::Unpublish {
            crate::node::helpers::finish(&volume, &cgroup, self.timeout)
                .await
                .map_err(helper_error)?;
        }
        Ok(out)
    }

    async fn run(
        &self,
        plugin_id: &str,
        op: Operation,
        env: &[(String, String)],
        secrets: &BTreeMap<String, String>,
        timeout: Duration,
    ) -> Result<Output, PluginError> {
        let path = self.path_of(plugin_id)?;
        let meta = std::fs::metadata(&path).map_err(|_| PluginError::NotFound {
            plugin: plugin_id.into(),
            path: path.clone(),
        })?;
        if !meta.is_file() {
            return Err(PluginError::NotFound {
                plugin: plugin_id.into(),
                path,
            });
        }
        if let Some(reason) = unsafe_reason(&meta) {
            return Err(PluginError::Unsafe {
                plugin: plugin_id.into(),
                path,
                reason,
            });
        }
        let started = Instant::now();
        // In a caller cgroup (the kit), the call starts through `dhv-binder helper run`,
        // which enters the cgroup and then execs the plugin (same argv, environment, PID).
        let mut cmd = match &self.caller_cgroup {
            Some((cgroup, trampoline)) => {
                let mut c = tokio::process::Command::new(trampoline);
                c.args(["helper", "run", "--cgroup"])
                    .arg(cgroup)
                    .arg("--")
                    .arg(&path);
                c
            }
            None => tokio::process::Command::new(&path),
        };
        cmd.arg(op.as_str())
            .env_clear()
            .env("DHV_OPERATION", op.as_str())
            .envs(
                env.iter()
                    .filter(|(k, _)| k != "DHV_ALLOWED_ROOTS")
                    .map(|(k, v)| (k, v)),
            )
            .env(
                "DHV_ALLOWED_ROOTS",
                self.allowed_roots
                    .get(plugin_id)
                    .map(String::as_str)
                    .unwrap_or(""),
            )
            .envs(self.dhv_binder.iter().map(|p| ("DHV_BINDER", p)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        // ETXTBSY: the file is being written (a plugin being replaced, or another thread of
        // this process forked while holding it open): try again briefly.
        let mut spawned = cmd.spawn();
        for _ in 0..10 {
            match &spawned {
                Err(e) if e.raw_os_error() == Some(nix::libc::ETXTBSY) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    spawned = cmd.spawn();
                }
                _ => break,
            }
        }
        let mut child = spawned.map_err(|source| match source.kind() {
            std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::NotFound => {
                PluginError::NotFound {
                    plugin: plugin_id.into(),
                    path: path.clone(),
                }
            }
            _ => PluginError::Spawn {
                plugin: plugin_id.into(),
                op,
                source,
            },
        })?;
        let pid = child.id();
        let mut stdout = child.stdout.take().expect("stdout is piped");
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let pipe = pipe_inode(&stdout);
        // The call ends when the plugin process has exited and its output is read, not at
        // EOF: a helper it started may hold the pipes open for as long as it lives.
        let (exited_tx, exited) = tokio::sync::watch::channel(None::<Instant>);
        let read_out = read_output(&mut stdout, STDOUT_LIMIT, exited.clone());
        let read_err = read_output(&mut stderr, 4 * STDOUT_LIMIT, exited);
        let wait = async {
            let status = child.wait().await;
            let _ = exited_tx.send(Some(Instant::now()));
            status
        };
        let work = async {
            let ((out, out_held), (err, err_held), status) = tokio::join!(read_out, read_err, wait);
            (out, err, status, out_held || err_held)
        };
        match tokio::time::timeout(timeout, work).await {
            Ok((out, err, status, held)) => {
                let holders = if held {
                    pipe.map(|ino| holders_of_pipe(ino, pid))
                        .unwrap_or_default()
                } else {
                    Vec::new()
                };
                // What the call left behind: its group killed, holders outside it killed
                // or (a publish or unpublish helper) left and named; all counted.
                let left = self.clean_up_after(plugin_id, op, pid, holders.clone(), Vec::new());
                let leftover = holders;
                if !left.is_empty() {
                    tracing::warn!(
                        plugin = plugin_id,
                        %op,
                        processes = %describe_leftover(&left),
                        "plugin {op} exited but processes it started still hold its stdout or stderr; the call ended without waiting for them (give such helpers </dev/null >/dev/null 2>&1, docs/plugin-protocol.md#calling-convention)"
                    );
                }
                let stderr = sanitize_tail(&err, secrets, STDERR_TAIL);
                let status = status.map_err(|source| PluginError::Spawn {
                    plugin: plugin_id.into(),
                    op,
                    source,
                })?;
                if status.success() {
                    Ok(Output {
                        stdout: out,
                        stderr,
                        elapsed: started.elapsed(),
                        leftover,
                    })
                } else {
                    #[derive(Deserialize)]
                    struct ErrOut {
                        error: String,
                        #[serde(default)]
                        error_class: Option<String>,
                    }
                    let parsed = serde_json::from_slice::<ErrOut>(&out).ok();
                    let class = parsed
                        .as_ref()
                        .and_then(|e| e.error_class.as_deref())
                        .and_then(crate::storage::error_class::ErrorClass::parse);
                    let message = parsed
                        .map(|e| sanitize_tail(e.error.as_bytes(), secrets, STDERR_TAIL))
                        .unwrap_or_default();
                    let e = PluginError::Failed {
                        plugin: plugin_id.into(),
                        op,
                        status: describe(status),
                        message,
                        stderr,
                        class,
                    };
                    tracing::warn!(plugin = plugin_id, %op, detail = %e.detail(), "{e}");
                    Err(e)
                }
            }
            Err(_) => {
                // The plugin's own processes but itself, killed with it: counted too.
                let mut stragglers = Vec::new();
                if let Some(pid) = pid {
                    stragglers = group_members(pid as i32);
                    stragglers.retain(|l| l.pid != pid as i32);
                    kill_group(pid).await;
                }
                let holders = pipe
                    .map(|ino| holders_of_pipe(ino, pid))
                    .unwrap_or_default();
                self.clean_up_after(plugin_id, op, pid, holders, stragglers);
                Err(PluginError::TimedOut {
                    plugin: plugin_id.into(),
                    op,
                    after: timeout,
                    stderr: String::new(),
                })
            }
        }
    }
}

/// The dhv-binder executable plugins call for `dhv-binder helper` (`DHV_BINDER`): this
/// process's own when it is dhv-binder (the agent, `plugin check`), else `DHV_BINDER` from
/// this process's environment, else none (the plugin then looks for `dhv-binder` on its
/// `PATH`). A runner can be given another ([`Runner::with_dhv_binder`]).
pub fn dhv_binder_exe() -> Option<&'static Path> {
    static EXE: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    EXE.get_or_init(|| {
        std::env::current_exe()
            .ok()
            .filter(|p| p.file_name().is_some_and(|n| n == "dhv-binder"))
            .or_else(|| std::env::var_os("DHV_BINDER").map(PathBuf::from))
    })
    .as_deref()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn plugin(dir: &Path, name: &str, body: &str) {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// `fence` is bounded by its own short timeout, not the runner's.
    #[tokio::test]
    async fn a_call_within_a_short_timeout_is_killed_at_it() {
        let dir = tempfile::tempdir().unwrap();
        plugin(dir.path(), "p", "exec /bin/sleep 30");
        let r = Runner::new(dir.path(), Duration::from_secs(60));
        let started = Instant::now();
        let e = r
            .call_within(
                "p",
                Operation::Fence,
                &[],
                &BTreeMap::new(),
                Duration::from_millis(300),
            )
            .await
            .unwrap_err();
        assert!(matches!(e, PluginError::TimedOut { .. }), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5), "{e}");
    }

    #[tokio::test]
    async fn runs_with_only_dhv_env_and_parses_output() {
        let dir = tempfile::tempdir().unwrap();
        plugin(
            dir.path(),
            "p",
            r#"case "$1" in fingerprint) echo '{"version":"1.2.3","deferred_bind":true}';;
               *) /usr/bin/env > "$DHV_TARGET_PATH/env"; echo "{\"path\":\"$DHV_TARGET_PATH\",\"context\":{\"op\":\"$DHV_OPERATION\"}}";; esac"#,
        );
        let r = Runner::new(dir.path(), Duration::from_secs(5));
        assert_eq!(
            r.fingerprint("p").await.unwrap(),
            Fingerprint {
                version: "1.2.3".into(),
                deferred_bind: true,
                capabilities: Vec::new(),
                ..Default::default()
            }
        );
        let out = r
            .call(
                "p",
                Operation::Publish,
                &[("DHV_TARGET_PATH".into(), dir.path().display().to_string())],
                &BTreeMap::new(),
            )
            .await
            .unwrap();
        let res: PublishResult = parse("p", Operation::Publish, &out.stdout).unwrap();
        assert_eq!(res.path.as_deref(), Some(dir.path().to_str().unwrap()));
        assert_eq!(res.context["op"], "publish");
        // Nomad's contract: the environment holds DHV_* variables only (no PATH, no HOME).
        let env = std::fs::read_to_string(dir.path().join("env")).unwrap();
        let names: Vec<&str> = env.lines().filter_map(|l| l.split('=').next()).collect();
        assert!(
            names.iter().all(|n| n.starts_with("DHV_") || *n == "PWD"),
            "{names:?}"
        );
        assert!(names.contains(&"DHV_OPERATION"));
    }

    #[tokio::test]
    async fn the_periodic_rescan_runs_only_a_plugin_whose_file_changed() {
        let dir = tempfile::tempdir().unwrap();
        let runs = tempfile::tempdir().unwrap();
        let log = runs.path().join("runs");
        let versioned = |v: &str| {
            format!(
                r#"echo run >> '{}'; echo '{{"version":"{v}","deferred_bind":true}}'"#,
                log.display()
            )
        };
        let count = || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .count()
        };
        plugin(dir.path(), "p", &versioned("1.0.0"));
        let r = Runner::new(dir.path(), Duration::from_secs(5));
        // Nothing known yet: the plugin runs.
        assert_eq!(
            r.fingerprint_if_changed("p").await.unwrap().version,
            "1.0.0"
        );
        assert_eq!(count(), 1);
        // The same file, unchanged: the remembered fingerprint, no exec.
        assert_eq!(
            r.fingerprint_if_changed("p").await.unwrap().version,
            "1.0.0"
        );
        assert_eq!(
            r.clone().fingerprint_if_changed("p").await.unwrap().version,
            "1.0.0"
        );
        assert_eq!(count(), 1);
        // Rewritten (a new version): it runs again.
        plugin(dir.path(), "p", &versioned("1.0.10"));
        assert_eq!(
            r.fingerprint_if_changed("p").await.unwrap().version,
            "1.0.10"
        );
        assert_eq!(count(), 2);
        // Its mode changed: it runs again.
        std::fs::set_permissions(dir.path().join("p"), std::fs::Permissions::from_mode(0o750))
            .unwrap();
        assert_eq!(
            r.fingerprint_if_changed("p").await.unwrap().version,
            "1.0.10"
        );
        assert_eq!(count(), 3);
        // Replaced by another file (a rename over it): it runs again.
        plugin(runs.path(), "new", &versioned("2.0.0"));
        std::fs::rename(runs.path().join("new"), dir.path().join("p")).unwrap();
        assert_eq!(
            r.fingerprint_if_changed("p").await.unwrap().version,
            "2.0.0"
        );
        assert_eq!(count(), 4);
        // A failed fingerprint is not remembered: every rescan runs the plugin again.
        plugin(
            dir.path(),
            "p",
            &format!("echo run >> '{}'; exit 1", log.display()),
        );
        assert!(r.fingerprint_if_changed("p").await.is_err());
        assert!(r.fingerprint_if_changed("p").await.is_err());
        assert_eq!(count(), 6);
        // An explicit fingerprint always runs.
        plugin(dir.path(), "p", &versioned("3.0.0"));
        assert_eq!(r.fingerprint("p").await.unwrap().version, "3.0.0");
        assert_eq!(r.fingerprint("p").await.unwrap().version, "3.0.0");
        assert_eq!(count(), 8);
    }

    #[tokio::test]
    async fn an_observed_runner_reports_every_call_with_its_outcome() {
        let dir = tempfile::tempdir().unwrap();
        plugin(
            dir.path(),
            "p",
            r#"case "$1" in fingerprint) echo '{"version":"1","deferred_bind":true}';; *) exit 2;; esac"#,
        );
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = seen.clone();
        let r = Runner::new(dir.path(), Duration::from_secs(5)).observed(std::sync::Arc::new(
            move |id: &str, op, e: Option<&PluginError>, _| {
                log.lock().unwrap().push((id.to_string(), op, e.is_some()))
            },
        ));
        r.fingerprint("p").await.unwrap();
        r.call("p", Operation::Publish, &[], &BTreeMap::new())
            .await
            .unwrap_err();
        assert_eq!(
            *seen.lock().unwrap(),
            vec![
                ("p".to_string(), Operation::Fingerprint, false),
                ("p".to_string(), Operation::Publish, true),
            ]
        );
    }

    #[tokio::test]
    async fn failure_carries_message_and_redacted_stderr() {
        let dir = tempfile::tempdir().unwrap();
        plugin(
            dir.path(),
            "p",
            r#"echo "login with s3cret failed" >&2; echo '{"error":"backend s3cret refused"}'; exit 3"#,
        );
        let r = Runner::new(dir.path(), Duration::from_secs(5));
        let secrets = BTreeMap::from([("password".to_string(), "s3cret".to_string())]);
        let e = r
            .call("p", Operation::Create, &[], &secrets)
            .await
            .unwrap_err();
        let text = e.to_string();
        assert!(text.contains("exit code 3"), "{text}");
        // What reaches callers and records carries none of the plugin's output.
        assert!(!text.contains("backend"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
        let detail = e.detail();
        assert!(detail.contains("backend [redacted] refused"), "{detail}");
        assert!(detail.contains("login with [redacted] failed"), "{detail}");
        assert!(!detail.contains("s3cret"), "{detail}");
        // The report (for records and callers off the node) carries the redacted words.
        let report = e.report();
        assert!(report.contains("exit code 3"), "{report}");
        assert!(report.contains("backend [redacted] refused"), "{report}");
        assert!(!report.contains("s3cret"), "{report}");
        assert!(!report.contains("agent's log"), "{report}");
    }

    /// Secrets with quotes, backslashes, newlines and non-ASCII are redacted in every form a
    /// plugin (or our escaping) may print them, before escaping and truncation.
    #[tokio::test]
    async fn awkward_secrets_are_redacted_in_every_form() {
        let dir = tempfile::tempdir().unwrap();
        let secrets = BTreeMap::from([
            ("quote".to_string(), r#"pa"ss'wo\rd"#.to_string()),
            ("lines".to_string(), "first-line\nsecond-line".to_string()),
            ("unicode".to_string(), "pässwörd-秘密".to_string()),
        ]);
        // The plugin echoes each secret raw, JSON-escaped (as jq -R would) and line by line,
        // then a long filler so that truncation happens after the secrets were printed.
        plugin(
            dir.path(),
            "p",
            r#"printf '%s\n' "$DHV_SECRETS" >&2
printf 'first-line\n' >&2
printf '%s\n' 'pa"ss'"'"'wo\rd' 'pässwörd-秘密' 'second-line' >&2
echo "{\"error\":$(printf '%s' "$DHV_SECRETS")}"
exit 1"#,
        );
        let env = [(
            "DHV_SECRETS".to_string(),
            serde_json::to_string(&secrets).unwrap(),
        )];
        let r = Runner::new(dir.path(), Duration::from_secs(5));
        let e = r
            .call("p", Operation::Publish, &env, &secrets)
            .await
            .unwrap_err();
        let shown = format!("{e} {e:?} {}", e.detail());
        for leak in [
            "pa\"ss",
            "wo\\rd",
            "first-line",
            "second-line",
            "pässwörd",
            "秘密",
            "p\\u{e4}ss",
        ] {
            assert!(!shown.contains(leak), "{leak:?} leaked: {shown}");
        }
        assert!(shown.contains("[redacted]"), "{shown}");
        // Text is escaped after redaction: no raw newline reaches a log line.
        assert!(!e.detail().contains('\n'), "{}", e.detail());
    }

    /// A secret that is also part of a path: error text is redacted, but the data the agent
    /// acts on (the published path) is never rewritten.
    #[tokio::test]
    async fn a_secret_inside_a_path_is_redacted_only_in_text() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("vol-data");
        std::fs::create_dir(&target).unwrap();
        plugin(
            dir.path(),
            "p",
            r#"echo "publishing to $DHV_TARGET_PATH" >&2; echo "{\"path\":\"$DHV_TARGET_PATH\"}""#,
        );
        let secrets = BTreeMap::from([("k".to_string(), "vol-data".to_string())]);
        let env = [("DHV_TARGET_PATH".to_string(), target.display().to_string())];
        let r = Runner::new(dir.path(), Duration::from_secs(5));
        let out = r
            .call("p", Operation::Publish, &env, &secrets)
            .await
            .unwrap();
        let res: PublishResult = parse("p", Operation::Publish, &out.stdout).unwrap();
        assert_eq!(res.path.as_deref(), Some(target.to_str().unwrap()));
        assert!(!out.stderr.contains("vol-data"), "{}", out.stderr);
        assert!(out.stderr.contains("[redacted]"), "{}", out.stderr);
    }

    #[tokio::test]
    async fn unsafe_plugin_files_are_refused_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        plugin(dir.path(), "p", "echo '{\"version\":\"1\"}'");
        let r = Runner::new(dir.path(), Duration::from_secs(5));
        assert!(r.fingerprint("p").await.is_ok());
        let p = dir.path().join("p");
        for mode in [0o775, 0o757] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = r.fingerprint("p").await.unwrap_err();
            assert!(matches!(e, PluginError::Unsafe { .. }), "{e}");
            assert!(e.to_string().contains("chmod go-w"), "{e}");
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        nix::unistd::chown(&p, Some(nix::unistd::Uid::from_raw(65534)), None)
            .expect("chown to nobody (this test runs as root, as scripts/test does)");
        let e = r.fingerprint("p").await.unwrap_err();
        assert!(e.to_string().contains("owned by uid 65534"), "{e}");
    }

    #[test]
    fn an_unreadable_plugin_directory_is_an_error_not_empty() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, "").unwrap();
        assert!(Runner::new(&file, Duration::from_secs(1)).list().is_err());
        let missing = dir.path().join("missing");
        assert_eq!(
            Runner::new(&missing, Duration::from_secs(1))
                .list()
                .unwrap(),
            Vec::<String>::new()
        );
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_process_group() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("child.pid");
        plugin(
            dir.path(),
            "p",
            &format!("/bin/sleep 30 & echo $! > {}; wait", marker.display()),
        );
        let r = Runner::new(dir.path(), Duration::from_millis(500));
        let e = r
            .call("p", Operation::Publish, &[], &BTreeMap::new())
            .await
            .unwrap_err();
        assert!(e.is_uncertain(), "{e}");
        let pid: i32 = std::fs::read_to_string(&marker)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // The grandchild must be gone (or a zombie reaped by init) shortly after.
        let gone = (0..40).any(|_| {
            std::thread::sleep(Duration::from_millis(50));
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| s.contains(") Z "))
                .unwrap_or(true)
        });
        assert!(gone, "plugin's child {pid} survived the timeout");
    }

    fn alive(pid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
    }

    /// Issue 33 finding 7: a plugin that leaves children behind. Its `create` leaves one in
    /// its process group (output redirected) and one detached (`setsid`) holding the call's
    /// stdout: the call ends at once, both are killed and counted. A `publish` helper outside
    /// the group is left running (a FUSE server may be one) and counted as left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn children_a_call_leaves_behind_are_killed_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let pids = dir.path().join("pids");
        plugin(
            dir.path(),
            "p",
            &format!(
                "/bin/sleep 300 </dev/null >/dev/null 2>&1 &\necho $! >> {p}\n/usr/bin/setsid /bin/sleep 300 &\necho $! >> {p}\necho '{{}}'",
                p = pids.display()
            ),
        );
        let counted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let c = counted.clone();
        let r = Runner::new(dir.path(), Duration::from_secs(20)).on_leftovers(std::sync::Arc::new(
            move |plugin: &str, op, fate, n| {
                c.lock().unwrap().push((plugin.to_string(), op, fate, n))
            },
        ));
        let started = Instant::now();
        r.call("p", Operation::Create, &[], &BTreeMap::new())
            .await
            .unwrap();
        let took = started.elapsed();
        let left: Vec<i32> = std::fs::read_to_string(&pids)
            .unwrap()
            .lines()
            .map(|l| l.trim().parse().unwrap())
            .collect();
        let survivors: Vec<i32> = (0..40)
            .map(|_| {
                std::thread::sleep(Duration::from_millis(50));
                left.iter()
                    .copied()
                    .filter(|p| alive(*p))
                    .collect::<Vec<_>>()
            })
            .find(|s| s.is_empty())
            .unwrap_or_else(|| left.iter().copied().filter(|p| alive(*p)).collect());
        for p in &survivors {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*p),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        assert!(took < Duration::from_secs(5), "the call waited {took:?}");
        assert!(survivors.is_empty(), "children left running: {survivors:?}");
        assert_eq!(
            *counted.lock().unwrap(),
            vec![("p".to_string(), Operation::Create, LeftoverFate::Killed, 2)]
        );

        // A publish helper outside the group: left, and counted as left.
        std::fs::remove_file(&pids).unwrap();
        counted.lock().unwrap().clear();
        r.call("p", Operation::Publish, &[], &BTreeMap::new())
            .await
            .unwrap();
        let left: Vec<i32> = std::fs::read_to_string(&pids)
            .unwrap()
            .lines()
            .map(|l| l.trim().parse().unwrap())
            .collect();
        let helper_alive = alive(left[1]);
        for p in &left {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*p),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        assert!(helper_alive, "the publish helper was killed");
        assert_eq!(
            *counted.lock().unwrap(),
            vec![
                ("p".to_string(), Operation::Publish, LeftoverFate::Killed, 1),
                ("p".to_string(), Operation::Publish, LeftoverFate::Left, 1)
            ]
        );
    }

    #[tokio::test]
    async fn traversal_and_missing_plugins_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let r = Runner::new(dir.path(), Duration::from_secs(1));
        assert!(matches!(
            r.fingerprint("../../bin/sh").await,
            Err(PluginError::BadId(_))
        ));
        assert!(matches!(
            r.fingerprint("absent").await,
            Err(PluginError::NotFound { .. })
        ));
    }

    #[tokio::test]
    async fn allowed_roots_come_from_the_node_only() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("exports");
        std::fs::create_dir(&root).unwrap();
        plugin(
            dir.path(),
            "p",
            r#"echo "{\"path\":\"$DHV_ALLOWED_ROOTS\"}""#,
        );
        let roots = allowed_roots(&[format!("p={}", root.display())]).unwrap();
        let r = Runner::new(dir.path(), Duration::from_secs(5)).with_allowed_roots(roots);
        // A value smuggled in through the call's environment (e.g. from a record) is ignored.
        let env = [("DHV_ALLOWED_ROOTS".to_string(), "/".to_string())];
        let out = r
            .call("p", Operation::Publish, &env, &BTreeMap::new())
            .await
            .unwrap();
        let res: PublishResult = parse("p", Operation::Publish, &out.stdout).unwrap();
        assert_eq!(res.path.as_deref(), Some(root.to_str().unwrap()));
        // Unconfigured plugins get an empty value (they must refuse: fail closed).
        let r = Runner::new(dir.path(), Duration::from_secs(5));
        let out = r
            .call("p", Operation::Publish, &env, &BTreeMap::new())
            .await
            .unwrap();
        let res: PublishResult = parse("p", Operation::Publish, &out.stdout).unwrap();
        assert_eq!(res.path.as_deref(), Some(""));
        for bad in ["p", "p=relative", "../x=/tmp", "p=/nonexistent/dir"] {
            assert!(allowed_roots(&[bad.to_string()]).is_err(), "{bad}");
        }
    }
}
