//! A per-volume credential proxy between a FUSE remote's client and its HTTP (WebDAV)
//! server, so that a published volume's credentials can change without an unmount
//! (`dhv-binder helper credential-proxy`, the webdav reference plugin's `refresh`;
//! docs/plugin-protocol.md, "refresh").
//!
//! rclone 1.60 takes a WebDAV password only when its mount starts (its backend sets basic
//! auth once, in `NewFs`; only `bearer_token_command` is run again, on a 401, and only for
//! servers that take bearer tokens). So the mount's rclone talks to this proxy instead, on
//! 127.0.0.1, with a fixed random *inner* credential that only it and the proxy know (a
//! 0600 file; rclone gets it in its environment, never on a command line). A loopback port
//! is reachable by every local process: a request without the inner credential is refused
//! (401) before anything is forwarded. The proxy forwards each request to the server with
//! the *outer* credential, read from its 0600 file on each request: the plugin's `refresh`
//! replaces that file atomically (rename), and the next request carries the new value.
//!
//! Forwarding: the request's path and query are kept (the proxy's URL has the server's
//! path, so every `href` of a `PROPFIND` answer means the same on both sides); paths
//! outside the server's base path are refused (403). WebDAV's `Destination` header
//! (`MOVE`, `COPY`; RFC 4918 §10.3) names the proxy's origin and is rewritten to the
//! server's; an answer's `Location` the other way. Hop-by-hop headers (RFC 9110 §7.6.1)
//! are not forwarded. Bodies stream both ways (a large upload is never held in memory).
//! Redirects are returned to the client, never followed with the credential.
//!
//! Lifetime: the proxy lives as long as its client and no longer. `--client` names the file
//! where the plugin records its client (the mount's rclone) as `PID START`, its process ID
//! and start time (field 22 of `/proc/PID/stat`, so that a reused PID is not taken for it).
//! The proxy waits for a running process with that record (at most `--client-wait`), then
//! watches it through a pidfd and exits once it has exited: an rclone killed or crashed
//! leaves no proxy behind, and a proxy whose publish was killed before its rclone started
//! ends by itself.

use base64::Engine as _;
use bytes::Bytes;
use futures_util::TryStreamExt;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The most requests served at once (rclone's default `--transfers` and `--checkers`
/// together are 12; a client past this waits for its connection to be accepted).
pub const MAX_CONNECTIONS: usize = 64;

/// The largest credentials file read (a user name and a password).
const MAX_CREDENTIALS: u64 = 64 * 1024;

/// How long a connection to the server may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a client has to send its request headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// The shortest inner password accepted (it guards a port every local process can reach).
const MIN_INNER: usize = 16;

/// Headers never forwarded (hop-by-hop, RFC 9110 §7.6.1), nor the ones the proxy sets.
const NOT_FORWARDED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "authorization",
];

/// What the proxy is told at start.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// The server's URL (`http://` or `https://`, with its base path).
    pub upstream: String,
    /// The outer credential: a JSON object `{"user": "…", "password": "…"}` (both optional),
    /// read on each request.
    pub credentials: PathBuf,
    /// The inner credential, `user:password` on one line, read once at start.
    pub inner: PathBuf,
    /// Where to listen: a loopback address (`127.0.0.1:0` picks a free port).
    pub listen: SocketAddr,
    /// Where the chosen port is written (decimal, one line, mode 0600) once listening.
    pub port_file: PathBuf,
    /// The file recording the client the proxy lives for: `PID START` on one line, its
    /// process ID and its start time in clock ticks after boot (field 22 of
    /// `/proc/PID/stat`).
    pub client: PathBuf,
    /// How long to wait, from the start, for `client` to name a running process.
    pub client_wait: Duration,
}

/// Why the proxy cannot start or forward.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("--upstream {0:?} is not an http(s) URL with a host")]
    BadUpstream(String),
    #[error(
        "--listen {0} is not a loopback address: the proxy must not be reachable from the network"
    )]
    NotLoopback(SocketAddr),
    #[error("cannot read the inner credential {path}: {reason}")]
    Inner { path: PathBuf, reason: String },
    #[error("cannot read the credentials file {path}: {reason}; the plugin's publish or refresh writes it")]
    Credentials { path: PathBuf, reason: String },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write the port file {path}: {source}")]
    PortFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot make the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("no running process was recorded in {path} within {waited:?} of the start: the proxy has no client to serve (the publish that started it ended before its client started); the next publish starts another")]
    NoClient { path: PathBuf, waited: Duration },
}

