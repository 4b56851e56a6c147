//! The core's offers: a constrained volume is offered only once the node's attributes are
//! read and satisfy it, and withdrawn when they change.

use super::*;
use crate::nomad::types::NodeFacts;
use crate::volume::constraint::Constraint;

fn facts(rack: &str) -> NodeFacts {
    NodeFacts {
        id: NODE.into(),
        name: "node-1".into(),
        meta: BTreeMap::from([("rack".to_string(), rack.to_string())]),
        ..Default::default()
    }
}

fn registers(e: &[Effect]) -> bool {
    e.iter()
        .any(|x| matches!(x, Effect::RegisterPlaceholder { target: t, .. } if *t == target("r")))
}

/// Issue 48 #1: a volume constrained to `${meta.rack} = r1` gets no placeholder before the
/// node is read, one once the node says rack r1, and loses it when the node's meta changes
/// to r2.
#[test]
fn a_constrained_volume_follows_the_nodes_attributes() {
    let mut rec = volume("r", "single-node-writer");
    rec.spec.constraints = vec![Constraint::new("${meta.rack}", "=", "r1").unwrap()];
    let mut h = H::new(&[], vec![]);
    assert!(
        h.setup.iter().any(|x| matches!(x, Effect::ReadNode)),
        "the node is read at start"
    );
    let mut e = h.feed(Input::Catalogue(crate::cluster::catalog::shared(
        BTreeMap::from([(key("r"), rec.clone())]),
    )));
    // The namespace's placeholders are listed first.
    e.extend(h.feed(Input::Tick));
    e.extend(h.feed(Input::Done(Completion::PlaceholdersListed(Ok(
        BTreeMap::new(),
    )))));
    assert!(!registers(&e), "not before the node is read: {e:?}");
    let e = h.feed(Input::Done(Completion::NodeRead(Ok(Some(facts("r2"))))));
    assert!(!registers(&e), "rack r2 does not satisfy it: {e:?}");
    let e = h.feed(Input::Done(Completion::NodeRead(Ok(Some(facts("r1"))))));
    assert!(registers(&e), "rack r1 does: {e:?}");
    h.feed(Input::Done(Completion::Placeholder {
        volume: key("r"),
        result: Ok(Some("hv-r".into())),
    }));
    let e = h.feed(Input::Done(Completion::NodeRead(Ok(Some(facts("r2"))))));
    assert!(
        e.iter()
            .any(|x| matches!(x, Effect::DeregisterPlaceholder { id, .. } if id == "hv-r")),
        "withdrawn when the meta changes: {e:?}"
    );
}

fn fingerprinted(zone: Option<&str>) -> Input {
    let fp = Fingerprint {
        version: "1".into(),
        deferred_bind: true,
        capabilities: Vec::new(),
        max_volumes: None,
        topology: zone
            .map(|z| BTreeMap::from([("zone".to_string(), z.to_string())]))
            .unwrap_or_default(),
        refresh_interval: None,
    };
    Input::Done(Completion::Plugins(BTreeMap::from([(
        "bind".to_string(),
        Ok(fp),
    )])))
}

