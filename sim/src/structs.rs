//! Nomad wire types (Go field names, declaration order) and their canonicalisation.
//!
//! Field order and names follow `nomad/structs/*.go`; top-level `Allocation` fields are omitempty
//! (the Go struct carries `codec:",omitempty"`), nested structs are encoded in full.
#![allow(non_snake_case)]

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}
fn is_zero_i64(v: &i64) -> bool {
    *v == 0
}
fn is_empty_str(s: &str) -> bool {
    s.is_empty()
}

/// Job constraint (`structs.Constraint`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct Constraint {
    pub LTarget: String,
    pub RTarget: String,
    pub Operand: String,
}

/// Restart policy (`structs.RestartPolicy`); durations in ns. Before [`Job::canonicalize`] a
/// field the job did not set is [`RestartPolicy::UNSET`] (a number) or empty (`Mode`), as
/// the API's pointer fields are nil: canonicalizing merges the set fields over the group's
/// policy, and the group's over the job type's default (`api/tasks.go`
/// `RestartPolicy.Merge`, `TaskGroup.Canonicalize`, `Task.Canonicalize`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(default)]
pub struct RestartPolicy {
    pub Attempts: i64,
    pub Interval: i64,
    pub Delay: i64,
    pub Mode: String,
    pub RenderTemplates: bool,
}

impl Default for RestartPolicy {
    /// Every field unset.
    fn default() -> Self {
        RestartPolicy {
            Attempts: Self::UNSET,
            Interval: Self::UNSET,
            Delay: Self::UNSET,
            Mode: String::new(),
            RenderTemplates: false,
        }
    }
}

impl RestartPolicy {
    /// A number the job did not set.
    pub const UNSET: i64 = -1;

    /// `self` with the fields `over` sets put over it (`api/tasks.go` `RestartPolicy.Merge`).
    pub fn merged(&self, over: &RestartPolicy) -> RestartPolicy {
        let pick = |o: i64, s: i64| if o == Self::UNSET { s } else { o };
        RestartPolicy {
            Attempts: pick(over.Attempts, self.Attempts),
            Interval: pick(over.Interval, self.Interval),
            Delay: pick(over.Delay, self.Delay),
            Mode: if over.Mode.is_empty() {
                self.Mode.clone()
            } else {
                over.Mode.clone()
            },
            RenderTemplates: over.RenderTemplates || self.RenderTemplates,
        }
    }

    /// Nomad's default for service jobs (`DefaultServiceJobRestartPolicy`).
    pub fn service_default() -> Self {
        RestartPolicy {
            Attempts: 2,
            Interval: 30 * 60 * 1_000_000_000,
            Delay: 15 * 1_000_000_000,
            Mode: "fail".into(),
            RenderTemplates: false,
        }
    }
    /// Nomad's default for batch jobs (`DefaultBatchJobRestartPolicy`).
    pub fn batch_default() -> Self {
        RestartPolicy {
            Attempts: 3,
            Interval: 24 * 3600 * 1_000_000_000,
            Delay: 15 * 1_000_000_000,
            Mode: "fail".into(),
            RenderTemplates: false,
        }
    }
}

/// Reschedule policy (`structs.ReschedulePolicy`); durations in ns.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct ReschedulePolicy {
    pub Attempts: i64,
    pub Interval: i64,
    pub Delay: i64,
    pub DelayFunction: String,
    pub MaxDelay: i64,
    pub Unlimited: bool,
}

impl ReschedulePolicy {
    /// `DefaultServiceJobReschedulePolicy`.
    pub fn service_default() -> Self {
        ReschedulePolicy {
            Attempts: 0,
            Interval: 0,
            Delay: 30 * 1_000_000_000,
            DelayFunction: "exponential".into(),
            MaxDelay: 3600 * 1_000_000_000,
            Unlimited: true,
        }
    }
    /// `DefaultBatchJobReschedulePolicy`.
    pub fn batch_default() -> Self {
        ReschedulePolicy {
            Attempts: 1,
            Interval: 24 * 3600 * 1_000_000_000,
            Delay: 5 * 1_000_000_000,
            DelayFunction: "constant".into(),
            MaxDelay: 0,
            Unlimited: false,
        }
    }
}

/// Group volume request (`structs.VolumeRequest`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct VolumeRequest {
    pub Name: String,
    pub Type: String,
    pub Source: String,
    pub ReadOnly: bool,
    pub Sticky: bool,
    pub AccessMode: String,
    pub AttachmentMode: String,
    pub MountOptions: Value,
    pub PerAlloc: bool,
}

