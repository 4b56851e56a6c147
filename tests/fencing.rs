//! Issue 31, end to end: one writer means one writer. The simulator with three client nodes,
//! a dhv-binder per node, the bind plugin's shared export, and a task that appends to a file
//! in a `single-node-writer` volume.

mod support;

use serde_json::{json, Value};
use std::time::{SystemTime, UNIX_EPOCH};
use support::cluster::Cluster;

const VOLUME: &str = "shared-data";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A service job whose main task appends `<alloc id> <n>` to `/data/log.txt` ten times a
/// second, failing as soon as a write fails; the example's prestart task gates the volume.
fn writer_job(sb_dir: &std::path::Path) -> std::path::PathBuf {
    writer_job_named(sb_dir, "writer", "")
}

/// [`writer_job`] named `name`, with `extra` lines in its group (a constraint).
fn writer_job_named(sb_dir: &std::path::Path, name: &str, extra: &str) -> std::path::PathBuf {
    let group = format!(
        "{extra}\n    restart {{\n      attempts = 3\n      interval = \"5m\"\n      delay    = \"5s\"\n      mode     = \"fail\"\n    }}"
    );
    support::jobs::exec_writer_job(
        sb_dir,
        name,
        VOLUME,
        &group,
        r#"i=0; while echo \"$NOMAD_ALLOC_ID $i\" >> /data/log.txt; do i=$((i+1)); sleep 0.1; done; echo write failed >&2; exit 1"#,
    )
}

/// The lines of the volume's log (in the bind plugin's storage: `<export>/default/<id>/`),
/// as (allocation, n), in file order.
fn log_lines(c: &Cluster) -> Vec<(String, u64)> {
    let ns = c.export.join("default");
    let text = std::fs::read_dir(&ns)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("log.txt"))
        .find(|p| p.is_file())
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let (a, n) = l.split_once(' ')?;
            Some((a.to_string(), n.parse().ok()?))
        })
        .collect()
}

fn last_event_ms(c: &Cluster, i: usize, ev: &str) -> Option<u64> {
    c.journal(i)
        .iter()
        .filter(|e| e["event"] == ev)
        .filter_map(|e| e["unix_ms"].as_u64())
        .next_back()
}

