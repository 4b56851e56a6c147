//! Fuzzing that stays (issue 13 §6): bounded property runs, in the normal test suite, of every
//! parser fed by Nomad, a plugin or a caller. Each must return (an error is fine), never panic
//! or hang. A failing case proptest finds is saved under tests/fuzz.proptest-regressions and
//! becomes a regression test.

use dhv_binder::cluster::trust::RecordTrust;
use dhv_binder::nomad::events::{decode_line, LineBuffer, Piece};
use dhv_binder::nomad::types::{AllocStub, Allocation, HostVolumeStub, Variable, VariableMeta};
use dhv_binder::storage::plugin::{self, CreateResult, Fingerprint, Operation, PublishResult};
use dhv_binder::volume::{parse_spec, VolumeRecord};
use proptest::prelude::*;
use std::collections::BTreeMap;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        max_shrink_iters: 2000,
        ..ProptestConfig::default()
    }
}

/// JSON-ish text: fragments of what the real inputs look like, glued at random, plus noise.
fn jsonish() -> impl Strategy<Value = String> {
    let frag = prop_oneof![
        Just("{".to_string()),
        Just("}".to_string()),
        Just("[".to_string()),
        Just("]".to_string()),
        Just(",".to_string()),
        Just(":".to_string()),
        Just("\"ID\"".to_string()),
        Just("\"NodeID\"".to_string()),
        Just("\"Index\"".to_string()),
        Just("\"Events\"".to_string()),
        Just("\"Topic\":\"Allocation\"".to_string()),
        Just("\"Payload\"".to_string()),
        Just("\"Allocation\"".to_string()),
        Just("\"TaskStates\"".to_string()),
        Just("\"me\"".to_string()),
        Just("null".to_string()),
        Just("1e999".to_string()),
        Just("-1".to_string()),
        Just("18446744073709551616".to_string()),
        Just("\"\\ud800\"".to_string()),
        "[ -~]{0,12}",
        any::<String>().prop_map(|s| s.chars().take(8).collect()),
    ];
    prop::collection::vec(frag, 0..60).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn event_stream_lines(line in jsonish(), raw in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_line(line.as_bytes(), "me", 1 << 20);
        let _ = decode_line(&raw, "me", 1 << 20);
        let _ = decode_line(line.as_bytes(), "me", 8);
    }

    #[test]
    fn event_stream_framing(chunks in prop::collection::vec(prop::collection::vec(prop_oneof![Just(b'\n'), any::<u8>()], 0..300), 0..20), max in 1usize..256) {
        let mut b = LineBuffer::new(max);
        let total: usize = chunks.iter().map(Vec::len).sum();
        let mut seen = 0usize;
        for c in &chunks {
            b.push(c);
            while let Some(p) = b.next_piece() {
                match p {
                    Piece::Line(l) => { prop_assert!(l.len() <= max); seen += l.len() + 1; }
                    Piece::Oversized(n) => { prop_assert!(n > max); seen += n + 1; }
                }
            }
            // Never more than one line's worth (plus the chunk being scanned) is held.
            prop_assert!(b.pending() <= max + c.len());
        }
        prop_assert!(seen + b.pending() <= total + chunks.len());
    }

    /// After a large line the buffer gives its memory back.
    #[test]
    fn event_buffer_shrinks_after_a_large_line(big in (256usize << 10)..(1usize << 20)) {
        let mut b = LineBuffer::new(4 << 20);
        let mut line = vec![b'x'; big];
        line.push(b'\n');
        line.extend_from_slice(b"{}");
        b.push(&line);
        let mut got = 0;
        while let Some(p) = b.next_piece() {
            if let Piece::Line(l) = p { got = l.len(); }
        }
        prop_assert_eq!(got, big);
        prop_assert!(b.capacity() <= 64 << 10, "{} bytes still allocated", b.capacity());
    }

    #[test]
    fn blocking_query_bodies(body in jsonish()) {
        let _ = serde_json::from_str::<Vec<AllocStub>>(&body);
        let _ = serde_json::from_str::<Allocation>(&body);
        let _ = serde_json::from_str::<Vec<HostVolumeStub>>(&body);
        let _ = serde_json::from_str::<Vec<VariableMeta>>(&body);
        let _ = serde_json::from_str::<Variable>(&body);
    }

    #[test]
    fn volume_records(items in prop::collection::btree_map(
        prop_oneof![Just("id".to_string()), Just("spec".to_string()), Just("secrets".to_string()), Just("state".to_string()), Just("context".to_string()), Just("capacity_bytes".to_string()), Just("signature".to_string()), Just("delete_signature".to_string()), "[a-z_]{1,8}"],
        jsonish(), 0..10), path in "[ -~]{0,40}", ns in "[ -~]{0,12}") {
        let var = Variable { namespace: ns, path, items, ..Default::default() };
        if let Ok(rec) = VolumeRecord::from_variable(&var) {
            let _ = format!("{rec:?}");
            let _ = RecordTrust::Keys(vec![vec![7; 32]]).verify(&rec);
            let _ = rec.placeholder_capabilities();
        }
    }

    #[test]
    fn hcl_volume_specs(text in prop_oneof![
        jsonish(),
        prop::collection::vec(prop_oneof![
            Just("name = \"a\"\n".to_string()), Just("plugin_id = \"p\"\n".to_string()),
            Just("capability {\n".to_string()), Just("parameters {\n".to_string()), Just("}\n".to_string()),
            Just("access_mode = \"single-node-writer\"\n".to_string()), Just("capacity_min = \"10GiB\"\n".to_string()),
            Just("x = [[[[".to_string()), Just("<<EOF\n".to_string()), Just("EOF\n".to_string()),
            Just("${".to_string()), Just("\"".to_string()), Just("/*".to_string()), "[ -~\n]{0,20}",
        ], 0..40).prop_map(|v| v.concat()),
    ]) {
        let _ = parse_spec(&text);
    }

    #[test]
    fn plugin_stdout(out in prop_oneof![jsonish(), any::<String>()], secret in any::<String>()) {
        let _ = plugin::parse::<PublishResult>("p", Operation::Publish, out.as_bytes());
        let _ = plugin::parse::<CreateResult>("p", Operation::Create, out.as_bytes());
        let _ = plugin::parse::<Fingerprint>("p", Operation::Fingerprint, out.as_bytes());
        let secrets = BTreeMap::from([("k".to_string(), secret.clone())]);
        let text = plugin::sanitize_tail(format!("{out}{secret}{out}").as_bytes(), &secrets, 2048);
        prop_assert!(!text.chars().any(char::is_control), "{:?}", text);
        if secret.chars().count() >= 4 && !secret.chars().any(char::is_control) {
            prop_assert!(!text.contains(&plugin::escape_control(&secret)), "{:?} in {:?}", secret, text);
        }
    }

    #[test]
    fn jwts(header in jsonish(), payload in jsonish(), sig in "[A-Za-z0-9_-]{0,90}") {
        use base64::Engine as _;
        let e = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let token = format!("{}.{}.{sig}", e(&header), e(&payload));
        let key = jsonwebtoken::DecodingKey::from_ed_der(&[3u8; 32]);
        for alg in [jsonwebtoken::Algorithm::EdDSA, jsonwebtoken::Algorithm::RS256] {
            prop_assert!(dhv_binder::nomad::identity::verify_with(&token, &key, alg, &["nomadproject.io".into()], dhv_binder::nomad::identity::IssuerCheck::Any).is_err());
        }
        let _ = jsonwebtoken::decode_header(&token);
    }

    #[test]
    fn mountinfo_lines(lines in prop::collection::vec(prop_oneof![
        "[0-9]{1,3} [0-9]{1,3} [0-9]{1,3}:[0-9]{1,3} / [ -~]{0,30} rw - tmpfs tmpfs rw",
        "[ -~\\\\]{0,80}",
        any::<String>().prop_map(|s| s.chars().take(80).collect()),
    ], 0..20)) {
        let _ = dhv_binder::node::mounts::MountTable::parse(lines.join("\n").as_bytes(), std::path::Path::new("fuzz"));
    }
}

