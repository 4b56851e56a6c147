//! A scripted front on the simulator's server, for replay tests: the test, not clients and
//! the scheduler, decides what the allocations are and which frames the event stream carries.
//!
//! Everything a caller sees is the simulator's own: the store (`store::Server`), its index
//! rules (one index per write; the node allocation list's index is the highest ModifyIndex on
//! the node), the event broker and its subscription filter, the HTTP API (`api::router`) and
//! its wire encoding (`structs`). What the script adds:
//! - allocations written as given ([`Replay::put_alloc`], [`Replay::reset`],
//!   [`Replay::delete_alloc`]), with no event (the script publishes the frames itself);
//! - frames published as given ([`Replay::push`]: recorded or synthesised NDJSON, decoded to
//!   the simulator's `Frame`, applied to the store and delivered by its broker);
//! - faults Nomad itself never produces: raw bytes on open streams ([`Replay::push_raw`]: a
//!   torn frame, garbage, a repeated or older frame), writes whose event is lost
//!   ([`Replay::apply_silently`]), half-open connections ([`Replay::stall`]), a revoked
//!   token ([`Replay::require_token`]), a lock taken by another holder
//!   ([`Replay::steal_locks`]), a recorded JWKS ([`Replay::start`]).
//!
//! The simulator's scheduler would act on allocations that have no job or whose node it does
//! not know (stop them, mark them lost, place replacements). A scripted allocation therefore
//! brings a stub job (type `system`, no datacenter: feasible on no node, so nothing is placed)
//! and a stub node (ready), so that the reconciler finds nothing to do. No lock timers run
//! (locks never lapse unless the script says so) and no client runs tasks.

use crate::api::{json_response, router, AgentInfo, ApiError, AppState};
use crate::broker::Broker;
use crate::identity::Keyring;
use crate::policy::AclState;
use crate::state::State;
use crate::store::Server;
use crate::structs::{Allocation, Frame, HostVolume, Job, Node, TaskGroup, VariableLock};
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{broadcast, watch};

/// Frames the event broker keeps (the simulator's default `event_buffer_size`).
const BUFFER: usize = 100;

/// What the front records and the faults it injects.
#[derive(Debug)]
struct Record {
    /// Event stream heartbeat interval for new connections.
    heartbeat: Duration,
    /// The token every request must carry (`None`: any).
    required_token: Option<String>,
    /// The JWKS served at `/.well-known/jwks.json` (a recording), instead of the keyring's.
    jwks: Value,
    /// Every request as `METHOD path?query`.
    requests: Vec<String>,
    /// `X-Nomad-Token` of every request, in order.
    tokens_seen: Vec<Option<String>>,
    /// Successful lock operations: `acquire`, `renew`, `release`.
    lock_ops: Vec<String>,
    /// Response body bytes by endpoint: `stream`, `node-allocations`, `allocation`.
    bytes_out: BTreeMap<&'static str, u64>,
    /// When the last [`ANSWERS_KEPT`] counted answers (or event stream chunks) were ready to
    /// send: endpoint as in `bytes_out`, Unix time in ns.
    answers: VecDeque<(&'static str, u64)>,
}

/// How many answer times [`Replay::answered_since`] can look back over.
const ANSWERS_KEPT: usize = 1024;

struct Shared {
    record: Mutex<Record>,
    /// Raw bytes for every open event stream.
    raw: broadcast::Sender<Bytes>,
    /// Which connections are half-open.
    stalled: watch::Sender<Stall>,
}

/// The half-open connections a test scripted ([`Replay::stall`], [`Replay::stall_reads`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stall {
    None,
    /// New requests other than the event stream are held; open streams flow on.
    Reads,
    /// Everything: streams deliver nothing, requests are answered only after healing.
    All,
}

impl Shared {
    fn record(&self) -> MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until no stall holds a new request; `answered`: one already answered, which
    /// only a stall of everything holds.
    async fn healed(&self, answered: bool) {
        let mut rx = self.stalled.subscribe();
        let _ = rx
            .wait_for(|s| *s == Stall::None || (answered && *s == Stall::Reads))
            .await;
    }

    fn count(&self, what: &'static str, n: usize) {
        // The clock is read under the lock, so that the times are in the queue's order.
        let mut r = self.record();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        *r.bytes_out.entry(what).or_default() += n as u64;
        if r.answers.len() == ANSWERS_KEPT {
            r.answers.pop_front();
        }
        r.answers.push_back((what, now));
    }
}

