//! The scheduler: reconciles every job against its allocations and places missing ones.
//!
//! Models `scheduler/generic_sched.go`, `scheduler/scheduler_system.go` and the feasibility
//! checks of `scheduler/feasible/feasible.go` (`DriverChecker`, `HostVolumeChecker`), writing one plan
//! (`PlanResult` events) per pass. Placements that find no feasible node are retried on the next
//! pass (node or host volume change), like Nomad's blocked evaluations.

use crate::clock::now_ns;
use crate::state::State;
use crate::structs::{
    Allocation, Deployment, DeploymentState, Job, Node, TaskGroup, UpdateStrategy,
};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};

/// Why a node is infeasible for a group (for logs and tests).
///
/// `work` is the pass's view of every allocation (the store's plus this plan's placements
/// and stops), from which the node's proposed allocations are taken.
pub fn infeasible_reason(
    st: &State,
    work: &BTreeMap<String, Allocation>,
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
    if let Some(d) = g.Tasks.iter().find(|t| !has_driver(node, &t.Driver)) {
        return Some(format!("missing drivers: {}", d.Driver));
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
            match am.as_str() {
                "single-node-reader-only" if !req.ReadOnly => {
                    return Some(format!("host volume {source} is single-node-reader-only"));
                }
                "single-node-writer" if req.ReadOnly => {
                    return Some(format!(
                        "host volume {source} is single-node-writer, requested read-only"
                    ));
                }
                "single-node-single-writer" => {
                    if let Some(w) = single_writer_on(st, work, job, &vol.Name, node) {
                        return Some(format!(
                            "host volume {source} is single-node-single-writer and allocation {w} writes it on this node"
                        ));
                    }
                }
                _ => {}
            }
        }
    }
    None
}

/// An allocation proposed on `node` whose group writes the dynamic host volume `vol_name`
/// (`scheduler/feasible/feasible.go` `HostVolumeChecker.hostVolumeIsAvailable`, case
/// single-node-single-writer, over `scheduler/feasible/context.go`
/// `EvalContext.ProposedAllocs`): the node's allocations that are not client-terminal,
/// minus those this plan stops for `job`, plus this plan's placements (an allocation stopped by an
/// earlier plan whose tasks still run counts). Each group is read from the job's current
/// version in the state; a job or group that is gone counts as a writer (it cannot be
/// proven not to use the volume). Sources match as `HostVolume.MatchesRequestSource`
/// (`per_alloc` adds the allocation's `[N]`).
fn single_writer_on(
    st: &State,
    work: &BTreeMap<String, Allocation>,
    job: &Job,
    vol_name: &str,
    node: &Node,
) -> Option<String> {
    let mut seen = BTreeSet::new();
    for a in work.values() {
        if a.NodeID != node.ID || a.client_terminal() {
            continue;
        }
        // A pass plans every job; Nomad's plan is one evaluation's, of one job.
        let stopped_by_this_plan = a.server_terminal()
            && a.Namespace == job.Namespace
            && a.JobID == job.ID
            && st
                .allocs
                .get(&a.ID)
                .is_none_or(|before| !before.server_terminal());
        if stopped_by_this_plan {
            continue;
        }
        if !seen.insert((a.Namespace.clone(), a.JobID.clone(), a.TaskGroup.clone())) {
            continue;
        }
        let Some(job) = st.jobs.get(&(a.Namespace.clone(), a.JobID.clone())) else {
            return Some(a.ID.clone());
        };
        let Some(g) = job.TaskGroups.iter().find(|g| g.Name == a.TaskGroup) else {
            return Some(a.ID.clone());
        };
        let writes = g
            .Volumes
            .iter()
            .flat_map(|v| v.values())
            .any(|r| r.Type == "host" && r.source_for(&a.Name) == vol_name && !r.ReadOnly);
        if writes {
            return Some(a.ID.clone());
        }
    }
    None
}

