//! Deployment endpoints (`command/agent/deployment_endpoint.go`, `job_endpoint.go`
//! `jobDeployments`/`jobLatestDeployment`): list, read, allocations, promote; and the job's
//! deployments. Promotion itself is [`crate::deployments::promote`].

use super::*;

/// `GET /v1/deployments`: the namespace's deployments (`*` = all), `[]` when none.
pub(super) async fn deployments_list(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    let tok = token(&headers);
    if ns != "*" {
        authorize(&st, &headers, crate::acl::Need::Namespace(&ns, "read-job"))?;
    }
    let idx = blocking(&st, &q, |t| t.deployments).await?;
    let all: Vec<crate::structs::Deployment> = st
        .server
        .read()
        .deployments
        .values()
        .filter(|d| ns_visible(&ns, &d.Namespace))
        .cloned()
        .collect();
    // The ACL check reads the server: not under the lock above.
    let list: Vec<Value> = all
        .into_iter()
        .filter(|d| crate::acl::can_read_ns(&st.server, tok.as_deref(), &d.Namespace, "read-job"))
        .map(|d| json!(d))
        .collect();
    ok(idx, &list)
}

/// `GET /v1/deployment/<id>`, `GET /v1/deployment/allocations/<id>`, and
/// `PUT|POST /v1/deployment/promote/<id>` (`DeploymentSpecificRequest` routes by prefix).
pub(super) async fn deployment_specific(
    State(st): State<AppState>,
    method: Method,
    headers: HeaderMap,
    Path(path): Path<String>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> ApiResult {
    let q = Query::parse(q);
    let path = path.trim_start_matches('/').to_string();
    if let Some(id) = path.strip_prefix("promote/") {
        if method != Method::PUT && method != Method::POST {
            return Err(ApiError(
                StatusCode::METHOD_NOT_ALLOWED,
                "Invalid method".into(),
            ));
        }
        return promote(&st, &headers, id, &body);
    }
    if method != Method::GET {
        return Err(ApiError(
            StatusCode::METHOD_NOT_ALLOWED,
            "Invalid method".into(),
        ));
    }
    if let Some(id) = path.strip_prefix("allocations/") {
        let ns = deployment_ns(&st, id);
        authorize(&st, &headers, crate::acl::Need::Namespace(&ns, "read-job"))?;
        let idx = blocking(&st, &q, |t| t.allocs).await?;
        let list: Vec<Value> = st
            .server
            .read()
            .allocs
            .values()
            .filter(|a| a.DeploymentID == id)
            .map(|a| a.stub())
            .collect();
        return ok(idx, &list);
    }
    let ns = deployment_ns(&st, &path);
    authorize(&st, &headers, crate::acl::Need::Namespace(&ns, "read-job"))?;
    let idx = blocking(&st, &q, |t| t.deployments).await?;
    let d = st.server.read().deployments.get(&path).cloned();
    match d {
        Some(d) => ok(idx, &d),
        None => Err(ApiError(
            StatusCode::NOT_FOUND,
            "deployment not found".into(),
        )),
    }
}

/// The deployment's namespace, or `default` for an unknown one (the ACL check then runs
/// against the request's namespace, as Nomad's does before the lookup).
fn deployment_ns(st: &AppState, id: &str) -> String {
    st.server
        .read()
        .deployments
        .get(id)
        .map(|d| d.Namespace.clone())
        .unwrap_or_else(|| "default".into())
}

/// `deploymentPromote` + `Deployment.Promote`: body `{"DeploymentID", "All", "Groups"}`; a
/// missing or different ID → 400; needs `submit-job` (or `promote-deployment`) in the
/// deployment's namespace; the state-store errors are uncoded (500).
fn promote(st: &AppState, headers: &HeaderMap, id: &str, body: &Bytes) -> ApiResult {
    let v: Value = serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
    let given = v
        .get("DeploymentID")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if given.is_empty() {
        return Err(bad("DeploymentID must be specified"));
    }
    if given != id {
        return Err(bad("Deployment ID does not match"));
    }
    let ns = deployment_ns(st, id);
    let tok = token(headers);
    let submit = crate::acl::check(
        &st.server,
        tok.as_deref(),
        crate::acl::Need::Namespace(&ns, "submit-job"),
    );
    if submit.is_err() {
        authorize(
            st,
            headers,
            crate::acl::Need::Namespace(&ns, "promote-deployment"),
        )?;
    }
    let all = v.get("All").and_then(Value::as_bool).unwrap_or(false);
    let groups = (!all).then(|| {
        v.get("Groups")
            .and_then(Value::as_array)
            .map(|g| {
                g.iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    });
    let idx = crate::deployments::promote(&st.server, id, groups)?;
    ok(
        idx,
        &json!({"EvalID": "", "EvalCreateIndex": idx, "DeploymentModifyIndex": idx,
            "RevertedJobVersion": null, "Index": idx}),
    )
}

/// `GET /v1/job/<id>/deployments`: the job's deployments, newest first.
pub(super) async fn job_deployments(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let (q, ns) = in_namespace(&st, &headers, q, "read-job")?;
    let idx = blocking(&st, &q, |t| t.deployments).await?;
    let mut list: Vec<crate::structs::Deployment> = st
        .server
        .read()
        .deployments
        .values()
        .filter(|d| d.Namespace == ns && d.JobID == id)
        .cloned()
        .collect();
    list.sort_by_key(|d| std::cmp::Reverse(d.CreateIndex));
    ok(idx, &list)
}

/// `GET /v1/job/<id>/deployment`: the latest deployment, or `null`.
pub(super) async fn job_latest_deployment(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let (q, ns) = in_namespace(&st, &headers, q, "read-job")?;
    let idx = blocking(&st, &q, |t| t.deployments).await?;
    let d = st.server.read().latest_deployment(&ns, &id).cloned();
    ok(idx, &d)
}