/// A running scripted front on loopback.
#[derive(Clone)]
pub struct Replay {
    /// `http://127.0.0.1:<port>`.
    pub addr: String,
    /// The simulator's server behind the front.
    pub server: Arc<Server>,
    shared: Arc<Shared>,
}

impl Replay {
    /// Starts on 127.0.0.1:0 as the client agent of node `node_id` (registered, ready),
    /// serving `jwks` as the cluster's public keys (the keys that signed recorded workload
    /// identities). ACLs off; event stream heartbeats every 30 s (the simulator's default).
    ///
    /// Panics when loopback cannot be bound or the keyring cannot be made (a test harness).
    pub async fn start(node_id: &str, jwks: Value) -> Replay {
        let keyring = tokio::task::spawn_blocking(Keyring::generate)
            .await
            .expect("keyring task")
            .expect("keyring");
        let server = Server::new("global", BUFFER, Arc::new(keyring), AclState::default());
        server.write(|st| {
            let idx = st.next_index();
            ensure_node(st, node_id, idx);
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = format!("http://{}", listener.local_addr().expect("local addr"));
        let shared = Arc::new(Shared {
            record: Mutex::new(Record {
                heartbeat: Duration::from_secs(30),
                required_token: None,
                jwks,
                requests: Vec::new(),
                tokens_seen: Vec::new(),
                lock_ops: Vec::new(),
                bytes_out: BTreeMap::new(),
                answers: VecDeque::with_capacity(ANSWERS_KEPT),
            }),
            raw: broadcast::channel(1024).0,
            stalled: watch::channel(Stall::None).0,
        });
        let replay = Replay {
            addr,
            server,
            shared,
        };
        let front = replay.clone();
        let node = node_id.to_string();
        tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                // One router per connection: a heartbeat change applies to new connections.
                let app = router(AppState {
                    server: front.server.clone(),
                    agent: Arc::new(AgentInfo {
                        node_id: Some(node.clone()),
                        name: "replay".into(),
                        region: "global".into(),
                        datacenter: "dc1".into(),
                        node_pool: "default".into(),
                        heartbeat: front.shared.record().heartbeat,
                    }),
                })
                .layer(axum::middleware::from_fn_with_state(
                    front.shared.clone(),
                    faults,
                ));
                tokio::spawn(async move {
                    let svc = hyper_util::service::TowerToHyperService::new(app);
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(conn), svc)
                        .await;
                });
            }
        });
        replay
    }

    /// Sets the event stream heartbeat interval of connections opened from now on.
    pub fn set_heartbeat(&self, every: Duration) {
        self.shared.record().heartbeat = every;
    }

    /// Writes a full allocation (with Job) as given, with no event: at its ModifyIndex when
    /// that is above the store's index, else at the next index (its ModifyIndex kept as
    /// scripted, or set to the write's index when absent).
    ///
    /// Panics when `alloc` is not an allocation.
    pub fn put_alloc(&self, alloc: Value) {
        let mut a: Allocation = serde_json::from_value(alloc).expect("an allocation");
        self.server.write(|st| {
            let idx = write_index(st, a.ModifyIndex);
            if a.ModifyIndex == 0 {
                a.ModifyIndex = idx;
            }
            st.tables.allocs = idx;
            script_alloc(st, a, idx);
        });
    }

    /// Publishes one NDJSON frame through the broker to every subscription it matches, and
    /// applies its allocations to the store (top-level fields merged, as the state store's
    /// upsert replaces the object). A frame at or below the store's index is published at
    /// the next index (one write, one new index), payloads unchanged.
    ///
    /// A heartbeat line (`{}`) is sent as is to every open stream.
    ///
    /// Panics when `line` is neither: inject such bytes with [`Replay::push_raw`].
    pub fn push(&self, line: &str) {
        if line.trim() == "{}" {
            self.push_raw("{}\n");
            return;
        }
        let mut frame: Frame = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a frame ({e}): push_raw injects bytes as they are"));
        self.server.write(|st| {
            let idx = apply(st, &frame);
            frame.Index = idx;
            for ev in &mut frame.Events {
                ev.Index = idx;
            }
            st.broker.publish(frame);
        });
    }

    /// One write as Nomad's state store makes it for a plan apply or a client update: the
    /// allocations of `stored` (whole, with their Job, as the store keeps them) are written
    /// and `frame` (the stream's payloads, without the Job, as `nomad/state/events.go`
    /// sends them) is published at that write's index, without applying its payloads a
    /// second time ([`Replay::push`] applies what it publishes). The write's index is
    /// `stored`'s when above the store's, else the next one.
    ///
    /// Returns the wall-clock time (ns since the Unix epoch) read after the store was
    /// updated and before the frame is published and blocking queries wake: the moment the
    /// event exists, which latency measurements start from.
    ///
    /// Panics when either line is not a frame.
    pub fn commit(&self, stored: &str, frame: &str) -> u64 {
        let stored: Frame = serde_json::from_str(stored).expect("a frame (stored)");
        let mut frame: Frame = serde_json::from_str(frame).expect("a frame (published)");
        self.server.write(|st| {
            let idx = apply(st, &stored);
            frame.Index = idx;
            for ev in &mut frame.Events {
                ev.Index = idx;
            }
            let at = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
                .unwrap_or(0);
            st.broker.publish(frame);
            at
        })
    }

    /// The store's latest index (every write raises it).
    pub fn index(&self) -> u64 {
        self.server.index()
    }

    /// Applies a frame's allocations to the store without publishing it: an event the
    /// watcher never sees (lost in a gap, a stall, a torn line).
    ///
    /// Panics when `line` is not a frame.
    pub fn apply_silently(&self, line: &str) {
        let frame: Frame = serde_json::from_str(line).expect("a frame");
        self.server.write(|st| {
            apply(st, &frame);
        });
    }

    /// Sends raw bytes (no newline added) to every open event stream: half a frame, a line
    /// that is not JSON, a repeated or older frame (faults Nomad never produces).
    pub fn push_raw(&self, bytes: &str) {
        let _ = self.shared.raw.send(Bytes::from(bytes.to_string()));
    }

    /// Closes every open event stream (EOF), as a server restart does.
    pub fn close_streams(&self) {
        self.server.stream_close.send_modify(|g| *g += 1);
    }

    /// Removes an allocation with no event (garbage collection / purge), at a new index.
    pub fn delete_alloc(&self, id: &str) {
        self.server.write(|st| {
            st.allocs.remove(id);
            let idx = st.next_index();
            st.tables.allocs = idx;
        });
    }

    /// Replaces every allocation with `allocs`, the store's index with `index` (lower than
    /// before: a snapshot restore, or a new cluster at the same address) and the event broker
    /// with an empty one, then closes every open stream. Variables and volumes are kept.
    ///
    /// Panics when an element of `allocs` is not an allocation.
    pub fn reset(&self, allocs: Vec<Value>, index: u64) {
        self.server.write(|st| {
            st.allocs.clear();
            st.index = index;
            st.tables.allocs = index;
            st.broker = Broker::new(BUFFER);
            for a in allocs {
                let a: Allocation = serde_json::from_value(a).expect("an allocation");
                script_alloc(st, a, index);
            }
        });
        self.close_streams();
    }

    /// Stores a variable (`Variables.Apply` set) with these items (a JSON object of strings).
    ///
    /// Panics when `items` is not an object of strings.
    pub fn put_var(&self, ns: &str, path: &str, items: Value) {
        let items: BTreeMap<String, String> = serde_json::from_value(items).expect("items");
        self.server
            .put_var(ns, path, items, None, None)
            .expect("variable write");
    }

    /// Requires `token` as every request's `X-Nomad-Token` from now on (`None`: any), and
    /// closes every open stream, as a token revocation does (`handleACLUpdates` closes the
    /// subscriptions of a deleted token). A request with another token is refused when it
    /// starts, as Nomad resolves the token once, before a blocking query blocks
    /// (`Variables.List`, `Node.GetAllocs`): 403 "ACL token not found"; an event stream
    /// subscribe gets `200 OK` and EOF without a heartbeat (the error travels inside the
    /// hijacked stream). The public JWKS needs no token.
    ///
    /// The simulator's own ACLs stay off: they re-resolve the token when a blocking query
    /// wakes, so a query started with a since-deleted token answers an empty list.
    pub fn require_token(&self, token: Option<&str>) {
        self.shared.record().required_token = token.map(String::from);
        self.close_streams();
    }

    /// Half-opens (`true`) or heals every connection: while half-open, event streams deliver
    /// nothing (not even heartbeats) and other requests are answered only after healing.
    pub fn stall(&self, on: bool) {
        let to = if on { Stall::All } else { Stall::None };
        self.shared.stalled.send_replace(to);
    }

    /// Holds (`true`) or releases every new request but the event stream (the JWKS
    /// included): they are not answered (their connections half-open) while open streams
    /// deliver frames and heartbeats as usual. A request already being answered finishes.
    /// It replaces a [`Replay::stall`] (one stall state; `false` heals both).
    pub fn stall_reads(&self, on: bool) {
        let to = if on { Stall::Reads } else { Stall::None };
        self.shared.stalled.send_replace(to);
    }

    /// Gives every held variable lock to another holder (the lock lapsed and another node
    /// took it): the holder's renewals and new acquisitions are refused from now on.
    pub fn steal_locks(&self) {
        self.server.write(|st| {
            for v in st.vars.values_mut() {
                if let Some(l) = &v.Lock {
                    v.Lock = Some(VariableLock {
                        ID: uuid::Uuid::new_v4().to_string(),
                        TTL: l.TTL.clone(),
                        LockDelay: l.LockDelay.clone(),
                    });
                }
            }
            st.lock_timers = Default::default();
        });
    }

    /// Every request so far, as `METHOD path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.shared.record().requests.clone()
    }

    /// The `X-Nomad-Token` of every request so far, in order.
    pub fn tokens_seen(&self) -> Vec<Option<String>> {
        self.shared.record().tokens_seen.clone()
    }

    /// Successful lock operations so far: `acquire`, `renew`, `release`.
    pub fn lock_ops(&self) -> Vec<String> {
        self.shared.record().lock_ops.clone()
    }

    /// Response body bytes sent so far by endpoint: `stream`, `node-allocations`,
    /// `allocation`.
    pub fn bytes_out(&self) -> BTreeMap<&'static str, u64> {
        self.shared.record().bytes_out.clone()
    }

    /// When the first answer of endpoint `what` (as in [`Replay::bytes_out`]; for `stream`,
    /// the first chunk: a frame, a heartbeat or raw bytes) at or after `since_ns` had its
    /// body ready to send, in Unix ns: the server's share of a latency. `None` when there
    /// was none, or when answers after `since_ns` were already dropped (only the last 1024
    /// are kept), since the first of them may be among those.
    pub fn answered_since(&self, what: &str, since_ns: u64) -> Option<u64> {
        let r = self.shared.record();
        let full = r.answers.len() == ANSWERS_KEPT;
        if full && r.answers.front().is_some_and(|(_, t)| *t > since_ns) {
            return None;
        }
        r.answers
            .iter()
            .find(|(w, t)| *w == what && *t >= since_ns)
            .map(|(_, t)| *t)
    }

    /// The registered host volumes, as `GET /v1/volume/host/:id` encodes them.
    pub fn host_volumes(&self) -> Vec<Value> {
        let vols: Vec<HostVolume> = self.server.read().host_volumes.values().cloned().collect();
        vols.iter()
            .map(|v| serde_json::to_value(v).unwrap_or(Value::Null))
            .collect()
    }
}

