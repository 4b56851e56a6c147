//! Unit tests of the Nomad client: URLs, errors, bodies and transport rules.

use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A burst of concurrent requests opens one connection each; once answered, at most
/// [`POOL_IDLE_PER_HOST`] stay open (idle connections hold buffers: memory).
#[tokio::test]
async fn a_burst_leaves_few_idle_connections() {
    const BURST: usize = 20;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    let open = Arc::new(AtomicUsize::new(0));
    // Every answer waits until the whole burst is in: one connection per request.
    let all_in = Arc::new(tokio::sync::Barrier::new(BURST));
    let o = open.clone();
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                return;
            };
            let (o, all_in) = (o.clone(), all_in.clone());
            o.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |_req| {
                    let all_in = all_in.clone();
                    async move {
                        all_in.wait().await;
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from("{}")),
                        ))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                    .await;
                o.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    let client = loopback_client(&addr);
    let reads: Vec<_> = (0..BURST)
        .map(|i| {
            let c = client.clone();
            tokio::spawn(async move { c.allocation(&format!("a{i}")).await })
        })
        .collect();
    for r in reads {
        r.await.unwrap().unwrap();
    }
    assert!(open.load(Ordering::SeqCst) >= POOL_IDLE_PER_HOST);
    // The extra connections close as they return to the pool (waited on, not timed).
    for _ in 0..200 {
        if open.load(Ordering::SeqCst) <= POOL_IDLE_PER_HOST {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "{} connections stay open after the burst, more than {POOL_IDLE_PER_HOST}",
        open.load(Ordering::SeqCst)
    );
}

/// Issue 10: a large list of the node's allocations makes the next list request close
/// its connection (the read buffer a large answer grew goes with it); small lists keep
/// theirs.
#[tokio::test]
async fn a_large_allocation_list_retires_its_connection_after_the_next_answer() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    // (connection number, whether the request asked to close it), per request.
    let seen = Arc::new(std::sync::Mutex::new(Vec::<(usize, bool)>::new()));
    let answers = Arc::new(AtomicUsize::new(0));
    let (sn, an) = (seen.clone(), answers.clone());
    tokio::spawn(async move {
        for conn in 0.. {
            let Ok((sock, _)) = listener.accept().await else {
                return;
            };
            let (sn, an) = (sn.clone(), an.clone());
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req: hyper::Request<_>| {
                    let close = req
                        .headers()
                        .get(hyper::header::CONNECTION)
                        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
                    sn.lock().unwrap().push((conn, close));
                    // The second and the fifth answer are large, the others small.
                    let pad = if matches!(an.fetch_add(1, Ordering::SeqCst), 1 | 4) {
                        "x".repeat(ROTATE_AFTER_BYTES)
                    } else {
                        String::new()
                    };
                    let body = format!(r#"[{{"ID":"a1","ModifyIndex":7,"Pad":"{pad}"}}]"#);
                    async move {
                        let mut r = hyper::Response::new(http_body_util::Full::new(
                            bytes::Bytes::from(body),
                        ));
                        r.headers_mut()
                            .insert("X-Nomad-Index", hyper::header::HeaderValue::from(7u32));
                        Ok::<_, std::convert::Infallible>(r)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                    .await;
            });
        }
    });
    let client = loopback_client(&addr);
    // Blocking queries, then a list that is none (index 0), then a blocking query.
    for index in [5, 5, 5, 5, 0, 5] {
        let l = client
            .node_allocations_listed("n1", index, Duration::from_secs(1))
            .await
            .unwrap()
            .0;
        assert_eq!(l.value.len(), 1);
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![
            (0, false),
            (0, false),
            (0, true),
            (1, false),
            (1, true),
            (2, false)
        ],
        "small, large (kept), the next closes its connection, then a new one; a \
         non-blocking list closes its own, large or not, and leaves the next alone"
    );
}

/// A one-answer HTTP server: every request gets `status` with a text/plain `body`.
async fn answering(status: &'static str, body: &'static str) -> Client {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let mut buf = [0u8; 8192];
            let _ = s.read(&mut buf).await;
            let resp = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
        }
    });
    Client::new(&NomadConfig::plain(&format!("http://{addr}"))).unwrap()
}

