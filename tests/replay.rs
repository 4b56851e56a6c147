//! Replay tests: the real agent (in-process) against the simulator's scripted front
//! (`nomad_sim::replay::Replay`) serving recorded node lists and event streams (synthesised
//! fixtures and real captures) through the simulator's store, broker and encoding, with
//! faults injected by the test, and a recording plugin that does real bind mounts in the
//! test's sandbox.

mod support;

use dhv_binder::config::AgentConfig;
use dhv_binder::nomad::watch::WatchMode;
use nomad_sim::replay::Replay;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;
use support::fixtures::{fixture, orders_record, shared};
use support::inproc::{agent_config, ready, start_agent, status, Running};
use support::sandbox::{calls, eventually, recording_plugin, Sandbox};

const NODE_A: &str = "3f6b2c1e-8d4a-4b7e-9c2f-5a1d7e3b9c40";
const ALLOC: &str = "5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70";

fn stream_config(sb: &Sandbox, watch_mode: WatchMode) -> AgentConfig {
    let mut cfg = agent_config(sb);
    cfg.watch_mode = watch_mode;
    cfg.stream_idle_timeout = Duration::from_secs(75);
    cfg
}

/// A scripted Nomad for node A whose node list at start holds the dhv-binder system
/// allocation only, with the `orders-data` volume record.
async fn orders_node() -> Replay {
    let nomad = Replay::start(NODE_A, fixture("jwks.json")).await;
    for a in fixture("node-allocations.json").as_array().unwrap() {
        if a["JobID"] == "dhv-binder" {
            nomad.put_alloc(a.clone());
        }
    }
    orders_record(&nomad);
    nomad
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
    let nomad = orders_node().await;
    recording_plugin(&sb.join("plugins"), "fake");
    let cfg = agent_config(&sb);
    let agent = start_agent(&nomad, cfg.clone());
    ready(&cfg, &nomad, 1).await;
    let placeholder = &nomad.host_volumes()[0];
    assert_eq!(placeholder["Name"], "orders-data");
    assert_eq!(placeholder["NodeID"], NODE_A);
    let target = sb.join("state/mnt/default/orders-data");
    assert_eq!(placeholder["HostPath"], target.display().to_string());

    // The scheduler placed the allocation: its full form (with Job) exists before the event.
    let mut full = fixture("allocation.json");
    full["ClientStatus"] = json!("pending");
    full["ModifyIndex"] = json!(1205);
    full.as_object_mut().unwrap().remove("TaskStates");
    nomad.put_alloc(full);

    let lines = stream_lines();
    let plugins = sb.join("plugins");
    for line in lines.iter().filter(|l| frame_index(l) <= 1223) {
        nomad.push(line);
    }
    // The recording plugin logs the call before it mounts: wait for both.
    eventually(10, "publish after PlanResult", || {
        calls(&plugins).len() == 1 && dhv_binder::node::mounts::is_mount_point(&target)
    })
    .await;
    assert_eq!(
        calls(&plugins),
        vec![format!("publish default/orders-data {ALLOC}")]
    );
    assert!(dhv_binder::node::mounts::is_mount_point(&target));

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
        nomad.push(line);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        calls(&plugins).len(),
        1,
        "unpublished on DesiredStatus=stop: {:?}",
        calls(&plugins)
    );
    assert!(dhv_binder::node::mounts::is_mount_point(&target));

    // ClientStatus=complete: exactly one unpublish.
    for line in lines.iter().filter(|l| frame_index(l) >= 1245) {
        nomad.push(line);
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
    assert!(!dhv_binder::node::mounts::is_mount_point(&target));
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
    let nomad = Replay::start(&node, fixture("jwks.json")).await;
    orders_record(&nomad);
    recording_plugin(&sb.join("plugins"), "fake");
    let cfg = agent_config(&sb);
    let agent = start_agent(&nomad, cfg.clone());
    ready(&cfg, &nomad, 1).await;
    nomad.push(&serde_json::to_string(&v).unwrap());
    for line in shared(
        "nomad-captures",
        "event-stream-frame-allocupdated-complete-connect-sidecar-1.2.ndjson",
    )
    .lines()
    {
        nomad.push(line);
    }
    nomad.push(
        &serde_json::to_string(
            &serde_json::from_str::<Value>(&shared(
                "nomad-captures",
                "event-stream-frame-evaluation-jobregistered-1.6.3.json",
            ))
            .unwrap(),
        )
        .unwrap(),
    );
    nomad.push_raw("this is not json\n");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let s = status(&cfg).await;
    assert_eq!(s["watch"]["state"], "streaming", "{s}");
    assert!(calls(&sb.join("plugins")).is_empty());
    agent.stop().await;
}

