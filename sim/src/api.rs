//! The HTTP API (`command/agent/*_endpoint.go`), served on the server address and on every
//! simulated client agent's address (same state; only `/v1/agent/self` differs).

use crate::broker::SubscriptionFilter;
use crate::store::{Server, StoreError, TableIndex};
use crate::structs::{Frame, HostVolume, Job, Variable};
use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use axum::Router;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// Who serves this listener.
#[derive(Clone, Debug)]
pub struct AgentInfo {
    /// Node ID when this is a client agent address.
    pub node_id: Option<String>,
    /// Member name.
    pub name: String,
    /// Region.
    pub region: String,
    /// Datacenter.
    pub datacenter: String,
    /// Node pool (client agents).
    pub node_pool: String,
    /// Event stream heartbeat interval.
    pub heartbeat: Duration,
}

/// Router state.
#[derive(Clone)]
pub struct AppState {
    /// The server.
    pub server: Arc<Server>,
    /// This listener's agent.
    pub agent: Arc<AgentInfo>,
}

/// An API error; body is text/plain like Nomad's `CodedError`.
#[derive(Debug)]
pub struct ApiError(pub StatusCode, pub String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.0, self.1).into_response();
        r.headers_mut().insert(
            "content-type",
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        r
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound(m) => ApiError(StatusCode::NOT_FOUND, m),
            StoreError::BadRequest(m) => ApiError(StatusCode::BAD_REQUEST, m),
            StoreError::Forbidden => ApiError(StatusCode::FORBIDDEN, "Permission denied".into()),
            StoreError::Internal(m) => ApiError(StatusCode::INTERNAL_SERVER_ERROR, m),
            StoreError::Conflict(body, _) => ApiError(StatusCode::CONFLICT, body.to_string()),
        }
    }
}

type ApiResult = Result<Response, ApiError>;

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, msg.into())
}

/// JSON response with Nomad's query-meta headers.
pub fn json_response(status: StatusCode, index: u64, body: &impl serde::Serialize) -> Response {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut r = (status, bytes).into_response();
    let h = r.headers_mut();
    h.insert("content-type", HeaderValue::from_static("application/json"));
    h.insert("x-nomad-index", HeaderValue::from(index.max(1)));
    h.insert("x-nomad-knownleader", HeaderValue::from_static("true"));
    h.insert("x-nomad-lastcontact", HeaderValue::from_static("0"));
    r
}

fn ok(index: u64, body: &impl serde::Serialize) -> ApiResult {
    Ok(json_response(StatusCode::OK, index, body))
}

fn pct_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => match u8::from_str_radix(&s[i + 1..i + 3], 16) {
                Ok(b) => {
                    out.push(b);
                    i += 2;
                }
                Err(_) => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parsed query string (repeatable keys kept in order).
#[derive(Debug, Default)]
pub struct Query(Vec<(String, String)>);

impl Query {
    fn parse(raw: Option<String>) -> Self {
        Query(
            raw.unwrap_or_default()
                .split('&')
                .filter(|p| !p.is_empty())
                .map(|p| match p.split_once('=') {
                    Some((k, v)) => (pct_decode(k), pct_decode(v)),
                    None => (pct_decode(p), String::new()),
                })
                .collect(),
        )
    }
    fn get(&self, k: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
    }
    fn has(&self, k: &str) -> bool {
        self.0.iter().any(|(key, _)| key == k)
    }
    fn all(&self, k: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(key, _)| key == k)
            .map(|(_, v)| v.as_str())
            .collect()
    }
    fn namespace(&self) -> String {
        match self.get("namespace") {
            Some(ns) if !ns.is_empty() => ns.to_string(),
            _ => "default".into(),
        }
    }
    fn bool(&self, k: &str) -> bool {
        self.get(k) == Some("") || self.go_bool(k) == Ok(Some(true))
    }
    /// A boolean parameter as Go's `strconv.ParseBool` reads it (`1 t T TRUE true True`,
    /// `0 f F FALSE false False`); absent or empty → `None`; anything else → the error text
    /// Nomad returns ("Failed to parse value of …").
    fn go_bool(&self, k: &str) -> Result<Option<bool>, String> {
        match self.get(k) {
            None | Some("") => Ok(None),
            Some("1" | "t" | "T" | "TRUE" | "true" | "True") => Ok(Some(true)),
            Some("0" | "f" | "F" | "FALSE" | "false" | "False") => Ok(Some(false)),
            Some(v) => Err(format!(
                "Failed to parse value of {k:?} ({v}) as a bool: strconv.ParseBool: parsing {v:?}: invalid syntax"
            )),
        }
    }
    /// Blocking query options: (index, wait). `QueryOptions.TimeToBlock`
    /// (nomad/structs/structs.go): default and cap `MaxBlockingRPCQueryTime` = 300 s; then
    /// `blockingRPC` (nomad/rpc.go) adds a jitter of up to wait/16.
    fn blocking(&self) -> Result<(u64, Duration), ApiError> {
        let index = match self.get("index") {
            None | Some("") => 0,
            Some(s) => s.parse().map_err(|_| bad("Invalid index"))?,
        };
        let wait = match self.get("wait") {
            None | Some("") => Duration::from_secs(300),
            Some(s) => crate::clock::parse_go_duration(s).map_err(|_| bad("Invalid wait time"))?,
        };
        let wait = if wait.is_zero() {
            Duration::from_secs(300)
        } else {
            wait.min(Duration::from_secs(300))
        };
        let jitter = rand::random::<f64>() * wait.as_secs_f64() / 16.0;
        Ok((index, wait + Duration::from_secs_f64(jitter)))
    }
}

