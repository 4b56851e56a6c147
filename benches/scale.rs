//! The agent under load (run: `cargo bench --bench scale`): every figure of issue 10 in one
//! run, from the real `dhv-binder agent` process driven by the simulator's scripted front
//! (`nomad_sim::replay`) on loopback. See docs/scale.md for what the figures mean.
//!
//! 1. Allocation event → plugin exec, p50/p99, in both watch modes, with the state directory on
//!    disk (the bench's temporary directory) and on a tmpfs mounted under it; then on tmpfs
//!    with the machine idle for 0.5 s before each sample (an allocation on a quiet node).
//!    Each row also gives a plugin run started by the bench alone in the same rhythm, and
//!    splits the latency at the simulator's answer that carries the allocation (a stream
//!    frame, or in poll mode the node's whole allocation list): the server's share, then
//!    the agent's and the exec's.
//! 2. N = 1/10/50/200 allocations placed at once (one frame, N volumes), last publish done,
//!    beside the ideal ⌈N / max-parallel⌉ × (plugin + exec) + one commit, at max-parallel 8
//!    and, for N = 200, at max-parallel = the machine's cores; with the agent's and the
//!    plugins' CPU per publish, the agent's mount table readings during the burst
//!    (`dhv_binder_mount_table_reads_total`), and its heap before the burst and once the
//!    N volumes are published (jemalloc's allocated bytes, as in part 4).
//! 3. 400 releases with a 150 ms unpublish, measured / ideal schedule, in both modes.
//! 4. The agent's RSS, all and anonymous: idle, with 200 published volumes, after a
//!    400-volume teardown (each the least of 20 samples over 2 s); and its heap (jemalloc's
//!    allocated bytes, `dhv_binder_heap_allocated_bytes` from its metrics endpoint) before
//!    and after the release part's teardown, printed with part 3.
//! 5. fsync-class system calls per publish (`strace -f` attached to the agent).
//! 6. Plugin execs in 10 s while the agent is idle.
//! 7. A node with 1,000 published volumes (`BENCH_RESTART_VOLUMES`): the burst of 1,000
//!    placements in one frame against its CPU floor, RSS and heap with them published, the
//!    agent's CPU, requests and plugin calls in 30 idle seconds, then SIGKILL and a new
//!    agent on the same state: time and the agent's own CPU until it is ready (status
//!    complete, every volume published in its records, nothing waiting), its requests to
//!    the servers meanwhile, and the plugin publish/unpublish calls (there should be none).
//!
//! The plugin is `benches/support/plugin.rs`, built by the bench into a small static binary
//! (copied into each node's plugin directory): started
//! with `DHV_OPERATION` set it bind-mounts (publish) or unmounts (unpublish), stretches its
//! work to the configured time, and appends `op start_ns end_ns volume alloc` to the node's
//! call log. Every mount (plugin mounts, the tmpfs) is under the node's own temporary
//! directory and detached when the node is dropped.
//!
//! Environment: `BENCH_SAMPLES` (latency samples per mode and filesystem, default 100);
//! `BENCH_IDLE_SAMPLES` and `BENCH_IDLE_MS` (latency samples taken after an idle time each,
//! per mode: default 20 after 500 ms);
//! `BENCH_PARTS` (comma list of `latency`, `burst`, `release`, `fsync`, `restart`; default all;
//! `burst-cores` runs only the bursts at max-parallel = cores);
//! `BENCH_AGENT_BIN` (another agent binary, e.g. main's, for a before/after table);
//! `BENCH_PLUGIN=bench-binary` (run this binary as the plugin instead of the lean static one
//! built from `benches/support/plugin.rs`; see [`plugin_binary`]);
//! `BENCH_AGENT_ENV` (extra `KEY=value` pairs for the agent, e.g. allocator settings);
//! `BENCH_HOLD` (seconds to keep each release node up after its teardown, to inspect it);
//! `BENCH_TRACE` (print each latency sample's commit and plugin start times, each burst's
//! calls as start/duration/concurrency, and the release part's slot turnaround);
//! `BENCH_PERF_CTL` (a `perf record --control fifo:` path: each burst writes `enable` to it
//! as it places its allocations and `disable` once the last publish is done, so a profiler
//! started disabled with `-D -1` samples only the bursts; part 7 frames its idle window, or
//! its burst with `BENCH_PERF_PHASE=burst`; `BENCH_PERF_PHASE=latency` frames part 1's
//! back-to-back samples).
//! Needs root (mounts), `strace` (scripts/install-deps), and `rustc` with the static C
//! library (libc6-dev) to build the plugin.

#[path = "../tests/support/inproc.rs"]
mod inproc;
#[path = "../tests/support/sandbox.rs"]
mod sandbox;

use dhv_binder::nomad::watch::WatchMode;
use nomad_sim::replay::Replay;
use sandbox::Sandbox;
use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const NODE: &str = "3f6b2c1e-8d4a-4b7e-9c2f-5a1d7e3b9c40";
const PLUGIN: &str = "bench";
const MAX_PARALLEL: usize = 8;

/// The bench's volume plugin ([`plugin_binary`] builds it on its own; this binary runs the
/// same code when started with `DHV_OPERATION`, for `BENCH_PLUGIN=bench-binary`).
#[path = "support/plugin.rs"]
mod plugin;

use plugin::now_ns;

/// The plugin binary each node copies into its plugin directory, built once per run.
///
/// By default `benches/support/plugin.rs` compiled by `rustc` (`$RUSTC`, else `rustc` on
/// the PATH) into a static binary under Cargo's `CARGO_TARGET_TMPDIR`: a lean plugin, whose
/// exec is what issue 10's goal assumes (about 0.7 ms). With `BENCH_PLUGIN=bench-binary`,
/// this bench binary itself (6.5 MB, dynamically linked: about 1.1 ms per exec here), with
/// which the figures docs/scale.md marks `BENCH_PLUGIN=bench-binary` were taken.
///
/// Exits the bench with what to do when `rustc` or the static C library (`libc6-dev`) is
/// missing.
fn plugin_binary() -> &'static std::path::Path {
    static BIN: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BIN.get_or_init(|| {
        if std::env::var("BENCH_PLUGIN").as_deref() == Ok("bench-binary") {
            return std::env::current_exe().expect("the bench's own path");
        }
        let src = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/support/plugin.rs");
        let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("scale-bench-plugin");
        let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_string());
        let built = Command::new(&rustc)
            .args(["--edition", "2021", "--crate-name", "dhv_bench_plugin"])
            .args([
                "-C",
                "opt-level=2",
                "-C",
                "panic=abort",
                "-C",
                "strip=symbols",
            ])
            .args(["-C", "target-feature=+crt-static", "-o"])
            .arg(&out)
            .arg(src)
            .status();
        match built {
            Ok(s) if s.success() => out,
            other => {
                eprintln!(
                    "benches/scale: building the bench plugin ({rustc} {src}, static) failed \
                     ({other:?}): needs rustc and the static C library (libc6-dev); or run \
                     with BENCH_PLUGIN=bench-binary"
                );
                std::process::exit(1);
            }
        }
    })
}