/// The index of a scripted write: `wanted` when above the store's index, else the next one.
fn write_index(st: &mut State, wanted: u64) -> u64 {
    if wanted > st.index {
        st.index = wanted;
        wanted
    } else {
        st.next_index()
    }
}

/// Applies a frame's allocation payloads at a new index (the frame's when above the store's),
/// merging top-level fields into the stored allocation; returns the index.
fn apply(st: &mut State, frame: &Frame) -> u64 {
    let idx = write_index(st, frame.Index);
    for ev in &frame.Events {
        script_namespace(st, &ev.Namespace);
        let Some(payload) = ev.Payload.get("Allocation").and_then(Value::as_object) else {
            continue;
        };
        let id = payload
            .get("ID")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let mut merged = st
            .allocs
            .get(id)
            .and_then(|a| serde_json::to_value(a).ok())
            .unwrap_or_else(|| json!({}));
        for (k, v) in payload {
            merged[k] = v.clone();
        }
        match serde_json::from_value::<Allocation>(merged) {
            Ok(a) => script_alloc(st, a, idx),
            Err(e) => panic!("allocation payload the simulator cannot decode: {e}"),
        }
    }
    st.tables.allocs = idx;
    idx
}

/// A namespace named by the script exists (Nomad creates none on demand: the script stands
/// for the operator who made it).
fn script_namespace(st: &mut State, ns: &str) {
    if !ns.is_empty() {
        st.namespaces.insert(ns.to_string());
    }
}

