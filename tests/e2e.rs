//! End to end: the real dhv-binder daemon (one process per simulated node) against the
//! Nomad simulator, with the example job from jobspecs/, real processes and real mounts,
//! once per reference plugin (bind, ext4 loop image, FUSE WebDAV remote); then secrets that
//! never leak, plugin discovery while running, and a dead FUSE mount republished (B14).

mod support;

use serde_json::Value;
use std::path::PathBuf;
use support::cluster::{repo, Cluster, NOBODY_GID, NOBODY_UID};
use support::namespace::Namespaced;
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

async fn wait_placeholders(c: &Cluster, name: &str, want: usize) {
    wait_placeholders_within(c, name, want, 30).await
}

/// [`wait_placeholders`] with a deadline of `secs`.
async fn wait_placeholders_within(c: &Cluster, name: &str, want: usize, secs: u64) {
    c.wait_for(
        secs,
        &format!("{want} ready placeholder(s) of {name}"),
        || async {
            let vols = c.get("/v1/volumes?type=host&namespace=*").await;
            let ready = vols
                .as_array()
                .unwrap()
                .iter()
                .filter(|v| v["Name"] == name && v["State"] == "ready")
                .count();
            (ready == want).then_some(())
        },
    )
    .await;
}

/// Runs the example job until its main task runs; returns (allocation, node index).
async fn run_example(c: &Cluster, other_than: Option<&str>) -> (String, Value, usize) {
    let jobspec = repo().join("jobspecs/example.nomad.hcl");
    let job = c.run_job(&jobspec).await;
    let alloc = c
        .wait_for(90, "the main task running", || async {
            c.allocs(&job).await.into_iter().find(|a| {
                Some(a["ID"].as_str().unwrap()) != other_than
                    && task_state(a, "app")["State"] == "running"
            })
        })
        .await;
    let node = c.node_index(alloc["NodeID"].as_str().unwrap());
    (job, alloc, node)
}

async fn read_until(c: &Cluster, path: PathBuf, what: &str, needles: &[&str]) -> String {
    c.wait_for(20, what, || async {
        std::fs::read_to_string(&path)
            .ok()
            .filter(|t| needles.iter().all(|n| t.contains(n)))
    })
    .await
}

