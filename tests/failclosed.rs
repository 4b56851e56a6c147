//! Fail-closed start-up checks of the real binary (issue 12, input 5): the agent refuses to
//! run in a mount namespace that is not the host's.

use std::path::Path;
use std::process::{Command, Output};

/// Runs `dhv-binder agent` (through `prefix`, e.g. `unshare -m`) against a Nomad address
/// where nothing listens, ended by `timeout` after `seconds`.
fn agent(prefix: &[&str], dir: &Path, seconds: u32) -> Output {
    let mut args: Vec<String> = vec![seconds.to_string()];
    args.extend(prefix.iter().map(|s| s.to_string()));
    args.push(env!("CARGO_BIN_EXE_dhv-binder").into());
    args.push("agent".into());
    args.push("--allow-unsigned-records".into());
    Command::new("timeout")
        .args(&args)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--socket")
        .arg(dir.join("api.sock"))
        .arg("--plugin-dir")
        .arg(dir.join("plugins"))
        .env_clear()
        .env("NOMAD_ADDR", "http://127.0.0.1:1")
        .output()
        .expect("run the agent")
}

#[test]
fn the_agent_refuses_a_private_mount_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let out = agent(
        &["unshare", "--mount", "--propagation", "unchanged"],
        dir.path(),
        60,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("private mount namespace") && stderr.contains("raw_exec"),
        "{stderr}"
    );
    assert!(
        !dir.path().join("state").exists(),
        "the agent touched its state before the check"
    );

    // The same agent in the host's namespace passes the check and stops only at Nomad, which
    // it waits for (with a backoff) until `timeout` ends it (exit 124).
    let out = agent(&[], dir.path(), 8);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(124), "{stderr}");
    assert!(
        stderr.contains("waiting for the local Nomad agent"),
        "{stderr}"
    );
    assert!(!stderr.contains("private mount namespace"), "{stderr}");
}

// ---------------------------------------------------------------------------------------
// The real agent (in-process) against the simulator's scripted front, replaying the recorded
// allocation `orders.app[0]`, with real mounts in the test's sandbox (issue 12, inputs 2,
// 3, 4, 6 and 9).

mod support;

use nomad_sim::replay::Replay as ScriptedNomad;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;
use support::fixtures::{fixture, orders_record, shared as testdata};
use support::inproc::{agent_config, ready, start_agent, status, Running};
use support::namespace::Namespaced;
use support::sandbox::{calls, eventually, recording_plugin, script, Sandbox};

const NODE_A: &str = "3f6b2c1e-8d4a-4b7e-9c2f-5a1d7e3b9c40";
const ALLOC: &str = "5b0e8f7a-2c4d-4e19-b6a3-9d8c1f2e4a70";
const VOLUME: &str = "default/orders-data";

fn frames(pred: impl Fn(u64) -> bool) -> Vec<String> {
    testdata("nomad-fixtures", "event-stream-allocation.ndjson")
        .lines()
        .filter(|l| {
            let i = serde_json::from_str::<Value>(l)
                .ok()
                .and_then(|v| v["Index"].as_u64())
                .unwrap_or(0);
            pred(i)
        })
        .map(String::from)
        .collect()
}

/// Every log line of the in-process agents of this test binary (the audit lines too).
fn logs() -> &'static Mutex<Vec<u8>> {
    static LOGS: OnceLock<&'static Mutex<Vec<u8>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf: &'static Mutex<Vec<u8>> = Box::leak(Box::new(Mutex::new(Vec::new())));
        let _ = tracing_subscriber::fmt()
            .with_env_filter("info")
            .with_ansi(false)
            .with_writer(move || LogWriter(buf))
            .try_init();
        buf
    })
}