async fn blocking(
    st: &AppState,
    q: &Query,
    table: fn(&TableIndex) -> u64,
) -> Result<u64, ApiError> {
    let (index, wait) = q.blocking()?;
    if index > 0 {
        st.server.block_until(index, wait, table).await;
    }
    Ok(table(&st.server.read().tables))
}

fn token(headers: &HeaderMap) -> Option<String> {
    if let Some(t) = headers.get("x-nomad-token").and_then(|v| v.to_str().ok()) {
        return Some(t.to_string());
    }
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|s| s.trim().to_string())
}

fn authorize(
    st: &AppState,
    headers: &HeaderMap,
    need: crate::acl::Need<'_>,
) -> Result<(), ApiError> {
    crate::acl::check(&st.server, token(headers).as_deref(), need).map_err(ApiError::from)
}

/// Builds the router for one listener.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/agent/self", get(agent_self))
        .route("/v1/status/leader", get(status_leader))
        .route("/v1/namespaces", get(namespaces))
        .route("/v1/namespace/:name", get(namespace_get))
        .route("/v1/nodes", get(nodes))
        .route("/v1/node/:id", get(node_get))
        .route("/v1/node/:id/allocations", get(node_allocs))
        .route("/v1/node/:id/drain", put(node_drain).post(node_drain))
        .route(
            "/v1/node/:id/eligibility",
            put(node_eligibility).post(node_eligibility),
        )
        .route("/v1/allocations", get(allocs_list))
        .route("/v1/allocation/:id", get(alloc_get))
        .route("/v1/allocation/:id/stop", put(alloc_stop).post(alloc_stop))
        .route(
            "/v1/client/allocation/:id/restart",
            put(alloc_restart).post(alloc_restart),
        )
        .route(
            "/v1/jobs",
            get(jobs_list).put(jobs_register).post(jobs_register),
        )
        .route("/v1/jobs/parse", post(jobs_parse).put(jobs_parse))
        .route(
            "/v1/job/:id",
            get(job_get)
                .delete(job_delete)
                .put(jobs_register)
                .post(jobs_register),
        )
        .route("/v1/job/:id/allocations", get(job_allocs))
        .route("/v1/event/stream", any(event_stream))
        .route("/v1/vars", get(vars_list))
        .route("/v1/var/*path", any(var_handler))
        .route(
            "/v1/volume/host/register",
            put(volume_register).post(volume_register),
        )
        .route("/v1/volume/host/:id", get(volume_get).delete(volume_delete))
        .route("/v1/volumes", get(volumes_list))
        .route("/.well-known/jwks.json", get(jwks))
        .route("/v1/system/gc", put(system_gc))
        .route(
            "/v1/acl/bootstrap",
            post(crate::acl::http_bootstrap).put(crate::acl::http_bootstrap),
        )
        .route(
            "/v1/acl/policy/:name",
            put(crate::acl::http_policy_put)
                .post(crate::acl::http_policy_put)
                .get(crate::acl::http_policy_get)
                .delete(crate::acl::http_policy_delete),
        )
        .route("/v1/acl/policies", get(crate::acl::http_policies_list))
        .route("/v1/acl/tokens", get(crate::acl::http_tokens_list))
        .route(
            "/v1/acl/token",
            put(crate::acl::http_token_put).post(crate::acl::http_token_put),
        )
        .route("/v1/acl/token/self", get(crate::acl::http_token_self))
        .route(
            "/v1/acl/token/:accessor",
            get(crate::acl::http_token_get)
                .put(crate::acl::http_token_update)
                .post(crate::acl::http_token_update)
                .delete(crate::acl::http_token_delete),
        )
        .route(
            "/v1/sim/node/:id/heartbeat",
            put(sim_heartbeat).post(sim_heartbeat),
        )
        .route(
            "/v1/sim/events/close",
            put(crate::faults::close_streams).post(crate::faults::close_streams),
        )
        .route(
            "/v1/sim/events/reset",
            put(crate::faults::reset_buffer).post(crate::faults::reset_buffer),
        )
        .route(
            "/v1/sim/leader",
            put(crate::faults::set_leader).post(crate::faults::set_leader),
        )
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            no_leader_guard,
        ))
        .with_state(state)
}

