//! The scheduler: reconciles every job against its allocations and places missing ones.
//!
//! Models `scheduler/generic_sched.go`, `scheduler/scheduler_system.go` and the feasibility
//! checks of `scheduler/feasible/feasible.go` (`HostVolumeChecker`), writing one plan
//! (`PlanResult` events) per pass. Placements that find no feasible node are retried on the next
//! pass (node or host volume change), like Nomad's blocked evaluations.

use crate::clock::now_ns;
use crate::store::State;
use crate::structs::{Allocation, Job, Node, TaskGroup};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};

/// Why a node is infeasible for a group (for logs and tests).
pub fn infeasible_reason(
    st: &State,
    job: &Job,
    g: &TaskGroup,
    alloc_name: &str,
    node: &Node,
) -> Option<String> {
    if node.Status != "ready" {
        return Some("node not ready".into());
    }
    if node.SchedulingEligibility != "eligible" {
        return Some("node ineligible".into());
    }
    if job.NodePool != "all" && job.NodePool != node.NodePool {
        return Some("node pool".into());
    }
    if !job
        .Datacenters
        .iter()
        .any(|dc| glob_match(dc, &node.Datacenter))
    {
        return Some("datacenter".into());
    }
    for c in job
        .Constraints
        .iter()
        .flatten()
        .chain(g.Constraints.iter().flatten())
    {
        if !constraint_ok(node, &c.LTarget, &c.Operand, &c.RTarget) {
            return Some(format!(
                "constraint {} {} {}",
                c.LTarget, c.Operand, c.RTarget
            ));
        }
    }
    for req in g.Volumes.iter().flat_map(|v| v.values()) {
        if req.Type != "host" {
            continue;
        }
        let source = req.source_for(alloc_name);
        let Some(hv) = node.HostVolumes.get(&source) else {
            return Some(format!("missing compatible host volumes: {source}"));
        };
        if hv.ID.is_empty() {
            if req.Sticky {
                return Some("sticky static host volume".into());
            }
            if hv.ReadOnly && !req.ReadOnly {
                return Some(format!("host volume {source} is read-only"));
            }
        } else {
            let Some(vol) = st.host_volumes.get(&(job.Namespace.clone(), hv.ID.clone())) else {
                return Some(format!(
                    "dynamic host volume {source} not in namespace {}",
                    job.Namespace
                ));
            };
            if vol.State != "ready" {
                return Some(format!("dynamic host volume {source} is {}", vol.State));
            }
            let (am, att) = (req.effective_access_mode(), req.effective_attachment_mode());
            if !vol
                .RequestedCapabilities
                .iter()
                .any(|c| c.AccessMode == am && c.AttachmentMode == att)
            {
                return Some(format!(
                    "dynamic host volume {source} lacks capability {am}/{att}"
                ));
            }
        }
    }
    None
}

fn glob_match(pattern: &str, s: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == s,
        Some((pre, post)) => {
            s.len() >= pre.len() + post.len() && s.starts_with(pre) && s.ends_with(post)
        }
    }
}

fn node_target(node: &Node, target: &str) -> Option<String> {
    let t = target.trim_start_matches("${").trim_end_matches('}');
    match t {
        "node.unique.id" => Some(node.ID.clone()),
        "node.unique.name" => Some(node.Name.clone()),
        "node.datacenter" => Some(node.Datacenter.clone()),
        "node.pool" => Some(node.NodePool.clone()),
        "node.class" => Some(node.NodeClass.clone()),
        _ => {
            if let Some(a) = t.strip_prefix("attr.") {
                node.Attributes.get(a).cloned()
            } else if let Some(m) = t.strip_prefix("meta.") {
                node.Meta.get(m).cloned()
            } else if target.starts_with("${") {
                None
            } else {
                Some(target.to_string())
            }
        }
    }
}

fn constraint_ok(node: &Node, l: &str, op: &str, r: &str) -> bool {
    let lv = node_target(node, l);
    match op {
        "=" | "==" | "is" => lv.as_deref() == Some(r),
        "!=" | "not" => lv.as_deref() != Some(r),
        "is_set" => lv.is_some(),
        "is_not_set" => lv.is_none(),
        // Not modelled: regexp, version, semver, set_contains, distinct_* (treated as satisfied).
        _ => true,
    }
}

