//! The docker driver against a real, private Docker engine (scripts/dockerd-private): the
//! container's mounts (alloc, local, secrets, host volumes read-write and read-only), its
//! environment (the task's only), the workload identity, logs, `kill_timeout` on stop, exit
//! codes under the restart policy, containers removed; no placement on a node without an
//! engine, and a clear failure when the engine is gone at start.

mod common;
#[path = "common/docker_engine.rs"]
mod docker_engine;
use common::Sim;
use docker_engine::{DockerEngine, IMAGE};
use serde_json::Value;
use std::time::{Duration, Instant};

fn task_state<'a>(a: &'a Value, t: &str) -> &'a str {
    a["TaskStates"][t]["State"].as_str().unwrap_or("")
}

fn events(a: &Value, t: &str) -> Vec<Value> {
    a["TaskStates"][t]["Events"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_task_runs_in_a_real_container_with_nomads_mounts_env_and_stop() {
    let engine = DockerEngine::shared();
    let tmp = tempfile::tempdir().unwrap();
    let (hv, ro) = (tmp.path().join("hv"), tmp.path().join("ro"));
    std::fs::create_dir_all(&hv).unwrap();
    std::fs::create_dir_all(&ro).unwrap();
    let sim = Sim::start_env(
        &format!(
            "client \"node-1\" {{\n  host_volume \"shared\" {{\n    path = \"{}\"\n  }}\n  host_volume \"ro\" {{\n    path = \"{}\"\n    read_only = true\n  }}\n}}\n",
            hv.display(),
            ro.display()
        ),
        &[("DOCKER_HOST", engine.host.as_str()), ("SIM_HOST_ONLY", "leak")],
    )
    .await;
    let node = sim.get(&format!("/v1/node/{}", sim.nodes[0].1)).await;
    assert_eq!(node["Drivers"]["docker"]["Healthy"], true, "{node}");
    let job = sim
        .run_job(&format!(
            r#"job "dk" {{
  group "g" {{
    volume "data" {{
      type = "host"
      source = "shared"
    }}
    volume "ro" {{
      type = "host"
      source = "ro"
      read_only = true
    }}
    task "pre" {{
      driver = "docker"
      lifecycle {{
        hook = "prestart"
        sidecar = false
      }}
      identity {{
        env = true
        file = true
      }}
      config {{
        image = "{IMAGE}"
        entrypoint = ["/bin/sh", "-c"]
        args = ["[ \"$(cat /secrets/nomad_token)\" = \"$NOMAD_TOKEN\" ] && [ -n \"$NOMAD_TOKEN\" ] && echo token-ok > /alloc/pre.txt"]
      }}
    }}
    task "main" {{
      driver = "docker"
      kill_timeout = "2s"
      volume_mount {{
        volume = "data"
        destination = "/data"
      }}
      volume_mount {{
        volume = "ro"
        destination = "/ro"
      }}
      env {{
        GREETING = "hi-${{NOMAD_ALLOC_INDEX}}"
      }}
      config {{
        image = "{IMAGE}"
        command = "/bin/sh"
        args = ["-c", "echo $NOMAD_ALLOC_DIR $NOMAD_TASK_DIR $NOMAD_SECRETS_DIR $GREETING x$SIM_HOST_ONLY > /data/out; cat /alloc/pre.txt >> /data/out; touch /ro/x 2>/dev/null && echo ro-writable >> /data/out; echo to-stdout; echo to-stderr >&2; trap '' TERM INT; while true; do sleep 0.1; done"]
      }}
    }}
  }}
}}"#
        ))
        .await;
    let a = sim
        .wait_for(60, "main running", || async {
            let a = sim.job_allocs(&job).await.first()?.clone();
            (task_state(&a, "main") == "running" && hv.join("out").exists()).then_some(a)
        })
        .await;
    let id = a["ID"].as_str().unwrap().to_string();
    let out = sim
        .wait_for(10, "the container's write", || async {
            let s = std::fs::read_to_string(hv.join("out")).ok()?;
            s.contains("token-ok").then_some(s)
        })
        .await;
    assert_eq!(out, "/alloc /local /secrets hi-0 x\ntoken-ok\n");
    assert_eq!(a["TaskStates"]["pre"]["Failed"], false, "{a}");
    let logs = sim.nodes[0].3.join("alloc").join(&id).join("alloc/logs");
    let stdout = sim
        .wait_for(10, "main's stdout", || async {
            let s = std::fs::read_to_string(logs.join("main.stdout.0")).ok()?;
            s.contains("to-stdout").then_some(s)
        })
        .await;
    assert_eq!(stdout, "to-stdout\n");
    let stderr = std::fs::read_to_string(logs.join("main.stderr.0")).unwrap();
    assert_eq!(stderr, "to-stderr\n");
    // The container as the engine sees it: Nomad's name, private propagation, read-only bind.
    let name = format!("main-{id}");
    let mounts: Value =
        serde_json::from_str(&engine.docker(&["inspect", "--format", "{{json .Mounts}}", &name]))
            .unwrap();
    let m = |dst: &str| {
        mounts
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["Destination"] == dst)
            .cloned()
            .unwrap_or_else(|| panic!("no mount at {dst}: {mounts}"))
    };
    assert_eq!(m("/data")["Propagation"], "rprivate");
    assert_eq!(m("/data")["RW"], true);
    assert_eq!(m("/ro")["RW"], false);
    for d in ["/alloc", "/local", "/secrets"] {
        assert_eq!(m(d)["RW"], true, "{d}");
    }
    // Stop: main ignores SIGTERM, so the engine kills it after kill_timeout (2s).
    let t0 = Instant::now();
    sim.req(reqwest::Method::DELETE, &format!("/v1/job/{job}"), None)
        .await;
    let a = sim
        .wait_for(30, "main dead", || async {
            let a = sim.get(&format!("/v1/allocation/{id}")).await;
            (task_state(&a, "main") == "dead").then_some(a)
        })
        .await;
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_secs(2),
        "stopped before kill_timeout: {took:?}"
    );
    let ev = events(&a, "main");
    let kinds: Vec<&str> = ev.iter().map(|e| e["Type"].as_str().unwrap()).collect();
    assert!(
        kinds.contains(&"Killing") && kinds.contains(&"Killed"),
        "{kinds:?}"
    );
    let term = ev.iter().find(|e| e["Type"] == "Terminated").unwrap();
    assert_eq!(term["ExitCode"], 137, "SIGKILLed by the engine: {term}");
    assert_eq!(engine.containers_of(&id), "", "containers left behind");
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_exit_codes_follow_the_restart_policy() {
    let engine = DockerEngine::shared();
    let sim = Sim::start_env(
        "client \"node-1\" {}\n",
        &[("DOCKER_HOST", engine.host.as_str())],
    )
    .await;
    let job = sim
        .run_job(&format!(
            r#"job "ex" {{
  group "g" {{
    restart {{
      attempts = 1
      delay = "1s"
      mode = "fail"
    }}
    task "t" {{
      driver = "docker"
      config {{
        image = "{IMAGE}"
        command = "/bin/sh"
        args = ["-c", "exit 3"]
      }}
    }}
  }}
}}"#
        ))
        .await;
    let a = sim
        .wait_for(60, "task failed", || async {
            let a = sim.job_allocs(&job).await.first()?.clone();
            (a["TaskStates"]["t"]["Failed"] == true).then_some(a)
        })
        .await;
    let ev = events(&a, "t");
    let codes: Vec<i64> = ev
        .iter()
        .filter(|e| e["Type"] == "Terminated")
        .map(|e| e["ExitCode"].as_i64().unwrap())
        .collect();
    assert_eq!(codes, [3, 3], "{ev:?}");
    assert_eq!(a["TaskStates"]["t"]["Restarts"], 1);
    assert_eq!(ev.last().unwrap()["Type"], "Not Restarting");
    assert_eq!(
        engine.containers_of(a["ID"].as_str().unwrap()),
        "",
        "containers left behind"
    );
}

