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
}

/// A running fake.
#[derive(Clone)]
pub struct FakeNomad {
    pub addr: String,
    pub state: Arc<Mutex<State>>,
    lines: broadcast::Sender<Option<String>>,
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
                ..Default::default()
            })),
            lines,
            changed: Arc::new(Notify::new()),
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
        let _ = self.lines.send(Some(line.to_string()));
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
    }

    /// Stores a full allocation (with Job).
    pub fn put_alloc(&self, a: Value) {
        let mut st = self.state.lock().unwrap();
        let id = a["ID"].as_str().unwrap().to_string();
        st.allocs.insert(id, a);
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

    async fn block(&self, index: u64, current: impl Fn(&State) -> u64) {
        if index == 0 {
            return;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
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
            ("GET", ["v1", "node", id, "allocations"]) => {
                let id = id.to_string();
                self.block(index, |s| s.alloc_index).await;
                let st = self.state.lock().unwrap();
                let list: Vec<Value> = st
                    .allocs
                    .values()
                    .filter(|a| a["NodeID"] == id.as_str())
                    .cloned()
                    .collect();
                Self::full(StatusCode::OK, Value::Array(list), st.alloc_index)
            }
            ("GET", ["v1", "allocation", id]) => {
                let st = self.state.lock().unwrap();
                match st.allocs.get(*id) {
                    Some(a) => Self::full(StatusCode::OK, a.clone(), st.alloc_index),
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
                let stream = async_stream(move |tx| async move {
                    let _ = tx.send(Ok(Frame::data(Bytes::from_static(b"{}\n")))).await;
                    loop {
                        match rx.recv().await {
                            Ok(Some(line)) => {
                                if tx
                                    .send(Ok(Frame::data(Bytes::from(format!("{line}\n")))))
                                    .await
                                    .is_err()
                                {
                                    return;
                                }
                            }
                            Ok(None) | Err(_) => return,
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
                self.block(index, |s| s.index).await;
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