/// How the proxy ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyEnd {
    /// The client it served (the process ID recorded in `--client`) has exited.
    ClientExited { pid: u32 },
}

impl std::fmt::Display for ProxyEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProxyEnd::ClientExited { pid } => {
                write!(
                    f,
                    "its client (pid {pid}) has exited: nothing left to serve"
                )
            }
        }
    }
}

/// A process as a record names it: its ID and start time (clock ticks after boot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessRecord {
    pub pid: u32,
    pub start: u64,
}

impl ProcessRecord {
    /// Parses `PID START` (one line, as the webdav plugin writes it); `None` for anything
    /// else.
    pub fn parse(text: &str) -> Option<ProcessRecord> {
        let mut words = text.split_whitespace();
        let pid = words.next()?.parse().ok().filter(|p| *p > 0)?;
        let start = words.next()?.parse().ok()?;
        words
            .next()
            .is_none()
            .then_some(ProcessRecord { pid, start })
    }

    /// Reads the record in `path` (at most 64 bytes); `None` when missing or malformed.
    pub fn read(path: &Path) -> Option<ProcessRecord> {
        let f = std::fs::File::open(path).ok()?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::Read::take(f, 64), &mut text).ok()?;
        ProcessRecord::parse(&text)
    }

    /// The record of process `pid` as it is now; `None` without one.
    pub fn of(pid: u32) -> Option<ProcessRecord> {
        let (_, start) = stat(pid)?;
        Some(ProcessRecord { pid, start })
    }

    /// True while this very process runs: a process with this ID and this start time that
    /// has not exited (a zombie has).
    pub fn running(&self) -> bool {
        stat(self.pid)
            .is_some_and(|(state, start)| start == self.start && state != 'Z' && state != 'X')
    }
}

/// The state and start time of process `pid`, from `/proc/<pid>/stat` (the command, in
/// parentheses, may hold spaces and parentheses: the fields are counted after its last `)`).
fn stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = text.rsplit_once(") ")?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Fields 3 (state) … 22 (start time): the 20th after the command.
    let start = fields.nth(18)?.parse().ok()?;
    Some((state, start))
}

/// The first wait between two reads of the client's record; doubled up to
/// [`CLIENT_POLL_MAX`].
const CLIENT_POLL_MIN: Duration = Duration::from_millis(20);

/// The longest wait between two reads of the client's record, and between two checks of a
/// client that cannot be watched through a pidfd.
const CLIENT_POLL_MAX: Duration = Duration::from_secs(1);

/// Returns once the client recorded in `path` has exited; fails when no running process
/// is recorded there within `wait`. The record is read again, with backoff, until it names
/// a running process (a stale record of an exited one counts as none); that process is
/// then watched through a pidfd (readable once it has exited, whoever its parent is), or,
/// where no pidfd can be opened or polled, checked once a second.
pub async fn client_exited(path: &Path, wait: Duration) -> Result<ProxyEnd, ProxyError> {
    let deadline = tokio::time::Instant::now() + wait;
    let mut pause = CLIENT_POLL_MIN;
    let client = loop {
        if let Some(r) = ProcessRecord::read(path).filter(ProcessRecord::running) {
            break r;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(ProxyError::NoClient {
                path: path.to_path_buf(),
                waited: wait,
            });
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(CLIENT_POLL_MAX);
    };
    if let Some(fd) = pidfd(client) {
        // Sound: `AsyncFd` owns the `OwnedFd`, so the descriptor is neither closed nor
        // replaced while registered (as in `node::holders::exits`).
        #[allow(deprecated)]
        if let Ok(fd) = tokio::io::unix::AsyncFd::with_interest(fd, tokio::io::Interest::READABLE) {
            if fd.readable().await.is_ok() {
                return Ok(ProxyEnd::ClientExited { pid: client.pid });
            }
        }
    }
    while client.running() {
        tokio::time::sleep(CLIENT_POLL_MAX).await;
    }
    Ok(ProxyEnd::ClientExited { pid: client.pid })
}

/// A pidfd of the process `client` records, opened and then checked to be that very
/// process (its start time): a pidfd names one process for good, so a PID reused before
/// the open is caught here. `None` when it cannot be opened (it has exited, or kernels
/// before 5.3) or names another process.
fn pidfd(client: ProcessRecord) -> Option<std::os::fd::OwnedFd> {
    let pid = rustix::process::Pid::from_raw(i32::try_from(client.pid).ok()?)?;
    let fd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()?;
    client.running().then_some(fd)
}

/// The outer credential, as the credentials file holds it.
#[derive(Debug, Default, serde::Deserialize)]
struct Outer {
    #[serde(default)]
    user: String,
    #[serde(default)]
    password: String,
}

/// Reads the outer credential file (JSON, at most 64 KiB): the value of
/// the `Authorization` header to send, `None` when both user and password are empty.
pub fn read_outer(path: &Path) -> Result<Option<String>, ProxyError> {
    let bad = |reason: String| ProxyError::Credentials {
        path: path.to_path_buf(),
        reason,
    };
    let f = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(f, MAX_CREDENTIALS), &mut text)
        .map_err(|e| bad(e.to_string()))?;
    let o: Outer = serde_json::from_str(&text)
        .map_err(|e| bad(format!("not a JSON object of user and password ({e})")))?;
    if o.user.is_empty() && o.password.is_empty() {
        return Ok(None);
    }
    Ok(Some(basic(&o.user, &o.password)))
}

