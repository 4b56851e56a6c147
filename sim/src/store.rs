//! The server's state store: tables, the global index, event publication and blocking-query waits.
//!
//! Every mutation takes one new index (like one raft apply), writes objects with it and publishes
//! one frame with the events Nomad's FSM would emit for that message type (`nomad/state/events.go`).

use crate::broker::{Dropped, SubscriptionFilter};
use crate::clock::now_ns;
use crate::identity::Keyring;
use crate::state::{State, TableIndex};
use crate::structs::{
    Allocation, ClientHostVolumeConfig, Frame, HostVolume, HostVolumeCapability, Job, Node,
    TaskState, Variable,
};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;

/// Errors of store operations, mapped to HTTP statuses by the API.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// 404 with this text.
    #[error("{0}")]
    NotFound(String),
    /// 400 with this text.
    #[error("{0}")]
    BadRequest(String),
    /// 409 with this JSON body.
    #[error("conflict")]
    Conflict(Value, u64),
    /// 409 with this text (a held lock: `errVarIsLocked`-class errors).
    #[error("{0}")]
    Locked(String),
    /// 403 "Permission denied".
    #[error("Permission denied")]
    Forbidden,
    /// 500 with this text.
    #[error("{0}")]
    Internal(String),
}

/// A client-side update of one allocation (`Node.UpdateAlloc`).
#[derive(Debug, Clone)]
pub struct ClientAllocUpdate {
    /// Alloc ID.
    pub id: String,
    /// Reporting node.
    pub node_id: String,
    /// Computed ClientStatus.
    pub client_status: String,
    /// Description.
    pub client_description: String,
    /// Task states.
    pub task_states: BTreeMap<String, TaskState>,
}

/// The shared server.
pub struct Server {
    state: Mutex<State>,
    index_tx: watch::Sender<u64>,
    /// Region.
    pub region: String,
    /// Keyring for workload identities.
    pub keyring: Arc<Keyring>,
    /// Bumped to close every open event stream (sim faults).
    pub stream_close: watch::Sender<u64>,
    /// `alloc restart` requests, read by the client running the alloc.
    pub restart_tx: tokio::sync::broadcast::Sender<crate::restart::RestartRequest>,
    /// Nodes whose client agent is restarting (sim only, [`crate::nodes::restart_client`]):
    /// their HTTP listener and Task API sockets are away until they leave the set.
    pub restarting: watch::Sender<std::collections::BTreeSet<String>>,
    /// A node's client agent came back from a restart: its alloc runners run the prestart
    /// hooks of their restored tasks again (`volume_hook.go` `validateHostVolumes`).
    pub restored_tx: tokio::sync::broadcast::Sender<String>,
    /// Requests and response bytes per endpoint over every listener (`crate::counters`).
    pub counters: crate::counters::Counters,
}

impl Server {
    /// A new empty server.
    pub fn new(
        region: &str,
        buffer: usize,
        keyring: Arc<Keyring>,
        acl: crate::policy::AclState,
    ) -> Arc<Self> {
        let (index_tx, _) = watch::channel(1);
        Arc::new(Server {
            state: Mutex::new(State::new(region, buffer, keyring.clone(), acl)),
            index_tx,
            region: region.into(),
            keyring,
            stream_close: watch::channel(0).0,
            restart_tx: tokio::sync::broadcast::channel(64).0,
            restarting: watch::channel(Default::default()).0,
            restored_tx: tokio::sync::broadcast::channel(64).0,
            counters: crate::counters::Counters::default(),
        })
    }

    /// Locks the state for reading.
    pub fn read(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs a mutation, then publishes its events and wakes waiters.
    pub fn write<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let (r, idx) = {
            let mut st = self.read();
            let r = f(&mut st);
            st.flush_events();
            (r, st.index)
        };
        self.index_tx.send_replace(idx);
        r
    }

    /// Latest index.
    pub fn index(&self) -> u64 {
        *self.index_tx.borrow()
    }

    /// Receiver that changes on every write.
    pub fn subscribe_index(&self) -> watch::Receiver<u64> {
        self.index_tx.subscribe()
    }

    /// Blocking-query wait: returns once `table(state) > min_index` or `wait` elapses.
    pub async fn block_until(&self, min_index: u64, wait: Duration, table: fn(&TableIndex) -> u64) {
        self.block_until_with(min_index, wait, |s| table(&s.tables))
            .await
    }

