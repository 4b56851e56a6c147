//! The agent: one owner of all node state, one loop. Messages come in (watcher events,
//! catalogue snapshots, API requests, step completions, ticks); after each, the reconcile
//! plan is computed and its steps handed to the executor. No shared mutable state.

use crate::api::{ApiError, PublishReply, PublishedVolume, Request2Agent};
use crate::catalog::{self, Catalogue};
use crate::claims::ClaimSettings;
use crate::config::AgentConfig;
use crate::executor::{self, Completion, NodeEnv};
use crate::identity::Verifier;
use crate::journal::{Journal, MountRecord, MountState, UserKey};
use crate::nomad::Client;
use crate::plugin::{Fingerprint, Runner};
use crate::reconcile::{self, ClaimState, Inputs, Step};
use crate::view::{requests, View};
use crate::volume::{VolumeKey, VolumeRecord, VolumeState};
use crate::watch::{self, backoff_delay, Health, WatchConfig, WatchEvent};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// Why the agent could not start. The CLI maps these to exit codes.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot learn this node's ID from the local Nomad agent: {0}")]
    AgentSelf(#[source] crate::nomad::NomadError),
    #[error("the Nomad agent at {0} runs no client: run dhv-binder on client nodes, with NOMAD_ADDR pointing at the local agent")]
    NotAClient(String),
    #[error(transparent)]
    Journal(#[from] crate::journal::JournalError),
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

struct Waiter {
    alloc_id: String,
    namespace: String,
    deadline: Instant,
    reply: oneshot::Sender<Result<PublishReply, ApiError>>,
}

struct Backoff {
    attempt: u32,
    not_before: Instant,
}

/// This node's claim on a single-node volume.
#[derive(Debug, Clone)]
struct Claim {
    id: String,
    state: ClaimState,
    renewed: Instant,
}

/// The agent's state, owned by its loop.
struct Agent {
    cfg: AgentConfig,
    node: NodeEnv,
    client: Client,
    runner: Runner,
    journal: Journal,
    view: View,
    health: Health,
    volumes: Catalogue,
    volumes_loaded: bool,
    plugins: BTreeMap<String, Result<Fingerprint, String>>,
    plugins_loaded: bool,
    busy: BTreeSet<VolumeKey>,
    backoff: HashMap<VolumeKey, Backoff>,
    last_error: HashMap<VolumeKey, String>,
    waiters: Vec<Waiter>,
    fetching: BTreeSet<String>,
    placeholders: BTreeMap<VolumeKey, String>,
    placeholders_loaded: bool,
    placeholder_busy: BTreeSet<VolumeKey>,
    placeholder_backoff: HashMap<VolumeKey, Backoff>,
    worker_busy: BTreeSet<VolumeKey>,
    worker_backoff: HashMap<VolumeKey, Backoff>,
    fingerprinting: bool,
    last_fingerprint: Option<Instant>,
    waiting: Vec<reconcile::Waiting>,
    publish_latency_ms: Vec<u64>,
    claims: BTreeMap<VolumeKey, Claim>,
    claim_settings: ClaimSettings,
    claim_wait: BTreeMap<VolumeKey, String>,
    claim_backoff: HashMap<VolumeKey, Backoff>,
    renewing: BTreeSet<VolumeKey>,
    mount_health: crate::health::Monitor,
    done_tx: mpsc::UnboundedSender<Completion>,
}

const STEP_BACKOFF_BASE: Duration = Duration::from_secs(1);
const STEP_BACKOFF_CAP: Duration = Duration::from_secs(60);

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
    std::fs::create_dir_all(cfg.mount_root()).map_err(|source| StartError::Socket {
        path: cfg.mount_root(),
        source,
    })?;
    std::fs::create_dir_all(cfg.volumes_dir()).map_err(|source| StartError::Socket {
        path: cfg.volumes_dir(),
        source,
    })?;
    let _state_lock = StateLock::acquire(&cfg.state_dir)?;
    let journal = Journal::open(&cfg.state_dir, &node_id)?;
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
    let (api_tx, mut api_rx) = mpsc::channel::<Request2Agent>(256);
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Completion>();

    let mut wcfg = WatchConfig::new(&node_id);
    wcfg.idle_timeout = cfg.stream_idle_timeout;
    wcfg.resync_interval = cfg.resync_interval;
    wcfg.mode = cfg.watch_mode;
    wcfg.token_file = cfg.token_file.clone();
    let tasks = [
        tokio::spawn(watch::run(client.clone(), wcfg, watch_tx)),
        tokio::spawn(catalog::run(
            client.clone(),
            Duration::from_secs(300),
            cat_tx,
        )),
        tokio::spawn(crate::api::serve(
            listener,
            Verifier::new(client.clone(), &cfg.audiences),
            api_tx,
        )),
    ];

    let runner = Runner::new(&cfg.plugin_dir, cfg.plugin_timeout);
    let node = NodeEnv {
        node_id: node_id.clone(),
        node_pool,
        volumes_dir: cfg.volumes_dir(),
        plugin_dir: cfg.plugin_dir.clone(),
        roots: cfg.plugin_roots(),
    };
    let mut agent = Agent {
        cfg: cfg.clone(),
        node,
        client: client.clone(),
        runner,
        journal,
        view: View::default(),
        health: Health::Listing,
        volumes: Catalogue::new(),
        volumes_loaded: false,
        plugins: BTreeMap::new(),
        plugins_loaded: false,
        busy: BTreeSet::new(),
        backoff: HashMap::new(),
        last_error: HashMap::new(),
        waiters: Vec::new(),
        fetching: BTreeSet::new(),
        placeholders: BTreeMap::new(),
        placeholders_loaded: false,
        placeholder_busy: BTreeSet::new(),
        placeholder_backoff: HashMap::new(),
        worker_busy: BTreeSet::new(),
        worker_backoff: HashMap::new(),
        fingerprinting: false,
        last_fingerprint: None,
        waiting: Vec::new(),
        publish_latency_ms: Vec::new(),
        claims: BTreeMap::new(),
        claim_settings: ClaimSettings {
            ttl: cfg.claim_ttl,
            lock_delay: cfg.claim_lock_delay,
        },
        claim_wait: BTreeMap::new(),
        claim_backoff: HashMap::new(),
        renewing: BTreeSet::new(),
        mount_health: crate::health::Monitor::new(
            cfg.health_interval,
            cfg.health_interval.min(Duration::from_secs(5)),
        ),
        done_tx,
    };
    // Claims recorded before a restart are renewed at once: a failed renew means another
    // node may have the volume now, and the mount here is removed before anything else.
    let stale = Instant::now()
        .checked_sub(cfg.claim_ttl)
        .unwrap_or_else(Instant::now);
    for m in agent.journal.mounts().values() {
        if let Some(id) = &m.claim_id {
            agent.claims.insert(
                m.volume.clone(),
                Claim {
                    id: id.clone(),
                    state: ClaimState::Held,
                    renewed: stale,
                },
            );
        }
    }
    let mut health_rx = agent.mount_health.take_reports();
    let (plugins_tx, mut plugins_rx) = mpsc::channel::<()>(1);
    let discovery = tokio::spawn(crate::discovery::run(cfg.plugin_dir.clone(), plugins_tx));
    agent.spawn_placeholder_list();

    let mut tick = tokio::time::interval(cfg.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(ev) = watch_rx.recv() => agent.on_watch(ev),
            Some(cat) = cat_rx.recv() => {
                agent.volumes = cat;
                agent.volumes_loaded = true;
            }
            Some(req) = api_rx.recv() => agent.on_api(req),
            Some(done) = done_rx.recv() => agent.on_done(done),
            _ = tick.tick() => agent.on_tick(),
            Some(()) = plugins_rx.recv() => {
                agent.last_fingerprint = None;
                agent.on_tick();
            }
            Some(r) = health_rx.recv() => agent.on_mount_health(r),
        }
        agent.drive();
    }
    tracing::info!("dhv-binder agent stopping; published volumes stay mounted for their tasks");
    for t in tasks {
        t.abort();
    }
    discovery.abort();
    Ok(())
}

