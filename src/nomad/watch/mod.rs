//! The watcher: one state machine that keeps the node's allocations known.
//!
//! Two sources of truth, chosen by [`WatchMode`], feed the same [`WatchEvent`]s:
//! - `stream`: list (`GET /v1/node/:id/allocations`, record the index) → stream
//!   (`GET /v1/event/stream?topic=Allocation&topic=Job&namespace=*&index=<list index + 1>`),
//!   reading only `NodeID` of other nodes' allocation events, and of Job events only the
//!   deletions (a purge deletes the job's allocations with no allocation event);
//! - `poll`: list → blocking query `GET /v1/node/:id/allocations?index=<last>&wait=…`, each
//!   answer a full list of the node's allocations (with their Jobs).
//!
//! Any error, EOF, silence longer than the idle timeout, an index that goes backwards, or
//! the periodic resync sends the machine back to a full list, after a backoff (exponential,
//! jittered, reset after a healthy period; at least 1 s after an auth failure, with the
//! token file re-read). Events are hints: the stream can skip events silently (resume at
//! the closest index, buffer of 100, snapshot restore), so every (re)connect starts with a
//! full list (nomad-facts.md §1), and the view is swapped whole ([`WatchEvent::Relisted`]).

mod reads;
mod stream;

use crate::nomad::events::{decode_line, JobRef, Line, LineBuffer, Piece};
use crate::nomad::retry::backoff_delay;
use crate::nomad::types::{Allocation, ListedAlloc};
use crate::nomad::{Client, NomadError};
use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use reads::Fetches;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// What the watcher tells the agent.
#[derive(Debug, Clone)]
pub enum WatchEvent {
    /// A full list of the node's allocations at `index`: replaces the view.
    Relisted { allocs: Vec<Allocation>, index: u64 },
    /// One allocation changed (with its Job when it was fetched, without otherwise).
    Upsert(Box<Allocation>),
    /// An allocation is gone from Nomad (404: garbage-collected or purged).
    Removed(String),
    /// The watcher's health changed.
    Health(Health),
}

pub use crate::config::WatchMode;

/// Why the watcher is not connected, for status output and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// 401/403, an expired token, or a subscription refused (EOF before the first `{}`).
    AuthFailed,
    /// No connection to the Nomad agent (agent down, connection refused, reset).
    Unreachable,
    /// 500 "No cluster leader": an election is in progress.
    NoLeader,
    /// Another 5xx or unexpected status.
    ServerError,
    /// An answer that was not the JSON Nomad sends.
    BadAnswer,
    /// The server ended the event stream (restart, restore, ACL change, slow reader).
    ClosedByServer,
    /// Nothing at all (not even a heartbeat) for longer than the idle timeout; or, in
    /// stream mode, a read of allocations ([`NomadError::TimedOut`]) unanswered that long.
    Stalled,
    /// The index went backwards: snapshot restore or a new cluster.
    IndexReset,
    /// The list was empty and Nomad does not know this node (`GET /v1/node/:id` is 404):
    /// the node was purged or the configured node ID is wrong. Nothing is unpublished.
    NodeUnknown,
}

impl Fault {
    fn of(e: &NomadError) -> Self {
        match e {
            NomadError::PermissionDenied { .. } | NomadError::Unauthorized { .. } => {
                Fault::AuthFailed
            }
            NomadError::Unreachable { .. } => Fault::Unreachable,
            NomadError::TimedOut { .. } => Fault::Stalled,
            NomadError::NoLeader { .. } => Fault::NoLeader,
            NomadError::Decode { .. } => Fault::BadAnswer,
            _ => Fault::ServerError,
        }
    }
}

/// What a read of the node's allocation list is, in errors.
const LIST_WHAT: &str = "list the node's allocations (GET /v1/node/:id/allocations)";

/// A poll answer with an allocation that does not decode: refused whole, as a list that
/// does not decode.
fn bad_list(source: serde_json::Error) -> NomadError {
    NomadError::Decode {
        what: LIST_WHAT.to_string(),
        source,
    }
}