/// Stores a scripted allocation with the stub node and stub job that keep the reconciler idle.
fn script_alloc(st: &mut State, a: Allocation, idx: u64) {
    if !a.NodeID.is_empty() {
        ensure_node(st, &a.NodeID, idx);
    }
    if !a.JobID.is_empty() {
        let key = (a.Namespace.clone(), a.JobID.clone());
        let version = a.Job.as_ref().map(|j| j.Version).unwrap_or(0);
        let job = st.jobs.entry(key).or_insert_with(|| Job {
            ID: a.JobID.clone(),
            Name: a.JobID.clone(),
            Namespace: a.Namespace.clone(),
            Type: "system".into(),
            Status: "running".into(),
            CreateIndex: idx,
            ModifyIndex: idx,
            JobModifyIndex: idx,
            ..Default::default()
        });
        job.Version = version;
        if job.group(&a.TaskGroup).is_none() {
            job.TaskGroups.push(TaskGroup {
                Name: a.TaskGroup.clone(),
                Count: 1,
                ..Default::default()
            });
        }
    }
    script_namespace(st, &a.Namespace);
    st.allocs.insert(a.ID.clone(), a);
}

/// Registers a ready node with this ID unless known (no event, no scheduling pass).
fn ensure_node(st: &mut State, id: &str, idx: u64) {
    st.nodes.entry(id.to_string()).or_insert_with(|| Node {
        ID: id.into(),
        Name: format!("replay-{}", &id[..id.len().min(8)]),
        Datacenter: "dc1".into(),
        NodePool: "default".into(),
        SchedulingEligibility: "eligible".into(),
        Status: "ready".into(),
        CreateIndex: idx,
        ModifyIndex: idx,
        ..Default::default()
    });
    st.tables.nodes = st.tables.nodes.max(idx);
}