impl VolumeRequest {
    /// Source name for an allocation, adding the `[N]` suffix when `PerAlloc` (`AllocSuffix`).
    pub fn source_for(&self, alloc_name: &str) -> String {
        if self.PerAlloc {
            let suffix = alloc_name
                .rfind('[')
                .map(|i| &alloc_name[i..])
                .unwrap_or("");
            format!("{}{}", self.Source, suffix)
        } else {
            self.Source.clone()
        }
    }
    /// Access mode after Nomad's host-volume defaults.
    pub fn effective_access_mode(&self) -> String {
        if self.AccessMode.is_empty() {
            if self.ReadOnly {
                "single-node-reader-only".into()
            } else {
                "single-node-writer".into()
            }
        } else {
            self.AccessMode.clone()
        }
    }
    /// Attachment mode after defaults ("" → "file-system").
    pub fn effective_attachment_mode(&self) -> String {
        if self.AttachmentMode.is_empty() {
            "file-system".into()
        } else {
            self.AttachmentMode.clone()
        }
    }
}

/// Task volume mount (`structs.VolumeMount`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct VolumeMount {
    pub Volume: String,
    pub Destination: String,
    pub ReadOnly: bool,
    pub PropagationMode: String,
    pub SELinuxLabel: String,
}

/// Task lifecycle (`structs.TaskLifecycleConfig`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct Lifecycle {
    pub Hook: String,
    pub Sidecar: bool,
}

/// Workload identity (`structs.WorkloadIdentity`); TTL in ns.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct WorkloadIdentity {
    pub Name: String,
    pub Audience: Vec<String>,
    pub ChangeMode: String,
    pub ChangeSignal: String,
    pub Env: bool,
    pub File: bool,
    pub Filepath: String,
    pub ServiceName: String,
    pub TTL: i64,
    pub ExtraClaims: Value,
}

/// Task resources (`structs.Resources`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(default)]
pub struct Resources {
    pub CPU: i64,
    pub Cores: i64,
    pub MemoryMB: i64,
    pub MemoryMaxMB: i64,
    pub DiskMB: i64,
    pub IOPS: i64,
    pub Networks: Value,
    pub Devices: Value,
    pub NUMA: Value,
    pub SecretsMB: i64,
}

impl Default for Resources {
    fn default() -> Self {
        Resources {
            CPU: 100,
            Cores: 0,
            MemoryMB: 300,
            MemoryMaxMB: 0,
            DiskMB: 0,
            IOPS: 0,
            Networks: Value::Null,
            Devices: Value::Null,
            NUMA: Value::Null,
            SecretsMB: 0,
        }
    }
}

/// A task (`structs.Task`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct Task {
    pub Name: String,
    pub Driver: String,
    pub User: String,
    pub Config: Map<String, Value>,
    pub Env: Option<BTreeMap<String, String>>,
    pub Services: Value,
    pub Vault: Value,
    pub Secrets: Value,
    pub Consul: Value,
    pub Templates: Value,
    pub Constraints: Option<Vec<Constraint>>,
    pub Affinities: Value,
    pub Resources: Resources,
    pub RestartPolicy: Option<RestartPolicy>,
    pub DispatchPayload: Value,
    pub Lifecycle: Option<Lifecycle>,
    pub Meta: Option<BTreeMap<String, String>>,
    pub KillTimeout: i64,
    pub LogConfig: Value,
    pub Artifacts: Value,
    pub Leader: bool,
    pub ShutdownDelay: i64,
    pub VolumeMounts: Option<Vec<VolumeMount>>,
    pub ScalingPolicies: Value,
    pub KillSignal: String,
    pub Kind: String,
    pub CSIPluginConfig: Value,
    pub Identity: Option<WorkloadIdentity>,
    pub Identities: Option<Vec<WorkloadIdentity>>,
    pub Actions: Value,
    pub Schedule: Value,
}

impl Task {
    /// True for a prestart task that is not a sidecar (must exit 0 before main tasks start).
    pub fn is_ephemeral_prestart(&self) -> bool {
        matches!(&self.Lifecycle, Some(l) if l.Hook == "prestart" && !l.Sidecar)
    }
}

/// A task group (`structs.TaskGroup`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct TaskGroup {
    pub Name: String,
    pub Count: i64,
    pub Update: Value,
    pub Migrate: Value,
    pub Constraints: Option<Vec<Constraint>>,
    pub Scaling: Value,
    pub RestartPolicy: Option<RestartPolicy>,
    pub Disconnect: Value,
    pub Tasks: Vec<Task>,
    pub EphemeralDisk: Value,
    pub Meta: Option<BTreeMap<String, String>>,
    pub ReschedulePolicy: Option<ReschedulePolicy>,
    pub Affinities: Value,
    pub Spreads: Value,
    pub Networks: Value,
    pub Consul: Value,
    pub Services: Value,
    pub Volumes: Option<BTreeMap<String, VolumeRequest>>,
    pub ShutdownDelay: Option<i64>,
    pub MaxRunDuration: Option<i64>,
    pub StopAfterClientDisconnect: Option<i64>,
    pub MaxClientDisconnect: Option<i64>,
    pub PreventRescheduleOnLost: bool,
}

