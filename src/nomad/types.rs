//! Nomad wire types: the subset of Nomad's JSON that dhv-binder reads and writes.
//!
//! Nomad encodes Go field names as keys, omits every zero-valued top-level `Allocation`
//! field (the struct is `codec:",omitempty"`), writes zero `time.Time` as `null` and nil
//! slices/maps as `null`. Every field here therefore defaults when missing or `null`, and
//! unknown fields are ignored (nomad-facts.md §2; `nomad/structs/alloc.go`).

use serde::{Deserialize, Deserializer, Serialize};
use std::collections::BTreeMap;

/// A short string of Nomad's (a namespace, job, group, task or driver name, a status, an
/// access mode): up to 24 bytes are kept in place, with no allocation of their own, so the
/// allocations and Jobs the view keeps cost a node of 1,000 allocations no heap for them
/// (docs/scale.md, memory per allocation). Compares and derefs as a `str`.
pub type Text = compact_str::CompactString;

/// A small map sorted by key, kept in one vector: an allocation's task states and its
/// group's volumes hold one or a few entries each, and a `BTreeMap` gives each map a node
/// of eleven slots (about 1.2 KiB for task states, 1.7 KiB for volume requests); the
/// view keeps every allocation of the node (docs/scale.md, memory per allocation). The
/// fields read and write it as the `BTreeMap` they were (`small_map_from_object`,
/// `small_map_as_object`); it iterates in key order.
pub type SmallMap<V> = litemap::LiteMap<Text, V>;

/// Deserializes a [`SmallMap`] from a JSON object, or `null` (or a missing field) as an
/// empty map, as a `BTreeMap` field with [`null_default`] did: anything else (an array
/// among them, which `LiteMap` alone would take) is an error, and a later duplicate key
/// wins. The vector holds exactly the entries.
fn small_map_from_object<'de, D, V>(d: D) -> Result<SmallMap<V>, D::Error>
where
    D: Deserializer<'de>,
    V: Deserialize<'de>,
{
    let map = Option::<BTreeMap<Text, V>>::deserialize(d)?.unwrap_or_default();
    let mut sorted = Vec::with_capacity(map.len());
    sorted.extend(map);
    // A BTreeMap's entries come out sorted by key, each key once.
    Ok(SmallMap::from_sorted_store_unchecked(sorted))
}

/// Serializes a [`SmallMap`] as a JSON object, also when it is empty (`LiteMap` writes an
/// empty map as `[]` to human-readable formats).
fn small_map_as_object<S, V>(m: &SmallMap<V>, s: S) -> Result<S::Ok, S::Error>
where
    S: serde::Serializer,
    V: Serialize,
{
    s.collect_map(m.iter())
}

/// Deserializes `null` (or a missing field, with `#[serde(default)]`) as `T::default()`.
pub fn null_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// Client statuses after which an allocation's tasks are dead on its node
/// (`ClientTerminalStatus`, `nomad/structs/alloc.go`).
pub const CLIENT_TERMINAL: [&str; 3] = ["complete", "failed", "lost"];