/// The acceptance path, for the volume "shared-data" already created with some plugin:
/// placeholders on every node, the example job's prestart task blocks until the volume is
/// published on the node the scheduler picked, the main task finds a mount and writes to
/// it; after the job stops the placeholder is no longer a mount point, the journal shows
/// the unpublish; running the job again finds the first run's file. `storage` is where the
/// plugin keeps the volume's files, when they can be read without publishing.
async fn example_job_round_trip(c: &Cluster, storage: Option<PathBuf>) {
    wait_placeholders(c, "shared-data", c.nodes.len()).await;
    let (job, alloc, node) = run_example(c, None).await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let prestart = task_state(&alloc, "publish-volumes");
    assert_eq!(prestart["State"], "dead", "{alloc}");
    assert_eq!(prestart["Failed"], false, "{alloc}");
    let other = 1 - node;
    let target = c.target(node, "shared-data");
    assert!(dhv_binder::node::mounts::is_mount_point(&target));
    assert!(!dhv_binder::node::mounts::is_mount_point(
        &c.target(other, "shared-data")
    ));
    read_until(
        c,
        target.join("greetings.txt"),
        "the main task's line, read through the published mount",
        &[&alloc_id],
    )
    .await;
    // The shipped example is fenced by Nomad (its `disconnect { stop_on_client_after }`
    // lies in the range the agent asks for): no `unfenced` warning about it.
    let (code, st) = c.status(node);
    assert_eq!(code, 0, "{st}");
    let st: Value = serde_json::from_str(&st).unwrap();
    assert!(
        st["unfenced"].as_object().is_some_and(|o| o.is_empty()),
        "the example job triggers the agent's own warning: {}",
        st["unfenced"]
    );

    c.stop_job(&job, false).await;
    c.wait_for(60, "the allocation complete", || async {
        c.allocs(&job)
            .await
            .into_iter()
            .find(|a| a["ID"] == alloc_id.as_str() && a["ClientStatus"] == "complete")
    })
    .await;
    c.wait_for(30, "the unpublish done in the journal", || async {
        c.journal(node)
            .last()
            .filter(|e| e["event"] == "unpublish-done")
            .map(|_| ())
    })
    .await;
    assert!(!dhv_binder::node::mounts::is_mount_point(&target));
    let events: Vec<String> = c
        .journal(node)
        .iter()
        .map(|e| e["event"].as_str().unwrap().to_string())
        .collect();
    assert!(
        events.ends_with(&["unpublish-intent".to_string(), "unpublish-done".to_string()]),
        "{events:?}"
    );
    assert_eq!(
        events.iter().filter(|e| *e == "publish-done").count(),
        1,
        "{events:?}"
    );
    if let Some(storage) = &storage {
        let text = std::fs::read_to_string(storage.join("greetings.txt")).unwrap();
        assert!(
            text.contains(&alloc_id),
            "the data is not in the storage: {text:?}"
        );
    }

    // Run the job again: the new allocation finds the file and appends to it.
    let (job, second, node) = run_example(c, Some(&alloc_id)).await;
    let second_id = second["ID"].as_str().unwrap().to_string();
    read_until(
        c,
        c.target(node, "shared-data").join("greetings.txt"),
        "the second write next to the first",
        &[&alloc_id, &second_id],
    )
    .await;
    c.stop_job(&job, false).await;
    let target = c.target(node, "shared-data");
    c.wait_for(
        60,
        "the placeholder unmounted after the second run",
        || async { (!dhv_binder::node::mounts::is_mount_point(&target)).then_some(()) },
    )
    .await;

    let (code, out) = c.cli(&["volume", "delete", "shared-data"]);
    assert_eq!(code, 0, "{out}");
    if let Some(storage) = &storage {
        assert!(
            !storage.exists(),
            "the plugin's delete left the storage behind"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_job_with_bind_plugin() {
    let c = Cluster::start(2).await;
    let out = c.create_volume("shared-data", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    let storage = c
        .export
        .join("default")
        .join(volume_id(&c, "shared-data").await);
    example_job_round_trip(&c, Some(storage)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_job_with_ext4_plugin() {
    let c = Cluster::start(2).await;
    let images = c.sb.join("images");
    let out = c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "ext4",
        &[("dir", images.to_str().unwrap()), NOBODY_UID, NOBODY_GID],
        &[],
        "capacity_min = \"64MiB\"",
    );
    assert!(out.contains("is ready"), "{out}");
    let image = images
        .join("default")
        .join(format!("{}.img", volume_id(&c, "shared-data").await));
    let meta = std::fs::metadata(&image).unwrap();
    assert_eq!(meta.len(), 64 << 20, "the image is sized from capacity_min");
    example_job_round_trip(&c, None).await;
    assert!(!image.exists(), "delete left the image behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_job_with_webdav_fuse_plugin() {
    let c = Cluster::start(2).await;
    let server = WebdavServer::start(&c.sb.join("webdav-root"), "dhv", "e2e-webdav-pw");
    let out = c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "webdav",
        &[("url", &server.url), ("user", "dhv")],
        &[("password", "e2e-webdav-pw")],
        "",
    );
    assert!(out.contains("is ready"), "{out}");
    let storage = server
        .dir
        .join("default")
        .join(volume_id(&c, "shared-data").await);
    example_job_round_trip(&c, Some(storage)).await;
}

/// A plugin that echoes the volume's secret on stderr and in its errors: the first publish
/// fails with the secret in `{"error"}` and on stderr, the second prints malformed output
/// containing it, the third succeeds; the first unpublish fails the same way.
const LEAKY_PLUGIN: &str = r#"#!/bin/sh
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
pw="$(printf '%s' "${DHV_SECRETS:-null}" | jq -r '.password // empty')"
n() { f="$DHV_PLUGIN_DIR/leaky.$1"; c=$(cat "$f" 2>/dev/null || echo 0); echo $((c+1)) > "$f"; echo $((c+1)); }
case "$1" in
fingerprint) echo '{"version":"1.0.0","deferred_bind":true}' ;;
create)
  echo "leaky: logging in with password=$pw" >&2
  echo '{"bytes":0,"context":{}}' ;;
publish)
  echo "leaky: publish, password=$pw" >&2
  case "$(n publish)" in
  1) echo "{\"error\":\"login refused for password $pw\"}"; exit 1 ;;
  2) echo "garbage with $pw in it"; exit 0 ;;
  esac
  mkdir -p "$DHV_VOLUMES_DIR/leaky/$DHV_VOLUME_ID"
  chown 65534:65534 "$DHV_VOLUMES_DIR/leaky/$DHV_VOLUME_ID"
  mountpoint -q "$DHV_TARGET_PATH" || mount --bind "$DHV_VOLUMES_DIR/leaky/$DHV_VOLUME_ID" "$DHV_TARGET_PATH"
  echo "{\"path\":\"$DHV_TARGET_PATH\",\"context\":{}}" ;;
unpublish)
  echo "leaky: unpublish, password=$pw" >&2
  if [ "$(n unpublish)" = 1 ]; then echo "{\"error\":\"logout refused for $pw\"}"; exit 1; fi
  while mountpoint -q "$DHV_TARGET_PATH"; do umount "$DHV_TARGET_PATH"; done
  echo '{}' ;;
