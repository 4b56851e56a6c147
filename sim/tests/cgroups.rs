//! Per-task cgroups (docs/simulator.md, "Task cgroups"): a raw_exec task runs in
//! `<cgroup_parent>/share.slice/<alloc id>.<task>.scope` with the memory limits of its
//! `resources`, and a process it starts in a session of its own (`setsid`, out of its process
//! group) dies with the task when the task stops: the whole cgroup is killed, then removed.
//! The cgroup parent is a scratch cgroup of the test's own, removed even on failure.

mod common;

use common::Sim;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `<cgroup2 mount>/nomad-sim-test-<uuid>`: killed and removed (with everything under it)
/// on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mount = info
            .lines()
            .find_map(|l| {
                let (left, right) = l.split_once(" - ")?;
                (right.split_whitespace().next()? == "cgroup2")
                    .then(|| left.split_whitespace().nth(4).map(PathBuf::from))?
            })
            .expect("no cgroup v2 filesystem is mounted (see /proc/self/mountinfo): the task cgroup tests need one, Linux 5.14 or later for cgroup.kill");
        let path = mount.join(format!("nomad-sim-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir(&path).unwrap_or_else(|e| {
            panic!(
                "cannot make the scratch cgroup {} (the tests run as root on a writable cgroup2 mount): {e}",
                path.display()
            )
        });
        Scratch(path)
    }
}

fn remove_tree(p: &Path) {
    if let Ok(d) = std::fs::read_dir(p) {
        for e in d.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(p);
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0.join("cgroup.kill"), "1");
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(self.0.join("cgroup.events"))
            .is_ok_and(|t| t.lines().any(|l| l == "populated 1"))
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        remove_tree(&self.0);
    }
}

fn alive(pid: i32) -> bool {
    // A zombie is dead too: its parent (init, after setsid's parent died) reaps it later.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .is_some_and(|r| !r.trim_start().starts_with('Z'))
    })
}

#[tokio::test]
async fn a_raw_exec_task_runs_in_its_own_cgroup_with_its_memory_limit_and_the_cgroup_dies_with_it()
{
    let scratch = Scratch::new();
    let parent = scratch.0.join("nomad.slice");
    let sim = Sim::start(&format!(
        "client \"node-1\" {{\n  cgroup_parent = \"{}\"\n}}\n",
        parent.display()
    ))
    .await;
    // `app` starts a process in a session of its own (out of the task's process group) and
    // notes its PID; `big` sets memory_max.
    let job = sim
        .run_job(
            r#"
job "cg" {
  type = "service"
  group "g" {
    task "app" {
      driver = "raw_exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "setsid sleep 600 & echo $! > $NOMAD_TASK_DIR/child; exec sleep 600"]
      }
      resources {
        memory = 64
      }
    }
    task "big" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args    = ["600"]
      }
      resources {
        memory     = 32
        memory_max = 128
      }
    }
  }
}
"#,
        )
        .await;
    let alloc = sim
        .wait_for(30, "both tasks running", || async {
            sim.job_allocs(&job).await.into_iter().find(|a| {
                a["TaskStates"]["app"]["State"] == "running"
                    && a["TaskStates"]["big"]["State"] == "running"
            })
        })
        .await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let task_dir = sim.nodes[0].3.join(format!("alloc/{alloc_id}/app/local"));
    let child: i32 = sim
        .wait_for(10, "the task's setsid child", || async {
            std::fs::read_to_string(task_dir.join("child"))
                .ok()
                .and_then(|t| t.trim().parse().ok())
        })
        .await;
    let app = parent.join(format!("share.slice/{alloc_id}.app.scope"));
    let big = parent.join(format!("share.slice/{alloc_id}.big.scope"));
    let procs = std::fs::read_to_string(app.join("cgroup.procs"))
        .unwrap_or_else(|e| panic!("the task's cgroup {}: {e}", app.display()));
    assert!(
        procs.lines().any(|l| l.trim() == child.to_string()),
        "the setsid child {child} is not in the task's cgroup: {procs:?}"
    );
    assert!(
        procs.lines().count() >= 2,
        "the task itself is not in its cgroup: {procs:?}"
    );
    assert!(
        !std::fs::read_to_string(big.join("cgroup.procs"))
            .unwrap()
            .trim()
            .is_empty(),
        "the second task is not in its cgroup"
    );

    // memory.max from `memory` (64 MiB), or from `memory_max` with `memory` as memory.low.
    let offered = std::fs::read_to_string(scratch.0.join("cgroup.controllers"))
        .unwrap()
        .split_whitespace()
        .any(|c| c == "memory");
    if offered {
        let read = |p: &Path, f: &str| std::fs::read_to_string(p.join(f)).unwrap();
        assert_eq!(read(&app, "memory.max").trim(), (64u64 << 20).to_string());
        assert_eq!(read(&big, "memory.max").trim(), (128u64 << 20).to_string());
        assert_eq!(read(&big, "memory.low").trim(), (32u64 << 20).to_string());
    } else {
        // A hybrid host keeps the memory controller on cgroup v1: the sim says the tasks
        // run without memory.max instead of pretending.
        assert!(
            sim.log().contains("without memory.max"),
            "no memory controller under {} and the sim did not say so:\n{}",
            scratch.0.display(),
            sim.log()
        );
        eprintln!(
            "this host offers no memory controller in cgroup v2 ({}/cgroup.controllers): memory.max not checked here",
            scratch.0.display()
        );
    }

    // Stop: the whole cgroup is killed (the setsid child too) and removed.
    let r = sim
        .http
        .delete(format!("{}/v1/job/{job}", sim.server))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    sim.wait_for(30, "the tasks' cgroups removed", || async {
        (!app.exists() && !big.exists()).then_some(())
    })
    .await;
    sim.wait_for(5, "the setsid child killed with the cgroup", || async {
        (!alive(child)).then_some(())
    })
    .await;
}
