//! A thin scripted fake of Nomad's HTTP API for replay tests: it speaks the real protocol
//! (paths, NDJSON event stream with `{}` heartbeats, blocking queries, CAS on variables)
//! and serves what the test scripts, with faults injected by the test.

#![allow(dead_code)]

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{broadcast, Notify};

type Body = BoxBody<Bytes, Infallible>;

/// What the fake holds.
#[derive(Default)]
pub struct State {
    pub node_id: String,
    /// Full allocations by ID (with Job), as `GET /v1/allocation/:id` answers.
    pub allocs: BTreeMap<String, Value>,
    pub alloc_index: u64,
    /// (namespace, path) → variable JSON.
    pub vars: BTreeMap<(String, String), Value>,
    pub index: u64,
    pub host_volumes: Vec<Value>,
    pub jwks: Value,
    /// Every request as "METHOD path?query".
    pub requests: Vec<String>,
    /// Number of event stream connections so far.
    pub streams: u64,
    /// Status to answer to the next N event stream subscribes (e.g. 403).
    pub refuse_streams: Vec<u16>,
    /// Lock operations seen: "acquire", "renew", "release".
    pub lock_ops: Vec<String>,
    /// Refuse every lock-acquire (another node holds the claim).
    pub refuse_locks: bool,
    /// When set, every request but the JWKS needs this `X-Nomad-Token`: others get 403
    /// "Permission denied", and an event stream subscribe gets `200 OK` then EOF with no
    /// `{}` (Nomad 2.x: the ACL error travels inside the hijacked stream).
    pub required_token: Option<String>,
    /// Tokens presented, in order (to check that a new token was used).
    pub tokens_seen: Vec<Option<String>>,
    /// Interval of `{}` heartbeats on open streams (Nomad: 30 s).
    pub heartbeat: Duration,
    /// Half-open connections: streams send nothing (not even heartbeats) and blocking
    /// queries never answer while set.
    pub stalled: bool,
    /// Answer every request with 500 "No cluster leader" while set.
    pub no_leader: bool,
    /// Bytes of response bodies sent, by endpoint ("stream", "node-allocations", "allocation").
    pub bytes_out: BTreeMap<&'static str, u64>,
}

impl State {
    /// The index of `GET /v1/node/:id/allocations`, as Nomad computes it (`Node.GetAllocs`):
    /// the highest ModifyIndex of the node's allocations, or the allocs table index if none.
    pub fn node_index(&self, node: &str) -> u64 {
        self.allocs
            .values()
            .filter(|a| a["NodeID"] == node)
            .filter_map(|a| a["ModifyIndex"].as_u64())
            .max()
            .unwrap_or(self.alloc_index)
    }

    fn count(&mut self, what: &'static str, n: usize) {
        *self.bytes_out.entry(what).or_default() += n as u64;
    }
}

/// A running fake.
#[derive(Clone)]
pub struct FakeNomad {
    pub addr: String,
    pub state: Arc<Mutex<State>>,
    lines: broadcast::Sender<Option<String>>,
    unstall: Arc<Notify>,
    changed: Arc<Notify>,
}

