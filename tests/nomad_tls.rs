//! TLS to Nomad as the Nomad CLI does it (issue 13 §5): `NOMAD_CACERT` is the only trust
//! root, `NOMAD_CLIENT_CERT`/`NOMAD_CLIENT_KEY` answer a server that asks for a client
//! certificate (Nomad's `verify_https_client`), `NOMAD_SKIP_VERIFY` skips the server check.
//!
//! Every certificate is made here (rcgen); the server is a loopback TLS listener (rustls)
//! answering `GET /v1/agent/self`.

use dhv_binder::config::NomadConfig;
use dhv_binder::nomad::{Client, NomadError};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;

/// A certificate authority made for one test.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Self {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    /// A leaf for `127.0.0.1` (and `server.global.nomad`, the name Nomad's servers carry).
    fn leaf(&self, cn: &str) -> (String, String) {
        let mut p = CertificateParams::new(vec!["server.global.nomad".to_string()]).unwrap();
        p.subject_alt_names
            .push(SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()));
        p.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn pem(&self) -> String {
        self.cert.pem()
    }
}

/// Parses PEM certificates with rustls' own PEM reader.
fn certs(pem: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .expect("PEM certificates")
}

fn key(pem: &str) -> rustls::pki_types::PrivateKeyDer<'static> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::PrivateKeyDer::from_pem_slice(pem.as_bytes()).expect("a PEM key")
}

/// A loopback TLS server with `leaf` (cert, key); when `client_ca` is given it requires a
/// client certificate signed by it. Returns `https://127.0.0.1:<port>`.
async fn server(leaf: (String, String), client_ca: Option<&Ca>) -> String {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap();
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(certs(&ca.pem()).remove(0)).unwrap();
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .unwrap();
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder
        .with_single_cert(certs(&leaf.0), key(&leaf.1))
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("https://{}", l.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = vec![0u8; 8192];
                let _ = s.read(&mut buf).await;
                let body =
                    r#"{"config":{"Region":"global"},"stats":{"client":{"node_id":"tls-node"}}}"#;
                let _ = s
                    .write_all(
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .await;
                let _ = s.shutdown().await;
            });
        }
    });
    addr
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

async fn ask(cfg: NomadConfig) -> Result<String, NomadError> {
    let a = Client::new(&cfg)?.agent_self().await?;
    Ok(a.node_id().unwrap_or_default().to_string())
}

#[tokio::test]
async fn nomad_cacert_is_the_only_trust_root() {
    let dir = tempfile::tempdir().unwrap();
    let (ours, other) = (Ca::new("nomad-ca"), Ca::new("another-ca"));
    let addr = server(ours.leaf("server.global.nomad"), None).await;
    let ours_pem = write(dir.path(), "ca.pem", &ours.pem());
    let other_pem = write(dir.path(), "other.pem", &other.pem());

    // Signed by NOMAD_CACERT: trusted.
    let cfg = NomadConfig {
        ca_cert: Some(ours_pem),
        ..NomadConfig::plain(&addr)
    };
    assert_eq!(ask(cfg).await.unwrap(), "tls-node");

    // Another CA in NOMAD_CACERT: the server's certificate is refused.
    let cfg = NomadConfig {
        ca_cert: Some(other_pem.clone()),
        ..NomadConfig::plain(&addr)
    };
    let e = ask(cfg).await.unwrap_err();
    assert!(matches!(e, NomadError::Unreachable { .. }), "{e:?}");
    let said = e.to_string();
    assert!(
        said.contains("UnknownIssuer") && said.contains("check NOMAD_CACERT"),
        "the error must name the certificate problem and what to check: {said}"
    );

    // No NOMAD_CACERT: the built-in roots do not know a private CA either.
    let e = ask(NomadConfig::plain(&addr)).await.unwrap_err();
    assert!(matches!(e, NomadError::Unreachable { .. }), "{e:?}");

    // A bundle trusts every CA in it, not only the first.
    let bundle = write(
        dir.path(),
        "bundle.pem",
        &format!("{}{}", other.pem(), ours.pem()),
    );
    let cfg = NomadConfig {
        ca_cert: Some(bundle),
        ..NomadConfig::plain(&addr)
    };
    assert_eq!(ask(cfg).await.unwrap(), "tls-node");

    // NOMAD_SKIP_VERIFY: accepted whoever signed it (as `nomad -tls-skip-verify`).
    let cfg = NomadConfig {
        ca_cert: Some(other_pem),
        skip_verify: true,
        ..NomadConfig::plain(&addr)
    };
    assert_eq!(ask(cfg).await.unwrap(), "tls-node");
}

#[tokio::test]
async fn a_server_that_verifies_clients_gets_nomad_client_cert() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("nomad-ca");
    let addr = server(ca.leaf("server.global.nomad"), Some(&ca)).await;
    let ca_pem = write(dir.path(), "ca.pem", &ca.pem());
    let (cert, key) = ca.leaf("cli.global.nomad");
    let cert = write(dir.path(), "cli.pem", &cert);
    let key = write(dir.path(), "cli-key.pem", &key);

    let cfg = NomadConfig {
        ca_cert: Some(ca_pem.clone()),
        client_cert: Some(cert),
        client_key: Some(key.clone()),
        ..NomadConfig::plain(&addr)
    };
    assert_eq!(ask(cfg).await.unwrap(), "tls-node");

    // Without a client certificate the handshake is refused.
    let cfg = NomadConfig {
        ca_cert: Some(ca_pem.clone()),
        ..NomadConfig::plain(&addr)
    };
    assert!(ask(cfg).await.is_err());

    // A client certificate file that cannot be read is a configuration error naming it.
    let cfg = NomadConfig {
        ca_cert: Some(ca_pem),
        client_cert: Some(dir.path().join("missing.pem")),
        client_key: Some(key),
        ..NomadConfig::plain(&addr)
    };
    let Err(e) = Client::new(&cfg) else {
        panic!("a missing client certificate was accepted")
    };
    assert!(e.to_string().contains("NOMAD_CLIENT_CERT"), "{e}");
}

#[test]
fn an_unreadable_or_bad_cacert_is_a_configuration_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = NomadConfig {
        ca_cert: Some(dir.path().join("nope.pem")),
        ..NomadConfig::plain("https://127.0.0.1:4646")
    };
    let Err(e) = Client::new(&missing) else {
        panic!("a missing CA file was accepted")
    };
    assert!(matches!(e, NomadError::Config(_)), "{e:?}");
    assert!(e.to_string().contains("NOMAD_CACERT"), "{e}");
    let bad = NomadConfig {
        ca_cert: Some(write(dir.path(), "bad.pem", "not a certificate")),
        ..NomadConfig::plain("https://127.0.0.1:4646")
    };
    let e = Client::new(&bad).err();
    assert!(
        matches!(e, Some(NomadError::Config(_))),
        "a file with no certificate must be refused: {e:?}"
    );
}