/// The partition: the writer's node loses the servers (its heartbeats stop, its agent's
/// calls to its local Nomad fail as Nomad's do) while its task keeps appending. With the
/// default claim settings, its dhv-binder fences the volume on itself before the claim can
/// lapse (the writer is killed, the mount read-only); the replacement on another node
/// publishes only after the lapse. In the file, no line of the old allocation comes after the
/// new allocation's first line. The new node's plugin revokes the old node's access at the
/// storage (`fence_node`, the bind plugin's deny marker) before its publish. When the partition
/// heals, the old node finds its claim lost and unpublishes once its task is gone; when it
/// takes the claim again later, it restores its own access (`unfence_node`) before its
/// publish, which the marker would refuse otherwise. Prints the timeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_writer_is_fenced_before_another_node_takes_the_volume() {
    let c = Cluster::start_with(3, "heartbeat_grace = \"2s\"", &[]).await;
    c.log_plugin_calls("bind", "0");
    c.create_volume(VOLUME, "single-node-writer");
    c.wait_for(30, "a ready placeholder on every node", || async {
        let vols = c.get("/v1/volumes?type=host&namespace=*").await;
        let n = vols
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["Name"] == VOLUME && v["State"] == "ready")
            .count();
        (n == c.nodes.len()).then_some(())
    })
    .await;
    let job = c.run_job(&writer_job(c.sb.path())).await;
    let first: Value = c
        .running_alloc(&job, "app", 120, "the writer running")
        .await;
    let first_id = first["ID"].as_str().unwrap().to_string();
    let old = c.node_index(first["NodeID"].as_str().unwrap());
    // Past the acquire's 2 x TTL lease into steady renewals, for a representative timeline.
    c.wait_for(60, "the writer's lines for 12 s", || async {
        (log_lines(&c).len() >= 120).then_some(())
    })
    .await;

    let t_cut = now_ms();
    c.put(
        &format!("/v1/sim/node/{}/partition?on=true", c.nodes[old].id),
        json!({}),
    )
    .await;
    let t_fence = c
        .wait_for(60, "the old node fencing the volume", || async {
            last_event_ms(&c, old, "fenced")
        })
        .await;
    let (code, status) = c.status(old);
    assert_eq!(code, 0, "{status}");
    let st: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(st["claims"][format!("default/{VOLUME}")], "fenced", "{st}");

    let second: Value = c
        .wait_for(120, "the replacement writing on another node", || async {
            let a = c.allocs(&job).await.into_iter().find(|a| {
                a["ID"] != first_id.as_str() && a["TaskStates"]["app"]["State"] == "running"
            })?;
            let id = a["ID"].as_str()?.to_string();
            log_lines(&c).iter().any(|(x, _)| *x == id).then_some(a)
        })
        .await;
    let second_id = second["ID"].as_str().unwrap().to_string();
    let new = c.node_index(second["NodeID"].as_str().unwrap());
    assert_ne!(new, old);
    let t_take = last_event_ms(&c, new, "publish-done").unwrap();
    eprintln!(
        "partition hand-over with the default claim settings: fence on the old node {} ms after the cut, publish on the new node {} ms after the cut ({} ms after the fence)",
        t_fence.saturating_sub(t_cut),
        t_take.saturating_sub(t_cut),
        t_take.saturating_sub(t_fence)
    );
    assert!(t_fence < t_take, "fenced before the other node published");
    // Storage-side fence: the new node's plugin fenced the old node before the publish.
    let (old_id, new_id) = (c.nodes[old].id.clone(), c.nodes[new].id.clone());
    let publish_start = c
        .plugin_log()
        .into_iter()
        .filter(|(w, _, op, n)| w == "start" && op == "publish" && *n == new_id)
        .map(|(_, t, _, _)| t)
        .next_back()
        .expect("the new node's publish in the plugin log");
    let fenced = c.node_fence_calls();
    assert!(
        fenced.iter().any(|(t, op, by, rc, who)| op == "fence_node"
            && *by == new_id
            && *rc == 0
            && *who == old_id
            && *t < publish_start),
        "no fence_node of the old node {old_id} by the new node {new_id} before its publish: {fenced:?}"
    );
    assert!(
        last_event_ms(&c, new, "node-fenced").is_some(),
        "the new node's journal records the storage-side fence"
    );
    // Let both run on: the old task (restarted by its partitioned client) must not append.
    tokio::time::sleep(std::time::Duration::from_secs(8)).await;
    let lines = log_lines(&c);
    let first_new = lines.iter().position(|(a, _)| *a == second_id).unwrap();
    let last_old = lines.iter().rposition(|(a, _)| *a == first_id).unwrap();
    assert!(
        last_old < first_new,
        "the old allocation wrote after the new one began: line {last_old} vs {first_new}"
    );

    // The partition heals: the claim is the new node's, so the old node unpublishes once
    // its task is gone.
    c.put(
        &format!("/v1/sim/node/{}/partition?on=false", c.nodes[old].id),
        json!({}),
    )
    .await;
    let target = c.target(old, VOLUME);
    c.wait_for(
        180,
        "the fenced mount removed on the old node (the unpublish retries with backoff)",
        || async { (!dhv_binder::node::mounts::is_mount_point(&target)).then_some(()) },
    )
    .await;
    assert!(dhv_binder::node::mounts::is_mount_point(
        &c.target(new, VOLUME)
    ));
    c.stop_job(&job, false).await;
    // The old node is allowed back once it takes the claim again: its plugin's
    // `unfence_node` for itself comes before its publish (the deny marker refuses it).
    let back = c
        .run_job(&writer_job_named(
            c.sb.path(),
            "back",
            &format!(
                "    constraint {{\n      attribute = \"${{node.unique.id}}\"\n      value     = \"{old_id}\"\n    }}"
            ),
        ))
        .await;
    let back_alloc: Value = c
        .wait_for(120, "the old node writing the volume again", || async {
            let a = c
                .allocs(&back)
                .await
                .into_iter()
                .find(|a| a["TaskStates"]["app"]["State"] == "running")?;
            let id = a["ID"].as_str()?.to_string();
            log_lines(&c).iter().any(|(x, _)| *x == id).then_some(a)
        })
        .await;
    assert_eq!(back_alloc["NodeID"], old_id.as_str());
    let fenced = c.node_fence_calls();
    assert!(
        fenced
            .iter()
            .any(|(_, op, by, rc, who)| op == "unfence_node"
                && *by == old_id
                && *rc == 0
                && *who == old_id),
        "the old node unfenced itself before publishing again: {fenced:?}"
    );
    c.stop_job(&back, false).await;
}

