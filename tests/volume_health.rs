//! End to end: volumes that tell how they are. The real daemon against the Nomad simulator,
//! with a loop-mounted ext4 volume and a FUSE WebDAV one (`rclone mount` of a server on
//! 127.0.0.1): each published volume's usage under kubelet's metric names, read by `statfs`
//! on the agent's schedule; a hung FUSE mount is reported abnormal while the healthy volume
//! beside it keeps fresh figures, and a killed one is abnormal until it is republished; when a volume's last user leaves, its unused time starts,
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
    // So does the agent's status (`dhv-binder status -json`).
    let (_, out) = c.status(0);
    let doc: Value = serde_json::from_str(&out).unwrap();
    let usage = &doc["volume_usage"];
    assert_eq!(
        usage["default/remote"]["condition"]["class"], "inaccessible",
        "{usage}"
    );
    assert_eq!(
        usage["default/data"]["condition"]["abnormal"], false,
        "{usage}"
    );
    assert!(
        usage["default/data"]["usage"]["used_bytes"]
            .as_f64()
            .is_some_and(|u| u >= used_before + N as f64),
        "{usage}"
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
    c.wait_for(30, "the resumed mount healthy", || async {
        (sample(&metrics(&c, 0).await, abnormal, "remote") == Some(0.0)).then_some(())
    })
    .await;
    // Its FUSE server killed: abnormal within 30 s, healthy again once it is republished.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // (The agent republishes a dead mount at once: the 1 lasts until the new mount is read,
    // under a second here, so the log says it.)
    let seen = c
        .wait_for(30, "the dead mount abnormal", || async {
            std::fs::read_to_string(&c.nodes[0].log)
                .ok()?
                .lines()
                .find(|l| {
                    l.contains("volume is abnormal")
                        && l.contains("default/remote")
                        && l.contains("server is gone")
                })
                .map(str::to_string)
        })
        .await;
    assert!(seen.contains("inaccessible"), "{seen}");
    c.wait_for(60, "the republished mount healthy", || async {
        let healthy_again = std::fs::read_to_string(&c.nodes[0].log)
            .ok()?
            .lines()
            .skip_while(|l| !l.contains("server is gone"))
            .any(|l| l.contains("volume is healthy again") && l.contains("default/remote"));
        (healthy_again && sample(&metrics(&c, 0).await, abnormal, "remote") == Some(0.0))
            .then_some(())
    })
    .await;

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
    // `volume list -unused` finds it (from the node record), not the volume still in use.
    let idle = c
        .wait_for(30, "data listed as unused", || async {
            let (_, out) = c.cli(&["volume", "list", "-unused", "1s"]);
            out.contains("data").then_some(out)
        })
        .await;
    assert!(idle.contains(" ago"), "{idle}");
    assert!(!idle.contains("remote"), "{idle}");
    let (_, none) = c.cli(&["volume", "list", "-unused", "720h"]);
    assert!(none.contains("No volume unused that long"), "{none}");
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

/// The ID of volume `name` (from its record).
async fn volume_id(c: &Cluster, name: &str) -> String {
    let v = c
        .get(&format!(
            "/v1/var/dhv-binder/volumes/{name}?namespace=default"
        ))
        .await;
    v["Items"]["id"].as_str().unwrap().to_string()
}

/// Two bind volumes share their export's filesystem, so `statfs` of their mounts says the
/// same of both: the bind plugin's `stats` (a bounded walk) gives each its own usage, and
/// 8 MiB written into one shows in its figures alone. Its `health` says `degraded` while
/// the storage fences this node from the volume, and healthy once it no longer does; each
/// change is an event in `volume status -verbose` and flips the abnormal series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_volume_reports_its_own_usage_and_its_storages_health() {
    let c = Cluster::start_with(
        1,
        "",
        &[
            ("DHV_BINDER_METRICS_ADDR", "127.0.0.1:0"),
            ("DHV_BINDER_USAGE_INTERVAL", "1s"),
            ("DHV_BINDER_CHECK_INTERVAL", "1s"),
        ],
    )
    .await;
    for name in ["shared", "quiet"] {
        let out = c.create_volume(name, "single-node-writer");
        assert!(out.contains("is ready"), "{out}");
    }
    run_on(&c, "shared").await;
    run_on(&c, "quiet").await;
    let used = "dhv_binder_volume_stats_used_bytes";
    let capacity = "dhv_binder_volume_stats_capacity_bytes";
    let abnormal = "dhv_binder_volume_stats_health_status_abnormal";
    let before = c
        .wait_for(30, "both volumes' figures", || async {
            let m = metrics(&c, 0).await;
            (sample(&m, used, "shared").is_some() && sample(&m, used, "quiet").is_some())
                .then_some(m)
        })
        .await;
    let used_before = sample(&before, used, "shared").unwrap();
    assert!(
        used_before < 1048576.0,
        "the volume's own usage, not its export's filesystem's: {used_before}\n{before}"
    );
    const N: usize = 8 << 20;
    {
        let mut f = std::fs::File::create(c.target(0, "shared").join("blob")).unwrap();
        f.write_all(&vec![0x5a; N]).unwrap();
        f.sync_all().unwrap();
    }
    let after = c
        .wait_for(30, "the bind volume's usage to grow by 8 MiB", || async {
            let m = metrics(&c, 0).await;
            sample(&m, used, "shared")
                .is_some_and(|u| u >= used_before + N as f64)
                .then_some(m)
        })
        .await;
    let quiet = sample(&after, used, "quiet").unwrap();
    assert!(
        quiet < 1048576.0,
        "the other volume's figures are its own: {quiet}\n{after}"
    );
    let (shared_used, shared_cap) = (
        sample(&after, used, "shared").unwrap(),
        sample(&after, capacity, "shared").unwrap(),
    );
    let available = sample(&after, "dhv_binder_volume_stats_available_bytes", "shared").unwrap();
    assert_eq!(shared_cap, shared_used + available, "{after}");
    assert_eq!(sample(&after, abnormal, "shared"), Some(0.0), "{after}");
    eprintln!("bind used {used_before} -> {shared_used} bytes after writing {N}; the other volume {quiet}");

    // The storage fences this node from the volume (the marker `fence_node` writes, as
    // when another node took it over): its health says degraded. (Taking the volume's
    // directory away is `data-loss` to the plugin, but the agent's own mount check sees the
    // mount's root move first and republishes it: `inaccessible`.)
    let marks = c
        .export
        .join("default/.fenced")
        .join(volume_id(&c, "shared").await);
    std::fs::create_dir_all(&marks).unwrap();
    std::fs::write(marks.join(&c.nodes[0].id), b"").unwrap();
    c.wait_for(30, "the volume abnormal", || async {
        (sample(&metrics(&c, 0).await, abnormal, "shared") == Some(1.0)).then_some(())
    })
    .await;
    let (_, out) = c.status(0);
    let doc: Value = serde_json::from_str(&out).unwrap();
    let cond = &doc["volume_usage"]["default/shared"]["condition"];
    assert_eq!(cond["class"], "degraded", "{cond}");
    assert!(
        cond["message"]
            .as_str()
            .unwrap()
            .contains("fenced from the volume at the storage"),
        "{cond}"
    );
    assert_eq!(sample(&metrics(&c, 0).await, abnormal, "quiet"), Some(0.0));
    std::fs::remove_file(marks.join(&c.nodes[0].id)).unwrap();
    c.wait_for(30, "the volume healthy again", || async {
        (sample(&metrics(&c, 0).await, abnormal, "shared") == Some(0.0)).then_some(())
    })
    .await;
    // Both changes are events of the node, in `volume status -verbose`.
    let verbose = c
        .wait_for(60, "the changes of condition in -verbose", || async {
            let (_, out) = c.cli(&["volume", "status", "-verbose", "shared"]);
            let lines: Vec<&str> = out.lines().filter(|l| l.contains("condition")).collect();
            (lines
                .iter()
                .any(|l| l.contains("degraded") && l.contains("abnormal"))
                && lines.iter().any(|l| l.contains("healthy")))
            .then_some(out)
        })
        .await;
    eprintln!("{verbose}");
}

