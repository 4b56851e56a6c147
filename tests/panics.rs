//! A panic reachable from a task (issue 13 §4): after a lost claim the agent unpublishes the
//! volume but keeps the allocation's user record; the allocation's own publish call then
//! indexed the journal's mounts by that volume (`no entry found for key`) and killed the
//! agent's owner loop.
//!
//! Self-contained on purpose (the simulator's scripted front and the in-process agent of
//! tests/support), so that it moves as is into the reshaped core's scenario tests.

mod support;

use nomad_sim::replay::Replay;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;
use support::inproc::{agent_config, alloc_json, ready, start_agent, status, volume_record};
use support::sandbox::{calls, eventually, recording_plugin, Sandbox};

const NODE: &str = "3f6b2c1e-8d4a-4b7e-9c2f-5a1d7e3b9c40";
/// The allocation of the fixture workload identity token (so its publish call verifies).
const TOKEN_ALLOC: &str = "5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70";

fn fixture(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/nomad-fixtures")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_after_a_lost_claim_answers_and_the_agent_lives() {
    let sb = Sandbox::new();
    let nomad = Replay::start(NODE, fixture("jwks.json")).await;
    volume_record(&nomad, "default", "v1", "fake", "single-node-writer");
    let plugins = sb.join("plugins");
    recording_plugin(&plugins, "fake");
    nomad.put_alloc(alloc_json(TOKEN_ALLOC, NODE, &["v1"], "pending", 100));
    let mut cfg = agent_config(&sb);
    cfg.claim_ttl = Duration::from_secs(10);
    let agent = start_agent(&nomad, cfg.clone());
    ready(&cfg, &nomad, 1).await;
    let token = fixture("workload-identity.json")["default_identity"]["compact"]
        .as_str()
        .unwrap()
        .to_string();
    let uri = format!("/v1/allocations/{TOKEN_ALLOC}/publish?wait=20s");
    let publish =
        || dhv_binder::api::client::call(&cfg.socket, hyper::Method::POST, &uri, Some(&token));
    publish().await.expect("the first publish");
    // The claim is lost (its TTL lapsed, as while the node was frozen): the agent unpublishes.
    // Another node takes it at once: this node cannot claim it back.
    nomad.steal_locks();
    eventually(30, "unpublish after the lost claim", || {
        calls(&plugins).iter().any(|c| c.starts_with("unpublish"))
    })
    .await;
    // The allocation's prestart calls again: an answer (success or a clear error), never a
    // dead agent.
    let r = publish().await;
    eprintln!("publish after the lost claim: {r:?}");
    if let Err(e) = &r {
        assert!(
            matches!(e, dhv_binder::api::client::CallError::Api { .. }),
            "the agent did not answer: {e}"
        );
    }
    let s = status(&cfg).await;
    assert!(
        s.is_object(),
        "the agent no longer answers status after the publish call: {s}"
    );
    // The journal invariant: no user record without its mount record.
    let users = s["users"].as_array().cloned().unwrap_or_default();
    let mounts = s["mounts"].as_array().cloned().unwrap_or_default();
    for u in &users {
        let vol = &u["volume"];
        assert!(
            mounts.iter().any(|m| &m["volume"] == vol),
            "user record without a mount record: {u} (mounts {mounts:?})"
        );
    }
    agent.stop().await;
}
