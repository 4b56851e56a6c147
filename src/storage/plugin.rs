//! The plugin runner: Nomad's dynamic host volume plugin contract, extended with
//! `publish` and `unpublish` for deferred binding (docs/plugin-protocol.md).
//!
//! A plugin is an executable `<plugin_dir>/<plugin_id>`, called with the operation as
//! `argv[1]` and in `DHV_OPERATION`, an environment of `DHV_*` variables only (no PATH, as
//! Nomad does), stdin from /dev/null, stdout parsed as JSON, stderr kept for errors. It runs
//! in its own process group; past the timeout the group gets SIGTERM, then SIGKILL.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

const STDOUT_LIMIT: usize = 1 << 20;
const STDERR_TAIL: usize = 2048;
/// Characters of unparsable stdout kept for the node's log (after redaction).
const BAD_OUTPUT_KEPT: usize = 200;
const KILL_GRACE: Duration = Duration::from_secs(3);
/// Nomad gives fingerprint 1 s; we allow a little more for slow disks.
pub const FINGERPRINT_TIMEOUT: Duration = Duration::from_secs(5);

/// A plugin operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Fingerprint,
    Create,
    Delete,
    Publish,
    Unpublish,
    /// Optional (capability `snapshot`): copies a volume's content into a new snapshot.
    SnapshotCreate,
    /// Optional (capability `snapshot`): removes a snapshot.
    SnapshotDelete,
    /// Optional (capability `snapshot_list`): lists the snapshots the storage holds.
    SnapshotList,
    /// Optional (capability `expand`, online with `expand_online`): grows a volume.
    Expand,
    /// Optional (capability `fence`): makes the volume published at `DHV_TARGET_PATH`
    /// unwritable on this node now, without the network, bounded by [`FENCE_TIMEOUT`].
    Fence,
    /// Optional (capability `fence_node`): revokes node `DHV_FENCED_NODE_ID`'s access to the
    /// volume at the storage, before this node publishes a volume it takes over.
    FenceNode,
    /// Optional (capability `fence_node`): gives node `DHV_FENCED_NODE_ID` its access back.
    UnfenceNode,
}

/// The most a `fence` call may take: it runs when the claim's lease is about to end, and
/// must not wait on the network (docs/plugin-protocol.md, "fence"). Past it the call's
/// process group is killed and the agent's own fence stands alone.
pub const FENCE_TIMEOUT: Duration = Duration::from_secs(2);

impl Operation {
    /// The `argv[1]` / `DHV_OPERATION` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Fingerprint => "fingerprint",
            Operation::Create => "create",
            Operation::Delete => "delete",
            Operation::Publish => "publish",
            Operation::Unpublish => "unpublish",
            Operation::SnapshotCreate => "snapshot_create",
            Operation::SnapshotDelete => "snapshot_delete",
            Operation::SnapshotList => "snapshot_list",
            Operation::Expand => "expand",
            Operation::Fence => "fence",
            Operation::FenceNode => "fence_node",
            Operation::UnfenceNode => "unfence_node",
        }
    }

    /// The capability a plugin must declare in its fingerprint for this operation, `None` for
    /// the operations every deferred plugin has.
    pub fn capability(self) -> Option<Capability> {
        match self {
            Operation::SnapshotCreate | Operation::SnapshotDelete => Some(Capability::Snapshot),
            Operation::SnapshotList => Some(Capability::SnapshotList),
            Operation::Expand => Some(Capability::Expand),
            Operation::Fence => Some(Capability::Fence),
            Operation::FenceNode | Operation::UnfenceNode => Some(Capability::FenceNode),
            _ => None,
        }
    }
}

