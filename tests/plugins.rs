//! The conformance kit (`dhv-binder plugin check`) against every reference plugin, with real
//! mounts (bind, loop-mounted ext4, a FUSE WebDAV remote served on 127.0.0.1), and against
//! a plain plugin written to Nomad's non-deferred DHV contract.

mod support;

use std::path::Path;
use std::process::Command;
use support::cgroup::ScratchCgroup;
use support::cluster::{dhv_binder_bin, repo};
use support::sandbox::{script, Sandbox};
use support::webdav::WebdavServer;

/// Runs the kit on `plugin`; returns (exit code, report). The report is printed, so that a
/// test run shows it.
/// The kit's scratch cgroups live under a scratch cgroup of the test's own.
fn check(sb: &Sandbox, plugin: &Path, args: &[&str]) -> (i32, String) {
    let cgroup = ScratchCgroup::new();
    let out = Command::new(dhv_binder_bin())
        .args(["plugin", "check"])
        .arg(plugin)
        .args(["--timeout", "30s", "--scratch"])
        .arg(sb.join("scratch"))
        .arg("--cgroup")
        .arg(&cgroup.path)
        .args(args)
        .env_clear()
        .output()
        .expect("run dhv-binder plugin check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    (out.status.code().unwrap_or(-1), text)
}

/// Asserts the kit passed every base rule, and passed `extra` (optional operations) too.
fn assert_conforms(code: i32, report: &str, extra: &[&str]) {
    assert_eq!(code, 0, "the plugin does not conform:\n{report}");
    assert!(!report.contains("FAIL"), "{report}");
    for rule in [
        "fingerprint",
        "deferred_bind",
        "capabilities",
        "JSON input parsed",
        "error classes",
        "create x10",
        "publish x10",
        "unpublish x10",
        "data kept across publishes",
        "unpublish of nothing",
        "publish to occupied target",
        "read-only publish",
        "unpublish while in use",
        "concurrent calls",
        "killed by the timeout",
        "helper outlives the caller",
        "delete x10",
        "delete of nothing",
        "unknown operation refused",
        "output shape",
        "helpers do not hold the output",
        "within the timeout",
        "nothing left mounted",
    ]
    .iter()
    .chain(extra)
    {
        assert!(
            report.contains(&format!("PASS  {rule} ")),
            "rule {rule:?} did not pass:\n{report}"
        );
    }
    assert!(report.contains("deferred: yes"), "{report}");
}

#[test]
fn bind_plugin_conforms() {
    let sb = Sandbox::new();
    let export = sb.join("export");
    std::fs::create_dir_all(&export).unwrap();
    let (code, report) = check(
        &sb,
        &repo().join("plugins/bind"),
        &[
            "--param",
            &format!("export={}", export.display()),
            "--param",
            "uid=65534",
            "--param",
            "gid=65534",
            "--param",
            "mode=0750",
            // A local plugin keeps no cache the kit could cut off from its storage.
            "-skip",
            "unpublish that cannot flush",
        ],
    );
    assert_conforms(
        code,
        &report,
        &[
            "owner and mode",
            "snapshot x2",
            "create from snapshot",
            "snapshot_delete x2",
            "clone",
            "paths confined",
            "symlink race",
            "fence",
            "fence x2",
            "fence of nothing",
            // Its own usage by a bounded walk, its health, its volumes listed.
            "stats",
            "health",
            "list",
            // A deny marker per fenced node, which its publish checks.
            "fence_node and unfence_node x2",
        ],
    );
    assert!(report.contains("SKIP  expand "), "{report}");
    assert!(
        report.contains("SKIP  unpublish that cannot flush    -skip: the plugin's author says it does not apply")
            && report.contains("; skipped by -skip: unpublish that cannot flush\n")
            && report.contains("deferred: yes (every rule run passed; not run by -skip: unpublish that cannot flush)"),
        "{report}"
    );
}

/// Issue 46 §4: without a `--param` naming the storage directory's owner and mode, and with
/// no URL to cut, the rules `owner and mode` and `unpublish that cannot flush` cannot run:
/// the run fails, saying what each needs, and `deferred: yes` is not printed. (The
/// whole kit, as an author runs it first; `-skip` is shown by `bind_plugin_conforms`.)
#[test]
fn a_rule_that_cannot_run_fails_the_kit_unless_the_author_skips_it() {
    let sb = Sandbox::new();
    let export = sb.join("export");
    std::fs::create_dir_all(&export).unwrap();
    let (code, report) = check(
        &sb,
        &repo().join("plugins/bind"),
        &["--param", &format!("export={}", export.display())],
    );
    assert_eq!(code, 1, "a rule that never ran passed the kit:\n{report}");
    assert!(
        report.contains("FAIL  owner and mode                 not run: no --param uid=, gid= or mode= given to check"),
        "{report}"
    );
    assert!(
        report.contains("FAIL  unpublish that cannot flush    not run: no http(s):// parameter"),
        "{report}"
    );
    assert!(
        report.contains("could not run: owner and mode, unpublish that cannot flush"),
        "{report}"
    );
    assert!(
        report.contains("deferred: declared, but NOT conforming: owner and mode, unpublish that cannot flush did not pass"),
        "{report}"
    );
    assert!(!report.contains("deferred: yes"), "{report}");
    // Every rule that could run still ran and passed.
    assert!(report.contains("PASS  symlink race "), "{report}");
    assert!(report.contains("PASS  paths confined "), "{report}");
}

#[test]
fn ext4_plugin_conforms() {
    let sb = Sandbox::new();
    // The images directory as a parameter: the kit races a directory beneath it.
    let images = sb.join("images");
    std::fs::create_dir_all(&images).unwrap();
    let (code, report) = check(
        &sb,
        &repo().join("plugins/ext4"),
        &[
            "--capacity",
            &(64u64 << 20).to_string(),
            "--param",
            &format!("dir={}", images.display()),
            "--param",
            "uid=65534",
            "--param",
            "gid=65534",
            "--param",
            "mode=0770",
            "-skip",
            "unpublish that cannot flush",
        ],
    );
    assert_conforms(
        code,
        &report,
        &[
            "owner and mode",
            "snapshot x2",
            "snapshot_list",
            "create from snapshot",
            "snapshot_delete x2",
            "clone",
            "expand",
            "paths confined",
            "symlink race",
            "foreign signature refused",
            "unclean filesystem checked",
        ],
    );
    // No fence of its own (the agent's remount and kill stand alone): not offered, not failed.
    assert!(report.contains("SKIP  fence "), "{report}");
}

/// Issue 46: the ext4 plugin refuses to create a volume without `dir`: the images would live
/// in this node's own volumes dir, which no other node of the cluster sees.
#[test]
fn the_ext4_plugin_refuses_a_volume_without_a_dir() {
    let sb = Sandbox::new();
    let volumes = sb.join("volumes");
    std::fs::create_dir_all(&volumes).unwrap();
    let out = Command::new(repo().join("plugins/ext4"))
        .arg("create")
        .env_clear()
        .env("DHV_OPERATION", "create")
        .env("DHV_BINDER", dhv_binder_bin())
        .env("DHV_VOLUMES_DIR", &volumes)
        .env("DHV_ALLOWED_ROOTS", &volumes)
        .env("DHV_NAMESPACE", "default")
        .env("DHV_VOLUME_NAME", "local")
        .env("DHV_VOLUME_ID", "0e3a5f7c-44a7-4c1e-9d1e-6b7a1c2d3e4f")
        .env("DHV_CAPACITY_MIN_BYTES", (64u64 << 20).to_string())
        .env("DHV_PARAMETERS", r#"{"uid":"65534"}"#)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "created without dir: {stdout}");
    assert!(
        stdout.contains("parameter dir is not set") && stdout.contains("every node"),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read_dir(&volumes).unwrap().count(),
        0,
        "an image was made in the node's own volumes dir"
    );
}

/// The ext4 plugin never checks a filesystem that is still live. A mount lazily detached
/// while a process holds a file in it is in no mount table, yet its filesystem is mounted
/// (read-write, its journal in use): `e2fsck -p` of the image file would replay the journal
/// under it. The plugin checks through the loop device, which e2fsck opens exclusively, and
/// refuses the publish as "not now" (exit 75) until the old mount is gone; then it publishes.
#[test]
fn the_ext4_plugin_never_checks_a_filesystem_still_mounted_out_of_sight() {
    let sb = Sandbox::new();
    let (volumes, images) = (sb.join("volumes"), sb.join("images"));
    std::fs::create_dir_all(&volumes).unwrap();
    std::fs::create_dir_all(&images).unwrap();
    let (first, second) = (sb.join("first"), sb.join("second"));
    std::fs::create_dir_all(&first).unwrap();
    std::fs::create_dir_all(&second).unwrap();
    let params = format!(r#"{{"dir":"{}"}}"#, images.display());
    let call = |op: &str, target: &Path, context: &str| {
        let out = Command::new(repo().join("plugins/ext4"))
            .arg(op)
            .env_clear()
            .env("DHV_OPERATION", op)
            .env("DHV_BINDER", dhv_binder_bin())
            .env("DHV_VOLUMES_DIR", &volumes)
            .env("DHV_ALLOWED_ROOTS", &images)
            .env("DHV_NAMESPACE", "default")
            .env("DHV_VOLUME_NAME", "live")
            .env("DHV_VOLUME_ID", "3c1d2e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f")
            .env("DHV_CAPACITY_MIN_BYTES", (32u64 << 20).to_string())
            .env("DHV_PARAMETERS", &params)
            .env("DHV_CONTEXT", context)
            .env("DHV_TARGET_PATH", target)
            .env("DHV_READ_ONLY", "false")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), text)
    };
    let (code, created) = call("create", &first, "null");
    assert_eq!(code, Some(0), "{created}");
    let context = serde_json::from_str::<serde_json::Value>(created.lines().next().unwrap())
        .unwrap()["context"]
        .to_string();
    let (code, out) = call("publish", &first, &context);
    assert_eq!(code, Some(0), "{out}");
    // A holder keeps the filesystem alive; the mount is detached lazily, out of every table.
    let held = std::fs::File::create(first.join("held")).unwrap();
    nix::mount::umount2(&first, nix::mount::MntFlags::MNT_DETACH).unwrap();
    let refused = call("publish", &second, &context);
    let mounted = dhv_binder::node::mounts::is_mount_point(&second);
    drop(held);
    // Now free: published, then unpublished (the loop device detached).
    let (code2, out2) = call("publish", &second, &context);
    let (code3, out3) = call("unpublish", &second, &context);
    assert_eq!(
        refused.0,
        Some(75),
        "a publish over a live filesystem was not refused as not now: {}",
        refused.1
    );
    assert!(
        refused.1.contains("still mounted") && !mounted,
        "{}",
        refused.1
    );
    assert_eq!(code2, Some(0), "{out2}");
    assert_eq!(code3, Some(0), "{out3}");
    assert!(
        dhv_binder::node::mounts::mounts_under(sb.path()).is_empty(),
        "mounts left behind"
    );
}

#[test]
fn webdav_fuse_plugin_conforms() {
    let sb = Sandbox::new();
    let server = WebdavServer::start(&sb.join("webdav-root"), "dhv", "conformance-pw");
    // Secrets come from a file, never argv.
    let secrets = sb.join("secrets.txt");
    std::fs::write(&secrets, "password=conformance-pw\n").unwrap();
    let (code, report) = check(
        &sb,
        &repo().join("plugins/webdav"),
        &[
            "--param",
            &format!("url={}", server.url),
            "--param",
            "user=dhv",
            // An unpublish with unsaved writes fails after 3 s (not the default 20 s).
            "--param",
            "flush_wait=3",
            "--secrets-file",
            secrets.to_str().unwrap(),
            // Its storage is the server's, reached by URL: no node path to confine or race,
            // and rclone sets no owner or mode.
            "-skip",
            "paths confined",
            "-skip",
            "symlink race",
            "-skip",
            "owner and mode",
        ],
    );
    // Its fence aborts the FUSE connection, with the server unreachable; its unpublish
    // fails while a write is only in rclone's cache.
    assert_conforms(
        code,
        &report,
        &[
            "fence",
            "fence x2",
            "fence of nothing",
            "unpublish that cannot flush",
            "refresh",
            "refresh of nothing",
        ],
    );
    // Its rclone and its credential proxy run in the volume's helper cgroup: they outlived
    // the caller's.
    assert!(
        report.contains("PASS  helper outlives the caller     2 helper process(es)"),
        "{report}"
    );
    // It declares no other optional operation: none is called.
    for rule in [
        "snapshot x2",
        "clone",
        "expand",
        "fence_node and unfence_node x2",
    ] {
        assert!(report.contains(&format!("SKIP  {rule} ")), "{report}");
    }
    // Every rclone and credential proxy of the kit's volumes ended.
    assert_eq!(
        left_running(&sb.join("scratch")),
        Vec::<String>::new(),
        "left running after the kit"
    );
    // The volume's directory lived on the server, and delete removed it.
    assert!(server.dir.join("default").is_dir());
    assert_eq!(
        std::fs::read_dir(server.dir.join("default"))
            .unwrap()
            .count(),
        0,
        "delete left the volume's directory on the server"
    );
}

/// The webdav plugin with the unpublish of the issue 36 report: when the real unpublish
/// fails (rclone's cache still holds writes), it ends the mount's rclone, detaches the mount
/// and reports success anyway.
const FORGETFUL_UNPUBLISH: &str = r#"#!/bin/sh
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
op="${1:-${DHV_OPERATION:-}}"
if [ "$op" = unpublish ] && ! WEBDAV "$@" >/dev/null; then
  tgt="$DHV_TARGET_PATH"
  pkill -KILL -f "^rclone mount [^ ]* $tgt " 2>/dev/null || true
  while findmnt -rn --mountpoint "$tgt" >/dev/null; do umount -l "$tgt"; done
  echo '{}'
  exit 0
fi
exec WEBDAV "$@"
"#;

/// Issue 36: a plugin whose unpublish reports success while a write acknowledged through
/// the mount is only in its cache (the storage unreachable) fails the kit's rule
/// `unpublish that cannot flush`.
#[test]
fn an_unpublish_that_forgets_unsaved_writes_fails_the_kit() {
    let sb = Sandbox::new();
    let server = WebdavServer::start(&sb.join("webdav-root"), "dhv", "conformance-pw");
    let secrets = sb.join("secrets.txt");
    std::fs::write(&secrets, "password=conformance-pw\n").unwrap();
    let plugin = sb.join("plugins/forgetful");
    script(
        &plugin,
        &FORGETFUL_UNPUBLISH.replace("WEBDAV", repo().join("plugins/webdav").to_str().unwrap()),
    );
    let (code, report) = check(
        &sb,
        &plugin,
        &[
            "--param",
            &format!("url={}", server.url),
            "--param",
            "user=dhv",
            "--param",
            "flush_wait=3",
            "--secrets-file",
            secrets.to_str().unwrap(),
            "-rule",
            "unpublish that cannot flush",
        ],
    );
    assert_eq!(code, 1, "{report}");
    let line = report
        .lines()
        .find(|l| !l.starts_with("-rule:") && l.contains(" unpublish that cannot flush "))
        .unwrap_or_else(|| panic!("no such rule:\n{report}"));
    assert!(
        line.starts_with("FAIL")
            && line.contains("unpublish reported success")
            && line.contains("with the storage unreachable"),
        "{line}"
    );
    // It killed the mount's rclone: the rclone's credential proxy ended with it.
    assert_eq!(
        left_running(&sb.join("scratch")),
        Vec::<String>::new(),
        "left running after the kit"
    );
}

/// Calls the webdav plugin directly for volume `id` of namespace `default` (the server at
/// `url`, user `dhv`, password `pw`, flush_wait 2 s), with `target` as its target and
/// `cgroup`, when given, as its helper cgroup; returns (success, stdout and stderr).
fn webdav_call(
    sb: &Sandbox,
    url: &str,
    id: &str,
    target: &Path,
    cgroup: Option<&Path>,
    op: &str,
) -> (bool, String) {
    let mut cmd = Command::new(repo().join("plugins/webdav"));
    cmd.arg(op)
        .env_clear()
        .env("DHV_OPERATION", op)
        .env("DHV_VOLUMES_DIR", sb.join("volumes"))
        .env("DHV_NAMESPACE", "default")
        .env("DHV_VOLUME_NAME", "webdav-direct")
        // It starts the volume's credential proxy (`dhv-binder helper credential-proxy`).
        .env("DHV_BINDER", dhv_binder_bin())
        .env("DHV_VOLUME_ID", id)
        .env(
            "DHV_PARAMETERS",
            format!(r#"{{"url":"{url}","user":"dhv","flush_wait":"2"}}"#),
        )
        .env("DHV_SECRETS", r#"{"password":"pw"}"#)
        .env("DHV_TARGET_PATH", target)
        .env("DHV_READ_ONLY", "false");
    if let Some(c) = cgroup {
        cmd.env("DHV_HELPER_CGROUP", c);
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// A process started by a test, in a process group of its own, whose whole group is
/// killed when dropped: on success and on a failed assertion alike.
struct GroupGuard(std::process::Child);

impl GroupGuard {
    fn spawn(cmd: &mut Command) -> GroupGuard {
        use std::os::unix::process::CommandExt;
        GroupGuard(cmd.process_group(0).spawn().unwrap())
    }
}

impl Drop for GroupGuard {
    fn drop(&mut self) {
        let group = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        let _ = self.0.wait();
    }
}

/// The processes whose command line names something under `dir` (a test's own sandbox):
/// what a test's plugin calls left running, "PID command line".
fn processes_naming(dir: &Path) -> Vec<String> {
    let want = dir.to_string_lossy().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            text.contains(&want).then(|| format!("{pid} {text}"))
        })
        .collect()
}

/// Waits up to 10 s until no process names `dir`; returns those still running then.
fn left_running(dir: &Path) -> Vec<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let left = processes_naming(dir);
        if left.is_empty() || std::time::Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Issue 44 §7: the webdav plugin knows the rclone it started by the PID and start time it
/// recorded, not by a command line any local process can imitate. A process running as
/// `rclone mount <the volume's remote> <its target> …` (a shell reading a script named
/// `mount`) neither keeps the unpublish waiting for it to "finish uploading" (it failed after
/// `flush_wait`, "rclone is still uploading"), nor is killed by the next publish as a stale
/// rclone of the volume.
#[test]
fn webdav_is_not_fooled_by_a_process_that_imitates_its_rclone() {
    let sb = Sandbox::new();
    let server = WebdavServer::start(&sb.join("webdav-root"), "dhv", "pw");
    let target = sb.join("target");
    std::fs::create_dir_all(&target).unwrap();
    let id = "0e3a5f7c-44a7-4c1e-9d1e-6b7a1c2d3e4f";
    let call = |op: &str| webdav_call(&sb, &server.url, id, &target, None, op);
    assert!(call("create").0);
    let (ok, out) = call("publish");
    assert!(ok, "{out}");
    // The imitation: argv "rclone mount :webdav:default/<id> <target> --imitation", a shell
    // running ./mount (a sleep) from its working directory. Its group (the shell and its
    // sleep) is killed when the guard drops, whether the test passes or not.
    let fake = sb.join("imitation");
    std::fs::create_dir_all(&fake).unwrap();
    std::fs::write(fake.join("mount"), "sleep 600\n").unwrap();
    let mut imitation = GroupGuard::spawn(
        std::os::unix::process::CommandExt::arg0(&mut Command::new("/bin/sh"), "rclone")
            .arg("mount")
            .arg(format!(":webdav:default/{id}"))
            .arg(&target)
            .arg("--imitation")
            .current_dir(&fake),
    );
    // Its command line is set a moment after spawn() returns (the exec still loading it).
    let mut cmdline = Vec::new();
    for _ in 0..100 {
        cmdline = std::fs::read(format!("/proc/{}/cmdline", imitation.0.id())).unwrap();
        if !cmdline.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        String::from_utf8_lossy(&cmdline).starts_with("rclone\0mount\0:webdav:default/"),
        "the imitation's command line: {cmdline:?}"
    );
    let (ok, out) = call("unpublish");
    assert!(ok, "the unpublish waited on the imitation: {out}");
    assert!(!dhv_binder::node::mounts::is_mount_point(&target));
    // The next publish finds no rclone of its own to stop: the imitation lives on.
    let (ok, out) = call("publish");
    assert!(ok, "{out}");
    assert!(
        imitation.0.try_wait().unwrap().is_none(),
        "the publish killed a process that only looked like its rclone"
    );
    let (ok, out) = call("unpublish");
    assert!(ok, "{out}");
    drop(imitation);
    assert!(call("delete").0);
}

/// The volume's credential proxy lives only as long as the rclone it serves: with its
/// rclone killed (a crash, an OOM kill, a plugin that ends it), no proxy is left in the
/// volume's helper cgroup, and the next unpublish finds nothing to stop. (Each kit run of
/// the webdav plugin used to leave a proxy behind, one per such publish on a node.)
#[test]
fn the_webdav_credential_proxy_ends_with_its_rclone() {
    let sb = Sandbox::new();
    let server = WebdavServer::start(&sb.join("webdav-root"), "dhv", "pw");
    let target = sb.join("target");
    std::fs::create_dir_all(&target).unwrap();
    let scratch = ScratchCgroup::new();
    let helper = scratch.child("helper");
    let id = "5b1f2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
    let call = |op: &str| webdav_call(&sb, &server.url, id, &target, Some(&helper), op);
    assert!(call("create").0);
    let (ok, out) = call("publish");
    assert!(ok, "{out}");
    let record =
        std::fs::read_to_string(sb.join(&format!("volumes/webdav/rclone-{id}.pid"))).unwrap();
    let rclone: i32 = record.split_whitespace().next().unwrap().parse().unwrap();
    let running = dhv_binder::node::helpers::pids(&helper);
    assert_eq!(
        running.len(),
        2,
        "rclone and its proxy in the helper cgroup: {running:?}"
    );
    assert!(running.contains(&rclone), "{running:?} {record}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(rclone),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // The proxy watches its client by pidfd and ends at once; 30 s is for a loaded machine.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !dhv_binder::node::helpers::pids(&helper).is_empty()
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let left = dhv_binder::node::helpers::pids(&helper);
    let described: Vec<String> = left
        .iter()
        .map(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| format!("{p} {}", String::from_utf8_lossy(&c).replace('\0', " ")))
                .unwrap_or_default()
        })
        .collect();
    assert!(
        left.is_empty(),
        "30 s after its rclone was killed, the helper cgroup still holds {described:?}"
    );
    // The dead mount is detached; nothing was left for the unpublish to stop.
    let (ok, out) = call("unpublish");
    assert!(ok, "{out}");
    assert!(call("delete").0);
    assert_eq!(left_running(&sb.join("volumes")), Vec::<String>::new());
}

/// A write still only in rclone's cache when its rclone dies (the server down, then the
/// FUSE process killed) reaches the server through the next publish's rclone, and the
/// unpublish after it succeeds. Each publish talks to the server through a credential proxy
/// on a new port with a new inner credential; rclone named the cache of a remote set by
/// its environment after a hash of those settings, so the next rclone used a cache of its
/// own, never uploaded the file, and every unpublish refused ("not on the WebDAV server
/// yet"). The plugin's remote now comes from a config file: one cache, whatever the port.
#[test]
fn a_republish_uploads_what_a_killed_rclone_left_unsaved() {
    let sb = Sandbox::new();
    let mut server = WebdavServer::start(&sb.join("webdav-root"), "dhv", "pw");
    let url = server.url.clone();
    let target = sb.join("target");
    std::fs::create_dir_all(&target).unwrap();
    let id = "7c2d9e4f-1a3b-4c5d-8e6f-0a1b2c3d4e5f";
    let call = |op: &str| webdav_call(&sb, &url, id, &target, None, op);
    assert!(call("create").0);
    let (ok, out) = call("publish");
    assert!(ok, "{out}");

    // The server goes down; a file is written through the mount, into rclone's cache only
    // (its directory cache, 2 s, still lists the volume).
    std::fs::read_dir(&target).unwrap().for_each(drop);
    server.stop();
    std::fs::write(
        target.join("unsaved.txt"),
        "written while the server was down\n",
    )
    .expect("a write through the mount");
    let meta = sb.join("volumes/webdav/cache").join(id).join("vfsMeta");
    let dirty = || {
        Command::new("grep")
            .args(["-rlE", r#""Dirty": *true"#])
            .arg(&meta)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).lines().count())
            .unwrap_or(0)
    };
    // rclone marks the file in its cache's metadata a moment after the close.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while dirty() != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the write is not marked unsaved in rclone's cache after 10 s ({} marked)",
            dirty()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    // Its rclone dies before it could upload the file.
    let record =
        std::fs::read_to_string(sb.join(&format!("volumes/webdav/rclone-{id}.pid"))).unwrap();
    let rclone: i32 = record.split_whitespace().next().unwrap().parse().unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(rclone),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while Path::new(&format!("/proc/{rclone}/stat")).exists()
        && !std::fs::read_to_string(format!("/proc/{rclone}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
    {
        assert!(std::time::Instant::now() < deadline, "rclone did not die");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    // The server is back; the volume is published again (the dead mount detached).
    server.restart();
    let (ok, out) = call("publish");
    assert!(ok, "{out}");
    let on_server = server.dir.join("default").join(id).join("unsaved.txt");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::fs::read_to_string(&on_server).ok().as_deref()
        != Some("written while the server was down\n")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the file the killed rclone left unsaved never reached the server \
             ({} file(s) unsaved in the cache; the cache's remotes: {:?})",
            dirty(),
            std::fs::read_dir(&meta)
                .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
                .unwrap_or_default()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let (ok, out) = call("unpublish");
    assert!(ok, "the unpublish after the upload: {out}");
    assert_eq!(dirty(), 0, "a file is still marked unsaved");
    assert!(!dhv_binder::node::mounts::is_mount_point(&target));
    assert!(call("delete").0);
    assert_eq!(
        left_running(&sb.join("volumes")),
        Vec::<String>::new(),
        "left running after the delete"
    );
}

/// Nomad's own contract (nomad-facts §4): fingerprint/create/delete, no deferred_bind. Works
/// as Nomad's built-in `mkdir` does.
const PLAIN_NOMAD_PLUGIN: &str = r#"#!/bin/sh
set -eu
PATH=/usr/bin:/bin
case "$1" in
fingerprint) echo '{"version":"0.0.1"}' ;;
create)
  dir="$DHV_VOLUMES_DIR/$DHV_VOLUME_ID"
  mkdir -p "$dir"
  echo "{\"path\":\"$dir\",\"bytes\":0}" ;;
delete) rm -rf "$DHV_CREATED_PATH"; echo '{}' ;;
*) echo "{\"error\":\"unknown operation $1\"}"; exit 1 ;;
esac
"#;

/// Writes the plain Nomad plugin as `<dir>/plain`.
pub fn plain_plugin(dir: &Path) {
    script(&dir.join("plain"), PLAIN_NOMAD_PLUGIN);
}

#[test]
fn plain_nomad_plugin_is_reported_not_deferred() {
    let sb = Sandbox::new();
    plain_plugin(&sb.join("plugins"));
    let (code, report) = check(&sb, &sb.join("plugins/plain"), &[]);
    assert_eq!(
        code, 1,
        "a plugin that cannot defer must fail the kit:\n{report}"
    );
    for rule in [
        "fingerprint",
        "create x10 (Nomad contract)",
        "delete x10 (Nomad contract)",
        "unknown operation refused",
        "output shape",
    ] {
        assert!(
            report.contains(&format!("PASS  {rule} ")),
            "rule {rule:?} did not pass:\n{report}"
        );
    }
    assert!(report.contains("FAIL  deferred_bind "), "{report}");
    assert!(report.contains("SKIP  publish x10 "), "{report}");
    assert!(report.contains("deferred: NO"), "{report}");
}

/// Issue 47: the kit checks `stats`, `health` and `list` where declared: bind passes; a
/// bind whose `stats` does not count what is written fails "stats" with the figures.
#[test]
fn the_kit_checks_stats_health_and_list() {
    let sb = Sandbox::new();
    let export = sb.join("export");
    std::fs::create_dir_all(&export).unwrap();
    let param = format!("export={}", export.display());
    let rules = ["-rule", "stats", "-rule", "health", "-rule", "list"];
    let mut args = vec!["--param", param.as_str()];
    args.extend(rules);
    let (code, report) = check(&sb, &repo().join("plugins/bind"), &args);
    assert_eq!(code, 0, "{report}");
    for rule in ["stats", "health", "list"] {
        assert!(report.contains(&format!("PASS  {rule} ")), "{report}");
    }
    let bind = std::fs::read_to_string(repo().join("plugins/bind")).unwrap();
    let blind = bind.replace("  used=\"${walk#* }\"\n", "  used=4096\n");
    assert_ne!(
        blind, bind,
        "the bind plugin's stats changed: update this test"
    );
    script(&sb.join("plugins/blind"), &blind);
    let (code, report) = check(&sb, &sb.join("plugins/blind"), &args);
    assert_eq!(code, 1, "{report}");
    assert!(
        report.contains("FAIL  stats ") && report.contains("used 4096 → 4096 bytes"),
        "{report}"
    );
    assert!(
        dhv_binder::node::mounts::mounts_under(sb.path()).is_empty(),
        "the kit left mounts behind"
    );
}

/// The ext4 plugin passes `rule` (its evidence naming `evidence`), and the ext4 plugin with
/// `from` replaced by `to` fails it, its evidence saying `why`; no mount is left behind.
fn ext4_rule_catches(rule: &str, evidence: &str, from: &str, to: &str, why: &str) {
    let sb = Sandbox::new();
    let images = sb.join("images");
    std::fs::create_dir_all(&images).unwrap();
    let param = format!("dir={}", images.display());
    let capacity = (32u64 << 20).to_string();
    let args = [
        "--capacity",
        capacity.as_str(),
        "--param",
        param.as_str(),
        "-rule",
        rule,
    ];
    let (code, report) = check(&sb, &repo().join("plugins/ext4"), &args);
    assert_eq!(code, 0, "{report}");
    assert!(
        report.contains(&format!("PASS  {rule} ")) && report.contains(evidence),
        "{report}"
    );
    let ext4 = std::fs::read_to_string(repo().join("plugins/ext4")).unwrap();
    let mutant = ext4.replace(from, to);
    assert_ne!(mutant, ext4, "the ext4 plugin changed: update this test");
    script(&sb.join("plugins/mutant"), &mutant);
    let (code, report) = check(&sb, &sb.join("plugins/mutant"), &args);
    assert_eq!(code, 1, "{report}");
    assert!(
        report.contains(&format!("FAIL  {rule} ")) && report.contains(why),
        "{report}"
    );
    assert!(
        dhv_binder::node::mounts::mounts_under(sb.path()).is_empty(),
        "the kit left mounts behind"
    );
}

/// Issue 47: check before trust. The ext4 plugin checks an image left unclean before it
/// mounts it again; one that mounts it unchecked fails the kit.
#[test]
fn the_kit_refuses_a_plugin_that_mounts_an_unclean_filesystem_unchecked() {
    ext4_rule_catches(
        "unclean filesystem checked",
        "",
        "check_fs() {\n",
        "check_fs() {\n  return 0\n",
        "mounted unchecked",
    );
}

/// Issue 47: never format what holds anything. The ext4 plugin refuses an image given a
/// partition table before its first publish; one that formats over it fails the kit.
#[test]
fn the_kit_refuses_a_plugin_that_formats_over_a_signature() {
    ext4_rule_catches(
        "foreign signature refused",
        "(dos)",
        "    [ -z \"$sigs\" ] || fail ",
        "    [ -n \"$sigs\" ] || fail ",
        "it must be refused, never formatted",
    );
}

/// The bind plugin as it was before issue 12: a busy unmount fell back to a lazy detach
/// and reported success. The kit fails it.
#[test]
fn a_lazy_unmount_fails_the_kit() {
    let sb = Sandbox::new();
    let export = sb.join("export");
    std::fs::create_dir_all(&export).unwrap();
    let bind = std::fs::read_to_string(repo().join("plugins/bind")).unwrap();
    let lazy = bind.replace(
        "    unmount \"$tgt\"\n",
        "    umount \"$tgt\" 2>/dev/null || umount -l \"$tgt\"\n",
    );
    assert_ne!(
        lazy, bind,
        "the bind plugin's unpublish loop changed: update this test"
    );
    script(&sb.join("plugins/lazy"), &lazy);
    let (code, report) = check(
        &sb,
        &sb.join("plugins/lazy"),
        &[
            "--param",
            &format!("export={}", export.display()),
            "-rule",
            "unpublish while in use",
        ],
    );
    assert_eq!(code, 1, "{report}");
    assert!(
        report.contains("FAIL  unpublish while in use ")
            && report.contains("reported success with a file open inside"),
        "{report}"
    );
    assert!(
        dhv_binder::node::mounts::mounts_under(sb.path()).is_empty(),
        "the kit left mounts behind"
    );
}

/// The bind plugin with a publish that starts a helper in its own session which inherits the
/// call's stdout and stderr: the calls still end (the kit finishes within its timeouts), and
/// the kit fails "helpers do not hold the output", naming the helper.
#[test]
fn a_helper_holding_stdout_fails_the_kit() {
    let sb = Sandbox::new();
    let export = sb.join("export");
    std::fs::create_dir_all(&export).unwrap();
    let bind = std::fs::read_to_string(repo().join("plugins/bind")).unwrap();
    let pids = sb.join("helper.pids");
    let leaky = bind.replace(
        "publish)\n  own_dir",
        &format!(
            "publish)\n  setsid sleep 120 &\n  echo $! >> {}\n  own_dir",
            pids.display()
        ),
    );
    assert_ne!(
        leaky, bind,
        "the bind plugin's publish changed: update this test"
    );
    script(&sb.join("plugins/leaky"), &leaky);
    // The rule that watches every call, reached through the publishes of one rule.
    let (code, report) = check(
        &sb,
        &sb.join("plugins/leaky"),
        &[
            "--param",
            &format!("export={}", export.display()),
            "-rule",
            "publish x10",
        ],
    );
    for pid in std::fs::read_to_string(&pids)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse::<i32>().ok())
    {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert_eq!(code, 1, "{report}");
    assert!(
        report.contains("FAIL  helpers do not hold the output ") && report.contains("(sleep)"),
        "{report}"
    );
    assert!(report.contains("PASS  publish x10 "), "{report}");
    assert!(
        dhv_binder::node::mounts::mounts_under(sb.path()).is_empty(),
        "the kit left mounts behind"
    );
}

/// A plugin that breaks the rules fails the kit with evidence.
#[test]
fn a_broken_plugin_fails_the_kit() {
    let sb = Sandbox::new();
    script(
        &sb.join("plugins/sloppy"),
        r#"#!/bin/sh
PATH=/usr/sbin:/usr/bin:/sbin:/bin
case "$1" in
fingerprint) echo 'starting'; echo '{"version":"1.0.0","deferred_bind":true}' ;;
create) echo "{\"context\":{\"n\":\"$$\"}}" ;;
publish) mount -t tmpfs tmpfs "$DHV_TARGET_PATH"; echo '{}' ;;
unpublish) umount "$DHV_TARGET_PATH" ;;
*) exit 0 ;;
esac
"#,
    );
    let (code, report) = check(&sb, &sb.join("plugins/sloppy"), &[]);
    assert_eq!(code, 1, "{report}");
    assert!(report.contains("FAIL  fingerprint "), "{report}");
    assert!(sb.path().join("scratch").exists());
    assert!(
        dhv_binder::node::mounts::mounts_under(sb.path()).is_empty(),
        "the kit left mounts behind"
    );
}