/// Issue 44 item 1: a task that lies about who it is does not outlive the fence. Its writer
/// runs under a false `NOMAD_ALLOC_ID` (an allocation no node knows); whose a process is
/// comes from its cgroup, so when its node is partitioned the fence kills it as any other
/// holder (the status's fence report names it with its real allocation, read from its
/// cgroup), and no line of the old allocation comes after the new allocation's first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_under_a_false_alloc_id_is_killed_by_the_fence() {
    let c = Cluster::start_with(3, "heartbeat_grace = \"2s\"", &[]).await;
    c.create_volume(VOLUME, "single-node-writer");
    c.wait_for(30, "a ready placeholder on every node", || async {
        let vols = c.get("/v1/volumes?type=host&namespace=*").await;
        let n = vols
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["Name"] == VOLUME && v["State"] == "ready")
            .count();
        (n == c.nodes.len()).then_some(())
    })
    .await;
    let group = "    restart {\n      attempts = 3\n      interval = \"5m\"\n      delay    = \"5s\"\n      mode     = \"fail\"\n    }";
    let job = c
        .run_job(&support::jobs::exec_writer_job(
            c.sb.path(),
            "liar",
            VOLUME,
            group,
            r#"A=$NOMAD_ALLOC_ID exec env NOMAD_ALLOC_ID=00000000-0000-4000-8000-000000000000 sh -c 'i=0; while echo \"$A $i\" >> /data/log.txt; do i=$((i+1)); sleep 0.1; done; echo write failed >&2; exit 1'"#,
        ))
        .await;
    let first: Value = c.running_alloc(&job, "app", 120, "the liar writing").await;
    let first_id = first["ID"].as_str().unwrap().to_string();
    let old = c.node_index(first["NodeID"].as_str().unwrap());
    c.wait_for(60, "the liar's lines", || async {
        (log_lines(&c).iter().filter(|(a, _)| *a == first_id).count() >= 30).then_some(())
    })
    .await;
    c.put(
        &format!("/v1/sim/node/{}/partition?on=true", c.nodes[old].id),
        json!({}),
    )
    .await;
    let report: Value = c
        .wait_for(60, "the old node's fence report", || async {
            let (code, status) = c.status(old);
            let st: Value = serde_json::from_str(&status).ok()?;
            let r = st["fenced"][format!("default/{VOLUME}")]["fence"].clone();
            (code == 0 && r.is_object()).then_some(r)
        })
        .await;
    let killed: Vec<&Value> = report["stopped"]
        .as_array()
        .map(|s| s.iter().collect())
        .unwrap_or_default();
    eprintln!("the old node's fence: {report}");
    assert!(
        killed.iter().any(|h| h["alloc_id"] == first_id.as_str()),
        "the fence killed no process of the liar's allocation {first_id} (named by its cgroup): {report}"
    );
    let second: Value = c
        .wait_for(120, "the replacement writing on another node", || async {
            let a = c.allocs(&job).await.into_iter().find(|a| {
                a["ID"] != first_id.as_str() && a["TaskStates"]["app"]["State"] == "running"
            })?;
            let id = a["ID"].as_str()?.to_string();
            log_lines(&c).iter().any(|(x, _)| *x == id).then_some(a)
        })
        .await;
    let second_id = second["ID"].as_str().unwrap().to_string();
    assert_ne!(c.node_index(second["NodeID"].as_str().unwrap()), old);
    // Let both run on: the old task (restarted by its partitioned client) must not append.
    tokio::time::sleep(std::time::Duration::from_secs(8)).await;
    let lines = log_lines(&c);
    let first_new = lines.iter().position(|(a, _)| *a == second_id).unwrap();
    let old_after = lines[first_new..]
        .iter()
        .filter(|(a, _)| *a == first_id)
        .count();
    eprintln!(
        "lines of the old allocation after the new one's first: {old_after} (of {} lines)",
        lines.len()
    );
    assert_eq!(
        old_after, 0,
        "the old allocation wrote after the new one began"
    );
    c.stop_job(&job, false).await;
}

/// Hand-over on evidence: the holder's dhv-binder is killed while its writer keeps running
/// on a node Nomad reports `ready`. Another node that wants the volume waits past the lock's
/// lapse (TTL 10 s + lock delay 2 s here) and never publishes: its prestart says who holds the
/// volume (node, allocation, job). The volume is never mounted on two nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_whose_agent_is_down_while_its_task_runs_is_never_taken_over() {
    let mut c = Cluster::start_with(
        2,
        "",
        &[
            ("DHV_BINDER_CLAIM_TTL", "10s"),
            ("DHV_BINDER_CLAIM_LOCK_DELAY", "2s"),
        ],
    )
    .await;
    c.log_plugin_calls("bind", "0");
    c.create_volume(VOLUME, "single-node-writer");
    let job = c.run_job(&writer_job(c.sb.path())).await;
    let first: Value = c
        .running_alloc(&job, "app", 120, "the writer running")
        .await;
    let holder = c.node_index(first["NodeID"].as_str().unwrap());
    let other = 1 - holder;
    c.kill_agent(holder, nix::sys::signal::Signal::SIGKILL);
    let second = c
        .run_job(&writer_job_named(
            c.sb.path(),
            "second",
            &format!(
                "    constraint {{\n      attribute = \"${{node.unique.id}}\"\n      value     = \"{}\"\n    }}",
                c.nodes[other].id
            ),
        ))
        .await;
    // Past the lapse: 2 x TTL + lock delay after the last renewal at the latest.
    tokio::time::sleep(std::time::Duration::from_secs(30)).await;
    let (_, status) = c.status(other);
    let st: Value = serde_json::from_str(&status).unwrap();
    let waiting = st["waiting"].to_string();
    assert!(
        waiting.contains("still runs with it")
            && waiting.contains(&first["ID"].as_str().unwrap()[..8])
            && waiting.contains(first["NodeName"].as_str().unwrap()),
        "the waiting node names the holder's allocation (short ID) and node: {st}"
    );
    assert!(
        !dhv_binder::node::mounts::is_mount_point(&c.target(other, VOLUME)),
        "published on a second node while the holder's task runs"
    );
    assert!(c
        .allocs(&second)
        .await
        .iter()
        .all(|a| a["TaskStates"]["app"]["State"] != "running"));
    let iv = c.published_intervals();
    for (i, a) in iv.iter().enumerate() {
        for b in iv.iter().skip(i + 1) {
            assert!(
                a.0 == b.0 || a.2 <= b.1 || b.2 <= a.1,
                "published on two nodes at once: {a:?} and {b:?}"
            );
        }
    }
}