/// `read` (a request that is not a blocking query), given up after `after`: then
/// [`NomadError::TimedOut`] (fault `stalled`) saying `what()`, its connection taken as dead. The relist and
/// stream mode's allocation reads are bounded by the idle timeout this way.
async fn within<T>(
    after: Duration,
    what: impl FnOnce() -> String,
    read: impl std::future::Future<Output = Result<T, NomadError>>,
) -> Result<T, NomadError> {
    tokio::time::timeout(after, read).await.unwrap_or_else(|_| {
        Err(NomadError::TimedOut {
            what: what(),
            after,
        })
    })
}

/// The watcher's connection health and counters, for status output.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum Health {
    /// Reading the full list (start, reconnect, resync).
    Listing,
    /// Event stream up (first heartbeat seen).
    Streaming { index: u64, counters: Counters },
    /// Blocking queries answered.
    Polling { index: u64, counters: Counters },
    /// Not connected; `reason` says what failed and what to do. The view keeps the last
    /// full list; nothing is planned from absence until the next one.
    Disconnected {
        fault: Fault,
        reason: String,
        counters: Counters,
    },
}

/// Watcher settings.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    pub node_id: String,
    pub mode: WatchMode,
    /// Stream: silence (no line, no heartbeat) this long means dead. Poll: a blocking query
    /// unanswered this long past its `wait` (plus Nomad's jitter of wait/16) means dead.
    pub idle_timeout: Duration,
    /// Stream: full relist this often. Poll: the blocking query's `wait`.
    pub resync_interval: Duration,
    /// Lines longer than this are skipped and counted.
    pub max_line: usize,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// A connection up this long resets the backoff.
    pub healthy_after: Duration,
    /// Re-read on every reconnect and after every auth failure (`--token-file`).
    pub token_file: Option<PathBuf>,
    /// While some allocation may be deleted by Nomad's GC with its tasks possibly alive
    /// ([`Allocation::may_vanish_while_live`]), it is verified this often: a deletion raises
    /// no index (poll) and emits no event (stream). Poll mode shortens its blocking query's
    /// `wait` to this; stream mode reads each such allocation (`GET /v1/allocation/:id`).
    pub verify_interval: Duration,
    /// Which allocations have a process on this node, from the kernel, in both modes. A
    /// purge deletes a job's running allocations with no rise of the list's index (and the
    /// GC a live one) and no allocation event; its Job event says so only from Nomad 1.11.3
    /// (`Deleted`). So an allocation whose processes were seen and are gone is read by its
    /// ID (`GET /v1/allocation/:id`, 404 → [`WatchEvent::Removed`]) at the next probe,
    /// every `verify_interval`. `None`: no probe (the next full answer, at the latest
    /// after `resync_interval`, shows the deletion).
    pub processes: Option<ProcessProbe>,
}

/// Which allocations have a process on this node (a process in the allocation's task
/// cgroup: the agent's probe reads each process's cgroup, never its environment), read by
/// the caller from the kernel; `None` when it could not be read (nothing is concluded then).
/// Called on a blocking thread.
#[derive(Clone)]
pub struct ProcessProbe(pub std::sync::Arc<dyn Fn() -> Option<BTreeSet<String>> + Send + Sync>);

impl std::fmt::Debug for ProcessProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProcessProbe")
    }
}

impl WatchConfig {
    /// Defaults for a node: 75 s idle timeout (30 s heartbeats), 5 min resync, poll mode.
    pub fn new(node_id: &str) -> Self {
        Self {
            node_id: node_id.to_string(),
            mode: WatchMode::default(),
            idle_timeout: Duration::from_secs(75),
            resync_interval: Duration::from_secs(300),
            max_line: 16 << 20,
            backoff_base: Duration::from_millis(500),
            backoff_cap: Duration::from_secs(30),
            healthy_after: Duration::from_secs(60),
            token_file: None,
            verify_interval: Duration::from_secs(5),
            processes: None,
        }
    }

    /// The blocking query's `wait`: the resync interval, or the verify interval while some
    /// allocation needs verifying. Nomad caps `wait` at 300 s (`MaxBlockingRPCQueryTime`,
    /// nomad/structs/structs.go); whole seconds on the wire.
    fn poll_wait(&self, verifying: bool) -> Duration {
        let wait = if verifying {
            self.resync_interval.min(self.verify_interval)
        } else {
            self.resync_interval
        };
        wait.clamp(Duration::from_secs(1), Duration::from_secs(300))
    }
}