/// A group's update strategy (`structs.UpdateStrategy`), read from `TaskGroup.Update`.
/// Durations in nanoseconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpdateStrategy {
    /// Destructive updates at a time; 0 = no update strategy (`IsEmpty`).
    pub max_parallel: i64,
    /// Canaries placed before the old allocations are touched.
    pub canary: i64,
    /// Promote once every canary is healthy.
    pub auto_promote: bool,
    /// Kept on the deployment state (auto revert itself is not modelled).
    pub auto_revert: bool,
    /// How long every task must run before the allocation is healthy.
    pub min_healthy_time: i64,
    /// An allocation not healthy by then is unhealthy.
    pub healthy_deadline: i64,
    /// Kept on the deployment state.
    pub progress_deadline: i64,
}

impl UpdateStrategy {
    /// The strategy of a canonicalized `Update` value; `None` when absent or `MaxParallel` is 0
    /// (`UpdateStrategy.IsEmpty`: no deployment, updates all at once).
    pub fn of(update: &Value) -> Option<Self> {
        let i = |k: &str| update.get(k).and_then(Value::as_i64).unwrap_or(0);
        let b = |k: &str| update.get(k).and_then(Value::as_bool).unwrap_or(false);
        let u = UpdateStrategy {
            max_parallel: i("MaxParallel"),
            canary: i("Canary"),
            auto_promote: b("AutoPromote"),
            auto_revert: b("AutoRevert"),
            min_healthy_time: i("MinHealthyTime"),
            healthy_deadline: i("HealthyDeadline"),
            progress_deadline: i("ProgressDeadline"),
        };
        (u.max_parallel > 0).then_some(u)
    }
}

/// One group's progress in a deployment (`structs.DeploymentState`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct DeploymentState {
    pub AutoRevert: bool,
    pub AutoPromote: bool,
    pub ProgressDeadline: i64,
    pub RequireProgressBy: Option<String>,
    pub Promoted: bool,
    pub PlacedCanaries: Option<Vec<String>>,
    pub DesiredCanaries: i64,
    pub DesiredTotal: i64,
    pub PlacedAllocs: i64,
    pub HealthyAllocs: i64,
    pub UnhealthyAllocs: i64,
}

/// A deployment (`structs.Deployment`, `nomad/structs/deployment.go`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct Deployment {
    pub ID: String,
    pub Namespace: String,
    pub JobID: String,
    pub JobVersion: u64,
    pub JobModifyIndex: u64,
    pub JobSpecModifyIndex: u64,
    pub JobCreateIndex: u64,
    pub IsMultiregion: bool,
    pub TaskGroups: BTreeMap<String, DeploymentState>,
    pub Status: String,
    pub StatusDescription: String,
    pub EvalPriority: i64,
    pub CreateIndex: u64,
    pub ModifyIndex: u64,
    pub CreateTime: i64,
    pub ModifyTime: i64,
}

impl Deployment {
    /// `Active`: running, paused, pending, blocked, initializing (the sim uses running only).
    pub fn active(&self) -> bool {
        matches!(
            self.Status.as_str(),
            "running" | "paused" | "pending" | "blocked" | "initializing"
        )
    }

    /// `RequiresPromotion`: some group wants canaries and is not promoted.
    pub fn requires_promotion(&self) -> bool {
        self.TaskGroups
            .values()
            .any(|g| g.DesiredCanaries > 0 && !g.Promoted)
    }

    /// The running status description: waiting for a (manual or automatic) promotion, or not.
    pub fn running_description(&self) -> &'static str {
        if !self.requires_promotion() {
            "Deployment is running"
        } else if self
            .TaskGroups
            .values()
            .filter(|g| g.DesiredCanaries > 0)
            .all(|g| g.AutoPromote)
        {
            "Deployment is running pending automatic promotion"
        } else {
            "Deployment is running but requires manual promotion"
        }
    }
}

impl TaskGroup {
    /// `GetDisconnectLostAfter`: the group's `disconnect.lost_after` (or the older
    /// `max_client_disconnect`), ns; 0 = the allocations are lost when their node goes down.
    pub fn lost_after(&self) -> i64 {
        self.Disconnect
            .get("LostAfter")
            .and_then(Value::as_i64)
            .filter(|v| *v > 0)
            .or(self.MaxClientDisconnect)
            .unwrap_or(0)
    }