/// B10 (a) and B17 (in poll mode, the default; the fault tests below cover both modes):
/// the allocation finishes while the daemon is down (no event is ever
/// seen); on start, the first full list finds it terminal and unpublishes exactly once.
/// Then a stream drop with a silent deletion (GC, no event) is caught by the relist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_and_reconnect_converge_without_events() {
    let sb = Sandbox::new();
    let nomad = Replay::start(NODE_A, fixture("jwks.json")).await;
    orders_record(&nomad);
    recording_plugin(&sb.join("plugins"), "fake");
    let plugins = sb.join("plugins");
    let mut full = fixture("allocation.json");
    full["ModifyIndex"] = json!(1300);
    nomad.put_alloc(full.clone());
    let cfg = stream_config(&sb, WatchMode::Poll);
    let agent = start_agent(&nomad, cfg.clone());
    // Published and recorded (the journal is written after the plugin returns).
    eventually(10, "publish from the first list", || {
        calls(&plugins).len() == 1
            && support::inproc::journal_text(&sb.join("state")).is_ok_and(|j| j.contains(ALLOC))
    })
    .await;
    agent.stop().await;

    // While the daemon is down the allocation completes.
    set_client_status(&mut full, "complete");
    full["DesiredStatus"] = json!("stop");
    full["ModifyIndex"] = json!(1400);
    nomad.put_alloc(full.clone());
    let agent = start_agent(&nomad, cfg.clone());
    eventually(10, "unpublish after restart", || calls(&plugins).len() == 2).await;
    assert_eq!(calls(&plugins)[1], "unpublish default/orders-data");

    // A new allocation runs; then the stream drops and the allocation is purged silently.
    full["ClientStatus"] = json!("running");
    full["DesiredStatus"] = json!("run");
    full["ModifyIndex"] = json!(1500);
    nomad.put_alloc(full.clone());
    nomad.close_streams();
    eventually(15, "publish after reconnect", || calls(&plugins).len() == 3).await;
    nomad.delete_alloc(ALLOC);
    nomad.close_streams();
    eventually(15, "unpublish after the purge", || {
        calls(&plugins).len() == 4
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(calls(&plugins).len(), 4, "{:?}", calls(&plugins));
    agent.stop().await;
}

// ---------------------------------------------------------------------------------------
// Event stream and blocking query faults, each run in both watch modes. Every test starts
// with the fixture allocation running on this node (published once from the first list),
// injects a fault, changes the truth in the simulator's store, and asserts that the plugin
// calls end up exactly [publish, unpublish] (or as stated): nothing lost, nothing repeated.
// ---------------------------------------------------------------------------------------

/// Generates `<name>::stream` and `<name>::poll` from `async fn <name>(WatchMode)`.
macro_rules! both_modes {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stream() {
                tokio::time::timeout(std::time::Duration::from_secs(60), super::$name(super::WatchMode::Stream))
                    .await
                    .expect("test timed out");
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn poll() {
                tokio::time::timeout(std::time::Duration::from_secs(60), super::$name(super::WatchMode::Poll))
                    .await
                    .expect("test timed out");
            }
        }
    )*};
}

both_modes!(
    purge_of_a_running_allocation,
    disconnect_mid_frame,
    duplicate_and_out_of_order_events,
    b17_gap_beyond_the_buffer,
    b17_index_reset_snapshot_restore,
    b18_stalled_connection,
    b30_token_expiry_and_rotation,
    garbage_line,
    five_mib_lines,
);

const ALLOC_B: &str = "9c1d3e5f-7a2b-4c6d-8e0f-1a3b5c7d9e21";

/// The fixture allocation as an event payload carries it: no Job.
fn payload(id: &str, client: &str, desired: &str, index: u64) -> Value {
    let mut a = fixture("allocation.json");
    a.as_object_mut().unwrap().remove("Job");
    a["ID"] = json!(id);
    a["ModifyIndex"] = json!(index);
    a["DesiredStatus"] = json!(desired);
    set_client_status(&mut a, client);
    a
}

