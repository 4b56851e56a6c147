//! The plugin protocol's words: the operations, the capabilities a fingerprint declares,
//! what each operation prints, and a call that did not succeed (docs/plugin-protocol.md).
//!
//! A new optional operation is a variant of [`Operation`] (its `argv[1]` name and the
//! [`Capability`] it needs) and, when it prints something, a result type here.

use crate::escape::escape_control;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Characters of unparsable stdout kept for the node's log (after redaction).
const BAD_OUTPUT_KEPT: usize = 200;
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
    /// Optional (capability `refresh`): applies the volume's current secrets to its mount
    /// published at `DHV_TARGET_PATH` without unmounting it (Kubernetes CSI's
    /// `requiresRepublish`); called when a referenced Variable changes and every
    /// `refresh_interval` of the fingerprint.
    Refresh,
    /// Optional (capability `stats`): the published volume's own usage, in the shape of
    /// CSI's `NodeGetVolumeStats` ([`super::volume_health::StatsResult`]).
    Stats,
    /// Optional (capability `health`): the published volume's condition as its storage
    /// sees it ([`super::volume_health::HealthResult`]).
    Health,
    /// Optional (capability `list`): the volumes the storage holds
    /// ([`super::volume_health::ListResult`]).
    List,
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
            Operation::Refresh => "refresh",
            Operation::Stats => "stats",
            Operation::Health => "health",
            Operation::List => "list",
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
            Operation::Refresh => Some(Capability::Refresh),
            Operation::Stats => Some(Capability::Stats),
            Operation::Health => Some(Capability::Health),
            Operation::List => Some(Capability::List),
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
    /// A secret the volume references could not be read; the plugin was not called.
    #[error("plugin {plugin:?} {op} not called: {source}")]
    Secret {
        plugin: String,
        op: Operation,
        #[source]
        source: Box<super::secrets::SecretError>,
    },
    #[error("plugin {plugin:?} {op} printed output that is not the expected JSON ({reason}); the output is in the agent's log on this node")]
    BadOutput {
        plugin: String,
        op: Operation,
        reason: String,
        stdout: String,
    },
}

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
    /// A referenced secret that could not be read for now (Nomad or Vault unreachable, a
    /// variable not written yet) is temporary too: the plugin was not called.
    pub fn is_temporary(&self) -> bool {
        match self {
            PluginError::Failed { status, .. } => *status == format!("exit code {EXIT_TEMPORARY}"),
            PluginError::Secret { source, .. } => source.is_transient(),
            _ => false,
        }
    }
}

/// What `fingerprint` prints:
/// `{"version":"1.0.0","deferred_bind":true,"capabilities":["snapshot","clone"]}`.
///
/// Nomad parses only `version` (unknown keys are ignored by Go's `json.Unmarshal`,
/// `client/hostvolumemanager/host_volume_plugin.go`), so the extra keys keep the plugin a
/// valid Nomad DHV plugin.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
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
    /// Where the node's storage is reachable from (CSI's `accessible_topology`):
    /// `{"zone": "a"}`; a spec's `topology_request` is matched against it
    /// ([`crate::volume::topology`]). Checked at fingerprint (bad segments fail it).
    #[serde(default)]
    pub topology: crate::volume::topology::Segments,
    /// With capability `refresh`: how often the agent calls `refresh` on each published
    /// volume of the plugin, besides when a referenced Variable changes (Kubernetes CSI's
    /// `requiresRepublish` period). A duration such as `"10m"` (humantime), from
    /// [`MIN_REFRESH_INTERVAL`] to [`MAX_REFRESH_INTERVAL`]; anything else fails the
    /// fingerprint. Absent: only on a change.
    #[serde(default, deserialize_with = "refresh_interval")]
    pub refresh_interval: Option<Duration>,
}

/// The shortest `refresh_interval` a fingerprint may declare.
pub const MIN_REFRESH_INTERVAL: Duration = Duration::from_secs(10);

/// The longest `refresh_interval` a fingerprint may declare (a week).
pub const MAX_REFRESH_INTERVAL: Duration = Duration::from_secs(7 * 24 * 3600);

fn refresh_interval<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let Some(text) = Option::<String>::deserialize(d)? else {
        return Ok(None);
    };
    let v = humantime::parse_duration(&text).map_err(|e| {
        serde::de::Error::custom(format!(
            "refresh_interval {text:?} is not a duration such as \"10m\" ({e})"
        ))
    })?;
    if !(MIN_REFRESH_INTERVAL..=MAX_REFRESH_INTERVAL).contains(&v) {
        return Err(serde::de::Error::custom(format!(
            "refresh_interval {text:?} is outside {MIN_REFRESH_INTERVAL:?}..={MAX_REFRESH_INTERVAL:?}"
        )));
    }
    Ok(Some(v))
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
    /// `refresh`: applies new credentials to a published volume without unmounting it.
    Refresh,
    /// `stats`: the published volume's own usage, where `statfs` of its mount is a shared
    /// filesystem's.
    Stats,
    /// `health`: the published volume's condition as its storage sees it.
    Health,
    /// `list`: the volumes the storage holds (the orphan report).
    List,
}

impl Capability {
    /// Every capability, in documentation order.
    pub const ALL: [Capability; 11] = [
        Capability::Snapshot,
        Capability::SnapshotList,
        Capability::Clone,
        Capability::Expand,
        Capability::ExpandOnline,
        Capability::Fence,
        Capability::FenceNode,
        Capability::Refresh,
        Capability::Stats,
        Capability::Health,
        Capability::List,
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
            Capability::Refresh => "refresh",
            Capability::Stats => "stats",
            Capability::Health => "health",
            Capability::List => "list",
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
            stdout: escape_control(&super::redact::redact(text, secrets))
                .chars()
                .take(BAD_OUTPUT_KEPT)
                .collect(),
        };
        tracing::warn!(plugin, %op, detail = %e.detail(), "{e}");
        e
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::redact::sanitize_tail;
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

    #[test]
    fn a_refresh_interval_is_a_bounded_duration_or_the_fingerprint_fails() {
        let fp = |extra: &str| {
            parse::<Fingerprint>(
                "dav",
                Operation::Fingerprint,
                format!(r#"{{"version":"1.0.0","deferred_bind":true,"capabilities":["refresh"]{extra}}}"#)
                    .as_bytes(),
            )
        };
        assert_eq!(fp("").unwrap().refresh_interval, None);
        let ok = fp(r#","refresh_interval":"10m""#).unwrap();
        assert_eq!(ok.refresh_interval, Some(Duration::from_secs(600)));
        assert!(ok.require("dav", Operation::Refresh).is_ok());
        for bad in [r#""1s""#, r#""30d""#, r#""often""#, "600"] {
            assert!(
                fp(&format!(r#","refresh_interval":{bad}"#)).is_err(),
                "{bad} was taken"
            );
        }
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