/// While the sim plays a leader election (`PUT /v1/sim/leader?leader=false`), every request an
/// agent forwards to the leader fails with 500 "No cluster leader" (`errNoLeader`,
/// `nomad/structs/errors.go`; `nomad/rpc.go` `forward`). Served anyway, as by a follower or the
/// local agent: `?stale` reads, `/v1/status/leader` (empty string), `/v1/agent/self`, the
/// public JWKS, the sim-only API, and the event stream (`Event.Stream` is served by whichever
/// server the RPC lands on and never forwarded to the leader, `nomad/event_endpoint.go`).
async fn no_leader_guard(
    State(st): State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = req.uri().path();
    let local = path == "/v1/status/leader"
        || path == "/v1/agent/self"
        || path.starts_with("/v1/sim/")
        || path.starts_with("/.well-known/")
        || path == "/v1/event/stream";
    let stale = req.method() == Method::GET
        && Query::parse(req.uri().query().map(String::from)).has("stale");
    if !local && !stale && st.server.read().leaderless {
        return ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            "No cluster leader".into(),
        )
        .into_response();
    }
    next.run(req).await
}

async fn agent_self(State(st): State<AppState>, headers: HeaderMap) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::AgentRead)?;
    let a = &st.agent;
    let mut body = json!({
        "config": {
            "Region": a.region, "Datacenter": a.datacenter, "NodeName": a.name,
            "Client": {"Enabled": a.node_id.is_some(), "NodePool": a.node_pool},
            "Server": {"Enabled": a.node_id.is_none()},
            "ACL": {"Enabled": st.server.read().acl.enabled},
        },
        "member": {"Name": a.name, "Tags": {"region": a.region, "dc": a.datacenter}},
        "stats": {},
    });
    if let Some(id) = &a.node_id {
        body["stats"]["client"] = json!({"node_id": id, "known_servers": "127.0.0.1:4647", "num_allocations": "0", "last_heartbeat": "0", "heartbeat_ttl": "0"});
    } else {
        body["stats"]["nomad"] = json!({"leader": "true", "server": "true"});
    }
    ok(st.server.index(), &body)
}

async fn status_leader(State(st): State<AppState>) -> ApiResult {
    if st.server.read().leaderless {
        return ok(st.server.index(), &"");
    }
    ok(st.server.index(), &"127.0.0.1:4647")
}

async fn namespaces(State(st): State<AppState>) -> ApiResult {
    let s = st.server.read();
    let list: Vec<Value> = s
        .namespaces
        .iter()
        .map(|n| json!({"Name": n, "Description": if n == "default" {"Default shared namespace"} else {""}, "Quota": "", "Meta": null, "Capabilities": null, "NodePoolConfiguration": null, "VaultConfiguration": null, "ConsulConfiguration": null, "CreateIndex": 1, "ModifyIndex": 1}))
        .collect();
    ok(s.index, &list)
}

/// `GET /v1/namespace/:name`: 404 "Namespace not found" when it does not exist
/// (`command/agent/namespace_endpoint.go` `namespaceQuery`). Nomad lets any capability in
/// the namespace read it (`nomad/namespace_endpoint.go` `GetNamespace`); stricter here:
/// `read-job`.
async fn namespace_get(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> ApiResult {
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&name, "read-job"),
    )?;
    let s = st.server.read();
    if !s.namespaces.contains(&name) {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            "Namespace not found".into(),
        ));
    }
    let desc = if name == "default" {
        "Default shared namespace"
    } else {
        ""
    };
    ok(
        s.index,
        &json!({"Name": name, "Description": desc, "Quota": "", "Meta": null, "CreateIndex": 1, "ModifyIndex": 1}),
    )
}

async fn nodes(State(st): State<AppState>, headers: HeaderMap, RawQuery(q): RawQuery) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::NodeRead)?;
    let q = Query::parse(q);
    let idx = blocking(&st, &q, |t| t.nodes).await?;
    let prefix = q.get("prefix").unwrap_or("");
    let list: Vec<Value> = st
        .server
        .read()
        .nodes
        .values()
        .filter(|n| n.ID.starts_with(prefix))
        .map(|n| n.stub())
        .collect();
    ok(idx, &list)
}

