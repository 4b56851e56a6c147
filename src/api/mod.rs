//! The local API: HTTP/1.1 on a unix socket, called by prestart tasks (`dhv-binder prestart`)
//! and by operators (`dhv-binder status`).
//!
//! - `POST /v1/allocations/<alloc_id>/publish[?wait=<duration>]` with the caller's Nomad
//!   workload identity token (`Authorization: Bearer <jwt>` or `X-Nomad-Token`): blocks until
//!   every deferred volume of that allocation is published on this node. 200 with
//!   `{"alloc_id","volumes":[{"namespace","name","path","read_only"}]}`; errors are
//!   `{"error":"...","retryable":bool}` with the status codes of [`ApiError`]. With
//!   `progress=<duration>` (and `seen=<id>`), the call also ends early with 202 and
//!   `{"alloc_id","volumes":[],"waiting":{"reason","id"}}` ([`WaitReport`]) when the
//!   allocation starts to wait for something outside the agent (a claim another node holds,
//!   a missing plugin) or that reason changes from `seen`, and after `progress` while it still
//!   waits: the caller prints it and calls again. An agent older than this ignores both
//!   parameters (it answers at the end only), a caller older than this sends neither.
//! - `GET /v1/status`: the agent's state, for callers with peer UID 0 only. The document is
//!   this API's own, in snake_case (`node_id`, `volumes[].plugin_id`, `mount_health`), with
//!   times as Unix seconds in fields named `since` or `*_since`; `dhv-binder status -json`
//!   prints it in Nomad's casing ([`crate::cli::output::nomad_json`]), this answer stays as
//!   it is.
//! - `GET /v1/health`: `{"ready":bool}` (anyone).
//!
//! Routing is axum's [`Router`] (paths, methods, path parameters and the query string);
//! unknown paths (404) and methods (405) answer with the same error body. [`serve`]'s
//! accept loop hands each connection, with its peer UID, to hyper's HTTP/1 server.

pub mod admission;

use crate::nomad::identity::{Claims, Verifier};
use crate::volume::is_alloc_id;
use admission::{Admission, CallerKey, Refused, WarnBudget};
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Extension, Query, State};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderMap;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};

/// The longest a publish call may block.
pub const MAX_WAIT: Duration = Duration::from_secs(600);
/// Default publish wait when the caller gives none.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(300);

/// Why a call on the local API did not succeed: one variant per reason, in the caller's
/// terms. [`ApiError::status`] is the one place that maps reasons to HTTP statuses.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum ApiError {
    #[error("{0:?} is not an allocation ID (a lower-case UUID)")]
    NotAnAllocId(String),
    #[error("wait={value:?} is not a duration: {reason}")]
    BadWait { value: String, reason: String },
    #[error("no such endpoint: {0}")]
    NoSuchEndpoint(String),
    #[error("method {0} not allowed")]
    MethodNotAllowed(String),
    #[error("no workload identity token: send the task's NOMAD_TOKEN as `Authorization: Bearer` (set identity {{ env = true }} on the prestart task)")]
    NoToken,
    /// The token did not verify (signature, audience, expiry, claims).
    #[error("{0}")]
    TokenRejected(String),
    /// The keys to verify tokens with could not be fetched from Nomad.
    #[error("{0}")]
    KeysUnavailable(String),
    #[error("the token belongs to allocation {token_alloc}, not {alloc_id}: a task may only publish for its own allocation")]
    OtherAllocation {
        token_alloc: String,
        alloc_id: String,
    },
    #[error("the token is for namespace {token}, the allocation runs in {alloc}")]
    WrongNamespace { token: String, alloc: String },
    #[error("allocation {alloc_id} runs on node {node}, not on this node {here}")]
    OtherNode {
        alloc_id: String,
        node: String,
        here: String,
    },
    #[error("status is for root on this node (run `dhv-binder status` as root)")]
    NotRoot,
    #[error("allocation {alloc_id} does not exist in Nomad")]
    UnknownAllocation { alloc_id: String },
    #[error("allocation {alloc_id} is {client_status} (desired {desired_status}): nothing is published for it")]
    AllocationStopped {
        alloc_id: String,
        client_status: String,
        desired_status: String,
    },
    #[error("publishing volume {volume} failed: {error}")]
    PublishFailed {
        volume: crate::volume::VolumeKey,
        error: String,
    },
    /// This node withholds the volume (an attach limit, a publish that cannot succeed
    /// here, an operator's pause): not retried here, so that the allocation fails and
    /// Nomad's reschedule policy places it on another node.
    #[error("volume {volume} is not published on this node: {why}")]
    NotOnThisNode {
        volume: crate::volume::VolumeKey,
        why: String,
    },
    /// A volume waits for something outside the agent (a plugin, a claim).
    #[error("{0}")]
    Waiting(String),
    /// Nomad could not be asked about the allocation.
    #[error("{0}")]
    Nomad(String),
    /// The journal could not record the outcome.
    #[error("the agent cannot write its journal: {0}")]
    Journal(String),
    #[error("the agent is shutting down")]
    ShuttingDown,
    #[error("allocation {alloc_id} is not known on this node yet")]
    AllocationNotSeen { alloc_id: String },
    #[error("volumes of allocation {alloc_id} were not published in time")]
    NotPublishedInTime { alloc_id: String },
    /// The allocation already waits in as many publish calls as one allocation may.
    #[error("allocation {alloc_id} already waits in {max} publish calls: wait for one to end (each waits until the volumes are published or its wait is over)")]
    TooManyCalls { alloc_id: String, max: usize },
    /// The request carries a body larger than the API takes (none of its calls has one).
    #[error("the request body is larger than {max} bytes: the local API's calls take no body")]
    BodyTooLarge { max: usize },
    /// The request's body did not arrive in time.
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(Duration),
}