/// Storage-side fencing, node side: the bind plugin declares `fence`, so when a partitioned
/// node fences its claim, dhv-binder calls the plugin's `fence` for the mount (beside its own
/// remount and kill), and the status's fence report says the plugin fenced it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_node_calls_the_plugins_fence() {
    let c = Cluster::start_with(
        1,
        "",
        &[
            ("DHV_BINDER_CLAIM_TTL", "10s"),
            ("DHV_BINDER_CLAIM_LOCK_DELAY", "2s"),
        ],
    )
    .await;
    c.log_plugin_calls("bind", "0");
    c.create_volume(VOLUME, "single-node-writer");
    let job = c.run_job(&writer_job(c.sb.path())).await;
    c.wait_for(120, "the writer's first lines", || async {
        (!log_lines(&c).is_empty()).then_some(())
    })
    .await;
    let node = c.nodes[0].id.clone();
    c.put(&format!("/v1/sim/node/{node}/partition?on=true"), json!({}))
        .await;
    let fence: Value = c
        .wait_for(60, "the node's fence report", || async {
            let (_, status) = c.status(0);
            let st: Value = serde_json::from_str(&status).ok()?;
            let f = st["fenced"][format!("default/{VOLUME}")]["fence"].clone();
            (!f.is_null()).then_some(f)
        })
        .await;
    assert_eq!(fence["plugin"], json!({"plugin": "bind"}), "{fence}");
    let calls: Vec<_> = c
        .plugin_log()
        .into_iter()
        .filter(|(what, _, op, n)| what == "end" && op == "fence" && *n == node)
        .collect();
    assert_eq!(calls.len(), 1, "one fence call by the plugin: {calls:?}");
    assert!(fence["read_only"] == true, "{fence}");
    c.put(
        &format!("/v1/sim/node/{node}/partition?on=false"),
        json!({}),
    )
    .await;
    c.stop_job(&job, false).await;
}

/// Nomad's own fence: a writer whose group sets `disconnect { stop_on_client_after }` below
/// the claim's fence deadline and above the client's heartbeat interval (25 s: the
/// simulator's clients heartbeat every 10–20 s, as Nomad's up to 500 nodes) is stopped by its
/// partitioned client (the simulator follows `client/heartbeatstop.go`, counting from the
/// last heartbeat) before dhv-binder's fence is due: its lines end 5–25 s after the cut,
/// while the agent has not fenced yet, and it is not flagged `unfenced`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_client_stops_a_writer_with_stop_on_client_after_before_the_fence() {
    let c = Cluster::start_with(1, "", &[]).await;
    c.create_volume(VOLUME, "single-node-writer");
    let job = c
        .run_job(&writer_job_named(
            c.sb.path(),
            "stopping",
            "    disconnect {\n      stop_on_client_after = \"25s\"\n    }",
        ))
        .await;
    c.wait_for(120, "the writer's first lines", || async {
        (!log_lines(&c).is_empty()).then_some(())
    })
    .await;
    let (_, status) = c.status(0);
    let st: Value = serde_json::from_str(&status).unwrap();
    assert!(
        st["unfenced"].as_object().is_some_and(|o| o.is_empty()),
        "stop_on_client_after within the fence deadline: not flagged: {st}"
    );
    let node = c.nodes[0].id.clone();
    let t_cut = now_ms();
    c.put(&format!("/v1/sim/node/{node}/partition?on=true"), json!({}))
        .await;
    // The writer appends every 100 ms: 2 s without a new line means it stopped.
    let mut last = (log_lines(&c).len(), now_ms());
    let t_stopped = c
        .wait_for(60, "the writer stopped by its client", || {
            let n = log_lines(&c).len();
            let t = now_ms();
            if n != last.0 {
                last = (n, t);
            }
            let stopped = (t - last.1 >= 2_000).then_some(last.1);
            async move { stopped }
        })
        .await;
    let after = t_stopped.saturating_sub(t_cut);
    eprintln!("the partitioned client stopped the writer {after} ms after the cut");
    // Counted from the last heartbeat, up to 20 s before the cut.
    assert!(
        (4_000..27_000).contains(&after),
        "stopped {after} ms after the cut (stop_on_client_after = 25 s)"
    );
    assert!(
        last_event_ms(&c, 0, "fenced").is_none_or(|t| t > t_stopped),
        "the client stopped the writer before dhv-binder fenced"
    );
    c.put(
        &format!("/v1/sim/node/{node}/partition?on=false"),
        json!({}),
    )
    .await;
    c.stop_job(&job, false).await;
}

