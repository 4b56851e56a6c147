//! End to end, secrets by reference (issue 49): a bind and a webdav volume whose password
//! lives in a Nomad Variable (`secret_ref`), read by the node at each plugin call; the
//! Variable is changed and the next call uses the new value, without a re-create; a reader
//! of the volume records (`dhv-binder/volumes/`) sees no secret value anywhere, and neither
//! do the agents' logs, journals, status and the CLI's output.

mod support;

use serde_json::{json, Value};
use support::cluster::{Cluster, NOBODY_GID, NOBODY_UID};
use support::sandbox::script;
use support::webdav::WebdavServer;

/// The Variable holding the password, under the agents' default `--secrets-path`.
const SECRET_PATH: &str = "dhv-binder-secrets/shared-data";

/// The spec lines that reference it.
const SECRET_REF: &str = "secret_ref \"password\" {\n  variable = \"dhv-binder-secrets/shared-data\"\n  item     = \"password\"\n}\n";

/// The bind plugin, wrapped: each call appends "<operation> <password it was given>" to
/// `bindpw.calls` beside it (in the test's sandbox), then runs the bind plugin
/// (`fingerprint` gets no `DHV_*` but the operation, as in Nomad).
const BIND_WRAPPER: &str = r#"#!/bin/sh
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
dir="$(dirname "$0")"
pw="$(printf '%s' "${DHV_SECRETS:-null}" | jq -r '.password // empty')"
printf '%s %s\n' "$1" "$pw" >>"$dir/bindpw.calls"
exec "$dir/bind" "$@"
"#;

async fn set_password(c: &Cluster, pw: &str) {
    c.put(
        &format!("/v1/var/{SECRET_PATH}?namespace=default"),
        json!({"Namespace": "default", "Path": SECRET_PATH, "Items": {"password": pw}}),
    )
    .await;
}

async fn wait_placeholders(c: &Cluster, name: &str, want: usize) {
    c.wait_for(30, &format!("{want} ready placeholder(s)"), || async {
        let vols = c.get("/v1/volumes?type=host&namespace=*").await;
        let ready = vols
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["Name"] == name && v["State"] == "ready")
            .count();
        (ready == want).then_some(())
    })
    .await;
}

/// Runs the example job until its main task runs (an allocation other than `other_than`);
/// returns (job, allocation ID, node index).
async fn run_example(c: &Cluster, other_than: Option<&str>) -> (String, String, usize) {
    let job = c
        .run_job(&support::cluster::repo().join("jobspecs/example.nomad.hcl"))
        .await;
    let alloc = c
        .wait_for(90, "the main task running", || async {
            c.allocs(&job).await.into_iter().find(|a| {
                Some(a["ID"].as_str().unwrap()) != other_than
                    && a["TaskStates"]["app"]["State"] == "running"
            })
        })
        .await;
    let node = c.node_index(alloc["NodeID"].as_str().unwrap());
    let id = alloc["ID"].as_str().unwrap().to_string();
    // Running is not yet written: the task's line reaches the volume a moment later.
    let written = c.target(node, "shared-data").join("greetings.txt");
    c.wait_for(60, "the main task's line in the volume", || async {
        std::fs::read_to_string(&written)
            .is_ok_and(|t| t.contains(&id))
            .then_some(())
    })
    .await;
    (job, id, node)
}

/// Stops the job and waits until node `node` has unpublished the volume.
async fn stop_and_unpublish(c: &Cluster, job: &str, node: usize) {
    c.stop_job(job, false).await;
    let target = c.target(node, "shared-data");
    c.wait_for(60, "the volume unpublished", || async {
        (!dhv_binder::node::mounts::is_mount_point(&target)
            && c.journal(node)
                .last()
                .is_some_and(|e| e["event"] == "unpublish-done"))
        .then_some(())
    })
    .await;
}

/// Every volume record in namespace `default`, as a reader of `dhv-binder/volumes/` sees it.
async fn records(c: &Cluster) -> Vec<Value> {
    let list = c
        .get("/v1/vars?prefix=dhv-binder/volumes/&namespace=default")
        .await;
    let mut out = Vec::new();
    for v in list.as_array().unwrap() {
        let path = v["Path"].as_str().unwrap();
        out.push(c.get(&format!("/v1/var/{path}?namespace=default")).await);
    }
    out
}

