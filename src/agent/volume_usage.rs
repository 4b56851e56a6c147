//! How each volume on this node is: its usage and condition, read by `statfs` of its
//! mount on a bounded schedule, and since when it has been unused. It runs beside the core
//! on a task of its own and never stalls it: the shell hands it the journal's mounts and
//! users after each pass ([`UsageHandle::follow`]); each round reads every published mount
//! at most [`READS_AT_ONCE`] at a time, each `statfs` on its own thread with its own
//! timeout and never two out for one mount (`crate::node::usage`), so a hung mount costs
//! one thread and is reported as `inaccessible` while the others keep fresh figures.
//!
//! A volume whose plugin declares `stats` or `health` (docs/plugin-protocol.md) has it
//! called in the same round, after its `statfs` answered, each call bounded by
//! [`CHECK_TIMEOUT`] (the call's processes are killed past it): `stats` gives the volume's
//! own usage in place of its mount's filesystem's (bind on a shared export), `health` its
//! condition as its storage sees it (`degraded`, `data-loss`). A change of condition is kept
//! as an event for the node record (`volume status -verbose`).
//!
//! Unused-since: when a volume's last user on this node goes away, the time is kept in
//! `<state_dir>/unused-since.json` (replaced atomically), so it survives an agent restart;
//! a volume this node never saw in use has no time ("never used").

use crate::metrics::{Metrics, Unused, VolumeFigures, VolumeStatsSource};
use crate::node::journal::MountRecord;
use crate::node::journal::{Journal, MountState};
use crate::node::usage::{Condition, Reading, Usage, UsageReader};
use crate::volume::VolumeKey;
use futures_util::StreamExt;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How many `statfs` calls of one round wait for an answer at once.
pub(crate) const READS_AT_ONCE: usize = 8;

/// How long one `statfs` may take before its mount is reported `inaccessible`.
pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The most volumes whose unused-since time is kept (the oldest are forgotten first).
const MAX_UNUSED: usize = 10_000;

/// How long one `stats` or `health` call may take; past it its processes are killed. A
/// `health` that does not answer in time makes the volume `degraded`.
pub(crate) const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// The most condition changes kept per volume, and the most volumes with changes kept
/// (those changed last); the node record keeps fewer ([`crate::cluster::nodes::MAX_NODE_HISTORY`]).
const MAX_CONDITION_EVENTS: usize = 10;
const MAX_CONDITION_VOLUMES: usize = 64;

/// The optional operations the usage task calls on one published volume, with what a call
/// needs: the environment `unpublish` gets (the stored target and contexts,
/// [`crate::storage::environment::unpublish_env`]) and the volume's record (for its secrets,
/// read at each call).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Checks {
    /// The plugin declares `stats`.
    pub stats: bool,
    /// The plugin declares `health`.
    pub health: bool,
    /// The call's environment.
    pub env: Vec<(String, String)>,
    /// The volume's record, when this node has it.
    pub record: Option<Arc<crate::volume::VolumeRecord>>,
}

/// What the usage task needs to call plugins: the runner and this node's part of the
/// environment.
#[derive(Clone)]
pub(crate) struct Calls {
    pub runner: crate::storage::plugin::Runner,
    pub node: crate::storage::environment::NodeEnv,
    /// How often each volume's plugin is asked (`--check-interval`); between calls its
    /// last answers stand.
    pub every: Duration,
}

/// A volume's plugin's last answers: when it was asked, `stats`' usage and `health`'s
/// condition (`None`: not declared, or `stats` gave nothing sound).
#[derive(Debug, Clone, PartialEq)]
struct Answers {
    at: tokio::time::Instant,
    usage: Option<Usage>,
    condition: Option<Condition>,
}

/// One volume of the journal, as the usage task sees it.
#[derive(Debug, Clone)]
pub(crate) struct Known {
    /// Its mount record, shared with the journal (its plugin and target); `None` for a
    /// volume with users and no record.
    pub mount: Option<Arc<MountRecord>>,
    /// Published (its mount is read); else publishing or unpublishing (left alone).
    pub published: bool,
    /// The mount table shows its target mounted. Published and not mounted: its mount is
    /// gone (a dead mount detached to be published again), `inaccessible` without a read.
    pub mounted: bool,
    /// Allocations using it here.
    pub users: usize,
    /// Its plugin's `stats` and `health`, when it declares either.
    pub checks: Option<Checks>,
    /// Not published: its last publish failed stating a condition (the plugin refused a
    /// damaged filesystem: `data-loss`).
    pub failed: Option<Condition>,
}

impl Known {
    /// The plugin that published it (empty without a record).
    pub fn plugin(&self) -> &str {
        self.mount.as_deref().map_or("", |m| m.plugin_id.as_str())
    }

    /// Where it is mounted (empty without a record).
    pub fn target(&self) -> &Path {
        self.mount
            .as_deref()
            .map_or(Path::new(""), |m| m.target.as_path())
    }
}

/// Equal when what the task reads of the record (plugin, target) and the rest are: a
/// record that changed elsewhere (its time, its last error) is the same to the task.
impl PartialEq for Known {
    fn eq(&self, o: &Self) -> bool {
        self.plugin() == o.plugin()
            && self.target() == o.target()
            && self.published == o.published
            && self.mounted == o.mounted
            && self.users == o.users
            && self.checks == o.checks
            && self.failed == o.failed
    }
}

/// The last reading of one published volume.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Figures {
    pub usage: Option<Usage>,
    pub condition: Condition,
}