async fn node_get(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::NodeRead)?;
    let q = Query::parse(q);
    let idx = blocking(&st, &q, |t| t.nodes).await?;
    let node = st
        .server
        .node(&id)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, "node not found".into()))?;
    ok(idx, &node.to_json())
}

async fn node_allocs(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::NodeRead)?;
    let q = Query::parse(q);
    // `Node.GetAllocs` (nomad/node_endpoint.go): no existence check (an unknown node ID is
    // `200 []`); the index is the highest ModifyIndex among the node's allocations (the
    // allocs table index only when it has none), and `blockingRPC` re-blocks until that number
    // exceeds `index`: a deletion never wakes the query, and the index can go down.
    let (index, wait) = q.blocking()?;
    let node_index = |s: &crate::store::State| {
        s.allocs
            .values()
            .filter(|a| a.NodeID == id)
            .map(|a| a.ModifyIndex)
            .max()
            .unwrap_or(s.tables.allocs)
    };
    if index > 0 {
        st.server.block_until_with(index, wait, node_index).await;
    }
    let idx = node_index(&st.server.read());
    let tok = token(&headers);
    let allocs: Vec<_> = st
        .server
        .node_allocs(&id)
        .into_iter()
        .filter(|a| crate::acl::can_read_ns(&st.server, tok.as_deref(), &a.Namespace, "read-job"))
        .collect();
    ok(idx, &allocs)
}

async fn node_drain(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::NodeWrite)?;
    // `decodeBody` (command/agent/http.go): no body → 400 "Request body is empty".
    if body.is_empty() {
        return Err(bad("Request body is empty"));
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
    let (idx, eval) = crate::nodes::set_drain(&st.server, &id, &v)?;
    ok(
        idx,
        &json!({"EvalIDs": [eval], "EvalCreateIndex": idx, "NodeModifyIndex": idx, "Index": idx}),
    )
}

async fn node_eligibility(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::NodeWrite)?;
    let v: Value = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
    let elig = v
        .get("Eligibility")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let idx = crate::nodes::set_eligibility(&st.server, &id, &elig)?;
    ok(
        idx,
        &json!({"EvalIDs": [], "EvalCreateIndex": 0, "NodeModifyIndex": idx, "Index": idx}),
    )
}

async fn sim_heartbeat(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let stop = q.bool("stop");
    crate::nodes::set_heartbeat_stopped(&st.server, &id, stop)?;
    ok(
        st.server.index(),
        &json!({"NodeID": id, "HeartbeatStopped": stop}),
    )
}

fn alloc_visible(q_ns: &str, ns: &str) -> bool {
    q_ns == "*" || q_ns == ns
}

async fn allocs_list(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    if ns != "*" {
        authorize(&st, &headers, crate::acl::Need::Namespace(&ns, "read-job"))?;
    }
    // `parseBool` (command/agent/http.go): a bad value is a 400.
    let resources = q.go_bool("resources").map_err(bad)?.unwrap_or(false);
    let task_states = q.go_bool("task_states").map_err(bad)?.unwrap_or(true);
    let idx = blocking(&st, &q, |t| t.allocs).await?;
    let prefix = q.get("prefix").unwrap_or("");
    let tok = token(&headers);
    let namespaces = st.server.read().namespaces.clone();
    let readable: std::collections::BTreeSet<String> = namespaces
        .into_iter()
        .filter(|n| crate::acl::can_read_ns(&st.server, tok.as_deref(), n, "read-job"))
        .collect();
    let list: Vec<Value> = st
        .server
        .read()
        .allocs
        .values()
        .filter(|a| {
            alloc_visible(&ns, &a.Namespace)
                && readable.contains(&a.Namespace)
                && a.ID.starts_with(prefix)
        })
        .map(|a| a.stub_with(resources, task_states))
        .collect();
    ok(idx, &list)
}

async fn alloc_get(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let idx = blocking(&st, &q, |t| t.allocs).await?;
    let alloc = {
        let s = st.server.read();
        s.allocs.get(&id).cloned().or_else(|| {
            let m: Vec<_> = s
                .allocs
                .values()
                .filter(|a| a.ID.starts_with(&id))
                .collect();
            (m.len() == 1 && id.len() >= 4).then(|| m[0].clone())
        })
    };
    let alloc = alloc.ok_or_else(|| ApiError(StatusCode::NOT_FOUND, "alloc not found".into()))?;
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&alloc.Namespace, "read-job"),
    )?;
    ok(idx, &alloc)
}

