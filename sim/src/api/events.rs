//! The event stream (`command/agent/event_endpoint.go`, `nomad/stream/`).

use super::*;

/// `GET /v1/event/stream`: NDJSON frames, `{}` heartbeat at once and every interval.
pub(super) async fn event_stream(
    State(st): State<AppState>,
    method: Method,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> ApiResult {
    if method != Method::GET {
        return Err(ApiError(
            StatusCode::METHOD_NOT_ALLOWED,
            "Invalid method".into(),
        ));
    }
    let q = Query::parse(q);
    let index: u64 = match q.get("index") {
        None | Some("") => 0,
        Some(s) => s.parse().map_err(|_| {
            bad(format!(
                "Unable to parse index: strconv.Atoi: parsing {s:?}: invalid syntax"
            ))
        })?,
    };
    let mut topics: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let requested = q.all("topic");
    if requested.is_empty() {
        topics.insert("*".into(), vec!["*".into()]);
    }
    for t in requested {
        let parts: Vec<&str> = t.split(':').collect();
        let (topic, key) = match parts.as_slice() {
            [topic] => (*topic, "*"),
            [topic, key] => (*topic, *key),
            _ => return Err(bad(format!("Invalid topic query: {t}"))),
        };
        topics
            .entry(topic.to_string())
            .or_default()
            .push(key.to_string());
    }
    let ns = q.namespace();
    let tok = token(&headers);
    for topic in topics.keys() {
        crate::acl::check_event_topic(&st.server, tok.as_deref(), topic, &ns)?;
    }
    let auth = StreamAuth {
        token: tok.filter(|t| !t.is_empty()),
        topics: topics.keys().cloned().collect(),
        namespace: ns.clone(),
    };
    let (cursor, filter) = st.server.subscribe_events(index, topics, &ns);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(stream_task(
        st.server.clone(),
        cursor,
        filter,
        auth,
        st.agent.heartbeat,
        tx,
    ));
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut r = Response::new(body);
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    r.headers_mut()
        .insert("cache-control", HeaderValue::from_static("no-cache"));
    Ok(r)
}

/// What a subscription was authorized with, to re-check it when ACLs change.
struct StreamAuth {
    /// The subscriber's token; `None` (no token) is never re-checked, like Nomad's empty token.
    token: Option<String>,
    /// Requested topics.
    topics: Vec<String>,
    /// Requested namespace (`*` as requested).
    namespace: String,
}

impl StreamAuth {
    /// Whether the subscription is still allowed (`handleACLUpdates` /
    /// `checkSubscriptionsAgainstACLChange`, `nomad/stream/event_broker.go`: a deleted token,
    /// or a token or policy change that takes a permission away, force-closes the stream).
    fn still_allowed(&self, server: &Server) -> bool {
        let Some(tok) = &self.token else { return true };
        self.topics
            .iter()
            .all(|t| crate::acl::check_event_topic(server, Some(tok), t, &self.namespace).is_ok())
    }
}

async fn stream_task(
    server: Arc<Server>,
    mut cursor: u64,
    filter: SubscriptionFilter,
    auth: StreamAuth,
    heartbeat: Duration,
    tx: tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    let hb = Bytes::from_static(b"{}\n");
    if tx.send(Ok(hb.clone())).await.is_err() {
        return;
    }
    let mut index_rx = server.subscribe_index();
    let mut close_rx = server.stream_close.subscribe();
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat);
    let mut acl_index = server.read().tables.acl;
    loop {
        let now_acl = server.read().tables.acl;
        if now_acl != acl_index {
            acl_index = now_acl;
            if !auth.still_allowed(&server) {
                tracing::debug!("closing event stream: subscription closed by server, client should resubscribe");
                return;
            }
        }
        let frames = match server.frames_from(cursor) {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!(error = %e, "closing event stream");
                return;
            }
        };
        for f in frames {
            cursor = f.Index + 1;
            let events = filter.filter(&f);
            if events.is_empty() {
                continue;
            }
            let mut line = serde_json::to_vec(&Frame {
                Index: f.Index,
                Events: events,
            })
            .unwrap_or_default();
            line.push(b'\n');
            if tx.send(Ok(Bytes::from(line))).await.is_err() {
                return;
            }
        }
        tokio::select! {
            r = index_rx.changed() => if r.is_err() { return },
            _ = ticker.tick() => {
                if tx.send(Ok(hb.clone())).await.is_err() { return; }
            }
            _ = close_rx.changed() => return,
            _ = tx.closed() => return,
        }
    }
}

// ------------------------------------------------------------------------- variables
