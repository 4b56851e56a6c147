//! End-to-end harness: the Nomad simulator (`nomad-sim agent`, a separate binary) with N
//! client nodes, and one real `dhv-binder agent` process per node, all inside a sandbox.
//! Every process is stopped and every mount detached on drop, even when a test panics.

#![allow(dead_code)]

use super::cgroup::ScratchCgroup;
use super::sandbox::Sandbox;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The dhv-binder binary under test.
pub fn dhv_binder_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dhv-binder"))
}

/// The binary the cluster runs (agents and CLI): `BENCH_AGENT_BIN` when set (another build, e.g. the
/// one before a change, for a bench's before/after table), else [`dhv_binder_bin`].
pub fn agent_bin() -> PathBuf {
    std::env::var_os("BENCH_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(dhv_binder_bin)
}

/// The simulator binary: built by `cargo build --workspace` next to dhv-binder.
pub fn nomad_sim_bin() -> PathBuf {
    let p = dhv_binder_bin().with_file_name("nomad-sim");
    assert!(
        p.is_file(),
        "the Nomad simulator binary {} is missing: build it first with `cargo build -p nomad-sim` (scripts/test does this)",
        p.display()
    );
    p
}

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One simulated node and its dhv-binder.
pub struct Node {
    pub name: String,
    pub id: String,
    pub address: String,
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub agent: Option<Child>,
    pub log: PathBuf,
}

/// Volume parameters (bind, ext4) that make its root directory `nobody`'s, the user the exec
/// driver runs a task as when it sets none.
pub const NOBODY_UID: (&str, &str) = ("uid", "65534");
/// See [`NOBODY_UID`].
pub const NOBODY_GID: (&str, &str) = ("gid", "65534");

/// A running cluster. Fields are dropped in order: processes first, then the sandbox.
pub struct Cluster {
    pub sim: Option<Child>,
    pub server: String,
    pub nodes: Vec<Node>,
    pub plugin_dir: PathBuf,
    pub export: PathBuf,
    pub http: reqwest::Client,
    pub agent_env: Vec<(String, String)>,
    /// The test's cgroup: node `i`'s agent runs in `node-<i>.agent` (as Nomad runs a task in
    /// its own), its plugins' helpers under `node-<i>.helpers` (`--helper-cgroup`), and the
    /// simulator runs node `i`'s tasks under `node-<i>.nomad` (its `cgroup_parent`).
    pub cgroup: ScratchCgroup,
    pub sb: Sandbox,
}

fn stop(child: &mut Child, grace: Duration) {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut a) = n.agent.take() {
                stop(&mut a, Duration::from_secs(5));
            }
        }
        if let Some(mut s) = self.sim.take() {
            stop(&mut s, Duration::from_secs(20));
        }
        self.sb.unmount_all();
        if std::thread::panicking() {
            // Leave the logs where a developer can read them.
            let keep =
                std::env::temp_dir().join(format!("dhv-binder-failed-{}", std::process::id()));
            let _ = std::fs::create_dir_all(&keep);
            for n in &self.nodes {
                let _ = std::fs::copy(&n.log, keep.join(format!("{}.agent.log", n.name)));
                // CI keeps only the test's output: its agents' last warnings go there too.
                let log = std::fs::read_to_string(&n.log).unwrap_or_default();
                let warned: Vec<&str> = log
                    .lines()
                    .filter(|l| l.contains("WARN") || l.contains("ERROR"))
                    .collect();
                let from = warned.len().saturating_sub(30);
                eprintln!(
                    "{}'s agent: its last {} warnings and errors (of {}):",
                    n.name,
                    warned.len() - from,
                    warned.len()
                );
                for l in &warned[from..] {
                    eprintln!("  {l}");
                }
            }
            let _ = std::fs::copy(self.sb.join("sim.log"), keep.join("sim.log"));
            // Task logs and states of the simulated allocations (mounts are detached now).
            let _ = Command::new("cp")
                .args(["-r", "--no-dereference"])
                .arg(self.sb.join("sim"))
                .arg(keep.join("sim"))
                .status();
            eprintln!("logs kept in {}", keep.display());
        }
    }
}

