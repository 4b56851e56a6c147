//! Thin Nomad HTTP API client: the calls dhv-binder makes, with Nomad's error semantics.
//!
//! Connection settings follow the Nomad CLI's environment conventions (see [`crate::config`]).

pub mod events;
pub mod identity;
pub(crate) mod retry;
pub mod route;
pub(crate) mod scan;
pub mod transport;
pub mod types;
pub mod watch;

use crate::config::NomadConfig;
use reqwest::{Method, StatusCode};
use route::{capability_for, Route};
use serde::de::DeserializeOwned;
use std::time::Duration;
use types::*;

/// A failed Nomad API call. Messages say what to do; they never contain the token.
#[derive(Debug, thiserror::Error)]
pub enum NomadError {
    /// Nomad could not be reached at all.
    #[error("cannot reach Nomad at {addr} ({what}): {source}{detail}; {hint}")]
    Unreachable {
        addr: String,
        what: String,
        #[source]
        source: reqwest::Error,
        /// The innermost cause (reqwest's own message hides it: "error sending request").
        detail: String,
        /// What to check: the TLS settings for a handshake failure, else the address.
        hint: &'static str,
    },
    /// 403: the token lacks a capability. `reason` is Nomad's own answer (its body, bounded
    /// and control-escaped, e.g. "Permission denied"); `needs` the capability the call
    /// takes, for the hint.
    #[error("Nomad refused {what}: {reason} (HTTP 403); the token needs {needs}: the daemon's policy is jobspecs/dhv-binder-policy.hcl, an operator's jobspecs/operator-policy.hcl")]
    PermissionDenied {
        what: String,
        reason: String,
        needs: String,
    },
    /// 401: no token, or an expired or unknown one.
    #[error("Nomad refused {what}: the token is missing, unknown or expired; set NOMAD_TOKEN or --token-file")]
    Unauthorized { what: String },
    /// A read that is not a blocking query got no whole answer in time (`after`, the
    /// watcher's idle timeout): its connection is taken as dead (half-open) and the watcher
    /// reconnects. Transient.
    #[error("Nomad did not answer the request to {what} within {after:?}; treating the connection as dead and reconnecting (check the network path to NOMAD_ADDR, or raise --stream-idle-timeout for a slow link)")]
    TimedOut { what: String, after: Duration },
    /// 500 "No cluster leader" (an election is in progress), or the Task API's 500 "Server
    /// error authenticating request" (it could not reach the servers to check the token:
    /// an election, or its agent restarting); retry.
    #[error("Nomad has no cluster leader right now, or its agent cannot reach the servers ({what}); retrying")]
    NoLeader { what: String },
    /// 409 on a variable write with `cas`: the variable changed; the current one is attached.
    #[error("variable {path} changed concurrently (check-and-set conflict)")]
    CasConflict {
        path: String,
        current: Box<Variable>,
    },
    /// Any other non-success status.
    #[error("Nomad answered {status} to {what}: {body}")]
    Status {
        what: String,
        status: u16,
        body: String,
    },
    /// The body was not the JSON Nomad sends.
    #[error("Nomad's answer to {what} could not be decoded: {source}")]
    Decode {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    /// The answer was larger than dhv-binder reads for one call.
    #[error("Nomad's answer to {what} is larger than {limit} bytes and was not read")]
    TooLarge { what: String, limit: usize },
    /// The client itself could not be built (bad TLS files, bad address).
    #[error("cannot configure the Nomad client: {0}")]
    Config(String),
    /// A request that is refused before it is sent: a value that cannot be a path segment
    /// or a variable path (see [`route::Route`]). Nothing left the node.
    #[error("not sent: {what}: {reason}")]
    BadRequest { what: String, reason: String },
    /// Nomad answered a variable read with another variable (its `Path` or `Namespace`
    /// differs from what was asked): the answer is dropped.
    #[error("Nomad's answer to {what} is for {got}, not {asked}; dropped")]
    Mismatch {
        what: String,
        asked: String,
        got: String,
    },
}

impl NomadError {
    /// True for errors worth retrying with backoff (network, leader election, 5xx).
    pub fn is_transient(&self) -> bool {
        match self {
            NomadError::Unreachable { .. }
            | NomadError::NoLeader { .. }
            | NomadError::TimedOut { .. } => true,
            NomadError::Status { status, .. } => *status >= 500 || *status == 429,
            _ => false,
        }
    }

    /// True for 401/403: retrying with the same token will not help.
    pub fn is_auth(&self) -> bool {
        matches!(
            self,
            NomadError::PermissionDenied { .. } | NomadError::Unauthorized { .. }
        )
    }
}

/// A variable lock operation (`PUT /v1/var/:path?<op>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockOp {
    /// `lock-acquire`: creates or overwrites the variable with a new lock.
    Acquire,
    /// `lock-renew`: restarts the lock's TTL timer.
    Renew,
    /// `lock-release`: removes the lock, keeps the Items.
    Release,
}

impl LockOp {
    /// The query parameter naming the operation.
    pub fn query(self) -> &'static str {
        match self {
            LockOp::Acquire => "lock-acquire",
            LockOp::Renew => "lock-renew",
            LockOp::Release => "lock-release",
        }
    }

    fn what(self) -> &'static str {
        match self {
            LockOp::Acquire => "acquire a lock (PUT /v1/var/:path?lock-acquire)",
            LockOp::Renew => "renew a lock (PUT /v1/var/:path?lock-renew)",
            LockOp::Release => "release a lock (PUT /v1/var/:path?lock-release)",
        }
    }
}

/// The result of a blocking query: the body and the `X-Nomad-Index` header.
#[derive(Debug, Clone)]
pub struct Indexed<T> {
    pub value: T,
    pub index: u64,
}

