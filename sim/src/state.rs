//! The server's tables: nodes, jobs, allocations, evaluations, variables (with the leader's
//! lock timers), host volumes, namespaces, ACLs, and the events a mutation queues for its index.
//!
//! Only [`crate::store::Server`] hands out a `State` (under its lock); mutations take one new
//! index and publish the queued events as one frame (`nomad/state/events.go`).

use crate::broker::Broker;
use crate::identity::Keyring;
use crate::policy::AclState;
use crate::structs::{Allocation, Deployment, Event, Frame, HostVolume, Job, Node, Variable};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// A variable's key: (namespace, path).
pub type VarKey = (String, String);

/// Per-table indexes for blocking queries.
#[derive(Debug, Default, Clone, Copy)]
pub struct TableIndex {
    /// nodes table.
    pub nodes: u64,
    /// jobs table.
    pub jobs: u64,
    /// allocs table.
    pub allocs: u64,
    /// evals table.
    pub evals: u64,
    /// variables table.
    pub vars: u64,
    /// host_volumes table.
    pub host_volumes: u64,
    /// acl tables.
    pub acl: u64,
    /// deployment table.
    pub deployments: u64,
}

/// The leader's lock timers (`nomad/locks.go`).
#[derive(Debug, Default, Clone)]
pub struct LockTimers {
    /// Locks whose TTL timer runs: key → (fires at, TTL, lock delay).
    pub held: BTreeMap<VarKey, (Instant, Duration, Duration)>,
    /// Locks whose timer fired: key → when the delayed release removes the lock.
    pub lapsed: BTreeMap<VarKey, Instant>,
}

/// The tables.
pub struct State {
    pub(crate) index: u64,
    pub(crate) tables: TableIndex,
    pub(crate) region: String,
    pub(crate) nodes: BTreeMap<String, Node>,
    pub(crate) jobs: BTreeMap<(String, String), Job>,
    pub(crate) allocs: BTreeMap<String, Allocation>,
    pub(crate) evals: BTreeMap<String, Value>,
    pub(crate) deployments: BTreeMap<String, Deployment>,
    pub(crate) vars: BTreeMap<(String, String), Variable>,
    pub(crate) host_volumes: BTreeMap<(String, String), HostVolume>,
    pub(crate) namespaces: BTreeSet<String>,
    pub(crate) broker: Broker,
    pub(crate) keyring: Arc<Keyring>,
    pub(crate) acl: AclState,
    pub(crate) leaderless: bool,
    pub(crate) stopped_heartbeats: BTreeSet<String>,
    /// Nodes cut off from the servers (`PUT /v1/sim/node/:id/partition`): heartbeats stopped
    /// and every request their client agent forwards fails (see `api::partition_guard`).
    pub(crate) partitioned: BTreeSet<String>,
    /// Draining nodes → when their drain deadline forces the rest off (ns; `None` = none).
    pub(crate) drain_deadlines: BTreeMap<String, Option<i64>>,
    pub(crate) lock_timers: LockTimers,
    /// The servers' heartbeat settings (`server { min_heartbeat_ttl, max_heartbeats_per_second }`).
    pub(crate) heartbeat: crate::config::HeartbeatSettings,
    /// The Nomad version whose shapes the simulator speaks (`nomad_version`).
    pub(crate) version: crate::config::NomadVersion,
    pending_events: Vec<Event>,
}

impl State {
    /// Empty tables at index 1 with the `default` namespace.
    pub(crate) fn new(region: &str, buffer: usize, keyring: Arc<Keyring>, acl: AclState) -> Self {
        State {
            index: 1,
            tables: TableIndex::default(),
            region: region.into(),
            nodes: BTreeMap::new(),
            jobs: BTreeMap::new(),
            allocs: BTreeMap::new(),
            evals: BTreeMap::new(),
            deployments: BTreeMap::new(),
            vars: BTreeMap::new(),
            host_volumes: BTreeMap::new(),
            namespaces: ["default".to_string()].into(),
            broker: Broker::new(buffer),
            keyring,
            acl,
            leaderless: false,
            stopped_heartbeats: BTreeSet::new(),
            partitioned: BTreeSet::new(),
            drain_deadlines: BTreeMap::new(),
            lock_timers: Default::default(),
            heartbeat: Default::default(),
            version: Default::default(),
            pending_events: Vec::new(),
        }
    }

    /// Whether a write carrying `lock_id` may modify the variable at `key` (unlocked, or the
    /// same lock ID).
    pub(crate) fn var_write_allowed(&self, key: &VarKey, lock_id: Option<&str>) -> bool {
        match self.vars.get(key).and_then(|v| v.Lock.as_ref()) {
            Some(l) if !l.ID.is_empty() => lock_id == Some(l.ID.as_str()),
            _ => true,
        }
    }
    /// Takes the next index for a mutation.
    pub(crate) fn next_index(&mut self) -> u64 {
        self.index += 1;
        self.index
    }

    /// Whether the sim fault API has stopped this node's heartbeats (partition).
    pub fn heartbeat_stopped(&self, node_id: &str) -> bool {
        self.stopped_heartbeats.contains(node_id)
    }