    /// `GetDisconnectStopTimeout` (`nomad/structs/structs.go`): the group's
    /// `disconnect.stop_on_client_after`, else the older `stop_after_client_disconnect`;
    /// `None` when neither is set. A client that has not heartbeated for this long stops the
    /// group's allocations (`client/heartbeatstop.go`, see [`crate::client`]).
    pub fn stop_on_client_after(&self) -> Option<std::time::Duration> {
        self.Disconnect
            .get("StopOnClientAfter")
            .and_then(Value::as_i64)
            .or(self.StopAfterClientDisconnect)
            .map(|ns| std::time::Duration::from_nanos(ns.max(0) as u64))
    }

    /// `Replace`: whether an `unknown` allocation is replaced while its node is disconnected
    /// (`disconnect.replace`, default true).
    pub fn replace_on_disconnect(&self) -> bool {
        self.Disconnect
            .get("Replace")
            .and_then(Value::as_bool)
            .unwrap_or(true)
    }

    /// A task's lifecycle `(hook, sidecar)`, `None` for a main task (or an unknown name).
    pub fn lifecycle_of(&self, task: &str) -> Option<(&str, bool)> {
        self.Tasks
            .iter()
            .find(|t| t.Name == task)
            .and_then(|t| t.Lifecycle.as_ref())
            .map(|l| (l.Hook.as_str(), l.Sidecar))
    }

    /// `disconnect.reconcile` (default `best_score`).
    pub fn reconcile_on_reconnect(&self) -> &str {
        self.Disconnect
            .get("Reconcile")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .unwrap_or("best_score")
    }
}

/// A job (`structs.Job`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct Job {
    pub Stop: bool,
    pub Region: String,
    pub Namespace: String,
    pub ID: String,
    pub ParentID: String,
    pub Name: String,
    pub Type: String,
    pub Priority: i64,
    pub AllAtOnce: bool,
    pub Datacenters: Vec<String>,
    pub NodePool: String,
    pub Constraints: Option<Vec<Constraint>>,
    pub Affinities: Value,
    pub Spreads: Value,
    pub TaskGroups: Vec<TaskGroup>,
    pub Update: Value,
    pub Multiregion: Value,
    pub Periodic: Value,
    pub ParameterizedJob: Value,
    pub Dispatched: bool,
    pub DispatchIdempotencyToken: String,
    pub Payload: Value,
    pub Meta: Option<BTreeMap<String, String>>,
    pub ConsulNamespace: String,
    pub VaultNamespace: String,
    pub NomadTokenID: String,
    pub Status: String,
    pub StatusDescription: String,
    pub Stable: bool,
    pub Version: u64,
    pub SubmitTime: i64,
    pub CreateIndex: u64,
    pub ModifyIndex: u64,
    pub JobModifyIndex: u64,
    pub UI: Value,
    pub VersionTag: Value,
}

fn update_default() -> Value {
    json!({"Stagger":30_000_000_000i64,"MaxParallel":1,"HealthCheck":"checks","MinHealthyTime":10_000_000_000i64,
        "HealthyDeadline":300_000_000_000i64,"ProgressDeadline":600_000_000_000i64,"AutoRevert":false,"AutoPromote":false,"Canary":0})
}

/// `base` with the fields `set` has (both JSON objects; a non-object `set` changes nothing).
fn overlay(mut base: Value, set: &Value) -> Value {
    if let (Some(b), Some(s)) = (base.as_object_mut(), set.as_object()) {
        for (k, v) in s {
            b.insert(k.clone(), v.clone());
        }
    }
    base
}