/// An allocation as returned by `GET /v1/allocation/:id`, `GET /v1/node/:id/allocations`
/// and (without `Job`) in event stream payloads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Allocation {
    /// Shared: the view's map and index, the watcher's maps and the journal's user
    /// records hold the copy the watcher first made, not one each (a read of the same
    /// allocation by the agent's core may bring another; docs/scale.md, memory per
    /// allocation).
    #[serde(rename = "ID", deserialize_with = "null_default")]
    pub id: std::sync::Arc<str>,
    #[serde(rename = "Namespace", deserialize_with = "null_default")]
    pub namespace: Text,
    /// `<job>.<group>[<index>]`.
    #[serde(rename = "Name", deserialize_with = "null_default")]
    pub name: Text,
    /// Shared: the allocations the view keeps, all of one node, hold one copy
    /// (`crate::agent::view`).
    #[serde(rename = "NodeID", deserialize_with = "null_default")]
    pub node_id: std::sync::Arc<str>,
    #[serde(rename = "JobID", deserialize_with = "null_default")]
    pub job_id: Text,
    /// Absent in event payloads (the server strips it), present in reads and node lists.
    /// Shared: the view keeps one copy of a reduced Job for all the allocations whose
    /// reduced Jobs are equal (`crate::agent::view`; docs/scale.md, memory per allocation).
    #[serde(rename = "Job", skip_serializing_if = "Option::is_none")]
    pub job: Option<std::sync::Arc<Job>>,
    #[serde(rename = "TaskGroup", deserialize_with = "null_default")]
    pub task_group: Text,
    /// `run`, `stop` or `evict`.
    #[serde(rename = "DesiredStatus", deserialize_with = "null_default")]
    pub desired_status: Text,
    /// `pending`, `running`, `complete`, `failed`, `lost` or `unknown`.
    #[serde(rename = "ClientStatus", deserialize_with = "null_default")]
    pub client_status: Text,
    #[serde(
        rename = "TaskStates",
        deserialize_with = "small_map_from_object",
        serialize_with = "small_map_as_object"
    )]
    pub task_states: SmallMap<TaskState>,
    #[serde(rename = "CreateIndex", deserialize_with = "null_default")]
    pub create_index: u64,
    #[serde(rename = "ModifyIndex", deserialize_with = "null_default")]
    pub modify_index: u64,
    /// Changes only on server-side updates (plans, desired transitions).
    #[serde(rename = "AllocModifyIndex", deserialize_with = "null_default")]
    pub alloc_modify_index: u64,
}

/// One allocation of a node's list (`GET /v1/node/:id/allocations`), read only as far as
/// its `ID` and `ModifyIndex`: a poll answer lists every allocation of the node with its
/// Job (terminal ones too, until the servers collect them), and most are unchanged since
/// the last answer, so only the changed ones are decoded whole ([`ListedAlloc::decode`]).
/// The rest of its JSON is kept as it came: a slice of the answer, not a copy.
#[derive(Debug)]
pub struct ListedAlloc {
    /// `ID`.
    pub id: String,
    /// `ModifyIndex`: raised by every change of the allocation (client or server side).
    pub modify_index: u64,
    raw: bytes::Bytes,
}

impl ListedAlloc {
    /// The whole allocation. Errors: the JSON is not an allocation.
    pub fn decode(&self) -> Result<Allocation, serde_json::Error> {
        serde_json::from_slice(&self.raw)
    }

    /// Reads a node's allocation list (a JSON array of allocations) in one pass over its
    /// bytes (`nomad::scan::list`); each allocation's JSON is validated when it is
    /// decoded. Errors: the answer is not an array of objects, or an `ID` that is not a
    /// string (or null) or a `ModifyIndex` that is not an unsigned integer (or null); the
    /// list is refused whole.
    pub fn list(body: bytes::Bytes) -> Result<Vec<ListedAlloc>, serde_json::Error> {
        use serde::de::Error;
        let elements = crate::nomad::scan::list(&body).map_err(|at| {
            serde_json::Error::custom(format!(
                "not a list of allocations: bad JSON near byte {at}"
            ))
        })?;
        let field = |r: &Option<std::ops::Range<usize>>| r.clone().map(|r| &body[r]);
        elements
            .iter()
            .map(|e| {
                let id = match field(&e.id) {
                    None | Some(b"null") => String::new(),
                    Some(raw) => serde_json::from_slice::<String>(raw)?,
                };
                let modify_index = match field(&e.modify_index) {
                    None | Some(b"null") => 0,
                    Some(raw) => serde_json::from_slice::<u64>(raw)?,
                };
                Ok(ListedAlloc {
                    id,
                    modify_index,
                    raw: body.slice(e.whole.clone()),
                })
            })
            .collect()
    }
}