/// Sets an allocation's ClientStatus as its client reports it: `complete` and `failed`
/// come with every task state `dead` (the daemon counts an allocation finished only then:
/// Nomad reports `failed` while a poststop task still runs).
fn set_client_status(a: &mut Value, client: &str) {
    a["ClientStatus"] = json!(client);
    if matches!(client, "complete" | "failed") {
        if let Some(states) = a["TaskStates"].as_object_mut() {
            for st in states.values_mut() {
                st["State"] = json!("dead");
            }
        }
    }
}

/// One frame at `index` with the given allocation payloads (Type AllocationUpdated).
fn frame(index: u64, allocs: &[Value]) -> String {
    let events: Vec<Value> = allocs
        .iter()
        .map(|a| {
            json!({"Topic": "Allocation", "Type": "AllocationUpdated", "Key": a["ID"],
                   "Namespace": "default", "FilterKeys": [a["JobID"], ""], "Index": index,
                   "Payload": {"Allocation": a}})
        })
        .collect();
    json!({"Index": index, "Events": events}).to_string()
}

/// The allocation of another node, as in a busy cluster's stream.
fn other_node(i: u64, index: u64) -> Value {
    let mut a = payload(
        &format!("00000000-0000-4000-8000-{i:012}"),
        "running",
        "run",
        index,
    );
    a["NodeID"] = json!(format!("11111111-0000-4000-8000-{:012}", i % 997));
    a
}

struct Case {
    sb: Sandbox,
    nomad: Replay,
    cfg: AgentConfig,
    agent: Option<Running>,
    plugins: PathBuf,
}

impl Case {
    /// The fixture allocation runs on this node at index 1300; the agent publishes it.
    async fn start(mode: WatchMode, tune: impl FnOnce(&mut AgentConfig, &Replay)) -> Case {
        let sb = Sandbox::new();
        let nomad = Replay::start(NODE_A, fixture("jwks.json")).await;
        orders_record(&nomad);
        recording_plugin(&sb.join("plugins"), "fake");
        let mut full = fixture("allocation.json");
        full["ModifyIndex"] = json!(1300);
        nomad.put_alloc(full);
        let mut cfg = stream_config(&sb, mode);
        tune(&mut cfg, &nomad);
        let agent = Some(start_agent(&nomad, cfg.clone()));
        let plugins = sb.join("plugins");
        let case = Case {
            sb,
            nomad,
            cfg,
            agent,
            plugins,
        };
        eventually(15, "publish from the first list", || {
            case.calls().len() == 1
        })
        .await;
        case.connected(mode).await;
        case
    }

    fn calls(&self) -> Vec<String> {
        calls(&self.plugins)
    }