impl ApiError {
    /// The HTTP status and whether the caller should retry: the one place that decides.
    pub fn status(&self) -> (StatusCode, bool) {
        use ApiError::*;
        match self {
            NotAnAllocId(_) | BadWait { .. } => (StatusCode::BAD_REQUEST, false),
            MethodNotAllowed(_) => (StatusCode::METHOD_NOT_ALLOWED, false),
            NoToken => (StatusCode::UNAUTHORIZED, false),
            TokenRejected(_)
            | OtherAllocation { .. }
            | WrongNamespace { .. }
            | OtherNode { .. }
            | NotRoot => (StatusCode::FORBIDDEN, false),
            NoSuchEndpoint(_) | UnknownAllocation { .. } => (StatusCode::NOT_FOUND, false),
            AllocationStopped { .. } | NotOnThisNode { .. } => (StatusCode::CONFLICT, false),
            KeysUnavailable(_) | PublishFailed { .. } | Waiting(_) | Nomad(_) | ShuttingDown => {
                (StatusCode::SERVICE_UNAVAILABLE, true)
            }
            AllocationNotSeen { .. } | NotPublishedInTime { .. } => {
                (StatusCode::GATEWAY_TIMEOUT, true)
            }
            TooManyCalls { .. } => (StatusCode::TOO_MANY_REQUESTS, true),
            BodyTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, false),
            BodyTimeout(_) => (StatusCode::REQUEST_TIMEOUT, true),
            Journal(_) => (StatusCode::INTERNAL_SERVER_ERROR, true),
        }
    }
}

/// The error body.
#[derive(Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    pub retryable: bool,
}

/// One published volume in a publish reply.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PublishedVolume {
    pub namespace: String,
    pub name: String,
    pub path: String,
    pub read_only: bool,
}

/// The publish reply.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PublishReply {
    pub alloc_id: String,
    pub volumes: Vec<PublishedVolume>,
    /// Set on a progress report (the call asked for `progress`): the allocation still
    /// waits, `volumes` is empty, and the caller calls again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<WaitReport>,
}

/// Why an allocation's publish still waits, as a progress report tells it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WaitReport {
    /// One line per waiting volume, joined by `"; "` (the holder of a claim: job,
    /// allocation, node), or what is under way.
    pub reason: String,
    /// A digest of `reason` (16 hex digits), for the next call's `seen`.
    pub id: String,
}

impl WaitReport {
    /// The report of `reason`, with its digest.
    pub fn of(reason: String) -> Self {
        let d = ring::digest::digest(&ring::digest::SHA256, reason.as_bytes());
        let id = d.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect();
        Self { reason, id }
    }
}

/// What a caller asked to be told while it waits (`progress`, `seen`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// Report after this long in this call if the allocation still waits.
    pub after: Duration,
    /// The [`WaitReport::id`] the caller last printed (empty: none yet).
    pub seen: String,
}