delete) echo "leaky: delete, password=$pw" >&2; echo '{}' ;;
*) exit 1 ;;
esac
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_never_reach_logs_journal_status_or_cli_output() {
    let c = Cluster::start(2).await;
    script(&c.plugin_dir.join("leaky"), LEAKY_PLUGIN);
    c.wait_plugin("leaky").await;
    let secret = format!("pw-{}", uuid::Uuid::new_v4().simple());
    let mut outputs = Vec::new();
    outputs.push(c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "leaky",
        &[],
        &[("password", &secret)],
        "",
    ));
    wait_placeholders(&c, "shared-data", 2).await;
    let (job, alloc, node) = run_example(&c, None).await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let events: Vec<String> = c
        .journal(node)
        .iter()
        .map(|e| e["event"].as_str().unwrap().to_string())
        .collect();
    assert!(
        events.iter().filter(|e| *e == "publish-failed").count() >= 2,
        "the plugin's failures did not happen: {events:?}"
    );
    for i in 0..2 {
        outputs.push(c.status(i).1);
    }
    outputs.push(c.cli(&["volume", "status", "shared-data"]).1);
    outputs.push(c.cli(&["volume", "list"]).1);
    c.stop_job(&job, false).await;
    c.wait_for(60, "the unpublish done after one failure", || async {
        let ev = c.journal(node);
        (ev.iter().any(|e| e["event"] == "unpublish-failed")
            && ev.last().is_some_and(|e| e["event"] == "unpublish-done"))
        .then_some(())
    })
    .await;
    outputs.push(c.status(node).1);
    outputs.push(c.cli(&["volume", "delete", "shared-data"]).1);

    // Everything the daemon and the CLI wrote.
    let mut files: Vec<PathBuf> = Vec::new();
    for n in &c.nodes {
        files.push(n.log.clone());
        files.push(n.state_dir.join("journal.json"));
        files.push(n.state_dir.join("journal.wal"));
        files.push(n.state_dir.join("journal.log"));
    }
    // The prestart task's output: the daemon's API answers, errors included.
    let out = std::process::Command::new("find")
        .arg(c.sb.join("sim"))
        .args(["-path", &format!("*{alloc_id}*"), "-name", "*.std*.*"])
        .output()
        .unwrap();
    files.extend(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(PathBuf::from),
    );
    let mut scanned = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap_or_default();
        scanned += text.len();
        assert!(
            !text.contains(&secret),
            "the secret is in {}:\n{text}",
            f.display()
        );
    }
    for o in &outputs {
        assert!(!o.contains(&secret), "the secret is in CLI output:\n{o}");
    }
    // The plugin really did echo it: the redaction is what kept it out.
    let logs: String = c
        .nodes
        .iter()
        .map(|n| std::fs::read_to_string(&n.log).unwrap_or_default())
        .collect();
    assert!(
        logs.contains("[redacted]"),
        "no redaction happened:\n{logs}"
    );
    eprintln!(
        "scanned {} files ({scanned} bytes) and {} CLI outputs",
        files.len(),
        outputs.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugin_files_are_noticed_while_running() {
    let c = Cluster::start(2).await;
    c.create_volume("shared-data", "single-node-writer");
    wait_placeholders(&c, "shared-data", 2).await;
    // Well under the 15 s periodic rescan: the inotify path did it.
    let bind = c.plugin_dir.join("bind");
    let saved = std::fs::read(&bind).unwrap();
    std::fs::remove_file(&bind).unwrap();
    let started = std::time::Instant::now();
    wait_placeholders(&c, "shared-data", 0).await;
    let removed_after = started.elapsed();
    script(&bind, &String::from_utf8(saved).unwrap());
    let started = std::time::Instant::now();
    wait_placeholders(&c, "shared-data", 2).await;
    let added_after = started.elapsed();
    eprintln!("placeholder gone {removed_after:?} after removing the plugin, back {added_after:?} after adding it");
    assert!(
        removed_after.as_secs() < 10 && added_after.as_secs() < 10,
        "changes were not noticed before the periodic rescan"
    );
    for n in &c.nodes {
        let log = std::fs::read_to_string(&n.log).unwrap();
        assert!(log.contains("plugin directory changed"), "{log}");
    }

    // A plain Nomad DHV plugin (no deferred_bind) dropped in while running: noticed,
    // reported as not deferred, and never used: its volume gets no placeholder.
    script(
        &c.plugin_dir.join("plain"),
        "#!/bin/sh\ncase \"$1\" in fingerprint) echo '{\"version\":\"0.0.1\"}';; create) mkdir -p \"$DHV_VOLUMES_DIR/$DHV_VOLUME_ID\"; echo \"{\\\"path\\\":\\\"$DHV_VOLUMES_DIR/$DHV_VOLUME_ID\\\"}\";; *) echo '{}';; esac\n",
    );
    c.wait_for(
        10,
        "the plain plugin fingerprinted as not deferred",
        || async {
            let (_, out) = c.status(0);
            let v: Value = serde_json::from_str(&out).ok()?;
            (v["plugins"]["plain"]["deferred_bind"] == false).then_some(())
        },
    )
    .await;
    let spec = c.sb.join("plain.volume.hcl");
    std::fs::write(
        &spec,
        "name = \"plain-data\"\ntype = \"host\"\nplugin_id = \"plain\"\ncapability {\n  access_mode = \"single-node-writer\"\n  attachment_mode = \"file-system\"\n}\n",
    )
    .unwrap();
    // `volume create` refuses it at once, naming why each node cannot serve it.
    c.wait_for(
        10,
        "volume create refused for want of a deferred plugin",
        || async {
            let (code, out) = c.cli(&["volume", "create", "--detach", spec.to_str().unwrap()]);
            (code == 1 && out.contains("node-1 (plugin is not deferred_bind)")).then_some(())
        },
    )
    .await;
    // Registered all the same (an existing storage): the agents still never use the plugin.
    let mut text = std::fs::read_to_string(&spec).unwrap();
    text.push_str("context {\n  path = \"/nowhere\"\n}\n");
    std::fs::write(&spec, text).unwrap();
    let (code, out) = c.cli(&["volume", "register", spec.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("jobs using it cannot start yet"), "{out}");
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let (_, out) = c.status(0);
    let v: Value = serde_json::from_str(&out).unwrap();
    let vol = v["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "plain-data")
        .cloned()
        .unwrap_or_else(|| panic!("{out}"));
    assert_eq!(vol["served_here"], false, "{out}");
    assert!(vol["placeholder_id"].is_null(), "{out}");
    assert_eq!(vol["state"], "ready", "{out}");
    let vols = c.get("/v1/volumes?type=host&namespace=*").await;
    assert!(
        !vols
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["Name"] == "plain-data"),
        "{vols}"
    );
    let log = std::fs::read_to_string(&c.nodes[0].log).unwrap();
    assert!(log.contains("plugin is not deferred"), "{log}");
}

/// B14: the FUSE process behind a published mount dies; within a health interval the mount
/// is reported, detached, published again, and the allocation's task is restarted onto it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_fuse_mount_is_republished_and_the_allocation_restarted() {
    let c = Cluster::start(2).await;
    let server = WebdavServer::start(&c.sb.join("webdav-root"), "dhv", "b14-pw");
    c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "webdav",
        &[("url", &server.url), ("user", "dhv")],
        &[("password", "b14-pw")],
        "",
    );
    wait_placeholders(&c, "shared-data", 2).await;
    let (job, alloc, node) = run_example(&c, None).await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let target = c.target(node, "shared-data");
    let greetings = server
        .dir
        .join("default")
        .join(volume_id(&c, "shared-data").await)
        .join("greetings.txt");
    read_until(
        &c,
        greetings.clone(),
        "the first line on the server",
        &[&alloc_id],
    )
    .await;

    // Once rclone's cache marks nothing dirty: a write still dirty when its rclone dies is
    // uploaded by the next publish's rclone (tests/plugins.rs,
    // `a_republish_uploads_what_a_killed_rclone_left_unsaved`); this test is about the
    // republish of a mount whose writes had all reached the server.
    let meta = c.nodes[node]
        .state_dir
        .join("volumes/webdav/cache")
        .join(volume_id(&c, "shared-data").await)
        .join("vfsMeta");
    c.wait_for(20, "rclone's cache with nothing dirty", || async {
        (dirty_files(&meta) == 0).then_some(())
    })
    .await;
    // The FUSE process dies (as when a storage plugin restarts).
    let pids = mount_pids(&target);
    assert_eq!(pids.len(), 1, "{pids:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    c.wait_for(10, "the dead mount reported in the log", || async {
        std::fs::read_to_string(&c.nodes[node].log)
            .ok()
            .filter(|l| l.contains("published mount is dead"))
            .map(|_| ())
    })
    .await;
    c.wait_for(
        30,
        "the task restarted onto the republished mount",
        || async {
            c.allocs(&job).await.into_iter().find(|a| {
                a["ID"] == alloc_id.as_str()
                    && task_state(a, "app")["Restarts"].as_u64().unwrap_or(0) >= 1
                    && task_state(a, "app")["State"] == "running"
            })
        },
    )
    .await;
    // The restarted task wrote a second line, through the new mount, to the server.
    c.wait_for(20, "a second line from the same allocation", || async {
        std::fs::read_to_string(&greetings)
            .ok()
            .filter(|t| t.matches(alloc_id.as_str()).count() >= 2)
    })
    .await;
    assert!(
        std::fs::metadata(&target).is_ok(),
        "the target is still dead"
    );
    let (_, out) = c.status(node);
    let v: Value = serde_json::from_str(&out).unwrap();
    let rec = &v["mount_health"]["recovered"];
    assert_eq!(rec[0]["volume"], "default/shared-data", "{out}");
    assert!(
        rec[0]["error"].as_str().unwrap().contains("not connected"),
        "{out}"
    );
    let events: Vec<String> = c
        .journal(node)
        .iter()
        .map(|e| e["event"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        events.iter().filter(|e| *e == "publish-done").count(),
        2,
        "{events:?}"
    );
    c.stop_job(&job, false).await;
    c.wait_for(60, "unpublished after the job stopped", || async {
        (!dhv_binder::node::mounts::is_mount_point(&target)).then_some(())
    })
    .await;
}