/// Issue 48 #1: a volume whose `topology_request` requires zone a is offered only while
/// the plugin's fingerprint reports zone a here (not with no topology, not zone b), is
/// withdrawn when it changes, and a pending one is created only where it is met.
#[test]
fn a_required_topology_follows_the_plugins_fingerprint() {
    use crate::volume::topology::{Topology, TopologyRequest};
    let mut rec = volume("r", "single-node-writer");
    rec.spec.topology_request = TopologyRequest {
        required: vec![Topology {
            segments: BTreeMap::from([("zone".to_string(), "a".to_string())]),
        }],
        preferred: Vec::new(),
    };
    let mut h = H::new(&[], vec![]);
    let mut e = h.feed(Input::Catalogue(crate::cluster::catalog::shared(
        BTreeMap::from([(key("r"), rec.clone())]),
    )));
    e.extend(h.feed(Input::Tick));
    e.extend(h.feed(Input::Done(Completion::PlaceholdersListed(Ok(
        BTreeMap::new(),
    )))));
    assert!(!registers(&e), "no topology here: {e:?}");
    let e = h.feed(fingerprinted(Some("b")));
    assert!(!registers(&e), "zone b: {e:?}");
    let why = h.core.status()["offers"]["topology"]["default/r"].to_string();
    assert!(why.contains("zone=b") && why.contains("{zone=a}"), "{why}");
    let e = h.feed(fingerprinted(Some("a")));
    assert!(registers(&e), "zone a: {e:?}");
    h.feed(Input::Done(Completion::Placeholder {
        volume: key("r"),
        result: Ok(Some("hv-r".into())),
    }));
    let e = h.feed(fingerprinted(Some("b")));
    assert!(
        e.iter()
            .any(|x| matches!(x, Effect::DeregisterPlaceholder { id, .. } if id == "hv-r")),
        "withdrawn when the topology changes: {e:?}"
    );
    // A pending volume: created only where the topology is met.
    let mut pending = rec.clone();
    pending.state = VolumeState::Pending;
    let e = h.feed(Input::Catalogue(crate::cluster::catalog::shared(
        BTreeMap::from([(key("r"), pending)]),
    )));
    assert!(!e.iter().any(|x| matches!(x, Effect::Create(_))), "{e:?}");
    let e = h.feed(fingerprinted(Some("a")));
    assert!(e.iter().any(|x| matches!(x, Effect::Create(_))), "{e:?}");
}

/// Issue 48 #3: a record holding a "final" failure (written by another node) withdraws
/// this node's placeholder, and one cleared by an operator brings it back.
#[test]
fn a_final_failure_in_the_record_withdraws_the_placeholder_everywhere() {
    let rec = volume("r", "single-node-writer");
    let mut h = H::new(&[], vec![]);
    let mut e = h.feed(Input::Catalogue(crate::cluster::catalog::shared(
        BTreeMap::from([(key("r"), rec.clone())]),
    )));
    e.extend(h.feed(Input::Tick));
    e.extend(h.feed(Input::Done(Completion::PlaceholdersListed(Ok(
        BTreeMap::new(),
    )))));
    assert!(registers(&e), "{e:?}");
    h.feed(Input::Done(Completion::Placeholder {
        volume: key("r"),
        result: Ok(Some("hv-r".into())),
    }));
    let mut broken = rec.clone();
    broken.final_failure = Some(crate::volume::final_failure::FinalFailure::new(
        "other-node",
        "node-2",
        "superblock corrupt",
    ));
    let e = h.feed(Input::Catalogue(crate::cluster::catalog::shared(
        BTreeMap::from([(key("r"), broken)]),
    )));
    assert!(
        e.iter()
            .any(|x| matches!(x, Effect::DeregisterPlaceholder { id, .. } if id == "hv-r")),
        "{e:?}"
    );
    h.feed(Input::Done(Completion::Placeholder {
        volume: key("r"),
        result: Ok(None),
    }));
    let e = h.feed(Input::Catalogue(crate::cluster::catalog::shared(
        BTreeMap::from([(key("r"), rec)]),
    )));
    assert!(registers(&e), "offered again once cleared: {e:?}");
}

/// A pending volume that prefers zone b is left to the nodes in zone b for
/// [`crate::agent::offer::PREFER_GRACE`]: a node in zone a takes its create only after it.
#[test]
fn a_node_outside_the_preferred_topology_creates_only_after_a_grace() {
    use crate::volume::topology::{Topology, TopologyRequest};
    let mut rec = volume("r", "single-node-writer");
    rec.state = VolumeState::Pending;
    rec.spec.topology_request = TopologyRequest {
        required: Vec::new(),
        preferred: vec![Topology {
            segments: BTreeMap::from([("zone".to_string(), "b".to_string())]),
        }],
    };
    let mut h = H::new(&[], vec![]);
    h.feed(fingerprinted(Some("a")));
    let e = h.feed(Input::Catalogue(crate::cluster::catalog::shared(
        BTreeMap::from([(key("r"), rec)]),
    )));
    assert!(!e.iter().any(|x| matches!(x, Effect::Create(_))), "{e:?}");
    let e = h.at(crate::agent::offer::PREFER_GRACE / 2, Input::Tick);
    assert!(!e.iter().any(|x| matches!(x, Effect::Create(_))), "{e:?}");
    let e = h.at(crate::agent::offer::PREFER_GRACE, Input::Tick);
    assert!(e.iter().any(|x| matches!(x, Effect::Create(_))), "{e:?}");
}