impl Job {
    /// Fills Nomad's defaults (`Job.Canonicalize` plus the server-side defaults applied at
    /// register): namespace "default", datacenters ["*"], node_pool "default", restart and
    /// reschedule policies by job type, kill timeout 5s, default identity, `Volumes[alias].Name`.
    pub fn canonicalize(&mut self, region: &str) {
        if self.Namespace.is_empty() {
            self.Namespace = "default".into();
        }
        if self.Name.is_empty() {
            self.Name = self.ID.clone();
        }
        if self.Type.is_empty() {
            self.Type = "service".into();
        }
        if self.Region.is_empty() || self.Region == "global" {
            self.Region = region.into();
        }
        if self.Priority == 0 {
            self.Priority = 50;
        }
        if self.Datacenters.is_empty() {
            self.Datacenters = vec!["*".into()];
        }
        if self.NodePool.is_empty() {
            self.NodePool = "default".into();
        }
        // `api/jobs.go` `Job.Canonicalize`: a service job without an `update` block gets the
        // default strategy; any other job keeps none (a system job then replaces every
        // allocation at once: `UpdateStrategy.Rolling` is false for the zero value).
        let is_service_like =
            self.Type == "service" || (self.Type == "system" && !self.Update.is_null());
        if self.Type == "system" && self.Update.is_null() {
            self.Update = json!({"Stagger":0,"MaxParallel":0,"HealthCheck":"","MinHealthyTime":0,
                "HealthyDeadline":0,"ProgressDeadline":0,"AutoRevert":false,"AutoPromote":false,"Canary":0});
        }
        if is_service_like {
            let defaults = json!({"Stagger":30_000_000_000i64,"MaxParallel":1,"HealthCheck":"","MinHealthyTime":0,
                "HealthyDeadline":0,"ProgressDeadline":0,"AutoRevert":false,"AutoPromote":false,"Canary":0});
            self.Update = overlay(defaults, &self.Update);
        }
        let job_type = self.Type.clone();
        for tg in &mut self.TaskGroups {
            if tg.Count == 0 && job_type != "system" {
                tg.Count = 1;
            }
            if job_type == "system" {
                tg.Count = 1;
            }
            if job_type == "service" {
                // `TaskGroup.Canonicalize` (api/tasks.go): the job's update block merged under
                // the group's (the jobspec parser does that), then the defaults under both.
                tg.Update = overlay(update_default(), &tg.Update);
            }
            // `DisconnectStrategy.Canonicalize`: replace = true, reconcile = best_score.
            if let Some(d) = tg.Disconnect.as_object_mut() {
                d.entry("Replace").or_insert(json!(true));
                d.entry("Reconcile").or_insert(json!("best_score"));
                d.entry("LostAfter").or_insert(json!(0));
                d.entry("StopOnClientAfter").or_insert(Value::Null);
            }
            if tg.Migrate.is_null() && job_type == "service" {
                tg.Migrate = json!({"MaxParallel":1,"HealthCheck":"checks","MinHealthyTime":10_000_000_000i64,"HealthyDeadline":300_000_000_000i64});
            }
            let default_rp = if job_type == "batch" || job_type == "sysbatch" {
                RestartPolicy::batch_default()
            } else {
                RestartPolicy::service_default()
            };
            let rp = match tg.RestartPolicy.take() {
                None => default_rp,
                Some(p) => default_rp.merged(&p),
            };
            tg.RestartPolicy = Some(rp.clone());
            if tg.ReschedulePolicy.is_none() {
                tg.ReschedulePolicy = match job_type.as_str() {
                    "service" => Some(ReschedulePolicy::service_default()),
                    "batch" => Some(ReschedulePolicy::batch_default()),
                    _ => None,
                };
            }
            if tg.EphemeralDisk.is_null() {
                tg.EphemeralDisk = json!({"Sticky":false,"SizeMB":300,"Migrate":false});
            }
            if let Some(vols) = &mut tg.Volumes {
                for (alias, v) in vols.iter_mut() {
                    if v.Name.is_empty() {
                        v.Name = alias.clone();
                    }
                }
            }
            for t in &mut tg.Tasks {
                if t.KillTimeout == 0 {
                    t.KillTimeout = 5_000_000_000;
                }
                if t.LogConfig.is_null() {
                    t.LogConfig = json!({"MaxFiles":10,"MaxFileSizeMB":10,"Disabled":false});
                }
                // `Task.Canonicalize`: the group's policy with the task's set fields over it.
                t.RestartPolicy = Some(match t.RestartPolicy.take() {
                    None => rp.clone(),
                    Some(p) => rp.merged(&p),
                });
                if let Some(l) = &t.Lifecycle {
                    if l.Hook.is_empty() {
                        t.Lifecycle = None;
                    }
                }
                if let Some(vms) = &mut t.VolumeMounts {
                    for vm in vms.iter_mut() {
                        if vm.PropagationMode.is_empty() {
                            vm.PropagationMode = "private".into();
                        }
                    }
                }
                let mut ident = t.Identity.take().unwrap_or_default();
                ident.Name = "default".into();
                ident.Audience = vec!["nomadproject.io".into()];
                t.Identity = Some(ident);
                if let Some(ids) = &mut t.Identities {
                    if ids.is_empty() {
                        t.Identities = None;
                    }
                }
            }
        }
    }

    /// Group by name.
    pub fn group(&self, name: &str) -> Option<&TaskGroup> {
        self.TaskGroups.iter().find(|g| g.Name == name)
    }

    /// Spec equality ignoring server-managed fields (status, version, indexes, submit time).
    pub fn same_spec(&self, other: &Job) -> bool {
        let strip = |j: &Job| {
            let mut j = j.clone();
            j.Status.clear();
            j.StatusDescription.clear();
            j.Stable = false;
            j.Version = 0;
            j.SubmitTime = 0;
            j.CreateIndex = 0;
            j.ModifyIndex = 0;
            j.JobModifyIndex = 0;
            j
        };
        strip(self) == strip(other)
    }
}