/// The watcher's states. [`Watcher::step`] takes one by value and returns the next.
#[derive(Debug)]
enum State {
    List {
        attempt: u32,
    },
    Stream {
        index: u64,
        attempt: u32,
    },
    Poll {
        index: u64,
        attempt: u32,
        since: Instant,
    },
    Backoff {
        attempt: u32,
        fault: Fault,
        reason: String,
    },
    Stopped,
}

/// Shortest time between two blocking queries when Nomad answers at once without a newer
/// index (a missing or stale `X-Nomad-Index`): a blocking query never becomes a busy loop.
pub const MIN_QUERY_INTERVAL: Duration = Duration::from_millis(500);

/// The delay before relisting after `fault`: auth failures wait at least 1 s (B30).
fn fault_delay(cfg: &WatchConfig, fault: Fault, attempt: u32) -> Duration {
    let d = backoff_delay(cfg.backoff_base, cfg.backoff_cap, attempt);
    if fault == Fault::AuthFailed {
        d.max(Duration::from_secs(1))
    } else {
        d
    }
}

/// Counters for status output.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    /// Full lists read (start, reconnects, resyncs, every poll answer).
    pub relists: u64,
    pub reconnects: u64,
    pub frames: u64,
    /// Allocation events of other nodes dropped after reading their NodeID only.
    pub skipped_other_nodes: u64,
    /// Frames at or below the list's index (covered by the list) or repeated.
    pub stale_frames: u64,
    /// Lines that were not JSON, or longer than the limit: skipped, then a relist.
    pub bad_lines: u64,
    /// Times the index went backwards.
    pub index_resets: u64,
    pub auth_failures: u64,
    /// The last full list of the node's allocations (`GET /v1/node/:id/allocations`: the
    /// first list, each relist, and in poll mode every answer): how many allocations it
    /// held, terminal ones included, and its size in bytes. Poll mode pays this per answer.
    pub list_allocations: u64,
    pub list_bytes: u64,
}

/// An allocation's job.
fn job_of(a: &Allocation) -> JobRef {
    JobRef {
        namespace: a.namespace.clone(),
        id: a.job_id.clone(),
    }
}

/// Reads the token file into `client` (and all its clones). The token is never logged; an
/// unreadable file keeps the current token.
pub fn read_token_file(client: &Client, path: &std::path::Path) {
    match std::fs::read_to_string(path) {
        Ok(t) => {
            let t = t.trim();
            let t = (!t.is_empty()).then(|| t.to_string());
            if client.set_token(t) {
                tracing::info!(path = %path.display(), "using a new Nomad token from the token file");
            }
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the token file; keeping the current token")
        }
    }
}

/// Runs the watcher until `tx` is closed.
pub async fn run(client: Client, cfg: WatchConfig, tx: mpsc::Sender<WatchEvent>) {
    let mut w = Watcher {
        client,
        cfg,
        tx,
        known: HashMap::new(),
        jobs: HashMap::new(),
        polled: None,
        last_whole: Instant::now(),
        verifying: BTreeSet::new(),
        counters: Counters::default(),
        last_index: 0,
        last_list: Instant::now(),
        bad_streak: 0,
        disconnected: false,
        live: BTreeSet::new(),
        running_here: BTreeSet::new(),
        probe_at: Instant::now(),
        failures: crate::nomad::retry::FailureLog::new(
            crate::nomad::retry::Call::AllocationWatch,
            crate::nomad::retry::LOG_EVERY,
        ),
    };
    let mut state = State::List { attempt: 0 };
    loop {
        state = w.step(state).await;
        if matches!(state, State::Stopped) {
            return;
        }
    }
}

