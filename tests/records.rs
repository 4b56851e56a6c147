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