struct LogWriter(&'static Mutex<Vec<u8>>);

impl std::io::Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn log_lines(needle: &str) -> Vec<String> {
    String::from_utf8_lossy(&logs().lock().unwrap())
        .lines()
        .filter(|l| l.contains(needle))
        .map(String::from)
        .collect()
}

struct Replay {
    sb: Sandbox,
    nomad: ScriptedNomad,
    cfg: dhv_binder::config::AgentConfig,
    agent: Option<Running>,
    target: PathBuf,
    token: String,
}

impl Replay {
    /// The agent with `orders-data` published for the running allocation `ALLOC`.
    async fn published() -> Replay {
        Self::start(false).await
    }

    /// [`Replay::published`] with the state directory given as `<sandbox>/link/x/../state`,
    /// `link` a symlink to `<sandbox>/real`.
    async fn published_symlinked() -> Replay {
        Self::start(true).await
    }

    async fn start(symlinked: bool) -> Replay {
        logs();
        let sb = Sandbox::new();
        let nomad = ScriptedNomad::start(NODE_A, fixture("jwks.json")).await;
        for a in fixture("node-allocations.json").as_array().unwrap() {
            if a["JobID"] == "dhv-binder" {
                nomad.put_alloc(a.clone());
            }
        }
        orders_record(&nomad);
        recording_plugin(&sb.join("plugins"), "fake");
        let mut cfg = agent_config(&sb);
        let root = std::fs::canonicalize(sb.path()).unwrap();
        let real_state = if symlinked {
            std::fs::create_dir_all(root.join("real/x")).unwrap();
            std::os::unix::fs::symlink(root.join("real"), root.join("link")).unwrap();
            cfg.state_dir = sb.join("link/x/../state");
            root.join("real/state")
        } else {
            root.join("state")
        };
        let agent = start_agent(&nomad, cfg.clone());
        ready(&cfg, &nomad, 1).await;
        let target = real_state.join("mnt/default/orders-data");
        let mut full = fixture("allocation.json");
        full["ClientStatus"] = json!("pending");
        full["ModifyIndex"] = json!(1205);
        full.as_object_mut().unwrap().remove("TaskStates");
        nomad.put_alloc(full);
        for line in frames(|i| i <= 1223) {
            nomad.push(&line);
        }
        eventually(20, "published", || {
            dhv_binder::node::mounts::is_mount_point(&target)
        })
        .await;
        let token = fixture("workload-identity.json")["default_identity"]["compact"]
            .as_str()
            .unwrap()
            .to_string();
        Replay {
            sb,
            nomad,
            cfg,
            agent: Some(agent),
            target,
            token,
        }
    }

    /// The allocation's own prestart call.
    async fn prestart(&self, wait: &str) -> Result<Value, String> {
        dhv_binder::api::client::call(
            &self.cfg.socket,
            hyper::Method::POST,
            &format!("/v1/allocations/{ALLOC}/publish?wait={wait}"),
            Some(&self.token),
        )
        .await
        .map_err(|e| e.to_string())
    }

    fn plugin_calls(&self, op: &str) -> usize {
        calls(&self.sb.join("plugins"))
            .iter()
            .filter(|c| c.starts_with(op))
            .count()
    }

    /// Replaces the plugin: publish fails (and is logged), everything else as before.
    fn break_publish(&self) {
        let dir = self.sb.join("plugins");
        let _ = std::fs::rename(dir.join("fake"), dir.join("real"));
        script(
            &dir.join("fake"),
            &format!(
                "#!/bin/sh\nif [ \"$1\" = publish ]; then echo \"publish $DHV_NAMESPACE/$DHV_VOLUME_NAME failed\" >> {log}; echo '{{\"error\":\"storage unreachable\"}}'; exit 1; fi\nexec {real} \"$@\"\n",
                log = dir.join("calls.log").display(),
                real = dir.join("real").display()
            ),
        );
    }

    fn repair_publish(&self) {
        let dir = self.sb.join("plugins");
        std::fs::rename(dir.join("real"), dir.join("fake")).unwrap();
    }

    /// The volume stays published, with `task` named as its holder, its claim kept and
    /// its unpublish reported as failed; once the task is gone, it is unpublished.
    async fn held_until_released(&self, task: &mut Namespaced) {
        let pid = task.pid();
        status_until(&self.cfg, "the task named as the volume's holder", |s| {
            s["holders"][VOLUME]["holders"]
                .as_array()
                .is_some_and(|h| h.iter().any(|h| h["pid"] == pid))
        })
        .await;
        let s = status(&self.cfg).await;
        assert_eq!(s["claims"][VOLUME], "held", "{s}");
        assert!(
            s["errors"][VOLUME]
                .as_str()
                .is_some_and(|e| e.contains("still in use")),
            "{s}"
        );
        assert_eq!(
            self.plugin_calls("unpublish"),
            0,
            "unpublished under the task"
        );
        assert!(dhv_binder::node::mounts::is_mount_point(&self.target));
        task.end();
        eventually(90, "unpublished once the task is gone", || {
            self.plugin_calls("unpublish") == 1
                && !dhv_binder::node::mounts::is_mount_point(&self.target)
        })
        .await;
    }

    async fn stop(&mut self) {
        if let Some(a) = self.agent.take() {
            a.stop().await;
        }
    }
}

/// A task of the allocation: its own mount namespace with the volume bound in (as the exec
/// and docker drivers make), killed on drop.
fn task_holding(r: &Replay) -> Namespaced {
    Namespaced::holding(r.sb.path(), &r.target, &r.sb.join("task/data"))
}

/// Polls the agent's status until `f` holds (20 s at most).
async fn status_until(
    cfg: &dhv_binder::config::AgentConfig,
    what: &str,
    f: impl Fn(&Value) -> bool,
) {
    for _ in 0..200 {
        if f(&status(cfg).await) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for {what}: {}", status(cfg).await);
}

fn erofs(r: std::io::Result<()>) -> bool {
    matches!(r, Err(e) if e.raw_os_error() == Some(nix::libc::EROFS))
}

/// Input 2: the target unmounted behind the agent's back while the plugin's publish fails:
/// the prestart call is not answered 200 from the journal; a foreign tmpfs mounted on the
/// target is reported, never accepted, never published over; once it is gone and the
/// storage is back, the volume is published again and the call answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prestart_is_answered_from_the_kernel_not_the_journal() {
    let mut r = Replay::published().await;
    let ok = r.prestart("10s").await.expect("published");
    assert_eq!(ok["volumes"][0]["path"], r.target.display().to_string());

    r.break_publish();
    nix::mount::umount(&r.target).unwrap();
    let answer = r.prestart("3s").await;
    assert!(answer.is_err(), "answered {answer:?} with nothing mounted");
    eventually(20, "a republish tried (and failed)", || {
        r.plugin_calls("publish default/orders-data failed") > 0
    })
    .await;
    assert!(!dhv_binder::node::mounts::is_mount_point(&r.target));

    // A foreign tmpfs on the target: reported, not accepted, not published over.
    nix::mount::mount(
        Some("foreign"),
        &r.target,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        Some("size=1m"),
    )
    .unwrap();
    status_until(&r.cfg, "the foreign mount reported in status", |s| {
        s["foreign_mounts"][VOLUME].is_string()
    })
    .await;
    let tries = r.plugin_calls("publish");
    let answer = r.prestart("2s").await;
    let err = answer.expect_err("a foreign mount is not the volume");
    assert!(err.contains("holds tmpfs foreign"), "{err}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        r.plugin_calls("publish"),
        tries,
        "published over a foreign mount"
    );
    assert!(!log_lines("foreign mount at a volume's target").is_empty());

    // The foreign mount goes, the storage comes back: published again, answered.
    nix::mount::umount(&r.target).unwrap();
    r.repair_publish();
    let ok = r.prestart("20s").await.expect("published again");
    assert_eq!(ok["volumes"][0]["path"], r.target.display().to_string());
    assert!(dhv_binder::node::mounts::is_mount_point(&r.target));
    r.stop().await;
}

/// Input 3: a republish that fails after a restart leaves the placeholder read-only, so a
/// task restarted by Nomad (which does not re-run a finished prestart task) cannot write
/// to the node's disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_republish_leaves_no_writable_directory() {
    let mut r = Replay::published().await;
    r.stop().await;
    nix::mount::umount(&r.target).unwrap();
    r.break_publish();
    r.agent = Some(start_agent(&r.nomad, r.cfg.clone()));
    eventually(20, "the republish failed", || {
        r.plugin_calls("publish default/orders-data failed") > 0
    })
    .await;
    assert!(r.target.is_dir());
    assert!(!dhv_binder::node::mounts::is_mount_point(&r.target));
    assert!(
        erofs(std::fs::write(r.target.join("data.txt"), "lost")),
        "the placeholder is writable"
    );
    r.stop().await;
}