/// A verified caller's publish request.
#[derive(Debug, Clone)]
pub struct PublishRequest {
    pub alloc_id: String,
    /// The namespace of the caller's workload identity.
    pub namespace: String,
    /// How long the caller waits at most.
    pub wait: Duration,
    /// Progress reports the caller asked for; `None`: answer at the end only.
    pub progress: Option<Progress>,
}

/// A request for the agent's owner loop.
#[derive(Debug)]
pub enum Request2Agent {
    /// Publish for a verified caller; the reply comes when done, failed or timed out.
    Publish {
        request: PublishRequest,
        reply: oneshot::Sender<Result<PublishReply, ApiError>>,
    },
    /// The status document.
    Status {
        reply: oneshot::Sender<serde_json::Value>,
    },
}

struct Ctx {
    verifier: Verifier,
    agent: mpsc::Sender<Request2Agent>,
    admission: Arc<Admission>,
    /// Warnings about refused connections and calls, at most one per kind per interval.
    warnings: Arc<WarnBudget<String>>,
    limits: Limits,
}

/// The caller (`SO_PEERCRED` of its connection): its UID for root-only endpoints, both
/// for the audit line of a refused call.
#[derive(Debug, Clone)]
struct Peer {
    /// The UID that counts for root-only endpoints (root in a task counts as no one).
    uid: Option<u32>,
    /// The caller's own UID and pid, for the audit line.
    real_uid: Option<u32>,
    pid: Option<i32>,
    /// Who it is for admission ([`CallerKey`]: its allocation when it runs in a task's
    /// cgroup).
    caller: Arc<CallerKey>,
}

/// Why a call was refused (the error's message), carried on its response for the audit.
#[derive(Debug, Clone)]
struct Refusal(String);

/// A refused call (a 4xx answer) writes an audit line (target `dhv_binder::audit`): the
/// caller's uid and pid, the allocation asked for, the status and the reason. At most one
/// line per status per [`Limits::warn_interval`]; each line counts the refusals of its status
/// not logged since the one before (`not_logged_before`).
async fn audit(
    State(ctx): State<Arc<Ctx>>,
    Extension(peer): Extension<Peer>,
    req: hyper::Request<axum::body::Body>,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    if resp.status().is_client_error() {
        // One line per status per interval: a flood of bad calls cannot flood the log.
        let kind = format!("refused socket call {}", resp.status().as_u16());
        let Some(not_logged) = ctx.warnings.note(kind, std::time::Instant::now()) else {
            return resp;
        };
        let alloc_id = path
            .strip_prefix("/v1/allocations/")
            .and_then(|r| r.split('/').next())
            .unwrap_or_default();
        let unknown = || "unknown".to_string();
        tracing::warn!(
            target: "dhv_binder::audit",
            caller_uid = peer.real_uid.map(|u| u.to_string()).unwrap_or_else(unknown),
            caller_pid = peer.pid.map(|p| p.to_string()).unwrap_or_else(unknown),
            %alloc_id,
            %method,
            %path,
            status = resp.status().as_u16(),
            reason = %resp.extensions().get::<Refusal>().map(|r| r.0.as_str()).unwrap_or_default(),
            not_logged_before = not_logged,
            "refused socket call (at most one line per status every {:?}; not_logged_before counts those in between)",
            ctx.limits.warn_interval
        );
    }
    resp
}

/// The endpoints. Unknown paths and methods answer with an [`ApiError`] body too.
fn router(ctx: Arc<Ctx>) -> Router {
    Router::new()
        .route(
            "/v1/allocations/:alloc_id/publish",
            post(publish_route).fallback(method_not_allowed),
        )
        .route("/v1/status", get(status_route).fallback(method_not_allowed))
        .route("/v1/health", get(health_route).fallback(no_such_endpoint))
        .fallback(no_such_endpoint)
        .layer(axum::middleware::from_fn_with_state(
            ctx.clone(),
            bounded_body,
        ))
        .layer(axum::middleware::from_fn_with_state(ctx.clone(), audit))
        .with_state(ctx)
}

/// Owns the socket file: dropping it removes the file, but only while it is still the one
/// this agent created (a later agent's socket is never removed).
pub struct SocketGuard {
    path: std::path::PathBuf,
    inode: (u64, u64),
}

impl Drop for SocketGuard {
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.inode) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Binds the socket, mode 0666 (every caller authenticates with a token, and tasks often run
/// as `nobody`). A stale socket file is replaced; a socket that answers belongs to another
/// running agent and is an `AddrInUse` error.
pub fn bind(path: &Path) -> std::io::Result<(UnixListener, SocketGuard)> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            "another dhv-binder agent answers on this socket; run one agent per node",
        ));
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    let m = std::fs::symlink_metadata(path)?;
    Ok((
        listener,
        SocketGuard {
            path: path.to_path_buf(),
            inode: (m.dev(), m.ino()),
        },
    ))
}

