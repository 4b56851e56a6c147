//! Field scenarios (../shared/scenarios.md) as replay tests: the real agent in-process
//! against the simulator's scripted front (`nomad_sim::replay`), with plugins that record
//! their calls and do real mounts.

mod support;

use nomad_sim::replay::Replay;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};
use support::inproc::{agent_config, alloc_json, frame, ready, start_agent, status, volume_record};
use support::sandbox::{
    aborting_plugin, calls, eventually, recording_plugin, wrapper_plugin, Sandbox,
};

const NODE: &str = "3f6b2c1e-8d4a-4b7e-9c2f-5a1d7e3b9c40";
/// The allocation of the fixture workload identity token (so its prestart call verifies).
const TOKEN_ALLOC: &str = "5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70";

fn alloc_id(n: u32) -> String {
    format!("00000000-0000-4000-8000-{n:012}")
}

fn fixture(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/nomad-fixtures")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn token() -> String {
    fixture("workload-identity.json")["default_identity"]["compact"]
        .as_str()
        .unwrap()
        .to_string()
}

async fn scripted_nomad() -> Replay {
    Replay::start(NODE, fixture("jwks.json")).await
}

fn count(plugins: &Path, op: &str) -> usize {
    calls(plugins).iter().filter(|c| c.starts_with(op)).count()
}