    /// Blocking-query wait on a computed index: returns once `index(state) > min_index` or
    /// `wait` elapses; every other write re-runs `index` and blocks again (`blockingRPC`).
    pub async fn block_until_with(
        &self,
        min_index: u64,
        wait: Duration,
        index: impl Fn(&State) -> u64,
    ) {
        let mut rx = self.subscribe_index();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if index(&self.read()) > min_index {
                return;
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                return;
            }
        }
    }

    // ---------------------------------------------------------------- event stream

    /// Starts a subscription: (cursor, filter with `*` namespaces expanded now).
    pub fn subscribe_events(
        &self,
        index: u64,
        topics: BTreeMap<String, Vec<String>>,
        namespace: &str,
    ) -> (u64, SubscriptionFilter) {
        let st = self.read();
        let namespaces = if namespace == "*" {
            st.namespaces.clone()
        } else {
            [namespace.to_string()].into()
        };
        let cursor = st.broker.start_cursor(index, st.index);
        (cursor, SubscriptionFilter { topics, namespaces })
    }

    /// Frames at or after `cursor`.
    pub fn frames_from(&self, cursor: u64) -> Result<Vec<Arc<Frame>>, Dropped> {
        self.read().broker.frames_from(cursor)
    }

    // ---------------------------------------------------------------- nodes

    /// Registers a node (NodeRegistration).
    pub fn register_node(&self, mut node: Node) {
        self.write(|st| {
            let idx = st.next_index();
            node.CreateIndex = idx;
            node.ModifyIndex = idx;
            node.StatusUpdatedAt = crate::clock::now_secs();
            let id = node.ID.clone();
            st.nodes.insert(id.clone(), node);
            st.tables.nodes = idx;
            st.emit_node("NodeRegistration", &id);
        });
        self.reschedule_all();
    }

    /// Snapshot of a node.
    pub fn node(&self, id: &str) -> Option<Node> {
        self.read().nodes.get(id).cloned()
    }

    /// Allocations placed on a node (full, with Job).
    pub fn node_allocs(&self, node_id: &str) -> Vec<Allocation> {
        self.read()
            .allocs
            .values()
            .filter(|a| a.NodeID == node_id)
            .cloned()
            .collect()
    }

    /// Client status update (`Node.UpdateAlloc` → AllocationUpdated), one index for the batch.
    ///
    /// Refused (`Err` with the updates back, nothing written) while the reporting node is
    /// `down` or `disconnected` (`nomad/node_endpoint.go` `UpdateAlloc`: "node %s is not allowed
    /// to update allocs while in status %s"); the client keeps them for its next sync. Accepted
    /// updates copy the client's status whatever the server had (`nestedUpdateAllocFromClient`):
    /// a returning node turns its `lost` allocations `complete` once their tasks are killed.
    pub fn update_allocs_from_client(
        &self,
        updates: Vec<ClientAllocUpdate>,
    ) -> Result<(), Vec<ClientAllocUpdate>> {
        if updates.is_empty() {
            return Ok(());
        }
        let unresponsive = {
            let st = self.read();
            updates.iter().any(|u| {
                st.nodes
                    .get(&u.node_id)
                    .is_some_and(|n| matches!(n.Status.as_str(), "down" | "disconnected"))
            })
        };
        if unresponsive {
            return Err(updates);
        }
        let mut any_failed = false;
        self.write(|st| {
            let idx = st.next_index();
            let now = now_ns();
            let mut jobs = BTreeSet::new();
            for u in updates {
                let Some(a) = st.allocs.get_mut(&u.id) else {
                    continue;
                };
                a.ClientStatus = u.client_status;
                a.ClientDescription = u.client_description;
                a.TaskStates = u.task_states;
                a.NetworkStatus = Some(json!({"InterfaceName":"","Address":"","DNS":null}));
                a.ModifyIndex = idx;
                a.ModifyTime = now;
                if a.ClientStatus == "failed" {
                    any_failed = true;
                }
                let a = a.clone();
                jobs.insert((a.Namespace.clone(), a.JobID.clone()));
                st.emit_alloc("AllocationUpdated", &a);
            }
            st.tables.allocs = idx;
            for (ns, id) in jobs {
                st.refresh_job_status(&ns, &id, "AllocationUpdated");
            }
        });
        if any_failed {
            self.reschedule_all();
        }
        Ok(())
    }

    /// Runs the scheduler for every job (blocked evaluations are retried this way).
    pub fn reschedule_all(&self) {
        self.write(crate::scheduler::reconcile_all);
    }

    // ---------------------------------------------------------- namespaces

    /// `Namespace.UpsertNamespaces`: creates a namespace (the sim keeps names only). A name
    /// outside `^[a-zA-Z0-9-]{1,128}$` → 500 (`Namespace.Validate`, an uncoded multierror).
    pub fn upsert_namespace(&self, name: &str) -> Result<u64, StoreError> {
        let valid = !name.is_empty()
            && name.len() <= 128
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !valid {
            return Err(StoreError::Internal(format!(
                "1 error occurred:\n\t* invalid name {name:?}. Must match regex ^[a-zA-Z0-9-]{{1,128}}$\n\n"
            )));
        }
        Ok(self.write(|st| {
            let idx = st.next_index();
            st.namespaces.insert(name.to_string());
            idx
        }))
    }

    // ---------------------------------------------------------------- jobs

    /// Registers a job (JobRegistered), then schedules it (PlanResult).
    pub fn register_job(&self, mut job: Job) -> Result<(String, u64, u64), StoreError> {
        job.canonicalize(&self.region);
        validate_job(&job)?;
        let eval_id = uuid::Uuid::new_v4().to_string();
        let (job_modify_index, idx) = self.write(|st| {
            // `upsertJobImpl` (nomad/state/state_store.go): an uncoded error, HTTP 500.
            if !st.namespaces.contains(&job.Namespace) {
                return Err(StoreError::Internal(format!(
                    "job {:?} is in nonexistent namespace {:?}",
                    job.ID, job.Namespace
                )));
            }
            let key = (job.Namespace.clone(), job.ID.clone());
            let idx = st.next_index();
            let now = now_ns();
            match st.jobs.get(&key) {
                Some(old) if old.same_spec(&job) && !old.Stop => {
                    job = old.clone();
                }
                Some(old) => {
                    job.Version = old.Version + 1;
                    job.CreateIndex = old.CreateIndex;
                    job.ModifyIndex = idx;
                    job.JobModifyIndex = idx;
                    job.SubmitTime = now;
                    job.Status = "pending".into();
                }
                None => {
                    job.CreateIndex = idx;
                    job.ModifyIndex = idx;
                    job.JobModifyIndex = idx;
                    job.SubmitTime = now;
                    job.Status = "pending".into();
                }
            }
            st.jobs.insert(key, job.clone());
            st.tables.jobs = idx;
            st.emit_job("JobRegistered", &job, false);
            let eval = eval_json(&eval_id, &job, "job-register", idx, now);
            st.evals.insert(eval_id.clone(), eval.clone());
            st.tables.evals = idx;
            st.emit(
                "Evaluation",
                "JobRegistered",
                &eval_id,
                &job.Namespace,
                Some(vec![job.ID.clone()]),
                json!({ "Evaluation": eval }),
            );
            Ok((job.JobModifyIndex, idx))
        })?;
        self.reschedule_all();
        Ok((eval_id, job_modify_index, idx))
    }

    /// Deregisters a job: stop (Job.Stop = true: the scheduler then stops the allocations,
    /// PlanResult "alloc not needed due to job update") or purge (`nomad/fsm.go`
    /// `handleJobDeregister` → `nomad/state/state_store.go` `DeleteJobTxn`): the job, its
    /// deployments and, through `deleteAllocsForJobTxn`, every allocation of the job, running
    /// ones included, are deleted in the same write. An allocation deletion publishes no
    /// event (the `Deleted()` branch of `eventFromChange` has no allocs case); the allocs
    /// table index rises, no allocation's ModifyIndex does. The clients kill the deleted
    /// allocations' tasks when they see them gone.
    pub fn deregister_job(
        &self,
        ns: &str,
        id: &str,
        purge: bool,
    ) -> Result<(String, u64, u64), StoreError> {
        let eval_id = uuid::Uuid::new_v4().to_string();
        let key = (ns.to_string(), id.to_string());
        let r = self.write(|st| {
            let Some(mut job) = st.jobs.get(&key).cloned() else {
                return Err(StoreError::NotFound("job not found".into()));
            };
            let idx = st.next_index();
            let now = now_ns();
            if purge {
                st.jobs.remove(&key);
                job.Status = "dead".into();
                st.emit_job("JobDeregistered", &job, true);
                st.allocs
                    .retain(|_, a| !(a.Namespace == job.Namespace && a.JobID == job.ID));
                st.tables.allocs = idx;
                let before = st.deployments.len();
                st.deployments
                    .retain(|_, d| !(d.Namespace == job.Namespace && d.JobID == job.ID));
                if st.deployments.len() != before {
                    st.tables.deployments = idx;
                }
            } else {
                job.Stop = true;
                job.Version += 1;
                job.ModifyIndex = idx;
                job.JobModifyIndex = idx;
                job.SubmitTime = now;
                st.jobs.insert(key.clone(), job.clone());
                st.emit_job("JobDeregistered", &job, false);
            }
            st.tables.jobs = idx;
            let eval = eval_json(&eval_id, &job, "job-deregister", idx, now);
            st.evals.insert(eval_id.clone(), eval.clone());
            st.tables.evals = idx;
            st.emit(
                "Evaluation",
                "JobDeregistered",
                &eval_id,
                ns,
                Some(vec![id.to_string()]),
                json!({ "Evaluation": eval }),
            );
            Ok((job.JobModifyIndex, idx))
        })?;
        self.reschedule_all();
        Ok((eval_id, r.0, r.1))
    }

    // ---------------------------------------------------------------- allocations

    /// Sets a desired transition (`nomad alloc stop` → Migrate; AllocationUpdateDesiredStatus).
    pub fn stop_alloc(&self, alloc_id: &str) -> Result<(String, u64), StoreError> {
        let eval_id = uuid::Uuid::new_v4().to_string();
        let idx = self.write(|st| {
            let Some(a) = st.allocs.get_mut(alloc_id) else {
                return Err(StoreError::NotFound("alloc not found".into()));
            };
            let idx = st.index + 1;
            a.DesiredTransition.Migrate = Some(true);
            a.ModifyIndex = idx;
            a.AllocModifyIndex = idx;
            a.ModifyTime = now_ns();
            let a = a.clone();
            st.next_index();
            st.tables.allocs = idx;
            st.emit_alloc("AllocationUpdateDesiredStatus", &a);
            Ok(idx)
        })?;
        self.reschedule_all();
        Ok((eval_id, idx))
    }

    /// Forced garbage collection (`PUT /v1/system/gc` → `CoreScheduler` with force,
    /// `nomad/core_sched.go`): jobs whose status is dead (stopped, or batch finished) are reaped
    /// with their allocations (`jobGC` → JobBatchDeregister: a Job event `JobBatchDeregistered`
    /// with `Deleted`); then every other allocation `allocGCEligible` accepts (terminal, not
    /// running on the client, and job gone/stopped/dead, or DesiredStatus stop, or not failed; a
    /// failed alloc still wanting to run waits for its reschedule) is deleted. Allocation
    /// deletions publish no events (the `Deleted()` branch of `eventFromChange` has no allocs
    /// case); blocking queries wake. Returns (allocs deleted, index).
    pub fn gc(&self) -> (usize, u64) {
        self.write(|st| {
            let dead_jobs: Vec<(String, String)> = st
                .jobs
                .keys()
                .filter(|(ns, id)| st.job_status(ns, id) == "dead")
                .cloned()
                .collect();
            let eligible: Vec<String> = st
                .allocs
                .values()
                .filter(|a| {
                    let key = (a.Namespace.clone(), a.JobID.clone());
                    if dead_jobs.contains(&key) {
                        return true;
                    }
                    if !a.terminal() || a.ClientStatus == "running" {
                        return false;
                    }
                    let Some(job) = st.jobs.get(&key).filter(|j| !j.Stop) else {
                        return true;
                    };
                    // A failed allocation waits for its reschedule unless the group's policy
                    // allows none, or the reschedule already happened.
                    let no_reschedule = job.group(&a.TaskGroup).is_none_or(|g| {
                        g.ReschedulePolicy
                            .as_ref()
                            .is_none_or(|p| !p.Unlimited && p.Attempts == 0)
                    });
                    a.DesiredStatus == "stop"
                        || a.ClientStatus != "failed"
                        || no_reschedule
                        || !a.NextAllocation.is_empty()
                })
                .map(|a| a.ID.clone())
                .collect();
            if eligible.is_empty() && dead_jobs.is_empty() {
                return (0, st.index);
            }
            let idx = st.next_index();
            for id in &eligible {
                st.allocs.remove(id);
            }
            st.tables.allocs = idx;
            for key in &dead_jobs {
                if let Some(mut job) = st.jobs.remove(key) {
                    job.Status = "dead".into();
                    st.emit_job("JobBatchDeregistered", &job, true);
                }
            }
            if !dead_jobs.is_empty() {
                st.tables.jobs = idx;
            }
            (eligible.len(), idx)
        })
    }

    // ---------------------------------------------------------------- host volumes

    /// `HostVolume.Register`: the node's client stats the path, then the volume is written
    /// pending (HostVolumeRegistered) and the node fingerprint makes it ready (NodeRegistration).
    pub fn register_host_volume(&self, mut v: HostVolume) -> Result<HostVolume, StoreError> {
        if v.Namespace.is_empty() {
            v.Namespace = "default".into();
        }
        // `HostVolume.Register` (nomad/host_volume_endpoint.go): node ID, then host path,
        // then `HostVolume.Validate` (nomad/structs/host_volumes.go); all uncoded: HTTP 500.
        if v.NodeID.is_empty() {
            return Err(StoreError::Internal(
                "cannot register volume: node ID is required".into(),
            ));
        }
        if v.HostPath.is_empty() {
            return Err(StoreError::Internal(
                "cannot register volume: host path is required".into(),
            ));
        }
        if !v.ID.is_empty() && uuid::Uuid::try_parse(&v.ID).is_err() {
            return Err(StoreError::Internal(format!(
                "volume validation failed: invalid ID {:?}",
                v.ID
            )));
        }
        if v.Name.is_empty() {
            return Err(StoreError::Internal(
                "volume validation failed: missing name".into(),
            ));
        }
        self.validate_volume_update(&v)?;
        if v.ID.is_empty() {
            v.ID = uuid::Uuid::new_v4().to_string();
        }
        // `CanonicalizeForRegister` (nomad/structs/host_volumes.go): a registered volume
        // keeps the PluginID it was sent with (none for a volume made outside Nomad); an
        // update without one keeps the existing volume's.
        if v.PluginID.is_empty() {
            if let Some(old) = self.host_volume(&v.Namespace, &v.ID) {
                v.PluginID = old.PluginID;
            }
        }
        if v.RequestedCapabilities.is_empty() {
            v.RequestedCapabilities = vec![HostVolumeCapability {
                AttachmentMode: "file-system".into(),
                AccessMode: "single-node-writer".into(),
            }];
        }
        // `validateVolumeForState`: uncoded, HTTP 500, with the (new) volume ID.
        let node = self.node(&v.NodeID).ok_or_else(|| {
            StoreError::Internal(format!(
                "validating volume {:?} against state failed: node {:?} does not exist",
                v.ID, v.NodeID
            ))
        })?;
        // `registerVolume` asks the node's client (`ClientHostVolume.Register`); with no
        // connection to it (down, disconnected, silent) `findNodeConnAndForward` answers
        // `structs.ErrNoNodeConn` (nomad/client_rpc.go): HTTP 500 "No path to node".
        if !self.node_connected(&node.ID) {
            return Err(StoreError::Internal("No path to node".into()));
        }
        if let Some(existing) = node.HostVolumes.get(&v.Name) {
            if !existing.ID.is_empty() && existing.ID != v.ID {
                return Err(StoreError::BadRequest(format!(
                    "rpc error: volume name already exists on this node: {}",
                    v.Name
                )));
            }
        }
        if !std::path::Path::new(&v.HostPath).exists() {
            return Err(StoreError::BadRequest(format!(
                "rpc error: stat {}: no such file or directory",
                v.HostPath
            )));
        }
        v.NodePool = node.NodePool.clone();
        let registered = self.write(|st| {
            // `validateVolumeUpdate` (nomad/host_volume_endpoint.go): uncoded, HTTP 500.
            if !st.namespaces.contains(&v.Namespace) {
                return Err(StoreError::Internal(format!(
                    "volume validation failed: no such namespace {:?}",
                    v.Namespace
                )));
            }
            let key = (v.Namespace.clone(), v.ID.clone());
            if let Some(old) = st.host_volumes.get(&key) {
                if old.NodeID != v.NodeID {
                    return Err(StoreError::BadRequest(
                        "host volume cannot change node ID".into(),
                    ));
                }
                v.CreateIndex = old.CreateIndex;
                v.CreateTime = old.CreateTime;
            }
            let idx = st.next_index();
            let now = now_ns();
            if v.CreateIndex == 0 {
                v.CreateIndex = idx;
                v.CreateTime = now;
            }
            v.ModifyIndex = idx;
            v.ModifyTime = now;
            v.State = "pending".into();
            v.Allocations = None;
            st.host_volumes.insert(key, v.clone());
            st.tables.host_volumes = idx;
            st.emit_volume("HostVolumeRegistered", &v, false);
            Ok(v.clone())
        })?;
        // Client fingerprint: node.HostVolumes gains the entry, the volume turns ready.
        self.write(|st| {
            let idx = st.next_index();
            let now = now_ns();
            if let Some(n) = st.nodes.get_mut(&registered.NodeID) {
                n.HostVolumes.insert(
                    registered.Name.clone(),
                    ClientHostVolumeConfig {
                        Name: registered.Name.clone(),
                        Path: registered.HostPath.clone(),
                        ReadOnly: false,
                        ID: registered.ID.clone(),
                    },
                );
                n.ModifyIndex = idx;
            }
            st.tables.nodes = idx;
            st.emit_node("NodeRegistration", &registered.NodeID);
            let key = (registered.Namespace.clone(), registered.ID.clone());
            let node_ready = st
                .nodes
                .get(&registered.NodeID)
                .is_some_and(|n| n.Status == "ready");
            let state = if node_ready { "ready" } else { "unavailable" };
            st.set_host_volume_state(&key, state, idx, now);
        });
        self.reschedule_all();
        Ok(registered)
    }

    /// `validateVolumeUpdate` (nomad/host_volume_endpoint.go), before the client is asked:
    /// a volume registered with an ID must exist ("cannot update volume %q: volume does not
    /// exist"), and `HostVolume.ValidateUpdate` (nomad/structs/host_volumes.go) refuses an
    /// update of a volume that allocations not client-terminal claim ("cannot update a
    /// volume in use: claimed by allocs (…)"). Plain errors: HTTP 500.
    fn validate_volume_update(&self, v: &HostVolume) -> Result<(), StoreError> {
        if v.ID.is_empty() {
            return Ok(());
        }
        let Some(existing) = self.host_volume(&v.Namespace, &v.ID) else {
            return Err(StoreError::Internal(format!(
                "cannot update volume {:?}: volume does not exist",
                v.ID
            )));
        };
        let users: Vec<String> = existing
            .Allocations
            .iter()
            .flatten()
            .filter_map(|a| a["ID"].as_str().map(String::from))
            .collect();
        if !users.is_empty() {
            return Err(StoreError::Internal(format!(
                "validating volume {:?} update failed: cannot update a volume in use: claimed by allocs ({})",
                v.ID,
                users.join(", ")
            )));
        }
        Ok(())
    }

    /// Host volume with denormalized non-terminal `Allocations` stubs.
    pub fn host_volume(&self, ns: &str, id: &str) -> Option<HostVolume> {
        let st = self.read();
        let mut v = st
            .host_volumes
            .get(&(ns.to_string(), id.to_string()))?
            .clone();
        let allocs: Vec<Value> = st
            .allocs
            .values()
            .filter(|a| alloc_uses_volume(a, &v))
            .map(|a| a.stub())
            .collect();
        if !allocs.is_empty() {
            v.Allocations = Some(allocs);
        }
        Some(v)
    }

    /// Whether the servers have a connection to the node's client: it exists, is neither
    /// `down` nor `disconnected`, and heartbeats (not partitioned, not restarting).
    pub fn node_connected(&self, node_id: &str) -> bool {
        let st = self.read();
        st.nodes
            .get(node_id)
            .is_some_and(|n| !matches!(n.Status.as_str(), "down" | "disconnected"))
            && !st.heartbeat_stopped(node_id)
    }

    /// Deletes a host volume (refused while claimed by non-terminal allocs). The node's
    /// client is asked first (`deleteVolume`); when the servers have no connection to it
    /// (`IsErrUnknownNode`, `IsErrNoNodeConn`) the delete is refused unless `force`
    /// ("volume cannot be removed from unknown node without force=true", HTTP 500), and
    /// with `force` the volume is removed from the state only
    /// (nomad/host_volume_endpoint.go `Delete`).
    pub fn delete_host_volume(&self, ns: &str, id: &str, force: bool) -> Result<u64, StoreError> {
        let node_of = self
            .read()
            .host_volumes
            .get(&(ns.to_string(), id.to_string()))
            .map(|v| v.NodeID.clone());
        let reachable = node_of.as_deref().is_some_and(|n| self.node_connected(n));
        let r = self.write(|st| {
            let key = (ns.to_string(), id.to_string());
            // `HostVolume.Delete` (nomad/host_volume_endpoint.go) returns plain errors: HTTP
            // 500 for a missing volume and for one in use.
            let Some(v) = st.host_volumes.get(&key).cloned() else {
                return Err(StoreError::Internal(format!("no such volume: {id}")));
            };
            let users: Vec<String> = st
                .allocs
                .values()
                .filter(|a| alloc_uses_volume(a, &v))
                .map(|a| a.ID.clone())
                .collect();
            if !users.is_empty() {
                return Err(StoreError::Internal(format!(
                    "volume {id} in use by allocations: {users:?}"
                )));
            }
            if !reachable && !force {
                return Err(StoreError::Internal(
                    "volume cannot be removed from unknown node without force=true".into(),
                ));
            }
            let idx = st.next_index();
            st.host_volumes.remove(&key);
            st.tables.host_volumes = idx;
            st.emit_volume("HostVolumeDeleted", &v, true);
            if let Some(n) = st.nodes.get_mut(&v.NodeID) {
                if n.HostVolumes.get(&v.Name).is_some_and(|e| e.ID == v.ID) {
                    n.HostVolumes.remove(&v.Name);
                    n.ModifyIndex = idx;
                    st.tables.nodes = idx;
                    st.emit_node("NodeRegistration", &v.NodeID);
                }
            }
            Ok(idx)
        })?;
        Ok(r)
    }

    // ---------------------------------------------------------------- variables

    fn emit_var(st: &mut State, v: &Variable, deleted: bool) {
        st.emit(
            "Variable",
            "VariableUpdated",
            &v.Path,
            &v.Namespace,
            None,
            json!({"Metadata": v.metadata(), "Deleted": deleted}),
        );
    }

    /// `Variables.Apply` set / cas.
    pub fn put_var(
        &self,
        ns: &str,
        path: &str,
        items: BTreeMap<String, String>,
        cas: Option<u64>,
        lock_id: Option<&str>,
    ) -> Result<Variable, StoreError> {
        self.write(|st| {
            let key = (ns.to_string(), path.to_string());
            let cur = st.vars.get(&key).cloned();
            if let Some(c) = cas {
                let cur_idx = cur.as_ref().map(|v| v.ModifyIndex).unwrap_or(0);
                if cur_idx != c {
                    let body = cur.clone().unwrap_or(Variable {
                        Namespace: ns.into(),
                        Path: path.into(),
                        ..Default::default()
                    });
                    return Err(StoreError::Conflict(json!(body), cur_idx));
                }
            }
            if !st.var_write_allowed(&key, lock_id) {
                // `varSetTxn`: a locked variable answers a zero value naming only the path.
                let zero = Variable {
                    Namespace: ns.into(),
                    Path: path.into(),
                    ..Default::default()
                };
                return Err(StoreError::Conflict(json!(zero), st.index));
            }
            // Variables do not create (nor need) their namespace.
            let idx = st.next_index();
            let now = now_ns();
            let v = Variable {
                Namespace: ns.into(),
                Path: path.into(),
                Lock: cur.as_ref().and_then(|c| c.Lock.clone()),
                CreateIndex: cur.as_ref().map(|c| c.CreateIndex).unwrap_or(idx),
                CreateTime: cur.as_ref().map(|c| c.CreateTime).unwrap_or(now),
                ModifyIndex: idx,
                ModifyTime: now,
                Items: Some(items),
            };
            st.vars.insert(key, v.clone());
            st.tables.vars = idx;
            Self::emit_var(st, &v, false);
            Ok(v)
        })
    }

    /// `Variables.Apply` delete / delete-cas.
    pub fn delete_var(&self, ns: &str, path: &str, cas: Option<u64>) -> Result<u64, StoreError> {
        self.write(|st| {
            let key = (ns.to_string(), path.to_string());
            let cur = st.vars.get(&key).cloned();
            if !st.var_write_allowed(&key, None) {
                let c = cur.clone().unwrap_or_default();
                return Err(StoreError::Conflict(json!(c.metadata()), c.ModifyIndex));
            }
            if let Some(c) = cas {
                let cur_idx = cur.as_ref().map(|v| v.ModifyIndex).unwrap_or(0);
                if cur_idx != c {
                    return Err(StoreError::Conflict(
                        json!(cur.unwrap_or_default()),
                        cur_idx,
                    ));
                }
            }
            let idx = st.next_index();
            if let Some(v) = st.vars.remove(&key) {
                st.tables.vars = idx;
                Self::emit_var(st, &v, true);
            }
            Ok(idx)
        })
    }

    /// Mutates a variable's lock under the store lock (used by the lock module).
    pub fn with_state<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        self.write(f)
    }
}