struct Watcher {
    client: Client,
    cfg: WatchConfig,
    tx: mpsc::Sender<WatchEvent>,
    /// AllocModifyIndex of each allocation whose Job we have sent. The allocation IDs of
    /// these maps and sets are shared ([`Watcher::id`]): one copy per allocation, not one
    /// per map (docs/scale.md, memory per allocation).
    known: HashMap<Arc<str>, u64>,
    /// The job of each allocation in the view: a deleted job's allocations are read again
    /// (stream mode).
    jobs: HashMap<Arc<str>, JobRef>,
    /// Poll mode: the ModifyIndex of each allocation of the last answer, once a full list
    /// was sent; the next answers are sent as their changes ([`Watcher::poll_changes`]).
    /// `None` after a fault: the next answer is sent whole.
    polled: Option<HashMap<Arc<str>, u64>>,
    /// When the last whole list was sent to the agent.
    last_whole: Instant,
    /// Allocations that Nomad may delete while their tasks may still run
    /// ([`Allocation::may_vanish_while_live`]): verified every `verify_interval`.
    verifying: BTreeSet<Arc<str>>,
    counters: Counters,
    /// The highest index seen, to notice an index going backwards across lists.
    last_index: u64,
    last_list: Instant,
    /// Relists caused by skipped lines in a row: spaces them out exponentially.
    bad_streak: u32,
    /// Health says disconnected until a list succeeds again.
    disconnected: bool,
    /// The allocations whose tasks may run here ([`Allocation::tasks_finished`] false), for
    /// the process probe ([`WatchConfig::processes`]).
    live: BTreeSet<Arc<str>>,
    /// Those of `live` that had a process at the last probe.
    running_here: BTreeSet<Arc<str>>,
    /// When the process probe runs next.
    probe_at: Instant,
    /// The disconnections' log lines (one a minute at most, with a count) and their metric.
    failures: crate::nomad::retry::FailureLog,
}

enum StreamEnd {
    Resync,
    Fault(Fault, String),
    Closed,
}

impl Watcher {
    /// Allocation `id` as the maps and sets keep it: the copy one of them holds already,
    /// or a new one.
    fn id(&self, id: &str) -> Arc<str> {
        self.held_id(id).unwrap_or_else(|| Arc::from(id))
    }

    /// The copy of allocation ID `id` one of the maps holds, if any.
    fn held_id(&self, id: &str) -> Option<Arc<str>> {
        self.known
            .get_key_value(id)
            .map(|(k, _)| k)
            .or_else(|| self.jobs.get_key_value(id).map(|(k, _)| k))
            .or_else(|| self.polled.as_ref()?.get_key_value(id).map(|(k, _)| k))
            .map(Arc::clone)
    }

    /// Gives `a` the copy of its ID the maps hold, if any, and returns it: the maps, the
    /// allocation sent to the agent and what the agent keeps of it share one ID.
    fn share_id(&self, a: &mut Allocation) -> Arc<str> {
        if let Some(held) = self.held_id(&a.id) {
            a.id = held;
        }
        Arc::clone(&a.id)
    }

    async fn emit(&self, ev: WatchEvent) -> bool {
        self.tx.send(ev).await.is_ok()
    }

    /// Forgets an allocation Nomad no longer has.
    fn forget(&mut self, id: &str) {
        self.known.remove(id);
        self.jobs.remove(id);
        self.verifying.remove(id);
        self.live.remove(id);
        self.running_here.remove(id);
    }

    /// The process probe ([`WatchConfig::processes`]), in both modes: the allocations of
    /// `live` whose processes were seen at an earlier probe and are gone now. Each is then
    /// read by its ID (one read per disappearance: a task between two runs costs one read,
    /// not one per probe). Empty when there is no probe or the kernel could not be read.
    async fn probe_gone(&mut self) -> Vec<String> {
        let Some(probe) = self.cfg.processes.clone() else {
            return Vec::new();
        };
        if self.live.is_empty() {
            return Vec::new();
        }
        let Ok(Some(alive)) = tokio::task::spawn_blocking(move || (probe.0)()).await else {
            return Vec::new();
        };
        let mut gone = Vec::new();
        for id in &self.live {
            if alive.contains(&**id) {
                self.running_here.insert(Arc::clone(id));
            } else if self.running_here.remove(id) {
                gone.push(id.to_string());
            }
        }
        gone
    }