/// A node whose engine does not answer has no `docker` driver (the fingerprint leaves it
/// out), and the scheduler places no docker task there (`DriverChecker`, "missing drivers"):
/// the job stays pending with no allocation, while an exec job on the same node is placed.
#[tokio::test(flavor = "multi_thread")]
async fn docker_tasks_are_not_placed_on_a_node_without_an_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let host = format!("unix://{}/no-engine.sock", tmp.path().display());
    let sim = Sim::start_env("client \"node-1\" {}\n", &[("DOCKER_HOST", host.as_str())]).await;
    let node = sim.get(&format!("/v1/node/{}", sim.nodes[0].1)).await;
    assert!(node["Drivers"]["docker"].is_null(), "undetected: {node}");
    assert!(node["Drivers"]["exec"]["Healthy"] == true, "{node}");
    let spec = |name: &str, driver: &str, config: &str| {
        format!(
            "job \"{name}\" {{\n  group \"g\" {{\n    task \"t\" {{\n      driver = \"{driver}\"\n      config {{\n{config}\n      }}\n    }}\n  }}\n}}\n"
        )
    };
    // Job registration runs the scheduler before it answers: the placement is decided.
    let docker = sim
        .run_job(&spec(
            "dk",
            "docker",
            &format!("        image = \"{IMAGE}\"\n        command = \"/bin/true\""),
        ))
        .await;
    let exec = sim
        .run_job(&spec(
            "ex",
            "exec",
            "        command = \"/bin/sleep\"\n        args = [\"600\"]",
        ))
        .await;
    assert_eq!(
        sim.job_allocs(&exec).await.len(),
        1,
        "the exec job is placed"
    );
    assert!(
        sim.job_allocs(&docker).await.is_empty(),
        "a docker task was placed on a node without the docker driver"
    );
    let job = sim.get(&format!("/v1/job/{docker}")).await;
    assert_eq!(job["Status"], "pending", "{job}");
}

