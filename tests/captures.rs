//! Every real Nomad capture (testdata/nomad-captures) and every synthesised fixture
//! (testdata/nomad-fixtures) decodes with the daemon's types.

use dhv_binder::nomad::events::{decode_line, Line};
use dhv_binder::nomad::types::{Allocation, HostVolume, HostVolumeStub, Variable};
use std::path::PathBuf;

fn shared(dir: &str, name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("testdata")
        .join(dir)
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the test data lives in testdata/ at the repository root)",
            p.display()
        )
    })
}

#[test]
fn node_allocation_lists_decode() {
    for (dir, name) in [
        ("nomad-captures", "node-allocations-3-allocs-1.0.x.json"),
        ("nomad-fixtures", "node-allocations.json"),
    ] {
        let allocs: Vec<Allocation> =
            serde_json::from_str(&shared(dir, name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!allocs.is_empty(), "{name}");
        for a in &allocs {
            assert!(!a.id.is_empty() && !a.node_id.is_empty(), "{name}");
            assert!(a.job.is_some(), "{name}: node lists carry the Job");
        }
    }
}

#[test]
fn allocation_read_decodes_with_volumes_and_lifecycle() {
    let a: Allocation = serde_json::from_str(&shared("nomad-fixtures", "allocation.json")).unwrap();
    let g = a.group().expect("group");
    assert_eq!(
        g.volumes.get("data").map(|v| v.source.as_str()),
        Some("orders-data")
    );
    assert!(g
        .tasks
        .iter()
        .any(|t| t.lifecycle.as_ref().is_some_and(|l| l.hook == "prestart")));
    assert_eq!(a.alloc_suffix(), Some("[0]"));
}

#[test]
fn allocations_list_capture_decodes() {
    let v: Vec<Allocation> = serde_json::from_str(&shared(
        "nomad-captures",
        "allocations-list-docs-sample-1.2.0-dev.json",
    ))
    .unwrap();
    assert!(!v.is_empty());
}

#[test]
fn event_stream_fixture_decodes_and_filters_by_node() {
    let text = shared("nomad-fixtures", "event-stream-allocation.ndjson");
    let first: Allocation =
        serde_json::from_str(&shared("nomad-fixtures", "allocation.json")).unwrap();
    let mut mine = 0;
    let mut skipped = 0;
    for line in text.lines() {
        match decode_line(line.as_bytes(), &first.node_id, 1 << 24).unwrap() {
            Line::Heartbeat => {}
            Line::Frame {
                allocations,
                skipped: s,
                ..
            } => {
                skipped += s;
                for ev in allocations {
                    assert_eq!(ev.allocation.node_id, first.node_id);
                    assert!(ev.allocation.job.is_none(), "event payloads carry no Job");
                    mine += 1;
                }
            }
        }
    }
    assert!(mine > 0 && skipped > 0, "mine {mine}, skipped {skipped}");
}

#[test]
fn real_event_frames_decode() {
    // Pretty-printed single frames: decode as one line after compacting.
    for name in [
        "event-stream-frame-allocupdated-alloc-job-node-1.6.3.json",
        "event-stream-frame-evaluation-jobregistered-1.6.3.json",
    ] {
        let v: serde_json::Value = serde_json::from_str(&shared("nomad-captures", name)).unwrap();
        let line = serde_json::to_vec(&v).unwrap();
        let node = v
            .pointer("/Events/0/Payload/Allocation/NodeID")
            .and_then(|n| n.as_str())
            .unwrap_or("none");
        match decode_line(&line, node, 1 << 24).unwrap_or_else(|e| panic!("{name}: {e}")) {
            Line::Frame { allocations, .. } => {
                if node != "none" {
                    assert_eq!(allocations.len(), 1, "{name}");
                    assert_eq!(allocations[0].allocation.client_status, "complete");
                }
            }
            Line::Heartbeat => panic!("{name}: not a frame"),
        }
    }
    let text = shared(
        "nomad-captures",
        "event-stream-frame-allocupdated-complete-connect-sidecar-1.2.ndjson",
    );
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let node = v
            .pointer("/Events/0/Payload/Allocation/NodeID")
            .and_then(|n| n.as_str())
            .unwrap();
        match decode_line(line.as_bytes(), node, 1 << 24).unwrap() {
            Line::Frame { allocations, .. } => assert_eq!(allocations.len(), 1),
            Line::Heartbeat => panic!("not a frame"),
        }
    }
}

#[test]
fn host_volumes_and_variables_decode() {
    let hv: HostVolume =
        serde_json::from_str(&shared("nomad-fixtures", "host-volume.json")).unwrap();
    assert!(!hv.id.is_empty());
    let hv: HostVolume = serde_json::from_str(&shared(
        "nomad-captures",
        "host-volume-read-docs-sample-1.10.0-dev.json",
    ))
    .unwrap();
    assert_eq!(hv.state, "ready");
    let list: Vec<HostVolumeStub> =
        serde_json::from_str(&shared("nomad-fixtures", "host-volumes-list.json")).unwrap();
    assert_eq!(list.len(), 2);
    let v: serde_json::Value =
        serde_json::from_str(&shared("nomad-fixtures", "variable.json")).unwrap();
    let var: Variable = serde_json::from_value(v["response"]["body"].clone()).unwrap();
    assert_eq!(var.modify_index, 1213);
    let created: serde_json::Value =
        serde_json::from_str(&shared("nomad-fixtures", "host-volume-create.json")).unwrap();
    let hv: HostVolume =
        serde_json::from_value(created["response"]["body"]["Volume"].clone()).unwrap();
    assert_eq!(hv.state, "pending");
}