/// B03: the plugin is gone (drained, removed) when the allocation ends: the unpublish stays
/// pending in the journal, visible in status, survives a daemon restart, and runs exactly
/// once when the plugin returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b03_pending_unpublish_waits_for_the_plugin_across_restarts() {
    let sb = Sandbox::new();
    let nomad = scripted_nomad().await;
    volume_record(&nomad, "default", "v1", "fake", "multi-node-multi-writer");
    recording_plugin(&sb.join("plugins"), "fake");
    let plugins = sb.join("plugins");
    let a1 = alloc_json(&alloc_id(1), NODE, &["v1"], "running", 100);
    nomad.put_alloc(a1.clone());
    let cfg = agent_config(&sb);
    let agent = start_agent(&nomad, cfg.clone());
    eventually(10, "publish", || count(&plugins, "publish") == 1).await;

    // The plugin goes away, then the allocation completes.
    std::fs::create_dir_all(sb.join("away")).unwrap();
    std::fs::rename(plugins.join("fake"), sb.join("away/fake")).unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let mut done = a1.clone();
    done["ClientStatus"] = json!("complete");
    done["TaskStates"]["app"]["State"] = json!("dead");
    done["ModifyIndex"] = json!(110);
    nomad.push(&frame(110, "AllocationUpdated", &done));
    let mut pending = Value::Null;
    for _ in 0..100 {
        pending = status(&cfg).await;
        if pending["waiting"].as_array().is_some_and(|w| !w.is_empty()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reason = pending["waiting"][0]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(reason.contains("pending unpublish"), "{pending}");
    assert_eq!(
        pending["mounts"].as_array().unwrap().len(),
        1,
        "the record must stay"
    );

    // A restart in the middle: the entry is still there, still pending.
    agent.stop().await;
    let agent = start_agent(&nomad, cfg.clone());
    ready(&cfg, &nomad, 0).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let s = status(&cfg).await;
    assert_eq!(s["mounts"].as_array().unwrap().len(), 1, "{s}");
    assert_eq!(count(&plugins, "unpublish"), 0);

    // The plugin returns: exactly one unpublish, then the record is cleared.
    std::fs::rename(sb.join("away/fake"), plugins.join("fake")).unwrap();
    eventually(10, "unpublish after the plugin returned", || {
        count(&plugins, "unpublish") == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(count(&plugins, "unpublish"), 1);
    assert!(status(&cfg).await["mounts"].as_array().unwrap().is_empty());
    agent.stop().await;
}

/// B10 (b): the daemon restarts while the allocation runs; the journal reloaded from disk
/// holds it, the healthy mount is not published again, and the later terminal event causes
/// exactly one unpublish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b10_restart_while_running_then_terminal_unpublishes_once() {
    let sb = Sandbox::new();
    let nomad = scripted_nomad().await;
    volume_record(&nomad, "default", "v1", "fake", "single-node-writer");
    recording_plugin(&sb.join("plugins"), "fake");
    let plugins = sb.join("plugins");
    let a1 = alloc_json(&alloc_id(1), NODE, &["v1"], "running", 100);
    nomad.put_alloc(a1.clone());
    let cfg = agent_config(&sb);
    let agent = start_agent(&nomad, cfg.clone());
    eventually(10, "published and the user recorded", || {
        support::inproc::journal_text(&sb.join("state")).is_ok_and(|j| j.contains(&alloc_id(1)))
    })
    .await;
    agent.stop().await;
    let agent = start_agent(&nomad, cfg.clone());
    ready(&cfg, &nomad, 0).await;
    let s = status(&cfg).await;
    assert_eq!(s["users"].as_array().unwrap().len(), 1, "{s}");
    let mut done = a1.clone();
    done["ClientStatus"] = json!("complete");
    done["TaskStates"]["app"]["State"] = json!("dead");
    done["ModifyIndex"] = json!(120);
    nomad.push(&frame(120, "AllocationUpdated", &done));
    eventually(10, "unpublish", || count(&plugins, "unpublish") == 1).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        (count(&plugins, "publish"), count(&plugins, "unpublish")),
        (1, 1),
        "{:?}",
        calls(&plugins)
    );
    // The claim was renewed after the restart (from the journal's lock ID), then released.
    let ops = nomad.lock_ops();
    assert_eq!(ops.first().map(String::as_str), Some("acquire"), "{ops:?}");
    assert!(
        ops.contains(&"renew".to_string()) && ops.last().map(String::as_str) == Some("release"),
        "{ops:?}"
    );
    agent.stop().await;
}

/// B13: after a restart the plugin is unavailable for a while. Meanwhile nothing is
/// unpublished and the running allocation's record stays; a second allocation's prestart
/// call (for a volume not yet mounted here) gets a retryable error (503), not a permanent
/// one; when the plugin appears the second allocation is served and the first volume is
/// not published again. (A second allocation of an already mounted volume is served at
/// once without the plugin: it only becomes a user of the mount.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b13_plugin_late_after_restart() {
    let sb = Sandbox::new();
    let nomad = scripted_nomad().await;
    volume_record(&nomad, "default", "v1", "fake", "multi-node-multi-writer");
    volume_record(
        &nomad,
        "default",
        "orders-data",
        "fake",
        "multi-node-multi-writer",
    );
    recording_plugin(&sb.join("plugins"), "fake");
    let plugins = sb.join("plugins");
    nomad.put_alloc(alloc_json(&alloc_id(1), NODE, &["v1"], "running", 100));
    let cfg = agent_config(&sb);
    let agent = start_agent(&nomad, cfg.clone());
    eventually(10, "published and the user recorded", || {
        support::inproc::journal_text(&sb.join("state")).is_ok_and(|j| j.contains(&alloc_id(1)))
    })
    .await;
    agent.stop().await;

    std::fs::create_dir_all(sb.join("away")).unwrap();
    std::fs::rename(plugins.join("fake"), sb.join("away/fake")).unwrap();
    let agent = start_agent(&nomad, cfg.clone());
    ready(&cfg, &nomad, 0).await;
    // The second allocation is the fixture token's; it needs a volume not mounted yet.
    let mut a2 = alloc_json(TOKEN_ALLOC, NODE, &["orders-data"], "pending", 130);
    a2["ClientStatus"] = json!("pending");
    nomad.put_alloc(a2.clone());
    nomad.push(&frame(130, "PlanResult", &a2));
    let err = dhv_binder::api::client::call(
        &cfg.socket,
        hyper::Method::POST,
        &format!("/v1/allocations/{TOKEN_ALLOC}/publish?wait=1s"),
        Some(&token()),
    )
    .await
    .unwrap_err();
    assert!(
        err.is_retryable(),
        "a missing plugin must be retryable: {err}"
    );
    assert_eq!(count(&plugins, "unpublish"), 0);
    let s = status(&cfg).await;
    assert_eq!(s["mounts"].as_array().unwrap().len(), 1, "{s}");
    assert_eq!(s["users"].as_array().unwrap().len(), 1, "{s}");

    std::fs::rename(sb.join("away/fake"), plugins.join("fake")).unwrap();
    let reply = dhv_binder::api::client::call(
        &cfg.socket,
        hyper::Method::POST,
        &format!("/v1/allocations/{TOKEN_ALLOC}/publish?wait=10s"),
        Some(&token()),
    )
    .await
    .expect("publish once the plugin is back");
    assert_eq!(reply["volumes"].as_array().unwrap().len(), 1);
    let publishes: Vec<String> = calls(&plugins)
        .into_iter()
        .filter(|c| c.starts_with("publish"))
        .collect();
    assert_eq!(publishes.len(), 2, "{publishes:?}");
    assert!(
        publishes[1].contains("orders-data"),
        "the healthy mount of v1 was published again: {publishes:?}"
    );
    agent.stop().await;
}

