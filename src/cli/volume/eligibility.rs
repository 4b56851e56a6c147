//! Which nodes can serve a volume, and why no agent acts on its record: the refusals the
//! nodes published, a plugin no live node has.

use super::super::output::short_id;
use crate::cluster::nodes::{Liveness, NodeRecord};
use crate::volume::{self, VolumeRecord, VolumeState};
use std::collections::BTreeMap;

/// Why node `r` cannot serve a volume of `plugin_id` in `node_pool` (`stale`, `pool gpu`,
/// `no such plugin`, `plugin unhealthy: …`, `plugin is not deferred_bind`); `None` when it
/// can. `now` in Unix seconds.
pub fn why_not(r: &NodeRecord, plugin_id: &str, node_pool: &str, now: u64) -> Option<String> {
    if r.can_serve(plugin_id, node_pool, now) {
        return None;
    }
    Some(if r.liveness(now) == Liveness::Stale {
        "stale".to_string()
    } else if !node_pool.is_empty() && r.node_pool != node_pool {
        format!("pool {}", r.node_pool)
    } else {
        match r.plugins.get(plugin_id) {
            None => "no such plugin".into(),
            Some(p) if !p.healthy => format!("plugin unhealthy: {}", p.error),
            Some(p) if p.deferred_bind => "cannot serve it".into(),
            Some(_) => "plugin is not deferred_bind".into(),
        }
    })
}

/// Why no node can serve a plugin, naming what each node has; `None` when one can.
pub fn no_eligible_node(
    records: &[NodeRecord],
    plugin_id: &str,
    node_pool: &str,
    now: u64,
) -> Option<String> {
    if records
        .iter()
        .any(|r| r.can_serve(plugin_id, node_pool, now))
    {
        return None;
    }
    let pool = if node_pool.is_empty() {
        String::new()
    } else {
        format!(" in node pool {node_pool:?}")
    };
    if records.is_empty() {
        return Some(format!(
            "no dhv-binder agent has published its node record, so no node can run plugin {plugin_id:?}{pool}: is the dhv-binder system job running (see `dhv-binder node status`)?"
        ));
    }
    let seen: Vec<String> = records
        .iter()
        .map(|r| {
            let why = why_not(r, plugin_id, node_pool, now).unwrap_or_default();
            format!("{} ({why})", r.node_name)
        })
        .collect();
    Some(format!(
        "no live node has a healthy deferred plugin {plugin_id:?}{pool}: {}; install the plugin in the plugin directory of a node{pool} (see `dhv-binder plugin status`)",
        seen.join(", ")
    ))
}

/// Why no node may create a volume whose `topology_request` requires a topology: no live
/// node that can serve its plugin reports a topology containing a required one (naming
/// what each reports); `None` when one does, or when nothing is required.
pub fn no_topology_node(
    records: &[NodeRecord],
    spec: &volume::VolumeSpec,
    now: u64,
) -> Option<String> {
    let req = &spec.topology_request;
    if req.required.is_empty() {
        return None;
    }
    let able: Vec<&NodeRecord> = records
        .iter()
        .filter(|r| r.can_serve(&spec.plugin_id, &spec.node_pool, now))
        .collect();
    fn topology<'a>(
        r: &'a NodeRecord,
        plugin: &str,
    ) -> Option<&'a crate::volume::topology::Segments> {
        r.plugins.get(plugin).map(|p| &p.topology)
    }
    let topology = |r: &NodeRecord| topology(r, &spec.plugin_id).cloned();
    if able.is_empty() || able.iter().any(|r| req.allows(topology(r).as_ref())) {
        return None;
    }
    let seen: Vec<String> = able
        .iter()
        .map(|r| {
            let t = topology(r).map_or("none".into(), |t| crate::volume::topology::show(&t));
            format!("{} ({t})", r.node_name)
        })
        .collect();
    Some(format!(
        "no live node's plugin {:?} reports a topology that meets the volume's required topologies ({}): {}; change topology_request, or install the plugin where its fingerprint reports one",
        spec.plugin_id,
        req.show_required(),
        seen.join(", ")
    ))
}

/// `id` as `name (id)` from the node records; the ID alone when no record names it.
pub fn node_name(records: &[NodeRecord], id: &str) -> String {
    records
        .iter()
        .find(|r| r.node_id == id)
        .map(|r| format!("{} ({})", r.node_name, short_id(id, false)))
        .unwrap_or_else(|| id.to_string())
}