/// Issue 45: Nomad's client counts `stop_on_client_after` from its last heartbeat that
/// succeeded and heartbeats once per server-given TTL (10–20 s here, as on Nomad up to 500
/// nodes: `nomad/heartbeat.go` `resetHeartbeatTimer`), so 8 s stops a healthy client's
/// writer between two heartbeats (`client/heartbeatstop.go` `shouldStopAfter`). The agent
/// flags it `unfenced` with the safe range (25–30 s with the defaults), and the simulator
/// stops the writer though nothing cut the client off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_on_client_after_below_the_heartbeat_interval_is_flagged_and_stops_healthy_work() {
    let c = Cluster::start_with(1, "", &[]).await;
    c.create_volume(VOLUME, "single-node-writer");
    let job = c
        .run_job(&writer_job_named(
            c.sb.path(),
            "short",
            "    disconnect {\n      stop_on_client_after = \"8s\"\n    }",
        ))
        .await;
    let warning = c
        .wait_for(120, "the writer flagged unfenced", || async {
            let (_, status) = c.status(0);
            let st: Value = serde_json::from_str(&status).ok()?;
            st["unfenced"]
                .as_object()?
                .values()
                .find_map(|w| w.as_str().map(str::to_string))
        })
        .await;
    assert!(
        warning.contains("shorter than its client's heartbeat interval")
            && warning.contains("between 25s")
            && warning.contains("and 30s"),
        "{warning}"
    );
    c.wait_for(120, "the writer's first lines", || async {
        (!log_lines(&c).is_empty()).then_some(())
    })
    .await;
    // Nothing cuts the client off, yet its writer stops within a heartbeat interval.
    let mut last = (log_lines(&c).len(), now_ms());
    c.wait_for(60, "the healthy client stopped the writer", || {
        let n = log_lines(&c).len();
        let t = now_ms();
        if n != last.0 {
            last = (n, t);
        }
        let stopped = (t - last.1 >= 2_000).then_some(());
        async move { stopped }
    })
    .await;
    let sim_log = std::fs::read_to_string(c.sb.join("sim.log")).unwrap_or_default();
    assert!(
        sim_log.contains("(stop_on_client_after 8s): stopping allocation"),
        "stopped by the client's heartbeat stop: {sim_log}"
    );
    c.stop_job(&job, false).await;
}

/// Kills and reaps a process when dropped (a holder the test started), even on failure.
struct Holder(std::process::Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Delete on evidence: the writer's job stops, but a process on its node keeps the mount
/// (its working directory is in the volume), so the unpublish is refused and retried. No
/// allocation uses the volume any more, yet `volume delete` is refused naming that node, and
/// the storage survives. Once the holder is gone and the node has unmounted, the delete runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_while_a_node_keeps_the_mount_is_refused_naming_the_node() {
    let c = Cluster::start(2).await;
    c.create_volume(VOLUME, "single-node-writer");
    let job = c.run_job(&writer_job(c.sb.path())).await;
    let first: Value = c
        .running_alloc(&job, "app", 120, "the writer running")
        .await;
    let node = c.node_index(first["NodeID"].as_str().unwrap());
    c.wait_for(30, "the writer's first lines", || async {
        (!log_lines(&c).is_empty()).then_some(())
    })
    .await;
    let target = c.target(node, VOLUME);
    let holder = Holder(
        std::process::Command::new("sleep")
            .arg("600")
            .current_dir(&target)
            .spawn()
            .expect("start a holder in the volume"),
    );
    c.stop_job(&job, false).await;
    c.wait_for(60, "the writer stopped", || async {
        c.allocs(&job)
            .await
            .iter()
            .all(|a| a["ClientStatus"] != "running")
            .then_some(())
    })
    .await;
    assert!(dhv_binder::node::mounts::is_mount_point(&target));

    let (code, out) = c.cli(&["volume", "delete", VOLUME]);
    assert_ne!(code, 0, "the delete was accepted under a live mount: {out}");
    assert!(
        out.contains(&c.nodes[node].id) && out.contains("still mounted"),
        "the refusal names the node: {out}"
    );
    assert!(
        !log_lines(&c).is_empty(),
        "the storage was removed under the live mount"
    );
    assert!(dhv_binder::node::mounts::is_mount_point(&target));

    drop(holder);
    c.wait_for(90, "the mount released once its holder is gone", || async {
        (!dhv_binder::node::mounts::is_mount_point(&target)).then_some(())
    })
    .await;
    let (code, out) = c.cli(&["volume", "delete", VOLUME]);
    assert_eq!(code, 0, "{out}");
}

/// The writer still appends to the volume's log, and `first` (the job's first allocation)
/// still runs: nothing was killed.
async fn writes_on(c: &Cluster, job: &str, first: &Value) {
    let lines = log_lines(c).len();
    c.wait_for(10, "the writer still writing", || async {
        (log_lines(c).len() > lines).then_some(())
    })
    .await;
    assert!(c
        .allocs(job)
        .await
        .iter()
        .any(|a| a["ID"] == first["ID"] && a["TaskStates"]["app"]["State"] == "running"));
}

