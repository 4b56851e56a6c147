//! `nomad-sim agent`: one server plus N client nodes in one process, like `nomad agent -dev`.
//!
//! Writes `<data_dir>/ready.json` once every listener is bound; on SIGINT/SIGTERM kills every
//! task (with kill timeouts) and exits 0 (allocations are destroyed on exit, as in -dev).

use crate::api::{router, AgentInfo, AppState};
use crate::client::run_node;
use crate::config::AgentConfig;
use crate::identity::Keyring;
use crate::store::Server;
use crate::structs::{ClientHostVolumeConfig, Node};
use crate::taskrunner::NodeCtx;
use anyhow::Context;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

fn node_for(cfg: &AgentConfig, c: &crate::config::ClientConfig, id: &str, addr: &str) -> Node {
    let now = crate::clock::now_rfc3339();
    let driver = |name: &str| {
        json!({"Attributes": {format!("driver.{name}"): "true"}, "Detected": true, "Healthy": true,
               "HealthDescription": "Healthy", "UpdateTime": now})
    };
    let mut attrs: BTreeMap<String, String> = [
        ("kernel.name", "linux".to_string()),
        ("os.name", "linux".to_string()),
        ("arch", std::env::consts::ARCH.to_string()),
        ("nomad.version", format!("{}-sim", cfg.nomad_version)),
        ("nomad.revision", "nomad-sim".to_string()),
        ("nomad.advertise.address", addr.to_string()),
        ("unique.hostname", c.name.clone()),
        ("unique.network.ip-address", cfg.bind_addr.clone()),
        ("driver.exec", "1".to_string()),
        ("driver.raw_exec", "1".to_string()),
        ("cpu.numcores", "2".to_string()),
        ("memory.totalbytes", "8589934592".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let mut drivers: BTreeMap<String, serde_json::Value> = [
        ("exec".to_string(), driver("exec")),
        ("raw_exec".to_string(), driver("raw_exec")),
    ]
    .into();
    if let Some(d) = crate::docker_driver::node_driver(&now) {
        attrs.insert("driver.docker".into(), "1".into());
        drivers.insert("docker".into(), d);
    }
    Node {
        ID: id.into(),
        Datacenter: c.datacenter.clone(),
        Name: c.name.clone(),
        HTTPAddr: addr.into(),
        Attributes: attrs,
        NodeResources: json!({"Cpu": {"CpuShares": 4000, "TotalCpuCores": 2, "ReservableCpuCores": [0, 1]},
            "Memory": {"MemoryMB": 8192}, "Disk": {"DiskMB": 100000}, "Networks": null, "NodeNetworks": null,
            "Devices": null, "NUMA": null, "MinDynamicPort": 20000, "MaxDynamicPort": 32000}),
        ReservedResources: json!({"Cpu": {"CpuShares": 0, "ReservedCpuCores": null}, "Memory": {"MemoryMB": 0},
            "Disk": {"DiskMB": 0}, "Networks": {"ReservedHostPorts": ""}}),
        Meta: c.meta.clone(),
        NodePool: c.node_pool.clone(),
        ComputedClass: format!("v1:{}", c.node_pool),
        SchedulingEligibility: "eligible".into(),
        Status: "ready".into(),
        Events: vec![
            json!({"Message": "Node registered", "Subsystem": "Cluster", "Details": null,
            "Timestamp": now, "CreateIndex": 0}),
        ],
        Drivers: drivers,
        HostVolumes: c
            .host_volumes
            .iter()
            .map(|h| {
                (
                    h.name.clone(),
                    ClientHostVolumeConfig {
                        Name: h.name.clone(),
                        Path: h.path.display().to_string(),
                        ReadOnly: h.read_only,
                        ID: String::new(),
                    },
                )
            })
            .collect(),
        ..Default::default()
    }
}

async fn serve(listener: TcpListener, state: AppState, mut shutdown: watch::Receiver<bool>) {
    let app = router(state);
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = shutdown.wait_for(|s| *s).await;
        })
        .await;
}

/// Serves a client node's HTTP API. While its client agent restarts (the node is in
/// [`Server::restarting`]) the listener is closed, its connections dropped (a restarting
/// agent's port refuses connections), and bound again on the same address once it is back.
/// Open connections per peer address, for `http_max_conns_per_client`.
#[derive(Clone, Default)]
struct ConnCount(Arc<std::sync::Mutex<HashMap<std::net::IpAddr, usize>>>);

/// One open connection of a peer, counted until dropped.
struct Counted(ConnCount, std::net::IpAddr);

impl ConnCount {
    /// Counts a new connection from `ip`, or `None` when it already has `limit` open (0: no
    /// limit).
    fn admit(&self, ip: std::net::IpAddr, limit: usize) -> Option<Counted> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(ip).or_insert(0);
        if limit > 0 && *n >= limit {
            return None;
        }
        *n += 1;
        Some(Counted(self.clone(), ip))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut m = (self.0).0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.1) {
            *n = n.saturating_sub(1);
        }
    }
}