    /// Poll mode's process probe: an allocation whose processes are gone
    /// ([`Watcher::probe_gone`]) is read by its ID; a 404 (purged or garbage-collected: no
    /// index rose) is sent as [`WatchEvent::Removed`] and taken out of the poll's last
    /// answer; a read that fails is tried again at the next probe. False when the agent is
    /// gone.
    async fn probe(&mut self) -> bool {
        for id in self.probe_gone().await {
            let what = || format!("read allocation {id} (GET /v1/allocation/:id)");
            match within(self.cfg.idle_timeout, what, self.client.allocation(&id)).await {
                Ok(None) => {
                    tracing::info!(alloc_id = %id, "the allocation's processes are gone and Nomad no longer has it (purged or garbage-collected)");
                    self.forget(&id);
                    if let Some(polled) = self.polled.as_mut() {
                        polled.remove(id.as_str());
                    }
                    if !self.emit(WatchEvent::Removed(id)).await {
                        return false;
                    }
                }
                Ok(Some(_)) => {}
                Err(e) => {
                    tracing::warn!(alloc_id = %id, error = %e, "the allocation's processes are gone and reading it failed; reading it again at the next probe");
                    let id = self.id(&id);
                    self.running_here.insert(id);
                }
            }
        }
        true
    }

    fn refresh_token(&self) {
        if let Some(path) = &self.cfg.token_file {
            read_token_file(&self.client, path);
        }
    }

    /// A fresh full list: checks the index, emits it, resets what the stream path knows.
    async fn relisted(&mut self, allocs: Vec<Allocation>, index: u64) -> bool {
        self.counters.relists += 1;
        if self.last_list.elapsed() >= self.cfg.healthy_after {
            self.bad_streak = 0;
        }
        self.last_list = Instant::now();
        if index < self.last_index {
            // Normal when the node's newest allocation was garbage-collected (the list's
            // index is the highest ModifyIndex of the node's allocations, `Node.GetAllocs`)
            // or, in stream mode, after other nodes' frames; also after a restore.
            tracing::debug!(
                index,
                previous = self.last_index,
                "the list's index is below the last index seen; the list replaces the view"
            );
        }
        self.last_index = index;
        self.last_whole = Instant::now();
        let ids: Vec<Arc<str>> = allocs.iter().map(|a| Arc::clone(&a.id)).collect();
        let with_ids = || allocs.iter().zip(ids.iter());
        self.known = with_ids()
            .map(|(a, id)| (Arc::clone(id), a.alloc_modify_index))
            .collect();
        self.jobs = with_ids()
            .map(|(a, id)| (Arc::clone(id), job_of(a)))
            .collect();
        self.live = with_ids()
            .filter(|(a, _)| !a.tasks_finished())
            .map(|(_, id)| Arc::clone(id))
            .collect();
        self.polled = Some(
            with_ids()
                .map(|(a, id)| (Arc::clone(id), a.modify_index))
                .collect(),
        );
        self.verifying = with_ids()
            .filter(|(a, _)| a.may_vanish_while_live())
            .map(|(_, id)| Arc::clone(id))
            .collect();
        drop(ids);
        self.emit(WatchEvent::Relisted { allocs, index }).await
    }

