//! Node status management: eligibility, drain, heartbeats (`nomad/node_endpoint.go`,
//! `nomad/heartbeat.go`, `nomad/drainer`).

use crate::state::State;
use crate::store::{Server, StoreError};
use crate::structs::Allocation;
use serde_json::{json, Value};

/// `PUT /v1/node/:id/eligibility` (NodeEligibility event).
pub fn set_eligibility(server: &Server, id: &str, elig: &str) -> Result<u64, StoreError> {
    if elig != "eligible" && elig != "ineligible" {
        return Err(StoreError::BadRequest(format!(
            "invalid scheduling eligibility {elig:?}"
        )));
    }
    let idx = server.write(|st| {
        if !st.nodes.contains_key(id) {
            return Err(StoreError::NotFound("node not found".into()));
        }
        let idx = st.next_index();
        if let Some(n) = st.nodes.get_mut(id) {
            n.SchedulingEligibility = elig.into();
            n.ModifyIndex = idx;
        }
        st.tables.nodes = idx;
        st.emit_node("NodeEligibility", id);
        Ok(idx)
    })?;
    server.reschedule_all();
    Ok(idx)
}

/// `PUT /v1/node/:id/drain` body `{"DrainSpec":{"Deadline":ns,"IgnoreSystemJobs":bool}|null,
/// "MarkEligible":bool}`: sets DrainStrategy, marks the node ineligible and sets
/// `DesiredTransition.Migrate` on its allocs other than system ones
/// (AllocationUpdateDesiredStatus), which the scheduler then stops and replaces; the system
/// allocs go last or at the deadline ([`drain_tick`]). `Deadline` < 0 forces at once, 0 means
/// none (`DrainStrategy.DeadlineTime`). `DrainSpec: null` cancels the drain.
pub fn set_drain(server: &Server, id: &str, body: &Value) -> Result<(u64, String), StoreError> {
    let spec = body.get("DrainSpec").cloned().unwrap_or(Value::Null);
    let mark_eligible = body
        .get("MarkEligible")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let eval = uuid::Uuid::new_v4().to_string();
    let idx = server.write(|st| {
        if !st.nodes.contains_key(id) {
            return Err(StoreError::NotFound("node not found".into()));
        }
        let idx = st.next_index();
        let ignore_system = spec
            .get("IgnoreSystemJobs")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        if let Some(n) = st.nodes.get_mut(id) {
            if spec.is_null() {
                n.DrainStrategy = None;
                if mark_eligible {
                    n.SchedulingEligibility = "eligible".into();
                }
            } else {
                let deadline = spec.get("Deadline").and_then(Value::as_i64).unwrap_or(0);
                n.DrainStrategy = Some(
                    json!({"Deadline": deadline, "IgnoreSystemJobs": ignore_system,
                    "ForceDeadline": null, "StartedAt": crate::clock::now_rfc3339()}),
                );
                n.SchedulingEligibility = "ineligible".into();
            }
            n.ModifyIndex = idx;
        }
        st.tables.nodes = idx;
        st.emit_node("NodeDrain", id);
        if spec.is_null() {
            st.drain_deadlines.remove(id);
        } else {
            let deadline = spec.get("Deadline").and_then(Value::as_i64).unwrap_or(0);
            let at = match deadline {
                d if d < 0 => Some(0),
                0 => None,
                d => Some(crate::clock::now_ns().saturating_add(d)),
            };
            st.drain_deadlines.insert(id.to_string(), at);
            let ids: Vec<String> = st
                .allocs
                .values()
                .filter(|a| a.NodeID == id && !a.terminal() && !is_system(a))
                .map(|a| a.ID.clone())
                .collect();
            mark_migrate(st, &ids, idx);
        }
        Ok(idx)
    })?;
    server.reschedule_all();
    Ok((idx, eval))
}

fn is_system(a: &Allocation) -> bool {
    a.Job.as_ref().is_some_and(|j| j.Type == "system")
}

