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
/// poll waits [`MIN_QUERY_INTERVAL`] between queries, and the record catalogue (its marker
/// unreadable) lists once, then on its 10 s fallback pace, instead of spinning (the review
/// saw 420–930 requests per 30 s).
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
    // The record watch with the marker unreadable: it lists on its fallback pace.
    let (_marker, marker) =
        tokio::sync::watch::channel(dhv_binder::cluster::changes::MarkerView::Unavailable);
    let cat = tokio::spawn(dhv_binder::cluster::catalog::run(
        client(&addr),
        dhv_binder::cluster::catalog::Follow {
            marker,
            relist: std::time::Duration::ZERO,
            reads: Default::default(),
            failing: None,
        },
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

/// A record watch as the agent runs it: the one marker watch and the volume records' follow
/// loop, against `nomad`; returns the catalogues it sends, the reads handle and the tasks.
fn follow_records(
    nomad: &nomad_sim::replay::Replay,
    relist: std::time::Duration,
) -> (
    tokio::sync::mpsc::Receiver<dhv_binder::cluster::catalog::Catalogue>,
    dhv_binder::cluster::catalog::Reads,
    [tokio::task::JoinHandle<()>; 2],
) {
    use dhv_binder::cluster::{catalog, changes};
    let (mtx, mrx) = tokio::sync::watch::channel(changes::MarkerView::Unknown);
    let reads = catalog::Reads::default();
    let (ctx, crx) = tokio::sync::mpsc::channel(64);
    let tasks = [
        tokio::spawn(changes::watch(
            client(&nomad.addr),
            std::time::Duration::from_secs(300),
            mtx,
        )),
        tokio::spawn(catalog::run(
            client(&nomad.addr),
            catalog::Follow {
                marker: mrx,
                relist,
                reads: reads.clone(),
                failing: None,
            },
            dhv_binder::cluster::trust::RecordTrust::Unverified,
            catalog::Rejections::default(),
            ctx,
        )),
    ];
    (crx, reads, tasks)
}

/// A volume record variable named `name` (unsigned: the watch under test runs unverified).
fn record_var(name: &str) -> dhv_binder::nomad::types::Variable {
    let (spec, secrets) = dhv_binder::volume::parse_spec(&format!(
        "name = \"{name}\"\nplugin_id = \"bind\"\ncapability {{\n  access_mode = \"single-node-writer\"\n  attachment_mode = \"file-system\"\n}}"
    ))
    .unwrap();
    dhv_binder::volume::VolumeRecord::new(spec, secrets).to_variable()
}

/// Requests since `from` (an index into `Replay::requests`) whose line starts with `prefix`.
fn count_since(nomad: &nomad_sim::replay::Replay, from: usize, prefix: &str) -> usize {
    nomad.requests()[from..]
        .iter()
        .filter(|r| r.starts_with(prefix))
        .count()
}

/// Waits (up to 10 s) for a catalogue that `ok` accepts; the last catalogue received.
async fn catalogue_where(
    rx: &mut tokio::sync::mpsc::Receiver<dhv_binder::cluster::catalog::Catalogue>,
    what: &str,
    ok: impl Fn(&dhv_binder::cluster::catalog::Catalogue) -> bool,
) {
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while let Some(c) = rx.recv().await {
            if ok(&c) {
                return;
            }
        }
        panic!("the record watch ended");
    })
    .await
    .unwrap_or_else(|_| panic!("no catalogue {what} within 10 s"));
}

