//! Prometheus metrics: the registry, the typed update API the agent calls, and the scrape
//! endpoint (`GET /metrics`, OpenMetrics text), off unless `--metrics-addr` is given.
//!
//! Names follow Prometheus conventions (`dhv_binder_` prefix, base units, `_total` on
//! counters, `_seconds` on durations). Label values come from closed sets (operations,
//! outcomes, states, faults) or from plugin IDs (bounded by the plugin directory): never
//! from allocation IDs or error text, and volume names only in the per-volume families of
//! `volume_stats` (kubelet's `kubelet_volume_stats_*` carry them too; bounded by the
//! volumes this node has). See docs/operations/README.md for the list,
//! docs/grafana-dashboard.json and docs/prometheus-alerts.yml for a dashboard and alerts.

use crate::cluster::trust::RefusedReason;
use crate::nomad::watch::Health;
use crate::storage::plugin::{Fingerprint, Operation, PluginError};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod endpoint;
mod process;
mod volume_stats;

pub use endpoint::{
    bind, serve, CLASSIC_CONTENT_TYPE, CONTENT_TYPE, HEADER_READ_TIMEOUT, MAX_CONNECTIONS,
    MAX_CONNECTION_LIFE, MAX_PER_PEER,
};
use process::ProcessCollector;
pub use process::{heap_bytes, process_figures, ProcessFigures};
use volume_stats::VolumeStatsCollector;
pub use volume_stats::{Unused, VolumeFigures, VolumeStatsSource};

/// The endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot listen for metrics on {addr}: {source}; pick a free address with --metrics-addr (or leave it unset to turn metrics off)")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// How a plugin call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Ok,
    /// Failed with an answer (non-zero exit, bad output, refused).
    Error,
    /// Killed at the timeout: its effect is uncertain.
    Timeout,
}

impl Outcome {
    /// The outcome of a plugin call's result.
    pub fn of<T>(r: &Result<T, PluginError>) -> Self {
        Self::of_error(r.as_ref().err())
    }

    /// The outcome of a plugin call that failed with `error` (`None`: it succeeded).
    pub fn of_error(error: Option<&PluginError>) -> Self {
        match error {
            None => Outcome::Ok,
            Some(e) if e.is_uncertain() => Outcome::Timeout,
            Some(_) => Outcome::Error,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Error => "error",
            Outcome::Timeout => "timeout",
        }
    }
}

/// How a prestart caller's publish wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WaitOutcome {
    Published,
    Failed,
    TimedOut,
}

