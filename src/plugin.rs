//! The plugin runner: Nomad's dynamic host volume plugin contract, extended with
//! `publish` and `unpublish` for deferred binding (docs/plugin-protocol.md).
//!
//! A plugin is an executable `<plugin_dir>/<plugin_id>`, called with the operation as
//! argv[1] and in `DHV_OPERATION`, an environment of `DHV_*` variables only (no PATH, as
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
}

impl Operation {
    /// The argv[1] / DHV_OPERATION value.
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
        }
    }

    /// The capability a plugin must declare in its fingerprint for this operation, `None` for
    /// the operations every deferred plugin has.
    pub fn capability(self) -> Option<Capability> {
        match self {
            Operation::SnapshotCreate | Operation::SnapshotDelete => Some(Capability::Snapshot),
            Operation::SnapshotList => Some(Capability::SnapshotList),
            Operation::Expand => Some(Capability::Expand),
            _ => None,
        }
    }
}

impl std::fmt::Display for Operation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A plugin call that did not succeed. `stderr` is the redacted tail of what it wrote.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("plugin ID {0:?} is not a valid name (letters, digits, '_', '.', '-')")]
    BadId(String),
    #[error("plugin {plugin:?} not found: {path} is missing or not executable")]
    NotFound { plugin: String, path: PathBuf },
    #[error("cannot start plugin {plugin:?} {op}: {source}")]
    Spawn {
        plugin: String,
        op: Operation,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "plugin {plugin:?} {op} timed out after {after:?} and was killed; its outcome is unknown{}",
        tail(stderr)
    )]
    TimedOut {
        plugin: String,
        op: Operation,
        after: Duration,
        stderr: String,
    },
    #[error(
        "plugin {plugin:?} {op} failed ({status}){}{}",
        msg(message),
        tail(stderr)
    )]
    Failed {
        plugin: String,
        op: Operation,
        status: String,
        message: String,
        stderr: String,
    },
    #[error("plugin {plugin:?} {op} printed output that is not the expected JSON ({reason}): {stdout:?}")]
    BadOutput {
        plugin: String,
        op: Operation,
        reason: String,
        stdout: String,
    },
}

fn tail(stderr: &str) -> String {
    if stderr.trim().is_empty() {
        String::new()
    } else {
        format!("; stderr: {}", stderr.trim())
    }
}

fn msg(m: &str) -> String {
    if m.is_empty() {
        String::new()
    } else {
        format!(": {m}")
    }
}

impl PluginError {
    /// True when the call may have had an effect we did not see (timeout).
    pub fn is_uncertain(&self) -> bool {
        matches!(self, PluginError::TimedOut { .. })
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
}

impl Capability {
    /// Every capability, in documentation order.
    pub const ALL: [Capability; 5] = [
        Capability::Snapshot,
        Capability::SnapshotList,
        Capability::Clone,
        Capability::Expand,
        Capability::ExpandOnline,
    ];

    /// The name in the fingerprint.
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Snapshot => "snapshot",
            Capability::SnapshotList => "snapshot_list",
            Capability::Clone => "clone",
            Capability::Expand => "expand",
            Capability::ExpandOnline => "expand_online",
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

/// Runs plugins from one directory.
#[derive(Debug, Clone)]
pub struct Runner {
    plugin_dir: PathBuf,
    timeout: Duration,
}

/// The successful output of one call.
#[derive(Debug, Clone)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: String,
    pub elapsed: Duration,
}

/// Replaces every secret value in `text` with `[redacted]`.
pub fn redact(text: &str, secrets: &BTreeMap<String, String>) -> String {
    let mut out = text.to_string();
    for v in secrets.values().filter(|v| !v.is_empty()) {
        out = out.replace(v.as_str(), "[redacted]");
    }
    out
}

impl Runner {
    /// A runner for `plugin_dir`, killing calls after `timeout`.
    pub fn new(plugin_dir: &Path, timeout: Duration) -> Self {
        Self {
            plugin_dir: plugin_dir.to_path_buf(),
            timeout,
        }
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

    /// Lists the plugin IDs present (executable regular files with valid names).
    pub fn list(&self) -> Vec<String> {
        use std::os::unix::fs::PermissionsExt;
        let Ok(rd) = std::fs::read_dir(&self.plugin_dir) else {
            return Vec::new();
        };
        let mut ids: Vec<String> = rd
            .filter_map(|e| e.ok())
            .filter(|e| {
                std::fs::metadata(e.path())
                    .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            })
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| crate::volume::validate_identifier("plugin_id", n, false).is_ok())
            .collect();
        ids.sort();
        ids
    }