/// The claim named in `dhv-binder status` on node `i` ("held", "fenced", "lost"; "" when none).
fn claim_state(c: &Cluster, i: usize) -> String {
    let (_, status) = c.status(i);
    serde_json::from_str::<Value>(&status).unwrap_or_default()["claims"]
        [format!("default/{VOLUME}")]
    .as_str()
    .unwrap_or_default()
    .to_string()
}

/// Claims that were never lost are not given up: after a leader change, the new leader
/// answers the holder's renewals 409 until it has re-armed its lock timers (here for 8 s,
/// several renewals with a 10 s TTL). The holder reads the claim, finds it still its own, and
/// keeps it: never `lost`, `held` again once a renewal succeeds, and its writer runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_refused_after_a_leader_change_loses_no_claim() {
    let c = Cluster::start_with(1, "", &[("DHV_BINDER_CLAIM_TTL", "10s")]).await;
    c.create_volume(VOLUME, "single-node-writer");
    let job = c.run_job(&writer_job(c.sb.path())).await;
    let first: Value = c
        .running_alloc(&job, "app", 120, "the writer running")
        .await;
    c.wait_for(30, "the claim held", || async {
        (claim_state(&c, 0) == "held").then_some(())
    })
    .await;
    c.put("/v1/sim/leader?leader=false", json!({})).await;
    c.put("/v1/sim/leader?leader=true&timers_after=8", json!({}))
        .await;
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::time::Instant::now() < until {
        let st = claim_state(&c, 0);
        assert_ne!(st, "lost", "a claim refused by a new leader was given up");
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    c.wait_for(30, "the claim held again", || async {
        (claim_state(&c, 0) == "held").then_some(())
    })
    .await;
    writes_on(&c, &job, &first).await;
    c.stop_job(&job, false).await;
}

/// A paused agent (SIGSTOP, as a suspended VM) does not resume on a lapsed lease: the holder's
/// dhv-binder is stopped past its lease (2 x TTL 10 s + lock delay 2 s = 22 s after its last
/// renewal) while its writer runs; the first thing it records after SIGCONT is the fence, and
/// the volume is unwritable here (the lock is gone by then, so no renewal restores it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_paused_past_its_lease_fences_first_on_resume() {
    let c = Cluster::start_with(
        1,
        "",
        &[
            ("DHV_BINDER_CLAIM_TTL", "10s"),
            ("DHV_BINDER_CLAIM_LOCK_DELAY", "2s"),
        ],
    )
    .await;
    c.create_volume(VOLUME, "single-node-writer");
    let job = c.run_job(&writer_job(c.sb.path())).await;
    c.wait_for(120, "the writer writing", || async {
        (log_lines(&c).len() >= 10).then_some(())
    })
    .await;
    c.signal_agent(0, nix::sys::signal::Signal::SIGSTOP);
    // Past the lease: with 16 s (the lease's length before Nomad's renewal was read as 2 x
    // TTL) the lock was still held, a renewal after the resume restored the volume and the
    // writer wrote again within the check's 2 s under load.
    tokio::time::sleep(std::time::Duration::from_secs(24)).await;
    let t_resume = now_ms();
    c.signal_agent(0, nix::sys::signal::Signal::SIGCONT);
    c.wait_for(20, "the fence after the resume", || async {
        last_event_ms(&c, 0, "fenced").filter(|t| *t >= t_resume)
    })
    .await;
    let after: Vec<String> = c
        .journal(0)
        .iter()
        .filter(|e| e["unix_ms"].as_u64().is_some_and(|t| t >= t_resume))
        .map(|e| e["event"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        after.first().map(String::as_str),
        Some("fenced"),
        "the first event after the resume: {after:?}"
    );
    // The event is the decision; the writer may append until the fence is carried out (its
    // holders killed, the mount read-only), which its report in status says.
    // (From the agent's log: status shows the report only until the claim is taken again,
    // which a loaded machine's status reads can miss.)
    c.wait_for(20, "the fence's report", || async {
        let log = std::fs::read_to_string(&c.nodes[0].log).ok()?;
        log.contains("volume fenced on this node").then_some(())
    })
    .await;
    let lines = log_lines(&c).len();
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!(log_lines(&c).len(), lines, "written after the fence");
    c.stop_job(&job, false).await;
}

