//! Real tasks: exec prestart + main with a host volume (incl. a mount made after placement),
//! ClientStatus order, stop → kill → complete, workload identity JWT, raw_exec refusal.

mod common;
use common::Sim;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

struct Unmount(PathBuf);
impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

fn task_state<'a>(a: &'a Value, t: &str) -> &'a str {
    a["TaskStates"][t]["State"].as_str().unwrap_or("")
}

fn event_types(a: &Value, t: &str) -> Vec<String> {
    a["TaskStates"][t]["Events"]
        .as_array()
        .map(|e| {
            e.iter()
                .map(|x| x["Type"].as_str().unwrap().to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn b64(s: &str) -> Value {
    use base64::Engine;
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s)
        .unwrap();
    serde_json::from_slice(&raw).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_prestart_then_main_with_host_volume() {
    tokio::time::timeout(Duration::from_secs(120), async {
        let tmp = tempfile::tempdir().unwrap();
        let hv = tmp.path().join("hv");
        let storage = tmp.path().join("storage");
        std::fs::create_dir_all(&hv).unwrap();
        std::fs::create_dir_all(&storage).unwrap();
        std::fs::write(storage.join("data.txt"), "from-storage").unwrap();
        let sim = Sim::start(&format!(
            "client \"node-1\" {{\n  host_volume \"shared\" {{\n    path = \"{}\"\n  }}\n}}\n",
            hv.display()
        ))
        .await;
        let job = sim
            .run_job(
                r#"job "lc" {
  group "g" {
    volume "data" {
      type = "host"
      source = "shared"
    }
    task "pre" {
      driver = "exec"
      lifecycle {
        hook = "prestart"
        sidecar = false
      }
      identity {
        env = true
        file = true
      }
      config {
        command = "/bin/sh"
        args = ["-c", "printf %s \"$NOMAD_TOKEN\" > /alloc/pre-token; while [ ! -e /alloc/go ]; do sleep 0.1; done"]
      }
    }
    task "main" {
      driver = "exec"
      kill_timeout = "3s"
      volume_mount {
        volume = "data"
        destination = "/srv/data"
      }
      env {
        GREETING = "hi-${NOMAD_ALLOC_INDEX}"
      }
      config {
        command = "/bin/sh"
        args = ["-c", "echo $$ > /alloc/main.pid; cat /srv/data/data.txt; echo; echo $NOMAD_ALLOC_DIR $GREETING; echo token=${NOMAD_TOKEN}; trap 'echo got-int; exit 0' INT; while true; do sleep 0.1; done"]
      }
    }
  }
}"#,
            )
            .await;
        // Prestart running, main pending → ClientStatus already "running".
        let a = sim
            .wait_for(20, "prestart running", || async {
                let allocs = sim.job_allocs(&job).await;
                let a = allocs.first()?.clone();
                (task_state(&a, "pre") == "running").then_some(a)
            })
            .await;
        assert_eq!(task_state(&a, "main"), "pending");
        assert_eq!(a["ClientStatus"], "running");
        let id = a["ID"].as_str().unwrap().to_string();
        let alloc_dir = sim.nodes[0].3.join("alloc").join(&id);
        for d in ["alloc/logs", "alloc/data", "alloc/tmp", "pre/local", "pre/secrets", "pre/tmp"] {
            assert!(alloc_dir.join(d).is_dir(), "{d}");
        }
        // The host volume path becomes a mount point after placement, before main starts.
        nix::mount::mount(Some(&storage), &hv, None::<&str>, nix::mount::MsFlags::MS_BIND, None::<&str>).unwrap();
        let _guard = Unmount(hv.clone());
        // A mount of someone else's on the host when main starts: libcontainer pivots into the
        // task's root and detaches the old one, so the task's namespace must not carry it.
        let unrelated = tmp.path().join("unrelated");
        std::fs::create_dir_all(&unrelated).unwrap();
        nix::mount::mount(Some("sim-unrelated"), &unrelated, Some("tmpfs"), nix::mount::MsFlags::empty(), Some("size=1m")).unwrap();
        let _unrelated = Unmount(unrelated.clone());
        std::fs::write(alloc_dir.join("alloc/go"), "").unwrap();
        let a = sim
            .wait_for(20, "main running", || async {
                let a = sim.get(&format!("/v1/allocation/{id}")).await;
                (task_state(&a, "main") == "running").then_some(a)
            })
            .await;
        assert_eq!(task_state(&a, "pre"), "dead");
        assert_eq!(a["TaskStates"]["pre"]["Failed"], false);
        assert_eq!(event_types(&a, "pre"), ["Received", "Task Setup", "Started", "Terminated"]);
        assert!(a["TaskStates"]["main"]["FinishedAt"].is_null());
        assert!(a["Job"].is_object());
        let stdout = alloc_dir.join("alloc/logs/main.stdout.0");
        let out = sim
            .wait_for(10, "main output", || async {
                let s = std::fs::read_to_string(&stdout).ok()?;
                s.contains("/alloc").then_some(s)
            })
            .await;
        assert!(out.contains("from-storage"), "main sees the mount under the host volume: {out}");
        // The whole namespace, as `setns` sees it (a chroot hides the mounts outside it from
        // the task's own /proc/self/mountinfo, so the task cannot report this itself).
        let pid = std::fs::read_to_string(alloc_dir.join("alloc/main.pid")).unwrap();
        let ns = std::process::Command::new("nsenter")
            .args(["-t", pid.trim(), "-m", "cat", "/proc/self/mountinfo"])
            .output()
            .expect("run nsenter (util-linux)");
        assert!(ns.status.success(), "nsenter: {ns:?}");
        let task_mounts = String::from_utf8_lossy(&ns.stdout);
        assert!(task_mounts.contains(" /srv/data "), "{task_mounts}");
        assert!(
            !task_mounts.contains("sim-unrelated"),
            "the task's namespace holds a host mount that is not its own:\n{task_mounts}"
        );
        assert!(out.contains("/alloc hi-0"), "{out}");
        assert!(out.contains("token=\n"), "main has no identity env: {out}");
        // Mounts live only in the task's namespace.
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(!mountinfo.contains(&id), "task mounts leaked to the host");

        // Default identity: env == file, RS256, verifies against the JWKS, Nomad's claims.
        let tok_env = std::fs::read_to_string(alloc_dir.join("alloc/pre-token")).unwrap();
        let tok_file = std::fs::read_to_string(alloc_dir.join("pre/secrets/nomad_token")).unwrap();
        assert_eq!(tok_env, tok_file);
        verify_token(&sim, &tok_env, &id, &job).await;

        // Stop: kill signal → Killing / Terminated / Killed → complete.
        sim.req(reqwest::Method::DELETE, &format!("/v1/job/{job}"), None).await;
        let a = sim
            .wait_for(20, "complete", || async {
                let a = sim.get(&format!("/v1/allocation/{id}")).await;
                (a["ClientStatus"] == "complete").then_some(a)
            })
            .await;
        assert_eq!(a["DesiredStatus"], "stop");
        let ev = event_types(&a, "main");
        assert_eq!(&ev[ev.len() - 3..], ["Killing", "Terminated", "Killed"]);
        assert!(std::fs::read_to_string(&stdout).unwrap().contains("got-int"));
        assert!(!a["TaskStates"]["main"]["FinishedAt"].is_null());
    })
    .await
    .expect("test timed out");
}

async fn verify_token(sim: &Sim, token: &str, alloc: &str, job: &str) {
    let jwks = sim.get("/.well-known/jwks.json").await;
    let key = &jwks["keys"][0];
    assert_eq!(key["kty"], "RSA");
    assert_eq!(key["alg"], "RS256");
    let parts: Vec<&str> = token.split('.').collect();
    assert_eq!(parts.len(), 3);
    let header = b64(parts[0]);
    assert_eq!(
        header,
        json!({"alg": "RS256", "kid": key["kid"], "typ": "JWT"})
    );
    let dk = jsonwebtoken::DecodingKey::from_rsa_components(
        key["n"].as_str().unwrap(),
        key["e"].as_str().unwrap(),
    )
    .unwrap();
    let mut v = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::RS256);
    v.set_audience(&["nomadproject.io"]);
    v.required_spec_claims.clear();
    v.validate_exp = false;
    let data =
        jsonwebtoken::decode::<Value>(token, &dk, &v).expect("token verifies against the JWKS");
    let c = data.claims;
    let keys: Vec<&str> = c.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "aud",
            "iat",
            "jti",
            "nbf",
            "nomad_allocation_id",
            "nomad_job_id",
            "nomad_namespace",
            "nomad_task",
            "sub"
        ]
    );
    assert_eq!(c["aud"], "nomadproject.io");
    assert_eq!(c["nomad_allocation_id"], alloc);
    assert_eq!(c["nomad_job_id"], job);
    assert_eq!(c["nomad_namespace"], "default");
    assert_eq!(c["nomad_task"], "pre");
    assert_eq!(c["sub"], format!("global:default:{job}:g:pre:default"));
    assert!(c["iat"].as_i64().unwrap() > 1_700_000_000);
}

