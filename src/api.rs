//! The local API: HTTP/1.1 on a unix socket, called by prestart tasks (`dhv-binder prestart`)
//! and by operators (`dhv-binder status`).
//!
//! - `POST /v1/allocations/<alloc_id>/publish[?wait=<duration>]` with the caller's Nomad
//!   workload identity token (`Authorization: Bearer <jwt>` or `X-Nomad-Token`): blocks until
//!   every deferred volume of that allocation is published on this node. 200 with
//!   `{"alloc_id","volumes":[{"namespace","name","path","read_only"}]}`; errors are
//!   `{"error":"...","retryable":bool}` with the status codes of [`ApiError`].
//! - `GET /v1/status`: the agent's state, for callers with peer UID 0 only.
//! - `GET /v1/health`: `{"ready":bool}` (anyone).

use crate::identity::{Claims, Verifier};
use crate::volume::is_alloc_id;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
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
            AllocationStopped { .. } => (StatusCode::CONFLICT, false),
            KeysUnavailable(_) | PublishFailed { .. } | Waiting(_) | Nomad(_) | ShuttingDown => {
                (StatusCode::SERVICE_UNAVAILABLE, true)
            }
            AllocationNotSeen { .. } | NotPublishedInTime { .. } => {
                (StatusCode::GATEWAY_TIMEOUT, true)
            }
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
}

/// A verified caller's publish request.
#[derive(Debug, Clone)]
pub struct PublishRequest {
    pub alloc_id: String,
    /// The namespace of the caller's workload identity.
    pub namespace: String,
    /// How long the caller waits at most.
    pub wait: Duration,
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

/// Serves the API until the listener fails or the agent goes away.
pub async fn serve(listener: UnixListener, verifier: Verifier, agent: mpsc::Sender<Request2Agent>) {
    let ctx = Arc::new(Ctx { verifier, agent });
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "local API accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let peer_uid = stream.peer_cred().map(|c| c.uid()).ok();
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let ctx = ctx.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(&ctx, req, peer_uid).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
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

fn token_of(req: &Request<Incoming>) -> Option<String> {
    let h = req.headers();
    if let Some(v) = h.get("authorization").and_then(|v| v.to_str().ok()) {
        if let Some(t) = v.strip_prefix("Bearer ") {
            return Some(t.trim().to_string());
        }
    }
    h.get("x-nomad-token")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_string())
}

fn wait_of(req: &Request<Incoming>) -> Result<Duration, ApiError> {
    let Some(q) = req.uri().query() else {
        return Ok(DEFAULT_WAIT);
    };
    for pair in q.split('&') {
        if let Some(v) = pair.strip_prefix("wait=") {
            return humantime::parse_duration(v)
                .map(|d| d.min(MAX_WAIT))
                .map_err(|e| ApiError::BadWait {
                    value: v.to_string(),
                    reason: e.to_string(),
                });
        }
    }
    Ok(DEFAULT_WAIT)
}

async fn handle(ctx: &Ctx, req: Request<Incoming>, peer_uid: Option<u32>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_string();
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (req.method(), segs.as_slice()) {
        (&Method::POST, ["v1", "allocations", alloc_id, "publish"]) => {
            let alloc_id = alloc_id.to_string();
            match publish(ctx, &req, alloc_id).await {
                Ok(r) => json(StatusCode::OK, &r),
                Err(e) => error(e),
            }
        }
        (&Method::GET, ["v1", "status"]) => {
            if peer_uid != Some(0) {
                return error(ApiError::NotRoot);
            }
            let (tx, rx) = oneshot::channel();
            if ctx
                .agent
                .send(Request2Agent::Status { reply: tx })
                .await
                .is_err()
            {
                return error(ApiError::ShuttingDown);
            }
            match rx.await {
                Ok(v) => json(StatusCode::OK, &v),
                Err(_) => error(ApiError::ShuttingDown),
            }
        }
        (&Method::GET, ["v1", "health"]) => {
            json(StatusCode::OK, &serde_json::json!({"ready": true}))
        }
        (_, ["v1", "allocations", _, "publish"]) | (_, ["v1", "status"]) => {
            error(ApiError::MethodNotAllowed(req.method().to_string()))
        }
        _ => error(ApiError::NoSuchEndpoint(path)),
    }
}

async fn publish(
    ctx: &Ctx,
    req: &Request<Incoming>,
    alloc_id: String,
) -> Result<PublishReply, ApiError> {
    if !is_alloc_id(&alloc_id) {
        return Err(ApiError::NotAnAllocId(alloc_id));
    }
    let wait = wait_of(req)?;
    let token = token_of(req).ok_or(ApiError::NoToken)?;
    let claims: Claims = ctx.verifier.verify(&token).await.map_err(|e| match e {
        crate::identity::IdentityError::Jwks(_) => ApiError::KeysUnavailable(e.to_string()),
        _ => ApiError::TokenRejected(e.to_string()),
    })?;
    if claims.nomad_allocation_id != alloc_id {
        return Err(ApiError::OtherAllocation {
            token_alloc: claims.nomad_allocation_id,
            alloc_id,
        });
    }
    let (tx, rx) = oneshot::channel();
    let request = PublishRequest {
        alloc_id,
        namespace: claims.nomad_namespace,
        wait,
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