/// A plugin that fails says why: its `{"error"}` message and its stderr are in the failing
/// rules' evidence (redacted and escaped as the agent logs them), not "in the agent's log".
#[test]
fn a_failing_plugins_error_and_stderr_are_in_the_evidence() {
    let sb = Sandbox::new();
    script(
        &sb.join("plugins/grumpy"),
        r#"#!/bin/sh
case "$1" in
fingerprint) echo '{"version":"1.0.0","deferred_bind":true}' ;;
create) echo '{}' ;;
publish) echo "mount: no route to the export server" >&2; echo '{"error":"cannot reach storage backend"}'; exit 1 ;;
*) exit 0 ;;
esac
"#,
    );
    let (code, report) = check(&sb, &sb.join("plugins/grumpy"), &[]);
    assert_eq!(code, 1, "{report}");
    let publish = report
        .lines()
        .find(|l| l.starts_with("FAIL  publish x10 "))
        .unwrap_or_else(|| panic!("no failing publish rule:\n{report}"));
    assert!(
        publish.contains("error: cannot reach storage backend"),
        "{publish}"
    );
    assert!(
        publish.contains("stderr: mount: no route to the export server"),
        "{publish}"
    );
    assert!(!report.contains("agent's log"), "{report}");
    // Ten calls that failed alike are one entry, without the plugin's trailing newline.
    assert!(publish.contains("calls 1-10: plugin \"grumpy\" publish failed (exit code 1): error: cannot reach storage backend; stderr: mount: no route to the export server"), "{publish}");
    assert!(!publish.contains("call 2"), "{publish}");
    assert!(!publish.ends_with("\\u{a}"), "{publish}");
}

