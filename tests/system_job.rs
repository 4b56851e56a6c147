//! The deployed shape, end to end: the repository's own system job
//! (jobspecs/dhv-binder.nomad.hcl, only its variables and host paths changed) submitted to
//! the simulator as `nomad job run -var` does, its artifact (the freshly built binary and the
//! reference plugins, packed as a release) served over loopback HTTP and checked against its
//! real SHA-256; the agent runs as the raw_exec task on every node, talking to Nomad through
//! its Task API socket with its workload identity; then the example exec job
//! (jobspecs/example.nomad.hcl) gets its deferred volume published on its node only. Every
//! simulated task runs in its own cgroup under the test's scratch cgroup, as Nomad runs it.
//! The second test upgrades the system job while an ext4 and a webdav volume are written,
//! then kills the new agent's cgroup outright.

mod support;

use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use support::cgroup::ScratchCgroup;
use support::cluster::{dhv_binder_bin, repo, Cluster};
use support::webdav::{mount_pids, WebdavServer};

/// Packs the release archive the jobspec's artifact expects: `dhv-binder/dhv-binder` and
/// `dhv-binder/plugins/*` in a tar.gz (as `scripts/release` lays it out); returns its path
/// and SHA-256 (hex).
fn pack_release(dir: &Path, name: &str) -> (PathBuf, String) {
    let root = dir.join(format!("{name}.d"));
    let top = root.join("dhv-binder");
    std::fs::create_dir_all(top.join("plugins")).unwrap();
    // The release's name in it: each archive (and its checksum) differs from the others.
    std::fs::write(top.join("RELEASE"), name).unwrap();
    std::fs::copy(dhv_binder_bin(), top.join("dhv-binder")).unwrap();
    for e in std::fs::read_dir(repo().join("plugins")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), top.join("plugins").join(e.file_name())).unwrap();
    }
    let archive = dir.join(name);
    let st = Command::new("tar")
        // gzip's fastest level: the debug binary is tens of MB (a .tar.gz all the same).
        .args(["-I", "gzip -1", "-cf"])
        .arg(&archive)
        .arg("-C")
        .arg(&root)
        .arg("dhv-binder")
        .status()
        .expect("run tar (needs tar and gzip)");
    assert!(st.success(), "tar failed");
    std::fs::remove_dir_all(&root).unwrap();
    let out = Command::new("sha256sum")
        .arg(&archive)
        .output()
        .expect("run sha256sum (coreutils)");
    let text = String::from_utf8(out.stdout).unwrap();
    let sum = text.split_whitespace().next().unwrap().to_string();
    assert_eq!(sum.len(), 64, "sha256sum: {text}");
    (archive, sum)
}

/// Serves the files of `dir` over HTTP/1.0 on a loopback port, one thread, until the test
/// process ends; returns the base URL.
fn serve(dir: PathBuf) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match conn.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let req = String::from_utf8_lossy(&req);
            let path = req.split_whitespace().nth(1).unwrap_or("/");
            let file = dir.join(path.trim_start_matches('/'));
            let _ = match std::fs::read(&file) {
                Ok(body) => conn
                    .write_all(
                        format!(
                            "HTTP/1.0 200 OK\r\nContent-Type: application/gzip\r\nContent-Length: {}\r\n\r\n",
                            body.len()
                        )
                        .as_bytes(),
                    )
                    .and_then(|_| conn.write_all(&body)),
                Err(_) => conn.write_all(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n"),
            };
        }
    });
    url
}

