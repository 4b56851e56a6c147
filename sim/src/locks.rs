//! Variable locks (`nomad/variables_endpoint.go` lock-acquire/renew/release).

use crate::api::ApiError;
use crate::store::Server;
use crate::structs::Variable;
use axum::http::StatusCode;
use axum::response::Response;

/// Handles `?lock-acquire|lock-renew|lock-release` on `PUT /v1/var/<path>`.
pub fn http_lock(
    _server: &Server,
    _ns: &str,
    _path: &str,
    _op: &str,
    _v: Variable,
) -> Result<Response, ApiError> {
    Err(ApiError(
        StatusCode::NOT_IMPLEMENTED,
        "variable locks are not simulated yet".into(),
    ))
}
