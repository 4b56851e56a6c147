//! Job endpoints (`command/agent/job_endpoint.go`): list, parse, register, read, deregister, allocations.

use super::*;

pub(super) fn job_stub(j: &Job) -> Value {
    json!({"ID": j.ID, "ParentID": j.ParentID, "Name": j.Name, "Namespace": j.Namespace,
        "Datacenters": j.Datacenters, "NodePool": j.NodePool, "Multiregion": j.Multiregion, "Type": j.Type,
        "Priority": j.Priority, "Periodic": !j.Periodic.is_null(), "ParameterizedJob": !j.ParameterizedJob.is_null(),
        "Stop": j.Stop, "Status": j.Status, "StatusDescription": j.StatusDescription, "JobSummary": null,
        "CreateIndex": j.CreateIndex, "ModifyIndex": j.ModifyIndex, "JobModifyIndex": j.JobModifyIndex,
        "SubmitTime": j.SubmitTime})
}

pub(super) async fn jobs_list(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let (q, ns) = in_namespace(&st, &headers, q, "list-jobs")?;
    let idx = blocking(&st, &q, |t| t.jobs).await?;
    let prefix = q.get("prefix").unwrap_or("");
    let list: Vec<Value> = st
        .server
        .read()
        .jobs
        .values()
        .filter(|j| ns_visible(&ns, &j.Namespace) && j.ID.starts_with(prefix))
        .map(job_stub)
        .collect();
    ok(idx, &list)
}

pub(super) async fn jobs_parse(State(st): State<AppState>, body: Bytes) -> ApiResult {
    let v: Value =
        serde_json::from_slice(&body).map_err(|e| bad(format!("Unable to parse request: {e}")))?;
    let hcl = v
        .get("JobHCL")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("Job spec is empty"))?;
    // `Variables`: HCL variable-file content (`name = "value"` lines), as `nomad job run
    // -var`/`-var-file` send it (`api/jobs.go` `JobsParseRequest.Variables`).
    let vars = v
        .get("Variables")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let mut job =
        crate::jobspec::parse_with_variables(hcl, vars).map_err(|e| bad(e.to_string()))?;
    if v.get("Canonicalize")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        job.canonicalize(&st.server.region);
    }
    ok(st.server.index(), &job)
}

pub(super) async fn jobs_register(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult {
    let v: Value =
        serde_json::from_slice(&body).map_err(|e| bad(format!("Unable to parse request: {e}")))?;
    let job_v = v
        .get("Job")
        .cloned()
        .ok_or_else(|| bad("Job must be specified"))?;
    let job: Job =
        serde_json::from_value(job_v).map_err(|e| bad(format!("Unable to parse job: {e}")))?;
    let ns = if job.Namespace.is_empty() {
        "default".to_string()
    } else {
        job.Namespace.clone()
    };
    authorize(
        &st,
        &headers,
        crate::acl::Need::Namespace(&ns, "submit-job"),
    )?;
    let (eval, jmi, idx) = st.server.register_job(job)?;
    ok(
        idx,
        &json!({"EvalID": eval, "EvalCreateIndex": idx, "JobModifyIndex": jmi, "Warnings": "", "Index": idx, "LastContact": 0, "KnownLeader": false}),
    )
}

pub(super) async fn job_get(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let (q, ns) = in_namespace(&st, &headers, q, "read-job")?;
    let idx = blocking(&st, &q, |t| t.jobs).await?;
    let job = st.server.read().jobs.get(&(ns, id)).cloned();
    let job = job.ok_or_else(|| ApiError(StatusCode::NOT_FOUND, "job not found".into()))?;
    ok(idx, &job)
}

pub(super) async fn job_delete(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let (q, ns) = in_namespace(&st, &headers, q, "submit-job")?;
    // `jobDelete` parses purge with strconv.ParseBool and returns a plain (uncoded) error → 500.
    let purge = q
        .go_bool("purge")
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e))?
        .unwrap_or(false);
    let (eval, jmi, idx) = st.server.deregister_job(&ns, &id, purge)?;
    ok(
        idx,
        &json!({"EvalID": eval, "EvalCreateIndex": idx, "JobModifyIndex": jmi, "VolumeEvalID": "", "VolumeEvalIndex": 0, "Index": idx, "LastContact": 0, "KnownLeader": false}),
    )
}

pub(super) async fn job_allocs(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let (q, ns) = in_namespace(&st, &headers, q, "read-job")?;
    let idx = blocking(&st, &q, |t| t.allocs).await?;
    let list: Vec<Value> = st
        .server
        .read()
        .allocs
        .values()
        .filter(|a| a.Namespace == ns && a.JobID == id)
        .map(|a| a.stub())
        .collect();
    ok(idx, &list)
}

// ------------------------------------------------------------------------- event stream
