//! Namespace endpoints (`command/agent/namespace_endpoint.go`).

use super::*;

pub(super) async fn namespaces(State(st): State<AppState>) -> ApiResult {
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
pub(super) async fn namespace_get(
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

/// `PUT|POST /v1/namespace/:name` and `PUT|POST /v1/namespace` (`namespaceUpdate`,
/// `NamespaceCreateRequest`): body `{"Name", "Description"}`; a name other than the path's →
/// 400 "Namespace name does not match request path"; management token only.
pub(super) async fn namespace_put(
    State(st): State<AppState>,
    headers: HeaderMap,
    path: Option<Path<String>>,
    body: Bytes,
) -> ApiResult {
    let v: Value = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
    let name = v.get("Name").and_then(Value::as_str).unwrap_or_default();
    if let Some(Path(p)) = &path {
        if name != p {
            return Err(bad("Namespace name does not match request path"));
        }
    }
    authorize(&st, &headers, crate::acl::Need::Management)?;
    let idx = st.server.upsert_namespace(name)?;
    ok(idx, &json!({"Index": idx}))
}
