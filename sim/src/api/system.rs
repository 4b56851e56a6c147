//! System and keyring endpoints: `PUT /v1/system/gc`, `/.well-known/jwks.json`.

use super::*;

/// `PUT /v1/system/gc` (management): forced GC of terminal allocations, silently.
pub(super) async fn system_gc(State(st): State<AppState>, headers: HeaderMap) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::Management)?;
    let (n, idx) = st.server.gc();
    tracing::debug!(allocs = n, "garbage collected");
    let mut r = json_response(StatusCode::OK, idx, &Value::Null);
    *r.body_mut() = Body::empty();
    Ok(r)
}

/// `GET /.well-known/openid-configuration`: the discovery document when the server has an
/// `oidc_issuer`, else 404 "OIDC Discovery endpoint disabled"
/// (`command/agent/keyring_endpoint.go` `OIDCDiscoveryRequest`).
pub(super) async fn openid_configuration(State(st): State<AppState>) -> ApiResult {
    match st.server.keyring.openid_configuration() {
        Some(doc) => Ok(json_response(StatusCode::OK, st.server.index(), &doc)),
        None => Err(ApiError(
            StatusCode::NOT_FOUND,
            "OIDC Discovery endpoint disabled".into(),
        )),
    }
}

pub(super) async fn jwks(State(st): State<AppState>) -> ApiResult {
    let mut r = json_response(StatusCode::OK, st.server.index(), &st.server.keyring.jwks());
    r.headers_mut()
        .insert("cache-control", HeaderValue::from_static("max-age=900"));
    Ok(r)
}