async fn alloc_stop(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult {
    let ns = st
        .server
        .read()
        .allocs
        .get(&id)
        .map(|a| a.Namespace.clone())
        .unwrap_or_default();
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&ns, "alloc-lifecycle"),
    )?;
    let (eval, idx) = st.server.stop_alloc(&id)?;
    ok(idx, &json!({"EvalID": eval, "Index": idx}))
}

async fn alloc_restart(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    let ns = st
        .server
        .read()
        .allocs
        .get(&id)
        .map(|a| a.Namespace.clone())
        .unwrap_or_default();
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&ns, "alloc-lifecycle"),
    )?;
    let v: Value = if body.is_empty() {
        json!({})
    } else {
        serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?
    };
    let task = v
        .get("TaskName")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let all = v.get("AllTasks").and_then(Value::as_bool).unwrap_or(false);
    crate::restart::request(&st.server, &id, &task, all)?;
    ok(st.server.index(), &json!({}))
}

fn job_stub(j: &Job) -> Value {
    json!({"ID": j.ID, "ParentID": j.ParentID, "Name": j.Name, "Namespace": j.Namespace,
        "Datacenters": j.Datacenters, "NodePool": j.NodePool, "Multiregion": j.Multiregion, "Type": j.Type,
        "Priority": j.Priority, "Periodic": !j.Periodic.is_null(), "ParameterizedJob": !j.ParameterizedJob.is_null(),
        "Stop": j.Stop, "Status": j.Status, "StatusDescription": j.StatusDescription, "JobSummary": null,
        "CreateIndex": j.CreateIndex, "ModifyIndex": j.ModifyIndex, "JobModifyIndex": j.JobModifyIndex,
        "SubmitTime": j.SubmitTime})
}

async fn jobs_list(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    authorize(&st, &headers, crate::acl::Need::Namespace(&ns, "list-jobs"))?;
    let idx = blocking(&st, &q, |t| t.jobs).await?;
    let prefix = q.get("prefix").unwrap_or("");
    let list: Vec<Value> = st
        .server
        .read()
        .jobs
        .values()
        .filter(|j| alloc_visible(&ns, &j.Namespace) && j.ID.starts_with(prefix))
        .map(job_stub)
        .collect();
    ok(idx, &list)
}

async fn jobs_parse(State(st): State<AppState>, body: Bytes) -> ApiResult {
    let v: Value =
        serde_json::from_slice(&body).map_err(|e| bad(format!("Unable to parse request: {e}")))?;
    let hcl = v
        .get("JobHCL")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("Job spec is empty"))?;
    let mut job = crate::jobspec::parse(hcl).map_err(|e| bad(e.to_string()))?;
    if v.get("Canonicalize")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        job.canonicalize(&st.server.region);
    }
    ok(st.server.index(), &job)
}

async fn jobs_register(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> ApiResult {
    let v: Value =
        serde_json::from_slice(&body).map_err(|e| bad(format!("Unable to parse request: {e}")))?;
    let job_v = v
        .get("Job")
        .cloned()
        .ok_or_else(|| bad("Job must be specified"))?;
    let job: Job =
        serde_json::from_value(job_v).map_err(|e| bad(format!("Unable to parse job: {e}")))?;
    let ns = if job.Namespace.is_empty() {
        "default".to_string()
    } else {
        job.Namespace.clone()
    };
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&ns, "submit-job"),
    )?;
    let (eval, jmi, idx) = st.server.register_job(job)?;
    ok(
        idx,
        &json!({"EvalID": eval, "EvalCreateIndex": idx, "JobModifyIndex": jmi, "Warnings": "", "Index": idx, "LastContact": 0, "KnownLeader": false}),
    )
}

async fn job_get(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    authorize(&st, &headers, crate::acl::Need::Namespace(&ns, "read-job"))?;
    let idx = blocking(&st, &q, |t| t.jobs).await?;
    let job = st.server.read().jobs.get(&(ns, id)).cloned();
    let job = job.ok_or_else(|| ApiError(StatusCode::NOT_FOUND, "job not found".into()))?;
    ok(idx, &job)
}

async fn job_delete(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&ns, "submit-job"),
    )?;
    // `jobDelete` parses purge with strconv.ParseBool and returns a plain (uncoded) error → 500.
    let purge = q
        .go_bool("purge")
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e))?
        .unwrap_or(false);
    let (eval, jmi, idx) = st.server.deregister_job(&ns, &id, purge)?;
    ok(
        idx,
        &json!({"EvalID": eval, "EvalCreateIndex": idx, "JobModifyIndex": jmi, "VolumeEvalID": "", "VolumeEvalIndex": 0, "Index": idx, "LastContact": 0, "KnownLeader": false}),
    )
}