/// What the task knows, shared with the shell (it annotates the node record).
#[derive(Debug, Default)]
struct State {
    figures: BTreeMap<VolumeKey, Figures>,
    unused: BTreeMap<VolumeKey, u64>,
    in_use: BTreeSet<VolumeKey>,
    /// Changes of condition: (Unix seconds, the new condition), oldest first.
    changes: BTreeMap<VolumeKey, std::collections::VecDeque<(u64, Condition)>>,
    /// Each published volume's plugin's last answers.
    answers: BTreeMap<VolumeKey, Answers>,
    /// The volumes of the last round (shared with the shell's channel): each one's plugin,
    /// for the metrics.
    known: Arc<BTreeMap<VolumeKey, Known>>,
}

/// The shell's side of the usage task.
pub(crate) struct UsageHandle {
    tx: tokio::sync::watch::Sender<Arc<BTreeMap<VolumeKey, Known>>>,
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
    node: Option<crate::storage::environment::NodeEnv>,
}

fn wall_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// The journal's volumes: published mounts (read by `statfs`) and every volume with users.
pub(crate) fn known(journal: &Journal, mounted: &BTreeSet<PathBuf>) -> BTreeMap<VolumeKey, Known> {
    let users = journal.users_by_volume();
    let mut out: BTreeMap<VolumeKey, Known> = journal
        .mounts()
        .iter()
        .map(|(k, m)| {
            (
                k.clone(),
                Known {
                    mount: Some(Arc::clone(m)),
                    published: m.state == MountState::Published,
                    mounted: mounted.contains(&m.target),
                    users: users.get(k).map_or(0, |u| u.len()),
                    checks: None,
                    failed: (m.state == MountState::Publishing)
                        .then(|| {
                            crate::storage::volume_health::failed_publish_condition(&m.last_error)
                        })
                        .flatten(),
                },
            )
        })
        .collect();
    for (k, u) in users {
        out.entry(k.clone()).or_insert_with(|| Known {
            mount: None,
            published: false,
            mounted: false,
            users: u.len(),
            checks: None,
            failed: None,
        });
    }
    out
}

/// Gives each published volume of `next` the `stats` and `health` its plugin declares (in
/// `plugins`), with the environment of its calls, when `record` has its record.
fn add_checks<'a>(
    next: &mut BTreeMap<VolumeKey, Known>,
    journal: &Journal,
    node: &crate::storage::environment::NodeEnv,
    plugins: &BTreeMap<String, Result<crate::storage::plugin::Fingerprint, String>>,
    record: impl Fn(&VolumeKey) -> Option<&'a Arc<crate::volume::VolumeRecord>>,
) {
    use crate::storage::protocol::Capability;
    for (k, v) in next.iter_mut().filter(|(_, v)| v.published) {
        let Some(Ok(fp)) = plugins.get(v.plugin()) else {
            continue;
        };
        let (stats, health) = (
            fp.supports(Capability::Stats),
            fp.supports(Capability::Health),
        );
        let Some(m) = journal.mounts().get(k) else {
            continue;
        };
        // Without its record (not read yet after a restart) the plugin would be
        // called without the volume's parameters and context: not called.
        let rec = record(k).filter(|r| r.id == m.volume_id);
        if let (true, Some(rec)) = (stats || health, rec) {
            // The secrets are read at each call (`ask`), never kept here.
            let mut env = crate::storage::environment::unpublish_env(node, m, Some(rec));
            env.retain(|(k, _)| k != "DHV_SECRETS");
            v.checks = Some(Checks {
                stats,
                health,
                env,
                record: Some(Arc::clone(rec)),
            });
        }
    }
}

/// `<state_dir>/unused-since.json`.
fn unused_path(state_dir: &Path) -> PathBuf {
    state_dir.join("unused-since.json")
}

/// The unused-since times kept by an earlier agent; empty when there are none or the file
/// cannot be read (logged: the times start again from now on).
fn load_unused(state_dir: &Path) -> BTreeMap<VolumeKey, u64> {
    let path = unused_path(state_dir);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return BTreeMap::new(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the volumes' unused-since times; they start again from now");
            return BTreeMap::new();
        }
    };
    match serde_json::from_slice::<Vec<(VolumeKey, u64)>>(&text) {
        Ok(v) => v
            .into_iter()
            .filter(|(k, _)| k.relative_path().is_ok())
            .take(MAX_UNUSED)
            .collect(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "the volumes' unused-since file is malformed; the times start again from now");
            BTreeMap::new()
        }
    }
}

/// Replaces the unused-since file (temp file, fsync, rename, fsync of the directory).
fn save_unused(state_dir: &Path, unused: &BTreeMap<VolumeKey, u64>) -> std::io::Result<()> {
    use std::io::Write;
    let path = unused_path(state_dir);
    let tmp = state_dir.join("unused-since.json.tmp");
    let body = serde_json::to_vec(&unused.iter().collect::<Vec<_>>())?;
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&body)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    std::fs::File::open(state_dir)?.sync_all()
}