fn retry_ready(map: &HashMap<VolumeKey, Backoff>, key: &VolumeKey, now: Instant) -> bool {
    map.get(key).is_none_or(|b| b.not_before <= now)
}

fn bump(map: &mut HashMap<VolumeKey, Backoff>, key: &VolumeKey) {
    let attempt = map.get(key).map(|b| b.attempt + 1).unwrap_or(0);
    map.insert(
        key.clone(),
        Backoff {
            attempt,
            not_before: Instant::now()
                + backoff_delay(STEP_BACKOFF_BASE, STEP_BACKOFF_CAP, attempt),
        },
    );
}

impl Agent {
    fn deferred_plugins(&self) -> BTreeSet<String> {
        self.plugins
            .iter()
            .filter(|(_, f)| matches!(f, Ok(fp) if fp.deferred_bind))
            .map(|(id, _)| id.clone())
            .collect()
    }

    fn target_of(&self, key: &VolumeKey) -> PathBuf {
        self.cfg.mount_root().join(&key.namespace).join(&key.name)
    }

    fn serves(&self, rec: &VolumeRecord, deferred: &BTreeSet<String>) -> bool {
        deferred.contains(&rec.spec.plugin_id)
            && (rec.spec.node_pool.is_empty() || rec.spec.node_pool == self.node.node_pool)
    }