async fn job_allocs(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    authorize(&st, &headers, crate::acl::Need::Namespace(&ns, "read-job"))?;
    let idx = blocking(&st, &q, |t| t.allocs).await?;
    let list: Vec<Value> = st
        .server
        .read()
        .allocs
        .values()
        .filter(|a| a.Namespace == ns && a.JobID == id)
        .map(|a| a.stub())
        .collect();
    ok(idx, &list)
}

// ------------------------------------------------------------------------- event stream

/// `GET /v1/event/stream`: NDJSON frames, `{}` heartbeat at once and every interval.
async fn event_stream(
    State(st): State<AppState>,
    method: Method,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    if method != Method::GET {
        return Err(ApiError(
            StatusCode::METHOD_NOT_ALLOWED,
            "Invalid method".into(),
        ));
    }
    let q = Query::parse(q);
    let index: u64 = match q.get("index") {
        None | Some("") => 0,
        Some(s) => s.parse().map_err(|_| {
            bad(format!(
                "Unable to parse index: strconv.Atoi: parsing {s:?}: invalid syntax"
            ))
        })?,
    };
    let mut topics: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let requested = q.all("topic");
    if requested.is_empty() {
        topics.insert("*".into(), vec!["*".into()]);
    }
    for t in requested {
        let parts: Vec<&str> = t.split(':').collect();
        let (topic, key) = match parts.as_slice() {
            [topic] => (*topic, "*"),
            [topic, key] => (*topic, *key),
            _ => return Err(bad(format!("Invalid topic query: {t}"))),
        };
        topics
            .entry(topic.to_string())
            .or_default()
            .push(key.to_string());
    }
    let ns = q.namespace();
    let tok = token(&headers);
    for topic in topics.keys() {
        crate::acl::check_event_topic(&st.server, tok.as_deref(), topic, &ns)?;
    }
    let auth = StreamAuth {
        token: tok.filter(|t| !t.is_empty()),
        topics: topics.keys().cloned().collect(),
        namespace: ns.clone(),
    };
    let (cursor, filter) = st.server.subscribe_events(index, topics, &ns);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(stream_task(
        st.server.clone(),
        cursor,
        filter,
        auth,
        st.agent.heartbeat,
        tx,
    ));
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut r = Response::new(body);
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    r.headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-cache"));
    Ok(r)
}

/// What a subscription was authorized with, to re-check it when ACLs change.
struct StreamAuth {
    /// The subscriber's token; `None` (no token) is never re-checked, like Nomad's empty token.
    token: Option<String>,
    /// Requested topics.
    topics: Vec<String>,
    /// Requested namespace (`*` as requested).
    namespace: String,
}

impl StreamAuth {
    /// Whether the subscription is still allowed (`handleACLUpdates` /
    /// `checkSubscriptionsAgainstACLChange`, `nomad/stream/event_broker.go`: a deleted token,
    /// or a token or policy change that takes a permission away, force-closes the stream).
    fn still_allowed(&self, server: &Server) -> bool {
        let Some(tok) = &self.token else { return true };
        self.topics
            .iter()
            .all(|t| crate::acl::check_event_topic(server, Some(tok), t, &self.namespace).is_ok())
    }
}

async fn stream_task(
    server: Arc<Server>,
    mut cursor: u64,
    filter: SubscriptionFilter,
    auth: StreamAuth,
    heartbeat: Duration,
    tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    let hb = Bytes::from_static(b"{}\n");
    if tx.send(Ok(hb.clone())).await.is_err() {
        return;
    }
    let mut index_rx = server.subscribe_index();
    let mut close_rx = crate::faults::close_receiver(&server);
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat);
    let mut acl_index = server.read().tables.acl;
    loop {
        let now_acl = server.read().tables.acl;
        if now_acl != acl_index {
            acl_index = now_acl;
            if !auth.still_allowed(&server) {
                tracing::debug!("closing event stream: subscription closed by server, client should resubscribe");
                return;
            }
        }
        let frames = match server.frames_from(cursor) {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!(error = %e, "closing event stream");
                return;
            }
        };
        for f in frames {
            cursor = f.Index + 1;
            let events = filter.filter(&f);
            if events.is_empty() {
                continue;
            }
            let mut line = serde_json::to_vec(&Frame {
                Index: f.Index,
                Events: events,
            })
            .unwrap_or_default();
            line.push(b'\n');
            if tx.send(Ok(Bytes::from(line))).await.is_err() {
                return;
            }
        }
        tokio::select! {
            r = index_rx.changed() => if r.is_err() { return },
            _ = ticker.tick() => {
                if tx.send(Ok(hb.clone())).await.is_err() { return; }
            }
            _ = close_rx.changed() => return,
            _ = tx.closed() => return,
        }
    }
}

// ------------------------------------------------------------------------- variables