impl Allocation {
    /// True once the client reports the tasks dead (`complete`, `failed` or `lost`).
    pub fn is_client_terminal(&self) -> bool {
        CLIENT_TERMINAL.contains(&self.client_status.as_str())
    }

    /// True once the allocation's tasks are known dead on its node, so that its volumes may
    /// be unpublished: `complete` or `failed` as the client reported, or `lost` with every
    /// task state `dead`. A server-side `lost` (the node stopped heartbeating) with tasks
    /// last seen running is not enough: on a partitioned node they may still be writing
    /// (nomad-facts.md §7). `unknown` (disconnected) never is.
    ///
    /// Whatever the status, every task state must be `dead`: Nomad reports `failed` while a
    /// poststop task still runs (`client/allocrunner/alloc_runner.go` `getClientStatus` gives
    /// `failed` precedence). No task states at all (never started) counts as finished.
    pub fn tasks_finished(&self) -> bool {
        matches!(self.client_status.as_str(), "complete" | "failed" | "lost")
            && self.task_states.values().all(|t| t.state == "dead")
    }

    /// True when Nomad's garbage collector may delete this allocation although its tasks may
    /// still run here: server- or client-terminal, not `running` on the client
    /// (`nomad/core_sched.go` `allocGCEligible`), and not [`Allocation::tasks_finished`]
    /// (a `lost` allocation of a partitioned node, `failed` with a poststop task running).
    /// Such a deletion raises no index and emits no event, so the watcher verifies these
    /// allocations by short reads.
    pub fn may_vanish_while_live(&self) -> bool {
        let terminal =
            matches!(self.desired_status.as_str(), "stop" | "evict") || self.is_client_terminal();
        terminal && self.client_status != "running" && !self.tasks_finished()
    }

    /// How long the client may take to kill this allocation's tasks once told to: its
    /// group's shutdown delay plus the longest task kill timeout (default 5 s) and shutdown
    /// delay. Used when an allocation vanishes from Nomad (purge, GC) while its tasks were
    /// last seen running: its volumes stay until this has passed.
    pub fn kill_grace(&self) -> std::time::Duration {
        let Some(g) = self.group() else {
            return std::time::Duration::from_secs(5);
        };
        let task = g
            .tasks
            .iter()
            .map(|t| {
                let kill = if t.kill_timeout == 0 {
                    5_000_000_000
                } else {
                    t.kill_timeout
                };
                kill.saturating_add(t.shutdown_delay)
            })
            .max()
            .unwrap_or(5_000_000_000);
        std::time::Duration::from_nanos(g.shutdown_delay.saturating_add(task))
    }

    /// The `[N]` suffix of the allocation name (`AllocSuffix`, `nomad/structs/funcs.go`),
    /// used for `per_alloc` volume sources; `None` when the name has no index.
    pub fn alloc_suffix(&self) -> Option<&str> {
        let open = self.name.rfind('[')?;
        self.name.ends_with(']').then(|| &self.name[open..])
    }

    /// Drops the embedded Job's task groups other than this allocation's own: all the agent
    /// reads of a Job is its own group (volume requests, tasks' lifecycle and kill grace), and
    /// the view keeps the Job. The lists kept are cut to their length: decoding grows a
    /// list of one task group, task or mount to room for four.
    pub fn keep_own_group(&mut self) {
        if let Some(job) = &mut self.job {
            let own = &self.task_group;
            let roomy = |j: &Job| {
                j.task_groups.capacity() > j.task_groups.len()
                    || j.task_groups.iter().any(|g| {
                        g.tasks.capacity() > g.tasks.len()
                            || g.tasks
                                .iter()
                                .any(|t| t.volume_mounts.capacity() > t.volume_mounts.len())
                    })
            };
            if job.task_groups.iter().any(|g| g.name != *own) || roomy(job) {
                let job = std::sync::Arc::make_mut(job);
                job.task_groups.retain(|g| g.name == *own);
                job.task_groups.shrink_to_fit();
                for g in &mut job.task_groups {
                    g.tasks.shrink_to_fit();
                    for t in &mut g.tasks {
                        t.volume_mounts.shrink_to_fit();
                    }
                }
            }
        }
    }