/// Socket requests: raw bytes to the real server (one process-wide runtime, few cases, each
/// bounded by the server's header timeout).
#[test]
fn socket_requests() {
    use dhv_binder::api::{serve_with, Limits, Request2Agent};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("api.sock");
    let _guard = rt.block_on(async {
        let (listener, guard) = dhv_binder::api::bind(&socket).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Request2Agent>(8);
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        let client = dhv_binder::nomad::Client::new(&dhv_binder::config::NomadConfig::plain(
            "http://127.0.0.1:9",
        ))
        .unwrap();
        let limits = Limits {
            header_read_timeout: std::time::Duration::from_millis(300),
            ..Limits::default()
        };
        tokio::spawn(serve_with(
            listener,
            dhv_binder::nomad::identity::Verifier::new(client, &[]),
            tx,
            limits,
        ));
        guard
    });
    let request = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300),
        (
            prop_oneof![
                Just("GET".to_string()),
                Just("POST".to_string()),
                Just("PUT".to_string()),
                Just("\u{0}".to_string()),
                "[A-Z]{0,8}",
            ],
            prop_oneof![
                Just("/v1/health".to_string()),
                Just("/v1/status".to_string()),
                Just(
                    "/v1/allocations/5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70/publish?wait=1ms"
                        .to_string()
                ),
                "/v1/allocations/[ -~]{0,40}/publish",
                "/[ -~]{0,60}",
            ],
            prop_oneof![
                Just("".to_string()),
                "Authorization: Bearer [ -~]{0,200}\r\n",
                "X-Nomad-Token: [ -~]{0,50}\r\n",
                "[ -~]{0,40}: [ -~]{0,40}\r\n"
            ],
        )
            .prop_map(|(m, p, h)| format!("{m} {p} HTTP/1.1\r\nHost: x\r\n{h}\r\n").into_bytes()),
    ];
    let mut runner = proptest::test_runner::TestRunner::new(config(96));
    runner
        .run(&request, |bytes: Vec<u8>| {
            rt.block_on(async {
                let mut s = tokio::net::UnixStream::connect(&socket).await.unwrap();
                let _ = s.write_all(&bytes).await;
                let _ = s.shutdown().await;
                let mut out = Vec::new();
                let _ = tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    s.read_to_end(&mut out),
                )
                .await;
            });
            Ok(())
        })
        .unwrap();
    // The server survived every request and still answers.
    let r = rt.block_on(dhv_binder::api::client::call(
        &socket,
        hyper::Method::GET,
        "/v1/health",
        None,
    ));
    assert!(r.is_ok(), "{r:?}");
}