/// The repository's system job with only host paths (and its static metrics port) changed:
/// every simulated node runs on this one host, so each node's state, socket and helper cgroups live under the sandbox at
/// `<sandbox>/<node name>/...` (`${node.unique.name}`, interpolated by the client).
fn system_job(c: &Cluster) -> String {
    let job = std::fs::read_to_string(repo().join("jobspecs/dhv-binder.nomad.hcl")).unwrap();
    let sb = c.sb.path().display().to_string();
    let helpers = c.cgroup.child("node-1.helpers");
    let _ = c.cgroup.child("node-2.helpers");
    let helpers = helpers
        .display()
        .to_string()
        .replace("node-1.helpers", "${node.unique.name}.helpers");
    let replaced = [
        (
            "\"/var/lib/dhv-binder/socket/api.sock\"",
            format!("\"{sb}/${{node.unique.name}}/run/api.sock\""),
        ),
        (
            "\"/var/lib/dhv-binder\"",
            format!("\"{sb}/${{node.unique.name}}/state\""),
        ),
        (
            "bind=/srv/dhv-exports",
            format!(
                "bind={},ext4={}",
                c.export.display(),
                c.sb.join("images").display()
            ),
        ),
        (
            "\"/etc/dhv-binder/record-keys.pub\"",
            format!("\"{}\"", c.sb.join("record-keys.pub").display()),
        ),
        // The metrics port is the host's too: the simulated nodes share this host (and other
        // tests may run beside this one), so it becomes a dynamic port, one per allocation.
        ("static = 9464", String::new()),
        (
            "DHV_BINDER_HELPER_CGROUP = \"auto\"",
            format!("DHV_BINDER_HELPER_CGROUP = \"{helpers}\""),
        ),
    ];
    let mut job = job;
    for (from, to) in replaced {
        assert!(job.contains(from), "the system job no longer has {from}");
        job = job.replace(from, &to);
    }
    job
}

/// Parses `hcl` with `-var` values (`POST /v1/jobs/parse` with `Variables`, as `nomad job
/// run -var` sends them) and registers it; returns the job ID.
async fn run_with_vars(c: &Cluster, hcl: &str, vars: &str) -> String {
    let r = c
        .http
        .post(format!("{}/v1/jobs/parse", c.server))
        .json(&json!({"JobHCL": hcl, "Variables": vars, "Canonicalize": true}))
        .send()
        .await
        .unwrap();
    assert!(
        r.status().is_success(),
        "parse: {}",
        r.text().await.unwrap()
    );
    let job: Value = r.json().await.unwrap();
    let r = c
        .http
        .put(format!("{}/v1/jobs", c.server))
        .json(&json!({"Job": job}))
        .send()
        .await
        .unwrap();
    assert!(
        r.status().is_success(),
        "register: {}",
        r.text().await.unwrap()
    );
    job["ID"].as_str().unwrap().to_string()
}

/// The example job, named `name` and using volume `volume`, with a main task that appends a
/// numbered, timestamped line to `/data/log` every 50 ms, opening the file each time (each
/// write goes through the mount), and reports every failed write on stderr.
fn writer_job(dir: &Path, name: &str, volume: &str) -> PathBuf {
    support::jobs::line_writer_example(dir, &format!("{name}.nomad.hcl"), name, volume)
}

/// The numbered lines of the writer's log, in order, with their times (ns).
fn lines(text: &str) -> Vec<(u64, u128)> {
    support::jobs::log_lines(text)
}

fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_repositorys_system_job_runs_the_agent_and_serves_the_example_job() {
    let c = Cluster::start_sim(2, "", &[], &[]).await;
    let releases = c.sb.join("releases");
    std::fs::create_dir_all(&releases).unwrap();
    let (_, sum) = pack_release(&releases, "dhv-binder_test_linux_amd64.tar.gz");
    let url = format!("{}/dhv-binder_test_linux_amd64.tar.gz", serve(releases));
    let vars = format!("release_url = \"{url}\"\nrelease_sha256 = \"{sum}\"\n");
    let system = run_with_vars(&c, &system_job(&c), &vars).await;
    assert_eq!(system, "dhv-binder");

    // One allocation per node, its agent task running, the agent's node record healthy.
    let allocs = c
        .wait_for(
            60,
            "the system job's agent running on every node",
            || async {
                let a = c.allocs(&system).await;
                let running: Vec<Value> = a
                    .into_iter()
                    .filter(|a| a["TaskStates"]["agent"]["State"] == "running")
                    .collect();
                (running.len() == c.nodes.len()).then_some(running)
            },
        )
        .await;
    let mut on: Vec<&str> = allocs
        .iter()
        .map(|a| a["NodeID"].as_str().unwrap())
        .collect();
    on.sort();
    let mut nodes: Vec<&str> = c.nodes.iter().map(|n| n.id.as_str()).collect();
    nodes.sort();
    assert_eq!(on, nodes, "not one agent per node");
    c.wait_plugin("bind").await;
    // Each agent serves its metrics at its allocation's port (NOMAD_PORT_metrics).
    for a in &allocs {
        let a = c
            .get(&format!("/v1/allocation/{}", a["ID"].as_str().unwrap()))
            .await;
        let ports = &a["AllocatedResources"]["Shared"]["Ports"];
        assert_eq!(ports[0]["Label"], "metrics", "{ports}");
        let url = format!("http://127.0.0.1:{}/metrics", ports[0]["Value"]);
        let text = reqwest::get(&url).await.unwrap().text().await.unwrap();
        assert!(text.contains("dhv_binder"), "{url}: {text}");
    }

    // The deferred volume and the example job.
    let out = c.create_volume("shared-data", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    let job = c.run_job(&repo().join("jobspecs/example.nomad.hcl")).await;
    let alloc = c
        .wait_for(60, "the example's main task running", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| a["TaskStates"]["app"]["State"] == "running")
        })
        .await;
    let i = c.node_index(alloc["NodeID"].as_str().unwrap());
    let alloc_id = alloc["ID"].as_str().unwrap();
    let greetings = c.target(i, "shared-data").join("greetings.txt");
    let text = c
        .wait_for(20, "the task's write in the volume", || async {
            std::fs::read_to_string(&greetings)
                .ok()
                .filter(|t| t.contains(&format!("written by allocation {alloc_id}")))
        })
        .await;
    assert!(text.ends_with('\n'), "{text}");
    assert_eq!(
        support::cluster::mount_count(&c.target(i, "shared-data")),
        1
    );
    let other = 1 - i;
    assert_eq!(
        support::cluster::mount_count(&c.target(other, "shared-data")),
        0,
        "the volume is mounted on the other node too"
    );

    // Stop the example: the volume is unpublished.
    c.stop_job(&job, false).await;
    c.wait_for(60, "the unpublish done in the journal", || async {
        c.journal(i)
            .last()
            .filter(|e| e["event"] == "unpublish-done")
            .map(|_| ())
    })
    .await;

    c.stop_job(&system, false).await;
    c.wait_for(60, "the agents stopped", || async {
        c.allocs(&system)
            .await
            .iter()
            .all(|a| a["ClientStatus"] == "complete" || a["ClientStatus"] == "failed")
            .then_some(())
    })
    .await;
}

/// The written lines of a writer job's log on `volume` (read through its mount on node 0).
fn written(c: &Cluster, volume: &str) -> Vec<(u64, u128)> {
    lines(&std::fs::read_to_string(c.target(0, volume).join("log")).unwrap_or_default())
}

/// Lines `1..=n` each once, in order.
fn contiguous(l: &[(u64, u128)]) -> bool {
    l.iter().enumerate().all(|(k, (n, _))| *n == k as u64 + 1)
}

/// The longest gap between two consecutive writes, in ms.
fn longest_gap_ms(l: &[(u64, u128)]) -> u128 {
    l.windows(2)
        .map(|w| w[1].1.saturating_sub(w[0].1))
        .max()
        .unwrap_or(0)
        / 1_000_000
}

/// The lines written in `[from, to)` that are in `stored`: how many, their bytes, and the
/// longest gap (ms) between two writes that ends in the window.
fn written_between(stored: &[(u64, u128)], from: u128, to: u128) -> (usize, usize, u128) {
    let during: Vec<_> = stored
        .iter()
        .filter(|(_, t)| *t >= from && *t < to)
        .collect();
    let gap = stored
        .windows(2)
        .filter(|w| w[1].1 >= from && w[1].1 < to)
        .map(|w| w[1].1.saturating_sub(w[0].1))
        .max()
        .unwrap_or(0);
    (
        during.len(),
        during
            .iter()
            .map(|(n, t)| format!("line {n} {t}\n").len())
            .sum(),
        gap / 1_000_000,
    )
}