#[tokio::test(flavor = "multi_thread")]
async fn raw_exec_refuses_host_volume_mounts() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let tmp = tempfile::tempdir().unwrap();
        let sim = Sim::start(&format!(
            "client \"node-1\" {{\n  host_volume \"v\" {{\n    path = \"{}\"\n  }}\n}}\n",
            tmp.path().display()
        ))
        .await;
        sim.run_job(
            r#"job "rx" {
  type = "batch"
  group "g" {
    volume "v" {
      type = "host"
      source = "v"
    }
    task "t" {
      driver = "raw_exec"
      volume_mount {
        volume = "v"
        destination = "/x"
      }
      config {
        command = "/bin/true"
      }
    }
  }
}"#,
        )
        .await;
        let a = sim
            .wait_for(20, "failed", || async {
                let allocs = sim.job_allocs("rx").await;
                let a = allocs.first()?.clone();
                (a["ClientStatus"] == "failed").then_some(a)
            })
            .await;
        let evs = a["TaskStates"]["t"]["Events"].as_array().unwrap();
        let hook = evs
            .iter()
            .find(|e| e["Type"] == "Task hook failed")
            .expect("hook failure event");
        assert!(hook["DisplayMessage"]
            .as_str()
            .unwrap()
            .contains("does not support host volumes"));
        assert_eq!(a["TaskStates"]["t"]["Failed"], true);
        let _ = Path::new("/");
    })
    .await
    .expect("test timed out");
}

