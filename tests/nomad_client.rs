//! HTTP client hardening (issue 13 §5): no token across a redirect, no proxy for loopback,
//! bounded bodies, NOMAD_SKIP_VERIFY parsed as the Nomad CLI parses it.

use dhv_binder::config::{go_bool, NomadConfig};
use dhv_binder::nomad::{is_loopback, Client, NomadError};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A loopback server answering every request with `reply(port)`; returns its address,
/// a request counter and the requests it saw.
async fn server(
    reply: impl Fn() -> String + Send + Sync + 'static,
) -> (String, Arc<AtomicUsize>, Arc<Mutex<Vec<String>>>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", l.local_addr().unwrap());
    let hits = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (h, sn, reply) = (hits.clone(), seen.clone(), Arc::new(reply));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let (h, sn, reply) = (h.clone(), sn.clone(), reply.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let n = s.read(&mut buf).await.unwrap_or(0);
                h.fetch_add(1, Ordering::SeqCst);
                sn.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&buf[..n]).into_owned());
                let _ = s.write_all(reply().as_bytes()).await;
            });
        }
    });
    (addr, hits, seen)
}

fn client(addr: &str) -> Client {
    Client::new(&NomadConfig {
        token: Some("s3cret-token".into()),
        ..NomadConfig::plain(addr)
    })
    .unwrap()
}

/// Every test here runs with a proxy in the environment that must never be used for loopback.
async fn poison_proxy() -> Arc<AtomicUsize> {
    let (proxy, hits, _) = server(|| {
        "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string()
    })
    .await;
    for k in ["HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"] {
        std::env::set_var(k, &proxy);
    }
    std::env::remove_var("NO_PROXY");
    std::env::remove_var("no_proxy");
    hits
}