impl std::fmt::Display for Operation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A plugin call that did not succeed. Its `Display` (what reaches API callers, records and
/// the journal) never carries the plugin's output: `message` and `stderr` are the plugin's
/// own words, redacted and control-escaped, for the agent's log only ([`PluginError::detail`]).
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("plugin ID {0:?} is not a valid name (letters, digits, '_', '.', '-')")]
    BadId(String),
    #[error("plugin {plugin:?} not found: {path} is missing or not executable")]
    NotFound { plugin: String, path: PathBuf },
    #[error("plugin {plugin:?} at {path} is refused: {reason}")]
    Unsafe {
        plugin: String,
        path: PathBuf,
        reason: String,
    },
    #[error("cannot start plugin {plugin:?} {op}: {source}")]
    Spawn {
        plugin: String,
        op: Operation,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "plugin {plugin:?} {op} timed out after {after:?} and was killed; its outcome is unknown (its output is in the agent's log)"
    )]
    TimedOut {
        plugin: String,
        op: Operation,
        after: Duration,
        stderr: String,
    },
    #[error(
        "plugin {plugin:?} {op} failed ({status}); its output is in the agent's log on this node"
    )]
    Failed {
        plugin: String,
        op: Operation,
        status: String,
        message: String,
        stderr: String,
        /// The `error_class` the plugin printed beside its `error`, if any
        /// (it wins over the exit code, [`crate::storage::error_class::ErrorClass::of_status`]).
        class: Option<crate::storage::error_class::ErrorClass>,
    },
    #[error("plugin {plugin:?} {op}: {source}")]
    Helper {
        plugin: String,
        op: Operation,
        #[source]
        source: crate::node::helpers::HelperError,
    },
    #[error("plugin {plugin:?} {op} printed output that is not the expected JSON ({reason}); the output is in the agent's log on this node")]
    BadOutput {
        plugin: String,
        op: Operation,
        reason: String,
        stdout: String,
    },
}

pub use crate::escape::escape_control;

/// Exit code of a plugin call that refuses for now and is to be retried (`EX_TEMPFAIL` of
/// sysexits.h); any other non-zero code is a failure. Used by the optional operations
/// (docs/plugin-protocol.md).
pub const EXIT_TEMPORARY: i32 = 75;

/// The most characters of [`PluginError::report`]: a volume record holds it (Nomad keeps
/// 64 KiB per variable) and one terminal line shows it.
pub const REPORT_LIMIT: usize = 512;

impl PluginError {
    /// The plugin's own words (its `{"error"}` message, stderr tail or stdout), redacted and
    /// escaped, for the agent's local log; empty when there are none.
    pub fn detail(&self) -> String {
        match self {
            PluginError::Failed {
                message, stderr, ..
            } => match (message.is_empty(), stderr.trim().is_empty()) {
                (true, true) => String::new(),
                (false, true) => format!("error: {message}"),
                (true, false) => format!("stderr: {}", stderr.trim()),
                (false, false) => format!("error: {message}; stderr: {}", stderr.trim()),
            },
            PluginError::TimedOut { stderr, .. } => stderr.trim().to_string(),
            PluginError::BadOutput { stdout, .. } => format!("stdout: {stdout}"),
            _ => String::new(),
        }
    }

    /// One line for whoever is off the node (the volume record, `volume create`, `volume
    /// status`, the conformance kit's evidence): what failed, with the plugin's own words
    /// ([`PluginError::detail`]: redacted, escaped) in place of "its output is in the agent's
    /// log", cut to [`REPORT_LIMIT`] characters. Without plugin words it is the `Display`.
    pub fn report(&self) -> String {
        let detail = self.detail();
        if detail.is_empty() {
            return self.to_string();
        }
        let head = match self {
            PluginError::Failed {
                plugin, op, status, ..
            } => format!("plugin {plugin:?} {op} failed ({status})"),
            PluginError::TimedOut {
                plugin, op, after, ..
            } => format!(
                "plugin {plugin:?} {op} timed out after {after:?} and was killed; its outcome is unknown"
            ),
            PluginError::BadOutput {
                plugin, op, reason, ..
            } => format!(
                "plugin {plugin:?} {op} printed output that is not the expected JSON ({reason})"
            ),
            _ => return self.to_string(),
        };
        // A plugin's last newline, escaped, says nothing.
        let mut detail = detail.as_str();
        while let Some(d) = detail.strip_suffix("\\u{a}") {
            detail = d.trim_end();
        }
        let line = format!("{head}: {detail}");
        if line.chars().count() <= REPORT_LIMIT {
            return line;
        }
        let mut cut: String = line.chars().take(REPORT_LIMIT - 1).collect();
        cut.push('…');
        cut
    }