impl WaitOutcome {
    fn as_str(self) -> &'static str {
        match self {
            WaitOutcome::Published => "published",
            WaitOutcome::Failed => "failed",
            WaitOutcome::TimedOut => "timeout",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginCallLabels {
    plugin: String,
    operation: &'static str,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeftoverLabels {
    plugin: String,
    operation: &'static str,
    fate: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    call: &'static str,
}

/// `dhv_binder_nomad_retries_total{call}`: the failures of each loop that retries a call to
/// Nomad after a backoff ([`crate::nomad::retry::Call`], counted by [`crate::nomad::retry::FailureLog`]),
/// read at each scrape.
#[derive(Debug)]
struct NomadRetriesCollector;

impl prometheus_client::collector::Collector for NomadRetriesCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        let mut family = encoder.encode_descriptor(
            "nomad_retries",
            "Failed calls to Nomad that a loop tries again after a backoff, by call (agent_self, allocation_watch, record_watch, change_marker, node_record, placeholder_list, placeholder_change, allocation_restart)",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for call in crate::nomad::retry::Call::ALL {
            let labels = CallLabels { call: call.name() };
            ConstCounter::new(call.retries()).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FaultLabels {
    fault: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginOnly {
    plugin: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginLabels {
    plugin: String,
    deferred: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn plugin_buckets() -> Histogram {
    // 10 ms to ~80 s: fingerprints are fast, FUSE and iSCSI publishes take seconds.
    Histogram::new(exponential_buckets(0.01, 2.0, 14))
}

fn wait_buckets() -> Histogram {
    // 50 ms to ~7 min (the longest a publish call may block is 10 min).
    Histogram::new(exponential_buckets(0.05, 2.0, 14))
}

const WATCH_STATES: [&str; 4] = ["listing", "polling", "streaming", "disconnected"];
const MOUNT_STATES: [&str; 4] = ["publishing", "published", "unpublishing", "dead"];
const CLAIM_STATES: [&str; 4] = ["held", "fenced", "lost", "waiting"];

/// This node's single-node claims by state, for [`Metrics::set_claims`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClaimCounts {
    /// Held and renewed in time.
    pub held: usize,
    /// Not renewed before the lease was about to end: the volume was made unwritable here.
    pub fenced: usize,
    /// A renewal found the lock gone: the volume is being unpublished here.
    pub lost: usize,
    /// Volumes whose acquire was refused (another node holds the claim) or failed, not held
    /// here: a publish waits for them.
    pub waiting: usize,
}

struct Inner {
    registry: Registry,
    /// The process's own figures, unprefixed as every Prometheus client names them.
    process: Registry,
    plugin_call: HistogramFamily<PluginCallLabels>,
    plugin_leftovers: Family<LeftoverLabels, Counter>,
    publish_wait: HistogramFamily<OutcomeLabels>,
    pending: Gauge,
    uncertain: Gauge,
    waiters: Gauge,
    claim_waits: Counter,
    claim_waiters: Gauge,
    claim_wait_oldest: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// When the oldest current claim wait began (its age is read at each scrape).
    claim_wait_since: Mutex<Option<std::time::Instant>>,
    claim_losses: Counter,
    claim_fences: Counter,
    claims: Family<StateLabels, Gauge>,
    records_refused: Family<ReasonLabels, Counter>,
    mounts: Family<StateLabels, Gauge>,
    mount_deaths: Counter,
    mount_table_reads: Counter,
    watch_state: Family<StateLabels, Gauge>,
    watch_faults: Family<FaultLabels, Counter>,
    watch_list_allocations: Gauge,
    watch_list_bytes: Gauge,
    journal_write: Histogram,
    journal_write_failing: Gauge,
    volumes_frozen: Gauge,
    journal_write_failures: Counter,
    allocations: Gauge,
    volumes: Gauge,
    volumes_served: Gauge,
    plugins: Family<PluginLabels, Gauge>,
    plugin_attached: Family<PluginOnly, Gauge>,
    plugin_max_volumes: Family<PluginOnly, Gauge>,
    heap_allocated: Gauge,
    heap_resident: Gauge,
    last_watch: Mutex<&'static str>,
    volume_stats: VolumeStatsCollector,
}

/// A watch fault's label value (its kebab-case name).
fn fault_name(f: crate::nomad::watch::Fault) -> String {
    serde_json::to_value(f)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}

/// The agent's metrics. Cheap to clone (one shared registry); every method is safe to
/// call from any task.
#[derive(Clone)]
pub struct Metrics(Arc<Inner>);

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every metric registered (and `dhv_binder_build_info`).
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("dhv_binder");
        let plugin_call: HistogramFamily<PluginCallLabels> =
            Family::new_with_constructor(plugin_buckets);
        r.register_with_unit(
            "plugin_call_duration",
            "Plugin calls by plugin, operation and outcome (ok, error, timeout)",
            Unit::Seconds,
            plugin_call.clone(),
        );
        let plugin_leftovers = Family::<LeftoverLabels, Counter>::default();
        r.register(
            "plugin_leftover_processes",
            "Processes plugin calls left behind when they ended, by plugin, operation and fate (killed: in the call's process group, or holding its output outside it; left: a publish or unpublish helper outside the group holding its output)",
            plugin_leftovers.clone(),
        );
        let publish_wait: HistogramFamily<OutcomeLabels> =
            Family::new_with_constructor(wait_buckets);
        r.register_with_unit(
            "publish_wait_duration",
            "How long prestart callers waited for their volumes, by outcome (published, failed, timeout)",
            Unit::Seconds,
            publish_wait.clone(),
        );
        let pending = Gauge::default();
        r.register(
            "operations_pending",
            "Publish and unpublish intents not yet done (running or waiting to be retried), and creates and deletes running",
            pending.clone(),
        );
        let uncertain = Gauge::default();
        r.register(
            "operations_uncertain",
            "Volumes whose last plugin call timed out: its effect is unknown until the next call",
            uncertain.clone(),
        );
        let waiters = Gauge::default();
        r.register(
            "publish_waiters",
            "Prestart callers waiting for a publish",
            waiters.clone(),
        );
        let claim_waits = Counter::default();
        r.register(
            "claim_waits",
            "Allocations that had to wait for a single-node claim another node holds, each counted once when its wait began",
            claim_waits.clone(),
        );
        let claim_waiters = Gauge::default();
        r.register(
            "claim_waiters",
            "Allocations waiting now for a single-node claim another node holds",
            claim_waiters.clone(),
        );
        let claim_wait_oldest = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        r.register_with_unit(
            "claim_wait_oldest",
            "Age of the oldest current claim wait (0 when none), read at each scrape",
            Unit::Seconds,
            claim_wait_oldest.clone(),
        );
        let claim_losses = Counter::default();
        r.register(
            "claim_losses",
            "Claims this node held and lost (renewal refused or lapsed)",
            claim_losses.clone(),
        );
        let claim_fences = Counter::default();
        r.register(
            "claim_fences",
            "Volumes this node fenced on itself: a claim's lease was about to end without a renewal",
            claim_fences.clone(),
        );
        let claims = Family::<StateLabels, Gauge>::default();
        r.register(
            "claims",
            "This node's single-node claims by state (held, fenced, lost), and volumes waiting for a claim another node holds (waiting)",
            claims.clone(),
        );
        let records_refused = Family::<ReasonLabels, Counter>::default();
        r.register(
            "records_refused",
            "Volume and snapshot records this agent read and refused to act on, by reason (malformed, unsigned, malformed-signature, untrusted-key, bad-signature, unsigned-delete; marker-line: a line of the change marker that names no record, each line once); each version of a record once",
            records_refused.clone(),
        );
        let mounts = Family::<StateLabels, Gauge>::default();
        r.register(
            "mounts",
            "Volumes on this node by mount state (publishing, published, unpublishing, dead)",
            mounts.clone(),
        );
        let mount_deaths = Counter::default();
        r.register(
            "mount_deaths",
            "Published mounts found dead by the health probes",
            mount_deaths.clone(),
        );
        let mount_table_reads = Counter::default();
        r.register(
            "mount_table_reads",
            "Readings of the host's mount table (/proc/1/mountinfo) not answered from the last one: each costs the kernel's formatting and the agent's parsing of every mount on the node",
            mount_table_reads.clone(),
        );
        let watch_state = Family::<StateLabels, Gauge>::default();
        r.register(
            "watch_state",
            "1 for the allocation watch's current state (listing, polling, streaming, disconnected)",
            watch_state.clone(),
        );
        let watch_faults = Family::<FaultLabels, Counter>::default();
        r.register(
            "watch_faults",
            "Times the allocation watch disconnected, by fault",
            watch_faults.clone(),
        );
        let watch_list_allocations = Gauge::default();
        r.register(
            "watch_list_allocations",
            "Allocations in the last full list of the node's allocations (GET /v1/node/:id/allocations), terminal ones included: poll mode reads such a list at every answer",
            watch_list_allocations.clone(),
        );
        let watch_list_bytes = Gauge::default();
        r.register_with_unit(
            "watch_list",
            "Size of the last full list of the node's allocations, with their Jobs: what poll mode reads at every answer",
            Unit::Bytes,
            watch_list_bytes.clone(),
        );
        let journal_write = Histogram::new(exponential_buckets(0.0005, 2.0, 14));
        r.register_with_unit(
            "journal_write_duration",
            "Journal writes (write, fsync, rename, fsync of the directory)",
            Unit::Seconds,
            journal_write.clone(),
        );
        let allocations = Gauge::default();
        r.register(
            "allocations",
            "Allocations of this node the agent knows",
            allocations.clone(),
        );
        let volumes = Gauge::default();
        r.register(
            "volumes",
            "Volume records known cluster-wide",
            volumes.clone(),
        );
        let volumes_served = Gauge::default();
        r.register(
            "volumes_served",
            "Volume records this node can serve (it has their plugin, in their node pool)",
            volumes_served.clone(),
        );
        let plugins = Family::<PluginLabels, Gauge>::default();
        r.register(
            "plugin_up",
            "1 when a plugin's fingerprint succeeded, 0 when it failed",
            plugins.clone(),
        );
        let plugin_attached = Family::<PluginOnly, Gauge>::default();
        r.register(
            "plugin_attached_volumes",
            "Volumes of a plugin with an attach limit that are attached on this node",
            plugin_attached.clone(),
        );
        let plugin_max_volumes = Family::<PluginOnly, Gauge>::default();
        r.register(
            "plugin_max_volumes",
            "A plugin's attach limit on this node (fingerprint max_volumes or --max-volumes)",
            plugin_max_volumes.clone(),
        );
        let heap_allocated = Gauge::default();
        r.register_with_unit(
            "heap_allocated",
            "Bytes the agent's allocator has handed out and not had back (jemalloc stats.allocated, read at each scrape)",
            Unit::Bytes,
            heap_allocated.clone(),
        );
        let heap_resident = Gauge::default();
        r.register_with_unit(
            "heap_resident",
            "Bytes of the allocator's pages resident in memory: heap, metadata, freed pages not yet returned (jemalloc stats.resident, read at each scrape)",
            Unit::Bytes,
            heap_resident.clone(),
        );
        r.register(
            "build",
            "The agent's version",
            Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        for s in WATCH_STATES {
            watch_state.get_or_create(&StateLabels { state: s }).set(0);
        }
        for s in MOUNT_STATES {
            mounts.get_or_create(&StateLabels { state: s }).set(0);
        }
        for s in CLAIM_STATES {
            claims.get_or_create(&StateLabels { state: s }).set(0);
        }
        for r in RefusedReason::ALL {
            let _ = records_refused.get_or_create(&ReasonLabels { reason: r.as_str() });
        }
        // Closed label sets are exported from the first scrape, at 0 (a panel or an alert
        // on them shows 0, not "No data", until the first fault or wait).
        {
            use crate::nomad::watch::Fault;
            for f in [
                Fault::AuthFailed,
                Fault::Unreachable,
                Fault::NoLeader,
                Fault::ServerError,
                Fault::BadAnswer,
                Fault::ClosedByServer,
                Fault::Stalled,
                Fault::IndexReset,
                Fault::NodeUnknown,
            ] {
                let _ = watch_faults.get_or_create(&FaultLabels {
                    fault: fault_name(f),
                });
            }
        }
        for o in [
            WaitOutcome::Published,
            WaitOutcome::Failed,
            WaitOutcome::TimedOut,
        ] {
            let _ = publish_wait.get_or_create(&OutcomeLabels {
                outcome: o.as_str(),
            });
        }
        let journal_write_failing = Gauge::default();
        r.register(
            "journal_write_failing",
            "1 while the agent's journal cannot be written (state disk full or failing): new publishes and unpublishes wait; 0 otherwise",
            journal_write_failing.clone(),
        );
        let journal_write_failures = Counter::default();
        r.register(
            "journal_write_failures",
            "Journal writes that failed (retried about once a second while failing)",
            journal_write_failures.clone(),
        );
        let volumes_frozen = Gauge::default();
        r.register(
            "volumes_frozen",
            "Volumes a freezing storage operation of this node (a snapshot_create given the mount) may hold frozen now, and volumes whose thaw afterwards failed; their tasks' writes wait while frozen",
            volumes_frozen.clone(),
        );
        r.register_collector(Box::new(NomadRetriesCollector));
        let volume_stats = VolumeStatsCollector::default();
        r.register_collector(Box::new(volume_stats.clone()));
        let mut process = Registry::default();
        process.register_collector(Box::new(ProcessCollector));
        Self(Arc::new(Inner {
            process,
            registry: r,
            plugin_call,
            plugin_leftovers,
            publish_wait,
            pending,
            uncertain,
            waiters,
            claim_waits,
            claim_waiters,
            claim_wait_oldest,
            claim_wait_since: Mutex::new(None),
            claim_losses,
            claim_fences,
            claims,
            records_refused,
            mounts,
            mount_deaths,
            mount_table_reads,
            watch_state,
            watch_faults,
            watch_list_allocations,
            watch_list_bytes,
            journal_write,
            journal_write_failing,
            journal_write_failures,
            volumes_frozen,
            allocations,
            volumes,
            volumes_served,
            plugins,
            plugin_attached,
            plugin_max_volumes,
            heap_allocated,
            heap_resident,
            last_watch: Mutex::new(""),
            volume_stats,
        }))
    }

    /// One plugin call finished after `elapsed`.
    pub fn plugin_call(&self, plugin: &str, op: Operation, outcome: Outcome, elapsed: Duration) {
        self.0
            .plugin_call
            .get_or_create(&PluginCallLabels {
                plugin: plugin.to_string(),
                operation: op.as_str(),
                outcome: outcome.as_str(),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// A plugin call left `n` processes behind, killed or left running (`fate`).
    pub fn plugin_leftovers(
        &self,
        plugin: &str,
        op: Operation,
        fate: crate::storage::plugin::LeftoverFate,
        n: usize,
    ) {
        self.0
            .plugin_leftovers
            .get_or_create(&LeftoverLabels {
                plugin: plugin.to_string(),
                operation: op.as_str(),
                fate: fate.as_str(),
            })
            .inc_by(n as u64);
    }

    /// A prestart caller's publish call was answered after `elapsed`.
    pub fn publish_wait(&self, outcome: WaitOutcome, elapsed: Duration) {
        self.0
            .publish_wait
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .observe(elapsed.as_secs_f64());
    }

    /// The work in hand: steps planned or running, uncertain calls, waiting callers.
    pub fn set_pending(&self, pending: usize, uncertain: usize, waiters: usize) {
        self.0.pending.set(pending as i64);
        self.0.uncertain.set(uncertain as i64);
        self.0.waiters.set(waiters as i64);
    }

    /// A journal write ended: ok, or failed (the failing gauge follows the last write).
    pub fn journal_write_result(&self, ok: bool) {
        self.0.journal_write_failing.set(i64::from(!ok));
        if !ok {
            self.0.journal_write_failures.inc();
        }
    }

    /// Volumes a freezing operation may hold frozen now.
    pub fn set_frozen(&self, volumes: usize) {
        self.0.volumes_frozen.set(volumes as i64);
    }

    /// Claim waits: `begun` allocations started waiting for another node's claim since the
    /// last call, `current` wait now, the oldest since `oldest`.
    pub fn claim_waits(&self, begun: u64, current: usize, oldest: Option<std::time::Instant>) {
        self.0.claim_waits.inc_by(begun);
        self.0
            .claim_waiters
            .set(i64::try_from(current).unwrap_or(i64::MAX));
        if let Ok(mut since) = self.0.claim_wait_since.lock() {
            *since = oldest;
        }
    }

    /// A held claim was lost.
    pub fn claim_lost(&self) {
        self.0.claim_losses.inc();
    }

    /// A volume was fenced on this node (its claim's lease was about to end).
    pub fn claim_fenced(&self) {
        self.0.claim_fences.inc();
    }

    /// This node's claims by state.
    pub fn set_claims(&self, c: ClaimCounts) {
        for (s, n) in CLAIM_STATES
            .iter()
            .zip([c.held, c.fenced, c.lost, c.waiting])
        {
            self.0
                .claims
                .get_or_create(&StateLabels { state: s })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// A watcher read a volume or snapshot record and refused it.
    pub fn record_refused(&self, reason: RefusedReason) {
        self.0
            .records_refused
            .get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            })
            .inc();
    }

    /// Mounts on this node by state (`dead`: found dead by the probes, not yet republished).
    pub fn set_mounts(
        &self,
        publishing: usize,
        published: usize,
        unpublishing: usize,
        dead: usize,
    ) {
        for (s, n) in MOUNT_STATES
            .iter()
            .zip([publishing, published, unpublishing, dead])
        {
            self.0
                .mounts
                .get_or_create(&StateLabels { state: s })
                .set(n as i64);
        }
    }

    /// A probe found a published mount dead.
    pub fn mount_died(&self) {
        self.0.mount_deaths.inc();
    }

    /// The watch's health; a change into `disconnected` counts one fault.
    pub fn set_watch(&self, h: &Health) {
        let (state, fault, counters) = match h {
            Health::Listing => ("listing", None, None),
            Health::Polling { counters, .. } => ("polling", None, Some(counters)),
            Health::Streaming { counters, .. } => ("streaming", None, Some(counters)),
            Health::Disconnected {
                fault, counters, ..
            } => ("disconnected", Some(*fault), Some(counters)),
        };
        if let Some(c) = counters {
            let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
            self.0.watch_list_allocations.set(gauge(c.list_allocations));
            self.0.watch_list_bytes.set(gauge(c.list_bytes));
        }
        let mut last = self.0.last_watch.lock().unwrap_or_else(|e| e.into_inner());
        if *last == state {
            return;
        }
        *last = state;
        for s in WATCH_STATES {
            self.0
                .watch_state
                .get_or_create(&StateLabels { state: s })
                .set(i64::from(s == state));
        }
        if let Some(f) = fault {
            let fault = fault_name(f);
            self.0
                .watch_faults
                .get_or_create(&FaultLabels { fault })
                .inc();
        }
    }

    /// One journal write took `elapsed`.
    pub fn journal_write(&self, elapsed: Duration) {
        self.0.journal_write.observe(elapsed.as_secs_f64());
    }

    /// What the agent knows: its node's allocations, volume records, and those it serves.
    pub fn set_known(&self, allocations: usize, volumes: usize, volumes_served: usize) {
        self.0.allocations.set(allocations as i64);
        self.0.volumes.set(volumes as i64);
        self.0.volumes_served.set(volumes_served as i64);
    }

    /// The plugin inventory: one `plugin_up` series per plugin found (removed plugins vanish).
    pub fn set_plugins(&self, plugins: &BTreeMap<String, Result<Fingerprint, String>>) {
        self.0.plugins.clear();
        for (id, r) in plugins {
            let (deferred, up) = match r {
                Ok(fp) => (if fp.deferred_bind { "true" } else { "false" }, 1),
                Err(_) => ("unknown", 0),
            };
            self.0
                .plugins
                .get_or_create(&PluginLabels {
                    plugin: id.clone(),
                    deferred,
                })
                .set(up);
        }
    }

    /// Reads every published volume's usage and condition, and the unused-since times of
    /// volumes no longer used here, from `source` at each scrape (a volume it leaves out
    /// has no series).
    pub fn read_volume_stats_from(&self, source: Arc<dyn VolumeStatsSource>) {
        self.0.volume_stats.read_from(source);
    }

    /// The attach count and limit of each plugin with a limit (series of plugins without
    /// one are removed).
    pub fn set_attach(&self, attach: &BTreeMap<String, crate::cluster::nodes::AttachCount>) {
        self.0.plugin_attached.clear();
        self.0.plugin_max_volumes.clear();
        for (id, a) in attach {
            let l = PluginOnly { plugin: id.clone() };
            self.0
                .plugin_attached
                .get_or_create(&l)
                .set(a.attached as i64);
            self.0
                .plugin_max_volumes
                .get_or_create(&l)
                .set(i64::from(a.max_volumes));
        }
    }

    /// The OpenMetrics text exposition of every metric (the allocator's figures and the
    /// mount table reading count read now).
    pub fn encode(&self) -> String {
        // Raised to the count, never past it (scrapes may run at once).
        self.0.mount_table_reads.inner().fetch_max(
            crate::node::mounts::MountTable::host_reads(),
            std::sync::atomic::Ordering::Relaxed,
        );
        let oldest = self.0.claim_wait_since.lock().ok().and_then(|s| *s);
        self.0
            .claim_wait_oldest
            .set(oldest.map_or(0.0, |t| t.elapsed().as_secs_f64()));
        if let Some((allocated, resident)) = heap_bytes() {
            self.0
                .heap_allocated
                .set(i64::try_from(allocated).unwrap_or(i64::MAX));
            self.0
                .heap_resident
                .set(i64::try_from(resident).unwrap_or(i64::MAX));
        }
        let mut s = String::new();
        let encoded = prometheus_client::encoding::text::encode_registry(&mut s, &self.0.process)
            .and_then(|_| prometheus_client::encoding::text::encode(&mut s, &self.0.registry));
        if let Err(e) = encoded {
            tracing::warn!(error = %e, "cannot encode metrics");
        }
        s
    }

    /// [`Metrics::encode`] in Prometheus' classic text format (version 0.0.4), for a
    /// scraper that does not ask for OpenMetrics: no `# UNIT` or `# EOF` lines, counters
    /// and info metrics described under their samples' names (`..._total`, `..._info`).
    pub fn encode_classic(&self) -> String {
        endpoint::classic(&self.encode())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every metric family the agent exports.
    const EXPORTED: [&str; 34] = [
        "dhv_binder_plugin_call_duration_seconds",
        "dhv_binder_plugin_leftover_processes_total",
        "dhv_binder_publish_wait_duration_seconds",
        "dhv_binder_operations_pending",
        "dhv_binder_operations_uncertain",
        "dhv_binder_publish_waiters",
        "dhv_binder_claim_waits_total",
        "dhv_binder_claim_waiters",
        "dhv_binder_claim_wait_oldest_seconds",
        "dhv_binder_claim_losses_total",
        "dhv_binder_claim_fences_total",
        "dhv_binder_claims",
        "dhv_binder_records_refused_total",
        "dhv_binder_mounts",
        "dhv_binder_mount_deaths_total",
        "dhv_binder_mount_table_reads_total",
        "dhv_binder_watch_state",
        "dhv_binder_watch_faults_total",
        "dhv_binder_watch_list_allocations",
        "dhv_binder_watch_list_bytes",
        "dhv_binder_journal_write_duration_seconds",
        "dhv_binder_journal_write_failing",
        "dhv_binder_journal_write_failures_total",
        "dhv_binder_volumes_frozen",
        "dhv_binder_allocations",
        "dhv_binder_volumes",
        "dhv_binder_volumes_served",
        "dhv_binder_plugin_up",
        "dhv_binder_plugin_attached_volumes",
        "dhv_binder_plugin_max_volumes",
        "dhv_binder_heap_allocated_bytes",
        "dhv_binder_heap_resident_bytes",
        "dhv_binder_build_info",
        "dhv_binder_nomad_retries_total",
    ];

    /// The process's own series (the standard, unprefixed names).
    const PROCESS: [&str; 6] = [
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
        "process_cpu_seconds_total",
    ];

    /// True for an exported family's name, or a histogram family's series
    /// (`_bucket`, `_count`, `_sum` of a `_seconds` family).
    fn exported(name: &str) -> bool {
        PROCESS.contains(&name)
            || EXPORTED.contains(&name)
            || volume_stats::FAMILIES.contains(&name)
            || ["_bucket", "_count", "_sum"].iter().any(|s| {
                name.strip_suffix(s)
                    .is_some_and(|f| f.ends_with("_seconds") && EXPORTED.contains(&f))
            })
    }

    /// The shipped dashboard and alerting rules name only metrics the agent exports (a
    /// renamed metric would leave a panel empty or an alert silent).
    #[test]
    fn the_dashboard_and_alerts_use_exported_metrics() {
        let docs = [
            include_str!("../../docs/prometheus-alerts.yml"),
            include_str!("../../docs/grafana-dashboard.json"),
        ];
        let mut seen = 0;
        for text in docs {
            for (at, _) in text.match_indices("dhv_binder_") {
                let name: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                assert!(exported(&name), "{name} is not exported");
                seen += 1;
            }
        }
        assert!(seen > 20, "the docs name {seen} metrics");
        // The heap: alerted on, and both gauges on the dashboard.
        assert!(docs[0].contains("dhv_binder_heap_allocated_bytes"));
        for name in [
            "dhv_binder_heap_allocated_bytes",
            "dhv_binder_heap_resident_bytes",
        ] {
            assert!(docs[1].contains(name), "{name} not on the dashboard");
        }
    }

    fn line_value(text: &str, prefix: &str) -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    /// The readings counter follows the host table's readings, read at each scrape: a
    /// fresh registry shows every reading the process made so far, never more.
    #[test]
    fn the_mount_table_readings_are_counted_at_each_scrape() {
        crate::node::mounts::MountTable::read()
            .expect("the host's mount table (tests run as root)");
        let m = Metrics::new();
        let shown = line_value(&m.encode(), "dhv_binder_mount_table_reads_total ")
            .expect("the readings counter is exported");
        assert!(shown >= 1.0, "a reading was made: {shown}");
        assert!(shown <= crate::node::mounts::MountTable::host_reads() as f64);
        // A scrape never lowers it, and one with no reading between shows the same or more.
        let again = line_value(&m.encode(), "dhv_binder_mount_table_reads_total ").unwrap();
        assert!(again >= shown);
    }

    /// Issue 44 #9: many idle connections from one address do not starve a scrape from
    /// another (80 took every place before), and one that sends nothing is closed after
    /// [`HEADER_READ_TIMEOUT`] from its start.
    #[tokio::test]
    async fn idle_connections_from_one_peer_leave_room_for_a_scrape() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = l.local_addr().unwrap();
        let _server = tokio::spawn(serve(l, Metrics::new()));
        let mut idle = Vec::new();
        for _ in 0..80 {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            idle.push(s.connect(addr).await.unwrap());
        }
        // Let the server accept them all.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut answer)).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
        // An idle connection the server kept is closed after the header timeout.
        let mut buf = [0u8; 1];
        let mut kept = idle.pop().unwrap();
        for c in idle.iter_mut().rev() {
            if matches!(c.try_read(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
            {
                std::mem::swap(c, &mut kept);
                break;
            }
        }
        let closed = tokio::time::timeout(HEADER_READ_TIMEOUT * 3, kept.read(&mut buf)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
    }

    #[tokio::test]
    async fn the_endpoint_serves_every_metric_and_counts_move() {
        let m = Metrics::new();
        let l = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(serve(l, m.clone()));
        let scrape = || async {
            let r = reqwest::Client::new()
                .get(format!("http://{addr}/metrics"))
                .header(
                    "Accept",
                    "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
                )
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(r.headers()["content-type"], CONTENT_TYPE);
            r.text().await.unwrap()
        };
        let before = scrape().await;
        assert_eq!(
            line_value(&before, "dhv_binder_claim_losses_total"),
            Some(0.0)
        );

        m.plugin_call(
            "bind",
            Operation::Publish,
            Outcome::Ok,
            Duration::from_millis(30),
        );
        m.plugin_call(
            "bind",
            Operation::Publish,
            Outcome::Timeout,
            Duration::from_secs(60),
        );
        m.publish_wait(WaitOutcome::Published, Duration::from_millis(200));
        m.plugin_leftovers(
            "bind",
            Operation::Create,
            crate::storage::plugin::LeftoverFate::Killed,
            2,
        );
        m.claim_lost();
        m.set_claims(ClaimCounts {
            held: 2,
            fenced: 1,
            lost: 0,
            waiting: 3,
        });
        m.record_refused(RefusedReason::UntrustedKey);
        m.record_refused(RefusedReason::UntrustedKey);
        m.record_refused(RefusedReason::Unsigned);
        m.set_pending(2, 1, 3);
        m.set_mounts(0, 4, 1, 1);
        m.journal_write(Duration::from_millis(2));
        m.set_known(7, 3, 2);
        let c = crate::nomad::watch::Counters {
            list_allocations: 12,
            list_bytes: 34_567,
            ..Default::default()
        };
        m.set_watch(&Health::Polling {
            index: 1,
            counters: c.clone(),
        });
        let down = Health::Disconnected {
            fault: crate::nomad::watch::Fault::Unreachable,
            reason: "refused".into(),
            counters: c,
        };
        m.set_watch(&down);
        m.set_watch(&down);
        let mut plugins = BTreeMap::new();
        plugins.insert(
            "bind".to_string(),
            Ok(Fingerprint {
                version: "1".into(),
                deferred_bind: true,
                capabilities: Vec::new(),
                ..Default::default()
            }),
        );
        plugins.insert("nfs".to_string(), Err("exit 1".to_string()));
        m.set_plugins(&plugins);
        m.set_attach(&BTreeMap::from([(
            "bind".to_string(),
            crate::cluster::nodes::AttachCount {
                attached: 1,
                max_volumes: 2,
            },
        )]));

        let after = scrape().await;
        // Every metric is exposed (families once they have a member).
        // Every family has a series of exactly its name (histograms: its `_count`), and
        // every series belongs to an exported family.
        let series: Vec<&str> = after
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| l.split(['{', ' ']).next().unwrap_or(l))
            .collect();
        for name in EXPORTED {
            let count = format!("{name}_count");
            assert!(
                series.iter().any(|s| *s == name || *s == count),
                "{name} missing:\n{after}"
            );
        }
        for s in &series {
            assert!(exported(s), "{s} is exported but not listed");
        }
        let has = |l: &str| assert!(after.lines().any(|x| x == l), "no line {l:?} in:\n{after}");
        has("dhv_binder_plugin_call_duration_seconds_count{plugin=\"bind\",operation=\"publish\",outcome=\"ok\"} 1");
        has("dhv_binder_plugin_leftover_processes_total{plugin=\"bind\",operation=\"create\",fate=\"killed\"} 2");
        has("dhv_binder_plugin_call_duration_seconds_count{plugin=\"bind\",operation=\"publish\",outcome=\"timeout\"} 1");
        has("dhv_binder_publish_wait_duration_seconds_count{outcome=\"published\"} 1");
        has("dhv_binder_claim_losses_total 1");
        has("dhv_binder_claims{state=\"held\"} 2");
        has("dhv_binder_claims{state=\"fenced\"} 1");
        has("dhv_binder_claims{state=\"lost\"} 0");
        has("dhv_binder_claims{state=\"waiting\"} 3");
        has("dhv_binder_records_refused_total{reason=\"untrusted-key\"} 2");
        has("dhv_binder_records_refused_total{reason=\"unsigned\"} 1");
        has("dhv_binder_records_refused_total{reason=\"bad-signature\"} 0");
        has("dhv_binder_operations_pending 2");
        has("dhv_binder_operations_uncertain 1");
        has("dhv_binder_publish_waiters 3");
        has("dhv_binder_mounts{state=\"published\"} 4");
        has("dhv_binder_mounts{state=\"dead\"} 1");
        has("dhv_binder_watch_state{state=\"disconnected\"} 1");
        has("dhv_binder_watch_state{state=\"polling\"} 0");
        has("dhv_binder_watch_faults_total{fault=\"unreachable\"} 1");
        has("dhv_binder_watch_list_allocations 12");
        has("dhv_binder_watch_list_bytes 34567");
        has("dhv_binder_journal_write_duration_seconds_count 1");
        has("dhv_binder_allocations 7");
        has("dhv_binder_plugin_up{plugin=\"bind\",deferred=\"true\"} 1");
        has("dhv_binder_plugin_attached_volumes{plugin=\"bind\"} 1");
        has("dhv_binder_plugin_max_volumes{plugin=\"bind\"} 2");
        has("dhv_binder_plugin_up{plugin=\"nfs\",deferred=\"unknown\"} 0");
        // Every loop that retries a call to Nomad has its counter (issue 45 #2).
        for call in crate::nomad::retry::Call::ALL {
            let prefix = format!(
                "dhv_binder_nomad_retries_total{{call=\"{}\"}} ",
                call.name()
            );
            assert!(
                after.lines().any(|l| l.starts_with(&prefix)),
                "{prefix}missing:\n{after}"
            );
        }
        // A scraper that does not ask for OpenMetrics gets the classic text format.
        let r = reqwest::get(format!("http://{addr}/metrics"))
            .await
            .unwrap();
        assert_eq!(r.headers()["content-type"], CLASSIC_CONTENT_TYPE);
        let text = r.text().await.unwrap();
        assert!(
            text.lines()
                .any(|l| l == "# TYPE dhv_binder_claim_losses_total counter"),
            "{text}"
        );
        assert!(
            text.lines().any(|l| l == "dhv_binder_claim_losses_total 1"),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l == "# TYPE dhv_binder_build_info gauge"),
            "{text}"
        );
        assert!(
            !text.contains("# EOF") && !text.contains("# UNIT"),
            "{text}"
        );
        let r = reqwest::get(format!("http://{addr}/other")).await.unwrap();
        assert_eq!(r.status(), 404);
        server.abort();
    }

    /// Issue 37 #13: closed label sets are there from the first scrape (a dashboard shows
    /// 0, not "No data"), and so are the process's figures.
    #[test]
    fn families_exist_from_the_first_scrape_with_the_process_figures() {
        let text = Metrics::new().encode();
        for l in [
            "dhv_binder_watch_faults_total{fault=\"unreachable\"} 0",
            "dhv_binder_watch_faults_total{fault=\"node-unknown\"} 0",
            "dhv_binder_publish_wait_duration_seconds_count{outcome=\"published\"} 0",
            "dhv_binder_publish_wait_duration_seconds_count{outcome=\"timeout\"} 0",
        ] {
            assert!(text.lines().any(|x| x == l), "no line {l:?} in:\n{text}");
        }
        let p = process_figures().expect("/proc/self");
        assert!(
            p.resident_bytes > 0 && p.open_fds > 0 && p.max_fds > 0,
            "{p:?}"
        );
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            p.start_time_seconds > 1.0e9 && p.start_time_seconds <= now + 1.0,
            "{p:?}"
        );
        for name in PROCESS {
            assert!(
                text.lines().any(|l| l.split(' ').next() == Some(name)),
                "{name} missing:\n{text}"
            );
        }
        assert_eq!(text.matches("# EOF").count(), 1, "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    /// Issue 37 #13: every family is there from the first scrape, before anything
    /// happened: the claims by state and the refused records by reason at 0 for every
    /// state and reason; the families labelled by plugin appear with the first plugin
    /// found (its fingerprint is a timed call).
    #[test]
    fn every_family_but_the_plugin_ones_is_there_at_the_first_scrape() {
        let text = Metrics::new().encode();
        let series: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| l.split(['{', ' ']).next().unwrap_or(l))
            .collect();
        let by_plugin = [
            "dhv_binder_plugin_call_duration_seconds",
            "dhv_binder_plugin_leftover_processes_total",
            "dhv_binder_plugin_up",
            "dhv_binder_plugin_attached_volumes",
            "dhv_binder_plugin_max_volumes",
        ];
        for name in EXPORTED.iter().filter(|n| !by_plugin.contains(n)) {
            let count = format!("{name}_count");
            assert!(
                series.iter().any(|s| s == name || *s == count),
                "{name} missing at the first scrape:\n{text}"
            );
        }
        for state in ["held", "fenced", "lost", "waiting"] {
            let l = format!("dhv_binder_claims{{state=\"{state}\"}} 0");
            assert!(text.lines().any(|x| x == l), "no line {l:?} in:\n{text}");
        }
        for r in RefusedReason::ALL {
            let l = format!(
                "dhv_binder_records_refused_total{{reason=\"{}\"}} 0",
                r.as_str()
            );
            assert!(text.lines().any(|x| x == l), "no line {l:?} in:\n{text}");
        }
        // The classic format has them too, described under their samples' names.
        let classic = Metrics::new().encode_classic();
        for l in [
            "# TYPE dhv_binder_records_refused_total counter",
            "# TYPE dhv_binder_claims gauge",
            "dhv_binder_records_refused_total{reason=\"untrusted-key\"} 0",
            "dhv_binder_claims{state=\"held\"} 0",
        ] {
            assert!(
                classic.lines().any(|x| x == l),
                "no line {l:?} in:\n{classic}"
            );
        }
    }

    /// The allocator's figures can be read (jemalloc is built with its `stats` feature):
    /// without them a scrape would show the heap gauges at 0.
    #[test]
    fn the_allocator_figures_are_readable() {
        let (allocated, resident) = heap_bytes().expect("jemalloc's stats (feature `stats`)");
        assert!(
            resident >= allocated || resident > 0,
            "{allocated} / {resident}"
        );
    }

    #[test]
    fn no_label_carries_an_identifier_or_free_text() {
        let m = Metrics::new();
        m.plugin_call("bind", Operation::Create, Outcome::Error, Duration::ZERO);
        let text = m.encode();
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            if let Some(labels) = l.split('{').nth(1).and_then(|x| x.split('}').next()) {
                for kv in labels.split(',') {
                    let key = kv.split('=').next().unwrap_or_default();
                    assert!(
                        [
                            "plugin",
                            "operation",
                            "outcome",
                            "state",
                            "fault",
                            "deferred",
                            "reason",
                            "version",
                            "call",
                            "le"
                        ]
                        .contains(&key),
                        "unexpected label {key} in {l}"
                    );
                }
            }
        }
    }
}
