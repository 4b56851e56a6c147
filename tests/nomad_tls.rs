//! TLS to Nomad as the Nomad CLI does it (issue 13 §5): `NOMAD_CACERT` is the only trust
//! root, `NOMAD_CLIENT_CERT`/`NOMAD_CLIENT_KEY` answer a server that asks for a client
//! certificate (Nomad's `verify_https_client`), `NOMAD_SKIP_VERIFY` skips the server check.
//!
//! `NOMAD_TLS_SERVER_NAME` checks the certificate against a name other than the address's
//! host, `NOMAD_CAPATH` trusts every CA in a directory, `NOMAD_HTTP_AUTH` sends basic auth
//! (issue 37 item 8).
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

    /// A leaf carrying only the DNS `names` (no IP address).
    fn leaf_named(&self, names: &[&str]) -> (String, String) {
        let mut p = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
        p.distinguished_name.push(DnType::CommonName, names[0]);
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
    recording_server(leaf, client_ca).await.0
}

/// [`server`], also returning the head of every request it was sent.
async fn recording_server(
    leaf: (String, String),
    client_ca: Option<&Ca>,
) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen_by_server = seen.clone();
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
            let seen = seen_by_server.clone();
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = vec![0u8; 8192];
                let n = s.read(&mut buf).await.unwrap_or(0);
                seen.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&buf[..n]).to_string());
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
    (addr, seen)
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

/// The agent's certificate names `server.global.nomad` only, the address is an IP: refused,
/// until NOMAD_TLS_SERVER_NAME names what the certificate carries (as `nomad
/// -tls-server-name`); a name it does not carry is still refused.
#[tokio::test]
async fn tls_server_name_verifies_a_certificate_that_does_not_name_the_address() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("nomad-ca");
    let addr = server(ca.leaf_named(&["server.global.nomad"]), None).await;
    let ca_pem = write(dir.path(), "ca.pem", &ca.pem());
    let with = |name: Option<&str>| NomadConfig {
        ca_cert: Some(ca_pem.clone()),
        tls_server_name: name.map(str::to_string),
        ..NomadConfig::plain(&addr)
    };
    let e = ask(with(None)).await.unwrap_err();
    assert!(
        e.to_string().contains("NOMAD_TLS_SERVER_NAME"),
        "the hint must point at the server name setting: {e}"
    );
    assert_eq!(
        ask(with(Some("server.global.nomad"))).await.unwrap(),
        "tls-node"
    );
    assert!(ask(with(Some("client.global.nomad"))).await.is_err());
    let Err(e) = Client::new(&with(Some("10.0.0.1"))) else {
        panic!("an IP address as the server name was accepted")
    };
    assert!(matches!(e, NomadError::Config(_)), "{e:?}");
}

/// NOMAD_CAPATH: every CA in the directory (and below) is trusted, nothing else; a file in it
/// that holds no certificate is an error naming it; NOMAD_CACERT wins when both are set.
#[tokio::test]
async fn ca_path_trusts_every_ca_in_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let (ours, other) = (Ca::new("nomad-ca"), Ca::new("another-ca"));
    let addr = server(ours.leaf("server.global.nomad"), None).await;
    let good = dir.path().join("good");
    std::fs::create_dir_all(good.join("sub")).unwrap();
    write(&good, "a-other.pem", &other.pem());
    write(&good.join("sub"), "ours.crt", &ours.pem());
    let cfg = NomadConfig {
        ca_path: Some(good.clone()),
        ..NomadConfig::plain(&addr)
    };
    assert_eq!(ask(cfg).await.unwrap(), "tls-node");

    let wrong = dir.path().join("wrong");
    std::fs::create_dir(&wrong).unwrap();
    write(&wrong, "other.pem", &other.pem());
    let cfg = NomadConfig {
        ca_path: Some(wrong.clone()),
        ..NomadConfig::plain(&addr)
    };
    let e = ask(cfg).await.unwrap_err();
    assert!(matches!(e, NomadError::Unreachable { .. }), "{e:?}");

    // NOMAD_CACERT wins over NOMAD_CAPATH (go-rootcerts LoadCACerts).
    let cfg = NomadConfig {
        ca_cert: Some(write(dir.path(), "ours.pem", &ours.pem())),
        ca_path: Some(wrong.clone()),
        ..NomadConfig::plain(&addr)
    };
    assert_eq!(ask(cfg).await.unwrap(), "tls-node");

    write(&wrong, "README", "not a certificate");
    let cfg = NomadConfig {
        ca_path: Some(wrong),
        ..NomadConfig::plain(&addr)
    };
    let Err(e) = Client::new(&cfg) else {
        panic!("a CA directory with a non-certificate file was accepted")
    };
    assert!(
        e.to_string().contains("NOMAD_CAPATH") && e.to_string().contains("README"),
        "{e}"
    );
    let cfg = NomadConfig {
        ca_path: Some(dir.path().join("missing")),
        ..NomadConfig::plain(&addr)
    };
    assert!(matches!(Client::new(&cfg), Err(NomadError::Config(_))));
}

