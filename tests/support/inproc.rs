//! The real agent run in-process against the simulator's scripted front
//! (`nomad_sim::replay::Replay`), and builders for what the script serves.

#![allow(dead_code)]

use super::sandbox::Sandbox;
use dhv_binder::config::{AgentConfig, NomadConfig};
use nomad_sim::replay::Replay;
use serde_json::{json, Value};
use std::time::Duration;

/// A running in-process agent.
pub struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stops the agent as SIGTERM would, and waits for it.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
    }

    /// Stops the agent abruptly (as SIGKILL would: nothing of it runs after), and waits
    /// until its task is gone (its state lock released), as a killed process's would be.
    pub async fn abort(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// Settings for a test agent in the sandbox: fast tick, short plugin timeout.
/// The Nomad cgroup parent of every in-process agent of this test binary (one process: its
/// task cgroups are set once, `dhv_binder::node::identity::configure`): a cgroup path
/// relative to the cgroup2 mount, named after this process. A test that stands for a task
/// makes it (`support::cgroup::ScratchCgroup::at`) and puts a process in
/// `share.slice/<alloc id>.<task>.scope` under it.
pub fn nomad_cgroup_parent() -> String {
    format!("dhv-binder-test-inproc-{}", std::process::id())
}

pub fn agent_config(sb: &Sandbox) -> AgentConfig {
    AgentConfig {
        watch_mode: dhv_binder::nomad::watch::WatchMode::Stream,
        token_file: None,
        state_dir: sb.join("state"),
        socket: sb.join("run/api.sock"),
        plugin_dir: sb.join("plugins"),
        volumes_dir: Some(sb.join("volumes")),
        plugin_timeout: Duration::from_secs(10),
        stream_idle_timeout: Duration::from_secs(95),
        resync_interval: Duration::from_secs(300),
        // Records are planted with plain variable writes (`volume_record`), which do not
        // update the change marker: the relist finds them (docs/records.md "The change marker").
        record_relist: Duration::from_secs(1),
        tick: Duration::from_millis(200),
        plugin_rescan: Duration::from_millis(500),
        health_interval: Duration::from_secs(10),
        usage_interval: Duration::from_secs(60),
        check_interval: Duration::from_secs(300),
        max_parallel: 8,
        claim_ttl: Duration::from_secs(15),
        claim_lock_delay: Duration::from_secs(15),
        heartbeat_interval_max: Duration::from_secs(20),
        fallback_addresses: Vec::new(),
        claim_fence_margin: None,
        audiences: vec![],
        metrics_addr: None,
        log_format: Default::default(),
        record_keys: None,
        allow_unsigned_records: true,
        plugin_roots: vec![],
        secrets_path: dhv_binder::storage::secrets::DEFAULT_SECRETS_PATH.into(),
        vault_addr: None,
        vault_token: None,
        max_volumes: vec![],
        token_issuer: None,
        helper_cgroup: dhv_binder::config::HelperCgroupSetting::None,
        helper_memory_max: dhv_binder::config::MemoryMax(None),
        nomad_cgroup_parent: Some(nomad_cgroup_parent()),
        other_node_cgroups: vec![],
    }
}

/// Starts the agent against `nomad`.
pub fn start_agent(nomad: &Replay, cfg: AgentConfig) -> Running {
    let client = dhv_binder::nomad::Client::new(&NomadConfig::plain(&nomad.addr)).unwrap();
    let (stop, rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        dhv_binder::agent::run(cfg, client, dhv_binder::metrics::Metrics::new(), async {
            let _ = rx.await;
        })
        .await
        .expect("agent failed");
    });
    Running { stop, task }
}

/// The agent's status document (`Null` while it is not up).
pub async fn status(cfg: &AgentConfig) -> Value {
    dhv_binder::api::client::call(&cfg.socket, hyper::Method::GET, "/v1/status", None)
        .await
        .unwrap_or(Value::Null)
}