/// A chroot_env destination inside another (read-only) one: Nomad copies the chroot, so
/// `"/usr" = "/usr"` plus a file at `/usr/local/bin/<x>` works there, and must here too, without
/// writing into the host's `/usr`.
#[tokio::test(flavor = "multi_thread")]
async fn exec_chroot_env_nested_destination() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let tmp = tempfile::tempdir().unwrap();
        let tool = tmp.path().join("sim-nested-tool");
        std::fs::write(&tool, "#!/bin/sh\necho nested-tool-ran \"$@\"\n").unwrap();
        std::fs::set_permissions(
            &tool,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let conf_dir = tmp.path().join("conf");
        std::fs::create_dir_all(&conf_dir).unwrap();
        std::fs::write(conf_dir.join("x.conf"), "nested-dir").unwrap();
        let name = format!("nomad-sim-nested-{}", std::process::id());
        let host_file = Path::new("/usr/local/bin").join(&name);
        let host_dir = Path::new("/usr/share").join(&name);
        let mut chroot = String::new();
        for d in ["/bin", "/lib", "/lib64", "/lib32", "/sbin", "/usr", "/etc"] {
            chroot.push_str(&format!("    \"{d}\" = \"{d}\"\n"));
        }
        chroot.push_str(&format!(
            "    \"{}\" = \"{}\"\n    \"{}\" = \"{}\"\n",
            tool.display(),
            host_file.display(),
            conf_dir.display(),
            host_dir.display()
        ));
        let sim = Sim::start(&format!(
            "client \"node-1\" {{\n  chroot_env {{\n{chroot}  }}\n}}\n"
        ))
        .await;
        let job = sim
            .run_job(&format!(
                r#"job "nested" {{
  type = "batch"
  group "g" {{
    task "t" {{
      driver = "exec"
      config {{
        command = "/bin/sh"
        args = ["-c", "{} arg; cat {}/x.conf; echo; touch /usr/local/bin/ro-check 2>/dev/null && echo writable || echo read-only"]
      }}
    }}
  }}
}}"#,
                host_file.display(),
                host_dir.display()
            ))
            .await;
        let a = sim
            .wait_for(20, "task dead", || async {
                let a = sim.job_allocs(&job).await.first()?.clone();
                (task_state(&a, "t") == "dead").then_some(a)
            })
            .await;
        let id = a["ID"].as_str().unwrap();
        let logs = sim.nodes[0].3.join("alloc").join(id).join("alloc/logs");
        let out = std::fs::read_to_string(logs.join("t.stdout.0")).unwrap_or_default();
        let err = std::fs::read_to_string(logs.join("t.stderr.0")).unwrap_or_default();
        assert_eq!(
            a["ClientStatus"], "complete",
            "stdout: {out}\nstderr: {err}\n{a:#}"
        );
        assert_eq!(out, "nested-tool-ran arg\nnested-dir\nread-only\n", "stderr: {err}");
        assert!(!host_file.exists(), "{} created on the host", host_file.display());
        assert!(!host_dir.exists(), "{} created on the host", host_dir.display());
        assert!(!Path::new("/usr/local/bin/ro-check").exists());
    })
    .await
    .expect("test timed out");
}

