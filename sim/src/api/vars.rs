//! Variable endpoints (`command/agent/variable_endpoint.go`), lock operations included (see [`crate::locks`]).

use super::*;

pub(super) fn valid_var_path(p: &str) -> bool {
    !p.is_empty()
        && p.len() <= 128
        && p.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_~/".contains(c))
}

pub(super) async fn vars_list(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    // Resolved before the wait, checked against after it (`Variables.List`).
    let caller = crate::acl::caller(&st.server, token(&headers).as_deref())?;
    let idx = blocking(&st, &q, |t| t.vars).await?;
    let prefix = q.get("prefix").unwrap_or("").to_string();
    // `Variables.List` hides locks from all but management tokens.
    let management = caller
        .check(&st.server, crate::acl::Need::Management)
        .is_ok();
    let list: Vec<Variable> = st
        .server
        .read()
        .vars
        .values()
        .filter(|v| ns_visible(&ns, &v.Namespace) && v.Path.starts_with(&prefix))
        .map(|v| Variable {
            Lock: v.Lock.clone().filter(|_| management),
            ..v.metadata()
        })
        .collect::<Vec<_>>();
    let list: Vec<Variable> = list
        .into_iter()
        .filter(|v| {
            caller
                .check(
                    &st.server,
                    crate::acl::Need::Variable(&v.Namespace, &v.Path, "list"),
                )
                .is_ok()
        })
        .collect();
    ok(idx, &list)
}

pub(super) async fn var_handler(
    State(st): State<AppState>,
    method: Method,
    headers: HeaderMap,
    Path(path): Path<String>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> ApiResult {
    let q = Query::parse(q);
    let ns = q.namespace();
    let path = path.trim_start_matches('/').to_string();
    if !valid_var_path(&path) {
        return Err(bad(format!("invalid path {path:?}")));
    }
    let tok = token(&headers);
    // `parseCAS` (command/agent/variable_endpoint.go), only on writes: empty = no CAS;
    // unparsable → 400.
    let cas = || -> Result<Option<u64>, ApiError> {
        match q.get("cas") {
            None | Some("") => Ok(None),
            Some(s) => s.parse::<u64>().map(Some).map_err(|_| {
                bad(format!(
                    "can not parse cas: strconv.ParseUint: parsing {s:?}: invalid syntax"
                ))
            }),
        }
    };
    let lock_op = ["lock-acquire", "lock-renew", "lock-release"]
        .into_iter()
        .find(|op| q.has(op))
        .and_then(LockOp::from_query);
    match method {
        Method::GET => {
            crate::acl::check(
                &st.server,
                tok.as_deref(),
                crate::acl::Need::Variable(&ns, &path, "read"),
            )?;
            // `Variables.Read` (nomad/variables_endpoint.go): a blocking read watches the one
            // variable (`GetVariable`'s `FirstWatch` on its key) and answers only when its index
            // passes `index`: the variable's ModifyIndex when it exists, the variables table
            // index when it does not (`setReplyQueryMeta(..., TableVariables, ...)`). So a
            // read of an existing variable sleeps through every other variable write.
            let key = (ns.clone(), path.clone());
            let read_index = |s: &crate::state::State| {
                s.vars
                    .get(&key)
                    .map(|v| v.ModifyIndex)
                    .unwrap_or(s.tables.vars)
            };
            let (index, wait) = q.blocking()?;
            if index > 0 {
                st.server.block_until_with(index, wait, read_index).await;
            }
            let (idx, v) = {
                let s = st.server.read();
                (read_index(&s), s.vars.get(&key).cloned())
            };
            // `Variables.Read` hides the Lock from all but management tokens.
            let management =
                crate::acl::check(&st.server, tok.as_deref(), crate::acl::Need::Management).is_ok();
            match v {
                Some(mut v) => {
                    if !management {
                        v.Lock = None;
                    }
                    ok(idx, &v)
                }
                // `variableQuery` (command/agent/variable_endpoint.go) sets the query's meta
                // (`X-Nomad-Index`) before its 404 "variable not found".
                None => {
                    let mut r = ApiError(StatusCode::NOT_FOUND, "variable not found".into())
                        .into_response();
                    r.headers_mut()
                        .insert("x-nomad-index", HeaderValue::from(idx.max(1)));
                    Ok(r)
                }
            }
        }
        Method::PUT | Method::POST => {
            crate::acl::check(
                &st.server,
                tok.as_deref(),
                crate::acl::Need::Variable(&ns, &path, "write"),
            )?;
            let mut v: Variable = if body.is_empty() {
                Variable::default()
            } else {
                serde_json::from_slice(&body)
                    .map_err(|e| bad(format!("failed to parse variable: {e}")))?
            };
            if let Some(op) = lock_op {
                if q.get("cas").is_some_and(|c| !c.is_empty()) {
                    return Err(bad("CAS can't be used with lock operations"));
                }
                return match crate::locks::apply(&st.server, &ns, &path, op, v) {
                    Ok((idx, body)) => ok(idx, &body),
                    Err(StoreError::Conflict(body, idx)) => {
                        Ok(json_response(StatusCode::CONFLICT, idx, &body))
                    }
                    Err(e) => Err(e.into()),
                };
            }
            let items = v.Items.take().unwrap_or_default();
            if items.is_empty() {
                return Err(bad("variable missing required Items object"));
            }
            // `canonicalizeAndValidate` (nomad/variables_endpoint.go), VarOpSet/VarOpCAS.
            if v.Lock.as_ref().is_some_and(|l| {
                [&l.TTL, &l.LockDelay]
                    .iter()
                    .any(|d| !d.is_null() && d.as_str() != Some("") && d.as_f64() != Some(0.0))
            }) {
                return Err(bad("variable should not contain lock definition"));
            }
            if crate::locks::items_size(&items) > crate::locks::MAX_VARIABLE_SIZE {
                return Err(bad("variables are limited to 64KiB in total size"));
            }
            let cas = cas()?;
            let lock_id = v
                .Lock
                .as_ref()
                .map(|l| l.ID.clone())
                .filter(|i| !i.is_empty());
            match st
                .server
                .put_var(&ns, &path, items, cas, lock_id.as_deref())
            {
                Ok(v) => ok(v.ModifyIndex, &v),
                Err(StoreError::Conflict(body, idx)) => {
                    Ok(json_response(StatusCode::CONFLICT, idx, &body))
                }
                Err(e) => Err(e.into()),
            }
        }
        Method::DELETE => {
            crate::acl::check(
                &st.server,
                tok.as_deref(),
                crate::acl::Need::Variable(&ns, &path, "destroy"),
            )?;
            match st.server.delete_var(&ns, &path, cas()?) {
                Ok(idx) => {
                    let mut r = json_response(StatusCode::OK, idx, &Value::Null);
                    *r.body_mut() = Body::empty();
                    Ok(r)
                }
                Err(StoreError::Conflict(body, idx)) => {
                    Ok(json_response(StatusCode::CONFLICT, idx, &body))
                }
                Err(e) => Err(e.into()),
            }
        }
        _ => Err(ApiError(
            StatusCode::METHOD_NOT_ALLOWED,
            "Invalid method".into(),
        )),
    }
}

// ------------------------------------------------------------------------- host volumes