/// `DesiredTransition` with `*bool` fields; omitted from an Allocation when all are nil.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct DesiredTransition {
    pub Migrate: Option<bool>,
    pub Reschedule: Option<bool>,
    pub ForceReschedule: Option<bool>,
    pub NoShutdownDelay: Option<bool>,
    pub MigrateDisablePlacement: Option<bool>,
}

impl DesiredTransition {
    fn is_empty(&self) -> bool {
        *self == DesiredTransition::default()
    }
}

/// A task event (`structs.TaskEvent`), all fields present on the wire.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct TaskEvent {
    pub Type: String,
    pub Time: i64,
    pub Message: String,
    pub DisplayMessage: String,
    pub Details: BTreeMap<String, String>,
    pub FailsTask: bool,
    pub RestartReason: String,
    pub SetupError: String,
    pub DriverError: String,
    pub ExitCode: i64,
    pub Signal: i64,
    pub KillTimeout: i64,
    pub KillError: String,
    pub KillReason: String,
    pub StartDelay: i64,
    pub DownloadError: String,
    pub ValidationError: String,
    pub DiskLimit: i64,
    pub FailedSibling: String,
    pub VaultError: String,
    pub TaskSignalReason: String,
    pub TaskSignal: String,
    pub DriverMessage: String,
    pub GenericSource: String,
}

impl TaskEvent {
    /// A new event of `kind` stamped now.
    pub fn new(kind: &str) -> Self {
        TaskEvent {
            Type: kind.into(),
            Time: crate::clock::now_ns(),
            ..Default::default()
        }
    }
}

/// Per-task client state (`structs.TaskState`); zero times are `null`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct TaskState {
    pub State: String,
    pub Failed: bool,
    pub Restarts: u64,
    pub LastRestart: Option<String>,
    pub StartedAt: Option<String>,
    pub FinishedAt: Option<String>,
    pub Events: Vec<TaskEvent>,
    pub Paused: String,
}

impl TaskState {
    /// Successful = dead and not failed.
    pub fn successful(&self) -> bool {
        self.State == "dead" && !self.Failed
    }
}

/// `getClientStatus` (`client/allocrunner/alloc_runner.go`): status and description from TaskStates.
pub fn client_status(states: &BTreeMap<String, TaskState>) -> (&'static str, &'static str) {
    let (mut pending, mut running, mut dead, mut failed) = (false, false, false, false);
    for s in states.values() {
        match s.State.as_str() {
            "running" => running = true,
            "pending" => pending = true,
            "dead" => {
                if s.Failed {
                    failed = true
                } else {
                    dead = true
                }
            }
            _ => {}
        }
    }
    if failed {
        ("failed", "Failed tasks")
    } else if running {
        ("running", "Tasks are running")
    } else if pending {
        ("pending", "No tasks have started")
    } else if dead {
        ("complete", "All tasks have completed")
    } else {
        ("pending", "No tasks have started")
    }
}

/// An allocation (`structs.Allocation`); every top-level field is omitempty.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
#[serde(default)]
pub struct Allocation {
    #[serde(skip_serializing_if = "is_empty_str")]
    pub ID: String,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub Namespace: String,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub EvalID: String,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub Name: String,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub NodeID: String,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub NodeName: String,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub JobID: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub Job: Option<Box<Job>>,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub TaskGroup: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub Resources: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub SharedResources: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub TaskResources: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub AllocatedResources: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub Metrics: Option<Value>,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub DesiredStatus: String,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub DesiredDescription: String,
    #[serde(skip_serializing_if = "DesiredTransition::is_empty")]
    pub DesiredTransition: DesiredTransition,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub ClientStatus: String,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub ClientDescription: String,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub TaskStates: BTreeMap<String, TaskState>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub AllocStates: Option<Value>,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub PreviousAllocation: String,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub NextAllocation: String,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub DeploymentID: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub DeploymentStatus: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub RescheduleTracker: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub NetworkStatus: Option<Value>,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub FollowupEvalID: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub PreemptedAllocations: Option<Vec<String>>,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub PreemptedByAllocation: String,
    #[serde(skip_serializing_if = "is_empty_str")]
    pub SigningKeyID: String,
    #[serde(skip_serializing_if = "is_zero_u64")]
    pub CreateIndex: u64,
    #[serde(skip_serializing_if = "is_zero_u64")]
    pub ModifyIndex: u64,
    #[serde(skip_serializing_if = "is_zero_u64")]
    pub AllocModifyIndex: u64,
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub CreateTime: i64,
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub ModifyTime: i64,
    /// `SignedIdentities` is `json:"-"` in Nomad: task name → default identity JWT.
    #[serde(skip)]
    pub signed_identities: BTreeMap<String, String>,
    /// When the allocation last turned `unknown` (ns; Nomad reads it from `AllocStates`,
    /// `LastUnknown`).
    #[serde(skip)]
    pub unknown_since: Option<i64>,
}