impl State {
    /// Notes who uses what now: a volume whose last user went away since the last look is
    /// unused from `now`. True when the unused-since times changed.
    fn observe(&mut self, known: &BTreeMap<VolumeKey, Known>, now: u64) -> bool {
        let mut changed = false;
        let used: BTreeSet<VolumeKey> = known
            .iter()
            .filter(|(_, k)| k.users > 0)
            .map(|(v, _)| v.clone())
            .collect();
        for v in &used {
            changed |= self.unused.remove(v).is_some();
        }
        for gone in self.in_use.difference(&used) {
            self.unused.insert(gone.clone(), now);
            changed = true;
        }
        while self.unused.len() > MAX_UNUSED {
            let oldest = self
                .unused
                .iter()
                .min_by_key(|(_, t)| **t)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => self.unused.remove(&k),
                None => break,
            };
        }
        self.in_use = used;
        // A volume being published again keeps its last (abnormal) reading until it is
        // read again; one whose mount record is gone loses it.
        self.figures.retain(|k, _| {
            known
                .get(k)
                .is_some_and(|k| k.published || !k.target().as_os_str().is_empty())
        });
        // A volume published again is asked again at once.
        self.answers.retain(|k, _| {
            known
                .get(k)
                .is_some_and(|k| k.published && k.checks.is_some())
        });
        changed
    }

    /// A round's readings: each volume still known gets its figures (a change of condition
    /// logged) and its plugin's new answers.
    fn apply(
        &mut self,
        figures: BTreeMap<VolumeKey, (Figures, Option<Answers>)>,
        known: &BTreeMap<VolumeKey, Known>,
    ) {
        for (k, (f, a)) in figures {
            // Still known (the journal may have moved on during the round).
            if !known.contains_key(&k) {
                continue;
            }
            if let Some(a) = a {
                self.answers.insert(k.clone(), a);
            }
            let before = self.figures.get(&k).map(|f| f.condition.clone());
            if before.as_ref() != Some(&f.condition) {
                if f.condition.abnormal {
                    tracing::warn!(volume = %k, condition = %f.condition.word(), message = %f.condition.message, "volume is abnormal");
                } else if before.is_some() {
                    tracing::info!(volume = %k, "volume is healthy again");
                }
            }
            self.set_figures(&k, f, wall_secs());
        }
    }

    /// Sets `k`'s figures; a condition that differs from the last one (or a first one that
    /// is abnormal) is kept as a change at `now`. True when it changed.
    fn set_figures(&mut self, k: &VolumeKey, f: Figures, now: u64) -> bool {
        let before = self.figures.get(k).map(|f| f.condition.clone());
        let changed = match &before {
            Some(b) => b.abnormal != f.condition.abnormal || b.class != f.condition.class,
            None => f.condition.abnormal,
        };
        if changed {
            let q = self.changes.entry(k.clone()).or_default();
            q.push_back((now, f.condition.clone()));
            while q.len() > MAX_CONDITION_EVENTS {
                q.pop_front();
            }
            while self.changes.len() > MAX_CONDITION_VOLUMES {
                let oldest = self
                    .changes
                    .iter()
                    .min_by_key(|(_, q)| q.back().map_or(0, |(t, _)| *t))
                    .map(|(k, _)| k.clone());
                match oldest {
                    Some(o) => self.changes.remove(&o),
                    None => break,
                };
            }
        }
        self.figures.insert(k.clone(), f);
        changed
    }
}

impl UsageHandle {
    /// Starts the usage task: a round every `every`, each `statfs` bounded by `timeout`;
    /// unused-since times kept under `state_dir`; figures exported on `metrics`.
    /// With `calls`, the plugins' `stats` and `health` are called where declared.
    pub(crate) fn start(
        every: Duration,
        timeout: Duration,
        state_dir: &Path,
        metrics: Metrics,
        calls: Option<Calls>,
    ) -> Self {
        let state = Arc::new(Mutex::new(State {
            unused: load_unused(state_dir),
            ..Default::default()
        }));
        let (tx, rx) = tokio::sync::watch::channel(Arc::default());
        let node = calls.as_ref().map(|c| c.node.clone());
        let task = tokio::spawn(run(
            rx,
            Settings {
                every,
                timeout,
                state_dir: state_dir.to_path_buf(),
                calls,
            },
            state.clone(),
            metrics,
        ));
        Self {
            tx,
            state,
            task,
            node,
        }
    }

    /// Hands the task the journal's volumes (after each pass; the task wakes only when
    /// they changed), with the `stats` and `health` of each published volume whose plugin
    /// (in `plugins`, the node's fingerprints) declares them and whose record (`record`, for
    /// the calls' parameters, contexts and secrets) this node has.
    pub(crate) fn follow<'a>(
        &self,
        journal: &Journal,
        mounted: &BTreeSet<PathBuf>,
        plugins: Option<&BTreeMap<String, Result<crate::storage::plugin::Fingerprint, String>>>,
        record: impl Fn(&VolumeKey) -> Option<&'a Arc<crate::volume::VolumeRecord>>,
    ) {
        let mut next = known(journal, mounted);
        if let (Some(node), Some(plugins)) = (&self.node, plugins) {
            add_checks(&mut next, journal, node, plugins, record);
        }
        self.tx.send_if_modified(|k| {
            if **k == next {
                return false;
            }
            *k = Arc::new(next);
            true
        });
    }

    /// `volumes` (the core's view for the node record) with each one's usage (whole
    /// percents), condition class and unused-since time; volumes unused
    /// here and no longer mounted are added.
    pub(crate) fn annotate(
        &self,
        mut volumes: BTreeMap<String, crate::cluster::nodes::NodeVolume>,
    ) -> BTreeMap<String, crate::cluster::nodes::NodeVolume> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for (k, f) in &s.figures {
            let v = volumes.entry(k.to_string()).or_default();
            v.used_percent = f.usage.map(used_percent);
            v.condition = f.condition.class_word();
        }
        // The most recently unused first, so the record's bound keeps those.
        let mut unused: Vec<_> = s.unused.iter().collect();
        unused.sort_by_key(|(_, t)| std::cmp::Reverse(**t));
        for (k, t) in unused {
            let name = k.to_string();
            if volumes.len() >= crate::cluster::nodes::MAX_NODE_VOLUMES
                && !volumes.contains_key(&name)
            {
                continue;
            }
            volumes.entry(name).or_default().unused_since = Some(*t);
        }
        volumes
    }
}

