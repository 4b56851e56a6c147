//! Planted volume records (issue 13 §1): the real agents, with the operator's public key
//! configured on each node, against the Nomad simulator. Whoever may write variables under
//! `dhv-binder/volumes/` (a namespace user, or one node's daemon token) plants records; none
//! of them makes a node mount or delete anything, and each is named in the agent's log.

mod support;

use serde_json::{json, Value};
use support::cluster::Cluster;

/// A host directory and file the attacker wants: mounted into a job, or deleted.
fn victims(c: &Cluster) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = c.sb.join("victim-dir");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("precious"), "keep me").unwrap();
    let file = c.sb.join("victim-file");
    std::fs::write(&file, "keep me too").unwrap();
    (dir, file)
}

/// A variable body for a record, as `VolumeRecord::to_variable` writes it.
fn body(name: &str, items: Value) -> Value {
    json!({"Namespace": "default", "Path": format!("dhv-binder/volumes/{name}"), "Items": items})
}

fn spec(name: &str, export: &str) -> String {
    json!({
        "name": name, "namespace": "default", "plugin_id": "bind", "capacity_min": 0,
        "capacity_max": 0, "node_pool": "",
        "capabilities": [{"access_mode": "single-node-writer", "attachment_mode": "file-system"}],
        "parameters": {"export": export}
    })
    .to_string()
}

