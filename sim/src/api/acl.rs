//! ACL endpoints (`command/agent/acl_endpoint.go`): bootstrap, policies and tokens.

use super::{json_response, ApiError, AppState};
use crate::acl::{check, Need};
use crate::policy::{parse_policy, Policy, Token};
use crate::state::State;
use axum::body::Bytes;
use axum::extract::{Path, State as AxState};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{json, Value};
fn token_of(h: &HeaderMap) -> Option<String> {
    h.get("x-nomad-token")
        .and_then(|v| v.to_str().ok())
        .map(String::from)
        .or_else(|| {
            h.get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(|s| s.trim().to_string())
        })
}

fn new_token(st: &mut State, name: &str, management: bool, policies: Vec<String>) -> Value {
    let idx = st.next_index();
    let secret = uuid::Uuid::new_v4().to_string();
    let json = json!({"AccessorID": uuid::Uuid::new_v4().to_string(), "SecretID": secret, "Name": name,
        "Type": if management {"management"} else {"client"}, "Policies": if management {Value::Null} else {json!(policies)},
        "Roles": null, "Global": false, "CreateTime": crate::clock::now_rfc3339(), "ExpirationTime": null,
        "CreateIndex": idx, "ModifyIndex": idx});
    st.acl.tokens.insert(
        secret,
        Token {
            json: json.clone(),
            management,
            policies,
        },
    );
    st.tables.acl = idx;
    emit_token(st, "ACLTokenUpserted", &json);
    json
}

/// ACLToken event: Key = AccessorID, payload `{"ACLToken": token}` with SecretID emptied
/// (`NewACLTokenEvent`, `nomad/structs/event.go`).
fn emit_token(st: &mut State, kind: &str, token: &Value) {
    let mut t = token.clone();
    t["SecretID"] = json!("");
    let key = t["AccessorID"].as_str().unwrap_or_default().to_string();
    st.emit("ACLToken", kind, &key, "", None, json!({ "ACLToken": t }));
}

/// The secret of the token with this accessor ID.
fn secret_of(st: &State, accessor: &str) -> Option<String> {
    st.acl
        .tokens
        .iter()
        .find(|(_, t)| t.json["AccessorID"] == accessor)
        .map(|(s, _)| s.clone())
}

fn token_stub(t: &Value) -> Value {
    json!({"AccessorID": t["AccessorID"], "Name": t["Name"], "Type": t["Type"], "Policies": t["Policies"],
        "Roles": t["Roles"], "Global": t["Global"], "Hash": "", "CreateTime": t["CreateTime"],
        "ExpirationTime": t["ExpirationTime"], "CreateIndex": t["CreateIndex"], "ModifyIndex": t["ModifyIndex"]})
}

fn empty_ok(index: u64) -> Response {
    let mut r = json_response(StatusCode::OK, index, &Value::Null);
    *r.body_mut() = axum::body::Body::empty();
    r
}

/// `GET /v1/acl/tokens`: token stubs (no SecretID).
pub async fn http_tokens_list(
    AxState(st): AxState<AppState>,
    h: HeaderMap,
) -> Result<Response, ApiError> {
    check(&st.server, token_of(&h).as_deref(), Need::Management)?;
    let s = st.server.read();
    let list: Vec<Value> = s.acl.tokens.values().map(|t| token_stub(&t.json)).collect();
    Ok(json_response(StatusCode::OK, s.tables.acl, &list))
}

/// `GET /v1/acl/token/:accessor_id`.
pub async fn http_token_get(
    AxState(st): AxState<AppState>,
    h: HeaderMap,
    Path(accessor): Path<String>,
) -> Result<Response, ApiError> {
    check(&st.server, token_of(&h).as_deref(), Need::Management)?;
    let s = st.server.read();
    let t = secret_of(&s, &accessor)
        .and_then(|sec| s.acl.tokens.get(&sec))
        .map(|t| t.json.clone())
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, "ACL token not found".into()))?;
    Ok(json_response(StatusCode::OK, s.tables.acl, &t))
}

