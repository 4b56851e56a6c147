//! The agent core: all node state as plain data, changed only by [`Core::handle`], which
//! returns the effects to perform. No I/O, no tokio, no spawning; the clock is the `now`
//! passed in. Each pass: apply the input, compute the reconcile plan, turn its steps into
//! journal intents and effects, answer the callers whose outcome is decided, and gather
//! every journal change of the pass into at most one commit, ahead of its plugin calls.

mod completions;
mod forced_unpublish;
mod mount_table;
mod offers;
mod status;

use crate::agent::claim_waits::ClaimWaits;
use crate::agent::claims::Claims;
use crate::agent::effect::{Answer, Effect, PluginFence};
use crate::agent::input::{ApiCall, Completion, Input, ReplyId};
use crate::agent::latency::Latency;
use crate::agent::mount_health::MountHealth;
use crate::agent::offer::Offers;
use crate::agent::placeholders::Placeholders;
use crate::agent::reconcile::{self, ClaimState, Inputs, Scope, Step, Waiting};
use crate::agent::retry::{Retries, Work, STEP_RETRY};
use crate::agent::storage_ops::{self, StorageOps};
use crate::agent::view::View;
use crate::agent::waiters::{Known, Waiter, Waiters};
use crate::agent::workers::Workers;
use crate::api::{ApiError, PublishReply};
use crate::cluster::catalog::Catalogue;
use crate::cluster::claims::ClaimSettings;
use crate::node::journal::{EventKind, Journal, JournalError, MountRecord, MountState};
use crate::node::mounts::MountTable;
use crate::nomad::watch::{Health, WatchEvent};
use crate::storage::environment::NodeEnv;
use crate::storage::plugin::{Capability, Fingerprint};
use crate::volume::{VolumeKey, VolumeRecord, VolumeState};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The longest the tick leaves the chores (placeholders, creates and deletes: a pass over
/// every volume) unrun when no input asked for them ([`Core::chores_due_on_tick`]).
pub(crate) const CHORES_EVERY: Duration = Duration::from_secs(10);

/// True when this node serves `rec`: its plugin is here (deferred) and the volume is for
/// this node's pool (or any pool).
fn serves(rec: &VolumeRecord, deferred: &BTreeSet<String>, node_pool: &str) -> bool {
    deferred.contains(&rec.spec.plugin_id)
        && (rec.spec.node_pool.is_empty() || rec.spec.node_pool == node_pool)
}

/// The core's fixed settings.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub node: NodeEnv,
    /// Where volumes are mounted: `<mount_root>/<namespace>/<name>`.
    pub mount_root: PathBuf,
    /// How often plugins are fingerprinted again without a directory change.
    pub plugin_rescan: Duration,
    pub claims: ClaimSettings,
    /// How often published mounts are probed.
    pub health_interval: Duration,
    /// `--heartbeat-interval-max`: the longest interval between two heartbeats of the local
    /// Nomad client, the lower bound of a safe `stop_on_client_after`.
    pub heartbeat_interval_max: Duration,
    /// Seeds the retry jitter.
    pub seed: u64,
    /// `--max-volumes`: the attach limit of a plugin on this node, over its fingerprint's.
    pub max_volumes: BTreeMap<String, u32>,
}