    /// The task group this allocation runs, from its embedded Job.
    pub fn group(&self) -> Option<&TaskGroup> {
        self.job
            .as_ref()?
            .task_groups
            .iter()
            .find(|g| g.name == self.task_group)
    }
}

/// A job as embedded in an allocation (`structs.Job`), reduced to what dhv-binder needs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Job {
    #[serde(rename = "ID", deserialize_with = "null_default")]
    pub id: Text,
    #[serde(rename = "Namespace", deserialize_with = "null_default")]
    pub namespace: Text,
    #[serde(rename = "Type", deserialize_with = "null_default")]
    pub job_type: Text,
    #[serde(rename = "Version", deserialize_with = "null_default")]
    pub version: u64,
    #[serde(rename = "TaskGroups", deserialize_with = "null_default")]
    pub task_groups: Vec<TaskGroup>,
}

/// `structs.TaskGroup`, reduced.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TaskGroup {
    #[serde(rename = "Name", deserialize_with = "null_default")]
    pub name: Text,
    /// Alias → volume request.
    #[serde(
        rename = "Volumes",
        deserialize_with = "small_map_from_object",
        serialize_with = "small_map_as_object"
    )]
    pub volumes: SmallMap<VolumeRequest>,
    #[serde(rename = "Tasks", deserialize_with = "null_default")]
    pub tasks: Vec<Task>,
    /// Nanoseconds (`*time.Duration`, `null` when unset).
    #[serde(rename = "ShutdownDelay", deserialize_with = "null_default")]
    pub shutdown_delay: u64,
    /// The group's `disconnect` block (`structs.DisconnectStrategy`), `null` when unset.
    #[serde(rename = "Disconnect", deserialize_with = "null_default")]
    pub disconnect: Disconnect,
    /// The older group-level `stop_after_client_disconnect` (nanoseconds, `null` when unset).
    #[serde(
        rename = "StopAfterClientDisconnect",
        deserialize_with = "null_default"
    )]
    pub stop_after_client_disconnect: Option<u64>,
}

impl TaskGroup {
    /// How long a client that lost its servers keeps this group's allocations running
    /// before it stops them itself (`client/heartbeatstop.go`), when set: the `disconnect`
    /// block's `stop_on_client_after`, else the older `stop_after_client_disconnect`.
    pub fn stop_on_client_after(&self) -> Option<std::time::Duration> {
        self.disconnect
            .stop_on_client_after
            .or(self.stop_after_client_disconnect)
            .filter(|ns| *ns > 0)
            .map(std::time::Duration::from_nanos)
    }
}

/// `structs.DisconnectStrategy` (`nomad/structs/group.go`): only what the agent reads.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Disconnect {
    /// Nanoseconds (`*time.Duration`, `null` when unset).
    #[serde(rename = "StopOnClientAfter", deserialize_with = "null_default")]
    pub stop_on_client_after: Option<u64>,
}

/// `structs.VolumeRequest` (`nomad/structs/volumes.go`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VolumeRequest {
    #[serde(rename = "Name", deserialize_with = "null_default")]
    pub name: Text,
    /// `host` or `csi`.
    #[serde(rename = "Type", deserialize_with = "null_default")]
    pub volume_type: Text,
    #[serde(rename = "Source", deserialize_with = "null_default")]
    pub source: Text,
    #[serde(rename = "ReadOnly", deserialize_with = "null_default")]
    pub read_only: bool,
    #[serde(rename = "Sticky", deserialize_with = "null_default")]
    pub sticky: bool,
    #[serde(rename = "AccessMode", deserialize_with = "null_default")]
    pub access_mode: Text,
    #[serde(rename = "AttachmentMode", deserialize_with = "null_default")]
    pub attachment_mode: Text,
    #[serde(rename = "PerAlloc", deserialize_with = "null_default")]
    pub per_alloc: bool,
}

