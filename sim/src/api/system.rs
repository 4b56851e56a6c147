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

pub(super) async fn jwks(State(st): State<AppState>) -> ApiResult {
    let mut r = json_response(StatusCode::OK, st.server.index(), &st.server.keyring.jwks());
    r.headers_mut()
        .insert("cache-control", HeaderValue::from_static("max-age=900"));
    Ok(r)
}