/// An agent restarted while the servers are out of reach for a few seconds (an upgrade of the
/// system job during a short outage) keeps its claim and kills nothing: the lease of a claim
/// restored from the journal is known again from the renewals kept on disk on the same boot
/// (`<state_dir>/leases.json`), so its failed first renewal fences it only a margin before
/// that lease ends, as without the restart. The writer writes on throughout. Without the file
/// the restored claim's lease is unknown and the same restart fences at once (the second half).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_restarted_during_a_short_outage_keeps_its_claim_and_kills_nothing() {
    let mut c = Cluster::start_with(1, "", &[]).await;
    c.create_volume(VOLUME, "single-node-writer");
    let job = c.run_job(&writer_job(c.sb.path())).await;
    let first: Value = c
        .running_alloc(&job, "app", 120, "the writer running")
        .await;
    c.wait_for(30, "the claim held and a renewal kept on disk", || async {
        let leases = std::fs::read_to_string(c.nodes[0].state_dir.join("leases.json")).ok()?;
        (claim_state(&c, 0) == "held" && leases.contains(VOLUME)).then_some(())
    })
    .await;
    let restart = |c: &mut Cluster, forget: bool| {
        c.kill_agent(0, nix::sys::signal::Signal::SIGKILL);
        if forget {
            std::fs::remove_file(c.nodes[0].state_dir.join("leases.json")).unwrap();
        }
    };
    let outage = |on: bool| format!("/v1/sim/node/{}/partition?on={on}", c.nodes[0].id);
    let (cut, heal) = (outage(true), outage(false));

    restart(&mut c, false);
    c.put(&cut, json!({})).await;
    c.start_agent(0);
    // Long enough for the restored claim's first renewals to fail (one at once, then every
    // TTL/6 = 2.5 s), short of the lease's fence moment (30 s after the last renewal sent).
    tokio::time::sleep(std::time::Duration::from_secs(8)).await;
    c.put(&heal, json!({})).await;
    c.wait_for(30, "the claim renewed after the outage", || async {
        (claim_state(&c, 0) == "held").then_some(())
    })
    .await;
    let events: Vec<String> = c
        .journal(0)
        .iter()
        .filter_map(|e| e["event"].as_str().map(str::to_string))
        .collect();
    assert!(
        !events.iter().any(|e| e == "fenced"),
        "a restart during a short outage fenced the volume: {events:?}"
    );
    writes_on(&c, &job, &first).await;

    // The same restart without the renewals on disk: the lease is unknown, and the first
    // failed renewal fences (fail closed).
    restart(&mut c, true);
    c.put(&cut, json!({})).await;
    c.start_agent(0);
    c.wait_for(
        20,
        "the fence of a claim whose lease is unknown",
        || async {
            c.journal(0)
                .iter()
                .any(|e| e["event"] == "fenced")
                .then_some(())
        },
    )
    .await;
    c.put(&heal, json!({})).await;
    c.stop_job(&job, false).await;
}

/// `single-node-single-writer`: one writing allocation, even on one node. Nomad lets two
/// writers of one volume overlap on a node in one case: an allocation whose status is `failed`
/// while its poststop task still runs (`getClientStatus` gives `failed` precedence) is
/// client-terminal, so the scheduler places another writer there and its client starts it (a
/// replacement of the same job would wait for the previous allocation to be client-terminal,
/// which a `failed` one already is; another job has no previous allocation). Here the first
/// job's allocation fails (a sibling task exits 1) and its poststop task appends to the volume
/// for four seconds after that; a second job's writer is placed meanwhile. Its prestart waits,
/// its status naming the holder (allocation, job, node), and its task starts only after the old
/// allocation's tasks are all dead: no line of the old allocation comes after the new
/// allocation's first line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_writer_on_the_same_node_waits_for_the_first_with_single_node_single_writer() {
    let c = Cluster::start_with(1, "", &[]).await;
    c.create_volume(VOLUME, "single-node-single-writer");
    // The first job fails three seconds after its tasks start (no restart, no reschedule); its
    // poststop task then appends to the volume for four seconds: the allocation is `failed`
    // but not finished until it did.
    let first_extra = r#"    reschedule {
      attempts  = 0
      unlimited = false
    }
    task "trip" {
      driver = "exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "sleep 3; exit 1"]
      }
      restart {
        attempts = 0
        mode     = "fail"
      }
    }
    task "flush" {
      lifecycle {
        hook = "poststop"
      }
      driver = "exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "i=1000; while [ $i -lt 1040 ]; do echo \"$NOMAD_ALLOC_ID $i\" >> /data/log.txt; i=$((i+1)); sleep 0.1; done"]
      }
      volume_mount {
        volume      = "data"
        destination = "/data"
      }
    }"#;
    let spec = |name: &str, extra: &str| {
        let path = writer_job_named(c.sb.path(), name, extra);
        let hcl = std::fs::read_to_string(&path).unwrap().replace(
            "access_mode     = \"single-node-writer\"",
            "access_mode     = \"single-node-single-writer\"",
        );
        std::fs::write(&path, hcl).unwrap();
        path
    };
    let job = c.run_job(&spec("ssw", first_extra)).await;
    let old: Value = c
        .running_alloc(&job, "app", 60, "the first writer running")
        .await;
    let old_id = old["ID"].as_str().unwrap().to_string();
    c.wait_for(10, "the first writer's lines", || async {
        log_lines(&c)
            .iter()
            .any(|(a, _)| *a == old_id)
            .then_some(())
    })
    .await;
    // Not placed while the first allocation runs; placed once it is `failed`, while its
    // poststop task still writes.
    let job2 = c.run_job(&spec("ssw2", "")).await;
    // While the old poststop task still writes, the new allocation waits and the status says why.
    let waiting = c
        .wait_for(20, "the second writer waiting", || async {
            let (_, s) = c.status(0);
            let st: Value = serde_json::from_str(&s).ok()?;
            let w = st["waiting"].to_string();
            w.contains("single-node-single-writer").then_some(w)
        })
        .await;
    for part in [old_id.as_str(), "ssw", c.nodes[0].id.as_str()] {
        assert!(waiting.contains(part), "{part} not named: {waiting}");
    }
    let old_now: Value = c
        .allocs(&job)
        .await
        .into_iter()
        .find(|a| a["ID"] == old_id.as_str())
        .unwrap();
    assert_eq!(old_now["ClientStatus"], "failed", "{old_now}");
    let new: Value = c
        .running_alloc(&job2, "app", 60, "the second writer running")
        .await;
    let new_id = new["ID"].as_str().unwrap().to_string();
    c.wait_for(10, "the second writer's lines", || async {
        log_lines(&c)
            .iter()
            .any(|(a, _)| *a == new_id)
            .then_some(())
    })
    .await;
    let lines = log_lines(&c);
    let first_new = lines.iter().position(|(a, _)| *a == new_id).unwrap();
    let old_after = lines[first_new..]
        .iter()
        .filter(|(a, _)| *a == old_id)
        .count();
    assert_eq!(
        old_after, 0,
        "two writers at once: {} lines of the old allocation after the new one's first",
        old_after
    );
    assert!(
        lines.iter().any(|(a, n)| *a == old_id && *n >= 1000),
        "the old allocation's poststop wrote: {lines:?}"
    );
}