/// With no engine at start, the driver fails the task with a Driver Failure that says what to
/// do (reached when the engine went away after the node was fingerprinted).
#[test]
fn docker_start_without_an_engine_says_to_start_one() {
    let tmp = tempfile::tempdir().unwrap();
    let host = format!("unix://{}/no-engine.sock", tmp.path().display());
    let msg = nomad_sim::docker_driver::check_engine(&host, IMAGE).unwrap_err();
    assert!(
        msg.contains(&host) && msg.contains("needs a running Docker engine"),
        "{msg}"
    );
}

struct Unmount(std::path::PathBuf);
impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// A mount made at the volume's path after the container started reaches it with
/// `propagation_mode = "host-to-task"` (rslave), without a restart, and not with the default
/// `private`: the running container keeps writing to what it was created with.
#[tokio::test(flavor = "multi_thread")]
async fn docker_host_to_task_sees_a_later_mount_and_private_does_not() {
    use nix::mount::{mount, MsFlags};
    let engine = DockerEngine::shared();
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("vols");
    std::fs::create_dir_all(&root).unwrap();
    // rslave needs the volume's path on a shared mount (Docker refuses it on a private one).
    mount(
        Some(&root),
        &root,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .unwrap();
    let _root = Unmount(root.clone());
    mount(
        None::<&str>,
        &root,
        None::<&str>,
        MsFlags::MS_SHARED,
        None::<&str>,
    )
    .unwrap();
    let (slave, private, storage) = (
        root.join("slave"),
        root.join("private"),
        tmp.path().join("storage"),
    );
    for d in [&slave, &private, &storage] {
        std::fs::create_dir_all(d).unwrap();
    }
    let sim = Sim::start_env(
        &format!(
            "client \"node-1\" {{\n  host_volume \"slave\" {{\n    path = \"{}\"\n  }}\n  host_volume \"private\" {{\n    path = \"{}\"\n  }}\n}}\n",
            slave.display(),
            private.display()
        ),
        &[("DOCKER_HOST", engine.host.as_str())],
    )
    .await;
    let job = sim
        .run_job(&format!(
            r#"job "prop" {{
  group "g" {{
    volume "s" {{
      type = "host"
      source = "slave"
    }}
    volume "p" {{
      type = "host"
      source = "private"
    }}
    task "t" {{
      driver = "docker"
      volume_mount {{
        volume = "s"
        destination = "/s"
        propagation_mode = "host-to-task"
      }}
      volume_mount {{
        volume = "p"
        destination = "/p"
      }}
      config {{
        image = "{IMAGE}"
        command = "/bin/sh"
        args = ["-c", "touch /alloc/up; while true; do [ -e /s/published ] && echo seen > /s/from-task; [ -e /p/published ] && echo seen > /p/from-task; sleep 0.1; done"]
      }}
    }}
  }}
}}"#
        ))
        .await;
    let a = sim
        .wait_for(60, "task running", || async {
            let a = sim.job_allocs(&job).await.first()?.clone();
            let id = a["ID"].as_str()?.to_string();
            let up = sim.nodes[0].3.join("alloc").join(&id).join("alloc/up");
            (task_state(&a, "t") == "running" && up.exists()).then_some(a)
        })
        .await;
    std::fs::write(storage.join("published"), "").unwrap();
    mount(
        Some(&storage),
        &slave,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .unwrap();
    let _s = Unmount(slave.clone());
    mount(
        Some(&storage),
        &private,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .unwrap();
    let _p = Unmount(private.clone());
    sim.wait_for(
        20,
        "the host-to-task container's write in the storage",
        || async { storage.join("from-task").exists().then_some(()) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let id = a["ID"].as_str().unwrap();
    let a = sim.get(&format!("/v1/allocation/{id}")).await;
    assert_eq!(a["TaskStates"]["t"]["Restarts"], 0, "no restart");
    // The private mount still shows the container the empty directory it was created with.
    let seen = engine.docker(&["exec", &format!("t-{id}"), "ls", "/p"]);
    assert_eq!(
        seen, "",
        "the private container sees the later mount: {seen}"
    );
    sim.req(reqwest::Method::DELETE, &format!("/v1/job/{job}"), None)
        .await;
    sim.wait_for(30, "task dead", || async {
        let a = sim.get(&format!("/v1/allocation/{id}")).await;
        (task_state(&a, "t") == "dead").then_some(())
    })
    .await;
}
