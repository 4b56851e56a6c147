//! ACLs: tokens, policies, capability checks and workload-identity tokens.
//!
//! Models `acl/policy.go` (policy HCL, namespace policy expansion), `acl/acl.go` (glob matching,
//! implicit workload-identity variable access `matchingVariablesCapabilitySet`) and
//! `nomad/auth/auth.go` (a JWT signed by the keyring is accepted as a token when its alloc exists
//! and is not client-terminal; policies attached to the job via `JobACL` apply). Off unless
//! `acl { enabled = true }`; `acl { bootstrap_token = "<secret>" }` creates a management token.

use crate::api::{json_response, ApiError, AppState};
use crate::hcl_value::{attributes, label, Attrs, HclError};
use crate::store::{Server, State, StoreError};
use axum::body::Bytes;
use axum::extract::{Path, State as AxState};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// Rules of one `namespace "<glob>"` block.
#[derive(Debug, Default, Clone)]
pub struct NamespaceRule {
    /// Expanded capabilities.
    pub capabilities: Vec<String>,
    /// Variables path glob → capabilities.
    pub variables: Vec<(String, Vec<String>)>,
}

/// A parsed policy.
#[derive(Debug, Default, Clone)]
pub struct ParsedPolicy {
    /// Namespace glob → rule.
    pub namespaces: Vec<(String, NamespaceRule)>,
    /// `node { policy }`.
    pub node: String,
    /// `agent { policy }`.
    pub agent: String,
    /// `operator { policy }`.
    pub operator: String,
}

/// A stored policy (`structs.ACLPolicy`).
#[derive(Debug, Clone)]
pub struct Policy {
    /// Wire JSON.
    pub json: Value,
    /// Parsed rules.
    pub parsed: ParsedPolicy,
    /// `JobACL` binding (namespace, job, group, task), if any.
    pub job_acl: Option<(String, String, String, String)>,
}

/// A token (`structs.ACLToken`).
#[derive(Debug, Clone)]
pub struct Token {
    /// Wire JSON (with SecretID).
    pub json: Value,
    /// management or client.
    pub management: bool,
    /// Attached policy names.
    pub policies: Vec<String>,
}

/// ACL tables and settings.
#[derive(Debug, Default, Clone)]
pub struct AclState {
    /// Whether ACLs are enforced.
    pub enabled: bool,
    /// Management token secrets from config.
    pub management: Vec<String>,
    /// Tokens by secret ID.
    pub tokens: BTreeMap<String, Token>,
    /// Policies by name.
    pub policies: BTreeMap<String, Policy>,
    /// Bootstrap already done.
    pub bootstrapped: bool,
}

/// A capability a request needs.
#[derive(Debug, Clone, Copy)]
pub enum Need<'a> {
    /// `node:read`.
    NodeRead,
    /// `node:write`.
    NodeWrite,
    /// `agent:read`.
    AgentRead,
    /// Management token only.
    Management,
    /// Namespace capability (namespace, capability); namespace `*` = every existing namespace.
    Namespace(&'a str, &'a str),
    /// Variable capability (namespace, path, read|write|list|destroy).
    Variable(&'a str, &'a str, &'a str),
}

/// `*` glob matching (any number of `*`).
pub fn glob(pattern: &str, s: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == s;
    }
    let mut rest = s;
    for (i, p) in parts.iter().enumerate() {
        if i == 0 {
            if !rest.starts_with(p) {
                return false;
            }
            rest = &rest[p.len()..];
        } else if i == parts.len() - 1 {
            return rest.ends_with(p);
        } else if let Some(pos) = rest.find(p) {
            rest = &rest[pos + p.len()..];
        } else {
            return false;
        }
    }
    true
}

fn expand_ns_policy(policy: &str) -> Vec<&'static str> {
    let read = vec![
        "list-jobs",
        "parse-job",
        "read-job",
        "csi-list-volume",
        "csi-read-volume",
        "read-job-scaling",
        "list-scaling-policies",
        "read-scaling-policy",
        "host-volume-read",
    ];
    match policy {
        "read" => read,
        "write" => {
            let mut w = read;
            w.extend([
                "scale-job",
                "submit-job",
                "dispatch-job",
                "read-logs",
                "read-fs",
                "alloc-exec",
                "alloc-lifecycle",
                "csi-write-volume",
                "csi-mount-volume",
                "submit-recommendation",
                "host-volume-create",
                "host-volume-register",
                "host-volume-write",
                "host-volume-delete",
            ]);
            w
        }
        "scale" => vec![
            "list-scaling-policies",
            "read-scaling-policy",
            "read-job-scaling",
            "scale-job",
        ],
        "deny" => vec!["deny"],
        _ => vec![],
    }
}

