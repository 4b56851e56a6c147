//! The shell: the one place that performs effects. It owns the channels, the journal's
//! files, the reply channels of waiting callers and a `JoinSet` of running effects (plugin
//! calls bounded by a semaphore of `--max-parallel` permits); it feeds every message and
//! every completion to the [`Core`] and performs what the core returns.
//!
//! A journal commit runs on a blocking thread; the plugin calls that wait on it start when
//! it is durable. Commits returned while one is being written are folded into one write.

use crate::agent::after_calls::{AfterCalls, Next};
use crate::agent::core::{Core, Settings};
use crate::agent::effect::{Answer, Effect};
use crate::agent::executor::{self, Called};
use crate::agent::input::{ApiCall, Completion, Input, ReplyId};
use crate::agent::meter::Meter;
use crate::api::{ApiError, PublishReply, Request2Agent};
use crate::cluster::catalog::{self, Catalogue};
use crate::cluster::changes::MarkerView;
use crate::cluster::claims::ClaimSettings;
use crate::config::AgentConfig;
use crate::metrics::Metrics;
use crate::node::guard::Guard;
use crate::node::journal::{Commit, JournalError, Store};
use crate::node::mounts::{MountTable, MountsError};
use crate::nomad::identity::Verifier;
use crate::nomad::watch::{self, WatchConfig, WatchEvent};
use crate::nomad::Client;
use crate::storage::environment::NodeEnv;
use crate::storage::plugin::Runner;
use crate::volume::VolumeKey;
use spaced::Spaced;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio::task::JoinSet;