fn mount_id(target: &std::path::Path) -> Option<String> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .find(|l| {
            l.split(' ')
                .nth(4)
                .is_some_and(|p| std::path::Path::new(p) == target)
        })
        .map(|l| l.split(' ').next().unwrap().to_string())
}

fn published_count(c: &Cluster, node: usize) -> usize {
    c.journal(node)
        .iter()
        .filter(|e| e["event"] == "publish-done")
        .count()
}

/// B02 and §5 row 2: restarting the allocation's main task leaves the volume alone (same
/// mount, no unpublish, no second publish); restarting all tasks re-runs the prestart
/// task, whose publish call is answered with the same path without a second mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b02_alloc_restart_keeps_the_same_mount() {
    let c = Cluster::start(1).await;
    c.create_volume("shared-data", "single-node-writer");
    let job = c.run_job(&repo().join("jobspecs/example.nomad.hcl")).await;
    let alloc = c
        .wait_for(60, "the main task running", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| task_state(a, "app")["State"] == "running")
        })
        .await;
    let id = alloc["ID"].as_str().unwrap().to_string();
    let target = c.target(0, "shared-data");
    let before = mount_id(&target).expect("published");

    for (all, restarts) in [(false, 1), (true, 2)] {
        let r = c
            .http
            .put(format!("{}/v1/client/allocation/{id}/restart", c.server))
            .json(&serde_json::json!({"AllTasks": all}))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "restart: {}", r.status());
        c.wait_for(60, "the main task restarted and running", || async {
            c.allocs(&job).await.into_iter().find(|a| {
                a["ID"] == id.as_str()
                    && task_state(a, "app")["Restarts"].as_u64() >= Some(restarts)
                    && task_state(a, "app")["State"] == "running"
            })
        })
        .await;
        assert_eq!(
            mount_id(&target).as_deref(),
            Some(before.as_str()),
            "the mount changed (all tasks: {all})"
        );
        assert_eq!(support::cluster::mount_count(&target), 1);
        assert_eq!(
            published_count(&c, 0),
            1,
            "published again (all tasks: {all})"
        );
        assert!(
            !c.journal(0)
                .iter()
                .any(|e| e["event"] == "unpublish-intent"),
            "unpublished on a restart"
        );
    }
    // The prestart task ran twice: once at start, once for the all-tasks restart.
    let a = c.get(&format!("/v1/allocation/{id}")).await;
    assert!(
        task_state(&a, "publish-volumes")["Restarts"].as_u64() >= Some(1) || {
            let log = std::fs::read_to_string(c.sb.join(&format!(
                "sim/node-1/alloc/{id}/alloc/logs/publish-volumes.stdout.0"
            )))
            .unwrap_or_default();
            log.matches("published at").count() >= 2
        },
        "the prestart task did not run again: {a}"
    );
    c.stop_job(&job, false).await;
}