/// `structs.Task`, reduced.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Task {
    #[serde(rename = "Name", deserialize_with = "null_default")]
    pub name: Text,
    #[serde(rename = "Driver", deserialize_with = "null_default")]
    pub driver: Text,
    /// `null` for main tasks.
    #[serde(rename = "Lifecycle")]
    pub lifecycle: Option<Lifecycle>,
    #[serde(rename = "VolumeMounts", deserialize_with = "null_default")]
    pub volume_mounts: Vec<VolumeMount>,
    /// Nanoseconds.
    #[serde(rename = "KillTimeout", deserialize_with = "null_default")]
    pub kill_timeout: u64,
    /// Nanoseconds.
    #[serde(rename = "ShutdownDelay", deserialize_with = "null_default")]
    pub shutdown_delay: u64,
}

/// `structs.TaskLifecycleConfig`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Lifecycle {
    /// `prestart`, `poststart` or `poststop`.
    #[serde(rename = "Hook", deserialize_with = "null_default")]
    pub hook: Text,
    #[serde(rename = "Sidecar", deserialize_with = "null_default")]
    pub sidecar: bool,
}

/// `structs.VolumeMount`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VolumeMount {
    #[serde(rename = "Volume", deserialize_with = "null_default")]
    pub volume: Text,
    #[serde(rename = "Destination", deserialize_with = "null_default")]
    pub destination: Text,
    #[serde(rename = "ReadOnly", deserialize_with = "null_default")]
    pub read_only: bool,
    /// `private` (or empty: the default), `host-to-task` or `bidirectional`: whether a mount
    /// made at the volume's path after the task started reaches it (the docker driver maps
    /// these to `rprivate`, `rslave`, `rshared`, `drivers/docker/driver.go`).
    #[serde(rename = "PropagationMode", deserialize_with = "null_default")]
    pub propagation_mode: Text,
}

/// `structs.TaskState`, reduced to what the agent reads: the rest (`Restarts`, `StartedAt`,
/// `FinishedAt`, `Events`, ...) is skipped while decoding, so the view keeps no copy of it
/// (docs/scale.md, memory per allocation).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TaskState {
    /// `pending`, `running` or `dead`.
    #[serde(rename = "State", deserialize_with = "null_default")]
    pub state: Text,
    #[serde(rename = "Failed", deserialize_with = "null_default")]
    pub failed: bool,
}

/// A dynamic host volume (`structs.HostVolume`, `nomad/structs/host_volumes.go`), as sent to
/// `PUT /v1/volume/host/register` and returned by `GET /v1/volume/host/:id`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HostVolume {
    #[serde(rename = "Namespace", deserialize_with = "null_default")]
    pub namespace: String,
    #[serde(rename = "ID", deserialize_with = "null_default")]
    pub id: String,
    #[serde(rename = "Name", deserialize_with = "null_default")]
    pub name: String,
    #[serde(rename = "PluginID", deserialize_with = "null_default")]
    pub plugin_id: String,
    #[serde(rename = "NodePool", deserialize_with = "null_default")]
    pub node_pool: String,
    #[serde(rename = "NodeID", deserialize_with = "null_default")]
    pub node_id: String,
    #[serde(rename = "RequestedCapabilities", deserialize_with = "null_default")]
    pub requested_capabilities: Vec<Capability>,
    #[serde(rename = "HostPath", deserialize_with = "null_default")]
    pub host_path: String,
    /// `pending`, `ready` or `unavailable`.
    #[serde(rename = "State", deserialize_with = "null_default")]
    pub state: String,
    /// Read-time only: stubs of the non-terminal allocations using the volume.
    #[serde(
        rename = "Allocations",
        deserialize_with = "null_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub allocations: Vec<AllocStub>,
}