/// A job whose main task sleeps and whose poststop task writes `<alloc dir>/poststop`
/// (after a second), with raw_exec.
const WITH_POSTSTOP: &str = r#"job "post" {
  group "g" {
    task "main" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args    = ["600"]
      }
    }
    task "cleanup" {
      lifecycle {
        hook = "poststop"
      }
      driver = "raw_exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "sleep 1; echo ran > $NOMAD_ALLOC_DIR/poststop"]
      }
    }
  }
}"#;

/// Poststop tasks run after a server-side stop (job stop, alloc stop, drain, update) and
/// after a purge: the client kills the leader, main and sidecar tasks, never the poststop
/// ones (`client/allocrunner/alloc_runner.go` `handleAllocUpdate`, `destroyImpl` →
/// `killTasks`), and the coordinator runs the poststop tasks once every other task is dead
/// (`client/allocrunner/tasklifecycle/coordinator.go` `nextStateLocked`, `isAllocDone`).
/// The allocation stays `running` while the poststop task runs, then turns `complete`.
#[tokio::test(flavor = "multi_thread")]
async fn poststop_tasks_run_after_a_server_side_stop_and_a_purge() {
    tokio::time::timeout(Duration::from_secs(90), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        for purge in [false, true] {
            let job = sim.run_job(WITH_POSTSTOP).await;
            let alloc = sim
                .wait_for(30, "the main task running", || async {
                    sim.job_allocs(&job)
                        .await
                        .into_iter()
                        .find(|a| task_state(a, "main") == "running")
                })
                .await;
            let id = alloc["ID"].as_str().unwrap().to_string();
            let marker = sim
                .path()
                .join("data/node-1/alloc")
                .join(&id)
                .join("alloc/poststop");
            sim.req(
                reqwest::Method::DELETE,
                &format!("/v1/job/{job}?purge={purge}"),
                None,
            )
            .await;
            if !purge {
                let a = sim
                    .wait_for(15, "the poststop task running", || async {
                        let a = sim.get(&format!("/v1/allocation/{id}")).await;
                        (task_state(&a, "cleanup") == "running").then_some(a)
                    })
                    .await;
                assert_eq!(task_state(&a, "main"), "dead");
                assert_eq!(a["ClientStatus"], "running", "{a}");
                let a = sim
                    .wait_for(15, "the allocation complete", || async {
                        let a = sim.get(&format!("/v1/allocation/{id}")).await;
                        (a["ClientStatus"] == "complete").then_some(a)
                    })
                    .await;
                assert_eq!(task_state(&a, "cleanup"), "dead");
                assert!(event_types(&a, "cleanup").contains(&"Started".to_string()));
            }
            sim.wait_for(15, "the poststop task's file", || async {
                std::fs::read_to_string(&marker)
                    .ok()
                    .filter(|s| s.trim() == "ran")
            })
            .await;
        }
    })
    .await
    .expect("test timed out");
}