/// B26 and §5 row 15: a reader volume is published read-only; a task whose volume_mount
/// says read_only = false still cannot write (EROFS); after the stop, the unpublish uses
/// the stored target and no mount remains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b26_reader_volume_is_read_only_and_unpublished_at_the_stored_path() {
    let c = Cluster::start(1).await;
    c.create_volume("ro-data", "single-node-reader-only");
    let spec = std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl"))
        .unwrap()
        .replace("shared-data-demo", "ro-demo")
        .replace("source          = \"shared-data\"", "source          = \"ro-data\"\n      read_only       = true")
        .replace("single-node-writer", "single-node-reader-only")
        .replace(
            "echo \"$(date -u +%Y-%m-%dT%H:%M:%SZ) written by allocation $NOMAD_ALLOC_ID\" >> /data/greetings.txt",
            "if touch /data/probe 2>/tmp/err; then echo WRITABLE; else cat /tmp/err; fi",
        )
        .replace("cat /data/greetings.txt", "ls /data");
    let path = c.sb.join("ro.nomad.hcl");
    std::fs::write(&path, spec).unwrap();
    let job = c.run_job(&path).await;
    let alloc = c
        .wait_for(60, "the main task running", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| task_state(a, "app")["State"] == "running")
        })
        .await;
    let id = alloc["ID"].as_str().unwrap();
    let log =
        c.sb.join(&format!("sim/node-1/alloc/{id}/alloc/logs/app.stdout.0"));
    let out = c
        .wait_for(20, "the write attempt", || async {
            std::fs::read_to_string(&log)
                .ok()
                .filter(|t| t.contains("Read-only") || t.contains("WRITABLE"))
        })
        .await;
    assert!(out.contains("Read-only file system"), "{out}");
    let target = c.target(0, "ro-data");
    let publish = c
        .journal(0)
        .into_iter()
        .find(|e| e["event"] == "publish-done")
        .unwrap();
    assert_eq!(publish["detail"]["read_only"], true);
    c.stop_job(&job, false).await;
    c.wait_for(30, "unpublished", || async {
        c.journal(0)
            .last()
            .filter(|e| e["event"] == "unpublish-done")
            .map(|_| ())
    })
    .await;
    let intent = c
        .journal(0)
        .into_iter()
        .find(|e| e["event"] == "unpublish-intent")
        .unwrap();
    assert_eq!(intent["detail"]["target"], publish["detail"]["target"]);
    assert_eq!(support::cluster::mount_count(&target), 0);
}