/// `Basic <base64(user:password)>` (RFC 7617).
fn basic(user: &str, password: &str) -> String {
    let pair = format!("{user}:{password}");
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(pair)
    )
}

/// Reads the inner credential (`user:password`, one line) into the header value a client
/// must send.
pub fn read_inner(path: &Path) -> Result<String, ProxyError> {
    let bad = |reason: String| ProxyError::Inner {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let line = text.trim_end_matches(['\n', '\r']);
    let (user, password) = line
        .split_once(':')
        .ok_or_else(|| bad("not user:password".into()))?;
    if password.len() < MIN_INNER {
        return Err(bad(format!(
            "the password is shorter than {MIN_INNER} characters"
        )));
    }
    Ok(basic(user, password))
}

/// True when `got` equals `want`, in time independent of where they differ.
pub fn same_secret(got: &[u8], want: &[u8]) -> bool {
    got.len() == want.len() && got.iter().zip(want).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// The origin (`scheme://host[:port]`) of a URL, as it appears in headers.
fn origin(u: &reqwest::Url) -> String {
    let mut o = format!("{}://{}", u.scheme(), u.host_str().unwrap_or_default());
    if let Some(p) = u.port() {
        o.push_str(&format!(":{p}"));
    }
    o
}

/// A `Destination` (or `Location`) header value rewritten from `from`'s origin to `to`'s:
/// an absolute URL must have `from`'s origin (anything else is refused, `None`), a path is
/// kept as it is.
pub fn rewrite_origin(value: &str, from: &str, to: &str) -> Option<String> {
    if value.starts_with('/') {
        return Some(value.to_string());
    }
    let rest = value.strip_prefix(from)?;
    (rest.is_empty() || rest.starts_with('/')).then(|| format!("{to}{rest}"))
}

/// The server's URL for a request's `path` and `query`: the server's scheme, host and port
/// whatever the request says (a path such as `//other.example/x` stays a path; an
/// absolute-form request target's authority is ignored).
pub fn upstream_url(upstream: &reqwest::Url, path: &str, query: Option<&str>) -> reqwest::Url {
    let mut url = upstream.clone();
    url.set_path(path);
    url.set_query(query);
    url
}

/// True when `path` (a URL's path, its `..` segments resolved) is the base path or beneath it.
pub fn within_base(path: &str, base: &str) -> bool {
    path.starts_with(base) || format!("{path}/") == base
}

/// True when a rewritten `Destination` (an absolute URL on the server, or a path) names a
/// place within the base path once its `..` segments are resolved.
fn destination_within_base(to: &str, upstream: &reqwest::Url, base: &str) -> bool {
    upstream
        .join(to)
        .is_ok_and(|u| origin(&u) == origin(upstream) && within_base(u.path(), base))
}

type Body = BoxBody<Bytes, std::io::Error>;

fn plain(status: StatusCode, text: &str) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(format!("{text}\n")))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r
}