/// The items of an unsigned record in `state` whose plugin context points at `target`.
fn unsigned(name: &str, export: &str, state: &str, target: &std::path::Path) -> Value {
    json!({
        "id": uuid::Uuid::new_v4().to_string(), "spec": spec(name, export),
        "secrets": "{}", "state": state,
        "context": json!({"export_path": target}).to_string(),
        "capacity_bytes": "0", "worker_node": "", "error": ""
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_records_mount_and_delete_nothing() {
    let c = Cluster::start(2).await;
    let (victim_dir, victim_file) = victims(&c);
    // A legitimate, signed volume.
    let out = c.create_volume("good", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    let good = c
        .get("/v1/var/dhv-binder/volumes/good?namespace=default")
        .await;
    let good_items = good["Items"].clone();
    assert!(
        good_items["signature"]
            .as_str()
            .is_some_and(|s| s.starts_with("ed25519:")),
        "the CLI did not sign: {good_items}"
    );
    let export_root = c.export.display().to_string();
    let good_dir = std::path::PathBuf::from(
        serde_json::from_str::<Value>(good_items["context"].as_str().unwrap()).unwrap()
            ["export_path"]
            .as_str()
            .unwrap(),
    );
    std::fs::write(good_dir.join("data"), "the good volume's data").unwrap();

    // 1. An unsigned record, ready, whose context points at a host directory.
    c.put(
        "/v1/var/dhv-binder/volumes/evil-unsigned?namespace=default",
        body(
            "evil-unsigned",
            unsigned("evil-unsigned", "/", "ready", &victim_dir),
        ),
    )
    .await;
    // 2. The good record's signature on a record with other parameters (a forged export).
    let mut tampered = good_items.clone();
    tampered["spec"] = Value::from(spec("evil-tampered", "/"));
    tampered["context"] = Value::from(json!({"export_path": victim_dir}).to_string());
    c.put(
        "/v1/var/dhv-binder/volumes/evil-tampered?namespace=default",
        body("evil-tampered", tampered),
    )
    .await;
    // 3. The good record copied, signature and all, to another path.
    c.put(
        "/v1/var/dhv-binder/volumes/evil-copy?namespace=default",
        body("evil-copy", good_items.clone()),
    )
    .await;
    // 4. An unsigned record in state deleting whose context names a host file (delete as root).
    c.put(
        "/v1/var/dhv-binder/volumes/evil-delete?namespace=default",
        body(
            "evil-delete",
            unsigned("evil-delete", &export_root, "deleting", &victim_file),
        ),
    )
    .await;
    // 5. What one node's daemon token can do to a signed record: move it to `deleting`
    //    (no operator delete signature) with its context pointing at the victim directory.
    let mut forged_delete = good_items.clone();
    forged_delete["state"] = Value::from("deleting");
    forged_delete["worker_node"] = Value::from("");
    c.put(
        "/v1/var/dhv-binder/volumes/good?namespace=default",
        body("good", forged_delete),
    )
    .await;

    // Every node logs each planted record by its path, and acts on none of them.
    for path in [
        "dhv-binder/volumes/evil-unsigned",
        "dhv-binder/volumes/evil-tampered",
        "dhv-binder/volumes/evil-copy",
        "dhv-binder/volumes/evil-delete",
        "dhv-binder/volumes/good",
    ] {
        for n in &c.nodes {
            c.wait_for(
                30,
                &format!("{} logs the refusal of {path}", n.name),
                || async {
                    let log = std::fs::read_to_string(&n.log).unwrap_or_default();
                    log.lines()
                        .any(|l| l.contains("refusing a volume record") && l.contains(path))
                        .then_some(())
                },
            )
            .await;
        }
    }
    // The agents went on to act on a later signed record: the planted ones had their chance.
    let out = c.create_volume("after", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    let logs: String = c
        .nodes
        .iter()
        .map(|n| std::fs::read_to_string(&n.log).unwrap_or_default())
        .collect();
    for reason in [
        "is not signed",
        "does not verify",
        "copied to another path",
        "without a valid operator delete signature",
    ] {
        assert!(logs.contains(reason), "no refusal says {reason:?}:\n{logs}");
    }
    // `dhv-binder status` names each refused record with its reason.
    let (code, st) = c.status(0);
    assert_eq!(code, 0, "{st}");
    let st: Value = serde_json::from_str(&st).unwrap();
    for path in [
        "evil-unsigned",
        "evil-tampered",
        "evil-copy",
        "evil-delete",
        "good",
    ] {
        let key = format!("default/dhv-binder/volumes/{path}");
        assert!(
            st["rejected_records"][&key]
                .as_str()
                .is_some_and(|r| !r.is_empty()),
            "status does not name {key}: {}",
            st["rejected_records"]
        );
    }
    // No placeholder was registered for a planted record.
    let vols = c.get("/v1/volumes?type=host&namespace=*").await;
    let names: Vec<&str> = vols
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["Name"].as_str())
        .collect();
    assert!(
        names.iter().all(|n| !n.starts_with("evil")),
        "placeholders for planted records: {names:?}"
    );
    // Nothing was mounted from the victims, and nothing was deleted.
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let victim = victim_dir.display().to_string();
    assert!(
        !mountinfo.lines().any(|l| l.contains(&victim)),
        "a victim is mounted:\n{mountinfo}"
    );
    assert_eq!(
        std::fs::read_to_string(victim_dir.join("precious")).unwrap(),
        "keep me"
    );
    assert_eq!(
        std::fs::read_to_string(&victim_file).unwrap(),
        "keep me too"
    );
    assert_eq!(
        std::fs::read_to_string(good_dir.join("data")).unwrap(),
        "the good volume's data"
    );
    // The records are still there (never deleted by an agent): the operator sees them.
    for name in [
        "evil-unsigned",
        "evil-tampered",
        "evil-copy",
        "evil-delete",
        "good",
    ] {
        let v = c
            .get(&format!(
                "/v1/var/dhv-binder/volumes/{name}?namespace=default"
            ))
            .await;
        assert!(v["Items"].is_object(), "{name} is gone: {v}");
    }
}

/// The operator's own delete, signed by the CLI, still works end to end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_delete_is_carried_out() {
    let c = Cluster::start(1).await;
    let out = c.create_volume("doomed", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    let (code, out) = c.cli(&["volume", "delete", "doomed"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("deleted"), "{out}");
}

/// The plugin context of a created volume, as the record holds it (a JSON string).
async fn context_of(c: &Cluster, name: &str) -> (Value, std::path::PathBuf) {
    let v = c
        .get(&format!(
            "/v1/var/dhv-binder/volumes/{name}?namespace=default"
        ))
        .await;
    let items = v["Items"].clone();
    let ctx: Value = serde_json::from_str(items["context"].as_str().unwrap()).unwrap();
    let dir = std::path::PathBuf::from(ctx["export_path"].as_str().unwrap());
    (items, dir)
}

/// Issue 33 §1: whoever may write Variables in the volume's namespace re-points a signed,
/// created volume's context (not signed: a node wrote it) at another volume's directory,
/// with a trailing `/`. The bind plugin derives the directory from the signed export,
/// namespace and ID, so the job using the volume gets nothing of the other volume's data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repointed_context_mounts_nothing_of_another_volume() {
    let c = Cluster::start(1).await;
    let out = c.create_volume("prod-data", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    let out = c.create_volume("shared-data", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    let (_, prod_dir) = context_of(&c, "prod-data").await;
    std::fs::write(prod_dir.join("precious"), "prod's data").unwrap();
    let (mut items, _) = context_of(&c, "shared-data").await;
    items["context"] =
        Value::from(json!({"export_path": format!("{}/", prod_dir.display())}).to_string());
    c.put(
        "/v1/var/dhv-binder/volumes/shared-data?namespace=default",
        body("shared-data", items),
    )
    .await;
    // The signature still verifies (the context is not part of it): the agent acts on the
    // record, and the plugin refuses the context.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let job = c
        .run_job(&support::cluster::repo().join("jobspecs/example.nomad.hcl"))
        .await;
    let target = c.target(0, "shared-data");
    c.wait_for(90, "the plugin's refusal of the context", || async {
        assert!(
            !target.join("precious").exists(),
            "prod's directory was mounted for shared-data"
        );
        let log = std::fs::read_to_string(&c.nodes[0].log).unwrap_or_default();
        log.lines()
            .any(|l| l.contains("publish failed") && l.contains("does not belong to this record"))
            .then_some(())
    })
    .await;
    assert!(!target.join("precious").exists());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let prod = prod_dir.display().to_string();
    assert!(
        !mountinfo.lines().any(|l| l.contains(&prod)),
        "prod's directory is mounted:\n{mountinfo}"
    );
    c.stop_job(&job, true).await;
    assert_eq!(
        std::fs::read_to_string(prod_dir.join("precious")).unwrap(),
        "prod's data"
    );
}

/// Issue 33 §2: the saved `deleting` record of a deleted volume, operator's delete signature
/// and all, written back later with another volume's directory as its context. The delete
/// signature binds the context and the variable's CreateIndex: the record is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_signed_delete_deletes_nothing() {
    let mut c = Cluster::start(1).await;
    let out = c.create_volume("prod-data", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    let out = c.create_volume("doomed", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    let (_, prod_dir) = context_of(&c, "prod-data").await;
    std::fs::write(prod_dir.join("precious"), "prod's data").unwrap();
    // The attacker saves the signed `deleting` record while no node has acted on it yet.
    c.kill_agent(0, nix::sys::signal::Signal::SIGKILL);
    let (code, out) = c.cli(&["volume", "delete", "--detach", "doomed"]);
    assert_eq!(code, 0, "{out}");
    let (saved, doomed_dir) = context_of(&c, "doomed").await;
    assert_eq!(saved["state"], "deleting", "{saved}");
    assert!(
        saved["delete_signature"]
            .as_str()
            .is_some_and(|s| s.starts_with("ed25519:")),
        "{saved}"
    );
    c.start_agent(0);
    c.wait_for(60, "the operator's delete done", || async {
        c.get_opt("/v1/var/dhv-binder/volumes/doomed?namespace=default")
            .await
            .is_none()
            .then_some(())
    })
    .await;
    assert!(!doomed_dir.exists(), "the signed delete did not delete");
    // Later: the saved record written back, pointing at prod's directory.
    let mut replay = saved.clone();
    replay["context"] = Value::from(json!({"export_path": prod_dir}).to_string());
    replay["worker_node"] = Value::from("");
    c.put(
        "/v1/var/dhv-binder/volumes/doomed?namespace=default",
        body("doomed", replay),
    )
    .await;
    c.wait_for(30, "the refusal of the replayed delete", || async {
        let log = std::fs::read_to_string(&c.nodes[0].log).unwrap_or_default();
        log.lines()
            .any(|l| {
                l.contains("refusing a volume record")
                    && l.contains("dhv-binder/volumes/doomed")
                    && l.contains("without a valid operator delete signature")
            })
            .then_some(())
    })
    .await;
    assert_eq!(
        std::fs::read_to_string(prod_dir.join("precious")).unwrap(),
        "prod's data"
    );
}

/// Issue 46 §3: a pending volume signed with a key no node trusts is refused by every node,
/// whose refusal says to sign it with a trusted key and run the command again; running
/// `volume create` again with the operator's (trusted) key signs the pending record again,
/// and the volume is created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_volume_signed_with_an_untrusted_key_is_fixed_by_creating_it_again_with_the_right_key(
) {
    let c = Cluster::start(1).await;
    let (_, stranger) = dhv_binder::cluster::trust::SigningKey::generate().unwrap();
    let stranger_key = c.sb.join("stranger.key");
    {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&stranger_key)
            .and_then(|mut f| f.write_all(stranger.as_bytes()))
            .unwrap();
    }
    let spec = c.sb.join("resigned.volume.hcl");
    std::fs::write(
        &spec,
        format!(
            "name = \"resigned\"\ntype = \"host\"\nplugin_id = \"bind\"\ncapability {{\n  access_mode = \"single-node-writer\"\n  attachment_mode = \"file-system\"\n}}\nparameters {{\n  export = \"{}\"\n}}\n",
            c.export.display()
        ),
    )
    .unwrap();
    let spec = spec.to_str().unwrap();
    let out = std::process::Command::new(support::cluster::agent_bin())
        .args(["volume", "create", "-timeout", "10s", spec])
        .env_clear()
        .env("NOMAD_ADDR", &c.server)
        .env("DHV_BINDER_SIGNING_KEY", &stranger_key)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(75), "{text}");
    assert!(
        text.contains("does not trust") && text.contains("run the command again"),
        "{text}"
    );
    // The advice followed: the same command with the trusted key.
    let (code, out) = c.cli(&["volume", "create", "-timeout", "30s", spec]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("signed it again with key"), "{out}");
    assert!(out.contains("is ready"), "{out}");
}

/// Issue 35: with the agents' default record settings (`--record-relist 5m`: no shortened
/// relist), a volume created reaches every node through the change marker: from the start
/// of `volume create` (an agent must see the pending record, take it, run the plugin, write
/// it ready; every other agent must see it ready) to a ready placeholder on every node takes
/// about a second. The issue asks for 15 s; the bound here is 5 s, below any list the
/// agents could fall back on (the 10 s fallback pace, the 5 min relist; agents that listed
/// on a 10 s floor took 6 s or more to take the create alone). A job submitted at once runs:
/// its prestart is not held back by anything record-related.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_record_reaches_every_node_at_once_and_its_job_starts() {
    let c = Cluster::start_with(2, "", &[("DHV_BINDER_RECORD_RELIST", "5m")]).await;
    // Let the agents' first full lists pass (each lists at start, then follows the marker).
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let asked = std::time::Instant::now();
    let out = c.create_volume("shared-data", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    let created = asked.elapsed();
    c.wait_for(
        15,
        "a ready placeholder of shared-data on every node",
        || async {
            let vols = c.get("/v1/volumes?type=host&namespace=*").await;
            let n = vols
                .as_array()
                .unwrap()
                .iter()
                .filter(|v| v["Name"] == "shared-data" && v["State"] == "ready")
                .count();
            (n == c.nodes.len()).then_some(())
        },
    )
    .await;
    let everywhere = asked.elapsed();
    eprintln!(
        "volume create took {created:?}; a ready placeholder on every node {everywhere:?} after it started"
    );
    assert!(
        everywhere < std::time::Duration::from_secs(5),
        "{everywhere:?}: the record reached the nodes by a list, not through the marker"
    );
    let job = c
        .run_job(&support::cluster::repo().join("jobspecs/example.nomad.hcl"))
        .await;
    let submitted = std::time::Instant::now();
    c.wait_for(30, "the example job's main task running", || async {
        c.allocs(&job)
            .await
            .into_iter()
            .find(|a| a["TaskStates"]["app"]["State"] == "running")
    })
    .await;
    eprintln!(
        "the job's main task ran {:?} after submission",
        submitted.elapsed()
    );
}

/// Swaps `dir` and `link` (a symlink to a directory outside the roots) with
/// `renameat2(RENAME_EXCHANGE)` until dropped: `dir` is the symlink about 40% of the time,
/// flipping every few hundred microseconds. Dropping it (also on a panic) stops the thread
/// and leaves `dir` a directory.
struct Flipper {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Flipper {
    fn start(dir: std::path::PathBuf, link: std::path::PathBuf) -> Self {
        use rustix::fs::{renameat_with, RenameFlags, CWD};
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut swaps = 0;
            let swap = || renameat_with(CWD, &dir, CWD, &link, RenameFlags::EXCHANGE).is_ok();
            while !s.load(Ordering::Relaxed) {
                if swap() {
                    swaps += 1;
                    std::thread::sleep(std::time::Duration::from_micros(400));
                    while !swap() {}
                    swaps += 1;
                }
                std::thread::sleep(std::time::Duration::from_micros(600));
            }
            swaps
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the thread; returns how many swaps it made.
    fn stop(&mut self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .take()
            .map(|t| t.join().unwrap_or(0))
            .unwrap_or(0)
    }
}

impl Drop for Flipper {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Volumes published at once in the symlink race (each one publish attempt, retried by the
/// agent after a refusal until one succeeds).
const RACED_VOLUMES: usize = 10;
/// How long the directory is swapped while the agent publishes.
const RACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Issue 33 §3, the symlink race end to end: the real agent and the bind plugin, with the
/// simulator. The operator keeps other volumes' storage beneath the directory of the volume
/// `team` (their export is that directory), which `team`'s task may write. The task (here
/// the test, writing where the task writes: `team`'s directory on the host) swaps the
/// `default` directory in it, again and again, with a symlink to a host directory outside
/// every storage root holding a file for each volume's ID. A job then uses
/// [`RACED_VOLUMES`] of the nested volumes while the swapping goes on for [`RACE`]; no
/// publish attempt (each refusal is retried by the agent) may mount the outside directory,
/// and once the swapping stops every volume is published from its own directory. (The context
/// cannot be tampered with any more: since §1 the plugin derives the directory from the
/// signed export, namespace and ID, so the race is on the path itself.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_swapped_for_a_symlink_never_gets_the_outside_mounted() {
    let c = Cluster::start(1).await;
    c.log_plugin_calls("bind", "0");
    let out = c.create_volume("team", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    let (_, team_dir) = context_of(&c, "team").await;
    let team = team_dir.display().to_string();
    let outside = c.sb.join("outside");
    let mut names = Vec::new();
    for i in 0..RACED_VOLUMES {
        let name = format!("nested-{i}");
        let out = c.create_volume_with(
            &name,
            "single-node-writer",
            "bind",
            &[("export", &team)],
            &[],
            "",
        );
        assert!(out.contains("is ready"), "{out}");
        let (_, dir) = context_of(&c, &name).await;
        assert!(dir.starts_with(&team_dir), "{}", dir.display());
        // What the attacker wants mounted: a directory outside the roots where the volume's
        // own directory would be.
        let victim = outside.join(dir.file_name().unwrap());
        std::fs::create_dir_all(&victim).unwrap();
        std::fs::write(victim.join("precious"), "outside the roots").unwrap();
        names.push(name);
    }
    let swapped = team_dir.join("default");
    let link = team_dir.join("default.swap");
    std::os::unix::fs::symlink(&outside, &link).unwrap();
    let mut flipper = Flipper::start(swapped.clone(), link.clone());
    // One job using every nested volume; the prestart waits until all are published.
    let volumes: String = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            format!(
                "    volume \"v{i}\" {{\n      type = \"host\"\n      source = \"{n}\"\n      access_mode = \"single-node-writer\"\n      attachment_mode = \"file-system\"\n    }}\n"
            )
        })
        .collect();
    let example =
        std::fs::read_to_string(support::cluster::repo().join("jobspecs/example.nomad.hcl"))
            .unwrap();
    let head = "    volume \"data\" {\n      type            = \"host\"\n      source          = \"shared-data\"\n      access_mode     = \"single-node-writer\"\n      attachment_mode = \"file-system\"\n    }\n";
    assert!(example.contains(head), "jobspecs/example.nomad.hcl changed");
    let spec = example
        .replace(head, &volumes)
        .replace("job \"shared-data-demo\"", "job \"race\"")
        .replace("mountpoint -q /data ||", "true ||")
        .replace(
            "      volume_mount {\n        volume      = \"data\"\n        destination = \"/data\"\n      }\n",
            "",
        )
        .replace(">> /data/greetings.txt", ">/dev/null")
        .replace("cat /data/greetings.txt", "true");
    let jobspec = c.sb.join("race.nomad.hcl");
    std::fs::write(&jobspec, spec).unwrap();
    let job = c.run_job(&jobspec).await;
    let targets: Vec<_> = names.iter().map(|n| c.target(0, n)).collect();
    // The race: the agent publishes, is refused, retries; every 20 ms the test looks for
    // the outside directory at a target or in the mount table.
    let outside_text = outside.display().to_string();
    let mut escaped = std::collections::BTreeSet::new();
    let mut outside_mounts = std::collections::BTreeSet::new();
    let started = std::time::Instant::now();
    while started.elapsed() < RACE {
        for t in &targets {
            if t.join("precious").exists() {
                escaped.insert(t.display().to_string());
            }
        }
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        outside_mounts.extend(
            mountinfo
                .lines()
                .filter(|l| l.contains(&outside_text))
                .map(String::from),
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let swaps = flipper.stop();
    let attempts = c
        .plugin_log()
        .iter()
        .filter(|(phase, _, op, _)| phase == "start" && op == "publish")
        .count();
    let mounted = targets
        .iter()
        .filter(|t| dhv_binder::node::mounts::is_mount_point(t))
        .count();
    eprintln!(
        "symlink race: {} of {attempts} publish attempts mounted the outside directory ({swaps} swaps; {mounted} of {RACED_VOLUMES} volumes mounted at the end of the race)",
        escaped.len().max(outside_mounts.len().min(1))
    );
    assert!(
        escaped.is_empty() && outside_mounts.is_empty(),
        "{} of {attempts} publish attempts mounted the directory outside the roots: {escaped:?}\n{outside_mounts:?}",
        escaped.len()
    );
    assert!(attempts >= RACED_VOLUMES, "only {attempts} publishes");
    // Refusals name the symlink.
    let log = std::fs::read_to_string(&c.nodes[0].log).unwrap_or_default();
    assert!(
        attempts == RACED_VOLUMES || log.contains("is a symbolic link"),
        "{attempts} publishes but no refusal naming the symlink in the agent's log"
    );
    // Once the swapping stops, every volume is published: from its own directory.
    c.wait_for(
        90,
        "every raced volume published after the race",
        || async {
            targets
                .iter()
                .all(|t| dhv_binder::node::mounts::is_mount_point(t))
                .then_some(())
        },
    )
    .await;
    assert!(targets.iter().all(|t| !t.join("precious").exists()));
    c.stop_job(&job, true).await;
    c.wait_for(60, "the raced volumes unpublished", || async {
        targets
            .iter()
            .all(|t| !dhv_binder::node::mounts::is_mount_point(t))
            .then_some(())
    })
    .await;
    let _ = std::fs::remove_file(&link);
}
