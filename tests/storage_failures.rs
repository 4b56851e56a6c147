//! End to end: the storage path survives its own failures. The real daemon against the
//! Nomad simulator, with real FUSE mounts (`rclone mount` of a WebDAV server on 127.0.0.1)
//! and real plugin processes: an unpublish with the storage server down keeps the volume
//! published until every write is on the server (no acknowledged write lost), and a plugin
//! whose helper keeps the call's stdout open does not wedge the call.

mod support;

use serde_json::Value;
use std::time::Instant;
use support::cluster::{repo, Cluster};
use support::sandbox::script;
use support::webdav::{mount_pids, WebdavServer};

fn task_state<'a>(alloc: &'a Value, task: &str) -> &'a Value {
    &alloc["TaskStates"][task]
}

async fn volume_id(c: &Cluster, name: &str) -> String {
    let v = c
        .get(&format!(
            "/v1/var/dhv-binder/volumes/{name}?namespace=default"
        ))
        .await;
    v["Items"]["id"].as_str().unwrap().to_string()
}

/// Runs the example job until its main task runs; returns (job, allocation, node index).
async fn run_example(c: &Cluster) -> (String, Value, usize) {
    let job = c.run_job(&repo().join("jobspecs/example.nomad.hcl")).await;
    let alloc = c
        .wait_for(90, "the main task running", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| task_state(a, "app")["State"] == "running")
        })
        .await;
    let node = c.node_index(alloc["NodeID"].as_str().unwrap());
    (job, alloc, node)
}

fn count(c: &Cluster, node: usize, event: &str) -> usize {
    c.journal(node)
        .iter()
        .filter(|e| e["event"] == event)
        .count()
}

/// Kills what `rclone mount` processes still serve `target` when the test ends (a failed
/// assertion must not leave one behind).
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

/// Issue 36, item 1: with the WebDAV server down, a file written through the mount is only
/// in rclone's cache. Unpublish must not report success (nor kill the rclone that holds the
/// file): it fails, again on every retry, with the volume still mounted and claimed; once
/// the server is back the file reaches it and the unpublish completes. Bytes lost: 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_with_the_server_down_keeps_writes_that_are_only_in_the_cache() {
    let c = Cluster::start(1).await;
    let mut server = WebdavServer::start(&c.sb.join("webdav-root"), "dhv", "flush-pw");
    c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "webdav",
        &[("url", &server.url), ("user", "dhv"), ("flush_wait", "2")],
        &[("password", "flush-pw")],
        "",
    );
    let (job, alloc, node) = run_example(&c).await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let target = c.target(node, "shared-data");
    let _cleanup = KillMounts(target.clone());
    let on_server = server
        .dir
        .join("default")
        .join(volume_id(&c, "shared-data").await);
    c.wait_for(30, "the task's line on the server", || async {
        std::fs::read_to_string(on_server.join("greetings.txt"))
            .ok()
            .filter(|t| t.contains(&alloc_id))
    })
    .await;

    // The server goes down; a file is written through the mount. rclone's directory cache
    // (2 s) still lists the volume, so the write is accepted, into rclone's cache only.
    std::fs::read_dir(&target).unwrap().for_each(drop);
    server.stop();
    let data: Vec<u8> = (0..256 * 1024u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(target.join("unsaved.bin"), &data).expect("write through the mount");

    c.stop_job(&job, false).await;
    // The first refusals may be the task's own processes still holding the mount (a
    // process blocked on the FUSE mount whose server is gone dies slowly): wait for the
    // plugin's own refusal, the unsaved file.
    c.wait_for(
        90,
        "an unpublish refused for the unsaved file (or one reported done)",
        || async {
            let log = std::fs::read_to_string(&c.nodes[node].log).unwrap_or_default();
            ((count(&c, node, "unpublish-failed") >= 1
                && log.contains("are not on the WebDAV server yet"))
                || count(&c, node, "unpublish-done") > 0)
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        count(&c, node, "unpublish-done"),
        0,
        "unpublish reported done with the file only in the cache"
    );
    assert!(
        dhv_binder::node::mounts::is_mount_point(&target),
        "the volume was unmounted with unsaved data"
    );
    assert_eq!(
        mount_pids(&target).len(),
        1,
        "the rclone holding the unsaved file is gone"
    );
    let log = std::fs::read_to_string(&c.nodes[node].log).unwrap();
    assert!(
        log.contains("are not on the WebDAV server yet"),
        "the agent's log does not say why: {log}"
    );
    let (_, status) = c.status(node);
    let v: Value = serde_json::from_str(&status).unwrap();
    let m = v["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["volume"]["name"] == "shared-data")
        .unwrap_or_else(|| panic!("the volume is no longer in status: {status}"));
    assert_eq!(m["state"], "unpublishing", "{status}");
    assert!(
        m["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("unpublish")),
        "status does not mark it: {status}"
    );

    let back = Instant::now();
    server.restart();
    c.wait_for(
        120,
        "the unpublish done once the server is back",
        || async { (count(&c, node, "unpublish-done") == 1).then_some(()) },
    )
    .await;
    eprintln!(
        "unpublish completed {:.1}s after the server returned",
        back.elapsed().as_secs_f64()
    );
    let got = std::fs::read(on_server.join("unsaved.bin")).expect("the file on the server");
    let lost = data
        .len()
        .saturating_sub(got.iter().zip(&data).take_while(|(a, b)| a == b).count());
    eprintln!("bytes lost: {lost} of {}", data.len());
    assert_eq!(
        got, data,
        "the file on the server differs from what was written"
    );
    assert!(!dhv_binder::node::mounts::is_mount_point(&target));
    assert!(mount_pids(&target).is_empty());
}

/// A plugin whose `publish` starts a helper in its own session (`setsid`) that inherits the
/// call's stdout and stderr and outlives the call; otherwise a bind mount. The helper's PID
/// is appended to `<plugin_dir>/helper.pids`.
const LEAKY_HELPER_PLUGIN: &str = r#"#!/bin/sh
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
case "$1" in
fingerprint) echo '{"version":"1.0.0","deferred_bind":true}' ;;
create) echo '{"bytes":0,"context":{}}' ;;
publish)
  src="$DHV_VOLUMES_DIR/helper/$DHV_VOLUME_ID"
  mkdir -p "$src" "$DHV_TARGET_PATH"
  chown 65534:65534 "$src"
  setsid sleep 600 &
  echo $! >> "$DHV_PLUGIN_DIR/helper.pids"
  mountpoint -q "$DHV_TARGET_PATH" || mount --bind "$src" "$DHV_TARGET_PATH"
  echo "{\"path\":\"$DHV_TARGET_PATH\",\"context\":{}}" ;;
