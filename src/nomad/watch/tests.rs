use super::*;

/// Issue 11 #10 and #2: Nomad caps a blocking query's wait at 300 s
/// (`MaxBlockingRPCQueryTime`); while an allocation may vanish with its tasks alive, the
/// wait shrinks to the verify interval, so each answer is a verifying read.
#[test]
fn poll_wait_is_capped_and_shrinks_while_verifying() {
    let mut cfg = WatchConfig::new("n");
    cfg.resync_interval = Duration::from_secs(600);
    assert_eq!(cfg.poll_wait(false), Duration::from_secs(300));
    assert_eq!(cfg.poll_wait(true), Duration::from_secs(5));
    cfg.resync_interval = Duration::from_secs(2);
    assert_eq!(cfg.poll_wait(true), Duration::from_secs(2));
}

#[test]
fn backoff_grows_and_is_capped() {
    let b = Duration::from_millis(100);
    let cap = Duration::from_secs(2);
    assert!(backoff_delay(b, cap, 0) <= Duration::from_millis(120));
    assert!(backoff_delay(b, cap, 3) >= Duration::from_millis(640));
    assert!(backoff_delay(b, cap, 30) <= Duration::from_millis(2400));
}

#[test]
fn auth_failures_wait_at_least_a_second_and_are_capped() {
    let mut cfg = WatchConfig::new("n");
    cfg.backoff_base = Duration::from_millis(10);
    cfg.backoff_cap = Duration::from_secs(5);
    for attempt in 0..40 {
        let d = fault_delay(&cfg, Fault::AuthFailed, attempt);
        assert!(d >= Duration::from_secs(1), "{d:?}");
        assert!(d <= Duration::from_secs(6), "{d:?}");
    }
    assert!(fault_delay(&cfg, Fault::Unreachable, 0) < Duration::from_millis(20));
}

#[test]
fn health_serializes_with_its_state_and_fault() {
    let h = Health::Disconnected {
        fault: Fault::AuthFailed,
        reason: "x".into(),
        counters: Counters::default(),
    };
    let v = serde_json::to_value(&h).unwrap();
    assert_eq!(v["state"], "disconnected");
    assert_eq!(v["fault"], "auth-failed");
}

/// A loopback Nomad for the stream path: a node list at index 10 (`list`, empty until
/// the test sets it; counted in `lists`), an event stream fed by the test, and
/// allocation reads that wait until the test opens `gate` (counted in `reads`). Node
/// `node-gone` is unknown (404); any other exists.
mod slow_nomad {
    use bytes::Bytes;
    use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
    use hyper::body::Frame;
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use tokio::sync::{mpsc, watch};

    pub struct Server {
        pub addr: String,
        pub reads: Arc<AtomicUsize>,
        pub lists: Arc<AtomicUsize>,
        pub list: Arc<Mutex<String>>,
        pub gate: watch::Sender<bool>,
        pub lines: mpsc::UnboundedSender<String>,
    }

    pub fn alloc(id: &str, node: &str, status: &str, index: u64, with_job: bool) -> String {
        let job = if with_job {
            r#","Job":{"ID":"j","Namespace":"default","TaskGroups":[]}"#
        } else {
            ""
        };
        format!(
            r#"{{"ID":"{id}","Namespace":"default","NodeID":"{node}","JobID":"j","TaskGroup":"g","DesiredStatus":"run","ClientStatus":"{status}","ModifyIndex":{index},"AllocModifyIndex":{index}{job}}}"#
        )
    }

    pub fn frame(index: u64, allocs: &[String]) -> String {
        let events: Vec<String> = allocs
            .iter()
            .map(|a| {
                format!(
                    r#"{{"Topic":"Allocation","Type":"AllocationUpdated","Key":"k","Namespace":"default","Index":{index},"Payload":{{"Allocation":{a}}}}}"#
                )
            })
            .collect();
        format!("{{\"Index\":{index},\"Events\":[{}]}}\n", events.join(","))
    }