/// Issue 46: a busy unpublish follows the evidence, not its backoff. After the writer's job
/// stops, a process in a private mount namespace still holds the volume: the unpublish is
/// refused, naming it, five times (the backoff then waits 13 s or more), while a job on the
/// other node waits for the claim. Once that process dies, the unpublish comes within a
/// second or two (its exit is watched by a pidfd), and the other node takes the claim and
/// publishes. Prints the timeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_follows_the_last_holders_exit_not_the_unpublish_backoff() {
    let c = Cluster::start(2).await;
    c.create_volume(VOLUME, "single-node-writer");
    let job = c.run_job(&writer_job(c.sb.path())).await;
    let first: Value = c
        .running_alloc(&job, "app", 120, "the writer running")
        .await;
    let holder = c.node_index(first["NodeID"].as_str().unwrap());
    let other = 1 - holder;
    let mut process = support::namespace::Namespaced::holding(
        c.sb.path(),
        &c.target(holder, VOLUME),
        &c.sb.path().join("holder-ns/data"),
    );
    let pid = process.pid();
    c.stop_job(&job, false).await;
    c.run_job(&writer_job_named(
        c.sb.path(),
        "second",
        &format!(
            "    constraint {{\n      attribute = \"${{node.unique.id}}\"\n      value     = \"{}\"\n    }}",
            c.nodes[other].id
        ),
    ))
    .await;
    let refused = |c: &Cluster| {
        c.journal(holder)
            .iter()
            .filter(|e| e["event"] == "unpublish-failed")
            .count()
    };
    c.wait_for(60, "five refused unpublishes", || async {
        (refused(&c) >= 5).then_some(())
    })
    .await;
    let (_, st) = c.status(holder);
    assert!(
        st.contains(&format!("\"pid\":{pid}")) || st.contains(&format!("\"pid\": {pid}")),
        "the holder is named: {st}"
    );
    assert!(dhv_binder::node::mounts::is_mount_point(
        &c.target(holder, VOLUME)
    ));
    // Timed from its exit, not from the kill: a process in a mount namespace of its own exits
    // only once the kernel has torn the namespace down (seconds on a machine busy with
    // mounts), and until then it holds the volume.
    process.end();
    let died = now_ms();
    let unpublished = c
        .wait_for(30, "the unpublish after the holder's exit", || async {
            last_event_ms(&c, holder, "unpublish-done")
        })
        .await;
    let published = c
        .wait_for(30, "the volume published on the other node", || async {
            last_event_ms(&c, other, "publish-done")
        })
        .await;
    eprintln!(
        "holder pid {pid} killed and exited; unpublished {} ms later (after {} refusals), published on the other node {} ms later",
        unpublished.saturating_sub(died),
        refused(&c),
        published.saturating_sub(died)
    );
    assert!(
        unpublished.saturating_sub(died) < 3_000,
        "the unpublish waited {} ms after the last holder's exit (its backoff, not the evidence)",
        unpublished.saturating_sub(died)
    );
    assert!(
        published.saturating_sub(died) < 6_000,
        "the other node published {} ms after the last holder's exit",
        published.saturating_sub(died)
    );
}
