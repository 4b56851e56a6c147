//! The usage task's cost at scale (issue 47; run: `cargo bench --bench volume_usage`):
//! `BENCH_VOLUMES` (default 1000) directories of an export, each bind-mounted onto a target
//! of its own as the bind plugin publishes them (so the mount table holds that many more
//! entries, as on such a node), each holding `BENCH_FILES` (default 10) files of 4 KiB.
//! Rounds run as the agent's usage task runs them (`src/agent/volume_usage.rs` `round`):
//! every target read by `statfs` (`UsageReader::read`, 5 s timeout), at most 8 at once;
//! then the same with the bind plugin's `stats` and `health` after each `statfs`
//! (`Runner::call_within`, 10 s each), as for a plugin that declares them. `BENCH_ROUNDS`
//! (default 3) rounds of each. Printed per round (means): wall time; CPU of this process
//! (user + system, `getrusage(RUSAGE_SELF)`: the agent's share) and of the plugin processes
//! (`RUSAGE_CHILDREN`); the calls; RSS (`VmRSS`) before and after and its peak (`VmHWM`);
//! and per minute at the default `--usage-interval` of 60 s. Needs root (bind mounts) and
//! the bind plugin's tools (findmnt, jq), as the tests do. Every mount is undone at the end.

use dhv_binder::node::usage::{Reading, UsageReader};
use dhv_binder::storage::plugin::{Operation, Runner};
use futures_util::StreamExt;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn env_num(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// CPU time (user + system) of `who` so far, in ms.
fn cpu_ms(who: nix::sys::resource::UsageWho) -> f64 {
    let u = nix::sys::resource::getrusage(who).expect("getrusage");
    let ms = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 * 1000.0 + t.tv_usec() as f64 / 1000.0;
    ms(u.user_time()) + ms(u.system_time())
}

/// A line of /proc/self/status in KiB (`VmRSS`, `VmHWM`).
fn status_kib(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Unmounts every target when the bench ends, even on a panic.
struct Mounts(Vec<PathBuf>);

impl Drop for Mounts {
    fn drop(&mut self) {
        for t in &self.0 {
            let _ = nix::mount::umount2(t, nix::mount::MntFlags::empty());
        }
    }
}

/// One published volume: its target and the environment its plugin calls get.
struct Volume {
    target: PathBuf,
    env: Vec<(String, String)>,
}

/// One round: each target's `statfs`, then (with `calls`) its `stats` and `health`, at most
/// 8 volumes at once. Returns how many calls answered.
async fn round(vols: &[Volume], runner: Option<&Runner>) -> (usize, usize) {
    let reader = UsageReader::default();
    let outcomes: Vec<(bool, usize)> = futures_util::stream::iter(vols)
        .map(|v| {
            let reader = reader.clone();
            async move {
                let r = reader.read(v.target.clone(), Duration::from_secs(5)).await;
                let mut calls = 0;
                if let (Some(runner), Reading::Usage(_)) = (runner, &r) {
                    for op in [Operation::Stats, Operation::Health] {
                        let out = runner
                            .call_within(
                                "bind",
                                op,
                                &v.env,
                                &BTreeMap::new(),
                                Duration::from_secs(10),
                            )
                            .await;
                        assert!(out.is_ok(), "{op}: {:?}", out.err().map(|e| e.report()));
                        calls += 1;
                    }
                }
                (matches!(r, Reading::Usage(_)), calls)
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    (
        outcomes.iter().filter(|(ok, _)| *ok).count(),
        outcomes.iter().map(|(_, c)| c).sum(),
    )
}

fn main() {
    let n = env_num("BENCH_VOLUMES", 1000);
    let files = env_num("BENCH_FILES", 10);
    let rounds = env_num("BENCH_ROUNDS", 3);
    let dir = tempfile::Builder::new()
        .prefix("dhv-binder-usage-bench-")
        .tempdir()
        .expect("temp dir");
    let export = dir.path().join("export");
    let plugins = dir.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::copy(repo.join("plugins/bind"), plugins.join("bind")).unwrap();
    let mut mounts = Mounts(Vec::new());
    let mut vols = Vec::new();
    for i in 0..n {
        let id = format!("00000000-0000-4000-8000-{i:012}");
        let src = export.join("default").join(&id);
        std::fs::create_dir_all(&src).unwrap();
        for f in 0..files {
            std::fs::write(src.join(format!("f{f}")), vec![0x5a; 4096]).unwrap();
        }
        let target = dir.path().join("targets").join(&id);
        std::fs::create_dir_all(&target).unwrap();
        nix::mount::mount(
            Some(&src),
            &target,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .expect("bind mount (the bench needs root)");
        mounts.0.push(target.clone());
        let env = vec![
            (
                "DHV_VOLUMES_DIR".into(),
                dir.path().join("volumes").display().to_string(),
            ),
            ("DHV_NAMESPACE".into(), "default".into()),
            ("DHV_VOLUME_NAME".into(), format!("v{i}")),
            ("DHV_VOLUME_ID".into(), id.clone()),
            ("DHV_NODE_ID".into(), "bench-node".into()),
            ("DHV_CONTEXT_SIGNED".into(), "false".into()),
            (
                "DHV_PARAMETERS".into(),
                serde_json::json!({"export": export}).to_string(),
            ),
            (
                "DHV_CONTEXT".into(),
                serde_json::json!({"export_path": src}).to_string(),
            ),
            ("DHV_TARGET_PATH".into(), target.display().to_string()),
            ("DHV_SECRETS".into(), "{}".into()),
        ];
        vols.push(Volume { target, env });
    }
    let runner = Runner::new(&plugins, Duration::from_secs(30)).with_allowed_roots(BTreeMap::from(
        [("bind".to_string(), export.display().to_string())],
    ));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "{n} published bind volumes ({files} files of 4 KiB each), {rounds} rounds each, at most 8 volumes at once"
    );
    println!(
        "{:<22} {:>8} {:>8} {:>12} {:>14} {:>10} {:>10} {:>10}",
        "round", "statfs", "calls", "wall ms", "agent CPU ms", "child CPU", "RSS KiB", "peak KiB"
    );
    for (label, with_calls) in [("statfs only", false), ("statfs + stats/health", true)] {
        let rss_before = status_kib("VmRSS:");
        let (mut wall, mut cpu, mut child, mut reads, mut calls) = (0.0, 0.0, 0.0, 0, 0);
        for _ in 0..rounds {
            let (c0, k0, t0) = (
                cpu_ms(nix::sys::resource::UsageWho::RUSAGE_SELF),
                cpu_ms(nix::sys::resource::UsageWho::RUSAGE_CHILDREN),
                Instant::now(),
            );
            let (r, c) = rt.block_on(round(&vols, with_calls.then_some(&runner)));
            wall += t0.elapsed().as_secs_f64() * 1000.0;
            cpu += cpu_ms(nix::sys::resource::UsageWho::RUSAGE_SELF) - c0;
            child += cpu_ms(nix::sys::resource::UsageWho::RUSAGE_CHILDREN) - k0;
            reads += r;
            calls += c;
        }
        let k = rounds as f64;
        println!(
            "{label:<22} {:>8} {:>8} {:>12.0} {:>14.0} {:>10.0} {:>10} {:>10}",
            reads / rounds,
            calls / rounds,
            wall / k,
            cpu / k,
            child / k,
            format!("{rss_before}→{}", status_kib("VmRSS:")),
            status_kib("VmHWM:"),
        );
        println!(
            "  per minute at a 60 s interval: {} statfs, {} plugin calls; {:.2} % of one CPU in the agent, {:.1} % in the plugin processes",
            reads / rounds,
            calls / rounds,
            cpu / k / 600.0,
            child / k / 600.0,
        );
    }
    drop(mounts);
}