impl FakeNomad {
    /// Starts on 127.0.0.1:0.
    pub async fn start(node_id: &str, jwks: Value) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let (lines, _) = broadcast::channel(1024);
        let fake = FakeNomad {
            addr,
            state: Arc::new(Mutex::new(State {
                node_id: node_id.to_string(),
                jwks,
                index: 1,
                alloc_index: 1,
                heartbeat: Duration::from_secs(30),
                ..Default::default()
            })),
            lines,
            changed: Arc::new(Notify::new()),
            unstall: Arc::new(Notify::new()),
        };
        let f = fake.clone();
        tokio::spawn(async move {
            loop {
                let Ok((s, _)) = listener.accept().await else {
                    return;
                };
                let f = f.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let f = f.clone();
                        async move { Ok::<_, Infallible>(f.handle(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        fake
    }

    /// Sends raw bytes (no newline added) to every open event stream, e.g. half a frame.
    pub fn push_raw(&self, bytes: &str) {
        let _ = self.lines.send(Some(bytes.to_string()));
    }

    /// Sets the token Nomad requires (`None`: ACLs off) and closes every open stream, as
    /// an ACL change does ("subscription closed by server, client should resubscribe").
    pub fn require_token(&self, token: Option<&str>) {
        self.state.lock().unwrap().required_token = token.map(String::from);
        self.close_streams();
    }

    /// Half-opens (`true`) or heals every connection (see [`State::stalled`]).
    pub fn stall(&self, on: bool) {
        self.state.lock().unwrap().stalled = on;
        if !on {
            self.unstall.notify_waiters();
        }
    }

    /// Replaces the whole state with that of another cluster (snapshot restore to an older
    /// state, or a new cluster at the same address): the allocations given, lower indexes.
    /// Open streams are closed, as `restoreImpl` abandons the event broker.
    pub fn reset(&self, allocs: Vec<Value>, alloc_index: u64) {
        {
            let mut st = self.state.lock().unwrap();
            st.allocs.clear();
            for a in allocs {
                st.allocs.insert(a["ID"].as_str().unwrap().to_string(), a);
            }
            st.alloc_index = alloc_index;
        }
        self.close_streams();
        self.changed.notify_waiters();
    }

    /// Sends one NDJSON line to every open event stream, and applies the allocations in a
    /// frame to the stored state (top-level fields merged, as Nomad's state store does).
    pub fn push(&self, line: &str) {
        if let Ok(v) = serde_json::from_str::<Value>(line) {
            if let Some(events) = v.get("Events").and_then(|e| e.as_array()) {
                let mut st = self.state.lock().unwrap();
                for ev in events {
                    if let Some(a) = ev.pointer("/Payload/Allocation") {
                        let id = a["ID"].as_str().unwrap_or_default().to_string();
                        let entry = st.allocs.entry(id).or_insert_with(|| json!({}));
                        for (k, val) in a.as_object().unwrap() {
                            entry[k] = val.clone();
                        }
                    }
                }
                if let Some(i) = v.get("Index").and_then(|i| i.as_u64()) {
                    st.alloc_index = st.alloc_index.max(i);
                    st.index = st.index.max(i);
                }
            }
        }
        let _ = self.lines.send(Some(format!("{line}\n")));
        self.changed.notify_waiters();
    }

    /// Applies a frame's allocations to the stored state without sending it (an event the
    /// watcher never sees: lost in a gap, a garbled line, a stall).
    pub fn apply_silently(&self, line: &str) {
        let v: Value = serde_json::from_str(line).unwrap();
        let mut st = self.state.lock().unwrap();
        for ev in v["Events"].as_array().unwrap() {
            if let Some(a) = ev.pointer("/Payload/Allocation") {
                let id = a["ID"].as_str().unwrap_or_default().to_string();
                let entry = st.allocs.entry(id).or_insert_with(|| json!({}));
                for (k, val) in a.as_object().unwrap() {
                    entry[k] = val.clone();
                }
            }
        }
        if let Some(i) = v["Index"].as_u64() {
            st.alloc_index = st.alloc_index.max(i);
            st.index = st.index.max(i);
        }
        drop(st);
        self.changed.notify_waiters();
    }

    /// Closes every open event stream (EOF), as a server restart does.
    pub fn close_streams(&self) {
        let _ = self.lines.send(None);
    }

    /// Removes an allocation silently (GC / purge: Nomad emits no event).
    pub fn delete_alloc(&self, id: &str) {
        let mut st = self.state.lock().unwrap();
        st.allocs.remove(id);
        st.alloc_index += 1;
        st.index += 1;
        drop(st);
        self.changed.notify_waiters();
    }

    /// Stores a full allocation (with Job), as a state store write at a new index (its
    /// ModifyIndex, if higher, else the next one).
    pub fn put_alloc(&self, mut a: Value) {
        let mut st = self.state.lock().unwrap();
        let id = a["ID"].as_str().unwrap().to_string();
        let idx = a["ModifyIndex"]
            .as_u64()
            .unwrap_or(0)
            .max(st.alloc_index + 1);
        if a["ModifyIndex"].as_u64().is_none() {
            a["ModifyIndex"] = json!(idx);
        }
        st.alloc_index = idx;
        st.allocs.insert(id, a);
        drop(st);
        self.changed.notify_waiters();
    }

    /// Stores a variable as Nomad would.
    pub fn put_var(&self, ns: &str, path: &str, items: Value) {
        let mut st = self.state.lock().unwrap();
        st.index += 1;
        let idx = st.index;
        st.vars.insert(
            (ns.to_string(), path.to_string()),
            json!({"Namespace": ns, "Path": path, "CreateIndex": idx, "ModifyIndex": idx, "Items": items}),
        );
        drop(st);
        self.changed.notify_waiters();
    }

    pub fn requests(&self) -> Vec<String> {
        self.state.lock().unwrap().requests.clone()
    }

    fn full(status: StatusCode, body: Value, index: u64) -> Response<Body> {
        Response::builder()
            .status(status)
            .header("Content-Type", "application/json")
            .header("X-Nomad-Index", index.to_string())
            .header("X-Nomad-KnownLeader", "true")
            .header("X-Nomad-LastContact", "0")
            .body(Full::new(Bytes::from(body.to_string())).boxed())
            .unwrap()
    }

    fn text(status: StatusCode, body: &str) -> Response<Body> {
        Response::builder()
            .status(status)
            .body(Full::new(Bytes::from(body.to_string())).boxed())
            .unwrap()
    }

    async fn block(&self, index: u64, wait: Duration, current: impl Fn(&State) -> u64) {
        if index == 0 {
            return;
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.changed.notified();
            if current(&self.state.lock().unwrap()) > index {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return;
            }
        }
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path().to_string();
        let query: BTreeMap<String, String> = req
            .uri()
            .query()
            .unwrap_or("")
            .split('&')
            .filter_map(|p| p.split_once('='))
            .map(|(k, v)| (k.to_string(), v.replace("%2F", "/").replace("%2A", "*")))
            .collect();
        let method = req.method().clone();
        self.state.lock().unwrap().requests.push(format!(
            "{method} {path}?{}",
            req.uri().query().unwrap_or("")
        ));
        let index: u64 = query.get("index").and_then(|i| i.parse().ok()).unwrap_or(0);
        // Nomad's `wait` (default 5 min), e.g. "300s"; jitter left out.
        let wait = query
            .get("wait")
            .and_then(|w| humantime::parse_duration(w).ok())
            .unwrap_or(Duration::from_secs(300));
        let token = req
            .headers()
            .get("X-Nomad-Token")
            .and_then(|t| t.to_str().ok())
            .map(String::from);
        let (denied, no_leader, stalled) = {
            let mut st = self.state.lock().unwrap();
            st.tokens_seen.push(token.clone());
            let denied = st.required_token.is_some()
                && st.required_token != token
                && path != "/.well-known/jwks.json";
            (denied, st.no_leader, st.stalled)
        };
        if stalled && path != "/v1/event/stream" {
            // A half-open connection: the request is never answered until healed.
            self.unstall.notified().await;
        }
        if no_leader {
            return Self::text(StatusCode::INTERNAL_SERVER_ERROR, "No cluster leader");
        }
        if denied && path == "/v1/event/stream" {
            return Response::builder()
                .status(StatusCode::OK)
                .header("Content-Type", "application/json")
                .body(Full::new(Bytes::new()).boxed())
                .unwrap();
        }
        if denied {
            return Self::text(StatusCode::FORBIDDEN, "Permission denied");
        }
        let segs: Vec<String> = path
            .trim_matches('/')
            .split('/')
            .map(String::from)
            .collect();
        let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
        let ns = query
            .get("namespace")
            .cloned()
            .unwrap_or_else(|| "default".into());
        match (method.as_str(), segs.as_slice()) {
            ("GET", ["v1", "agent", "self"]) => {
                let st = self.state.lock().unwrap();
                Self::full(
                    StatusCode::OK,
                    json!({"config": {"Region": "global", "Client": {"Enabled": true, "NodePool": "default"}},
                           "member": {"Name": "fake"}, "stats": {"client": {"node_id": st.node_id}}}),
                    0,
                )
            }
            ("GET", [".well-known", "jwks.json"]) => {
                Self::full(StatusCode::OK, self.state.lock().unwrap().jwks.clone(), 0)
            }
            ("GET", ["v1", "node", id]) => {
                // Nomad: 404 "node not found" for an unknown node (`nodeQuery`).
                let st = self.state.lock().unwrap();
                if *id == st.node_id.as_str() {
                    Self::full(
                        StatusCode::OK,
                        json!({"ID": st.node_id, "Status": "ready"}),
                        st.index,
                    )
                } else {
                    Self::text(StatusCode::NOT_FOUND, "node not found")
                }
            }
            ("GET", ["v1", "node", id, "allocations"]) => {
                let id = id.to_string();
                self.block(index, wait, |s| s.node_index(&id)).await;
                if self.state.lock().unwrap().stalled {
                    self.unstall.notified().await;
                }
                let mut st = self.state.lock().unwrap();
                let list: Vec<Value> = st
                    .allocs
                    .values()
                    .filter(|a| a["NodeID"] == id.as_str())
                    .cloned()
                    .collect();
                let body = Value::Array(list);
                st.count("node-allocations", body.to_string().len());
                Self::full(StatusCode::OK, body, st.node_index(&id))
            }
            ("GET", ["v1", "allocation", id]) => {
                let mut st = self.state.lock().unwrap();
                match st.allocs.get(*id).cloned() {
                    Some(a) => {
                        st.count("allocation", a.to_string().len());
                        Self::full(StatusCode::OK, a, st.alloc_index)
                    }
                    None => Self::text(StatusCode::NOT_FOUND, "alloc not found"),
                }
            }
            ("GET", ["v1", "event", "stream"]) => {
                let refuse = {
                    let mut st = self.state.lock().unwrap();
                    st.streams += 1;
                    if st.refuse_streams.is_empty() {
                        None
                    } else {
                        Some(st.refuse_streams.remove(0))
                    }
                };
                if let Some(code) = refuse {
                    return Self::text(StatusCode::from_u16(code).unwrap(), "Permission denied");
                }
                let mut rx = self.lines.subscribe();
                let me = self.clone();
                let stream = async_stream(move |tx| async move {
                    let send = |b: Bytes| {
                        let tx = tx.clone();
                        let me = me.clone();
                        async move {
                            let n = b.len();
                            if me.state.lock().unwrap().stalled {
                                return true; // swallowed: the peer sees silence
                            }
                            me.state.lock().unwrap().count("stream", n);
                            tx.send(Ok(Frame::data(b))).await.is_ok()
                        }
                    };
                    if !send(Bytes::from_static(b"{}\n")).await {
                        return;
                    }
                    let every = me.state.lock().unwrap().heartbeat;
                    let mut hb =
                        tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                    loop {
                        tokio::select! {
                            _ = hb.tick() => {
                                if !send(Bytes::from_static(b"{}\n")).await {
                                    return;
                                }
                            }
                            m = rx.recv() => match m {
                                Ok(Some(chunk)) => {
                                    if !send(Bytes::from(chunk)).await {
                                        return;
                                    }
                                }
                                Ok(None) | Err(_) => return,
                            }
                        }
                    }
                });
                Response::builder()
                    .status(StatusCode::OK)
                    .header("Content-Type", "application/json")
                    .body(BodyExt::boxed(StreamBody::new(stream)))
                    .unwrap()
            }
            ("GET", ["v1", "vars"]) => {
                self.block(index, wait.min(Duration::from_secs(30)), |s| s.index)
                    .await;
                let st = self.state.lock().unwrap();
                let prefix = query.get("prefix").cloned().unwrap_or_default();
                let list: Vec<Value> = st
                    .vars
                    .iter()
                    .filter(|((vns, p), _)| (ns == "*" || *vns == ns) && p.starts_with(&prefix))
                    .map(|(_, v)| {
                        json!({"Namespace": v["Namespace"], "Path": v["Path"],
                               "CreateIndex": v["CreateIndex"], "ModifyIndex": v["ModifyIndex"]})
                    })
                    .collect();
                Self::full(StatusCode::OK, Value::Array(list), st.index)
            }
            ("GET", ["v1", "var", rest @ ..]) => {
                let p = rest.join("/");
                let st = self.state.lock().unwrap();
                match st.vars.get(&(ns, p)) {
                    Some(v) => Self::full(StatusCode::OK, v.clone(), st.index),
                    None => Self::text(StatusCode::NOT_FOUND, "variable not found"),
                }
            }
            ("PUT", ["v1", "var", rest @ ..]) => {
                let p = rest.join("/");
                let body: Value =
                    serde_json::from_slice(&req.into_body().collect().await.unwrap().to_bytes())
                        .unwrap();
                let mut st = self.state.lock().unwrap();
                let cur = st.vars.get(&(ns.clone(), p.clone())).cloned();
                let held = cur
                    .as_ref()
                    .and_then(|c| c["Lock"]["ID"].as_str().map(String::from))
                    .filter(|id| !id.is_empty());
                let asked = body["Lock"]["ID"].as_str().unwrap_or("").to_string();
                if query.contains_key("lock-acquire") {
                    if held.is_some() || st.refuse_locks {
                        return Self::full(StatusCode::CONFLICT, cur.unwrap_or(json!({})), 0);
                    }
                    st.index += 1;
                    let idx = st.index;
                    let v = json!({"Namespace": ns, "Path": p, "CreateIndex": idx, "ModifyIndex": idx,
                        "Items": body["Items"], "Lock": {"ID": uuid::Uuid::new_v4().to_string(),
                        "TTL": body["Lock"]["TTL"], "LockDelay": body["Lock"]["LockDelay"]}});
                    st.vars.insert((ns, p), v.clone());
                    st.lock_ops.push("acquire".into());
                    return Self::full(StatusCode::OK, v, idx);
                }
                if query.contains_key("lock-renew") || query.contains_key("lock-release") {
                    if held.as_deref() != Some(asked.as_str()) {
                        return Self::full(StatusCode::CONFLICT, cur.unwrap_or(json!({})), 0);
                    }
                    let mut v = cur.unwrap();
                    if query.contains_key("lock-release") {
                        v.as_object_mut().unwrap().remove("Lock");
                        st.vars.insert((ns, p), v.clone());
                        st.lock_ops.push("release".into());
                    } else {
                        st.lock_ops.push("renew".into());
                    }
                    return Self::full(StatusCode::OK, v, 0);
                }
                if let Some(cas) = query.get("cas").and_then(|c| c.parse::<u64>().ok()) {
                    let cur_idx = cur
                        .as_ref()
                        .map(|c| c["ModifyIndex"].as_u64().unwrap())
                        .unwrap_or(0);
                    if cur_idx != cas {
                        return Self::full(StatusCode::CONFLICT, cur.unwrap_or(json!({})), cur_idx);
                    }
                }
                st.index += 1;
                let idx = st.index;
                let create = cur
                    .as_ref()
                    .map(|c| c["CreateIndex"].clone())
                    .unwrap_or(json!(idx));
                let v = json!({"Namespace": ns, "Path": p, "CreateIndex": create, "ModifyIndex": idx, "Items": body["Items"]});
                st.vars.insert((ns, p), v.clone());
                drop(st);
                self.changed.notify_waiters();
                Self::full(StatusCode::OK, v, idx)
            }
            ("DELETE", ["v1", "var", rest @ ..]) => {
                let p = rest.join("/");
                let mut st = self.state.lock().unwrap();
                st.vars.remove(&(ns, p));
                st.index += 1;
                drop(st);
                self.changed.notify_waiters();
                Self::full(StatusCode::OK, json!(null), 0)
            }
            ("PUT", ["v1", "volume", "host", "register"]) => {
                let body: Value =
                    serde_json::from_slice(&req.into_body().collect().await.unwrap().to_bytes())
                        .unwrap();
                let mut v = body["Volume"].clone();
                if v["ID"].as_str().unwrap_or("").is_empty() {
                    v["ID"] = json!(uuid::Uuid::new_v4().to_string());
                }
                v["State"] = json!("ready");
                let mut st = self.state.lock().unwrap();
                st.host_volumes.retain(|h| h["ID"] != v["ID"]);
                st.host_volumes.push(v.clone());
                Self::full(
                    StatusCode::OK,
                    json!({"Volume": v, "Warnings": "", "Index": 1}),
                    1,
                )
            }
            ("GET", ["v1", "volumes"]) => {
                let st = self.state.lock().unwrap();
                if query.get("type").map(String::as_str) != Some("host") {
                    return Self::full(StatusCode::OK, json!([]), 0);
                }
                Self::full(StatusCode::OK, Value::Array(st.host_volumes.clone()), 0)
            }
            ("GET", ["v1", "volume", "host", id]) => {
                let st = self.state.lock().unwrap();
                match st.host_volumes.iter().find(|h| h["ID"] == *id) {
                    Some(h) => Self::full(StatusCode::OK, h.clone(), 0),
                    None => Self::text(StatusCode::NOT_FOUND, "volume not found"),
                }
            }
            ("DELETE", ["v1", "volume", "host", id]) => {
                let mut st = self.state.lock().unwrap();
                st.host_volumes.retain(|h| h["ID"] != *id);
                Self::full(StatusCode::OK, json!({}), 0)
            }
            _ => Self::text(StatusCode::NOT_FOUND, "no such endpoint in the fake"),
        }
    }
}

/// A body stream fed by a task through a channel.
fn async_stream<F, Fut>(f: F) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Frame<Bytes>, Infallible>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(f(tx));
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|v| (v, rx)) })
}

impl FakeNomad {
    /// Drops every variable lock, as a TTL expiry does (the holder's next renew fails).
    pub fn expire_locks(&self) {
        let mut st = self.state.lock().unwrap();
        for v in st.vars.values_mut() {
            if let Some(o) = v.as_object_mut() {
                o.remove("Lock");
            }
        }
    }
}