/// Input 4: the allocation is done, but a process in another mount namespace (a task's)
/// still has the volume mounted: no unpublish (the host's unmount would succeed and leave
/// the filesystem alive there), the claim is kept, the holder is named in status; once it
/// is gone, the volume is unpublished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_unpublished_under_a_live_process() {
    let mut r = Replay::published().await;
    let mut task = task_holding(&r);
    for line in frames(|i| i >= 1242) {
        r.nomad.push(&line);
    }
    r.held_until_released(&mut task).await;
    r.stop().await;
}

/// Input 6: a state directory reached through a symlink (and `..`): publishes succeed and
/// are checked at the real path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlinked_state_dir_publishes() {
    let mut r = Replay::published_symlinked().await;
    let ok = r.prestart("10s").await.expect("published");
    let resolved = std::fs::canonicalize(r.sb.join("real/state")).unwrap();
    assert_eq!(
        ok["volumes"][0]["path"],
        resolved
            .join("mnt/default/orders-data")
            .display()
            .to_string()
    );
    assert_eq!(r.target, resolved.join("mnt/default/orders-data"));
    let s = status(&r.cfg).await;
    assert!(s["errors"].as_object().unwrap().is_empty(), "{s}");
    r.stop().await;
}

/// Input 9: every refused socket call writes one audit line with the caller's uid and
/// pid, the allocation and the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_calls_are_audited() {
    let mut r = Replay::published().await;
    let other = "8e2a4c6d-0b1f-4a3e-9d5c-7b9e1f3a5c82";
    let err = dhv_binder::api::client::call(
        &r.cfg.socket,
        hyper::Method::POST,
        &format!("/v1/allocations/{other}/publish?wait=1s"),
        Some(&r.token),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("HTTP 403"), "{err}");
    let err = dhv_binder::api::client::call(
        &r.cfg.socket,
        hyper::Method::POST,
        &format!("/v1/allocations/{ALLOC}/publish"),
        None,
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("HTTP 401"), "{err}");
    let me = format!("caller_pid=\"{}\"", std::process::id());
    let audit: Vec<String> = log_lines("refused socket call")
        .into_iter()
        .filter(|l| l.contains("dhv_binder::audit") && l.contains(&me))
        .collect();
    let line = |alloc: &str, status: &str| {
        audit
            .iter()
            .filter(|l| l.contains(&format!("alloc_id={alloc}")) && l.contains(status))
            .count()
    };
    assert_eq!(line(other, "status=403"), 1, "{audit:#?}");
    assert_eq!(line(ALLOC, "status=401"), 1, "{audit:#?}");
    assert!(audit
        .iter()
        .all(|l| l.contains("caller_uid=\"0\"") && l.contains("reason=")));
    r.stop().await;
}