unpublish)
  while mountpoint -q "$DHV_TARGET_PATH"; do umount "$DHV_TARGET_PATH"; done
  echo '{}' ;;
delete) echo '{}' ;;
*) exit 1 ;;
esac
"#;

/// Kills the helpers a plugin recorded in `pids` when the test ends.
struct KillPids(std::path::PathBuf);

impl Drop for KillPids {
    fn drop(&mut self) {
        for pid in std::fs::read_to_string(&self.0)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
        {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Issue 36, item 2: a helper that keeps the call's stdout open does not wedge the call.
/// The publish ends when the plugin process exits with its JSON read: one publish, no
/// timeout, the task runs; the helper is named in the agent's log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_helper_holding_the_calls_stdout_does_not_wedge_the_call() {
    let c = Cluster::start_with(1, "", &[("DHV_BINDER_PLUGIN_TIMEOUT", "10s")]).await;
    let pids = c.plugin_dir.join("helper.pids");
    let _cleanup = KillPids(pids.clone());
    script(&c.plugin_dir.join("helper"), LEAKY_HELPER_PLUGIN);
    c.wait_plugin("helper").await;
    c.create_volume_with("shared-data", "single-node-writer", "helper", &[], &[], "");
    let started = Instant::now();
    let (job, _alloc, node) = run_example(&c).await;
    eprintln!(
        "the task ran {:.1}s after the job was submitted",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(
        count(&c, node, "publish-failed"),
        0,
        "{:?}",
        c.journal(node)
    );
    assert_eq!(count(&c, node, "publish-done"), 1);
    let helper: i32 = std::fs::read_to_string(&pids)
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        std::path::Path::new(&format!("/proc/{helper}")).exists(),
        "the helper (it left the call's process group) was killed"
    );
    let log = std::fs::read_to_string(&c.nodes[node].log).unwrap();
    assert!(
        log.contains("still hold its stdout or stderr") && log.contains(&format!("pid {helper}")),
        "the leftover helper is not named in the agent's log: {log}"
    );
    c.stop_job(&job, false).await;
    c.wait_for(30, "the unpublish done", || async {
        (count(&c, node, "unpublish-done") == 1).then_some(())
    })
    .await;
}

/// Sends SIGCONT to the stopped FUSE servers when the test ends (before the cluster's
/// teardown unmounts), so that nothing stays blocked on them.
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

/// Issue 36, item 3: four FUSE servers hung (SIGSTOP; as many as the probe threads) and a
/// fifth killed. The hung ones are reported hung (not acted on), the dead one is found
/// dead, republished, and its allocation restarted. Prints the time to republish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_fuse_mount_among_hung_ones_is_republished() {
    let c = Cluster::start(1).await;
    let server = WebdavServer::start(&c.sb.join("webdav-root"), "dhv", "hung-pw");
    let example = std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl")).unwrap();
    let mut jobs = Vec::new();
    for i in 1..=5 {
        let name = format!("vol-{i}");
        c.create_volume_with(
            &name,
            "single-node-writer",
            "webdav",
            &[("url", &server.url), ("user", "dhv")],
            &[("password", "hung-pw")],
            "",
        );
        let spec = c.sb.join(&format!("job-{i}.nomad.hcl"));
        std::fs::write(
            &spec,
            example
                .replace("\"shared-data-demo\"", &format!("\"demo-{i}\""))
                .replace("\"shared-data\"", &format!("\"{name}\"")),
        )
        .unwrap();
        jobs.push(c.run_job(&spec).await);
    }
    let mut allocs = Vec::new();
    for job in &jobs {
        let a = c
            .wait_for(120, &format!("{job}'s main task running"), || async {
                c.allocs(job)
                    .await
                    .into_iter()
                    .find(|a| task_state(a, "app")["State"] == "running")
            })
            .await;
        allocs.push(a["ID"].as_str().unwrap().to_string());
    }
    let targets: Vec<_> = (1..=5).map(|i| c.target(0, &format!("vol-{i}"))).collect();
    let _cleanup: Vec<_> = targets.iter().map(|t| KillMounts(t.clone())).collect();
    let mut stopped = Vec::new();
    for t in &targets[..4] {
        let pids = mount_pids(t);
        assert_eq!(pids.len(), 1, "{pids:?}");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pids[0]),
            nix::sys::signal::Signal::SIGSTOP,
        )
        .unwrap();
        stopped.push(pids[0]);
    }
    let _resume = Resume(stopped);
    // Let the hung probes take every probe thread before the fifth server dies.
    c.wait_for(30, "the four hung mounts reported", || async {
        let (_, out) = c.status(0);
        let v: Value = serde_json::from_str(&out).ok()?;
        let text = v["mount_health"].to_string();
        (1..=4)
            .all(|i| text.contains(&format!("vol-{i}")))
            .then_some(())
    })
    .await;
    let dead = mount_pids(&targets[4]);
    assert_eq!(dead.len(), 1, "{dead:?}");
    let killed = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(dead[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    c.wait_for(60, "vol-5 published again", || async {
        (c.journal(0)
            .iter()
            .filter(|e| e["event"] == "publish-done" && e["volume"] == "default/vol-5")
            .count()
            >= 2)
            .then_some(())
    })
    .await;
    let republished = killed.elapsed();
    c.wait_for(60, "vol-5's allocation restarted", || async {
        c.allocs(&jobs[4]).await.into_iter().find(|a| {
            a["ID"] == allocs[4].as_str()
                && task_state(a, "app")["Restarts"].as_u64().unwrap_or(0) >= 1
                && task_state(a, "app")["State"] == "running"
        })
    })
    .await;
    eprintln!(
        "dead mount among 4 hung ones: republished {:.1}s after its server died, allocation restarted {:.1}s after",
        republished.as_secs_f64(),
        killed.elapsed().as_secs_f64()
    );
    let (_, out) = c.status(0);
    let v: Value = serde_json::from_str(&out).unwrap();
    let health = v["mount_health"].to_string();
    assert!(
        health.contains("did not answer"),
        "hung not reported: {health}"
    );
    assert!(
        health.contains("not connected"),
        "the dead one not reported: {health}"
    );
    assert!(std::fs::metadata(&targets[4]).is_ok());
    for t in &targets[..4] {
        assert!(
            dhv_binder::node::mounts::is_mount_point(t),
            "a hung mount was touched"
        );
    }
}

/// The PIDs whose command line is exactly `args`.
fn pids_running(args: &[&str]) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let got: Vec<String> = c
                    .split(|b| *b == 0)
                    .filter(|a| !a.is_empty())
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect();
                got == args
            })
        })
        .collect()
}