/// One plugin call from the node's call log.
#[derive(Debug, Clone)]
struct Call {
    op: String,
    start: u64,
    end: u64,
    alloc: String,
}

/// One simulated node: a scripted Nomad, the agent process, its own temporary directory.
struct Node {
    agent: Option<Child>,
    fake: Replay,
    cfg: dhv_binder::config::AgentConfig,
    /// Extra environment for the agent (before `BENCH_AGENT_ENV`).
    env: Vec<(String, String)>,
    /// Dropped last: detaches every mount below the node's directory (plugin mounts,
    /// the tmpfs) once the agent is stopped ([`Node`]'s `Drop`).
    sb: Sandbox,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop();
    }
}

fn volume_name(i: usize) -> String {
    format!("v{i:04}")
}

fn alloc_id(i: usize) -> String {
    format!("00000000-0000-4000-8000-{i:012}")
}

fn mode_name(mode: WatchMode) -> &'static str {
    match mode {
        WatchMode::Stream => "stream",
        WatchMode::Poll => "poll",
    }
}

impl Node {
    /// Starts a node with `volumes` volume records (multi-node, no claims) served by the
    /// bench plugin (publish and unpublish stretched to `plugin_us`), and waits until the
    /// agent is ready with every placeholder registered.
    async fn start(mode: WatchMode, tmpfs: bool, volumes: usize, plugin_us: (u64, u64)) -> Node {
        Self::start_with(mode, tmpfs, volumes, plugin_us, MAX_PARALLEL, &[]).await
    }

    /// [`Node::start`] with extra environment for the agent (before `BENCH_AGENT_ENV`).
    async fn start_with(
        mode: WatchMode,
        tmpfs: bool,
        volumes: usize,
        plugin_us: (u64, u64),
        max_parallel: usize,
        env: &[(&str, &str)],
    ) -> Node {
        let sb = Sandbox::new();
        if tmpfs {
            let state = sb.join("state");
            std::fs::create_dir_all(&state).unwrap();
            nix::mount::mount(
                Some("tmpfs"),
                &state,
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some("size=256m"),
            )
            .expect("mount a tmpfs under the bench's temporary directory");
        }
        std::fs::create_dir_all(sb.join("plugins")).unwrap();
        std::fs::copy(plugin_binary(), sb.join("plugins").join(PLUGIN)).unwrap();
        std::fs::write(
            sb.join("plugin.conf"),
            format!("{} {}", plugin_us.0, plugin_us.1),
        )
        .unwrap();
        let fake = Replay::start(NODE, json!({"keys": []})).await;
        for i in 0..volumes {
            inproc::volume_record(
                &fake,
                "default",
                &volume_name(i),
                PLUGIN,
                "multi-node-multi-writer",
            );
        }
        let mut cfg = inproc::agent_config(&sb);
        cfg.watch_mode = mode;
        cfg.max_parallel = max_parallel;
        let mut node = Node {
            agent: None,
            fake,
            cfg,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            sb,
        };
        node.spawn();
        node.ready(volumes).await;
        node
    }

