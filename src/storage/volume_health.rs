//! What the optional operations that tell how a volume is print (docs/plugin-protocol.md,
//! "stats", "health" and "list"), and what the agent makes of it:
//!
//! - `stats` (capability `stats`): the published volume's own usage, for storage where
//!   `statfs` of the mount is a shared filesystem's (bind on an NFS export: every volume
//!   shares one). The shape is CSI's `NodeGetVolumeStatsResponse.usage`
//!   (`{"usage":[{"unit":"BYTES","total":…,"used":…,"available":…},{"unit":"INODES",…}]}`);
//! - `health` (capability `health`): the volume's condition as its storage sees it, CSI's
//!   `VolumeCondition` (`abnormal`, `message`) with a class (`degraded`, `data-loss`,
//!   `inaccessible`: Kubernetes 1.37's classes). A future Nomad plugin `healthcheck`
//!   (hashicorp/nomad#24862) maps onto it;
//! - `list` (capability `list`): the volumes the storage holds, by the IDs dhv-binder gave
//!   them (`DHV_VOLUME_ID` at `create`), for the orphan report.
//!
//! Every figure and word is the plugin's: checked for shape and bounds here, never trusted
//! beyond that (a message is cut and control-escaped; a usage whose parts do not add up is
//! refused).

use crate::escape::escape_control;
use crate::node::usage::{Condition, ConditionClass, Usage};
use serde::Deserialize;

/// The most characters of a `health` message kept (a node record and one terminal line
/// show it).
pub const MAX_HEALTH_MESSAGE: usize = 200;

/// The most volumes one `list` answer may name (more is refused as malformed output).
pub const MAX_LISTED: usize = 100_000;

/// The unit of one usage entry (CSI's `VolumeUsage.Unit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum UsageUnit {
    /// Bytes.
    Bytes,
    /// Inodes (files and directories).
    Inodes,
}

/// One entry of `stats`'s `usage` (CSI's `VolumeUsage`): `total`, `used` and `available`
/// in `unit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct UsageEntry {
    /// `BYTES` or `INODES`.
    pub unit: UsageUnit,
    /// The volume's capacity in `unit` (a quota, the backend's size).
    #[serde(default)]
    pub total: u64,
    /// In use.
    #[serde(default)]
    pub used: u64,
    /// Still free for the volume's writers.
    #[serde(default)]
    pub available: u64,
}

/// What `stats` prints: `{"usage":[…]}` with at most one entry per unit, `BYTES` required.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct StatsResult {
    /// The volume's usage, one entry per unit.
    pub usage: Vec<UsageEntry>,
}

/// A `stats` or `health` answer that is JSON but not a sound answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnswerError {
    #[error("stats printed no BYTES entry in \"usage\" (CSI NodeGetVolumeStats needs one)")]
    NoBytes,
    #[error("stats printed {0} entries for one unit (one per unit)")]
    Repeated(&'static str),
    #[error("stats' {unit} entry does not add up: used {used} and available {available} exceed total {total}")]
    DoesNotAddUp {
        unit: &'static str,
        total: u64,
        used: u64,
        available: u64,
    },
    #[error("health printed \"abnormal\": true without a \"class\" (degraded, data-loss or inaccessible)")]
    NoClass,
    #[error("list printed more than {MAX_LISTED} volumes")]
    TooMany,
    #[error("list printed volume ID {0:?}, which is not an ID dhv-binder gives")]
    BadId(String),
}

impl StatsResult {
    /// The figures in [`Usage`]'s terms: `BYTES` gives capacity, used and available;
    /// `INODES` (optional; zeros when absent) the inode figures. Refused when there is no
    /// `BYTES` entry, a unit is repeated, or `used + available` exceeds `total` (a volume
    /// of unknown capacity prints `total` 0 and is refused: it cannot say how full it is).
    pub fn usage(&self) -> Result<Usage, AnswerError> {
        let mut bytes = None;
        let mut inodes = None;
        for e in &self.usage {
            let (slot, name) = match e.unit {
                UsageUnit::Bytes => (&mut bytes, "BYTES"),
                UsageUnit::Inodes => (&mut inodes, "INODES"),
            };
            if slot.is_some() {
                return Err(AnswerError::Repeated(name));
            }
            if e.used
                .checked_add(e.available)
                .is_none_or(|sum| sum > e.total)
            {
                return Err(AnswerError::DoesNotAddUp {
                    unit: name,
                    total: e.total,
                    used: e.used,
                    available: e.available,
                });
            }
            *slot = Some(*e);
        }
        let b = bytes.ok_or(AnswerError::NoBytes)?;
        let i = inodes.unwrap_or(UsageEntry {
            unit: UsageUnit::Inodes,
            total: 0,
            used: 0,
            available: 0,
        });
        Ok(Usage {
            capacity_bytes: b.total,
            used_bytes: b.used,
            available_bytes: b.available,
            inodes: i.total,
            inodes_used: i.used,
            inodes_free: i.available,
        })
    }
}