/// Issue 44 §4: a task bound to the placeholder before a read-only publish, with
/// `propagation_mode = "host-to-task"` (no prestart gate: it starts on the empty
/// placeholder), gets the volume read-only, nosuid and nodev. The publish reaches the task
/// as a copy of the mount as it was when it appeared; with a bind then a remount, that copy
/// was writable (the task printed WRITABLE).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_to_task_task_under_a_read_only_publish_cannot_write() {
    let c = Cluster::start(1).await;
    c.create_volume("ro-h2t", "single-node-reader-only");
    let id = volume_id(&c, "ro-h2t").await;
    std::fs::write(c.export.join("default").join(&id).join("seed"), "seed").unwrap();
    // The publish waits until the task runs on the empty placeholder (the file `go`).
    let real = c.sb.join("real-plugins/bind");
    std::fs::create_dir_all(real.parent().unwrap()).unwrap();
    std::fs::copy(c.plugin_dir.join("bind"), &real).unwrap();
    let go = c.sb.join("go");
    script(
        &c.plugin_dir.join("bind"),
        &format!(
            "#!/bin/sh\nif [ \"$1\" = publish ]; then\n  i=0\n  while [ ! -e '{go}' ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i + 1)); done\nfi\nexec '{real}' \"$@\"\n",
            go = go.display(),
            real = real.display()
        ),
    );
    let spec = c.sb.join("ro-h2t.nomad.hcl");
    std::fs::write(
        &spec,
        r#"job "ro-h2t" {
  type        = "service"
  datacenters = ["*"]
  group "app" {
    volume "data" {
      type            = "host"
      source          = "ro-h2t"
      access_mode     = "single-node-reader-only"
      attachment_mode = "file-system"
      read_only       = true
    }
    task "app" {
      driver = "exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "echo waiting; until [ -e /data/seed ]; do sleep 0.2; done; grep ' /data ' /proc/self/mountinfo | tail -n 1; if touch /data/probe 2>/tmp/err; then echo WRITABLE; else cat /tmp/err; fi; sleep 600"]
      }
      volume_mount {
        volume           = "data"
        destination      = "/data"
        propagation_mode = "host-to-task"
      }
      kill_timeout = "1s"
    }
  }
}
"#,
    )
    .unwrap();
    let job = c.run_job(&spec).await;
    let alloc = c
        .running_alloc(&job, "app", 60, "the task running before the publish")
        .await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let log = c.sb.join(&format!(
        "sim/node-1/alloc/{alloc_id}/alloc/logs/app.stdout.0"
    ));
    c.wait_for(30, "the task waiting on the empty placeholder", || async {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|t| t.contains("waiting"))
            .map(|_| ())
    })
    .await;
    std::fs::write(&go, "").unwrap();
    let out = c
        .wait_for(60, "the task's write attempt", || async {
            std::fs::read_to_string(&log)
                .ok()
                .filter(|t| t.contains("Read-only") || t.contains("WRITABLE"))
        })
        .await;
    assert!(out.contains("Read-only file system"), "{out}");
    let line = out
        .lines()
        .find(|l| l.contains(" /data "))
        .unwrap_or_else(|| panic!("no /data line in {out}"));
    let opts: Vec<&str> = line.split(' ').nth(5).unwrap().split(',').collect();
    for o in ["ro", "nosuid", "nodev"] {
        assert!(opts.contains(&o), "{o} missing in the task's copy: {line}");
    }
    assert!(!c.export.join("default").join(&id).join("probe").exists());
    let a = c.get(&format!("/v1/allocation/{alloc_id}")).await;
    assert_eq!(
        task_state(&a, "app")["Restarts"],
        0,
        "the task was restarted: {a}"
    );
    c.stop_job(&job, false).await;
}

/// B15 (docs/simulator.md, issue 34 table, row 1): `job stop -purge` deletes the job's
/// allocations at once, the running one included (`DeleteJobTxn` → `deleteAllocsForJobTxn`),
/// with no allocation event and no rise of the node's allocation index; the client kills the
/// tasks. The daemon notices within seconds in either watch mode (stream: the Job topic's
/// `JobDeregistered`, with `Deleted` from Nomad 1.11.3, without it before (issue 45: the
/// simulator speaks `nomad_version`'s shape), then a 404 on the job's allocation here; in
/// both modes the allocation's processes gone, then a 404 on it), unpublishes once the task
/// is gone, exactly once, and releases the claim, within 30 s with the default settings (the
/// resync alone would take 300 s).
async fn b15_purged_job_is_unpublished_and_its_claim_released(mode: &str, nomad_version: &str) {
    let c = Cluster::start_with(
        1,
        &format!("nomad_version = \"{nomad_version}\""),
        &[("DHV_BINDER_WATCH_MODE", mode)],
    )
    .await;
    c.create_volume("shared-data", "single-node-writer");
    // Another allocation on the node (on a real node, the daemon's own), so that the
    // node's allocation list's index stays the highest ModifyIndex of its allocations and
    // the purge does not raise it.
    let sleeper = c.sb.join("sleeper.nomad.hcl");
    std::fs::write(
        &sleeper,
        r#"job "sleeper" {
  datacenters = ["*"]
  group "g" {
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args    = ["1000"]
      }
    }
  }
}
"#,
    )
    .unwrap();
    c.run_job(&sleeper).await;
    let job = c.run_job(&repo().join("jobspecs/example.nomad.hcl")).await;
    let alloc = c
        .wait_for(60, "the main task running", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| task_state(a, "app")["State"] == "running")
        })
        .await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let claim = "/v1/var/dhv-binder/claims/shared-data";
    let held = c.get(claim).await;
    assert!(held["Lock"]["ID"].is_string(), "no claim held: {held}");
    let purged_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    c.stop_job(&job, true).await;
    assert!(
        c.get_opt(&format!("/v1/allocation/{alloc_id}"))
            .await
            .is_none(),
        "the purge left the allocation"
    );
    c.wait_for(30, "the unpublish and the claim's release", || async {
        let done = c
            .journal(0)
            .last()
            .is_some_and(|e| e["event"] == "unpublish-done");
        let v = c.get_opt(claim).await;
        let released = v.is_none_or(|v| v.get("Lock").is_none_or(|l| l.is_null()));
        (done && released).then_some(())
    })
    .await;
    // One unpublish, done once. Under load the client may still be killing the purged
    // task when the agent first tries: each such try is refused (the mount is busy) and
    // recorded as failed before the next; none may succeed early.
    let journal = c.journal(0);
    let events: Vec<&str> = journal
        .iter()
        .filter_map(|e| e["event"].as_str())
        .filter(|e| e.starts_with("unpublish-"))
        .collect();
    let intents: Vec<u64> = journal
        .iter()
        .filter(|e| e["event"] == "unpublish-intent")
        .map(|e| e["unix_ms"].as_u64().unwrap())
        .collect();
    let (done, failed) = (
        events.iter().filter(|e| **e == "unpublish-done").count(),
        events.iter().filter(|e| **e == "unpublish-failed").count(),
    );
    assert!(
        done == 1 && intents.len() == failed + 1,
        "every unpublish try but the last was refused, and one succeeded: {events:?}"
    );
    eprintln!(
        "B15 ({mode}, Nomad {nomad_version}): first unpublish try {} ms after the purge, {} tries",
        intents[0] - purged_at,
        intents.len()
    );
    assert_eq!(
        support::cluster::mount_count(&c.target(0, "shared-data")),
        0
    );
}

