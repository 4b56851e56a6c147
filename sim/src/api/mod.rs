//! The HTTP API (`command/agent/*_endpoint.go`), served on the server address and on every
//! simulated client agent's address (same state; only `/v1/agent/self` differs).

mod acl;
mod agent;
mod allocs;
mod deployments;
mod events;
mod faults;
mod jobs;
mod namespaces;
mod nodes;
mod system;
mod vars;
mod volumes;

use crate::broker::SubscriptionFilter;
use crate::locks::LockOp;
use crate::restart::RestartError;
use crate::state::TableIndex;
use crate::store::{Server, StoreError};
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
            StoreError::Locked(m) => ApiError(StatusCode::CONFLICT, m),
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

/// Whether an object in namespace `ns` is listed for a query of namespace `q_ns` (`*` = all).
fn ns_visible(q_ns: &str, ns: &str) -> bool {
    q_ns == "*" || q_ns == ns
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

/// The start of a namespaced endpoint: its query, its namespace (`?namespace=`, default
/// `default`), and the caller's `capability` there checked (each endpoint's `ResolveACL`
/// then `AllowNsOp`, e.g. `nomad/job_endpoint.go` `GetJob`).
fn in_namespace(
    st: &AppState,
    headers: &HeaderMap,
    raw: Option<String>,
    capability: &str,
) -> Result<(Query, String), ApiError> {
    let q = Query::parse(raw);
    let ns = q.namespace();
    authorize(st, headers, crate::acl::Need::Namespace(&ns, capability))?;
    Ok((q, ns))
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
        .route("/v1/agent/self", get(agent::agent_self))
        .route("/v1/status/leader", get(agent::status_leader))
        .route("/v1/namespaces", get(namespaces::namespaces))
        .route(
            "/v1/namespace/:name",
            get(namespaces::namespace_get)
                .put(namespaces::namespace_put)
                .post(namespaces::namespace_put),
        )
        .route(
            "/v1/namespace",
            put(namespaces::namespace_put).post(namespaces::namespace_put),
        )
        .route("/v1/nodes", get(nodes::nodes))
        .route("/v1/node/:id", get(nodes::node_get))
        .route("/v1/node/:id/allocations", get(nodes::node_allocs))
        .route(
            "/v1/node/:id/drain",
            put(nodes::node_drain).post(nodes::node_drain),
        )
        .route(
            "/v1/node/:id/eligibility",
            put(nodes::node_eligibility).post(nodes::node_eligibility),
        )
        .route("/v1/allocations", get(allocs::allocs_list))
        .route("/v1/allocation/:id", get(allocs::alloc_get))
        .route(
            "/v1/allocation/:id/stop",
            put(allocs::alloc_stop).post(allocs::alloc_stop),
        )
        .route(
            "/v1/client/allocation/:id/restart",
            put(allocs::alloc_restart).post(allocs::alloc_restart),
        )
        .route(
            "/v1/jobs",
            get(jobs::jobs_list)
                .put(jobs::jobs_register)
                .post(jobs::jobs_register),
        )
        .route(
            "/v1/jobs/parse",
            post(jobs::jobs_parse).put(jobs::jobs_parse),
        )
        .route(
            "/v1/job/:id",
            get(jobs::job_get)
                .delete(jobs::job_delete)
                .put(jobs::jobs_register)
                .post(jobs::jobs_register),
        )
        .route("/v1/job/:id/allocations", get(jobs::job_allocs))
        .route("/v1/job/:id/deployments", get(deployments::job_deployments))
        .route(
            "/v1/job/:id/deployment",
            get(deployments::job_latest_deployment),
        )
        .route("/v1/deployments", get(deployments::deployments_list))
        .route(
            "/v1/deployment/*path",
            any(deployments::deployment_specific),
        )
        .route("/v1/event/stream", any(events::event_stream))
        .route("/v1/vars", get(vars::vars_list))
        .route("/v1/var/*path", any(vars::var_handler))
        .route(
            "/v1/volume/host/register",
            put(volumes::volume_register).post(volumes::volume_register),
        )
        .route(
            "/v1/volume/host/:id",
            get(volumes::volume_get).delete(volumes::volume_delete),
        )
        .route("/v1/volumes", get(volumes::volumes_list))
        .route("/.well-known/jwks.json", get(system::jwks))
        .route(
            "/.well-known/openid-configuration",
            get(system::openid_configuration),
        )
        .route("/v1/system/gc", put(system::system_gc))
        .route(
            "/v1/acl/bootstrap",
            post(acl::http_bootstrap).put(acl::http_bootstrap),
        )
        .route(
            "/v1/acl/policy/:name",
            put(acl::http_policy_put)
                .post(acl::http_policy_put)
                .get(acl::http_policy_get)
                .delete(acl::http_policy_delete),
        )
        .route("/v1/acl/policies", get(acl::http_policies_list))
        .route("/v1/acl/tokens", get(acl::http_tokens_list))
        .route(
            "/v1/acl/token",
            put(acl::http_token_put).post(acl::http_token_put),
        )
        .route("/v1/acl/token/self", get(acl::http_token_self))
        .route(
            "/v1/acl/token/:accessor",
            get(acl::http_token_get)
                .put(acl::http_token_update)
                .post(acl::http_token_update)
                .delete(acl::http_token_delete),
        )
        .route(
            "/v1/sim/node/:id/restart",
            put(nodes::sim_restart).post(nodes::sim_restart),
        )
        .route(
            "/v1/sim/node/:id/heartbeat",
            put(nodes::sim_heartbeat).post(nodes::sim_heartbeat),
        )
        .route(
            "/v1/sim/node/:id/partition",
            put(nodes::sim_partition).post(nodes::sim_partition),
        )
        .route(
            "/v1/sim/events/close",
            put(faults::close_streams).post(faults::close_streams),
        )
        .route(
            "/v1/sim/events/reset",
            put(faults::reset_buffer).post(faults::reset_buffer),
        )
        .route(
            "/v1/sim/leader",
            put(faults::set_leader).post(faults::set_leader),
        )
        .route("/v1/sim/counters", get(sim_counters))
        .route(
            "/v1/sim/counters/reset",
            put(sim_counters_reset).post(sim_counters_reset),
        )
        // Counts what each matched route answers, after every guard below has had its say.
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            count_request,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            no_leader_guard,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            rpc_error_prefix,
        ))
        // Outermost: a partitioned node's requests fail before anything else answers
        // them, with their own `rpc error: ` text.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            partition_guard,
        ))
        .with_state(state)
}