/// Issue 11 #1: the body of each lock operation is one Nomad accepts
/// (`canonicalizeAndValidate`): release and renew carry `Lock.ID` only; a release with any
/// `Items` key, even `{}`, is refused with 400.
#[tokio::test]
async fn lock_operations_send_the_bodies_nomad_accepts() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let mut req = Vec::new();
            let mut buf = [0u8; 8192];
            // Headers, then Content-Length bytes of body.
            loop {
                let n = s.read(&mut buf).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                req.extend_from_slice(&buf[..n]);
                let text = String::from_utf8_lossy(&req).to_string();
                if let Some(h) = text.find("\r\n\r\n") {
                    let len = text
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length: ")
                                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    if req.len() >= h + 4 + len {
                        break;
                    }
                }
            }
            let text = String::from_utf8_lossy(&req).to_string();
            let body = "{\"Namespace\":\"default\",\"Path\":\"p\",\"Lock\":{\"ID\":\"L\"}}";
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
            let _ = tx.send(text);
        }
    });
    let c = Client::new(&NomadConfig::plain(&format!("http://{addr}"))).unwrap();
    let var = |id: &str| Variable {
        namespace: "default".into(),
        path: "dhv-binder/claims/v".into(),
        items: [("node_id".to_string(), "n".to_string())].into(),
        lock: Some(VariableLock {
            id: id.into(),
            ttl: "15s".into(),
            lock_delay: "15s".into(),
        }),
        ..Default::default()
    };
    let body_of = |req: String| -> serde_json::Value {
        let b = &req[req.find("\r\n\r\n").unwrap() + 4..];
        serde_json::from_str(b).unwrap()
    };
    c.lock_op(LockOp::Acquire, &var("")).await.unwrap();
    let acquire = body_of(rx.recv().await.unwrap());
    assert_eq!(acquire["Items"]["node_id"], "n");
    assert_eq!(acquire["Lock"]["TTL"], "15s");
    for op in [LockOp::Renew, LockOp::Release] {
        c.lock_op(op, &var("L")).await.unwrap();
        let req = rx.recv().await.unwrap();
        assert!(req.contains(op.query()), "{req}");
        let body = body_of(req);
        assert!(body.get("Items").is_none(), "{op:?} sent Items: {body}");
        assert_eq!(body["Lock"], serde_json::json!({"ID": "L"}), "{op:?}");
    }
}

/// Issue 34 item 4: a lock operation the local agent cannot take at all (nothing listens:
/// it restarts) goes to the fallback agents in turn; an agent that answers, even with an
/// error, is not bypassed (a partitioned agent answers, and its answer decides).
#[tokio::test]
async fn lock_operations_go_to_a_fallback_only_when_the_local_agent_cannot_be_connected_to() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let body = "{\"Namespace\":\"default\",\"Path\":\"p\",\"Lock\":{\"ID\":\"L\"}}";
    let server = answering("200 OK", body).await;
    let cfg = NomadConfig::plain(&format!("http://{closed}"));
    let var = Variable {
        namespace: "default".into(),
        path: "dhv-binder/claims/v".into(),
        lock: Some(VariableLock {
            id: "L".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let alone = Client::new(&cfg).unwrap();
    assert!(matches!(
        alone.lock_op(LockOp::Renew, &var).await,
        Err(NomadError::Unreachable { .. })
    ));
    let unreachable = format!("http://{closed}");
    let with = Client::new(&cfg)
        .unwrap()
        .with_fallbacks(&cfg, &[unreachable, server.address().to_string()])
        .unwrap();
    let got = with.lock_op(LockOp::Renew, &var).await.unwrap();
    assert_eq!(got.lock.map(|l| l.id).as_deref(), Some("L"));
    // A local agent that answers (here a 500 from a partitioned client) decides.
    let partitioned = answering("500 Internal Server Error", "rpc error: failed to get conn").await;
    let pcfg = NomadConfig::plain(partitioned.address());
    let with = Client::new(&pcfg)
        .unwrap()
        .with_fallbacks(&pcfg, &[server.address().to_string()])
        .unwrap();
    assert!(matches!(
        with.lock_op(LockOp::Renew, &var).await,
        Err(NomadError::Status { status: 500, .. })
    ));
}

/// Issue 11 #7: `HostVolume.Delete` answers a volume already gone with 500 "no such
/// volume" (nomad/host_volume_endpoint.go); other 500s stay errors.
#[tokio::test]
async fn deleting_a_host_volume_that_is_gone_is_success() {
    let c = answering("500 Internal Server Error", "no such volume: 1234").await;
    c.delete_host_volume("default", "1234").await.unwrap();
    // Through a client agent (`helper/pool` `ConnPool.RPC` wraps uncoded errors).
    let c = answering(
        "500 Internal Server Error",
        "rpc error: no such volume: 1234",
    )
    .await;
    c.delete_host_volume("default", "1234").await.unwrap();
    let c = answering(
        "500 Internal Server Error",
        "volume 1234 in use by allocations: [a]",
    )
    .await;
    let e = c.delete_host_volume("default", "1234").await.unwrap_err();
    assert!(matches!(e, NomadError::Status { status: 500, .. }), "{e}");
}

/// An election answers "No cluster leader", through a client agent with `rpc error: `,
/// and the Task API "Server error authenticating request" (`ACL.WhoAmI` failed): all
/// are [`NomadError::NoLeader`], which the callers retry.
#[tokio::test]
async fn an_election_through_a_client_agent_or_the_task_api_is_no_leader() {
    for body in [
        "No cluster leader",
        "rpc error: No cluster leader",
        "Server error authenticating request\n",
    ] {
        let c = answering("500 Internal Server Error", body).await;
        let e = c.delete_host_volume("default", "1234").await.unwrap_err();
        assert!(matches!(e, NomadError::NoLeader { .. }), "{body}: {e}");
    }
}