/// The scripted faults and the record, around the simulator's router.
async fn faults(
    axum::extract::State(shared): axum::extract::State<Arc<Shared>>,
    req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let method = req.method().clone();
    let token = req
        .headers()
        .get("X-Nomad-Token")
        .and_then(|t| t.to_str().ok())
        .map(String::from);
    let denied = {
        let mut r = shared.record();
        r.requests.push(format!("{method} {path}?{query}"));
        let denied = r.required_token.is_some()
            && r.required_token != token
            // Nomad's keyring endpoints are public (no token): the JWKS and the OIDC
            // discovery document (`command/agent/keyring_endpoint.go`).
            && !path.starts_with("/.well-known/");
        r.tokens_seen.push(token);
        denied
    };
    let stream = path == "/v1/event/stream";
    if denied && stream {
        let mut r = Response::new(Body::empty());
        r.headers_mut()
            .insert("content-type", HeaderValue::from_static("application/json"));
        return r;
    }
    if !stream {
        // A half-open connection: the request is not answered until healed.
        shared.healed(false).await;
    }
    if denied {
        return ApiError(StatusCode::FORBIDDEN, "ACL token not found".into()).into_response();
    }
    if method == "GET" && path == "/.well-known/jwks.json" {
        let jwks = shared.record().jwks.clone();
        let mut r = json_response(StatusCode::OK, 0, &jwks);
        r.headers_mut()
            .insert("cache-control", HeaderValue::from_static("max-age=900"));
        return r;
    }
    let resp = next.run(req).await;
    if !stream {
        // A blocking query that returned while the connection went half-open.
        shared.healed(true).await;
    }
    let status = resp.status();
    if status == StatusCode::OK && path.starts_with("/v1/var/") {
        for op in ["acquire", "renew", "release"] {
            if query.contains(&format!("lock-{op}")) {
                shared.record().lock_ops.push(op.into());
            }
        }
    }
    let what: &'static str = if stream {
        "stream"
    } else if path.starts_with("/v1/node/") && path.ends_with("/allocations") {
        "node-allocations"
    } else if path.starts_with("/v1/allocation/") {
        "allocation"
    } else {
        return resp;
    };
    let (parts, body) = resp.into_parts();
    if !stream || status != StatusCode::OK {
        let bytes = axum::body::to_bytes(body, usize::MAX)
            .await
            .unwrap_or_default();
        shared.count(what, bytes.len());
        return Response::from_parts(parts, Body::from(bytes));
    }
    // The event stream: the simulator's frames and heartbeats, with raw bytes injected
    // between them and everything swallowed while half-open.
    let mut inner = body.into_data_stream();
    let mut raw = shared.raw.subscribe();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        loop {
            let chunk = tokio::select! {
                c = inner.next() => match c {
                    Some(Ok(c)) => c,
                    _ => return,
                },
                r = raw.recv() => match r {
                    Ok(c) => c,
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = tx.closed() => return,
            };
            if *shared.stalled.borrow() == Stall::All {
                continue;
            }
            shared.count("stream", chunk.len());
            if tx.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
    });
    Response::from_parts(
        parts,
        Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
}
