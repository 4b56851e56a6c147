//! Deployments over the store: allocation health, promotion, completion and failure.
//!
//! Models `client/allochealth/tracker.go` (`watchTaskEvents`, health by task states: an
//! allocation is healthy once every task that is not poststop, nor a finished prestart or
//! poststart, has run for `min_healthy_time` since the latest start; a failed task or a failed
//! allocation, or no health by `healthy_deadline`, is unhealthy), `nomad/deploymentwatcher`
//! (`deployment_watcher.go` `autoPromoteDeployment`, `PromoteDeployment`; a deployment with an
//! unhealthy allocation fails, without auto revert) and `nomad/state/state_store.go`
//! (`UpdateDeploymentPromotion`: every group being promoted needs as many healthy canaries
//! as it desires, else an uncoded multierror "Task group %q has %d/%d healthy allocations").
//! A deployment is successful when every group has at least `max(DesiredTotal,
//! DesiredCanaries)` healthy allocations and is promoted where it has canaries
//! (`isDeploymentComplete`); the job version becomes `Stable`.
//!
//! The sim decides health on the server from the task states the client reported (Nomad's
//! client decides it and reports `DeploymentStatus` in `Node.UpdateAlloc`); the outcome and
//! the timing (latest task start + `min_healthy_time`) are the same.

use crate::clock::{now_ns, rfc3339_nano};
use crate::state::State;
use crate::store::{Server, StoreError};
use crate::structs::{Allocation, Deployment, UpdateStrategy};
use serde_json::json;
use std::collections::BTreeMap;

/// Health of one allocation as the client's tracker would decide it at `now` (ns): `Some`
/// when decided, `None` while it waits.
pub fn decide_health(a: &Allocation, u: &UpdateStrategy, now: i64) -> Option<bool> {
    if a.ClientStatus == "failed" {
        return Some(false);
    }
    let group = a.Job.as_ref().and_then(|j| j.group(&a.TaskGroup))?;
    let hook = |task: &str| {
        group
            .lifecycle_of(task)
            .filter(|(_, sidecar)| !sidecar)
            .map(|(h, _)| h)
    };
    let mut latest_start: Option<i64> = Some(0);
    for t in &group.Tasks {
        let h = hook(&t.Name);
        if h == Some("poststop") {
            continue;
        }
        let Some(s) = a.TaskStates.get(&t.Name) else {
            latest_start = None;
            continue;
        };
        if h == Some("poststart") && s.successful() {
            continue;
        }
        if s.Failed || (s.FinishedAt.is_some() && h != Some("prestart")) {
            return Some(false);
        }
        if s.State == "pending" {
            latest_start = None;
            continue;
        }
        let started = s
            .Events
            .iter()
            .filter(|e| e.Type == "Started")
            .map(|e| e.Time)
            .max();
        latest_start = match (latest_start, started) {
            (Some(l), Some(st)) => Some(l.max(st)),
            _ => None,
        };
    }
    if let Some(start) = latest_start.filter(|s| *s > 0) {
        if now >= start.saturating_add(u.min_healthy_time) {
            return Some(true);
        }
    }
    (u.healthy_deadline > 0 && now >= a.CreateTime.saturating_add(u.healthy_deadline))
        .then_some(false)
}

fn strategy_of(a: &Allocation) -> Option<UpdateStrategy> {
    a.Job
        .as_ref()
        .and_then(|j| j.group(&a.TaskGroup))
        .and_then(|g| UpdateStrategy::of(&g.Update))
}

/// An allocation's health with this pass's decisions applied.
fn health(a: &Allocation, decided: &BTreeMap<String, bool>) -> Option<bool> {
    decided.get(&a.ID).copied().or(a.healthy())
}

/// Healthy canaries per group of deployment `d` (non-terminal, health set true).
fn healthy_canaries(
    st: &State,
    d: &Deployment,
    decided: &BTreeMap<String, bool>,
) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    for (g, s) in &d.TaskGroups {
        let n = s
            .PlacedCanaries
            .iter()
            .flatten()
            .filter_map(|id| st.allocs.get(id))
            .filter(|a| !a.terminal() && health(a, decided) == Some(true))
            .count() as i64;
        out.insert(g.clone(), n);
    }
    out
}

/// Marks the groups promoted (`UpdateDeploymentPromotion`), or says which group lacks
/// healthy canaries.
fn promote_in(
    st: &State,
    d: &mut Deployment,
    groups: Option<&[String]>,
    decided: &BTreeMap<String, bool>,
) -> Result<(), String> {
    let healthy = healthy_canaries(st, d, decided);
    let wanted = |g: &str| groups.is_none_or(|gs| gs.iter().any(|x| x == g));
    let mut missing = Vec::new();
    for (g, s) in &d.TaskGroups {
        if !wanted(g) || s.DesiredCanaries == 0 {
            continue;
        }
        let have = healthy.get(g).copied().unwrap_or(0);
        if have < s.DesiredCanaries {
            missing.push(format!(
                "Task group {g:?} has {have}/{} healthy allocations",
                s.DesiredCanaries
            ));
        }
    }
    if !missing.is_empty() {
        let n = missing.len();
        let list: String = missing.iter().map(|m| format!("\t* {m}\n")).collect();
        let noun = if n == 1 { "error" } else { "errors" };
        return Err(format!("{n} {noun} occurred:\n{list}\n"));
    }
    for (g, s) in d.TaskGroups.iter_mut() {
        if wanted(g) {
            s.Promoted = true;
        }
    }
    if d.Status == "running" {
        d.StatusDescription = d.running_description().into();
    }
    Ok(())
}

