//! The shell: the one place that performs effects. It owns the channels, the journal's
//! files, the reply channels of waiting callers and a `JoinSet` of running effects (plugin
//! calls bounded by a semaphore of `--max-parallel` permits); it feeds every message and
//! every completion to the [`Core`] and performs what the core returns.
//!
//! A journal commit runs on a blocking thread; the plugin calls that wait on it start when
//! it is durable. Commits returned while one is being written are folded into one write.

use crate::agent::core::{Core, Settings};
use crate::agent::effect::{Answer, Effect};
use crate::agent::input::{ApiCall, Completion, Input, ReplyId};
use crate::api::{ApiError, PublishReply, Request2Agent};
use crate::catalog::{self, Catalogue};
use crate::claims::ClaimSettings;
use crate::config::AgentConfig;
use crate::environment::NodeEnv;
use crate::executor;
use crate::identity::Verifier;
use crate::journal::{Commit, JournalError, Store};
use crate::mounts::MountTable;
use crate::nomad::Client;
use crate::plugin::Runner;
use crate::watch::{self, WatchConfig, WatchEvent};
use std::collections::HashMap;
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

/// What a finished task reports to the loop.
enum Report {
    Done(Completion),
    /// A plugin call or detach finished; the mount table read right after it.
    DoneMounts(Completion, std::io::Result<MountTable>),
    Mounts(std::io::Result<MountTable>),
    Committed {
        seq: u64,
        result: Result<(), JournalError>,
        then: Vec<Effect>,
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
    replies: HashMap<ReplyId, Pending>,
    next_reply: u64,
    committing: bool,
    queued: Option<(Commit, Vec<Effect>)>,
    reading_mounts: bool,
}

impl Shell {
    fn perform(&mut self, effects: Vec<Effect>) {
        for e in effects {
            self.perform_one(e);
        }
    }

    fn plugin_call(
        &mut self,
        call: impl std::future::Future<Output = Completion> + Send + 'static,
        read_mounts: bool,
    ) {
        let permits = self.permits.clone();
        self.tasks.spawn(async move {
            let _permit = permits.acquire_owned().await;
            let done = call.await;
            if read_mounts {
                let table = tokio::task::spawn_blocking(MountTable::read)
                    .await
                    .unwrap_or_else(|e| Err(std::io::Error::other(e)));
                Report::DoneMounts(done, table)
            } else {
                Report::Done(done)
            }
        });
    }

    fn call(&mut self, call: impl std::future::Future<Output = Completion> + Send + 'static) {
        self.tasks.spawn(async move { Report::Done(call.await) });
    }

