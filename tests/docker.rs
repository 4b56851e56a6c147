//! Docker tasks on deferred volumes, end to end with real containers: the simulator's docker
//! driver on a private Docker engine (scripts/dockerd-private, under the test's scratch
//! directory), one dhv-binder agent, the reference `bind` and `webdav` plugins.
//!
//! One engine and one cluster for the whole binary (a single test, three stories):
//! - **fail closed, then a restart**: a container started before its volume is published
//!   (no prestart gate, default `private` propagation) finds an empty read-only directory,
//!   writes nothing to the node's disk, and gets the volume by the restart the agent asks for
//!   once the volume is published (that task only: its allocation's other task runs on);
//! - **host-to-task**: a container started before the publish with
//!   `propagation_mode = "host-to-task"` sees the volume without a restart (the agent's
//!   placeholder tree is a shared mount, so Docker accepts `rslave`);
//! - **dead FUSE server**: the `rclone mount` of a webdav volume dies; the agent publishes it
//!   again and restarts the (gated) docker allocation, whose new container writes through the
//!   new mount.

#[path = "../sim/tests/common/docker_engine.rs"]
mod docker_engine;
mod support;

use docker_engine::{DockerEngine, IMAGE};
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use support::cluster::Cluster;
use support::webdav::{mount_pids, WebdavServer};

fn task<'a>(a: &'a Value, t: &str) -> &'a Value {
    &a["TaskStates"][t]
}

/// A job of one docker task `app` mounting the deferred volume `volume` at /data with
/// `propagation`, running `script`; with `gated`, the prestart task of
/// jobspecs/example-docker.nomad.hcl (curl on the agent's socket, token on stdin) before it;
/// with `other`, a second task `other` that does not mount the volume.
fn jobspec(
    name: &str,
    volume: &str,
    propagation: &str,
    gated: bool,
    other: bool,
    script: &str,
) -> String {
    let other = if other {
        format!(
            r#"
    task "other" {{
      driver = "docker"
      kill_timeout = "1s"
      config {{
        image   = "{IMAGE}"
        command = "/bin/sleep"
        args    = ["3600"]
      }}
    }}"#
        )
    } else {
        String::new()
    };
    let gate = if gated {
        format!(
            r#"
    volume "dhv-binder" {{
      type      = "host"
      source    = "dhv-binder-socket"
      read_only = true
    }}
    task "publish-volumes" {{
      lifecycle {{
        hook    = "prestart"
        sidecar = false
      }}
      driver = "docker"
      config {{
        image      = "{IMAGE}"
        entrypoint = ["/bin/sh", "-c"]
        args = ["printf 'Authorization: Bearer %s\\n' \"$NOMAD_TOKEN\" | curl --silent --show-error --fail-with-body --max-time 60 --unix-socket /run/dhv-binder/api.sock -X POST -H @- \"http://dhv-binder/v1/allocations/$NOMAD_ALLOC_ID/publish?wait=1m\""]
      }}
      identity {{
        env = true
      }}
      volume_mount {{
        volume      = "dhv-binder"
        destination = "/run/dhv-binder"
        read_only   = true
      }}
    }}"#
        )
    } else {
        String::new()
    };
    format!(
        r#"job "{name}" {{
  type        = "service"
  datacenters = ["*"]
  group "app" {{
    restart {{
      attempts = 0
      mode     = "fail"
    }}
    volume "data" {{
      type            = "host"
      source          = "{volume}"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }}{gate}{other}
    task "app" {{
      driver       = "docker"
      kill_timeout = "1s"
      config {{
        image   = "{IMAGE}"
        command = "/bin/sh"
        args    = ["-c", {script}]
      }}
      volume_mount {{
        volume           = "data"
        destination      = "/data"
        propagation_mode = "{propagation}"
      }}
    }}
  }}
}}
"#,
        script = Value::from(script)
    )
}

async fn run(c: &Cluster, name: &str, spec: &str) -> String {
    let path = c.sb.join(&format!("{name}.nomad.hcl"));
    std::fs::write(&path, spec).unwrap();
    c.run_job(&path).await
}

