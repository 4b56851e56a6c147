//! How the client reaches Nomad: TCP (`http://`, `https://`, with the TLS variables) or a
//! unix socket (`unix:///path`), such as the Task API socket Nomad (1.5+) gives every task
//! at `${NOMAD_SECRETS_DIR}/api.sock` and names in `NOMAD_UNIX_ADDR`.
//!
//! The Task API (Nomad: `client/allocrunner/taskrunner/api_hook.go`, `apiHook.Prestart`
//! and `apiSocketPath`) serves the local agent's HTTP API on that socket and always
//! requires a token, even with ACLs off: the task's workload identity (`identity { env =
//! true }` gives it as NOMAD_TOKEN), which the client sends as `X-Nomad-Token`. No address,
//! CA or client certificate is needed, so it works unchanged on clusters with mTLS.

pub use crate::config::{BadAddress, Endpoint, UNIX_SCHEME};

impl Endpoint {
    /// The base URL request paths are appended to.
    pub fn base_url(&self) -> String {
        match self {
            Endpoint::Tcp(base) => base.clone(),
            // Nomad ignores the Host header; any name does.
            Endpoint::Unix(_) => "http://localhost".into(),
        }
    }

    /// Points a client builder at the socket, for a unix endpoint.
    pub fn configure(&self, b: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
        match self {
            Endpoint::Tcp(_) => b,
            Endpoint::Unix(path) => b.unix_socket(path.clone()),
        }
    }
}

/// NOMAD_TLS_SERVER_NAME on a TCP address: requests go to the URL with the host replaced by
/// the name (so TLS sends it as SNI and verifies the certificate against it, as Go's
/// `tls.Config.ServerName`), and this resolver sends that name to the address's real host.
/// Nomad ignores the Host header, so the changed Host is harmless.
#[derive(Debug, Clone)]
pub struct ServerName {
    /// The name certificates are checked against.
    name: String,
    /// The host of NOMAD_ADDR: an IP address or a DNS name (resolved on every connect).
    real: String,
    /// The base URL with the host replaced by `name`.
    base: String,
}

impl ServerName {
    /// For `base` (`https://host:port`) and the server name. Errors when the name is not a
    /// valid host name.
    pub fn new(base: &str, name: &str) -> Result<Self, crate::nomad::NomadError> {
        let bad = |e: String| {
            crate::nomad::NomadError::Config(format!("NOMAD_TLS_SERVER_NAME {name:?}: {e}"))
        };
        let mut url = reqwest::Url::parse(base).map_err(|e| bad(e.to_string()))?;
        let real = url
            .host_str()
            .ok_or_else(|| bad("NOMAD_ADDR has no host".into()))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        if name.parse::<std::net::IpAddr>().is_ok() || name.contains(['/', ':', '@', ' ']) {
            return Err(bad(
                "not a DNS name (the name the Nomad agent's certificate carries)".into(),
            ));
        }
        url.set_host(Some(name)).map_err(|e| bad(e.to_string()))?;
        Ok(Self {
            name: name.to_ascii_lowercase(),
            real,
            base: url.as_str().trim_end_matches('/').to_string(),
        })
    }

    /// The base URL request paths are appended to.
    pub fn base_url(&self) -> String {
        self.base.clone()
    }
}

impl reqwest::dns::Resolve for ServerName {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        // The port is the URL's: the connector replaces the one resolved here.
        let host = if name.as_str().eq_ignore_ascii_case(&self.name) {
            self.real.clone()
        } else {
            name.as_str().to_string()
        };
        Box::pin(async move {
            let addrs: Vec<std::net::SocketAddr> = match host.parse::<std::net::IpAddr>() {
                Ok(ip) => vec![(ip, 0).into()],
                Err(_) => tokio::net::lookup_host((host.as_str(), 0)).await?.collect(),
            };
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// The PEM certificates of a CA file (`what` names its setting in errors). A bundle may hold
/// several CAs (the Nomad CLI trusts each of them). Errors when the file cannot be read or
/// holds no certificate.
pub(super) fn ca_file(
    path: &std::path::Path,
    what: &str,
) -> Result<Vec<reqwest::Certificate>, crate::nomad::NomadError> {
    let pem = std::fs::read(path)
        .map_err(|e| crate::nomad::NomadError::Config(format!("{what} {}: {e}", path.display())))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .map_err(|e| crate::nomad::NomadError::Config(format!("{what} {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(crate::nomad::NomadError::Config(format!(
            "{what} {}: no PEM certificate in the file (it must hold the CA that signed the Nomad agent's certificate)",
            path.display()
        )));
    }
    Ok(certs)
}

/// The certificates of every file under NOMAD_CAPATH, walked as go-rootcerts `LoadCAPath`
/// does: each file must hold a PEM certificate (a stray file is an error naming it), and a
/// directory with none is refused.
pub(super) fn ca_dir(
    dir: &std::path::Path,
) -> Result<Vec<reqwest::Certificate>, crate::nomad::NomadError> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let rd = std::fs::read_dir(&d).map_err(|e| {
            crate::nomad::NomadError::Config(format!("NOMAD_CAPATH {}: {e}", d.display()))
        })?;
        let mut entries: Vec<_> = rd.filter_map(Result::ok).map(|e| e.path()).collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                todo.push(p);
            } else {
                out.extend(ca_file(&p, "NOMAD_CAPATH")?);
            }
        }
    }
    if out.is_empty() {
        return Err(crate::nomad::NomadError::Config(format!(
            "NOMAD_CAPATH {}: no certificate in the directory (it must hold the CA that signed the Nomad agent's certificate)",
            dir.display()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_to_tcp_or_unix_and_others_are_refused() {
        assert_eq!(
            Endpoint::parse("http://127.0.0.1:4646/").unwrap(),
            Endpoint::Tcp("http://127.0.0.1:4646".into())
        );
        let u = Endpoint::parse("unix:///alloc/t/secrets/api.sock").unwrap();
        assert_eq!(u, Endpoint::Unix("/alloc/t/secrets/api.sock".into()));
        assert_eq!(u.base_url(), "http://localhost");
        assert!(Endpoint::parse("unix://secrets/api.sock").is_err());
        assert!(Endpoint::parse("127.0.0.1:4646").is_err());
    }

    #[tokio::test]
    async fn requests_travel_over_the_unix_socket_with_the_token() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("api.sock");
        let l = tokio::net::UnixListener::bind(&sock).unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).await.unwrap();
            let req = String::from_utf8_lossy(&buf[..n]).to_string();
            let body = r#"{"stats":{"client":{"node_id":"n1"}}}"#;
            s.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            )
            .await
            .unwrap();
            req
        });
        let cfg = crate::config::NomadConfig {
            address: format!("unix://{}", sock.display()),
            token: Some("wi-token".into()),
            region: None,
            namespace: "default".into(),
            ca_cert: None,
            ca_path: None,
            tls_server_name: None,
            http_auth: None,
            client_cert: None,
            client_key: None,
            skip_verify: false,
        };
        let c = crate::nomad::Client::new(&cfg).unwrap();
        let me = c.agent_self().await.unwrap();
        assert_eq!(me.node_id(), Some("n1"));
        let req = server.await.unwrap();
        assert!(req.starts_with("GET /v1/agent/self"), "{req}");
        assert!(
            req.to_ascii_lowercase().contains("x-nomad-token: wi-token"),
            "{req}"
        );
    }
}