/// `POST /v1/deployment/promote/:id` (`Deployment.Promote`): all groups, or the named ones.
/// Errors are Nomad's uncoded ones (HTTP 500): "deployment not found", "can't promote
/// terminal deployment", the healthy-canary multierror.
pub fn promote(server: &Server, id: &str, groups: Option<Vec<String>>) -> Result<u64, StoreError> {
    let r = server.write(|st| {
        let mut d = st
            .deployments
            .get(id)
            .cloned()
            .ok_or_else(|| StoreError::Internal("deployment not found".into()))?;
        if !d.active() {
            return Err(StoreError::Internal(
                "can't promote terminal deployment".into(),
            ));
        }
        promote_in(st, &mut d, groups.as_deref(), &BTreeMap::new())
            .map_err(StoreError::Internal)?;
        let idx = st.next_index();
        d.ModifyIndex = idx;
        d.ModifyTime = now_ns();
        st.deployments.insert(d.ID.clone(), d.clone());
        st.tables.deployments = idx;
        st.emit_deployment("DeploymentPromotion", &d);
        Ok(idx)
    });
    if r.is_ok() {
        server.reschedule_all();
    }
    r
}

/// Deployment `d` after this pass: health counts, automatic promotion, failure (an
/// unhealthy allocation) or success; `None` when nothing changes.
fn advance(st: &State, d: &Deployment, decided: &BTreeMap<String, bool>) -> Option<Deployment> {
    let mut n = d.clone();
    for (g, s) in n.TaskGroups.iter_mut() {
        let (mut h, mut u) = (0, 0);
        for a in st
            .allocs
            .values()
            .filter(|a| a.DeploymentID == d.ID && &a.TaskGroup == g)
        {
            match health(a, decided) {
                Some(true) => h += 1,
                Some(false) => u += 1,
                None => {}
            }
        }
        s.HealthyAllocs = h;
        s.UnhealthyAllocs = u;
    }
    if n.TaskGroups.values().any(|s| s.UnhealthyAllocs > 0) {
        n.Status = "failed".into();
        n.StatusDescription = "Failed due to unhealthy allocations".into();
    } else {
        let auto = n.requires_promotion()
            && n.TaskGroups
                .values()
                .filter(|s| s.DesiredCanaries > 0)
                .all(|s| s.AutoPromote);
        if auto {
            // Not every canary healthy yet: it stays unpromoted.
            let _ = promote_in(st, &mut n, None, decided);
        }
        let old_left = st.allocs.values().any(|a| {
            a.Namespace == n.Namespace
                && a.JobID == n.JobID
                && !a.terminal()
                && a.Job.as_ref().map(|j| j.Version) != Some(n.JobVersion)
        });
        let complete = !old_left
            && n.TaskGroups.values().all(|s| {
                s.HealthyAllocs >= s.DesiredTotal.max(s.DesiredCanaries)
                    && (s.DesiredCanaries == 0 || s.Promoted)
            });
        if complete {
            n.Status = "successful".into();
            n.StatusDescription = "Deployment completed successfully".into();
        }
    }
    (n != *d).then_some(n)
}

/// One pass of the watcher: decides the health of the allocations of running deployments,
/// updates the deployments' counts, promotes automatically, completes or fails them, then
/// lets the scheduler continue the rollout. Writes (one index) only when something changed.
/// Run periodically.
pub fn tick(server: &Server) {
    let now = now_ns();
    let changed = server.write(|st| {
        let decided: BTreeMap<String, bool> = st
            .allocs
            .values()
            .filter(|a| !a.DeploymentID.is_empty() && a.healthy().is_none())
            .filter(|a| !a.server_terminal())
            .filter(|a| {
                st.deployments
                    .get(&a.DeploymentID)
                    .is_some_and(|d| d.active())
            })
            .filter_map(|a| {
                let u = strategy_of(a)?;
                decide_health(a, &u, now).map(|h| (a.ID.clone(), h))
            })
            .collect();
        let advanced: Vec<(Deployment, Deployment)> = st
            .deployments
            .values()
            .filter(|d| d.active())
            .filter_map(|d| advance(st, d, &decided).map(|n| (d.clone(), n)))
            .collect();
        if decided.is_empty() && advanced.is_empty() {
            return false;
        }
        let idx = st.next_index();
        for (id, healthy) in &decided {
            let Some(a) = st.allocs.get_mut(id) else {
                continue;
            };
            let canary = a.is_canary();
            a.DeploymentStatus = Some(json!({"Healthy": healthy, "Timestamp": rfc3339_nano(now),
                "Canary": canary, "ModifyIndex": idx}));
            a.ModifyIndex = idx;
            a.ModifyTime = now;
            let a = a.clone();
            st.tables.allocs = idx;
            st.emit_alloc("AllocationUpdated", &a);
        }
        for (before, mut d) in advanced {
            let kind = if before.requires_promotion() && !d.requires_promotion() {
                "DeploymentPromotion"
            } else if before.Status != d.Status {
                "DeploymentStatusUpdate"
            } else {
                "DeploymentAllocHealth"
            };
            d.ModifyIndex = idx;
            d.ModifyTime = now;
            if d.Status == "successful" {
                let key = (d.Namespace.clone(), d.JobID.clone());
                if let Some(j) = st.jobs.get_mut(&key) {
                    // `UpdateJobStability`: no event (`MsgTypeEvents` has no entry for it).
                    if j.Version == d.JobVersion && !j.Stable {
                        j.Stable = true;
                        j.ModifyIndex = idx;
                        st.tables.jobs = idx;
                    }
                }
            }
            st.deployments.insert(d.ID.clone(), d.clone());
            st.tables.deployments = idx;
            st.emit_deployment(kind, &d);
        }
        true
    });
    if changed {
        server.reschedule_all();
    }
}
