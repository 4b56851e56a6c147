//! Variable locks (`PUT /v1/var/<path>?lock-acquire|lock-renew|lock-release`).
//!
//! Models `nomad/variables_endpoint.go` (`Apply`, `canonicalizeAndValidate`, `RenewLock`),
//! `nomad/state/state_store_variables.go` (`VarLockAcquire`, `VarLockRelease`),
//! `nomad/structs/variables.go` (`VariableLock.Canonicalize`/`Validate`, `ValidateForLock`)
//! and `nomad/locks.go` (the leader's TTL timers):
//! - acquire: a missing `Lock` or zero durations take the 15 s defaults; the TTL must lie in
//!   10 s..=24 h and neither duration may be negative (400); Items over 64 KiB are refused
//!   (400); the variable is overwritten, Items included; a lock held under another ID → 409
//!   with a body naming only Namespace and Path;
//! - renew: body `{"Lock":{"ID"}}`; no lock ID → 500 (uncoded validation error); no variable
//!   → 404 "variable doesn't exist"; no lock, another ID, or a lock whose timer has fired → 409;
//! - release: a missing lock ID → 400 "missing lock information"; any `Items`, even `{}` (Go
//!   decodes it into a non-nil map) → 400 "lock release operation doesn't take variable
//!   items"; no variable or no lock → 500; another ID → 409;
//! - lifetime: the timer is armed with 2×TTL on acquire and reset to 2×TTL on every renew
//!   (`RenewTTLTimer` doubles the TTL as a grace for the client; `nomad/lock/ttl.go` `Create`
//!   resets an existing timer). When it fires the
//!   lock stays on the variable for `LockDelay` (renew and acquire get 409), then a raft
//!   release removes it (a `VariableUpdated` event). A new leader re-arms every lock with a
//!   fresh 2×TTL (`restoreLockTTLTimers`): see [`restore_timers`].
//!
//! `TTL`/`LockDelay` are Go duration strings on the wire ("15s"); numbers are nanoseconds.

use crate::clock::{go_duration_string, now_ns, parse_go_duration};
use crate::state::{LockTimers, State, VarKey};
use crate::store::{Server, StoreError};
use crate::structs::{Variable, VariableLock};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

type Key = VarKey;

/// A lock operation (`?lock-acquire`, `?lock-renew`, `?lock-release`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockOp {
    /// `VarOpLockAcquire`.
    Acquire,
    /// `VarOpLockRenew`.
    Renew,
    /// `VarOpLockRelease`.
    Release,
}

impl LockOp {
    /// The operation named by a query parameter.
    pub fn from_query(name: &str) -> Option<Self> {
        match name {
            "lock-acquire" => Some(LockOp::Acquire),
            "lock-renew" => Some(LockOp::Renew),
            "lock-release" => Some(LockOp::Release),
            _ => None,
        }
    }
}

const DEFAULT_TTL: Duration = Duration::from_secs(15);
const DEFAULT_DELAY: Duration = Duration::from_secs(15);
const MIN_TTL: Duration = Duration::from_secs(10);
const MAX_TTL: Duration = Duration::from_secs(24 * 3600);
/// `maxVariableSize` (`nomad/structs/variables.go`): the sum of key and value lengths.
pub const MAX_VARIABLE_SIZE: usize = 65536;

fn bad(msg: impl Into<String>) -> StoreError {
    StoreError::BadRequest(msg.into())
}

/// A Go duration from the wire: string, nanoseconds, or absent (zero). Negative → `None`.
fn dur(v: &Value) -> Result<Option<Duration>, StoreError> {
    match v {
        Value::Null => Ok(Some(Duration::ZERO)),
        Value::String(s) if s.is_empty() => Ok(Some(Duration::ZERO)),
        Value::String(s) if s.starts_with('-') => Ok(None),
        Value::String(s) => parse_go_duration(s)
            .map(Some)
            .map_err(|e| bad(format!("time: invalid duration {s:?}: {e}"))),
        Value::Number(n) => match n.as_f64() {
            Some(f) if f < 0.0 => Ok(None),
            Some(f) => Ok(Some(Duration::from_nanos(f as u64))),
            None => Err(bad("invalid lock duration")),
        },
        _ => Err(bad("invalid lock duration")),
    }
}

