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

/// Serves until the process is killed: checks each request's inner credential, forwards it
/// with the outer credential read now, streams the answer back.
pub async fn serve(cfg: ProxyConfig) -> Result<(), ProxyError> {
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
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return Ok(());
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