/// B22: an unpublish that unmounted, then timed out before reporting, is retried; the retry
/// finds nothing mounted and succeeds: the record is cleared after exactly one retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b22_unpublish_retry_after_timeout_succeeds() {
    let sb = Sandbox::new();
    let nomad = scripted_nomad().await;
    volume_record(&nomad, "default", "v1", "fake", "multi-node-multi-writer");
    let plugins = sb.join("plugins");
    recording_plugin(&plugins, "real");
    // "fake" delegates to "real", but its first unpublish hangs after unmounting.
    wrapper_plugin(
        &plugins,
        "fake",
        &format!(
            "\"$REAL\" \"$@\" || exit $?\nif [ \"$1\" = unpublish ] && [ ! -e {marker} ]; then touch {marker}; sleep 30; fi",
            marker = sb.join("hung-once").display()
        ),
    );
    nomad.put_alloc(alloc_json(&alloc_id(1), NODE, &["v1"], "running", 100));
    let mut cfg = agent_config(&sb);
    cfg.plugin_timeout = Duration::from_secs(2);
    let agent = start_agent(&nomad, cfg.clone());
    eventually(10, "publish", || count(&plugins, "publish") == 1).await;
    let mut done = alloc_json(&alloc_id(1), NODE, &["v1"], "complete", 140);
    done["DesiredStatus"] = json!("stop");
    nomad.push(&frame(140, "AllocationUpdated", &done));
    eventually(20, "the retried unpublish", || {
        count(&plugins, "unpublish") == 2
            && support::inproc::journal_text(&sb.join("state")).is_ok_and(|j| !j.contains("\"v1\""))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        count(&plugins, "unpublish"),
        2,
        "no error loop: {:?}",
        calls(&plugins)
    );
    agent.stop().await;
}

/// B23: three allocations on the node need one volume within milliseconds. The plugin
/// aborts any call that overlaps another on the same volume; dhv-binder never overlaps
/// them: one publish, three users, no abort.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b23_simultaneous_publishes_never_overlap() {
    let sb = Sandbox::new();
    let nomad = scripted_nomad().await;
    volume_record(&nomad, "default", "v1", "fake", "multi-node-multi-writer");
    let plugins = sb.join("plugins");
    recording_plugin(&plugins, "real");
    aborting_plugin(&plugins, "fake", &sb.join("locks"), "0.3");
    let cfg = agent_config(&sb);
    let agent = start_agent(&nomad, cfg.clone());
    ready(&cfg, &nomad, 1).await;
    for n in 1..=3 {
        let a = alloc_json(&alloc_id(n), NODE, &["v1"], "pending", 200 + n as u64);
        nomad.put_alloc(a.clone());
        nomad.push(&frame(200 + n as u64, "PlanResult", &a));
    }
    eventually(15, "three users", || {
        support::inproc::journal_text(&sb.join("state")).is_ok_and(|j| {
            serde_json::from_str::<Value>(&j).unwrap()["users"]
                .as_array()
                .unwrap()
                .len()
                == 3
        })
    })
    .await;
    assert_eq!(count(&plugins, "publish"), 1);
    assert!(
        !sb.join("locks/aborts").exists(),
        "the plugin saw overlapping calls"
    );
    agent.stop().await;
}

