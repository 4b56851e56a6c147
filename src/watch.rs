//! The watcher: one state machine that keeps the node's allocations known.
//!
//! Two sources of truth, chosen by [`WatchMode`], feed the same [`WatchEvent`]s:
//! - `stream`: list (`GET /v1/node/:id/allocations`, record the index) → stream
//!   (`GET /v1/event/stream?topic=Allocation&namespace=*&index=<list index + 1>`), reading
//!   only `NodeID` of other nodes' events;
//! - `poll`: list → blocking query `GET /v1/node/:id/allocations?index=<last>&wait=…`, each
//!   answer a full list of the node's allocations (with their Jobs).
//!
//! Any error, EOF, silence longer than the idle timeout, an index that goes backwards, or
//! the periodic resync sends the machine back to a full list, after a backoff (exponential,
//! jittered, reset after a healthy period; at least 1 s after an auth failure, with the
//! token file re-read). Events are hints: the stream can skip events silently (resume at
//! the closest index, buffer of 100, snapshot restore), so every (re)connect starts with a
//! full list (nomad-facts.md §1), and the view is swapped whole ([`WatchEvent::Relisted`]).

use crate::nomad::events::{decode_line, Line, LineBuffer, Piece};
use crate::nomad::types::{Allocation, ListedAlloc};
use crate::nomad::{Client, NomadError};
use crate::retry::backoff_delay;
use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
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
        polled: None,
        last_whole: Instant::now(),
        verifying: BTreeSet::new(),
        counters: Counters::default(),
        last_index: 0,
        last_list: Instant::now(),
        bad_streak: 0,
        disconnected: false,
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
    /// AllocModifyIndex of each allocation whose Job we have sent.
    known: HashMap<String, u64>,
    /// Poll mode: the ModifyIndex of each allocation of the last answer, once a full list
    /// was sent; the next answers are sent as their changes ([`Watcher::poll_changes`]).
    /// `None` after a fault: the next answer is sent whole.
    polled: Option<HashMap<String, u64>>,
    /// When the last whole list was sent to the agent.
    last_whole: Instant,
    /// Allocations that Nomad may delete while their tasks may still run
    /// ([`Allocation::may_vanish_while_live`]): verified every `verify_interval`.
    verifying: BTreeSet<String>,
    counters: Counters,
    /// The highest index seen, to notice an index going backwards across lists.
    last_index: u64,
    last_list: Instant,
    /// Relists caused by skipped lines in a row: spaces them out exponentially.
    bad_streak: u32,
    /// Health says disconnected until a list succeeds again.
    disconnected: bool,
}

enum StreamEnd {
    Resync,
    Fault(Fault, String),
    Closed,
}

