//! Agent endpoints (`command/agent/agent_endpoint.go`, `status_endpoint.go`): `/v1/agent/self`, `/v1/status/leader`.

use super::*;

pub(super) async fn agent_self(State(st): State<AppState>, headers: HeaderMap) -> ApiResult {
    authorize(&st, &headers, crate::acl::Need::AgentRead)?;
    let a = &st.agent;
    let mut body = json!({
        "config": {
            "Region": a.region, "Datacenter": a.datacenter, "NodeName": a.name,
            "Client": {"Enabled": a.node_id.is_some(), "NodePool": a.node_pool},
            "Server": {"Enabled": a.node_id.is_none()},
            "ACL": {"Enabled": st.server.read().acl.enabled},
        },
        "member": {"Name": a.name, "Tags": {"region": a.region, "dc": a.datacenter}},
        "stats": {},
    });
    if let Some(id) = &a.node_id {
        body["stats"]["client"] = json!({"node_id": id, "known_servers": "127.0.0.1:4647", "num_allocations": "0", "last_heartbeat": "0", "heartbeat_ttl": "0"});
    } else {
        body["stats"]["nomad"] = json!({"leader": "true", "server": "true"});
    }
    ok(st.server.index(), &body)
}

pub(super) async fn status_leader(State(st): State<AppState>) -> ApiResult {
    if st.server.read().leaderless {
        return ok(st.server.index(), &"");
    }
    ok(st.server.index(), &"127.0.0.1:4647")
}