/// The change marker (issue 35): variable writes that are not record changes (other
/// applications', node records, claims) wake no agent: no list, no record read, no new
/// marker read. A record written through a writer that updates the marker reaches the
/// catalogue with one marker answer and one read of that record, no list. More changes than
/// the marker's ring holds between two reads make the agent list once (the gap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_watch_reads_what_the_marker_names_and_sleeps_through_other_writes() {
    use dhv_binder::cluster::changes;
    use dhv_binder::volume::VolumeKey;
    let _ = poison_proxy().await;
    let nomad = nomad_sim::replay::Replay::start("node-1", serde_json::json!({"keys": []})).await;
    let writer = client(&nomad.addr);
    for name in ["a", "b", "c"] {
        changes::put_record(&writer, &record_var(name), Some(0))
            .await
            .unwrap();
    }
    let (mut rx, _reads, tasks) = follow_records(&nomad, std::time::Duration::from_secs(300));
    catalogue_where(&mut rx, "with the 3 records", |c| c.len() == 3).await;
    // Let the marker watch settle into its blocking read.
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;

    // 1. 60 writes that are not record changes: another application's variable, a node
    //    record, a claim.
    let from = nomad.requests().len();
    for i in 0..20 {
        for path in [
            "other-app/config",
            "dhv-binder/nodes/node-1",
            "dhv-binder/claims/default/a",
        ] {
            nomad.put_var("default", path, serde_json::json!({"n": i.to_string()}));
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let after = nomad.requests();
    assert_eq!(
        after.len() - from,
        0,
        "requests after 60 unrelated variable writes: {:?}",
        &after[from..]
    );

    // 2. A record change through the marker: one marker answer, one read of that record.
    let from = nomad.requests().len();
    changes::put_record(&writer, &record_var("d"), Some(0))
        .await
        .unwrap();
    let d = VolumeKey {
        namespace: "default".into(),
        name: "d".into(),
    };
    catalogue_where(&mut rx, "with the new record", |c| c.contains_key(&d)).await;
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    let agent = |p: &str| count_since(&nomad, from, p);
    // The writer's own requests: its record PUT, the marker's GET and PUT.
    assert_eq!(agent("GET /v1/vars"), 0, "{:?}", &nomad.requests()[from..]);
    assert_eq!(agent("GET /v1/var/dhv-binder/volumes/d"), 1);
    assert_eq!(agent("GET /v1/var/dhv-binder/volumes/"), 1);
    // The writer's read of the marker, and the agent's next blocking read (its answer).
    assert_eq!(agent("GET /v1/var/dhv-binder/records-changed"), 2);

    // 3. More changes than the ring holds between two reads of the marker (written here as
    //    one marker update): a gap, one list, which reads the new records.
    let from = nomad.requests().len();
    let cur = writer
        .variable(changes::MARKER_NAMESPACE, changes::MARKER_PATH)
        .await
        .unwrap()
        .unwrap();
    let mut m = changes::Marker::from_variable(&cur).unwrap();
    for i in 0..changes::RING + 4 {
        let v = writer
            .put_variable(&record_var(&format!("e{i}")), Some(0))
            .await
            .unwrap();
        m.push("default", &v.path, v.modify_index);
    }
    writer
        .put_variable(&m.to_variable(), Some(cur.modify_index))
        .await
        .unwrap();
    catalogue_where(&mut rx, "with every new record", |c| {
        c.len() == 4 + changes::RING + 4
    })
    .await;
    assert_eq!(
        count_since(&nomad, from, "GET /v1/vars"),
        1,
        "{:?}",
        &nomad.requests()[from..]
    );
    assert_eq!(
        count_since(&nomad, from, "GET /v1/var/dhv-binder/volumes/"),
        changes::RING + 4
    );
    for t in tasks {
        t.abort();
    }
}

/// Writers that update the marker at once: each conflict (409 on `?cas=`) is read again and
/// retried, so no change is lost; the ring holds the last [`RING`] in sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_marker_updates_retry_their_conflicts_and_lose_no_change() {
    use dhv_binder::cluster::changes::{self, Marker, RING};
    let _ = poison_proxy().await;
    let nomad = nomad_sim::replay::Replay::start("node-1", serde_json::json!({"keys": []})).await;
    let writers: Vec<_> = (0..8)
        .map(|w| {
            let c = client(&nomad.addr);
            tokio::spawn(async move {
                for i in 0..5 {
                    changes::announce(&c, "default", &format!("dhv-binder/volumes/w{w}-{i}"), 1)
                        .await
                        .expect("an update lost to conflicts");
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    let var = client(&nomad.addr)
        .variable(changes::MARKER_NAMESPACE, changes::MARKER_PATH)
        .await
        .unwrap()
        .expect("the marker exists");
    let m = Marker::from_variable(&var).unwrap();
    assert_eq!(m.seq, 40, "every change numbered once");
    assert_eq!(m.ring.len(), RING);
    let puts = nomad
        .requests()
        .iter()
        .filter(|r| r.starts_with("PUT /v1/var/dhv-binder/records-changed"))
        .count();
    assert!(
        puts > 40,
        "{puts} writes for 40 changes: no conflict happened"
    );
}

/// An allocation names a volume the node has no record for: its record is read at once
/// (`Reads::ask`), even when its writer did not update the marker and the relist is far.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_asked_for_is_read_at_once_without_the_marker() {
    use dhv_binder::volume::VolumeKey;
    let _ = poison_proxy().await;
    let nomad = nomad_sim::replay::Replay::start("node-1", serde_json::json!({"keys": []})).await;
    let (mut rx, reads, tasks) = follow_records(&nomad, std::time::Duration::from_secs(300));
    catalogue_where(&mut rx, "(the first, empty)", |c| c.is_empty()).await;
    let var = record_var("quiet");
    client(&nomad.addr)
        .put_variable(&var, Some(0))
        .await
        .unwrap();
    let key = VolumeKey {
        namespace: "default".into(),
        name: "quiet".into(),
    };
    let from = nomad.requests().len();
    reads.ask("default", &dhv_binder::volume::record_path("quiet"));
    catalogue_where(&mut rx, "with the record asked for", |c| {
        c.contains_key(&key)
    })
    .await;
    assert_eq!(count_since(&nomad, from, "GET /v1/vars"), 0);
    for t in tasks {
        t.abort();
    }
}

/// Issue 50: a restarted agent asks for the record of every volume its allocations name
/// while the first list is still reading them all; a record the list has read is not read a
/// second time for the ask (1,000 volumes cost 2,000 reads at a restart when it was).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_asked_for_during_the_first_list_are_read_once() {
    use dhv_binder::volume::VolumeKey;
    let _ = poison_proxy().await;
    let nomad = nomad_sim::replay::Replay::start("node-1", serde_json::json!({"keys": []})).await;
    let names: Vec<String> = (0..20).map(|i| format!("v{i:02}")).collect();
    for n in &names {
        client(&nomad.addr)
            .put_variable(&record_var(n), Some(0))
            .await
            .unwrap();
    }
    let from = nomad.requests().len();
    let (mut rx, reads, tasks) = follow_records(&nomad, std::time::Duration::from_secs(300));
    for n in &names {
        reads.ask("default", &dhv_binder::volume::record_path(n));
    }
    catalogue_where(&mut rx, "with every record", |c| {
        names.iter().all(|n| {
            c.contains_key(&VolumeKey {
                namespace: "default".into(),
                name: n.as_str().into(),
            })
        })
    })
    .await;
    // Let the asks be taken up after the list.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(
        count_since(&nomad, from, "GET /v1/var/dhv-binder/volumes/"),
        names.len(),
        "{:?}",
        &nomad.requests()[from..]
    );
    for t in tasks {
        t.abort();
    }
}

/// Issue 44 #3: crafted lines in the change marker (a path with a blocking query of its
/// own, one that climbs to `/v1/acl/token/self`, a stale alias `<name>?x`) are refused,
/// counted and never read: no request leaves for them, and a new record the marker names
/// after them still reaches the catalogue at once (with the lines used as written, the
/// blocking query held the whole read for its 300 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crafted_marker_lines_are_refused_and_do_not_delay_a_new_record() {
    use dhv_binder::cluster::{catalog, changes};
    use dhv_binder::volume::VolumeKey;
    let _ = poison_proxy().await;
    let nomad = nomad_sim::replay::Replay::start("node-1", serde_json::json!({"keys": []})).await;
    let writer = client(&nomad.addr);
    changes::put_record(&writer, &record_var("data"), Some(0))
        .await
        .unwrap();
    let refused = Arc::new(AtomicUsize::new(0));
    let (mtx, mrx) = tokio::sync::watch::channel(changes::MarkerView::Unknown);
    let (ctx, mut rx) = tokio::sync::mpsc::channel(64);
    let counted = refused.clone();
    let tasks = [
        tokio::spawn(changes::watch_observed(
            client(&nomad.addr),
            std::time::Duration::from_secs(300),
            mtx,
            Arc::new(move |_| {
                counted.fetch_add(1, Ordering::SeqCst);
            }),
        )),
        tokio::spawn(catalog::run(
            client(&nomad.addr),
            catalog::Follow {
                marker: mrx,
                relist: std::time::Duration::from_secs(300),
                reads: catalog::Reads::default(),
                failing: None,
            },
            dhv_binder::cluster::trust::RecordTrust::Unverified,
            catalog::Rejections::default(),
            ctx,
        )),
    ];
    catalogue_where(&mut rx, "with the first record", |c| c.len() == 1).await;
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;

    // A writer of the marker adds its lines (`crafted` at once), then a volume is created
    // (`name`): its record must arrive as if the lines were not there.
    let from = nomad.requests().len();
    let round = |crafted: &'static [&'static str], name: &'static str| {
        let writer = client(&nomad.addr);
        async move {
            let cur = writer
                .variable(changes::MARKER_NAMESPACE, changes::MARKER_PATH)
                .await
                .unwrap()
                .unwrap();
            let mut m = changes::Marker::from_variable(&cur).unwrap();
            for path in crafted {
                m.push("default", path, 999);
            }
            writer
                .put_variable(&m.to_variable(), Some(cur.modify_index))
                .await
                .unwrap();
            changes::put_record(&writer, &record_var(name), Some(0))
                .await
                .unwrap();
            VolumeKey {
                namespace: "default".into(),
                name: name.into(),
            }
        }
    };
    // A line with a blocking query of its own: as written, it held the read for 300 s.
    let fresh = round(
        &["dhv-binder/volumes/data?index=99999999&wait=300s"],
        "fresh",
    )
    .await;
    catalogue_where(&mut rx, "with the new record", |c| c.contains_key(&fresh)).await;
    // A line to another endpoint (with the agent's token), a stale alias of a record.
    let crafted: &[&str] = &[
        "dhv-binder/volumes/../../../acl/token/self",
        "dhv-binder/volumes/data?x",
    ];
    let later = round(crafted, "later").await;
    catalogue_where(&mut rx, "with the next record", |c| c.contains_key(&later)).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let sent = nomad.requests()[from..].to_vec();
    for r in &sent {
        assert!(
            !r.contains("acl") && !r.contains("99999999") && !r.contains("data%3F"),
            "a request for a crafted line: {r} (all: {sent:?})"
        );
    }
    assert_eq!(
        count_since(&nomad, from, "GET /v1/var/dhv-binder/volumes/data"),
        0,
        "{sent:?}"
    );
    assert_eq!(count_since(&nomad, from, "GET /v1/vars"), 0, "{sent:?}");
    assert_eq!(refused.load(Ordering::SeqCst), 3);
    for t in tasks {
        t.abort();
    }
}
