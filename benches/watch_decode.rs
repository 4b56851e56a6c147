//! Benchmark of the watcher's decode path (run: `cargo bench --bench watch_decode`).
//!
//! 1. Generates a recorded cluster event stream (`topic=Allocation`) from the shapes of the
//!    fixture stream and the real captures: ≥ 100,000 allocation events, 99 % of them for
//!    other nodes, frames of 1–8 events, `{}` heartbeats, written to a temporary file.
//! 2. Replays it in 64 KiB chunks through the watcher's path ([`LineBuffer`] +
//!    [`decode_line`]) and through plain serde_json decoding of every frame into
//!    `Allocation`s (the baseline), in the same run; reports events/s for each and the ratio.
//! 3. Peak RSS (VmHWM, reset between phases through /proc/self/clear_refs) of the watcher
//!    path at two stream sizes: it must not grow with the number of other nodes' events.
//! 4. Bytes served by the simulator's scripted front (`nomad_sim::replay`) to one node's
//!    watcher in each watch mode at small N, beside the model of docs/scale.md.
//! 5. A poll answer of 100 allocations with their Jobs (the shapes of the real capture of
//!    `GET /v1/node/:id/allocations`): the watcher's one-pass read of IDs and ModifyIndexes
//!    ([`ListedAlloc::list`]) beside serde_json decoding it whole, µs per answer.
//!
//! Environment: `BENCH_EVENTS` (default 100000), `BENCH_SKIP_FAKE=1` skips part 4.

use dhv_binder::nomad::events::{decode_line, Line, LineBuffer, Piece};
use dhv_binder::nomad::types::{Allocation, ListedAlloc};
use dhv_binder::nomad::watch::{self, WatchConfig, WatchEvent, WatchMode};
use nomad_sim::replay::Replay;
use serde_json::{json, Value};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const ME: &str = "3f6b2c1e-8d4a-4b7e-9c2f-5a1d7e3b9c40";

fn shared(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("testdata")
        .join(p)
}

/// Allocation payload shapes: every allocation event of the fixture stream and the captures.
fn templates() -> Vec<Value> {
    let mut out = Vec::new();
    let mut take = |text: &str| {
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            for ev in v["Events"].as_array().into_iter().flatten() {
                if ev["Topic"] == "Allocation" {
                    out.push(ev["Payload"]["Allocation"].clone());
                }
            }
        }
    };
    take(
        &std::fs::read_to_string(shared("nomad-fixtures/event-stream-allocation.ndjson")).unwrap(),
    );
    take(
        &std::fs::read_to_string(shared(
            "nomad-captures/event-stream-frame-allocupdated-complete-connect-sidecar-1.2.ndjson",
        ))
        .unwrap(),
    );
    let one: Value = serde_json::from_str(
        &std::fs::read_to_string(shared(
            "nomad-captures/event-stream-frame-allocupdated-alloc-job-node-1.6.3.json",
        ))
        .unwrap(),
    )
    .unwrap();
    take(&one.to_string());
    assert!(out.len() >= 10, "too few templates: {}", out.len());
    out
}

/// A small deterministic generator (no dependency on a seeded RNG crate).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn uuid(tag: u64, n: u64) -> String {
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        tag,
        n >> 48 & 0xffff,
        n >> 36 & 0xfff,
        n >> 24 & 0xfff,
        n & 0xffff_ffff_ffff
    )
}

/// Writes a stream of at least `events` allocation events to `path`; returns (events, mine, bytes).
fn generate(path: &Path, events: usize, nodes: u64) -> (usize, usize, u64) {
    let tpl = templates();
    let mut rng = Lcg(42);
    let mut w = BufWriter::new(std::fs::File::create(path).unwrap());
    let (mut n, mut mine, mut bytes) = (0usize, 0usize, 0u64);
    let mut index = 100_000u64;
    w.write_all(b"{}\n").unwrap();
    while n < events {
        index += 1 + rng.next() % 3;
        let k = 1 + (rng.next() % 8) as usize;
        let mut evs = Vec::with_capacity(k);
        for _ in 0..k {
            let mut a = tpl[(rng.next() as usize) % tpl.len()].clone();
            let alloc = rng.next() % 200_000;
            let own = rng.next() % 100 == 0;
            let node = if own {
                ME.to_string()
            } else {
                uuid(0x11111111, 1 + rng.next() % nodes)
            };
            mine += own as usize;
            a["ID"] = json!(uuid(0x22222222, alloc));
            a["NodeID"] = json!(node);
            a["ModifyIndex"] = json!(index);
            evs.push(
                json!({"Topic": "Allocation", "Type": "AllocationUpdated", "Key": a["ID"],
                "Namespace": a["Namespace"], "FilterKeys": [a["JobID"], ""], "Index": index,
                "Payload": {"Allocation": a}}),
            );
        }
        n += k;
        let line = json!({"Index": index, "Events": evs}).to_string();
        bytes += line.len() as u64 + 1;
        w.write_all(line.as_bytes()).unwrap();
        w.write_all(b"\n").unwrap();
        if rng.next() % 50 == 0 {
            w.write_all(b"{}\n").unwrap();
        }
    }
    w.flush().unwrap();
    (n, mine, bytes)
}

