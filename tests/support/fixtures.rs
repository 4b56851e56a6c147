//! The recorded and synthesised Nomad data in `testdata/`.

#![allow(dead_code)]

use nomad_sim::replay::Replay;
use serde_json::{json, Value};
use std::path::PathBuf;

/// The text of `testdata/<dir>/<name>`.
pub fn shared(dir: &str, name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("testdata")
        .join(dir)
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// `testdata/nomad-fixtures/<name>`, parsed.
pub fn fixture(name: &str) -> Value {
    serde_json::from_str(&shared("nomad-fixtures", name)).unwrap()
}

/// Stores the volume record of the fixtures' `orders-data`, served by plugin `fake`.
pub fn orders_record(nomad: &Replay) {
    let spec = json!({"name": "orders-data", "namespace": "default", "plugin_id": "fake",
        "capacity_min": 0, "capacity_max": 0, "node_pool": "",
        "capabilities": [{"access_mode": "single-node-writer", "attachment_mode": "file-system"}],
        "parameters": {}});
    nomad.put_var(
        "default",
        "dhv-binder/volumes/orders-data",
        json!({"id": "c7e4a2d9-1f3b-4c56-8a9e-2b7d4f1e6a83", "spec": spec.to_string(), "secrets": "{}",
               "state": "ready", "context": "{}", "capacity_bytes": "0", "worker_node": "", "error": ""}),
    );
}