/// A service (re)started on the node while a volume is published (a package upgrade restarts
/// one with `PrivateTmp=`) has a slave copy of the volume's mount in its namespace: the
/// unpublish does not wait for it, removes it with the host's mount, and leaves the service
/// running. A private copy, which the host's unmount would not reach, holds the unpublish
/// until its process exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_started_after_the_publish_does_not_hold_up_the_unpublish() {
    let c = Cluster::start(1).await;
    c.create_volume("shared-data", "single-node-writer");
    let job = c.run_job(&repo().join("jobspecs/example.nomad.hcl")).await;
    c.wait_for(60, "the main task running", || async {
        c.allocs(&job)
            .await
            .into_iter()
            .find(|a| task_state(a, "app")["State"] == "running")
    })
    .await;
    let target = c.target(0, "shared-data");
    // A process in a namespace of its own made while the volume is published (as systemd
    // makes one for a service with `PrivateTmp=`: slave), and a private one.
    let idle = "cd / && echo ready && exec sleep 600";
    let mut service = Namespaced::start(c.sb.path(), "slave", idle);
    let pinning = Namespaced::start(c.sb.path(), "private", idle);
    for s in [&service, &pinning] {
        assert!(s.has_mount_at(&target), "no copy of {}", target.display());
    }
    c.stop_job(&job, false).await;
    c.wait_for(60, "an unpublish refused for the private copy", || async {
        c.journal(0)
            .iter()
            .any(|e| {
                e["event"] == "unpublish-failed"
                    && e["detail"]["error"]
                        .as_str()
                        .is_some_and(|m| m.contains(&format!("pid {}", pinning.pid())))
            })
            .then_some(())
    })
    .await;
    let refusal = c
        .journal(0)
        .into_iter()
        .rev()
        .find(|e| e["event"] == "unpublish-failed")
        .unwrap();
    assert!(
        !refusal["detail"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains(&format!("pid {}", service.pid())),
        "the slave copy was counted as a holder: {refusal}"
    );
    drop(pinning);
    c.wait_for(
        60,
        "the unpublish once the private copy is gone",
        || async {
            c.journal(0)
                .last()
                .is_some_and(|e| e["event"] == "unpublish-done")
                .then_some(())
        },
    )
    .await;
    assert!(
        !service.has_mount_at(&target),
        "the unpublish left the service's copy"
    );
    assert!(service.alive(), "the service was killed");
    assert_eq!(support::cluster::mount_count(&target), 0);
}