/// The agent's state.
#[derive(Debug)]
pub(crate) struct Core {
    s: Settings,
    journal: Journal,
    view: View,
    watch: Health,
    volumes: Catalogue,
    volumes_loaded: bool,
    /// Why the volume records cannot be read, while they cannot.
    records_unreadable: Option<String>,
    plugins: BTreeMap<String, Result<Fingerprint, String>>,
    plugins_loaded: bool,
    fingerprinting: bool,
    last_fingerprint: Option<Instant>,
    /// The next fingerprint runs every plugin (at start, after a directory change), not
    /// only those whose file changed (the periodic rescan).
    fingerprint_every: bool,
    /// Volumes with a plugin or claim call in flight (calls on one volume are serialized).
    busy: BTreeSet<VolumeKey>,
    last_error: BTreeMap<VolumeKey, String>,
    /// What the node record says of a failed step ([`Core::step_failed`]): the `last_error`
    /// it stands for, and the text without the plugin's words. Used while `last_error`
    /// still holds that error.
    node_errors: BTreeMap<VolumeKey, (String, String)>,
    retries: Retries<Work>,
    waiters: Waiters,
    /// The allocations waiting for another node's claim (for the metrics).
    claim_waits: ClaimWaits,
    fetching: BTreeSet<String>,
    placeholders: Placeholders,
    /// Volumes withheld from Nomad here although served: cool-downs (attach limits are
    /// decided from the journal and the plugins).
    offers: Offers,
    /// This node's attributes and meta (volume constraints), once read; re-read every
    /// [`crate::agent::offer::NODE_REREAD`].
    node_facts: Option<crate::volume::constraint::NodeFacts>,
    node_read_at: Option<Instant>,
    reading_node: bool,
    workers: Workers,
    storage_ops: StorageOps,
    claims: Claims,
    mount_health: MountHealth,
    waiting: Vec<Waiting>,
    latency: Latency,
    /// The host's mount table, as last read.
    table: MountTable,
    /// Targets where the host's table shows what their publish established (the
    /// kernel's answer to "published?", kept current by [`Core::on_table`]).
    mounted: BTreeSet<PathBuf>,
    /// False until the first mount table reading was checked against every record.
    targets_checked: bool,
    /// Volumes whose target holds something other than what their publish established:
    /// never published over, never answered as published (why, for the log and status).
    foreign: BTreeMap<VolumeKey, String>,
    /// Volumes fenced on this node (the claim's lease was about to end without a renewal):
    /// when, and what the fence did once it ran (cleared when the claim is renewed or the
    /// volume unpublished).
    fenced: BTreeMap<VolumeKey, serde_json::Value>,
    /// Who still used a volume when its unpublish was refused (cleared once unpublished).
    holders: BTreeMap<VolumeKey, crate::node::holders::Usage>,
    /// Allocations that write a single-node volume with no Nomad-side fence (no
    /// `disconnect { stop_on_client_after }` within the lease), with the warning.
    unfenced: BTreeMap<String, String>,
    /// Allocations with tasks that may start on a deferred volume before it is published.
    ungated: BTreeMap<String, Vec<crate::agent::gate::Ungated>>,
    /// Ungated tasks whose allocation finished while their volume was not published here:
    /// they ran, if at all, on the empty read-only placeholder (allocation ID, task), the
    /// last [`crate::agent::gate::EXITED_KEPT`].
    ungated_exited: std::collections::VecDeque<(String, crate::agent::gate::Ungated)>,
    /// The last commit handed to the shell, and the last one known durable.
    issued: u64,
    durable: u64,
    /// Plugin calls waiting on a commit, by commit: failed if the commit fails.
    gated: BTreeMap<u64, Vec<VolumeKey>>,
    /// Successful answers held until the commit that recorded them is durable.
    held: Vec<(u64, ReplyId, PublishReply)>,
    /// Whether the journal can be written: while not, no publish or unpublish starts.
    journal_trouble: crate::agent::journal_trouble::JournalTrouble,
    now: Instant,
    /// Scoped planning: the volumes the inputs since the last pass can have affected, or
    /// `replan_all` for the cases that need every volume (start, relist, catalogue or
    /// plugin set loaded).
    dirty: BTreeSet<VolumeKey>,
    replan_all: bool,
    /// Volumes whose step waits on a retry deadline: dirty again once it is due.
    parked: BTreeSet<VolumeKey>,
    /// The plan's waiting volumes, kept per volume across scoped passes.
    plan_waiting: BTreeMap<VolumeKey, Waiting>,
    /// Placeholders and create/delete workers are driven only when their inputs can have
    /// changed (catalogue, plugins, node facts, cool-downs, their own completions, an
    /// unpublish), when a retry or a topology grace came due, and at least every
    /// [`CHORES_EVERY`] on the tick.
    chores_due: bool,
    /// When the chores last ran.
    last_chores: Option<Instant>,
    /// Planning work so far (allocations, user records, claims and mount records visited,
    /// targets checked against the mount table).
    plan_visits: u64,
    /// False in tests that compare scoped planning with a full plan on every pass.
    scoped: bool,
    /// Operators' forced unpublishes on this node (`volume unpublish -force`).
    forced: crate::agent::forced::Forced,
    /// Credentials applied to published mounts (plugin `refresh`).
    refreshes: crate::agent::refresh::Refreshes,
}

impl Core {
    /// A core starting from the journal's records, at `now`.
    pub(crate) fn new(s: Settings, journal: Journal, now: Instant) -> Self {
        let mut claims = Claims::new(s.claims);
        claims.restore(journal.mounts().values().map(|m| &**m), now);
        Self {
            retries: Retries::new(s.seed),
            mount_health: MountHealth::new(s.health_interval),
            s,
            journal,
            view: View::default(),
            watch: Health::Listing,
            volumes: Catalogue::new(),
            volumes_loaded: false,
            records_unreadable: None,
            plugins: BTreeMap::new(),
            plugins_loaded: false,
            fingerprinting: false,
            last_fingerprint: None,
            fingerprint_every: true,
            busy: BTreeSet::new(),
            last_error: BTreeMap::new(),
            node_errors: BTreeMap::new(),
            waiters: Waiters::default(),
            claim_waits: ClaimWaits::default(),
            fetching: BTreeSet::new(),
            placeholders: Placeholders::default(),
            offers: Offers::default(),
            node_facts: None,
            node_read_at: None,
            reading_node: false,
            workers: Workers::default(),
            storage_ops: StorageOps::default(),
            claims,
            waiting: Vec::new(),
            latency: Latency::default(),
            table: MountTable::default(),
            mounted: BTreeSet::new(),
            targets_checked: false,
            foreign: BTreeMap::new(),
            fenced: BTreeMap::new(),
            unfenced: BTreeMap::new(),
            holders: BTreeMap::new(),
            ungated: BTreeMap::new(),
            ungated_exited: Default::default(),
            issued: 0,
            durable: 0,
            gated: BTreeMap::new(),
            held: Vec::new(),
            journal_trouble: Default::default(),
            now,
            dirty: BTreeSet::new(),
            replan_all: true,
            parked: BTreeSet::new(),
            plan_waiting: BTreeMap::new(),
            chores_due: true,
            last_chores: None,
            plan_visits: 0,
            scoped: true,
            forced: Default::default(),
            refreshes: Default::default(),
        }
    }

    /// Planning work so far: allocations, user records, claims and mount records the
    /// planner visited (what a burst's cost is counted in).
    #[cfg(test)]
    pub(crate) fn plan_visits(&self) -> u64 {
        self.plan_visits
    }

    /// Plans every volume on every pass and checks every record against every mount table
    /// reading (the reference the scoped planner and target checks are tested against).
    #[cfg(test)]
    pub(crate) fn plan_everything(&mut self) {
        self.scoped = false;
    }