    /// Starts the agent process (again, after [`Node::kill`]) with the node's settings.
    fn spawn(&mut self) {
        let bin = std::env::var("BENCH_AGENT_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_dhv-binder").to_string());
        let extra: Vec<(String, String)> = std::env::var("BENCH_AGENT_ENV")
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.sb.join("agent.log"))
            .unwrap();
        let cfg = &self.cfg;
        let agent = Command::new(bin)
            .arg("agent")
            .arg("--state-dir")
            .arg(&cfg.state_dir)
            .arg("--socket")
            .arg(&cfg.socket)
            .arg("--plugin-dir")
            .arg(&cfg.plugin_dir)
            .arg("--volumes-dir")
            .arg(cfg.volumes_dir())
            .arg("--watch-mode")
            .arg(mode_name(cfg.watch_mode))
            .arg("--max-parallel")
            .arg(cfg.max_parallel.to_string())
            // The bench plants its records unsigned, as the in-process tests do.
            .arg("--allow-unsigned-records")
            .env_clear()
            .env("NOMAD_ADDR", &self.fake.addr)
            .env("DHV_BINDER_LOG", "warn")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .envs(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the dhv-binder agent");
        self.agent = Some(agent);
    }

    /// Kills the agent with SIGKILL (nothing of its own shutdown runs) and reaps it.
    fn kill(&mut self) {
        if let Some(mut c) = self.agent.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    async fn ready(&self, placeholders: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let s = inproc::status(&self.cfg).await;
            let registered = self.fake.host_volumes().len();
            if s["view"]["complete"] == true && registered >= placeholders {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "the agent never got ready: {}\n{}",
            inproc::status(&self.cfg).await,
            std::fs::read_to_string(self.sb.join("agent.log")).unwrap_or_default()
        );
    }

    /// Stops the agent as SIGTERM does, and waits for it.
    fn stop(&mut self) {
        if let Some(mut c) = self.agent.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = c.wait();
        }
    }

    fn pid(&self) -> u32 {
        self.agent.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// The agent's resident memory now (`/proc/<pid>/status`): all of it and its anonymous
    /// part, in KiB. The rest is file-backed (the binary's code and the libraries', paged in
    /// as it runs and dropped by the kernel under pressure).
    fn rss_kib(&self) -> Rss {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        Rss {
            total: field("VmRSS:"),
            anon: field("RssAnon:"),
        }
    }

    /// The least resident memory of 20 samples over 2 s ([`Node::rss_kib`]): what the
    /// agent holds, without the garbage of a resync (every 2 s on the release nodes) that
    /// waits for the allocator's 1 s decay (.cargo/config.toml). Both figures are those of
    /// the sample with the least in all.
    async fn rss_settled(&self) -> Rss {
        let mut least = self.rss_kib();
        for _ in 1..20 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = self.rss_kib();
            if now.total < least.total {
                least = now;
            }
        }
        least
    }

    /// The agent's heap (`dhv_binder_heap_allocated_bytes`, jemalloc's live bytes) from its
    /// metrics endpoint at `addr`, in KiB; `None` when it cannot be read.
    async fn heap_kib(addr: &str) -> Option<u64> {
        Self::metric(addr, "dhv_binder_heap_allocated_bytes")
            .await
            .map(|b| b / 1024)
    }

    /// One unlabelled metric's value from the agent's metrics endpoint at `addr`; `None`
    /// when it cannot be read.
    async fn metric(addr: &str, name: &str) -> Option<u64> {
        let text = reqwest::get(format!("http://{addr}/metrics"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<u64>().ok())
    }

    fn calls(&self) -> Vec<Call> {
        std::fs::read_to_string(self.sb.join("calls.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let mut f = l.split(' ');
                Some(Call {
                    op: f.next()?.to_string(),
                    start: f.next()?.parse().ok()?,
                    end: f.next()?.parse().ok()?,
                    // The volume name is logged for people reading the log.
                    alloc: f.nth(1).unwrap_or_default().to_string(),
                })
            })
            .collect()
    }

    fn count(&self, op: &str) -> usize {
        self.calls().iter().filter(|c| c.op == op).count()
    }

    /// The latest end of an `op` call (ns since the epoch).
    fn last_end(&self, op: &str) -> Option<u64> {
        self.calls()
            .iter()
            .filter(|c| c.op == op)
            .map(|c| c.end)
            .max()
    }

    /// Waits until the call log holds `n` calls of `op`.
    async fn wait_calls(&self, op: &str, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if self.count(op) >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!(
            "waited 120 s for {n} {op} calls, saw {}\n{}",
            self.count(op),
            std::fs::read_to_string(self.sb.join("agent.log")).unwrap_or_default()
        );
    }

    /// Stores allocations (ID number, volume number) in `client_status`, then sends them as
    /// one frame at a new index (payloads without Job, as Nomad does). Returns the time the
    /// write was done, before the frame went out ([`Replay::commit`]).
    fn place(&mut self, allocs: &[(usize, usize)], client_status: &str) -> u64 {
        // Nomad's indexes only rise, and an allocation's ModifyIndex is the index of the
        // write that stored it: the frame is written above the store's index.
        let index = self.fake.index() + 1;
        let mut events = Vec::new();
        let mut stored = Vec::new();
        for &(a, v) in allocs {
            let vol = volume_name(v);
            let full = inproc::alloc_json(&alloc_id(a), NODE, &[&vol], client_status, index);
            let f: Value =
                serde_json::from_str(&inproc::frame(index, "AllocationUpdated", &full)).unwrap();
            let mut with_job = f["Events"][0].clone();
            with_job["Payload"]["Allocation"] = full;
            stored.push(with_job);
            events.push(f["Events"][0].clone());
        }
        // Every allocation stored in one write, with its Job, and the stream's frame
        // (payloads without the Job, as Nomad sends them) published at that write's index,
        // as Nomad's plan apply commits every allocation of a plan at one index. The time
        // is taken when the write is done and before the frame goes out and blocking
        // queries wake: the scripted front's own decoding and storing of the allocations is
        // no part of the agent's latency.
        self.fake.commit(
            &json!({"Index": index, "Events": stored}).to_string(),
            &json!({"Index": index, "Events": events}).to_string(),
        )
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// Part 1: `samples` allocations, one at a time, each on one of 10 volumes; the event →
/// publish exec latency of each, then the allocation completes and its unpublish is awaited.
/// With a `gap`, the agent is left idle that long before each sample (allocations that come
/// now and then, as on most nodes, rather than back to back).
async fn latency(mode: WatchMode, tmpfs: bool, samples: usize, gap: Duration) -> Latency {
    let mut node = Node::start(mode, tmpfs, 10, (200, 200)).await;
    let mut lat = Vec::with_capacity(samples);
    let mut server = Vec::with_capacity(samples);
    let mut rest = Vec::with_capacity(samples);
    // The answer that carries the allocation to the agent: a stream frame, or the node's
    // whole allocation list for the blocking query.
    let answer = match mode {
        WatchMode::Stream => "stream",
        WatchMode::Poll => "node-allocations",
    };
    // `BENCH_PERF_PHASE=latency` frames the back-to-back samples for the profiler: one
    // allocation's whole cycle (publish, then unpublish) at a time.
    let frame = gap.is_zero() && std::env::var("BENCH_PERF_PHASE").is_ok_and(|p| p == "latency");
    if frame {
        perf_control("enable");
    }
    let cpu0 = agent_cpu_ms(node.pid()).0;
    for i in 0..samples {
        tokio::time::sleep(gap).await;
        let t0 = node.place(&[(i, i % 10)], "running");
        node.wait_calls("publish", i + 1).await;
        let c = node
            .calls()
            .into_iter()
            .find(|c| c.op == "publish" && c.alloc == alloc_id(i))
            .expect("publish of the sample's allocation");
        lat.push(ms(c.start.saturating_sub(t0)));
        if let Some(a) = node
            .fake
            .answered_since(answer, t0)
            .filter(|a| *a <= c.start)
        {
            server.push(ms(a - t0));
            rest.push(ms(c.start - a));
        }
        if std::env::var_os("BENCH_TRACE").is_some() {
            // Unix ns, to line up with the agent's own log (`DHV_BINDER_LOG=debug`).
            eprintln!(
                "latency {} {} sample {i}: committed {t0}, plugin started {} (+{:.3} ms)",
                mode_name(mode),
                if tmpfs { "tmpfs" } else { "disk" },
                c.start,
                ms(c.start.saturating_sub(t0))
            );
        }
        node.place(&[(i, i % 10)], "complete");
        node.wait_calls("unpublish", i + 1).await;
    }
    let cycle_cpu = (agent_cpu_ms(node.pid()).0 - cpu0) / samples.max(1) as f64;
    if frame {
        perf_control("disable");
    }
    for v in [&mut lat, &mut server, &mut rest] {
        v.sort_by(|a, b| a.total_cmp(b));
    }
    // The exec alone, started as the samples were: back to back, or after the same idle.
    let exec = if gap.is_zero() {
        exec_cost(&node)
    } else {
        exec_cost_after(&node, gap, samples).await
    };
    Latency {
        p50: quantile(&lat, 0.5),
        p99: quantile(&lat, 0.99),
        server: (quantile(&server, 0.5), quantile(&server, 0.99)),
        agent: (quantile(&rest, 0.5), quantile(&rest, 0.99)),
        split: server.len(),
        exec,
        cycle_cpu,
    }
}

/// Part 1's figures for one row (ms).
struct Latency {
    p50: f64,
    p99: f64,
    /// p50, p99 of the server's share: commit → the answer carrying the allocation ready
    /// to send (a stream frame; in poll mode the node's whole allocation list, which grows
    /// with the allocations the node holds).
    server: (f64, f64),
    /// p50, p99 of the rest: that answer ready → the plugin started (the agent's read,
    /// plan, commit and spawn, and the exec).
    agent: (f64, f64),
    /// How many samples `server` and `agent` cover: those whose answer was found.
    split: usize,
    /// A whole plugin run (fork, exec, dynamic linking, the plugin's work, exit) started
    /// by the bench itself in the same rhythm: what the machine charges for an exec.
    exec: f64,
    /// The agent's CPU per sample (ms): one allocation's whole cycle, its publish and then
    /// its unpublish, with the gap's idle work when there is a gap.
    cycle_cpu: f64,
}

/// Mean wall time of starting the plugin and waiting for it (a no-op operation): the
/// "exec" of the ideal schedule.
fn exec_cost(node: &Node) -> f64 {
    exec_costs(node).0
}

/// Runs the node's plugin once, a no-op operation, and waits for it.
fn run_plugin(node: &Node) {
    let _ = Command::new(node.sb.join("plugins").join(PLUGIN))
        .arg("create")
        .env_clear()
        .env("DHV_OPERATION", "create")
        .stdout(Stdio::null())
        .status();
}

/// Median wall time (ms) of one plugin run (as [`exec_cost`]) when each starts after `gap`
/// of idle: the machine's own cost of waking to start a process.
async fn exec_cost_after(node: &Node, gap: Duration, n: usize) -> f64 {
    let mut walls = Vec::with_capacity(n);
    for _ in 0..n {
        tokio::time::sleep(gap).await;
        let t = Instant::now();
        run_plugin(node);
        walls.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    walls.sort_by(f64::total_cmp);
    quantile(&walls, 0.5)
}

/// Mean wall time and mean CPU time (user + system, of the child: fork, exec, dynamic
/// linking, the plugin's own start) of one plugin run, in ms.
fn exec_costs(node: &Node) -> (f64, f64) {
    let n = 30;
    let cpu0 = children_cpu_ms();
    let t = Instant::now();
    for _ in 0..n {
        run_plugin(node);
    }
    let wall = t.elapsed().as_secs_f64() * 1000.0 / n as f64;
    (wall, (children_cpu_ms() - cpu0) / n as f64)
}

/// CPU time of this process's waited-for children so far, in ms (getrusage(2)).
fn children_cpu_ms() -> f64 {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_CHILDREN).expect("getrusage");
    let ms = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 * 1000.0 + t.tv_usec() as f64 / 1000.0;
    ms(u.user_time()) + ms(u.system_time())
}

/// CPU time of the agent so far, in ms: its threads' run time (`/proc/<pid>/task/*/
/// schedstat`, ns) and that of its waited-for children, the plugins (`/proc/<pid>/stat`
/// cutime + cstime, clock ticks of 10 ms).
fn agent_cpu_ms(pid: u32) -> (f64, f64) {
    let mut own = 0u64;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(s) = std::fs::read_to_string(t.path().join("schedstat")) {
                own += s
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): state is field 3, cutime 16.
    let rest = stat.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    let children_ticks = f.get(13).copied().unwrap_or(0) + f.get(14).copied().unwrap_or(0);
    (own as f64 / 1e6, children_ticks as f64 * 10.0)
}

/// Writes `command` to the `BENCH_PERF_CTL` fifo, if one is given (a profiler's control).
/// Never blocks: a fifo nobody reads (ENXIO) or a path that is not a fifo is reported.
fn perf_control(command: &str) {
    use std::io::Write;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let Some(path) = std::env::var_os("BENCH_PERF_CTL") else {
        return;
    };
    let written = std::fs::metadata(&path)
        .and_then(|m| {
            if m.file_type().is_fifo() {
                Ok(())
            } else {
                Err(std::io::Error::other("not a fifo"))
            }
        })
        .and_then(|()| {
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(nix::fcntl::OFlag::O_NONBLOCK.bits())
                .open(&path)
        })
        .and_then(|mut f| f.write_all(format!("{command}\n").as_bytes()));
    if let Err(e) = written {
        println!("   BENCH_PERF_CTL {}: {e}", path.to_string_lossy());
    }
}

/// Mean time of one small durable write (write + fdatasync) in the node's state directory:
/// the "one commit" of the ideal schedule.
fn commit_cost(node: &Node) -> f64 {
    use std::io::Write;
    let p = node.cfg.state_dir.join("bench-commit");
    let mut f = std::fs::File::create(&p).unwrap();
    let n = 20;
    let t = Instant::now();
    for _ in 0..n {
        f.write_all(&[b'x'; 512]).unwrap();
        f.sync_data().unwrap();
    }
    let d = t.elapsed().as_secs_f64() * 1000.0 / n as f64;
    let _ = std::fs::remove_file(&p);
    d
}

struct Burst {
    elapsed_ms: f64,
    ideal_ms: f64,
    /// N plugin runs' CPU over the machine's cores, plus one commit.
    floor_ms: f64,
    /// The agent's own CPU per publish during the burst (its threads, not the plugins).
    agent_cpu_ms: f64,
    /// Readings of the host's mount table during the burst (`None`: the metrics endpoint
    /// could not be read).
    table_reads: Option<u64>,
    /// The plugins' CPU per publish (the agent's waited-for children).
    plugin_cpu_ms: f64,
    /// One plugin run's CPU measured by the bench (fork, exec, start).
    exec_cpu_ms: f64,
    exec_ms: f64,
    commit_ms: f64,
    rss_idle: Rss,
    rss_loaded: Rss,
    /// The agent's heap (KiB, [`Node::heap_kib`]) before the burst and after it, where
    /// `rss_idle` and `rss_loaded` are taken (`None`: not readable).
    heap: (Option<u64>, Option<u64>),
    idle_execs: Option<usize>,
}

/// Part 7's figures: a node with `n` published volumes, idle, then restarted.
struct Restart {
    n: usize,
    /// The burst that published them: last publish's end after the frame, and the CPU
    /// floor (every plugin run's CPU over the cores, plus one commit).
    burst_ms: f64,
    floor_ms: f64,
    /// The agent's CPU per publish during that burst.
    burst_agent_cpu_ms: f64,
    /// Writes of the node's record from the burst's frame to 2 s after its last publish.
    burst_record_writes: usize,
    /// RSS and heap with the `n` records and no allocation, then with `n` published.
    rss_records: Rss,
    heap_records_kib: Option<u64>,
    rss: Rss,
    heap_kib: Option<u64>,
    /// The agent's CPU while idle with `n` published, in % of one core, over `idle_s`.
    idle_cpu_pct: f64,
    idle_s: u64,
    /// Requests to the servers and plugin calls while idle.
    idle_requests: usize,
    idle_calls: usize,
    /// From SIGKILL's start of the new agent to ready (status complete, every volume
    /// published in its records, nothing waiting), wall and the new agent's own CPU.
    ready_ms: f64,
    ready_cpu_ms: f64,
    /// Requests to the servers from the start to ready, and plugin publish/unpublish calls
    /// from the kill to 5 s after ready.
    restart_requests: usize,
    restart_calls: usize,
    rss_after_restart: Rss,
}

/// Part 7 (issue 50): `n` allocations on `n` volumes in one frame (poll mode, state on
/// disk, max-parallel = cores); then the agent idle for `idle_s` seconds; then SIGKILL and
/// a new agent on the same state, until it is ready. `BENCH_PERF_CTL` frames the idle
/// window (a profile of what the agent does with `n` volumes published and nothing to do).
async fn restart(n: usize, idle_s: u64) -> Restart {
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.to_string())
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let env: &[(&str, &str)] = &[("DHV_BINDER_METRICS_ADDR", metrics.as_str())];
    let mut node = Node::start_with(WatchMode::Poll, false, n, (200, 200), cores, env).await;
    let (_, exec_cpu) = exec_costs(&node);
    let commit = commit_cost(&node);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_records = node.rss_settled().await;
    let heap_records_kib = Node::heap_kib(&metrics).await;
    let allocs: Vec<(usize, usize)> = (0..n).map(|i| (i, i)).collect();
    // `BENCH_PERF_PHASE=burst` frames the burst for the profiler instead of the idle window.
    let frame_burst = std::env::var("BENCH_PERF_PHASE").is_ok_and(|p| p == "burst");
    let cpu0 = agent_cpu_ms(node.pid());
    let req_burst = node.fake.requests().len();
    if frame_burst {
        perf_control("enable");
    }
    let t0 = node.place(&allocs, "running");
    node.wait_calls("publish", n).await;
    if frame_burst {
        perf_control("disable");
    }
    let cpu1 = agent_cpu_ms(node.pid());
    let last = node.last_end("publish").unwrap_or(t0);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The node's record written during the burst and the 2 s after it: one whole record
    // (every volume of the node) per write, a Raft write each on the servers.
    let burst_record_writes = node
        .fake
        .requests()
        .iter()
        .skip(req_burst)
        .filter(|r| r.starts_with("PUT /v1/var/dhv-binder/nodes/"))
        .count();
    let rss = node.rss_settled().await;
    let heap_kib = Node::heap_kib(&metrics).await;

    // Idle: health probes and usage readings go on; nothing else should.
    let (calls0, req0) = (node.calls().len(), node.fake.requests().len());
    let idle0 = agent_cpu_ms(node.pid()).0;
    if !frame_burst {
        perf_control("enable");
    }
    tokio::time::sleep(Duration::from_secs(idle_s)).await;
    if !frame_burst {
        perf_control("disable");
    }
    let idle1 = agent_cpu_ms(node.pid()).0;
    let (idle_calls, idle_requests) = (
        node.calls().len() - calls0,
        node.fake.requests().len() - req0,
    );

    node.kill();
    let calls_before = node.calls().len();
    let req_before = node.fake.requests().len();
    let started = Instant::now();
    node.spawn();
    let deadline = started + Duration::from_secs(120);
    loop {
        let s = inproc::status(&node.cfg).await;
        let mounts = s["mounts"].as_array().map_or(&[][..], |m| &m[..]);
        if s["view"]["complete"] == true
            && mounts.len() == n
            && mounts.iter().all(|m| m["state"] == "published")
            && s["waiting"].as_array().is_some_and(|w| w.is_empty())
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted agent never got ready: {}",
            std::fs::read_to_string(node.sb.join("agent.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let ready_ms = started.elapsed().as_secs_f64() * 1000.0;
    let ready_cpu_ms = agent_cpu_ms(node.pid()).0;
    let restart_requests = node.fake.requests().len() - req_before;
    if std::env::var_os("BENCH_TRACE").is_some() {
        let mut by: std::collections::BTreeMap<String, usize> = Default::default();
        for r in node.fake.requests().iter().skip(req_before) {
            let shape: String = r
                .split('?')
                .next()
                .unwrap_or_default()
                .split('/')
                .map(|seg| {
                    if seg.len() > 20 || seg.starts_with('v') && seg.len() == 5 {
                        "*"
                    } else {
                        seg
                    }
                })
                .collect::<Vec<_>>()
                .join("/");
            *by.entry(shape).or_default() += 1;
        }
        println!("   requests until ready, by shape: {by:?}");
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let restart_calls = node
        .calls()
        .iter()
        .skip(calls_before)
        .filter(|c| c.op == "publish" || c.op == "unpublish")
        .count();
    let rss_after_restart = node.rss_settled().await;
    Restart {
        n,
        burst_ms: ms(last.saturating_sub(t0)),
        floor_ms: n as f64 * exec_cpu / cores as f64 + commit,
        burst_agent_cpu_ms: (cpu1.0 - cpu0.0) / n as f64,
        burst_record_writes,
        rss_records,
        heap_records_kib,
        rss,
        heap_kib,
        idle_cpu_pct: (idle1 - idle0) / (idle_s as f64 * 1000.0) * 100.0,
        idle_s,
        idle_requests,
        idle_calls,
        ready_ms,
        ready_cpu_ms,
        restart_requests,
        restart_calls,
        rss_after_restart,
    }
}

/// Part 2: `n` allocations on `n` volumes in one frame; time to the last publish's end.
/// With `idle_window`, then counts the plugin execs of 10 idle seconds.
async fn burst(
    mode: WatchMode,
    tmpfs: bool,
    n: usize,
    idle_window: bool,
    max_parallel: usize,
) -> Burst {
    // The metrics endpoint on a free loopback port, for the mount table reading count.
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.to_string())
        .unwrap_or_default();
    let env: &[(&str, &str)] = if metrics.is_empty() {
        &[]
    } else {
        &[("DHV_BINDER_METRICS_ADDR", metrics.as_str())]
    };
    let mut node = Node::start_with(mode, tmpfs, n, (200, 200), max_parallel, env).await;
    let (exec, exec_cpu) = exec_costs(&node);
    let commit = commit_cost(&node);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_idle = node.rss_settled().await;
    let heap_idle = Node::heap_kib(&metrics).await;
    let allocs: Vec<(usize, usize)> = (0..n).map(|i| (i, i)).collect();
    let reads = "dhv_binder_mount_table_reads_total";
    let reads0 = Node::metric(&metrics, reads).await;
    let cpu0 = agent_cpu_ms(node.pid());
    perf_control("enable");
    let t0 = node.place(&allocs, "running");
    node.wait_calls("publish", n).await;
    let cpu1 = agent_cpu_ms(node.pid());
    perf_control("disable");
    let reads1 = Node::metric(&metrics, reads).await;
    let last = node.last_end("publish").unwrap_or(t0);
    if std::env::var_os("BENCH_TRACE").is_some() {
        let mut calls: Vec<Call> = node
            .calls()
            .into_iter()
            .filter(|c| c.op == "publish")
            .collect();
        calls.sort_by_key(|c| c.start);
        let mut line = String::new();
        for c in &calls {
            let conc = calls
                .iter()
                .filter(|d| d.start <= c.start && d.end > c.start)
                .count();
            line.push_str(&format!(
                "{:.1}/{:.2}/{} ",
                ms(c.start.saturating_sub(t0)),
                ms(c.end - c.start),
                conc
            ));
        }
        println!("   trace N={n}: {line}");
    }
    let ideal = n.div_ceil(max_parallel) as f64 * (0.2 + exec) + commit;
    // What the machine can do at best: every plugin run's CPU spread over every core.
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let floor = n as f64 * exec_cpu / cores as f64 + commit;
    // Let the agent record the publishes before reading its memory and counting.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_loaded = node.rss_settled().await;
    let heap_loaded = Node::heap_kib(&metrics).await;
    let idle_execs = if idle_window {
        let before = node.calls().len();
        tokio::time::sleep(Duration::from_secs(10)).await;
        let idle: Vec<String> = node
            .calls()
            .into_iter()
            .skip(before)
            .map(|c| format!("{} {}", c.op, c.alloc))
            .collect();
        if !idle.is_empty() {
            println!("   plugin calls while idle: {}", idle.join(", "));
        }
        Some(idle.len())
    } else {
        None
    };
    Burst {
        elapsed_ms: ms(last.saturating_sub(t0)),
        ideal_ms: ideal,
        floor_ms: floor,
        agent_cpu_ms: (cpu1.0 - cpu0.0) / n as f64,
        table_reads: reads0.zip(reads1).map(|(a, b)| b.saturating_sub(a)),
        plugin_cpu_ms: (cpu1.1 - cpu0.1) / n as f64,
        exec_cpu_ms: exec_cpu,
        exec_ms: exec,
        commit_ms: commit,
        rss_idle,
        rss_loaded,
        heap: (heap_idle, heap_loaded),
        idle_execs,
    }
}

/// Resident memory of the agent, in KiB ([`Node::rss_kib`]).
#[derive(Clone, Copy, Default)]
struct Rss {
    total: u64,
    anon: u64,
}

impl std::fmt::Display for Rss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} / {:.1}",
            self.total as f64 / 1024.0,
            self.anon as f64 / 1024.0
        )
    }
}