/// B28: identifiers that try to escape (allocation IDs with `../`, plugin IDs and volume
/// names with traversal) are refused before any filesystem or exec action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b28_traversal_identifiers_are_refused() {
    let sb = Sandbox::new();
    let nomad = scripted_nomad().await;
    let plugins = sb.join("plugins");
    recording_plugin(&plugins, "fake");
    // Records written by someone else with hostile contents.
    let bad_spec = |name: &str, plugin: &str| {
        json!({"name": name, "namespace": "default", "plugin_id": plugin, "capacity_min": 0,
               "capacity_max": 0, "node_pool": "", "parameters": {},
               "capabilities": [{"access_mode": "multi-node-multi-writer", "attachment_mode": "file-system"}]})
        .to_string()
    };
    for (path, name, plugin) in [
        ("dhv-binder/volumes/evil1", "evil1", "../../bin/sh"),
        ("dhv-binder/volumes/evil2", "../../etc", "fake"),
        ("dhv-binder/volumes/evil3", "a\nb", "fake"),
    ] {
        nomad.put_var(
            "default",
            path,
            json!({"id": uuid::Uuid::new_v4().to_string(), "spec": bad_spec(name, plugin), "secrets": "{}",
                   "state": "ready", "context": "{}", "capacity_bytes": "0", "worker_node": "", "error": ""}),
        );
    }
    nomad.put_alloc(alloc_json(
        &alloc_id(1),
        NODE,
        &["../../etc", "evil1"],
        "running",
        100,
    ));
    let cfg = agent_config(&sb);
    let agent = start_agent(&nomad, cfg.clone());
    ready(&cfg, &nomad, 0).await;
    for id in [
        "../x",
        "..%2F..%2Fetc",
        "5B0E8F7A-2C4D-4E19-B6A3-9D8C1F2E4A70",
        "not-a-uuid",
    ] {
        let err = dhv_binder::api::client::call(
            &cfg.socket,
            hyper::Method::POST,
            &format!("/v1/allocations/{id}/publish"),
            Some(&token()),
        )
        .await
        .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("HTTP 400") || text.contains("HTTP 404"),
            "{id}: {text}"
        );
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(calls(&plugins).is_empty(), "{:?}", calls(&plugins));
    let s = status(&cfg).await;
    assert!(
        s["volumes"].as_array().unwrap().is_empty(),
        "hostile records were loaded: {s}"
    );
    assert!(nomad.host_volumes().is_empty());
    let mnt = std::fs::read_dir(sb.join("state/mnt"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(mnt, 0, "paths were created for hostile names");
    agent.stop().await;
}

/// B31: 20 allocations × 20 volumes on one node stop together: 20 node-level releases (400
/// user records) due at once, the plugin taking 150 ms per call and rejecting concurrent
/// calls on one volume. dhv-binder queues instead of failing: all finish, none dropped or
/// repeated, well under 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b31_mass_teardown_finishes_fast_without_self_inflicted_backoff() {
    let sb = Sandbox::new();
    let nomad = scripted_nomad().await;
    let plugins = sb.join("plugins");
    recording_plugin(&plugins, "real");
    aborting_plugin(&plugins, "fake", &sb.join("locks"), "0.15");
    let vols: Vec<String> = (0..20).map(|i| format!("v{i:02}")).collect();
    for v in &vols {
        volume_record(&nomad, "default", v, "fake", "multi-node-multi-writer");
    }
    let refs: Vec<&str> = vols.iter().map(String::as_str).collect();
    let allocs: Vec<Value> = (1..=20)
        .map(|n| alloc_json(&alloc_id(n), NODE, &refs, "running", 100 + n as u64))
        .collect();
    for a in &allocs {
        nomad.put_alloc(a.clone());
    }
    let cfg = agent_config(&sb);
    let agent = start_agent(&nomad, cfg.clone());
    eventually(60, "400 users", || {
        support::inproc::journal_text(&sb.join("state"))
            .ok()
            .and_then(|j| serde_json::from_str::<Value>(&j).ok())
            .is_some_and(|j| j["users"].as_array().unwrap().len() == 400)
    })
    .await;
    let started = Instant::now();
    for (i, a) in allocs.iter().enumerate() {
        let mut done = a.clone();
        done["ClientStatus"] = json!("complete");
        done["TaskStates"]["app"]["State"] = json!("dead");
        done["ModifyIndex"] = json!(1000 + i as u64);
        nomad.push(&frame(1000 + i as u64, "AllocationUpdated", &done));
    }
    eventually(30, "20 unpublishes", || count(&plugins, "unpublish") == 20).await;
    let took = started.elapsed();
    eprintln!("B31: 400 releases (20 node-level unpublishes) took {took:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    for v in &vols {
        let ops: Vec<String> = calls(&plugins)
            .into_iter()
            .filter(|c| c.split_whitespace().nth(1) == Some(&format!("default/{v}")))
            .map(|c| c.split_whitespace().next().unwrap().to_string())
            .collect();
        assert_eq!(ops, ["publish", "unpublish"], "{v}");
    }
    assert!(took < Duration::from_secs(30));
    agent.stop().await;
}

