//! The recorded and synthesised Nomad data in `testdata/`.

#![allow(dead_code)]

use serde_json::Value;
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