fn chunks(path: &Path, mut f: impl FnMut(&[u8])) {
    let mut file = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = file.read(&mut buf).unwrap();
        if n == 0 {
            return;
        }
        f(&buf[..n]);
    }
}

/// The watcher's path: split lines, decode lazily. Returns (own events, other events).
fn watcher_pass(path: &Path) -> (usize, usize) {
    let mut lb = LineBuffer::new(16 << 20);
    let (mut own, mut other) = (0, 0);
    chunks(path, |c| {
        lb.push(c);
        while let Some(p) = lb.next_piece() {
            let Piece::Line(l) = p else {
                panic!("oversized")
            };
            if let Line::Frame {
                allocations,
                skipped,
                ..
            } = decode_line(&l, ME, 16 << 20).unwrap()
            {
                own += allocations.len();
                other += skipped;
            }
        }
    });
    (own, other)
}

#[derive(serde::Deserialize)]
struct FullFrame {
    #[serde(rename = "Index", default)]
    _index: u64,
    #[serde(rename = "Events", default)]
    events: Vec<FullEvent>,
}
#[derive(serde::Deserialize)]
struct FullEvent {
    #[serde(rename = "Payload")]
    payload: FullPayload,
}
#[derive(serde::Deserialize)]
struct FullPayload {
    #[serde(rename = "Allocation")]
    allocation: Allocation,
}

/// The baseline: every frame decoded in full into `Allocation`s, then filtered by node.
fn baseline_pass(path: &Path) -> (usize, usize) {
    let mut pending: Vec<u8> = Vec::new();
    let (mut own, mut other) = (0, 0);
    chunks(path, |c| {
        pending.extend_from_slice(c);
        let mut start = 0;
        while let Some(p) = memchr::memchr(b'\n', &pending[start..]) {
            let line = &pending[start..start + p];
            start += p + 1;
            if line.len() > 2 {
                let f: FullFrame = serde_json::from_slice(line).unwrap();
                for e in f.events {
                    if &*e.payload.allocation.node_id == ME {
                        own += 1;
                    } else {
                        other += 1;
                    }
                }
            }
        }
        pending.drain(..start);
    });
    (own, other)
}

fn status_kib(key: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut best = Duration::MAX;
    let mut out = None;
    for _ in 0..runs {
        let t = Instant::now();
        let r = f();
        best = best.min(t.elapsed());
        out = Some(r);
    }
    (best, out.unwrap())
}