struct Release {
    elapsed_ms: f64,
    ideal_ms: f64,
    /// Before any allocation: 400 records, placeholders registered, nothing published.
    rss_before: Rss,
    rss_full: Rss,
    rss_after: Rss,
    /// After the terminal allocations were garbage-collected and a resync dropped them.
    rss_gc: Rss,
    /// The agent's heap (KiB) at the idle and after-GC points, from its metrics endpoint.
    heap_before: Option<u64>,
    heap_gc: Option<u64>,
}

/// Part 3: 400 volumes published, then all 400 allocations complete in one frame; the
/// unpublishes (150 ms each) against the ideal schedule.
async fn release(mode: WatchMode) -> Release {
    let n = 400;
    // The metrics endpoint on a free loopback port, for the heap figures.
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.to_string())
        .unwrap_or_default();
    // A short resync, so that the allocations garbage-collected after the teardown leave the
    // agent's view within seconds (a GC wakes neither watch mode; docs/scale.md).
    let mut node = Node::start_with(
        mode,
        false,
        n,
        (200, 150_000),
        MAX_PARALLEL,
        &[
            ("DHV_BINDER_RESYNC_INTERVAL", "2s"),
            ("DHV_BINDER_METRICS_ADDR", metrics.as_str()),
        ],
    )
    .await;
    let exec = exec_cost(&node);
    let allocs: Vec<(usize, usize)> = (0..n).map(|i| (i, i)).collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_before = node.rss_settled().await;
    let heap_before = Node::heap_kib(&metrics).await;
    node.place(&allocs, "running");
    node.wait_calls("publish", n).await;
    let rss_full = node.rss_settled().await;
    let t0 = node.place(&allocs, "complete");
    node.wait_calls("unpublish", n).await;
    let last = node.last_end("unpublish").unwrap_or(t0);
    let ideal = n.div_ceil(MAX_PARALLEL) as f64 * (150.0 + exec);
    if std::env::var_os("BENCH_TRACE").is_some() {
        // How long a plugin-call slot stays empty between one unpublish's end and the next
        // one's start (the agent's turnaround: holder scan, exec, table read).
        let mut calls: Vec<Call> = node
            .calls()
            .into_iter()
            .filter(|c| c.op == "unpublish")
            .collect();
        calls.sort_by_key(|c| c.start);
        let first = calls.first().map_or(t0, |c| c.start);
        let mut ends: Vec<u64> = Vec::new();
        let mut gaps: Vec<f64> = Vec::new();
        for c in &calls {
            if ends.len() < MAX_PARALLEL {
                ends.push(c.end);
                continue;
            }
            ends.sort();
            let freed = ends.remove(0);
            gaps.push(ms(c.start.saturating_sub(freed)));
            ends.push(c.end);
        }
        gaps.sort_by(f64::total_cmp);
        let q = |p: f64| {
            gaps.get(((gaps.len() as f64 - 1.0) * p) as usize)
                .copied()
                .unwrap_or(0.0)
        };
        println!(
            "   trace: first unpublish {:.1} ms after the frame; slot turnaround p50 {:.1} p90 {:.1} max {:.1} ms",
            ms(first.saturating_sub(t0)), q(0.5), q(0.9), q(1.0)
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rss_after = node.rss_settled().await;
    // Nomad garbage-collects the terminal allocations; the next resync drops them.
    for &(a, _) in &allocs {
        node.fake.delete_alloc(&alloc_id(a));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let rss_gc = node.rss_settled().await;
    let heap_gc = Node::heap_kib(&metrics).await;
    if let Some(secs) = std::env::var("BENCH_HOLD")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        // For a look from outside (gdb, /proc) at the agent after the teardown.
        println!(
            "   holding the agent (pid {}, {} mode) for {secs} s",
            node.pid(),
            mode_name(mode)
        );
        tokio::time::sleep(Duration::from_secs(secs)).await;
        println!(
            "   heap after the hold: {} KiB",
            Node::heap_kib(&metrics)
                .await
                .map_or("?".to_string(), |k| k.to_string())
        );
    }
    Release {
        elapsed_ms: ms(last.saturating_sub(t0)),
        ideal_ms: ideal,
        rss_before,
        rss_full,
        rss_after,
        rss_gc,
        heap_before,
        heap_gc,
    }
}

/// The system calls that make data durable.
const SYNC_CALLS: [&str; 6] = [
    "fsync",
    "fdatasync",
    "sync_file_range",
    "syncfs",
    "sync",
    "msync",
];

/// Part 5: fsync-class calls of the agent (all threads, plugin children included) while
/// `n` allocations are placed at once and published. strace stays attached until the agent
/// exits (detaching while a traced child is between vfork and exec can hang both); calls
/// are counted up to one second after the last publish was seen.
async fn fsyncs(n: usize) -> Option<(u64, Vec<String>)> {
    let mut node = Node::start(WatchMode::Stream, false, n, (200, 200)).await;
    let out = node.sb.join("strace.out");
    let mut strace = match Command::new("strace")
        .args(["-f", "-ttt", "-e"])
        .arg(format!("trace={}", SYNC_CALLS.join(",")))
        .arg("-o")
        .arg(&out)
        .arg("-p")
        .arg(node.pid().to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            println!("   strace unavailable ({e}): run scripts/install-deps");
            return None;
        }
    };
    // strace attaches asynchronously: give it a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let allocs: Vec<(usize, usize)> = (0..n).map(|i| (i, i)).collect();
    node.place(&allocs, "running");
    node.wait_calls("publish", n).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let until = now_ns() as f64 / 1e9;
    node.stop();
    let _ = strace.wait();
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let mut by_call = std::collections::BTreeMap::<&str, u64>::new();
    for l in text.lines().filter(|l| !l.contains("resumed>")) {
        let mut f = l.split_whitespace();
        let (Some(_pid), Some(t), Some(call)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let name = call.split('(').next().unwrap_or_default();
        if t.parse::<f64>().is_ok_and(|t| t <= until) {
            if let Some(k) = SYNC_CALLS.iter().find(|k| **k == name) {
                *by_call.entry(k).or_default() += 1;
            }
        }
    }
    let total = by_call.values().sum();
    Some((
        total,
        by_call.iter().map(|(k, v)| format!("{k} {v}")).collect(),
    ))
}

fn main() {
    if std::env::var_os("DHV_OPERATION").is_some() {
        plugin::main();
        return;
    }
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("benches/scale: the plugin mounts (bind mounts, a tmpfs): run as root");
        std::process::exit(1);
    }
    let samples = env_usize("BENCH_SAMPLES", 100);
    // Built before anything is timed.
    let plugin = plugin_binary();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let parts = std::env::var("BENCH_PARTS")
        .unwrap_or_else(|_| "latency,burst,release,fsync,restart".to_string());
    let part = |p: &str| parts.split(',').any(|x| x.trim() == p);
    let started = Instant::now();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "scale bench: max-parallel {MAX_PARALLEL}, {samples} latency samples; plugin {} ({:.1} MB); load average {}",
        plugin.display(),
        std::fs::metadata(plugin).map(|m| m.len()).unwrap_or(0) as f64 / 1e6,
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    // Interrupted, the bench drops the run: every node's Drop stops its agent and detaches
    // its mounts.
    rt.block_on(async {
        tokio::select! {
            _ = run(part, samples) => {}
            _ = interrupted() => println!("interrupted: nodes stopped, mounts detached"),
        }
    });
    println!("total {:.0} s", started.elapsed().as_secs_f64());
}