impl Watcher {
    async fn emit(&self, ev: WatchEvent) -> bool {
        self.tx.send(ev).await.is_ok()
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
        self.known = allocs
            .iter()
            .map(|a| (a.id.clone(), a.alloc_modify_index))
            .collect();
        self.polled = Some(
            allocs
                .iter()
                .map(|a| (a.id.clone(), a.modify_index))
                .collect(),
        );
        self.verifying = allocs
            .iter()
            .filter(|a| a.may_vanish_while_live())
            .map(|a| a.id.clone())
            .collect();
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
                    || listed
                        .iter()
                        .any(|a| before.get(&a.id).is_some_and(|m| a.modify_index < *m))
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
        let mut now: HashMap<String, u64> = HashMap::with_capacity(listed.len());
        let mut events = Vec::new();
        for l in listed {
            if before.get(&l.id) == Some(&l.modify_index) {
                // Unchanged: what was learnt of it (its Job, whether it needs verifying)
                // stands, as every change of those raises its ModifyIndex.
                now.insert(l.id, l.modify_index);
                continue;
            }
            let a = l.decode().map_err(bad_list)?;
            now.insert(a.id.clone(), a.modify_index);
            self.known.insert(a.id.clone(), a.alloc_modify_index);
            if a.may_vanish_while_live() {
                self.verifying.insert(a.id.clone());
            } else {
                self.verifying.remove(&a.id);
            }
            events.push(WatchEvent::Upsert(Box::new(a)));
        }
        for id in before.keys().filter(|id| !now.contains_key(*id)) {
            self.known.remove(id);
            self.verifying.remove(id);
            events.push(WatchEvent::Removed(id.clone()));
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
                tracing::warn!(?fault, %reason, attempt, ?delay, mode = ?self.cfg.mode, "allocation watch disconnected; relisting after backoff");
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
                let query =
                    self.client
                        .node_allocations_listed(&self.cfg.node_id, index.max(1), wait);
                let asked = tokio::time::Instant::now();
                match tokio::time::timeout(deadline, query).await {
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

    async fn stream(&mut self, list_index: u64) -> StreamEnd {
        let resp = match self.client.event_stream(list_index + 1).await {
            Ok(r) => r,
            Err(e) => return StreamEnd::Fault(Fault::of(&e), e.to_string()),
        };
        let mut body = resp.bytes_stream();
        let mut lines = LineBuffer::new(self.cfg.max_line);
        let mut last_frame: Option<u64> = None;
        let mut got_heartbeat = false;
        let mut resync_at = self.last_list + self.cfg.resync_interval;
        let mut health_at = Instant::now();
        let mut bad_seen = false;
        let mut fetches = Fetches::new(
            self.client.clone(),
            &self.cfg.node_id,
            self.cfg.idle_timeout,
        );
        let mut verify_at = Instant::now() + self.cfg.verify_interval;
        loop {
            let verify = !self.verifying.is_empty();
            let next = tokio::select! {
                n = tokio::time::timeout(self.cfg.idle_timeout, body.next()) => n,
                _ = tokio::time::sleep_until(resync_at) => return StreamEnd::Resync,
                Some(answer) = fetches.running.next(), if !fetches.running.is_empty() => {
                    let reads = match fetches.answered(answer) {
                        Ok(reads) => reads,
                        Err(e) => return StreamEnd::Fault(Fault::of(&e), e.to_string()),
                    };
                    for (id, read) in reads {
                        if let Err(end) = self.fetched(&mut fetches, id, read).await {
                            return end;
                        }
                    }
                    fetches.flush(self.known.len());
                    continue;
                }
                _ = tokio::time::sleep_until(verify_at), if verify => {
                    verify_at = Instant::now() + self.cfg.verify_interval;
                    self.verify(&mut fetches);
                    fetches.flush(self.known.len());
                    continue;
                }
            };
            let chunk = match next {
                Err(_) => {
                    return StreamEnd::Fault(
                        Fault::Stalled,
                        format!(
                            "event stream disconnected: silent for {:?} (no heartbeat); treating it as dead",
                            self.cfg.idle_timeout
                        ),
                    )
                }
                Ok(None) if !got_heartbeat => {
                    return StreamEnd::Fault(
                        Fault::AuthFailed,
                        "event stream ended before its first heartbeat: the subscription was refused (the token is expired, or lacks read-job in every namespace)".into(),
                    )
                }
                Ok(None) => {
                    return StreamEnd::Fault(
                        Fault::ClosedByServer,
                        "event stream disconnected: closed by the server".into(),
                    )
                }
                Ok(Some(Err(e))) => {
                    return StreamEnd::Fault(
                        Fault::Unreachable,
                        format!("event stream disconnected: {e}"),
                    )
                }
                Ok(Some(Ok(c))) => c,
            };
            lines.push(&chunk);
            while let Some(piece) = lines.next_piece() {
                let bad = match piece {
                    Piece::Oversized(n) => {
                        tracing::warn!(
                            bytes = n,
                            limit = self.cfg.max_line,
                            "skipped an oversized event stream line"
                        );
                        true
                    }
                    Piece::Line(line) => {
                        match self
                            .line(
                                &line,
                                list_index,
                                &mut last_frame,
                                &mut got_heartbeat,
                                &mut fetches,
                            )
                            .await
                        {
                            Ok(bad) => bad,
                            Err(end) => return end,
                        }
                    }
                };
                if bad {
                    // The line may have carried one of our events: relist soon, spacing
                    // such relists out exponentially (no relist loop on a bad feed).
                    self.counters.bad_lines += 1;
                    if !bad_seen {
                        bad_seen = true;
                        let gap = backoff_delay(
                            self.cfg.backoff_base,
                            self.cfg.backoff_cap,
                            self.bad_streak,
                        );
                        self.bad_streak = self.bad_streak.saturating_add(1);
                        resync_at = resync_at.min((self.last_list + gap).max(Instant::now()));
                    }
                    health_at = Instant::now() - Duration::from_secs(10);
                }
            }
            // The chunk's reads start together: a burst's many reads become one list.
            fetches.flush(self.known.len());
            if got_heartbeat && health_at.elapsed() >= Duration::from_secs(5) {
                health_at = Instant::now();
                let h = Health::Streaming {
                    index: last_frame.unwrap_or(list_index),
                    counters: self.counters.clone(),
                };
                if !self.emit(WatchEvent::Health(h)).await {
                    return StreamEnd::Closed;
                }
            }
        }
    }

    /// Handles one line. `Ok(true)`: the line was unusable and skipped.
    async fn line(
        &mut self,
        line: &[u8],
        list_index: u64,
        last_frame: &mut Option<u64>,
        got_heartbeat: &mut bool,
        fetches: &mut Fetches,
    ) -> Result<bool, StreamEnd> {
        let first = !*got_heartbeat;
        let result = match decode_line(line, &self.cfg.node_id, self.cfg.max_line) {
            Err(e) => {
                tracing::warn!(error = %e, bytes = line.len(), "skipped an event stream line");
                return Ok(true);
            }
            Ok(Line::Heartbeat) => {
                *got_heartbeat = true;
                Ok(false)
            }
            Ok(Line::Frame {
                index,
                allocations,
                skipped,
            }) => {
                *got_heartbeat = true;
                self.counters.frames += 1;
                self.counters.skipped_other_nodes += skipped as u64;
                if last_frame.is_some_and(|l| index < l) {
                    self.counters.index_resets += 1;
                    return Err(StreamEnd::Fault(
                        Fault::IndexReset,
                        format!(
                            "event index went backwards ({index} after {}): Nomad's state was reset or restored; relisting",
                            last_frame.unwrap_or_default()
                        ),
                    ));
                }
                if index <= list_index || last_frame.is_some_and(|l| index == l) {
                    // Covered by the list (Nomad resends the closest index it has, and
                    // `index` is inclusive), or a repeated frame.
                    self.counters.stale_frames += 1;
                    return Ok(false);
                }
                *last_frame = Some(index);
                self.last_index = self.last_index.max(index);
                for ev in allocations {
                    if !self.allocation(ev.allocation, fetches).await {
                        return Err(StreamEnd::Closed);
                    }
                }
                Ok(false)
            }
        };
        if first && *got_heartbeat {
            let h = Health::Streaming {
                index: last_frame.unwrap_or(list_index),
                counters: self.counters.clone(),
            };
            if !self.emit(WatchEvent::Health(h)).await {
                return Err(StreamEnd::Closed);
            }
        }
        result
    }

    /// Stream mode: reads every allocation that may have been deleted with its tasks alive
    /// (a purge or GC emits no event), off the reader through `fetches` like every other
    /// read of the stream path; one whose read is already pending is covered by it. A 404
    /// becomes [`WatchEvent::Removed`] in [`Watcher::fetched`].
    fn verify(&self, fetches: &mut Fetches) {
        for id in &self.verifying {
            if !fetches.waiting.contains_key(id) {
                fetches.verifies.insert(id.clone());
                fetches.start(id.clone());
            }
        }
    }

    /// True when an event of this node's allocation needs the full allocation (with its
    /// Job): it is new to us or changed server-side, and its tasks may still run
    /// ([`Allocation::tasks_finished`]: a `failed` one with a poststop task running does).
    fn needs_job(&self, a: &Allocation) -> bool {
        !a.tasks_finished()
            && self
                .known
                .get(&a.id)
                .is_none_or(|&seen| a.alloc_modify_index > seen)
    }

    /// Handles an event of this node's allocation without waiting for Nomad: one that needs
    /// its Job is read off the reader ([`Fetches`]); one of an allocation whose read is
    /// pending waits behind it, to keep the allocation's updates in order; any other is
    /// sent at once. False when the agent is gone.
    async fn allocation(&mut self, a: Allocation, fetches: &mut Fetches) -> bool {
        if a.may_vanish_while_live() {
            self.verifying.insert(a.id.clone());
        } else {
            self.verifying.remove(&a.id);
        }
        if let Some(held) = fetches.waiting.get_mut(&a.id) {
            held.push(a);
            return true;
        }
        if self.needs_job(&a) {
            fetches.start(a.id);
            return true;
        }
        self.emit(WatchEvent::Upsert(Box::new(a))).await
    }

    /// A read of the stream path finished: sends it, then the events that arrived for the
    /// allocation meanwhile and are newer than the read (reading again if one of them
    /// needs the Job again). A failed read ends the stream (the relist covers it).
    async fn fetched(
        &mut self,
        fetches: &mut Fetches,
        id: String,
        read: Result<Option<Allocation>, NomadError>,
    ) -> Result<(), StreamEnd> {
        let verify_only = fetches.verifies.remove(&id);
        let held = fetches.finish(&id);
        let full = match read {
            Err(e) => return Err(StreamEnd::Fault(Fault::of(&e), e.to_string())),
            Ok(None) => {
                // Gone (garbage-collected or purged): its older updates no longer matter.
                self.known.remove(&id);
                self.verifying.remove(&id);
                return if self.emit(WatchEvent::Removed(id)).await {
                    Ok(())
                } else {
                    Err(StreamEnd::Closed)
                };
            }
            Ok(Some(full)) => full,
        };
        if full.may_vanish_while_live() {
            self.verifying.insert(full.id.clone());
        } else {
            self.verifying.remove(&full.id);
        }
        if verify_only && held.is_empty() {
            // Still there, and no event arrived meanwhile: the stream brings its changes.
            return Ok(());
        }
        let read_at = full.modify_index;
        self.known.insert(full.id.clone(), full.alloc_modify_index);
        if !self.emit(WatchEvent::Upsert(Box::new(full))).await {
            return Err(StreamEnd::Closed);
        }
        let mut rest = held.into_iter().filter(|a| a.modify_index > read_at);
        while let Some(a) = rest.next() {
            if self.needs_job(&a) {
                // Read again; the events after this one wait behind the new read.
                fetches.start(id.clone());
                if let Some(w) = fetches.waiting.get_mut(&id) {
                    w.extend(rest);
                }
                return Ok(());
            }
            if !self.emit(WatchEvent::Upsert(Box::new(a))).await {
                return Err(StreamEnd::Closed);
            }
        }
        Ok(())
    }
}

/// How many single allocation reads of the stream path run at once.
const FETCH_PARALLEL: usize = 8;

/// Reads waiting to start that are read together through the node's allocation list
/// instead, when they are also at least a quarter of the node's allocations
/// ([`Fetches::flush`]).
const LIST_MIN: usize = 8;

/// One read of the stream path, answered.
type Read = (String, Result<Option<Allocation>, NomadError>);

/// What one of the stream path's requests answered.
enum Answer {
    /// `GET /v1/allocation/:id`.
    One(Box<Read>),
    /// `GET /v1/node/:id/allocations`, read for the allocations `ids`.
    List(Vec<String>, Result<Vec<ListedAlloc>, NomadError>),
}

/// The stream path's allocation reads (for the Job: an event's payload has none), kept off
/// the stream reader so that a slow read never stalls it: at most one read per allocation
/// (later events of that allocation wait for it, coalesced), at most [`FETCH_PARALLEL`]
/// single reads in flight, the rest queued in arrival order. A burst (at least
/// [`LIST_MIN`] queued reads, and at least a quarter of the node's allocations) is read
/// with one request for the node's allocation list, as poll mode reads it, instead of one
/// request each. Dropped (and its reads cancelled) when the stream ends: the relist that
/// follows covers them.
struct Fetches {
    client: Client,
    node_id: String,
    /// How long one read (single or list) may take before it counts as a dead connection
    /// ([`NomadError::TimedOut`]; the stream then ends and the relist covers the read): the
    /// watcher's idle timeout, as the relist's own.
    timeout: Duration,
    running: FuturesUnordered<BoxFuture<'static, Answer>>,
    /// Whether one of `running` is a list read (at most one is).
    listing: bool,
    queued: VecDeque<String>,
    /// Reads that a list answered without their allocation: each is read alone, never
    /// by another list (which would lack it again).
    alone: VecDeque<String>,
    /// Allocations with a read queued or in flight, and the events of each that arrived
    /// since, oldest first.
    waiting: HashMap<String, Vec<Allocation>>,
    /// Reads started only to verify that the allocation still exists: their answer is
    /// sent on only when it is a deletion or events arrived behind it.
    verifies: HashSet<String>,
}

impl Fetches {
    fn new(client: Client, node_id: &str, timeout: Duration) -> Self {
        Self {
            client,
            node_id: node_id.to_string(),
            timeout,
            running: FuturesUnordered::new(),
            listing: false,
            queued: VecDeque::new(),
            alone: VecDeque::new(),
            waiting: HashMap::new(),
            verifies: HashSet::new(),
        }
    }

    /// Queues a read of allocation `id`; [`Fetches::flush`] starts it.
    fn start(&mut self, id: String) {
        self.waiting.entry(id.clone()).or_default();
        self.queued.push_back(id);
    }

    /// Starts queued reads: all of them as one list read when they are a burst (at least
    /// [`LIST_MIN`], and at least a quarter of the `node_allocs` allocations the node has,
    /// since a list answer carries every one of them), and no list read runs already;
    /// otherwise single reads, as many as free slots allow. Every read covered by a list
    /// was queued before the list is asked for, so the list is at least as new as the
    /// event that asked for the read.
    fn flush(&mut self, node_allocs: usize) {
        let queued = self.queued.len();
        if !self.listing && queued >= LIST_MIN && queued * 4 >= node_allocs + queued {
            let ids: Vec<String> = self.queued.drain(..).collect();
            let (client, node) = (self.client.clone(), self.node_id.clone());
            let after = self.timeout;
            self.listing = true;
            self.running.push(Box::pin(async move {
                let list = client.node_allocations_listed(&node, 0, Duration::ZERO);
                let read = within(after, || LIST_WHAT.into(), list)
                    .await
                    .map(|(l, _)| l.value);
                Answer::List(ids, read)
            }));
        }
        while self.running.len() - usize::from(self.listing) < FETCH_PARALLEL {
            let Some(id) = self.alone.pop_front().or_else(|| self.queued.pop_front()) else {
                break;
            };
            let client = self.client.clone();
            let after = self.timeout;
            self.running.push(Box::pin(async move {
                let what = || format!("read allocation {id} (GET /v1/allocation/:id)");
                let read = within(after, what, client.allocation(&id)).await;
                Answer::One(Box::new((id, read)))
            }));
        }
    }

    /// The reads an answer settles. A list answers each allocation it was read for that it
    /// holds (decoded whole then); one it does not hold is read alone, queued again (the
    /// allocation may have been deleted since its event, or be in a namespace the token
    /// lists without: only its own read tells). Errors: the request failed, or an
    /// allocation of the list that was read for is not an allocation (the stream ends
    /// and the relist covers every read, as for a failed single read).
    fn answered(&mut self, answer: Answer) -> Result<Vec<Read>, NomadError> {
        match answer {
            Answer::One(read) => Ok(vec![*read]),
            Answer::List(ids, read) => {
                self.listing = false;
                let listed = read?;
                let by_id: HashMap<&str, &ListedAlloc> =
                    listed.iter().map(|l| (l.id.as_str(), l)).collect();
                let mut reads = Vec::with_capacity(ids.len());
                for id in ids {
                    match by_id.get(id.as_str()) {
                        Some(l) => {
                            let full = l.decode().map_err(|source| NomadError::Decode {
                                what: "list the node's allocations (GET /v1/node/:id/allocations)"
                                    .to_string(),
                                source,
                            })?;
                            reads.push((id, Ok(Some(full))));
                        }
                        None => self.alone.push_back(id),
                    }
                }
                Ok(reads)
            }
        }
    }

    /// The read of `id` was answered: returns the events held behind it.
    fn finish(&mut self, id: &str) -> Vec<Allocation> {
        let held = self.waiting.remove(id).unwrap_or_default();
        // Give back memory after a burst.
        if self.waiting.is_empty() {
            self.waiting.shrink_to(FETCH_PARALLEL);
            self.queued.shrink_to(FETCH_PARALLEL);
            self.alone.shrink_to(FETCH_PARALLEL);
        }
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 11 #10 and #2: Nomad caps a blocking query's wait at 300 s
    /// (`MaxBlockingRPCQueryTime`); while an allocation may vanish with its tasks alive, the
    /// wait shrinks to the verify interval, so each answer is a verifying read.
    #[test]
    fn poll_wait_is_capped_and_shrinks_while_verifying() {
        let mut cfg = WatchConfig::new("n");
        cfg.resync_interval = Duration::from_secs(600);
        assert_eq!(cfg.poll_wait(false), Duration::from_secs(300));
        assert_eq!(cfg.poll_wait(true), Duration::from_secs(5));
        cfg.resync_interval = Duration::from_secs(2);
        assert_eq!(cfg.poll_wait(true), Duration::from_secs(2));
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let b = Duration::from_millis(100);
        let cap = Duration::from_secs(2);
        assert!(backoff_delay(b, cap, 0) <= Duration::from_millis(120));
        assert!(backoff_delay(b, cap, 3) >= Duration::from_millis(640));
        assert!(backoff_delay(b, cap, 30) <= Duration::from_millis(2400));
    }

    #[test]
    fn auth_failures_wait_at_least_a_second_and_are_capped() {
        let mut cfg = WatchConfig::new("n");
        cfg.backoff_base = Duration::from_millis(10);
        cfg.backoff_cap = Duration::from_secs(5);
        for attempt in 0..40 {
            let d = fault_delay(&cfg, Fault::AuthFailed, attempt);
            assert!(d >= Duration::from_secs(1), "{d:?}");
            assert!(d <= Duration::from_secs(6), "{d:?}");
        }
        assert!(fault_delay(&cfg, Fault::Unreachable, 0) < Duration::from_millis(20));
    }

    #[test]
    fn health_serializes_with_its_state_and_fault() {
        let h = Health::Disconnected {
            fault: Fault::AuthFailed,
            reason: "x".into(),
            counters: Counters::default(),
        };
        let v = serde_json::to_value(&h).unwrap();
        assert_eq!(v["state"], "disconnected");
        assert_eq!(v["fault"], "auth-failed");
    }

    /// A loopback Nomad for the stream path: a node list at index 10 (`list`, empty until
    /// the test sets it; counted in `lists`), an event stream fed by the test, and
    /// allocation reads that wait until the test opens `gate` (counted in `reads`). Node
    /// `node-gone` is unknown (404); any other exists.
    mod slow_nomad {
        use bytes::Bytes;
        use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
        use hyper::body::Frame;
        use std::convert::Infallible;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Mutex};
        use tokio::sync::{mpsc, watch};

        pub struct Server {
            pub addr: String,
            pub reads: Arc<AtomicUsize>,
            pub lists: Arc<AtomicUsize>,
            pub list: Arc<Mutex<String>>,
            pub gate: watch::Sender<bool>,
            pub lines: mpsc::UnboundedSender<String>,
        }

        pub fn alloc(id: &str, node: &str, status: &str, index: u64, with_job: bool) -> String {
            let job = if with_job {
                r#","Job":{"ID":"j","Namespace":"default","TaskGroups":[]}"#
            } else {
                ""
            };
            format!(
                r#"{{"ID":"{id}","Namespace":"default","NodeID":"{node}","JobID":"j","TaskGroup":"g","DesiredStatus":"run","ClientStatus":"{status}","ModifyIndex":{index},"AllocModifyIndex":{index}{job}}}"#
            )
        }

        pub fn frame(index: u64, allocs: &[String]) -> String {
            let events: Vec<String> = allocs
                .iter()
                .map(|a| {
                    format!(
                        r#"{{"Topic":"Allocation","Type":"AllocationUpdated","Key":"k","Namespace":"default","Index":{index},"Payload":{{"Allocation":{a}}}}}"#
                    )
                })
                .collect();
            format!("{{\"Index\":{index},\"Events\":[{}]}}\n", events.join(","))
        }

        type Body = BoxBody<Bytes, Infallible>;

        /// Starts the server; `full` answers every allocation read (once the gate opens).
        pub async fn start(full: String) -> Server {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = format!("http://{}", listener.local_addr().unwrap());
            let reads = Arc::new(AtomicUsize::new(0));
            let lists = Arc::new(AtomicUsize::new(0));
            let list = Arc::new(Mutex::new("[]".to_string()));
            let (gate, gate_rx) = watch::channel(false);
            let (lines, lines_rx) = mpsc::unbounded_channel::<String>();
            let lines_rx = Arc::new(Mutex::new(Some(lines_rx)));
            let (r, ls, l) = (reads.clone(), lists.clone(), list.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((sock, _)) = listener.accept().await else {
                        return;
                    };
                    let (r, ls, l, gate_rx, lines_rx, full) = (
                        r.clone(),
                        ls.clone(),
                        l.clone(),
                        gate_rx.clone(),
                        lines_rx.clone(),
                        full.clone(),
                    );
                    tokio::spawn(async move {
                        let svc = hyper::service::service_fn(move |req| {
                            let (r, ls, l, mut gate_rx, lines_rx, full) = (
                                r.clone(),
                                ls.clone(),
                                l.clone(),
                                gate_rx.clone(),
                                lines_rx.clone(),
                                full.clone(),
                            );
                            async move {
                                let path = req.uri().path().to_string();
                                let body: Body = if path == "/v1/node/node-gone" {
                                    return Ok::<_, Infallible>(
                                        hyper::Response::builder()
                                            .status(404)
                                            .body(Full::new(Bytes::from("node not found")).boxed())
                                            .unwrap(),
                                    );
                                } else if path.starts_with("/v1/node/")
                                    && !path.ends_with("/allocations")
                                {
                                    Full::new(Bytes::from("{}")).boxed()
                                } else if path.starts_with("/v1/node/") {
                                    ls.fetch_add(1, Ordering::SeqCst);
                                    let answer = l.lock().unwrap().clone();
                                    Full::new(Bytes::from(answer)).boxed()
                                } else if path == "/v1/event/stream" {
                                    let rx = lines_rx.lock().unwrap().take().expect("one stream");
                                    let first = futures_util::stream::once(async {
                                        Ok::<_, Infallible>(Frame::data(Bytes::from("{}\n")))
                                    });
                                    let rest =
                                        futures_util::stream::unfold(rx, |mut rx| async move {
                                            let l = rx.recv().await?;
                                            Some((Ok(Frame::data(Bytes::from(l))), rx))
                                        });
                                    use futures_util::StreamExt;
                                    BodyExt::boxed(StreamBody::new(first.chain(rest)))
                                } else {
                                    r.fetch_add(1, Ordering::SeqCst);
                                    let _ = gate_rx.wait_for(|open| *open).await;
                                    Full::new(Bytes::from(full)).boxed()
                                };
                                Ok::<_, Infallible>(
                                    hyper::Response::builder()
                                        .header("X-Nomad-Index", "10")
                                        .header("Content-Type", "application/json")
                                        .body(body)
                                        .unwrap(),
                                )
                            }
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                            .await;
                    });
                }
            });
            Server {
                addr,
                reads,
                lists,
                list,
                gate,
                lines,
            }
        }
    }

    /// A stream-mode watcher of node `node` against the loopback Nomad at `addr`: its
    /// events, and its task (abort it at the end).
    fn stream_watcher(
        addr: &str,
        node: &str,
    ) -> (mpsc::Receiver<WatchEvent>, tokio::task::JoinHandle<()>) {
        let mut cfg = WatchConfig::new(node);
        cfg.mode = WatchMode::Stream;
        let (tx, rx) = mpsc::channel(64);
        let task = tokio::spawn(run(crate::nomad::loopback_client(addr), cfg, tx));
        (rx, task)
    }

    /// Waits for the next allocation event (health events skipped).
    async fn next_alloc_event(rx: &mut mpsc::Receiver<WatchEvent>) -> WatchEvent {
        loop {
            match tokio::time::timeout(Duration::from_secs(20), rx.recv())
                .await
                .expect("no allocation event from the watcher")
                .expect("the watcher stopped")
            {
                WatchEvent::Health(_) | WatchEvent::Relisted { .. } => {}
                ev => return ev,
            }
        }
    }

    /// Stream mode: while the read of a new allocation of this node hangs, the reader goes
    /// on (another allocation's update, later on the stream, arrives first), updates of the
    /// allocation being read wait behind its read, and the read is not repeated for them
    /// (one read in total). Without the fix the reader waits for the read: deadlock.
    #[tokio::test]
    async fn stream_reader_keeps_consuming_while_a_read_is_slow() {
        use slow_nomad::{alloc, frame};
        use std::sync::atomic::Ordering;
        const ME: &str = "node-me";
        // Nomad answers the read with the allocation as it is then (index 13).
        let server = slow_nomad::start(alloc("a", ME, "running", 13, true)).await;
        let (mut rx, task) = stream_watcher(&server.addr, ME);
        // "a" is new (read needed); then two more updates of "a" (client side, same
        // AllocModifyIndex), an other node's event, and "b" finishing (no read needed).
        let a11 = alloc("a", ME, "pending", 11, false);
        server.lines.send(frame(11, &[a11])).unwrap();
        let a12 = alloc("a", ME, "running", 12, false)
            .replace(r#""AllocModifyIndex":12"#, r#""AllocModifyIndex":11"#);
        let a13 = alloc("a", ME, "running", 13, false)
            .replace(r#""AllocModifyIndex":13"#, r#""AllocModifyIndex":11"#);
        server.lines.send(frame(12, &[a12])).unwrap();
        server.lines.send(frame(13, &[a13])).unwrap();
        let other = alloc("x", "node-other", "running", 14, false);
        let b = alloc("b", ME, "complete", 15, false);
        server.lines.send(frame(15, &[other, b])).unwrap();
        match next_alloc_event(&mut rx).await {
            WatchEvent::Upsert(a) => assert_eq!(a.id, "b", "{a:?}"),
            ev => panic!("expected b's update first, got {ev:?}"),
        }
        server.gate.send(true).unwrap();
        match next_alloc_event(&mut rx).await {
            WatchEvent::Upsert(a) => {
                assert_eq!((a.id.as_str(), a.modify_index), ("a", 13));
                assert!(a.job.is_some(), "the read carries the Job");
            }
            ev => panic!("expected a's read, got {ev:?}"),
        }
        // The held updates (11..13) are not newer than the read: nothing more for "a".
        let c = alloc("c", ME, "complete", 16, false);
        server.lines.send(frame(16, &[c])).unwrap();
        match next_alloc_event(&mut rx).await {
            WatchEvent::Upsert(a) => assert_eq!(a.id, "c", "{a:?}"),
            ev => panic!("expected c's update, got {ev:?}"),
        }
        assert_eq!(
            server.reads.load(Ordering::SeqCst),
            1,
            "coalesced: one read"
        );
        task.abort();
    }

    /// Stream mode: the read that verifies an allocation which may vanish with its tasks
    /// alive runs off the reader: while it hangs, a later update of another allocation
    /// still arrives. Without the fix the verifying read ran inline and the reader stalled.
    #[tokio::test]
    async fn stream_verifying_read_runs_off_the_reader() {
        use slow_nomad::{alloc, frame};
        use std::sync::atomic::Ordering;
        const ME: &str = "node-me";
        // Lost on the server with its task last seen running: verified by reads.
        let lost = |index| {
            alloc("v", ME, "lost", index, true).replace(
                r#""DesiredStatus":"run""#,
                r#""DesiredStatus":"stop","TaskStates":{"app":{"State":"running"}}"#,
            )
        };
        let server = slow_nomad::start(lost(11)).await;
        let mut cfg = WatchConfig::new(ME);
        cfg.mode = WatchMode::Stream;
        cfg.verify_interval = Duration::from_millis(20);
        let (tx, mut rx) = mpsc::channel(64);
        let task = tokio::spawn(run(crate::nomad::loopback_client(&server.addr), cfg, tx));
        server.lines.send(frame(11, &[lost(11)])).unwrap();
        // "v" is new: its Job is read (the gate holds every read).
        while server.reads.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        server.gate.send(true).unwrap();
        match next_alloc_event(&mut rx).await {
            WatchEvent::Upsert(a) => assert_eq!(a.id, "v", "{a:?}"),
            ev => panic!("expected v's read, got {ev:?}"),
        }
        // Close the gate again and wait for the verifying read to hang on it.
        server.gate.send(false).unwrap();
        let before = server.reads.load(Ordering::SeqCst);
        while server.reads.load(Ordering::SeqCst) == before {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let b = alloc("b", ME, "complete", 15, false);
        server.lines.send(frame(15, &[b])).unwrap();
        match next_alloc_event(&mut rx).await {
            WatchEvent::Upsert(a) => assert_eq!(a.id, "b", "{a:?}"),
            ev => panic!("expected b's update while the verifying read hangs, got {ev:?}"),
        }
        // The verifying read, once answered with "v" unchanged, sends nothing.
        server.gate.send(true).unwrap();
        let c = alloc("c", ME, "complete", 16, false);
        while server.reads.load(Ordering::SeqCst) < before + 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        server.lines.send(frame(16, &[c])).unwrap();
        match next_alloc_event(&mut rx).await {
            WatchEvent::Upsert(a) => assert_eq!(a.id, "c", "{a:?}"),
            ev => panic!("expected c's update (no resend of v), got {ev:?}"),
        }
        task.abort();
    }

    /// Issue 10: stream mode reads a burst of new allocations (one frame) with one request
    /// for the node's allocation list, not one read each; an allocation the list does not
    /// hold is read alone. Without the change: twelve single reads.
    #[tokio::test]
    async fn stream_burst_is_read_with_one_list() {
        use slow_nomad::{alloc, frame};
        use std::sync::atomic::Ordering;
        const ME: &str = "node-me";
        // The single read answers a9 (the one the list lacks: created after it, say).
        let server = slow_nomad::start(alloc("a9", ME, "running", 30, true)).await;
        server.gate.send(true).unwrap();
        let (mut rx, task) = stream_watcher(&server.addr, ME);
        // The first list (empty) is done before the stream opens.
        loop {
            match tokio::time::timeout(Duration::from_secs(20), rx.recv()).await {
                Ok(Some(WatchEvent::Relisted { .. })) => break,
                Ok(Some(_)) => {}
                other => panic!("expected the first list, got {other:?}"),
            }
        }
        let ids: Vec<String> = (0..12).map(|i| format!("a{i}")).collect();
        let listed: Vec<String> = ids
            .iter()
            .filter(|id| *id != "a9")
            .map(|id| alloc(id, ME, "running", 30, true))
            .collect();
        *server.list.lock().unwrap() = format!("[{}]", listed.join(","));
        let events: Vec<String> = ids
            .iter()
            .map(|id| alloc(id, ME, "pending", 20, false))
            .collect();
        server.lines.send(frame(20, &events)).unwrap();
        let mut got = BTreeSet::new();
        while got.len() < ids.len() {
            match next_alloc_event(&mut rx).await {
                WatchEvent::Upsert(a) => {
                    assert!(a.job.is_some(), "read with its Job: {a:?}");
                    assert_eq!(a.modify_index, 30, "{a:?}");
                    got.insert(a.id.clone());
                }
                ev => panic!("expected the burst's reads, got {ev:?}"),
            }
        }
        assert_eq!(got, ids.iter().cloned().collect::<BTreeSet<_>>());
        assert_eq!(
            server.lists.load(Ordering::SeqCst),
            2,
            "the first list, the burst's"
        );
        assert_eq!(server.reads.load(Ordering::SeqCst), 1, "a9 alone");
        task.abort();
    }

    /// Issue 10 (review): allocations a burst's list lacks (deleted since their events) are
    /// read alone, never by another list. Without the fix the same list was asked for
    /// again and again and the ten were never read.
    #[tokio::test]
    async fn reads_a_list_lacks_are_read_alone_not_listed_again() {
        use slow_nomad::{alloc, frame};
        use std::sync::atomic::Ordering;
        const ME: &str = "node-me";
        let server = slow_nomad::start(alloc("gone", ME, "running", 30, true)).await;
        server.gate.send(true).unwrap();
        let (mut rx, task) = stream_watcher(&server.addr, ME);
        let events: Vec<String> = (0..10)
            .map(|i| alloc(&format!("a{i}"), ME, "pending", 20, false))
            .collect();
        server.lines.send(frame(20, &events)).unwrap();
        for _ in 0..10 {
            match next_alloc_event(&mut rx).await {
                WatchEvent::Upsert(_) => {}
                ev => panic!("expected the single reads' answers, got {ev:?}"),
            }
        }
        assert_eq!(server.reads.load(Ordering::SeqCst), 10, "each read alone");
        assert_eq!(
            server.lists.load(Ordering::SeqCst),
            2,
            "the first list, the burst's"
        );
        task.abort();
    }

    /// Issue 11 #10: `GET /v1/node/<unknown>/allocations` answers `200 []`. Before acting
    /// on an empty list the watcher reads the node; a 404 is a fault, never an empty view
    /// (which would unpublish every volume of the node). Without the fix the empty list was
    /// sent as the node's allocations.
    #[tokio::test]
    async fn empty_list_of_an_unknown_node_is_a_fault_not_an_empty_view() {
        let server = slow_nomad::start(String::new()).await;
        for mode in [WatchMode::Poll, WatchMode::Stream] {
            let mut cfg = WatchConfig::new("node-gone");
            cfg.mode = mode;
            let (tx, mut rx) = mpsc::channel(64);
            let task = tokio::spawn(run(crate::nomad::loopback_client(&server.addr), cfg, tx));
            loop {
                match tokio::time::timeout(Duration::from_secs(20), rx.recv())
                    .await
                    .expect("no event from the watcher")
                    .expect("the watcher stopped")
                {
                    WatchEvent::Health(Health::Listing) => {}
                    WatchEvent::Health(Health::Disconnected { fault, .. }) => {
                        assert_eq!(fault, Fault::NodeUnknown, "{mode:?}");
                        break;
                    }
                    ev => panic!("{mode:?}: expected a NodeUnknown fault, got {ev:?}"),
                }
            }
            task.abort();
        }
    }

    /// The watcher's next event other than a health report.
    async fn next_change(rx: &mut mpsc::Receiver<WatchEvent>) -> WatchEvent {
        loop {
            match tokio::time::timeout(Duration::from_secs(20), rx.recv())
                .await
                .expect("no event from the watcher")
                .expect("the watcher stopped")
            {
                WatchEvent::Health(_) => {}
                ev => return ev,
            }
        }
    }

    /// Poll mode's health tells the size of the last list answer (what each answer costs:
    /// `dhv_binder_watch_list_bytes`, the status line): its allocations and bytes.
    #[tokio::test]
    async fn poll_health_tells_the_last_lists_size() {
        use nomad_sim::replay::Replay;
        let node = "0b0b0b0b-0000-4000-8000-000000000002";
        let fake = Replay::start(node, serde_json::json!({"keys": []})).await;
        let alloc = |id: &str, index: u64| -> serde_json::Value {
            serde_json::from_str(&slow_nomad::alloc(id, node, "running", index, true)).unwrap()
        };
        fake.put_alloc(alloc("a1", 10));
        fake.put_alloc(alloc("a2", 11));
        let mut cfg = WatchConfig::new(node);
        cfg.mode = WatchMode::Poll;
        let (tx, mut rx) = mpsc::channel(64);
        let task = tokio::spawn(run(crate::nomad::loopback_client(&fake.addr), cfg, tx));
        /// The list's bytes once a poll health tells a list of `want` allocations.
        async fn polled(rx: &mut mpsc::Receiver<WatchEvent>, want: u64) -> u64 {
            loop {
                let ev = tokio::time::timeout(Duration::from_secs(20), rx.recv())
                    .await
                    .expect("no health from the watcher")
                    .expect("the watcher stopped");
                if let WatchEvent::Health(Health::Polling { counters, .. }) = ev {
                    if counters.list_allocations == want {
                        return counters.list_bytes;
                    }
                }
            }
        }
        let two = polled(&mut rx, 2).await;
        fake.put_alloc(alloc("a3", 20));
        let three = polled(&mut rx, 3).await;
        assert!(two > 100 && three > two, "{two} then {three} bytes");
        task.abort();
    }

    /// Issue 10: in poll mode each answer of the blocking query is the node's whole list;
    /// after the first list the watcher sends only what changed (as the stream does), so
    /// the agent plans only the touched volumes instead of every volume per answer. Against
    /// the simulator's node list (`Node.GetAllocs` semantics).
    #[tokio::test]
    async fn poll_answers_after_the_first_list_are_sent_as_changes() {
        use nomad_sim::replay::Replay;
        let node = "0b0b0b0b-0000-4000-8000-000000000001";
        let fake = Replay::start(node, serde_json::json!({"keys": []})).await;
        let alloc = |id: &str, status: &str, index: u64| -> serde_json::Value {
            serde_json::from_str(&slow_nomad::alloc(id, node, status, index, true)).unwrap()
        };
        fake.put_alloc(alloc("a1", "running", 10));
        fake.put_alloc(alloc("a2", "running", 11));
        let mut cfg = WatchConfig::new(node);
        cfg.mode = WatchMode::Poll;
        let (tx, mut rx) = mpsc::channel(64);
        let task = tokio::spawn(run(crate::nomad::loopback_client(&fake.addr), cfg, tx));
        match next_change(&mut rx).await {
            WatchEvent::Relisted { allocs, .. } => assert_eq!(allocs.len(), 2),
            ev => panic!("expected the first list whole, got {ev:?}"),
        }
        fake.put_alloc(alloc("a1", "complete", 20));
        match next_change(&mut rx).await {
            WatchEvent::Upsert(a) => assert_eq!(
                (a.id.as_str(), a.client_status.as_str()),
                ("a1", "complete")
            ),
            ev => panic!("expected only the changed allocation, got {ev:?}"),
        }
        fake.put_alloc(alloc("a3", "pending", 21));
        match next_change(&mut rx).await {
            WatchEvent::Upsert(a) => assert_eq!(a.id, "a3"),
            ev => panic!("expected the new allocation alone, got {ev:?}"),
        }
        // A garbage collection does not wake the query; the next change's answer shows it.
        fake.delete_alloc("a2");
        fake.put_alloc(alloc("a3", "running", 30));
        let mut got = [next_change(&mut rx).await, next_change(&mut rx).await];
        got.sort_by_key(|e| matches!(e, WatchEvent::Removed(_)));
        match &got[..] {
            [WatchEvent::Upsert(a), WatchEvent::Removed(id)] => {
                assert_eq!((a.id.as_str(), id.as_str()), ("a3", "a2"));
            }
            ev => panic!("expected a3 changed and a2 removed, got {ev:?}"),
        }
        // A restored, older state of one allocation under a newer answer index: the view
        // takes an older state only from a whole list, so the answer is sent whole.
        fake.put_alloc(alloc("a3", "pending", 5));
        fake.put_alloc(alloc("a1", "complete", 40));
        match next_change(&mut rx).await {
            WatchEvent::Relisted { allocs, index } => {
                assert_eq!((allocs.len(), index), (2, 40));
            }
            ev => panic!("expected the whole list after a ModifyIndex went back, got {ev:?}"),
        }
        task.abort();
    }
}