impl Allocation {
    /// Client-terminal: complete, failed or lost.
    pub fn client_terminal(&self) -> bool {
        matches!(self.ClientStatus.as_str(), "complete" | "failed" | "lost")
    }
    /// Server-terminal: DesiredStatus stop or evict.
    pub fn server_terminal(&self) -> bool {
        matches!(self.DesiredStatus.as_str(), "stop" | "evict")
    }
    /// Either terminal.
    pub fn terminal(&self) -> bool {
        self.client_terminal() || self.server_terminal()
    }
    /// Whether the allocation was placed as a canary (`DeploymentStatus.Canary`).
    pub fn is_canary(&self) -> bool {
        self.DeploymentStatus
            .as_ref()
            .and_then(|d| d.get("Canary"))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }
    /// The deployment health the client reported: `Some(true)` healthy, `Some(false)`
    /// unhealthy, `None` not yet set (`DeploymentStatus.Healthy`).
    pub fn healthy(&self) -> Option<bool> {
        self.DeploymentStatus
            .as_ref()
            .and_then(|d| d.get("Healthy"))
            .and_then(Value::as_bool)
    }
    /// Index part of the name, `orders.app[3]` → 3.
    pub fn name_index(&self) -> u64 {
        self.Name
            .rfind('[')
            .and_then(|i| self.Name[i + 1..].trim_end_matches(']').parse().ok())
            .unwrap_or(0)
    }

    /// `AllocListStub` JSON (not omitempty; `DesiredTransition` and `RescheduleTracker` present).
    /// `AllocatedResources` is `omitempty` and only filled with `resources=true`
    /// (`Allocation.Stub` with `AllocStubFields`, `nomad/structs/alloc.go`): see [`Self::stub_with`].
    pub fn stub(&self) -> Value {
        self.stub_with(false, true)
    }

    /// Stub with the `resources` / `task_states` field selection of `GET /v1/allocations`.
    pub fn stub_with(&self, resources: bool, task_states: bool) -> Value {
        let (job_type, job_version) = self
            .Job
            .as_ref()
            .map(|j| (j.Type.clone(), j.Version))
            .unwrap_or_default();
        let mut stub = json!({
            "ID": self.ID, "EvalID": self.EvalID, "Name": self.Name, "Namespace": self.Namespace,
            "NodeID": self.NodeID, "NodeName": self.NodeName, "JobID": self.JobID,
            "JobType": job_type, "JobVersion": job_version, "TaskGroup": self.TaskGroup,
            "AllocatedResources": self.AllocatedResources,
            "DesiredStatus": self.DesiredStatus, "DesiredDescription": self.DesiredDescription,
            "ClientStatus": self.ClientStatus, "ClientDescription": self.ClientDescription,
            "DesiredTransition": self.DesiredTransition,
            "TaskStates": if self.TaskStates.is_empty() || !task_states { Value::Null } else { json!(self.TaskStates) },
            "DeploymentStatus": self.DeploymentStatus, "FollowupEvalID": self.FollowupEvalID,
            "NextAllocation": self.NextAllocation,
            "RescheduleTracker": self.RescheduleTracker, "PreemptedAllocations": self.PreemptedAllocations,
            "PreemptedByAllocation": self.PreemptedByAllocation,
            "CreateIndex": self.CreateIndex, "ModifyIndex": self.ModifyIndex,
            "CreateTime": self.CreateTime, "ModifyTime": self.ModifyTime,
        });
        if !resources {
            if let Some(o) = stub.as_object_mut() {
                o.remove("AllocatedResources");
            }
        }
        stub
    }
}

/// Entry of `Node.HostVolumes` (`structs.ClientHostVolumeConfig`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct ClientHostVolumeConfig {
    pub Name: String,
    pub Path: String,
    pub ReadOnly: bool,
    pub ID: String,
}

/// A client node (`structs.Node`, sanitized: `SecretID` empty).
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
#[serde(default)]
pub struct Node {
    pub ID: String,
    pub SecretID: String,
    pub Datacenter: String,
    pub Name: String,
    pub HTTPAddr: String,
    pub TLSEnabled: bool,
    pub Attributes: BTreeMap<String, String>,
    pub NodeResources: Value,
    pub ReservedResources: Value,
    pub Resources: Value,
    pub Reserved: Value,
    pub Links: Value,
    pub Meta: BTreeMap<String, String>,
    pub NodeClass: String,
    pub NodePool: String,
    pub ComputedClass: String,
    pub DrainStrategy: Option<Value>,
    pub SchedulingEligibility: String,
    pub Status: String,
    pub StatusDescription: String,
    pub StatusUpdatedAt: i64,
    pub Events: Vec<Value>,
    pub Drivers: BTreeMap<String, Value>,
    pub CSIControllerPlugins: Value,
    pub CSINodePlugins: Value,
    pub HostVolumes: BTreeMap<String, ClientHostVolumeConfig>,
    pub HostNetworks: Value,
    pub LastDrain: Value,
    pub CreateIndex: u64,
    pub ModifyIndex: u64,
}