    /// True when the call may have had an effect we did not see (timeout).
    pub fn is_uncertain(&self) -> bool {
        matches!(self, PluginError::TimedOut { .. })
    }

    /// True when the plugin refused for now and asks to be called again later: exit code
    /// [`EXIT_TEMPORARY`] (for example ext4's `expand` while the filesystem is still mounted
    /// somewhere). The operation stays pending and is retried with backoff.
    pub fn is_temporary(&self) -> bool {
        matches!(self, PluginError::Failed { status, .. } if *status == format!("exit code {EXIT_TEMPORARY}"))
    }
}

/// What `fingerprint` prints:
/// `{"version":"1.0.0","deferred_bind":true,"capabilities":["snapshot","clone"]}`.
///
/// Nomad parses only `version` (unknown keys are ignored by Go's `json.Unmarshal`,
/// `client/hostvolumemanager/host_volume_plugin.go`), so the extra keys keep the plugin a
/// valid Nomad DHV plugin.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Fingerprint {
    pub version: String,
    #[serde(default)]
    pub deferred_bind: bool,
    /// The optional operations the plugin declares, as written (unknown names are kept and
    /// ignored, so a newer plugin runs under an older agent).
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// How many of its volumes the node can have published at once (CSI's
    /// `max_volumes_per_node`); unlimited when absent. The agent's `--max-volumes` overrides
    /// it (docs/plugin-protocol.md, "Attach limits").
    #[serde(default)]
    pub max_volumes: Option<u32>,
}

impl Fingerprint {
    /// True when the fingerprint declares `cap`.
    pub fn supports(&self, cap: Capability) -> bool {
        self.capabilities.iter().any(|c| c == cap.as_str())
    }

    /// `Ok` when the plugin declares what `op` needs; else the error that names the plugin
    /// and the missing capability.
    pub fn require(&self, plugin: &str, op: Operation) -> Result<(), CapabilityError> {
        match op.capability() {
            Some(cap) => self.require_capability(plugin, cap),
            None => Ok(()),
        }
    }

    /// `Ok` when the plugin declares `cap`; else the error that names the plugin and `cap`.
    pub fn require_capability(&self, plugin: &str, cap: Capability) -> Result<(), CapabilityError> {
        if self.supports(cap) {
            Ok(())
        } else {
            Err(CapabilityError {
                plugin: plugin.into(),
                capability: cap,
                declared: self.capabilities.clone(),
            })
        }
    }
}

/// An optional operation a plugin may declare in its fingerprint's `capabilities`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Capability {
    /// `snapshot_create`, `snapshot_delete`, and `create` with `DHV_SNAPSHOT_ID`.
    Snapshot,
    /// `snapshot_list`: what the storage holds, with the caller's secrets.
    SnapshotList,
    /// `create` with `DHV_CLONE_ID`: a new volume with another volume's content.
    Clone,
    /// `expand` while the volume is not published.
    Expand,
    /// `expand` while the volume is published (the filesystem grows under its users).
    ExpandOnline,
    /// `fence`: makes the volume unwritable on this node now, without the network.
    Fence,
    /// `fence_node` and `unfence_node`: revoke and restore another node's access at the
    /// storage (an export rule, a blocklist entry, a reservation).
    FenceNode,
}

impl Capability {
    /// Every capability, in documentation order.
    pub const ALL: [Capability; 7] = [
        Capability::Snapshot,
        Capability::SnapshotList,
        Capability::Clone,
        Capability::Expand,
        Capability::ExpandOnline,
        Capability::Fence,
        Capability::FenceNode,
    ];

    /// The name in the fingerprint.
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Snapshot => "snapshot",
            Capability::SnapshotList => "snapshot_list",
            Capability::Clone => "clone",
            Capability::Expand => "expand",
            Capability::ExpandOnline => "expand_online",
            Capability::Fence => "fence",
            Capability::FenceNode => "fence_node",
        }
    }
}