async fn serve_node(
    listener: TcpListener,
    state: AppState,
    node_id: String,
    max_conns: usize,
    mut shutdown: watch::Receiver<bool>,
) {
    let Ok(addr) = listener.local_addr() else {
        return;
    };
    let app = router(state.clone());
    let mut restarting = state.server.restarting.subscribe();
    let mut listener = Some(listener);
    let open = ConnCount::default();
    loop {
        if let Some(l) = listener.take() {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    a = l.accept() => {
                        let Ok((stream, peer)) = a else { continue };
                        // Over the per-address limit: closed at once, unanswered (go-connlimit
                        // `HTTPConnStateFunc` closes it on `StateNew`).
                        let Some(counted) = open.admit(peer.ip(), max_conns) else {
                            tracing::debug!(%peer, max_conns, "connection refused: http_max_conns_per_client");
                            drop(stream);
                            continue;
                        };
                        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
                        conns.spawn(async move {
                            let _counted = counted;
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                                .await;
                        });
                    }
                    Some(_) = conns.join_next(), if !conns.is_empty() => {}
                    _ = restarting.wait_for(|s| s.contains(&node_id)) => break,
                    _ = shutdown.wait_for(|s| *s) => return,
                }
            }
            // Dropping the listener and the connections: the port refuses, open requests
            // (blocking queries, event streams) end with a reset.
            conns.abort_all();
        }
        tokio::select! {
            _ = restarting.wait_for(|s| !s.contains(&node_id)) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        // Bind the same address again (retried while the kernel still holds it).
        for _ in 0..50 {
            match TcpListener::bind(addr).await {
                Ok(l) => {
                    listener = Some(l);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        if listener.is_none() {
            tracing::error!(node = %node_id, %addr, "cannot bind the client's address again after its restart");
            return;
        }
    }
}

/// Runs the agent until SIGINT/SIGTERM.
pub async fn run(cfg: AgentConfig) -> anyhow::Result<()> {
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("creating {}", cfg.data_dir.display()))?;
    let ready_path = cfg.data_dir.join("ready.json");
    let _ = std::fs::remove_file(&ready_path);
    let issuer = cfg.oidc_issuer.clone();
    let keyring = Arc::new(
        tokio::task::spawn_blocking(Keyring::generate)
            .await??
            .with_issuer(issuer),
    );
    let mut acl = crate::policy::AclState {
        enabled: cfg.acl.enabled,
        ..Default::default()
    };
    if let Some(t) = &cfg.acl.bootstrap_token {
        acl.management.push(t.clone());
    }
    // `Client.setupNode` (client/client.go): every static host volume's path must exist, or
    // the client (and with it the agent) refuses to start: "node setup failed".
    for c in &cfg.clients {
        for v in &c.host_volumes {
            if let Err(e) = std::fs::metadata(&v.path) {
                anyhow::bail!(
                    "client {}: node setup failed: failed to validate volume {}, err: stat {}: {e}",
                    c.name,
                    v.name,
                    v.path.display()
                );
            }
        }
    }
    let server = Server::new(&cfg.region, cfg.event_buffer_size, keyring, acl);
    crate::nodes::set_heartbeat_settings(&server, cfg.heartbeat);
    let version = cfg.nomad_version;
    server.write(|st| st.version = version);
    let self_exe = std::env::current_exe().context("locating nomad-sim executable")?;
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let server_listener = TcpListener::bind((cfg.bind_addr.as_str(), cfg.http_port))
        .await
        .with_context(|| format!("binding server HTTP on {}:{}", cfg.bind_addr, cfg.http_port))?;
    let server_addr = server_listener.local_addr()?;
    let mut http_tasks = Vec::new();
    http_tasks.push(tokio::spawn(serve(
        server_listener,
        AppState {
            server: server.clone(),
            agent: Arc::new(AgentInfo {
                node_id: None,
                name: "nomad-sim-server.global".into(),
                region: cfg.region.clone(),
                datacenter: cfg.datacenter.clone(),
                node_pool: String::new(),
                heartbeat: cfg.event_heartbeat_interval,
            }),
        },
        shutdown_rx.clone(),
    )));
    let mut ready_nodes = Vec::new();
    let mut node_tasks = Vec::new();
    let (node_stop_tx, node_stop_rx) = watch::channel(false);
    for c in &cfg.clients {
        let listener = TcpListener::bind((cfg.bind_addr.as_str(), c.http_port))
            .await
            .with_context(|| format!("binding client {} HTTP", c.name))?;
        let addr = listener.local_addr()?;
        let id = uuid::Uuid::new_v4().to_string();
        let data_dir = cfg.data_dir.join(&c.name);
        std::fs::create_dir_all(data_dir.join("alloc"))?;
        let node = node_for(&cfg, c, &id, &addr.to_string());
        server.register_node(node.clone());
        let client_state = AppState {
            server: server.clone(),
            agent: Arc::new(AgentInfo {
                node_id: Some(id.clone()),
                name: c.name.clone(),
                region: cfg.region.clone(),
                datacenter: c.datacenter.clone(),
                node_pool: c.node_pool.clone(),
                heartbeat: cfg.event_heartbeat_interval,
            }),
        };
        http_tasks.push(tokio::spawn(serve_node(
            listener,
            client_state.clone(),
            id.clone(),
            cfg.http_max_conns_per_client,
            shutdown_rx.clone(),
        )));
        let ctx = Arc::new(NodeCtx {
            node,
            region: cfg.region.clone(),
            data_dir: data_dir.clone(),
            chroot_env: c
                .chroot_env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            self_exe: self_exe.clone(),
            task_api: Some(crate::task_api::TaskApi::new(client_state)),
            cgroups: match &c.cgroup_parent {
                None => None,
                Some(p) => {
                    let parent = crate::cgroup::resolve_parent(p)?;
                    let cg = crate::cgroup::TaskCgroups::open(&parent)?;
                    if cg.memory_limited() {
                        tracing::info!(node = %c.name, parent = %parent.display(), "tasks run in their own cgroups");
                    } else {
                        tracing::warn!(node = %c.name, parent = %parent.display(), "tasks run in their own cgroups without memory.max: the memory controller is not offered under the cgroup parent (a hybrid host keeps it on cgroup v1)");
                    }
                    Some(cg)
                }
            },
        });
        node_tasks.push(tokio::spawn(run_node(
            server.clone(),
            ctx,
            node_stop_rx.clone(),
        )));
        ready_nodes.push(json!({"name": c.name, "id": id, "address": format!("http://{addr}"), "data_dir": data_dir}));
    }
    tokio::spawn(heartbeat_monitor(server.clone(), cfg.heartbeat_grace));
    {
        let server = server.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            let mut n: u64 = 0;
            loop {
                tick.tick().await;
                crate::locks::expire(&server);
                crate::deployments::tick(&server);
                crate::nodes::drain_tick(&server);
                n += 1;
                if n.is_multiple_of(5) {
                    // Delayed reschedules (follow-up evaluations) come due.
                    server.reschedule_all();
                }
            }
        });
    }
    let ready =
        json!({"server": {"address": format!("http://{server_addr}")}, "nodes": ready_nodes});
    let tmp = cfg.data_dir.join(".ready.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&ready)?)?;
    std::fs::rename(&tmp, &ready_path)?;
    tracing::info!(server = %server_addr, nodes = cfg.clients.len(), "nomad-sim agent ready");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutting down: killing all tasks");
    let _ = node_stop_tx.send(true);
    for t in node_tasks {
        let _ = t.await;
    }
    let _ = shutdown_tx.send(true);
    server.stream_close.send_modify(|g| *g += 1);
    for t in http_tasks {
        let _ = tokio::time::timeout(Duration::from_secs(2), t).await;
    }
    let _ = std::fs::remove_file(&ready_path);
    tracing::info!("nomad-sim agent stopped");
    Ok(())
}