/// `PUT|POST /v1/acl/token/:accessor_id`: update Name and Policies (ACLTokenUpserted). Streams
/// using the token are re-authorized.
pub async fn http_token_update(
    AxState(st): AxState<AppState>,
    h: HeaderMap,
    Path(accessor): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    check(&st.server, token_of(&h).as_deref(), Need::Management)?;
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?;
    let t = st.server.write(|s| {
        let sec = secret_of(s, &accessor)
            .ok_or_else(|| ApiError(StatusCode::BAD_REQUEST, "cannot find token".into()))?;
        let idx = s.next_index();
        let tok = s.acl.tokens.get_mut(&sec).expect("token by secret");
        if let Some(name) = v.get("Name").and_then(Value::as_str) {
            tok.json["Name"] = json!(name);
        }
        if let Some(p) = v.get("Policies").and_then(Value::as_array) {
            tok.policies = p
                .iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect();
            if !tok.management {
                tok.json["Policies"] = json!(tok.policies);
            }
        }
        tok.json["ModifyIndex"] = json!(idx);
        let json = tok.json.clone();
        s.tables.acl = idx;
        emit_token(s, "ACLTokenUpserted", &json);
        Ok::<_, ApiError>(json)
    })?;
    Ok(json_response(StatusCode::OK, st.server.index(), &t))
}

/// `DELETE /v1/acl/token/:accessor_id` (ACLTokenDeleted); streams using it are closed.
pub async fn http_token_delete(
    AxState(st): AxState<AppState>,
    h: HeaderMap,
    Path(accessor): Path<String>,
) -> Result<Response, ApiError> {
    check(&st.server, token_of(&h).as_deref(), Need::Management)?;
    let idx = st.server.write(|s| {
        let sec = secret_of(s, &accessor).ok_or_else(|| {
            ApiError(
                StatusCode::BAD_REQUEST,
                format!("Cannot delete nonexistent tokens: {accessor}"),
            )
        })?;
        let idx = s.next_index();
        let tok = s.acl.tokens.remove(&sec).expect("token by secret");
        s.tables.acl = idx;
        emit_token(s, "ACLTokenDeleted", &tok.json);
        Ok::<_, ApiError>(idx)
    })?;
    Ok(empty_ok(idx))
}

/// `GET /v1/acl/policies`: policy stubs.
pub async fn http_policies_list(
    AxState(st): AxState<AppState>,
    h: HeaderMap,
) -> Result<Response, ApiError> {
    check(&st.server, token_of(&h).as_deref(), Need::Management)?;
    let s = st.server.read();
    let list: Vec<Value> = s
        .acl
        .policies
        .values()
        .map(|p| {
            json!({"Name": p.json["Name"], "Description": p.json["Description"], "JobACL": p.json["JobACL"],
                "CreateIndex": p.json["CreateIndex"], "ModifyIndex": p.json["ModifyIndex"]})
        })
        .collect();
    Ok(json_response(StatusCode::OK, s.tables.acl, &list))
}

/// `DELETE /v1/acl/policy/:name` (ACLPolicyDeleted); streams are re-authorized.
pub async fn http_policy_delete(
    AxState(st): AxState<AppState>,
    h: HeaderMap,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    check(&st.server, token_of(&h).as_deref(), Need::Management)?;
    let idx = st.server.write(|s| {
        let p = s.acl.policies.remove(&name).ok_or_else(|| {
            ApiError(
                StatusCode::BAD_REQUEST,
                format!("Cannot delete nonexistent policies: {name}"),
            )
        })?;
        let idx = s.next_index();
        s.tables.acl = idx;
        s.emit(
            "ACLPolicy",
            "ACLPolicyDeleted",
            &name,
            "",
            None,
            json!({ "ACLPolicy": p.json }),
        );
        Ok::<_, ApiError>(idx)
    })?;
    Ok(empty_ok(idx))
}