impl Cluster {
    /// Starts the simulator with `nodes` clients, then a dhv-binder per node, with the
    /// reference plugins installed in a shared plugin directory.
    pub async fn start(nodes: usize) -> Cluster {
        Self::start_with(nodes, "", &[]).await
    }

    /// Like [`Cluster::start`], with extra simulator config and extra agent environment.
    pub async fn start_with(nodes: usize, sim_extra: &str, agent_env: &[(&str, &str)]) -> Cluster {
        Self::start_full(nodes, sim_extra, agent_env, &[]).await
    }

    /// Like [`Cluster::start_with`], with extra environment for the simulator (e.g. the
    /// `DOCKER_HOST` of a private engine for its docker driver).
    pub async fn start_full(
        nodes: usize,
        sim_extra: &str,
        agent_env: &[(&str, &str)],
        sim_env: &[(&str, &str)],
    ) -> Cluster {
        let mut c = Self::start_sim(nodes, sim_extra, agent_env, sim_env).await;
        for i in 0..c.nodes.len() {
            c.start_agent(i);
        }
        c.wait_plugin("bind").await;
        c
    }

    /// The simulator with `nodes` clients and no agent started (a test runs them itself, e.g.
    /// as the system job); the sandbox has the plugins, export, keys and per-node `run/`.
    pub async fn start_sim(
        nodes: usize,
        sim_extra: &str,
        agent_env: &[(&str, &str)],
        sim_env: &[(&str, &str)],
    ) -> Cluster {
        Self::start_sim_with_meta(nodes, sim_extra, agent_env, sim_env, &[]).await
    }

    /// Like [`Cluster::start`], with client meta: `(node index, key, value)` entries in the
    /// simulator's client blocks (`client "node-<i+1>" { meta { key = "value" } }`).
    pub async fn start_with_meta(nodes: usize, meta: &[(usize, &str, &str)]) -> Cluster {
        let mut c = Self::start_sim_with_meta(nodes, "", &[], &[], meta).await;
        for i in 0..c.nodes.len() {
            c.start_agent(i);
        }
        c.wait_plugin("bind").await;
        c
    }