/// §5 row 13: a plugin that hangs on one volume and prints garbage on another is killed at
/// the timeout / refused with a clear error, and retried with backoff until it behaves;
/// a third volume is published at once, unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row13_stuck_or_broken_volumes_never_block_others() {
    let sb = Sandbox::new();
    let nomad = scripted_nomad().await;
    let plugins = sb.join("plugins");
    recording_plugin(&plugins, "real");
    let fixed = sb.join("fixed");
    wrapper_plugin(
        &plugins,
        "fake",
        &format!(
            "if [ \"$1\" = publish ] && [ ! -e {fixed} ]; then\n  case \"$DHV_VOLUME_NAME\" in\n    v-hang) echo 'hanging on the backend' >&2; sleep 30 ;;\n    v-garbage) echo 'this is not json'; exit 0 ;;\n  esac\nfi\nexec \"$REAL\" \"$@\"",
            fixed = fixed.display()
        ),
    );
    for v in ["v-hang", "v-garbage", "v-ok"] {
        volume_record(&nomad, "default", v, "fake", "multi-node-multi-writer");
    }
    let mut cfg = agent_config(&sb);
    cfg.plugin_timeout = Duration::from_secs(2);
    let agent = start_agent(&nomad, cfg.clone());
    ready(&cfg, &nomad, 3).await;
    let started = Instant::now();
    for (n, v) in [(1, "v-hang"), (2, "v-garbage"), (3, "v-ok")] {
        let a = alloc_json(&alloc_id(n), NODE, &[v], "pending", 300 + n as u64);
        nomad.put_alloc(a.clone());
        nomad.push(&frame(300 + n as u64, "PlanResult", &a));
    }
    eventually(5, "v-ok published while v-hang hangs", || {
        support::inproc::journal_text(&sb.join("state")).is_ok_and(|j| j.contains(&alloc_id(3)))
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "v-ok waited for the stuck volume"
    );
    let mut errors = Value::Null;
    for _ in 0..100 {
        errors = status(&cfg).await["errors"].clone();
        if errors["default/v-hang"].is_string() && errors["default/v-garbage"].is_string() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let hang = errors["default/v-hang"].as_str().unwrap_or_default();
    assert!(
        hang.contains("timed out") && hang.contains("killed"),
        "{errors}"
    );
    let garbage = errors["default/v-garbage"].as_str().unwrap_or_default();
    // The error says what went wrong and carries the plugin's own words, redacted and cut
    // to one bounded line (issue 37 §4: a plugin's error reaches the user).
    assert!(
        garbage.contains("not the expected JSON") && garbage.contains("this is not json"),
        "{errors}"
    );
    // The plugin is fixed: the retries (with backoff) publish both.
    std::fs::write(&fixed, "").unwrap();
    eventually(30, "both published after the fix", || {
        support::inproc::journal_text(&sb.join("state"))
            .is_ok_and(|j| j.contains(&alloc_id(1)) && j.contains(&alloc_id(2)))
    })
    .await;
    agent.stop().await;
}

/// One agent per node: a second agent on the same state directory, or on the same socket,
/// refuses to start, and the first agent's socket is left in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agent_on_the_node_refuses_to_start() {
    let sb = Sandbox::new();
    let nomad = scripted_nomad().await;
    recording_plugin(&sb.join("plugins"), "fake");
    let cfg = agent_config(&sb);
    let agent = start_agent(&nomad, cfg.clone());
    ready(&cfg, &nomad, 0).await;
    let client = || {
        dhv_binder::nomad::Client::new(&dhv_binder::config::NomadConfig::plain(&nomad.addr))
            .unwrap()
    };
    let same_state = dhv_binder::agent::run(
        cfg.clone(),
        client(),
        dhv_binder::metrics::Metrics::new(),
        async {},
    )
    .await;
    assert!(
        matches!(
            same_state,
            Err(dhv_binder::agent::StartError::AlreadyRunning(_))
        ),
        "{same_state:?}"
    );
    let mut other = cfg.clone();
    other.state_dir = sb.join("state-2");
    let same_socket = dhv_binder::agent::run(
        other,
        client(),
        dhv_binder::metrics::Metrics::new(),
        async {},
    )
    .await;
    let text = format!("{:?}", same_socket.err());
    assert!(text.contains("another dhv-binder agent answers"), "{text}");
    assert!(
        status(&cfg).await["node_id"] == NODE,
        "the first agent's socket was taken"
    );
    agent.stop().await;
    assert!(!cfg.socket.exists(), "the socket outlived its agent");
}