/// The counting front (`crate::counters`): one request to the method and matched route
/// template (`GET /v1/vars`), and
/// its response body's bytes as they are sent. The counters endpoints count themselves too.
async fn count_request(
    State(st): State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    // A variable's requests also count under its path's first two segments
    // (`GET /v1/var/dhv-binder/records-changed`, `GET /v1/var/dhv-binder/volumes`).
    let folder = req
        .uri()
        .path()
        .strip_prefix("/v1/var/")
        .map(|p| p.splitn(3, '/').take(2).collect::<Vec<_>>().join("/"));
    let method = req.method().clone();
    let route = format!("{method} {route}");
    let sink = match folder {
        Some(f) => st
            .server
            .counters
            .request_under(&[&route, &format!("{method} /v1/var/{f}")]),
        None => st.server.counters.request(&route),
    };
    let resp = next.run(req).await;
    let (parts, body) = resp.into_parts();
    if let Some(n) = axum::body::HttpBody::size_hint(&body).exact() {
        sink.add(n as usize);
        return Response::from_parts(parts, body);
    }
    use futures_util::StreamExt;
    let counted = body.into_data_stream().map(move |chunk| {
        if let Ok(c) = &chunk {
            sink.add(c.len());
        }
        chunk
    });
    Response::from_parts(parts, axum::body::Body::from_stream(counted))
}

/// Sim only: `GET /v1/sim/counters`, the counting front's figures (`crate::counters`).
async fn sim_counters(State(st): State<AppState>) -> Response {
    axum::Json(st.server.counters.snapshot()).into_response()
}

/// Sim only: `PUT /v1/sim/counters/reset` zeroes the counting front.
async fn sim_counters_reset(State(st): State<AppState>) -> Response {
    st.server.counters.reset();
    StatusCode::OK.into_response()
}

/// A client agent forwards a request to the servers over RPC, and an uncoded error that
/// comes back (a 500: "no such volume", "No cluster leader", state-store errors) is wrapped
/// as `rpc error: <message>` (`helper/pool/pool.go` `ConnPool.RPC`; coded errors, 4xx, pass
/// unwrapped, and `command/agent/http.go` `errCodeFromHandler` strips a 403's prefix). The
/// server's own address answers without the prefix.
async fn rpc_error_prefix(
    State(st): State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    let forwarded = !(path.starts_with("/v1/sim/") || path == "/v1/agent/self");
    if st.agent.node_id.is_none()
        || !forwarded
        || resp.status() != StatusCode::INTERNAL_SERVER_ERROR
    {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        return ApiError(parts.status, String::new()).into_response();
    };
    let text = String::from_utf8_lossy(&bytes);
    let text = if text.starts_with("rpc error: ") {
        text.into_owned()
    } else {
        format!("rpc error: {text}")
    };
    ApiError(parts.status, text).into_response()
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

/// How long a request through a partitioned client takes to fail: the connection pool's dial
/// timeout (`helper/pool/pool.go` `getNewConn`: `net.DialTimeout(..., 10*time.Second)`).
pub const PARTITION_DIAL_TIMEOUT: Duration = Duration::from_secs(10);

/// A request through the HTTP API of a client agent whose node is partitioned
/// (`PUT /v1/sim/node/:id/partition?on=true`) fails as Nomad's does when no server can be
/// reached: the client forwards it (`client/rpc.go` `rpc`), the dial times out after
/// [`PARTITION_DIAL_TIMEOUT`], a dial error is not retried (`canRetry`), and the HTTP layer
/// answers 500 with the pool's error (`helper/pool/pool.go` `RPC`: "rpc error: failed to get
/// conn: ..."). Served locally: `/v1/agent/self` and the sim-only API.
async fn partition_guard(
    State(st): State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = req.uri().path();
    let local = path == "/v1/agent/self" || path.starts_with("/v1/sim/");
    let cut = st
        .agent
        .node_id
        .as_ref()
        .is_some_and(|id| st.server.read().partitioned.contains(id));
    if cut && !local {
        tokio::time::sleep(PARTITION_DIAL_TIMEOUT).await;
        return ApiError(
            StatusCode::INTERNAL_SERVER_ERROR,
            "rpc error: failed to get conn: dial tcp 127.0.0.1:4647: i/o timeout".into(),
        )
        .into_response();
    }
    next.run(req).await
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