/// Issue 34 row 2: after a server-side stop Nomad kills the main task, then runs the
/// poststop task (`killTasks`, the lifecycle coordinator). A poststop task that uses the
/// deferred volume finds it still published and writes to it; the unpublish waits for its
/// end (the allocation stays `running` until then, and its task is not yet `dead`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poststop_task_after_a_stop_writes_to_the_volume_before_the_unpublish() {
    let c = Cluster::start(1).await;
    c.create_volume("shared-data", "single-node-writer");
    let storage = c
        .export
        .join("default")
        .join(volume_id(&c, "shared-data").await);
    let src = std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl")).unwrap();
    let flush = r#"    task "flush" {
      lifecycle {
        hook = "poststop"
      }
      driver = "exec"
      config {
        command = "/bin/sh"
        args    = ["-c", "sleep 3; mountpoint -q /data || exit 1; echo \"flushed by poststop of $NOMAD_ALLOC_ID\" >> /data/greetings.txt"]
      }
      volume_mount {
        volume      = "data"
        destination = "/data"
      }
    }

    task "app" {"#;
    let with_poststop = src.replacen("    task \"app\" {", flush, 1);
    assert_ne!(with_poststop, src, "the example job has no task \"app\"");
    let jobspec = c.sb.join("poststop.nomad.hcl");
    std::fs::write(&jobspec, with_poststop).unwrap();
    let job = c.run_job(&jobspec).await;
    let alloc = c
        .wait_for(60, "the main task running", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| task_state(a, "app")["State"] == "running")
        })
        .await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    c.stop_job(&job, false).await;
    let done = c
        .wait_for(60, "the allocation complete", || async {
            let a = c.get(&format!("/v1/allocation/{alloc_id}")).await;
            (a["ClientStatus"] == "complete").then_some(a)
        })
        .await;
    let flush = task_state(&done, "flush");
    assert_eq!(flush["State"], "dead", "{done}");
    assert_eq!(
        flush["Failed"], false,
        "the poststop task found no mount: {done}"
    );
    let text = std::fs::read_to_string(storage.join("greetings.txt")).unwrap();
    assert!(
        text.contains(&format!("flushed by poststop of {alloc_id}")),
        "the poststop task's write is not in the volume: {text:?}"
    );
    c.wait_for(30, "the unpublish", || async {
        c.journal(0)
            .last()
            .filter(|e| e["event"] == "unpublish-done")
            .cloned()
    })
    .await;
    let finished = chrono_ms(flush["FinishedAt"].as_str().unwrap());
    let intent = c
        .journal(0)
        .into_iter()
        .find(|e| e["event"] == "unpublish-intent")
        .unwrap();
    assert!(
        intent["unix_ms"].as_u64().unwrap() >= finished,
        "unpublished at {} ms, before the poststop task ended at {finished} ms",
        intent["unix_ms"]
    );
}

/// Milliseconds since the Unix epoch of an RFC 3339 time as Nomad writes it.
fn chrono_ms(t: &str) -> u64 {
    humantime::parse_rfc3339(t)
        .unwrap_or_else(|e| panic!("not an RFC 3339 time {t:?}: {e}"))
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b15_purged_job_is_unpublished_and_its_claim_released_in_poll_mode() {
    b15_purged_job_is_unpublished_and_its_claim_released("poll", "2.0.5").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b15_purged_job_is_unpublished_and_its_claim_released_in_stream_mode() {
    b15_purged_job_is_unpublished_and_its_claim_released("stream", "2.0.5").await;
}

/// Issue 45: on Nomad 1.10.x–1.11.2 a purge's Job event has no `Deleted`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b15_purged_job_is_unpublished_and_its_claim_released_in_stream_mode_on_nomad_1_10() {
    b15_purged_job_is_unpublished_and_its_claim_released("stream", "1.10.5").await;
}

/// Issue 45: the last version before `Deleted` (hashicorp/nomad#27614).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b15_purged_job_is_unpublished_and_its_claim_released_in_stream_mode_on_nomad_1_11_2() {
    b15_purged_job_is_unpublished_and_its_claim_released("stream", "1.11.2").await;
}

/// Issue 45: a version with `Deleted`, in poll mode too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b15_purged_job_is_unpublished_and_its_claim_released_in_poll_mode_on_nomad_1_10() {
    b15_purged_job_is_unpublished_and_its_claim_released("poll", "1.10.5").await;
}

/// The node that ran a volume's create registers its placeholder right after, not at the
/// safety relist (`--record-relist`, 60 s here): its worker's record write updates the change
/// marker, which the agent follows, so a job submitted once `volume create` says ready places
/// there at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_creating_node_registers_its_placeholder_without_waiting_for_a_relist() {
    let mut c = Cluster::start_sim(1, "", &[("DHV_BINDER_RECORD_RELIST", "60s")], &[]).await;
    // The record is written while the agent is down (its node record, which `volume create`
    // asks for, stays): its first listing after the start finds it pending.
    c.start_agent(0);
    c.wait_plugin("bind").await;
    c.kill_agent(0, nix::sys::signal::Signal::SIGTERM);
    let spec = c.sb.join("floor.volume.hcl");
    std::fs::write(
        &spec,
        format!(
            "name = \"floor-data\"\ntype = \"host\"\nplugin_id = \"bind\"\ncapability {{\n  access_mode = \"single-node-writer\"\n  attachment_mode = \"file-system\"\n}}\nparameters {{\n  export = \"{}\"\n}}\n",
            c.export.display()
        ),
    )
    .unwrap();
    let (code, out) = c.cli(&["volume", "create", "-detach", spec.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    c.start_agent(0);
    let started = std::time::Instant::now();
    wait_placeholders_within(&c, "floor-data", 1, 15).await;
    eprintln!(
        "agent start to placeholder registered: {:.1} s (relist 60 s)",
        started.elapsed().as_secs_f64()
    );
}

/// Files of rclone's cache metadata under `dir` that mark a file not uploaded yet
/// (`"Dirty": true`), as the webdav plugin counts them.
fn dirty_files(dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| {
            let p = e.path();
            if p.is_dir() {
                dirty_files(&p)
            } else {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                usize::from(text.contains("\"Dirty\": true") || text.contains("\"Dirty\":true"))
            }
        })
        .sum()
}