    /// [`Cluster::start_sim`] with client meta (see [`Cluster::start_with_meta`]).
    pub async fn start_sim_with_meta(
        nodes: usize,
        sim_extra: &str,
        agent_env: &[(&str, &str)],
        sim_env: &[(&str, &str)],
        meta: &[(usize, &str, &str)],
    ) -> Cluster {
        let sb = Sandbox::new();
        let plugin_dir = sb.join("plugins");
        std::fs::create_dir_all(&plugin_dir).unwrap();
        for entry in std::fs::read_dir(repo().join("plugins")).unwrap() {
            let e = entry.unwrap();
            let dst = plugin_dir.join(e.file_name());
            std::fs::copy(e.path(), &dst).unwrap();
        }
        let export = sb.join("export");
        std::fs::create_dir_all(&export).unwrap();
        std::fs::create_dir_all(sb.join("images")).unwrap();
        // The operator's signing key (the CLI signs records) and the nodes' trusted keys.
        let (key, text) = dhv_binder::cluster::trust::SigningKey::generate().unwrap();
        {
            use std::io::Write as _;
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(sb.join("operator.key"))
                .and_then(|mut f| f.write_all(text.as_bytes()))
                .unwrap();
        }
        std::fs::write(sb.join("record-keys.pub"), key.public_line()).unwrap();
        // Whatever the umask: the agent refuses a key file others may write.
        std::fs::set_permissions(
            sb.join("record-keys.pub"),
            std::os::unix::fs::PermissionsExt::from_mode(0o644),
        )
        .unwrap();
        let mut cfg = format!(
            "data_dir = \"{}\"\nbind_addr = \"127.0.0.1\"\nports {{\n  http = 0\n}}\nevent_heartbeat_interval = \"2s\"\n",
            sb.join("sim").display()
        );
        cfg.push_str(sim_extra);
        cfg.push('\n');
        // Nomad's default exec chroot, with /usr split so that the directory holding the
        // dhv-binder build can appear as /usr/local/bin (where jobspecs/ expects it)
        // without writing to the host's /usr.
        let chroot: String = [
            "/bin",
            "/etc",
            "/lib",
            "/lib64",
            "/sbin",
            "/usr/bin",
            "/usr/sbin",
            "/usr/lib",
            "/usr/libexec",
            "/usr/share",
        ]
        .iter()
        .filter(|p| Path::new(p).exists())
        .map(|p| format!("    \"{p}\" = \"{p}\"\n"))
        .collect();
        // The test's scratch cgroup: each node's tasks run in cgroups under
        // `node-<i>.nomad` (the simulator's `cgroup_parent`, as Nomad's `nomad.slice`).
        let cgroup = ScratchCgroup::new();
        for i in 1..=nodes {
            let run = sb.join(&format!("node-{i}/run"));
            std::fs::create_dir_all(&run).unwrap();
            let meta: String = meta
                .iter()
                .filter(|(n, _, _)| n + 1 == i)
                .map(|(_, k, v)| format!("    {k} = \"{v}\"\n"))
                .collect();
            let meta = if meta.is_empty() {
                meta
            } else {
                format!("  meta {{\n{meta}  }}\n")
            };
            cfg.push_str(&format!(
                "client \"node-{i}\" {{\n{meta}  cgroup_parent = \"{}\"\n  chroot_env = {{\n{}    \"{}\" = \"/usr/local/bin\"\n  }}\n  host_volume \"dhv-binder-socket\" {{\n    path = \"{}\"\n    read_only = true\n  }}\n}}\n",
                cgroup.path.join(format!("node-{i}.nomad")).display(),
                chroot,
                dhv_binder_bin().parent().unwrap().display(),
                run.display()
            ));
        }
        let cfg_path = sb.join("sim.hcl");
        std::fs::write(&cfg_path, cfg).unwrap();
        let sim = Command::new(nomad_sim_bin())
            .args(["agent", "-config"])
            .arg(&cfg_path)
            .envs(sim_env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(sb.join("sim.log")).unwrap())
            .spawn()
            .expect("start nomad-sim");
        let mut cluster = Cluster {
            sim: Some(sim),
            server: String::new(),
            nodes: Vec::new(),
            plugin_dir,
            export,
            // With ACLs on, the agents' NOMAD_TOKEN also authorizes the test's own reads.
            http: {
                let mut headers = reqwest::header::HeaderMap::new();
                if let Some((_, t)) = agent_env.iter().find(|(k, _)| *k == "NOMAD_TOKEN") {
                    headers.insert("X-Nomad-Token", t.parse().expect("a token header value"));
                }
                reqwest::Client::builder()
                    .default_headers(headers)
                    .build()
                    .expect("an HTTP client")
            },
            agent_env: agent_env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            cgroup,
            sb,
        };
        let ready = cluster.sb.join("sim/ready.json");
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ready.exists() {
            let exited = cluster.sim.as_mut().unwrap().try_wait().ok().flatten();
            assert!(
                Instant::now() < deadline && exited.is_none(),
                "nomad-sim did not become ready:\n{}",
                std::fs::read_to_string(cluster.sb.join("sim.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let r: Value = serde_json::from_slice(&std::fs::read(&ready).unwrap()).unwrap();
        cluster.server = r["server"]["address"].as_str().unwrap().to_string();
        for n in r["nodes"].as_array().unwrap() {
            let name = n["name"].as_str().unwrap().to_string();
            let dir = cluster.sb.join(&name);
            let node = Node {
                name,
                id: n["id"].as_str().unwrap().to_string(),
                address: n["address"].as_str().unwrap().to_string(),
                state_dir: dir.join("state"),
                socket: dir.join("run/api.sock"),
                agent: None,
                log: dir.join("agent.log"),
            };
            cluster.nodes.push(node);
        }
        cluster
    }

    /// Waits until every agent's node record reports `plugin` healthy (`volume create`
    /// refuses a plugin no live node reports, e.g. one installed a moment ago).
    pub async fn wait_plugin(&self, plugin: &str) {
        for n in &self.nodes {
            let path = format!("/v1/var/dhv-binder/nodes/{}?namespace=default", n.id);
            let what = format!("{}'s node record with plugin {plugin}", n.name);
            self.wait_for(60, &what, || async {
                let r = self
                    .http
                    .get(format!("{}{path}", self.server))
                    .send()
                    .await
                    .ok()?;
                let v: Value = r.json().await.ok()?;
                let rec: Value = serde_json::from_str(v["Items"]["record"].as_str()?).ok()?;
                (rec["plugins"][plugin]["healthy"] == true).then_some(())
            })
            .await;
        }
    }

    /// Starts (or restarts) node `i`'s dhv-binder, as the system job would run it.
    pub fn start_agent(&mut self, i: usize) {
        let name = self.nodes[i].name.clone();
        // Whose process is whose: this node's tasks run under `<name>.nomad` (the
        // simulator's `cgroup_parent`); the other nodes' tasks, agents and helpers are
        // theirs, not this node's (operator configuration, as on one host per node).
        let parent = self.cgroup.path.join(format!("{}.nomad", name));
        let others: Vec<String> = self
            .nodes
            .iter()
            .filter(|o| o.name != name)
            .flat_map(|o| {
                ["nomad", "agent", "helpers"].map(|k| {
                    let p = self.cgroup.path.join(format!("{}.{k}", o.name));
                    p.display().to_string()
                })
            })
            .collect();
        let n = &mut self.nodes[i];
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&n.log)
            .unwrap();
        let agent_cgroup = self.cgroup.child(&format!("{}.agent", n.name));
        let helpers = self.cgroup.child(&format!("{}.helpers", n.name));
        // In its own cgroup, as Nomad runs a raw_exec task (`helper run` enters it, then
        // execs the agent: same PID).
        let child = Command::new(agent_bin())
            .args(["helper", "run", "--cgroup"])
            .arg(&agent_cgroup)
            .arg("--")
            .arg(agent_bin())
            .arg("agent")
            .env_clear()
            .env("DHV_BINDER_HELPER_CGROUP", &helpers)
            .env("DHV_BINDER_NOMAD_CGROUP_PARENT", &parent)
            .env("DHV_BINDER_OTHER_NODE_CGROUPS", others.join(","))
            .env("NOMAD_ADDR", &n.address)
            .env("DHV_BINDER_STATE_DIR", &n.state_dir)
            .env("DHV_BINDER_SOCKET", &n.socket)
            .env("DHV_BINDER_PLUGIN_DIR", &self.plugin_dir)
            // The storage the tests' volumes live in (bind's export, ext4's images), as
            // `--plugin-root <plugin_id>=<dir>` settings.
            .env(
                "DHV_BINDER_PLUGIN_ROOTS",
                format!(
                    "bind={},ext4={}",
                    self.export.display(),
                    self.sb.join("images").display()
                ),
            )
            .env("DHV_BINDER_TICK", "200ms")
            .env("DHV_BINDER_HEALTH_INTERVAL", "1s")
            .env("DHV_BINDER_LOG", "info,dhv_binder=debug")
            .env("DHV_BINDER_RECORD_KEYS", self.sb.join("record-keys.pub"))
            // The record watches' safety relist (default 5 min, docs/records.md "The change
            // marker") at 1 s, as the tick and the health interval are shortened: several
            // tests plant records with plain variable writes, which do not update the change
            // marker. Tests of the marker's latency set the default back (`agent_env`).
            .env("DHV_BINDER_RECORD_RELIST", "1s")
            .envs(self.agent_env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start dhv-binder agent");
        n.agent = Some(child);
    }

    /// Node `i`'s agent's cgroup (what Nomad kills when the agent's task stops).
    pub fn agent_cgroup(&self, i: usize) -> PathBuf {
        self.cgroup
            .path
            .join(format!("{}.agent", self.nodes[i].name))
    }

    /// Node `i`'s helper cgroups' parent (`--helper-cgroup`).
    pub fn helper_cgroups(&self, i: usize) -> PathBuf {
        self.cgroup
            .path
            .join(format!("{}.helpers", self.nodes[i].name))
    }

    /// Sends `signal` to node `i`'s dhv-binder and leaves it running (SIGSTOP, SIGCONT).
    pub fn signal_agent(&self, i: usize, signal: nix::sys::signal::Signal) {
        let a = self.nodes[i].agent.as_ref().expect("the agent runs");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(a.id() as i32), signal)
            .expect("signal the agent");
    }

    /// Stops node `i`'s dhv-binder with `signal`.
    pub fn kill_agent(&mut self, i: usize, signal: nix::sys::signal::Signal) {
        if let Some(mut a) = self.nodes[i].agent.take() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(a.id() as i32), signal);
            let _ = a.wait();
        }
    }

    /// Runs the dhv-binder CLI against the server; returns (status code, stdout + stderr).
    pub fn cli(&self, args: &[&str]) -> (i32, String) {
        let out = Command::new(agent_bin())
            .args(args)
            .env_clear()
            .env("NOMAD_ADDR", &self.server)
            .env("DHV_BINDER_SIGNING_KEY", self.sb.join("operator.key"))
            .output()
            .expect("run dhv-binder");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code().unwrap_or(-1), text)
    }

