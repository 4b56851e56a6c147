//! The local socket cannot be starved (issue 13 §2): idle and slow connections are bounded
//! per peer UID and overall, slow headers time out, and a caller still gets an answer.

use dhv_binder::api::{serve_with, Limits, Request2Agent};
use dhv_binder::config::NomadConfig;
use dhv_binder::nomad::identity::Verifier;
use dhv_binder::nomad::Client;
use std::path::Path;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

fn verifier() -> Verifier {
    let c = Client::new(&NomadConfig::plain("http://127.0.0.1:9")).unwrap();
    Verifier::new(c, &[])
}

async fn health(socket: &Path) -> Option<String> {
    let mut s = UnixStream::connect(socket).await.ok()?;
    s.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.ok()?;
    Some(String::from_utf8_lossy(&out).into_owned())
}

/// True when the server closed `s` (EOF or reset) before `within`.
async fn closed(s: &mut UnixStream, within: Duration) -> bool {
    let mut b = [0u8; 512];
    loop {
        match tokio::time::timeout(within, s.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // A 408 or similar answer before the close is fine: keep reading.
            Ok(Ok(_)) => continue,
            Err(_) => return false,
        }
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_starve_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    let (listener, _guard) = dhv_binder::api::bind(&socket).unwrap();
    let (tx, _rx) = tokio::sync::mpsc::channel::<Request2Agent>(8);
    let limits = Limits {
        max_connections: 16,
        max_per_uid: 8,
        header_read_timeout: Duration::from_secs(2),
        max_connection_life: Duration::from_secs(60),
    };
    tokio::spawn(serve_with(listener, verifier(), tx, limits));
    assert!(health(&socket).await.unwrap().contains("\"ready\":true"));

    let fds_before = open_fds();
    // 500 connections that send one byte and then nothing (the attack in the issue).
    let mut idle = Vec::new();
    for _ in 0..500 {
        let mut s = UnixStream::connect(&socket).await.unwrap();
        let _ = s.write_all(b"G").await;
        idle.push(s);
    }
    // Over the per-UID bound, the server closes the extra connections at once.
    let mut closed_early = 0;
    for s in idle.iter_mut().skip(limits.max_per_uid) {
        if closed(s, Duration::from_secs(20)).await {
            closed_early += 1;
        }
    }
    let server_fds = open_fds().saturating_sub(fds_before + idle.len());
    eprintln!(
        "500 idle connections: {closed_early} closed at once, server side holds ~{server_fds} extra fds"
    );
    assert_eq!(closed_early, 500 - limits.max_per_uid);
    // The ones it kept are closed once their headers are late.
    for s in idle.iter_mut().take(limits.max_per_uid) {
        assert!(
            closed(s, Duration::from_secs(30)).await,
            "a connection with incomplete headers was kept past the header timeout"
        );
    }
    drop(idle);
    // And the socket answers again.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match health(&socket).await {
            Some(r) if r.contains("\"ready\":true") => break,
            other if Instant::now() > deadline => panic!("the socket does not answer: {other:?}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// `/v1/status` is refused to a root caller inside another mount namespace (a task).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_is_refused_to_root_in_another_mount_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    let (listener, _guard) = dhv_binder::api::bind(&socket).unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Request2Agent>(8);
    tokio::spawn(async move {
        while let Some(r) = rx.recv().await {
            if let Request2Agent::Status { reply } = r {
                let _ = reply.send(serde_json::json!({"ok": true}));
            }
        }
    });
    tokio::spawn(serve_with(listener, verifier(), tx, Limits::default()));
    // From this process (root, same namespace): allowed.
    let r = dhv_binder::api::client::call(&socket, hyper::Method::GET, "/v1/status", None).await;
    assert!(r.is_ok(), "{r:?}");
    // From root in a new mount namespace (as a task would be): refused.
    let req = "GET /v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    let out = std::process::Command::new("unshare")
        .args(["--mount", "--", "python3", "-c"])
        .arg(format!(
            "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.connect({:?})\ns.sendall({:?}.encode())\nb=b''\nwhile True:\n  d=s.recv(4096)\n  if not d: break\n  b+=d\nsys.stdout.write(b.decode())",
            socket.display().to_string(),
            req
        ))
        .output()
        .expect("unshare --mount (util-linux) and python3, as root");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("HTTP/1.1 403"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