/// A count from the environment, else `default`.
fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn interrupted() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Every part selected, in order, printing as it goes.
async fn run(part: impl Fn(&str) -> bool, samples: usize) {
    if part("latency") {
        println!("1. allocation event -> plugin exec (ms; includes the exec):");
        for tmpfs in [false, true] {
            for mode in [WatchMode::Stream, WatchMode::Poll] {
                let l = latency(mode, tmpfs, samples, Duration::ZERO).await;
                println!(
                    "   {:<6} state on {:<5}  p50 {:>7.2}  p99 {:>7.2}  [{} split: server's answer {:.2} / {:.2}, answer -> plugin start {:.2} / {:.2}; a plugin run alone: {:.2}; agent CPU per publish + unpublish {:.2}]",
                    mode_name(mode),
                    if tmpfs { "tmpfs" } else { "disk" },
                    l.p50,
                    l.p99,
                    l.split,
                    l.server.0,
                    l.server.1,
                    l.agent.0,
                    l.agent.1,
                    l.exec,
                    l.cycle_cpu,
                );
            }
        }
        // Spaced out, as allocations come to most nodes: the machine idles between them
        // (a process started after 0.3 s or more of idle costs this VM 0.8 ms more).
        let spaced = env_usize("BENCH_IDLE_SAMPLES", 20);
        let gap = env_usize("BENCH_IDLE_MS", 500);
        for mode in [WatchMode::Stream, WatchMode::Poll] {
            let l = latency(mode, true, spaced, Duration::from_millis(gap as u64)).await;
            println!(
                "   {:<6} state on tmpfs, each after {gap} ms idle ({spaced} samples)  p50 {:>7.2}  p99 {:>7.2}  [a plugin run alone, after the same idle: {:.2}]",
                mode_name(mode),
                l.p50,
                l.p99,
                l.exec,
            );
        }
    }

    println!("2. N allocations placed at once, last publish done (0.2 ms plugin; ms):");
    let mut rss_idle = Rss::default();
    let mut rss_200 = Rss::default();
    let mut idle_execs = None;
    // The last rows run at `--max-parallel` = the machine's cores: the ideal schedule of
    // the rows before assumes 8 plugin runs at once, which two cores cannot give.
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let bursts: Vec<(bool, &[usize], usize)> = if part("burst") {
        vec![
            (false, &[1, 10, 50, 200], MAX_PARALLEL),
            (true, &[200], MAX_PARALLEL),
            (false, &[200], cores),
        ]
    } else if part("burst-cores") {
        vec![(false, &[200], cores)]
    } else {
        Vec::new()
    };
    for &(tmpfs, sizes, max_parallel) in &bursts {
        for mode in [WatchMode::Stream, WatchMode::Poll] {
            for &n in sizes {
                let last =
                    !tmpfs && mode == WatchMode::Poll && n == 200 && max_parallel == MAX_PARALLEL;
                let b = burst(mode, tmpfs, n, last, max_parallel).await;
                println!(
                        "   {:<6} {:<5} max-parallel {max_parallel} N = {n:>3}: {:>8.1}  ideal {:>7.1}  ({:>5.1}x)  CPU floor {:>6.1} ({:>4.1}x)  [exec {:.2} ms, {:.2} ms CPU; commit {:.2}] CPU/publish: agent {:.2} ms, plugin {:.2} ms; mount table reads {}; heap {} -> {} KiB",
                        mode_name(mode),
                        if tmpfs { "tmpfs" } else { "disk" },
                        b.elapsed_ms,
                        b.ideal_ms,
                        b.elapsed_ms / b.ideal_ms,
                        b.floor_ms,
                        b.elapsed_ms / b.floor_ms.max(b.ideal_ms),
                        b.exec_ms,
                        b.exec_cpu_ms,
                        b.commit_ms,
                        b.agent_cpu_ms,
                        b.plugin_cpu_ms,
                        b.table_reads.map_or("?".to_string(), |r| r.to_string()),
                        b.heap.0.map_or("?".to_string(), |h| h.to_string()),
                        b.heap.1.map_or("?".to_string(), |h| h.to_string()),
                    );
                if last {
                    rss_idle = b.rss_idle;
                    rss_200 = b.rss_loaded;
                    idle_execs = b.idle_execs;
                }
            }
        }
    }

    println!("3. 400 releases, 150 ms unpublish, state on disk:");
    let mut rss_400 = Rss::default();
    let mut rss_after = Rss::default();
    let mut rss_gc = Rss::default();
    let mut rss_before_400 = Rss::default();
    let modes: &[WatchMode] = if part("release") {
        &[WatchMode::Stream, WatchMode::Poll]
    } else {
        &[]
    };
    for &mode in modes {
        let r = release(mode).await;
        println!(
            "   {:<6} {:>8.0} ms, ideal {:>6.0} ms: {:.3}x ideal",
            mode_name(mode),
            r.elapsed_ms,
            r.ideal_ms,
            r.elapsed_ms / r.ideal_ms
        );
        let kib = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
        println!(
            "   {:<6} heap (jemalloc allocated, KiB): 400 records idle {}, after the teardown and GC {}",
            mode_name(mode),
            kib(r.heap_before),
            kib(r.heap_gc)
        );
        if mode == WatchMode::Poll {
            rss_400 = r.rss_full;
            rss_after = r.rss_after;
            rss_gc = r.rss_gc;
            rss_before_400 = r.rss_before;
        }
    }

    println!("4. agent RSS (poll mode; MiB, all / anonymous): idle {rss_idle}, 200 volumes {rss_200}; 400 records idle {rss_before_400}, 400 volumes {rss_400}, after the 400-volume teardown {rss_after}, once its terminal allocations are garbage-collected {rss_gc}");

    let n = 50;
    match if part("fsync") { fsyncs(n).await } else { None } {
            Some((total, by)) => println!(
                "5. fsync-class calls for {n} publishes at once (stream, disk): {total} ({:.1} per publish) [{}]",
                total as f64 / n as f64,
                by.join(", ")
            ),
            None => println!("5. fsync count: not measured"),
        }
    match idle_execs {
        Some(c) => println!("6. plugin execs in 10 s while idle (200 volumes published): {c}"),
        None => println!("6. idle plugin execs: not measured"),
    }
    if part("restart") {
        let n = env_usize("BENCH_RESTART_VOLUMES", 1000);
        let r = restart(n, 30).await;
        println!(
            "7. a node with {} published volumes (poll, disk, max-parallel = cores):",
            r.n
        );
        println!(
            "   burst of {} placements in one frame: {:.0} ms, CPU floor {:.0} ms ({:.1}x); agent CPU/publish {:.2} ms; {} writes of the node's record",
            r.n,
            r.burst_ms,
            r.floor_ms,
            r.burst_ms / r.floor_ms,
            r.burst_agent_cpu_ms,
            r.burst_record_writes
        );
        let kib = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
        println!(
            "   {} records, no allocation: RSS {} MiB, heap {} KiB; {} published: RSS {} MiB, heap {} KiB; idle {} s: agent CPU {:.2} % of one core, {} requests to the servers, {} plugin calls",
            r.n,
            r.rss_records,
            kib(r.heap_records_kib),
            r.n,
            r.rss,
            kib(r.heap_kib),
            r.idle_s,
            r.idle_cpu_pct,
            r.idle_requests,
            r.idle_calls
        );
        println!(
            "   SIGKILL, then start: ready in {:.0} ms wall, {:.0} ms of the agent's CPU; {} requests to the servers until ready; {} plugin publish/unpublish calls; RSS after {} MiB",
            r.ready_ms,
            r.ready_cpu_ms,
            r.restart_requests,
            r.restart_calls,
            r.rss_after_restart
        );
    }
}