/// One `{AttachmentMode, AccessMode}` pair of a host volume.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(default)]
pub struct Capability {
    #[serde(rename = "AttachmentMode", deserialize_with = "null_default")]
    pub attachment_mode: String,
    #[serde(rename = "AccessMode", deserialize_with = "null_default")]
    pub access_mode: String,
}

/// `structs.AllocListStub`, reduced.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AllocStub {
    #[serde(rename = "ID", deserialize_with = "null_default")]
    pub id: String,
    #[serde(rename = "Name", deserialize_with = "null_default")]
    pub name: String,
    #[serde(rename = "NodeID", deserialize_with = "null_default")]
    pub node_id: String,
    #[serde(rename = "JobID", deserialize_with = "null_default")]
    pub job_id: String,
    #[serde(rename = "ClientStatus", deserialize_with = "null_default")]
    pub client_status: String,
}

/// `structs.HostVolumeStub` from `GET /v1/volumes?type=host`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HostVolumeStub {
    #[serde(rename = "Namespace", deserialize_with = "null_default")]
    pub namespace: String,
    #[serde(rename = "ID", deserialize_with = "null_default")]
    pub id: String,
    #[serde(rename = "Name", deserialize_with = "null_default")]
    pub name: String,
    #[serde(rename = "NodeID", deserialize_with = "null_default")]
    pub node_id: String,
    #[serde(rename = "State", deserialize_with = "null_default")]
    pub state: String,
}

/// A Nomad Variable with its items (`VariableDecrypted`, `nomad/structs/variables.go`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Variable {
    #[serde(rename = "Namespace", deserialize_with = "null_default")]
    pub namespace: String,
    #[serde(rename = "Path", deserialize_with = "null_default")]
    pub path: String,
    #[serde(rename = "CreateIndex", deserialize_with = "null_default")]
    pub create_index: u64,
    #[serde(rename = "ModifyIndex", deserialize_with = "null_default")]
    pub modify_index: u64,
    #[serde(rename = "Items", deserialize_with = "null_default")]
    pub items: BTreeMap<String, String>,
    /// Present while the variable is locked (`lock-acquire`).
    #[serde(rename = "Lock", skip_serializing_if = "Option::is_none")]
    pub lock: Option<VariableLock>,
}

/// `VariableLock`: `ID` is server-generated at `lock-acquire`; `TTL` and `LockDelay` are Go
/// duration strings on the wire (`"15s"`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VariableLock {
    #[serde(rename = "ID", deserialize_with = "null_default")]
    pub id: String,
    #[serde(rename = "TTL", deserialize_with = "null_default")]
    pub ttl: serde_json::Value,
    #[serde(rename = "LockDelay", deserialize_with = "null_default")]
    pub lock_delay: serde_json::Value,
}

/// `VariableMetadata` from `GET /v1/vars`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VariableMeta {
    #[serde(rename = "Namespace", deserialize_with = "null_default")]
    pub namespace: String,
    #[serde(rename = "Path", deserialize_with = "null_default")]
    pub path: String,
    #[serde(rename = "ModifyIndex", deserialize_with = "null_default")]
    pub modify_index: u64,
}

/// `GET /v1/agent/self`, reduced. Nomad writes the top-level keys in lower case.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct AgentSelf {
    #[serde(alias = "Config", deserialize_with = "null_default")]
    pub config: serde_json::Value,
    /// `stats.client.node_id` holds the local client's node ID.
    #[serde(alias = "Stats", deserialize_with = "null_default")]
    pub stats: BTreeMap<String, BTreeMap<String, String>>,
}

impl AgentSelf {
    /// The node ID of the local client agent, if this agent runs a client.
    pub fn node_id(&self) -> Option<&str> {
        self.stats
            .get("client")
            .and_then(|c| c.get("node_id"))
            .map(String::as_str)
            .filter(|s| !s.is_empty())
    }

