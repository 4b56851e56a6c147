//! End to end: volumes that tell how they are. The real daemon against the Nomad simulator,
//! with a loop-mounted ext4 volume and a FUSE WebDAV one (`rclone mount` of a server on
//! 127.0.0.1): each published volume's usage under kubelet's metric names, read by `statfs`
//! on the agent's schedule; a hung FUSE mount is reported abnormal while the healthy volume
//! beside it keeps fresh figures; when a volume's last user leaves, its unused time starts,
//! and it holds across an agent restart.

mod support;

use serde_json::Value;
use std::io::Write;
use support::cluster::{repo, Cluster};
use support::webdav::{mount_pids, WebdavServer};

const NOBODY_UID: (&str, &str) = ("uid", "65534");
const NOBODY_GID: (&str, &str) = ("gid", "65534");

/// Kills what `rclone mount` processes still serve `target` when the test ends.
struct KillMounts(std::path::PathBuf);

impl Drop for KillMounts {
    fn drop(&mut self) {
        for pid in mount_pids(&self.0) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Resumes stopped processes when the test ends, even on failure.
struct Resume(Vec<i32>);

impl Drop for Resume {
    fn drop(&mut self) {
        for pid in &self.0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGCONT,
            );
        }
    }
}

/// The agent's metrics page (the agent runs with `DHV_BINDER_METRICS_ADDR=127.0.0.1:0`).
async fn metrics(c: &Cluster, node: usize) -> String {
    let log = std::fs::read_to_string(&c.nodes[node].log).unwrap();
    let addr = log
        .lines()
        .rfind(|l| l.contains("serving metrics at /metrics"))
        .and_then(|l| l.split("addr=").nth(1))
        .map(|a| a.split_whitespace().next().unwrap().to_string())
        .unwrap_or_else(|| panic!("no metrics address logged:\n{log}"));
    // Empty while a restarted agent has not logged its new address yet.
    match reqwest::get(format!("http://{addr}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The value of the series `family{namespace="default",volume="<volume>"...}`.
fn sample(text: &str, family: &str, volume: &str) -> Option<f64> {
    let head = format!("{family}{{namespace=\"default\",volume=\"{volume}\"");
    text.lines()
        .find(|l| l.starts_with(&head))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The example job on `volume`, as job `demo-<volume>`; returns its ID once its main task
/// runs.
async fn run_on(c: &Cluster, volume: &str) -> String {
    let example = std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl")).unwrap();
    let spec = c.sb.join(&format!("job-{volume}.nomad.hcl"));
    std::fs::write(
        &spec,
        example
            .replace("\"shared-data-demo\"", &format!("\"demo-{volume}\""))
            .replace("\"shared-data\"", &format!("\"{volume}\"")),
    )
    .unwrap();
    let job = c.run_job(&spec).await;
    c.running_alloc(&job, "app", 120, &format!("{job}'s main task running"))
        .await;
    job
}

/// Usage after N MiB are written into an ext4 volume, under kubelet's names; a hung FUSE
/// mount beside it is abnormal (1) while the ext4 one stays 0 and its figures keep moving;
/// the ext4 volume's unused time starts when its job stops and holds across a restart of
/// the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_condition_and_unused_since_of_each_volume() {
    let mut c = Cluster::start_with(
        1,
        "",
        &[
            ("DHV_BINDER_METRICS_ADDR", "127.0.0.1:0"),
            ("DHV_BINDER_USAGE_INTERVAL", "1s"),
        ],
    )
    .await;
    let images = c.sb.join("images");
    let out = c.create_volume_with(
        "data",
        "single-node-writer",
        "ext4",
        &[("dir", images.to_str().unwrap()), NOBODY_UID, NOBODY_GID],
        &[],
        "capacity_min = \"64MiB\"",
    );
    assert!(out.contains("is ready"), "{out}");
    let server = WebdavServer::start(&c.sb.join("webdav-root"), "dhv", "usage-pw");
    let out = c.create_volume_with(
        "remote",
        "single-node-writer",
        "webdav",
        &[("url", &server.url), ("user", "dhv")],
        &[("password", "usage-pw")],
        "",
    );
    assert!(out.contains("is ready"), "{out}");
    let data_job = run_on(&c, "data").await;
    run_on(&c, "remote").await;
    let remote = c.target(0, "remote");
    let _cleanup = KillMounts(remote.clone());

    let used = "dhv_binder_volume_stats_used_bytes";
    let abnormal = "dhv_binder_volume_stats_health_status_abnormal";
    let before = c
        .wait_for(30, "both volumes' figures", || async {
            let m = metrics(&c, 0).await;
            (sample(&m, used, "data").is_some() && sample(&m, abnormal, "remote") == Some(0.0))
                .then_some(m)
        })
        .await;
    let capacity = sample(&before, "dhv_binder_volume_stats_capacity_bytes", "data").unwrap();
    assert!(
        capacity > 50.0 * 1048576.0 && capacity <= 64.0 * 1048576.0,
        "the ext4 volume's capacity is its filesystem's: {capacity}\n{before}"
    );
    for family in [
        "dhv_binder_volume_stats_available_bytes",
        "dhv_binder_volume_stats_inodes",
        "dhv_binder_volume_stats_inodes_used",
        "dhv_binder_volume_stats_inodes_free",
    ] {
        assert!(
            sample(&before, family, "data").is_some(),
            "{family}:\n{before}"
        );
    }
    assert!(
        before.contains(
            r#"dhv_binder_volume_stats_used_bytes{namespace="default",volume="data",plugin="ext4"}"#
        ),
        "{before}"
    );
    let used_before = sample(&before, used, "data").unwrap();

    // The FUSE server hangs: its mount is abnormal within a few rounds.
    let pids = mount_pids(&remote);
    assert_eq!(pids.len(), 1, "{pids:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[0]),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    let _resume = Resume(pids.clone());
    c.wait_for(30, "the hung mount abnormal", || async {
        (sample(&metrics(&c, 0).await, abnormal, "remote") == Some(1.0)).then_some(())
    })
    .await;

    // 8 MiB written into the ext4 volume while the other hangs: its figures follow.
    const N: usize = 8 << 20;
    {
        let mut f = std::fs::File::create(c.target(0, "data").join("blob")).unwrap();
        f.write_all(&vec![0x5a; N]).unwrap();
        f.sync_all().unwrap();
    }
    let during = c
        .wait_for(30, "the ext4 volume's usage to grow by 8 MiB", || async {
            let m = metrics(&c, 0).await;
            sample(&m, used, "data")
                .is_some_and(|u| u >= used_before + N as f64)
                .then_some(m)
        })
        .await;
    assert_eq!(sample(&during, abnormal, "data"), Some(0.0), "{during}");
    assert_eq!(sample(&during, abnormal, "remote"), Some(1.0), "{during}");
    assert_eq!(
        sample(&during, used, "remote"),
        None,
        "a mount that does not answer has no usage:\n{during}"
    );
    eprintln!(
        "ext4 used {used_before} -> {} bytes after writing {N}; remote abnormal",
        sample(&during, used, "data").unwrap()
    );
    // The node record says so too (`volume status`, per node).
    let status = c
        .wait_for(30, "the node record's condition", || async {
            let (_, s) = c.cli(&["volume", "status", "-json", "data"]);
            let v: Value = serde_json::from_str(&s).ok()?;
            (v["Nodes"][0]["Condition"] == "healthy").then_some(v)
        })
        .await;
    assert!(
        status["Nodes"][0]["UsedPercent"]
            .as_u64()
            .is_some_and(|p| p >= 10),
        "{status}"
    );
    let (_, text) = c.cli(&["volume", "status", "remote"]);
    assert!(text.contains("inaccessible"), "{text}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[0]),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();

    // The last user of `data` leaves: its unused time starts and holds across a restart.
    let unused = "dhv_binder_volume_unused_seconds";
    let m = metrics(&c, 0).await;
    assert_eq!(sample(&m, unused, "data"), None, "in use:\n{m}");
    c.stop_job(&data_job, false).await;
    c.wait_for(60, "data unused", || async {
        sample(&metrics(&c, 0).await, unused, "data").map(|_| ())
    })
    .await;
    let since: Value = {
        let text = std::fs::read_to_string(c.nodes[0].state_dir.join("unused-since.json"))
            .expect("the unused-since times are kept in the state directory");
        serde_json::from_str(&text).unwrap()
    };
    assert!(since.to_string().contains("\"data\""), "{since}");
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    c.kill_agent(0, nix::sys::signal::Signal::SIGTERM);
    c.start_agent(0);
    let after = c
        .wait_for(60, "data unused after the restart", || async {
            sample(&metrics(&c, 0).await, unused, "data")
        })
        .await;
    assert!(
        after >= 2.0,
        "the unused time started before the restart, not at it: {after}"
    );
}