/// An upgrade as operators run it, with an ext4 and a webdav (rclone FUSE) volume in use by
/// writing tasks: the repository's system job updated to a new release replaces the agent
/// (its task cgroup killed by the simulator, as Nomad kills it); both volumes stay mounted
/// under their tasks, nothing is published again, every write lands. Then the new agent's
/// cgroup is killed outright (a crash, an OOM kill): the FUSE server lives in the volume's
/// helper cgroup and keeps serving; the restarted agent adopts it. One node: the rolling pace
/// of several nodes is `nodes::a_system_job_update_goes_node_by_node_under_max_parallel_and_stagger`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_and_a_killed_agent_cgroup_keep_ext4_and_webdav_volumes_mounted_and_lose_nothing(
) {
    let c = Cluster::start_sim(1, "", &[], &[]).await;
    let server = WebdavServer::start(&c.sb.join("webdav-root"), "dhv", "upgrade-pw");
    let releases = c.sb.join("releases");
    std::fs::create_dir_all(&releases).unwrap();
    let (_, sum) = pack_release(&releases, "dhv-binder_v1_linux_amd64.tar.gz");
    let base = serve(releases.clone());
    let vars = |name: &str, sum: &str| {
        format!("release_url = \"{base}/{name}\"\nrelease_sha256 = \"{sum}\"\n")
    };
    let system = run_with_vars(
        &c,
        &system_job(&c),
        &vars("dhv-binder_v1_linux_amd64.tar.gz", &sum),
    )
    .await;
    c.wait_for(60, "the agent running", || async {
        c.allocs(&system)
            .await
            .into_iter()
            .find(|a| a["TaskStates"]["agent"]["State"] == "running")
    })
    .await;
    c.wait_plugin("ext4").await;
    c.wait_plugin("webdav").await;

    let images = c.sb.join("images");
    let out = c.create_volume_with(
        "ext4-data",
        "single-node-writer",
        "ext4",
        &[
            ("dir", images.to_str().unwrap()),
            support::cluster::NOBODY_UID,
            support::cluster::NOBODY_GID,
        ],
        &[],
        "capacity_min = \"32MiB\"",
    );
    assert!(out.contains("is ready"), "{out}");
    let out = c.create_volume_with(
        "dav-data",
        "single-node-writer",
        "webdav",
        &[("url", &server.url), ("user", "dhv")],
        &[("password", "upgrade-pw")],
        "",
    );
    assert!(out.contains("is ready"), "{out}");
    let dav: Value = c
        .get("/v1/var/dhv-binder/volumes/dav-data?namespace=default")
        .await;
    let dav_id = dav["Items"]["id"].as_str().unwrap().to_string();
    let jobs = [
        c.run_job(&writer_job(c.sb.path(), "ext4-writer", "ext4-data"))
            .await,
        c.run_job(&writer_job(c.sb.path(), "dav-writer", "dav-data"))
            .await,
    ];
    for volume in ["ext4-data", "dav-data"] {
        c.wait_for(90, "the writer's first lines", || async {
            (written(&c, volume).len() >= 5).then_some(())
        })
        .await;
    }
    let journal_count = |event: &str| c.journal(0).iter().filter(|e| e["event"] == event).count();
    assert_eq!(journal_count("publish-done"), 2);
    let rclone = mount_pids(&c.target(0, "dav-data"));
    assert_eq!(rclone.len(), 1, "one rclone serves the mount: {rclone:?}");

    // The upgrade: a new release (another archive, another checksum).
    let (_, sum2) = pack_release(&releases, "dhv-binder_v2_linux_amd64.tar.gz");
    assert_ne!(sum2, sum);
    let upgraded_at = now_ns();
    run_with_vars(
        &c,
        &system_job(&c),
        &vars("dhv-binder_v2_linux_amd64.tar.gz", &sum2),
    )
    .await;
    let new = c
        .wait_for(
            60,
            "the new version's agent running, the old one stopped",
            || async {
                let a = c.allocs(&system).await;
                let old_gone = a
                    .iter()
                    .filter(|a| a["JobVersion"] == 0)
                    .all(|a| a["ClientStatus"] == "complete" || a["ClientStatus"] == "failed");
                let new = a.into_iter().find(|a| {
                    a["JobVersion"] == 1 && a["TaskStates"]["agent"]["State"] == "running"
                });
                new.filter(|_| old_gone)
            },
        )
        .await;
    let new_id = new["ID"].as_str().unwrap().to_string();
    // The new agent is up (its node record healthy again), then a little writing.
    c.wait_plugin("webdav").await;
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    for volume in ["ext4-data", "dav-data"] {
        assert_eq!(
            support::cluster::mount_count(&c.target(0, volume)),
            1,
            "{volume} was remounted or lost in the upgrade"
        );
    }
    assert_eq!(
        journal_count("publish-done"),
        2,
        "published again: {:?}",
        c.journal(0)
    );
    assert_eq!(
        mount_pids(&c.target(0, "dav-data")),
        rclone,
        "the FUSE server died with the old agent"
    );

    // The new agent's cgroup killed outright (what Nomad's executor does to a task's cgroup,
    // here without the task being stopped: a crash or an OOM kill).
    let agent_cgroup = c
        .cgroup
        .path
        .join(format!("node-1.nomad/share.slice/{new_id}.agent.scope"));
    assert!(
        agent_cgroup.join("cgroup.procs").exists(),
        "the agent does not run in its task cgroup {}",
        agent_cgroup.display()
    );
    let agent_log = c.sb.join(&format!(
        "sim/node-1/alloc/{new_id}/alloc/logs/agent.stderr.0"
    ));
    let adoptions = || {
        std::fs::read_to_string(&agent_log)
            .unwrap_or_default()
            .matches("adopted the helper cgroup of a published volume")
            .count()
    };
    let adopted_before = adoptions();
    assert!(
        adopted_before >= 1,
        "the new agent did not adopt the helper cgroup at its start"
    );
    let killed_at = now_ns();
    ScratchCgroup::kill(&agent_cgroup);
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert_eq!(
        mount_pids(&c.target(0, "dav-data")),
        rclone,
        "the FUSE server died with the agent's cgroup"
    );
    let before = written(&c, "dav-data").len();
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(
        written(&c, "dav-data").len() > before,
        "the task's writes to the webdav volume stopped with the agent"
    );
    // The task restarts the agent (the jobspec's restart delay), which adopts the helper.
    c.wait_for(
        30,
        "the restarted agent adopting the helper cgroup",
        || async { (adoptions() > adopted_before).then_some(()) },
    )
    .await;
    let restarted_at = now_ns();
    c.wait_plugin("webdav").await;
    for volume in ["ext4-data", "dav-data"] {
        assert_eq!(support::cluster::mount_count(&c.target(0, volume)), 1);
    }
    assert_eq!(journal_count("publish-done"), 2, "{:?}", c.journal(0));

    // Stop the writers: both volumes unpublished (the webdav one after rclone uploaded).
    let ext4_lines = written(&c, "ext4-data");
    for job in &jobs {
        c.stop_job(job, false).await;
    }
    c.wait_for(60, "both unpublishes done", || async {
        (journal_count("unpublish-done") == 2).then_some(())
    })
    .await;
    let dav_lines = lines(
        &std::fs::read_to_string(server.dir.join("default").join(&dav_id).join("log"))
            .expect("the log on the WebDAV server"),
    );
    for (volume, l) in [("ext4-data", &ext4_lines), ("dav-data", &dav_lines)] {
        assert!(contiguous(l), "{volume}: lines missing or out of order");
        assert!(
            l.iter().filter(|(_, t)| *t >= upgraded_at).count() >= 20,
            "{volume}: the writes stopped during the upgrade"
        );
    }
    for job in &jobs {
        let a = &c.allocs(job).await[0];
        let stderr = std::fs::read_to_string(c.sb.join(&format!(
            "sim/node-1/alloc/{}/alloc/logs/app.stderr.0",
            a["ID"].as_str().unwrap()
        )))
        .unwrap_or_default();
        assert!(!stderr.contains("failed"), "{job}: failed writes: {stderr}");
    }
    for (volume, l) in [("ext4", &ext4_lines), ("webdav", &dav_lines)] {
        let (n, bytes, gap) = written_between(l, upgraded_at, killed_at);
        let (kn, kbytes, kgap) = written_between(l, killed_at, restarted_at);
        eprintln!(
            "{volume}: upgrade: {n} writes ({bytes} bytes) reached the storage, longest gap {gap} ms; agent cgroup killed until the restarted agent adopted the helpers: {kn} writes ({kbytes} bytes), longest gap {kgap} ms; whole run: longest gap {} ms (the writer pauses 50 ms), 0 failed writes",
            longest_gap_ms(l)
        );
    }
    c.stop_job(&system, false).await;
}