/// NOMAD_HTTP_AUTH `user:password` reaches the server as basic auth on the request.
#[tokio::test]
async fn http_auth_is_sent_as_basic_auth() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("nomad-ca");
    let (addr, seen) = recording_server(ca.leaf("server.global.nomad"), None).await;
    let cfg = NomadConfig {
        ca_cert: Some(write(dir.path(), "ca.pem", &ca.pem())),
        http_auth: Some("ops:s3cret".into()),
        ..NomadConfig::plain(&addr)
    };
    assert_eq!(ask(cfg).await.unwrap(), "tls-node");
    let req = seen.lock().unwrap().join("\n").to_ascii_lowercase();
    // base64("ops:s3cret")
    assert!(
        req.contains("authorization: basic b3bzonmzy3jlda=="),
        "no basic auth in the request: {req}"
    );
}

/// The flags parse with the Nomad CLI's single dash, and the variables are read.
#[test]
fn tls_server_name_ca_path_and_http_auth_parse_as_nomad_spells_them() {
    use clap::Parser;
    let args = [
        "dhv-binder",
        "-tls-server-name=server.global.nomad",
        "-ca-path",
        "/etc/nomad.d/ca",
        "-http-auth=ops:pw",
        "volume",
        "list",
    ]
    .map(std::ffi::OsString::from);
    let c = dhv_binder::cli::Cli::try_parse_from(dhv_binder::cli::normalize_args(args)).unwrap();
    assert_eq!(
        c.nomad.tls_server_name.as_deref(),
        Some("server.global.nomad")
    );
    assert_eq!(c.nomad.ca_path, Some(PathBuf::from("/etc/nomad.d/ca")));
    assert_eq!(c.nomad.http_auth.as_deref(), Some("ops:pw"));
}

/// Runs `dhv-binder agent` for `seconds` with `env` only (as a Nomad client's task would
/// see it) and `args` after `agent`; returns its stderr.
fn agent_for(dir: &Path, seconds: u32, env: &[(&str, &str)], args: &[&str]) -> String {
    let out = std::process::Command::new("timeout")
        .arg(seconds.to_string())
        .arg(env!("CARGO_BIN_EXE_dhv-binder"))
        .arg("agent")
        .arg("--allow-unsigned-records")
        .args(["--helper-cgroup", "none"])
        .args(args)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--socket")
        .arg(dir.join("api.sock"))
        .arg("--plugin-dir")
        .arg(dir.join("plugins"))
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .envs(env.iter().copied())
        .output()
        .expect("run the agent");
    // An agent that reached Nomad placed its placeholder guard (a bind mount at
    // `state/mnt`, kept across restarts by design): detached here, so that the test's
    // temporary directory leaves no mount behind, whatever the test asserts next.
    let mut mounts = dhv_binder::node::mounts::mounts_under(dir);
    mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for m in mounts {
        let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
    }
    assert!(
        dhv_binder::node::mounts::mounts_under(dir).is_empty(),
        "a mount under {} could not be detached",
        dir.display()
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Issue 45 #7: a Nomad client passes its own NOMAD_* variables (all but the token and
/// licence ones) to the raw_exec and exec tasks it starts, so the agent run as a system job
/// may inherit the client's NOMAD_SKIP_VERIFY. Inherited, it does not turn TLS verification
/// off: the agent refuses a certificate it cannot verify and says why (before, it connected
/// to anyone); `--tls-skip-verify` on the command line still does. Over the Task API socket
/// an inherited CA path that this task cannot read is set aside instead of stopping the
/// agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inherited_nomad_skip_verify_does_not_turn_verification_off() {
    let dir = tempfile::tempdir().unwrap();
    let untrusted = Ca::new("someone-else");
    let (addr, seen) = recording_server(untrusted.leaf("server.global.nomad"), None).await;
    let d = dir.path().to_path_buf();
    let addr1 = addr.clone();
    let log = tokio::task::spawn_blocking(move || {
        agent_for(
            &d,
            4,
            &[("NOMAD_ADDR", addr1.as_str()), ("NOMAD_SKIP_VERIFY", "1")],
            &[],
        )
    })
    .await
    .unwrap();
    assert!(
        log.contains("NOMAD_SKIP_VERIFY is set in the environment")
            && log.contains("--tls-skip-verify"),
        "the agent says it set the variable aside: {log}"
    );
    assert!(
        log.contains("waiting for the local Nomad agent") && log.contains("UnknownIssuer"),
        "the certificate is refused: {log}"
    );
    assert!(
        seen.lock().unwrap().is_empty(),
        "no request reached the unverified server"
    );
    // On the command line, the flag still skips the check (testing only).
    let d = dir.path().to_path_buf();
    let addr2 = addr.clone();
    let log = tokio::task::spawn_blocking(move || {
        agent_for(
            &d,
            4,
            &[("NOMAD_ADDR", addr2.as_str())],
            &["--tls-skip-verify"],
        )
    })
    .await
    .unwrap();
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .any(|r| r.starts_with("GET /v1/agent/self")),
        "with --tls-skip-verify the agent asked the server: {log}"
    );
    // Over a unix socket, an inherited CA file the task cannot read does not stop it.
    let sock = format!("unix://{}", dir.path().join("nomad.sock").display());
    let d = dir.path().to_path_buf();
    let log = tokio::task::spawn_blocking(move || {
        agent_for(
            &d,
            3,
            &[
                ("NOMAD_ADDR", sock.as_str()),
                ("NOMAD_CACERT", "/nonexistent/nomad-ca.pem"),
            ],
            &[],
        )
    })
    .await
    .unwrap();
    assert!(
        log.contains("NOMAD_CACERT not used") && log.contains("waiting for the local Nomad agent"),
        "the inherited CA path is set aside, the agent waits for the socket: {log}"
    );
    assert!(!log.contains("nomad-ca.pem:"), "{log}");
}