/// `dhv-binder status` in its readable form, as an operator reads it.
fn status_text(c: &Cluster, node: usize) -> String {
    let out = std::process::Command::new(support::cluster::dhv_binder_bin())
        .arg("status")
        .env_clear()
        .env("DHV_BINDER_SOCKET", &c.nodes[node].socket)
        .output()
        .expect("run dhv-binder status");
    String::from_utf8_lossy(&out.stdout).into_owned()
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
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Thaws the volume when the test ends, even on failure (a write blocked on a frozen
/// filesystem would keep the test process from exiting).
struct ThawOnDrop(std::path::PathBuf);

impl Drop for ThawOnDrop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("fsfreeze")
            .arg("-u")
            .arg(&self.0)
            .output();
    }
}

/// Issue 36, item 4: the ext4 plugin's `snapshot_create` is killed (SIGKILL of its process
/// group) between its freeze and its thaw. While it runs, the volume is a reported
/// condition (`dhv-binder status`: volume, operation, since when; the gauge
/// `dhv_binder_volumes_frozen`). The agent, which started the freezing call, thaws the volume
/// as soon as the call has died and says so in its log; a task's write goes through. Later
/// attempts of the snapshot fail before freezing (so only the agent can thaw it). Prints how
/// long the volume stayed frozen after the kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_killed_while_frozen_is_thawed_by_the_agent() {
    let c = Cluster::start_with(1, "", &[("DHV_BINDER_METRICS_ADDR", "127.0.0.1:0")]).await;
    // The first snapshot_create sleeps with the volume frozen (a window to kill the call
    // in); any later one fails before it freezes anything.
    let ext4 = std::fs::read_to_string(c.plugin_dir.join("ext4")).unwrap();
    let trap = "  trap thaw EXIT\n";
    let freeze = "  for m in $FROZEN; do fsfreeze -f \"$m\" || fail \"cannot freeze $m\"; done\n";
    assert!(
        ext4.contains(trap) && ext4.contains(freeze),
        "the ext4 plugin's freeze changed: update this test"
    );
    let slow = ext4
        .replace(
            trap,
            &format!("  [ ! -e \"$DHV_PLUGIN_DIR/froze-once\" ] || fail \"this test lets only the first snapshot_create freeze the volume\"\n{trap}"),
        )
        .replace(
            freeze,
            &format!("{freeze}  if mkdir \"$DHV_PLUGIN_DIR/froze-once\" 2>/dev/null; then sleep 31; fi\n"),
        );
    script(&c.plugin_dir.join("ext4"), &slow);
    c.wait_plugin("ext4").await;
    let images = c.sb.join("images");
    c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "ext4",
        &[
            ("dir", images.to_str().unwrap()),
            support::cluster::NOBODY_UID,
            support::cluster::NOBODY_GID,
        ],
        &[],
        "capacity_min = \"64MiB\"",
    );
    let (job, _alloc, node) = run_example(&c).await;
    let target = c.target(node, "shared-data");
    let _thaw = ThawOnDrop(target.clone());
    let (code, out) = c.cli(&[
        "volume",
        "snapshot",
        "create",
        "shared-data",
        "killed",
        "--detach",
    ]);
    assert_eq!(code, 0, "{out}");
    let sleeper = c
        .wait_for(
            60,
            "the snapshot's copy running (the volume frozen)",
            || async { pids_running(&["sleep", "31"]).first().copied() },
        )
        .await;
    // Frozen is a reported condition: status names the volume, the operation and since
    // when; the gauge counts it.
    let (_, st) = c.status(node);
    let st: Value = serde_json::from_str(&st).unwrap();
    let f = &st["frozen"]["default/shared-data"];
    assert!(
        f["operation"]
            .as_str()
            .is_some_and(|o| o.starts_with("snapshot_create of snapshot ")),
        "status does not report the frozen volume: {st}"
    );
    assert!(f["since"].as_u64().is_some_and(|s| s > 0), "{st}");
    let text = status_text(&c, node);
    assert!(
        text.lines().any(|l| l.starts_with("Frozen ")
            && l.contains("default/shared-data: by snapshot_create of snapshot")),
        "{text}"
    );
    let m = metrics(&c, node).await;
    assert!(m.contains("dhv_binder_volumes_frozen 1"), "{m}");
    let stat = std::fs::read_to_string(format!("/proc/{sleeper}/stat")).unwrap();
    let pgid: i32 = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
    let killed = Instant::now();
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pgid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // A task's write: it blocks while the filesystem is frozen.
    let (tx, rx) = std::sync::mpsc::channel();
    let file = target.join("after-kill.txt");
    std::thread::spawn(move || {
        let r = std::fs::write(&file, b"written after the kill\n");
        let _ = tx.send((r.is_ok(), killed.elapsed()));
    });
    let (ok, frozen) = rx
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("the volume stayed frozen for 20 s after the snapshot call was killed");
    assert!(ok, "the write failed");
    eprintln!(
        "frozen for {:.2}s after the snapshot call was killed",
        frozen.as_secs_f64()
    );
    c.wait_for(10, "the thaw in the agent's log", || async {
        std::fs::read_to_string(&c.nodes[node].log)
            .ok()
            .filter(|l| l.contains("was left frozen by a snapshot_create call"))
            .map(|_| ())
    })
    .await;
    c.wait_for(10, "the frozen report gone", || async {
        let (_, st) = c.status(node);
        let st: Value = serde_json::from_str(&st).ok()?;
        st["frozen"].as_object()?.is_empty().then_some(())
    })
    .await;
    let m = metrics(&c, node).await;
    assert!(m.contains("dhv_binder_volumes_frozen 0"), "{m}");
    c.stop_job(&job, false).await;
    c.wait_for(60, "the unpublish done", || async {
        (count(&c, node, "unpublish-done") == 1).then_some(())
    })
    .await;
}