impl UsageHandle {
    /// The status document's `volume_usage`: per `namespace/name`, the last reading's
    /// `usage` (bytes and inodes, `null` when the mount did not answer) and `condition`
    /// (`abnormal`, `class`, `message`) of each published volume, and `unused_since` (Unix
    /// seconds) of each volume whose last user here went away.
    pub(crate) fn status(&self) -> serde_json::Value {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = serde_json::Map::new();
        for (k, q) in &s.changes {
            let changes: Vec<_> = q
                .iter()
                .map(|(t, c)| serde_json::json!({"time": t, "condition": c}))
                .collect();
            out.insert(
                k.to_string(),
                serde_json::json!({"condition_changes": changes}),
            );
        }
        for (k, f) in &s.figures {
            let e = out
                .entry(k.to_string())
                .or_insert_with(|| serde_json::json!({}));
            if let Some(o) = e.as_object_mut() {
                o.insert("usage".into(), serde_json::json!(f.usage));
                o.insert("condition".into(), serde_json::json!(f.condition));
            }
        }
        for (k, t) in &s.unused {
            let e = out
                .entry(k.to_string())
                .or_insert_with(|| serde_json::json!({}));
            if let Some(o) = e.as_object_mut() {
                o.insert("unused_since".into(), serde_json::json!(t));
            }
        }
        serde_json::Value::Object(out)
    }
}

impl UsageHandle {
    /// `history` (the core's events for the node record) with each volume's changes of
    /// condition beside them, in time order: event `condition`, detail `healthy` or the
    /// class (`inaccessible`, `degraded`, `data-loss`; the words are in the node's log and
    /// `dhv-binder status`), ok when healthy. Kept short: the record bounds the events.
    pub(crate) fn with_condition_events(
        &self,
        history: BTreeMap<String, Vec<crate::cluster::nodes::NodeEvent>>,
    ) -> BTreeMap<String, Vec<crate::cluster::nodes::NodeEvent>> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .with_condition_events(history)
    }
}

impl State {
    /// See [`UsageHandle::with_condition_events`].
    fn with_condition_events(
        &self,
        mut history: BTreeMap<String, Vec<crate::cluster::nodes::NodeEvent>>,
    ) -> BTreeMap<String, Vec<crate::cluster::nodes::NodeEvent>> {
        for (k, q) in &self.changes {
            let events = history.entry(k.to_string()).or_default();
            events.extend(q.iter().map(|(t, c)| crate::cluster::nodes::NodeEvent {
                time: *t,
                event: "condition".into(),
                ok: !c.abnormal,
                detail: c.class_word(),
                ..Default::default()
            }));
            // Stable: events of one second keep the journal's order, changes after them.
            events.sort_by_key(|e| e.time);
        }
        history
    }
}

impl Drop for UsageHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Percent of `u`'s bytes in use, rounded down (0 for a filesystem of no size).
fn used_percent(u: Usage) -> u8 {
    let pct = u128::from(u.used_bytes) * 100 / u128::from(u.capacity_bytes.max(1));
    u8::try_from(pct.min(100)).unwrap_or(100)
}

/// One volume of a round: its key, target, checks, plugin and the plugin's last answers.
type Target = (VolumeKey, PathBuf, Option<Checks>, String, Option<Answers>);

/// Which part of a round: every mount's `statfs` with the plugin's last answers, or the
/// plugin calls that are due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Every published volume's `statfs`, its plugin's last answers applied (none asked);
    /// a volume whose plugin has not answered yet is left for [`Phase::Ask`] unless its
    /// mount does not answer.
    Read,
    /// Only the volumes whose plugin is due (`--check-interval`): `statfs`, then `stats`
    /// and `health`.
    Ask,
}

/// One part of a round ([`Phase`]), at most [`READS_AT_ONCE`] volumes at once: so every
/// mount's `statfs` is read first, and slow or hung plugin calls (10 s each at most) delay
/// no mount's figures.
async fn round(
    reader: &UsageReader,
    known: &BTreeMap<VolumeKey, Known>,
    timeout: Duration,
    calls: Option<&Calls>,
    answers: &BTreeMap<VolumeKey, Answers>,
    phase: Phase,
) -> BTreeMap<VolumeKey, (Figures, Option<Answers>)> {
    let due = |v: &VolumeKey| {
        calls.is_some_and(|c| answers.get(v).is_none_or(|a| a.at.elapsed() >= c.every))
    };
    let targets: Vec<Target> = known
        .iter()
        .filter(|(v, k)| k.published && (phase == Phase::Read || (k.checks.is_some() && due(v))))
        .map(|(v, k)| {
            (
                v.clone(),
                k.target().to_path_buf(),
                k.checks.clone(),
                k.plugin().to_string(),
                answers.get(v).cloned(),
            )
        })
        .collect();
    futures_util::stream::iter(targets)
        .map(move |(v, target, checks, plugin, last)| {
            let reader = reader.clone();
            async move {
                let r = reader.read(target, timeout).await;
                let figures = Figures {
                    usage: match &r {
                        Reading::Usage(u) => Some(*u),
                        _ => None,
                    },
                    condition: Condition::of(&r),
                };
                let answered_mount = figures.usage.is_some();
                match (phase, calls, checks, last) {
                    (Phase::Ask, Some(calls), Some(checks), _) if answered_mount => {
                        let answers = ask(calls, &v, &plugin, &checks).await;
                        Some((v, (answered(figures, &checks, &answers), Some(answers))))
                    }
                    (Phase::Read, _, Some(checks), Some(last)) if answered_mount => {
                        Some((v, (answered(figures, &checks, &last), None)))
                    }
                    (Phase::Read, Some(_), Some(_), None) if answered_mount => None,
                    _ => Some((v, (figures, None))),
                }
            }
        })
        .buffer_unordered(READS_AT_ONCE)
        .filter_map(|x| async move { x })
        .collect()
        .await
}