    /// Gives restored claims their lease end back from the renewals kept on disk
    /// ([`crate::agent::claims::Claims::restore_leases`]); call right after [`Core::new`]
    /// with the same `now`. Returns the claims whose lease was restored.
    pub(crate) fn restore_leases(
        &mut self,
        ages: &BTreeMap<VolumeKey, (String, std::time::Duration)>,
        now: Instant,
    ) -> Vec<(VolumeKey, String, Instant)> {
        self.claims.restore_leases(ages, now)
    }

    /// The journal's records.
    pub(crate) fn journal(&self) -> &Journal {
        &self.journal
    }

    /// The plugins fingerprinted on this node, once they have been read at least once.
    pub(crate) fn plugins(&self) -> Option<&BTreeMap<String, Result<Fingerprint, String>>> {
        self.plugins_loaded.then_some(&self.plugins)
    }

    /// The record of volume `k` in this node's catalogue, if it has one.
    pub(crate) fn volume_record(
        &self,
        k: &VolumeKey,
    ) -> Option<&std::sync::Arc<crate::volume::VolumeRecord>> {
        self.volumes.get(k)
    }

    /// What this node's record says of its volumes (`volume status`, per node): each mount
    /// in the journal with its state, since when, its users and last error, each volume
    /// with an error but no mount, this node's claims and why a publish here waits.
    pub(crate) fn node_volumes(&self) -> BTreeMap<String, crate::cluster::nodes::NodeVolume> {
        let users = self.journal.users_by_volume();
        let mut out: BTreeMap<String, crate::cluster::nodes::NodeVolume> = self
            .journal
            .mounts()
            .iter()
            .map(|(k, m)| {
                let v = crate::cluster::nodes::NodeVolume {
                    state: match m.state {
                        MountState::Publishing => "publishing",
                        MountState::Published => "published",
                        MountState::Unpublishing => "unpublishing",
                    }
                    .to_string(),
                    since: m.since,
                    users: users
                        .get(k)
                        .map(|u| u.iter().map(|a| a.to_string()).collect())
                        .unwrap_or_default(),
                    ..Default::default()
                };
                (k.to_string(), v)
            })
            .collect();
        for (k, e) in &self.last_error {
            // A plugin's words (redacted) reach the volume's own callers (its record, a
            // prestart, `volume status` through the record); the node record, readable in
            // namespace default by every node token, says only what failed and that the
            // words are in this node's log.
            let shown = match self.node_errors.get(k) {
                Some((report, public)) if report == e => public,
                _ => e,
            };
            out.entry(k.to_string()).or_default().error = shown.clone();
        }
        for (k, state) in self.claims.status() {
            out.entry(k).or_default().claim = state;
        }
        for w in &self.waiting {
            out.entry(w.volume.to_string()).or_default().waiting = w.reason.clone();
        }
        // Jobs that mount a volume without the gate: those whose allocation ended before
        // the publish first (most recent first), then those that run.
        let short = |id: &str| id.chars().take(8).collect::<String>();
        for (id, u) in self.ungated_exited.iter().rev() {
            out.entry(u.volume.to_string())
                .or_default()
                .ungated
                .push(format!(
                    "{}/{} ({}): ended before the publish",
                    u.job,
                    u.task,
                    short(id)
                ));
        }
        for (id, us) in &self.ungated {
            for u in us {
                out.entry(u.volume.to_string())
                    .or_default()
                    .ungated
                    .push(format!("{}/{} ({})", u.job, u.task, short(id)));
            }
        }
        out
    }

    /// Notes a failed publish or unpublish of `volume`: `last_error` holds its report (the
    /// plugin's redacted words, for the volume's own callers), the node record its
    /// `Display`, which never carries the plugin's words ([`Core::node_volumes`]).
    fn step_failed(&mut self, volume: &VolumeKey, e: &crate::agent::executor::StepError) {
        let report = e.report();
        self.node_errors
            .insert(volume.clone(), (report.clone(), e.to_string()));
        self.last_error.insert(volume.clone(), report);
    }

    /// What this node's record says of its volumes' recent events (`volume status
    /// -verbose`): the journal's recent publish, unpublish and fence outcomes.
    pub(crate) fn node_history(&self) -> BTreeMap<String, Vec<crate::cluster::nodes::NodeEvent>> {
        let mut out: BTreeMap<String, Vec<crate::cluster::nodes::NodeEvent>> = self
            .journal
            .recent()
            .iter()
            .map(|(k, r)| {
                let events = r
                    .iter()
                    .map(|e| crate::cluster::nodes::NodeEvent {
                        time: e.time,
                        event: match e.kind {
                            EventKind::PublishDone | EventKind::PublishFailed => "publish",
                            EventKind::UnpublishDone | EventKind::UnpublishFailed => "unpublish",
                            EventKind::Fenced => "fence",
                            EventKind::NodeFenced => "fence-node",
                            EventKind::NodeUnfenced => "unfence-node",
                            EventKind::ClaimReleased => "claim-released",
                            EventKind::ForcedUnpublish => "forced-unpublish",
                            _ => "unfence",
                        }
                        .to_string(),
                        alloc_id: e.alloc_id.clone().unwrap_or_default(),
                        ok: !e.failed
                            && !matches!(
                                e.kind,
                                EventKind::PublishFailed | EventKind::UnpublishFailed
                            ),
                        ms: e.ms,
                        detail: e.detail.clone(),
                    })
                    .collect();
                (k.to_string(), events)
            })
            .collect();
        self.add_offer_events(&mut out);
        out
    }