/// Part 4: bytes the scripted front serves to one node's watcher in each mode, for a cluster of
/// `nodes` nodes where `events` allocation events happen, spread evenly over the nodes.
async fn measure_mode(mode: WatchMode, nodes: u64, events: u64, per_node: u64) -> (u64, u64) {
    let fake = Replay::start(ME, json!({"keys": []})).await;
    let full: Value = serde_json::from_str(
        &std::fs::read_to_string(shared("nomad-fixtures/allocation.json")).unwrap(),
    )
    .unwrap();
    let tpl = templates();
    for i in 0..per_node {
        let mut a = full.clone();
        a["ID"] = json!(uuid(0x33333333, i));
        a["ModifyIndex"] = json!(10 + i);
        fake.put_alloc(a);
    }
    let client =
        dhv_binder::nomad::Client::new(&dhv_binder::config::NomadConfig::plain(&fake.addr))
            .unwrap();
    let mut cfg = WatchConfig::new(ME);
    cfg.mode = mode;
    let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
    let task = tokio::spawn(watch::run(client, cfg, tx));
    // Wait until connected.
    loop {
        match rx.recv().await {
            Some(WatchEvent::Health(watch::Health::Streaming { .. }))
            | Some(WatchEvent::Health(watch::Health::Polling { .. })) => break,
            Some(_) => {}
            None => panic!("watcher stopped"),
        }
    }
    let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
    let start_bytes: u64 = fake.bytes_out().values().sum();
    let mut index = 1000;
    for e in 0..events {
        index += 1;
        let mine = e % nodes == 0;
        let mut a = tpl[(e as usize) % tpl.len()].clone();
        a["ModifyIndex"] = json!(index);
        if mine {
            a["ID"] = json!(uuid(0x33333333, e / nodes % per_node));
            a["NodeID"] = json!(ME);
            a["ClientStatus"] = json!("running");
        } else {
            a["ID"] = json!(uuid(0x44444444, e));
            a["NodeID"] = json!(uuid(0x11111111, 1 + e % nodes));
        }
        let line =
            json!({"Index": index, "Events": [{"Topic": "Allocation", "Type": "AllocationUpdated",
            "Key": a["ID"], "Namespace": "default", "FilterKeys": [a["JobID"], ""], "Index": index,
            "Payload": {"Allocation": a}}]})
            .to_string();
        fake.push(&line);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let bytes_out = fake.bytes_out();
    let total: u64 = bytes_out.values().sum::<u64>() - start_bytes;
    let per_change = if mode == WatchMode::Poll {
        bytes_out.get("node-allocations").copied().unwrap_or(0) / (events / nodes + 1).max(1)
    } else {
        0
    };
    task.abort();
    drain.abort();
    (total, per_change)
}

fn main() {
    let events: usize = std::env::var("BENCH_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().unwrap();
    let small = dir.path().join("small.ndjson");
    let large = dir.path().join("large.ndjson");
    let (n, mine, bytes) = generate(&small, events, 1000);
    let (n4, mine4, bytes4) = generate(&large, events * 4, 4000);
    println!("stream: {n} allocation events ({mine} for this node, {:.2} %), {:.1} MiB; large: {n4} events ({mine4} mine), {:.1} MiB",
        100.0 * mine as f64 / n as f64, bytes as f64 / (1 << 20) as f64, bytes4 as f64 / (1 << 20) as f64);

    // Warm the page cache, then measure both decoders in the same run, best of 3.
    watcher_pass(&small);
    let (tw, (own_w, other_w)) = best_of(3, || watcher_pass(&small));
    let (tb, (own_b, other_b)) = best_of(3, || baseline_pass(&small));
    assert_eq!((own_w, other_w), (own_b, other_b), "decoders disagree");
    assert_eq!(own_w + other_w, n);
    let ew = n as f64 / tw.as_secs_f64();
    let eb = n as f64 / tb.as_secs_f64();
    println!(
        "watcher decode path (lazy):   {:>12.0} events/s  {:>8.1} MiB/s",
        ew,
        bytes as f64 / tw.as_secs_f64() / (1 << 20) as f64
    );
    println!(
        "baseline (serde, full Allocation): {:>7.0} events/s  {:>8.1} MiB/s",
        eb,
        bytes as f64 / tb.as_secs_f64() / (1 << 20) as f64
    );
    println!("ratio watcher / baseline: {:.2}", ew / eb);

    // Peak RSS of the watcher path at two sizes (VmHWM reset before each pass).
    reset_peak();
    let base_rss = status_kib("VmHWM:");
    watcher_pass(&small);
    let rss_small = status_kib("VmHWM:");
    reset_peak();
    watcher_pass(&large);
    let rss_large = status_kib("VmHWM:");
    println!("peak RSS, watcher path: {rss_small} KiB at {n} events, {rss_large} KiB at {n4} events (process before: {base_rss} KiB)");

    poll_answer();

    if std::env::var("BENCH_SKIP_FAKE").is_ok() {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("bytes from the scripted Nomad to one node (A = 10 allocations on the node, 400 cluster events):");
    for nodes in [4u64, 16, 64] {
        let (s, _) = rt.block_on(measure_mode(WatchMode::Stream, nodes, 400, 10));
        let (p, per) = rt.block_on(measure_mode(WatchMode::Poll, nodes, 400, 10));
        println!("  N = {nodes:>3}: stream {:>9} B ({:>6} B/event), poll {:>9} B ({per} B per change on the node)", s, s / 400, p);
    }
}

/// Part 5: a poll answer of 100 allocations built from the real capture's allocations (each
/// with its Job); the watcher's read of it beside a whole decode, best of 3 rounds of 200.
fn poll_answer() {
    let text = std::fs::read_to_string(shared(
        "nomad-captures/node-allocations-3-allocs-1.0.x.json",
    ))
    .expect("the capture of a node's allocation list");
    let shapes: Vec<Value> = serde_json::from_str(&text).expect("a JSON list");
    let list: Vec<Value> = (0..100)
        .map(|i| {
            let mut a = shapes[i % shapes.len()].clone();
            a["ID"] = uuid(7, i as u64).into();
            a["ModifyIndex"] = (1000 + i).into();
            a
        })
        .collect();
    let body = bytes::Bytes::from(serde_json::to_vec(&list).unwrap());
    let rounds = 200;
    let (tl, n) = best_of(3, || {
        (0..rounds)
            .map(|_| ListedAlloc::list(body.clone()).expect("the list").len())
            .sum::<usize>()
    });
    let (tf, m) = best_of(3, || {
        (0..rounds)
            .map(|_| {
                serde_json::from_slice::<Vec<Allocation>>(&body)
                    .expect("the list")
                    .len()
            })
            .sum::<usize>()
    });
    assert_eq!((n, m), (100 * rounds, 100 * rounds));
    let us = |t: Duration| t.as_secs_f64() * 1e6 / rounds as f64;
    println!(
        "poll answer of 100 allocations ({} KiB): listed (IDs and ModifyIndexes) {:.0} µs, decoded whole {:.0} µs",
        body.len() / 1024,
        us(tl),
        us(tf)
    );
}
