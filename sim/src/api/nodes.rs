//! Node endpoints (`command/agent/node_endpoint.go`): list, read, allocations, drain, eligibility; and the sim's heartbeat fault.

use super::*;

pub(super) async fn nodes(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::NodeRead)?;
    let q = Query::parse(q);
    let idx = blocking(&st, &q, |t| t.nodes).await?;
    let prefix = q.get("prefix").unwrap_or("");
    let list: Vec<Value> = st
        .server
        .read()
        .nodes
        .values()
        .filter(|n| n.ID.starts_with(prefix))
        .map(|n| n.stub())
        .collect();
    ok(idx, &list)
}

pub(super) async fn node_get(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::NodeRead)?;
    let q = Query::parse(q);
    let idx = blocking(&st, &q, |t| t.nodes).await?;
    let node = st
        .server
        .node(&id)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, "node not found".into()))?;
    ok(idx, &node.to_json())
}

pub(super) async fn node_allocs(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::NodeRead)?;
    let q = Query::parse(q);
    // `Node.GetAllocs` (nomad/node_endpoint.go): no existence check (an unknown node ID is
    // `200 []`); the index is the highest ModifyIndex among the node's allocations (the
    // allocs table index only when it has none), and `blockingRPC` re-blocks until that number
    // exceeds `index`: a deletion never wakes the query, and the index can go down.
    let (index, wait) = q.blocking()?;
    let node_index = |s: &crate::state::State| {
        s.allocs
            .values()
            .filter(|a| a.NodeID == id)
            .map(|a| a.ModifyIndex)
            .max()
            .unwrap_or(s.tables.allocs)
    };
    if index > 0 {
        st.server.block_until_with(index, wait, node_index).await;
    }
    let idx = node_index(&st.server.read());
    let tok = token(&headers);
    let allocs: Vec<_> = st
        .server
        .node_allocs(&id)
        .into_iter()
        .filter(|a| crate::acl::can_read_ns(&st.server, tok.as_deref(), &a.Namespace, "read-job"))
        .collect();
    ok(idx, &allocs)
}

pub(super) async fn node_drain(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::NodeWrite)?;
    // `decodeBody` (command/agent/http.go): no body → 400 "Request body is empty".
    if body.is_empty() {
        return Err(bad("Request body is empty"));
    }
    let v: Value = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
    let (idx, eval) = crate::nodes::set_drain(&st.server, &id, &v)?;
    ok(
        idx,
        &json!({"EvalIDs": [eval], "EvalCreateIndex": idx, "NodeModifyIndex": idx, "Index": idx}),
    )
}

pub(super) async fn node_eligibility(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::NodeWrite)?;
    let v: Value = serde_json::from_slice(&body).map_err(|e| bad(e.to_string()))?;
    let elig = v
        .get("Eligibility")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let idx = crate::nodes::set_eligibility(&st.server, &id, &elig)?;
    ok(
        idx,
        &json!({"EvalIDs": [], "EvalCreateIndex": 0, "NodeModifyIndex": idx, "Index": idx}),
    )
}

pub(super) async fn sim_heartbeat(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let stop = q.bool("stop");
    crate::nodes::set_heartbeat_stopped(&st.server, &id, stop)?;
    ok(
        st.server.index(),
        &json!({"NodeID": id, "HeartbeatStopped": stop}),
    )
}

/// `PUT /v1/sim/node/:id/partition?on=true|false`: sim only, cut the node off from the
/// servers or heal it ([`crate::nodes::set_partitioned`]).
pub(super) async fn sim_partition(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let on = Query::parse(q).bool("on");
    crate::nodes::set_partitioned(&st.server, &id, on)?;
    if on {
        // Streams bridged through the client to a server break (`client/rpc.go`).
        st.server.stream_close.send_modify(|g| *g += 1);
    }
    ok(st.server.index(), &json!({"NodeID": id, "Partitioned": on}))
}

/// `PUT /v1/sim/node/:id/restart`: sim only, the node's client agent restarts
/// ([`crate::nodes::restart_client`]); answers the dynamic host volumes it dropped.
/// `down` (a Go duration, default 0) is how long the agent is away; the answer comes once it
/// is back.
pub(super) async fn sim_restart(
    State(st): State<AppState>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let down = match Query::parse(q).get("down") {
        None | Some("") => Duration::ZERO,
        Some(d) => crate::clock::parse_go_duration(d).map_err(|e| {
            ApiError(
                StatusCode::BAD_REQUEST,
                format!("Invalid down duration: {e}"),
            )
        })?,
    };
    let dropped = crate::nodes::restart_client(&st.server, &id, down).await?;
    ok(
        st.server.index(),
        &json!({"NodeID": id, "DroppedHostVolumes": dropped}),
    )
}