/// `figures` (a mount that answered `statfs`) with its plugin's answers: `stats`' usage in
/// place of the mount's when it gave a sound one; `health`'s condition.
fn answered(mut figures: Figures, checks: &Checks, answers: &Answers) -> Figures {
    if let Some(u) = answers.usage {
        figures.usage = Some(u);
    }
    if checks.health {
        figures.condition = answers.condition.clone().unwrap_or_default();
    }
    figures
}

/// Asks the plugin its `stats` and `health` (those it declares): `stats`' usage when sound
/// (else none, logged: the mount's figures stand); `health`'s condition, `degraded` when the
/// call fails or does not answer within [`CHECK_TIMEOUT`] (its storage cannot say it is
/// well).
async fn ask(calls: &Calls, volume: &VolumeKey, plugin: &str, checks: &Checks) -> Answers {
    let mut answers = Answers {
        at: tokio::time::Instant::now(),
        usage: None,
        condition: None,
    };
    use crate::storage::protocol::{parse_with, Operation};
    use crate::storage::volume_health::{HealthResult, StatsResult};
    let call = |op: Operation| async move {
        let secrets = match &checks.record {
            Some(r) => calls.runner.secrets_for(op, r).await?,
            None => BTreeMap::new(),
        };
        let mut env = checks.env.clone();
        crate::storage::environment::set_secrets(&mut env, &secrets);
        let out = calls
            .runner
            .call_within(plugin, op, &env, &secrets, CHECK_TIMEOUT)
            .await?;
        Ok::<_, crate::storage::plugin::PluginError>((out, secrets))
    };
    if checks.stats {
        let stats = call(Operation::Stats).await.and_then(|(out, secrets)| {
            parse_with::<StatsResult>(plugin, Operation::Stats, &out.stdout, &secrets)
        });
        match stats.map(|s| s.usage()) {
            Ok(Ok(u)) => answers.usage = Some(u),
            Ok(Err(e)) => {
                tracing::warn!(volume = %volume, plugin, error = %e, "the plugin's stats are not sound; the mount's statfs figures stand")
            }
            Err(e) => {
                tracing::warn!(volume = %volume, plugin, error = %e.report(), "the plugin's stats failed; the mount's statfs figures stand")
            }
        }
    }
    if checks.health {
        let health = call(Operation::Health).await.and_then(|(out, secrets)| {
            parse_with::<HealthResult>(plugin, Operation::Health, &out.stdout, &secrets)
        });
        answers.condition = Some(match health.map(|h| h.condition()) {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => Condition::abnormal(
                crate::node::usage::ConditionClass::Degraded,
                format!("the plugin's health answer is not sound: {e}"),
            ),
            Err(e) => Condition::abnormal(
                crate::node::usage::ConditionClass::Degraded,
                format!("the plugin's health did not say it is well: {}", e.report()),
            ),
        });
    }
    answers
}

/// The usage task's settings.
struct Settings {
    every: Duration,
    timeout: Duration,
    state_dir: PathBuf,
    calls: Option<Calls>,
}