fn resources_json(g: &TaskGroup) -> (Value, Value, Value, Value) {
    let mut tasks = serde_json::Map::new();
    let mut lifecycles = serde_json::Map::new();
    let mut task_res = serde_json::Map::new();
    let (mut cpu, mut mem) = (0, 0);
    for t in &g.Tasks {
        cpu += t.Resources.CPU;
        mem += t.Resources.MemoryMB;
        tasks.insert(
            t.Name.clone(),
            json!({"Cpu":{"CpuShares":t.Resources.CPU,"ReservedCores":null},
                   "Memory":{"MemoryMB":t.Resources.MemoryMB,"MemoryMaxMB":t.Resources.MemoryMaxMB},
                   "Networks":null,"Devices":null}),
        );
        lifecycles.insert(t.Name.clone(), json!(t.Lifecycle));
        task_res.insert(t.Name.clone(), json!(t.Resources));
    }
    let disk = g
        .EphemeralDisk
        .get("SizeMB")
        .and_then(Value::as_i64)
        .unwrap_or(300);
    let allocated = json!({"Tasks": tasks, "TaskLifecycles": lifecycles,
        "Shared": {"Networks": null, "DiskMB": disk, "Ports": null}});
    let res = |c: i64, m: i64, d: i64| {
        json!({"CPU":c,"Cores":0,"MemoryMB":m,"MemoryMaxMB":0,"DiskMB":d,"IOPS":0,
               "Networks":null,"Devices":null,"NUMA":null,"SecretsMB":0})
    };
    (
        res(cpu, mem, disk),
        res(0, 0, disk),
        Value::Object(task_res),
        allocated,
    )
}

struct Pass<'a> {
    st: &'a State,
    work: BTreeMap<String, Allocation>,
    touched: BTreeSet<String>,
    load: BTreeMap<String, usize>,
    eval_id: String,
}

impl Pass<'_> {
    fn stop(&mut self, id: &str, desc: &str) {
        if let Some(a) = self.work.get_mut(id) {
            a.DesiredStatus = "stop".into();
            a.DesiredDescription = desc.into();
            if let Some(n) = self.load.get_mut(&a.NodeID) {
                *n = n.saturating_sub(1);
            }
            self.touched.insert(id.to_string());
        }
    }

    fn place(
        &mut self,
        job: &Job,
        g: &TaskGroup,
        index: u64,
        only_node: Option<&str>,
        prev: Option<&str>,
    ) -> bool {
        let name = format!("{}.{}[{}]", job.ID, g.Name, index);
        let mut candidates: Vec<&Node> = self
            .st
            .nodes
            .values()
            .filter(|n| only_node.is_none_or(|o| o == n.ID))
            .filter(|n| infeasible_reason(self.st, job, g, &name, n).is_none())
            .collect();
        let in_pool = self
            .st
            .nodes
            .values()
            .filter(|n| job.NodePool == "all" || n.NodePool == job.NodePool)
            .count();
        if candidates.is_empty() {
            tracing::info!(job = %job.ID, group = %g.Name, alloc = %name, "no feasible node; placement blocked");
            return false;
        }
        // Avoid the node of the allocation being replaced when another one is feasible.
        if let Some(prev_node) = prev
            .and_then(|p| self.work.get(p))
            .map(|a| a.NodeID.clone())
        {
            if candidates.len() > 1 {
                candidates.retain(|n| n.ID != prev_node);
            }
        }
        candidates.sort_by_key(|n| (self.load.get(&n.ID).copied().unwrap_or(0), n.Name.clone()));
        let node = candidates[0];
        let id = uuid::Uuid::new_v4().to_string();
        let (resources, shared, task_res, allocated) = resources_json(g);
        let score = 0.5_f64;
        let mut nodes_available = serde_json::Map::new();
        for n in self.st.nodes.values() {
            let e = nodes_available
                .entry(n.Datacenter.clone())
                .or_insert(json!(0));
            *e = json!(e.as_i64().unwrap_or(0) + 1);
        }
        let metrics = json!({
            "NodesEvaluated": candidates.len(), "NodesFiltered": in_pool - candidates.len(),
            "NodesInPool": in_pool, "NodePool": job.NodePool, "NodesAvailable": nodes_available,
            "ClassFiltered": null, "ConstraintFiltered": null, "NodesExhausted": 0, "ClassExhausted": null,
            "DimensionExhausted": null, "QuotaExhausted": null, "ResourcesExhausted": null, "Scores": null,
            "ScoreMetaData": [{"NodeID": node.ID, "Scores": {"binpack": score, "job-anti-affinity": 0.0,
                "node-reschedule-penalty": 0.0, "node-affinity": 0.0}, "NormScore": score}],
            "AllocationTime": 100_000, "CoalescedFailures": 0,
        });
        let mut signed = BTreeMap::new();
        for t in &g.Tasks {
            match self.st.keyring.sign_default_identity(
                &self.st.region,
                &job.Namespace,
                &job.ID,
                &g.Name,
                &t.Name,
                &id,
            ) {
                Ok(tok) => {
                    signed.insert(t.Name.clone(), tok);
                }
                Err(e) => tracing::error!(error = %e, "signing identity"),
            }
        }
        let now = now_ns();
        let alloc = Allocation {
            ID: id.clone(),
            Namespace: job.Namespace.clone(),
            EvalID: self.eval_id.clone(),
            Name: name,
            NodeID: node.ID.clone(),
            NodeName: node.Name.clone(),
            JobID: job.ID.clone(),
            Job: Some(Box::new(job.clone())),
            TaskGroup: g.Name.clone(),
            Resources: Some(resources),
            SharedResources: Some(shared),
            TaskResources: Some(task_res),
            AllocatedResources: Some(allocated),
            Metrics: Some(metrics),
            DesiredStatus: "run".into(),
            ClientStatus: "pending".into(),
            PreviousAllocation: prev.unwrap_or_default().to_string(),
            SigningKeyID: self.st.keyring.kid.clone(),
            CreateTime: now,
            ModifyTime: now,
            signed_identities: signed,
            ..Default::default()
        };
        *self.load.entry(node.ID.clone()).or_insert(0) += 1;
        if let Some(p) = prev {
            if let Some(pa) = self.work.get_mut(p) {
                pa.NextAllocation = id.clone();
                self.touched.insert(p.to_string());
            }
        }
        self.work.insert(id.clone(), alloc);
        self.touched.insert(id);
        true
    }
}