    /// Creates the deferred volume `name` with the bind plugin, exporting under the sandbox,
    /// owned by `nobody` (65534) as jobspecs/volume.hcl has it: the exec driver runs tasks
    /// that set no `user` as `nobody`.
    pub fn create_volume(&self, name: &str, access_mode: &str) -> String {
        let export = self.export.display().to_string();
        self.create_volume_with(
            name,
            access_mode,
            "bind",
            &[("export", &export), NOBODY_UID, NOBODY_GID],
            &[],
            "",
        )
    }

    /// Creates the deferred volume `name` with `plugin`, `parameters`, `secrets` and any
    /// further spec lines (`extra`, e.g. `capacity_min = "64MiB"`); waits until it is ready.
    pub fn create_volume_with(
        &self,
        name: &str,
        access_mode: &str,
        plugin: &str,
        parameters: &[(&str, &str)],
        secrets: &[(&str, &str)],
        extra: &str,
    ) -> String {
        let block = |title: &str, kv: &[(&str, &str)]| {
            if kv.is_empty() {
                return String::new();
            }
            let body: String = kv
                .iter()
                .map(|(k, v)| format!("  {k} = {}\n", serde_json::Value::from(*v)))
                .collect();
            format!("{title} {{\n{body}}}\n")
        };
        let spec = self.sb.join(&format!("{name}.volume.hcl"));
        std::fs::write(
            &spec,
            format!(
                "name = \"{name}\"\ntype = \"host\"\nplugin_id = \"{plugin}\"\n{extra}\ncapability {{\n  access_mode = \"{access_mode}\"\n  attachment_mode = \"file-system\"\n}}\n{}{}",
                block("parameters", parameters),
                block("secrets", secrets),
            ),
        )
        .unwrap();
        let (code, out) = self.cli(&["volume", "create", spec.to_str().unwrap()]);
        assert_eq!(code, 0, "volume create failed: {out}");
        out
    }