/// Whether a non-client-terminal alloc on the volume's node asks for a host volume of its name.
pub fn alloc_uses_volume(a: &Allocation, v: &HostVolume) -> bool {
    if a.client_terminal() || a.NodeID != v.NodeID || a.Namespace != v.Namespace {
        return false;
    }
    let Some(job) = &a.Job else { return false };
    job.group(&a.TaskGroup)
        .and_then(|g| g.Volumes.as_ref())
        .is_some_and(|vols| {
            vols.values()
                .any(|r| r.Type == "host" && r.source_for(&a.Name) == v.Name)
        })
}

fn validate_job(job: &Job) -> Result<(), StoreError> {
    if job.ID.is_empty() {
        return Err(StoreError::BadRequest("Job ID is required".into()));
    }
    if !matches!(
        job.Type.as_str(),
        "service" | "batch" | "system" | "sysbatch"
    ) {
        return Err(StoreError::BadRequest(format!(
            "Invalid job type: {:?}",
            job.Type
        )));
    }
    if job.TaskGroups.is_empty() {
        return Err(StoreError::BadRequest(
            "Missing job task groups".to_string(),
        ));
    }
    for g in &job.TaskGroups {
        if g.Tasks.is_empty() {
            return Err(StoreError::BadRequest(format!(
                "Task group {} has no tasks",
                g.Name
            )));
        }
        let vols = g.Volumes.clone().unwrap_or_default();
        for t in &g.Tasks {
            for vm in t.VolumeMounts.iter().flatten() {
                if !vols.contains_key(&vm.Volume) {
                    return Err(StoreError::BadRequest(format!(
                        "Task {} has a volume mount referencing undefined volume {}",
                        t.Name, vm.Volume
                    )));
                }
            }
        }
        for v in vols.values() {
            if v.PerAlloc && v.Sticky {
                return Err(StoreError::BadRequest(
                    "volume cannot be per_alloc and sticky at the same time".into(),
                ));
            }
            if v.AccessMode == "single-node-reader-only" && !v.ReadOnly {
                return Err(StoreError::BadRequest(
                    "volume with single-node-reader-only access mode must be read_only".into(),
                ));
            }
        }
    }
    Ok(())
}

fn eval_json(id: &str, job: &Job, trigger: &str, idx: u64, now: i64) -> Value {
    json!({
        "ID": id, "Namespace": job.Namespace, "Priority": job.Priority, "Type": job.Type,
        "TriggeredBy": trigger, "JobID": job.ID, "JobModifyIndex": job.JobModifyIndex,
        "Status": "complete", "CreateIndex": idx, "ModifyIndex": idx,
        "CreateTime": now, "ModifyTime": now,
    })
}
