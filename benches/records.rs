//! The record watches at cluster scale (issue 35; run: `cargo bench --bench records`):
//! N real `dhv-binder agent` processes (default 50) against one simulator with V volume
//! records (default 60), the simulator's counting front (`GET /v1/sim/counters`) giving
//! what the agents ask of the servers for records: `GET /v1/vars` (the volume and snapshot
//! record lists), `GET /v1/var/dhv-binder/volumes/...` and `.../snapshots/...` (record reads)
//! and `GET /v1/var/dhv-binder/records-changed` (the change marker's blocking reads), from the
//! counting front's per-path counts (the CLI's reads of the node records are left out). Three phases of `BENCH_PHASE_SECS` (default 20 s) each:
//!
//! 1. idle: nothing written but the agents' own node records (each every 30 s);
//! 2. unrelated writes: another application's variable written `BENCH_WRITE_RATE` times a
//!    second (default 2); the figure is per agent per write, above the idle rate;
//! 3. record changes: `BENCH_CHANGES` new volume records (default 4), spread over the phase;
//!    the figure is per agent per change, above the idle rate.
//!
//! With `BENCH_BEFORE_BIN` (an agent built before the change) the same phases run first with
//! that agent, then with this build's: one run, one machine, a before/after table
//! (docs/records.md). `BENCH_AGENTS`, `BENCH_RECORDS` change N and V. Needs root (the cluster
//! harness's cgroups and the bind plugin), as the tests do.

#[path = "../tests/support/cgroup.rs"]
mod cgroup;
#[path = "../tests/support/cluster.rs"]
mod cluster;
#[path = "../tests/support/sandbox.rs"]
mod sandbox;