/// Sets `DesiredTransition.Migrate` on these allocations (`batchDrainAllocs`).
fn mark_migrate(st: &mut State, ids: &[String], idx: u64) {
    for aid in ids {
        if let Some(a) = st.allocs.get_mut(aid) {
            a.DesiredTransition.Migrate = Some(true);
            a.ModifyIndex = idx;
            a.AllocModifyIndex = idx;
            let a = a.clone();
            st.emit_alloc("AllocationUpdateDesiredStatus", &a);
        }
    }
    if !ids.is_empty() {
        st.tables.allocs = idx;
    }
}

/// The node drainer (`nomad/drainer/watch_nodes.go`, `drainer.go` `handleDeadlinedNodes`,
/// `draining_node.go` `IsDone`, `RemainingAllocs`): at the deadline every remaining
/// non-terminal allocation on the node, system ones included (unless `IgnoreSystemJobs`), is
/// drained at once; before it, once every allocation that is not a system one is client-
/// terminal, the remaining system allocations are drained. Then the drain completes (the
/// strategy is removed, the node stays ineligible). Run periodically.
pub fn drain_tick(server: &Server) {
    let now = crate::clock::now_ns();
    let due: Vec<String> = {
        let st = server.read();
        st.drain_deadlines
            .iter()
            .filter(|(id, deadline)| {
                let passed = deadline.is_some_and(|d| now >= d);
                let done = st
                    .allocs
                    .values()
                    .filter(|a| &a.NodeID == *id && !is_system(a))
                    .all(|a| a.client_terminal());
                passed || done
            })
            .map(|(id, _)| id.clone())
            .collect()
    };
    if due.is_empty() {
        return;
    }
    server.write(|st| {
        let idx = st.next_index();
        for id in &due {
            let ignore_system = st
                .nodes
                .get(id)
                .and_then(|n| n.DrainStrategy.as_ref())
                .and_then(|d| d.get("IgnoreSystemJobs"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let remaining: Vec<String> = st
                .allocs
                .values()
                .filter(|a| &a.NodeID == id && !a.terminal())
                .filter(|a| !(ignore_system && is_system(a)))
                .filter(|a| a.DesiredTransition.Migrate != Some(true))
                .map(|a| a.ID.clone())
                .collect();
            mark_migrate(st, &remaining, idx);
            st.drain_deadlines.remove(id);
            if let Some(n) = st.nodes.get_mut(id) {
                n.DrainStrategy = None;
                n.ModifyIndex = idx;
            }
            st.tables.nodes = idx;
            st.emit_node("NodeDrain", id);
        }
    });
    server.reschedule_all();
}

/// `helper/cluster.go` `RateScaledInterval`: the interval at which `n` actors each acting once
/// per interval make `rate` actions a second in all, at least `min`.
pub fn rate_scaled_interval(rate: f64, min: std::time::Duration, n: usize) -> std::time::Duration {
    if rate <= 0.001 {
        return min;
    }
    std::time::Duration::from_secs_f64(n as f64 / rate).max(min)
}

/// `helper/cluster.go` `RandomStagger`: a random duration in `[0, d)`.
pub fn random_stagger(d: std::time::Duration) -> std::time::Duration {
    use rand::Rng as _;
    if d.is_zero() {
        return d;
    }
    std::time::Duration::from_nanos(rand::thread_rng().gen_range(0..d.as_nanos() as u64))
}

/// The TTL a server answers a client's registration or heartbeat with (`nomad/heartbeat.go`
/// `resetHeartbeatTimer`): `RateScaledInterval(max_heartbeats_per_second, min_heartbeat_ttl,
/// n)` over the `n` nodes with a heartbeat timer (every node not `down`), plus a random
/// stagger of up to as much again. The client heartbeats once per TTL (`client/client.go`
/// `registerAndHeartbeat`): 10–20 s up to 500 nodes with Nomad's defaults.
pub fn heartbeat_ttl(server: &Server) -> std::time::Duration {
    let (settings, n) = {
        let st = server.read();
        let n = st.nodes.values().filter(|n| n.Status != "down").count();
        (st.heartbeat, n)
    };
    let ttl = rate_scaled_interval(settings.max_per_second, settings.min_ttl, n);
    ttl + random_stagger(ttl)
}

/// Sets the servers' heartbeat settings (the agent config's `server` block).
pub fn set_heartbeat_settings(server: &Server, settings: crate::config::HeartbeatSettings) {
    server.write(|st| st.heartbeat = settings);
}

/// Sim-only: stop or resume a node's heartbeats (a partitioned client). While stopped the node
/// neither heartbeats nor reports alloc updates nor sees new allocations; after the heartbeat
/// grace the server marks it down (its allocs become `lost` and are replaced).
pub fn set_heartbeat_stopped(server: &Server, id: &str, stopped: bool) -> Result<(), StoreError> {
    server.write(|st| {
        if !st.nodes.contains_key(id) {
            return Err(StoreError::NotFound("node not found".into()));
        }
        if stopped {
            st.stopped_heartbeats.insert(id.to_string());
        } else {
            st.stopped_heartbeats.remove(id);
        }
        Ok(())
    })
}

/// Sim-only: cut a node off from the servers, or heal it. Its heartbeats stop (as with
/// [`set_heartbeat_stopped`]: Nomad marks it down after the grace, `nomad/heartbeat.go`) and
/// every request made through its client agent's HTTP API that needs a server fails as the
/// client's RPC forwarding fails with no reachable server (`api::partition_guard`); its
/// tasks keep running.
pub fn set_partitioned(server: &Server, id: &str, on: bool) -> Result<(), StoreError> {
    set_heartbeat_stopped(server, id, on)?;
    server.write(|st| {
        if on {
            st.partitioned.insert(id.to_string());
        } else {
            st.partitioned.remove(id);
        }
    });
    Ok(())
}

/// Marks a node `down` or `ready` (NodeStreamEvent) and reschedules.
pub fn set_status(server: &Server, id: &str, status: &str) {
    let changed = server.write(|st| {
        let cur = st.nodes.get(id).map(|n| n.Status.clone());
        if cur.as_deref() == Some(status) || cur.is_none() {
            return false;
        }
        let idx = st.next_index();
        if let Some(n) = st.nodes.get_mut(id) {
            n.Status = status.into();
            n.StatusUpdatedAt = crate::clock::now_secs();
            n.ModifyIndex = idx;
        }
        st.tables.nodes = idx;
        st.emit_node("NodeStreamEvent", id);
        // Host volumes on a down node become unavailable; back to ready when it returns.
        let now = crate::clock::now_ns();
        let vols: Vec<_> = st
            .host_volumes
            .iter()
            .filter(|(_, v)| v.NodeID == id)
            .map(|(k, _)| k.clone())
            .collect();
        for k in vols {
            let fingerprinted = st
                .nodes
                .get(id)
                .is_some_and(|n| n.HostVolumes.values().any(|c| c.ID == k.1));
            let state = if status == "ready" && fingerprinted {
                "ready"
            } else {
                "unavailable"
            };
            st.set_host_volume_state(&k, state, idx, now);
        }
        true
    });
    if changed {
        server.reschedule_all();
    }
}

/// Sim-only: the node's client agent restarts (`PUT /v1/sim/node/:id/restart?down=<d>`).
///
/// While it is away (`down`, 0 by default: an instant restart) the client neither heartbeats
/// nor reports allocation updates (the server marks the node down after the heartbeat grace,
/// as for any silent client), its HTTP address refuses connections and every Task API socket
/// of its tasks is gone: Nomad's agent fingerprints and restores first and serves HTTP only
/// afterwards (`client/client.go` `NewClient` waits for the first fingerprints before
/// registering and restoring; `command/agent/http.go` `builtinAPI.Serve` holds the Task API
/// listeners of restored tasks until the HTTP servers exist, `apiHook.Prestart` creating the
/// socket again). Its tasks keep running: Nomad's client re-attaches to them and does not
/// re-run a finished prestart task (`client/allocrunner/alloc_runner.go` `Restore`,
/// `taskrunner/task_runner.go` `Restore`). Then it re-registers: dynamic host volumes are
/// restored by a `stat` of their path, and one that fails (gone, or a dead FUSE mount
/// answering ENOTCONN) is left out of the node's fingerprint
/// (`client/hostvolumemanager/host_volumes.go` `restoreForRegister`); the server then marks it
/// `unavailable` (`nomad/state/state_store_host_volumes.go` `upsertHostVolumeForNode`).
/// Finally the restored task runners run their prestart hooks again (`task_runner.go` `Run`:
/// the volume hook never reports itself done), so a running task whose group's host volume
/// did not come back fails its `volumes` hook and goes through its restart policy until it is
/// killed (`volume_hook.go` `validateHostVolumes`; the client's alloc runners are told through
/// [`Server::restored_tx`]). Returns the IDs of the volumes dropped.
pub async fn restart_client(
    server: &Server,
    id: &str,
    down: std::time::Duration,
) -> Result<Vec<String>, StoreError> {
    let node = server
        .node(id)
        .ok_or_else(|| StoreError::NotFound("node not found".into()))?;
    if !down.is_zero() {
        let was_stopped = server.read().heartbeat_stopped(id);
        set_heartbeat_stopped(server, id, true)?;
        server.restarting.send_modify(|s| {
            s.insert(id.to_string());
        });
        tokio::time::sleep(down).await;
        server.restarting.send_modify(|s| {
            s.remove(id);
        });
        set_heartbeat_stopped(server, id, was_stopped)?;
    }
    // The node as it is now (a drain or eligibility change may have come meanwhile).
    let node = server.node(id).unwrap_or(node);
    // The stats run outside the state lock: a hung mount must not stop the server.
    let dropped: Vec<String> = node
        .HostVolumes
        .values()
        .filter(|c| !c.ID.is_empty())
        .filter(|c| std::fs::metadata(&c.Path).is_err())
        .map(|c| c.ID.clone())
        .collect();
    server.write(|st| {
        let idx = st.next_index();
        let now = crate::clock::now_ns();
        if let Some(n) = st.nodes.get_mut(id) {
            n.HostVolumes.retain(|_, c| !dropped.contains(&c.ID));
            n.ModifyIndex = idx;
        }
        st.tables.nodes = idx;
        st.emit_node("NodeRegistration", id);
        let keys: Vec<_> = st
            .host_volumes
            .iter()
            .filter(|(_, v)| v.NodeID == id && dropped.contains(&v.ID))
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            st.set_host_volume_state(&k, "unavailable", idx, now);
        }
    });
    server.reschedule_all();
    let _ = server.restored_tx.send(id.to_string());
    Ok(dropped)
}

/// The status a node that missed its heartbeats gets (`nomad/heartbeat.go`
/// `disconnectState`): `disconnected` while one of its allocations is desired to run, has
/// `disconnect.lost_after` and has not expired (`Allocation.Expired`: `unknown` for longer
/// than it), else `down`.
pub fn unresponsive_status(server: &Server, id: &str) -> &'static str {
    let now = crate::clock::now_ns();
    let st = server.read();
    let can_disconnect = st.allocs.values().any(|a| {
        let lost_after = a
            .Job
            .as_ref()
            .and_then(|j| j.group(&a.TaskGroup))
            .map(|g| g.lost_after())
            .unwrap_or(0);
        let expired = a.ClientStatus == "unknown"
            && a.unknown_since
                .is_some_and(|t| now >= t.saturating_add(lost_after));
        a.NodeID == id && lost_after > 0 && a.DesiredStatus == "run" && !expired
    });
    if can_disconnect {
        "disconnected"
    } else {
        "down"
    }
}
