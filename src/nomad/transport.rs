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