/// Issue 48: a plugin whose fingerprint declares `max_volumes` 0 and a topology segment
/// the agent refuses fails "placement fields", and one whose publish of the kit's healthy
/// volume fails with exit 65 (the class "final": every node would stop offering the volume)
/// fails "error classes"; one that declares them well passes both.
#[test]
fn placement_fields_and_a_final_class_for_a_healthy_volume_are_checked() {
    let sb = Sandbox::new();
    let plugin = |name: &str, fingerprint: &str, code: i32| {
        script(
            &sb.join(&format!("plugins/{name}")),
            &format!(
                r#"#!/bin/sh
case "$1" in
fingerprint) echo '{fingerprint}' ;;
create) echo '{{}}' ;;
publish) echo '{{"error":"the image is corrupt"}}'; exit {code} ;;
*) exit 0 ;;
esac
"#
            ),
        );
    };
    plugin(
        "careless",
        r#"{"version":"1.0.0","deferred_bind":true,"max_volumes":0,"topology":{"zone":"a b"}}"#,
        65,
    );
    let (code, report) = check(
        &sb,
        &sb.join("plugins/careless"),
        &[
            "-rule",
            "publish x10",
            "-rule",
            "placement fields",
            "-rule",
            "error classes",
        ],
    );
    assert_eq!(code, 1, "{report}");
    let line = |rule: &str| {
        report
            .lines()
            .find(|l| l.contains(&format!("  {rule} ")))
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        line("placement fields").starts_with("FAIL")
            && line("placement fields").contains("max_volumes")
            && line("placement fields").contains("a b"),
        "{report}"
    );
    assert!(
        line("error classes").starts_with("FAIL")
            && line("error classes").contains("the image is corrupt"),
        "{report}"
    );
    plugin(
        "careful",
        r#"{"version":"1.0.0","deferred_bind":true,"max_volumes":4,"topology":{"zone":"a"}}"#,
        69,
    );
    let (_, report) = check(
        &sb,
        &sb.join("plugins/careful"),
        &[
            "-rule",
            "publish x10",
            "-rule",
            "placement fields",
            "-rule",
            "error classes",
        ],
    );
    assert!(
        report.contains("PASS  placement fields ")
            && report.contains("max_volumes 4; topology zone=a"),
        "{report}"
    );
    assert!(
        report.contains("PASS  error classes ") && report.contains("classed elsewhere"),
        "{report}"
    );
}

