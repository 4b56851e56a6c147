//! Allocation endpoints (`command/agent/alloc_endpoint.go`): list, read, stop, restart.

use super::*;

pub(super) async fn allocs_list(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    if ns != "*" {
        authorize(&st, &headers, crate::acl::Need::Namespace(&ns, "read-job"))?;
    }
    // `parseBool` (command/agent/http.go): a bad value is a 400.
    let resources = q.go_bool("resources").map_err(bad)?.unwrap_or(false);
    let task_states = q.go_bool("task_states").map_err(bad)?.unwrap_or(true);
    let idx = blocking(&st, &q, |t| t.allocs).await?;
    let prefix = q.get("prefix").unwrap_or("");
    let tok = token(&headers);
    let namespaces = st.server.read().namespaces.clone();
    let readable: std::collections::BTreeSet<String> = namespaces
        .into_iter()
        .filter(|n| crate::acl::can_read_ns(&st.server, tok.as_deref(), n, "read-job"))
        .collect();
    let list: Vec<Value> = st
        .server
        .read()
        .allocs
        .values()
        .filter(|a| {
            ns_visible(&ns, &a.Namespace)
                && readable.contains(&a.Namespace)
                && a.ID.starts_with(prefix)
        })
        .map(|a| a.stub_with(resources, task_states))
        .collect();
    ok(idx, &list)
}

pub(super) async fn alloc_get(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let idx = blocking(&st, &q, |t| t.allocs).await?;
    // `Alloc.GetAlloc` (nomad/alloc_endpoint.go) reads `AllocByID`: the exact ID only. A
    // prefix is the CLI's business (`GET /v1/allocations?prefix=`).
    let alloc = st.server.read().allocs.get(&id).cloned();
    let alloc = alloc.ok_or_else(|| ApiError(StatusCode::NOT_FOUND, "alloc not found".into()))?;
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&alloc.Namespace, "read-job"),
    )?;
    ok(idx, &alloc)
}

pub(super) async fn alloc_stop(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult {
    authorize_lifecycle(&st, &headers, &id)?;
    let (eval, idx) = st.server.stop_alloc(&id)?;
    ok(idx, &json!({"EvalID": eval, "Index": idx}))
}

pub(super) async fn alloc_restart(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    authorize_lifecycle(&st, &headers, &id)?;
    let v: Value = if body.is_empty() {
        json!({})
    } else {
        serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?
    };
    let task = v
        .get("TaskName")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let all = v.get("AllTasks").and_then(Value::as_bool).unwrap_or(false);
    let alloc = st.server.read().allocs.get(&id).cloned();
    let (reply, mut answer) = tokio::sync::mpsc::unbounded_channel();
    let req =
        crate::restart::RestartRequest::new(alloc.as_ref(), &task, all, reply).map_err(|e| {
            let status = match e {
                RestartError::UnknownAllocation => StatusCode::NOT_FOUND,
                _ => StatusCode::BAD_REQUEST,
            };
            ApiError(status, e.to_string())
        })?;
    let _ = st.server.restart_tx.send(req);
    // The client answers once the kill is done (`lifecycle.go` `restartImpl`); no alloc
    // runner for it on any client: `getAllocRunner`'s unknown allocation.
    match tokio::time::timeout(std::time::Duration::from_secs(60), answer.recv()).await {
        Ok(Some(Ok(()))) => ok(st.server.index(), &json!({})),
        Ok(Some(Err(msg))) => Err(ApiError(StatusCode::INTERNAL_SERVER_ERROR, msg)),
        _ => Err(ApiError(
            StatusCode::NOT_FOUND,
            RestartError::UnknownAllocation.to_string(),
        )),
    }
}

/// `alloc-lifecycle` in the allocation's namespace (`nomad/alloc_endpoint.go` `Stop`,
/// `client/alloc_endpoint.go` `Restart`); an unknown allocation is checked against the
/// empty namespace, and the endpoint then answers its own not-found.
fn authorize_lifecycle(st: &AppState, headers: &HeaderMap, id: &str) -> Result<(), ApiError> {
    let ns = st
        .server
        .read()
        .allocs
        .get(id)
        .map(|a| a.Namespace.clone())
        .unwrap_or_default();
    authorize(
        st,
        headers,
        crate::acl::Need::Namespace(&ns, "alloc-lifecycle"),
    )
}