/// A destructive update's replacement on the same node names the old allocation
/// (`PreviousAllocation`) and starts no task until the old one is client-terminal: its main
/// task ignores SIGINT and SIGTERM (killed at `kill_timeout`, 2 s) and its poststop task runs 1 s after
/// that. Meanwhile the replacement stays `pending` (`client/allocrunner/upstream_allocs_hook.go`
/// `Prerun`, `client/allocwatcher/alloc_watcher.go` `localPrevAlloc.Wait`).
#[tokio::test(flavor = "multi_thread")]
async fn a_replacement_on_the_same_node_waits_for_the_previous_allocation() {
    tokio::time::timeout(Duration::from_secs(90), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let log = sim.path().join("order.log");
        let spec = |v: u32| {
            format!(
                r#"job "prev" {{
  group "g" {{
    task "main" {{
      driver       = "raw_exec"
      kill_timeout = "2s"
      env {{
        LOG = "{log}"
        V   = "{v}"
      }}
      config {{
        command = "/bin/sh"
        args    = ["-c", "trap '' INT TERM; echo start $V >> $LOG; while true; do sleep 0.1; done"]
      }}
    }}
    task "cleanup" {{
      lifecycle {{
        hook = "poststop"
      }}
      driver = "raw_exec"
      env {{
        LOG = "{log}"
        V   = "{v}"
      }}
      config {{
        command = "/bin/sh"
        args    = ["-c", "sleep 1; echo poststop $V >> $LOG"]
      }}
    }}
  }}
}}"#,
                log = log.display()
            )
        };
        let job = sim.run_job(&spec(1)).await;
        let old = sim
            .wait_for(30, "version 1 running", || async {
                sim.job_allocs(&job)
                    .await
                    .into_iter()
                    .find(|a| task_state(a, "main") == "running")
            })
            .await;
        let old_id = old["ID"].as_str().unwrap().to_string();
        sim.run_job(&spec(2)).await;
        let new = sim
            .wait_for(15, "the replacement placed", || async {
                sim.job_allocs(&job)
                    .await
                    .into_iter()
                    .find(|a| a["ID"] != old_id.as_str())
            })
            .await;
        let new_id = new["ID"].as_str().unwrap().to_string();
        let a = sim.get(&format!("/v1/allocation/{new_id}")).await;
        assert_eq!(a["PreviousAllocation"], old_id.as_str(), "{a}");
        assert_eq!(a["NodeID"], old["NodeID"], "{a}");
        // While the old main task waits out its kill_timeout, the replacement is held.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let a = sim.get(&format!("/v1/allocation/{new_id}")).await;
        let o = sim.get(&format!("/v1/allocation/{old_id}")).await;
        assert_eq!(
            a["ClientStatus"], "pending",
            "old: {} {}\nnew: {a}",
            o["ClientStatus"], o["TaskStates"]
        );
        assert_eq!(task_state(&a, "main"), "pending", "{a}");
        assert!(
            !event_types(&a, "main").contains(&"Started".to_string()),
            "{a}"
        );
        sim.wait_for(20, "version 2 running", || async {
            let a = sim.get(&format!("/v1/allocation/{new_id}")).await;
            (task_state(&a, "main") == "running").then_some(())
        })
        .await;
        let old = sim.get(&format!("/v1/allocation/{old_id}")).await;
        assert_eq!(old["ClientStatus"], "complete", "{old}");
        let order = sim
            .wait_for(10, "version 2's start line", || async {
                std::fs::read_to_string(&log)
                    .ok()
                    .filter(|s| s.contains("start 2"))
            })
            .await;
        let lines: Vec<&str> = order.lines().collect();
        assert_eq!(lines, ["start 1", "poststop 1", "start 2"], "{order}");
    })
    .await
    .expect("test timed out");
}