fn valid_var_path(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 128
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_~/".contains(c))
}

async fn vars_list(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    let idx = blocking(&st, &q, |t| t.vars).await?;
    let prefix = q.get("prefix").unwrap_or("").to_string();
    let tok = token(&headers);
    // `Variables.List` hides locks from all but management tokens.
    let management =
        crate::acl::check(&st.server, tok.as_deref(), crate::acl::Need::Management).is_ok();
    let list: Vec<Variable> = st
        .server
        .read()
        .vars
        .values()
        .filter(|v| alloc_visible(&ns, &v.Namespace) && v.Path.starts_with(&prefix))
        .map(|v| Variable {
            Lock: v.Lock.clone().filter(|_| management),
            ..v.metadata()
        })
        .collect::<Vec<_>>();
    let list: Vec<Variable> = list
        .into_iter()
        .filter(|v| {
            crate::acl::check(
                &st.server,
                tok.as_deref(),
                crate::acl::Need::Variable(&v.Namespace, &v.Path, "list"),
            )
            .is_ok()
        })
        .collect();
    ok(idx, &list)
}

async fn var_handler(
    State(st): State<AppState>,
    method: Method,
    headers: HeaderMap,
    Path(path): Path<String>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    let path = path.trim_start_matches('/').to_string();
    if !valid_var_path(&path) {
        return Err(bad(format!("invalid path {path:?}")));
    }
    let tok = token(&headers);
    // `parseCAS` (command/agent/variable_endpoint.go), only on writes: empty = no CAS;
    // unparsable → 400.
    let cas = || -> Result<Option<u64>, ApiError> {
        match q.get("cas") {
            None | Some("") => Ok(None),
            Some(s) => s.parse::<u64>().map(Some).map_err(|_| {
                bad(format!(
                    "can not parse cas: strconv.ParseUint: parsing {s:?}: invalid syntax"
                ))
            }),
        }
    };
    let lock_op = ["lock-acquire", "lock-renew", "lock-release"]
        .into_iter()
        .find(|op| q.has(op));
    match method {
        Method::GET => {
            crate::acl::check(
                &st.server,
                tok.as_deref(),
                crate::acl::Need::Variable(&ns, &path, "read"),
            )?;
            let idx = blocking(&st, &q, |t| t.vars).await?;
            let v = st
                .server
                .read()
                .vars
                .get(&(ns.clone(), path.clone()))
                .cloned();
            // `Variables.Read` hides the Lock from all but management tokens.
            let management =
                crate::acl::check(&st.server, tok.as_deref(), crate::acl::Need::Management).is_ok();
            match v {
                Some(mut v) => {
                    if !management {
                        v.Lock = None;
                    }
                    ok(v.ModifyIndex.max(idx.min(v.ModifyIndex)), &v)
                }
                None => Err(ApiError(StatusCode::NOT_FOUND, "variable not found".into())),
            }
        }
        Method::PUT | Method::POST => {
            crate::acl::check(
                &st.server,
                tok.as_deref(),
                crate::acl::Need::Variable(&ns, &path, "write"),
            )?;
            let mut v: Variable = if body.is_empty() {
                Variable::default()
            } else {
                serde_json::from_slice(&body)
                    .map_err(|e| bad(format!("failed to parse variable: {e}")))?
            };
            if let Some(op) = lock_op {
                if q.get("cas").is_some_and(|c| !c.is_empty()) {
                    return Err(bad("CAS can't be used with lock operations"));
                }
                return crate::locks::http_lock(&st.server, &ns, &path, op, v);
            }
            let items = v.Items.take().unwrap_or_default();
            if items.is_empty() {
                return Err(bad("variable missing required Items object"));
            }
            // `canonicalizeAndValidate` (nomad/variables_endpoint.go), VarOpSet/VarOpCAS.
            if v.Lock.as_ref().is_some_and(|l| {
                [&l.TTL, &l.LockDelay]
                    .iter()
                    .any(|d| !d.is_null() && d.as_str() != Some("") && d.as_f64() != Some(0.0))
            }) {
                return Err(bad("variable should not contain lock definition"));
            }
            if crate::locks::items_size(&items) > crate::locks::MAX_VARIABLE_SIZE {
                return Err(bad("variables are limited to 64KiB in total size"));
            }
            let cas = cas()?;
            let lock_id = v
                .Lock
                .as_ref()
                .map(|l| l.ID.clone())
                .filter(|i| !i.is_empty());
            match st
                .server
                .put_var(&ns, &path, items, cas, lock_id.as_deref())
            {
                Ok(v) => ok(v.ModifyIndex, &v),
                Err(StoreError::Conflict(body, idx)) => {
                    Ok(json_response(StatusCode::CONFLICT, idx, &body))
                }
                Err(e) => Err(e.into()),
            }
        }
        Method::DELETE => {
            crate::acl::check(
                &st.server,
                tok.as_deref(),
                crate::acl::Need::Variable(&ns, &path, "destroy"),
            )?;
            match st.server.delete_var(&ns, &path, cas()?) {
                Ok(idx) => {
                    let mut r = json_response(StatusCode::OK, idx, &Value::Null);
                    *r.body_mut() = Body::empty();
                    Ok(r)
                }
                Err(StoreError::Conflict(body, idx)) => {
                    Ok(json_response(StatusCode::CONFLICT, idx, &body))
                }
                Err(e) => Err(e.into()),
            }
        }
        _ => Err(ApiError(
            StatusCode::METHOD_NOT_ALLOWED,
            "Invalid method".into(),
        )),
    }
}