/// The job's only allocation once `pred` holds for it.
async fn alloc_when(
    c: &Cluster,
    job: &str,
    secs: u64,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    c.wait_for(secs, what, || async {
        c.allocs(job).await.into_iter().find(|a| pred(a))
    })
    .await
}

fn logs(c: &Cluster, alloc: &Value) -> PathBuf {
    c.sb.join("sim")
        .join(&c.nodes[0].name)
        .join("alloc")
        .join(alloc["ID"].as_str().unwrap())
        .join("alloc/logs")
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// The node's disk under a placeholder: the guard's writable backing directory.
fn backing_is_empty(c: &Cluster, volume: &str) -> bool {
    let d = c.nodes[0]
        .state_dir
        .join("placeholders/default")
        .join(volume);
    std::fs::read_dir(&d).map(|d| d.count()).unwrap_or(0) == 0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_tasks_fail_closed_follow_host_to_task_and_restart_onto_a_republished_mount() {
    // Dropped last: the cluster stops its tasks (and their containers) first.
    let engine = DockerEngine::start();
    let c = Cluster::start_full(1, "", &[], &[("DOCKER_HOST", engine.host.as_str())]).await;
    let node = c.get(&format!("/v1/node/{}", c.nodes[0].id)).await;
    assert_eq!(node["Drivers"]["docker"]["Healthy"], true, "{node}");

    // Slow storage: every bind publish takes 3 s, so the ungated containers start first.
    let real = c.sb.join("real-plugins/bind");
    std::fs::create_dir_all(real.parent().unwrap()).unwrap();
    std::fs::copy(c.plugin_dir.join("bind"), &real).unwrap();
    let wrapper = c.plugin_dir.join("bind.tmp");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\n[ \"$1\" = publish ] && sleep 3\nexec {} \"$@\"\n",
            real.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&wrapper, c.plugin_dir.join("bind")).unwrap();
    c.create_volume("early", "single-node-writer");
    c.create_volume("live", "single-node-writer");
    let server = WebdavServer::start(&c.sb.join("webdav-root"), "dhv", "dk-pw");
    c.create_volume_with(
        "fuse",
        "single-node-writer",
        "webdav",
        &[("url", &server.url), ("user", "dhv")],
        &[("password", "dk-pw")],
        "",
    );
    c.wait_for(60, "the three placeholders ready", || async {
        let vols = c.get("/v1/volumes?type=host&namespace=*").await;
        let ready = vols
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["State"] == "ready")
            .count();
        (ready == 3).then_some(())
    })
    .await;

    // 1. Fail closed, then the agent's restart (private propagation, no gate).
    let early = run(
        &c,
        "early",
        &jobspec(
            "early",
            "early",
            "private",
            false,
            true,
            "if echo hello from $NOMAD_ALLOC_ID > /data/greetings.txt; then echo WROTE; else echo WRITE-FAILED; fi; exec sleep 3600",
        ),
    )
    .await;
    // 2. host-to-task, no gate: the running container sees the volume when it is published.
    let live = run(
        &c,
        "live",
        &jobspec(
            "live",
            "live",
            "host-to-task",
            false,
            false,
            "until echo hello from $NOMAD_ALLOC_ID > /data/greetings.txt 2>/dev/null; do [ -e /alloc/waited ] || { echo WAITING; touch /alloc/waited; }; sleep 0.1; done; echo WROTE; exec sleep 3600",
        ),
    )
    .await;

    let a = alloc_when(&c, &early, 60, "the early container running", |a| {
        task(a, "app")["State"] == "running"
    })
    .await;
    let early_logs = logs(&c, &a);
    c.wait_for(30, "the early container's first write attempt", || async {
        read(&early_logs.join("app.stdout.0"))
            .starts_with("WRITE-FAILED")
            .then_some(())
    })
    .await;
    c.wait_for(10, "EROFS in the early container's stderr", || async {
        read(&early_logs.join("app.stderr.0"))
            .contains("Read-only file system")
            .then_some(())
    })
    .await;
    assert!(
        backing_is_empty(&c, "early"),
        "the write landed on the node's disk"
    );
    let a = alloc_when(
        &c,
        &early,
        60,
        "the early container restarted by the agent onto the volume",
        |a| task(a, "app")["Restarts"] == 1 && task(a, "app")["State"] == "running",
    )
    .await;
    let early_id = a["ID"].as_str().unwrap().to_string();
    assert_eq!(
        task(&a, "other")["Restarts"],
        0,
        "the task without the volume was restarted"
    );
    let target = c.target(0, "early");
    c.wait_for(
        30,
        "the restarted container's write in the volume",
        || async {
            read(&target.join("greetings.txt"))
                .contains(early_id.as_str())
                .then_some(())
        },
    )
    .await;
    // The container's output reaches the task's log a moment after its write.
    let out = c
        .wait_for(10, "the restarted container's output", || async {
            let out = read(&early_logs.join("app.stdout.0"));
            out.contains("WROTE").then_some(out)
        })
        .await;
    assert_eq!(out, "WRITE-FAILED\nWROTE\n");
    assert!(
        backing_is_empty(&c, "early"),
        "a write landed on the node's disk"
    );
    c.wait_for(10, "the restart in the agent's log", || async {
        read(&c.nodes[0].log)
            .contains("allocation restarted onto the published volume")
            .then_some(())
    })
    .await;

    let a = alloc_when(&c, &live, 30, "the host-to-task container's write", |a| {
        task(a, "app")["State"] == "running"
    })
    .await;
    let live_logs = logs(&c, &a);
    let live_id = a["ID"].as_str().unwrap().to_string();
    let target = c.target(0, "live");
    c.wait_for(
        30,
        "the host-to-task container's write in the volume",
        || async {
            read(&target.join("greetings.txt"))
                .contains(live_id.as_str())
                .then_some(())
        },
    )
    .await;
    let out = c
        .wait_for(10, "the host-to-task container's output", || async {
            let out = read(&live_logs.join("app.stdout.0"));
            out.contains("WROTE").then_some(out)
        })
        .await;
    assert_eq!(
        out, "WAITING\nWROTE\n",
        "the container did not start before the publish"
    );
    let a = c.get(&format!("/v1/allocation/{live_id}")).await;
    assert_eq!(task(&a, "app")["Restarts"], 0, "host-to-task was restarted");
    assert!(
        backing_is_empty(&c, "live"),
        "a write landed on the node's disk"
    );
    for job in [&early, &live] {
        c.stop_job(job, false).await;
    }

    // 3. The FUSE server of a published webdav volume dies under a gated docker task.
    let fuse = run(
        &c,
        "fuse",
        &jobspec(
            "fuse",
            "fuse",
            "private",
            true,
            false,
            "echo hello from $NOMAD_ALLOC_ID >> /data/greetings.txt && exec sleep 3600",
        ),
    )
    .await;
    let a = alloc_when(&c, &fuse, 60, "the webdav container running", |a| {
        task(a, "app")["State"] == "running"
    })
    .await;
    let fuse_id = a["ID"].as_str().unwrap().to_string();
    let vid = c
        .get("/v1/var/dhv-binder/volumes/fuse?namespace=default")
        .await["Items"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let on_server = server.dir.join("default").join(vid).join("greetings.txt");
    c.wait_for(30, "the first line on the webdav server", || async {
        read(&on_server).contains(fuse_id.as_str()).then_some(())
    })
    .await;
    let target = c.target(0, "fuse");
    let pids = mount_pids(&target);
    assert_eq!(pids.len(), 1, "{pids:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    alloc_when(
        &c,
        &fuse,
        60,
        "the container restarted onto the republished mount",
        |a| task(a, "app")["Restarts"] == 1 && task(a, "app")["State"] == "running",
    )
    .await;
    c.wait_for(30, "a second line, through the new mount", || async {
        (read(&on_server).matches(fuse_id.as_str()).count() == 2).then_some(())
    })
    .await;
    c.stop_job(&fuse, false).await;
    c.wait_for(60, "unpublished after the job stopped", || async {
        (!dhv_binder::node::mounts::is_mount_point(&target)).then_some(())
    })
    .await;
    for id in [&early_id, &live_id, &fuse_id] {
        assert_eq!(engine.containers_of(id), "", "containers left behind");
    }
}