    type Body = BoxBody<Bytes, Infallible>;

    /// Starts the server; `full` answers every allocation read (once the gate opens).
    pub async fn start(full: String) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let reads = Arc::new(AtomicUsize::new(0));
        let lists = Arc::new(AtomicUsize::new(0));
        let list = Arc::new(Mutex::new("[]".to_string()));
        let (gate, gate_rx) = watch::channel(false);
        let (lines, lines_rx) = mpsc::unbounded_channel::<String>();
        let lines_rx = Arc::new(Mutex::new(Some(lines_rx)));
        let (r, ls, l) = (reads.clone(), lists.clone(), list.clone());
        tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    return;
                };
                let (r, ls, l, gate_rx, lines_rx, full) = (
                    r.clone(),
                    ls.clone(),
                    l.clone(),
                    gate_rx.clone(),
                    lines_rx.clone(),
                    full.clone(),
                );
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let (r, ls, l, mut gate_rx, lines_rx, full) = (
                            r.clone(),
                            ls.clone(),
                            l.clone(),
                            gate_rx.clone(),
                            lines_rx.clone(),
                            full.clone(),
                        );
                        async move {
                            let path = req.uri().path().to_string();
                            let body: Body = if path == "/v1/node/node-gone" {
                                return Ok::<_, Infallible>(
                                    hyper::Response::builder()
                                        .status(404)
                                        .body(Full::new(Bytes::from("node not found")).boxed())
                                        .unwrap(),
                                );
                            } else if path.starts_with("/v1/node/")
                                && !path.ends_with("/allocations")
                            {
                                Full::new(Bytes::from("{}")).boxed()
                            } else if path.starts_with("/v1/node/") {
                                ls.fetch_add(1, Ordering::SeqCst);
                                let answer = l.lock().unwrap().clone();
                                Full::new(Bytes::from(answer)).boxed()
                            } else if path == "/v1/event/stream" {
                                let rx = lines_rx.lock().unwrap().take().expect("one stream");
                                let first = futures_util::stream::once(async {
                                    Ok::<_, Infallible>(Frame::data(Bytes::from("{}\n")))
                                });
                                let rest = futures_util::stream::unfold(rx, |mut rx| async move {
                                    let l = rx.recv().await?;
                                    Some((Ok(Frame::data(Bytes::from(l))), rx))
                                });
                                use futures_util::StreamExt;
                                BodyExt::boxed(StreamBody::new(first.chain(rest)))
                            } else {
                                r.fetch_add(1, Ordering::SeqCst);
                                let _ = gate_rx.wait_for(|open| *open).await;
                                Full::new(Bytes::from(full)).boxed()
                            };
                            Ok::<_, Infallible>(
                                hyper::Response::builder()
                                    .header("X-Nomad-Index", "10")
                                    .header("Content-Type", "application/json")
                                    .body(body)
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                        .await;
                });
            }
        });
        Server {
            addr,
            reads,
            lists,
            list,
            gate,
            lines,
        }
    }
}

/// A stream-mode watcher of node `node` against the loopback Nomad at `addr`: its
/// events, and its task (abort it at the end).
fn stream_watcher(
    addr: &str,
    node: &str,
) -> (mpsc::Receiver<WatchEvent>, tokio::task::JoinHandle<()>) {
    let mut cfg = WatchConfig::new(node);
    cfg.mode = WatchMode::Stream;
    let (tx, rx) = mpsc::channel(64);
    let task = tokio::spawn(run(crate::nomad::loopback_client(addr), cfg, tx));
    (rx, task)
}

/// Waits for the next allocation event (health events skipped).
async fn next_alloc_event(rx: &mut mpsc::Receiver<WatchEvent>) -> WatchEvent {
    loop {
        match tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .expect("no allocation event from the watcher")
            .expect("the watcher stopped")
        {
            WatchEvent::Health(_) | WatchEvent::Relisted { .. } => {}
            ev => return ev,
        }
    }
}