/// Waits until the agent has a complete view and `placeholders` registered.
pub async fn ready(cfg: &AgentConfig, nomad: &Replay, placeholders: usize) {
    for _ in 0..300 {
        let s = status(cfg).await;
        if s["view"]["complete"] == true && nomad.host_volumes().len() >= placeholders {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("agent never got ready: {}", status(cfg).await);
}

/// Stores a ready volume record served by `plugin`.
pub fn volume_record(nomad: &Replay, ns: &str, name: &str, plugin: &str, access_mode: &str) {
    let spec = json!({"name": name, "namespace": ns, "plugin_id": plugin,
        "capacity_min": 0, "capacity_max": 0, "node_pool": "",
        "capabilities": [{"access_mode": access_mode, "attachment_mode": "file-system"}],
        "parameters": {}});
    nomad.put_var(
        ns,
        &dhv_binder::volume::record_path(name),
        json!({"id": uuid::Uuid::new_v4().to_string(), "spec": spec.to_string(), "secrets": "{}",
               "state": "ready", "context": "{}", "capacity_bytes": "0", "worker_node": "", "error": ""}),
    );
}

/// A full allocation (with Job) on `node` using host volume `sources`, as Nomad serves it.
pub fn alloc_json(
    id: &str,
    node: &str,
    sources: &[&str],
    client_status: &str,
    modify_index: u64,
) -> Value {
    let volumes: serde_json::Map<String, Value> = sources
        .iter()
        .map(|s| {
            (
                format!("v-{s}"),
                json!({"Name": format!("v-{s}"), "Type": "host", "Source": s, "ReadOnly": false,
                       "Sticky": false, "AccessMode": "", "AttachmentMode": "", "MountOptions": null, "PerAlloc": false}),
            )
        })
        .collect();
    json!({
        "ID": id, "Namespace": "default", "Name": "job.g[0]", "NodeID": node, "JobID": "job",
        "TaskGroup": "g", "DesiredStatus": "run", "ClientStatus": client_status,
        "ModifyIndex": modify_index, "AllocModifyIndex": modify_index, "CreateIndex": modify_index,
        "Job": {"ID": "job", "Namespace": "default", "Type": "service", "Version": 0,
                "TaskGroups": [{"Name": "g", "Volumes": volumes, "ShutdownDelay": null,
                    "Tasks": [{"Name": "app", "Driver": "exec", "Lifecycle": null, "VolumeMounts": null,
                               "KillTimeout": 1_000_000_000u64, "ShutdownDelay": 0}]}]},
        "TaskStates": {"app": {"State": if client_status == "running" { "running" } else if client_status == "pending" { "pending" } else { "dead" },
                               "Failed": client_status == "failed", "Restarts": 0, "LastRestart": null,
                               "StartedAt": null, "FinishedAt": null, "Events": []}}
    })
}

/// An allocation event frame for `alloc` (payload without Job, as Nomad sends it).
pub fn frame(index: u64, event_type: &str, alloc: &Value) -> String {
    let mut payload = alloc.clone();
    payload.as_object_mut().unwrap().remove("Job");
    json!({"Index": index, "Events": [{"Topic": "Allocation", "Type": event_type, "Key": alloc["ID"],
        "Namespace": "default", "FilterKeys": [alloc["JobID"], ""], "Index": index,
        "Payload": {"Allocation": payload}}]})
    .to_string()
}

/// The agent's journal as stored in `state` (`journal.json` with the changes of
/// `journal.wal` applied), as JSON text (`{"node_id":..,"mounts":[..],"users":[..]}`), for
/// tests that wait for a record to be written.
pub fn journal_text(
    state: &std::path::Path,
) -> Result<String, dhv_binder::node::journal::JournalError> {
    dhv_binder::node::journal::read_stored(state)
        .map(|s| serde_json::to_string(&s).expect("the state serialises"))
}