/// Why no agent acted on `rec` in time: the refusals nodes published for its record, its
/// missing signature, or no node able to serve it. `None` when nothing explains it.
pub fn why_waiting(rec: &VolumeRecord, records: &[NodeRecord], now: u64) -> Option<String> {
    let path = volume::record_path(&rec.spec.name);
    // Nodes that give the same reason are named together.
    let mut by_reason: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for n in records {
        if let Some(why) = n.refusal(&rec.spec.namespace, &path) {
            by_reason.entry(why).or_default().push(&n.node_name);
        }
    }
    let refusals: Vec<String> = by_reason
        .iter()
        .map(|(why, names)| {
            let verb = if names.len() == 1 {
                "refuses"
            } else {
                "refuse"
            };
            format!("{} {verb} it: {why}", names.join(", "))
        })
        .collect();
    if !refusals.is_empty() {
        return Some(format!(
            "{}; fix that and run the command again",
            refusals.join("; ")
        ));
    }
    if rec.state == VolumeState::Pending || rec.state == VolumeState::Deleting {
        if let Some(why) = no_eligible_node(records, &rec.spec.plugin_id, &rec.spec.node_pool, now)
        {
            return Some(why);
        }
    }
    if rec.state == VolumeState::Pending {
        if let Some(why) = no_topology_node(records, &rec.spec, now) {
            return Some(why);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::nodes;

    fn node(name: &str, pool: &str, plugin: Option<(&str, bool)>, seen: u64) -> NodeRecord {
        let mut r = NodeRecord::new(&format!("id-{name}"), name, pool);
        if let Some((id, deferred)) = plugin {
            r.plugins.insert(
                id.into(),
                nodes::PluginInfo {
                    version: "1".into(),
                    deferred_bind: deferred,
                    healthy: true,
                    error: String::new(),
                    capabilities: None,
                    topology: Default::default(),
                },
            );
        }
        r.last_seen = seen;
        r
    }

    /// Issue 48: `volume create` of a volume whose required topology no live node's plugin
    /// reports fails fast, naming what each node reports; one node that does suffices.
    #[test]
    fn create_fails_fast_when_no_node_meets_the_required_topology() {
        let now = 10_000;
        let zoned = |name: &str, zone: &str| {
            let mut r = node(name, "default", Some(("bind", true)), now);
            if let Some(p) = r.plugins.get_mut("bind") {
                p.topology = BTreeMap::from([("zone".to_string(), zone.to_string())]);
            }
            r
        };
        let (spec, _) = volume::parse_spec(
            "name = \"v\"\nplugin_id = \"bind\"\ntopology_request {\n  required {\n    topology { segments = { zone = \"a\" } }\n  }\n}",
        )
        .unwrap();
        let recs = vec![
            zoned("node-1", "b"),
            node("node-2", "default", Some(("bind", true)), now),
        ];
        let why = no_topology_node(&recs, &spec, now).unwrap();
        assert!(
            why.contains("{zone=a}")
                && why.contains("node-1 (zone=b)")
                && why.contains("node-2 (none)"),
            "{why}"
        );
        let recs = vec![zoned("node-1", "b"), zoned("node-3", "a")];
        assert_eq!(no_topology_node(&recs, &spec, now), None);
    }

    #[test]
    fn create_fails_fast_naming_what_each_node_lacks() {
        let now = 10_000;
        let recs = vec![
            node("node-1", "default", Some(("bind", true)), now),
            node("node-2", "gpu", Some(("nfs", true)), now),
            node("node-3", "default", Some(("nfs", false)), now),
            node("node-4", "default", Some(("nfs", true)), now - 1000),
        ];
        assert_eq!(no_eligible_node(&recs, "bind", "", now), None);
        assert_eq!(no_eligible_node(&recs, "nfs", "gpu", now), None);
        let why = no_eligible_node(&recs, "nfs", "default", now).unwrap();
        assert!(why.contains("node-1 (no such plugin)"), "{why}");
        assert!(why.contains("node-2 (pool gpu)"), "{why}");
        assert!(
            why.contains("node-3 (plugin is not deferred_bind)"),
            "{why}"
        );
        assert!(why.contains("node-4 (stale)"), "{why}");
        assert!(why.contains("in node pool \"default\""), "{why}");
        let why = no_eligible_node(&[], "nfs", "", now).unwrap();
        assert!(why.contains("no dhv-binder agent has published"), "{why}");
    }
}