// ------------------------------------------------------------------------- host volumes

async fn volume_register(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> ApiResult {
    let v: Value = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
    let vol: HostVolume = serde_json::from_value(
        v.get("Volume")
            .cloned()
            .ok_or_else(|| bad("missing volume definition"))?,
    )
    .map_err(|e| bad(e.to_string()))?;
    let ns = if vol.Namespace.is_empty() {
        "default".to_string()
    } else {
        vol.Namespace.clone()
    };
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&ns, "host-volume-register"),
    )?;
    let vol = st.server.register_host_volume(vol)?;
    ok(
        vol.ModifyIndex,
        &json!({"Volume": vol, "Warnings": "", "Index": vol.ModifyIndex}),
    )
}

async fn volume_get(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&ns, "host-volume-read"),
    )?;
    let idx = blocking(&st, &q, |t| t.host_volumes).await?;
    let v = st
        .server
        .host_volume(&ns, &id)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, "volume not found".into()))?;
    ok(idx, &v)
}

async fn volume_delete(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&ns, "host-volume-delete"),
    )?;
    let idx = st.server.delete_host_volume(&ns, &id)?;
    ok(idx, &json!({"Index": idx}))
}

async fn volumes_list(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    if q.get("type") != Some("host") {
        return ok(st.server.index(), &Vec::<Value>::new());
    }
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&ns, "host-volume-read"),
    )?;
    let idx = blocking(&st, &q, |t| t.host_volumes).await?;
    let node = q.get("node_id").unwrap_or("");
    let pool = q.get("node_pool").unwrap_or("");
    let prefix = q.get("prefix").unwrap_or("");
    let list: Vec<Value> = st
        .server
        .read()
        .host_volumes
        .values()
        .filter(|v| alloc_visible(&ns, &v.Namespace))
        .filter(|v| node.is_empty() || v.NodeID == node)
        .filter(|v| pool.is_empty() || v.NodePool == pool)
        .filter(|v| v.ID.starts_with(prefix) || v.Name.starts_with(prefix))
        .map(|v| v.stub())
        .collect();
    ok(idx, &list)
}

/// `PUT /v1/system/gc` (management): forced GC of terminal allocations, silently.
async fn system_gc(State(st): State<AppState>, headers: HeaderMap) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::Management)?;
    let (n, idx) = st.server.gc();
    tracing::debug!(allocs = n, "garbage collected");
    let mut r = json_response(StatusCode::OK, idx, &Value::Null);
    *r.body_mut() = Body::empty();
    Ok(r)
}

async fn jwks(State(st): State<AppState>) -> ApiResult {
    let mut r = json_response(StatusCode::OK, st.server.index(), &st.server.keyring.jwks());
    r.headers_mut()
        .insert("cache-control", HeaderValue::from_static("max-age=900"));
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `QueryOptions.TimeToBlock` (nomad/structs/structs.go) and `blockingRPC` (nomad/rpc.go):
    /// the wait defaults to and is capped at 300 s (`MaxBlockingRPCQueryTime`), plus a jitter
    /// of up to wait/16.
    #[test]
    fn blocking_waits_are_capped_at_300s_plus_jitter() {
        let cap = Duration::from_secs(300) + Duration::from_secs(300) / 16;
        for q in ["index=5&wait=10m", "index=5", "index=5&wait=301s"] {
            let (i, w) = Query::parse(Some(q.to_string())).blocking().unwrap();
            assert_eq!(i, 5);
            assert!(w >= Duration::from_secs(300) && w <= cap, "{q}: {w:?}");
        }
        let (_, w) = Query::parse(Some("index=5&wait=2s".into()))
            .blocking()
            .unwrap();
        assert!(
            w >= Duration::from_secs(2) && w <= Duration::from_millis(2125),
            "{w:?}"
        );
    }
}