struct Shared {
    upstream: reqwest::Url,
    upstream_origin: String,
    proxy_origin: String,
    base_path: String,
    inner: String,
    credentials: PathBuf,
    http: reqwest::Client,
}

/// Serves until its client has exited ([`client_exited`]) or the process is killed: checks
/// each request's inner credential, forwards it with the outer credential read now, streams
/// the answer back.
pub async fn serve(cfg: ProxyConfig) -> Result<ProxyEnd, ProxyError> {
    let upstream = reqwest::Url::parse(&cfg.upstream)
        .ok()
        .filter(|u| matches!(u.scheme(), "http" | "https") && u.host_str().is_some())
        .ok_or_else(|| ProxyError::BadUpstream(cfg.upstream.clone()))?;
    if !cfg.listen.ip().is_loopback() {
        return Err(ProxyError::NotLoopback(cfg.listen));
    }
    let inner = read_inner(&cfg.inner)?;
    // A missing or broken credentials file now is an error at start, not a 502 later.
    read_outer(&cfg.credentials)?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| ProxyError::Listen {
            addr: cfg.listen,
            source,
        })?;
    let local = listener.local_addr().map_err(|source| ProxyError::Listen {
        addr: cfg.listen,
        source,
    })?;
    write_port(&cfg.port_file, local.port()).map_err(|source| ProxyError::PortFile {
        path: cfg.port_file.clone(),
        source,
    })?;
    let http = reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(ProxyError::Client)?;
    let mut base_path = upstream.path().to_string();
    if !base_path.ends_with('/') {
        base_path.push('/');
    }
    let shared = Arc::new(Shared {
        upstream_origin: origin(&upstream),
        proxy_origin: format!("http://{local}"),
        upstream,
        base_path,
        inner,
        credentials: cfg.credentials,
        http,
    });
    tokio::select! {
        end = client_exited(&cfg.client, cfg.client_wait) => end,
        never = accept(listener, shared) => match never {},
    }
}

