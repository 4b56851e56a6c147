//! The agent core: all node state as plain data, changed only by [`Core::handle`], which
//! returns the effects to perform. No I/O, no tokio, no spawning; the clock is the `now`
//! passed in. Each pass: apply the input, compute the reconcile plan, turn its steps into
//! journal intents and effects, answer the callers whose outcome is decided, and gather
//! every journal change of the pass into at most one commit, ahead of its plugin calls.

use crate::agent::claims::Claims;
use crate::agent::effect::{Answer, Effect};
use crate::agent::input::{ApiCall, Completion, Input, ReplyId};
use crate::agent::latency::Latency;
use crate::agent::mount_health::MountHealth;
use crate::agent::placeholders::Placeholders;
use crate::agent::retry::{Retries, Work, STEP_RETRY};
use crate::agent::storage_ops::{self, StorageOps};
use crate::agent::waiters::{Known, Waiter, Waiters};
use crate::agent::workers::Workers;
use crate::api::{ApiError, PublishReply};
use crate::catalog::Catalogue;
use crate::claims::ClaimSettings;
use crate::environment::NodeEnv;
use crate::journal::{EventKind, Journal, JournalError, MountRecord, MountState};
use crate::mounts::MountTable;
use crate::plugin::Fingerprint;
use crate::reconcile::{self, ClaimState, Inputs, Scope, Step, Waiting};
use crate::view::View;
use crate::volume::{VolumeKey, VolumeRecord, VolumeState};
use crate::watch::{Health, WatchEvent};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

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
    /// Seeds the retry jitter.
    pub seed: u64,
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
    retries: Retries<Work>,
    waiters: Waiters,
    fetching: BTreeSet<String>,
    placeholders: Placeholders,
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
    /// Who still used a volume when its unpublish was refused (cleared once unpublished).
    holders: BTreeMap<VolumeKey, crate::holders::Usage>,
    /// Allocations with tasks that may start on a deferred volume before it is published.
    ungated: BTreeMap<String, Vec<crate::gate::Ungated>>,
    /// The last commit handed to the shell, and the last one known durable.
    issued: u64,
    durable: u64,
    /// Plugin calls waiting on a commit, by commit: failed if the commit fails.
    gated: BTreeMap<u64, Vec<VolumeKey>>,
    /// Successful answers held until the commit that recorded them is durable.
    held: Vec<(u64, ReplyId, PublishReply)>,
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
    /// changed (catalogue, plugins, their own completions, an unpublish, the tick).
    chores_due: bool,
    /// Planning work so far (allocations, user records, claims and mount records visited,
    /// targets checked against the mount table).
    plan_visits: u64,
    /// False in tests that compare scoped planning with a full plan on every pass.
    scoped: bool,
}

impl Core {
    /// A core starting from the journal's records, at `now`.
    pub(crate) fn new(s: Settings, journal: Journal, now: Instant) -> Self {
        let mut claims = Claims::new(s.claims);
        claims.restore(journal.mounts().values(), now);
        Self {
            retries: Retries::new(s.seed),
            mount_health: MountHealth::new(s.health_interval),
            s,
            journal,
            view: View::default(),
            watch: Health::Listing,
            volumes: Catalogue::new(),
            volumes_loaded: false,
            plugins: BTreeMap::new(),
            plugins_loaded: false,
            fingerprinting: false,
            last_fingerprint: None,
            fingerprint_every: true,
            busy: BTreeSet::new(),
            last_error: BTreeMap::new(),
            waiters: Waiters::default(),
            fetching: BTreeSet::new(),
            placeholders: Placeholders::default(),
            workers: Workers::default(),
            storage_ops: StorageOps::default(),
            claims,
            waiting: Vec::new(),
            latency: Latency::default(),
            table: MountTable::default(),
            mounted: BTreeSet::new(),
            targets_checked: false,
            foreign: BTreeMap::new(),
            holders: BTreeMap::new(),
            ungated: BTreeMap::new(),
            issued: 0,
            durable: 0,
            gated: BTreeMap::new(),
            held: Vec::new(),
            now,
            dirty: BTreeSet::new(),
            replan_all: true,
            parked: BTreeSet::new(),
            plan_waiting: BTreeMap::new(),
            chores_due: true,
            plan_visits: 0,
            scoped: true,
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

    /// The journal's records.
    #[cfg(test)]
    pub(crate) fn journal(&self) -> &Journal {
        &self.journal
    }

    /// The plugins fingerprinted on this node, once they have been read at least once.
    pub(crate) fn plugins(&self) -> Option<&BTreeMap<String, Result<Fingerprint, String>>> {
        self.plugins_loaded.then_some(&self.plugins)
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
        for input in inputs {
            self.apply(input, now, &mut out);
        }
        self.drive(now, &mut out);
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
                self.volumes = c;
                self.volumes_loaded = true;
                self.chores_due = true;
                let ids: Vec<String> = self.view.allocs().keys().cloned().collect();
                ids.iter().for_each(|id| self.check_gate(id));
            }
            Input::Snapshots(s) => self.storage_ops.on_snapshots(s),
            Input::Api { reply, call } => match call {
                ApiCall::Status => out.push(Effect::Reply {
                    to: reply,
                    answer: Answer::Status(Box::new(self.status())),
                }),
                ApiCall::Publish(req) => {
                    if !self.view.allocs().contains_key(&req.alloc_id)
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
            Input::Tick => {
                self.chores_due = true;
                self.on_tick(now, out)
            }
        }
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
                let ids: Vec<String> = self.view.allocs().keys().cloned().collect();
                self.ungated.retain(|id, _| ids.contains(id));
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
            }
            WatchEvent::Health(h) => self.watch = h,
        }
    }

    fn on_tick(&mut self, now: Instant, out: &mut Vec<Effect>) {
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
        out.extend(self.placeholders.list(now));
        out.extend(self.claims.renewals(now));
        out.extend(
            self.mount_health
                .tick(now, self.journal.mounts(), &self.mounted, &self.busy),
        );
        out.push(Effect::ReadMountTable);
    }