/// A Nomad API client bound to one agent address and token.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    streaming: reqwest::Client,
    /// The address as configured, for messages.
    addr: String,
    /// The URL base of requests (see [`transport::Endpoint::base_url`]); each request's
    /// [`Route`] is appended segment by segment.
    base: reqwest::Url,
    /// Shared by every clone, so that a token re-read from its file reaches all callers.
    token: std::sync::Arc<std::sync::RwLock<Option<String>>>,
    region: Option<String>,
    /// NOMAD_HTTP_AUTH as (user, password): basic auth sent with every request.
    http_auth: Option<(String, Option<String>)>,
    /// The last list of the node's allocations was at least [`ROTATE_AFTER_BYTES`]: the
    /// next one closes its connection. Shared by clones (one watch loop asks).
    rotate_list: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Other agents for claim lock calls while the local one cannot be connected to
    /// ([`Client::with_fallbacks`]).
    fallbacks: std::sync::Arc<Vec<Client>>,
    /// The settings this client was built from ([`Client::with_own_connections`]).
    settings: std::sync::Arc<NomadConfig>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("addr", &self.addr).finish()
    }
}

/// The longest a single variable read (`GET /v1/var/:path` that is no blocking query) may
/// take, answer included: a record read for the catalogue or a prestart never waits longer
/// on one request (blocking queries have the client's 400 s for their `wait`).
pub const VARIABLE_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Idle connections kept to the Nomad agent, per client (the agent uses two).
const POOL_IDLE_PER_HOST: usize = 4;
/// An idle connection is closed after this long.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// A list of the node's allocations at least this large (bytes of JSON) makes the next list
/// request close its connection once answered (`Connection: close`). Reading a large answer
/// grows the connection's read buffer to hyper's cap (`DEFAULT_MAX_BUFFER_SIZE`, 408 KiB,
/// `proto/h1/io.rs`; up to about twice that as the buffer grows), and a kept-alive
/// connection keeps that buffer for as long as it lives: the blocking query's connection
/// never idles, so it held 0.35–0.85 MiB after a 400-volume teardown (docs/scale.md). A
/// fresh connection starts at 8 KiB. The next request, not this one: the answer is already
/// read, and closing the connection it came on would cost the blocking query's next wait.
/// A list that is no blocking query (`index` 0: the first list, a relist after a fault, in
/// stream mode every resync) always closes its own connection: it is rare, and the whole
/// list, and would otherwise leave its grown buffer in the pool for the stream's reads.
pub const ROTATE_AFTER_BYTES: usize = 256 * 1024;

/// A transport failure as [`NomadError::Unreachable`], with the innermost cause and a hint:
/// a TLS handshake failure (unknown issuer, no client certificate) points at the TLS
/// settings, anything else at the address.
fn unreachable(addr: &str, what: impl Into<String>, source: reqwest::Error) -> NomadError {
    let mut inner: &dyn std::error::Error = &source;
    while let Some(next) = inner.source() {
        inner = next;
    }
    let detail = inner.to_string();
    let source_text = source.to_string();
    let lower = detail.to_ascii_lowercase();
    let tls = ["certificate", "tls", "handshake", "issuer", "alert"]
        .iter()
        .any(|w| lower.contains(w));
    NomadError::Unreachable {
        addr: addr.to_string(),
        what: what.into(),
        source,
        detail: if detail == source_text {
            String::new()
        } else {
            let d: String = crate::escape::escape_control(&detail)
                .chars()
                .take(300)
                .collect();
            format!(" ({d})")
        },
        hint: if tls {
            "a TLS handshake failed: check NOMAD_CACERT or NOMAD_CAPATH (the only CAs trusted), and NOMAD_CLIENT_CERT/NOMAD_CLIENT_KEY when the agent verifies clients (verify_https_client); the agent's certificate must name the host in NOMAD_ADDR, or set NOMAD_TLS_SERVER_NAME to a name it carries (e.g. server.global.nomad)"
        } else {
            "check NOMAD_ADDR and that the local Nomad agent runs"
        },
    }
}