/// Why the agent could not start. The CLI maps these to exit codes.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot learn this node's ID from the local Nomad agent: {0}")]
    AgentSelf(#[source] crate::nomad::NomadError),
    #[error("the Nomad agent at {0} runs no client: run dhv-binder on client nodes, with NOMAD_ADDR pointing at the local agent")]
    NotAClient(String),
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error("cannot bind the local API socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Nomad(#[from] crate::nomad::NomadError),
    #[error("another dhv-binder agent already uses the state directory {0} (its lock file is held); run one agent per node")]
    AlreadyRunning(PathBuf),
    /// The record keys (`--record-keys`) are unreadable or malformed (issue 13 §1).
    #[error(transparent)]
    Trust(#[from] crate::cluster::trust::TrustError),
    /// A `--plugin-root` is not an absolute, existing directory (issue 13 §1).
    #[error(transparent)]
    PluginRoot(#[from] crate::storage::plugin::RootError),
    /// The helper cgroups (`--helper-cgroup`) cannot be made.
    #[error(transparent)]
    Helpers(#[from] crate::node::helpers::HelperError),
    /// Not in the host's mount namespace, or the working directories are unusable.
    #[error(transparent)]
    Host(#[from] crate::node::host::HostError),
    /// The placeholder guard cannot be placed (see `crate::node::guard`).
    #[error(transparent)]
    Guard(#[from] crate::node::guard::GuardError),
    /// `--secrets-path` or the Vault settings cannot be used.
    #[error(transparent)]
    Secrets(#[from] crate::storage::secrets::SettingError),
    /// The claim renewals' thread cannot be started.
    #[error("cannot start the claim renewals' thread: {0}")]
    Renewals(#[source] std::io::Error),
    /// A setting is malformed (`--max-volumes`).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

/// An exclusive lock on `<state_dir>/agent.lock`, held for the agent's life: two agents
/// must never share a journal or mount points.
struct StateLock {
    _lock: nix::fcntl::Flock<std::fs::File>,
}

impl StateLock {
    fn acquire(state_dir: &std::path::Path) -> Result<Self, StartError> {
        use std::io::Write;
        let path = state_dir.join("agent.lock");
        let io = |source| StartError::Socket {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(state_dir).map_err(io)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io)?;
        let mut lock = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|_| StartError::AlreadyRunning(state_dir.to_path_buf()))?;
        let _ = lock.set_len(0);
        let _ = writeln!(&mut *lock, "{}", std::process::id());
        Ok(Self { _lock: lock })
    }
}

/// The most inputs planned together in one pass.
const BATCH: usize = 512;

/// The longest the node's record goes without a rebuild while only the tick runs over an
/// unchanged mount table: what a tick alone changes (an expiry) shows within this time;
/// every other pass rebuilds it at once.
const NODE_RECORD_EVERY: Duration = Duration::from_secs(10);

/// What a finished task reports to the loop.
enum Report {
    /// An effect that reports nothing back (its failure is logged).
    Nothing,
    Done(Completion),
    /// Calls that ran as one round and report together (the mount probes of one interval).
    Round(Vec<Completion>),
    /// A detach finished; the mount table read right after it.
    DoneMounts(Completion, Result<MountTable, MountsError>),
    /// A publish or unpublish finished; its outcome waits for a mount table read that
    /// starts after it ([`Shell::after_calls`]).
    CallDone(Called),
    /// Plugin calls that finished before one mount table read started, decided by that
    /// reading ([`Called::check`]), the reading, and how long it took.
    CallsMounts(Vec<Completion>, Result<MountTable, MountsError>, Duration),
    Mounts(Result<MountTable, MountsError>),
    /// A call, with the mount table read after it arrived.
    Fresh(Box<Input>, Result<MountTable, MountsError>),
    Committed {
        seq: u64,
        result: Result<(), JournalError>,
        then: Vec<Effect>,
        elapsed: Duration,
    },
}

enum Pending {
    Publish(oneshot::Sender<Result<PublishReply, ApiError>>),
    Status(oneshot::Sender<serde_json::Value>),
}

/// Performs effects.
struct Shell {
    cfg: AgentConfig,
    client: Client,
    runner: Runner,
    node: NodeEnv,
    claims: ClaimSettings,
    store: Store,
    tasks: JoinSet<Report>,
    permits: Arc<Semaphore>,
    /// The mount probes ([`crate::node::health::Prober`]).
    probes: crate::node::health::Prober,
    replies: HashMap<ReplyId, Pending>,
    next_reply: u64,
    committing: bool,
    queued: Option<(Commit, Vec<Effect>)>,
    reading_mounts: bool,
    /// Publishes and unpublishes that finished and wait for a mount table read started
    /// after them. One read serves every call that finished before it started (at most one
    /// such read runs), and while other calls run the reads are paced
    /// ([`AfterCalls`]): reading mountinfo costs the kernel time in the number of mounts,
    /// so a read per call made a burst of N publishes cost O(N²).
    after_calls: AfterCalls,
    /// The core's clock: monotonic, counting suspends (`CLOCK_BOOTTIME`).
    clock: crate::node::clock::BootClock,
    meter: Meter,
    /// Volume records the catalogue refused (unsigned, forged, malformed), added to every
    /// status answer as `rejected_records` (issue 13 §1).
    rejected_records: catalog::Rejections,
    /// The record keys: a `create` from a snapshot or a clone uses its source only if the
    /// source's record verifies (`crate::cluster::snapshot::read_source`).
    trust: crate::cluster::trust::RecordTrust,
    /// The placeholder guard, and whether it stands (placed at start, else retried).
    guard: Guard,
    guarded: bool,
    /// The claim renewals' thread ([`crate::agent::renewer`]), once started by `run`.
    renewer: Option<crate::agent::renewer::Renewer>,
    /// Each volume's usage, condition and unused time (`volume_usage` in the status).
    usage: Option<crate::agent::volume_usage::UsageHandle>,
    /// The renewals' outcomes, handed to the core before anything else of a pass.
    renewed: mpsc::UnboundedReceiver<Completion>,
    /// Given to the renewal thread when it starts.
    renewed_tx: mpsc::UnboundedSender<Completion>,
    /// The waits on the processes refused unpublishes named.
    holder_watches: crate::agent::holder_watch::HolderWatches,
    /// The renewals that succeeded, as the renewal thread records them: a fence checks it
    /// right before it runs.
    evidence: crate::agent::renewer::Evidence,
}

impl Shell {
    /// A shell with nothing running: `--max-parallel` permits for plugin calls.
    fn new(
        cfg: AgentConfig,
        client: Client,
        node: NodeEnv,
        claims: ClaimSettings,
        store: Store,
        meter: Meter,
    ) -> Self {
        let cfg_state = cfg.state_dir.clone();
        let (renewed_tx, renewed) = mpsc::unbounded_channel();
        Self {
            renewer: None,
            usage: None,
            renewed,
            renewed_tx,
            holder_watches: Default::default(),
            evidence: Default::default(),
            runner: Runner::new(&cfg.plugin_dir, cfg.plugin_timeout)
                .observed(meter.plugin_observer())
                .on_leftovers(meter.plugin_leftover_observer()),
            permits: Arc::new(Semaphore::new(cfg.max_parallel.max(1))),
            probes: crate::node::health::Prober::default(),
            cfg,
            client,
            node,
            claims,
            store,
            tasks: JoinSet::new(),
            replies: HashMap::new(),
            next_reply: 0,
            committing: false,
            queued: None,
            reading_mounts: false,
            after_calls: AfterCalls::default(),
            clock: crate::node::clock::BootClock::default(),
            meter,
            rejected_records: catalog::Rejections::default(),
            // Trusts no record until `with_trust` gives the node's keys (fail closed).
            trust: crate::cluster::trust::RecordTrust::Keys(Vec::new()),
            // Placed (or not) by `run`; a shell without it never retries.
            guard: Guard::new(&cfg_state),
            guarded: true,
        }
    }

    /// Places the placeholder guard if it could not be placed at start.
    fn retry_guard(&mut self) {
        if self.guarded {
            return;
        }
        match self.guard.establish() {
            Ok(()) => {
                tracing::info!(root = %self.guard.root().display(), "placeholder guard placed");
                self.guarded = true;
            }
            Err(e) => tracing::debug!(error = %e, "placeholder guard not placed yet"),
        }
    }

    /// The node's plugin roots (passed to plugins, never taken from a record), its record
    /// keys, and the refused volume and snapshot records the watchers report, shown by
    /// `status` (issue 13).
    fn with_trust(
        mut self,
        allowed_roots: std::collections::BTreeMap<String, String>,
        trust: crate::cluster::trust::RecordTrust,
        rejected_records: catalog::Rejections,
    ) -> Self {
        self.runner = self.runner.with_allowed_roots(allowed_roots);
        self.trust = trust;
        self.rejected_records = rejected_records;
        self
    }

    fn perform(&mut self, effects: Vec<Effect>) {
        let mut probes = Vec::new();
        for e in effects {
            match e {
                // (The meter counts nothing for a probe.)
                Effect::Probe { volume, target } => probes.push((volume, target)),
                e => self.perform_one(e),
            }
        }
        self.probe_round(probes);
    }

    /// A round of mount probes as one task that reports once, when every probe of the round
    /// has answered (each bounded by its timeout: a hung mount answers `Hung`): one pass of
    /// the loop for the round, not one per mounted volume (1,000 passes per interval at
    /// 1,000 volumes, each building the node's record anew).
    fn probe_round(&mut self, probes: Vec<(VolumeKey, PathBuf)>) {
        if probes.is_empty() {
            return;
        }
        let timeout = self.cfg.health_interval.min(Duration::from_secs(5));
        let prober = self.probes.clone();
        self.tasks.spawn(async move {
            let mut round = tokio::task::JoinSet::new();
            for (volume, target) in probes {
                let prober = prober.clone();
                round.spawn(async move {
                    let probe = prober.probe(target.clone(), timeout).await;
                    Completion::Probed {
                        volume,
                        target,
                        probe,
                    }
                });
            }
            let mut done = Vec::with_capacity(round.len());
            while let Some(c) = round.join_next().await {
                match c {
                    Ok(c) => done.push(c),
                    Err(e) => tracing::error!(error = %e, "a mount probe's task failed"),
                }
            }
            Report::Round(done)
        });
    }

    /// A call under the plugin-call permits, handed to the core at once.
    fn plugin_call(
        &mut self,
        call: impl std::future::Future<Output = Completion> + Send + 'static,
    ) {
        let permits = self.permits.clone();
        self.tasks.spawn(async move {
            let _permit = permits.acquire_owned().await;
            Report::Done(call.await)
        });
    }

    /// A call under the plugin-call permits whose outcome the next mount table read decides
    /// ([`Shell::read_after_calls`]); the permit is given back when the call ends.
    fn checked_call(&mut self, call: impl std::future::Future<Output = Called> + Send + 'static) {
        self.after_calls.started();
        let permits = self.permits.clone();
        self.tasks.spawn(async move {
            let _permit = permits.acquire_owned().await;
            Report::CallDone(call.await)
        });
    }

    /// Starts a mount table read for the calls finished so far, unless one runs or the
    /// pace says to wait ([`AfterCalls::next`]; the loop's timer then waits for
    /// [`AfterCalls::due`]).
    fn read_after_calls(&mut self) {
        if let Next::Read(calls) = self
            .after_calls
            .next(tokio::time::Instant::now().into_std())
        {
            self.tasks.spawn_blocking(move || {
                let started = std::time::Instant::now();
                let table = MountTable::read();
                let took = started.elapsed();
                let done = calls.into_iter().map(|c| c.check(table.as_ref())).collect();
                Report::CallsMounts(done, table, took)
            });
        }
    }

    /// An effect's task ended without its report (a panic): it may have been a plugin call
    /// or the reading for finished calls, neither of which will report now. The readings
    /// go on for the calls that do ([`AfterCalls::task_failed`]).
    fn task_failed(&mut self) {
        self.after_calls.task_failed();
        self.read_after_calls();
    }

    fn call(&mut self, call: impl std::future::Future<Output = Completion> + Send + 'static) {
        self.tasks.spawn(async move { Report::Done(call.await) });
    }

    fn order_renewals(&mut self, order: crate::agent::renewer::Order) {
        match &self.renewer {
            Some(r) => r.order(order),
            None => tracing::debug!(?order, "no renewal thread: order dropped"),
        }
    }

    /// The renewals' outcomes that have arrived, without waiting.
    fn renewals_arrived(&mut self) -> Vec<Input> {
        let mut out = Vec::new();
        while let Ok(c) = self.renewed.try_recv() {
            out.push(Input::Done(c));
        }
        out
    }

    fn perform_one(&mut self, e: Effect) {
        self.meter.effect(&e);
        let (client, runner, node) = (self.client.clone(), self.runner.clone(), self.node.clone());
        match e {
            Effect::Publish {
                volume,
                target,
                read_only,
                alloc_id,
                expected,
            } => self.checked_call(executor::publish(
                runner,
                node,
                self.guard.clone(),
                *volume,
                target,
                read_only,
                alloc_id,
                expected,
            )),
            Effect::Unpublish {
                mount,
                volume,
                keep_dir,
            } => self.checked_call(executor::unpublish(
                runner,
                node,
                self.guard.clone(),
                *mount,
                volume.map(|v| *v),
                keep_dir,
            )),
            // Not under the permits: a node whose calls all hang still learns its plugins.
            Effect::Fingerprint { changed_only } => {
                self.call(executor::fingerprint_all(runner, changed_only))
            }
            Effect::Create(rec) => self.plugin_call(executor::create(
                client,
                runner,
                node,
                *rec,
                self.cfg.mount_root(),
                self.trust.clone(),
            )),
            Effect::Storage(op) => self.checked_call(async move {
                Called::Other(executor::storage::perform(client, runner, node, op).await)
            }),
            Effect::Delete(rec) => self.plugin_call(executor::delete(client, runner, node, *rec)),
            Effect::ReadNode => self.call(executor::read_node(client, node.node_id.clone())),
            Effect::MarkFinal {
                volume,
                volume_id,
                failure,
            } => self.call(executor::final_mark::mark_final(
                client, volume, volume_id, failure,
            )),
            Effect::ListPlaceholders { namespaces } => self.call(executor::list_placeholders(
                client,
                node.node_id.clone(),
                self.guard.clone(),
                namespaces,
            )),
            Effect::RegisterPlaceholder { volume, target, id } => {
                self.call(executor::register_placeholder(
                    client,
                    node,
                    self.guard.clone(),
                    *volume,
                    target,
                    id,
                ))
            }
            Effect::DeregisterPlaceholder { volume, id } => {
                self.call(executor::deregister_placeholder(client, volume, id))
            }
            Effect::AcquireClaim {
                volume,
                volume_id,
                fencing,
            } => self.call(executor::acquire_claim(
                client,
                self.trust.clone(),
                self.claims,
                node,
                volume,
                volume_id,
                fencing.map(|rec| (runner, rec)),
            )),
            Effect::RenewClaim {
                volume,
                lock_id,
                acquired_index,
                at_once,
            } => self.order_renewals(crate::agent::renewer::Order::Keep {
                volume,
                lock_id,
                acquired_index,
                at_once,
            }),
            Effect::StopRenewing { volume } => {
                self.order_renewals(crate::agent::renewer::Order::Stop { volume })
            }
            Effect::ReleaseClaim { volume, lock_id } => {
                self.call(executor::release_claim(client, volume, lock_id))
            }
            Effect::FetchAlloc { alloc_id } => self.call(executor::fetch_alloc(client, alloc_id)),
            Effect::RestartAlloc {
                volume,
                alloc_id,
                task,
                all_tasks,
            } => self.call(executor::restart_alloc(
                client, volume, alloc_id, task, all_tasks,
            )),
            Effect::Refresh { volume, mount } => {
                self.plugin_call(executor::refresh(runner, node, *volume, *mount))
            }
            Effect::Probe { volume, target } => self.probe_round(vec![(volume, target)]),
            Effect::Fence {
                volume,
                target,
                plugin,
                lease_of,
            } => {
                // The plugin's `fence` (bounded, FENCE_TIMEOUT) runs beside the kernel's.
                let plugin_fence = plugin.map(|p| executor::plugin_fence(runner, node, *p));
                let (evidence, settings, clock) =
                    (self.evidence.clone(), self.claims, self.clock.clone());
                self.tasks.spawn(async move {
                    // The evidence first, right before anything is killed: a renewal that
                    // succeeded since the core decided keeps the claim this node's.
                    if let Some(lock_id) = lease_of {
                        let now = clock.at(tokio::time::Instant::now().into_std());
                        if let Some(sent) =
                            evidence.withdraws_fence(&volume, &lock_id, &settings, now)
                        {
                            return Report::Done(Completion::FenceWithdrawn {
                                volume,
                                lock_id,
                                sent,
                            });
                        }
                    }
                    let kernel = tokio::task::spawn_blocking(move || {
                        crate::node::fence::fence(&target, crate::node::identity::node())
                    });
                    let by_plugin = match plugin_fence {
                        Some(f) => Some(f.await),
                        None => None,
                    };
                    let mut report =
                        kernel
                            .await
                            .unwrap_or_else(|e| crate::node::fence::FenceReport {
                                errors: vec![format!("the fence did not finish: {e}")],
                                ..Default::default()
                            });
                    report.plugin = by_plugin;
                    let table = tokio::task::spawn_blocking(MountTable::read)
                        .await
                        .unwrap_or_else(|e| {
                            Err(crate::node::mounts::MountsError::Read {
                                path: crate::node::mounts::HOST_MOUNTINFO.into(),
                                source: std::io::Error::other(e),
                            })
                        });
                    Report::DoneMounts(Completion::Fenced { volume, report }, table)
                });
            }
            Effect::WatchHolders { volume, pids } => self.holder_watches.watch(volume, pids),
            Effect::KillHolders { volume, target } => {
                self.tasks.spawn_blocking(move || {
                    let report =
                        crate::node::fence::kill_holders(&target, crate::node::identity::node());
                    Report::DoneMounts(
                        Completion::HoldersKilled { volume, report },
                        MountTable::read(),
                    )
                });
            }
            Effect::AnswerUnpublish {
                request,
                state,
                message,
            } => {
                self.tasks.spawn(async move {
                    if let Err(e) = crate::cluster::unpublish_request::answer(
                        &client, &request, state, &message,
                    )
                    .await
                    {
                        tracing::warn!(volume = %request.volume, request = %request.id, error = %e, "cannot write the answer to the operator's unpublish request (the CLI waiting for it times out; the journal has the outcome)");
                    }
                    Report::Nothing
                });
            }
            Effect::Detach { volume, target } => {
                self.tasks.spawn_blocking(move || {
                    let result = crate::node::health::lazy_unmount(&target);
                    Report::DoneMounts(Completion::Detached { volume, result }, MountTable::read())
                });
            }
            Effect::ReadMountTable => {
                if !self.reading_mounts {
                    self.reading_mounts = true;
                    self.tasks
                        .spawn_blocking(|| Report::Mounts(MountTable::read_idle()));
                }
            }
            Effect::Commit { commit, then } => {
                if self.committing {
                    match &mut self.queued {
                        Some((q, t)) => {
                            q.absorb(commit);
                            t.extend(then);
                        }
                        None => self.queued = Some((commit, then)),
                    }
                } else {
                    self.start_commit(commit, then);
                }
            }
            Effect::Reply { to, answer } => match (self.replies.remove(&to), answer) {
                (Some(Pending::Publish(tx)), Answer::Publish(r)) => {
                    let _ = tx.send(r);
                }
                (Some(Pending::Status(tx)), Answer::Status(mut v)) => {
                    if let Some(o) = v.as_object_mut() {
                        let refused = serde_json::json!(self.rejected_records.snapshot());
                        o.insert("rejected_records".into(), refused);
                        if let Some(u) = &self.usage {
                            o.insert("volume_usage".into(), u.status());
                        }
                    }
                    let _ = tx.send(*v);
                }
                (Some(_), _) => tracing::error!("an answer of the wrong kind for a caller"),
                (None, _) => {}
            },
        }
    }

    fn start_commit(&mut self, commit: Commit, then: Vec<Effect>) {
        self.committing = true;
        let store = self.store.clone();
        self.tasks.spawn_blocking(move || {
            let started = std::time::Instant::now();
            let result = store.write(&commit);
            Report::Committed {
                seq: commit.seq,
                result,
                then,
                elapsed: started.elapsed(),
            }
        });
    }

    /// Takes a call: a publish call is handed to the core only with the host's mount
    /// table read after it arrived (it is answered from the kernel, never from a reading
    /// older than the question); others at once.
    fn admit(&mut self, req: Request2Agent) -> Option<Input> {
        match self.register(req) {
            i @ Input::Api {
                call: ApiCall::Publish(_),
                ..
            } => {
                self.tasks
                    .spawn_blocking(move || Report::Fresh(Box::new(i), MountTable::read()));
                None
            }
            i => Some(i),
        }
    }

    fn register(&mut self, req: Request2Agent) -> Input {
        self.next_reply += 1;
        let id = ReplyId(self.next_reply);
        let call = match req {
            Request2Agent::Publish { request, reply } => {
                self.replies.insert(id, Pending::Publish(reply));
                ApiCall::Publish(request)
            }
            Request2Agent::Status { reply } => {
                self.replies.insert(id, Pending::Status(reply));
                ApiCall::Status
            }
        };
        Input::Api { reply: id, call }
    }

    /// Callers whose connection closed while they waited.
    fn gone(&mut self) -> Vec<ReplyId> {
        let gone: Vec<ReplyId> = self
            .replies
            .iter()
            .filter(|(_, p)| match p {
                Pending::Publish(tx) => tx.is_closed(),
                Pending::Status(tx) => tx.is_closed(),
            })
            .map(|(id, _)| *id)
            .collect();
        for id in &gone {
            self.replies.remove(id);
        }
        gone
    }

    /// The forced-unpublish requests the core may act on: those naming this node, pending
    /// and fresh ([`UnpublishRequest::actionable`], by the wall clock), as one input.
    ///
    /// [`UnpublishRequest::actionable`]: crate::cluster::unpublish_request::UnpublishRequest::actionable
    fn unpublish_requests(&self, reqs: crate::cluster::unpublish_request::Requests) -> Vec<Input> {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let mine: Vec<_> = reqs
            .into_values()
            .filter(|r| r.node_id == self.node.node_id && r.actionable(now_ms))
            .collect();
        if mine.is_empty() {
            Vec::new()
        } else {
            vec![Input::UnpublishRequests(mine)]
        }
    }

    /// Turns a finished task into the core's inputs (a mount table reading first).
    fn on_report(&mut self, r: Report) -> Vec<Input> {
        let table = |t: Result<MountTable, MountsError>| match t {
            Ok(t) => Some(Input::MountTable(t)),
            Err(e) => {
                tracing::error!(error = %e, "cannot read the mount table; keeping the last reading");
                None
            }
        };
        match r {
            Report::Nothing => Vec::new(),
            Report::Done(c) => vec![Input::Done(c)],
            Report::Round(done) => done.into_iter().map(Input::Done).collect(),
            Report::DoneMounts(c, t) => table(t).into_iter().chain([Input::Done(c)]).collect(),
            Report::CallDone(c) => {
                self.after_calls.finished(c);
                self.read_after_calls();
                Vec::new()
            }
            Report::CallsMounts(calls, t, took) => {
                self.after_calls
                    .read_done(tokio::time::Instant::now().into_std(), took);
                self.read_after_calls();
                let done = calls.into_iter().map(Input::Done);
                table(t).into_iter().chain(done).collect()
            }
            Report::Fresh(i, t) => table(t).into_iter().chain([*i]).collect(),
            Report::Mounts(t) => {
                self.reading_mounts = false;
                table(t).into_iter().collect()
            }
            Report::Committed {
                seq,
                result,
                then,
                elapsed,
            } => {
                self.meter.committed(elapsed);
                self.committing = false;
                if result.is_ok() {
                    self.perform(then);
                }
                if let Some((c, t)) = self.queued.take() {
                    self.start_commit(c, t);
                }
                vec![Input::Committed { seq, result }]
            }
        }
    }
}

/// Where the loop's messages come from, besides the completions of effects.
struct Sources {
    watch: mpsc::Receiver<WatchEvent>,
    catalogue: mpsc::Receiver<Catalogue>,
    /// The snapshot records (`crate::cluster::snapshot::watch`).
    snapshots: mpsc::Receiver<crate::cluster::snapshot::Snapshots>,
    /// The operators' forced-unpublish requests (`crate::cluster::unpublish_request::watch`).
    unpublish: mpsc::Receiver<crate::cluster::unpublish_request::Requests>,
    api: mpsc::Receiver<Request2Agent>,
    plugins: mpsc::Receiver<()>,
    /// Why the volume records cannot be read, while they cannot (`catalog::Follow::failing`).
    records_failing: tokio::sync::watch::Receiver<Option<String>>,
    /// Changes of the Variables published volumes reference (`crate::agent::secret_watch`).
    secrets: mpsc::Receiver<crate::agent::refresh::Watched>,
    /// The periodic tick (`--tick`).
    tick: tokio::time::Interval,
    every: Duration,
    /// When the earliest after-pass work held back by its rate limit is due ([`spaced`]):
    /// the loop wakes for it then.
    later: Option<tokio::time::Instant>,
}

/// The periodic tick: every `every`, a late tick delays the next ones.
fn ticker(every: Duration) -> tokio::time::Interval {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick
}

impl Shell {
    /// Waits for what comes first: a message, an effect's completion, the periodic tick,
    /// the core's next wake-up (a retry or timer that is due, not sooner than 10 ms from
    /// now) or after-pass work held back by its rate limit; returns it with whatever else
    /// is already waiting (at most [`BATCH`]), so a burst of messages is planned once.
    async fn next_inputs(&mut self, core: &Core, src: &mut Sources) -> Vec<Input> {
        let floor = tokio::time::Instant::now() + Duration::from_millis(10);
        let wake = core
            .next_wakeup()
            .map(|w| tokio::time::Instant::from_std(self.clock.monotonic(w)))
            .map_or(floor + src.every, |w| w.max(floor));
        let wake = src.later.map_or(wake, |r| wake.min(r.max(floor)));
        let read_due = self.after_calls.due().map(tokio::time::Instant::from_std);
        let mut inputs: Vec<Input> = tokio::select! {
            biased;
            Some(c) = self.renewed.recv() => vec![Input::Done(c)],
            Some(c) = self.holder_watches.next() => vec![Input::Done(c)],
            Some(ev) = src.watch.recv() => vec![Input::Watch(ev)],
            Some(cat) = src.catalogue.recv() => vec![Input::Catalogue(cat)],
            Ok(()) = src.records_failing.changed() => {
                vec![Input::RecordsUnreadable(src.records_failing.borrow_and_update().clone())]
            }
            Some(snaps) = src.snapshots.recv() => vec![Input::Snapshots(snaps)],
            Some(reqs) = src.unpublish.recv() => self.unpublish_requests(reqs),
            Some(w) = src.secrets.recv() => vec![Input::SecretChanged(w)],
            Some(req) = src.api.recv() => self.admit(req).into_iter().collect(),
            Some(done) = self.tasks.join_next() => match done {
                Ok(r) => self.on_report(r),
                Err(e) => {
                    tracing::error!(error = %e, "an effect's task failed");
                    self.task_failed();
                    Vec::new()
                }
            },
            _ = src.tick.tick() => {
                self.retry_guard();
                let mut v: Vec<Input> = self.gone().into_iter().map(Input::CallerGone).collect();
                v.push(Input::Tick);
                v
            }
            _ = tokio::time::sleep_until(wake) => vec![Input::Tick],
            Some(()) = src.plugins.recv() => vec![Input::PluginsChanged],
            _ = tokio::time::sleep_until(read_due.unwrap_or(wake)), if read_due.is_some() => {
                self.read_after_calls();
                Vec::new()
            }
        };
        while inputs.len() < BATCH {
            if let Ok(ev) = src.watch.try_recv() {
                inputs.push(Input::Watch(ev));
            } else if let Some(done) = self.tasks.try_join_next() {
                match done {
                    Ok(r) => inputs.extend(self.on_report(r)),
                    Err(e) => {
                        tracing::error!(error = %e, "an effect's task failed");
                        self.task_failed();
                    }
                }
            } else {
                break;
            }
        }
        inputs
    }
}

/// The watcher's process probe: the allocations with a process on this node, read from
/// each process's cgroup (`crate::node::holders::AllocProcesses`); a failed read is logged
/// and concludes nothing.
fn process_probe() -> watch::ProcessProbe {
    let procs = std::sync::Mutex::new(crate::node::holders::AllocProcesses::new(
        crate::node::identity::node().clone(),
    ));
    watch::ProcessProbe(std::sync::Arc::new(move || {
        let mut procs = procs.lock().unwrap_or_else(|e| e.into_inner());
        match procs.scan() {
            Ok(found) => Some(found),
            Err(e) => {
                tracing::warn!(error = %e, "cannot tell which allocations have processes here");
                None
            }
        }
    }))
}

/// Starts the agent and runs it until `shutdown` resolves, keeping `metrics` current
/// (served by `crate::metrics::serve` when `--metrics-addr` is set).
pub async fn run(
    cfg: AgentConfig,
    client: Client,
    metrics: Metrics,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), StartError> {
    // The host's mount namespace and real directory paths, before anything else.
    let mut cfg = cfg;
    crate::node::host::preflight(&mut cfg)?;
    // Whose a process is, from its cgroup: this node's Nomad tasks' cgroups, and those of
    // other nodes simulated on this host (docs/architecture.md, "Whose process").
    let cgroups = crate::node::identity::NodeCgroups::from_settings(
        cfg.nomad_cgroup_parent.as_deref(),
        &cfg.other_node_cgroups,
        crate::node::helpers::cgroup2_mount()
            .ok()
            .flatten()
            .as_deref(),
    );
    if !crate::node::identity::configure(cgroups.clone())
        && crate::node::identity::node() != &cgroups
    {
        tracing::warn!(configured = ?crate::node::identity::node(), ignored = ?cgroups, "this process's task cgroups were set before (another agent in the same process): the first setting holds");
    }
    tokio::pin!(shutdown);
    // A node not prepared yet (no record keys, a storage root missing): one message per
    // missing item, then check again after a growing delay; never exit (Nomad would restart
    // the task for ever) and never spin.
    let mut backoff = crate::node::install::Backoff::default();
    loop {
        let missing = crate::node::install::missing(&cfg);
        if missing.is_empty() {
            break;
        }
        let delay = backoff.next_delay();
        for m in &missing {
            tracing::error!(retry_in = ?delay, "this node is not ready for dhv-binder: {m}");
        }
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            _ = tokio::time::sleep(delay) => {}
        }
    }
    // Fail closed on record trust and plugin roots before anything runs (issue 13 §1).
    let trust = crate::cluster::trust::RecordTrust::from_settings(
        cfg.record_keys.as_deref(),
        cfg.allow_unsigned_records,
    )?;
    let allowed_roots = crate::storage::plugin::allowed_roots(&cfg.plugin_roots)?;
    let secret_source = crate::storage::secrets::SecretSource::from_settings(
        client.clone(),
        &cfg.secrets_path,
        cfg.vault_addr.as_deref(),
        cfg.vault_token.clone(),
    )?;
    if let Some(path) = &cfg.token_file {
        watch::read_token_file(&client, path);
    }
    // The local Nomad agent may start after this one (a boot, the systemd unit): wait for it.
    // 1 s doubling to 60 s, jitter ±20 %; one line a minute at most, with a count.
    let mut attempt = 0u32;
    let mut failures = crate::nomad::retry::FailureLog::new(
        crate::nomad::retry::Call::AgentSelf,
        crate::nomad::retry::LOG_EVERY,
    );
    let me = loop {
        match client.agent_self().await {
            Ok(me) => break me,
            Err(e) if e.is_transient() => {
                let delay = crate::nomad::retry::backoff_delay(
                    Duration::from_secs(1),
                    Duration::from_secs(60),
                    attempt,
                );
                attempt = attempt.saturating_add(1);
                if let Some(failures) = failures.failed(std::time::Instant::now()) {
                    tracing::warn!(error = %e, retry_in = ?delay, failures, "waiting for the local Nomad agent (logged at most once a minute)");
                }
                tokio::select! {
                    _ = &mut shutdown => return Ok(()),
                    _ = tokio::time::sleep(delay) => {}
                }
            }
            Err(e) => return Err(StartError::AgentSelf(e)),
        }
    };
    let node_id = me
        .node_id()
        .ok_or_else(|| StartError::NotAClient(client.address().to_string()))?
        .to_string();
    let node_pool = me.node_pool();
    tracing::info!(%node_id, %node_pool, "dhv-binder agent starting");
    for dir in [cfg.mount_root(), cfg.volumes_dir()] {
        std::fs::create_dir_all(&dir).map_err(|source| StartError::Socket { path: dir, source })?;
    }
    let _state_lock = StateLock::acquire(&cfg.state_dir)?;
    // Unpublished placeholders are never writable (see crate::node::guard). Mounts published
    // below the placeholder root before the guard existed are left alone: the guard is
    // placed once they are gone (retried on every tick).
    let guard = Guard::new(&cfg.state_dir);
    let guarded = match guard.establish() {
        Ok(()) => true,
        Err(e @ crate::node::guard::GuardError::MountsBelow { .. }) => {
            tracing::warn!(error = %e, "placeholders stay writable until the guard is placed");
            false
        }
        Err(e) => return Err(e.into()),
    };
    let (store, journal) = Store::open(&cfg.state_dir, &node_id)?;
    // Plugins' helpers run in per-volume cgroups outside this one; those of published
    // volumes, left by the previous agent, are adopted as they are.
    let helpers = crate::node::helpers::from_settings(&cfg.helper_cgroup, cfg.helper_memory_max.0)?;
    if let Some(h) = &helpers {
        let ids: Vec<String> = journal
            .mounts()
            .values()
            .map(|m| m.volume_id.clone())
            .collect();
        h.adopt(&ids);
    }
    let (listener, _socket_guard) =
        crate::api::bind(&cfg.socket).map_err(|source| StartError::Socket {
            path: cfg.socket.clone(),
            source,
        })?;
    if !cfg.plugin_dir.is_dir() {
        tracing::warn!(plugin_dir = %cfg.plugin_dir.display(), "the plugin directory does not exist: this node serves no volume until plugins are installed there");
    }

    // Each refused record version is counted (dhv_binder_records_refused_total).
    let refusals = metrics.clone();
    let rejected_records = catalog::Rejections::observed(std::sync::Arc::new(move |reason| {
        refusals.record_refused(reason)
    }));
    let (watch_tx, watch_rx) = mpsc::channel::<WatchEvent>(256);
    let (cat_tx, cat_rx) = mpsc::channel::<Catalogue>(4);
    let (snap_tx, snap_rx) = mpsc::channel::<crate::cluster::snapshot::Snapshots>(4);
    let (unpublish_tx, unpublish_rx) =
        mpsc::channel::<crate::cluster::unpublish_request::Requests>(4);
    let (api_tx, api_rx) = mpsc::channel::<Request2Agent>(256);
    let (plugins_tx, plugins_rx) = mpsc::channel::<()>(1);

    let mut wcfg = WatchConfig::new(&node_id);
    wcfg.idle_timeout = cfg.stream_idle_timeout;
    wcfg.resync_interval = cfg.resync_interval;
    wcfg.mode = cfg.watch_mode;
    wcfg.token_file = cfg.token_file.clone();
    wcfg.processes = Some(process_probe());
    // The record watches follow the change marker (one blocking read of one variable per
    // agent, issue 35); the volume records' watch reads a record at once when an allocation
    // names a volume this node has no record for.
    let (marker_tx, marker_rx) = tokio::sync::watch::channel(MarkerView::Unknown);
    let record_reads = catalog::Reads::default();
    let (records_failing_tx, records_failing) = tokio::sync::watch::channel(None);
    let follow = catalog::Follow {
        marker: marker_rx,
        relist: cfg.record_relist,
        reads: record_reads.clone(),
        failing: Some(records_failing_tx),
    };
    let background = [
        tokio::spawn(watch::run(client.clone(), wcfg, watch_tx)),
        tokio::spawn(crate::cluster::changes::watch_observed(
            client.clone(),
            Duration::from_secs(300),
            marker_tx,
            {
                let m = metrics.clone();
                std::sync::Arc::new(move |reason| m.record_refused(reason))
            },
        )),
        tokio::spawn(catalog::run(
            client.clone(),
            follow.clone(),
            trust.clone(),
            rejected_records.clone(),
            cat_tx,
        )),
        tokio::spawn(crate::cluster::unpublish_request::watch(
            client.clone(),
            catalog::Follow {
                reads: catalog::Reads::default(),
                failing: None,
                ..follow.clone()
            },
            trust.clone(),
            rejected_records.clone(),
            unpublish_tx,
        )),
        tokio::spawn(crate::cluster::snapshot::watch(
            client.clone(),
            catalog::Follow {
                reads: catalog::Reads::default(),
                failing: None,
                ..follow
            },
            trust.clone(),
            rejected_records.clone(),
            snap_tx,
        )),
        tokio::spawn(crate::api::serve_with(
            listener,
            Verifier::new(client.clone(), &cfg.audiences).with_issuer(
                crate::nomad::identity::IssuerRule::from_setting(cfg.token_issuer.as_deref()),
            ),
            api_tx,
            crate::api::Limits::default(),
        )),
        tokio::spawn(crate::storage::discovery::run(
            cfg.plugin_dir.clone(),
            plugins_tx,
        )),
    ];

    // This node's record for `plugin status`, `node status` and `volume create`'s
    // fail-fast check; rebuilt after a loop turn that changed it (rate-limited in bursts:
    // `Spaced`).
    let node_name = me
        .config
        .pointer("/NodeName")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    let (node_record, node_publisher) = crate::cluster::nodes::spawn_publisher(
        client.clone(),
        crate::cluster::nodes::NodeRecord::new(&node_id, node_name, &node_pool),
        crate::cluster::nodes::HEARTBEAT,
    );
    let node = NodeEnv {
        node_id: node_id.clone(),
        node_pool,
        volumes_dir: cfg.volumes_dir(),
        plugin_dir: cfg.plugin_dir.clone(),
    };
    let claims = ClaimSettings {
        ttl: cfg.claim_ttl,
        lock_delay: cfg.claim_lock_delay,
        fence_margin: cfg.fence_margin(),
    };
    // Every `now` of the core counts the time the machine was suspended (a VM suspend must
    // not leave a lease looking younger than it is): `node::clock`.
    let clock = crate::node::clock::BootClock::default();
    let now = || clock.at(tokio::time::Instant::now().into_std());
    let mut core = Core::new(
        Settings {
            node: node.clone(),
            mount_root: cfg.mount_root(),
            plugin_rescan: cfg.plugin_rescan,
            claims,
            health_interval: cfg.health_interval,
            heartbeat_interval_max: cfg.heartbeat_interval_max,
            max_volumes: cfg.max_volumes_by_plugin()?,
            seed: std::process::id() as u64
                ^ u64::from(
                    std::time::UNIX_EPOCH
                        .elapsed()
                        .map(|d| d.subsec_nanos())
                        .unwrap_or(0),
                ),
        },
        journal,
        now(),
    );
    // The leases of the claims restored from the journal, when this restart is on the same
    // boot as the renewals kept on disk (`node::leases`).
    let lease_file = crate::node::leases::LeaseFile::new(&cfg.state_dir);
    let restored_leases = match lease_file.read() {
        Ok(ages) => core.restore_leases(&ages, now()),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the claims' renewals kept on disk");
            Vec::new()
        }
    };
    let usage_metrics = metrics.clone();
    let meter = Meter::new(metrics);
    let mut shell = Shell::new(cfg.clone(), client, node, claims, store, meter).with_trust(
        allowed_roots,
        trust,
        rejected_records,
    );
    shell.runner = shell.runner.with_secret_source(secret_source);
    shell.guard = guard;
    shell.usage = Some(crate::agent::volume_usage::UsageHandle::start(
        cfg.usage_interval,
        crate::agent::volume_usage::READ_TIMEOUT,
        &cfg.state_dir,
        usage_metrics,
        Some(crate::agent::volume_usage::Calls {
            runner: shell.runner.clone(),
            node: shell.node.clone(),
            every: cfg.check_interval,
        }),
    ));
    shell.guarded = guarded;
    shell.clock = clock.clone();
    for (volume, lock_id, sent) in &restored_leases {
        tracing::info!(%volume, "claim restored with its lease: its last renewal was sent {:?} ago", now().saturating_duration_since(*sent));
        shell.evidence.restored(volume, lock_id, *sent);
    }
    shell
        .evidence
        .keep_on_disk(lease_file, clock.clone())
        .map_err(StartError::Renewals)?;
    // Claim renewals on a thread of their own, over connections of their own.
    shell.renewer = Some(
        crate::agent::renewer::Renewer::start(
            shell.client.with_own_connections()?,
            shell.trust.clone(),
            node_id.clone(),
            claims,
            clock.clone(),
            shell.evidence.clone(),
            shell.renewed_tx.clone(),
        )
        .map_err(StartError::Renewals)?,
    );
    if let Some(h) = helpers {
        shell.runner = shell.runner.clone().with_helpers(h);
    }
    // The mount table first: nothing is planned from an unread one.
    match MountTable::read() {
        Ok(t) => {
            let e = core.handle(Input::MountTable(t), now());
            shell.perform(e);
        }
        Err(e) => tracing::error!(error = %e, "cannot read the mount table"),
    }
    let e = core.handle(Input::Tick, now());
    shell.perform(e);

    // The Variables published volumes reference, followed for their plugins' `refresh`.
    let (secrets_tx, secrets_rx) = mpsc::channel(64);
    let secret_watch =
        crate::agent::secret_watch::SecretWatch::start(shell.client.clone(), secrets_tx);
    let mut sources = Sources {
        secrets: secrets_rx,
        watch: watch_rx,
        catalogue: cat_rx,
        snapshots: snap_rx,
        unpublish: unpublish_rx,
        api: api_rx,
        plugins: plugins_rx,
        records_failing,
        tick: ticker(cfg.tick),
        every: cfg.tick,
        later: None,
    };
    let mut asked_for: BTreeSet<VolumeKey> = BTreeSet::new();
    // The after-pass work that visits every volume, each done at once unless a burst has
    // spent its rate limit ([`spaced`]).
    let mut usage_work = Spaced::new();
    let mut secrets_work = Spaced::new();
    let mut record_work = Spaced::new();
    // The last table reading the core was given: a table answered from the last reading
    // changes nothing the usage task follows, and a pass of the tick alone over it
    // rebuilds the node's record at most every `NODE_RECORD_EVERY` (a rebuild visits
    // every volume: at 1,000 volumes, two passes every 2 s were most of an idle agent's
    // CPU; docs/scale.md).
    let mut last_table: Option<MountTable> = None;
    loop {
        let inputs = tokio::select! {
            _ = &mut shutdown => break,
            inputs = shell.next_inputs(&core, &mut sources) => inputs,
        };
        for i in &inputs {
            shell.meter.input(i);
        }
        // The freshest renewal outcomes: the pass's fence decision weighs every answer in.
        let mut inputs = inputs;
        inputs.extend(shell.renewals_arrived());
        // Mounts and users change only by a journal commit, what is mounted by a reading.
        // A new fingerprint may declare `stats` or `health`; a record read may be one a
        // published volume's calls need.
        let catalogue_or_plugins = |i: &Input| {
            matches!(
                i,
                Input::Catalogue(_) | Input::Done(crate::agent::executor::Completion::Plugins(_))
            )
        };
        let mut new_table = false;
        for i in &inputs {
            if let Input::MountTable(t) = i {
                if !last_table.as_ref().is_some_and(|l| l.same_reading(t)) {
                    new_table = true;
                    last_table = Some(t.clone());
                }
            }
        }
        let tick_only = !new_table
            && inputs
                .iter()
                .all(|i| matches!(i, Input::Tick | Input::MountTable(_)));
        // Only the allocations and the records say which named volumes have no record.
        let names_changed = inputs
            .iter()
            .any(|i| matches!(i, Input::Watch(_) | Input::Catalogue(_)));
        let follows_changed = inputs.iter().any(catalogue_or_plugins);
        let effects = core.handle_all(inputs, now());
        let committed = effects.iter().any(|e| matches!(e, Effect::Commit { .. }));
        if new_table || follows_changed || committed {
            usage_work.mark();
        }
        // The referenced Variables change with the journal's mounts, the records, the plugins.
        if follows_changed || committed {
            secrets_work.mark();
        }
        let at = tokio::time::Instant::now();
        if !tick_only || committed || record_work.older_than(NODE_RECORD_EVERY, at) {
            record_work.mark();
        }
        if secrets_work.take(at) {
            secret_watch.follow(core.refresh_watched());
        }
        shell.perform(effects);
        shell.meter.after_pass(&core);
        // A volume named by an allocation and not in the catalogue: read its record now
        // (once per such volume, not once per pass), whatever the marker says.
        if names_changed {
            let unknown: BTreeSet<VolumeKey> = core.unknown_named_volumes().cloned().collect();
            for k in unknown.difference(&asked_for) {
                record_reads.ask(&k.namespace, &crate::volume::record_path(&k.name));
            }
            asked_for = unknown;
        }
        let usage = shell.usage.as_ref();
        if usage_work.take(at) {
            usage.inspect(|u| {
                u.follow(core.journal(), core.mounted(), core.plugins(), |k| {
                    core.volume_record(k)
                })
            });
        }
        let rebuild = record_work.take(at);
        sources.later = [usage_work.due(), secrets_work.due(), record_work.due()]
            .into_iter()
            .flatten()
            .min();
        if !rebuild {
            continue;
        }
        node_record.send_if_modified(|r| {
            let plugins = core.plugins().is_some_and(|p| r.set_plugins(p));
            let volumes = core.node_volumes();
            let volumes = r.set_volumes(match usage {
                Some(u) => u.annotate(volumes),
                None => volumes,
            });
            let refused = r.set_refused(&shell.rejected_records.snapshot());
            let history = core.node_history();
            let history = r.set_history(match usage {
                Some(u) => u.with_condition_events(history),
                None => history,
            });
            let attach = r.set_attach(core.attach_counts());
            r.set_watch(core.watch_health()) | plugins | volumes | refused | history | attach
        });
    }
    tracing::info!("dhv-binder agent stopping; published volumes stay mounted for their tasks");
    shell.evidence.close();
    for t in background {
        t.abort();
    }
    node_publisher.abort();
    Ok(())
}

mod spaced;
#[cfg(test)]
mod tests;