/// Whether `node` offers the task driver `driver` (`scheduler/feasible/feasible.go`
/// `DriverChecker.hasDrivers`): its `Drivers` entry must be detected and healthy; a node
/// without an entry falls back to the attribute `driver.<name>`, read as a Go boolean. A node
/// whose engine did not answer its fingerprint has no `docker` entry and no attribute, so no
/// docker task is placed there (filtered as "missing drivers").
fn has_driver(node: &Node, driver: &str) -> bool {
    if let Some(info) = node.Drivers.get(driver) {
        return info["Detected"] == true && info["Healthy"] == true;
    }
    matches!(
        node.Attributes
            .get(&format!("driver.{driver}"))
            .map(String::as_str),
        Some("1" | "t" | "T" | "TRUE" | "true" | "True")
    )
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

/// Nomad's default dynamic port range (`nomad/structs/network.go` `DefaultMinDynamicPort`,
/// `DefaultMaxDynamicPort`).
const DYNAMIC_PORTS: std::ops::RangeInclusive<u16> = 20000..=32000;

/// The group's network ports as an allocation's `AllocatedResources.Shared.Ports`
/// (`[{Label, Value, To, HostIP}]`, `null` when none): a static port keeps its value, a
/// dynamic one gets a port of [`DYNAMIC_PORTS`] that is free on the host's loopback now
/// (every simulated node shares the host's ports and address 127.0.0.1), as Nomad's
/// `NetworkIndex.AssignPorts` picks one free on the node.
fn allocated_ports(g: &TaskGroup) -> Value {
    let Some(nets) = g.Networks.as_array() else {
        return Value::Null;
    };
    let mut out = Vec::new();
    for n in nets {
        for (kind, ports) in [
            ("ReservedPorts", &n["ReservedPorts"]),
            ("DynamicPorts", &n["DynamicPorts"]),
        ] {
            for p in ports.as_array().into_iter().flatten() {
                let value = if kind == "ReservedPorts" {
                    p["Value"].as_i64().unwrap_or(0)
                } else {
                    free_dynamic_port()
                };
                out.push(json!({"Label": p["Label"], "Value": value,
                    "To": p["To"].as_i64().unwrap_or(0), "HostIP": "127.0.0.1"}));
            }
        }
    }
    if out.is_empty() {
        Value::Null
    } else {
        Value::Array(out)
    }
}

/// A port of [`DYNAMIC_PORTS`] that 127.0.0.1 can bind now (0 if 100 tries found none).
fn free_dynamic_port() -> i64 {
    use rand::Rng as _;
    let mut rng = rand::thread_rng();
    for _ in 0..100 {
        let port = rng.gen_range(DYNAMIC_PORTS);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port as i64;
        }
    }
    0
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
        "Shared": {"Networks": null, "DiskMB": disk, "Ports": allocated_ports(g)}});
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
    /// Deployments created or changed by this pass (written with the plan).
    deployments: BTreeMap<String, Deployment>,
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

    /// The nodes `getSelectOptions` penalises for a replacement of `prev`: the node `prev`
    /// failed on, and the nodes of the allocations it replaced in turn (Nomad's
    /// `RescheduleTracker.Events[].PrevNodeID`).
    fn penalty_nodes(&self, prev: Option<&str>) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        let mut cur = prev.and_then(|p| self.work.get(p));
        if let Some(a) = cur.filter(|a| a.ClientStatus == "failed") {
            out.insert(a.NodeID.clone());
        }
        // The history: every earlier allocation of the chain that failed (and so was
        // rescheduled), each chain walked once.
        let mut seen = BTreeSet::new();
        while let Some(a) = cur {
            if !seen.insert(a.ID.clone()) {
                break;
            }
            cur = self.work.get(&a.PreviousAllocation);
            if let Some(p) = cur.filter(|p| p.ClientStatus == "failed") {
                out.insert(p.NodeID.clone());
            }
        }
        out
    }

    fn place(
        &mut self,
        job: &Job,
        g: &TaskGroup,
        index: u64,
        only_node: Option<&str>,
        prev: Option<&str>,
    ) -> Option<String> {
        let name = format!("{}.{}[{}]", job.ID, g.Name, index);
        let mut candidates: Vec<&Node> = self
            .st
            .nodes
            .values()
            .filter(|n| only_node.is_none_or(|o| o == n.ID))
            .filter(|n| infeasible_reason(self.st, &self.work, job, g, &name, n).is_none())
            .collect();
        let in_pool = self
            .st
            .nodes
            .values()
            .filter(|n| job.NodePool == "all" || n.NodePool == job.NodePool)
            .count();
        if candidates.is_empty() {
            tracing::info!(job = %job.ID, group = %g.Name, alloc = %name, "no feasible node; placement blocked");
            return None;
        }
        // The reschedule penalty (`scheduler/generic_sched.go` `getSelectOptions`,
        // `scheduler/feasible/rank.go` `NodeReschedulingPenaltyIterator.Next`): the node the
        // replaced allocation failed on and every node of its reschedule history (here: its
        // `PreviousAllocation` chain) rank below every other feasible node.
        let penalty = self.penalty_nodes(prev);
        candidates.sort_by_key(|n| {
            (
                penalty.contains(&n.ID),
                self.load.get(&n.ID).copied().unwrap_or(0),
                n.Name.clone(),
            )
        });
        let node = candidates[0];
        let penalised = if penalty.contains(&node.ID) {
            -1.0
        } else {
            0.0
        };
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
                "node-reschedule-penalty": penalised, "node-affinity": 0.0}, "NormScore": score}],
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
        self.touched.insert(id.clone());
        Some(id)
    }
}