/// `VariableItems.Size`: the sum of key and value lengths in bytes.
pub fn items_size(items: &BTreeMap<String, String>) -> usize {
    items.iter().map(|(k, v)| k.len() + v.len()).sum()
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

/// The 409 body of a refused acquire or release: only Namespace and Path (plus an empty
/// `Lock` on release), never the variable's data.
fn conflict(st: &State, ns: &str, path: &str, with_lock: bool) -> StoreError {
    let body = Variable {
        Namespace: ns.into(),
        Path: path.into(),
        Lock: with_lock.then(|| VariableLock {
            ID: String::new(),
            TTL: json!(""),
            LockDelay: json!(""),
        }),
        ..Default::default()
    };
    StoreError::Conflict(json!(body), st.index)
}

/// The variable at `key` and its lock; a missing variable or lock answers `missing` or
/// `unlocked` with Nomad's messages.
fn locked_var(
    st: &State,
    key: &Key,
    missing: fn(String) -> StoreError,
    unlocked: fn(String) -> StoreError,
) -> Result<(Variable, VariableLock), StoreError> {
    let cur = st
        .vars
        .get(key)
        .cloned()
        .ok_or_else(|| missing("variable doesn't exist".into()))?;
    let lock = cur
        .Lock
        .clone()
        .ok_or_else(|| unlocked("variable doesn't hold a lock".into()))?;
    Ok((cur, lock))
}

fn locked_409(msg: &str) -> StoreError {
    StoreError::Locked(msg.into())
}

/// Runs a lock operation; `body` is the request Variable as decoded (Items `None` when the
/// key was absent or `null`, as Go leaves a nil map). Answers the index and the JSON body.
pub fn apply(
    server: &Server,
    ns: &str,
    path: &str,
    op: LockOp,
    body: Variable,
) -> Result<(u64, Value), StoreError> {
    let key: Key = (ns.to_string(), path.to_string());
    match op {
        LockOp::Acquire => acquire(server, key, body),
        LockOp::Renew => renew(server, key, body),
        LockOp::Release => release(server, key, body),
    }
}

fn acquire(server: &Server, key: Key, body: Variable) -> Result<(u64, Value), StoreError> {
    let (ns, path) = (key.0.clone(), key.1.clone());
    if ns == "*" {
        return Err(bad("can not target wildcard (\"*\")namespace"));
    }
    let req_lock = body.Lock.clone().unwrap_or_default();
    let (Some(mut ttl), Some(mut delay)) = (dur(&req_lock.TTL)?, dur(&req_lock.LockDelay)?) else {
        return Err(bad("Lock delay and TTL must be positive"));
    };
    if ttl.is_zero() {
        ttl = DEFAULT_TTL;
    }
    if delay.is_zero() {
        delay = DEFAULT_DELAY;
    }
    let items = body.Items.clone().unwrap_or_default();
    if items_size(&items) > MAX_VARIABLE_SIZE {
        return Err(bad("variables are limited to 64KiB in total size"));
    }
    if !(MIN_TTL..=MAX_TTL).contains(&ttl) {
        return Err(bad("TTL must be between 10 seconds and 24 hours"));
    }
    // `Canonicalize` keeps a caller-given ID; the same ID re-acquires its own lock.
    let id = if req_lock.ID.is_empty() {
        uuid::Uuid::new_v4().to_string()
    } else {
        req_lock.ID.clone()
    };
    server.write(|st| {
        let cur = st.vars.get(&key).cloned();
        if let Some(held) = cur.as_ref().and_then(|c| c.Lock.as_ref()) {
            if held.ID != id {
                return Err(conflict(st, &ns, &path, false));
            }
        }
        let idx = st.next_index();
        let now = now_ns();
        let v = Variable {
            Namespace: ns.clone(),
            Path: path.clone(),
            Lock: Some(VariableLock {
                ID: id.clone(),
                TTL: json!(go_duration_string(ttl)),
                LockDelay: json!(go_duration_string(delay)),
            }),
            CreateIndex: cur.as_ref().map(|c| c.CreateIndex).unwrap_or(idx),
            CreateTime: cur.as_ref().map(|c| c.CreateTime).unwrap_or(now),
            ModifyIndex: idx,
            ModifyTime: now,
            Items: Some(items),
        };
        st.vars.insert(key.clone(), v.clone());
        st.tables.vars = idx;
        st.lock_timers
            .held
            .insert(key.clone(), (Instant::now() + 2 * ttl, ttl, delay));
        // A pending delayed invalidation of an earlier lock is not cancelled: its
        // `time.AfterFunc` runs whatever happened since (`nomad/locks.go`).
        emit(st, &v);
        Ok((idx, json!(v)))
    })
}

fn renew(server: &Server, key: Key, body: Variable) -> Result<(u64, Value), StoreError> {
    let id = body.Lock.map(|l| l.ID).unwrap_or_default();
    if id.is_empty() {
        // `VariablesRenewLockRequest.Validate`: a multierror, not coded → 500.
        return Err(StoreError::Internal(
            "1 error occurred:\n\t* missing lock ID\n\n".into(),
        ));
    }
    server.write(|st| {
        // `RenewLock`: coded errors, 404 and 409.
        let (cur, lock) = locked_var(st, &key, StoreError::NotFound, StoreError::Locked)?;
        if lock.ID != id {
            return Err(locked_409("attempting to modify locked variable"));
        }
        // A fired timer cannot be renewed; the delayed release removes the lock later.
        let Some(timer) = st.lock_timers.held.get_mut(&key) else {
            return Err(locked_409("attempting to modify locked variable"));
        };
        // `RenewTTLTimer` resets the timer to 2×TTL (`lockTTL := variable.Lock.TTL * 2`, then
        // `lockTTLTimer.Create`, which is `Reset(lockTTL)` on an existing timer:
        // `nomad/lock/ttl.go` `Create`), as an acquire and a new leader arm it.
        timer.0 = Instant::now() + 2 * timer.1;
        Ok((cur.ModifyIndex, json!(cur.metadata())))
    })
}

fn release(server: &Server, key: Key, body: Variable) -> Result<(u64, Value), StoreError> {
    let id = body.Lock.as_ref().map(|l| l.ID.clone()).unwrap_or_default();
    if id.is_empty() {
        return Err(bad("missing lock information"));
    }
    if body.Items.is_some() {
        return Err(bad("lock release operation doesn't take variable items"));
    }
    let (ns, path) = (key.0.clone(), key.1.clone());
    server.write(|st| {
        // `VarLockRelease`: plain state-store errors, HTTP 500.
        let (cur, lock) = locked_var(st, &key, StoreError::Internal, StoreError::Internal)?;
        if lock.ID != id {
            return Err(conflict(st, &ns, &path, true));
        }
        let idx = st.next_index();
        let mut v = cur;
        v.Lock = None;
        v.ModifyIndex = idx;
        v.ModifyTime = now_ns();
        st.vars.insert(key.clone(), v.clone());
        st.tables.vars = idx;
        st.lock_timers.held.remove(&key);
        // `RemoveVariableLockTTLTimer` stops the TTL timer only: a lock whose timer already
        // fired keeps its delayed invalidation, which later removes whatever lock the
        // variable then has (see [`expire`]).
        emit(st, &v);
        // The answer echoes the request's (absent) Items with the written metadata.
        Ok((idx, json!(v.metadata())))
    })
}

/// Fires due timers: a lock whose 2×TTL passed enters its delay (it stays on the variable);
/// a lock whose delay passed is removed by a release (`VariableUpdated`). Run periodically.
pub fn expire(server: &Server) {
    let now = Instant::now();
    let (fired, released): (Vec<Key>, Vec<Key>) = {
        let st = server.read();
        (
            st.lock_timers
                .held
                .iter()
                .filter(|(_, (at, _, _))| *at <= now)
                .map(|(k, _)| k.clone())
                .collect(),
            st.lock_timers
                .lapsed
                .iter()
                .filter(|(_, at)| **at <= now)
                .map(|(k, _)| k.clone())
                .collect(),
        )
    };
    if fired.is_empty() && released.is_empty() {
        return;
    }
    server.write(|st| {
        for key in fired {
            if let Some((_, _, delay)) = st.lock_timers.held.remove(&key) {
                st.lock_timers.lapsed.insert(key, now + delay);
            }
        }
        if released.is_empty() {
            return;
        }
        let idx = st.next_index();
        for key in released {
            st.lock_timers.lapsed.remove(&key);
            // `invalidateVariableLock` applies a release without a lock ID
            // (`VarLockRelease` then skips the ID check): it removes whatever lock the
            // variable has now, even one acquired after the lapsed lock was released. (The
            // sim also drops that newer lock's timer; Nomad's keeps running and would
            // invalidate once more when it fires.)
            if st.vars.get(&key).is_none_or(|v| v.Lock.is_none()) {
                continue;
            }
            st.lock_timers.held.remove(&key);
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

/// A new leader re-arms every lock still on a variable with a fresh 2×TTL, whatever was left
/// of its clock or its delay (`nomad/locks.go` `restoreLockTTLTimers`).
pub fn restore_timers(st: &mut State) {
    let now = Instant::now();
    let mut held = BTreeMap::new();
    for (key, v) in &st.vars {
        let Some(l) = &v.Lock else { continue };
        let ttl = dur(&l.TTL).ok().flatten().unwrap_or(DEFAULT_TTL);
        let delay = dur(&l.LockDelay).ok().flatten().unwrap_or(DEFAULT_DELAY);
        held.insert(key.clone(), (now + 2 * ttl, ttl, delay));
    }
    st.lock_timers = LockTimers {
        held,
        lapsed: BTreeMap::new(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn server() -> Arc<Server> {
        let keyring = Arc::new(crate::identity::Keyring::generate().expect("keyring"));
        Server::new("global", 100, keyring, Default::default())
    }

    fn req(lock: Value, items: Option<Value>) -> Variable {
        let mut body = json!({ "Lock": lock });
        if let Some(i) = items {
            body["Items"] = i;
        }
        serde_json::from_value(body).expect("request variable")
    }

    fn http_lock(
        s: &Server,
        ns: &str,
        path: &str,
        op: &str,
        body: Variable,
    ) -> Result<(u64, Value), StoreError> {
        apply(s, ns, path, LockOp::from_query(op).expect("lock op"), body)
    }

    /// The status `api` answers for this result.
    fn status(r: &Result<(u64, Value), StoreError>) -> u16 {
        match r {
            Ok(_) => 200,
            Err(StoreError::BadRequest(_)) => 400,
            Err(StoreError::Forbidden) => 403,
            Err(StoreError::NotFound(_)) => 404,
            Err(StoreError::Conflict(..) | StoreError::Locked(_)) => 409,
            Err(StoreError::Internal(_)) => 500,
        }
    }

    fn acquire_id(s: &Server, ttl: &str, delay: &str) -> String {
        let r = http_lock(
            s,
            "default",
            "c/x",
            "lock-acquire",
            req(
                json!({"TTL": ttl, "LockDelay": delay}),
                Some(json!({"node_id": "a"})),
            ),
        );
        assert_eq!(status(&r), 200);
        let v = s.read().vars[&("default".to_string(), "c/x".to_string())].clone();
        v.Lock.expect("locked").ID
    }

    fn locked(s: &Server) -> bool {
        s.read().vars[&("default".to_string(), "c/x".to_string())]
            .Lock
            .is_some()
    }

    /// `canonicalizeAndValidate` and `VariableLock.Validate` (nomad/variables_endpoint.go,
    /// nomad/structs/variables.go); cases of `TestVariablesEndpoint_*Lock*` in
    /// nomad/variables_endpoint_test.go.
    #[tokio::test]
    async fn lock_request_bodies_are_validated_as_nomad_does() {
        let s = server();
        let acq = |lock: Value, items: Option<Value>| {
            status(&http_lock(
                &s,
                "default",
                "c/x",
                "lock-acquire",
                req(lock, items),
            ))
        };
        assert_eq!(acq(json!({"TTL": "9s"}), None), 400, "TTL below 10 s");
        assert_eq!(acq(json!({"TTL": "25h"}), None), 400, "TTL above 24 h");
        assert_eq!(acq(json!({"TTL": "-1s"}), None), 400, "negative");
        let big = "x".repeat(MAX_VARIABLE_SIZE);
        assert_eq!(
            acq(json!({}), Some(json!({ "k": big }))),
            400,
            "over 64 KiB"
        );
        assert!(
            s.read().vars.is_empty(),
            "nothing written by a refused acquire"
        );
        let id = acquire_id(&s, "", "");
        let v = s.read().vars[&("default".to_string(), "c/x".to_string())].clone();
        let l = v.Lock.expect("lock");
        assert_eq!(
            (l.TTL, l.LockDelay),
            (json!("15s"), json!("15s")),
            "defaults"
        );
        assert_eq!(acq(json!({}), None), 409, "held by another ID");
        let rel = |lock: Value, items: Option<Value>| {
            status(&http_lock(
                &s,
                "default",
                "c/x",
                "lock-release",
                req(lock, items),
            ))
        };
        assert_eq!(
            rel(json!({"ID": id}), Some(json!({}))),
            400,
            "Items {{}} on release"
        );
        assert_eq!(rel(json!(null), None), 400, "no lock information");
        assert_eq!(rel(json!({"ID": "other"}), None), 409, "another ID");
        let renew = |lock: Value| {
            status(&http_lock(
                &s,
                "default",
                "c/x",
                "lock-renew",
                req(lock, None),
            ))
        };
        assert_eq!(renew(json!({})), 500, "renew without an ID");
        assert_eq!(renew(json!({"ID": "other"})), 409, "renew with another ID");
        assert_eq!(renew(json!({"ID": id})), 200);
        assert_eq!(
            rel(json!({"ID": id}), None),
            200,
            "release with Lock.ID only"
        );
        assert!(!locked(&s));
        let items = s.read().vars[&("default".to_string(), "c/x".to_string())]
            .Items
            .clone();
        assert_eq!(items.unwrap()["node_id"], "a", "release keeps the Items");
        assert_eq!(rel(json!({"ID": id}), None), 500, "no lock to release");
        assert_eq!(renew(json!({"ID": id})), 409, "no lock to renew");
        let gone = http_lock(
            &s,
            "default",
            "c/none",
            "lock-renew",
            req(json!({"ID": "x"}), None),
        );
        assert_eq!(status(&gone), 404, "renew of a missing variable");
        let gone = http_lock(
            &s,
            "default",
            "c/none",
            "lock-release",
            req(json!({"ID": "x"}), None),
        );
        assert_eq!(status(&gone), 500, "release of a missing variable");
    }

    /// `nomad/locks.go`: 2×TTL after the acquire and after the last renew, then the lock
    /// stays through its delay (renew and acquire refused), then a release removes it.
    #[tokio::test(start_paused = true)]
    async fn a_silent_holder_keeps_the_lock_two_ttls_plus_the_delay_after_its_last_renewal() {
        let s = server();
        let id = acquire_id(&s, "10s", "5s");
        tokio::time::advance(Duration::from_secs(19)).await;
        expire(&s);
        assert!(locked(&s), "still held before 2×TTL");
        let renew = http_lock(
            &s,
            "default",
            "c/x",
            "lock-renew",
            req(json!({"ID": id}), None),
        );
        assert_eq!(status(&renew), 200, "renewable before 2×TTL");
        // A renewal resets the timer to 2×TTL (`RenewTTLTimer`), not to 1×TTL.
        tokio::time::advance(Duration::from_secs(19)).await;
        expire(&s);
        assert!(
            s.read()
                .lock_timers
                .held
                .contains_key(&("default".to_string(), "c/x".to_string())),
            "held within 2×TTL of the renewal"
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        expire(&s);
        assert!(
            locked(&s),
            "the lock stays on the variable during its delay"
        );
        let renew = http_lock(
            &s,
            "default",
            "c/x",
            "lock-renew",
            req(json!({"ID": id}), None),
        );
        assert_eq!(status(&renew), 409, "a fired timer cannot be renewed");
        let other = http_lock(&s, "default", "c/x", "lock-acquire", req(json!({}), None));
        assert_eq!(status(&other), 409, "nobody acquires during the delay");
        tokio::time::advance(Duration::from_secs(5)).await;
        expire(&s);
        assert!(!locked(&s), "released after the delay");
        let other = http_lock(&s, "default", "c/x", "lock-acquire", req(json!({}), None));
        assert_eq!(status(&other), 200);
    }

    /// `nomad/locks.go`: once a lock's timer fired, its invalidation runs after the lock delay
    /// whatever happened meanwhile, and removes the variable's lock without checking its ID
    /// (`invalidateVariableLock` → `VarLockRelease` with no lock): a holder that releases
    /// during the delay lets another acquire, and that new lock vanishes when the delay ends.
    #[tokio::test(start_paused = true)]
    async fn a_release_during_the_lock_delay_leaves_the_delayed_invalidation_armed() {
        let s = server();
        let first = acquire_id(&s, "10s", "5s");
        tokio::time::advance(Duration::from_secs(21)).await;
        expire(&s);
        assert!(locked(&s), "fired, in its delay");
        let rel = http_lock(
            &s,
            "default",
            "c/x",
            "lock-release",
            req(json!({"ID": first}), None),
        );
        assert_eq!(
            status(&rel),
            200,
            "the holder may still release during the delay"
        );
        let second = acquire_id(&s, "10s", "5s");
        assert_ne!(second, first);
        tokio::time::advance(Duration::from_secs(3)).await;
        expire(&s);
        assert!(locked(&s), "the new lock stands until the old delay ends");
        tokio::time::advance(Duration::from_secs(3)).await;
        expire(&s);
        assert!(
            !locked(&s),
            "the old lock's delayed invalidation removed the new holder's lock"
        );
        let renew = http_lock(
            &s,
            "default",
            "c/x",
            "lock-renew",
            req(json!({"ID": second}), None),
        );
        assert_eq!(
            status(&renew),
            409,
            "the new holder's renewal finds no lock"
        );
    }

    /// `restoreLockTTLTimers`: a new leader gives every lock a fresh 2×TTL, even one in its
    /// delay.
    #[tokio::test(start_paused = true)]
    async fn a_new_leader_restarts_every_lock_clock() {
        let s = server();
        acquire_id(&s, "10s", "5s");
        tokio::time::advance(Duration::from_secs(21)).await;
        expire(&s);
        s.write(restore_timers);
        tokio::time::advance(Duration::from_secs(10)).await;
        expire(&s);
        assert!(locked(&s), "the delay was forgotten: a fresh 2×TTL runs");
        tokio::time::advance(Duration::from_secs(11)).await;
        expire(&s);
        assert!(locked(&s), "fired: now in its delay");
        tokio::time::advance(Duration::from_secs(5)).await;
        expire(&s);
        assert!(!locked(&s));
    }
}