    /// A poll answer. The first after a full list or a fault is decoded and sent whole;
    /// after that only what changed is decoded and sent, as the event stream sends it (an
    /// allocation new or with a new ModifyIndex as an upsert, one missing as removed), so
    /// the watcher decodes and the agent plans only the allocations that changed instead
    /// of every allocation of the node per answer (issue 10). An index or a ModifyIndex
    /// that went backwards (a restore: the view takes an older state only from a whole
    /// list) is sent whole, and so is one answer per resync interval (the view's
    /// allocations that no answer lists age out, the agent plans every volume). Returns
    /// false when the receiver is gone; an allocation that does not decode is an error
    /// (the whole answer is refused, as a list that does not decode).
    async fn poll_changes(
        &mut self,
        listed: Vec<ListedAlloc>,
        index: u64,
    ) -> Result<bool, NomadError> {
        let whole = match &self.polled {
            None => true,
            Some(before) => {
                index < self.last_index
                    || listed.iter().any(|a| {
                        before
                            .get(a.id.as_str())
                            .is_some_and(|m| a.modify_index < *m)
                    })
                    || self.last_whole.elapsed() >= self.cfg.resync_interval
            }
        };
        if whole {
            self.polled = None;
            let allocs = listed
                .iter()
                .map(ListedAlloc::decode)
                .collect::<Result<Vec<_>, _>>()
                .map_err(bad_list)?;
            // The answer's buffer goes before the agent is waited on.
            drop(listed);
            return Ok(self.relisted(allocs, index).await);
        }
        let before = self.polled.take().unwrap_or_default();
        self.counters.relists += 1;
        self.last_list = Instant::now();
        self.last_index = index;
        let mut now: HashMap<Arc<str>, u64> = HashMap::with_capacity(listed.len());
        let mut events = Vec::new();
        for l in listed {
            if let Some((id, _)) = before
                .get_key_value(l.id.as_str())
                .filter(|(_, m)| **m == l.modify_index)
            {
                // Unchanged: what was learnt of it (its Job, whether it needs verifying)
                // stands, as every change of those raises its ModifyIndex.
                now.insert(Arc::clone(id), l.modify_index);
                continue;
            }
            let mut a = l.decode().map_err(bad_list)?;
            let id = match before.get_key_value(&*a.id) {
                Some((k, _)) => {
                    a.id = Arc::clone(k);
                    Arc::clone(k)
                }
                None => self.share_id(&mut a),
            };
            now.insert(Arc::clone(&id), a.modify_index);
            self.known.insert(Arc::clone(&id), a.alloc_modify_index);
            self.jobs.insert(Arc::clone(&id), job_of(&a));
            if a.tasks_finished() {
                self.live.remove(&*id);
            } else {
                self.live.insert(Arc::clone(&id));
            }
            if a.may_vanish_while_live() {
                self.verifying.insert(id);
            } else {
                self.verifying.remove(&*id);
            }
            events.push(WatchEvent::Upsert(Box::new(a)));
        }
        for id in before.keys().filter(|id| !now.contains_key(*id)) {
            self.forget(id);
            events.push(WatchEvent::Removed(id.to_string()));
        }
        self.polled = Some(now);
        for ev in events {
            if !self.emit(ev).await {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn backoff(&mut self, attempt: u32, fault: Fault, reason: String) -> State {
        self.polled = None;
        if fault == Fault::AuthFailed {
            self.counters.auth_failures += 1;
        }
        State::Backoff {
            attempt,
            fault,
            reason,
        }
    }

    /// Before an empty list is acted on: does Nomad know this node? An unknown node's
    /// allocations list is `200 []` too (`nomad/node_endpoint.go` `GetAllocs`), and acting
    /// on it would unpublish every volume here. A failed read counts as unknown (fail
    /// closed); its reason is logged.
    async fn node_known(&mut self, attempt: u32) -> bool {
        match self.client.node_exists(&self.cfg.node_id).await {
            Ok(known) => known,
            Err(e) => {
                tracing::warn!(error = %e, attempt, "the node's allocations list is empty and reading the node failed; not acting on the empty list");
                false
            }
        }
    }

    fn node_unknown(&mut self, attempt: u32) -> State {
        self.backoff(
            attempt,
            Fault::NodeUnknown,
            format!(
                "the allocations list of node {} is empty and Nomad does not answer for that node (GET /v1/node/:id): check the node ID (`--node-id`) and that the node is not purged; nothing is unpublished meanwhile",
                self.cfg.node_id
            ),
        )
    }

    fn healthy_reset(&self, attempt: u32, since: Instant) -> u32 {
        if since.elapsed() >= self.cfg.healthy_after {
            0
        } else {
            attempt
        }
    }

    async fn step(&mut self, state: State) -> State {
        match state {
            State::Stopped => State::Stopped,
            State::Backoff {
                attempt,
                fault,
                reason,
            } => {
                let delay = fault_delay(&self.cfg, fault, attempt);
                if let Some(failures) = self.failures.failed(Instant::now().into_std()) {
                    tracing::warn!(?fault, %reason, attempt, failures, ?delay, mode = ?self.cfg.mode, "allocation watch disconnected; relisting after backoff (logged at most once a minute)");
                }
                let health = Health::Disconnected {
                    fault,
                    reason,
                    counters: self.counters.clone(),
                };
                self.disconnected = true;
                if !self.emit(WatchEvent::Health(health)).await {
                    return State::Stopped;
                }
                tokio::time::sleep(delay).await;
                self.counters.reconnects += 1;
                State::List {
                    attempt: attempt.saturating_add(1),
                }
            }
            State::List { attempt } => {
                self.refresh_token();
                if !self.disconnected && !self.emit(WatchEvent::Health(Health::Listing)).await {
                    return State::Stopped;
                }
                let list = self
                    .client
                    .node_allocations(&self.cfg.node_id, 0, Duration::ZERO);
                match within(self.cfg.idle_timeout, || LIST_WHAT.into(), list).await {
                    Err(e) => self.backoff(attempt, Fault::of(&e), e.to_string()),
                    Ok((list, _)) if list.value.is_empty() && !self.node_known(attempt).await => {
                        self.node_unknown(attempt)
                    }
                    Ok((list, bytes)) => {
                        self.counters.list_allocations = list.value.len() as u64;
                        self.counters.list_bytes = bytes as u64;
                        self.disconnected = false;
                        let index = list.index;
                        if !self.relisted(list.value, index).await {
                            return State::Stopped;
                        }
                        match self.cfg.mode {
                            WatchMode::Stream => State::Stream { index, attempt },
                            WatchMode::Poll => {
                                let h = Health::Polling {
                                    index,
                                    counters: self.counters.clone(),
                                };
                                if !self.emit(WatchEvent::Health(h)).await {
                                    return State::Stopped;
                                }
                                State::Poll {
                                    index,
                                    attempt,
                                    since: Instant::now(),
                                }
                            }
                        }
                    }
                }
            }
            State::Poll {
                index,
                attempt,
                since,
            } => {
                // A GC deletion never raises this query's index (`Node.GetAllocs`): while
                // an allocation may vanish with its tasks alive, each answer after a short
                // wait is the verifying read.
                let wait = self.cfg.poll_wait(!self.verifying.is_empty());
                let deadline = wait + wait / 16 + self.cfg.idle_timeout;
                let (client, node) = (self.client.clone(), self.cfg.node_id.clone());
                let query = async move {
                    client
                        .node_allocations_listed(&node, index.max(1), wait)
                        .await
                };
                let asked = tokio::time::Instant::now();
                tokio::pin!(query);
                let answer = loop {
                    tokio::select! {
                        a = tokio::time::timeout_at(asked + deadline, &mut query) => break a,
                        _ = tokio::time::sleep_until(self.probe_at), if self.cfg.processes.is_some() => {
                            self.probe_at = Instant::now() + self.cfg.verify_interval;
                            if !self.probe().await {
                                return State::Stopped;
                            }
                        }
                    }
                };
                match answer {
                    Err(_) => {
                        let attempt = self.healthy_reset(attempt, since);
                        self.backoff(
                            attempt,
                            Fault::Stalled,
                            format!("blocking query unanswered after {deadline:?} (wait {wait:?}): treating the connection as dead"),
                        )
                    }
                    Ok(Err(e)) => {
                        let attempt = self.healthy_reset(attempt, since);
                        self.backoff(attempt, Fault::of(&e), e.to_string())
                    }
                    Ok(Ok((list, _)))
                        if list.value.is_empty() && !self.node_known(attempt).await =>
                    {
                        self.node_unknown(self.healthy_reset(attempt, since))
                    }
                    Ok(Ok((list, bytes))) => {
                        self.counters.list_allocations = list.value.len() as u64;
                        self.counters.list_bytes = bytes as u64;
                        let new = list.index;
                        match self.poll_changes(list.value, new).await {
                            Ok(true) => {}
                            Ok(false) => return State::Stopped,
                            Err(e) => {
                                let attempt = self.healthy_reset(attempt, since);
                                return self.backoff(attempt, Fault::of(&e), e.to_string());
                            }
                        }
                        if new <= index {
                            // Answered without a newer index: not a real wake-up.
                            tokio::time::sleep_until(asked + MIN_QUERY_INTERVAL).await;
                        }
                        let h = Health::Polling {
                            index: new,
                            counters: self.counters.clone(),
                        };
                        if !self.emit(WatchEvent::Health(h)).await {
                            return State::Stopped;
                        }
                        State::Poll {
                            index: new,
                            attempt: self.healthy_reset(attempt, since),
                            since,
                        }
                    }
                }
            }
            State::Stream { index, attempt } => {
                let started = Instant::now();
                match self.stream(index).await {
                    StreamEnd::Resync => State::List { attempt: 0 },
                    StreamEnd::Closed => State::Stopped,
                    StreamEnd::Fault(fault, reason) => {
                        let attempt = self.healthy_reset(attempt, started);
                        self.backoff(attempt, fault, reason)
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