/// Parses policy HCL.
pub fn parse_policy(rules: &str) -> Result<ParsedPolicy, HclError> {
    let body: hcl::Body = hcl::parse(rules)?;
    let mut p = ParsedPolicy::default();
    for b in body.blocks() {
        let ctx = b.identifier.to_string();
        let attrs = attributes(&ctx, &b.body)?;
        let a = Attrs::new(&ctx, &attrs);
        match b.identifier.as_str() {
            "namespace" => {
                let name = label(b, 0).unwrap_or_else(|| "default".into());
                let mut rule = NamespaceRule::default();
                if let Some(pol) = a.str("policy")? {
                    rule.capabilities
                        .extend(expand_ns_policy(&pol).into_iter().map(String::from));
                    let var_caps: Vec<String> = match pol.as_str() {
                        "read" => vec!["read".into(), "list".into()],
                        "write" => vec![
                            "write".into(),
                            "read".into(),
                            "destroy".into(),
                            "list".into(),
                        ],
                        _ => vec![],
                    };
                    if !var_caps.is_empty() {
                        rule.variables.push(("*".into(), var_caps));
                    }
                }
                for c in a.strings("capabilities")?.unwrap_or_default() {
                    rule.capabilities.push(c);
                }
                for vb in b
                    .body
                    .blocks()
                    .filter(|x| x.identifier.as_str() == "variables")
                {
                    for pb in vb.body.blocks().filter(|x| x.identifier.as_str() == "path") {
                        let glob = label(pb, 0).unwrap_or_default();
                        let pa = attributes(&ctx, &pb.body)?;
                        let caps = Attrs::new(&ctx, &pa)
                            .strings("capabilities")?
                            .unwrap_or_default();
                        rule.variables.push((glob, caps));
                    }
                }
                p.namespaces.push((name, rule));
            }
            "node" => p.node = a.str("policy")?.unwrap_or_default(),
            "agent" => p.agent = a.str("policy")?.unwrap_or_default(),
            "operator" => p.operator = a.str("policy")?.unwrap_or_default(),
            _ => {}
        }
    }
    Ok(p)
}

/// Who a request is.
enum Identity {
    Management,
    Policies(Vec<ParsedPolicy>, Option<(String, String, String, String)>),
}

fn resolve(st: &State, server: &Server, token: Option<&str>) -> Result<Identity, StoreError> {
    let acl = &st.acl;
    let Some(tok) = token.filter(|t| !t.is_empty()) else {
        let anon = acl
            .policies
            .get("anonymous")
            .map(|p| vec![p.parsed.clone()])
            .unwrap_or_default();
        return Ok(Identity::Policies(anon, None));
    };
    if acl.management.iter().any(|m| m == tok) {
        return Ok(Identity::Management);
    }
    if let Some(t) = acl.tokens.get(tok) {
        if t.management {
            return Ok(Identity::Management);
        }
        let pols = t
            .policies
            .iter()
            .filter_map(|n| acl.policies.get(n))
            .map(|p| p.parsed.clone())
            .collect();
        return Ok(Identity::Policies(pols, None));
    }
    if tok.matches('.').count() == 2 {
        let claims = server
            .keyring
            .verify(tok)
            .map_err(|_| StoreError::Forbidden)?;
        let alloc = st
            .allocs
            .get(&claims.nomad_allocation_id)
            .ok_or(StoreError::Forbidden)?;
        if alloc.client_terminal() {
            return Err(StoreError::Forbidden);
        }
        let group = alloc.TaskGroup.clone();
        let wi = (
            claims.nomad_namespace.clone(),
            claims.nomad_job_id.clone(),
            group.clone(),
            claims.nomad_task.clone(),
        );
        let pols = acl
            .policies
            .values()
            .filter(|p| {
                p.job_acl.as_ref().is_some_and(|(ns, job, g, t)| {
                    ns == &wi.0
                        && job == &wi.1
                        && (g.is_empty() || g == &wi.2)
                        && (t.is_empty() || t == &wi.3)
                })
            })
            .map(|p| p.parsed.clone())
            .collect();
        return Ok(Identity::Policies(pols, Some(wi)));
    }
    Err(StoreError::Forbidden)
}

/// The rule for a namespace: exact match wins, else the longest matching glob.
fn ns_rule<'a>(p: &'a ParsedPolicy, ns: &str) -> Option<&'a NamespaceRule> {
    if let Some((_, r)) = p.namespaces.iter().find(|(n, _)| n == ns) {
        return Some(r);
    }
    p.namespaces
        .iter()
        .filter(|(n, _)| glob(n, ns))
        .max_by_key(|(n, _)| n.len())
        .map(|(_, r)| r)
}

fn ns_allows(pols: &[ParsedPolicy], ns: &str, cap: &str) -> bool {
    let rules: Vec<&NamespaceRule> = pols.iter().filter_map(|p| ns_rule(p, ns)).collect();
    if rules
        .iter()
        .any(|r| r.capabilities.iter().any(|c| c == "deny"))
    {
        return false;
    }
    rules
        .iter()
        .any(|r| r.capabilities.iter().any(|c| c == cap))
}

fn var_allows(pols: &[ParsedPolicy], ns: &str, path: &str, op: &str) -> bool {
    let mut best: Option<(&str, &Vec<String>)> = None;
    for r in pols.iter().filter_map(|p| ns_rule(p, ns)) {
        for (g, caps) in &r.variables {
            if glob(g, path) && best.is_none_or(|(b, _)| g.len() > b.len()) {
                best = Some((g, caps));
            }
        }
    }
    best.is_some_and(|(_, caps)| !caps.iter().any(|c| c == "deny") && caps.iter().any(|c| c == op))
}

