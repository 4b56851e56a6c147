//! Delete and deregister on evidence: where a volume may still be mounted, from what each
//! node reports in its record (its journal's mounts, [`NodeRecord::volumes`]) and from the
//! volume's claim. Allocations alone do not prove a volume unused: a stopped job's mount stays
//! while a process on its node holds it (the unpublish is refused and retried), and a delete
//! then would remove the storage under a live mount. `volume delete` and `volume deregister`
//! refuse, and the node that runs the plugin's `delete` checks again just before it, while any
//! of these says the volume is (or may be) mounted somewhere.

use super::claims::claim_path;
use super::nodes::{self, Liveness, NodeRecord};
use crate::nomad::{Client, NomadError};
use crate::volume::VolumeKey;

/// One node that has, or may have, the volume mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountedOn {
    /// The Nomad node ID.
    pub node_id: String,
    /// Why it counts, in words for the operator (state, since when, its users, or that its
    /// record is stale).
    pub why: String,
}

impl std::fmt::Display for MountedOn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "node {} ({})", self.node_id, self.why)
    }
}

/// The nodes whose records show `volume` mounted, publishing or unpublishing at `now` (Unix
/// seconds), and the nodes whose record is stale but lists the volume (what they have
/// mounted now is unknown, so they count). A live record that lists only an error (no
/// mount) does not count.
pub fn mounted_on(records: &[NodeRecord], volume: &VolumeKey, now: u64) -> Vec<MountedOn> {
    let key = volume.to_string();
    records
        .iter()
        .filter_map(|r| {
            let v = r.volumes.get(&key)?;
            let stale = r.liveness(now) == Liveness::Stale;
            if v.state.is_empty() && !stale {
                return None;
            }
            let mut why = if v.state.is_empty() {
                "listed with no mount".to_string()
            } else {
                format!("{} for {}s", v.state, now.saturating_sub(v.since))
            };
            if !v.users.is_empty() {
                why.push_str(&format!(", used by {}", v.users.join(", ")));
            }
            if stale {
                why.push_str(&format!(
                    "; its record is stale, last written {}s ago: what it has mounted now is unknown (start its dhv-binder, or remove the node from Nomad and its record `{}`)",
                    now.saturating_sub(r.last_seen),
                    NodeRecord::path_of(&r.node_id)
                ));
            }
            Some(MountedOn {
                node_id: r.node_id.clone(),
                why,
            })
        })
        .collect()
}

/// Where `volume` is or may be mounted: [`mounted_on`] over every node record, and the
/// claim's holder while its lock is held (a node that claimed it is publishing or has it).
/// Empty when nothing says the volume is mounted anywhere. Nomad API: `GET /v1/vars`,
/// `GET /v1/var/:path`.
pub async fn evidence(
    client: &Client,
    volume: &VolumeKey,
    now: u64,
) -> Result<Vec<MountedOn>, NomadError> {
    let (records, _) = nodes::list(client).await?;
    let mut out = mounted_on(&records, volume, now);
    if let Some(var) = client
        .variable(&volume.namespace, &claim_path(&volume.name))
        .await?
    {
        let held = var.lock.as_ref().is_some_and(|l| !l.id.is_empty());
        if let (true, Some(node)) = (held, var.items.get("node_id")) {
            if !out.iter().any(|m| &m.node_id == node) {
                out.push(MountedOn {
                    node_id: node.clone(),
                    why: "holds the volume's claim".into(),
                });
            }
        }
    }
    Ok(out)
}

/// The sentence that refuses a delete (or deregister) of `volume` mounted on `on`.
pub fn refusal(volume: &VolumeKey, on: &[MountedOn]) -> String {
    let list: Vec<String> = on.iter().map(ToString::to_string).collect();
    format!(
        "volume {volume} is still mounted on {}; its storage is not removed while a node has it mounted: stop what holds the mount there (`dhv-binder volume status {}` shows it), then try again",
        list.join(", "),
        volume.name
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::nodes::NodeVolume;

    fn key() -> VolumeKey {
        VolumeKey {
            namespace: "default".into(),
            name: "v".into(),
        }
    }

    fn record(id: &str, last_seen: u64, state: &str) -> NodeRecord {
        let mut r = NodeRecord::new(id, id, "default");
        r.last_seen = last_seen;
        r.volumes.insert(
            "default/v".into(),
            NodeVolume {
                state: state.into(),
                since: 900,
                users: vec![],
                error: if state.is_empty() {
                    "boom".into()
                } else {
                    String::new()
                },
                ..Default::default()
            },
        );
        r
    }

    #[test]
    fn a_node_that_reports_a_mount_blocks_and_is_named() {
        let on = mounted_on(
            &[record("a", 1000, "unpublishing"), record("b", 1000, "")],
            &key(),
            1000,
        );
        assert_eq!(on.len(), 1, "{on:?}");
        assert_eq!(on[0].node_id, "a");
        assert!(on[0].why.contains("unpublishing"), "{}", on[0].why);
        assert!(refusal(&key(), &on).contains("node a"));
    }

    #[test]
    fn a_stale_record_that_lists_the_volume_blocks_even_without_a_mount() {
        let on = mounted_on(&[record("b", 100, "")], &key(), 1000);
        assert_eq!(on.len(), 1);
        assert!(on[0].why.contains("stale"), "{}", on[0].why);
    }

    #[test]
    fn nodes_that_do_not_list_the_volume_do_not_block() {
        let mut r = record("a", 1000, "published");
        r.volumes.clear();
        assert!(mounted_on(&[r], &key(), 1000).is_empty());
    }
}
