//! Host volume endpoints (`command/agent/host_volume_endpoint.go`).

use super::*;

pub(super) async fn volume_register(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult {
    let v: Value = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
    let vol: HostVolume = serde_json::from_value(
        v.get("Volume")
            .cloned()
            .ok_or_else(|| bad("missing volume definition"))?,
    )
    .map_err(|e| bad(e.to_string()))?;
    let ns = if vol.Namespace.is_empty() {
        "default".to_string()
    } else {
        vol.Namespace.clone()
    };
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&ns, "host-volume-register"),
    )?;
    let vol = st.server.register_host_volume(vol)?;
    ok(
        vol.ModifyIndex,
        &json!({"Volume": vol, "Warnings": "", "Index": vol.ModifyIndex}),
    )
}

pub(super) async fn volume_get(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let (q, ns) = in_namespace(&st, &headers, q, "host-volume-read")?;
    let idx = blocking(&st, &q, |t| t.host_volumes).await?;
    let v = st
        .server
        .host_volume(&ns, &id)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, "volume not found".into()))?;
    ok(idx, &v)
}

pub(super) async fn volume_delete(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let (q, ns) = in_namespace(&st, &headers, q, "host-volume-delete")?;
    // `command/agent/host_volume_endpoint.go` `deleteVolume`: `force` by `ParseBool`.
    let force = q
        .go_bool("force")
        .map_err(|_| bad("invalid force value"))?
        .unwrap_or(false);
    let idx = st.server.delete_host_volume(&ns, &id, force)?;
    ok(idx, &json!({"Index": idx}))
}

pub(super) async fn volumes_list(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    if q.get("type") != Some("host") {
        return ok(st.server.index(), &Vec::<Value>::new());
    }
    // `nomad/host_volume_endpoint.go` `HostVolume.List`: the token is resolved first (an
    // unknown one: 403), then the selector keeps a volume when
    // `NamespaceValidator(host-volume-read)(aclObj, ns)` holds for the REQUEST's namespace
    // `ns`, never the volume's. With `namespace=*` that is `AllowNamespaceOperation("*")`:
    // true when any namespace of the token grants the capability, and then every
    // namespace's volumes are listed; a namespace (or `*`) without it lists nothing (200,
    // empty), never 403.
    let caller = crate::acl::caller(&st.server, token(&headers).as_deref())?;
    let need = if ns == "*" {
        crate::acl::Need::AnyNamespace("host-volume-read")
    } else {
        crate::acl::Need::Namespace(&ns, "host-volume-read")
    };
    let idx = blocking(&st, &q, |t| t.host_volumes).await?;
    let allowed = caller.check(&st.server, need).is_ok();
    let node = q.get("node_id").unwrap_or("");
    let pool = q.get("node_pool").unwrap_or("");
    let prefix = q.get("prefix").unwrap_or("");
    let list: Vec<Value> = st
        .server
        .read()
        .host_volumes
        .values()
        .filter(|_| allowed)
        .filter(|v| ns_visible(&ns, &v.Namespace))
        .filter(|v| node.is_empty() || v.NodeID == node)
        .filter(|v| pool.is_empty() || v.NodePool == pool)
        .filter(|v| v.ID.starts_with(prefix) || v.Name.starts_with(prefix))
        .map(|v| v.stub())
        .collect();
    ok(idx, &list)
}