/// Bounds on the local API's connections (the socket is world-writable: any process on the
/// node, in or out of a task, may connect). Every task runs as `nobody` (or root in a
/// container, which may take any UID), so callers are told apart by [`CallerKey`]: a process
/// in a task's cgroup by its allocation alone, any other by its UID, cgroup and mount
/// namespace; an allocation that authenticated keeps a share of its own.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once, all callers but host root together.
    pub max_connections: usize,
    /// Connections open at once per caller ([`CallerKey`]): one task's flood, under however
    /// many UIDs, takes no more.
    pub max_per_caller: usize,
    /// Connections of host root (UID 0 in the agent's own mount namespace, `dhv-binder
    /// status`): a pool of its own that no task can take.
    pub root_connections: usize,
    /// Publish calls waiting at once per allocation (after its workload identity verified).
    pub max_per_allocation: usize,
    /// Connections kept for each allocation whose workload identity was verified from its
    /// own task cgroup, beyond `max_connections`: taken when those are all in use, so that
    /// no flood of other callers shuts an allocation out.
    pub kept_per_allocation: usize,
    /// Time allowed for a request's headers to arrive, from the connection's start (also
    /// for a connection that sends nothing).
    pub header_read_timeout: Duration,
    /// Time allowed for a request's body (the API's calls have none; a client that announces
    /// one must send it at once).
    pub body_read_timeout: Duration,
    /// The largest body taken, in bytes.
    pub max_body_bytes: usize,
    /// The longest a connection may live: the longest publish wait plus a margin.
    pub max_connection_life: Duration,
    /// At most one warning line per kind of refusal in this interval (each says how many
    /// were not logged since the one before).
    pub warn_interval: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_per_caller: 16,
            root_connections: 8,
            max_per_allocation: 4,
            kept_per_allocation: 4,
            header_read_timeout: Duration::from_secs(5),
            body_read_timeout: Duration::from_secs(5),
            max_body_bytes: 4096,
            max_connection_life: MAX_WAIT + Duration::from_secs(30),
            warn_interval: Duration::from_secs(10),
        }
    }
}