impl std::fmt::Display for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An optional operation was asked of a plugin that does not declare it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "plugin {plugin:?} does not support {capability}: its fingerprint declares capabilities {declared:?}, without {:?} (use a plugin that declares it, see docs/plugin-protocol.md#optional-operations)",
    capability.as_str()
)]
pub struct CapabilityError {
    pub plugin: String,
    pub capability: Capability,
    pub declared: Vec<String>,
}

/// What `snapshot_create` prints: `{"bytes":N,"context":{...}}`. `context` is stored in the
/// snapshot record and handed to `snapshot_delete` and to `create` from the snapshot.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct SnapshotResult {
    #[serde(default)]
    pub bytes: u64,
    #[serde(default)]
    pub context: serde_json::Value,
}

/// One entry of `snapshot_list`'s `{"snapshots":[{"id":…,"bytes":…,"ready":true}]}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ListedSnapshot {
    /// The snapshot ID dhv-binder gave at `snapshot_create` (DHV_SNAPSHOT_ID).
    pub id: String,
    #[serde(default)]
    pub bytes: u64,
    #[serde(default = "yes")]
    pub ready: bool,
}

fn yes() -> bool {
    true
}

/// What `snapshot_list` prints.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct SnapshotListResult {
    #[serde(default)]
    pub snapshots: Vec<ListedSnapshot>,
}

/// What `expand` prints: `{"bytes":N}`, the volume's size afterwards.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ExpandResult {
    #[serde(default)]
    pub bytes: u64,
}

/// What `create` prints for a deferred plugin: `{"bytes":N,"context":{...}}`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CreateResult {
    #[serde(default)]
    pub bytes: u64,
    #[serde(default)]
    pub context: serde_json::Value,
}

/// What `publish` prints: `{"path":"/target","context":{...}}`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PublishResult {
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub context: serde_json::Value,
}

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

/// A process left over from a plugin call, holding its stdout or stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    pub pid: i32,
    /// Its command name (`/proc/<pid>/comm`).
    pub comm: String,
}

impl std::fmt::Display for Leftover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} ({})", self.pid, escape_control(&self.comm))
    }
}

/// How long output is still read once the plugin has exited: what it wrote is in the pipe
/// already, so only a pipe some other process still holds open waits this long.
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(250);

/// Reads `r` into a buffer (keeping the first `limit` bytes, discarding the rest so the
/// writer never blocks) until EOF, or, once `exited` holds the plugin's exit time, until
/// [`DRAIN_AFTER_EXIT`] after it. Returns the bytes and whether the pipe was still held
/// open by someone else at that point.
async fn read_output<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    limit: usize,
    mut exited: tokio::sync::watch::Receiver<Option<Instant>>,
) -> (Vec<u8>, bool) {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        let exit_time = *exited.borrow();
        let n = match exit_time {
            Some(at) => {
                let until = tokio::time::Instant::from_std(at + DRAIN_AFTER_EXIT);
                match tokio::time::timeout_at(until, r.read(&mut chunk)).await {
                    Ok(n) => n,
                    Err(_) => return (buf, true),
                }
            }
            None => tokio::select! {
                n = r.read(&mut chunk) => n,
                changed = exited.changed() => {
                    if changed.is_err() {
                        // The waiter is gone: the call is over either way.
                        return (buf, false);
                    }
                    continue;
                }
            },
        };
        match n {
            Ok(0) | Err(_) => return (buf, false),
            Ok(n) => {
                let room = limit.saturating_sub(buf.len());
                buf.extend_from_slice(&chunk[..n.min(room)]);
            }
        }
    }
}

/// The inode of the pipe behind `stdout`, to find who else holds it.
fn pipe_inode(stdout: &tokio::process::ChildStdout) -> Option<u64> {
    use std::os::fd::AsRawFd;
    nix::sys::stat::fstat(stdout.as_raw_fd())
        .ok()
        .map(|st| st.st_ino)
}