/// Input 8: after the allocation finished and its volume was unpublished, a list from an
/// older index (a stale server, a snapshot restore) still shows it running: the agent
/// does not publish the volume again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_that_goes_back_in_time_undoes_nothing() {
    let mut r = Replay::published().await;
    for line in frames(|i| i >= 1242) {
        r.nomad.push(&line);
    }
    eventually(20, "unpublished after complete", || {
        r.plugin_calls("unpublish") == 1 && !dhv_binder::node::mounts::is_mount_point(&r.target)
    })
    .await;
    let mut old = fixture("allocation.json");
    old["ClientStatus"] = json!("running");
    old["ModifyIndex"] = json!(1220);
    let mut list: Vec<Value> = fixture("node-allocations.json")
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["JobID"] == "dhv-binder")
        .cloned()
        .collect();
    list.push(old);
    r.nomad.reset(list, 1230);
    status_until(&r.cfg, "the older list applied", |s| {
        s["watch"]["counters"]["relists"] == 2 && s["view"]["index"] == 1220
    })
    .await;
    // Planning runs on every input and tick (200 ms): give it a few passes.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        r.plugin_calls("publish"),
        1,
        "published again from an older list"
    );
    assert!(!dhv_binder::node::mounts::is_mount_point(&r.target));
    r.stop().await;
}

/// Input 7: the agent is stopped, the job purged while its task still runs (it takes its
/// time to stop), the agent started again: nothing in Nomad says the allocation existed,
/// but the task's mount namespace still holds the volume, so it is not unpublished until
/// the task is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_still_waits_for_a_task_to_stop() {
    let mut r = Replay::published().await;
    let mut task = task_holding(&r);
    r.stop().await;
    r.nomad.delete_alloc(ALLOC);
    r.agent = Some(start_agent(&r.nomad, r.cfg.clone()));
    r.held_until_released(&mut task).await;
    r.stop().await;
}