/// True when the process `pid` shares this agent's mount namespace (a root caller outside
/// any task's namespace). Any read error is "no".
fn same_mount_namespace(pid: Option<i32>) -> bool {
    let Some(pid) = pid.filter(|p| *p > 0) else {
        return false;
    };
    match (
        std::fs::read_link(format!("/proc/{pid}/ns/mnt")),
        std::fs::read_link("/proc/self/ns/mnt"),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Serves the API until the listener fails or the agent goes away, with [`Limits::default`].
pub async fn serve(listener: UnixListener, verifier: Verifier, agent: mpsc::Sender<Request2Agent>) {
    serve_with(listener, verifier, agent, Limits::default()).await
}

/// What a connection refused before it is served gets: a 503 the caller may retry.
const REFUSED_ANSWER: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: 86\r\n\r\n{\"error\":\"the agent serves as many connections as it may; try again\",\"retryable\":true}";

/// Logs a refused connection or call, at most one line per kind per interval.
fn warn_refused(warnings: &WarnBudget<String>, why: Refused, caller: &CallerKey) {
    if let Some(not_logged) = warnings.note(format!("{why:?}"), std::time::Instant::now()) {
        tracing::warn!(
            caller = %caller,
            not_logged_before = not_logged,
            "{} (at most one line of this kind every interval; not_logged_before counts those in between)",
            why.what()
        );
    }
}

/// Serves the API with explicit connection [`Limits`]. Every connection is accepted at
/// once (so host root's never waits behind a flood in the kernel's backlog) and then served
/// or closed with a 503: host root's from its own pool, any other's if the overall pool and
/// its caller's share have room. Each connection serves one request (no keep-alive), must
/// send its headers within `header_read_timeout` and any body within `body_read_timeout`,
/// and is closed after `max_connection_life`.
pub async fn serve_with(
    listener: UnixListener,
    verifier: Verifier,
    agent: mpsc::Sender<Request2Agent>,
    limits: Limits,
) {
    let admission = Arc::new(Admission::new(
        limits.max_connections,
        limits.max_per_caller,
        limits.root_connections,
        limits.max_per_allocation,
        limits.kept_per_allocation,
    ));
    let warnings = Arc::new(WarnBudget::new(limits.warn_interval));
    let ctx = Arc::new(Ctx {
        verifier,
        agent,
        admission: admission.clone(),
        warnings: warnings.clone(),
        limits,
    });
    let app = router(ctx);
    // The counts of refusals not yet logged, once their interval is over.
    let flusher = tokio::spawn({
        let warnings = warnings.clone();
        async move {
            let mut tick = tokio::time::interval(limits.warn_interval);
            loop {
                tick.tick().await;
                for (kind, n) in warnings.flush(std::time::Instant::now()) {
                    tracing::warn!(
                        kind = %kind,
                        not_logged = n,
                        "local API: refusals not logged in the last {:?}",
                        limits.warn_interval
                    );
                }
            }
        }
    });
    let _flusher = AbortOnDrop(flusher);
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                if let Some(n) = warnings.note("accept".into(), std::time::Instant::now()) {
                    tracing::warn!(error = %e, not_logged_before = n, "local API accept failed");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let cred = stream.peer_cred().ok();
        let uid = cred.map(|c| c.uid());
        let pid = cred.and_then(|c| c.pid());
        // `/v1/status` and root's own pool are for root outside any task: a root caller in
        // another mount namespace (a task) is treated as unprivileged.
        let host_root = uid == Some(0) && same_mount_namespace(pid);
        let caller = CallerKey::of(uid, pid, crate::node::identity::node());
        let ticket = match admission.connection(&caller, host_root) {
            Ok(t) => t,
            Err(why) => {
                warn_refused(&warnings, why, &caller);
                // Best effort, never waits: the caller learns to retry.
                let _ = stream.try_write(REFUSED_ANSWER);
                continue;
            }
        };
        let peer = Peer {
            uid: if host_root {
                Some(0)
            } else {
                uid.filter(|u| *u != 0)
            },
            real_uid: uid,
            pid,
            caller: Arc::new(caller),
        };
        let headers_in = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let inner = TowerToHyperService::new(app.clone().layer(Extension(peer)));
        let seen = headers_in.clone();
        let svc = hyper::service::service_fn(move |req| {
            seen.store(true, std::sync::atomic::Ordering::Relaxed);
            hyper::service::Service::call(&inner, req)
        });
        tokio::spawn(async move {
            let _ticket = ticket;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .keep_alive(false)
                .max_buf_size(16 * 1024)
                .serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            let started = tokio::time::Instant::now();
            // Headers within their time, counted from the connection's start whatever
            // hyper's timer counts from; dropping the connection closes it.
            tokio::select! {
                _ = &mut conn => return,
                _ = tokio::time::sleep_until(started + limits.header_read_timeout) => {}
            }
            if !headers_in.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
            let _ = tokio::time::timeout_at(started + limits.max_connection_life, conn).await;
        });
    }
}

/// Aborts a task when dropped (the warning flusher ends with the server).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads a request's body, at most [`Limits::max_body_bytes`] within
/// [`Limits::body_read_timeout`], before the route runs: a slow or endless body cannot hold
/// a connection.
async fn bounded_body(
    State(ctx): State<Arc<Ctx>>,
    req: hyper::Request<axum::body::Body>,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let max = ctx.limits.max_body_bytes;
    let announced = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > max as u64) {
        return ApiError::BodyTooLarge { max }.into_response();
    }
    let (parts, body) = req.into_parts();
    let limited = http_body_util::Limited::new(body, max);
    let bytes = match tokio::time::timeout(ctx.limits.body_read_timeout, limited.collect()).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(_)) => return ApiError::BodyTooLarge { max }.into_response(),
        Err(_) => return ApiError::BodyTimeout(ctx.limits.body_read_timeout).into_response(),
    };
    next.run(hyper::Request::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
}

fn json<T: Serialize>(status: StatusCode, body: &T) -> Response<Full<Bytes>> {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    Response::builder()
        .status(status)
        .header("Content-Type", "application/json")
        .body(Full::new(Bytes::from(bytes)))
        .unwrap_or_default()
}

fn error(e: ApiError) -> Response<Full<Bytes>> {
    let (status, retryable) = e.status();
    json(
        status,
        &ErrorBody {
            error: e.to_string(),
            retryable,
        },
    )
}

impl IntoResponse for ApiError {
    fn into_response(self) -> axum::response::Response {
        let reason = Refusal(self.to_string());
        let mut r = error(self).into_response();
        r.extensions_mut().insert(reason);
        r
    }
}

fn token_of(h: &HeaderMap) -> Option<String> {
    if let Some(v) = h.get("authorization").and_then(|v| v.to_str().ok()) {
        if let Some(t) = v.strip_prefix("Bearer ") {
            return Some(t.trim().to_string());
        }
    }
    h.get("x-nomad-token")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_string())
}