/// Whether a failed alloc may be replaced under its group's reschedule policy.
fn reschedule_eligible(
    job: &Job,
    g: &TaskGroup,
    a: &Allocation,
    work: &BTreeMap<String, Allocation>,
) -> bool {
    if a.ClientStatus != "failed" || !a.NextAllocation.is_empty() || job.Type == "system" {
        return false;
    }
    let Some(p) = &g.ReschedulePolicy else {
        return false;
    };
    // Previous attempts along the PreviousAllocation chain (all, and within the interval).
    let now = now_ns();
    let (mut total, mut in_interval) = (0u32, 0i64);
    let mut cur = a.PreviousAllocation.clone();
    while let Some(prev) = work.get(&cur) {
        total += 1;
        if p.Interval == 0 || now - prev.ModifyTime <= p.Interval {
            in_interval += 1;
        }
        cur = prev.PreviousAllocation.clone();
    }
    if !p.Unlimited && in_interval >= p.Attempts {
        return false;
    }
    let delay = match p.DelayFunction.as_str() {
        "exponential" => p.Delay.saturating_mul(1i64 << total.min(30)),
        "fibonacci" => {
            let (mut x, mut y) = (p.Delay, p.Delay);
            for _ in 0..total {
                (x, y) = (y, x.saturating_add(y));
            }
            x
        }
        _ => p.Delay,
    };
    let delay = if p.MaxDelay > 0 {
        delay.min(p.MaxDelay)
    } else {
        delay
    };
    now >= a.ModifyTime.saturating_add(delay)
}

