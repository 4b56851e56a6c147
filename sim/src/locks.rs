//! Variable locks (`PUT /v1/var/<path>?lock-acquire|lock-renew|lock-release`).
//!
//! Models `nomad/variables_endpoint.go` and `nomad/state/state_store_variables.go`: a lock has a
//! server-generated ID, a TTL (renewed by lock-renew) and a LockDelay; when the TTL lapses the
//! lock is dropped and nobody may acquire it again until the delay has passed. While locked, the
//! variable can only be written with the lock ID. `TTL`/`LockDelay` are Go duration strings on
//! the wire ("15s"), defaults 15s each.

use crate::api::{json_response, ApiError};
use crate::clock::{go_duration_string, now_ns, parse_go_duration};
use crate::store::{Server, State};
use crate::structs::{Variable, VariableLock};
use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::time::Instant;

/// Server-side lock timers.
#[derive(Debug, Default, Clone)]
pub struct LockTimers {
    /// (ns, path) → (expiry, lock delay).
    pub held: std::collections::BTreeMap<(String, String), (Instant, Duration)>,
    /// (ns, path) → end of the lock-delay window after an expiry.
    pub delayed: std::collections::BTreeMap<(String, String), Instant>,
}

const DEFAULT_TTL: Duration = Duration::from_secs(15);
const DEFAULT_DELAY: Duration = Duration::from_secs(15);

fn dur(v: &Value, default: Duration) -> Result<Duration, ApiError> {
    match v {
        Value::Null => Ok(default),
        Value::String(s) if s.is_empty() => Ok(default),
        Value::String(s) => parse_go_duration(s)
            .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("invalid lock: {e}"))),
        Value::Number(n) => Ok(Duration::from_nanos(n.as_u64().unwrap_or(0))),
        _ => Err(ApiError(StatusCode::BAD_REQUEST, "invalid lock".into())),
    }
}

fn conflict(v: &Variable) -> Result<Response, ApiError> {
    Ok(json_response(
        StatusCode::CONFLICT,
        v.ModifyIndex,
        &v.metadata(),
    ))
}

fn emit(st: &mut State, v: &Variable) {
    st.emit(
        "Variable",
        "VariableUpdated",
        &v.Path,
        &v.Namespace,
        None,
        json!({"Metadata": v.metadata(), "Deleted": false}),
    );
}

/// Handles a lock operation; `body` is the request Variable (`Lock.ID` for renew/release).
pub fn http_lock(
    server: &Server,
    ns: &str,
    path: &str,
    op: &str,
    body: Variable,
) -> Result<Response, ApiError> {
    let key = (ns.to_string(), path.to_string());
    let req_lock = body.Lock.clone().unwrap_or_default();
    match op {
        "lock-acquire" => {
            let ttl = dur(&req_lock.TTL, DEFAULT_TTL)?;
            let delay = dur(&req_lock.LockDelay, DEFAULT_DELAY)?;
            server.write(|st| {
                let cur = st.vars.get(&key).cloned();
                if let Some(c) = &cur {
                    if c.Lock.as_ref().is_some_and(|l| !l.ID.is_empty()) {
                        return conflict(c);
                    }
                }
                if st
                    .lock_timers
                    .delayed
                    .get(&key)
                    .is_some_and(|until| *until > Instant::now())
                {
                    if let Some(c) = &cur {
                        return conflict(c);
                    }
                    return Err(ApiError(
                        StatusCode::CONFLICT,
                        "lock is in its lock-delay period".into(),
                    ));
                }
                st.ensure_namespace(ns);
                let idx = st.next_index();
                let now = now_ns();
                let items = match &body.Items {
                    Some(i) if !i.is_empty() => Some(i.clone()),
                    _ => cur
                        .as_ref()
                        .and_then(|c| c.Items.clone())
                        .or_else(|| Some(Default::default())),
                };
                let v = Variable {
                    Namespace: ns.into(),
                    Path: path.into(),
                    Lock: Some(VariableLock {
                        ID: uuid::Uuid::new_v4().to_string(),
                        TTL: json!(go_duration_string(ttl)),
                        LockDelay: json!(go_duration_string(delay)),
                    }),
                    CreateIndex: cur.as_ref().map(|c| c.CreateIndex).unwrap_or(idx),
                    CreateTime: cur.as_ref().map(|c| c.CreateTime).unwrap_or(now),
                    ModifyIndex: idx,
                    ModifyTime: now,
                    Items: items,
                };
                st.vars.insert(key.clone(), v.clone());
                st.tables.vars = idx;
                st.lock_timers
                    .held
                    .insert(key.clone(), (Instant::now() + ttl, delay));
                st.lock_timers.delayed.remove(&key);
                emit(st, &v);
                Ok(json_response(StatusCode::OK, idx, &v))
            })
        }
        "lock-renew" | "lock-release" => server.write(|st| {
            let Some(cur) = st.vars.get(&key).cloned() else {
                return Err(ApiError(StatusCode::NOT_FOUND, "variable not found".into()));
            };
            let held = cur.Lock.as_ref().map(|l| l.ID.clone()).unwrap_or_default();
            if held.is_empty() || held != req_lock.ID {
                return conflict(&cur);
            }
            if op == "lock-renew" {
                let ttl = dur(
                    &cur.Lock
                        .as_ref()
                        .map(|l| l.TTL.clone())
                        .unwrap_or(Value::Null),
                    DEFAULT_TTL,
                )?;
                if let Some(t) = st.lock_timers.held.get_mut(&key) {
                    t.0 = Instant::now() + ttl;
                }
                return Ok(json_response(
                    StatusCode::OK,
                    cur.ModifyIndex,
                    &cur.metadata(),
                ));
            }
            let idx = st.next_index();
            let mut v = cur;
            v.Lock = None;
            v.ModifyIndex = idx;
            v.ModifyTime = now_ns();
            st.vars.insert(key.clone(), v.clone());
            st.tables.vars = idx;
            st.lock_timers.held.remove(&key);
            emit(st, &v);
            Ok(json_response(StatusCode::OK, idx, &v))
        }),
        _ => Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("unknown lock operation {op}"),
        )),
    }
}

/// Whether a write carrying `lock_id` may modify the variable at `key` (unlocked, or same ID).
pub fn write_allowed(st: &State, key: &(String, String), lock_id: Option<&str>) -> bool {
    match st.vars.get(key).and_then(|v| v.Lock.as_ref()) {
        Some(l) if !l.ID.is_empty() => lock_id == Some(l.ID.as_str()),
        _ => true,
    }
}

/// Drops locks whose TTL lapsed and starts their lock-delay window. Run periodically.
pub fn expire(server: &Server) {
    let now = Instant::now();
    let due: Vec<(String, String)> = {
        let st = server.read();
        st.lock_timers
            .held
            .iter()
            .filter(|(_, (exp, _))| *exp <= now)
            .map(|(k, _)| k.clone())
            .collect()
    };
    if due.is_empty() {
        return;
    }
    server.write(|st| {
        let idx = st.next_index();
        for key in due {
            let Some((_, delay)) = st.lock_timers.held.remove(&key) else {
                continue;
            };
            st.lock_timers.delayed.insert(key.clone(), now + delay);
            if let Some(v) = st.vars.get_mut(&key) {
                v.Lock = None;
                v.ModifyIndex = idx;
                v.ModifyTime = now_ns();
                let v = v.clone();
                st.tables.vars = idx;
                emit(st, &v);
            }
        }
    });
}
