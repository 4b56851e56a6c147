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