/// No value in `secrets` appears in the volume records, the agents' logs and journals,
/// their status, or the CLI's `volume status`.
async fn nowhere(c: &Cluster, secrets: &[&str]) {
    let mut texts: Vec<(String, String)> = Vec::new();
    for r in records(c).await {
        texts.push(("a volume record".into(), r.to_string()));
    }
    for (i, n) in c.nodes.iter().enumerate() {
        for f in [
            n.log.clone(),
            n.state_dir.join("journal.json"),
            n.state_dir.join("journal.wal"),
            n.state_dir.join("journal.log"),
        ] {
            let t = std::fs::read_to_string(&f).unwrap_or_default();
            texts.push((f.display().to_string(), t));
        }
        texts.push((format!("node {i}'s status"), c.status(i).1));
    }
    texts.push((
        "volume status".into(),
        c.cli(&["volume", "status", "shared-data"]).1,
    ));
    for (what, text) in &texts {
        for s in secrets {
            assert!(!text.contains(s), "a secret value is in {what}:\n{text}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bind_volumes_password_lives_in_a_variable_and_each_call_reads_it_anew() {
    // The wrapper may touch bind's export, as bind may (`--plugin-root`).
    let mut c = Cluster::start_sim(2, "", &[], &[]).await;
    script(&c.plugin_dir.join("bindpw"), BIND_WRAPPER);
    let roots = format!("bind={0},bindpw={0}", c.export.display());
    c.agent_env.push(("DHV_BINDER_PLUGIN_ROOTS".into(), roots));
    for i in 0..c.nodes.len() {
        c.start_agent(i);
    }
    c.wait_plugin("bindpw").await;
    let calls = c.plugin_dir.join("bindpw.calls");
    let (one, two) = (
        format!("pw-one-{}", uuid::Uuid::new_v4().simple()),
        format!("pw-two-{}", uuid::Uuid::new_v4().simple()),
    );
    let export = c.export.display().to_string();
    // Without the Variable, the create fails saying which reference and what to do.
    std::fs::write(
        c.sb.join("early.volume.hcl"),
        format!(
            "name = \"shared-data\"\nplugin_id = \"bindpw\"\nparameters {{\n  export = \"{export}\"\n}}\n{SECRET_REF}"
        ),
    )
    .unwrap();
    let early = c.sb.join("early.volume.hcl");
    let (code, out) = c.cli(&["volume", "create", early.to_str().unwrap()]);
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains(&format!("variable {SECRET_PATH} does not exist"))
            && out.contains("nomad var put"),
        "{out}"
    );
    set_password(&c, &one).await;
    let out = c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "bindpw",
        &[("export", &export), NOBODY_UID, NOBODY_GID],
        &[],
        SECRET_REF,
    );
    assert!(out.contains("is ready"), "{out}");
    let seen = || std::fs::read_to_string(&calls).unwrap_or_default();
    assert!(seen().contains(&format!("create {one}")), "{}", seen());
    // The record holds the reference, not the value.
    let rec = records(&c).await;
    assert!(rec[0].to_string().contains(SECRET_PATH), "{}", rec[0]);

    wait_placeholders(&c, "shared-data", 2).await;
    let (job, first, node) = run_example(&c, None).await;
    assert!(seen().contains(&format!("publish {one}")), "{}", seen());

    // Rotated in the Variable: the next call (this unpublish) already uses the new value.
    set_password(&c, &two).await;
    stop_and_unpublish(&c, &job, node).await;
    assert!(seen().contains(&format!("unpublish {two}")), "{}", seen());
    let (job, _, node) = run_example(&c, Some(&first)).await;
    assert!(seen().contains(&format!("publish {two}")), "{}", seen());
    stop_and_unpublish(&c, &job, node).await;

    nowhere(&c, &[&one, &two]).await;
    let (code, out) = c.cli(&["volume", "delete", "shared-data"]);
    assert_eq!(code, 0, "{out}");
    assert!(seen().contains(&format!("delete {two}")), "{}", seen());
}

/// A WebDAV server whose password is a first value, that value in the referenced Variable,
/// and the volume `shared-data` created on it (webdav plugin, `secret_ref`): the server, the
/// first and a second password, and the volume's ID.
async fn webdav_volume(c: &Cluster) -> (WebdavServer, String, String, String) {
    let (one, two) = (
        format!("dav-one-{}", uuid::Uuid::new_v4().simple()),
        format!("dav-two-{}", uuid::Uuid::new_v4().simple()),
    );
    let server = WebdavServer::start(&c.sb.join("webdav-root"), "dhv", &one);
    set_password(c, &one).await;
    let out = c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "webdav",
        &[("url", &server.url), ("user", "dhv")],
        &[],
        SECRET_REF,
    );
    assert!(out.contains("is ready"), "{out}");
    let id = records(c).await[0]["Items"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    (server, one, two, id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webdav_volumes_rotated_password_is_used_by_the_next_publish() {
    let c = Cluster::start(2).await;
    let (mut server, one, two, id) = webdav_volume(&c).await;
    let storage = server.dir.join("default").join(id).join("greetings.txt");
    wait_placeholders(&c, "shared-data", 2).await;
    let (job, first, node) = run_example(&c, None).await;
    stop_and_unpublish(&c, &job, node).await;
    let text = std::fs::read_to_string(&storage).unwrap();
    assert!(text.contains(&first), "{text:?}");

    // The storage's password changes, and the Variable with it: no re-create.
    server.password = two.clone();
    server.restart();
    set_password(&c, &two).await;
    let (job, second, node) = run_example(&c, Some(&first)).await;
    stop_and_unpublish(&c, &job, node).await;
    let text = std::fs::read_to_string(&storage).unwrap();
    assert!(
        text.contains(&first) && text.contains(&second),
        "the second run's write did not reach the server: {text:?}"
    );
    nowhere(&c, &[&one, &two]).await;
}

/// The example job, its task appending `tick N` to `/data/ticks.txt` every second while it
/// runs (instead of sleeping): the task writes through the volume across a rotation.
fn ticking_job(c: &Cluster) -> std::path::PathBuf {
    let spec = std::fs::read_to_string(support::cluster::repo().join("jobspecs/example.nomad.hcl"))
        .unwrap();
    let ticking = spec.replace(
        "while true; do sleep 1; done",
        "i=0; while true; do i=$((i+1)); echo \"tick $i\" >> /data/ticks.txt; sleep 1; done",
    );
    assert_ne!(
        ticking, spec,
        "the example job's loop changed: update this test"
    );
    let path = c.sb.join("ticking.nomad.hcl");
    std::fs::write(&path, ticking).unwrap();
    path
}

/// The highest `tick N` in `text`.
fn last_tick(text: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.strip_prefix("tick ")?.trim().parse().ok())
        .max()
        .unwrap_or(0)
}

/// What a WebDAV client with `user` and `password` gets from `url`: its HTTP status for a
/// `PROPFIND` (curl, so that no rclone config is involved).
fn dav_status(url: &str, user: &str, password: &str) -> String {
    let out = std::process::Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "PROPFIND",
        ])
        .args(["-H", "Depth: 0", "-K", "-"])
        .arg(url)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write as _;
            // The credential on stdin (curl's config), never on a command line.
            writeln!(child.stdin.take().unwrap(), "user = \"{user}:{password}\"")?;
            child.wait_with_output()
        })
        .expect("curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every process's command line, joined (no secret may be on one), but the test's own
/// WebDAV server's (`rclone serve webdav --pass …`: the storage, not dhv-binder's doing).
fn command_lines() -> String {
    let mut all = String::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(c) = std::fs::read(e.path().join("cmdline")) {
            let line = String::from_utf8_lossy(&c).replace('\0', " ");
            if !line.contains("rclone serve webdav") {
                all.push_str(&line);
                all.push('\n');
            }
        }
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_webdav_volume_keeps_serving_its_task_across_a_rotation_and_the_old_password_is_refused(
) {
    let c = Cluster::start(2).await;
    let (mut server, one, two, id) = webdav_volume(&c).await;
    let ticks = server.dir.join("default").join(&id).join("ticks.txt");
    wait_placeholders(&c, "shared-data", 2).await;
    let job = c.run_job(&ticking_job(&c)).await;
    let alloc = c
        .wait_for(90, "the main task running", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| a["TaskStates"]["app"]["State"] == "running")
        })
        .await;
    let node = c.node_index(alloc["NodeID"].as_str().unwrap());
    let target = c.target(node, "shared-data");
    let mount_before = std::fs::metadata(&target).map(|m| {
        use std::os::unix::fs::MetadataExt as _;
        m.dev()
    });
    let rclone_before = support::webdav::mount_pids(&target);
    assert_eq!(rclone_before.len(), 1, "{rclone_before:?}");
    // Writes before the change reach the server.
    let before = c
        .wait_for(60, "the task's ticks on the server", || async {
            let n = last_tick(&std::fs::read_to_string(&ticks).unwrap_or_default());
            (n >= 3).then_some(n)
        })
        .await;
    assert!(
        !command_lines().contains(&one),
        "the password is on a command line"
    );

    // The rotation: the server takes only the new password from now on, and the Variable
    // holds it. The agent sees the Variable's index move and refreshes the mount.
    server.password = two.clone();
    server.restart();
    assert_eq!(
        dav_status(&server.url, "dhv", &one),
        "401",
        "the old password still works"
    );
    set_password(&c, &two).await;
    let refreshed = c
        .wait_for(60, "the volume refreshed", || async {
            let (_, text) = c.status(node);
            let s: Value = serde_json::from_str(&text).ok()?;
            let done = s["refresh"]["default/shared-data"]["done"].as_u64()?;
            (done >= 1).then_some(done)
        })
        .await;
    assert_eq!(refreshed, 1);
    // The task keeps writing through the same mount, and what it writes after the change
    // reaches the server with the new password.
    let after = c
        .wait_for(
            60,
            "ticks written after the refresh on the server",
            || async {
                let n = last_tick(&std::fs::read_to_string(&ticks).unwrap_or_default());
                (n >= before + 5).then_some(n)
            },
        )
        .await;
    assert!(after >= before + 5);
    // A rename through the mount of a file on the server (a WebDAV MOVE, whose Destination
    // header names the proxy) reaches the server under the new name. (Renamed once uploaded:
    // rclone 1.60 uploads a file renamed during its upload under its old name.)
    std::fs::write(target.join("draft.txt"), "moved").unwrap();
    let on_server = server.dir.join("default").join(&id);
    c.wait_for(30, "the file on the server, whole", || async {
        (std::fs::read_to_string(on_server.join("draft.txt")).ok()? == "moved").then_some(())
    })
    .await;
    std::fs::rename(target.join("draft.txt"), target.join("final.txt")).unwrap();
    c.wait_for(30, "the renamed file on the server", || async {
        (std::fs::read_to_string(on_server.join("final.txt")).ok()? == "moved"
            && !on_server.join("draft.txt").exists())
        .then_some(())
    })
    .await;
    // The proxy's loopback port answers nobody without rclone's inner credential, whatever
    // they know of the server's.
    let volumes = c.nodes[node].state_dir.join("volumes/webdav");
    let port = std::fs::read_to_string(volumes.join(format!("proxy-{id}.port"))).unwrap();
    let proxy = format!("http://127.0.0.1:{}/", port.trim());
    assert_eq!(
        dav_status(&proxy, "dhv", &two),
        "401",
        "the proxy forwarded a stranger"
    );
    for f in ["json", "inner"] {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(volumes.join(format!("proxy-{id}.{f}")))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "proxy-{id}.{f}");
    }
    let mount_after = std::fs::metadata(&target).map(|m| {
        use std::os::unix::fs::MetadataExt as _;
        m.dev()
    });
    assert_eq!(
        mount_before.unwrap(),
        mount_after.unwrap(),
        "the mount was replaced"
    );
    assert_eq!(
        support::webdav::mount_pids(&target),
        rclone_before,
        "rclone was restarted"
    );
    let now = c
        .allocs(&job)
        .await
        .into_iter()
        .find(|a| a["ID"] == alloc["ID"])
        .unwrap();
    assert_eq!(now["TaskStates"]["app"]["State"], "running", "{now}");
    assert_eq!(now["TaskStates"]["app"]["Restarts"], 0, "{now}");
    assert_eq!(
        dav_status(&server.url, "dhv", &one),
        "401",
        "the old password works again"
    );
    assert_eq!(dav_status(&server.url, "dhv", &two), "207");
    assert!(
        !command_lines().contains(&two),
        "the password is on a command line"
    );

    stop_and_unpublish(&c, &job, node).await;
    let text = std::fs::read_to_string(&ticks).unwrap();
    assert!(last_tick(&text) >= after, "{text:?}");
    nowhere(&c, &[&one, &two]).await;
}