/// Runs a command; fails the test, saying what and why, when it cannot run or fails.
fn run(cmd: &str, args: &[&std::ffi::OsStr]) -> String {
    let out = std::process::Command::new(cmd)
        .args(args)
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {cmd} (install e2fsprogs and util-linux: scripts/install-deps): {e}")
        });
    assert!(out.status.success(), "{cmd} {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A small ext4 filesystem in an image file under its own temporary directory, loop-mounted
/// at `dir`. On drop (even on failure) every mount stacked at `dir` is detached, then the
/// loop device; declare it before the cluster, so that the agent using it is gone first.
struct LoopFs {
    _tmp: tempfile::TempDir,
    dir: std::path::PathBuf,
    device: String,
}

impl LoopFs {
    fn mount(mib: u64) -> LoopFs {
        let tmp = tempfile::tempdir().unwrap();
        let img = tmp.path().join("state.img");
        let dir = tmp.path().join("state");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::File::create(&img)
            .unwrap()
            .set_len(mib << 20)
            .unwrap();
        run(
            "mkfs.ext4",
            &["-q".as_ref(), "-F".as_ref(), img.as_os_str()],
        );
        run(
            "mount",
            &[
                "-o".as_ref(),
                "loop".as_ref(),
                img.as_os_str(),
                dir.as_os_str(),
            ],
        );
        let device = run(
            "findmnt",
            &[
                "-rn".as_ref(),
                "-o".as_ref(),
                "SOURCE".as_ref(),
                dir.as_os_str(),
            ],
        );
        LoopFs {
            _tmp: tmp,
            dir,
            device,
        }
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        while dhv_binder::node::mounts::is_mount_point(&self.dir) {
            if nix::mount::umount2(&self.dir, nix::mount::MntFlags::MNT_DETACH).is_err() {
                break;
            }
        }
        // `mount -o loop` sets autoclear; detach it in case the last user is gone already.
        let _ = std::process::Command::new("losetup")
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .args(["-d", &self.device])
            .output();
    }
}

/// Issue 36, item 5: the agent's state directory (an 8 MiB loop-mounted ext4) fills up.
/// The journal write fails into a reported condition (status `journal.failing`, metric),
/// logged once a minute at most (not once per attempt); a new publish waits with the reason
/// while the published volume stays mounted; once space returns the agent converges by
/// itself (the waiting publish succeeds) without a restart. The journal still decodes: a
/// restarted agent finds every volume published. (A read-only state directory, EROFS, goes
/// through the same path:
/// `agent::core::tests::a_read_only_state_directory_is_reported_and_recovered_after_remount_rw`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_state_disk_is_reported_paced_and_recovered_without_a_restart() {
    let fs = LoopFs::mount(8);
    let mut c = Cluster::start_with(1, "", &[("DHV_BINDER_METRICS_ADDR", "127.0.0.1:0")]).await;
    // The agent again, its state directory on the loop-mounted filesystem.
    c.kill_agent(0, nix::sys::signal::Signal::SIGTERM);
    let state = fs.dir.clone();
    c.nodes[0].state_dir = state.clone();
    c.start_agent(0);
    c.wait_plugin("bind").await;
    c.create_volume("shared-data", "single-node-writer");
    let (_job, alloc, node) = run_example(&c).await;
    assert_eq!(node, 0);
    let target = c.target(0, "shared-data");
    assert_eq!(support::cluster::mount_count(&target), 1, "{alloc}");

    // The volumes the later jobs ask for, with their placeholders (directories on the state
    // filesystem, which take blocks on ext4) made while there is space.
    for v in ["second-0", "second-1", "second-2", "second-3", "third-data"] {
        c.create_volume(v, "single-node-writer");
    }
    c.wait_for(60, "the placeholders registered", || async {
        let (_, out) = c.status(0);
        let v: Value = serde_json::from_str(&out).ok()?;
        let vols = v["volumes"].as_array()?;
        (vols.len() == 6 && vols.iter().all(|v| !v["placeholder_id"].is_null())).then_some(())
    })
    .await;

    // Fill the state filesystem until ENOSPC.
    let filler = state.join("filler");
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&filler).unwrap();
        // Down to single bytes: the filesystem ends with no free block.
        for size in [64 * 1024, 512, 1] {
            let block = vec![0u8; size];
            loop {
                match f.write_all(&block).and_then(|_| f.sync_all()) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(28) => break,
                    Err(e) => panic!("filling the state filesystem: {e}"),
                }
            }
        }
    }
    // The new job asks for four volumes: their intents need more than the slack in the
    // last pages of the journal's files (a small append there still succeeds).
    let mut extra = String::new();
    for i in 0..4 {
        extra.push_str(&format!(
            "    volume \"x{i}\" {{\n      type = \"host\"\n      source = \"second-{i}\"\n      access_mode = \"single-node-writer\"\n      attachment_mode = \"file-system\"\n    }}\n"
        ));
    }
    let spec = c.sb.join("second.nomad.hcl");
    let text = std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl"))
        .unwrap()
        .replace("\"shared-data-demo\"", "\"second-demo\"")
        .replace("\"shared-data\"", "\"second-0\"")
        .replacen(
            "    volume \"data\" {",
            &format!("{extra}    volume \"data\" {{"),
            1,
        );
    std::fs::write(&spec, text).unwrap();
    let second = c.run_job(&spec).await;
    let st = c
        .wait_for(
            60,
            "status saying the journal cannot be written",
            || async {
                let (_, out) = c.status(0);
                let v: Value = serde_json::from_str(&out).ok()?;
                (v["journal"]["failing"] == true).then_some(v)
            },
        )
        .await;
    eprintln!("journal: {}", st["journal"]);
    // A publish that starts now needs a durable intent: it waits, with the reason.
    let spec3 = c.sb.join("third.nomad.hcl");
    let text = std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl"))
        .unwrap()
        .replace("\"shared-data-demo\"", "\"third-demo\"")
        .replace("\"shared-data\"", "\"third-data\"");
    std::fs::write(&spec3, text).unwrap();
    let third = c.run_job(&spec3).await;
    c.wait_for(60, "the third volume waiting on the journal", || async {
        let (_, out) = c.status(0);
        let v: Value = serde_json::from_str(&out).ok()?;
        v["waiting"].as_array()?.iter().find(|w| {
            w["volume"] == "default/third-data"
                && w["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("state journal cannot be written"))
        })?;
        Some(())
    })
    .await;
    let log_len = |c: &Cluster| {
        std::fs::read_to_string(&c.nodes[0].log)
            .unwrap_or_default()
            .lines()
            .count()
    };
    let journal_lines = |c: &Cluster| {
        std::fs::read_to_string(&c.nodes[0].log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("journal write"))
            .count()
    };
    let (l0, j0, t0) = (log_len(&c), journal_lines(&c), Instant::now());
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    let (l1, j1, dt) = (log_len(&c), journal_lines(&c), t0.elapsed().as_secs_f64());
    eprintln!(
        "while full: {:.0} log lines/min in all, {:.0} journal failure lines/min",
        (l1 - l0) as f64 * 60.0 / dt,
        (j1 - j0) as f64 * 60.0 / dt
    );
    assert!(
        j1 - j0 <= 1,
        "journal failures logged per attempt: {}",
        j1 - j0
    );
    assert!(
        (l1 - l0) as f64 * 60.0 / dt < 600.0,
        "the log grows fast while full: {} lines in {dt:.1}s",
        l1 - l0
    );
    let (_, st) = c.status(0);
    let st: Value = serde_json::from_str(&st).unwrap();
    assert!(
        st["journal"]["failed_writes"].as_u64().unwrap() >= 2,
        "{st}"
    );
    let page = metrics(&c, 0).await;
    assert!(
        page.contains("dhv_binder_journal_write_failing 1"),
        "{page}"
    );
    assert_eq!(support::cluster::mount_count(&target), 1, "kept published");
    assert!(
        c.allocs(&third)
            .await
            .iter()
            .all(|a| task_state(a, "app")["State"] != "running"),
        "a publish ran without a durable intent"
    );

    // Space returns: the waiting publish succeeds without a restart.
    std::fs::remove_file(&filler).unwrap();
    let t = Instant::now();
    for job in [&second, &third] {
        c.wait_for(60, "the jobs' tasks running", || async {
            c.allocs(job)
                .await
                .into_iter()
                .find(|a| task_state(a, "app")["State"] == "running")
        })
        .await;
    }
    eprintln!(
        "converged {:.1}s after space returned",
        t.elapsed().as_secs_f64()
    );
    let (_, st) = c.status(0);
    let st: Value = serde_json::from_str(&st).unwrap();
    assert_eq!(st["journal"]["failing"], false, "{st}");
    assert_eq!(support::cluster::mount_count(&target), 1);
    assert!(!c.journal(0).is_empty(), "the history still decodes");
    // The history lost nothing: each volume published now has, after its last
    // `publish-intent`, its `publish-done` (an outcome whose commit failed while the disk
    // was full is written with the next commit that succeeds).
    let published: Vec<String> = st["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["state"] == "published")
        .filter_map(|m| m["volume"]["name"].as_str().map(|n| format!("default/{n}")))
        .collect();
    assert_eq!(published.len(), 6, "{st}");
    let history = c.journal(0);
    for v in &published {
        let events: Vec<&str> = history
            .iter()
            .filter(|e| e["volume"] == v.as_str())
            .filter_map(|e| e["event"].as_str())
            .collect();
        let last_intent = events.iter().rposition(|e| *e == "publish-intent");
        assert!(
            last_intent.is_some_and(|i| events[i..].contains(&"publish-done")),
            "{v}: published, but journal.log has {events:?}"
        );
    }

    // Never truncated nor undecodable: a restarted agent reads every volume back published.
    c.kill_agent(0, nix::sys::signal::Signal::SIGTERM);
    c.start_agent(0);
    let names = [
        "shared-data",
        "second-0",
        "second-1",
        "second-2",
        "second-3",
        "third-data",
    ];
    c.wait_for(30, "the restarted agent's status", || async {
        let (_, out) = c.status(0);
        let v: Value = serde_json::from_str(&out).ok()?;
        let published: Vec<&str> = v["mounts"]
            .as_array()?
            .iter()
            .filter(|m| m["state"] == "published")
            .filter_map(|m| m["volume"]["name"].as_str())
            .collect();
        names.iter().all(|n| published.contains(n)).then_some(())
    })
    .await;
    c.kill_agent(0, nix::sys::signal::Signal::SIGTERM);
}

/// Issue 36, item 6: the agent restarts while its node is cut off from the servers (the
/// simulator's partition: every request through the node's client fails, so the
/// allocations list and the volume records cannot be read). The volume it had published
/// stays mounted, and `dhv-binder status` says why it is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_kept_after_a_restart_with_an_incomplete_picture_says_why_in_status() {
    let mut c = Cluster::start(1).await;
    c.wait_plugin("bind").await;
    c.create_volume("shared-data", "single-node-writer");
    // The example job without its `disconnect { stop_on_client_after }`: a partition longer
    // than that would stop its task on the client (as Nomad does), and the volume would
    // rightly be unpublished once the picture is complete; this test is about the kept one.
    let example = std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl")).unwrap();
    let start = example
        .find("    disconnect {")
        .expect("the example's disconnect block");
    let end = start + example[start..].find("    }\n").unwrap() + "    }\n".len();
    let spec = c.sb.join("example-no-stop.nomad.hcl");
    std::fs::write(&spec, format!("{}{}", &example[..start], &example[end..])).unwrap();
    let job = c.run_job(&spec).await;
    let alloc = c
        .wait_for(90, "the main task running", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| task_state(a, "app")["State"] == "running")
        })
        .await;
    let node = c.node_index(alloc["NodeID"].as_str().unwrap());
    let target = c.target(node, "shared-data");
    c.kill_agent(node, nix::sys::signal::Signal::SIGTERM);
    c.put(
        &format!("/v1/sim/node/{}/partition?on=true", c.nodes[node].id),
        Value::Null,
    )
    .await;
    c.start_agent(node);
    let line = c
        .wait_for(30, "status saying why the volume is kept", || async {
            status_text(&c, node)
                .lines()
                .find(|l| {
                    l.starts_with("Waiting ") && l.contains("default/shared-data: kept published")
                })
                .map(str::to_string)
        })
        .await;
    eprintln!("{line}");
    assert!(
        line.contains("have not been") && line.contains("nothing is unpublished until"),
        "{line}"
    );
    let (_, st) = c.status(node);
    let st: Value = serde_json::from_str(&st).unwrap();
    assert_eq!(st["view"]["complete"], false, "{st}");
    assert_eq!(support::cluster::mount_count(&target), 1, "kept published");
    c.put(
        &format!("/v1/sim/node/{}/partition?on=false", c.nodes[node].id),
        Value::Null,
    )
    .await;
    c.wait_for(
        30,
        "the reason gone once the picture is complete",
        || async {
            let (_, st) = c.status(node);
            let st: Value = serde_json::from_str(&st).ok()?;
            (st["view"]["complete"] == true
                && !st["waiting"].to_string().contains("kept published"))
            .then_some(())
        },
    )
    .await;
    // Unless the claim was fenced: a claim restored after a restart whose first renewal
    // fails (here: the partition) is fenced at once, its writer killed (fail closed).
    let fenced = c.journal(node).iter().any(|e| e["event"] == "fenced");
    if !fenced {
        assert_eq!(support::cluster::mount_count(&target), 1, "still published");
    }
}

/// Issue 46: the agent restarts after the volume's record was purged (its variable deleted)
/// while the job that uses it still runs: the volume is kept published, and status says why
/// (the record is gone, the allocation still runs with it mounted), naming the allocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_kept_after_a_restart_with_its_record_purged_says_why_in_status() {
    let mut c = Cluster::start(1).await;
    c.wait_plugin("bind").await;
    c.create_volume("shared-data", "single-node-writer");
    let (_job, alloc, node) = run_example(&c).await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let target = c.target(node, "shared-data");
    c.kill_agent(node, nix::sys::signal::Signal::SIGTERM);
    let r = reqwest::Client::new()
        .delete(format!(
            "{}/v1/var/dhv-binder/volumes/shared-data?namespace=default",
            c.server
        ))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    c.start_agent(node);
    let line = c
        .wait_for(30, "status saying why the volume is kept", || async {
            status_text(&c, node)
                .lines()
                .find(|l| l.starts_with("Waiting ") && l.contains("default/shared-data: "))
                .map(str::to_string)
        })
        .await;
    eprintln!("{line}");
    assert!(
        line.contains("volume record is gone") && line.contains(&alloc_id),
        "{line}"
    );
    assert_eq!(support::cluster::mount_count(&target), 1, "kept published");
}