    fn on_watch(&mut self, ev: WatchEvent) {
        match ev {
            WatchEvent::Relisted { allocs, index } => {
                tracing::debug!(
                    count = allocs.len(),
                    index,
                    "relisted the node's allocations"
                );
                self.view.replace_all(allocs, index);
            }
            WatchEvent::Upsert(a) => {
                let a = *a;
                tracing::debug!(alloc_id = %a.id, client_status = %a.client_status, desired = %a.desired_status, "allocation update");
                self.view.upsert(a);
            }
            WatchEvent::Removed(id) => self.view.remove(&id),
            WatchEvent::Health(h) => self.health = h,
        }
    }

    fn on_tick(&mut self) {
        let gone = self.view.expire(std::time::Instant::now());
        if gone > 0 {
            tracing::info!(
                count = gone,
                "allocations removed from Nomad are past their kill grace"
            );
        }
        let due = self
            .last_fingerprint
            .is_none_or(|t| t.elapsed() >= self.cfg.plugin_rescan);
        if due && !self.fingerprinting {
            self.fingerprinting = true;
            self.last_fingerprint = Some(Instant::now());
            tokio::spawn(self.send_done(executor::fingerprint_all(self.runner.clone())));
        }
        if !self.placeholders_loaded {
            self.spawn_placeholder_list();
        }
        let every = self.claim_settings.ttl / 3;
        let due: Vec<(VolumeKey, String)> = self
            .claims
            .iter()
            .filter(|(k, c)| {
                c.state == ClaimState::Held
                    && c.renewed.elapsed() >= every
                    && !self.renewing.contains(*k)
            })
            .map(|(k, c)| (k.clone(), c.id.clone()))
            .collect();
        for (volume, id) in due {
            self.renewing.insert(volume.clone());
            tokio::spawn(self.send_done(executor::renew_claim(self.client.clone(), volume, id)));
        }
        self.mount_health.tick(
            self.journal.mounts(),
            &crate::mounts::mount_points(),
            &self.busy,
        );
    }

    fn on_mount_health(&mut self, report: crate::health::Report) {
        use crate::health::{Action, Report};
        match report {
            Report::Probed {
                volume,
                target,
                probe,
            } => {
                let busy = self.busy.contains(&volume);
                match self.mount_health.on_probe(
                    &volume,
                    &target,
                    probe,
                    busy,
                    self.journal.users(),
                ) {
                    Action::Nothing => {}
                    Action::Unmount(t) => {
                        if let Err(e) = crate::health::lazy_unmount(&t) {
                            tracing::warn!(%volume, target = %t.display(), error = %e, "cannot detach the dead mount");
                        }
                    }
                    Action::Restart(allocs) => {
                        self.mount_health.restart(&self.client, &volume, allocs)
                    }
                }
            }
            Report::Restarted {
                volume,
                alloc_id,
                result,
            } => self.mount_health.on_restarted(&volume, &alloc_id, result),
        }
    }

    fn send_done(
        &self,
        fut: impl std::future::Future<Output = Completion> + Send + 'static,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let tx = self.done_tx.clone();
        async move {
            let _ = tx.send(fut.await);
        }
    }