/// Wraps the cluster's `bind` plugin so that its `publish` waits (up to 120 s) until the
/// ungated `task`'s first run has reported its write attempt on stdout, then runs `then`:
/// the task meets the placeholder however slowly a loaded machine starts it (a fixed delay
/// let a slow first run be restarted onto the published volume before it wrote).
fn publish_after_the_tasks_write(c: &support::cluster::Cluster, task: &str, then: &str) {
    let real = c.sb.join("real-plugins/bind");
    std::fs::create_dir_all(real.parent().unwrap()).unwrap();
    std::fs::copy(c.plugin_dir.join("bind"), &real).unwrap();
    let logs = c.sb.join("sim");
    script(
        &c.plugin_dir.join("bind"),
        &format!(
            r#"#!/bin/sh
if [ "$1" = publish ]; then
  i=0
  until cat '{logs}'/*/alloc/*/alloc/logs/{task}.stdout.0 2>/dev/null | grep -q WRITE-FAILED; do
    i=$((i+1)); [ $i -ge 1200 ] && break
    sleep 0.1
  done
  {then}
fi
exec '{real}' "$@"
"#,
            logs = logs.display(),
            real = real.display()
        ),
    );
}

/// Input 1, end to end (simulator, real daemon, exec driver, bind plugin): a job that uses
/// the deferred volume without the prestart task. Its main task starts before the volume
/// is published and finds an empty read-only directory: the write fails with EROFS instead
/// of landing on the node's disk. The agent names the job, group and task in its log and
/// status, and restarts the allocation once the volume is published: the task's second run
/// writes to the volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_without_the_prestart_task_cannot_write_to_the_node() {
    let c = support::cluster::Cluster::start(1).await;
    c.create_volume("shared-data", "single-node-writer");
    // Publishing takes a while (slow storage): the ungated task writes first.
    publish_after_the_tasks_write(&c, "app", "");
    c.wait_for(30, "the placeholder ready", || async {
        let vols = c.get("/v1/volumes?type=host&namespace=*").await;
        vols.as_array()
            .unwrap()
            .iter()
            .any(|v| v["Name"] == "shared-data" && v["State"] == "ready")
            .then_some(())
    })
    .await;
    let jobspec = c.sb.join("no-gate.nomad.hcl");
    std::fs::write(
        &jobspec,
        r#"job "no-gate" {
  type        = "service"
  datacenters = ["*"]
  group "app" {
    volume "data" {
      type            = "host"
      source          = "shared-data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }
    task "app" {
      driver = "exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "if echo hello > /data/greetings.txt; then echo WROTE; else echo WRITE-FAILED; fi; exec sleep 600"]
      }
      volume_mount {
        volume      = "data"
        destination = "/data"
      }
    }
  }
}
"#,
    )
    .unwrap();
    let job = c.run_job(&jobspec).await;
    let alloc = c
        .wait_for(60, "the task running", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| a["TaskStates"]["app"]["State"] == "running")
        })
        .await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let logs =
        c.sb.join("sim")
            .join(&c.nodes[0].name)
            .join("alloc")
            .join(&alloc_id)
            .join("alloc/logs");
    let stdout = c
        .wait_for(30, "the task's write attempt", || async {
            std::fs::read_to_string(logs.join("app.stdout.0"))
                .ok()
                .filter(|t| t.contains("WRO") || t.contains("WRITE-FAILED"))
        })
        .await;
    let stderr = std::fs::read_to_string(logs.join("app.stderr.0")).unwrap_or_default();
    eprintln!("what the task sees:\n{stdout}{stderr}");
    assert!(stdout.contains("WRITE-FAILED"), "{stdout}");
    assert!(stderr.contains("Read-only file system"), "{stderr}");
    let disk = c.nodes[0]
        .state_dir
        .join("placeholders/default/shared-data");
    assert_eq!(
        std::fs::read_dir(&disk).map(|d| d.count()).unwrap_or(0),
        0,
        "the write landed on the node's disk"
    );
    let status = c
        .wait_for(30, "the ungated task in status", || async {
            let (code, out) = c.status(0);
            let doc: Value = serde_json::from_str(&out).ok().filter(|_| code == 0)?;
            let u = doc["ungated"][alloc_id.as_str()][0].clone();
            (u["job"] == "no-gate").then_some(u)
        })
        .await;
    assert_eq!(
        (
            &status["group"],
            &status["task"],
            &status["volume"]["name"],
            &status["reason"]
        ),
        (
            &json!("app"),
            &json!("app"),
            &json!("shared-data"),
            &json!("no_gate")
        ),
        "{status}"
    );
    eprintln!("what the agent's API says (GET /v1/status, ungated): {status}");
    let readable = std::process::Command::new(env!("CARGO_BIN_EXE_dhv-binder"))
        .arg("status")
        .env_clear()
        .env("DHV_BINDER_SOCKET", &c.nodes[0].socket)
        .output()
        .expect("run dhv-binder status");
    let readable = String::from_utf8_lossy(&readable.stdout);
    let line = readable
        .lines()
        .find(|l| l.starts_with("Ungated Task"))
        .unwrap_or_else(|| panic!("no Ungated Task line in `status`:\n{readable}"));
    assert!(
        line.contains("job \"no-gate\" group \"app\" task \"app\" mounts default/shared-data"),
        "{line}"
    );
    eprintln!("what the operator sees (status):\n{readable}");
    let log = std::fs::read_to_string(&c.nodes[0].log).unwrap();
    let warn = log
        .lines()
        .find(|l| l.contains("mounts deferred volume") && l.contains("no-gate"))
        .unwrap_or_else(|| panic!("no warning in the agent's log:\n{log}"));
    eprintln!("what the operator sees (log): {warn}");
    assert!(
        warn.contains("group \\\"app\\\"") || warn.contains("group=app"),
        "{warn}"
    );
    // Once the volume is published the agent restarts the task, which binds it this time.
    let target = c.target(0, "shared-data");
    c.wait_for(30, "the restarted task's write in the volume", || async {
        std::fs::read_to_string(logs.join("app.stdout.0"))
            .ok()
            .filter(|t| t.contains("WROTE"))
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(target.join("greetings.txt")).unwrap(),
        "hello\n"
    );
    assert_eq!(
        std::fs::read_dir(&disk).map(|d| d.count()).unwrap_or(0),
        0,
        "a write landed on the node's disk"
    );
}