impl Pass<'_> {
    /// One group of a job with an update strategy (`scheduler/reconciler/reconcile_cluster.go`
    /// `computeGroup`): creates the job version's deployment when the group has something to
    /// place or replace; places canaries (named after the allocations they will replace) while
    /// the old allocations keep running; once promoted, stops the old allocations that share a
    /// canary's name (`computeStop`); otherwise stops at most `max_parallel` minus the
    /// deployment's not-yet-healthy allocations of the old version (`computeUnderProvisionedBy`,
    /// `computeDestructiveUpdates`), whose indexes the caller then places. Returns the
    /// deployment ID when one runs for this group.
    fn deploy_group(
        &mut self,
        job: &Job,
        g: &TaskGroup,
        u: &UpdateStrategy,
        dep: &mut Option<Deployment>,
        replacements: &mut BTreeMap<String, String>,
    ) -> Option<String> {
        let in_group = |a: &&Allocation| {
            a.Namespace == job.Namespace
                && a.JobID == job.ID
                && a.TaskGroup == g.Name
                && !a.server_terminal()
                && a.ClientStatus != "lost"
        };
        let dep_id = dep.as_ref().map(|d| d.ID.clone()).unwrap_or_default();
        // `cancelUnneededCanaries`: unpromoted canaries of an older deployment, or of a
        // failed one, are stopped.
        let unneeded: Vec<String> = self
            .work
            .values()
            .filter(in_group)
            .filter(|a| a.is_canary())
            .filter(|a| {
                let d = if a.DeploymentID == dep_id {
                    dep.as_ref()
                } else {
                    self.st.deployments.get(&a.DeploymentID)
                };
                let promoted = d
                    .and_then(|d| d.TaskGroups.get(&g.Name))
                    .is_some_and(|s| s.Promoted);
                let current_ok =
                    a.DeploymentID == dep_id && dep.as_ref().is_some_and(|d| d.Status != "failed");
                !promoted && !current_ok
            })
            .map(|a| a.ID.clone())
            .collect();
        for id in unneeded {
            self.stop(&id, "alloc not needed due to job update");
        }
        let canaries: Vec<Allocation> = self
            .work
            .values()
            .filter(in_group)
            .filter(|a| !dep_id.is_empty() && a.DeploymentID == dep_id && a.is_canary())
            .cloned()
            .collect();
        let mut old: Vec<Allocation> = self
            .work
            .values()
            .filter(in_group)
            .filter(|a| a.Job.as_ref().map(|j| j.Version).unwrap_or(0) != job.Version)
            .cloned()
            .collect();
        old.sort_by_key(|a| a.name_index());
        let live_now = self.work.values().filter(in_group).count() as i64;
        let had_running = self.work.values().any(|a| {
            a.Namespace == job.Namespace
                && a.JobID == job.ID
                && a.Job.as_ref().map(|j| j.Version) == Some(job.Version)
        });
        let needs_work = !old.is_empty() || (live_now < g.Count && !had_running);
        if dep.is_none() && needs_work {
            *dep = Some(Deployment {
                ID: uuid::Uuid::new_v4().to_string(),
                Namespace: job.Namespace.clone(),
                JobID: job.ID.clone(),
                JobVersion: job.Version,
                JobModifyIndex: job.ModifyIndex,
                JobSpecModifyIndex: job.JobModifyIndex,
                JobCreateIndex: job.CreateIndex,
                Status: "running".into(),
                StatusDescription: "Deployment is running".into(),
                EvalPriority: job.Priority,
                ..Default::default()
            });
        }
        let d = dep.as_mut()?;
        if !d.active() && !d.TaskGroups.contains_key(&g.Name) {
            return None;
        }
        let mut state = d
            .TaskGroups
            .get(&g.Name)
            .cloned()
            .unwrap_or(DeploymentState {
                AutoRevert: u.auto_revert,
                AutoPromote: u.auto_promote,
                ProgressDeadline: u.progress_deadline,
                DesiredTotal: g.Count,
                ..Default::default()
            });
        let failed = d.Status == "failed";
        let canarying = |s: &DeploymentState| s.DesiredCanaries > 0 && !s.Promoted;
        if !canarying(&state) && !canaries.is_empty() {
            let names: BTreeSet<&str> = canaries.iter().map(|c| c.Name.as_str()).collect();
            old.retain(|o| {
                let replaced = names.contains(o.Name.as_str());
                if replaced {
                    self.stop(&o.ID, "alloc not needed due to job update");
                }
                !replaced
            });
        }
        if d.active()
            && !failed
            && !old.is_empty()
            && (canaries.len() as i64) < u.canary
            && !state.Promoted
        {
            state.DesiredCanaries = u.canary;
            let taken: BTreeSet<String> = canaries.iter().map(|c| c.Name.clone()).collect();
            let want = (u.canary as usize).saturating_sub(canaries.len());
            let names: Vec<u64> = old
                .iter()
                .filter(|o| !taken.contains(&o.Name))
                .map(|o| o.name_index())
                .take(want)
                .collect();
            d.TaskGroups.insert(g.Name.clone(), state.clone());
            for i in names {
                if let Some(id) = self.place(job, g, i, None, None) {
                    self.join_deployment(d, &g.Name, &id, true);
                }
            }
            state = d.TaskGroups[&g.Name].clone();
        }
        if d.active() && !failed && !canarying(&state) && !old.is_empty() {
            let mut limit = u.max_parallel;
            for a in self
                .work
                .values()
                .filter(in_group)
                .filter(|a| a.DeploymentID == d.ID)
            {
                match a.healthy() {
                    Some(false) => limit = 0,
                    Some(true) => {}
                    None => limit -= 1,
                }
            }
            for o in old.iter().take(limit.max(0) as usize) {
                self.stop(&o.ID, "alloc is being updated due to job update");
                replacements.insert(
                    format!("{}\u{0}{}\u{0}{}", o.Namespace, o.JobID, o.Name),
                    o.ID.clone(),
                );
            }
        }
        if d.Status == "running" {
            d.TaskGroups.insert(g.Name.clone(), state);
            d.StatusDescription = d.running_description().into();
        }
        self.deployments.insert(d.ID.clone(), d.clone());
        Some(d.ID.clone())
    }

    /// Marks a new allocation as part of deployment `d` (`DeploymentID`, a canary's
    /// `DeploymentStatus.Canary`) and counts it in the group's state.
    fn join_deployment(&mut self, d: &mut Deployment, group: &str, id: &str, canary: bool) {
        if !d.active() {
            return;
        }
        if let Some(a) = self.work.get_mut(id) {
            a.DeploymentID = d.ID.clone();
            if canary {
                a.DeploymentStatus =
                    Some(json!({"Healthy": null, "Timestamp": "0001-01-01T00:00:00Z",
                    "Canary": true, "ModifyIndex": 0}));
            }
        }
        let s = d.TaskGroups.entry(group.to_string()).or_default();
        s.PlacedAllocs += 1;
        if s.RequireProgressBy.is_none() && s.ProgressDeadline > 0 {
            s.RequireProgressBy = Some(crate::clock::rfc3339_nano(
                now_ns().saturating_add(s.ProgressDeadline),
            ));
        }
        if canary {
            s.PlacedCanaries
                .get_or_insert_with(Vec::new)
                .push(id.to_string());
        }
        self.deployments.insert(d.ID.clone(), d.clone());
    }
}