/// The publish call's query string.
#[derive(Debug, Deserialize)]
struct PublishQuery {
    /// How long to wait, as a duration (`90s`, `5m`); capped at [`MAX_WAIT`].
    wait: Option<String>,
    /// Report progress after this long (a duration), see [`Progress`].
    progress: Option<String>,
    /// The last [`WaitReport::id`] the caller printed.
    seen: Option<String>,
}

fn duration_of(v: String) -> Result<Duration, ApiError> {
    humantime::parse_duration(&v)
        .map(|d| d.min(MAX_WAIT))
        .map_err(|e| ApiError::BadWait {
            value: v,
            reason: e.to_string(),
        })
}

fn wait_of(
    q: Result<Query<PublishQuery>, QueryRejection>,
) -> Result<(Duration, Option<Progress>), ApiError> {
    let q = q.map_err(|e| ApiError::BadWait {
        value: String::new(),
        reason: e.body_text(),
    })?;
    let wait = q.0.wait.map_or(Ok(DEFAULT_WAIT), duration_of)?;
    let progress = match q.0.progress {
        None => None,
        Some(p) => Some(Progress {
            after: duration_of(p)?,
            // A digest: 16 hex digits; anything else is "nothing seen".
            seen: q
                .0
                .seen
                .filter(|s| s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit()))
                .unwrap_or_default(),
        }),
    };
    Ok((wait, progress))
}

async fn no_such_endpoint(uri: hyper::Uri) -> ApiError {
    ApiError::NoSuchEndpoint(uri.path().to_string())
}

async fn method_not_allowed(method: Method) -> ApiError {
    ApiError::MethodNotAllowed(method.to_string())
}

async fn health_route() -> Response<Full<Bytes>> {
    json(StatusCode::OK, &serde_json::json!({"ready": true}))
}

async fn status_route(
    State(ctx): State<Arc<Ctx>>,
    Extension(peer): Extension<Peer>,
) -> Result<Response<Full<Bytes>>, ApiError> {
    if peer.uid != Some(0) {
        return Err(ApiError::NotRoot);
    }
    let (tx, rx) = oneshot::channel();
    ctx.agent
        .send(Request2Agent::Status { reply: tx })
        .await
        .map_err(|_| ApiError::ShuttingDown)?;
    let v = rx.await.map_err(|_| ApiError::ShuttingDown)?;
    Ok(json(StatusCode::OK, &v))
}