impl Node {
    /// JSON as Nomad's `nodeExt` encodes it (extra `Drain` bool after `DrainStrategy`).
    pub fn to_json(&self) -> Value {
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        if let Value::Object(m) = &mut v {
            let mut out = Map::new();
            for (k, val) in std::mem::take(m) {
                let is_ds = k == "DrainStrategy";
                out.insert(k, val);
                if is_ds {
                    out.insert("Drain".into(), json!(self.DrainStrategy.is_some()));
                }
            }
            *m = out;
        }
        v
    }
    /// `NodeListStub` JSON (`GET /v1/nodes`).
    pub fn stub(&self) -> Value {
        json!({
            "Address": self.HTTPAddr.split(':').next().unwrap_or(""),
            "ID": self.ID, "Attributes": Value::Null, "Datacenter": self.Datacenter, "Name": self.Name,
            "NodeClass": self.NodeClass, "NodePool": self.NodePool,
            "Version": self.Attributes.get("nomad.version").cloned().unwrap_or_default(),
            "Drain": self.DrainStrategy.is_some(), "SchedulingEligibility": self.SchedulingEligibility,
            "Status": self.Status, "StatusDescription": self.StatusDescription,
            "Drivers": self.Drivers, "HostVolumes": self.HostVolumes, "NodeResources": Value::Null,
            "ReservedResources": Value::Null, "LastDrain": self.LastDrain,
            "CreateIndex": self.CreateIndex, "ModifyIndex": self.ModifyIndex,
        })
    }
}

/// Capability entry of a host volume.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct HostVolumeCapability {
    pub AttachmentMode: String,
    pub AccessMode: String,
}

/// A dynamic host volume (`structs.HostVolume`).
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
#[serde(default)]
pub struct HostVolume {
    pub Namespace: String,
    pub ID: String,
    pub Name: String,
    pub PluginID: String,
    pub NodePool: String,
    pub NodeID: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub Constraints: Option<Vec<Constraint>>,
    pub RequestedCapacityMinBytes: i64,
    pub RequestedCapacityMaxBytes: i64,
    pub CapacityBytes: i64,
    pub RequestedCapabilities: Vec<HostVolumeCapability>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub Parameters: Option<BTreeMap<String, String>>,
    pub HostPath: String,
    pub State: String,
    pub CreateIndex: u64,
    pub CreateTime: i64,
    pub ModifyIndex: u64,
    pub ModifyTime: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub Allocations: Option<Vec<Value>>,
}

impl HostVolume {
    /// `HostVolumeStub` JSON.
    pub fn stub(&self) -> Value {
        json!({
            "Namespace": self.Namespace, "ID": self.ID, "Name": self.Name, "PluginID": self.PluginID,
            "NodePool": self.NodePool, "NodeID": self.NodeID, "CapacityBytes": self.CapacityBytes,
            "State": self.State, "CreateIndex": self.CreateIndex, "CreateTime": self.CreateTime,
            "ModifyIndex": self.ModifyIndex, "ModifyTime": self.ModifyTime,
        })
    }
}

/// Variable lock (`structs.VariableLock`); TTL and LockDelay in ns.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct VariableLock {
    pub ID: String,
    pub TTL: Value,
    pub LockDelay: Value,
}

/// A decrypted variable (`structs.VariableDecrypted`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(default)]
pub struct Variable {
    pub Namespace: String,
    pub Path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub Lock: Option<VariableLock>,
    pub CreateIndex: u64,
    pub CreateTime: i64,
    pub ModifyIndex: u64,
    pub ModifyTime: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub Items: Option<BTreeMap<String, String>>,
}

impl Variable {
    /// `VariableMetadata` (no Items).
    pub fn metadata(&self) -> Variable {
        Variable {
            Items: None,
            ..self.clone()
        }
    }
}

/// One event (`structs.Event`), fields in wire order.
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
#[serde(default)]
pub struct Event {
    pub Topic: String,
    pub Type: String,
    pub Key: String,
    pub Namespace: String,
    pub FilterKeys: Option<Vec<String>>,
    pub Index: u64,
    pub Payload: Value,
}

/// One NDJSON frame (`structs.Events`).
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct Frame {
    pub Index: u64,
    pub Events: Vec<Event>,
}
