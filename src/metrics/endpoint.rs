//! The scrape endpoint: `GET /metrics` with content negotiation (OpenMetrics or the classic
//! text format), bounded connections per peer and in all.

use super::{Metrics, MetricsError};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpListener;

/// OpenMetrics text to the classic format ([`Metrics::encode_classic`]).
pub(super) fn classic(open: &str) -> String {
    let mut out = String::with_capacity(open.len());
    // Family name → the suffix its samples add (counters `_total`, info `_info`).
    let mut suffix: BTreeMap<String, &str> = BTreeMap::new();
    for l in open.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            if let Some((name, kind)) = rest.split_once(' ') {
                match kind {
                    "counter" => {
                        suffix.insert(name.to_string(), "_total");
                    }
                    "info" => {
                        suffix.insert(name.to_string(), "_info");
                    }
                    _ => {}
                }
            }
        }
    }
    for l in open.lines() {
        if l.starts_with("# UNIT ") || l == "# EOF" {
            continue;
        }
        let described = ["# TYPE ", "# HELP "]
            .iter()
            .find_map(|p| l.strip_prefix(p).map(|rest| (*p, rest)));
        match described {
            Some((p, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let add = suffix.get(name).copied().unwrap_or("");
                let tail = match (p, tail) {
                    ("# TYPE ", "counter") => "counter",
                    ("# TYPE ", "info") => "gauge",
                    (_, t) => t,
                };
                out.push_str(&format!("{p}{name}{add} {tail}\n"));
            }
            None => {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    out
}

/// The OpenMetrics content type of [`Metrics::encode`].
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The classic text format's content type ([`Metrics::encode_classic`]).
pub const CLASSIC_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Binds the metrics endpoint. Any address is accepted (the operator chose it); a
/// non-loopback one is logged, since the endpoint has no authentication.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener, MetricsError> {
    let l = TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "the metrics endpoint listens beyond loopback and has no authentication");
    }
    Ok(l)
}

/// How many scrape connections the endpoint holds at once; further ones are closed at
/// once (issue 33: 300 idle connections used up the agent's file descriptors).
pub const MAX_CONNECTIONS: usize = 64;

/// How many of those one peer (an IP address) may hold: a flood of idle connections from one
/// address leaves room for the scraper's.
pub const MAX_PER_PEER: usize = 8;

/// How long a connection may take to send a request's headers, counted from its start
/// (also for one that sends nothing), before it is closed.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest any one scrape connection is kept, whatever it does.
pub const MAX_CONNECTION_LIFE: Duration = Duration::from_secs(60);

/// Connections open per peer address; a [`PeerSlot`] gives its place back when dropped.
#[derive(Default)]
struct PeerSlots(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

/// One open connection of a peer, counted in [`PeerSlots`] while it lives.
struct PeerSlot(std::sync::Arc<PeerSlots>, std::net::IpAddr);

impl PeerSlots {
    /// A place for one more connection of `peer`, or `None` when it holds [`MAX_PER_PEER`].
    fn take(self: &std::sync::Arc<Self>, peer: std::net::IpAddr) -> Option<PeerSlot> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(peer).or_default();
        if *n >= MAX_PER_PEER {
            return None;
        }
        *n += 1;
        Some(PeerSlot(self.clone(), peer))
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut m = (self.0).0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

/// Serves `GET /metrics` on `listener` until the task is dropped; other paths are 404,
/// other methods 405. At most [`MAX_CONNECTIONS`] connections are served at once, at most
/// [`MAX_PER_PEER`] of one address (more are closed at once); each must send its first
/// request's headers within [`HEADER_READ_TIMEOUT`] of its start and is closed after
/// [`MAX_CONNECTION_LIFE`].
pub async fn serve(listener: TcpListener, metrics: Metrics) {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let peers = std::sync::Arc::new(PeerSlots::default());
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(peer_slot) = peers.take(peer.ip()) else {
            tracing::debug!(%peer, limit = MAX_PER_PEER, "metrics connection refused: too many open from this address");
            drop(stream);
            continue;
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, limit = MAX_CONNECTIONS, "metrics connection refused: too many open");
            drop(stream);
            continue;
        };
        let m = metrics.clone();
        tokio::spawn(async move {
            let _slots = (slot, peer_slot);
            let headers_in = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let seen = headers_in.clone();
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                seen.store(true, std::sync::atomic::Ordering::Relaxed);
                let m = m.clone();
                async move { Ok::<_, std::convert::Infallible>(answer(&m, &req)) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            let started = tokio::time::Instant::now();
            // The first headers within their time from the connection's start, whatever
            // hyper's timer counts from (as the local API does); dropping closes it.
            tokio::select! {
                _ = &mut conn => return,
                _ = tokio::time::sleep_until(started + HEADER_READ_TIMEOUT) => {}
            }
            if !headers_in.load(std::sync::atomic::Ordering::Relaxed) {
                return;
            }
            let _ = tokio::time::timeout_at(started + MAX_CONNECTION_LIFE, conn).await;
        });
    }
}

fn answer<B>(m: &Metrics, req: &Request<B>) -> Response<Full<Bytes>> {
    // Content negotiation: OpenMetrics when the scraper accepts it (Prometheus asks for
    // it first), else the classic text format.
    let open = req
        .headers()
        .get(hyper::header::ACCEPT)
        .and_then(|a| a.to_str().ok())
        .is_some_and(|a| a.contains("application/openmetrics-text"));
    let (status, ctype, body) = match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") if open => (StatusCode::OK, CONTENT_TYPE, m.encode()),
        (&Method::GET, "/metrics") => (StatusCode::OK, CLASSIC_CONTENT_TYPE, m.encode_classic()),
        (_, "/metrics") => (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "use GET\n".into(),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "metrics are at /metrics\n".into(),
        ),
    };
    Response::builder()
        .status(status)
        .header("Content-Type", ctype)
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_default()
}