async fn publish_route(
    State(ctx): State<Arc<Ctx>>,
    Extension(peer): Extension<Peer>,
    alloc_id: Result<axum::extract::Path<String>, PathRejection>,
    query: Result<Query<PublishQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response<Full<Bytes>>, ApiError> {
    let alloc_id = alloc_id
        .map(|p| p.0)
        .map_err(|e| ApiError::NotAnAllocId(e.body_text()))?;
    let reply = publish(&ctx, &peer.caller, alloc_id, query, &headers).await?;
    let status = if reply.waiting.is_some() {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok(json(status, &reply))
}

async fn publish(
    ctx: &Ctx,
    caller: &CallerKey,
    alloc_id: String,
    query: Result<Query<PublishQuery>, QueryRejection>,
    headers: &HeaderMap,
) -> Result<PublishReply, ApiError> {
    if !is_alloc_id(&alloc_id) {
        return Err(ApiError::NotAnAllocId(alloc_id));
    }
    let (wait, progress) = wait_of(query)?;
    let token = token_of(headers).ok_or(ApiError::NoToken)?;
    let claims: Claims = ctx.verifier.verify(&token).await.map_err(|e| match e {
        crate::nomad::identity::IdentityError::Jwks(_) => ApiError::KeysUnavailable(e.to_string()),
        _ => ApiError::TokenRejected(e.to_string()),
    })?;
    if claims.nomad_allocation_id != alloc_id {
        return Err(ApiError::OtherAllocation {
            token_alloc: claims.nomad_allocation_id,
            alloc_id,
        });
    }
    ctx.admission.authenticated(&alloc_id, caller);
    // Held while the call waits: one allocation cannot hold the agent in more calls.
    let _slot = ctx.admission.publish(&alloc_id).map_err(|why| {
        if let Some(n) = ctx
            .warnings
            .note(format!("{why:?}"), std::time::Instant::now())
        {
            tracing::warn!(alloc_id = %alloc_id, not_logged_before = n, "{}", why.what());
        }
        ApiError::TooManyCalls {
            alloc_id: alloc_id.clone(),
            max: ctx.limits.max_per_allocation,
        }
    })?;
    let (tx, rx) = oneshot::channel();
    let request = PublishRequest {
        alloc_id,
        namespace: claims.nomad_namespace,
        wait,
        progress,
    };
    ctx.agent
        .send(Request2Agent::Publish { request, reply: tx })
        .await
        .map_err(|_| ApiError::ShuttingDown)?;
    rx.await.map_err(|_| ApiError::ShuttingDown)?
}

/// Client side of the API, for `dhv-binder prestart` and `dhv-binder status`.
pub mod client {
    use super::*;
    use tokio::net::UnixStream;

    /// A failed call: transport, or an API error with its status.
    #[derive(Debug, thiserror::Error)]
    pub enum CallError {
        #[error("cannot reach dhv-binder at {path}: {source} (is the dhv-binder system job running on this node, and is its socket volume mounted into this task?)")]
        Connect {
            path: String,
            #[source]
            source: std::io::Error,
        },
        #[error("the local API call failed: {0}")]
        Http(String),
        #[error("{message} (HTTP {status})")]
        Api {
            status: u16,
            message: String,
            retryable: bool,
        },
    }

    impl CallError {
        /// True when trying again may succeed.
        pub fn is_retryable(&self) -> bool {
            match self {
                CallError::Connect { .. } | CallError::Http(_) => true,
                CallError::Api { retryable, .. } => *retryable,
            }
        }
    }

    /// Sends one request and returns the JSON body of a 2xx answer.
    pub async fn call(
        socket: &Path,
        method: Method,
        uri: &str,
        token: Option<&str>,
    ) -> Result<serde_json::Value, CallError> {
        let stream = UnixStream::connect(socket)
            .await
            .map_err(|source| CallError::Connect {
                path: socket.display().to_string(),
                source,
            })?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| CallError::Http(e.to_string()))?;
        tokio::spawn(conn);
        let mut rb = Request::builder()
            .method(method)
            .uri(uri)
            .header("Host", "dhv-binder");
        if let Some(t) = token {
            rb = rb.header("Authorization", format!("Bearer {t}"));
        }
        let req = rb
            .body(Full::new(Bytes::new()))
            .map_err(|e| CallError::Http(e.to_string()))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| CallError::Http(e.to_string()))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| CallError::Http(e.to_string()))?
            .to_bytes();
        if status.is_success() {
            return serde_json::from_slice(&body).map_err(|e| CallError::Http(e.to_string()));
        }
        let (message, retryable) = match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(b) => (b.error, b.retryable),
            Err(_) => (
                String::from_utf8_lossy(&body).into_owned(),
                status.is_server_error(),
            ),
        };
        Err(CallError::Api {
            status: status.as_u16(),
            message,
            retryable,
        })
    }
}

#[cfg(test)]
mod tests {
    //! The router over a real unix socket in the test's temp dir: every endpoint, every
    //! routing status, the error body, and the decisions taken before the agent is asked.
    use super::*;

    const ALLOC: &str = "00000000-0000-4000-8000-000000000001";

    /// Serves the API on a socket in a temp dir; the agent side answers status requests
    /// with `{"ok":true}` and keeps publish requests (returned through the receiver).
    async fn start() -> (
        tempfile::TempDir,
        std::path::PathBuf,
        mpsc::Receiver<PublishRequest>,
    ) {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("api.sock");
        let (listener, guard) = bind(&path).expect("bind");
        // Nomad is never reached in these tests but one: port 1 on loopback refuses.
        let client =
            crate::nomad::Client::new(&crate::config::NomadConfig::plain("http://127.0.0.1:1"))
                .expect("client");
        let (tx, mut rx) = mpsc::channel(8);
        let (pubs_tx, pubs) = mpsc::channel(8);
        tokio::spawn(serve(listener, Verifier::new(client, &[]), tx));
        tokio::spawn(async move {
            let _guard = guard;
            while let Some(r) = rx.recv().await {
                match r {
                    Request2Agent::Status { reply } => {
                        let _ = reply.send(serde_json::json!({"ok": true}));
                    }
                    Request2Agent::Publish { request, .. } => {
                        let _ = pubs_tx.send(request).await;
                    }
                }
            }
        });
        (dir, path, pubs)
    }

