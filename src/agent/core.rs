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
use crate::agent::waiters::{Known, Waiter, Waiters};
use crate::agent::workers::Workers;
use crate::api::{ApiError, PublishReply};
use crate::catalog::Catalogue;
use crate::claims::ClaimSettings;
use crate::environment::NodeEnv;
use crate::journal::{EventKind, Journal, JournalError, MountRecord, MountState};
use crate::plugin::Fingerprint;
use crate::reconcile::{self, Inputs, Step, Waiting};
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
    /// Volumes with a plugin or claim call in flight (calls on one volume are serialized).
    busy: BTreeSet<VolumeKey>,
    last_error: BTreeMap<VolumeKey, String>,
    retries: Retries<Work>,
    waiters: Waiters,
    fetching: BTreeSet<String>,
    placeholders: Placeholders,
    workers: Workers,
    claims: Claims,
    mount_health: MountHealth,
    waiting: Vec<Waiting>,
    latency: Latency,
    mounted: BTreeSet<PathBuf>,
    /// The last commit handed to the shell, and the last one known durable.
    issued: u64,
    durable: u64,
    /// Plugin calls waiting on a commit, by commit: failed if the commit fails.
    gated: BTreeMap<u64, Vec<VolumeKey>>,
    /// Successful answers held until the commit that recorded them is durable.
    held: Vec<(u64, ReplyId, PublishReply)>,
    now: Instant,
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
            busy: BTreeSet::new(),
            last_error: BTreeMap::new(),
            waiters: Waiters::default(),
            fetching: BTreeSet::new(),
            placeholders: Placeholders::default(),
            workers: Workers::default(),
            claims,
            waiting: Vec::new(),
            latency: Latency::default(),
            mounted: BTreeSet::new(),
            issued: 0,
            durable: 0,
            gated: BTreeMap::new(),
            held: Vec::new(),
            now,
        }
    }

    /// The journal's records.
    #[cfg(test)]
    pub(crate) fn journal(&self) -> &Journal {
        &self.journal
    }

    /// Applies one input at `now` and returns the effects to perform, in order.
    pub(crate) fn handle(&mut self, input: Input, now: Instant) -> Vec<Effect> {
        self.now = now;
        let mut out = Vec::new();
        match input {
            Input::Watch(ev) => self.on_watch(ev),
            Input::Catalogue(c) => {
                self.volumes = c;
                self.volumes_loaded = true;
            }
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
                self.on_tick(now, &mut out);
            }
            Input::MountTable(t) => self.mounted = t.points(),
            Input::Committed { seq, result } => self.on_committed(seq, result, &mut out),
            Input::Done(c) => self.on_done(c, now, &mut out),
            Input::Tick => self.on_tick(now, &mut out),
        }
        self.drive(now, &mut out);
        out
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

    fn target_of(&self, key: &VolumeKey) -> PathBuf {
        self.s.mount_root.join(&key.namespace).join(&key.name)
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
            }
            WatchEvent::Upsert(a) => {
                let a = *a;
                tracing::debug!(alloc_id = %a.id, client_status = %a.client_status, desired = %a.desired_status, "allocation update");
                self.view.upsert(a);
            }
            WatchEvent::Removed(id) => self.view.remove_at(&id, self.now),
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
            out.push(Effect::Fingerprint);
        }
        out.extend(self.placeholders.list());
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
                let (ready, keep): (Vec<_>, Vec<_>) =
                    std::mem::take(&mut self.held).into_iter().partition(|(s, _, _)| *s <= durable);
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
                        self.last_error
                            .insert(volume.clone(), format!("journal write failed: {e}"));
                        self.retries
                            .failed(&Work::Mount(volume), STEP_RETRY, self.now);
                    }
                }
                let (failed, keep): (Vec<_>, Vec<_>) =
                    std::mem::take(&mut self.held).into_iter().partition(|(s, _, _)| *s <= seq);
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
                    Ok(ctx) => {
                        m.state = MountState::Published;
                        m.publish_context = ctx;
                        m.last_error.clear();
                        self.retries.succeeded(&Work::Mount(volume.clone()));
                        self.last_error.remove(&volume);
                        let ms = elapsed.as_millis() as u64;
                        self.latency.record(ms);
                        tracing::info!(%volume, target = %m.target.display(), ms, "published");
                        self.journal.set_mount(m, EventKind::PublishDone, None);
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
                        tracing::info!(%volume, "unpublished");
                        self.journal
                            .remove_mount(&volume, EventKind::UnpublishDone);
                        self.claims.on_unpublished(&volume);
                    }
                    Err(e) => {
                        tracing::warn!(%volume, error = %e, "unpublish failed; will retry with backoff");
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
                self.plugins = map;
                self.plugins_loaded = true;
            }
            Completion::PlaceholdersListed(r) => self.placeholders.on_listed(r),
            Completion::Placeholder { volume, result } => {
                self.placeholders
                    .on_done(volume, result, &mut self.retries, now)
            }
            Completion::Worker { volume, result } => {
                self.workers.on_done(volume, result, &mut self.retries, now)
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
            } => self
                .mount_health
                .on_restarted(&volume, &alloc_id, result.err().map(|e| e.to_string())),
        }
    }

    /// Plans and turns steps into effects, keeps placeholders and records current,
    /// answers callers, and commits the pass's journal changes.
    fn drive(&mut self, now: Instant, out: &mut Vec<Effect>) {
        let deferred = self.deferred_plugins();
        let claims = self.claims.states();
        let plan = reconcile::plan(Inputs {
            view: &self.view,
            volumes_loaded: self.volumes_loaded && self.plugins_loaded,
            volumes: &self.volumes,
            mounts: self.journal.mounts(),
            users: self.journal.users(),
            mounted: &self.mounted,
            plugins: &deferred,
            busy: &self.busy,
            claims: &claims,
        });
        self.waiting = plan.waiting;
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
                    if !self.retries.ready(&Work::Mount(volume.clone()), now) {
                        continue;
                    }
                    if let Some(e) = self.start_publish(volume.clone(), alloc_id, read_only) {
                        gated.push(volume);
                        calls.push(e);
                    }
                }
                Step::Unpublish { volume } => {
                    if !self.retries.ready(&Work::Mount(volume.clone()), now) {
                        continue;
                    }
                    if let Some(e) = self.start_unpublish(volume.clone()) {
                        gated.push(volume);
                        calls.push(e);
                    }
                }
                Step::AcquireClaim { volume } => {
                    if !self.retries.ready(&Work::Claim(volume.clone()), now) {
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
        if self.placeholders_ready() {
            let want: BTreeMap<VolumeKey, (&VolumeRecord, PathBuf)> = self
                .volumes
                .values()
                .filter(|r| r.state == VolumeState::Ready && self.serves(r, &deferred))
                .map(|r| (r.key(), (r, self.target_of(&r.key()))))
                .collect();
            out.extend(self.placeholders.drive(&want, &self.retries, now));
        }
        if self.plugins_loaded {
            let pool = &self.s.node.node_pool;
            let served = self.volumes.values().filter(|r| serves(r, &deferred, pool));
            let (journal, placeholders) = (&self.journal, &self.placeholders);
            let in_use = |k: &VolumeKey| journal.mounts().contains_key(k) || placeholders.contains(k);
            out.extend(self.workers.drive(
                served,
                &self.s.node.node_id,
                in_use,
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

    fn placeholders_ready(&self) -> bool {
        self.volumes_loaded && self.plugins_loaded
    }

    /// Records the publish intent; the call itself waits for the commit.
    fn start_publish(&mut self, volume: VolumeKey, alloc_id: String, read_only: bool) -> Option<Effect> {
        let rec = self.volumes.get(&volume)?.clone();
        let prev = self.journal.mounts().get(&volume);
        let target = prev
            .map(|p| p.target.clone())
            .unwrap_or_else(|| self.target_of(&volume));
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
        };
        self.journal
            .set_mount(m, EventKind::PublishIntent, Some(&alloc_id));
        tracing::info!(%volume, %alloc_id, target = %target.display(), "publishing");
        self.busy.insert(volume);
        Some(Effect::Publish {
            volume: Box::new(rec),
            target,
            read_only,
            alloc_id,
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
        })
    }
}