    /// The local client's node pool (`config.Client.NodePool`), `default` when unset.
    pub fn node_pool(&self) -> String {
        self.config
            .pointer("/Client/NodePool")
            .and_then(|v| v.as_str())
            .filter(|s| !s.is_empty())
            .unwrap_or("default")
            .to_string()
    }
}

/// What a node's constraints are evaluated against: the parts of Nomad's node
/// (Nomad API: `GET /v1/node/:node_id`) that its scheduler's `resolveTarget`
/// (`scheduler/feasible/feasible.go`) reads for a constraint's target.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct NodeFacts {
    #[serde(rename = "ID", default)]
    pub id: String,
    #[serde(rename = "Name", default)]
    pub name: String,
    #[serde(rename = "NodeClass", default)]
    pub class: String,
    #[serde(rename = "Datacenter", default)]
    pub datacenter: String,
    #[serde(rename = "NodePool", default)]
    pub pool: String,
    #[serde(rename = "Attributes", default)]
    pub attributes: BTreeMap<String, String>,
    #[serde(rename = "Meta", default)]
    pub meta: BTreeMap<String, String>,
}

impl NodeFacts {
    /// The value of a constraint target on this node (`resolveTarget`); `None` when the
    /// attribute or meta key is not set.
    pub fn resolve(&self, target: &str) -> Option<&str> {
        let key = |p: &str| target.strip_prefix(p).and_then(|k| k.strip_suffix('}'));
        match target {
            "${node.unique.id}" => Some(&self.id),
            "${node.unique.name}" => Some(&self.name),
            "${node.class}" => Some(&self.class),
            "${node.datacenter}" => Some(&self.datacenter),
            "${node.pool}" => Some(&self.pool),
            _ => {
                if let Some(k) = key("${attr.") {
                    self.attributes.get(k).map(String::as_str)
                } else if let Some(k) = key("${meta.") {
                    self.meta.get(k).map(String::as_str)
                } else {
                    None
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listed allocation is read for its ID and ModifyIndex only; the rest decodes on
    /// demand, and a part that does not decode fails only then.
    #[test]
    fn a_listed_allocation_is_decoded_whole_only_on_demand() {
        let body = serde_json::json!([
            {"ID": "a", "ModifyIndex": 7, "ClientStatus": "running", "TaskStates": null},
            {"ID": "b", "ModifyIndex": null, "TaskStates": 5},
            {"ModifyIndex": 3},
        ])
        .to_string();
        let listed = ListedAlloc::list(body.into()).unwrap();
        assert_eq!(
            listed
                .iter()
                .map(|l| (l.id.as_str(), l.modify_index))
                .collect::<Vec<_>>(),
            vec![("a", 7), ("b", 0), ("", 3)]
        );
        let a = listed[0].decode().unwrap();
        assert_eq!((&*a.id, a.modify_index), ("a", 7));
        assert_eq!(a.client_status, "running");
        assert!(listed[1].decode().is_err(), "TaskStates: 5 is no map");
        // Not a list of objects: refused as a whole.
        let list = |s: &'static str| ListedAlloc::list(bytes::Bytes::from_static(s.as_bytes()));
        assert!(list(r#"[{"ID": 5}]"#).is_err());
        assert!(list(r#"[{"ID": "a", "ModifyIndex": -1}]"#).is_err());
        assert!(list(r#"[{"ID": "a", "ModifyIndex": 1.5}]"#).is_err());
        assert!(list("[1]").is_err());
        assert!(list(r#"[{"ID": "a"}] trailing"#).is_err());
        // Escapes in an ID are decoded as serde_json would.
        assert_eq!(list(r#"[{"ID": "\u0061"}]"#).unwrap()[0].id, "a");
    }

    /// The small maps decode from a JSON object as a `BTreeMap` does: any key order, a
    /// later duplicate key wins, `null` is empty; they iterate in key order.
    #[test]
    fn small_maps_decode_like_btree_maps() {
        let text = r#"{"TaskStates": {"web": {"State": "running"}, "init": {"State": "pending"},
                        "init": {"State": "dead"}},
                       "Job": {"TaskGroups": [{"Name": "g", "Volumes": null}]}}"#;
        let a: Allocation = serde_json::from_str(text).unwrap();
        let states: Vec<(&str, &str)> = a
            .task_states
            .iter()
            .map(|(t, s)| (t.as_str(), s.state.as_str()))
            .collect();
        assert_eq!(states, vec![("init", "dead"), ("web", "running")]);
        assert_eq!(a.task_states.get("web").map(|s| s.failed), Some(false));
        let group = &a.job.as_ref().unwrap().task_groups[0];
        assert!(group.volumes.is_empty());
        // Only an object (or null) is a map: an array is refused, as it was.
        for bad in [
            r#"{"TaskStates": []}"#,
            r#"{"TaskStates": [["web", {"State": "running"}]]}"#,
            r#"{"Job": {"TaskGroups": [{"Volumes": []}]}}"#,
        ] {
            assert!(serde_json::from_str::<Allocation>(bad).is_err(), "{bad}");
        }
        // Written out as objects, empty ones too, as a BTreeMap was; and read back the same.
        let out = serde_json::to_value(&a).unwrap();
        assert_eq!(out["TaskStates"]["web"]["State"], "running");
        assert_eq!(
            out["Job"]["TaskGroups"][0]["Volumes"],
            serde_json::json!({})
        );
        let again: Allocation = serde_json::from_value(out).unwrap();
        assert_eq!(again, a);
    }

    fn alloc(desired: &str, client: &str, states: &[(&str, &str)]) -> Allocation {
        let states: serde_json::Map<String, serde_json::Value> = states
            .iter()
            .map(|(t, s)| (t.to_string(), serde_json::json!({ "State": s })))
            .collect();
        serde_json::from_value(serde_json::json!({
            "ID": "a", "DesiredStatus": desired, "ClientStatus": client, "TaskStates": states,
        }))
        .unwrap()
    }

    /// Issue 11 #9: `failed` is reported while a poststop task still runs
    /// (`getClientStatus` gives `failed` precedence): not finished until every task is dead.
    #[test]
    fn finished_only_when_every_task_state_is_dead() {
        let failed_poststop = alloc("run", "failed", &[("app", "dead"), ("cleanup", "running")]);
        assert!(!failed_poststop.tasks_finished());
        assert!(alloc("run", "failed", &[("app", "dead"), ("cleanup", "dead")]).tasks_finished());
        assert!(alloc("run", "complete", &[("app", "dead")]).tasks_finished());
        assert!(!alloc("stop", "lost", &[("app", "running")]).tasks_finished());
        assert!(
            alloc("run", "failed", &[]).tasks_finished(),
            "never started"
        );
        assert!(!alloc("run", "running", &[("app", "dead")]).tasks_finished());
        assert!(!alloc("stop", "unknown", &[("app", "dead")]).tasks_finished());
    }

    /// Issue 11 #2: the allocations Nomad's GC may delete while their tasks may still run
    /// (`allocGCEligible`: terminal, not running on the client) are the ones to verify.
    #[test]
    fn allocations_the_gc_may_delete_while_live() {
        let failed_poststop = alloc("run", "failed", &[("app", "dead"), ("cleanup", "running")]);
        assert!(failed_poststop.may_vanish_while_live());
        assert!(alloc("stop", "lost", &[("app", "running")]).may_vanish_while_live());
        assert!(alloc("stop", "pending", &[("app", "pending")]).may_vanish_while_live());
        assert!(!alloc("stop", "running", &[("app", "running")]).may_vanish_while_live());
        assert!(!alloc("run", "running", &[("app", "running")]).may_vanish_while_live());
        assert!(!alloc("run", "complete", &[("app", "dead")]).may_vanish_while_live());
    }
}