    /// Waits until the watcher is streaming (heartbeat seen) or polling.
    async fn connected(&self, mode: WatchMode) {
        let want = match mode {
            WatchMode::Stream => "streaming",
            WatchMode::Poll => "polling",
        };
        for _ in 0..200 {
            if status(&self.cfg).await["watch"]["state"] == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("watcher never {want}: {}", status(&self.cfg).await);
    }

    /// The agent's status once `cond` holds, asked every 20 ms at most `tries` times;
    /// `Value::Null` when it never did.
    async fn status_when(&self, tries: usize, cond: impl Fn(&Value) -> bool) -> Value {
        for _ in 0..tries {
            let s = status(&self.cfg).await;
            if cond(&s) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Value::Null
    }

    /// Asserts the calls converge to `want` and stay there (nothing lost or repeated). The
    /// bound is generous: a watch backing off after errors (up to 30 s) converges later on
    /// a loaded machine, never differently.
    async fn converges(&self, what: &str, want: &[String]) {
        eventually(60, what, || self.calls().len() >= want.len()).await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert_eq!(self.calls(), want, "{what}");
    }

    async fn stop(mut self) {
        if let Some(a) = self.agent.take() {
            a.stop().await;
        }
        drop(self.sb);
    }
}

fn publish_a() -> String {
    format!("publish default/orders-data {ALLOC}")
}

fn unpublish() -> String {
    "unpublish default/orders-data".to_string()
}

/// Issue 34 row 1: a purge deletes the running allocation with no allocation event, and the
/// node's list index does not rise (the node has another allocation: the daemon's own).
/// Stream mode reads it again on the Job topic's deletion; poll mode when its processes
/// are gone (a process in the allocation's task cgroup, under the in-process agents' Nomad
/// cgroup parent, stands for the task). Either way the read
/// answers 404 and the volume is unpublished once, after the kill grace (10 s), long
/// before the resync (300 s).
async fn purge_of_a_running_allocation(mode: WatchMode) {
    let c = Case::start(mode, |_, _| {}).await;
    for a in fixture("node-allocations.json").as_array().unwrap() {
        if a["JobID"] == "dhv-binder" {
            c.nomad.put_alloc(a.clone());
        }
    }
    // Only poll mode reads processes (the stream mode case runs beside it, in this process
    // whose agents share one cgroup parent).
    let parent = (mode == WatchMode::Poll)
        .then(|| support::cgroup::ScratchCgroup::at(&support::inproc::nomad_cgroup_parent()));
    let enter = parent.as_ref().map_or(String::new(), |p| {
        let scope = p.child(&format!("share.slice/{ALLOC}.app.scope"));
        format!("echo $$ > '{}' && ", scope.join("cgroup.procs").display())
    });
    let mut task = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{enter}exec sleep 60"))
        .spawn()
        .expect("spawn sleep");
    // Poll mode's probe runs every 5 s: let it see the task's process.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let index = c.nomad.index();
    c.nomad.delete_alloc(ALLOC);
    c.nomad.push(
        &json!({"Index": 0, "Events": [{"Topic": "Job", "Type": "JobDeregistered",
            "Key": "orders", "Namespace": "default", "FilterKeys": null, "Index": 0,
            "Payload": {"Job": {"ID": "orders", "Namespace": "default", "Stop": true},
                        "Deleted": true}}]})
        .to_string(),
    );
    assert!(c.nomad.index() > index);
    task.kill().unwrap();
    task.wait().unwrap();
    eventually(30, "unpublish after the purge", || c.calls().len() >= 2).await;
    c.converges("unpublish after the purge", &[publish_a(), unpublish()])
        .await;
    c.stop().await;
}

/// The connection breaks in the middle of the frame that says the allocation completed; the
/// watcher drops the partial line, reconnects and relists.
async fn disconnect_mid_frame(mode: WatchMode) {
    let c = Case::start(mode, |_, _| {}).await;
    let done = frame(1400, &[payload(ALLOC, "complete", "stop", 1400)]);
    c.nomad.apply_silently(&done);
    c.nomad.push_raw(&done[..done.len() / 2]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    c.nomad.close_streams();
    c.converges(
        "unpublish after the broken frame",
        &[publish_a(), unpublish()],
    )
    .await;
    c.stop().await;
}

/// Repeated frames and events, and a frame older than the last one (which Nomad never
/// sends within one subscription: treated as an index reset, so relisted).
async fn duplicate_and_out_of_order_events(mode: WatchMode) {
    let c = Case::start(mode, |_, _| {}).await;
    let running = frame(
        1310,
        &[
            payload(ALLOC, "running", "run", 1310),
            payload(ALLOC, "running", "run", 1310),
        ],
    );
    c.nomad.push(&running);
    // The repeats are faults (Nomad sends each index once per subscription): raw bytes.
    c.nomad.push_raw(&format!("{running}\n"));
    let done = frame(1320, &[payload(ALLOC, "complete", "stop", 1320)]);
    c.nomad.push(&done);
    c.nomad.push_raw(&format!("{done}\n"));
    // A stale frame after the terminal one must not bring the allocation back to life.
    c.nomad.push_raw(&format!("{running}\n"));
    c.converges("one unpublish despite repeats", &[publish_a(), unpublish()])
        .await;
    let s = status(&c.cfg).await;
    if mode == WatchMode::Stream {
        assert!(
            s["watch"]["counters"]["index_resets"].as_u64().unwrap_or(0) >= 1
                || s["watch"]["state"] == "disconnected",
            "{s}"
        );
    }
    c.stop().await;
}

/// B17: the terminal event falls into a gap (server restart: the new buffer starts later,
/// and resuming at the old index silently skips it). The relist on reconnect finds the
/// allocation complete: exactly one unpublish.
async fn b17_gap_beyond_the_buffer(mode: WatchMode) {
    let c = Case::start(mode, |_, _| {}).await;
    c.nomad
        .apply_silently(&frame(1410, &[payload(ALLOC, "complete", "stop", 1410)]));
    c.nomad.close_streams();
    // Events after the restart, from other nodes only.
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.nomad.push(&frame(
        1430,
        &(0..5).map(|i| other_node(i, 1430)).collect::<Vec<_>>(),
    ));
    c.converges("unpublish after the gap", &[publish_a(), unpublish()])
        .await;
    c.stop().await;
}

/// B17 / row 10: a snapshot restore (or a new cluster at the same address) replaces the
/// state with lower indexes and closes every stream. The allocation is complete in the
/// restored state; a new allocation then arrives at an index below everything seen before.
async fn b17_index_reset_snapshot_restore(mode: WatchMode) {
    // A restore wakes no blocking query (the index only drops): poll mode sees it when the
    // query's wait ends, so the wait is short here.
    let c = Case::start(mode, |cfg, _| {
        if mode == WatchMode::Poll {
            cfg.resync_interval = Duration::from_secs(2);
        }
    })
    .await;
    let mut done = fixture("allocation.json");
    set_client_status(&mut done, "complete");
    done["DesiredStatus"] = json!("stop");
    done["ModifyIndex"] = json!(40);
    c.nomad.reset(vec![done], 40);
    c.converges("unpublish after the restore", &[publish_a(), unpublish()])
        .await;
    // A new allocation at index 50 (< 1300): must not be taken for a stale event.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut b = fixture("allocation.json");
    b["ID"] = json!(ALLOC_B);
    b["ModifyIndex"] = json!(50);
    b["AllocModifyIndex"] = json!(50);
    c.nomad.put_alloc(b);
    c.nomad
        .push(&frame(50, &[payload(ALLOC_B, "running", "run", 50)]));
    c.converges(
        "publish of the allocation placed after the restore",
        &[
            publish_a(),
            unpublish(),
            format!("publish default/orders-data {ALLOC_B}"),
        ],
    )
    .await;
    c.stop().await;
}

/// B18 (b): a half-open connection: no bytes at all, not even heartbeats (the simulator sends
/// them every 100 ms here). Detected within 3 heartbeat intervals in stream mode (idle
/// timeout 300 ms) and within wait + wait/16 + idle timeout in poll mode; health says
/// disconnected (stalled) meanwhile; after healing, the relist unpublishes exactly once.
async fn b18_stalled_connection(mode: WatchMode) {
    let c = Case::start(mode, |cfg, nomad| {
        nomad.set_heartbeat(Duration::from_millis(100));
        cfg.stream_idle_timeout = Duration::from_millis(300);
        if mode == WatchMode::Poll {
            cfg.resync_interval = Duration::from_secs(1); // the blocking query's wait
        }
    })
    .await;
    // Healthy but quiet for a while: heartbeats keep the stream alive.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_ne!(status(&c.cfg).await["watch"]["state"], "disconnected");
    c.nomad.stall(true);
    let stalled_at = std::time::Instant::now();
    c.nomad
        .apply_silently(&frame(1450, &[payload(ALLOC, "complete", "stop", 1450)]));
    let seen = c
        .status_when(100, |s| s["watch"]["state"] == "disconnected")
        .await;
    let took = stalled_at.elapsed();
    assert_eq!(seen["watch"]["fault"], "stalled", "{seen}");
    let bound = match mode {
        WatchMode::Stream => Duration::from_millis(300 + 300),
        WatchMode::Poll => Duration::from_millis(1000 + 62 + 300 + 500),
    };
    assert!(took <= bound, "stall detected after {took:?} (> {bound:?})");
    assert_eq!(c.calls(), vec![publish_a()], "acted while disconnected");
    c.nomad.stall(false);
    c.converges("unpublish after the stall", &[publish_a(), unpublish()])
        .await;
    c.stop().await;
}

/// Stream mode: the event stream flows (heartbeats every 100 ms) but the read of a new
/// allocation (for its Job) is never answered, its connection half-open. The read gives up
/// after the idle timeout (300 ms) and the stream restarts, the watcher saying so
/// (`stalled`), instead of waiting on the HTTP client's 400 s; nothing is published from the
/// unread allocation meanwhile; once reads are answered again, the relist publishes it.
/// Without the read's timeout the watcher said `streaming` for the 400 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_allocation_read_ends_the_stream_within_the_idle_timeout() {
    let c = Case::start(WatchMode::Stream, |cfg, nomad| {
        nomad.set_heartbeat(Duration::from_millis(100));
        cfg.stream_idle_timeout = Duration::from_millis(300);
    })
    .await;
    let mut b = fixture("allocation.json");
    b["ID"] = json!(ALLOC_B);
    b["ModifyIndex"] = json!(1310);
    b["AllocModifyIndex"] = json!(1310);
    c.nomad.put_alloc(b);
    c.nomad.stall_reads(true);
    let stalled_at = std::time::Instant::now();
    // The first allocation completes (its event carries all the agent needs) as the second
    // is placed (its event lacks the Job: a read), so that the volume is free for it.
    c.nomad.push(&frame(
        1310,
        &[
            payload(ALLOC, "complete", "stop", 1310),
            payload(ALLOC_B, "running", "run", 1310),
        ],
    ));
    let seen = c
        .status_when(150, |s| s["watch"]["fault"] == "stalled")
        .await;
    let took = stalled_at.elapsed();
    assert_eq!(
        seen["watch"]["fault"],
        "stalled",
        "{}",
        status(&c.cfg).await
    );
    // The read's timeout, not the stream's own silence (a starved machine could miss
    // heartbeats).
    assert!(
        seen["watch"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("read allocation")),
        "{seen}"
    );
    assert!(
        took <= Duration::from_millis(300 + 700),
        "the stalled read was given up after {took:?}"
    );
    let publish_b = format!("publish default/orders-data {ALLOC_B}");
    assert!(
        !c.calls().contains(&publish_b),
        "acted on an unread allocation: {:?}",
        c.calls()
    );
    c.nomad.stall_reads(false);
    c.converges(
        "publish once reads are answered again",
        &[publish_a(), unpublish(), publish_b],
    )
    .await;
    c.stop().await;
}

/// B30: the token expires (Nomad closes the stream; lists answer 403, a new subscribe is
/// 200 then EOF without `{}`). The agent classifies it as an auth failure, re-reads the
/// token file, backs off at least 1 s between tries, acts on nothing meanwhile (the
/// allocation is purged from Nomad during the outage: no unpublish from a view it cannot
/// refresh), never shows the token, and converges once a new token is in the file.
async fn b30_token_expiry_and_rotation(mode: WatchMode) {
    let c = Case::start(mode, |cfg, nomad| {
        let file = cfg.state_dir.parent().unwrap().join("token");
        std::fs::write(&file, "old-secret-token\n").unwrap();
        cfg.token_file = Some(file);
        nomad.require_token(Some("old-secret-token"));
        if mode == WatchMode::Poll {
            // An in-flight blocking query was authorized when it started: poll mode meets
            // the new ACL state when the query's wait ends.
            cfg.resync_interval = Duration::from_secs(1);
        }
    })
    .await;
    let file = c.cfg.token_file.clone().unwrap();
    c.nomad.require_token(Some("new-secret-token"));
    let mut s = Value::Null;
    for _ in 0..200 {
        s = status(&c.cfg).await;
        if s["watch"]["fault"] == "auth-failed" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert_eq!(s["watch"]["state"], "disconnected", "{s}");
    assert_eq!(s["watch"]["fault"], "auth-failed", "{s}");
    c.nomad.delete_alloc(ALLOC);
    let lists_before = c.nomad.requests().len();
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let s = status(&c.cfg).await;
    assert_eq!(s["watch"]["fault"], "auth-failed", "{s}");
    assert!(
        !s.to_string().contains("secret-token"),
        "token in status: {s}"
    );
    let tries = c
        .nomad
        .requests()
        .iter()
        .skip(lists_before)
        .filter(|r| r.contains("/allocations?") || r.contains("/allocations "))
        .count();
    assert!(
        tries <= 5,
        "{tries} list attempts in 3 s: not backing off ≥ 1 s"
    );
    assert_eq!(c.calls(), vec![publish_a()], "acted without a valid view");
    std::fs::write(&file, "new-secret-token\n").unwrap();
    c.converges(
        "unpublish of the purged allocation once the new token works",
        &[publish_a(), unpublish()],
    )
    .await;
    assert!(c
        .nomad
        .tokens_seen()
        .contains(&Some("new-secret-token".into())));
    c.stop().await;
}

/// A line that is not JSON takes the place of the terminal frame: skipped and counted, the
/// stream stays up (no reconnect loop), and a relist soon after finds the allocation done.
async fn garbage_line(mode: WatchMode) {
    let c = Case::start(mode, |_, _| {}).await;
    c.nomad
        .apply_silently(&frame(1460, &[payload(ALLOC, "complete", "stop", 1460)]));
    c.nomad
        .push_raw("{\"Index\":1460,\"Events\":[{\"Topic\":\"Allocation\",garbage\n");
    c.nomad.push_raw("\u{1}\u{2} not json at all\n");
    c.converges(
        "unpublish after a garbage line",
        &[publish_a(), unpublish()],
    )
    .await;
    if mode == WatchMode::Stream {
        let s = status(&c.cfg).await;
        assert_eq!(s["watch"]["state"], "streaming", "{s}");
        // At least the first: the relist it asks for ends that connection, and a line
        // still unread on it is gone with it (the relist covers what it could have said).
        assert!(
            s["watch"]["counters"]["bad_lines"].as_u64().unwrap() >= 1,
            "{s}"
        );
        assert_eq!(s["watch"]["counters"]["reconnects"], 0, "{s}");
    }
    c.stop().await;
}

/// 5 MiB lines: a garbage one (skipped, counted, no reconnect), then a valid 5 MiB frame
/// of 1,000 other nodes' events that also carries this node's terminal event (applied).
async fn five_mib_lines(mode: WatchMode) {
    let c = Case::start(mode, |_, _| {}).await;
    c.nomad.push_raw(&format!("{}\n", "x".repeat(5 << 20)));
    let mut allocs: Vec<Value> = (0..1000).map(|i| other_node(i, 1470)).collect();
    allocs.push(payload(ALLOC, "complete", "stop", 1470));
    let big = frame(1470, &allocs);
    assert!(big.len() >= 5 << 20, "{}", big.len());
    c.nomad.push(&big);
    c.converges(
        "unpublish from the 5 MiB frame",
        &[publish_a(), unpublish()],
    )
    .await;
    if mode == WatchMode::Stream {
        let s = status(&c.cfg).await;
        assert_eq!(s["watch"]["state"], "streaming", "{s}");
        assert_eq!(s["watch"]["counters"]["reconnects"], 0, "{s}");
        assert!(
            s["watch"]["counters"]["bad_lines"].as_u64().unwrap() >= 1,
            "{s}"
        );
    }
    c.stop().await;
}

/// An idle agent runs no plugin (issue 10): the periodic rescan (every 500 ms here) keeps
/// the fingerprint of a plugin whose file is unchanged since its last good run, and a
/// plugin whose file changed is fingerprinted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_agent_runs_no_plugin_and_a_changed_one_is_fingerprinted_again() {
    let sb = Sandbox::new();
    let nomad = orders_node().await;
    // Outside the plugin directory: a write there is a change of the directory.
    let runs = sb.join("fingerprints.log");
    let plugin = sb.join("plugins/fake");
    let write = |version: &str| {
        support::sandbox::script(
            &plugin,
            &format!(
                "#!/bin/sh\necho {version} >> '{}'\necho '{{\"version\":\"{version}\",\"deferred_bind\":true}}'\n",
                runs.display()
            ),
        )
    };
    let fingerprints = || -> Vec<String> {
        std::fs::read_to_string(&runs)
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    };
    write("1.0.0");
    let cfg = agent_config(&sb);
    assert_eq!(cfg.plugin_rescan, Duration::from_millis(500));
    let agent = start_agent(&nomad, cfg.clone());
    ready(&cfg, &nomad, 1).await;
    // Let a change noticed at start settle, then count the runs of six rescans.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = fingerprints();
    assert!(!before.is_empty(), "the plugin was never fingerprinted");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        fingerprints(),
        before,
        "plugin runs while the agent was idle"
    );

    // A new version of the plugin is run, and then kept again.
    write("1.0.10");
    eventually(10, "the changed plugin fingerprinted again", || {
        fingerprints().last().map(String::as_str) == Some("1.0.10")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = fingerprints();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        fingerprints(),
        after,
        "plugin runs while the agent was idle"
    );
    let s = status(&cfg).await;
    assert!(s.to_string().contains("1.0.10"), "{s}");
    agent.stop().await;
}
