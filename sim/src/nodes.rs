//! Node status management: eligibility, drain, heartbeats (`nomad/node_endpoint.go`,
//! `nomad/heartbeat.go`, `nomad/drainer`).

use crate::store::{Server, StoreError};
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
/// `DesiredTransition.Migrate` on its allocs (AllocationUpdateDesiredStatus), which the scheduler
/// then stops and replaces. `DrainSpec: null` cancels the drain.
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
        if !spec.is_null() {
            let ids: Vec<String> = st
                .allocs
                .values()
                .filter(|a| a.NodeID == id && !a.terminal())
                .filter(|a| !(ignore_system && a.Job.as_ref().is_some_and(|j| j.Type == "system")))
                .map(|a| a.ID.clone())
                .collect();
            for aid in ids {
                if let Some(a) = st.allocs.get_mut(&aid) {
                    a.DesiredTransition.Migrate = Some(true);
                    a.ModifyIndex = idx;
                    a.AllocModifyIndex = idx;
                    let a = a.clone();
                    st.emit_alloc("AllocationUpdateDesiredStatus", &a);
                }
            }
            st.tables.allocs = idx;
        }
        Ok(idx)
    })?;
    server.reschedule_all();
    Ok((idx, eval))
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
            if let Some(v) = st.host_volumes.get_mut(&k) {
                v.State = if status == "ready" {
                    "ready"
                } else {
                    "unavailable"
                }
                .into();
                v.ModifyIndex = idx;
                v.ModifyTime = now;
                let v = v.clone();
                st.tables.host_volumes = idx;
                st.emit_volume("NodeRegistration", &v, false);
            }
        }
        true
    });
    if changed {
        server.reschedule_all();
    }
}