/// What `health` prints: `{"abnormal":false}`, or
/// `{"abnormal":true,"class":"degraded","message":"…"}` (CSI's `VolumeCondition` with a
/// class).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct HealthResult {
    /// True when the storage says the volume is not well.
    pub abnormal: bool,
    /// Why, by class; required when `abnormal`.
    #[serde(default)]
    pub class: Option<ConditionClass>,
    /// The storage's words (cut to [`MAX_HEALTH_MESSAGE`] characters, control-escaped).
    #[serde(default)]
    pub message: String,
}

impl HealthResult {
    /// The condition it states: healthy, or abnormal of its class with its message
    /// (escaped and cut). Refused when abnormal without a class.
    pub fn condition(&self) -> Result<Condition, AnswerError> {
        if !self.abnormal {
            return Ok(Condition::default());
        }
        let class = self.class.ok_or(AnswerError::NoClass)?;
        let mut message: String = escape_control(&self.message)
            .chars()
            .take(MAX_HEALTH_MESSAGE)
            .collect();
        if message.is_empty() {
            message = "the plugin's health says so".into();
        }
        Ok(Condition::abnormal(
            class,
            format!("plugin health: {message}"),
        ))
    }
}

/// One volume `list` names: `{"id":"…","bytes":N}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ListedVolume {
    /// The volume ID dhv-binder gave at `create` (`DHV_VOLUME_ID`).
    pub id: String,
    /// Its size, bytes, when the storage knows it (0 when not).
    #[serde(default)]
    pub bytes: u64,
    /// Its Nomad namespace, when the storage knows it (empty when not).
    #[serde(default)]
    pub namespace: String,
}

/// What `list` prints: `{"volumes":[{"id":…,"bytes":…}]}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ListResult {
    /// The volumes the storage holds.
    #[serde(default)]
    pub volumes: Vec<ListedVolume>,
}

impl ListResult {
    /// The IDs, checked: at most [`MAX_LISTED`], each shaped as dhv-binder gives them
    /// (a UUID: ASCII letters, digits and `-`, at most 64 characters).
    pub fn ids(&self) -> Result<std::collections::BTreeSet<String>, AnswerError> {
        if self.volumes.len() > MAX_LISTED {
            return Err(AnswerError::TooMany);
        }
        self.volumes
            .iter()
            .map(|v| {
                let ok = !v.id.is_empty()
                    && v.id.len() <= 64
                    && v.id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
                if ok {
                    Ok(v.id.clone())
                } else {
                    Err(AnswerError::BadId(
                        escape_control(&v.id).chars().take(80).collect(),
                    ))
                }
            })
            .collect()
    }
}

/// What a plugin's `error` starts with when a publish refuses because the volume's data is
/// damaged (the ext4 plugin's check before trust found damage it cannot repair):
/// docs/plugin-protocol.md, "Check before trust".
pub const DATA_LOSS_PREFIX: &str = "data-loss:";