/// The `bind` plugin as it was before issues 12 and 13: JSON picked out with sed, and every
/// path taken from the record as it is. It fails "JSON input parsed" and "paths confined",
/// and the planted record did not get to the victims.
#[test]
fn a_sed_parsing_unconfined_plugin_fails_the_json_and_confinement_rules() {
    let sb = Sandbox::new();
    let export = sb.join("export");
    std::fs::create_dir_all(&export).unwrap();
    script(
        &sb.join("plugins/oldbind"),
        r#"#!/bin/sh
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
field() { printf '%s' "$1" | sed -n "s/.*\"$2\"[[:space:]]*:[[:space:]]*\"\([^\"]*\)\".*/\1/p"; }
case "$1" in
fingerprint) echo '{"version":"1.0.0","deferred_bind":true}' ;;
create)
  root="$(field "${DHV_PARAMETERS:-}" export)"
  case "$root" in /*) ;; *) echo '{"error":"export must be absolute"}'; exit 1 ;; esac
  mkdir -p "$root/$DHV_NAMESPACE/$DHV_VOLUME_ID"
  echo "{\"context\":{\"export_path\":\"$root/$DHV_NAMESPACE/$DHV_VOLUME_ID\"}}" ;;
publish)
  src="$(field "$DHV_CONTEXT" export_path)"
  mkdir -p "$DHV_TARGET_PATH"
  if findmnt -rn --mountpoint "$DHV_TARGET_PATH" >/dev/null; then
    [ "$(stat -c %d:%i "$src")" = "$(stat -c %d:%i "$DHV_TARGET_PATH")" ] || { echo '{"error":"occupied"}'; exit 1; }
  else
    mount --bind "$src" "$DHV_TARGET_PATH"
    [ "${DHV_READ_ONLY:-false}" = true ] && mount -o remount,bind,ro "$DHV_TARGET_PATH"
  fi
  echo "{\"path\":\"$DHV_TARGET_PATH\"}" ;;
unpublish)
  while findmnt -rn --mountpoint "$DHV_TARGET_PATH" >/dev/null; do umount "$DHV_TARGET_PATH"; done
  echo '{}' ;;
delete) echo '{}' ;;
*) echo '{"error":"unknown"}'; exit 1 ;;
esac
"#,
    );
    let (code, report) = check(
        &sb,
        &sb.join("plugins/oldbind"),
        &[
            "--param",
            &format!("export={}", export.display()),
            "-rule",
            "JSON input parsed",
            "-rule",
            "paths confined",
        ],
    );
    assert_eq!(code, 1, "{report}");
    assert!(report.contains("FAIL  JSON input parsed "), "{report}");
    assert!(report.contains("FAIL  paths confined "), "{report}");
    assert!(report.contains("publish SUCCEEDED"), "{report}");
    assert!(
        dhv_binder::node::mounts::mounts_under(sb.path()).is_empty(),
        "the kit left mounts behind"
    );
}

/// Issue 33 §3: the `bind` plugin as it was before `dhv-binder helper` (it checks each path
/// with `realpath` and uses it again with `mount --bind`, `mkdir`, `find -delete`), kept in
/// testdata/plugins/bind-before-handles, fails "symlink race": while a directory beneath its
/// export is swapped with a symlink to a copy outside the roots, it mounts, creates or
/// removes something outside. The kit cleans up after it.
#[test]
fn a_plugin_that_checks_a_path_then_uses_it_again_fails_the_symlink_race() {
    let sb = Sandbox::new();
    let export = sb.join("export");
    std::fs::create_dir_all(&export).unwrap();
    std::fs::create_dir_all(sb.join("plugins")).unwrap();
    let plugin = sb.join("plugins/oldbind");
    std::fs::copy(repo().join("testdata/plugins/bind-before-handles"), &plugin).unwrap();
    let (code, report) = check(
        &sb,
        &plugin,
        &[
            "--param",
            &format!("export={}", export.display()),
            "-rule",
            "symlink race",
            "-rule",
            "paths confined",
        ],
    );
    assert_eq!(code, 1, "{report}");
    let line = report
        .lines()
        .find(|l| !l.starts_with("-rule:") && l.contains("symlink race"))
        .unwrap_or_else(|| panic!("no symlink race rule in the report:\n{report}"));
    assert!(
        line.starts_with("FAIL") && line.contains("outside the roots"),
        "{report}"
    );
    // The rules before it still pass: only the race tells it from the reference plugin.
    assert!(report.contains("PASS  paths confined "), "{report}");
    assert!(
        dhv_binder::node::mounts::mounts_under(sb.path()).is_empty(),
        "the kit left mounts behind"
    );
}

/// Issue 44 §2: a plugin that does every step by handle but copies a volume by name
/// (testdata/plugins/bind-copy-by-name: `helper exec --open SRC --open DST -- cp -a`) fails
/// "symlink race": while a directory inside the volume is swapped with a symlink to a
/// directory outside the roots, its snapshots and clones hold files from outside.
#[test]
fn a_plugin_that_copies_a_volume_by_name_fails_the_symlink_race_inside_a_volume() {
    let sb = Sandbox::new();
    let export = sb.join("export");
    std::fs::create_dir_all(&export).unwrap();
    std::fs::create_dir_all(sb.join("plugins")).unwrap();
    let plugin = sb.join("plugins/cpbind");
    std::fs::copy(repo().join("testdata/plugins/bind-copy-by-name"), &plugin).unwrap();
    let (code, report) = check(
        &sb,
        &plugin,
        &[
            "--param",
            &format!("export={}", export.display()),
            "-rule",
            "symlink race",
            "-rule",
            "snapshot x2",
            "-rule",
            "create from snapshot",
            "-rule",
            "clone",
            "-rule",
            "paths confined",
        ],
    );
    assert_eq!(code, 1, "{report}");
    let line = report
        .lines()
        .find(|l| !l.starts_with("-rule:") && l.contains("symlink race"))
        .unwrap_or_else(|| panic!("no symlink race rule in the report:\n{report}"));
    assert!(
        line.starts_with("FAIL") && line.contains("file(s) from outside the roots"),
        "{report}"
    );
    // Everything else passes: only the copy tells it from the reference plugin.
    for rule in [
        "snapshot x2",
        "create from snapshot",
        "clone",
        "paths confined",
    ] {
        assert!(
            report.contains(&format!("PASS  {rule} ")),
            "{rule}: {report}"
        );
    }
    assert!(
        dhv_binder::node::mounts::mounts_under(sb.path()).is_empty(),
        "the kit left mounts behind"
    );
}

/// The fencing rules can fail, and `fence_node` is checked when declared: the `bind` plugin
/// wrapped so that its `fence` waits on its "storage server" (it sleeps past the 2 s fence
/// deadline, as a fence that needs the network does in a partition), and with a
/// `fence_node`/`unfence_node` that keeps an export rule per fenced node.
#[test]
fn a_fence_that_waits_on_the_network_fails_and_fence_node_is_checked() {
    let sb = Sandbox::new();
    let export = sb.join("export");
    std::fs::create_dir_all(&export).unwrap();
    script(
        &sb.join("plugins/netfence"),
        &format!(
            r#"#!/bin/sh
PATH=/usr/sbin:/usr/bin:/sbin:/bin
rules="{rules}"
case "$1" in
fingerprint) echo '{{"version":"1.0.0","deferred_bind":true,"capabilities":["fence","fence_node"]}}' ;;
fence) sleep 5; echo '{{}}' ;;
fence_node) mkdir -p "$rules"; touch "$rules/$DHV_FENCED_NODE_ID"; echo '{{}}' ;;
unfence_node) rm -f "$rules/$DHV_FENCED_NODE_ID"; echo '{{}}' ;;
*) exec {bind} "$@" ;;
esac
"#,
            rules = sb.join("rules").display(),
            bind = repo().join("plugins/bind").display()
        ),
    );
    let (code, report) = check(
        &sb,
        &sb.join("plugins/netfence"),
        &[
            "--param",
            &format!("export={}", export.display()),
            "-rule",
            "fence",
            "-rule",
            "fence_node and unfence_node x2",
        ],
    );
    assert_eq!(code, 1, "{report}");
    let fence = report
        .lines()
        .find(|l| l.starts_with("FAIL  fence "))
        .unwrap_or_else(|| panic!("the waiting fence did not fail:\n{report}"));
    assert!(fence.contains("timed out after 2s"), "{fence}");
    assert!(
        report.contains("PASS  fence_node and unfence_node x2 "),
        "{report}"
    );
    // unfence_node removed the rule fence_node made.
    assert_eq!(std::fs::read_dir(sb.join("rules")).unwrap().count(), 0);
    assert!(
        dhv_binder::node::mounts::mounts_under(sb.path()).is_empty(),
        "the kit left mounts behind"
    );
}