    async fn status_of(path: &Path, method: Method, uri: &str, token: Option<&str>) -> u16 {
        match client::call(path, method.clone(), uri, token).await {
            Ok(_) => 200,
            Err(client::CallError::Api { status, .. }) => status,
            Err(e) => panic!("{method} {uri}: {e}"),
        }
    }

    #[tokio::test]
    async fn routes_answer_with_the_statuses_of_their_errors() {
        let (_dir, p, _pubs) = start().await;
        let publish = format!("/v1/allocations/{ALLOC}/publish");
        assert_eq!(status_of(&p, Method::GET, "/v1/health", None).await, 200);
        assert_eq!(status_of(&p, Method::GET, "/v1/nothing", None).await, 404);
        assert_eq!(status_of(&p, Method::POST, "/v1/health", None).await, 404);
        assert_eq!(status_of(&p, Method::GET, &publish, None).await, 405);
        assert_eq!(status_of(&p, Method::DELETE, "/v1/status", None).await, 405);
        let bad_id = "/v1/allocations/not-an-id/publish";
        assert_eq!(status_of(&p, Method::POST, bad_id, None).await, 400);
        let bad_wait = format!("{publish}?wait=soon");
        assert_eq!(status_of(&p, Method::POST, &bad_wait, None).await, 400);
        assert_eq!(status_of(&p, Method::POST, &publish, None).await, 401);
        // A token that is not a JWT: refused for good.
        assert_eq!(
            status_of(&p, Method::POST, &publish, Some("a.b.c")).await,
            403
        );
        // A JWT (header {"alg":"RS256","kid":"k1"}) whose keys cannot be fetched (Nomad
        // refuses): retryable 503.
        let jwt = "eyJhbGciOiJSUzI1NiIsImtpZCI6ImsxIiwidHlwIjoiSldUIn0.e30.c2ln";
        match client::call(&p, Method::POST, &publish, Some(jwt)).await {
            Err(client::CallError::Api {
                status, retryable, ..
            }) => assert_eq!((status, retryable), (503, true)),
            other => panic!("expected 503: {other:?}"),
        }
        // Status is for root: the peer UID of the connection decides.
        let root = nix::unistd::geteuid().is_root();
        let want = if root { 200 } else { 403 };
        assert_eq!(status_of(&p, Method::GET, "/v1/status", None).await, want);
    }

    /// Issue 46 #2: `progress` and `seen` are read when given (a `seen` that is not a
    /// report's digest counts as nothing seen); without them the call answers at the end
    /// only, as for an older prestart.
    #[test]
    fn progress_is_asked_for_with_the_query_and_absent_without() {
        let q = |wait: Option<&str>, progress: Option<&str>, seen: Option<&str>| {
            wait_of(Ok(Query(PublishQuery {
                wait: wait.map(String::from),
                progress: progress.map(String::from),
                seen: seen.map(String::from),
            })))
        };
        assert_eq!(q(None, None, None).unwrap(), (DEFAULT_WAIT, None));
        let id = WaitReport::of("held".into()).id;
        assert_eq!(id.len(), 16);
        let (wait, p) = q(Some("90000ms"), Some("30s"), Some(&id)).unwrap();
        assert_eq!(wait, Duration::from_secs(90));
        assert_eq!(
            p,
            Some(Progress {
                after: Duration::from_secs(30),
                seen: id
            })
        );
        let (_, p) = q(None, Some("1s"), Some("not-a-digest")).unwrap();
        assert_eq!(p.unwrap().seen, "");
        assert!(q(None, Some("soon"), None).is_err());
    }

    #[tokio::test]
    async fn errors_carry_their_message_and_whether_to_retry() {
        let (_dir, p, _pubs) = start().await;
        let e = client::call(&p, Method::GET, "/v1/nothing", None)
            .await
            .unwrap_err();
        match e {
            client::CallError::Api {
                status,
                message,
                retryable,
            } => {
                assert_eq!(status, 404);
                assert_eq!(message, "no such endpoint: /v1/nothing");
                assert!(!retryable);
            }
            other => panic!("{other:?}"),
        }
    }
}