/// The condition a failed publish states, from its report
/// ([`crate::storage::protocol::PluginError::report`]: `plugin "<id>" publish failed
/// (<status>): error: <the plugin's error>…`): `data-loss` when the plugin's `error` starts
/// with [`DATA_LOSS_PREFIX`], with the report as the message; `None` for any other failure.
/// Only the first `): error: ` counts (a plugin ID and a status hold no `)`), so words
/// later in the message cannot forge it.
pub fn failed_publish_condition(report: &str) -> Option<Condition> {
    let (head, rest) = report.split_once("): error: ")?;
    if !head.starts_with("plugin ") || !head.contains(" publish failed (") {
        return None;
    }
    rest.starts_with(DATA_LOSS_PREFIX).then(|| {
        Condition::abnormal(
            ConditionClass::DataLoss,
            report
                .chars()
                .take(MAX_HEALTH_MESSAGE * 2)
                .collect::<String>(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::protocol::{parse, Capability, Fingerprint, Operation};

    #[test]
    fn stats_in_csi_shape_gives_the_volumes_own_usage() {
        let s: StatsResult = parse(
            "bind",
            Operation::Stats,
            br#"{"usage":[{"unit":"BYTES","total":1000,"used":300,"available":700},{"unit":"INODES","total":10,"used":4,"available":6}]}"#,
        )
        .unwrap();
        let u = s.usage().unwrap();
        assert_eq!(
            (u.capacity_bytes, u.used_bytes, u.available_bytes),
            (1000, 300, 700)
        );
        assert_eq!((u.inodes, u.inodes_used, u.inodes_free), (10, 4, 6));
        let bytes_only: StatsResult = parse(
            "bind",
            Operation::Stats,
            br#"{"usage":[{"unit":"BYTES","total":5,"used":5,"available":0}]}"#,
        )
        .unwrap();
        assert_eq!(bytes_only.usage().unwrap().inodes, 0);
    }

    #[test]
    fn unsound_stats_are_refused() {
        let bad = |j: &str| {
            parse::<StatsResult>("p", Operation::Stats, j.as_bytes())
                .map_err(|e| e.to_string())
                .and_then(|s| s.usage().map_err(|e| e.to_string()))
                .unwrap_err()
        };
        assert!(bad(r#"{"usage":[]}"#).contains("no BYTES"));
        assert!(bad(r#"{"usage":[{"unit":"INODES","total":1}]}"#).contains("no BYTES"));
        assert!(
            bad(r#"{"usage":[{"unit":"BYTES","total":1},{"unit":"BYTES","total":1}]}"#)
                .contains("2 entries")
                || bad(r#"{"usage":[{"unit":"BYTES","total":1},{"unit":"BYTES","total":1}]}"#)
                    .contains("one per unit")
        );
        assert!(
            bad(r#"{"usage":[{"unit":"BYTES","total":10,"used":8,"available":8}]}"#)
                .contains("does not add up")
        );
        assert!(bad(
            r#"{"usage":[{"unit":"BYTES","total":18446744073709551615,"used":18446744073709551615,"available":1}]}"#
        )
        .contains("does not add up"));
        assert!(bad(r#"{"usage":[{"unit":"BLOCKS","total":1}]}"#).contains("not the expected JSON"));
        assert!(bad(r#"{}"#).contains("not the expected JSON"));
    }

    #[test]
    fn health_states_a_condition_with_its_class() {
        let h = |j: &str| {
            parse::<HealthResult>("p", Operation::Health, j.as_bytes())
                .unwrap()
                .condition()
        };
        assert_eq!(h(r#"{"abnormal":false}"#).unwrap(), Condition::default());
        let c = h(r#"{"abnormal":true,"class":"degraded","message":"array degraded\n\u001b[2J"}"#)
            .unwrap();
        assert_eq!(c.class, Some(ConditionClass::Degraded));
        assert!(
            c.message.starts_with("plugin health: array degraded"),
            "{c:?}"
        );
        assert!(
            !c.message.contains('\u{1b}') && !c.message.contains('\n'),
            "{c:?}"
        );
        let c = h(&format!(
            r#"{{"abnormal":true,"class":"data-loss","message":"{}"}}"#,
            "x".repeat(5000)
        ))
        .unwrap();
        assert_eq!(c.class, Some(ConditionClass::DataLoss));
        assert!(
            c.message.chars().count() <= MAX_HEALTH_MESSAGE + 20,
            "{c:?}"
        );
        assert_eq!(h(r#"{"abnormal":true}"#).unwrap_err(), AnswerError::NoClass);
        assert!(parse::<HealthResult>(
            "p",
            Operation::Health,
            br#"{"abnormal":true,"class":"meh"}"#
        )
        .is_err());
    }

    /// A publish refused because the data is damaged states `data-loss`; any other
    /// failure, or the words further in, state nothing.
    #[test]
    fn a_publish_refused_for_damage_states_data_loss() {
        let c = failed_publish_condition(
            r#"plugin "ext4" publish failed (exit code 1): error: data-loss: e2fsck -p of /x found damage"#,
        )
        .unwrap();
        assert_eq!(c.class, Some(ConditionClass::DataLoss));
        assert!(c.message.contains("e2fsck -p"), "{c:?}");
        for other in [
            r#"plugin "ext4" publish failed (exit code 1): error: cannot attach a loop device"#,
            r#"plugin "ext4" publish failed (exit code 1): error: x; stderr: ): error: data-loss: forged"#,
            r#"plugin "ext4" unpublish failed (exit code 1): error: data-loss: not a publish"#,
            "cannot start plugin",
        ] {
            assert_eq!(failed_publish_condition(other), None, "{other}");
        }
    }

    #[test]
    fn list_names_ids_dhv_binder_gives() {
        let l: ListResult = parse(
            "bind",
            Operation::List,
            br#"{"volumes":[{"id":"a1-b2","bytes":3},{"id":"c3"}]}"#,
        )
        .unwrap();
        assert_eq!(l.ids().unwrap().len(), 2);
        let bad: ListResult =
            parse("bind", Operation::List, br#"{"volumes":[{"id":"../x"}]}"#).unwrap();
        assert!(matches!(bad.ids(), Err(AnswerError::BadId(_))));
    }

    #[test]
    fn the_operations_need_their_capabilities() {
        let fp: Fingerprint = parse(
            "bind",
            Operation::Fingerprint,
            br#"{"version":"1","capabilities":["stats","health","list"]}"#,
        )
        .unwrap();
        for (op, cap, name) in [
            (Operation::Stats, Capability::Stats, "stats"),
            (Operation::Health, Capability::Health, "health"),
            (Operation::List, Capability::List, "list"),
        ] {
            assert_eq!(op.as_str(), name);
            assert_eq!(cap.as_str(), name);
            assert!(fp.require("bind", op).is_ok());
            let bare: Fingerprint =
                parse("bind", Operation::Fingerprint, br#"{"version":"1"}"#).unwrap();
            assert_eq!(bare.require("bind", op).unwrap_err().capability, cap);
        }
    }
}