    /// Queues an event for the frame of the current index.
    pub(crate) fn emit(
        &mut self,
        topic: &str,
        kind: &str,
        key: &str,
        ns: &str,
        filter_keys: Option<Vec<String>>,
        payload: Value,
    ) {
        self.pending_events.push(Event {
            Topic: topic.into(),
            Type: kind.into(),
            Key: key.into(),
            Namespace: ns.into(),
            FilterKeys: filter_keys,
            Index: self.index,
            Payload: payload,
        });
    }

    /// Alloc event (Key = ID, FilterKeys = [JobID, DeploymentID], Job stripped).
    pub(crate) fn emit_alloc(&mut self, kind: &str, alloc: &Allocation) {
        let mut a = alloc.clone();
        a.Job = None;
        let payload = json!({ "Allocation": a });
        self.emit(
            "Allocation",
            kind,
            &alloc.ID,
            &alloc.Namespace,
            Some(vec![alloc.JobID.clone(), alloc.DeploymentID.clone()]),
            payload,
        );
    }

    /// Job event (Key = job ID, no FilterKeys). A deleted job's carries `"Deleted": true` from
    /// Nomad 1.11.3 on ([`crate::config::NomadVersion::job_event_deleted`]).
    pub(crate) fn emit_job(&mut self, kind: &str, job: &Job, deleted: bool) {
        let mut payload = json!({ "Job": job });
        if deleted && self.version.job_event_deleted() {
            payload["Deleted"] = json!(true);
        }
        self.emit("Job", kind, &job.ID, &job.Namespace, None, payload);
    }

    /// Deployment event (Key = deployment ID, FilterKeys = [JobID]; `NewDeploymentEvent`).
    pub(crate) fn emit_deployment(&mut self, kind: &str, d: &Deployment) {
        self.emit(
            "Deployment",
            kind,
            &d.ID,
            &d.Namespace,
            Some(vec![d.JobID.clone()]),
            json!({ "Deployment": d }),
        );
    }

    /// Sets a host volume's `State` at index `idx` (a `NodeRegistration` event, as the node's
    /// fingerprint brings it).
    pub(crate) fn set_host_volume_state(&mut self, key: &VarKey, state: &str, idx: u64, now: i64) {
        if let Some(v) = self.host_volumes.get_mut(key) {
            v.State = state.into();
            v.ModifyIndex = idx;
            v.ModifyTime = now;
            let v = v.clone();
            self.tables.host_volumes = idx;
            self.emit_volume("NodeRegistration", &v, false);
        }
    }

    /// The job's latest deployment (highest CreateIndex; `LatestDeploymentByJobID`).
    pub(crate) fn latest_deployment(&self, ns: &str, job: &str) -> Option<&Deployment> {
        self.deployments
            .values()
            .filter(|d| d.Namespace == ns && d.JobID == job)
            .max_by_key(|d| d.CreateIndex)
    }

    /// Node event (Key = node ID).
    pub(crate) fn emit_node(&mut self, kind: &str, node_id: &str) {
        if let Some(n) = self.nodes.get(node_id) {
            let payload = json!({ "Node": n.to_json() });
            self.emit("Node", kind, node_id, "", None, payload);
        }
    }

    /// Host volume event (Key = ID, FilterKeys [ID, Name, PluginID]).
    pub(crate) fn emit_volume(&mut self, kind: &str, v: &HostVolume, deleted: bool) {
        let key = if deleted { "" } else { v.ID.as_str() }.to_string();
        self.emit(
            "HostVolume",
            kind,
            &key,
            &v.Namespace,
            Some(vec![v.ID.clone(), v.Name.clone(), v.PluginID.clone()]),
            json!({ "Volume": v }),
        );
    }

    /// Publishes the queued events as the frame of the current index.
    pub(crate) fn flush_events(&mut self) {
        let events = std::mem::take(&mut self.pending_events);
        if !events.is_empty() {
            self.broker.publish(Frame {
                Index: self.index,
                Events: events,
            });
        }
    }

    /// Non-terminal allocations per node ID (for spreading).
    pub(crate) fn node_load(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for a in self.allocs.values().filter(|a| !a.terminal()) {
            *m.entry(a.NodeID.clone()).or_insert(0) += 1;
        }
        m
    }

    /// Job status per Nomad's `getJobStatus` (any non-terminal alloc → running).
    pub(crate) fn job_status(&self, ns: &str, id: &str) -> &'static str {
        let Some(job) = self.jobs.get(&(ns.to_string(), id.to_string())) else {
            return "dead";
        };
        let mut any = false;
        for a in self
            .allocs
            .values()
            .filter(|a| a.Namespace == ns && a.JobID == id)
        {
            any = true;
            if !a.terminal() {
                return "running";
            }
        }
        if job.Stop || any {
            "dead"
        } else {
            "pending"
        }
    }

    /// Updates the stored job status, emitting a Job event of `kind` when it changed.
    pub(crate) fn refresh_job_status(&mut self, ns: &str, id: &str, kind: &str) {
        let status = self.job_status(ns, id);
        let idx = self.index;
        let key = (ns.to_string(), id.to_string());
        let changed = match self.jobs.get_mut(&key) {
            Some(j) if j.Status != status => {
                j.Status = status.into();
                j.ModifyIndex = idx;
                Some(j.clone())
            }
            _ => None,
        };
        if let Some(j) = changed {
            self.tables.jobs = idx;
            self.emit_job(kind, &j, false);
        }
    }
}