/// One scheduler pass over all jobs; writes a plan (one index) if anything changes.
pub fn reconcile_all(st: &mut State) {
    let jobs: Vec<Job> = st.jobs.values().cloned().collect();
    let mut pass = Pass {
        st: &*st,
        work: st.allocs.clone(),
        touched: BTreeSet::new(),
        load: st.node_load(),
        eval_id: uuid::Uuid::new_v4().to_string(),
    };
    // Lost allocations on down nodes.
    let lost: Vec<String> = pass
        .work
        .values()
        .filter(|a| !a.terminal())
        .filter(|a| {
            pass.st
                .nodes
                .get(&a.NodeID)
                .is_none_or(|n| n.Status == "down")
        })
        .map(|a| a.ID.clone())
        .collect();
    let mut replacements: BTreeMap<String, String> = BTreeMap::new(); // alloc name → previous alloc
    for id in lost {
        pass.stop(&id, "alloc is lost since its node is down");
        if let Some(a) = pass.work.get(&id) {
            replacements.insert(
                format!("{}\u{0}{}\u{0}{}", a.Namespace, a.JobID, a.Name),
                id.clone(),
            );
        }
        if let Some(a) = pass.work.get_mut(&id) {
            a.ClientStatus = "lost".into();
            a.ClientDescription = "alloc is lost since its node is down".into();
        }
    }
    // Allocations of purged jobs: the reconciler stops every non-terminal one
    // (`scheduler/reconciler`, `filterByTerminal`); terminal ones stay until GC.
    let orphans: Vec<String> = pass
        .work
        .values()
        .filter(|a| !a.terminal())
        .filter(|a| {
            !pass
                .st
                .jobs
                .contains_key(&(a.Namespace.clone(), a.JobID.clone()))
        })
        .map(|a| a.ID.clone())
        .collect();
    for id in orphans {
        pass.stop(&id, "alloc not needed due to job update");
    }
    // Migrations (drain, `alloc stop`).
    let migrating: Vec<String> = pass
        .work
        .values()
        .filter(|a| !a.server_terminal() && a.DesiredTransition.Migrate == Some(true))
        .map(|a| a.ID.clone())
        .collect();
    for id in &migrating {
        pass.stop(id, "alloc is being migrated");
    }
    for id in migrating {
        if let Some(a) = pass.work.get(&id) {
            replacements.insert(
                format!("{}\u{0}{}\u{0}{}", a.Namespace, a.JobID, a.Name),
                id.clone(),
            );
        }
    }
    for job in &jobs {
        let job_allocs: Vec<Allocation> = pass
            .work
            .values()
            .filter(|a| a.Namespace == job.Namespace && a.JobID == job.ID)
            .cloned()
            .collect();
        if job.Stop {
            for a in job_allocs.iter().filter(|a| !a.server_terminal()) {
                pass.stop(&a.ID, "alloc not needed due to job update");
            }
            continue;
        }
        for a in job_allocs.iter().filter(|a| !a.server_terminal()) {
            let version = a.Job.as_ref().map(|j| j.Version).unwrap_or(0);
            match job.group(&a.TaskGroup) {
                None => pass.stop(&a.ID, "alloc not needed due to job update"),
                Some(g) if job.Type != "system" && a.name_index() >= g.Count as u64 => {
                    pass.stop(&a.ID, "alloc not needed due to job update")
                }
                Some(_) if version != job.Version => {
                    pass.stop(&a.ID, "alloc is being updated due to job update")
                }
                _ => {}
            }
        }
        for g in &job.TaskGroups {
            let live = |work: &BTreeMap<String, Allocation>, pred: &dyn Fn(&Allocation) -> bool| {
                work.values()
                    .filter(|a| {
                        a.Namespace == job.Namespace && a.JobID == job.ID && a.TaskGroup == g.Name
                    })
                    .filter(|a| !a.server_terminal() && a.ClientStatus != "lost")
                    .any(pred)
            };
            if job.Type == "system" || job.Type == "sysbatch" {
                let node_ids: Vec<String> = pass.st.nodes.keys().cloned().collect();
                for nid in node_ids {
                    if live(&pass.work, &|a: &Allocation| a.NodeID == nid) {
                        continue;
                    }
                    let node = &pass.st.nodes[&nid];
                    let name = format!("{}.{}[0]", job.ID, g.Name);
                    if infeasible_reason(pass.st, job, g, &name, node).is_none() {
                        pass.place(job, g, 0, Some(&nid), None);
                    }
                }
                continue;
            }
            for i in 0..g.Count.max(0) as u64 {
                let failed_prev: Option<String> = pass
                    .work
                    .values()
                    .filter(|a| {
                        a.Namespace == job.Namespace && a.JobID == job.ID && a.TaskGroup == g.Name
                    })
                    .filter(|a| a.name_index() == i && !a.server_terminal())
                    .find(|a| reschedule_eligible(job, g, a, &pass.work))
                    .map(|a| a.ID.clone());
                let filled = live(&pass.work, &|a: &Allocation| {
                    a.name_index() == i && failed_prev.as_deref() != Some(a.ID.as_str())
                });
                if filled {
                    continue;
                }
                let name = format!("{}.{}[{}]", job.ID, g.Name, i);
                let prev = failed_prev
                    .clone()
                    .or_else(|| {
                        replacements
                            .get(&format!("{}\u{0}{}\u{0}{}", job.Namespace, job.ID, name))
                            .cloned()
                    })
                    .filter(|p| {
                        pass.work
                            .get(p)
                            .is_some_and(|a| a.NextAllocation.is_empty())
                    });
                if pass.place(job, g, i, None, prev.as_deref()) {
                    if let Some(f) = failed_prev {
                        pass.stop(&f, "alloc was rescheduled because it failed");
                    }
                }
            }
        }
    }
    if pass.touched.is_empty() {
        return;
    }
    let Pass { work, touched, .. } = pass;
    let idx = st.next_index();
    let now = now_ns();
    let mut jobs_touched = BTreeSet::new();
    for id in touched {
        let Some(mut a) = work.get(&id).cloned() else {
            continue;
        };
        if a.CreateIndex == 0 {
            a.CreateIndex = idx;
        }
        a.ModifyIndex = idx;
        a.AllocModifyIndex = idx;
        a.ModifyTime = now;
        jobs_touched.insert((a.Namespace.clone(), a.JobID.clone()));
        st.allocs.insert(id, a.clone());
        st.emit_alloc("PlanResult", &a);
    }
    st.tables.allocs = idx;
    for (ns, id) in jobs_touched {
        st.refresh_job_status(&ns, &id, "PlanResult");
    }
}
