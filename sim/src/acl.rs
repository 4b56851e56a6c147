//! ACLs: tokens, policies and capability checks (`acl/acl.go`, `nomad/auth/auth.go`).
//!
//! Off unless `acl { enabled = true }`. Stage 1: only the management bootstrap token exists.

use crate::api::{ApiError, AppState};
use crate::store::{Server, StoreError};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

/// ACL tables and settings.
#[derive(Debug, Default, Clone)]
pub struct AclState {
    /// Whether ACLs are enforced.
    pub enabled: bool,
    /// Management token secrets.
    pub management: Vec<String>,
}

/// A capability a request needs.
#[derive(Debug, Clone, Copy)]
pub enum Need<'a> {
    /// `node:read`.
    NodeRead,
    /// `node:write`.
    NodeWrite,
    /// Namespace capability (namespace, capability); namespace `*` = any namespace.
    Namespace(&'a str, &'a str),
    /// Variable capability (namespace, path, read|write|list|destroy).
    Variable(&'a str, &'a str, &'a str),
}

/// Checks a token against a need.
pub fn check(server: &Server, token: Option<&str>, _need: Need<'_>) -> Result<(), StoreError> {
    let st = server.read();
    if !st.acl.enabled {
        return Ok(());
    }
    match token {
        Some(t) if st.acl.management.iter().any(|m| m == t) => Ok(()),
        _ => Err(StoreError::Forbidden),
    }
}

/// Event stream topic check (`validateNsOp`).
pub fn check_event_topic(
    server: &Server,
    token: Option<&str>,
    topic: &str,
    ns: &str,
) -> Result<(), ApiError> {
    let need = match topic {
        "Node" => Need::NodeRead,
        "HostVolume" => Need::Namespace(ns, "host-volume-read"),
        _ => Need::Namespace(ns, "read-job"),
    };
    check(server, token, need).map_err(ApiError::from)
}

fn not_yet() -> Result<Response, ApiError> {
    Err(ApiError(
        StatusCode::NOT_IMPLEMENTED,
        "ACL management is not simulated yet".into(),
    ))
}

/// `POST /v1/acl/bootstrap`.
pub async fn http_bootstrap(
    State(_st): State<AppState>,
    _h: HeaderMap,
    _b: Bytes,
) -> Result<Response, ApiError> {
    not_yet()
}
/// `PUT /v1/acl/policy/:name`.
pub async fn http_policy_put(
    State(_st): State<AppState>,
    _h: HeaderMap,
    Path(_n): Path<String>,
    _b: Bytes,
) -> Result<Response, ApiError> {
    not_yet()
}
/// `GET /v1/acl/policy/:name`.
pub async fn http_policy_get(
    State(_st): State<AppState>,
    _h: HeaderMap,
    Path(_n): Path<String>,
) -> Result<Response, ApiError> {
    not_yet()
}
/// `PUT /v1/acl/token`.
pub async fn http_token_put(
    State(_st): State<AppState>,
    _h: HeaderMap,
    _b: Bytes,
) -> Result<Response, ApiError> {
    not_yet()
}
/// `GET /v1/acl/token/self`.
pub async fn http_token_self(
    State(st): State<AppState>,
    _h: HeaderMap,
) -> Result<Response, ApiError> {
    let _ = st;
    not_yet()
}
