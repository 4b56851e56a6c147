//! `volume list -unused DURATION`: volumes idle for at least that long, from the node
//! records (each agent notes when a volume's last user on its node went away, kept across its
//! restarts): in use on some node, unused since a time, or never used on any node.

use super::output::{ago, table};
use crate::cluster::nodes::NodeRecord;
use crate::volume::VolumeKey;

/// How idle one volume is, by every node's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idle {
    /// Some node has an allocation using it.
    InUse,
    /// No node uses it; the latest its last user left any node (Unix seconds).
    Since(u64),
    /// No node has seen it in use.
    Never,
}

/// How idle `key` is by `records`.
pub fn idle(records: &[NodeRecord], key: &VolumeKey) -> Idle {
    let key = key.to_string();
    let mut latest: Option<u64> = None;
    for r in records {
        let Some(v) = r.volumes.get(&key) else {
            continue;
        };
        if !v.users.is_empty() {
            return Idle::InUse;
        }
        if let Some(t) = v.unused_since {
            latest = Some(latest.map_or(t, |l| l.max(t)));
        }
    }
    latest.map_or(Idle::Never, Idle::Since)
}

/// True when `i` has lasted at least `min_secs` at `now` (a volume never used counts).
pub fn idle_for(i: Idle, min_secs: u64, now: u64) -> bool {
    match i {
        Idle::InUse => false,
        Idle::Since(t) => now.saturating_sub(t) >= min_secs,
        Idle::Never => true,
    }
}

/// The readable list of idle volumes: (namespace, name, plugin, idle) rows.
pub fn render(rows: &[(String, String, String, Idle)], now: u64) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|(ns, name, plugin, i)| {
            vec![
                ns.clone(),
                name.clone(),
                plugin.clone(),
                match i {
                    Idle::Since(t) => ago(*t, now),
                    Idle::Never => "never used".into(),
                    Idle::InUse => "in use".into(),
                },
            ]
        })
        .collect();
    table(
        &["Namespace", "Name", "Plugin ID", "Unused Since"],
        &rows,
        "No volume unused that long",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::nodes::NodeVolume;

    fn node(vol: &str, users: usize, since: Option<u64>) -> NodeRecord {
        let mut r = NodeRecord::new("n", "n", "default");
        r.volumes.insert(
            vol.into(),
            NodeVolume {
                users: vec!["a".into(); users],
                unused_since: since,
                ..Default::default()
            },
        );
        r
    }

    #[test]
    fn a_volume_is_idle_from_its_latest_departure_on_any_node() {
        let k = VolumeKey {
            namespace: "default".into(),
            name: "data".into(),
        };
        let records = [
            node("default/data", 0, Some(100)),
            node("default/data", 0, Some(300)),
        ];
        assert_eq!(idle(&records, &k), Idle::Since(300));
        assert!(idle_for(Idle::Since(300), 700, 1000));
        assert!(!idle_for(Idle::Since(300), 701, 1000));
        let used = [
            node("default/data", 0, Some(100)),
            node("default/data", 1, None),
        ];
        assert_eq!(idle(&used, &k), Idle::InUse);
        assert!(!idle_for(Idle::InUse, 0, 1000));
        assert_eq!(idle(&[node("default/other", 0, Some(1))], &k), Idle::Never);
        assert!(idle_for(Idle::Never, u64::MAX, 0));
    }
}