    /// Volumes this node's allocations name that the catalogue has no record for (yet): the
    /// shell has the volume-record watch read its record at once (`catalog::Reads`).
    pub(crate) fn unknown_named_volumes(&self) -> impl Iterator<Item = &VolumeKey> + '_ {
        self.view
            .named_volumes()
            .filter(|k| !self.volumes.contains_key(*k))
    }

    /// The allocation watcher's health as last reported.
    pub(crate) fn watch_health(&self) -> &Health {
        &self.watch
    }

    /// Applies one input at `now` and returns the effects to perform, in order.
    pub(crate) fn handle(&mut self, input: Input, now: Instant) -> Vec<Effect> {
        self.handle_all(vec![input], now)
    }

    /// Applies inputs that arrived together (a burst), then plans once: a burst of N
    /// messages costs one planning pass, not N.
    pub(crate) fn handle_all(&mut self, inputs: Vec<Input>, now: Instant) -> Vec<Effect> {
        self.now = now;
        let mut out = Vec::new();
        // The renewals' outcomes first: the fence decides on every answer that has arrived
        // (a renewal answered late still extends the lease from its sending).
        let (renewals, inputs): (Vec<Input>, Vec<Input>) = inputs
            .into_iter()
            .partition(|i| matches!(i, Input::Done(Completion::ClaimRenewed { .. })));
        for input in renewals {
            self.apply(input, now, &mut out);
        }
        // Leases before any other input (a paused agent resumes here; docs/architecture.md,
        // "Fencing").
        let mut fences = Vec::new();
        self.fence_due(now, &mut fences);
        out.splice(0..0, fences);
        for input in inputs {
            self.apply(input, now, &mut out);
        }
        self.drive(now, &mut out);
        out.extend(self.claims.orders());
        out
    }

    fn apply(&mut self, input: Input, now: Instant, out: &mut Vec<Effect>) {
        match input {
            Input::Watch(ev) => self.on_watch(ev),
            Input::Catalogue(c) => {
                if self.volumes_loaded {
                    // The records that changed, appeared or went.
                    for (k, v) in &c {
                        if self.volumes.get(k) != Some(v) {
                            self.dirty.insert(k.clone());
                        }
                    }
                    for k in self.volumes.keys() {
                        if !c.contains_key(k) {
                            self.dirty.insert(k.clone());
                        }
                    }
                } else {
                    self.replan_all = true;
                }
                self.note_repairs(&c);
                self.volumes = c;
                self.volumes_loaded = true;
                self.chores_due = true;
                let ids: Vec<std::sync::Arc<str>> = self.view.allocs().keys().cloned().collect();
                ids.iter().for_each(|id| self.check_gate(id));
            }
            Input::Snapshots(s) => self.storage_ops.on_snapshots(s),
            Input::UnpublishRequests(r) => self.on_unpublish_requests(r, now, out),
            Input::RecordsUnreadable(why) => {
                // Said for every volume kept while the records are unknown.
                self.replan_all |= why != self.records_unreadable;
                self.records_unreadable = why;
            }
            Input::Api { reply, call } => match call {
                ApiCall::Status => out.push(Effect::Reply {
                    to: reply,
                    answer: Answer::Status(Box::new(self.status())),
                }),
                ApiCall::Publish(req) => {
                    if let Some(why) = self.journal_trouble.refusal() {
                        // Refused at once, not left to time out: the caller retries.
                        out.push(Effect::Reply {
                            to: reply,
                            answer: Answer::Publish(Err(ApiError::Journal(why))),
                        });
                        return;
                    }
                    if !self.view.allocs().contains_key(req.alloc_id.as_str())
                        && self.fetching.insert(req.alloc_id.clone())
                    {
                        out.push(Effect::FetchAlloc {
                            alloc_id: req.alloc_id.clone(),
                        });
                    }
                    self.waiters.push(Waiter {
                        reply,
                        alloc_id: req.alloc_id,
                        namespace: req.namespace,
                        deadline: now + req.wait,
                        since: now,
                        progress: req.progress,
                    });
                }
            },
            Input::CallerGone(reply) => self.waiters.gone(reply),
            Input::PluginsChanged => {
                self.last_fingerprint = None;
                self.fingerprint_every = true;
                self.on_tick(now, out);
            }
            Input::MountTable(t) => self.on_table(t),
            Input::Committed { seq, result } => self.on_committed(seq, result, out),
            Input::Done(c) => self.on_done(c, now, out),
            Input::SecretChanged((namespace, path)) => self.refreshes.variable_changed(
                &namespace,
                &path,
                self.journal.mounts(),
                &self.volumes,
            ),
            Input::Tick => {
                if self.chores_due_on_tick(now) {
                    self.chores_due = true;
                }
                self.on_tick(now, out)
            }
        }
    }

    /// Whether the tick runs the chores: a pass over every volume (1,000 volumes on a
    /// 2 s tick were most of an idle agent's CPU: docs/scale.md), so only at least every
    /// [`CHORES_EVERY`], or when what the chores wait on without an input came due since
    /// they last ran: a retry's deadline, or the end of a topology grace
    /// ([`crate::agent::offer::PREFER_GRACE`]). Everything else that changes their
    /// outcome sets `chores_due` itself.
    fn chores_due_on_tick(&self, now: Instant) -> bool {
        let Some(last) = self.last_chores else {
            return true;
        };
        now.saturating_duration_since(last) >= CHORES_EVERY
            || self.retries.came_due(last, now)
            || self.offers.grace_ended(last, now)
    }

    /// The earliest time something is due without any input (a retry, a caller's
    /// deadline, a claim renewal, a probe round, a fingerprint).
    pub(crate) fn next_wakeup(&self) -> Option<Instant> {
        [
            self.retries.next_after(self.now),
            self.waiters.next_wakeup(),
            self.claims.next_wakeup(),
            self.mount_health.next_wakeup(),
            self.last_fingerprint.map(|t| t + self.s.plugin_rescan),
            self.journal_trouble.next_wakeup(),
            self.offers.next_wakeup(),
            self.refreshes.next_wakeup(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn deferred_plugins(&self) -> BTreeSet<String> {
        self.plugins
            .iter()
            .filter(|(_, f)| matches!(f, Ok(fp) if fp.deferred_bind))
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The volume's mount point under the mount root; `None` (logged) for a key that is not
    /// a valid identifier pair, so no path leaves the root (issue 13 §5).
    fn target_of(&self, key: &VolumeKey) -> Option<PathBuf> {
        match key.relative_path() {
            Ok(rel) => Some(self.s.mount_root.join(rel)),
            Err(e) => {
                tracing::error!(volume = %key, error = %e, "refusing a volume key that is not a valid path");
                None
            }
        }
    }

    fn serves(&self, rec: &VolumeRecord, deferred: &BTreeSet<String>) -> bool {
        serves(rec, deferred, &self.s.node.node_pool)
    }

    fn on_watch(&mut self, ev: WatchEvent) {
        match ev {
            WatchEvent::Relisted { allocs, index } => {
                tracing::debug!(
                    count = allocs.len(),
                    index,
                    "relisted the node's allocations"
                );
                self.view.replace_all_at(allocs, index, self.now);
                let view = &self.view;
                self.ungated
                    .retain(|id, _| view.allocs().contains_key(id.as_str()));
                self.unfenced
                    .retain(|id, _| view.allocs().contains_key(id.as_str()));
                let ids: Vec<std::sync::Arc<str>> = self.view.allocs().keys().cloned().collect();
                ids.iter().for_each(|id| self.check_gate(id));
            }
            WatchEvent::Upsert(a) => {
                let a = *a;
                tracing::debug!(alloc_id = %a.id, client_status = %a.client_status, desired = %a.desired_status, "allocation update");
                let id = a.id.clone();
                self.view.upsert(a);
                self.check_gate(&id);
            }
            WatchEvent::Removed(id) => {
                self.view.remove_at(&id, self.now);
                self.ungated.remove(&id);
                self.unfenced.remove(&id);
            }
            WatchEvent::Health(h) => self.watch = h,
        }
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<Effect>) {
        self.give_up_forced(now, out);
        if self.offers.expire(now) {
            self.chores_due = true;
        }
        self.read_node_if_due(now, out);
        let gone = self.view.expire(now);
        if gone > 0 {
            tracing::info!(
                count = gone,
                "allocations removed from Nomad are past their kill grace"
            );
        }
        let due = self
            .last_fingerprint
            .is_none_or(|t| now.saturating_duration_since(t) >= self.s.plugin_rescan);
        if due && !self.fingerprinting {
            self.fingerprinting = true;
            self.last_fingerprint = Some(now);
            out.push(Effect::Fingerprint {
                changed_only: !std::mem::take(&mut self.fingerprint_every),
            });
        }
        // Not before the records are known: the listing reads only the namespaces served.
        if self.volumes_loaded {
            let namespaces = self
                .volumes
                .keys()
                .map(|k| k.namespace.to_string())
                .chain(self.placeholders.namespaces().map(str::to_string))
                .collect();
            out.extend(self.placeholders.list(now, namespaces, &self.retries));
        }
        out.extend(
            self.mount_health
                .tick(now, self.journal.mounts(), &self.mounted, &self.busy),
        );
        out.push(Effect::ReadMountTable);
    }

    /// Plans and turns steps into effects, keeps placeholders and records current,
    /// answers callers, and commits the pass's journal changes.
    fn drive(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let deferred = self.deferred_plugins();
        self.forget_ended_withdrawals();
        self.write_final_marks(now, out);
        let all = self.collect_dirty(now);
        let dirty = std::mem::take(&mut self.dirty);
        let claims: BTreeMap<VolumeKey, ClaimState> = if all {
            self.claims.states()
        } else {
            self.claims.states_of(&dirty)
        };
        let scope = if all {
            Scope::All
        } else {
            Scope::Volumes {
                dirty: &dirty,
                users: self.journal.users_by_volume(),
            }
        };
        let (plan, visits) = reconcile::plan_in(
            Inputs {
                view: &self.view,
                volumes_loaded: self.volumes_loaded && self.plugins_loaded,
                records_error: self.records_unreadable.as_deref(),
                volumes: &self.volumes,
                mounts: self.journal.mounts(),
                users: self.journal.users(),
                mounted: &self.mounted,
                plugins: &deferred,
                busy: &self.busy,
                claims: &claims,
                withdrawn: self.forced.withdrawn(),
            },
            scope,
        );
        self.plan_visits += visits as u64;
        if all {
            self.plan_waiting.clear();
        } else {
            for k in &dirty {
                self.plan_waiting.remove(k);
            }
        }
        for w in plan.waiting {
            self.plan_waiting.insert(w.volume.clone(), w);
        }
        // A claim wait lasts while the plan asks for the claim (or its acquire is in
        // flight): once the allocations that needed the volume end, it ends too.
        let acquiring: BTreeSet<&VolumeKey> = plan
            .steps
            .iter()
            .filter_map(|s| match s {
                Step::AcquireClaim { volume } => Some(volume),
                _ => None,
            })
            .collect();
        self.claims.forget_waits(|k| {
            (all || dirty.contains(k)) && !self.busy.contains(k) && !acquiring.contains(k)
        });
        self.waiting = self.plan_waiting.values().cloned().collect();
        self.waiting.extend(self.claims.waiting());
        // The allocations that wait for another node's claim (each counted once).
        let view = &self.view;
        let claim_waiters: BTreeSet<String> = self
            .claims
            .waiting()
            .flat_map(|w| {
                view.needing(&w.volume)
                    .map(|id| id.to_string())
                    .collect::<Vec<_>>()
            })
            .filter(|id| {
                view.allocs()
                    .get(id.as_str())
                    .is_some_and(|a| !a.tasks_finished() && a.desired_status == "run")
            })
            .collect();
        self.claim_waits.update(claim_waiters, now);
        let (mut add, mut remove, mut steps) = (Vec::new(), Vec::new(), Vec::new());
        for step in plan.steps {
            match step {
                Step::AddUser(u) => {
                    // A paused or drained volume gets no new user, even where published.
                    let refused = self
                        .volumes
                        .get(&u.volume)
                        .and_then(|r| self.not_a_new_user(r, &u.alloc_id));
                    match refused {
                        Some(w) => self.waiting.push(Waiting {
                            volume: u.volume.clone(),
                            reason: w.reason(now),
                        }),
                        None => add.push(u),
                    }
                }
                Step::RemoveUser(u) => remove.push(u),
                other => steps.push(other),
            }
        }
        self.journal.change_users(&add, &remove);
        let mut calls = Vec::new();
        let mut gated = Vec::new();
        for step in steps {
            match step {
                Step::AddUser(_) | Step::RemoveUser(_) => {}
                Step::Publish {
                    volume,
                    alloc_id,
                    read_only,
                } => {
                    if let Some(why) = self.foreign.get(&volume) {
                        // Never published over, never accepted: reported until it is gone.
                        self.last_error.insert(volume.clone(), why.clone());
                        self.waiting.push(Waiting {
                            volume,
                            reason: why.clone(),
                        });
                        continue;
                    }
                    // Withheld here: not published (the waiting callers are refused at once),
                    // but a volume cooling down after transient failures is still retried for
                    // an allocation already here (a fixed backend publishes it).
                    let withheld = self
                        .volumes
                        .get(&volume)
                        .and_then(|r| self.withheld(r, &self.attached_by_plugin(), now))
                        .filter(|w| !w.retried_here());
                    if let Some(w) = withheld {
                        self.waiting.push(Waiting {
                            volume,
                            reason: w.reason(now),
                        });
                        continue;
                    }
                    if !self.retries.ready(&Work::Mount(volume.clone()), now) {
                        self.parked.insert(volume);
                        continue;
                    }
                    if let Some(why) = self.journal_trouble.refuse(&volume) {
                        self.last_error.insert(volume.clone(), why.clone());
                        self.parked.insert(volume.clone());
                        self.waiting.push(Waiting {
                            volume,
                            reason: why,
                        });
                        continue;
                    }
                    if self.publish_held(&volume) {
                        self.waiting.push(Waiting {
                            reason: "a requested expansion runs before the next publish".into(),
                            volume,
                        });
                        continue;
                    }
                    if let Some(e) = self.start_publish(volume.clone(), alloc_id, read_only) {
                        gated.push(volume);
                        calls.push(e);
                    }
                }
                Step::Unpublish { volume } => {
                    if !self.retries.ready(&Work::Mount(volume.clone()), now) {
                        self.parked.insert(volume);
                        continue;
                    }
                    if let Some(why) = self.journal_trouble.refuse(&volume) {
                        self.last_error.insert(volume.clone(), why.clone());
                        self.parked.insert(volume.clone());
                        self.waiting.push(Waiting {
                            volume,
                            reason: why,
                        });
                        continue;
                    }
                    if let Some(e) = self.start_unpublish(volume.clone()) {
                        gated.push(volume);
                        calls.push(e);
                    }
                }
                Step::AcquireClaim { volume } => {
                    if !self.retries.ready(&Work::Claim(volume.clone()), now) {
                        self.parked.insert(volume);
                        continue;
                    }
                    let Some(rec) = self.volumes.get(&volume) else {
                        continue;
                    };
                    let volume_id = rec.id.clone();
                    let fencing = self
                        .plugins
                        .get(&rec.spec.plugin_id)
                        .and_then(|f| f.as_ref().ok())
                        .filter(|f| f.supports(Capability::FenceNode))
                        .map(|_| Box::new(VolumeRecord::clone(rec)));
                    self.busy.insert(volume.clone());
                    self.claims.acquire_sent(&volume, now);
                    out.push(Effect::AcquireClaim {
                        volume,
                        volume_id,
                        fencing,
                    });
                }
                Step::ReleaseClaim { volume } => {
                    let Some(lock_id) = self.claims.lock_id(&volume).map(str::to_string) else {
                        continue;
                    };
                    self.busy.insert(volume.clone());
                    self.claims.releasing(&volume);
                    out.extend(self.claims.orders());
                    out.push(Effect::ReleaseClaim { volume, lock_id });
                }
            }
        }
        let chores = std::mem::take(&mut self.chores_due);
        if chores && (self.placeholders_ready() || self.plugins_loaded) {
            self.last_chores = Some(now);
        }
        if chores && self.placeholders_ready() {
            let attached = self.attached_by_plugin();
            let want: BTreeMap<VolumeKey, (&VolumeRecord, PathBuf)> = self
                .volumes
                .values()
                .filter(|r| r.state == VolumeState::Ready && self.serves(r, &deferred))
                .filter(|r| self.withheld(r, &attached, now).is_none())
                .filter_map(|r| Some((r.key(), (&**r, self.target_of(&r.key())?))))
                .collect();
            // A pass over every volume: counted with the planning work.
            self.plan_visits += self.volumes.len() as u64;
            out.extend(self.placeholders.drive(&want, &self.retries, now));
        }
        if chores && self.plugins_loaded {
            self.plan_visits += self.volumes.len() as u64;
            let elsewhere = self.creates_elsewhere(now);
            let pool = &self.s.node.node_pool;
            let me = self.s.node.node_id.as_str();
            let served = self
                .volumes
                .values()
                .map(|r| &**r)
                .filter(|r| serves(r, &deferred, pool) && !storage_ops::create_elsewhere(r, me))
                // A volume is created only where its required topology is met.
                .filter(|r| !elsewhere.contains(&r.key()));
            let (journal, placeholders) = (&self.journal, &self.placeholders);
            let in_use =
                |k: &VolumeKey| journal.mounts().contains_key(k) || placeholders.contains(k);
            out.extend(self.workers.drive(
                served,
                &self.s.node.node_id,
                in_use,
                &self.retries,
                now,
            ));
        }
        if self.placeholders_ready() {
            out.extend(self.storage_ops.drive(
                &self.volumes,
                &self.plugins,
                self.journal.mounts(),
                &mut self.busy,
                &self.s.node.node_id,
                &self.s.node.node_pool,
                &self.retries,
                now,
            ));
        }
        if self.plugins_loaded {
            self.refresh_due(now, out);
        }
        self.answer_waiters(now, out);
        // While writes fail, the state is written again at a steady pace, not on every
        // pass (no publish or unpublish started above, so no call waits on it).
        let take = !calls.is_empty() || self.journal_trouble.may_write(now);
        if let Some(commit) = take.then(|| self.journal.take_commit()).flatten() {
            self.issued = commit.seq;
            if !gated.is_empty() {
                self.gated.insert(commit.seq, gated);
            }
            out.push(Effect::Commit {
                commit,
                then: calls,
            });
        } else {
            // Calls always come with intents, so with no commit there are none.
            out.extend(calls);
        }
    }

    /// Fences every volume whose claim's lease is about to end without a renewal: the
    /// kernel makes it unwritable here ([`Effect::Fence`]), recorded in the journal, the
    /// log and the status.
    fn fence_due(&mut self, now: Instant, out: &mut Vec<Effect>) {
        for volume in self.claims.fences_due(now) {
            let left = self
                .claims
                .lease_end(&volume)
                .map(|end| end.saturating_duration_since(now).as_millis() as u64);
            let lease_of = self.claims.lock_id(&volume).map(str::to_string);
            self.fence(
                volume,
                left,
                lease_of,
                "no renewal succeeded before its lease was about to end (another node may take it then)",
                out,
            );
        }
    }

    /// Makes `volume` unwritable here now ([`Effect::Fence`], with the plugin's `fence` when
    /// it declares it), recorded in the journal, the log and the status. `lease_left_ms`: how
    /// long the claim's lease had left (`None` when the claim was released by an operator);
    /// `lease_of`: the lock whose lease is ending (a renewal of it that succeeded withdraws
    /// the fence, [`Effect::Fence`]); `why`: for the log.
    fn fence(
        &mut self,
        volume: VolumeKey,
        lease_left_ms: Option<u64>,
        lease_of: Option<String>,
        why: &str,
        out: &mut Vec<Effect>,
    ) {
        let left = lease_left_ms;
        self.dirty.insert(volume.clone());
        let Some(m) = self
            .journal
            .mounts()
            .get(&volume)
            .map(|m| MountRecord::clone(m))
        else {
            tracing::warn!(%volume, lease_left_ms = ?left, "claim fenced: {why}; nothing is mounted here");
            return;
        };
        let target = m.target.clone();
        tracing::error!(%volume, target = %target.display(), lease_left_ms = ?left, "claim fenced: {why}; making the volume unwritable here");
        let detail = serde_json::json!({"target": target, "lease_left_ms": left});
        self.journal.note(EventKind::Fenced, &volume, detail);
        self.fenced.insert(
            volume.clone(),
            serde_json::json!({"since": crate::node::journal::now_secs(), "target": target, "lease_left_ms": left, "fence": null}),
        );
        let plugin = self
            .plugins
            .get(&m.plugin_id)
            .and_then(|f| f.as_ref().ok())
            .filter(|f| f.supports(Capability::Fence))
            .map(|_| {
                Box::new(PluginFence {
                    mount: m.clone(),
                    record: self.volumes.get(&volume).map(|r| VolumeRecord::clone(r)),
                })
            });
        out.push(Effect::Fence {
            volume,
            target,
            plugin,
            lease_of,
        });
    }

    /// A publish of `volume` waits for its pending expansion (storage_ops::holds_publish).
    fn publish_held(&self, volume: &VolumeKey) -> bool {
        self.volumes.get(volume).is_some_and(|r| {
            let fp = self
                .plugins
                .get(&r.spec.plugin_id)
                .and_then(|f| f.as_ref().ok());
            storage_ops::holds_publish(r, fp)
        })
    }

    /// Gathers what the inputs since the last pass dirtied: the view's changes (with the
    /// volumes the changed allocations are recorded as using), and parked volumes whose
    /// retry is due. Returns true when every volume is to be planned.
    fn collect_dirty(&mut self, now: Instant) -> bool {
        let changes = self.view.take_changes();
        self.dirty.extend(changes.volumes);
        for id in &changes.allocs {
            self.dirty.extend(self.journal.volumes_of(id).cloned());
        }
        let due: Vec<VolumeKey> = self
            .parked
            .iter()
            .filter(|v| {
                self.retries.ready(&Work::Mount((*v).clone()), now)
                    && self.retries.ready(&Work::Claim((*v).clone()), now)
            })
            .cloned()
            .collect();
        for v in due {
            self.parked.remove(&v);
            self.dirty.insert(v);
        }
        let all = std::mem::take(&mut self.replan_all) || changes.relisted || !self.scoped;
        if all {
            self.dirty.clear();
            self.parked.clear();
        }
        all
    }

    fn placeholders_ready(&self) -> bool {
        self.volumes_loaded && self.plugins_loaded
    }

    /// Records the publish intent; the call itself waits for the commit.
    fn start_publish(
        &mut self,
        volume: VolumeKey,
        alloc_id: String,
        read_only: bool,
    ) -> Option<Effect> {
        let rec = self.volumes.get(&volume)?.clone();
        let prev = self.journal.mounts().get(&volume);
        let target = match prev {
            Some(p) => p.target.clone(),
            None => self.target_of(&volume)?,
        };
        let m = MountRecord {
            volume: volume.clone(),
            volume_id: rec.id.clone(),
            plugin_id: rec.spec.plugin_id.clone(),
            state: MountState::Publishing,
            target: target.clone(),
            read_only,
            publish_context: prev.map(|p| p.publish_context.clone()).unwrap_or_default(),
            since: 0,
            last_error: String::new(),
            claim_id: self.claims.lock_id(&volume).map(Box::from),
            mount: prev.and_then(|p| p.mount.clone()),
        };
        let expected = m.mount.clone();
        self.journal
            .set_mount(m, EventKind::PublishIntent, Some(&alloc_id));
        tracing::info!(%volume, %alloc_id, target = %target.display(), "publishing");
        self.busy.insert(volume);
        Some(Effect::Publish {
            volume: Box::new(VolumeRecord::clone(&rec)),
            target,
            read_only,
            alloc_id,
            expected,
        })
    }

    /// The Variables the published volumes whose plugin declares `refresh` reference (what
    /// the shell's [`crate::agent::secret_watch`] follows).
    pub(crate) fn refresh_watched(&self) -> BTreeSet<crate::agent::refresh::Watched> {
        crate::agent::refresh::watched(self.journal.mounts(), &self.volumes, &self.plugins)
    }

    /// Starts the refreshes that are due ([`crate::agent::refresh::Refreshes::due`]); each
    /// makes its volume busy until it ends.
    fn refresh_due(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let due = self.refreshes.due(
            now,
            self.journal.mounts(),
            &self.mounted,
            &self.busy,
            &self.volumes,
            &self.plugins,
        );
        for k in due {
            let (Some(rec), Some(m)) = (self.volumes.get(&k), self.journal.mounts().get(&k)) else {
                continue;
            };
            tracing::info!(volume = %k, "refreshing the published volume's credentials");
            self.busy.insert(k.clone());
            out.push(Effect::Refresh {
                volume: Box::new(VolumeRecord::clone(rec)),
                mount: Box::new(MountRecord::clone(m)),
            });
        }
    }

    /// Records the unpublish intent; the call itself waits for the commit.
    fn start_unpublish(&mut self, volume: VolumeKey) -> Option<Effect> {
        let mut m = MountRecord::clone(self.journal.mounts().get(&volume)?);
        m.state = MountState::Unpublishing;
        self.journal
            .set_mount(m.clone(), EventKind::UnpublishIntent, None);
        tracing::info!(%volume, target = %m.target.display(), "unpublishing");
        self.busy.insert(volume.clone());
        Some(Effect::Unpublish {
            keep_dir: self.placeholders.contains(&volume),
            volume: self
                .volumes
                .get(&volume)
                .map(|r| Box::new(VolumeRecord::clone(r))),
            mount: Box::new(m),
        })
    }

    fn answer_waiters(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let refused = self.refused_for_waiters(now);
        let known = Known {
            refused: &refused,
            view: &self.view,
            volumes: &self.volumes,
            journal: &self.journal,
            last_error: &self.last_error,
            busy: &self.busy,
            waiting: &self.waiting,
            mounted: &self.mounted,
            holder_jobs: self.claims.holder_jobs(),
        };
        let answers = self.waiters.answer(&known, now);
        // A success rests on records that may not be on disk yet: it waits for them.
        let pending = self.journal.is_dirty() || self.issued > self.durable;
        let seq = self.issued + u64::from(self.journal.is_dirty());
        for (to, r) in answers {
            match r {
                // A progress report rests on nothing written: it goes at once.
                Ok(reply) if pending && reply.waiting.is_none() => self.held.push((seq, to, reply)),
                r => out.push(Effect::Reply {
                    to,
                    answer: Answer::Publish(r),
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests;
