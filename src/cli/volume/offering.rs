//! `volume status`'s "Offered By": which nodes offer the volume to Nomad's scheduler (a
//! `ready` placeholder host volume there) and why each other node does not, from what the
//! CLI can read: the record, the node records (plugins and their topology, pool, attach
//! counts, the volume's last error there), the placeholders, and, for a volume with
//! `constraint` blocks, each node's attributes (Nomad API: `GET /v1/node/:id`).
//! The agents decide (`agent::offer`); this only explains.

use crate::cluster::nodes::{Liveness, NodeRecord};
use crate::nomad::types::NodeFacts;
use crate::volume::{VolumeRecord, VolumeState};
use serde::Serialize;
use std::collections::BTreeMap;

/// Whether one node offers the volume, and why not.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct NodeOffer {
    #[serde(rename = "NodeID")]
    pub node_id: String,
    pub node_name: String,
    /// The node has a `ready` placeholder of the volume: Nomad may place its users there.
    pub offered: bool,
    /// Why the node does not offer it (or, offered, empty).
    pub why: String,
}

/// Why no node offers the volume, whatever the node: its state, a "final" publish
/// failure, an operator's pause or drain. `None` when nodes may offer it.
pub fn withheld_everywhere(rec: &VolumeRecord) -> Option<String> {
    if rec.state != VolumeState::Ready {
        return Some(format!(
            "the volume is {} (only a ready volume is offered)",
            rec.state.as_str()
        ));
    }
    if let Some(f) = &rec.final_failure {
        return Some(f.reason());
    }
    if !rec.spec.availability.is_active() {
        return Some(format!(
            "paused by an operator (availability {}): only its current users keep it",
            rec.spec.availability
        ));
    }
    None
}

/// Why `node` does not offer `rec` although nothing withholds it everywhere; `None` when
/// nothing the CLI can see explains it. `facts`: the node's attributes (read only for a
/// volume with constraints); `now`: Unix seconds.
fn why_not(
    rec: &VolumeRecord,
    node: &NodeRecord,
    facts: Option<&NodeFacts>,
    now: u64,
) -> Option<String> {
    let plugin = &rec.spec.plugin_id;
    if node.liveness(now) == Liveness::Stale {
        return Some(format!(
            "its agent has not written its node record for {}s",
            now.saturating_sub(node.last_seen)
        ));
    }
    if !rec.spec.node_pool.is_empty() && rec.spec.node_pool != node.node_pool {
        return Some(format!(
            "node pool {:?}, the volume's is {:?}",
            node.node_pool, rec.spec.node_pool
        ));
    }
    let Some(p) = node.plugins.get(plugin) else {
        return Some(format!("plugin {plugin:?} is not on this node"));
    };
    if !p.healthy {
        return Some(format!(
            "plugin {plugin:?} failed its fingerprint: {}",
            p.error
        ));
    }
    if !p.deferred_bind {
        return Some(format!("plugin {plugin:?} does not declare deferred_bind"));
    }
    if !rec.spec.topology_request.allows(Some(&p.topology)) {
        return Some(format!(
            "the plugin's topology here ({}) matches none of the volume's required topologies ({})",
            crate::volume::topology::show(&p.topology),
            rec.spec.topology_request.show_required()
        ));
    }
    if !rec.spec.constraints.is_empty() {
        match facts {
            None => return Some("its attributes cannot be read (GET /v1/node/:id), to evaluate the volume's constraints".into()),
            Some(f) => {
                if let Some(c) = crate::volume::constraint::unsatisfied(f, &rec.spec.constraints) {
                    return Some(format!("it does not satisfy the volume's constraint {c}"));
                }
            }
        }
    }
    if let Some(a) = node.attach.get(plugin) {
        if a.attached >= u64::from(a.max_volumes) {
            return Some(format!(
                "at its attach limit for plugin {plugin:?} ({} of {} volumes attached)",
                a.attached, a.max_volumes
            ));
        }
    }
    let mine = node.volumes.get(&rec.key().to_string());
    if let Some(v) = mine.filter(|v| !v.error.is_empty()) {
        return Some(format!(
            "a publish here failed (a cool-down withholds the volume for up to 5 minutes after a failure of class \"elsewhere\" or 3 in a row): {}",
            v.error
        ));
    }
    None
}

