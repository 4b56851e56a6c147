//! The daemon goes away under running tasks, as Nomad takes it away: its whole cgroup killed
//! (an upgrade of the system job, a drain, an OOM kill). The plugins' helpers (the webdav
//! plugin's `rclone mount`) live in per-volume helper cgroups outside the agent's
//! (docs/operations/upgrades.md, "Helper cgroups"), so a FUSE volume under a writing task stays
//! mounted and served; the next agent adopts the helper, and on unpublish waits for it.

mod support;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Duration;
use support::cgroup::ScratchCgroup;
use support::cluster::Cluster;
use support::webdav::{mount_pids, WebdavServer};

/// The example job with a main task that appends a numbered, timestamped line to
/// `/data/log` every 50 ms, opening the file each time (each write goes through the mount),
/// and reports every failed write on stderr with its time.
fn writer_job(dir: &Path) -> PathBuf {
    support::jobs::line_writer_example(dir, "writer.nomad.hcl", "shared-data-demo", "shared-data")
}

/// The cgroup v2 path of `pid` (relative to the cgroup2 mount).
fn cgroup_of(pid: i32) -> String {
    dhv_binder::node::helpers::cgroup_of(pid as u32)
        .unwrap()
        .unwrap_or_default()
}

/// The numbered lines of the writer's log, in order, with their times (ns).
fn lines(text: &str) -> Vec<(u64, u128)> {
    support::jobs::log_lines(text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webdav_volume_outlives_the_kill_of_the_agents_cgroup_and_is_adopted() {
    let mut c = Cluster::start(1).await;
    let server = WebdavServer::start(&c.sb.join("webdav-root"), "dhv", "upgrade-pw");
    let out = c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "webdav",
        &[("url", &server.url), ("user", "dhv")],
        &[("password", "upgrade-pw")],
        "",
    );
    assert!(out.contains("is ready"), "{out}");
    let vol: Value = c
        .get("/v1/var/dhv-binder/volumes/shared-data?namespace=default")
        .await;
    let volume_id = vol["Items"]["id"].as_str().unwrap().to_string();
    let job = c.run_job(&writer_job(c.sb.path())).await;
    let alloc = c
        .wait_for(90, "the writer running", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| a["TaskStates"]["app"]["State"] == "running")
        })
        .await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let target = c.target(0, "shared-data");
    let log = target.join("log");
    c.wait_for(20, "the writer's first lines", || async {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|t| lines(t).len() >= 5)
    })
    .await;

    // The helper runs in the volume's helper cgroup, outside the agent's.
    let helper = mount_pids(&target);
    assert_eq!(helper.len(), 1, "one rclone serves the mount: {helper:?}");
    let helpers = c.helper_cgroups(0);
    let volume_cgroup = helpers.join(format!("default.shared-data.{volume_id}.scope"));
    let mount = dhv_binder::node::helpers::cgroup2_mount().unwrap().unwrap();
    assert_eq!(
        mount.join(cgroup_of(helper[0]).trim_start_matches('/')),
        volume_cgroup,
        "rclone is not in the volume's helper cgroup"
    );
    let agent_pid = c.nodes[0].agent.as_ref().unwrap().id() as i32;
    assert_eq!(
        mount.join(cgroup_of(agent_pid).trim_start_matches('/')),
        c.agent_cgroup(0)
    );

    // The agent's cgroup killed outright, as Nomad does when the agent's task stops.
    let killed_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    ScratchCgroup::kill(&c.agent_cgroup(0));
    let mut gone = c.nodes[0].agent.take().unwrap();
    let _ = gone.wait();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        mount_pids(&target),
        helper,
        "the helper died with the agent"
    );
    let before = lines(&std::fs::read_to_string(&log).unwrap()).len();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = lines(&std::fs::read_to_string(&log).unwrap()).len();
    assert!(
        after > before,
        "the task's writes stopped with the agent ({before} lines, then {after})"
    );

    // A new agent adopts the helper and leaves the mount alone.
    c.start_agent(0);
    let agent_log = c.nodes[0].log.clone();
    c.wait_for(30, "the new agent adopting the helper cgroup", || async {
        std::fs::read_to_string(&agent_log)
            .ok()
            .filter(|t| t.contains("adopted the helper cgroup of a published volume"))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(mount_pids(&target), helper, "the volume was mounted again");
    assert_eq!(support::cluster::mount_count(&target), 1);

    // Unpublish: the agent waits for the helper to upload and exit, then removes its cgroup.
    c.stop_job(&job, false).await;
    c.wait_for(60, "the unpublish done in the journal", || async {
        c.journal(0)
            .last()
            .filter(|e| e["event"] == "unpublish-done")
            .map(|_| ())
    })
    .await;
    assert!(mount_pids(&target).is_empty(), "rclone still runs");
    assert!(
        !volume_cgroup.exists(),
        "the helper cgroup is left after unpublish"
    );
    let publishes = c
        .journal(0)
        .iter()
        .filter(|e| e["event"] == "publish-done")
        .count();
    assert_eq!(publishes, 1, "published again: {:?}", c.journal(0));

    // Every write the task made reached the storage, in order, none failed.
    let stored = std::fs::read_to_string(server.dir.join("default").join(&volume_id).join("log"))
        .expect("the log on the WebDAV server");
    let stored = lines(&stored);
    assert!(
        stored
            .iter()
            .enumerate()
            .all(|(i, (n, _))| *n == i as u64 + 1),
        "lines missing or out of order on the server"
    );
    let stderr = std::fs::read_to_string(c.sb.join(&format!(
        "sim/node-1/alloc/{alloc_id}/alloc/logs/app.stderr.0"
    )))
    .unwrap_or_default();
    assert!(
        !stderr.contains("failed"),
        "the task saw failed writes: {stderr}"
    );
    let during: Vec<_> = stored.iter().filter(|(_, t)| *t >= killed_at).collect();
    let longest = stored
        .windows(2)
        .map(|w| w[1].1.saturating_sub(w[0].1))
        .max()
        .unwrap_or(0);
    eprintln!(
        "agent cgroup killed: {} writes after the kill reached the storage ({} bytes); longest gap between two writes {} ms (the writer pauses 50 ms)",
        during.len(),
        during.iter().map(|(n, t)| format!("line {n} {t}\n").len()).sum::<usize>(),
        longest / 1_000_000
    );
}