async fn run(
    mut rx: tokio::sync::watch::Receiver<Arc<BTreeMap<VolumeKey, Known>>>,
    settings: Settings,
    state: Arc<Mutex<State>>,
    metrics: Metrics,
) {
    let Settings {
        every,
        timeout,
        state_dir,
        calls,
    } = settings;
    let reader = UsageReader::default();
    metrics.read_volume_stats_from(Arc::new(StatsSource(Arc::clone(&state))));
    let mut next_round = tokio::time::Instant::now();
    loop {
        let known = rx.borrow_and_update().clone();
        let unused = {
            let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
            // With the figures trimmed to these volumes: a scrape during the round labels
            // every volume it shows with its plugin.
            s.known = Arc::clone(&known);
            s.observe(&known, wall_secs()).then(|| s.unused.clone())
        };
        if let Some(unused) = unused {
            if let Err(e) = save_unused(&state_dir, &unused) {
                tracing::warn!(error = %e, "cannot keep the volumes' unused-since times (they are kept in memory)");
            }
        }
        // A newly published volume, and an abnormal one whose journal or mount changed,
        // is read at once; every one on the schedule. One whose mount is gone is not read.
        let due = tokio::time::Instant::now() >= next_round;
        let to_read: BTreeMap<VolumeKey, Known> = {
            let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
            for (k, _) in known.iter().filter(|(_, v)| v.published && !v.mounted) {
                let gone = Figures {
                    usage: None,
                    condition: Condition::abnormal(
                        crate::node::usage::ConditionClass::Inaccessible,
                        "not mounted: its mount is gone (a dead mount is published again)",
                    ),
                };
                if s.figures.get(k) != Some(&gone) {
                    tracing::warn!(volume = %k, "volume is abnormal: its mount is gone");
                }
                s.set_figures(k, gone, wall_secs());
            }
            // A publish refused for damage: the volume is abnormal of that class, unmounted.
            for (k, failed) in known
                .iter()
                .filter_map(|(k, v)| v.failed.as_ref().map(|f| (k, f)))
            {
                let f = Figures {
                    usage: None,
                    condition: failed.clone(),
                };
                if s.figures.get(k) != Some(&f) {
                    tracing::warn!(volume = %k, condition = %failed.word(), message = %failed.message, "volume is abnormal: its publish was refused");
                }
                s.set_figures(k, f, wall_secs());
            }
            known
                .iter()
                .filter(|(k, v)| {
                    let stale = s.figures.get(*k).is_none_or(|f| f.condition.abnormal);
                    v.published && v.mounted && (due || stale)
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        if due {
            next_round = tokio::time::Instant::now() + every;
        }
        if !to_read.is_empty() {
            for phase in [Phase::Read, Phase::Ask] {
                let answers = state
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .answers
                    .clone();
                let figures =
                    round(&reader, &to_read, timeout, calls.as_ref(), &answers, phase).await;
                let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
                s.apply(figures, &known);
            }
        }
        tokio::select! {
            r = rx.changed() => if r.is_err() { return },
            _ = tokio::time::sleep_until(next_round) => {}
        }
    }
}

/// The usage task's figures as metrics, read at each scrape (series of volumes gone from
/// here vanish).
struct StatsSource(Arc<Mutex<State>>);

impl VolumeStatsSource for StatsSource {
    fn read(&self) -> (Vec<VolumeFigures>, Vec<Unused>) {
        let s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let figures = s
            .figures
            .iter()
            .map(|(k, f)| VolumeFigures {
                namespace: Arc::clone(&k.namespace),
                volume: Arc::clone(&k.name),
                plugin: s
                    .known
                    .get(k)
                    .map(|v| v.plugin().to_string())
                    .unwrap_or_default(),
                usage: f.usage,
                abnormal: f.condition.abnormal,
            })
            .collect();
        let unused = s
            .unused
            .iter()
            .map(|(k, t)| (Arc::clone(&k.namespace), Arc::clone(&k.name), *t))
            .collect();
        (figures, unused)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: &str) -> VolumeKey {
        VolumeKey {
            namespace: "default".into(),
            name: n.into(),
        }
    }

    /// A published volume's record: plugin `plugin`, target `target`.
    fn mount(plugin: &str, target: &Path) -> Option<Arc<MountRecord>> {
        let mut m = crate::node::journal::tests::rec(crate::node::journal::MountState::Published);
        m.plugin_id = plugin.into();
        m.target = target.into();
        Some(Arc::new(m))
    }

    fn k(users: usize) -> Known {
        Known {
            mount: mount("bind", Path::new("/x")),
            published: true,
            mounted: true,
            users,
            checks: None,
            failed: None,
        }
    }

    /// The last user leaving starts the unused time; a new user ends it; a volume never
    /// used has none.
    #[test]
    fn unused_since_starts_when_the_last_user_leaves() {
        let mut s = State::default();
        let mut known = BTreeMap::from([(key("a"), k(2)), (key("b"), k(0))]);
        assert!(!s.observe(&known, 100));
        assert!(s.unused.is_empty(), "never used: no time");
        known.insert(key("a"), k(0));
        assert!(s.observe(&known, 200));
        assert_eq!(s.unused.get(&key("a")), Some(&200));
        known.remove(&key("a"));
        assert!(
            !s.observe(&known, 300),
            "unpublished afterwards: the time holds"
        );
        assert_eq!(s.unused.get(&key("a")), Some(&200));
        known.insert(key("a"), k(1));
        assert!(s.observe(&known, 400));
        assert!(s.unused.is_empty());
    }

    /// The times survive a restart: a new agent reads them back (a volume still unused
    /// keeps its time, whatever the new agent sees first).
    #[test]
    fn unused_since_is_kept_across_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let unused = BTreeMap::from([(key("a"), 200u64)]);
        save_unused(dir.path(), &unused).unwrap();
        let mut s = State {
            unused: load_unused(dir.path()),
            ..Default::default()
        };
        assert!(!s.observe(&BTreeMap::from([(key("a"), k(0))]), 500));
        assert_eq!(s.unused.get(&key("a")), Some(&200));
        std::fs::write(unused_path(dir.path()), b"not json").unwrap();
        assert!(load_unused(dir.path()).is_empty());
    }

    fn plugin(dir: &Path, name: &str, body: &str) {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A plugin's `stats` stands for the mount's `statfs` figures and its `health` for the
    /// condition; an unsound `stats` leaves the mount's figures, a failing `health` makes
    /// the volume degraded; a plugin that declares neither is read by `statfs` alone.
    #[tokio::test]
    async fn the_plugins_stats_and_health_stand_for_the_mounts_own() {
        let dir = tempfile::tempdir().unwrap();
        let plugins = dir.path().join("plugins");
        std::fs::create_dir(&plugins).unwrap();
        plugin(
            &plugins,
            "good",
            r#"case "$1" in
stats) echo asked >> "$DHV_TARGET_PATH/asked"; echo '{"usage":[{"unit":"BYTES","total":100,"used":40,"available":60},{"unit":"INODES","total":9,"used":3,"available":6}]}' ;;
health) [ -d "$DHV_TARGET_PATH" ] && echo '{"abnormal":true,"class":"degraded","message":"replica 2 of 3 is slow"}' ;;
esac"#,
        );
        plugin(
            &plugins,
            "bad",
            r#"case "$1" in
stats) echo '{"usage":[{"unit":"BYTES","total":1,"used":5,"available":0}]}' ;;
health) echo '{"error":"cannot reach the array"}'; exit 1 ;;
esac"#,
        );
        let calls = Calls {
            runner: crate::storage::plugin::Runner::new(&plugins, Duration::from_secs(5)),
            node: crate::storage::environment::NodeEnv {
                node_id: "n".into(),
                node_pool: "default".into(),
                volumes_dir: dir.path().into(),
                plugin_dir: plugins.clone(),
            },
            every: Duration::from_secs(3600),
        };
        let known_of = |plugin: &str, target: PathBuf, checks: bool| Known {
            mount: mount(plugin, &target),
            published: true,
            mounted: true,
            users: 1,
            failed: None,
            checks: checks.then(|| Checks {
                stats: true,
                health: true,
                env: vec![("DHV_TARGET_PATH".into(), target.display().to_string())],
                record: None,
            }),
        };
        // One target each: a reading of a target still out is `Hung` for the next.
        let with = |plugin: &str, checks: bool| {
            let target = dir.path().join(format!("t-{plugin}-{checks}"));
            std::fs::create_dir_all(&target).unwrap();
            known_of(plugin, target, checks)
        };
        let known = BTreeMap::from([
            (key("good"), with("good", true)),
            (key("bad"), with("bad", true)),
            (key("plain"), with("bad", false)),
        ]);
        let reader = UsageReader::default();
        let timeout = Duration::from_secs(5);
        let asked =
            || std::fs::read_to_string(dir.path().join("t-good-true/asked")).unwrap_or_default();
        // Every mount is read first: a volume whose plugin has not answered yet waits for
        // the plugin calls, one without checks has its figures at once.
        let read = round(
            &reader,
            &known,
            timeout,
            Some(&calls),
            &BTreeMap::new(),
            Phase::Read,
        )
        .await;
        assert_eq!(read.keys().collect::<Vec<_>>(), vec![&key("plain")]);
        assert_eq!(asked(), "", "nothing asked while the mounts are read");
        let plain = &read[&key("plain")].0;
        assert!(!plain.condition.abnormal, "{plain:?}");
        assert!(plain.usage.is_some_and(|u| u.capacity_bytes > 100));
        // Then the plugin calls that are due.
        let first = round(
            &reader,
            &known,
            timeout,
            Some(&calls),
            &BTreeMap::new(),
            Phase::Ask,
        )
        .await;
        assert!(!first.contains_key(&key("plain")), "nothing to ask");
        let f: BTreeMap<VolumeKey, Figures> = first
            .iter()
            .map(|(k, (f, _))| (k.clone(), f.clone()))
            .collect();
        let good = &f[&key("good")];
        assert_eq!(
            good.usage
                .map(|u| (u.capacity_bytes, u.used_bytes, u.inodes_free)),
            Some((100, 40, 6))
        );
        assert_eq!(good.condition.class_word(), "degraded");
        assert!(
            good.condition.message.contains("replica 2 of 3"),
            "{good:?}"
        );
        let bad = &f[&key("bad")];
        assert!(
            bad.usage.is_some_and(|u| u.capacity_bytes > 100),
            "the mount's statfs figures stand: {bad:?}"
        );
        assert_eq!(bad.condition.class_word(), "degraded");
        assert!(bad.condition.message.contains("health"), "{bad:?}");
        assert_eq!(asked().lines().count(), 1, "{}", asked());
        // Within the check interval the last answers stand: the mounts are read, the
        // plugin is not asked again.
        let answers: BTreeMap<VolumeKey, Answers> = first
            .into_iter()
            .filter_map(|(k, (_, a))| a.map(|a| (k, a)))
            .collect();
        let again = round(
            &reader,
            &known,
            timeout,
            Some(&calls),
            &answers,
            Phase::Read,
        )
        .await;
        assert_eq!(again[&key("good")].0, good.clone());
        let none = round(&reader, &known, timeout, Some(&calls), &answers, Phase::Ask).await;
        assert!(none.is_empty(), "nothing due: {none:?}");
        assert_eq!(
            asked().lines().count(),
            1,
            "asked again within the interval"
        );
        // Past it, asked again.
        let due = Calls {
            every: Duration::ZERO,
            ..calls.clone()
        };
        round(&reader, &known, timeout, Some(&due), &answers, Phase::Ask).await;
        assert_eq!(asked().lines().count(), 2, "{}", asked());
    }

    /// A published volume's plugin is called only when it declares `stats` or `health`
    /// and this node has the volume's record (whose ID is the mount's): without it the call
    /// would lack the volume's parameters and context. A publish refused for damage makes
    /// the volume's failed condition `data-loss`; any other failure none.
    #[test]
    fn checks_need_the_capability_and_the_record_and_a_refusal_for_damage_is_data_loss() {
        use crate::node::journal::{EventKind, MountRecord};
        let mut journal = Journal::new("n");
        let mount = |name: &str, plugin: &str, state: MountState, error: &str| MountRecord {
            volume: key(name),
            volume_id: format!("id-{name}"),
            plugin_id: plugin.into(),
            state,
            target: format!("/t/{name}").into(),
            read_only: false,
            publish_context: Default::default(),
            since: 0,
            last_error: error.into(),
            claim_id: None,
            mount: None,
        };
        for (name, plugin) in [("a", "checked"), ("b", "checked"), ("c", "plain")] {
            journal.set_mount(
                mount(name, plugin, MountState::Published, ""),
                EventKind::PublishDone,
                None,
            );
        }
        journal.set_mount(
            mount(
                "d",
                "ext4",
                MountState::Publishing,
                r#"plugin "ext4" publish failed (exit code 1): error: data-loss: e2fsck -p of /i found damage"#,
            ),
            EventKind::PublishFailed,
            None,
        );
        journal.set_mount(
            mount(
                "e",
                "ext4",
                MountState::Publishing,
                r#"plugin "ext4" publish failed (exit code 1): error: cannot attach a loop device"#,
            ),
            EventKind::PublishFailed,
            None,
        );
        let fp = |caps: &str| {
            crate::storage::protocol::parse::<crate::storage::plugin::Fingerprint>(
                "p",
                crate::storage::protocol::Operation::Fingerprint,
                format!(r#"{{"version":"1","capabilities":{caps}}}"#).as_bytes(),
            )
            .map_err(|e| e.to_string())
        };
        let plugins = BTreeMap::from([
            ("checked".to_string(), fp(r#"["stats","health"]"#)),
            ("plain".to_string(), fp("[]")),
        ]);
        let rec = |name: &str| {
            let mut r = crate::volume::VolumeRecord::new(
                crate::volume::parse_spec(&format!("name = \"{name}\"\nplugin_id = \"checked\"\n"))
                    .unwrap()
                    .0,
                BTreeMap::new(),
            );
            r.id = format!("id-{name}");
            r
        };
        let records = BTreeMap::from([
            (key("a"), Arc::new(rec("a"))),
            (key("c"), Arc::new(rec("c"))),
        ]);
        let node = crate::storage::environment::NodeEnv {
            node_id: "n".into(),
            node_pool: "default".into(),
            volumes_dir: "/v".into(),
            plugin_dir: "/p".into(),
        };
        let mut next = known(&journal, &BTreeSet::new());
        add_checks(&mut next, &journal, &node, &plugins, |k| records.get(k));
        let a = next[&key("a")]
            .checks
            .as_ref()
            .expect("declared, record here");
        assert!(a.stats && a.health);
        assert!(
            a.env
                .contains(&("DHV_TARGET_PATH".to_string(), "/t/a".to_string())),
            "{:?}",
            a.env
        );
        assert!(
            !a.env.iter().any(|(k, _)| k == "DHV_SECRETS"),
            "secrets are read at each call, not kept: {:?}",
            a.env
        );
        assert!(next[&key("b")].checks.is_none(), "no record: not called");
        assert!(next[&key("c")].checks.is_none(), "not declared");
        assert_eq!(
            next[&key("d")].failed.as_ref().map(Condition::class_word),
            Some("data-loss".to_string())
        );
        assert!(next[&key("e")].failed.is_none());
        assert!(next[&key("a")].failed.is_none());
    }

    /// Each change of condition (not each reading) is an event of the node record, beside
    /// the journal's events in time order; a first reading that is healthy is none.
    #[test]
    fn a_change_of_condition_is_an_event() {
        use crate::node::usage::ConditionClass;
        let mut s = State::default();
        let healthy = Figures::default();
        let degraded = Figures {
            usage: None,
            condition: Condition::abnormal(ConditionClass::Degraded, "slow"),
        };
        assert!(!s.set_figures(&key("a"), healthy.clone(), 100));
        assert!(!s.set_figures(&key("a"), healthy.clone(), 110));
        assert!(s.set_figures(&key("a"), degraded.clone(), 120));
        assert!(!s.set_figures(&key("a"), degraded, 130));
        let lost = Figures {
            usage: None,
            condition: Condition::abnormal(ConditionClass::DataLoss, "gone"),
        };
        assert!(s.set_figures(&key("a"), lost, 140));
        assert!(s.set_figures(&key("a"), healthy, 160));
        let journal = crate::cluster::nodes::NodeEvent {
            time: 150,
            event: "publish".into(),
            ok: true,
            ..Default::default()
        };
        let h = s.with_condition_events(BTreeMap::from([("default/a".to_string(), vec![journal])]));
        let seen: Vec<(u64, &str, &str, bool)> = h["default/a"]
            .iter()
            .map(|e| (e.time, e.event.as_str(), e.detail.as_str(), e.ok))
            .collect();
        assert_eq!(
            seen,
            vec![
                (120, "condition", "degraded", false),
                (140, "condition", "data-loss", false),
                (150, "publish", "", true),
                (160, "condition", "healthy", true),
            ]
        );
        for i in 0..MAX_CONDITION_VOLUMES + 5 {
            let f = Figures {
                usage: None,
                condition: Condition::abnormal(ConditionClass::Inaccessible, "x"),
            };
            s.set_figures(&key(&format!("v{i}")), f, 1000 + i as u64);
        }
        assert_eq!(s.changes.len(), MAX_CONDITION_VOLUMES, "bounded");
        assert!(
            !s.changes.contains_key(&key("a")),
            "the oldest changes go first"
        );
    }

    #[test]
    fn the_node_record_carries_whole_percents() {
        let u = |used, capacity| Usage {
            capacity_bytes: capacity,
            used_bytes: used,
            ..Default::default()
        };
        assert_eq!(used_percent(u(123, 1000)), 12);
        assert_eq!(used_percent(u(1000, 1000)), 100);
        assert_eq!(used_percent(u(0, 0)), 0);
        assert_eq!(used_percent(u(u64::MAX, u64::MAX)), 100);
    }
}