    /// Runs `fingerprint`.
    pub async fn fingerprint(&self, plugin_id: &str) -> Result<Fingerprint, PluginError> {
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
                stdout: String::from_utf8_lossy(&out.stdout).into(),
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
        self.run(plugin_id, op, env, secrets, self.timeout).await
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
        if !path.is_file() {
            return Err(PluginError::NotFound {
                plugin: plugin_id.into(),
                path,
            });
        }
        let started = Instant::now();
        let mut cmd = tokio::process::Command::new(&path);
        cmd.arg(op.as_str())
            .env_clear()
            .env("DHV_OPERATION", op.as_str())
            .envs(env.iter().map(|(k, v)| (k, v)))
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
        let read_out = async move {
            let mut buf = Vec::new();
            let _ = (&mut stdout)
                .take(STDOUT_LIMIT as u64)
                .read_to_end(&mut buf)
                .await;
            buf
        };
        let read_err = async move {
            let mut buf = Vec::new();
            let _ = (&mut stderr)
                .take(4 * STDOUT_LIMIT as u64)
                .read_to_end(&mut buf)
                .await;
            buf
        };
        let work = async {
            let (o, e, status) = tokio::join!(read_out, read_err, child.wait());
            (o, e, status)
        };
        match tokio::time::timeout(timeout, work).await {
            Ok((out, err, status)) => {
                let stderr = redact(&tail_of(&err), secrets);
                let status = status.map_err(|source| PluginError::Spawn {
                    plugin: plugin_id.into(),
                    op,
                    source,
                })?;
                // A plugin that exits while its children still hold the group: clean up.
                if let Some(pid) = pid {
                    let _ = nix::sys::signal::killpg(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
                if status.success() {
                    Ok(Output {
                        stdout: out,
                        stderr,
                        elapsed: started.elapsed(),
                    })
                } else {
                    #[derive(Deserialize)]
                    struct ErrOut {
                        error: String,
                    }
                    let message = serde_json::from_slice::<ErrOut>(&out)
                        .map(|e| redact(&e.error, secrets))
                        .unwrap_or_default();
                    Err(PluginError::Failed {
                        plugin: plugin_id.into(),
                        op,
                        status: describe(status),
                        message,
                        stderr,
                    })
                }
            }
            Err(_) => {
                if let Some(pid) = pid {
                    kill_group(pid).await;
                }
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

fn tail_of(bytes: &[u8]) -> String {
    let start = bytes.len().saturating_sub(STDERR_TAIL);
    String::from_utf8_lossy(&bytes[start..]).into_owned()
}

/// Parses a plugin's stdout as `T`. Empty stdout parses as `{}`.
pub fn parse<T: serde::de::DeserializeOwned>(
    plugin: &str,
    op: Operation,
    stdout: &[u8],
) -> Result<T, PluginError> {
    let text = String::from_utf8_lossy(stdout);
    let text = if text.trim().is_empty() {
        "{}"
    } else {
        text.trim()
    };
    serde_json::from_str(text).map_err(|e| PluginError::BadOutput {
        plugin: plugin.into(),
        op,
        reason: e.to_string(),
        stdout: text.chars().take(200).collect(),
    })
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
        assert!(text.contains("backend [redacted] refused"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
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
}