fn level_allows(level: &str, write: bool) -> bool {
    match level {
        "write" => true,
        "read" => !write,
        _ => false,
    }
}

/// Authenticates a token whatever the ACL setting (the Task API's `ACL.WhoAmI`): a
/// management or ACL token, or a workload identity of a live allocation; else `Forbidden`.
pub fn authenticate(server: &Server, token: &str) -> Result<(), StoreError> {
    let st = server.read();
    resolve(&st, server, Some(token)).map(|_| ())
}

/// Checks a token against a need. `Forbidden` → 403 "Permission denied".
pub fn check(server: &Server, token: Option<&str>, need: Need<'_>) -> Result<(), StoreError> {
    let st = server.read();
    if !st.acl.enabled {
        return Ok(());
    }
    let (pols, wi) = match resolve(&st, server, token)? {
        Identity::Management => return Ok(()),
        Identity::Policies(p, wi) => (p, wi),
    };
    let ok = match need {
        Need::Management => false,
        Need::NodeRead => pols.iter().any(|p| level_allows(&p.node, false)),
        Need::NodeWrite => pols.iter().any(|p| level_allows(&p.node, true)),
        Need::AgentRead => pols.iter().any(|p| level_allows(&p.agent, false)),
        Need::Namespace("*", cap) => {
            let namespaces: Vec<String> = st.namespaces.iter().cloned().collect();
            namespaces.iter().all(|ns| ns_allows(&pols, ns, cap))
        }
        Need::Namespace(ns, cap) => ns_allows(&pols, ns, cap),
        Need::Variable(ns, path, op) => {
            let implicit = wi.as_ref().is_some_and(|(wns, job, group, task)| {
                wns == ns
                    && (op == "read" || op == "list")
                    && [
                        "nomad/jobs".to_string(),
                        format!("nomad/jobs/{job}"),
                        format!("nomad/jobs/{job}/{group}"),
                        format!("nomad/jobs/{job}/{group}/{task}"),
                    ]
                    .iter()
                    .any(|p| p == path)
            });
            implicit || var_allows(&pols, ns, path, op)
        }
    };
    if ok {
        Ok(())
    } else {
        Err(StoreError::Forbidden)
    }
}

/// Whether the token may read anything in namespace `ns` (for filtering `namespace=*` lists).
pub fn can_read_ns(server: &Server, token: Option<&str>, ns: &str, cap: &str) -> bool {
    check(server, token, Need::Namespace(ns, cap)).is_ok()
}

/// Event stream topic check (`validateNsOp`, `nomad/event_endpoint.go`).
pub fn check_event_topic(
    server: &Server,
    token: Option<&str>,
    topic: &str,
    ns: &str,
) -> Result<(), ApiError> {
    let need = match topic {
        "Deployment" | "Evaluation" | "Allocation" | "Job" | "Service" | "CSIPlugin" => {
            Need::Namespace(ns, "read-job")
        }
        "HostVolume" => Need::Namespace(ns, "host-volume-read"),
        "CSIVolume" => Need::Namespace(ns, "csi-read-volume"),
        "Node" => Need::NodeRead,
        "Variable" => Need::Variable(ns, "*", "list"),
        _ => Need::Management,
    };
    let r = match need {
        Need::Variable(..) => {
            // Any variable access in the namespace suffices; per-event paths are not filtered here.
            let st = server.read();
            if !st.acl.enabled {
                Ok(())
            } else {
                match resolve(&st, server, token)? {
                    Identity::Management => Ok(()),
                    Identity::Policies(p, wi) => {
                        let any = wi.is_some()
                            || p.iter()
                                .filter_map(|x| ns_rule(x, ns))
                                .any(|r| !r.variables.is_empty());
                        if any {
                            Ok(())
                        } else {
                            Err(StoreError::Forbidden)
                        }
                    }
                }
            }
        }
        n => check(server, token, n),
    };
    r.map_err(ApiError::from)
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_dhv_binder_policy() {
        let p = parse_policy(
            r#"
namespace "*" {
  capabilities = ["read-job", "host-volume-register", "host-volume-read"]
  variables {
    path "dhv-binder/*" {
      capabilities = ["read", "write", "list", "destroy"]
    }
  }
}
node { policy = "read" }
agent { policy = "read" }
"#,
        )
        .unwrap();
        assert!(ns_allows(std::slice::from_ref(&p), "default", "read-job"));
        assert!(!ns_allows(
            std::slice::from_ref(&p),
            "default",
            "submit-job"
        ));
        assert!(var_allows(
            std::slice::from_ref(&p),
            "prod",
            "dhv-binder/claims/x",
            "write"
        ));
        assert!(!var_allows(
            std::slice::from_ref(&p),
            "prod",
            "other/x",
            "read"
        ));
        assert_eq!(p.node, "read");
        assert!(glob("a*c*e", "abcde"));
        assert!(!glob("a*c", "abd"));
    }
}
