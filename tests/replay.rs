//! Replay tests: the real agent (in-process) against a scripted fake Nomad that serves
//! recorded node lists and event streams (synthesised fixtures and real captures), with a
//! recording plugin that does real bind mounts in the test's sandbox.

mod support;

use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;
use support::fake_nomad::FakeNomad;
use support::inproc::{agent_config, ready, start_agent, status};
use support::sandbox::{calls, eventually, recording_plugin, Sandbox};

fn shared(dir: &str, name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared")
        .join(dir)
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn fixture(name: &str) -> Value {
    serde_json::from_str(&shared("nomad-fixtures", name)).unwrap()
}

const NODE_A: &str = "3f6b2c1e-8d4a-4b7e-9c2f-5a1d7e3b9c40";
const ALLOC: &str = "5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70";

/// The volume record for the fixtures' `orders-data`, served by plugin `fake`.
fn orders_record(fake: &FakeNomad) {
    let spec = json!({"name": "orders-data", "namespace": "default", "plugin_id": "fake",
        "capacity_min": 0, "capacity_max": 0, "node_pool": "",
        "capabilities": [{"access_mode": "single-node-writer", "attachment_mode": "file-system"}],
        "parameters": {}});
    fake.put_var(
        "default",
        "dhv-binder/volumes/orders-data",
        json!({"id": "c7e4a2d9-1f3b-4c56-8a9e-2b7d4f1e6a83", "spec": spec.to_string(), "secrets": "{}",
               "state": "ready", "context": "{}", "capacity_bytes": "0", "worker_node": "", "error": ""}),
    );
}

fn stream_lines() -> Vec<String> {
    shared("nomad-fixtures", "event-stream-allocation.ndjson")
        .lines()
        .map(String::from)
        .collect()
}

fn frame_index(line: &str) -> u64 {
    serde_json::from_str::<Value>(line)
        .ok()
        .and_then(|v| v["Index"].as_u64())
        .unwrap_or(0)
}

/// The synthesised stream for `orders.app[0]` replayed through the real agent: one publish
/// after the placement (PlanResult), nothing on task updates, nothing on DesiredStatus=stop
/// (B01), one unpublish after ClientStatus=complete; the prestart call is answered with the
/// path once published, and refused for another allocation (§5 row 12).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixture_stream_publishes_once_and_unpublishes_after_terminal() {
    let sb = Sandbox::new();
    let fake = FakeNomad::start(NODE_A, fixture("jwks.json")).await;
    // The node list at start: the dhv-binder system alloc only.
    for a in fixture("node-allocations.json").as_array().unwrap() {
        if a["JobID"] == "dhv-binder" {
            fake.put_alloc(a.clone());
        }
    }
    orders_record(&fake);
    recording_plugin(&sb.join("plugins"), "fake");
    let cfg = agent_config(&sb);
    let agent = start_agent(&fake, cfg.clone());
    ready(&cfg, &fake, 1).await;
    let placeholder = &fake.state.lock().unwrap().host_volumes[0].clone();
    assert_eq!(placeholder["Name"], "orders-data");
    assert_eq!(placeholder["NodeID"], NODE_A);
    let target = sb.join("state/mnt/default/orders-data");
    assert_eq!(placeholder["HostPath"], target.display().to_string());

    // The scheduler placed the allocation: its full form (with Job) exists before the event.
    let mut full = fixture("allocation.json");
    full["ClientStatus"] = json!("pending");
    full["ModifyIndex"] = json!(1205);
    full.as_object_mut().unwrap().remove("TaskStates");
    fake.put_alloc(full);

    let lines = stream_lines();
    let plugins = sb.join("plugins");
    for line in lines.iter().filter(|l| frame_index(l) <= 1223) {
        fake.push(line);
    }
    eventually(10, "publish after PlanResult", || {
        calls(&plugins).len() == 1
    })
    .await;
    assert_eq!(
        calls(&plugins),
        vec![format!("publish default/orders-data {ALLOC}")]
    );
    assert!(dhv_binder::mounts::is_mount_point(&target));

    // The prestart task's call, with the task's real (fixture) workload identity token.
    let wi = fixture("workload-identity.json");
    let token = wi["default_identity"]["compact"].as_str().unwrap();
    let reply = dhv_binder::api::client::call(
        &cfg.socket,
        hyper::Method::POST,
        &format!("/v1/allocations/{ALLOC}/publish?wait=10s"),
        Some(token),
    )
    .await
    .expect("prestart publish call");
    assert_eq!(reply["volumes"][0]["path"], target.display().to_string());
    // The same token for another allocation is refused, and publishes nothing.
    let other = "8e2a4c6d-0b1f-4a3e-9d5c-7b9e1f3a5c82";
    let err = dhv_binder::api::client::call(
        &cfg.socket,
        hyper::Method::POST,
        &format!("/v1/allocations/{other}/publish?wait=1s"),
        Some(token),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("HTTP 403"), "{err}");
    // No token at all: 401.
    let err = dhv_binder::api::client::call(
        &cfg.socket,
        hyper::Method::POST,
        &format!("/v1/allocations/{ALLOC}/publish"),
        None,
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("HTTP 401"), "{err}");

    // DesiredStatus=stop while the task still runs: no unpublish.
    for line in lines.iter().filter(|l| frame_index(l) == 1242) {
        fake.push(line);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        calls(&plugins).len(),
        1,
        "unpublished on DesiredStatus=stop: {:?}",
        calls(&plugins)
    );
    assert!(dhv_binder::mounts::is_mount_point(&target));

    // ClientStatus=complete: exactly one unpublish.
    for line in lines.iter().filter(|l| frame_index(l) >= 1245) {
        fake.push(line);
    }
    eventually(10, "unpublish after complete", || {
        calls(&plugins).len() == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        calls(&plugins),
        vec![
            format!("publish default/orders-data {ALLOC}"),
            "unpublish default/orders-data".to_string()
        ]
    );
    assert!(!dhv_binder::mounts::is_mount_point(&target));
    let log = std::fs::read_to_string(sb.join("state/journal.log")).unwrap();
    let events: Vec<String> = log
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["event"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(
        events,
        [
            "publish-intent",
            "publish-done",
            "user-added",
            "user-removed",
            "unpublish-intent",
            "unpublish-done"
        ]
    );
    agent.stop().await;
}

/// Real captured frames from real Nomad servers (other jobs, no deferred volumes) flow
/// through the watcher without a plugin call, and the stream stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_capture_frames_cause_no_plugin_calls() {
    let sb = Sandbox::new();
    let v: Value = serde_json::from_str(&shared(
        "nomad-captures",
        "event-stream-frame-allocupdated-alloc-job-node-1.6.3.json",
    ))
    .unwrap();
    let node = v
        .pointer("/Events/0/Payload/Allocation/NodeID")
        .unwrap()
        .as_str()
        .unwrap()
        .to_string();
    let fake = FakeNomad::start(&node, fixture("jwks.json")).await;
    orders_record(&fake);
    recording_plugin(&sb.join("plugins"), "fake");
    let cfg = agent_config(&sb);
    let agent = start_agent(&fake, cfg.clone());
    ready(&cfg, &fake, 1).await;
    fake.push(&serde_json::to_string(&v).unwrap());
    for line in shared(
        "nomad-captures",
        "event-stream-frame-allocupdated-complete-connect-sidecar-1.2.ndjson",
    )
    .lines()
    {
        fake.push(line);
    }
    fake.push(
        &serde_json::to_string(
            &serde_json::from_str::<Value>(&shared(
                "nomad-captures",
                "event-stream-frame-evaluation-jobregistered-1.6.3.json",
            ))
            .unwrap(),
        )
        .unwrap(),
    );
    fake.push("this is not json");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let s = status(&cfg).await;
    assert_eq!(s["watch"]["state"], "streaming", "{s}");
    assert!(calls(&sb.join("plugins")).is_empty());
    agent.stop().await;
}

/// B10 (a) and B17: the allocation finishes while the daemon is down (no event is ever
/// seen); on start, the first full list finds it terminal and unpublishes exactly once.
/// Then a stream drop with a silent deletion (GC, no event) is caught by the relist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_and_reconnect_converge_without_events() {
    let sb = Sandbox::new();
    let fake = FakeNomad::start(NODE_A, fixture("jwks.json")).await;
    orders_record(&fake);
    recording_plugin(&sb.join("plugins"), "fake");
    let plugins = sb.join("plugins");
    let mut full = fixture("allocation.json");
    full["ModifyIndex"] = json!(1300);
    fake.put_alloc(full.clone());
    let cfg = agent_config(&sb);
    let agent = start_agent(&fake, cfg.clone());
    eventually(10, "publish from the first list", || {
        calls(&plugins).len() == 1
    })
    .await;
    agent.stop().await;

    // While the daemon is down the allocation completes.
    full["ClientStatus"] = json!("complete");
    full["DesiredStatus"] = json!("stop");
    full["ModifyIndex"] = json!(1400);
    fake.put_alloc(full.clone());
    let agent = start_agent(&fake, cfg.clone());
    eventually(10, "unpublish after restart", || calls(&plugins).len() == 2).await;
    assert_eq!(calls(&plugins)[1], "unpublish default/orders-data");

    // A new allocation runs; then the stream drops and the allocation is purged silently.
    full["ClientStatus"] = json!("running");
    full["DesiredStatus"] = json!("run");
    full["ModifyIndex"] = json!(1500);
    fake.put_alloc(full.clone());
    fake.close_streams();
    eventually(15, "publish after reconnect", || calls(&plugins).len() == 3).await;
    fake.delete_alloc(ALLOC);
    fake.close_streams();
    eventually(15, "unpublish after the purge", || {
        calls(&plugins).len() == 4
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(calls(&plugins).len(), 4, "{:?}", calls(&plugins));
    agent.stop().await;
}