/// A crash after a batch's intents are committed and before its plugin calls start: the
/// whole batch is on disk as `publishing` (one commit), one call runs (`max_parallel` 1)
/// and hangs, the others wait for their turn when the agent is killed. The restarted agent
/// resolves every intent by publishing each volume exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_the_batch_commit_and_its_plugin_calls() {
    let sb = Sandbox::new();
    let nomad = scripted_nomad().await;
    let plugins = sb.join("plugins");
    recording_plugin(&plugins, "real");
    let release = sb.join("release");
    wrapper_plugin(
        &plugins,
        "fake",
        &format!(
            "if [ \"$1\" = publish ] && [ ! -e {release} ]; then touch {started}-$DHV_VOLUME_NAME; sleep 30; exit 1; fi\nexec \"$REAL\" \"$@\"",
            release = release.display(),
            started = sb.join("started").display(),
        ),
    );
    let names: Vec<String> = (0..5).map(|i| format!("v{i}")).collect();
    for v in &names {
        volume_record(&nomad, "default", v, "fake", "multi-node-multi-writer");
    }
    let vols: Vec<&str> = names.iter().map(String::as_str).collect();
    nomad.put_alloc(alloc_json(&alloc_id(1), NODE, &vols, "running", 100));
    let mut cfg = agent_config(&sb);
    cfg.max_parallel = 1;
    let agent = start_agent(&nomad, cfg.clone());
    let started = || {
        std::fs::read_dir(sb.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("started-")
            })
            .count()
    };
    eventually(20, "every intent committed, one call started", || {
        support::inproc::journal_text(&sb.join("state")).is_ok_and(|j| {
            serde_json::from_str::<Value>(&j).unwrap()["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["state"] == "publishing")
                .count()
                == 5
        }) && started() == 1
    })
    .await;
    agent.abort().await;
    assert_eq!(started(), 1, "the other calls of the batch had not started");
    std::fs::write(&release, b"").unwrap();

    cfg.max_parallel = 8;
    let agent = start_agent(&nomad, cfg.clone());
    eventually(20, "every volume of the batch published", || {
        support::inproc::journal_text(&sb.join("state")).is_ok_and(|j| {
            let j: Value = serde_json::from_str(&j).unwrap();
            j["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| m["state"] == "published")
                .count()
                == 5
                && j["users"].as_array().unwrap().len() == 5
        })
    })
    .await;
    for v in &names {
        let n = calls(&plugins)
            .iter()
            .filter(|c| c.starts_with(&format!("publish default/{v} ")))
            .count();
        assert_eq!(n, 1, "{v}: {:?}", calls(&plugins));
    }
    agent.stop().await;
}