    fn perform_one(&mut self, e: Effect) {
        let (client, runner, node) = (self.client.clone(), self.runner.clone(), self.node.clone());
        match e {
            Effect::Publish {
                volume,
                target,
                read_only,
                alloc_id,
            } => self.plugin_call(
                executor::publish(runner, node, *volume, target, read_only, alloc_id),
                true,
            ),
            Effect::Unpublish {
                mount,
                volume,
                keep_dir,
            } => self.plugin_call(
                executor::unpublish(runner, node, *mount, volume.map(|v| *v), keep_dir),
                true,
            ),
            // Not under the permits: a node whose calls all hang still learns its plugins.
            Effect::Fingerprint => self.call(executor::fingerprint_all(runner)),
            Effect::Create(rec) => self.plugin_call(
                executor::create(client, runner, node, *rec, self.cfg.mount_root()),
                false,
            ),
            Effect::Storage(op) => {
                self.plugin_call(executor::storage::perform(client, runner, node, op), true)
            }
            Effect::Delete(rec) => {
                self.plugin_call(executor::delete(client, runner, node, *rec), false)
            }
            Effect::ListPlaceholders => self.call(executor::list_placeholders(
                client,
                node.node_id.clone(),
                self.cfg.mount_root(),
            )),
            Effect::RegisterPlaceholder { volume, target } => self.call(
                executor::register_placeholder(client, node, *volume, target),
            ),
            Effect::DeregisterPlaceholder { volume, id } => {
                self.call(executor::deregister_placeholder(client, volume, id))
            }
            Effect::AcquireClaim { volume, volume_id } => self.call(executor::acquire_claim(
                client,
                self.claims,
                node.node_id,
                volume,
                volume_id,
            )),
            Effect::RenewClaim { volume, lock_id } => {
                self.call(executor::renew_claim(client, volume, lock_id))
            }
            Effect::ReleaseClaim { volume, lock_id } => {
                self.call(executor::release_claim(client, volume, lock_id))
            }
            Effect::FetchAlloc { alloc_id } => self.call(executor::fetch_alloc(client, alloc_id)),
            Effect::RestartAlloc { volume, alloc_id } => {
                self.call(executor::restart_alloc(client, volume, alloc_id))
            }
            Effect::Probe { volume, target } => {
                let timeout = self.cfg.health_interval.min(Duration::from_secs(5));
                self.tasks.spawn(async move {
                    let probe = crate::health::probe(target.clone(), timeout).await;
                    Report::Done(Completion::Probed {
                        volume,
                        target,
                        probe,
                    })
                });
            }
            Effect::Detach { volume, target } => {
                self.tasks.spawn_blocking(move || {
                    let result = crate::health::lazy_unmount(&target);
                    Report::DoneMounts(Completion::Detached { volume, result }, MountTable::read())
                });
            }
            Effect::ReadMountTable => {
                if !self.reading_mounts {
                    self.reading_mounts = true;
                    self.tasks
                        .spawn_blocking(|| Report::Mounts(MountTable::read()));
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
                (Some(Pending::Status(tx)), Answer::Status(v)) => {
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
            let result = store.write(&commit);
            Report::Committed {
                seq: commit.seq,
                result,
                then,
            }
        });
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

    /// Turns a finished task into the core's inputs (a mount table reading first).
    fn on_report(&mut self, r: Report) -> Vec<Input> {
        let table = |t: std::io::Result<MountTable>| match t {
            Ok(t) => Some(Input::MountTable(t)),
            Err(e) => {
                tracing::error!(error = %e, "cannot read the mount table; keeping the last reading");
                None
            }
        };
        match r {
            Report::Done(c) => vec![Input::Done(c)],
            Report::DoneMounts(c, t) => table(t).into_iter().chain([Input::Done(c)]).collect(),
            Report::Mounts(t) => {
                self.reading_mounts = false;
                table(t).into_iter().collect()
            }
            Report::Committed { seq, result, then } => {
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

/// Starts the agent and runs it until `shutdown` resolves.
pub async fn run(
    cfg: AgentConfig,
    client: Client,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), StartError> {
    if let Some(path) = &cfg.token_file {
        watch::read_token_file(&client, path);
    }
    let me = client.agent_self().await.map_err(StartError::AgentSelf)?;
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
    let (store, journal) = Store::open(&cfg.state_dir, &node_id)?;
    let (listener, _socket_guard) =
        crate::api::bind(&cfg.socket).map_err(|source| StartError::Socket {
            path: cfg.socket.clone(),
            source,
        })?;
    if !cfg.plugin_dir.is_dir() {
        tracing::warn!(plugin_dir = %cfg.plugin_dir.display(), "the plugin directory does not exist: this node serves no volume until plugins are installed there");
    }

    let (watch_tx, mut watch_rx) = mpsc::channel::<WatchEvent>(256);
    let (cat_tx, mut cat_rx) = mpsc::channel::<Catalogue>(4);
    let (snap_tx, mut snap_rx) = mpsc::channel::<crate::snapshot::Snapshots>(4);
    let (api_tx, mut api_rx) = mpsc::channel::<Request2Agent>(256);
    let (plugins_tx, mut plugins_rx) = mpsc::channel::<()>(1);

    let mut wcfg = WatchConfig::new(&node_id);
    wcfg.idle_timeout = cfg.stream_idle_timeout;
    wcfg.resync_interval = cfg.resync_interval;
    wcfg.mode = cfg.watch_mode;
    wcfg.token_file = cfg.token_file.clone();
    let background = [
        tokio::spawn(watch::run(client.clone(), wcfg, watch_tx)),
        tokio::spawn(catalog::run(
            client.clone(),
            Duration::from_secs(300),
            cat_tx,
        )),
        tokio::spawn(crate::snapshot::watch(
            client.clone(),
            Duration::from_secs(300),
            snap_tx,
        )),
        tokio::spawn(crate::api::serve(
            listener,
            Verifier::new(client.clone(), &cfg.audiences),
            api_tx,
        )),
        tokio::spawn(crate::discovery::run(cfg.plugin_dir.clone(), plugins_tx)),
    ];

    // This node's record for `plugin status`, `node status` and `volume create`'s
    // fail-fast check; refreshed after every loop turn below (issue 15).
    let node_name = me
        .config
        .pointer("/NodeName")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    let (node_record, node_publisher) = crate::nodes::spawn_publisher(
        client.clone(),
        crate::nodes::NodeRecord::new(&node_id, node_name, &node_pool),
        crate::nodes::HEARTBEAT,
    );
    let node = NodeEnv {
        node_id: node_id.clone(),
        node_pool,
        volumes_dir: cfg.volumes_dir(),
        plugin_dir: cfg.plugin_dir.clone(),
        roots: cfg.plugin_roots(),
    };
    let claims = ClaimSettings {
        ttl: cfg.claim_ttl,
        lock_delay: cfg.claim_lock_delay,
    };
    let now = || tokio::time::Instant::now().into_std();
    let mut core = Core::new(
        Settings {
            node: node.clone(),
            mount_root: cfg.mount_root(),
            plugin_rescan: cfg.plugin_rescan,
            claims,
            health_interval: cfg.health_interval,
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
    let mut shell = Shell {
        runner: Runner::new(&cfg.plugin_dir, cfg.plugin_timeout),
        permits: Arc::new(Semaphore::new(cfg.max_parallel.max(1))),
        cfg: cfg.clone(),
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
    };
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

    let mut tick = tokio::time::interval(cfg.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        let floor = tokio::time::Instant::now() + Duration::from_millis(10);
        let wake = core
            .next_wakeup()
            .map(tokio::time::Instant::from_std)
            .map_or(floor + cfg.tick, |w| w.max(floor));
        let mut inputs: Vec<Input> = tokio::select! {
            _ = &mut shutdown => break,
            Some(ev) = watch_rx.recv() => vec![Input::Watch(ev)],
            Some(cat) = cat_rx.recv() => vec![Input::Catalogue(cat)],
            Some(snaps) = snap_rx.recv() => vec![Input::Snapshots(snaps)],
            Some(req) = api_rx.recv() => vec![shell.register(req)],
            Some(done) = shell.tasks.join_next() => match done {
                Ok(r) => shell.on_report(r),
                Err(e) => {
                    tracing::error!(error = %e, "an effect's task failed");
                    Vec::new()
                }
            },
            _ = tick.tick() => {
                let mut v: Vec<Input> = shell.gone().into_iter().map(Input::CallerGone).collect();
                v.push(Input::Tick);
                v
            }
            _ = tokio::time::sleep_until(wake) => vec![Input::Tick],
            Some(()) = plugins_rx.recv() => vec![Input::PluginsChanged],
        };
        // Whatever else is already waiting joins this pass (bounded): a burst of messages
        // is planned once.
        while inputs.len() < BATCH {
            if let Ok(ev) = watch_rx.try_recv() {
                inputs.push(Input::Watch(ev));
            } else if let Some(done) = shell.tasks.try_join_next() {
                match done {
                    Ok(r) => inputs.extend(shell.on_report(r)),
                    Err(e) => tracing::error!(error = %e, "an effect's task failed"),
                }
            } else {
                break;
            }
        }
        let effects = core.handle_all(inputs, now());
        shell.perform(effects);
        node_record.send_if_modified(|r| {
            let plugins = core.plugins().is_some_and(|p| r.set_plugins(p));
            r.set_watch(core.watch_health()) | plugins
        });
    }
    tracing::info!("dhv-binder agent stopping; published volumes stay mounted for their tasks");
    for t in background {
        t.abort();
    }
    node_publisher.abort();
    Ok(())
}
