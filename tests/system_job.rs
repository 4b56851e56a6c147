//! The deployed shape, end to end: the repository's own system job
//! (jobspecs/dhv-binder.nomad.hcl, only its variables and host paths changed) submitted to
//! the simulator as `nomad job run -var` does, its artifact (the freshly built binary and the
//! reference plugins, packed as a release) served over loopback HTTP and checked against its
//! real SHA-256; the agent runs as the raw_exec task on every node, talking to Nomad through
//! its Task API socket with its workload identity; then the example exec job
//! (jobspecs/example.nomad.hcl) gets its deferred volume published on its node only.

mod support;

use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use support::cluster::{dhv_binder_bin, repo, Cluster};

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
            format!("bind={}", c.export.display()),
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

/// The example job with a main task that appends a numbered, timestamped line to
/// `/data/log` every 50 ms, opening the file each time (each write goes through the mount).
fn writer_job(dir: &Path) -> PathBuf {
    let example = std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl")).unwrap();
    let start = example.find("<<-EOT").expect("the example's heredoc") + "<<-EOT".len();
    let end = start + example[start..].find("EOT").unwrap();
    let body = r#"
          i=0
          while true; do
            i=$((i + 1))
            echo "line $i $(date +%s%N)" >> /data/log || echo "write $i failed" >&2
            sleep 0.05
          done
        "#;
    let job = format!("{}{}{}", &example[..start], body, &example[end..]);
    let path = dir.join("writer.nomad.hcl");
    std::fs::write(&path, job).unwrap();
    path
}

/// The numbered lines of the writer's log, in order, with their times (ns).
fn lines(text: &str) -> Vec<(u64, u128)> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "line").then_some(())?;
            Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
        })
        .collect()
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

    // An upgrade: the same binary re-packed (another checksum) submitted as a new version of
    // the system job while a task writes to the volume every 50 ms. Every agent is replaced;
    // the volume stays mounted under the task and is never published again.
    let writer = c.run_job(&writer_job(c.sb.path())).await;
    let walloc = c
        .wait_for(60, "the writer running", || async {
            c.allocs(&writer)
                .await
                .into_iter()
                .find(|a| a["TaskStates"]["app"]["State"] == "running")
        })
        .await;
    let i = c.node_index(walloc["NodeID"].as_str().unwrap());
    let target = c.target(i, "shared-data");
    let log = target.join("log");
    c.wait_for(20, "the writer's first lines", || async {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|t| lines(t).len() >= 5)
    })
    .await;
    let publishes = |c: &Cluster| {
        c.journal(i)
            .iter()
            .filter(|e| e["event"] == "publish-done")
            .count()
    };
    let published = publishes(&c);
    let (_, sum2) = pack_release(
        c.sb.join("releases").as_path(),
        "dhv-binder_test2_linux_amd64.tar.gz",
    );
    assert_ne!(sum2, sum, "the re-packed release has the same checksum");
    let vars = format!(
        "release_url = \"{}\"\nrelease_sha256 = \"{sum2}\"\n",
        url.replace("dhv-binder_test_", "dhv-binder_test2_")
    );
    let upgraded_at = now_ns();
    run_with_vars(&c, &system_job(&c), &vars).await;
    c.wait_for(
        60,
        "the new version's agent running on every node",
        || async {
            let a = c.allocs(&system).await;
            let new = a
                .iter()
                .filter(|a| a["JobVersion"] == 1 && a["TaskStates"]["agent"]["State"] == "running")
                .count();
            let old = a
                .iter()
                .filter(|a| a["JobVersion"] == 0 && a["ClientStatus"] == "running")
                .count();
            (new == c.nodes.len() && old == 0).then_some(())
        },
    )
    .await;
    // The new agents are up: their node records healthy again, then a little writing.
    c.wait_plugin("bind").await;
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!(
        support::cluster::mount_count(&target),
        1,
        "the volume was remounted or lost"
    );
    assert_eq!(
        publishes(&c),
        published,
        "published again: {:?}",
        c.journal(i)
    );
    let written = lines(&std::fs::read_to_string(&log).unwrap());
    assert!(
        written
            .iter()
            .enumerate()
            .all(|(k, (n, _))| *n == k as u64 + 1),
        "lines missing or out of order"
    );
    let after: Vec<_> = written.iter().filter(|(_, t)| *t >= upgraded_at).collect();
    assert!(
        after.len() >= 20,
        "the writes stopped during the upgrade: {} after it",
        after.len()
    );
    let longest = written
        .windows(2)
        .map(|w| w[1].1.saturating_sub(w[0].1))
        .max()
        .unwrap_or(0);
    eprintln!(
        "system job upgrade: {} writes after the update reached the volume ({} bytes); longest gap between two writes {} ms (the writer pauses 50 ms)",
        after.len(),
        after.iter().map(|(n, t)| format!("line {n} {t}\n").len()).sum::<usize>(),
        longest / 1_000_000
    );
    c.stop_job(&writer, false).await;
    c.wait_for(60, "the writer's unpublish done in the journal", || async {
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