/// `POST /v1/acl/bootstrap` (once).
pub async fn http_bootstrap(
    AxState(st): AxState<AppState>,
    _h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let r = st.server.write(|s| {
        if s.acl.bootstrapped {
            // `nomad/acl_endpoint.go` Bootstrap: the reset index is where bootstrap happened.
            let reset = s
                .acl
                .tokens
                .values()
                .find(|t| t.json["Name"] == "Bootstrap Token")
                .and_then(|t| t.json["CreateIndex"].as_u64())
                .unwrap_or(0);
            return Err(ApiError(
                StatusCode::BAD_REQUEST,
                format!("ACL bootstrap already done (reset index: {reset})"),
            ));
        }
        s.acl.bootstrapped = true;
        let mut t = new_token(s, "Bootstrap Token", true, vec![]);
        if let Some(secret) = req
            .get("BootstrapSecret")
            .and_then(Value::as_str)
            .filter(|x| !x.is_empty())
        {
            let old = t["SecretID"].as_str().unwrap_or_default().to_string();
            if let Some(tok) = s.acl.tokens.remove(&old) {
                t["SecretID"] = json!(secret);
                s.acl.tokens.insert(
                    secret.to_string(),
                    Token {
                        json: t.clone(),
                        ..tok
                    },
                );
            }
        }
        Ok(t)
    })?;
    Ok(json_response(StatusCode::OK, st.server.index(), &r))
}

/// `PUT /v1/acl/policy/:name` body `{Name, Description, Rules, JobACL}` (management only).
pub async fn http_policy_put(
    AxState(st): AxState<AppState>,
    h: HeaderMap,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    check(&st.server, token_of(&h).as_deref(), Need::Management)?;
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?;
    let rules = v
        .get("Rules")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let parsed = parse_policy(&rules).map_err(|e| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("failed to parse rules: {e}"),
        )
    })?;
    let job_acl = v.get("JobACL").filter(|j| !j.is_null()).map(|j| {
        let s = |k: &str| {
            j.get(k)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let ns = s("Namespace");
        (
            if ns.is_empty() { "default".into() } else { ns },
            s("JobID"),
            s("Group"),
            s("Task"),
        )
    });
    let idx = st.server.write(|s| {
        let idx = s.next_index();
        let json = json!({"Name": name, "Description": v.get("Description").cloned().unwrap_or(json!("")), "Rules": rules,
            "JobACL": v.get("JobACL").cloned().unwrap_or(Value::Null), "CreateIndex": idx, "ModifyIndex": idx});
        s.acl.policies.insert(
            name.clone(),
            Policy {
                json: json.clone(),
                parsed,
                job_acl,
            },
        );
        s.tables.acl = idx;
        s.emit(
            "ACLPolicy",
            "ACLPolicyUpserted",
            &name,
            "",
            None,
            json!({ "ACLPolicy": json }),
        );
        idx
    });
    let mut r = json_response(StatusCode::OK, idx, &Value::Null);
    *r.body_mut() = axum::body::Body::empty();
    Ok(r)
}

/// `GET /v1/acl/policy/:name`.
pub async fn http_policy_get(
    AxState(st): AxState<AppState>,
    h: HeaderMap,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    check(&st.server, token_of(&h).as_deref(), Need::Management)?;
    let p = st
        .server
        .read()
        .acl
        .policies
        .get(&name)
        .map(|p| p.json.clone());
    let p = p.ok_or_else(|| ApiError(StatusCode::NOT_FOUND, "ACL policy not found".into()))?;
    Ok(json_response(StatusCode::OK, st.server.index(), &p))
}

/// `PUT /v1/acl/token` body `{Name, Type, Policies}` (management only).
pub async fn http_token_put(
    AxState(st): AxState<AppState>,
    h: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    check(&st.server, token_of(&h).as_deref(), Need::Management)?;
    let v: Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.to_string()))?;
    let management = v.get("Type").and_then(Value::as_str) == Some("management");
    let policies: Vec<String> = v
        .get("Policies")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    let name = v
        .get("Name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let t = st
        .server
        .write(|s| new_token(s, &name, management, policies));
    Ok(json_response(StatusCode::OK, st.server.index(), &t))
}

/// `GET /v1/acl/token/self`.
pub async fn http_token_self(
    AxState(st): AxState<AppState>,
    h: HeaderMap,
) -> Result<Response, ApiError> {
    let tok = token_of(&h).unwrap_or_default();
    let t = st
        .server
        .read()
        .acl
        .tokens
        .get(&tok)
        .map(|t| t.json.clone());
    let t = t.ok_or_else(|| ApiError(StatusCode::FORBIDDEN, "ACL token not found".into()))?;
    Ok(json_response(StatusCode::OK, st.server.index(), &t))
}