/// Stream mode: while the read of a new allocation of this node hangs, the reader goes
/// on (another allocation's update, later on the stream, arrives first), updates of the
/// allocation being read wait behind its read, and the read is not repeated for them
/// (one read in total). Without the fix the reader waits for the read: deadlock.
#[tokio::test]
async fn stream_reader_keeps_consuming_while_a_read_is_slow() {
    use slow_nomad::{alloc, frame};
    use std::sync::atomic::Ordering;
    const ME: &str = "node-me";
    // Nomad answers the read with the allocation as it is then (index 13).
    let server = slow_nomad::start(alloc("a", ME, "running", 13, true)).await;
    let (mut rx, task) = stream_watcher(&server.addr, ME);
    // "a" is new (read needed); then two more updates of "a" (client side, same
    // AllocModifyIndex), an other node's event, and "b" finishing (no read needed).
    let a11 = alloc("a", ME, "pending", 11, false);
    server.lines.send(frame(11, &[a11])).unwrap();
    let a12 = alloc("a", ME, "running", 12, false)
        .replace(r#""AllocModifyIndex":12"#, r#""AllocModifyIndex":11"#);
    let a13 = alloc("a", ME, "running", 13, false)
        .replace(r#""AllocModifyIndex":13"#, r#""AllocModifyIndex":11"#);
    server.lines.send(frame(12, &[a12])).unwrap();
    server.lines.send(frame(13, &[a13])).unwrap();
    let other = alloc("x", "node-other", "running", 14, false);
    let b = alloc("b", ME, "complete", 15, false);
    server.lines.send(frame(15, &[other, b])).unwrap();
    match next_alloc_event(&mut rx).await {
        WatchEvent::Upsert(a) => assert_eq!(&*a.id, "b", "{a:?}"),
        ev => panic!("expected b's update first, got {ev:?}"),
    }
    server.gate.send(true).unwrap();
    match next_alloc_event(&mut rx).await {
        WatchEvent::Upsert(a) => {
            assert_eq!((&*a.id, a.modify_index), ("a", 13));
            assert!(a.job.is_some(), "the read carries the Job");
        }
        ev => panic!("expected a's read, got {ev:?}"),
    }
    // The held updates (11..13) are not newer than the read: nothing more for "a".
    let c = alloc("c", ME, "complete", 16, false);
    server.lines.send(frame(16, &[c])).unwrap();
    match next_alloc_event(&mut rx).await {
        WatchEvent::Upsert(a) => assert_eq!(&*a.id, "c", "{a:?}"),
        ev => panic!("expected c's update, got {ev:?}"),
    }
    assert_eq!(
        server.reads.load(Ordering::SeqCst),
        1,
        "coalesced: one read"
    );
    task.abort();
}

/// Stream mode: the read that verifies an allocation which may vanish with its tasks
/// alive runs off the reader: while it hangs, a later update of another allocation
/// still arrives. Without the fix the verifying read ran inline and the reader stalled.
#[tokio::test]
async fn stream_verifying_read_runs_off_the_reader() {
    use slow_nomad::{alloc, frame};
    use std::sync::atomic::Ordering;
    const ME: &str = "node-me";
    // Lost on the server with its task last seen running: verified by reads.
    let lost = |index| {
        alloc("v", ME, "lost", index, true).replace(
            r#""DesiredStatus":"run""#,
            r#""DesiredStatus":"stop","TaskStates":{"app":{"State":"running"}}"#,
        )
    };
    let server = slow_nomad::start(lost(11)).await;
    let mut cfg = WatchConfig::new(ME);
    cfg.mode = WatchMode::Stream;
    cfg.verify_interval = Duration::from_millis(20);
    let (tx, mut rx) = mpsc::channel(64);
    let task = tokio::spawn(run(crate::nomad::loopback_client(&server.addr), cfg, tx));
    server.lines.send(frame(11, &[lost(11)])).unwrap();
    // "v" is new: its Job is read (the gate holds every read).
    while server.reads.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.gate.send(true).unwrap();
    match next_alloc_event(&mut rx).await {
        WatchEvent::Upsert(a) => assert_eq!(&*a.id, "v", "{a:?}"),
        ev => panic!("expected v's read, got {ev:?}"),
    }
    // Close the gate again and wait for the verifying read to hang on it.
    server.gate.send(false).unwrap();
    let before = server.reads.load(Ordering::SeqCst);
    while server.reads.load(Ordering::SeqCst) == before {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let b = alloc("b", ME, "complete", 15, false);
    server.lines.send(frame(15, &[b])).unwrap();
    match next_alloc_event(&mut rx).await {
        WatchEvent::Upsert(a) => assert_eq!(&*a.id, "b", "{a:?}"),
        ev => panic!("expected b's update while the verifying read hangs, got {ev:?}"),
    }
    // The verifying read, once answered with "v" unchanged, sends nothing.
    server.gate.send(true).unwrap();
    let c = alloc("c", ME, "complete", 16, false);
    while server.reads.load(Ordering::SeqCst) < before + 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    server.lines.send(frame(16, &[c])).unwrap();
    match next_alloc_event(&mut rx).await {
        WatchEvent::Upsert(a) => assert_eq!(&*a.id, "c", "{a:?}"),
        ev => panic!("expected c's update (no resend of v), got {ev:?}"),
    }
    task.abort();
}

/// Issue 10: stream mode reads a burst of new allocations (one frame) with one request
/// for the node's allocation list, not one read each; an allocation the list does not
/// hold is read alone. Without the change: twelve single reads.
#[tokio::test]
async fn stream_burst_is_read_with_one_list() {
    use slow_nomad::{alloc, frame};
    use std::sync::atomic::Ordering;
    const ME: &str = "node-me";
    // The single read answers a9 (the one the list lacks: created after it, say).
    let server = slow_nomad::start(alloc("a9", ME, "running", 30, true)).await;
    server.gate.send(true).unwrap();
    let (mut rx, task) = stream_watcher(&server.addr, ME);
    // The first list (empty) is done before the stream opens.
    loop {
        match tokio::time::timeout(Duration::from_secs(20), rx.recv()).await {
            Ok(Some(WatchEvent::Relisted { .. })) => break,
            Ok(Some(_)) => {}
            other => panic!("expected the first list, got {other:?}"),
        }
    }
    let ids: Vec<String> = (0..12).map(|i| format!("a{i}")).collect();
    let listed: Vec<String> = ids
        .iter()
        .filter(|id| *id != "a9")
        .map(|id| alloc(id, ME, "running", 30, true))
        .collect();
    *server.list.lock().unwrap() = format!("[{}]", listed.join(","));
    let events: Vec<String> = ids
        .iter()
        .map(|id| alloc(id, ME, "pending", 20, false))
        .collect();
    server.lines.send(frame(20, &events)).unwrap();
    let mut got = BTreeSet::new();
    while got.len() < ids.len() {
        match next_alloc_event(&mut rx).await {
            WatchEvent::Upsert(a) => {
                assert!(a.job.is_some(), "read with its Job: {a:?}");
                assert_eq!(a.modify_index, 30, "{a:?}");
                got.insert(a.id.clone());
            }
            ev => panic!("expected the burst's reads, got {ev:?}"),
        }
    }
    assert_eq!(
        got,
        ids.iter()
            .map(|i| Arc::from(i.as_str()))
            .collect::<BTreeSet<_>>()
    );
    assert_eq!(
        server.lists.load(Ordering::SeqCst),
        2,
        "the first list, the burst's"
    );
    assert_eq!(server.reads.load(Ordering::SeqCst), 1, "a9 alone");
    task.abort();
}

/// Issue 10 (review): allocations a burst's list lacks (deleted since their events) are
/// read alone, never by another list. Without the fix the same list was asked for
/// again and again and the ten were never read.
#[tokio::test]
async fn reads_a_list_lacks_are_read_alone_not_listed_again() {
    use slow_nomad::{alloc, frame};
    use std::sync::atomic::Ordering;
    const ME: &str = "node-me";
    let server = slow_nomad::start(alloc("gone", ME, "running", 30, true)).await;
    server.gate.send(true).unwrap();
    let (mut rx, task) = stream_watcher(&server.addr, ME);
    let events: Vec<String> = (0..10)
        .map(|i| alloc(&format!("a{i}"), ME, "pending", 20, false))
        .collect();
    server.lines.send(frame(20, &events)).unwrap();
    for _ in 0..10 {
        match next_alloc_event(&mut rx).await {
            WatchEvent::Upsert(_) => {}
            ev => panic!("expected the single reads' answers, got {ev:?}"),
        }
    }
    assert_eq!(server.reads.load(Ordering::SeqCst), 10, "each read alone");
    assert_eq!(
        server.lists.load(Ordering::SeqCst),
        2,
        "the first list, the burst's"
    );
    task.abort();
}

/// Issue 11 #10: `GET /v1/node/<unknown>/allocations` answers `200 []`. Before acting
/// on an empty list the watcher reads the node; a 404 is a fault, never an empty view
/// (which would unpublish every volume of the node). Without the fix the empty list was
/// sent as the node's allocations.
#[tokio::test]
async fn empty_list_of_an_unknown_node_is_a_fault_not_an_empty_view() {
    let server = slow_nomad::start(String::new()).await;
    for mode in [WatchMode::Poll, WatchMode::Stream] {
        let mut cfg = WatchConfig::new("node-gone");
        cfg.mode = mode;
        let (tx, mut rx) = mpsc::channel(64);
        let task = tokio::spawn(run(crate::nomad::loopback_client(&server.addr), cfg, tx));
        loop {
            match tokio::time::timeout(Duration::from_secs(20), rx.recv())
                .await
                .expect("no event from the watcher")
                .expect("the watcher stopped")
            {
                WatchEvent::Health(Health::Listing) => {}
                WatchEvent::Health(Health::Disconnected { fault, .. }) => {
                    assert_eq!(fault, Fault::NodeUnknown, "{mode:?}");
                    break;
                }
                ev => panic!("{mode:?}: expected a NodeUnknown fault, got {ev:?}"),
            }
        }
        task.abort();
    }
}

/// The watcher's next event other than a health report.
async fn next_change(rx: &mut mpsc::Receiver<WatchEvent>) -> WatchEvent {
    loop {
        match tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .expect("no event from the watcher")
            .expect("the watcher stopped")
        {
            WatchEvent::Health(_) => {}
            ev => return ev,
        }
    }
}

/// Poll mode's health tells the size of the last list answer (what each answer costs:
/// `dhv_binder_watch_list_bytes`, the status line): its allocations and bytes.
#[tokio::test]
async fn poll_health_tells_the_last_lists_size() {
    use nomad_sim::replay::Replay;
    let node = "0b0b0b0b-0000-4000-8000-000000000002";
    let fake = Replay::start(node, serde_json::json!({"keys": []})).await;
    let alloc = |id: &str, index: u64| -> serde_json::Value {
        serde_json::from_str(&slow_nomad::alloc(id, node, "running", index, true)).unwrap()
    };
    fake.put_alloc(alloc("a1", 10));
    fake.put_alloc(alloc("a2", 11));
    let mut cfg = WatchConfig::new(node);
    cfg.mode = WatchMode::Poll;
    let (tx, mut rx) = mpsc::channel(64);
    let task = tokio::spawn(run(crate::nomad::loopback_client(&fake.addr), cfg, tx));
    /// The list's bytes once a poll health tells a list of `want` allocations.
    async fn polled(rx: &mut mpsc::Receiver<WatchEvent>, want: u64) -> u64 {
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(20), rx.recv())
                .await
                .expect("no health from the watcher")
                .expect("the watcher stopped");
            if let WatchEvent::Health(Health::Polling { counters, .. }) = ev {
                if counters.list_allocations == want {
                    return counters.list_bytes;
                }
            }
        }
    }
    let two = polled(&mut rx, 2).await;
    fake.put_alloc(alloc("a3", 20));
    let three = polled(&mut rx, 3).await;
    assert!(two > 100 && three > two, "{two} then {three} bytes");
    task.abort();
}

/// Issue 10: in poll mode each answer of the blocking query is the node's whole list;
/// after the first list the watcher sends only what changed (as the stream does), so
/// the agent plans only the touched volumes instead of every volume per answer. Against
/// the simulator's node list (`Node.GetAllocs` semantics).
#[tokio::test]
async fn poll_answers_after_the_first_list_are_sent_as_changes() {
    use nomad_sim::replay::Replay;
    let node = "0b0b0b0b-0000-4000-8000-000000000001";
    let fake = Replay::start(node, serde_json::json!({"keys": []})).await;
    let alloc = |id: &str, status: &str, index: u64| -> serde_json::Value {
        serde_json::from_str(&slow_nomad::alloc(id, node, status, index, true)).unwrap()
    };
    fake.put_alloc(alloc("a1", "running", 10));
    fake.put_alloc(alloc("a2", "running", 11));
    let mut cfg = WatchConfig::new(node);
    cfg.mode = WatchMode::Poll;
    let (tx, mut rx) = mpsc::channel(64);
    let task = tokio::spawn(run(crate::nomad::loopback_client(&fake.addr), cfg, tx));
    match next_change(&mut rx).await {
        WatchEvent::Relisted { allocs, .. } => assert_eq!(allocs.len(), 2),
        ev => panic!("expected the first list whole, got {ev:?}"),
    }
    fake.put_alloc(alloc("a1", "complete", 20));
    match next_change(&mut rx).await {
        WatchEvent::Upsert(a) => assert_eq!((&*a.id, a.client_status.as_str()), ("a1", "complete")),
        ev => panic!("expected only the changed allocation, got {ev:?}"),
    }
    fake.put_alloc(alloc("a3", "pending", 21));
    match next_change(&mut rx).await {
        WatchEvent::Upsert(a) => assert_eq!(&*a.id, "a3"),
        ev => panic!("expected the new allocation alone, got {ev:?}"),
    }
    // A garbage collection does not wake the query; the next change's answer shows it.
    fake.delete_alloc("a2");
    fake.put_alloc(alloc("a3", "running", 30));
    let mut got = [next_change(&mut rx).await, next_change(&mut rx).await];
    got.sort_by_key(|e| matches!(e, WatchEvent::Removed(_)));
    match &got[..] {
        [WatchEvent::Upsert(a), WatchEvent::Removed(id)] => {
            assert_eq!((&*a.id, id.as_str()), ("a3", "a2"));
        }
        ev => panic!("expected a3 changed and a2 removed, got {ev:?}"),
    }
    // A restored, older state of one allocation under a newer answer index: the view
    // takes an older state only from a whole list, so the answer is sent whole.
    fake.put_alloc(alloc("a3", "pending", 5));
    fake.put_alloc(alloc("a1", "complete", 40));
    match next_change(&mut rx).await {
        WatchEvent::Relisted { allocs, index } => {
            assert_eq!((allocs.len(), index), (2, 40));
        }
        ev => panic!("expected the whole list after a ModifyIndex went back, got {ev:?}"),
    }
    task.abort();
}