/// Each node of `records` (and each node with a placeholder): whether it offers `rec`, and
/// why not. `ready`: node ID → its placeholder is `ready`; `facts`: node ID → attributes.
pub fn offers(
    rec: &VolumeRecord,
    records: &[NodeRecord],
    ready: &BTreeMap<String, bool>,
    facts: &BTreeMap<String, NodeFacts>,
    now: u64,
) -> Vec<NodeOffer> {
    let everywhere = withheld_everywhere(rec);
    let mut out: Vec<NodeOffer> = records
        .iter()
        .map(|n| {
            let offered = ready.get(&n.node_id).copied().unwrap_or(false);
            let why = if offered {
                String::new()
            } else if let Some(w) = &everywhere {
                w.clone()
            } else {
                why_not(rec, n, facts.get(&n.node_id), now).unwrap_or_else(|| match ready.get(&n.node_id) {
                    Some(false) => "its placeholder is not ready in Nomad (the node is down, or its agent registers it again)".into(),
                    _ => "no placeholder yet (its agent registers one within a minute of the volume being ready)".into(),
                })
            };
            NodeOffer {
                node_id: n.node_id.clone(),
                node_name: n.node_name.clone(),
                offered,
                why,
            }
        })
        .collect();
    for (id, r) in ready {
        if !records.iter().any(|n| &n.node_id == id) {
            out.push(NodeOffer {
                node_id: id.clone(),
                offered: *r,
                why: if *r {
                    String::new()
                } else {
                    "its placeholder is not ready, and no dhv-binder agent publishes a node record there".into()
                },
                ..Default::default()
            });
        }
    }
    out.sort_by(|a, b| {
        (b.offered, &a.node_name, &a.node_id).cmp(&(a.offered, &b.node_name, &b.node_id))
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::nodes::{AttachCount, PluginInfo};

    fn node(name: &str, zone: &str) -> NodeRecord {
        let mut n = NodeRecord::new(&format!("id-{name}"), name, "default");
        n.plugins.insert(
            "bind".into(),
            PluginInfo {
                version: "1".into(),
                deferred_bind: true,
                healthy: true,
                topology: BTreeMap::from([("zone".to_string(), zone.to_string())]),
                ..Default::default()
            },
        );
        n.heartbeat_secs = 30;
        n.last_seen = 1000;
        n
    }

    fn rec() -> VolumeRecord {
        let (spec, _) = crate::volume::parse_spec(
            "name = \"v\"\nplugin_id = \"bind\"\nconstraint {\n  attribute = \"${meta.rack}\"\n  value = \"r1\"\n}\ntopology_request {\n  required {\n    topology { segments = { zone = \"a\" } }\n  }\n}",
        )
        .unwrap();
        let mut r = VolumeRecord::new(spec, BTreeMap::new());
        r.state = VolumeState::Ready;
        r
    }

    fn facts(name: &str, rack: &str) -> NodeFacts {
        NodeFacts {
            id: format!("id-{name}"),
            name: name.into(),
            meta: BTreeMap::from([("rack".to_string(), rack.to_string())]),
            ..Default::default()
        }
    }

    /// Issue 48 #1: each node says whether it offers the volume, and the others why not:
    /// the topology, a constraint, the attach limit, no plugin, a stale record; a "final"
    /// failure or a pause is said for every node.
    #[test]
    fn each_node_says_whether_it_offers_and_why_not() {
        let r = rec();
        let mut limited = node("n4", "a");
        limited.attach.insert(
            "bind".into(),
            AttachCount {
                attached: 2,
                max_volumes: 2,
            },
        );
        let mut bare = node("n5", "a");
        bare.plugins.clear();
        let mut stale = node("n6", "a");
        stale.last_seen = 1;
        let records = vec![
            node("n1", "a"),
            node("n2", "b"),
            node("n3", "a"),
            limited,
            bare,
            stale,
        ];
        let facts: BTreeMap<String, NodeFacts> = ["n1", "n2", "n3", "n4", "n5", "n6"]
            .iter()
            .map(|n| {
                (
                    format!("id-{n}"),
                    facts(n, if *n == "n3" { "r2" } else { "r1" }),
                )
            })
            .collect();
        let ready = BTreeMap::from([("id-n1".to_string(), true)]);
        let o = offers(&r, &records, &ready, &facts, 1000);
        let why = |n: &str| o.iter().find(|x| x.node_name == n).unwrap().why.clone();
        assert!(
            o[0].offered && o[0].node_name == "n1" && o[0].why.is_empty(),
            "{o:?}"
        );
        assert!(
            why("n2").contains("zone=b") && why("n2").contains("{zone=a}"),
            "{}",
            why("n2")
        );
        assert!(why("n3").contains("${meta.rack} = r1"), "{}", why("n3"));
        assert!(why("n4").contains("attach limit"), "{}", why("n4"));
        assert!(why("n5").contains("not on this node"), "{}", why("n5"));
        assert!(why("n6").contains("has not written"), "{}", why("n6"));
        let mut broken = r.clone();
        broken.final_failure = Some(crate::volume::final_failure::FinalFailure::new(
            "id-n1", "n1", "corrupt",
        ));
        let o = offers(&broken, &records, &BTreeMap::new(), &facts, 1000);
        assert!(
            o.iter()
                .all(|x| !x.offered && x.why.contains("class \"final\"")),
            "{o:?}"
        );
    }
}