/// The orphan report: the bind plugin's `list` of its export, compared with the records,
/// names a directory no record names and a ready volume whose directory is gone; the
/// volume whose storage is there is not named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orphan_report_names_storage_without_a_record_and_a_record_without_storage() {
    let c = Cluster::start(1).await;
    for name in ["kept", "lost"] {
        let out = c.create_volume(name, "single-node-writer");
        assert!(out.contains("is ready"), "{out}");
    }
    let (kept, lost) = (volume_id(&c, "kept").await, volume_id(&c, "lost").await);
    std::fs::remove_dir(c.export.join("default").join(&lost)).unwrap();
    let stray = "0e0e0e0e-1111-4222-8333-444455556666";
    std::fs::create_dir_all(c.export.join("default").join(stray)).unwrap();
    let (plugins, export) = (
        c.plugin_dir.display().to_string(),
        c.export.display().to_string(),
    );
    let args = [
        "volume",
        "orphans",
        "-plugin",
        "bind",
        "-plugin-dir",
        &plugins,
        "-plugin-root",
        &export,
    ];
    // (Under load one run in several showed the ready record without its finding for a
    // moment; the report is read until it names both, the record list printed otherwise.)
    let found = |text: &str| {
        let line = |id: &str| {
            text.lines()
                .find(|l| l.contains(id))
                .unwrap_or_default()
                .to_string()
        };
        line(stray).starts_with("storage-without-record")
            && line(&lost).starts_with("record-without-storage")
            && line(&lost).contains("default/lost")
    };
    let text = c
        .wait_for(30, "the orphan report naming both", || async {
            let (code, text) = c.cli(&args);
            if !found(&text) {
                eprintln!(
                    "{text}\nvolume list: {}",
                    c.cli(&["volume", "list", "-json"]).1
                );
            }
            // The same in `-json`: one row each.
            let mut json = args.to_vec();
            json.push("-json");
            let rows: Value = serde_json::from_str(&c.cli(&json).1).ok()?;
            let two = rows.as_array().map(Vec::len) == Some(2);
            (code == 0 && found(&text) && two).then_some(text)
        })
        .await;
    assert!(!text.contains(&kept), "{text}");
    eprintln!("{text}");
}