/// Processes other than this one and outside process group `group` (the call's, killed
/// when it ends) with the pipe `inode` open (found in /proc/*/fd).
fn holders_of_pipe(inode: u64, group: Option<u32>) -> Vec<Leftover> {
    let want = format!("pipe:[{inode}]");
    let me = std::process::id() as i32;
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me || group.is_some_and(|g| process_group(pid) == Some(g as i32)) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let holds = fds
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == want.as_str()));
        if holds {
            let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
            out.push(Leftover {
                pid,
                comm: comm.trim().to_string(),
            });
        }
    }
    out
}

/// The live processes (not zombies) of process group `group`, from /proc.
fn group_members(group: i32) -> Vec<Leftover> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|p| p.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| process_group(*pid) == Some(group))
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .and_then(|(_, r)| r.split_whitespace().next().map(|st| st != "Z"))
                })
                .unwrap_or(false)
        })
        .map(|pid| Leftover {
            pid,
            comm: std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .unwrap_or_default()
                .trim()
                .to_string(),
        })
        .collect()
}

/// The process group of `pid` (field 5 of /proc/<pid>/stat, after the command in
/// parentheses).
fn process_group(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(2)?
        .parse()
        .ok()
}

fn describe_leftover(found: &[Leftover]) -> String {
    found
        .iter()
        .map(Leftover::to_string)
        .collect::<Vec<_>>()
        .join(", ")
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
        if !matches!(op, Operation::Publish | Operation::Unpublish) {
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

async fn kill_group(pid: u32) {
    use nix::sys::signal::{killpg, Signal};
    let pg = nix::unistd::Pid::from_raw(pid as i32);
    if killpg(pg, Signal::SIGTERM).is_err() {
        return;
    }
    let deadline = Instant::now() + KILL_GRACE;
    while Instant::now() < deadline {
        // Signal 0 probes whether any process of the group is left.
        if killpg(pg, None).is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = killpg(pg, Signal::SIGKILL);
}

fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "unknown status".into(),
    }
}

/// Parses a plugin's stdout as `T`. Empty stdout parses as `{}`.
pub fn parse<T: serde::de::DeserializeOwned>(
    plugin: &str,
    op: Operation,
    stdout: &[u8],
) -> Result<T, PluginError> {
    parse_with(plugin, op, stdout, &BTreeMap::new())
}

/// [`parse`] for an operation that was given `secrets`: on bad output the stdout kept in the
/// error (and logged here, on the node only) is redacted before it is escaped and cut.
pub fn parse_with<T: serde::de::DeserializeOwned>(
    plugin: &str,
    op: Operation,
    stdout: &[u8],
    secrets: &BTreeMap<String, String>,
) -> Result<T, PluginError> {
    let text = String::from_utf8_lossy(stdout);
    let text = if text.trim().is_empty() {
        "{}"
    } else {
        text.trim()
    };
    // serde_json's messages may quote the offending value: keep only its kind and place.
    serde_json::from_str(text).map_err(|e| {
        let e = PluginError::BadOutput {
            plugin: plugin.into(),
            op,
            reason: format!(
                "{:?} error at line {} column {}",
                e.classify(),
                e.line(),
                e.column()
            ),
            stdout: escape_control(&redact(text, secrets))
                .chars()
                .take(BAD_OUTPUT_KEPT)
                .collect(),
        };
        tracing::warn!(plugin, %op, detail = %e.detail(), "{e}");
        e
    })
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

    #[test]
    fn fencing_operations_need_their_capabilities() {
        let fp: Fingerprint = serde_json::from_str(
            r#"{"version":"1","deferred_bind":true,"capabilities":["fence","fence_node","later"]}"#,
        )
        .unwrap();
        assert!(fp.supports(Capability::Fence) && fp.supports(Capability::FenceNode));
        for op in [
            Operation::Fence,
            Operation::FenceNode,
            Operation::UnfenceNode,
        ] {
            assert!(fp.require("p", op).is_ok(), "{op}");
        }
        assert_eq!(Operation::FenceNode.as_str(), "fence_node");
        assert_eq!(Operation::UnfenceNode.as_str(), "unfence_node");
        let bare: Fingerprint = serde_json::from_str(r#"{"version":"1"}"#).unwrap();
        let e = bare.require("p", Operation::UnfenceNode).unwrap_err();
        assert_eq!(e.capability, Capability::FenceNode);
        assert!(e.to_string().contains("fence_node"), "{e}");
        assert!(bare.require("p", Operation::Fence).is_err());
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
                max_volumes: None,
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

    #[test]
    fn a_report_is_bounded_and_without_words_is_the_display() {
        let e = PluginError::Failed {
            plugin: "p".into(),
            op: Operation::Create,
            status: "exit code 1".into(),
            message: "x".repeat(5000),
            stderr: String::new(),
            class: None,
        };
        assert_eq!(e.report().chars().count(), REPORT_LIMIT);
        assert!(e.report().ends_with('…'));
        let quiet = PluginError::Failed {
            plugin: "p".into(),
            op: Operation::Create,
            status: "exit code 1".into(),
            message: String::new(),
            stderr: " ".into(),
            class: None,
        };
        assert_eq!(quiet.report(), quiet.to_string());
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

    #[test]
    fn redaction_happens_before_truncation_and_escaping() {
        let secrets = BTreeMap::from([("k".to_string(), "top\nsecret\"value".to_string())]);
        // The secret straddles the cut: redacting after cutting would leak its tail.
        let raw = format!("{}top\nsecret\"value and more", "x".repeat(30));
        let t = sanitize_tail(raw.as_bytes(), &secrets, 25);
        assert!(!t.contains("value"), "{t}");
        assert!(!t.contains("secret"), "{t}");
        assert_eq!(
            escape_control("a\u{1b}[2Jb\r\u{202e}c\\"),
            "a\\u{1b}[2Jb\\u{d}\\u{202e}c\\\\"
        );
        // Cut on a character boundary.
        assert_eq!(sanitize_tail("ééé".as_bytes(), &BTreeMap::new(), 3), "é");
    }

    #[test]
    fn unparsable_stdout_is_redacted_before_it_is_cut() {
        let secret = "s3cr3t-value-longer-than-the-cut";
        let secrets = BTreeMap::from([("k".to_string(), secret.to_string())]);
        // The secret straddles the 200-character cut: cutting first would keep its head.
        let out = format!("{}{secret} not json", "x".repeat(BAD_OUTPUT_KEPT - 10));
        let e = parse_with::<Fingerprint>("p", Operation::Publish, out.as_bytes(), &secrets)
            .unwrap_err();
        let shown = format!("{e} {}", e.detail());
        assert!(!shown.contains(&secret[..10]), "{shown}");
        assert!(shown.contains("[redac"), "{shown}");
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

    #[test]
    fn capabilities_are_read_from_the_fingerprint_and_required_by_name() {
        let fp: Fingerprint = parse(
            "ext4",
            Operation::Fingerprint,
            br#"{"version":"1.0.0","deferred_bind":true,"capabilities":["snapshot","expand","from-the-future"]}"#,
        )
        .unwrap();
        assert!(fp.supports(Capability::Snapshot));
        assert!(fp.supports(Capability::Expand));
        assert!(!fp.supports(Capability::ExpandOnline));
        assert!(fp.require("ext4", Operation::SnapshotCreate).is_ok());
        assert!(fp.require("ext4", Operation::Publish).is_ok());
        let e = fp.require("ext4", Operation::SnapshotList).unwrap_err();
        assert_eq!(e.capability, Capability::SnapshotList);
        let text = e.to_string();
        assert!(
            text.contains("\"ext4\"") && text.contains("snapshot_list"),
            "{text}"
        );
        // A fingerprint without capabilities (every plain Nomad plugin) declares none.
        let plain: Fingerprint =
            parse("webdav", Operation::Fingerprint, br#"{"version":"1.0.0"}"#).unwrap();
        for op in [
            Operation::SnapshotCreate,
            Operation::SnapshotDelete,
            Operation::SnapshotList,
            Operation::Expand,
        ] {
            assert!(plain.require("webdav", op).is_err(), "{op}");
        }
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