/// Serves the connections `listener` accepts, at most [`MAX_CONNECTIONS`] at once, for ever.
async fn accept(
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
) -> std::convert::Infallible {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            // Not reached: the semaphore is never closed.
            return std::future::pending().await;
        };
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("credential proxy: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let svc = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, std::convert::Infallible>(forward(&shared, req).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// Writes `port` to `path` (mode 0600), replacing it atomically.
fn write_port(path: &Path, port: u16) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    writeln!(f, "{port}")?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

async fn forward(s: &Shared, req: Request<hyper::body::Incoming>) -> Response<Body> {
    let authed = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .is_some_and(|v| same_secret(v.as_bytes(), s.inner.as_bytes()));
    if !authed {
        let mut r = plain(
            StatusCode::UNAUTHORIZED,
            "the proxy's credential is required",
        );
        r.headers_mut().insert(
            hyper::header::WWW_AUTHENTICATE,
            hyper::header::HeaderValue::from_static("Basic realm=\"dhv-binder\""),
        );
        return r;
    }
    // Checked on the URL as it will be sent: setting the path resolves `..` and `%2e%2e`
    // segments, which the request's own path would hide.
    let url = upstream_url(&s.upstream, req.uri().path(), req.uri().query());
    if !within_base(url.path(), &s.base_path) {
        return plain(
            StatusCode::FORBIDDEN,
            "outside the server's base path this proxy serves",
        );
    }
    let outer = match read_outer(&s.credentials) {
        Ok(o) => o,
        Err(e) => return plain(StatusCode::BAD_GATEWAY, &e.to_string()),
    };
    let mut headers = reqwest::header::HeaderMap::new();
    for (name, value) in req.headers() {
        if NOT_FORWARDED.contains(&name.as_str()) {
            continue;
        }
        if name.as_str() == "destination" {
            let Some(to) = value
                .to_str()
                .ok()
                .and_then(|v| rewrite_origin(v, &s.proxy_origin, &s.upstream_origin))
                .filter(|to| destination_within_base(to, &s.upstream, &s.base_path))
            else {
                return plain(
                    StatusCode::BAD_REQUEST,
                    "Destination names another server than this proxy",
                );
            };
            match reqwest::header::HeaderValue::from_str(&to) {
                Ok(v) => headers.append(name.clone(), v),
                Err(_) => return plain(StatusCode::BAD_REQUEST, "bad Destination"),
            };
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    if let Some(outer) = outer {
        match reqwest::header::HeaderValue::from_str(&outer) {
            Ok(mut v) => {
                v.set_sensitive(true);
                headers.insert(reqwest::header::AUTHORIZATION, v);
            }
            Err(_) => {
                return plain(
                    StatusCode::BAD_GATEWAY,
                    "the credentials file's user or password cannot go in a header",
                )
            }
        }
    }
    let method = req.method().clone();
    let body = reqwest::Body::wrap_stream(
        req.into_body()
            .into_data_stream()
            .map_err(std::io::Error::other),
    );
    let answer = match s
        .http
        .request(method, url)
        .headers(headers)
        .body(body)
        .send()
        .await
    {
        Ok(a) => a,
        Err(e) => {
            return plain(
                StatusCode::BAD_GATEWAY,
                &format!("the server did not answer: {e}"),
            )
        }
    };
    let mut r = Response::builder().status(answer.status());
    for (name, value) in answer.headers() {
        if NOT_FORWARDED.contains(&name.as_str()) {
            continue;
        }
        if name.as_str() == "location" {
            if let Some(v) = value
                .to_str()
                .ok()
                .and_then(|v| rewrite_origin(v, &s.upstream_origin, &s.proxy_origin))
                .and_then(|v| hyper::header::HeaderValue::from_str(&v).ok())
            {
                r = r.header(name, v);
            }
            continue;
        }
        r = r.header(name, value);
    }
    let stream = answer
        .bytes_stream()
        .map_ok(Frame::data)
        .map_err(std::io::Error::other);
    r.body(BodyExt::boxed(StreamBody::new(stream)))
        .unwrap_or_else(|_| plain(StatusCode::BAD_GATEWAY, "bad answer from the server"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_on_the_proxy_is_rewritten_to_the_server_and_any_other_refused() {
        let (p, u) = ("http://127.0.0.1:4000", "https://dav.example:8443");
        assert_eq!(
            rewrite_origin("http://127.0.0.1:4000/base/a%20b", p, u).as_deref(),
            Some("https://dav.example:8443/base/a%20b")
        );
        assert_eq!(rewrite_origin("/base/x", p, u).as_deref(), Some("/base/x"));
        // Another origin, or one that only starts like the proxy's (port 40001).
        assert_eq!(rewrite_origin("http://evil.example/base/x", p, u), None);
        assert_eq!(rewrite_origin("http://127.0.0.1:40001/base/x", p, u), None);
    }

    #[test]
    fn a_request_reaches_the_server_it_serves_whatever_its_path_says() {
        let up = reqwest::Url::parse("https://dav.example:8443/base/").unwrap();
        let u = upstream_url(&up, "//evil.example/base/x", None);
        assert_eq!(u.host_str(), Some("dav.example"));
        assert_eq!(u.port(), Some(8443));
        let u = upstream_url(&up, "/base/a%20b/c", Some("x=1"));
        assert_eq!(u.as_str(), "https://dav.example:8443/base/a%20b/c?x=1");
    }

    /// A path that climbs out of the base path (`..`, or `%2e%2e` that URL parsing reads
    /// as `..`) is judged as it will be sent, and refused; so is such a Destination.
    #[test]
    fn a_path_or_destination_that_climbs_out_of_the_base_path_is_refused() {
        let up = reqwest::Url::parse("https://dav.example:8443/base/").unwrap();
        for climb in [
            "/base/../other/x",
            "/base/%2e%2e/other/x",
            "/base/a/%2E%2E/%2e%2e/x",
        ] {
            let u = upstream_url(&up, climb, None);
            assert!(!within_base(u.path(), "/base/"), "{climb} -> {u}");
        }
        assert!(within_base(
            upstream_url(&up, "/base/a/../b", None).path(),
            "/base/"
        ));
        assert!(within_base("/base", "/base/"));
        assert!(!destination_within_base(
            "https://dav.example:8443/base/%2e%2e/x",
            &up,
            "/base/"
        ));
        assert!(destination_within_base(
            "https://dav.example:8443/base/y",
            &up,
            "/base/"
        ));
        assert!(destination_within_base("/base/y", &up, "/base/"));
    }

    #[test]
    fn a_client_record_is_pid_and_start_time_and_nothing_else() {
        assert_eq!(
            ProcessRecord::parse("123 456\n"),
            Some(ProcessRecord {
                pid: 123,
                start: 456
            })
        );
        for bad in [
            "",
            "123",
            "0 456",
            "-1 456",
            "123 456 789",
            "x 456",
            "123 4.5",
        ] {
            assert_eq!(ProcessRecord::parse(bad), None, "{bad:?}");
        }
        let me = ProcessRecord::of(std::process::id()).unwrap();
        assert!(me.running());
        // The same PID with another start time is another process (a PID reused).
        assert!(!ProcessRecord {
            start: me.start + 1,
            ..me
        }
        .running());
    }

    /// The proxy waits for its client's record, then lives exactly as long as that
    /// process: it ends once the process has exited, whoever reaps it.
    #[tokio::test]
    async fn the_proxy_ends_once_its_recorded_client_has_exited() {
        let dir = tempfile::tempdir().unwrap();
        let record = dir.path().join("client.pid");
        let mut client = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let me = ProcessRecord::of(client.id()).unwrap();
        // A stale record first (the client of an earlier publish, exited), then this one's.
        std::fs::write(&record, format!("{} {}\n", me.pid, me.start + 1)).unwrap();
        let watch = tokio::spawn({
            let record = record.clone();
            async move { client_exited(&record, Duration::from_secs(60)).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        std::fs::write(&record, format!("{} {}\n", me.pid, me.start)).unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!watch.is_finished(), "ended while its client runs");
        client.kill().unwrap();
        let end = tokio::time::timeout(Duration::from_secs(20), watch)
            .await
            .expect("ends once its client has exited")
            .unwrap()
            .unwrap();
        assert_eq!(end, ProxyEnd::ClientExited { pid: me.pid });
        client.wait().unwrap();
    }

    /// A proxy whose client never started (its publish was killed first) ends by itself,
    /// and a record of an exited process is no client.
    #[tokio::test]
    async fn a_proxy_without_a_running_client_ends_after_its_wait() {
        let dir = tempfile::tempdir().unwrap();
        let record = dir.path().join("client.pid");
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        let was = ProcessRecord::of(gone.id());
        gone.wait().unwrap();
        if let Some(was) = was {
            std::fs::write(&record, format!("{} {}\n", was.pid, was.start)).unwrap();
        }
        let e = client_exited(&record, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(matches!(e, ProxyError::NoClient { .. }), "{e}");
        let e = client_exited(&dir.path().join("missing"), Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("no running process was recorded"),
            "{e}"
        );
    }

    #[test]
    fn the_inner_credential_must_be_long_and_is_compared_whole() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("inner");
        std::fs::write(&f, "rclone:short\n").unwrap();
        assert!(matches!(read_inner(&f), Err(ProxyError::Inner { .. })));
        std::fs::write(&f, "rclone:0123456789abcdef0123\n").unwrap();
        let want = read_inner(&f).unwrap();
        assert_eq!(want, basic("rclone", "0123456789abcdef0123"));
        assert!(same_secret(want.as_bytes(), want.as_bytes()));
        assert!(!same_secret(
            basic("rclone", "0123456789abcdef0124").as_bytes(),
            want.as_bytes()
        ));
        assert!(!same_secret(b"Basic", want.as_bytes()));
    }

    #[test]
    fn the_outer_credential_is_read_anew_and_empty_means_none() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("outer.json");
        std::fs::write(&f, r#"{"user":"dhv","password":"one"}"#).unwrap();
        assert_eq!(read_outer(&f).unwrap(), Some(basic("dhv", "one")));
        std::fs::write(&f, r#"{"user":"dhv","password":"two"}"#).unwrap();
        assert_eq!(read_outer(&f).unwrap(), Some(basic("dhv", "two")));
        std::fs::write(&f, "{}").unwrap();
        assert_eq!(read_outer(&f).unwrap(), None);
        std::fs::write(&f, "password").unwrap();
        let e = read_outer(&f).unwrap_err().to_string();
        assert!(!e.contains("password\""), "{e}");
    }
}