/// Runs `cmd args` and returns its stdout; panics with its stderr when it fails.
fn run(cmd: &str, args: &[&str]) -> String {
    let out = std::process::Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The ext4 image of volume `name`.
async fn image_of(c: &Cluster, name: &str) -> std::path::PathBuf {
    let v = c
        .get(&format!(
            "/v1/var/dhv-binder/volumes/{name}?namespace=default"
        ))
        .await;
    let id = v["Items"]["id"].as_str().unwrap().to_string();
    c.sb.join("images/default").join(format!("{id}.img"))
}

/// Waits until node 0's journal has `n` `unpublish-done` events for `volume`.
async fn unpublished(c: &Cluster, volume: &str, n: usize) {
    let key = format!("default/{volume}");
    c.wait_for(60, &format!("{volume} unpublished ({n})"), || async {
        (c.journal(0)
            .iter()
            .filter(|e| e["event"] == "unpublish-done" && e["volume"] == key.as_str())
            .count()
            >= n)
            .then_some(())
    })
    .await;
}

/// The first line of node 0's agent log that contains `text`, once there is one.
async fn agent_log_line(c: &Cluster, what: &str, text: &str) -> String {
    c.wait_for(120, what, || async {
        std::fs::read_to_string(&c.nodes[0].log)
            .ok()?
            .lines()
            .find(|l| l.contains(text))
            .map(str::to_string)
    })
    .await
}

/// The ext4 plugin checks before it trusts: an image left unclean is checked (`e2fsck -p`)
/// before it is mounted again; damage preen cannot repair fails the publish with the
/// checker's words, the image is not mounted and the volume is abnormal (`data-loss`); an
/// image that carries a partition table and no filesystem is refused, never formatted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ext4_image_is_checked_before_it_is_mounted_and_a_foreign_one_never_formatted() {
    let c = Cluster::start(1).await;
    let images = c.sb.join("images");
    for name in ["data", "foreign"] {
        let out = c.create_volume_with(
            name,
            "single-node-writer",
            "ext4",
            &[("dir", images.to_str().unwrap()), NOBODY_UID, NOBODY_GID],
            &[],
            "capacity_min = \"32MiB\"",
        );
        assert!(out.contains("is ready"), "{out}");
    }
    let job = run_on(&c, "data").await;
    for f in ["f1", "f2"] {
        std::fs::write(c.target(0, "data").join(f), b"four").unwrap();
    }
    c.stop_job(&job, false).await;
    unpublished(&c, "data", 1).await;
    let img = image_of(&c, "data").await;
    let img_s = img.to_str().unwrap();

    // Left unclean (as by a node that died with it mounted): checked before the mount (a
    // full check stamps the superblock's "Last checked"; the seconds differ from mkfs's).
    run("debugfs", &["-w", "-R", "ssv state 0", img_s]);
    let last_checked = || {
        run("dumpe2fs", &["-h", img_s])
            .lines()
            .find(|l| l.starts_with("Last checked:"))
            .unwrap_or_default()
            .to_string()
    };
    let formatted = last_checked();
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let job = run_on(&c, "data").await;
    let checked = last_checked();
    assert_ne!(
        checked, formatted,
        "the unclean filesystem was mounted unchecked"
    );
    c.stop_job(&job, false).await;
    unpublished(&c, "data", 2).await;

    // Damage preen cannot repair (two files claim one block), left unclean: not mounted.
    let block = run("debugfs", &["-R", "bmap f1 0", img_s]);
    run(
        "debugfs",
        &[
            "-w",
            "-R",
            &format!("sif f2 block[5] {}", block.trim()),
            img_s,
        ],
    );
    run("debugfs", &["-w", "-R", "ssv state 0", img_s]);
    let example = std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl")).unwrap();
    let spec = c.sb.join("job-data-again.nomad.hcl");
    std::fs::write(
        &spec,
        example
            .replace("\"shared-data-demo\"", "\"demo-data-again\"")
            .replace("\"shared-data\"", "\"data\""),
    )
    .unwrap();
    c.run_job(&spec).await;
    // The publish fails with the checker's words (the plugin's words reach the volume's
    // callers and this node's log; the node record says only that it failed).
    let failure = agent_log_line(
        &c,
        "the damaged image's publish failing",
        "UNEXPECTED INCONSISTENCY",
    )
    .await;
    assert!(failure.contains("data-loss: e2fsck -p"), "{failure}");
    assert!(
        !dhv_binder::node::mounts::is_mount_point(&c.target(0, "data")),
        "the damaged image was mounted"
    );
    // The volume is abnormal, of class data-loss, on this node: in its status (with the
    // checker's words) and its node record (`volume status`, per node).
    let cond = c
        .wait_for(30, "the damaged volume's condition", || async {
            let (_, out) = c.status(0);
            let doc: Value = serde_json::from_str(&out).ok()?;
            let cond = doc["volume_usage"]["default/data"]["condition"].clone();
            (cond["class"] == "data-loss").then_some(cond)
        })
        .await;
    assert!(
        cond["message"]
            .as_str()
            .is_some_and(|m| m.contains("UNEXPECTED INCONSISTENCY")),
        "{cond}"
    );
    c.wait_for(30, "the node record's data-loss", || async {
        let (_, s) = c.cli(&["volume", "status", "-json", "data"]);
        let v: Value = serde_json::from_str(&s).ok()?;
        (v["Nodes"][0]["Condition"] == "data-loss").then_some(())
    })
    .await;
    c.stop_job("demo-data-again", true).await;

    // A partition table and no filesystem: refused, and the image is left as it was.
    let foreign = image_of(&c, "foreign").await;
    {
        use std::io::{Seek, SeekFrom};
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&foreign)
            .unwrap();
        let mut entry = vec![0u8, 0, 0, 0, 0x83, 0, 0, 0];
        entry.extend(2048u32.to_le_bytes());
        entry.extend(16384u32.to_le_bytes());
        f.seek(SeekFrom::Start(446)).unwrap();
        f.write_all(&entry).unwrap();
        f.seek(SeekFrom::Start(510)).unwrap();
        f.write_all(&[0x55, 0xaa]).unwrap();
        f.sync_all().unwrap();
    }
    let before = std::fs::read(&foreign).unwrap();
    let spec = c.sb.join("job-foreign.nomad.hcl");
    std::fs::write(
        &spec,
        example
            .replace("\"shared-data-demo\"", "\"demo-foreign\"")
            .replace("\"shared-data\"", "\"foreign\""),
    )
    .unwrap();
    c.run_job(&spec).await;
    let refusal = agent_log_line(&c, "the foreign image refused", "refusing to format").await;
    assert!(
        refusal.contains("(dos)"),
        "the signature is named: {refusal}"
    );
    assert!(
        std::fs::read(&foreign).unwrap() == before,
        "the foreign image was written to"
    );
    c.stop_job("demo-foreign", true).await;
}