    /// Node `i`'s agent's status document, read from its socket (`GET /v1/status`, the
    /// agent's API: snake_case keys, Unix-second times): (0, the document as pretty JSON),
    /// or the exit code `dhv-binder status` gives for the failure (69 when the socket
    /// cannot be reached, else 1) and the error. The CLI's `status -json` prints the same
    /// document in Nomad's casing; tests read the API's form, which the agent's other
    /// engineers extend.
    ///
    /// Blocking, for sync and async callers alike: the call runs on a thread of its own with a
    /// current-thread runtime (a runtime cannot be started on a thread that runs one).
    pub fn status(&self, i: usize) -> (i32, String) {
        let socket = self.nodes[i].socket.clone();
        let answer = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the status call")
                .block_on(async {
                    tokio::time::timeout(
                        Duration::from_secs(30),
                        dhv_binder::api::client::call(
                            &socket,
                            hyper::Method::GET,
                            "/v1/status",
                            None,
                        ),
                    )
                    .await
                })
        })
        .join()
        .expect("the status call's thread panicked");
        use dhv_binder::api::client::CallError;
        use dhv_binder::cli::{EXIT_FAILED, EXIT_UNAVAILABLE};
        match answer {
            Ok(Ok(v)) => (0, serde_json::to_string_pretty(&v).unwrap()),
            Ok(Err(e @ CallError::Connect { .. })) => (EXIT_UNAVAILABLE, e.to_string()),
            Ok(Err(e)) => (EXIT_FAILED, e.to_string()),
            Err(_) => (
                EXIT_FAILED,
                format!("GET /v1/status on node {i}'s socket: no answer in 30 s"),
            ),
        }
    }

    pub async fn get(&self, path: &str) -> Value {
        self.get_opt(path)
            .await
            .unwrap_or_else(|| panic!("GET {path}: 404 Not Found"))
    }

    /// `GET path`, or `None` on 404 (the object does not exist, e.g. garbage-collected).
    pub async fn get_opt(&self, path: &str) -> Option<Value> {
        let r = self
            .http
            .get(format!("{}{path}", self.server))
            .send()
            .await
            .unwrap();
        if r.status() == reqwest::StatusCode::NOT_FOUND {
            return None;
        }
        assert!(r.status().is_success(), "GET {path}: {}", r.status());
        Some(r.json().await.unwrap())
    }

    /// Submits a jobspec file as the nomad CLI does (parse, then register).
    pub async fn run_job(&self, jobspec: &Path) -> String {
        let hcl = std::fs::read_to_string(jobspec).unwrap();
        let r = self
            .http
            .post(format!("{}/v1/jobs/parse", self.server))
            .json(&json!({"JobHCL": hcl, "Canonicalize": true}))
            .send()
            .await
            .unwrap();
        assert!(
            r.status().is_success(),
            "parse: {}",
            r.text().await.unwrap()
        );
        let job: Value = r.json().await.unwrap();
        let id = job["ID"].as_str().unwrap().to_string();
        let r = self
            .http
            .put(format!("{}/v1/jobs", self.server))
            .json(&json!({"Job": job}))
            .send()
            .await
            .unwrap();
        assert!(
            r.status().is_success(),
            "register: {}",
            r.text().await.unwrap()
        );
        id
    }

    pub async fn stop_job(&self, id: &str, purge: bool) {
        let r = self
            .http
            .delete(format!("{}/v1/job/{id}?purge={purge}", self.server))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "stop: {}", r.status());
    }

    pub async fn allocs(&self, job: &str) -> Vec<Value> {
        self.get(&format!("/v1/job/{job}/allocations"))
            .await
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Waits up to `secs` for an allocation of `job` whose task `task` is running, and
    /// returns it; panics naming `what` after that.
    pub async fn running_alloc(&self, job: &str, task: &str, secs: u64, what: &str) -> Value {
        self.wait_for(secs, what, || async {
            self.allocs(job)
                .await
                .into_iter()
                .find(|a| a["TaskStates"][task]["State"] == "running")
        })
        .await
    }

    /// Waits until `f` returns Some, polling every 100 ms.
    pub async fn wait_for<T, F, Fut>(&self, secs: u64, what: &str, mut f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let started = Instant::now();
        let deadline = started + Duration::from_secs(secs);
        loop {
            if let Some(v) = f().await {
                eprintln!("[{:>6.2}s] {what}", started.elapsed().as_secs_f64());
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {secs}s waiting for: {what}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The placeholder mount point of `volume` on node `i`.
    pub fn target(&self, i: usize, volume: &str) -> PathBuf {
        self.nodes[i].state_dir.join("mnt/default").join(volume)
    }

    pub fn node_index(&self, node_id: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n.id == node_id)
            .expect("known node")
    }

    /// The journal history of node `i`, as (event, volume) pairs.
    pub fn journal(&self, i: usize) -> Vec<Value> {
        std::fs::read_to_string(self.nodes[i].state_dir.join("journal.log"))
            .unwrap_or_default()
            .lines()
            // A line being appended right now may be incomplete: skip it.
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Cluster {
    /// Replaces plugin `name` with a wrapper that logs every call with timestamps to
    /// `<plugin_dir>/calls.log` ("<start|end> <unix ns> <op> <node id> <volume> [rc]") and
    /// sleeps `publish_delay` seconds after a successful publish (to widen a window).
    pub fn log_plugin_calls(&self, name: &str, publish_delay: &str) {
        let real = self.sb.join("real-plugins").join(name);
        std::fs::create_dir_all(real.parent().unwrap()).unwrap();
        std::fs::copy(self.plugin_dir.join(name), &real).unwrap();
        super::sandbox::script(
            &self.plugin_dir.join(name),
            &format!(
                r#"#!/bin/sh
PATH=/usr/sbin:/usr/bin:/sbin:/bin
[ "$1" = fingerprint ] && exec {real} "$@"
log="$DHV_PLUGIN_DIR/calls.log"
echo "start $(date +%s%N) $1 $DHV_NODE_ID $DHV_VOLUME_NAME" >> "$log"
{real} "$@"
rc=$?
if [ "$1" = publish ] && [ $rc = 0 ]; then sleep {publish_delay}; fi
echo "end $(date +%s%N) $1 $DHV_NODE_ID $DHV_VOLUME_NAME $rc ${{DHV_FENCED_NODE_ID:-}}" >> "$log"
exit $rc
"#,
                real = real.display()
            ),
        );
    }

    /// The wrapper's log: (start|end, unix ns, op, node id).
    pub fn plugin_log(&self) -> Vec<(String, u128, String, String)> {
        std::fs::read_to_string(self.plugin_dir.join("calls.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                Some((
                    f.first()?.to_string(),
                    f.get(1)?.parse().ok()?,
                    f.get(2)?.to_string(),
                    f.get(3)?.to_string(),
                ))
            })
            .collect()
    }

    /// The storage-side fence calls that ended: (unix ns, op, calling node, rc, fenced node),
    /// for `fence_node` and `unfence_node`.
    pub fn node_fence_calls(&self) -> Vec<(u128, String, String, i32, String)> {
        std::fs::read_to_string(self.plugin_dir.join("calls.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.first() == Some(&"end")
                    && f.get(2).is_some_and(|op| op.ends_with("fence_node")))
                .then_some(())?;
                Some((
                    f.get(1)?.parse().ok()?,
                    f.get(2)?.to_string(),
                    f.get(3)?.to_string(),
                    f.get(5)?.parse().ok()?,
                    f.get(6)?.to_string(),
                ))
            })
            .collect()
    }

    /// Per node, the intervals during which the volume could be mounted there:
    /// from the start of a publish to the end of the following unpublish (open = now).
    pub fn published_intervals(&self) -> Vec<(String, u128, u128)> {
        let mut open: std::collections::BTreeMap<String, u128> = Default::default();
        let mut out = Vec::new();
        for (phase, t, op, node) in self.plugin_log() {
            match (phase.as_str(), op.as_str()) {
                ("start", "publish") => {
                    open.entry(node).or_insert(t);
                }
                ("end", "unpublish") => {
                    if let Some(s) = open.remove(&node) {
                        out.push((node, s, t));
                    }
                }
                _ => {}
            }
        }
        for (node, s) in open {
            out.push((node, s, u128::MAX));
        }
        out
    }

    /// PUT with a JSON body against the server.
    pub async fn put(&self, path: &str, body: Value) -> Value {
        let r = self
            .http
            .put(format!("{}{path}", self.server))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "PUT {path}: {}", r.status());
        r.json().await.unwrap_or(Value::Null)
    }
}

/// How many mounts stand on `target` (stacked mounts count separately).
pub fn mount_count(target: &Path) -> usize {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split(' ').nth(4).is_some_and(|p| Path::new(p) == target))
        .count()
}