/// `Allocation.AppendState` for the client status.
fn append_alloc_state(a: &mut Allocation, status: &str, now: i64) {
    let entry = json!({"Field": "ClientStatus", "Value": status,
        "Time": crate::clock::rfc3339_nano(now)});
    match a.AllocStates.as_mut().and_then(Value::as_array_mut) {
        Some(list) => list.push(entry),
        None => a.AllocStates = Some(json!([entry])),
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
        deployments: BTreeMap::new(),
    };
    let now = now_ns();
    let group_of = |a: &Allocation| a.Job.as_ref().and_then(|j| j.group(&a.TaskGroup)).cloned();
    // Allocations on a disconnected node whose group has `disconnect.lost_after` turn
    // `unknown` (still desired to run) and are replaced unless `replace = false`
    // (`computeDisconnecting`, `appendUnknownDisconnectingUpdates`); once the window has
    // passed (`Allocation.Expired`), or on a down node, they are lost.
    let mut replacements: BTreeMap<String, String> = BTreeMap::new(); // alloc name → previous alloc
    let on_unresponsive: Vec<(String, bool)> = pass
        .work
        .values()
        .filter(|a| !a.terminal())
        .filter_map(|a| {
            let status = pass.st.nodes.get(&a.NodeID).map(|n| n.Status.as_str());
            match status {
                None | Some("down") => Some((a.ID.clone(), false)),
                Some("disconnected") => Some((a.ID.clone(), true)),
                _ => None,
            }
        })
        .collect();
    for (id, disconnected) in on_unresponsive {
        let Some(a) = pass.work.get(&id).cloned() else {
            continue;
        };
        let lost_after = group_of(&a).map(|g| g.lost_after()).unwrap_or(0);
        let key = format!("{}\u{0}{}\u{0}{}", a.Namespace, a.JobID, a.Name);
        if disconnected && lost_after > 0 {
            let since = a.unknown_since.unwrap_or(now);
            if now < since.saturating_add(lost_after) {
                if a.ClientStatus != "unknown" {
                    if let Some(w) = pass.work.get_mut(&id) {
                        w.ClientStatus = "unknown".into();
                        w.ClientDescription =
                            "alloc is unknown since its node is disconnected".into();
                        w.unknown_since = Some(now);
                        append_alloc_state(w, "unknown", now);
                    }
                    pass.touched.insert(id.clone());
                }
                if group_of(&a).is_some_and(|g| g.replace_on_disconnect()) {
                    replacements.insert(key, id.clone());
                }
                continue;
            }
        }
        pass.stop(&id, "alloc is lost since its node is down");
        replacements.insert(key, id.clone());
        if let Some(a) = pass.work.get_mut(&id) {
            a.ClientStatus = "lost".into();
            a.ClientDescription = "alloc is lost since its node is down".into();
        }
    }
    // Reconnected allocations (`reconcileReconnecting`): a failed one is replaced, one of an
    // older version stops; otherwise the original and its replacement are compared by the
    // group's `disconnect.reconcile` (`reconnecting_picker.go`) and the other one stops.
    let reconnected: Vec<String> = pass
        .work
        .values()
        .filter(|a| a.unknown_since.is_some() && a.ClientStatus != "unknown")
        .filter(|a| {
            pass.st
                .nodes
                .get(&a.NodeID)
                .is_some_and(|n| n.Status == "ready")
        })
        .map(|a| a.ID.clone())
        .collect();
    for id in reconnected {
        let Some(orig) = pass.work.get(&id).cloned() else {
            continue;
        };
        if let Some(w) = pass.work.get_mut(&id) {
            w.unknown_since = None;
            let status = w.ClientStatus.clone();
            append_alloc_state(w, &status, now);
        }
        pass.touched.insert(id.clone());
        if orig.server_terminal() {
            continue;
        }
        let job_now = pass
            .st
            .jobs
            .get(&(orig.Namespace.clone(), orig.JobID.clone()));
        let older =
            job_now.is_some_and(|j| orig.Job.as_ref().is_some_and(|oj| oj.Version < j.Version));
        if orig.ClientStatus == "failed" {
            pass.stop(&id, "alloc was rescheduled because it failed");
            continue;
        }
        if older {
            pass.stop(&id, "alloc not needed due to job update");
            continue;
        }
        let mut next = orig.NextAllocation.clone();
        let mut chain = Vec::new();
        while let Some(r) = pass.work.get(&next) {
            chain.push(r.ID.clone());
            next = r.NextAllocation.clone();
        }
        let strategy = group_of(&orig)
            .map(|g| g.reconcile_on_reconnect().to_string())
            .unwrap_or_default();
        for rid in chain {
            let Some(rep) = pass.work.get(&rid).cloned() else {
                continue;
            };
            if rep.server_terminal() {
                continue;
            }
            let keep_replacement = match strategy.as_str() {
                "keep_replacement" => true,
                "keep_original" => false,
                // best_score / longest_running: the sim scores every node alike, so the
                // replacement never scores better; the original started first.
                _ => orig.ClientStatus != "running" && rep.ClientStatus == "running",
            };
            if keep_replacement {
                pass.stop(&id, "alloc not needed due to job update");
            } else {
                pass.stop(
                    &rid,
                    "alloc not needed due to disconnected client reconnect",
                );
            }
        }
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
        // node → the system allocation this pass stops there for a new version.
        let mut system_replaces: BTreeMap<String, String> = BTreeMap::new();
        let job_allocs: Vec<Allocation> = pass
            .work
            .values()
            .filter(|a| a.Namespace == job.Namespace && a.JobID == job.ID)
            .cloned()
            .collect();
        // `cancelUnneededServiceDeployments`: an active deployment of a stopped job or of an
        // older version is cancelled.
        let mut dep = pass.st.latest_deployment(&job.Namespace, &job.ID).cloned();
        if let Some(d) = dep.clone() {
            if job.Stop || d.JobVersion != job.Version {
                if d.active() {
                    let mut d = d;
                    d.Status = "cancelled".into();
                    d.StatusDescription = if job.Stop {
                        "Cancelled because job is stopped".into()
                    } else {
                        "Cancelled due to newer version of job".into()
                    };
                    pass.deployments.insert(d.ID.clone(), d);
                }
                dep = None;
            }
        }
        if job.Stop {
            for a in job_allocs.iter().filter(|a| !a.server_terminal()) {
                pass.stop(&a.ID, "alloc not needed due to job update");
            }
            continue;
        }
        let strategy = |g: &TaskGroup| {
            (job.Type == "service")
                .then(|| UpdateStrategy::of(&g.Update))
                .flatten()
        };
        // A system job's rolling update (Nomad 1.10 `scheduler_system.go` `computeJobAllocs`):
        // with the job's `update` block rolling (`UpdateStrategy.Rolling`: stagger and
        // max_parallel both set), an evaluation replaces at most `max_parallel` allocations of
        // an older version (`evictAndPlace`) and, the limit reached, leaves the rest to a
        // follow-up evaluation `stagger` later (`Evaluation.NextRollingEval`). Here: a batch
        // `stagger` after the previous one, whose time is the newest replacement's.
        let rolling = (job.Type == "system")
            .then(|| {
                let n = |k: &str| job.Update.get(k).and_then(Value::as_i64).unwrap_or(0);
                (n("Stagger") > 0 && n("MaxParallel") > 0).then(|| (n("MaxParallel"), n("Stagger")))
            })
            .flatten();
        let mut system_limit = rolling.map(|(max_parallel, stagger)| {
            let last_batch = job_allocs
                .iter()
                .filter(|a| a.Job.as_ref().map(|j| j.Version) == Some(job.Version))
                .filter(|a| !a.PreviousAllocation.is_empty())
                .map(|a| a.CreateTime)
                .max();
            match last_batch {
                Some(t) if now < t.saturating_add(stagger) => 0,
                _ => max_parallel,
            }
        });
        let mut outdated: Vec<&Allocation> =
            job_allocs.iter().filter(|a| !a.server_terminal()).collect();
        // Nodes in name order: the order the batches take.
        outdated.sort_by_key(|a| {
            pass.st
                .nodes
                .get(&a.NodeID)
                .map(|n| n.Name.clone())
                .unwrap_or_default()
        });
        for a in outdated {
            let version = a.Job.as_ref().map(|j| j.Version).unwrap_or(0);
            match job.group(&a.TaskGroup) {
                None => pass.stop(&a.ID, "alloc not needed due to job update"),
                Some(g) if job.Type != "system" && a.name_index() >= g.Count as u64 => {
                    pass.stop(&a.ID, "alloc not needed due to job update")
                }
                // Groups with an update strategy are updated by their deployment below.
                Some(g) if version != job.Version && strategy(g).is_none() => {
                    match system_limit.as_mut() {
                        Some(0) => continue,
                        Some(n) => *n -= 1,
                        None => {}
                    }
                    pass.stop(&a.ID, "alloc is being updated due to job update");
                    if job.Type == "system" {
                        system_replaces.insert(a.NodeID.clone(), a.ID.clone());
                    }
                }
                _ => {}
            }
        }
        for g in &job.TaskGroups {
            let deploying = strategy(g)
                .map(|u| pass.deploy_group(job, g, &u, &mut dep, &mut replacements))
                .is_some();
            let live = |work: &BTreeMap<String, Allocation>, pred: &dyn Fn(&Allocation) -> bool| {
                work.values()
                    .filter(|a| {
                        a.Namespace == job.Namespace && a.JobID == job.ID && a.TaskGroup == g.Name
                    })
                    .filter(|a| !a.server_terminal() && a.ClientStatus != "lost")
                    // An `unknown` allocation is replaced unless its group says otherwise.
                    .filter(|a| a.ClientStatus != "unknown" || !g.replace_on_disconnect())
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
                    if infeasible_reason(pass.st, &pass.work, job, g, &name, node).is_none() {
                        // A replacement records the allocation it replaces
                        // (`computePlacements`: `PreviousAllocation`).
                        let prev = system_replaces.get(&nid).map(String::as_str);
                        pass.place(job, g, 0, Some(&nid), prev);
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
                if let Some(id) = pass.place(job, g, i, None, prev.as_deref()) {
                    if let Some(f) = failed_prev {
                        pass.stop(&f, "alloc was rescheduled because it failed");
                    }
                    if let Some(d) = dep.as_mut().filter(|_| deploying) {
                        pass.join_deployment(d, &g.Name, &id, false);
                    }
                }
            }
        }
    }
    let stored = &pass.st.deployments;
    pass.deployments.retain(|id, d| stored.get(id) != Some(d));
    if pass.touched.is_empty() && pass.deployments.is_empty() {
        return;
    }
    let Pass {
        work,
        touched,
        deployments,
        ..
    } = pass;
    let idx = st.next_index();
    let now = now_ns();
    for (id, mut d) in deployments {
        if d.CreateIndex == 0 {
            d.CreateIndex = idx;
            d.CreateTime = now;
        }
        d.ModifyIndex = idx;
        d.ModifyTime = now;
        st.deployments.insert(id, d.clone());
        st.tables.deployments = idx;
        // Written with the plan (`ApplyPlanResultsRequestType`).
        st.emit_deployment("PlanResult", &d);
    }
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