    fn on_committed(&mut self, seq: u64, result: Result<(), JournalError>, out: &mut Vec<Effect>) {
        match result {
            Ok(()) => {
                self.durable = self.durable.max(seq);
                let durable = self.durable;
                self.gated.retain(|s, _| *s > durable);
                let (ready, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
                    .into_iter()
                    .partition(|(s, _, _)| *s <= durable);
                self.held = keep;
                for (_, to, reply) in ready {
                    out.push(Effect::Reply {
                        to,
                        answer: Answer::Publish(Ok(reply)),
                    });
                }
            }
            Err(e) => {
                // The plugin calls of this commit were not started: fail them (their
                // intents stay in memory and are written with the next commit), and
                // answer no caller from records that are not on disk.
                tracing::error!(error = %e, "journal write failed; the calls that waited on it do not run");
                self.journal.redo();
                let failed: Vec<u64> = self.gated.range(..=seq).map(|(s, _)| *s).collect();
                for s in failed {
                    for volume in self.gated.remove(&s).unwrap_or_default() {
                        self.busy.remove(&volume);
                        self.dirty.insert(volume.clone());
                        self.last_error
                            .insert(volume.clone(), format!("journal write failed: {e}"));
                        self.retries
                            .failed(&Work::Mount(volume), STEP_RETRY, self.now);
                    }
                }
                let (failed, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
                    .into_iter()
                    .partition(|(s, _, _)| *s <= seq);
                self.held = keep;
                for (_, to, _) in failed {
                    out.push(Effect::Reply {
                        to,
                        answer: Answer::Publish(Err(ApiError::Journal(e.to_string()))),
                    });
                }
            }
        }
    }

    fn on_done(&mut self, done: Completion, now: Instant, out: &mut Vec<Effect>) {
        match &done {
            Completion::Published { volume, .. }
            | Completion::Unpublished { volume, .. }
            | Completion::ClaimAcquired { volume, .. }
            | Completion::ClaimRenewed { volume, .. }
            | Completion::ClaimReleased { volume, .. } => {
                self.dirty.insert(volume.clone());
            }
            _ => {}
        }
        // Chores (placeholders, creates and deletes) are a pass over every volume: due on
        // what can change them, not on every unpublish of a wave (that made a wave of N
        // unpublishes O(N²)). An unpublish matters to them only when its volume is no
        // longer ready (a delete waits for it); the tick runs them anyway.
        let unpublished_chore = matches!(
            &done,
            Completion::Unpublished { volume, .. }
                if !self.volumes.get(volume).is_some_and(|r| r.state == VolumeState::Ready)
        );
        if unpublished_chore
            || matches!(
                done,
                Completion::PlaceholdersListed(_)
                    | Completion::Placeholder { .. }
                    | Completion::Worker { .. }
            )
        {
            self.chores_due = true;
        }
        match done {
            Completion::Published {
                volume,
                result,
                elapsed,
            } => {
                self.busy.remove(&volume);
                let Some(mut m) = self.journal.mounts().get(&volume).cloned() else {
                    return;
                };
                match result {
                    Ok(p) => {
                        m.state = MountState::Published;
                        m.publish_context = p.context;
                        m.mount = Some(p.mount);
                        m.last_error.clear();
                        self.retries.succeeded(&Work::Mount(volume.clone()));
                        self.last_error.remove(&volume);
                        let ms = elapsed.as_millis() as u64;
                        self.latency.record(ms);
                        tracing::info!(%volume, target = %m.target.display(), ms, "published");
                        self.journal.set_mount(m, EventKind::PublishDone, None);
                        // What the publish established is now what "published" means.
                        if self.scoped {
                            self.check_touched();
                        } else {
                            self.check_all_targets();
                        }
                    }
                    Err(e) => {
                        tracing::warn!(%volume, error = %e, "publish failed; will retry with backoff");
                        m.last_error = e.to_string();
                        self.last_error.insert(volume.clone(), e.to_string());
                        self.retries.failed(&Work::Mount(volume), STEP_RETRY, now);
                        self.journal.set_mount(m, EventKind::PublishFailed, None);
                    }
                }
            }
            Completion::Unpublished { volume, result } => {
                self.busy.remove(&volume);
                match result {
                    Ok(()) => {
                        self.retries.succeeded(&Work::Mount(volume.clone()));
                        self.last_error.remove(&volume);
                        self.holders.remove(&volume);
                        tracing::info!(%volume, "unpublished");
                        self.journal.remove_mount(&volume, EventKind::UnpublishDone);
                        self.claims.on_unpublished(&volume);
                    }
                    Err(e) => {
                        tracing::warn!(%volume, error = %e, "unpublish failed; will retry with backoff");
                        if let crate::executor::StepError::InUse { usage, .. } = &e {
                            self.holders.insert(volume.clone(), usage.clone());
                        }
                        self.last_error.insert(volume.clone(), e.to_string());
                        self.retries
                            .failed(&Work::Mount(volume.clone()), STEP_RETRY, now);
                        if let Some(mut m) = self.journal.mounts().get(&volume).cloned() {
                            m.last_error = e.to_string();
                            self.journal.set_mount(m, EventKind::UnpublishFailed, None);
                        }
                    }
                }
            }
            Completion::Plugins(map) => {
                self.fingerprinting = false;
                let map: BTreeMap<String, Result<Fingerprint, String>> = map
                    .into_iter()
                    .map(|(id, r)| (id, r.map_err(|e| e.to_string())))
                    .collect();
                for (id, r) in &map {
                    if self.plugins.get(id) == Some(r) {
                        continue;
                    }
                    match r {
                        Ok(fp) if fp.deferred_bind => {
                            tracing::info!(plugin = %id, version = %fp.version, "plugin fingerprinted (deferred_bind)")
                        }
                        Ok(fp) => {
                            tracing::warn!(plugin = %id, version = %fp.version, "plugin is not deferred (no deferred_bind): dhv-binder will not use it")
                        }
                        Err(e) => {
                            tracing::warn!(plugin = %id, error = %e, "plugin fingerprint failed")
                        }
                    }
                }
                let before = self.deferred_plugins();
                self.plugins = map;
                if !self.plugins_loaded || self.deferred_plugins() != before {
                    self.replan_all = true;
                }
                self.plugins_loaded = true;
                self.chores_due = true;
            }
            Completion::PluginsUnreadable { dir, error } => {
                // Never "no plugins" (issue 13 §2): the plugins known before stand, and the
                // next fingerprint runs every plugin again.
                self.fingerprinting = false;
                self.fingerprint_every = true;
                tracing::warn!(plugin_dir = %dir.display(), %error, "plugin directory unreadable: keeping the plugins known before");
            }
            Completion::PlaceholdersListed(r) => self.placeholders.on_listed(r, now),
            Completion::Placeholder { volume, result } => {
                self.placeholders
                    .on_done(volume, result, &mut self.retries, now)
            }
            Completion::Worker { volume, result } => {
                self.workers.on_done(volume, result, &mut self.retries, now)
            }
            Completion::Storage { op, result } => {
                if let Some(v) = self.storage_ops.on_done(op, result, &mut self.retries, now) {
                    self.busy.remove(&v);
                }
            }
            Completion::ClaimAcquired { volume, result } => {
                self.busy.remove(&volume);
                self.claims
                    .on_acquired(volume, result, &mut self.retries, now);
            }
            Completion::ClaimRenewed { volume, result } => {
                let mounted_here = self.journal.mounts().contains_key(&volume);
                self.claims.on_renewed(&volume, result, mounted_here, now);
            }
            Completion::ClaimReleased { volume, result } => {
                self.busy.remove(&volume);
                self.claims.on_released(&volume, result);
            }
            Completion::AllocFetched { alloc_id, result } => {
                self.fetching.remove(&alloc_id);
                let fail = match result {
                    Ok(Some(a)) if a.node_id == self.s.node.node_id => {
                        self.view.upsert(*a);
                        None
                    }
                    Ok(Some(a)) => Some(ApiError::OtherNode {
                        alloc_id: alloc_id.clone(),
                        node: a.node_id.clone(),
                        here: self.s.node.node_id.clone(),
                    }),
                    Ok(None) => Some(ApiError::UnknownAllocation {
                        alloc_id: alloc_id.clone(),
                    }),
                    Err(e) => Some(ApiError::Nomad(e.to_string())),
                };
                if let Some(err) = fail {
                    for (to, r) in self.waiters.fail(&alloc_id, err) {
                        out.push(Effect::Reply {
                            to,
                            answer: Answer::Publish(r),
                        });
                    }
                }
            }
            Completion::Probed {
                volume,
                target,
                probe,
            } => {
                let busy = self.busy.contains(&volume);
                out.extend(self.mount_health.on_probe(
                    &volume,
                    &target,
                    probe,
                    busy,
                    self.journal.users(),
                ));
            }
            Completion::Detached { volume, result } => {
                if let Err(e) = result {
                    tracing::warn!(%volume, error = %e, "cannot detach the dead mount");
                }
            }
            Completion::Restarted {
                volume,
                alloc_id,
                result,
            } => self.mount_health.on_restarted(
                &volume,
                &alloc_id,
                result.err().map(|e| e.to_string()),
            ),
        }
    }

    /// Plans and turns steps into effects, keeps placeholders and records current,
    /// answers callers, and commits the pass's journal changes.
    fn drive(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let deferred = self.deferred_plugins();
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
                volumes: &self.volumes,
                mounts: self.journal.mounts(),
                users: self.journal.users(),
                mounted: &self.mounted,
                plugins: &deferred,
                busy: &self.busy,
                claims: &claims,
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
        self.waiting = self.plan_waiting.values().cloned().collect();
        self.waiting.extend(self.claims.waiting());
        let (mut add, mut remove, mut steps) = (Vec::new(), Vec::new(), Vec::new());
        for step in plan.steps {
            match step {
                Step::AddUser(u) => add.push(u),
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
                    if !self.retries.ready(&Work::Mount(volume.clone()), now) {
                        self.parked.insert(volume);
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
                    self.busy.insert(volume.clone());
                    out.push(Effect::AcquireClaim { volume, volume_id });
                }
                Step::ReleaseClaim { volume } => {
                    let Some(lock_id) = self.claims.lock_id(&volume).map(str::to_string) else {
                        continue;
                    };
                    self.busy.insert(volume.clone());
                    out.push(Effect::ReleaseClaim { volume, lock_id });
                }
            }
        }
        let chores = std::mem::take(&mut self.chores_due);
        if chores && self.placeholders_ready() {
            let want: BTreeMap<VolumeKey, (&VolumeRecord, PathBuf)> = self
                .volumes
                .values()
                .filter(|r| r.state == VolumeState::Ready && self.serves(r, &deferred))
                .filter_map(|r| Some((r.key(), (r, self.target_of(&r.key())?))))
                .collect();
            // A pass over every volume: counted with the planning work.
            self.plan_visits += self.volumes.len() as u64;
            out.extend(self.placeholders.drive(&want, &self.retries, now));
        }
        if chores && self.plugins_loaded {
            self.plan_visits += self.volumes.len() as u64;
            let pool = &self.s.node.node_pool;
            let me = self.s.node.node_id.as_str();
            let served = self
                .volumes
                .values()
                .filter(|r| serves(r, &deferred, pool) && !storage_ops::create_elsewhere(r, me));
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
        self.answer_waiters(now, out);
        if let Some(commit) = self.journal.take_commit() {
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

    /// Takes a new reading of the host's mount table and checks against it the targets it
    /// can have changed: where the table differs from the last reading
    /// ([`MountTable::changed_points`]) and where a mount record changed since the last
    /// check. The first reading checks every record. O(mounts) integer work per reading plus
    /// O(log n) per changed target: a burst of N publishes no longer costs N passes over
    /// every record (issue 10).
    fn on_table(&mut self, t: MountTable) {
        let before = std::mem::replace(&mut self.table, t);
        if !self.targets_checked || !self.scoped {
            self.targets_checked = true;
            self.journal.take_touched();
            self.check_all_targets();
            return;
        }
        let mut paths: BTreeSet<(PathBuf, Option<VolumeKey>)> = self
            .table
            .changed_points(&before)
            .into_iter()
            .map(|p| (p, None))
            .collect();
        paths.extend(
            self.journal
                .take_touched()
                .into_iter()
                .map(|(p, k)| (p, Some(k))),
        );
        for (p, k) in paths {
            self.check_target(&p, k.as_ref());
        }
    }

    /// Checks the targets whose mount records changed since the last check against the
    /// current reading (after a publish established what "published" means).
    fn check_touched(&mut self) {
        if !self.targets_checked {
            return;
        }
        for (p, k) in self.journal.take_touched() {
            self.check_target(&p, Some(&k));
        }
    }

    /// Every record against the current reading (the first reading).
    fn check_all_targets(&mut self) {
        let records: Vec<(PathBuf, VolumeKey)> = self
            .journal
            .mounts()
            .iter()
            .map(|(k, m)| (m.target.clone(), k.clone()))
            .collect();
        let stale_points: Vec<PathBuf> = self
            .mounted
            .iter()
            .filter(|p| self.journal.volume_at(p).is_none())
            .cloned()
            .collect();
        let stale_keys: Vec<VolumeKey> = self
            .foreign
            .keys()
            .filter(|k| !self.journal.mounts().contains_key(*k))
            .cloned()
            .collect();
        for (p, k) in records {
            self.check_target(&p, Some(&k));
        }
        for p in stale_points {
            self.check_target(&p, None);
        }
        for k in stale_keys {
            self.clear_foreign(&k);
        }
    }

    /// What the current reading says of the record (if any) targeting `target`; `gone` is
    /// a volume whose record was removed or moved away from `target`.
    fn check_target(&mut self, target: &std::path::Path, gone: Option<&VolumeKey>) {
        use crate::mounts::TargetState;
        self.plan_visits += 1;
        // A volume whose record went (or moved away from `target`) is nobody's foreign
        // mount any more.
        if let Some(k) = gone {
            if !self.journal.mounts().contains_key(k) {
                self.clear_foreign(k);
            }
        }
        let Some(key) = self.journal.volume_at(target).cloned() else {
            // No record targets it (any more): it is nobody's "published".
            self.mounted.remove(target);
            return;
        };
        let Some(m) = self.journal.mounts().get(&key) else {
            return;
        };
        let state = self.table.target_state(&m.target, m.mount.as_ref());
        let published = matches!(state, TargetState::Published { .. });
        let found = match state {
            TargetState::Published { .. } => None,
            TargetState::Unmounted => None,
            // Nothing established yet (an interrupted publish, an older journal): the
            // plugin's idempotent publish decides whether the mount is the volume's.
            _ if m.mount.is_none() => None,
            TargetState::Foreign { found } => Some(found.to_string()),
            TargetState::Stacked { count, top } => {
                Some(format!("{count} stacked mounts ({top} on top)"))
            }
        };
        let why = found.map(|found| {
            format!(
                "{} holds {found}, not this volume's mount{}: it is not published over nor used; unmount it",
                m.target.display(),
                m.mount.as_ref().map(|i| format!(" ({i})")).unwrap_or_default()
            )
        });
        // The volumes whose answer changed are planned again.
        let changed = if published {
            self.mounted.insert(target.to_path_buf())
        } else {
            self.mounted.remove(target)
        };
        if changed {
            self.dirty.insert(key.clone());
        }
        match why {
            Some(why) => {
                if self.foreign.get(&key) != Some(&why) {
                    tracing::error!(volume = %key, reason = %why, "foreign mount at a volume's target");
                    self.dirty.insert(key.clone());
                    self.foreign.insert(key, why);
                }
            }
            None => self.clear_foreign(&key),
        }
    }

    fn clear_foreign(&mut self, key: &VolumeKey) {
        if self.foreign.remove(key).is_some() {
            tracing::info!(volume = %key, "the foreign mount at the volume's target is gone");
            self.dirty.insert(key.clone());
        }
    }

    /// Notes (and logs once) the tasks of an allocation that could start on a deferred
    /// volume before it is published: no prestart gate.
    fn check_gate(&mut self, alloc_id: &str) {
        let Some(a) = self.view.allocs().get(alloc_id) else {
            self.ungated.remove(alloc_id);
            return;
        };
        let found = if a.tasks_finished() {
            Vec::new()
        } else {
            let reqs = crate::view::requests(a, &self.volumes);
            crate::gate::ungated(a, &reqs, crate::gate::SOCKET_VOLUME)
        };
        if found.is_empty() {
            self.ungated.remove(alloc_id);
            return;
        }
        if self.ungated.get(alloc_id) != Some(&found) {
            for u in &found {
                tracing::warn!(%alloc_id, job = %u.job, group = %u.group, task = %u.task, volume = %u.volume, "{u}");
            }
        }
        self.ungated.insert(alloc_id.to_string(), found);
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
            claim_id: self.claims.lock_id(&volume).map(str::to_string),
            mount: prev.and_then(|p| p.mount.clone()),
        };
        let expected = m.mount.clone();
        self.journal
            .set_mount(m, EventKind::PublishIntent, Some(&alloc_id));
        tracing::info!(%volume, %alloc_id, target = %target.display(), "publishing");
        self.busy.insert(volume);
        Some(Effect::Publish {
            volume: Box::new(rec),
            target,
            read_only,
            alloc_id,
            expected,
        })
    }

    /// Records the unpublish intent; the call itself waits for the commit.
    fn start_unpublish(&mut self, volume: VolumeKey) -> Option<Effect> {
        let mut m = self.journal.mounts().get(&volume)?.clone();
        m.state = MountState::Unpublishing;
        self.journal
            .set_mount(m.clone(), EventKind::UnpublishIntent, None);
        tracing::info!(%volume, target = %m.target.display(), "unpublishing");
        self.busy.insert(volume.clone());
        Some(Effect::Unpublish {
            keep_dir: self.placeholders.contains(&volume),
            volume: self.volumes.get(&volume).cloned().map(Box::new),
            mount: Box::new(m),
        })
    }

    fn answer_waiters(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let known = Known {
            view: &self.view,
            volumes: &self.volumes,
            journal: &self.journal,
            last_error: &self.last_error,
            busy: &self.busy,
            waiting: &self.waiting,
            mounted: &self.mounted,
        };
        let answers = self.waiters.answer(&known, now);
        // A success rests on records that may not be on disk yet: it waits for them.
        let pending = self.journal.is_dirty() || self.issued > self.durable;
        let seq = self.issued + u64::from(self.journal.is_dirty());
        for (to, r) in answers {
            match r {
                Ok(reply) if pending => self.held.push((seq, to, reply)),
                r => out.push(Effect::Reply {
                    to,
                    answer: Answer::Publish(r),
                }),
            }
        }
    }

    /// The status document (`GET /v1/status`).
    fn status(&self) -> serde_json::Value {
        let deferred = self.deferred_plugins();
        let volumes: Vec<_> = self
            .volumes
            .values()
            .map(|r| {
                serde_json::json!({
                    "namespace": r.spec.namespace, "name": r.spec.name, "id": r.id,
                    "plugin_id": r.spec.plugin_id, "state": r.state.as_str(),
                    "served_here": self.serves(r, &deferred),
                    "placeholder_id": self.placeholders.id(&r.key()),
                })
            })
            .collect();
        let plugins: BTreeMap<_, _> = self
            .plugins
            .iter()
            .map(|(id, r)| match r {
                Ok(fp) => (
                    id.clone(),
                    serde_json::json!({"version": fp.version, "deferred_bind": fp.deferred_bind}),
                ),
                Err(e) => (id.clone(), serde_json::json!({"error": e})),
            })
            .collect();
        serde_json::json!({
            "node_id": self.s.node.node_id,
            "node_pool": self.s.node.node_pool,
            "watch": self.watch,
            "view": {"complete": self.view.is_complete(), "index": self.view.index(), "allocations": self.view.allocs().len(), "departing": self.view.departing()},
            "volumes": volumes,
            "mounts": self.journal.mounts().values().collect::<Vec<_>>(),
            "users": self.journal.users(),
            "waiting": self.waiting.iter().map(|w| serde_json::json!({"volume": w.volume.to_string(), "reason": w.reason})).collect::<Vec<_>>(),
            "errors": self.last_error.iter().map(|(k, e)| (k.to_string(), e.clone())).collect::<BTreeMap<_, _>>(),
            "plugins": plugins,
            "publish_latency_ms": {"count": self.latency.count(), "median": self.latency.median_bound()},
            "pending_publish_calls": self.waiters.len(),
            "claims": self.claims.status(),
            "mount_health": self.mount_health.status(),
            "storage_ops": {"snapshots": self.storage_ops.snapshot_count(), "running": self.storage_ops.running()},
            "foreign_mounts": self.foreign.iter().map(|(k, why)| (k.to_string(), why.clone())).collect::<BTreeMap<_, _>>(),
            "holders": self.holders.iter().map(|(k, u)| (k.to_string(), u)).collect::<BTreeMap<_, _>>(),
            "ungated": self.ungated.iter().map(|(id, u)| (id.clone(), u)).collect::<BTreeMap<_, _>>(),
        })
    }
}

/// Counts the shell's metrics read after a pass (agent/meter.rs).
impl Core {
    /// Allocations of this node and volume records known (O(1)).
    pub(crate) fn known(&self) -> (usize, usize) {
        (self.view.allocs().len(), self.volumes.len())
    }

    /// Volume records this node serves (a pass over the catalogue: ask when it or the
    /// plugins changed).
    pub(crate) fn volumes_served(&self) -> usize {
        let deferred = self.deferred_plugins();
        self.volumes
            .values()
            .filter(|r| self.serves(r, &deferred))
            .count()
    }

    /// Mount records by state: publishing, published, unpublishing (a pass over the
    /// records: ask after a pass that commits, which writes them all anyway).
    pub(crate) fn mounts_by_state(&self) -> [usize; 3] {
        let mut n = [0; 3];
        for m in self.journal.mounts().values() {
            n[match m.state {
                MountState::Publishing => 0,
                MountState::Published => 1,
                MountState::Unpublishing => 2,
            }] += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    //! The core's decisions, driven with plain `Instant`s: no tokio, no root, no I/O.
    use super::*;
    use crate::agent::effect::publishes;
    use crate::api::PublishRequest;
    use crate::claims::ClaimError;
    use crate::executor::{StepError, WorkerError};
    use crate::journal::Journal;
    use crate::mounts::MountTable;
    use crate::reconcile::tests::{alloc, key, volume};

    const NODE: &str = "node-1";

    fn settings() -> Settings {
        Settings {
            node: NodeEnv {
                node_id: NODE.into(),
                node_pool: "default".into(),
                volumes_dir: "/v".into(),
                plugin_dir: "/p".into(),
            },
            mount_root: "/m".into(),
            plugin_rescan: Duration::from_secs(60),
            claims: ClaimSettings {
                ttl: Duration::from_secs(15),
                lock_delay: Duration::from_secs(15),
            },
            health_interval: Duration::from_secs(10),
            seed: 1,
        }
    }

    fn target(name: &str) -> PathBuf {
        PathBuf::from(format!("/m/default/{name}"))
    }

    /// What a publish of `name` established, as `MountTable::from_points` shows it.
    fn mounted_at(name: &str) -> crate::executor::PublishedMount {
        crate::executor::PublishedMount {
            context: serde_json::Value::Null,
            mount: crate::mounts::MountIdentity::of_point(&target(name)),
        }
    }

    struct H {
        core: Core,
        t: Instant,
        /// Every effect of the set-up.
        setup: Vec<Effect>,
    }

    impl H {
        /// A core that knows its plugin (`bind`), the volumes and the allocations.
        fn new(volumes: &[(&str, &str)], allocs: Vec<crate::nomad::types::Allocation>) -> Self {
            let t = Instant::now();
            let mut h = H {
                core: Core::new(settings(), Journal::new(NODE), t),
                t,
                setup: Vec::new(),
            };
            h.feed(Input::MountTable(MountTable::default()));
            h.feed(Input::Done(Completion::PlaceholdersListed(Ok(
                BTreeMap::new(),
            ))));
            let fp = Fingerprint {
                version: "1".into(),
                deferred_bind: true,
                capabilities: Vec::new(),
            };
            h.feed(Input::Done(Completion::Plugins(BTreeMap::from([(
                "bind".to_string(),
                Ok(fp),
            )]))));
            let e = h.feed(Input::Catalogue(
                volumes
                    .iter()
                    .map(|(n, m)| (key(n), volume(n, m)))
                    .collect(),
            ));
            h.setup.extend(e);
            let e = h.feed(Input::Watch(WatchEvent::Relisted { allocs, index: 1 }));
            h.setup.extend(e);
            h
        }

        fn feed(&mut self, i: Input) -> Vec<Effect> {
            self.core.handle(i, self.t)
        }

        fn at(&mut self, after: Duration, i: Input) -> Vec<Effect> {
            self.t += after;
            self.feed(i)
        }

        fn api_publish(&mut self, reply: u64, alloc_id: &str, wait: Duration) -> Vec<Effect> {
            self.feed(Input::Api {
                reply: ReplyId(reply),
                call: ApiCall::Publish(PublishRequest {
                    alloc_id: alloc_id.into(),
                    namespace: "default".into(),
                    wait,
                }),
            })
        }

        /// Completes a publish of `name` with its mount now in the table.
        fn published(&mut self, name: &str) -> Vec<Effect> {
            self.feed(Input::MountTable(MountTable::from_points([target(name)])));
            self.feed(Input::Done(Completion::Published {
                volume: key(name),
                result: Ok(mounted_at(name)),
                elapsed: Duration::from_millis(3),
            }))
        }

        fn committed(&mut self, e: &[Effect]) -> Vec<Effect> {
            let seq = commits(e).last().map(|(s, _)| *s).expect("a commit");
            self.feed(Input::Committed {
                seq,
                result: Ok(()),
            })
        }
    }

    /// The commits of `e`: (seq, the effects waiting on it).
    fn commits(e: &[Effect]) -> Vec<(u64, &Vec<Effect>)> {
        e.iter()
            .filter_map(|e| match e {
                Effect::Commit { commit, then } => Some((commit.seq, then)),
                _ => None,
            })
            .collect()
    }

    fn unpublishes(e: &[Effect]) -> usize {
        e.iter()
            .map(|e| match e {
                Effect::Unpublish { .. } => 1,
                Effect::Commit { then, .. } => unpublishes(then),
                _ => 0,
            })
            .sum()
    }

    fn replies(e: &[Effect]) -> Vec<(u64, &Result<PublishReply, ApiError>)> {
        e.iter()
            .filter_map(|e| match e {
                Effect::Reply {
                    to,
                    answer: Answer::Publish(r),
                } => Some((to.0, r)),
                _ => None,
            })
            .collect()
    }

    const A1: &str = "a1";

    #[test]
    fn a_publish_starts_only_after_its_intent_is_committed() {
        let t = Instant::now();
        let mut core = Core::new(settings(), Journal::new(NODE), t);
        let mut all = Vec::new();
        all.extend(core.handle(Input::MountTable(MountTable::default()), t));
        let fp = Fingerprint {
            version: "1".into(),
            deferred_bind: true,
            capabilities: Vec::new(),
        };
        all.extend(core.handle(
            Input::Done(Completion::Plugins(BTreeMap::from([(
                "bind".into(),
                Ok(fp),
            )]))),
            t,
        ));
        all.extend(core.handle(
            Input::Catalogue(BTreeMap::from([(
                key("d"),
                volume("d", "multi-node-multi-writer"),
            )])),
            t,
        ));
        let e = core.handle(
            Input::Watch(WatchEvent::Relisted {
                allocs: vec![alloc(A1, &["d"], "pending", "run")],
                index: 1,
            }),
            t,
        );
        assert_eq!(publishes(&all), 0);
        let c = commits(&e);
        assert_eq!(c.len(), 1, "{e:?}");
        assert_eq!(publishes(c[0].1), 1, "the publish waits on the commit");
        assert!(
            !e.iter().any(|x| matches!(x, Effect::Publish { .. })),
            "no publish outside the commit"
        );
        assert_eq!(
            core.journal().mounts()[&key("d")].state,
            MountState::Publishing
        );
    }

    #[test]
    fn a_burst_of_allocations_is_one_commit_with_every_publish() {
        let names: Vec<String> = (0..50).map(|i| format!("v{i}")).collect();
        let vols: Vec<(&str, &str)> = names
            .iter()
            .map(|n| (n.as_str(), "multi-node-multi-writer"))
            .collect();
        let t = Instant::now();
        let mut h = H {
            core: Core::new(settings(), Journal::new(NODE), t),
            t,
            setup: Vec::new(),
        };
        h.feed(Input::MountTable(MountTable::default()));
        h.feed(Input::Done(Completion::Plugins(BTreeMap::from([(
            "bind".to_string(),
            Ok(Fingerprint {
                version: "1".into(),
                deferred_bind: true,
                capabilities: Vec::new(),
            }),
        )]))));
        h.feed(Input::Catalogue(
            vols.iter().map(|(n, m)| (key(n), volume(n, m))).collect(),
        ));
        let allocs = names
            .iter()
            .enumerate()
            .map(|(i, n)| alloc(&format!("a{i}"), &[n.as_str()], "pending", "run"))
            .collect();
        let e = h.feed(Input::Watch(WatchEvent::Relisted { allocs, index: 1 }));
        let c = commits(&e);
        assert_eq!(c.len(), 1);
        assert_eq!(publishes(c[0].1), 50);
    }

    #[test]
    fn a_caller_is_answered_once_its_user_record_is_durable() {
        let mut h = H::new(
            &[("d", "multi-node-multi-writer")],
            vec![alloc(A1, &["d"], "pending", "run")],
        );
        assert!(replies(&h.api_publish(7, A1, Duration::from_secs(30))).is_empty());
        let e = h.published("d");
        assert!(
            replies(&e).is_empty(),
            "held until the user record is on disk"
        );
        assert_eq!(
            commits(&e).len(),
            1,
            "publish-done and the user record, one commit"
        );
        let e = h.committed(&e);
        let r = replies(&e);
        assert_eq!(r.len(), 1);
        let (to, Ok(reply)) = r[0] else {
            panic!("{r:?}")
        };
        assert_eq!(to, 7);
        assert_eq!(reply.volumes[0].path, target("d").display().to_string());
    }

    #[test]
    fn a_failed_commit_starts_nothing_and_answers_no_success() {
        let mut h = H::new(
            &[("d", "multi-node-multi-writer")],
            vec![alloc(A1, &["d"], "pending", "run")],
        );
        h.api_publish(7, A1, Duration::from_secs(30));
        let e = h.published("d");
        let seq = commits(&e)[0].0;
        let err = JournalError::Write {
            path: "/s/journal.json".into(),
            source: std::io::Error::other("disk full"),
        };
        let e = h.feed(Input::Committed {
            seq,
            result: Err(err),
        });
        let r = replies(&e);
        assert!(matches!(r[..], [(7, Err(ApiError::Journal(_)))]), "{r:?}");
        assert_eq!(commits(&e).len(), 1, "the state is written again");
    }

    #[test]
    fn publish_timed_out_when_the_deadline_passes_first() {
        let mut h = H::new(
            &[("d", "multi-node-multi-writer")],
            vec![alloc(A1, &["d"], "pending", "run")],
        );
        h.api_publish(7, A1, Duration::from_secs(2));
        assert_eq!(h.core.next_wakeup(), Some(h.t + Duration::from_secs(2)));
        assert!(replies(&h.at(Duration::from_secs(1), Input::Tick)).is_empty());
        let e = h.at(Duration::from_secs(1), Input::Tick);
        assert!(
            matches!(
                replies(&e)[..],
                [(7, Err(ApiError::NotPublishedInTime { .. }))]
            ),
            "{e:?}"
        );
    }

    #[test]
    fn a_caller_for_an_allocation_not_seen_yet_times_out_after_a_fetch() {
        let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
        let e = h.api_publish(7, A1, Duration::from_secs(1));
        assert!(
            matches!(&e[..], [Effect::FetchAlloc { alloc_id }] if alloc_id == A1),
            "{e:?}"
        );
        let e = h.at(Duration::from_secs(1), Input::Tick);
        assert!(matches!(
            replies(&e)[..],
            [(7, Err(ApiError::AllocationNotSeen { .. }))]
        ));
    }

    #[test]
    fn an_allocation_nomad_does_not_know_is_not_found() {
        let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
        h.api_publish(7, A1, Duration::from_secs(30));
        let e = h.feed(Input::Done(Completion::AllocFetched {
            alloc_id: A1.into(),
            result: Ok(None),
        }));
        assert!(matches!(
            replies(&e)[..],
            [(7, Err(ApiError::UnknownAllocation { .. }))]
        ));
    }

    #[test]
    fn a_caller_that_went_away_is_forgotten() {
        let mut h = H::new(
            &[("d", "multi-node-multi-writer")],
            vec![alloc(A1, &["d"], "pending", "run")],
        );
        h.api_publish(7, A1, Duration::from_secs(30));
        h.feed(Input::CallerGone(ReplyId(7)));
        let e = h.at(Duration::from_secs(31), Input::Tick);
        assert!(replies(&e).is_empty());
    }

    #[test]
    fn a_failed_publish_fails_its_caller_and_is_retried_after_its_backoff() {
        let mut h = H::new(
            &[("d", "multi-node-multi-writer")],
            vec![alloc(A1, &["d"], "pending", "run")],
        );
        h.api_publish(7, A1, Duration::from_secs(30));
        let err = StepError::NotMounted {
            plugin: "bind".into(),
            target: target("d"),
        };
        let e = h.feed(Input::Done(Completion::Published {
            volume: key("d"),
            result: Err(err),
            elapsed: Duration::from_millis(1),
        }));
        assert!(
            matches!(replies(&e)[..], [(7, Err(ApiError::PublishFailed { .. }))]),
            "{e:?}"
        );
        assert_eq!(publishes(&e), 0, "not again at once");
        let wake = h.core.next_wakeup().unwrap();
        assert!(
            wake <= h.t + Duration::from_millis(1200),
            "the retry is a wake-up"
        );
        let e = h.at(Duration::from_millis(1200), Input::Tick);
        assert_eq!(publishes(&e), 1);
    }

    #[test]
    fn a_stopped_allocation_is_refused_and_its_volume_unpublished() {
        let mut h = H::new(
            &[("d", "multi-node-multi-writer")],
            vec![alloc(A1, &["d"], "pending", "run")],
        );
        let e = h.published("d");
        h.committed(&e);
        let mut a = alloc(A1, &["d"], "complete", "stop");
        a.modify_index = 5;
        let e = h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a))));
        assert_eq!(unpublishes(&e), 1, "{e:?}");
        let e = h.api_publish(8, A1, Duration::from_secs(30));
        assert!(matches!(
            replies(&e)[..],
            [(8, Err(ApiError::AllocationStopped { .. }))]
        ));
    }

    #[test]
    fn a_lost_claim_is_unpublished_and_then_forgotten() {
        let mut h = H::new(
            &[("d", "single-node-writer")],
            vec![alloc(A1, &["d"], "running", "run")],
        );
        // Not published before the claim is held.
        let e = h.feed(Input::Tick);
        assert_eq!(publishes(&e), 0);
        h.feed(Input::Done(Completion::ClaimAcquired {
            volume: key("d"),
            result: Ok("lock".into()),
        }));
        let e = h.published("d");
        h.committed(&e);
        let e = h.at(Duration::from_secs(5), Input::Tick);
        assert!(e.iter().any(|x| matches!(x, Effect::RenewClaim { .. })));
        let e = h.feed(Input::Done(Completion::ClaimRenewed {
            volume: key("d"),
            result: Err(ClaimError::Lost { volume: key("d") }),
        }));
        assert_eq!(
            unpublishes(&e),
            1,
            "claim lost: unpublished first, though still needed"
        );
        let e = h.feed(Input::Done(Completion::Unpublished {
            volume: key("d"),
            result: Ok(()),
        }));
        assert!(
            !e.iter().any(|x| matches!(x, Effect::ReleaseClaim { .. })),
            "a lost claim is not released"
        );
        assert!(h.core.claims.states().is_empty());
    }

    #[test]
    fn a_claim_is_released_by_the_plan_once_nothing_uses_it() {
        let mut h = H::new(
            &[("d", "single-node-writer")],
            vec![alloc(A1, &["d"], "running", "run")],
        );
        h.feed(Input::Done(Completion::ClaimAcquired {
            volume: key("d"),
            result: Ok("lock".into()),
        }));
        let e = h.published("d");
        h.committed(&e);
        let mut a = alloc(A1, &["d"], "complete", "stop");
        a.modify_index = 5;
        h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a))));
        let e = h.feed(Input::Done(Completion::Unpublished {
            volume: key("d"),
            result: Ok(()),
        }));
        let released: Vec<_> = e
            .iter()
            .filter(|x| matches!(x, Effect::ReleaseClaim { lock_id, .. } if lock_id == "lock"))
            .collect();
        assert_eq!(released.len(), 1, "{e:?}");
        let e = h.feed(Input::Tick);
        assert!(
            !e.iter().any(|x| matches!(x, Effect::ReleaseClaim { .. })),
            "once"
        );
    }

    #[test]
    fn placeholders_follow_the_ready_volumes_this_node_serves() {
        let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
        let e = std::mem::take(&mut h.setup);
        let regs: Vec<_> = e
            .iter()
            .filter(
                |x| matches!(x, Effect::RegisterPlaceholder { target: t, .. } if *t == target("d")),
            )
            .collect();
        assert_eq!(regs.len(), 1, "{e:?}");
        assert!(
            !h.feed(Input::Tick)
                .iter()
                .any(|x| matches!(x, Effect::RegisterPlaceholder { .. })),
            "once in flight"
        );
        h.feed(Input::Done(Completion::Placeholder {
            volume: key("d"),
            result: Ok(Some("hv-1".into())),
        }));
        let e = h.feed(Input::Catalogue(BTreeMap::new()));
        assert!(e
            .iter()
            .any(|x| matches!(x, Effect::DeregisterPlaceholder { id, .. } if id == "hv-1")));
    }

    #[test]
    fn pending_volumes_are_created_and_a_mounted_one_is_not_deleted() {
        let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
        let mut rec = volume("d", "multi-node-multi-writer");
        rec.state = VolumeState::Pending;
        let e = h.feed(Input::Catalogue(BTreeMap::from([(key("d"), rec.clone())])));
        assert_eq!(
            e.iter().filter(|x| matches!(x, Effect::Create(_))).count(),
            1
        );
        h.feed(Input::Done(Completion::Worker {
            volume: key("d"),
            result: Err(WorkerError::TakenByOther),
        }));
        let e = h.feed(Input::Tick);
        assert!(
            !e.iter().any(|x| matches!(x, Effect::Create(_))),
            "backs off"
        );
        // A volume being deleted while a placeholder still points at it waits.
        rec.state = VolumeState::Deleting;
        h.feed(Input::Done(Completion::Placeholder {
            volume: key("d"),
            result: Ok(Some("hv-1".into())),
        }));
        let e = h.at(
            Duration::from_secs(5),
            Input::Catalogue(BTreeMap::from([(key("d"), rec)])),
        );
        assert!(!e.iter().any(|x| matches!(x, Effect::Delete(_))), "{e:?}");
    }

    #[test]
    fn plugins_are_fingerprinted_on_change_and_once_per_rescan() {
        let mut h = H::new(&[], vec![]);
        // The fingerprints asked for: `changed_only` of each.
        let fp = |e: &[Effect]| -> Vec<bool> {
            e.iter()
                .filter_map(|x| match x {
                    Effect::Fingerprint { changed_only } => Some(*changed_only),
                    _ => None,
                })
                .collect()
        };
        let done = |h: &mut H| h.feed(Input::Done(Completion::Plugins(BTreeMap::new())));
        assert_eq!(fp(&h.feed(Input::Tick)), [false], "every plugin at start");
        assert_eq!(fp(&h.feed(Input::Tick)), [] as [bool; 0], "one in flight");
        done(&mut h);
        assert_eq!(
            fp(&h.at(Duration::from_secs(1), Input::Tick)),
            [] as [bool; 0]
        );
        assert_eq!(
            fp(&h.feed(Input::PluginsChanged)),
            [false],
            "every plugin on a change"
        );
        done(&mut h);
        // The periodic rescan runs only the plugins whose file changed (no exec while idle).
        assert_eq!(fp(&h.at(Duration::from_secs(61), Input::Tick)), [true]);
        // A change seen while a rescan is in flight runs every plugin after it.
        assert_eq!(
            fp(&h.feed(Input::PluginsChanged)),
            [] as [bool; 0],
            "one in flight"
        );
        done(&mut h);
        assert_eq!(fp(&h.feed(Input::Tick)), [false]);
        // A directory that could not be read: the next fingerprint runs every plugin.
        h.feed(Input::Done(Completion::PluginsUnreadable {
            dir: "/plugins".into(),
            error: std::io::Error::other("EIO"),
        }));
        assert_eq!(fp(&h.at(Duration::from_secs(61), Input::Tick)), [false]);
        done(&mut h);
        assert_eq!(fp(&h.at(Duration::from_secs(61), Input::Tick)), [true]);
    }

    #[test]
    fn the_mount_table_is_read_on_the_tick_not_per_message() {
        let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
        let reads = |e: &[Effect]| {
            e.iter()
                .filter(|x| matches!(x, Effect::ReadMountTable))
                .count()
        };
        let e = h.feed(Input::Watch(WatchEvent::Relisted {
            allocs: vec![alloc(A1, &["d"], "pending", "run")],
            index: 2,
        }));
        assert_eq!(reads(&e), 0);
        assert_eq!(reads(&h.feed(Input::Tick)), 1);
    }

    #[test]
    fn a_dead_mount_is_detached_and_published_again() {
        let mut h = H::new(
            &[("d", "multi-node-multi-writer")],
            vec![alloc(A1, &["d"], "running", "run")],
        );
        let e = h.published("d");
        h.committed(&e);
        let e = h.at(Duration::from_secs(10), Input::Tick);
        assert!(e.iter().any(|x| matches!(x, Effect::Probe { .. })), "{e:?}");
        let e = h.feed(Input::Done(Completion::Probed {
            volume: key("d"),
            target: target("d"),
            probe: crate::health::Probe::Dead("ENOTCONN".into()),
        }));
        assert!(e.iter().any(|x| matches!(x, Effect::Detach { .. })));
        let mut e = h.feed(Input::MountTable(MountTable::default()));
        e.extend(h.feed(Input::Done(Completion::Detached {
            volume: key("d"),
            result: Ok(()),
        })));
        assert_eq!(publishes(&e), 1, "the plan publishes it again");
    }

    #[test]
    fn messages_that_arrive_together_are_planned_once() {
        let names: Vec<String> = (0..50).map(|i| format!("v{i}")).collect();
        let vols: Vec<(&str, &str)> = names
            .iter()
            .map(|n| (n.as_str(), "multi-node-multi-writer"))
            .collect();
        let mut h = H::new(&vols, vec![]);
        let burst = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let mut a = alloc(&format!("a{i}"), &[n.as_str()], "pending", "run");
                a.modify_index = 10;
                Input::Watch(WatchEvent::Upsert(Box::new(a)))
            })
            .collect();
        let e = h.core.handle_all(burst, h.t);
        let c = commits(&e);
        assert_eq!(c.len(), 1);
        assert_eq!(publishes(c[0].1), 50);
    }

    /// A deterministic generator for the property tests (no dependency, reproducible).
    struct Lcg(u64);

    impl Lcg {
        fn below(&mut self, n: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 33) as usize) % n
        }
    }

    /// The effects as comparable lines (a commit's history, not its wall-clock stamps).
    fn lines(e: &[Effect]) -> Vec<String> {
        let mut out = Vec::new();
        for x in e {
            match x {
                Effect::Commit { commit, then } => {
                    out.push(format!("commit {} {:?}", commit.seq, commit.events()));
                    out.extend(lines(then).into_iter().map(|l| format!("  {l}")));
                }
                Effect::Reply {
                    answer: Answer::Status(_),
                    to,
                } => out.push(format!("status {to:?}")),
                other => out.push(format!("{other:?}")),
            }
        }
        out
    }

    /// A call the world still owes the cores an answer for.
    #[derive(Debug, Clone)]
    enum Owed {
        Publish(VolumeKey),
        Unpublish(VolumeKey),
        Acquire(VolumeKey),
        Release(VolumeKey),
        Renew(VolumeKey),
        Commit(u64, Vec<Owed>),
    }

    fn owed(e: &[Effect], out: &mut Vec<Owed>) {
        for x in e {
            match x {
                Effect::Publish { volume, .. } => out.push(Owed::Publish(volume.key())),
                Effect::Unpublish { mount, .. } => out.push(Owed::Unpublish(mount.volume.clone())),
                Effect::AcquireClaim { volume, .. } => out.push(Owed::Acquire(volume.clone())),
                Effect::ReleaseClaim { volume, .. } => out.push(Owed::Release(volume.clone())),
                Effect::RenewClaim { volume, .. } => out.push(Owed::Renew(volume.clone())),
                Effect::Commit { commit, then } => {
                    let mut calls = Vec::new();
                    owed(then, &mut calls);
                    out.push(Owed::Commit(commit.seq, calls));
                }
                _ => {}
            }
        }
    }

    /// Two cores fed the same inputs: one plans only dirty volumes, one plans everything.
    struct Twin {
        scoped: Core,
        full: Core,
        t: Instant,
        owed: Vec<Owed>,
        mounted: BTreeSet<PathBuf>,
        allocs: BTreeMap<String, crate::nomad::types::Allocation>,
        index: u64,
        catalogues: [Catalogue; 3],
    }

    impl Twin {
        fn new() -> Self {
            let t = Instant::now();
            let mut full = Core::new(settings(), Journal::new(NODE), t);
            full.plan_everything();
            Twin {
                scoped: Core::new(settings(), Journal::new(NODE), t),
                full,
                t,
                owed: Vec::new(),
                mounted: BTreeSet::new(),
                allocs: BTreeMap::new(),
                index: 1,
                catalogues: {
                    let ready: Catalogue = [
                        ("a", "single-node-writer"),
                        ("b", "multi-node-multi-writer"),
                        ("c", "multi-node-multi-writer"),
                    ]
                    .iter()
                    .map(|(n, m)| (key(n), volume(n, m)))
                    .collect();
                    let mut deleting = ready.clone();
                    if let Some(c) = deleting.get_mut(&key("c")) {
                        c.state = VolumeState::Deleting;
                    }
                    let mut gone = ready.clone();
                    gone.remove(&key("c"));
                    [ready, deleting, gone]
                },
            }
        }

        /// Feeds both cores (the input is built twice: inputs are not `Clone`) and checks
        /// that they did the same.
        fn feed(&mut self, make: impl Fn() -> Input, step: &str) {
            let a = self.scoped.handle(make(), self.t);
            let b = self.full.handle(make(), self.t);
            assert_eq!(lines(&a), lines(&b), "after {step}");
            assert_eq!(self.scoped.waiting, self.full.waiting, "after {step}");
            owed(&a, &mut self.owed);
        }

        fn mount_table(&mut self) {
            let points = self.mounted.clone();
            self.feed(
                || Input::MountTable(MountTable::from_points(points.clone())),
                "mount table",
            );
        }

        /// The catalogue with volume `c` ready (0), being deleted (1) or gone (2); the
        /// records are made once (their IDs are random).
        fn catalogue(&mut self, c_state: usize) {
            let c = self.catalogues[c_state].clone();
            self.feed(|| Input::Catalogue(c.clone()), "catalogue");
        }

        fn answer(&mut self, o: Owed, ok: bool) {
            let err = || StepError::NotMounted {
                plugin: "bind".into(),
                target: target("x"),
            };
            match o {
                Owed::Publish(v) => {
                    if ok {
                        self.mounted.insert(target(&v.name));
                        self.mount_table();
                    }
                    self.feed(
                        || {
                            Input::Done(Completion::Published {
                                volume: v.clone(),
                                result: if ok {
                                    Ok(mounted_at(&v.name))
                                } else {
                                    Err(err())
                                },
                                elapsed: Duration::from_millis(1),
                            })
                        },
                        "published",
                    );
                }
                Owed::Unpublish(v) => {
                    if ok {
                        self.mounted.remove(&target(&v.name));
                        self.mount_table();
                    }
                    self.feed(
                        || {
                            Input::Done(Completion::Unpublished {
                                volume: v.clone(),
                                result: if ok { Ok(()) } else { Err(err()) },
                            })
                        },
                        "unpublished",
                    );
                }
                Owed::Acquire(v) => self.feed(
                    || {
                        Input::Done(Completion::ClaimAcquired {
                            volume: v.clone(),
                            result: if ok {
                                Ok(format!("lock-{}", v.name))
                            } else {
                                Err(ClaimError::Held {
                                    volume: v.clone(),
                                    holder: "node-2".into(),
                                })
                            },
                        })
                    },
                    "acquired",
                ),
                Owed::Release(v) => self.feed(
                    || {
                        Input::Done(Completion::ClaimReleased {
                            volume: v.clone(),
                            result: Ok(()),
                        })
                    },
                    "released",
                ),
                Owed::Renew(v) => self.feed(
                    || {
                        Input::Done(Completion::ClaimRenewed {
                            volume: v.clone(),
                            result: if ok {
                                Ok(())
                            } else {
                                Err(ClaimError::Lost { volume: v.clone() })
                            },
                        })
                    },
                    "renewed",
                ),
                Owed::Commit(seq, calls) => {
                    self.feed(
                        || Input::Committed {
                            seq,
                            result: if ok {
                                Ok(())
                            } else {
                                Err(JournalError::Write {
                                    path: "/j".into(),
                                    source: std::io::Error::other("disk full"),
                                })
                            },
                        },
                        "committed",
                    );
                    if ok {
                        self.owed.extend(calls);
                    }
                }
            }
        }
    }

    /// Scoped planning (only the volumes a message can affect, found through the view's
    /// volume index and the journal's user index) does exactly what planning every volume
    /// on every pass does, over random sequences of allocation updates and removals,
    /// relists, catalogue changes, lost mounts, failed and successful plugin, claim and
    /// journal calls, and retries coming due.
    #[test]
    fn scoped_planning_does_what_a_full_plan_does() {
        let statuses = ["pending", "running", "complete", "failed", "lost"];
        let desired = ["run", "stop"];
        let sources: [&[&str]; 5] = [&["a"], &["b"], &["a", "b"], &["c"], &["b", "c"]];
        let ids = ["x1", "x2", "x3", "x4"];
        let mut r = Lcg(99);
        for _ in 0..60 {
            let mut w = Twin::new();
            w.mount_table();
            let fp = || Fingerprint {
                version: "1".into(),
                deferred_bind: true,
                capabilities: Vec::new(),
            };
            w.feed(
                || {
                    Input::Done(Completion::Plugins(BTreeMap::from([(
                        "bind".into(),
                        Ok(fp()),
                    )])))
                },
                "plugins",
            );
            w.catalogue(0);
            w.feed(
                || {
                    Input::Watch(WatchEvent::Relisted {
                        allocs: vec![],
                        index: 1,
                    })
                },
                "first list",
            );
            for _ in 0..80 {
                match r.below(12) {
                    0..=2 => {
                        w.index += 1;
                        let mut a = alloc(
                            ids[r.below(4)],
                            sources[r.below(5)],
                            statuses[r.below(5)],
                            desired[r.below(2)],
                        );
                        a.modify_index = w.index;
                        w.allocs.insert(a.id.clone(), a.clone());
                        w.feed(
                            || Input::Watch(WatchEvent::Upsert(Box::new(a.clone()))),
                            "upsert",
                        );
                    }
                    3 => {
                        let id = ids[r.below(4)].to_string();
                        w.allocs.remove(&id);
                        w.feed(|| Input::Watch(WatchEvent::Removed(id.clone())), "removed");
                    }
                    4 if r.below(4) == 0 => {
                        let allocs: Vec<_> = w.allocs.values().cloned().collect();
                        let index = w.index;
                        w.feed(
                            || {
                                Input::Watch(WatchEvent::Relisted {
                                    allocs: allocs.clone(),
                                    index,
                                })
                            },
                            "relist",
                        );
                    }
                    5 if r.below(3) == 0 => w.catalogue(r.below(3)),
                    6..=8 if !w.owed.is_empty() => {
                        let o = w.owed.remove(r.below(w.owed.len()));
                        let ok = r.below(5) != 0;
                        w.answer(o, ok);
                    }
                    9 if !w.mounted.is_empty() && r.below(3) == 0 => {
                        let lost = w.mounted.iter().nth(r.below(w.mounted.len())).cloned();
                        w.mounted.remove(&lost.unwrap());
                        w.mount_table();
                    }
                    _ => {
                        w.t += Duration::from_millis(r.below(4000) as u64);
                        w.feed(|| Input::Tick, "tick");
                    }
                }
            }
            assert_eq!(w.scoped.journal().mounts(), w.full.journal().mounts());
            assert_eq!(w.scoped.journal().users(), w.full.journal().users());
        }
    }

    /// A core serving volumes `v0`..`v{n-1}`, one allocation each, placed and published
    /// one at a time (each upsert plans its publish, each publish completes); returns the
    /// core, the volume names and the planning work (visits) of the burst.
    fn published_one_at_a_time(n: usize) -> (H, Vec<String>, u64) {
        let names: Vec<String> = (0..n).map(|i| format!("v{i}")).collect();
        let vols: Vec<(&str, &str)> = names
            .iter()
            .map(|n| (n.as_str(), "multi-node-multi-writer"))
            .collect();
        let mut h = H::new(&vols, vec![]);
        let before = h.core.plan_visits();
        for (i, name) in names.iter().enumerate() {
            let mut a = alloc(&format!("a{i:04}"), &[name], "pending", "run");
            a.modify_index = 10 + i as u64;
            let e = h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a))));
            assert_eq!(publishes(&e), 1, "{e:?}");
            h.committed(&e);
            let points: Vec<PathBuf> = names[..=i].iter().map(|n| target(n)).collect();
            h.feed(Input::MountTable(MountTable::from_points(points)));
            let e = h.feed(Input::Done(Completion::Published {
                volume: key(name),
                result: Ok(mounted_at(name)),
                elapsed: Duration::from_millis(1),
            }));
            h.committed(&e);
        }
        assert_eq!(
            h.core.journal().users().len(),
            n,
            "every allocation is a user"
        );
        let work = h.core.plan_visits() - before;
        (h, names, work)
    }

    /// The planning work (visits of records, counted by the core) of a burst of `n`
    /// allocations whose messages arrive one at a time.
    fn burst_planning_work(n: usize) -> u64 {
        published_one_at_a_time(n).2
    }

    /// Issue 10: a 200-allocation burst whose messages arrive one at a time costs O(N)
    /// planning work. Counted, not timed.
    #[test]
    fn a_burst_costs_planning_work_linear_in_its_size() {
        let w50 = burst_planning_work(50);
        let w200 = burst_planning_work(200);
        println!("planning work: N=50: {w50} visits, N=200: {w200} visits");
        assert_eq!(
            w200,
            4 * w50,
            "planning work is not linear: {w50} for 50, {w200} for 200"
        );
    }

    /// The planning work (visits of records, counted by the core) of stopping `n`
    /// allocations one at a time after [`published_one_at_a_time`] published their volumes:
    /// each stop plans an unpublish, each unpublish completes.
    fn wave_planning_work(n: usize) -> u64 {
        let (mut h, names, _) = published_one_at_a_time(n);
        let points: Vec<PathBuf> = names.iter().map(|n| target(n)).collect();
        let before = h.core.plan_visits();
        for (i, name) in names.iter().enumerate().rev() {
            let mut a = alloc(&format!("a{i:04}"), &[name], "complete", "stop");
            a.modify_index = 10_000 + i as u64;
            let e = h.feed(Input::Watch(WatchEvent::Upsert(Box::new(a))));
            assert_eq!(unpublishes(&e), 1, "{name}: {e:?}");
            h.committed(&e);
            // The last mounted first: `from_points` numbers mounts by position, and the
            // mount IDs of the others must not change (they do not in a real table).
            h.feed(Input::MountTable(MountTable::from_points(
                points[..i].iter().cloned(),
            )));
            let e = h.feed(Input::Done(Completion::Unpublished {
                volume: key(name),
                result: Ok(()),
            }));
            h.committed(&e);
        }
        assert!(
            h.core.journal().mounts().is_empty(),
            "every volume unpublished"
        );
        h.core.plan_visits() - before
    }

    /// Issue 10: a wave of N unpublishes (a job of N allocations stopped) costs O(N)
    /// work, chores included (a pass over every volume per unpublish made it O(N²)).
    #[test]
    fn a_wave_of_unpublishes_costs_work_linear_in_its_size() {
        let w50 = wave_planning_work(50);
        let w200 = wave_planning_work(200);
        println!("unpublish wave work: N=50: {w50} visits, N=200: {w200} visits");
        assert!(
            w200 <= 4 * w50 + 8,
            "the wave's work is not linear: {w50} for 50, {w200} for 200"
        );
    }

    // Issue 13 (security): an unreadable plugin directory and invalid volume keys.

    #[test]
    fn an_unreadable_plugin_directory_keeps_the_plugins_known_before() {
        let mut h = H::new(&[("d", "multi-node-multi-writer")], vec![]);
        h.feed(Input::Done(Completion::Placeholder {
            volume: key("d"),
            result: Ok(Some("hv-1".into())),
        }));
        let mut e = h.feed(Input::Done(Completion::PluginsUnreadable {
            dir: "/p".into(),
            error: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        }));
        // A catalogue change plans again with the plugins the core now knows.
        e.extend(h.at(
            Duration::from_secs(1),
            Input::Catalogue(BTreeMap::from([
                (key("d"), volume("d", "multi-node-multi-writer")),
                (key("e"), volume("e", "multi-node-multi-writer")),
            ])),
        ));
        assert!(
            !e.iter()
                .any(|x| matches!(x, Effect::DeregisterPlaceholder { .. })),
            "a read error is not \"no plugins\": {e:?}"
        );
    }

    #[test]
    fn a_volume_key_that_is_not_a_path_gets_no_target() {
        let mut h = H::new(&[], vec![]);
        let e = h.feed(Input::Catalogue(BTreeMap::from([(
            key(".."),
            volume("..", "multi-node-multi-writer"),
        )])));
        assert!(
            !e.iter()
                .any(|x| matches!(x, Effect::RegisterPlaceholder { .. })),
            "{e:?}"
        );
    }
}