/// Marks nodes whose heartbeats were stopped (sim fault API) down after the grace, and ready
/// again once they resume (`nomad/heartbeat.go`).
async fn heartbeat_monitor(server: Arc<Server>, grace: Duration) {
    let mut since: BTreeMap<String, tokio::time::Instant> = BTreeMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        let (stopped, nodes): (Vec<String>, Vec<(String, String)>) = {
            let st = server.read();
            (
                st.stopped_heartbeats.iter().cloned().collect(),
                st.nodes
                    .values()
                    .map(|n| (n.ID.clone(), n.Status.clone()))
                    .collect(),
            )
        };
        let now = tokio::time::Instant::now();
        for (id, status) in nodes {
            if stopped.contains(&id) {
                let t = *since.entry(id.clone()).or_insert(now);
                if now.duration_since(t) >= grace {
                    let want = crate::nodes::unresponsive_status(&server, &id);
                    if status != want {
                        tracing::info!(node = %id, status = want, "node missed heartbeats");
                        crate::nodes::set_status(&server, &id, want);
                    }
                }
            } else {
                since.remove(&id);
                if status == "down" || status == "disconnected" {
                    tracing::info!(node = %id, "node heartbeating again: marking ready");
                    crate::nodes::set_status(&server, &id, "ready");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `http_max_conns_per_client`: an address at the limit has its next connection
    /// refused until one of its connections closes; 0 is no limit.
    #[test]
    fn connections_over_the_per_address_limit_are_closed() {
        let open = ConnCount::default();
        let ip: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let other: std::net::IpAddr = "127.0.0.2".parse().unwrap();
        let a = open.admit(ip, 2).expect("first");
        let _b = open.admit(ip, 2).expect("second");
        assert!(open.admit(ip, 2).is_none(), "a third is over the limit");
        assert!(open.admit(other, 2).is_some(), "the limit is per address");
        drop(a);
        assert!(open.admit(ip, 2).is_some(), "room again once one closed");
        let many: Vec<_> = (0..10).map(|_| open.admit(ip, 0)).collect();
        assert!(many.iter().all(Option::is_some), "0: no limit");
    }
}