impl Client {
    /// Builds a client from Nomad CLI-style settings. Errors when TLS files cannot be read.
    pub fn new(cfg: &NomadConfig) -> Result<Self, NomadError> {
        let endpoint = transport::Endpoint::parse(&cfg.address)
            .map_err(|e| NomadError::Config(e.to_string()))?;
        let server_name = match (&cfg.tls_server_name, &endpoint) {
            (Some(n), transport::Endpoint::Tcp(base)) if !n.trim().is_empty() => {
                Some(transport::ServerName::new(base, n.trim())?)
            }
            _ => None,
        };
        let http_auth =
            cfg.http_auth
                .as_deref()
                .filter(|a| !a.is_empty())
                .map(|a| match a.split_once(':') {
                    Some((u, p)) => (u.to_string(), Some(p.to_string())),
                    None => (a.to_string(), None),
                });
        let build = |timeout: Option<Duration>| -> Result<reqwest::Client, NomadError> {
            let mut b = reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(10))
                // A burst of concurrent requests (placeholders, claims, reads) opens one
                // connection each; keeping them all idle held ~30 KiB apiece (400 volumes:
                // 13 MiB after the teardown, docs/scale.md). A few stay for reuse.
                .pool_max_idle_per_host(POOL_IDLE_PER_HOST)
                .pool_idle_timeout(POOL_IDLE_TIMEOUT)
                .user_agent(concat!("dhv-binder/", env!("CARGO_PKG_VERSION")));
            if let Some(t) = timeout {
                b = b.timeout(t);
            }
            // Nomad's API never redirects: a 3xx is an answer, and no request (with its
            // X-Nomad-Token, which reqwest would not strip) goes to another origin.
            b = b.redirect(reqwest::redirect::Policy::none());
            // Go's ProxyFromEnvironment never proxies loopback: neither do we.
            if is_loopback(&cfg.address) {
                b = b.no_proxy();
            }
            // NOMAD_CACERT wins over NOMAD_CAPATH (go-rootcerts `LoadCACerts`); either
            // replaces the trust roots (the Nomad CLI trusts only them).
            let roots = match (&cfg.ca_cert, &cfg.ca_path) {
                (Some(ca), _) => Some(transport::ca_file(ca, "NOMAD_CACERT")?),
                (None, Some(dir)) => Some(transport::ca_dir(dir)?),
                (None, None) => None,
            };
            if let Some(certs) = roots {
                b = b.tls_built_in_root_certs(false);
                for cert in certs {
                    b = b.add_root_certificate(cert);
                }
            }
            if let Some(name) = &server_name {
                b = b.dns_resolver(std::sync::Arc::new(name.clone()));
            }
            if let (Some(cert), Some(key)) = (&cfg.client_cert, &cfg.client_key) {
                let mut pem = std::fs::read(cert).map_err(|e| {
                    NomadError::Config(format!("NOMAD_CLIENT_CERT {}: {e}", cert.display()))
                })?;
                pem.extend(std::fs::read(key).map_err(|e| {
                    NomadError::Config(format!("NOMAD_CLIENT_KEY {}: {e}", key.display()))
                })?);
                let id = reqwest::Identity::from_pem(&pem)
                    .map_err(|e| NomadError::Config(format!("client certificate: {e}")))?;
                b = b.identity(id);
            }
            if cfg.skip_verify {
                b = b.danger_accept_invalid_certs(true);
            }
            b = endpoint.configure(b);
            b.build().map_err(|e| NomadError::Config(e.to_string()))
        };
        Ok(Self {
            // Blocking queries wait up to `wait` (we use at most 5 min) plus Nomad's jitter.
            http: build(Some(Duration::from_secs(400)))?,
            streaming: build(None)?,
            addr: cfg.address.trim_end_matches('/').to_string(),
            base: reqwest::Url::parse(&match &server_name {
                Some(n) => n.base_url(),
                None => endpoint.base_url(),
            })
            .map_err(|e| NomadError::Config(format!("NOMAD_ADDR {}: {e}", cfg.address)))?,
            token: std::sync::Arc::new(std::sync::RwLock::new(cfg.token.clone())),
            region: cfg.region.clone(),
            http_auth,
            rotate_list: Default::default(),
            fallbacks: Default::default(),
            settings: std::sync::Arc::new(cfg.clone()),
        })
    }

    /// A client to the same agents (and fallbacks) with connections of its own, sharing
    /// this one's token: a client's connections are driven by the runtime that opened them,
    /// so work on another runtime (the claim renewals' thread, `crate::agent::renewer`) needs
    /// its own. Errors as [`Client::new`].
    pub fn with_own_connections(&self) -> Result<Client, NomadError> {
        let mut c = Client::new(&self.settings)?;
        c.token = self.token.clone();
        c.fallbacks = std::sync::Arc::new(
            self.fallbacks
                .iter()
                .map(Client::with_own_connections)
                .collect::<Result<_, _>>()?,
        );
        Ok(c)
    }

    /// This client, with `addresses` (other Nomad agents, e.g. the servers) to send lock
    /// operations ([`Client::lock_op`]) to while the configured agent cannot be connected to:
    /// a local client agent that restarts takes its socket and port away for as long as it
    /// fingerprints and restores (`client/client.go` `NewClient`), longer than a claim's
    /// lease may allow. Same TLS settings; the token is shared with this client (a re-read
    /// token reaches them too). Errors as [`Client::new`].
    pub fn with_fallbacks(
        mut self,
        cfg: &NomadConfig,
        addresses: &[String],
    ) -> Result<Self, NomadError> {
        let mut out = Vec::new();
        for a in addresses.iter().filter(|a| !a.trim().is_empty()) {
            let mut c = Client::new(&NomadConfig {
                address: a.trim().to_string(),
                ..cfg.clone()
            })?;
            c.token = self.token.clone();
            out.push(c);
        }
        self.fallbacks = std::sync::Arc::new(out);
        Ok(self)
    }

    /// Replaces the token of this client and of all its clones. Returns true when it changed.
    pub fn set_token(&self, token: Option<String>) -> bool {
        let mut t = self.token.write().unwrap_or_else(|e| e.into_inner());
        let changed = *t != token;
        *t = token;
        changed
    }

    /// The agent address this client talks to.
    pub fn address(&self) -> &str {
        &self.addr
    }

    /// A request to `route` (its URL built from encoded segments, [`Route::url`]) with the
    /// token, region and basic auth. Errors: [`NomadError::BadRequest`].
    fn request(
        &self,
        client: &reqwest::Client,
        method: Method,
        route: &Route,
    ) -> Result<reqwest::RequestBuilder, NomadError> {
        let mut rb = client.request(method, route.url(&self.base)?);
        if let Some(t) = &*self.token.read().unwrap_or_else(|e| e.into_inner()) {
            rb = rb.header("X-Nomad-Token", t);
        }
        if let Some(r) = &self.region {
            rb = rb.query(&[("region", r)]);
        }
        if let Some((user, password)) = &self.http_auth {
            rb = rb.basic_auth(user, password.as_ref());
        }
        Ok(rb)
    }

    async fn send(
        &self,
        rb: reqwest::RequestBuilder,
        what: &str,
        path: &Route,
    ) -> Result<reqwest::Response, NomadError> {
        let resp = rb
            .send()
            .await
            .map_err(|source| unreachable(&self.addr, what, source))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = error_text(resp).await;
        let body = body.trim().chars().take(512).collect::<String>();
        Err(match status {
            StatusCode::FORBIDDEN => NomadError::PermissionDenied {
                what: what.to_string(),
                reason: forbidden_reason(&body),
                needs: capability_for(path),
            },
            StatusCode::UNAUTHORIZED => NomadError::Unauthorized {
                what: what.to_string(),
            },
            // "No cluster leader" (through a client agent "rpc error: No cluster leader"),
            // or the Task API's "Server error authenticating request": its `ACL.WhoAmI`
            // failed (an election, or the client agent not registered yet after a restart;
            // `command/agent/http.go` `authMiddleware.ServeHTTP`). Both pass; retry.
            StatusCode::INTERNAL_SERVER_ERROR
                if body.contains("No cluster leader")
                    || body.contains("Server error authenticating request") =>
            {
                NomadError::NoLeader {
                    what: what.to_string(),
                }
            }
            _ => NomadError::Status {
                what: what.to_string(),
                status: status.as_u16(),
                body,
            },
        })
    }

    async fn get_json<T: DeserializeOwned>(
        &self,
        path: &Route,
        query: &[(&str, String)],
        what: &str,
    ) -> Result<Indexed<T>, NomadError> {
        let rb = self.request(&self.http, Method::GET, path)?.query(query);
        Ok(self.read_json(rb, path, what).await?.0)
    }

    /// Sends `rb` (a read of `path`) and decodes its JSON answer (at most [`MAX_BODY`]),
    /// with the answer's index and its size in bytes.
    async fn read_json<T: DeserializeOwned>(
        &self,
        rb: reqwest::RequestBuilder,
        path: &Route,
        what: &str,
    ) -> Result<(Indexed<T>, usize), NomadError> {
        let (bytes, index) = self.read_bytes(rb, path, what).await?;
        let value = serde_json::from_slice(&bytes).map_err(|source| NomadError::Decode {
            what: what.to_string(),
            source,
        })?;
        Ok((Indexed { value, index }, bytes.len()))
    }

    /// A successful answer's body (at most [`MAX_BODY`] bytes) and its `X-Nomad-Index`.
    async fn read_bytes(
        &self,
        rb: reqwest::RequestBuilder,
        path: &Route,
        what: &str,
    ) -> Result<(bytes::Bytes, u64), NomadError> {
        let resp = self.send(rb, what, path).await?;
        let index = header_index(&resp);
        let bytes = body_limited(resp, MAX_BODY)
            .await
            .map_err(|source| unreachable(&self.addr, what, source))?
            .ok_or_else(|| NomadError::TooLarge {
                what: what.to_string(),
                limit: MAX_BODY,
            })?;
        Ok((bytes, index))
    }

    /// A read where 404 means "absent": `Ok(None)`.
    async fn get_optional<T: DeserializeOwned>(
        &self,
        path: &Route,
        query: &[(&str, String)],
        what: &str,
    ) -> Result<Option<T>, NomadError> {
        match self.get_json(path, query, what).await {
            Ok(v) => Ok(Some(v.value)),
            Err(NomadError::Status { status: 404, .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Nomad API: `GET /v1/agent/self`. Used to learn the local node's ID and pool.
    pub async fn agent_self(&self) -> Result<AgentSelf, NomadError> {
        Ok(self
            .get_json(
                &Route::v1(&["agent", "self"]),
                &[],
                "read the local agent (GET /v1/agent/self)",
            )
            .await?
            .value)
    }

    /// Nomad API: `GET /v1/namespace/:name`. False on 404 ("Namespace not found",
    /// `command/agent/namespace_endpoint.go` `namespaceQuery`): Nomad creates no namespace
    /// on demand, so a job or host volume in a missing one is refused.
    pub async fn namespace_exists(&self, name: &str) -> Result<bool, NomadError> {
        self.exists(
            &Route::v1(&["namespace", name]),
            "read a namespace (GET /v1/namespace/:name)",
        )
        .await
    }

    /// A read of `path` for its existence only: false on 404.
    async fn exists(&self, path: &Route, what: &str) -> Result<bool, NomadError> {
        let found: Option<serde::de::IgnoredAny> = self.get_optional(path, &[], what).await?;
        Ok(found.is_some())
    }

    /// Nomad API: `GET /v1/node/:node_id` (needs `node:read`). True when Nomad knows the
    /// node, false on 404 ("node not found": purged, or a wrong ID). Needed because
    /// `GET /v1/node/:id/allocations` answers `200 []` for an unknown node
    /// (`nomad/node_endpoint.go` `GetAllocs`), which looks like a node with nothing on it.
    pub async fn node_exists(&self, node_id: &str) -> Result<bool, NomadError> {
        self.exists(
            &Route::v1(&["node", node_id]),
            "read this node (GET /v1/node/:id)",
        )
        .await
    }

    /// Nomad API: `GET /v1/node/:node_id` (needs `node:read`): the node's `Status` (`ready`,
    /// `down`, `disconnected`, `initializing`), `None` when Nomad does not know the node.
    pub async fn node_status(&self, node_id: &str) -> Result<Option<String>, NomadError> {
        #[derive(serde::Deserialize)]
        struct Node {
            #[serde(rename = "Status", default)]
            status: String,
        }
        let node: Option<Node> = self
            .get_optional(
                &Route::v1(&["node", node_id]),
                &[],
                "read a node (GET /v1/node/:id)",
            )
            .await?;
        Ok(node.map(|n| n.status))
    }

    /// Nomad API: `GET /v1/node/:node_id` (needs `node:read`): what a volume's
    /// constraints are evaluated against (ID, Name, NodeClass, Datacenter, NodePool,
    /// Attributes, Meta), `None` when Nomad does not know the node.
    pub async fn node_facts(
        &self,
        node_id: &str,
    ) -> Result<Option<crate::nomad::types::NodeFacts>, NomadError> {
        self.get_optional(
            &Route::v1(&["node", node_id]),
            &[],
            "read this node's attributes (GET /v1/node/:id)",
        )
        .await
    }

    /// Nomad API: `GET /v1/node/:node_id` (needs `node:read`): the node's `Name`, `None`
    /// when Nomad does not know the node.
    pub async fn node_name(&self, node_id: &str) -> Result<Option<String>, NomadError> {
        #[derive(serde::Deserialize)]
        struct Node {
            #[serde(rename = "Name", default)]
            name: String,
        }
        let node: Option<Node> = self
            .get_optional(
                &Route::v1(&["node", node_id]),
                &[],
                "read a node (GET /v1/node/:id)",
            )
            .await?;
        Ok(node.map(|n| n.name))
    }

    /// Nomad API: `GET /v1/node/:node_id/allocations`, a blocking query when `index > 0`
    /// (returns once the allocation table's index exceeds `index`, or after `wait`). With
    /// the answer's size in bytes: every allocation of the node with its Job, terminal ones
    /// too until the servers collect them.
    pub async fn node_allocations(
        &self,
        node_id: &str,
        index: u64,
        wait: Duration,
    ) -> Result<(Indexed<Vec<Allocation>>, usize), NomadError> {
        let what = "list the node's allocations (GET /v1/node/:id/allocations)";
        let (body, index) = self.list_node_allocations(node_id, index, wait).await?;
        let value = serde_json::from_slice(&body).map_err(|source| NomadError::Decode {
            what: what.to_string(),
            source,
        })?;
        Ok((Indexed { value, index }, body.len()))
    }

    /// [`Client::node_allocations`], each allocation decoded only as far as its ID and
    /// ModifyIndex ([`ListedAlloc`]): for answers of which only the changes are decoded.
    /// With the answer's size in bytes.
    pub async fn node_allocations_listed(
        &self,
        node_id: &str,
        index: u64,
        wait: Duration,
    ) -> Result<(Indexed<Vec<ListedAlloc>>, usize), NomadError> {
        let what = "list the node's allocations (GET /v1/node/:id/allocations)";
        let (body, index) = self.list_node_allocations(node_id, index, wait).await?;
        let bytes = body.len();
        let value = ListedAlloc::list(body).map_err(|source| NomadError::Decode {
            what: what.to_string(),
            source,
        })?;
        Ok((Indexed { value, index }, bytes))
    }

    /// The answer's bytes and its index.
    async fn list_node_allocations(
        &self,
        node_id: &str,
        index: u64,
        wait: Duration,
    ) -> Result<(bytes::Bytes, u64), NomadError> {
        use std::sync::atomic::Ordering;
        let mut q = vec![];
        if index > 0 {
            q.push(("index", index.to_string()));
            q.push(("wait", format!("{}s", wait.as_secs().max(1))));
        }
        let path = Route::v1(&["node", node_id, "allocations"]);
        let mut rb = self.request(&self.http, Method::GET, &path)?.query(&q);
        // A list that is not a blocking query (the first, a relist after a fault, and in
        // stream mode every resync and a burst's reads) is rare and the whole list: its own
        // connection closes, so that its read buffer does not stay with a pooled one.
        if self.rotate_list.swap(false, Ordering::Relaxed) || index == 0 {
            rb = rb.header(reqwest::header::CONNECTION, "close");
        }
        let answer = self
            .read_bytes(
                rb,
                &path,
                "list the node's allocations (GET /v1/node/:id/allocations)",
            )
            .await?;
        // A non-blocking list's connection is closing already.
        if index > 0 && answer.0.len() >= ROTATE_AFTER_BYTES {
            self.rotate_list.store(true, Ordering::Relaxed);
        }
        Ok(answer)
    }

    /// Nomad API: `GET /v1/allocation/:id` (with its Job). `Ok(None)` on 404.
    pub async fn allocation(&self, id: &str) -> Result<Option<Allocation>, NomadError> {
        self.get_optional(
            &Route::v1(&["allocation", id]),
            &[("namespace", "*".to_string())],
            "read an allocation (GET /v1/allocation/:id)",
        )
        .await
    }

    /// Nomad API: `GET /v1/event/stream?topic=Allocation&topic=Job&namespace=*&index=N`
    /// (the Job topic for its deletions: a purge deletes the job's allocations with no
    /// allocation event). Returns the open response; read it as NDJSON with
    /// [`events::decode_line`].
    pub async fn event_stream(&self, index: u64) -> Result<reqwest::Response, NomadError> {
        let path = &Route::v1(&["event", "stream"]);
        let rb = self.request(&self.streaming, Method::GET, path)?.query(&[
            ("topic", "Allocation".to_string()),
            ("topic", "Job".to_string()),
            ("namespace", "*".to_string()),
            ("index", index.to_string()),
        ]);
        self.send(
            rb,
            "subscribe to the event stream (GET /v1/event/stream)",
            path,
        )
        .await
    }

    /// Nomad API: `PUT /v1/volume/host/register`. Returns the registered volume (with its ID).
    pub async fn register_host_volume(&self, vol: &HostVolume) -> Result<HostVolume, NomadError> {
        #[derive(serde::Deserialize)]
        struct Resp {
            #[serde(rename = "Volume")]
            volume: HostVolume,
        }
        let path = &Route::v1(&["volume", "host", "register"]);
        let what = "register a placeholder host volume (PUT /v1/volume/host/register)";
        let rb = self
            .request(&self.http, Method::PUT, path)?
            .json(&serde_json::json!({ "Volume": vol, "PolicyOverride": false }));
        let resp = self.send(rb, what, path).await?;
        let bytes = body_limited(resp, MAX_BODY)
            .await
            .map_err(|source| unreachable(&self.addr, what, source))?
            .ok_or_else(|| NomadError::TooLarge {
                what: what.into(),
                limit: MAX_BODY,
            })?;
        let r: Resp = serde_json::from_slice(&bytes).map_err(|source| NomadError::Decode {
            what: what.into(),
            source,
        })?;
        Ok(r.volume)
    }

    /// Nomad API: `PUT /v1/client/allocation/:id/restart` (`nomad alloc restart`): restarts
    /// the task `task` if it runs, or with `task` empty the allocation's running tasks
    /// (`all_tasks` = every task, prestart ones included). Needs `alloc-lifecycle` in the
    /// allocation's namespace.
    pub async fn restart_allocation(
        &self,
        alloc_id: &str,
        task: &str,
        all_tasks: bool,
    ) -> Result<(), NomadError> {
        let path = Route::v1(&["client", "allocation", alloc_id, "restart"]);
        let rb = self
            .request(&self.http, Method::PUT, &path)?
            .json(&serde_json::json!({ "TaskName": task, "AllTasks": all_tasks }));
        self.send(
            rb,
            "restart an allocation (PUT /v1/client/allocation/:id/restart)",
            &path,
        )
        .await
        .map(|_| ())
    }

    /// Nomad API: `GET /v1/volumes?type=host&namespace=*[&node_id=]`.
    pub async fn list_host_volumes(
        &self,
        node_id: Option<&str>,
        namespace: &str,
    ) -> Result<Vec<HostVolumeStub>, NomadError> {
        let mut q = vec![
            ("type", "host".to_string()),
            ("namespace", namespace.to_string()),
        ];
        if let Some(n) = node_id {
            q.push(("node_id", n.to_string()));
        }
        Ok(self
            .get_json(
                &Route::v1(&["volumes"]),
                &q,
                "list host volumes (GET /v1/volumes?type=host)",
            )
            .await?
            .value)
    }

    /// Nomad API: `GET /v1/volume/host/:id?namespace=ns`. `Ok(None)` on 404.
    pub async fn host_volume(
        &self,
        namespace: &str,
        id: &str,
    ) -> Result<Option<HostVolume>, NomadError> {
        self.get_optional(
            &Route::v1(&["volume", "host", id]),
            &[("namespace", namespace.to_string())],
            "read a host volume (GET /v1/volume/host/:id)",
        )
        .await
    }

    /// Nomad API: `DELETE /v1/volume/host/:id?namespace=ns`. A missing volume is success.
    pub async fn delete_host_volume(&self, namespace: &str, id: &str) -> Result<(), NomadError> {
        let path = Route::v1(&["volume", "host", id]);
        let rb = self
            .request(&self.http, Method::DELETE, &path)?
            .query(&[("namespace", namespace)]);
        match self
            .send(
                rb,
                "deregister a placeholder host volume (DELETE /v1/volume/host/:id)",
                &path,
            )
            .await
        {
            Ok(_) | Err(NomadError::Status { status: 404, .. }) => Ok(()),
            // `HostVolume.Delete` (nomad/host_volume_endpoint.go) answers a volume that is
            // already gone with a plain error, HTTP 500 "no such volume: <id>"; through a
            // client agent "rpc error: no such volume: <id>" (`helper/pool` `ConnPool.RPC`).
            Err(NomadError::Status {
                status: 500, body, ..
            }) if body.contains("no such volume: ") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Nomad API: `GET /v1/vars?prefix=P&namespace=ns`, blocking when `index > 0`.
    pub async fn list_variables(
        &self,
        prefix: &str,
        namespace: &str,
        index: u64,
        wait: Duration,
    ) -> Result<Indexed<Vec<VariableMeta>>, NomadError> {
        let mut q = vec![
            ("prefix", prefix.to_string()),
            ("namespace", namespace.to_string()),
        ];
        if index > 0 {
            q.push(("index", index.to_string()));
            q.push(("wait", format!("{}s", wait.as_secs().max(1))));
        }
        let r: Indexed<Option<Vec<VariableMeta>>> = self
            .get_json(&Route::v1(&["vars"]), &q, "list variables (GET /v1/vars)")
            .await?;
        Ok(Indexed {
            value: r.value.unwrap_or_default(),
            index: r.index,
        })
    }

    /// Nomad API: `GET /v1/var/:path?namespace=ns`. `Ok(None)` on 404. The whole read takes
    /// at most [`VARIABLE_READ_TIMEOUT`] (then [`NomadError::TimedOut`]), and an answer for
    /// another path or namespace is [`NomadError::Mismatch`]; a path that is no variable
    /// path is [`NomadError::BadRequest`] and is not sent.
    pub async fn variable(
        &self,
        namespace: &str,
        path: &str,
    ) -> Result<Option<Variable>, NomadError> {
        Ok(self
            .variable_blocking(namespace, path, 0, Duration::ZERO)
            .await?
            .value)
    }

    /// Nomad API: `GET /v1/var/:path?namespace=ns&index=N&wait=W`, a blocking read of one
    /// variable when `index > 0`: Nomad answers when the variable's `ModifyIndex` passes
    /// `index` (or `wait` ends), not on other variables' writes (`nomad/variables_endpoint.go`
    /// `Variables.Read`; docs/records.md "The change marker"). `value` is `None` on 404, with
    /// the variables table index as `index` (a missing variable's read wakes on any write).
    /// With `index` 0 it is a single read, bounded by [`VARIABLE_READ_TIMEOUT`]. Errors as
    /// [`Client::variable`].
    pub async fn variable_blocking(
        &self,
        namespace: &str,
        path: &str,
        index: u64,
        wait: Duration,
    ) -> Result<Indexed<Option<Variable>>, NomadError> {
        let what = "read a variable (GET /v1/var/:path)";
        let url_path = Route::var(path)?;
        let mut q = vec![("namespace", namespace.to_string())];
        let mut rb = self.request(&self.http, Method::GET, &url_path)?;
        if index > 0 {
            q.push(("index", index.to_string()));
            q.push(("wait", format!("{}s", wait.as_secs().max(1))));
        } else {
            rb = rb.timeout(VARIABLE_READ_TIMEOUT);
        }
        let failed = |source: reqwest::Error| {
            if source.is_timeout() {
                NomadError::TimedOut {
                    what: what.into(),
                    after: VARIABLE_READ_TIMEOUT,
                }
            } else {
                unreachable(&self.addr, what, source)
            }
        };
        let resp = rb.query(&q).send().await.map_err(failed)?;
        let index = header_index(&resp);
        if resp.status() == StatusCode::NOT_FOUND {
            return Ok(Indexed { value: None, index });
        }
        let resp = self.check(resp, what, &url_path).await?;
        let bytes = body_limited(resp, MAX_BODY)
            .await
            .map_err(failed)?
            .ok_or_else(|| NomadError::TooLarge {
                what: what.into(),
                limit: MAX_BODY,
            })?;
        let v: Variable = serde_json::from_slice(&bytes).map_err(|source| NomadError::Decode {
            what: what.into(),
            source,
        })?;
        if v.path != path || v.namespace != namespace {
            return Err(NomadError::Mismatch {
                what: what.into(),
                asked: format!("{namespace}/{path}"),
                got: crate::escape::escape_control(&format!("{}/{}", v.namespace, v.path)),
            });
        }
        Ok(Indexed {
            value: Some(v),
            index,
        })
    }

    /// Nomad API: `PUT /v1/var/:path?namespace=ns[&cas=N]`. `cas = Some(0)` creates only if
    /// absent. A CAS conflict (409) is [`NomadError::CasConflict`] with the current variable.
    pub async fn put_variable(
        &self,
        var: &Variable,
        cas: Option<u64>,
    ) -> Result<Variable, NomadError> {
        let mut q = vec![("namespace", var.namespace.clone())];
        if let Some(c) = cas {
            q.push(("cas", c.to_string()));
        }
        let body = serde_json::json!({
            "Namespace": var.namespace, "Path": var.path, "Items": var.items,
        });
        self.write_variable(var, &q, body, "write a variable (PUT /v1/var/:path)", false)
            .await
    }

    /// PUTs a variable body; 409 (and, with `missing_is_conflict`, 404) become
    /// [`NomadError::CasConflict`] carrying whatever current variable Nomad sent back.
    async fn write_variable(
        &self,
        var: &Variable,
        query: &[(&str, String)],
        body: serde_json::Value,
        what: &str,
        missing_is_conflict: bool,
    ) -> Result<Variable, NomadError> {
        let path = Route::var(&var.path)?;
        let rb = self
            .request(&self.http, Method::PUT, &path)?
            .query(query)
            .json(&body);
        let resp = rb
            .send()
            .await
            .map_err(|source| unreachable(&self.addr, what, source))?;
        let status = resp.status();
        if status == StatusCode::CONFLICT
            || (missing_is_conflict && status == StatusCode::NOT_FOUND)
        {
            let bytes = body_limited(resp, MAX_BODY)
                .await
                .ok()
                .flatten()
                .unwrap_or_default();
            let current: Variable = serde_json::from_slice(&bytes).unwrap_or_default();
            return Err(NomadError::CasConflict {
                path: var.path.clone(),
                current: Box::new(current),
            });
        }
        let resp = self.check(resp, what, &path).await?;
        let bytes = body_limited(resp, MAX_BODY)
            .await
            .map_err(|source| unreachable(&self.addr, what, source))?
            .ok_or_else(|| NomadError::TooLarge {
                what: what.into(),
                limit: MAX_BODY,
            })?;
        serde_json::from_slice(&bytes).map_err(|source| NomadError::Decode {
            what: what.into(),
            source,
        })
    }

    /// Nomad API: `DELETE /v1/var/:path?namespace=ns[&cas=N]`. A missing variable is success.
    pub async fn delete_variable(
        &self,
        namespace: &str,
        path: &str,
        cas: Option<u64>,
    ) -> Result<(), NomadError> {
        let url_path = Route::var(path)?;
        let mut q = vec![("namespace", namespace.to_string())];
        if let Some(c) = cas {
            q.push(("cas", c.to_string()));
        }
        let rb = self
            .request(&self.http, Method::DELETE, &url_path)?
            .query(&q);
        match self
            .send(rb, "delete a variable (DELETE /v1/var/:path)", &url_path)
            .await
        {
            Ok(_) | Err(NomadError::Status { status: 404, .. }) => Ok(()),
            Err(NomadError::Status {
                status: 409, body, ..
            }) => Err(NomadError::CasConflict {
                path: path.to_string(),
                current: Box::new(serde_json::from_str(&body).unwrap_or_default()),
            }),
            Err(e) => Err(e),
        }
    }

    /// Nomad API: `PUT /v1/var/:path?lock-acquire|lock-renew|lock-release`. The body is the
    /// one Nomad accepts for `op` (`nomad/variables_endpoint.go` `canonicalizeAndValidate`):
    /// acquire sends `Items` and `Lock{TTL, LockDelay}`; renew and release send only
    /// `Lock{ID}`: release refuses any `Items` key, even `{}` (400). A lock held by someone
    /// else (or in its lock delay, or a stale ID) is [`NomadError::CasConflict`]: Nomad answers
    /// 409 for all of them (404 on renew when the variable is gone).
    ///
    /// When the agent cannot be connected to at all (refused, socket gone: it restarts) and
    /// fallback agents are set ([`Client::with_fallbacks`]), the operation is sent to them in
    /// turn; the first one that answers decides.
    pub async fn lock_op(&self, op: LockOp, var: &Variable) -> Result<Variable, NomadError> {
        let first = self.lock_op_here(op, var).await;
        let down =
            matches!(&first, Err(NomadError::Unreachable { source, .. }) if source.is_connect());
        if !down {
            return first;
        }
        for f in self.fallbacks.iter() {
            match f.lock_op_here(op, var).await {
                Err(NomadError::Unreachable { source, .. }) if source.is_connect() => continue,
                other => {
                    tracing::info!(local = %self.addr, via = %f.addr, op = op.what(), ok = other.is_ok(), "the local Nomad agent cannot be connected to; lock operation sent to a fallback agent");
                    return other;
                }
            }
        }
        first
    }

    async fn lock_op_here(&self, op: LockOp, var: &Variable) -> Result<Variable, NomadError> {
        let id = var.lock.as_ref().map(|l| l.id.clone()).unwrap_or_default();
        let body = match op {
            LockOp::Acquire => serde_json::json!({
                "Namespace": var.namespace, "Path": var.path, "Items": var.items, "Lock": var.lock,
            }),
            LockOp::Renew | LockOp::Release => serde_json::json!({
                "Namespace": var.namespace, "Path": var.path, "Lock": {"ID": id},
            }),
        };
        let q = [
            ("namespace", var.namespace.clone()),
            (op.query(), String::new()),
        ];
        self.write_variable(var, &q, body, op.what(), true).await
    }

    /// Nomad API: `GET /.well-known/openid-configuration` (public, no ACL): the cluster's
    /// workload identity issuer (the servers' `oidc_issuer`, which Nomad puts in every
    /// token's `iss`), or `None` when the cluster sets none (Nomad then answers 404 "OIDC
    /// Discovery endpoint disabled" and its tokens carry no `iss`).
    pub async fn oidc_issuer(&self) -> Result<Option<String>, NomadError> {
        #[derive(serde::Deserialize)]
        struct Discovery {
            issuer: String,
        }
        let doc: Option<Discovery> = self
            .get_optional(
                &Route::root(&[".well-known", "openid-configuration"]),
                &[],
                "read the OIDC discovery document (GET /.well-known/openid-configuration)",
            )
            .await?;
        Ok(doc.map(|d| d.issuer).filter(|i| !i.is_empty()))
    }

    /// Nomad API: `GET /.well-known/jwks.json` (public, no ACL): the keys that sign workload
    /// identities.
    pub async fn jwks(&self) -> Result<jsonwebtoken::jwk::JwkSet, NomadError> {
        Ok(self
            .get_json(
                &Route::root(&[".well-known", "jwks.json"]),
                &[],
                "read the JWKS (GET /.well-known/jwks.json)",
            )
            .await?
            .value)
    }

    async fn check(
        &self,
        resp: reqwest::Response,
        what: &str,
        path: &Route,
    ) -> Result<reqwest::Response, NomadError> {
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let body = error_text(resp).await;
        Err(match status {
            StatusCode::FORBIDDEN => NomadError::PermissionDenied {
                what: what.into(),
                reason: forbidden_reason(&body),
                needs: capability_for(path),
            },
            StatusCode::UNAUTHORIZED => NomadError::Unauthorized { what: what.into() },
            _ => NomadError::Status {
                what: what.into(),
                status: status.as_u16(),
                body: body.trim().chars().take(512).collect(),
            },
        })
    }
}

/// True when `address`'s host is a loopback address or `localhost`.
pub fn is_loopback(address: &str) -> bool {
    let Ok(url) = reqwest::Url::parse(address) else {
        return false;
    };
    let Some(host) = url.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Largest body read from Nomad for one ordinary call (lists of a big cluster fit well
/// below it); a larger one is an error, never buffered.
pub const MAX_BODY: usize = 64 << 20;
/// Largest error body read (only its start is shown).
const MAX_ERROR_BODY: usize = 64 << 10;

/// Reads a response body of at most `limit` bytes. `Ok(None)` when it is larger.
async fn body_limited(
    mut resp: reqwest::Response,
    limit: usize,
) -> Result<Option<bytes::Bytes>, reqwest::Error> {
    if resp.content_length().is_some_and(|n| n > limit as u64) {
        return Ok(None);
    }
    let mut buf = bytes::BytesMut::new();
    while let Some(chunk) = resp.chunk().await? {
        if buf.len() + chunk.len() > limit {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Some(buf.freeze()))
}

/// An error body's start, as text: at most [`MAX_ERROR_BODY`] bytes are read.
/// Nomad's reason for a 403, bounded; "Permission denied" (Nomad's
/// `structs.ErrPermissionDenied`) when it sent no body.
fn forbidden_reason(body: &str) -> String {
    let b: String = body.trim().chars().take(300).collect();
    if b.is_empty() {
        "Permission denied".into()
    } else {
        b
    }
}

async fn error_text(mut resp: reqwest::Response) -> String {
    let mut buf = Vec::new();
    while let Ok(Some(chunk)) = resp.chunk().await {
        let room = MAX_ERROR_BODY.saturating_sub(buf.len());
        buf.extend_from_slice(chunk.get(..room.min(chunk.len())).unwrap_or_default());
        if buf.len() >= MAX_ERROR_BODY {
            break;
        }
    }
    crate::escape::escape_control(&String::from_utf8_lossy(&buf))
}

fn header_index(resp: &reqwest::Response) -> u64 {
    resp.headers()
        .get("X-Nomad-Index")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A client of a test server on loopback at `address`: no token, no TLS.
#[cfg(test)]
pub(crate) fn loopback_client(address: &str) -> Client {
    Client::new(&NomadConfig::plain(address)).expect("a client without TLS files")
}

#[cfg(test)]
mod tests;