use cluster::Cluster;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn env_num(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// Requests and bytes under `keys` in a counters answer.
fn sum(c: &Value, keys: &[&str]) -> (f64, f64) {
    keys.iter().fold((0.0, 0.0), |(r, b), k| {
        (
            r + c[*k]["requests"].as_f64().unwrap_or(0.0),
            b + c[*k]["bytes"].as_f64().unwrap_or(0.0),
        )
    })
}

/// Record requests and bytes in a counters answer: the lists (`GET /v1/vars`), the change
/// marker's reads and the record reads (`GET /v1/var/dhv-binder/{volumes,snapshots}/...`).
/// Other variable reads are left out: the CLI's reads of the node records (`volume create`
/// reads all N of them twice) are the CLI's, not the agents'.
fn records(c: &Value) -> (f64, f64) {
    split(c)
        .iter()
        .fold((0.0, 0.0), |(r, b), (r1, b1)| (r + r1, b + b1))
}

/// The split of a phase's record requests and bytes: lists, marker reads, record reads.
fn split(c: &Value) -> [(f64, f64); 3] {
    [
        sum(c, &["GET /v1/vars"]),
        sum(c, &["GET /v1/var/dhv-binder/records-changed"]),
        sum(
            c,
            &[
                "GET /v1/var/dhv-binder/volumes",
                "GET /v1/var/dhv-binder/snapshots",
            ],
        ),
    ]
}

/// The change marker's sequence number (0 when there is none).
async fn marker_seq(c: &Cluster) -> u64 {
    c.get_opt("/v1/var/dhv-binder/records-changed?namespace=default")
        .await
        .and_then(|m| m["Items"]["seq"].as_str().and_then(|s| s.parse().ok()))
        .unwrap_or(0)
}

struct Figures {
    idle_req: f64,
    idle_bytes: f64,
    write_req: f64,
    write_bytes: f64,
    change_req: f64,
    change_bytes: f64,
    /// Per agent per change, above idle: (requests, bytes) of lists, marker reads, record reads.
    change_split: [(f64, f64); 3],
    /// Marker updates (record writes announced) per change.
    marker_updates: f64,
    writes: u64,
    changes: u64,
}

async fn counters(c: &Cluster) -> Value {
    c.get("/v1/sim/counters").await
}

async fn reset(c: &Cluster) {
    let r = c
        .http
        .put(format!("{}/v1/sim/counters/reset", c.server))
        .send()
        .await
        .expect("reset the counters");
    assert!(r.status().is_success(), "counters reset: {}", r.status());
}

async fn run(label: &str, n: usize, v: usize, phase: Duration) -> Figures {
    let t0 = Instant::now();
    // The agents' own defaults, not the tests' shortened relist (tests/support/cluster.rs):
    // the floor of the agents before the marker, the relist of those after it.
    let c = Cluster::start_with(
        n,
        "",
        &[
            ("DHV_BINDER_RECORD_FLOOR", "10s"),
            ("DHV_BINDER_RECORD_RELIST", "5m"),
        ],
    )
    .await;
    eprintln!("[{label}] {n} agents up in {:?}", t0.elapsed());
    let export = c.export.display().to_string();
    let create = |names: Vec<String>| {
        let c = &c;
        let export = export.clone();
        std::thread::scope(|s| {
            for chunk in names.chunks(names.len().div_ceil(12).max(1)) {
                let export = export.clone();
                s.spawn(move || {
                    for name in chunk {
                        c.create_volume_with(
                            name,
                            "single-node-multi-writer",
                            "bind",
                            &[("export", &export)],
                            &[],
                            "",
                        );
                    }
                });
            }
        });
    };
    let t0 = Instant::now();
    create((0..v).map(|i| format!("rec{i}")).collect());
    eprintln!("[{label}] {v} records in {:?}", t0.elapsed());
    // Let the placeholders and node records settle.
    tokio::time::sleep(Duration::from_secs(15)).await;
    let per_agent = |x: f64| x / n as f64;

    reset(&c).await;
    tokio::time::sleep(phase).await;
    let idle = counters(&c).await;
    let (idle_req, idle_bytes) = records(&idle);
    let idle_split = split(&idle);

    let rate = env_num("BENCH_WRITE_RATE", 2);
    reset(&c).await;
    let start = Instant::now();
    let mut writes = 0u64;
    while start.elapsed() < phase {
        c.put(
            "/v1/var/other-app/config",
            json!({"Items": {"n": writes.to_string()}}),
        )
        .await;
        writes += 1;
        tokio::time::sleep_until(
            tokio::time::Instant::from_std(start)
                + Duration::from_millis(1000 * writes / rate.max(1)),
        )
        .await;
    }
    let (wr, wb) = records(&counters(&c).await);

    let changes = env_num("BENCH_CHANGES", 4);
    let seq0 = marker_seq(&c).await;
    reset(&c).await;
    let start = Instant::now();
    for i in 0..changes {
        create(vec![format!("new{i}")]);
        tokio::time::sleep_until(
            tokio::time::Instant::from_std(start) + phase.mul_f64((i + 1) as f64 / changes as f64),
        )
        .await;
    }
    let took = start.elapsed();
    let changed = counters(&c).await;
    let (cr, cb) = records(&changed);
    let change_split = split(&changed);
    let scale = took.as_secs_f64() / phase.as_secs_f64();
    let marker_updates = (marker_seq(&c).await - seq0) as f64 / changes as f64;
    drop(c);
    Figures {
        idle_req: per_agent(idle_req),
        idle_bytes: per_agent(idle_bytes),
        write_req: per_agent(wr - idle_req) / writes as f64,
        write_bytes: per_agent(wb - idle_bytes) / writes as f64,
        change_req: per_agent(cr - idle_req * scale) / changes as f64,
        change_bytes: per_agent(cb - idle_bytes * scale) / changes as f64,
        change_split: [0, 1, 2].map(|i| {
            let per = |x: f64, idle: f64| per_agent(x - idle * scale) / changes as f64;
            (
                per(change_split[i].0, idle_split[i].0),
                per(change_split[i].1, idle_split[i].1),
            )
        }),
        marker_updates,
        writes,
        changes,
    }
}

#[tokio::main]
async fn main() {
    let n = env_num("BENCH_AGENTS", 50) as usize;
    let v = env_num("BENCH_RECORDS", 60) as usize;
    let phase = Duration::from_secs(env_num("BENCH_PHASE_SECS", 20));
    let mut rows = Vec::new();
    if let Some(before) = std::env::var_os("BENCH_BEFORE_BIN") {
        std::env::set_var("BENCH_AGENT_BIN", before);
        rows.push(("before", run("before", n, v, phase).await));
        std::env::remove_var("BENCH_AGENT_BIN");
    }
    rows.push(("this build", run("after", n, v, phase).await));
    println!(
        "N = {n} agents, V = {v} records, phases of {} s; record requests (GET /v1/vars + GET /v1/var/dhv-binder/{{volumes,snapshots,records-changed}}/...) per agent",
        phase.as_secs()
    );
    println!("| agent | idle req/s | idle B/s | req per unrelated write | B per unrelated write | req per record change | B per record change |");
    println!("|---|---|---|---|---|---|---|");
    for (label, f) in &rows {
        let s = phase.as_secs_f64();
        println!(
            "| {label} | {:.3} | {:.0} | {:.3} | {:.0} | {:.2} | {:.0} |",
            f.idle_req / s,
            f.idle_bytes / s,
            f.write_req,
            f.write_bytes,
            f.change_req,
            f.change_bytes
        );
        eprintln!(
            "[{label}] {} unrelated writes, {} record changes",
            f.writes, f.changes
        );
    }
    println!();
    println!("Per agent per record change (a volume create), above idle: requests (bytes) of lists, marker reads, record reads; marker updates (announced record writes) per change");
    println!("| agent | lists | marker reads | record reads | marker updates per change |");
    println!("|---|---|---|---|---|");
    for (label, f) in &rows {
        let [l, m, r] = f.change_split;
        println!(
            "| {label} | {:.2} ({:.0} B) | {:.2} ({:.0} B) | {:.2} ({:.0} B) | {:.1} |",
            l.0, l.1, m.0, m.1, r.0, r.1, f.marker_updates
        );
    }
}