/// Issue 46, item 5: a batch job without the prestart task whose task tries its write and
/// exits before the (slow) publish: Nomad reports it `complete`, its write failed on the
/// read-only placeholder. The agent says so loudly: an error in its log, the task in
/// `status` (`ungated_exited`), and `volume status` lists the job among the volume's ungated
/// jobs, "ended before the publish".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_without_the_prestart_task_that_ends_before_the_publish_is_reported() {
    let c = support::cluster::Cluster::start(1).await;
    c.create_volume("shared-data", "single-node-writer");
    publish_after_the_tasks_write(&c, "report", "sleep 2; ");
    c.wait_for(30, "the placeholder ready", || async {
        let vols = c.get("/v1/volumes?type=host&namespace=*").await;
        vols.as_array()
            .unwrap()
            .iter()
            .any(|v| v["Name"] == "shared-data" && v["State"] == "ready")
            .then_some(())
    })
    .await;
    let jobspec = c.sb.join("no-gate-batch.nomad.hcl");
    std::fs::write(
        &jobspec,
        r#"job "no-gate-batch" {
  type        = "batch"
  datacenters = ["*"]
  group "app" {
    volume "data" {
      type            = "host"
      source          = "shared-data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }
    task "report" {
      driver = "exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "sleep 1; echo done > /data/report.txt || echo WRITE-FAILED; exit 0"]
      }
      volume_mount {
        volume      = "data"
        destination = "/data"
      }
    }
  }
}
"#,
    )
    .unwrap();
    let job = c.run_job(&jobspec).await;
    let alloc = c
        .wait_for(60, "the batch allocation complete", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| a["ClientStatus"] == "complete")
        })
        .await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let exited = c
        .wait_for(30, "the ended ungated task in status", || async {
            let (code, out) = c.status(0);
            let doc: Value = serde_json::from_str(&out).ok().filter(|_| code == 0)?;
            doc["ungated_exited"]
                .as_array()?
                .iter()
                .find(|e| e["alloc_id"] == alloc_id.as_str())
                .cloned()
        })
        .await;
    assert_eq!(
        (&exited["task"]["job"], &exited["task"]["task"]),
        (&json!("no-gate-batch"), &json!("report")),
        "{exited}"
    );
    let log = std::fs::read_to_string(&c.nodes[0].log).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("ended before deferred volume") && l.contains(&alloc_id))
        .unwrap_or_else(|| panic!("no error in the agent's log:\n{log}"));
    eprintln!("what the operator sees (log): {line}");
    let out = c
        .wait_for(30, "volume status naming the ungated job", || async {
            let (code, out) = c.cli(&["volume", "status", "shared-data"]);
            (code == 0 && out.contains("Ungated Jobs")).then_some(out)
        })
        .await;
    eprintln!("what the operator sees (volume status):\n{out}");
    assert!(
        out.contains("no-gate-batch/report (") && out.contains("ended before the publish"),
        "{out}"
    );
}
