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
    let mut e = h.feed(Input::Catalogue(BTreeMap::from([(key("r"), rec.clone())])));
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