    fn spawn_placeholder_list(&mut self) {
        tokio::spawn(self.send_done(executor::list_placeholders(
            self.client.clone(),
            self.node.node_id.clone(),
            self.cfg.mount_root(),
        )));
    }

    fn on_api(&mut self, req: Request2Agent) {
        match req {
            Request2Agent::Status { reply } => {
                let _ = reply.send(self.status());
            }
            Request2Agent::Publish {
                alloc_id,
                claims,
                wait,
                reply,
            } => {
                if !self.view.allocs().contains_key(&alloc_id)
                    && self.fetching.insert(alloc_id.clone())
                {
                    tokio::spawn(
                        self.send_done(executor::fetch_alloc(
                            self.client.clone(),
                            alloc_id.clone(),
                        )),
                    );
                }
                self.waiters.push(Waiter {
                    alloc_id,
                    namespace: claims.nomad_namespace,
                    deadline: Instant::now() + wait,
                    reply,
                });
            }
        }
    }

    fn on_done(&mut self, done: Completion) {
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
                        self.backoff.remove(&volume);
                        self.last_error.remove(&volume);
                        self.publish_latency_ms.push(elapsed.as_millis() as u64);
                        tracing::info!(%volume, target = %m.target.display(), ms = elapsed.as_millis() as u64, "published");
                        if let Err(e) = self.journal.set_mount(m, "publish-done", None) {
                            tracing::error!(error = %e, "journal write failed");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(%volume, error = %e, "publish failed; will retry with backoff");
                        m.last_error = e.clone();
                        self.last_error.insert(volume.clone(), e);
                        bump(&mut self.backoff, &volume);
                        if let Err(e) = self.journal.set_mount(m, "publish-failed", None) {
                            tracing::error!(error = %e, "journal write failed");
                        }
                    }
                }
            }
            Completion::Unpublished { volume, result } => {
                self.busy.remove(&volume);
                match result {
                    Ok(()) => {
                        self.backoff.remove(&volume);
                        self.last_error.remove(&volume);
                        if let Some(m) = self.journal.mounts().get(&volume) {
                            // Leave no directory behind, but never delete data: rmdir only.
                            let _ = std::fs::remove_dir(&m.target);
                            if self.placeholders.contains_key(&volume) {
                                let _ = std::fs::create_dir_all(&m.target);
                            }
                        }
                        tracing::info!(%volume, "unpublished");
                        if let Err(e) = self.journal.remove_mount(&volume, "unpublish-done") {
                            tracing::error!(error = %e, "journal write failed");
                        }
                        match self.claims.get(&volume).cloned() {
                            Some(c) if c.state == ClaimState::Held => {
                                self.busy.insert(volume.clone());
                                tokio::spawn(self.send_done(executor::release_claim(
                                    self.client.clone(),
                                    volume,
                                    c.id,
                                )));
                            }
                            Some(_) => {
                                self.claims.remove(&volume);
                            }
                            None => {}
                        }
                    }
                    Err(e) => {
                        tracing::warn!(%volume, error = %e, "unpublish failed; will retry with backoff");
                        self.last_error.insert(volume.clone(), e.clone());
                        bump(&mut self.backoff, &volume);
                        if let Some(mut m) = self.journal.mounts().get(&volume).cloned() {
                            m.last_error = e;
                            let _ = self.journal.set_mount(m, "unpublish-failed", None);
                        }
                    }
                }
            }
            Completion::Plugins(map) => {
                self.fingerprinting = false;
                for (id, r) in &map {
                    let changed = self.plugins.get(id) != Some(r);
                    if changed {
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
                }
                self.plugins = map;
                self.plugins_loaded = true;
            }
            Completion::PlaceholdersListed(r) => match r {
                Ok(map) => {
                    self.placeholders = map;
                    self.placeholders_loaded = true;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list this node's placeholder host volumes; retrying")
                }
            },
            Completion::Placeholder { volume, result } => {
                self.placeholder_busy.remove(&volume);
                match result {
                    Ok(Some(id)) => {
                        tracing::info!(%volume, host_volume_id = %id, "placeholder host volume registered");
                        self.placeholder_backoff.remove(&volume);
                        self.placeholders.insert(volume, id);
                    }
                    Ok(None) => {
                        tracing::info!(%volume, "placeholder host volume deregistered");
                        self.placeholder_backoff.remove(&volume);
                        self.placeholders.remove(&volume);
                    }
                    Err(e) => {
                        tracing::warn!(%volume, error = %e, "placeholder host volume change failed; will retry");
                        bump(&mut self.placeholder_backoff, &volume);
                    }
                }
            }
            Completion::Worker { volume, result } => {
                self.worker_busy.remove(&volume);
                match result {
                    Ok(()) => {
                        self.worker_backoff.remove(&volume);
                    }
                    Err(e) if e.contains("another node changed the record first") => {
                        tracing::debug!(%volume, "another node took the create/delete first");
                        bump(&mut self.worker_backoff, &volume);
                    }
                    Err(e) => {
                        tracing::warn!(%volume, error = %e, "volume create/delete step failed");
                        bump(&mut self.worker_backoff, &volume);
                    }
                }
            }
            Completion::ClaimAcquired { volume, result } => {
                self.busy.remove(&volume);
                match result {
                    Ok(id) => {
                        tracing::info!(%volume, "claim acquired");
                        self.claim_wait.remove(&volume);
                        self.claim_backoff.remove(&volume);
                        self.claims.insert(
                            volume,
                            Claim {
                                id,
                                state: ClaimState::Held,
                                renewed: Instant::now(),
                            },
                        );
                    }
                    Err((held, msg)) => {
                        if self.claim_wait.get(&volume) != Some(&msg) {
                            tracing::info!(%volume, reason = %msg, "publish waits for the claim");
                        }
                        let reason = if held {
                            format!("publish waits for the single-node claim: {msg}")
                        } else {
                            format!("cannot take the claim: {msg}")
                        };
                        self.claim_wait.insert(volume.clone(), reason);
                        let attempt = self
                            .claim_backoff
                            .get(&volume)
                            .map(|b| b.attempt + 1)
                            .unwrap_or(0);
                        self.claim_backoff.insert(
                            volume,
                            Backoff {
                                attempt,
                                not_before: Instant::now()
                                    + backoff_delay(
                                        Duration::from_millis(500),
                                        Duration::from_secs(3),
                                        attempt,
                                    ),
                            },
                        );
                    }
                }
            }
            Completion::ClaimRenewed { volume, result } => {
                self.renewing.remove(&volume);
                match result {
                    Ok(()) => {
                        if let Some(c) = self.claims.get_mut(&volume) {
                            c.renewed = Instant::now();
                        }
                    }
                    Err((true, msg)) => {
                        tracing::warn!(%volume, reason = %msg, "claim lost: another node may use the volume now; unpublishing here before anything else");
                        if let Some(c) = self.claims.get_mut(&volume) {
                            c.state = ClaimState::Lost;
                        }
                        if !self.journal.mounts().contains_key(&volume) {
                            self.claims.remove(&volume);
                        }
                    }
                    Err((false, msg)) => {
                        tracing::warn!(%volume, error = %msg, "claim renewal failed; retrying");
                    }
                }
            }
            Completion::ClaimReleased { volume, result } => {
                self.busy.remove(&volume);
                if let Err(e) = result {
                    tracing::warn!(%volume, error = %e, "claim release failed; it expires with its TTL");
                }
                self.claims.remove(&volume);
            }
            Completion::AllocFetched { alloc_id, result } => {
                self.fetching.remove(&alloc_id);
                match result {
                    Ok(Some(a)) if a.node_id == self.node.node_id => self.view.upsert(*a),
                    Ok(Some(a)) => self.fail_waiters(
                        &alloc_id,
                        ApiError::Forbidden(format!(
                            "allocation {alloc_id} runs on node {}, not on this node {}",
                            a.node_id, self.node.node_id
                        )),
                    ),
                    Ok(None) => self.fail_waiters(
                        &alloc_id,
                        ApiError::NotFound(format!(
                            "allocation {alloc_id} does not exist in Nomad"
                        )),
                    ),
                    Err(e) => self.fail_waiters(&alloc_id, ApiError::Unavailable(e)),
                }
            }
        }
    }

    fn fail_waiters(&mut self, alloc_id: &str, err: ApiError) {
        let (done, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiters)
            .into_iter()
            .partition(|w| w.alloc_id == alloc_id);
        self.waiters = keep;
        for w in done {
            let _ = w.reply.send(Err(err.clone()));
        }
    }

    /// Plans and starts steps, keeps placeholders and records current, answers waiters.
    fn drive(&mut self) {
        let deferred = self.deferred_plugins();
        let mounted = crate::mounts::mount_points();
        let claims: BTreeMap<VolumeKey, ClaimState> = self
            .claims
            .iter()
            .map(|(k, c)| (k.clone(), c.state))
            .collect();
        let plan = reconcile::plan(Inputs {
            view: &self.view,
            volumes_loaded: self.volumes_loaded && self.plugins_loaded,
            volumes: &self.volumes,
            mounts: self.journal.mounts(),
            users: self.journal.users(),
            mounted: &mounted,
            plugins: &deferred,
            busy: &self.busy,
            claims: &claims,
        });
        self.waiting = plan.waiting;
        for (volume, reason) in &self.claim_wait {
            if !self.claims.contains_key(volume) {
                self.waiting.push(reconcile::Waiting {
                    volume: volume.clone(),
                    reason: reason.clone(),
                });
            }
        }
        let now = Instant::now();
        // Journal-only steps first, in one durable write, before any plugin call starts.
        let (mut add, mut remove) = (Vec::new(), Vec::new());
        let mut calls = Vec::new();
        for step in plan.steps {
            match step {
                Step::AddUser(u) => add.push(u),
                Step::RemoveUser(u) => remove.push(u),
                other => calls.push(other),
            }
        }
        if let Err(e) = self.journal.change_users(&add, &remove) {
            tracing::error!(error = %e, "journal write failed");
        }
        for step in calls {
            match step {
                Step::AddUser(_) | Step::RemoveUser(_) => {}
                Step::Publish {
                    volume,
                    alloc_id,
                    read_only,
                } => {
                    if self.busy.len() >= self.cfg.max_parallel
                        || !retry_ready(&self.backoff, &volume, now)
                    {
                        continue;
                    }
                    self.start_publish(volume, alloc_id, read_only);
                }
                Step::Unpublish { volume } => {
                    if self.busy.len() >= self.cfg.max_parallel
                        || !retry_ready(&self.backoff, &volume, now)
                    {
                        continue;
                    }
                    self.start_unpublish(volume);
                }
                Step::AcquireClaim { volume } => {
                    if self.busy.len() >= self.cfg.max_parallel
                        || !retry_ready(&self.claim_backoff, &volume, now)
                    {
                        continue;
                    }
                    let Some(rec) = self.volumes.get(&volume) else {
                        continue;
                    };
                    let volume_id = rec.id.clone();
                    self.busy.insert(volume.clone());
                    tokio::spawn(self.send_done(executor::acquire_claim(
                        self.client.clone(),
                        self.claim_settings,
                        self.node.clone(),
                        volume,
                        volume_id,
                    )));
                }
                Step::ReleaseClaim { volume } => {
                    let Some(c) = self.claims.get(&volume) else {
                        continue;
                    };
                    let id = c.id.clone();
                    self.busy.insert(volume.clone());
                    tokio::spawn(self.send_done(executor::release_claim(
                        self.client.clone(),
                        volume,
                        id,
                    )));
                }
            }
        }
        self.drive_placeholders(&deferred, now);
        self.drive_workers(&deferred, now);
        self.answer_waiters(now);
    }

    fn start_publish(&mut self, volume: VolumeKey, alloc_id: String, read_only: bool) {
        let Some(rec) = self.volumes.get(&volume).cloned() else {
            return;
        };
        let target = self.target_of(&volume);
        if let Err(e) = std::fs::create_dir_all(&target) {
            self.last_error.insert(
                volume.clone(),
                format!("cannot create {}: {e}", target.display()),
            );
            bump(&mut self.backoff, &volume);
            return;
        }
        let prev = self.journal.mounts().get(&volume);
        let m = MountRecord {
            volume: volume.clone(),
            volume_id: rec.id.clone(),
            plugin_id: rec.spec.plugin_id.clone(),
            state: MountState::Publishing,
            target: prev
                .map(|p| p.target.clone())
                .unwrap_or_else(|| target.clone()),
            read_only,
            publish_context: prev.map(|p| p.publish_context.clone()).unwrap_or_default(),
            since: 0,
            last_error: String::new(),
            claim_id: self.claims.get(&volume).map(|c| c.id.clone()),
        };
        let target = m.target.clone();
        if let Err(e) = self.journal.set_mount(m, "publish-intent", Some(&alloc_id)) {
            tracing::error!(error = %e, "journal write failed; not publishing");
            return;
        }
        tracing::info!(%volume, %alloc_id, target = %target.display(), "publishing");
        self.busy.insert(volume);
        tokio::spawn(self.send_done(executor::publish(
            self.runner.clone(),
            self.node.clone(),
            rec,
            target,
            read_only,
            alloc_id,
        )));
    }

    fn start_unpublish(&mut self, volume: VolumeKey) {
        let Some(mut m) = self.journal.mounts().get(&volume).cloned() else {
            return;
        };
        m.state = MountState::Unpublishing;
        if let Err(e) = self.journal.set_mount(m.clone(), "unpublish-intent", None) {
            tracing::error!(error = %e, "journal write failed; not unpublishing");
            return;
        }
        tracing::info!(%volume, target = %m.target.display(), "unpublishing");
        self.busy.insert(volume.clone());
        let rec = self.volumes.get(&volume).cloned();
        tokio::spawn(self.send_done(executor::unpublish(
            self.runner.clone(),
            self.node.clone(),
            m,
            rec,
        )));
    }

    fn drive_placeholders(&mut self, deferred: &BTreeSet<String>, now: Instant) {
        if !self.placeholders_loaded || !self.volumes_loaded || !self.plugins_loaded {
            return;
        }
        let want: BTreeMap<VolumeKey, VolumeRecord> = self
            .volumes
            .values()
            .filter(|r| r.state == VolumeState::Ready && self.serves(r, deferred))
            .map(|r| (r.key(), r.clone()))
            .collect();
        for (key, rec) in &want {
            if self.placeholders.contains_key(key)
                || self.placeholder_busy.contains(key)
                || !retry_ready(&self.placeholder_backoff, key, now)
            {
                continue;
            }
            self.placeholder_busy.insert(key.clone());
            tokio::spawn(self.send_done(executor::register_placeholder(
                self.client.clone(),
                self.node.clone(),
                rec.clone(),
                self.target_of(key),
                None,
            )));
        }
        let stale: Vec<(VolumeKey, String)> = self
            .placeholders
            .iter()
            .filter(|(k, _)| !want.contains_key(*k))
            .map(|(k, id)| (k.clone(), id.clone()))
            .collect();
        for (key, id) in stale {
            if self.placeholder_busy.contains(&key)
                || !retry_ready(&self.placeholder_backoff, &key, now)
            {
                continue;
            }
            self.placeholder_busy.insert(key.clone());
            tokio::spawn(self.send_done(executor::deregister_placeholder(
                self.client.clone(),
                key,
                id,
            )));
        }
    }

    fn drive_workers(&mut self, deferred: &BTreeSet<String>, now: Instant) {
        if !self.plugins_loaded {
            return;
        }
        let jobs: Vec<VolumeRecord> = self
            .volumes
            .values()
            .filter(|r| self.serves(r, deferred))
            .filter(|r| match r.state {
                VolumeState::Pending => true,
                VolumeState::Creating => r.worker_node == self.node.node_id,
                VolumeState::Deleting => {
                    r.worker_node.is_empty() || r.worker_node == self.node.node_id
                }
                _ => false,
            })
            .filter(|r| {
                !self.worker_busy.contains(&r.key())
                    && retry_ready(&self.worker_backoff, &r.key(), now)
            })
            .cloned()
            .collect();
        for rec in jobs {
            // A volume still published here is not deleted from under its mount.
            if rec.state == VolumeState::Deleting
                && (self.journal.mounts().contains_key(&rec.key())
                    || self.placeholders.contains_key(&rec.key()))
            {
                continue;
            }
            self.worker_busy.insert(rec.key());
            let fut = if rec.state == VolumeState::Deleting {
                tokio::spawn(self.send_done(executor::delete(
                    self.client.clone(),
                    self.runner.clone(),
                    self.node.clone(),
                    rec,
                )))
            } else {
                tokio::spawn(self.send_done(executor::create(
                    self.client.clone(),
                    self.runner.clone(),
                    self.node.clone(),
                    rec,
                )))
            };
            drop(fut);
        }
    }

    fn answer_waiters(&mut self, now: Instant) {
        let waiters = std::mem::take(&mut self.waiters);
        for w in waiters {
            match self.waiter_outcome(&w, now) {
                Some(r) => {
                    let _ = w.reply.send(r);
                }
                None => self.waiters.push(w),
            }
        }
    }

    /// `Some` when the waiter can be answered now.
    fn waiter_outcome(&self, w: &Waiter, now: Instant) -> Option<Result<PublishReply, ApiError>> {
        if w.reply.is_closed() {
            return Some(Err(ApiError::Timeout("caller went away".into())));
        }
        let Some(alloc) = self.view.allocs().get(&w.alloc_id) else {
            if now >= w.deadline {
                return Some(Err(ApiError::Timeout(format!(
                    "allocation {} is not known on this node yet",
                    w.alloc_id
                ))));
            }
            return None;
        };
        if alloc.namespace != w.namespace {
            return Some(Err(ApiError::Forbidden(format!(
                "the token is for namespace {}, the allocation runs in {}",
                w.namespace, alloc.namespace
            ))));
        }
        if alloc.is_client_terminal() || alloc.desired_status != "run" {
            return Some(Err(ApiError::Conflict(format!(
                "allocation {} is {} (desired {}): nothing is published for it",
                w.alloc_id, alloc.client_status, alloc.desired_status
            ))));
        }
        alloc.job.as_ref()?;
        let reqs = requests(alloc, &self.volumes);
        let mut done = Vec::new();
        for r in &reqs {
            let user = UserKey {
                alloc_id: w.alloc_id.clone(),
                volume: r.volume.clone(),
            };
            if self.journal.users().contains(&user) {
                let m = &self.journal.mounts()[&r.volume];
                done.push(PublishedVolume {
                    namespace: r.volume.namespace.clone(),
                    name: r.volume.name.clone(),
                    path: m.target.display().to_string(),
                    read_only: m.read_only,
                });
            } else if let Some(e) = self
                .last_error
                .get(&r.volume)
                .filter(|_| !self.busy.contains(&r.volume))
            {
                return Some(Err(ApiError::Unavailable(format!(
                    "publishing volume {} failed: {e}",
                    r.volume
                ))));
            } else if let Some(wt) = self.waiting.iter().find(|x| x.volume == r.volume) {
                if now >= w.deadline {
                    return Some(Err(ApiError::Unavailable(wt.reason.clone())));
                }
            }
        }
        if done.len() == reqs.len() {
            return Some(Ok(PublishReply {
                alloc_id: w.alloc_id.clone(),
                volumes: done,
            }));
        }
        if now >= w.deadline {
            return Some(Err(ApiError::Timeout(format!(
                "volumes of allocation {} were not published in time",
                w.alloc_id
            ))));
        }
        None
    }

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
                    "placeholder_id": self.placeholders.get(&r.key()),
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
        let mut lat = self.publish_latency_ms.clone();
        lat.sort_unstable();
        serde_json::json!({
            "node_id": self.node.node_id,
            "node_pool": self.node.node_pool,
            "watch": self.health,
            "view": {"complete": self.view.is_complete(), "index": self.view.index(), "allocations": self.view.allocs().len(), "departing": self.view.departing()},
            "volumes": volumes,
            "mounts": self.journal.mounts().values().collect::<Vec<_>>(),
            "users": self.journal.users(),
            "waiting": self.waiting.iter().map(|w| serde_json::json!({"volume": w.volume.to_string(), "reason": w.reason})).collect::<Vec<_>>(),
            "errors": self.last_error.iter().map(|(k, e)| (k.to_string(), e.clone())).collect::<BTreeMap<_, _>>(),
            "plugins": plugins,
            "publish_latency_ms": {"count": lat.len(), "median": lat.get(lat.len() / 2)},
            "pending_publish_calls": self.waiters.len(),
            "claims": self.claims.iter().map(|(k, c)| (k.to_string(), format!("{:?}", c.state).to_lowercase())).collect::<BTreeMap<_, _>>(),
            "mount_health": self.mount_health.status(),
        })
    }
}