#[tokio::test]
async fn no_token_across_a_redirect_and_no_proxy_for_loopback() {
    let proxy_hits = poison_proxy().await;
    let (other, other_hits, _) = server(|| {
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}".to_string()
    })
    .await;
    // Another origin (another port): the redirect target must never see the token.
    let target = format!("{other}/v1/agent/self");
    let (addr, hits, seen) = server(move || {
        format!("HTTP/1.1 307 Temporary Redirect\r\nLocation: {target}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    })
    .await;
    let r = client(&addr).agent_self().await;
    assert!(
        matches!(r, Err(NomadError::Status { status: 307, .. })),
        "{r:?}"
    );
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    assert!(seen.lock().unwrap()[0].contains("s3cret-token"));
    assert_eq!(
        other_hits.load(Ordering::SeqCst),
        0,
        "the redirect was followed"
    );
    assert_eq!(
        proxy_hits.load(Ordering::SeqCst),
        0,
        "loopback went through HTTP_PROXY"
    );
}

#[tokio::test]
async fn oversized_answers_are_not_read() {
    let _ = poison_proxy().await;
    let (addr, _, _) = server(|| {
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\nConnection: close\r\n\r\n{"
            .to_string()
    })
    .await;
    let r = client(&addr).agent_self().await;
    assert!(matches!(r, Err(NomadError::TooLarge { .. })), "{r:?}");
    // An error body full of terminal escapes is escaped and cut.
    let (addr, _, _) = server(|| {
        let body = format!("\u{1b}[2Jfake{}", "x".repeat(200_000));
        format!(
            "HTTP/1.1 500 Internal Server Error\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    })
    .await;
    let e = client(&addr).agent_self().await.unwrap_err().to_string();
    assert!(!e.contains('\u{1b}'), "{e:?}");
    assert!(e.len() < 2000, "{}", e.len());
}

#[test]
fn skip_verify_is_parsed_as_go_parse_bool() {
    for t in ["1", "t", "T", "TRUE", "true", "True"] {
        assert_eq!(go_bool(t), Ok(true), "{t}");
    }
    for f in ["", "0", "f", "F", "FALSE", "false", "False"] {
        assert_eq!(go_bool(f), Ok(false), "{f}");
    }
    // clap's default would take these as true; Nomad does not.
    for bad in ["yes", "on", "tRuE", "2", "y"] {
        assert!(go_bool(bad).is_err(), "{bad}");
    }
    assert!(is_loopback("http://127.0.0.1:4646"));
    assert!(is_loopback("http://127.8.0.1:4646"));
    assert!(is_loopback("https://localhost:4646"));
    assert!(is_loopback("http://[::1]:4646"));
    assert!(!is_loopback("http://10.0.0.1:4646"));
    assert!(!is_loopback("http://localhost.evil.example:4646"));
}

#[test]
fn skip_verify_flag_and_env_parse_through_clap() {
    use clap::Parser;
    let parse = |args: &[&str]| dhv_binder::cli::Cli::try_parse_from(args);
    let c = parse(&["dhv-binder", "--tls-skip-verify", "volume", "list"]).unwrap();
    assert!(c.nomad.skip_verify);
    let c = parse(&["dhv-binder", "--tls-skip-verify=false", "volume", "list"]).unwrap();
    assert!(!c.nomad.skip_verify);
    let c = parse(&["dhv-binder", "volume", "list"]).unwrap();
    assert!(!c.nomad.skip_verify);
    assert!(parse(&["dhv-binder", "--tls-skip-verify=yes", "volume", "list"]).is_err());
}

/// A Nomad that answers every blocking query at once without `X-Nomad-Index`: the allocation
/// poll and the record catalogue wait [`MIN_QUERY_INTERVAL`] between queries instead of
/// spinning (the review saw 420–930 requests per 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_queries_without_an_index_do_not_spin() {
    let _ = poison_proxy().await;
    let (addr, hits, seen) = server(|| {
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n[]".to_string()
    })
    .await;
    let mut wcfg =
        dhv_binder::nomad::watch::WatchConfig::new("3f6b2c1e-8d4a-4b7e-9c2f-5a1d7e3b9c40");
    wcfg.mode = dhv_binder::nomad::watch::WatchMode::Poll;
    let (wtx, mut wrx) = tokio::sync::mpsc::channel(64);
    let watch = tokio::spawn(dhv_binder::nomad::watch::run(client(&addr), wcfg, wtx));
    let (ctx, mut crx) = tokio::sync::mpsc::channel(64);
    let cat = tokio::spawn(dhv_binder::cluster::catalog::run(
        client(&addr),
        std::time::Duration::from_secs(300),
        dhv_binder::cluster::catalog::Pace::new(std::time::Duration::ZERO),
        dhv_binder::cluster::trust::RecordTrust::Unverified,
        dhv_binder::cluster::catalog::Rejections::default(),
        ctx,
    ));
    let drain = tokio::spawn(async move {
        loop {
            tokio::select! {
                Some(_) = wrx.recv() => {}
                Some(_) = crx.recv() => {}
                else => break,
            }
        }
    });
    let window = std::time::Duration::from_secs(3);
    tokio::time::sleep(window).await;
    watch.abort();
    cat.abort();
    drain.abort();
    let seen = seen.lock().unwrap().clone();
    let polls = seen.iter().filter(|r| r.contains("/allocations")).count();
    // An empty allocation list is followed by one `GET /v1/node/:id` (is the node still
    // known? issue 11): part of that poll, not a query of its own.
    let node_checks = seen
        .iter()
        .filter(|r| r.contains("/v1/node/") && !r.contains("/allocations"))
        .count();
    assert!(
        node_checks <= polls,
        "{node_checks} node checks for {polls} polls"
    );
    let n = hits.load(Ordering::SeqCst) - node_checks;
    eprintln!(
        "{n} requests in {window:?} ({polls} allocation polls) against a Nomad that never blocks"
    );
    // At most one query per floor interval per loop, plus the first of each.
    let bound = 2
        * (window.as_millis() / dhv_binder::nomad::watch::MIN_QUERY_INTERVAL.as_millis()) as usize
        + 2;
    assert!(n <= bound, "{n} requests in {window:?} (bound {bound})");
    assert!(polls >= 2, "the poll loop did not run: {polls}");
}

/// A Nomad where some variable is written all the time: every blocking variables list
/// answers at once with a higher index (the variables table index, issue 35). The volume
/// records' watch lists at most once per floor (1 s here, plus up to 0.2 s of jitter), not
/// once per write; a nudge (an allocation names a volume the node has no record for) ends
/// the floor wait at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_watch_lists_once_per_floor_however_often_variables_change() {
    let _ = poison_proxy().await;
    let index = Arc::new(std::sync::atomic::AtomicU64::new(10));
    let i = index.clone();
    let (addr, hits, _) = server(move || {
        let n = i.fetch_add(1, Ordering::SeqCst);
        format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Nomad-Index: {n}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n[]")
    })
    .await;
    let run = |floor: std::time::Duration| {
        let pace = dhv_binder::cluster::catalog::Pace::new(floor);
        let nudge = pace.nudge.clone();
        let (ctx, mut crx) = tokio::sync::mpsc::channel(64);
        let cat = tokio::spawn(dhv_binder::cluster::catalog::run(
            client(&addr),
            std::time::Duration::from_secs(300),
            pace,
            dhv_binder::cluster::trust::RecordTrust::Unverified,
            dhv_binder::cluster::catalog::Rejections::default(),
            ctx,
        ));
        let drain = tokio::spawn(async move { while crx.recv().await.is_some() {} });
        (cat, drain, nudge)
    };
    // The floor: over 3 s, the first list and at most 3 more (every 1–1.2 s).
    let (cat, drain, _) = run(std::time::Duration::from_secs(1));
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    cat.abort();
    drain.abort();
    let n = hits.swap(0, Ordering::SeqCst);
    assert!(
        (2..=4).contains(&n),
        "{n} lists in 3 s with a 1 s floor against a variables index that always rose"
    );
    // The nudge: with a 60 s floor, each notification lists again at once.
    let (cat, drain, nudge) = run(std::time::Duration::from_secs(60));
    let wait_hits = |want: usize| {
        let hits = hits.clone();
        async move {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while hits.load(Ordering::SeqCst) < want {
                assert!(
                    std::time::Instant::now() < deadline,
                    "{} lists, want {want}: the nudge did not end the floor wait",
                    hits.load(Ordering::SeqCst)
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    };
    wait_hits(1).await;
    nudge.notify_one();
    wait_hits(2).await;
    nudge.notify_one();
    wait_hits(3).await;
    cat.abort();
    drain.abort();
}