/// The bind plugin, wrapped to declare `refresh` with a 10 s `refresh_interval`: each
/// `refresh` appends "refresh <password it was given> <target>" to `bindrf.calls` beside it.
const REFRESH_WRAPPER: &str = r#"#!/bin/sh
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
dir="$(dirname "$0")"
case "$1" in
fingerprint)
  "$dir/bind" fingerprint | jq -c '.capabilities += ["refresh"] | .refresh_interval = "10s"'
  ;;
refresh)
  pw="$(printf '%s' "${DHV_SECRETS:-null}" | jq -r '.password // empty')"
  printf 'refresh %s %s\n' "$pw" "$DHV_TARGET_PATH" >>"$dir/bindrf.calls"
  echo '{}'
  ;;
*) exec "$dir/bind" "$@" ;;
esac
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_volume_is_refreshed_when_its_variable_changes_and_on_the_plugins_period() {
    let mut c = Cluster::start_sim(2, "", &[], &[]).await;
    script(&c.plugin_dir.join("bindrf"), REFRESH_WRAPPER);
    let roots = format!("bind={0},bindrf={0}", c.export.display());
    c.agent_env.push(("DHV_BINDER_PLUGIN_ROOTS".into(), roots));
    for i in 0..c.nodes.len() {
        c.start_agent(i);
    }
    c.wait_plugin("bindrf").await;
    let calls = c.plugin_dir.join("bindrf.calls");
    let seen = || std::fs::read_to_string(&calls).unwrap_or_default();
    let (one, two) = (
        format!("rf-one-{}", uuid::Uuid::new_v4().simple()),
        format!("rf-two-{}", uuid::Uuid::new_v4().simple()),
    );
    set_password(&c, &one).await;
    let export = c.export.display().to_string();
    let out = c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "bindrf",
        &[("export", &export), NOBODY_UID, NOBODY_GID],
        &[],
        SECRET_REF,
    );
    assert!(out.contains("is ready"), "{out}");
    wait_placeholders(&c, "shared-data", 2).await;
    let (job, _, node) = run_example(&c, None).await;
    let target = c.target(node, "shared-data");
    // (A slow start may let the period refresh it once already, with the value it has.)
    assert!(
        seen().lines().all(|l| l.contains(&one)),
        "refreshed with another value before the change: {}",
        seen()
    );

    // The Variable changes: the node it is published on refreshes it with the new value,
    // at once (well before the 10 s period).
    let changed = std::time::Instant::now();
    set_password(&c, &two).await;
    let want = format!("refresh {two} {}", target.display());
    c.wait_for(30, "the refresh with the new password", || async {
        seen().contains(&want).then_some(())
    })
    .await;
    let took = changed.elapsed();
    // Then every 10 s (the plugin's refresh_interval), with the value read anew each time.
    c.wait_for(30, "a refresh by the plugin's period", || async {
        (seen().matches(&want).count() >= 2).then_some(())
    })
    .await;
    eprintln!("refresh after the change: {took:?}");
    // The plugin logs its call before it answers; status counts the call once the agent has
    // taken the answer in.
    c.wait_for(10, "status counting both refreshes", || async {
        let (_, text) = c.status(node);
        let s: Value = serde_json::from_str(&text).ok()?;
        (s["refresh"]["default/shared-data"]["done"].as_u64() >= Some(2)).then_some(())
    })
    .await;

    // Unpublished: no more refreshes.
    stop_and_unpublish(&c, &job, node).await;
    let n = seen().lines().count();
    tokio::time::sleep(std::time::Duration::from_secs(12)).await;
    assert_eq!(seen().lines().count(), n, "{}", seen());
    nowhere(&c, &[&one, &two]).await;
}
