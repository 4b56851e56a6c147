//! Issue 46 item 10: `volume unpublish -node N -force [-kill]`, an operator's forced
//! unpublish on one node. The request travels through Nomad Variables to the node's agent
//! (signed with the operator's key), never through the node's local socket; refused without
//! `-force` while an allocation there runs with the volume, refused while a process holds
//! the mount unless `-kill`; with `-kill` the holder is killed as the fence kills, the volume
//! is unpublished (the kernel's mount table shows it gone), not published again for the
//! still-running allocation, and the journal and `volume status -verbose` show who asked.

mod support;

use serde_json::Value;
use std::time::Duration;
use support::cluster::Cluster;

const VOLUME: &str = "shared-data";

fn writer_job(sb_dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    support::jobs::exec_writer_job(
        sb_dir,
        name,
        VOLUME,
        "",
        r#"while echo \"$NOMAD_ALLOC_ID\" >> /data/log.txt; do sleep 0.2; done; exit 1"#,
    )
}

fn mounted(c: &Cluster) -> bool {
    dhv_binder::node::mounts::is_mount_point(&c.target(0, VOLUME))
}

fn forced_events(c: &Cluster) -> Vec<Value> {
    c.journal(0)
        .into_iter()
        .filter(|e| e["event"] == "forced-unpublish")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_unpublishes_a_held_volume_on_one_node_only_with_force_and_kill() {
    let c = Cluster::start_with(1, "", &[]).await;
    c.create_volume(VOLUME, "single-node-writer");
    let job = c.run_job(&writer_job(c.sb.path(), "writer")).await;
    let alloc: Value = c
        .running_alloc(&job, "app", 120, "the writer running")
        .await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    c.wait_for(30, "the volume published", || async {
        mounted(&c).then_some(())
    })
    .await;
    let node = c.nodes[0].id.clone();

    // Without -force, while an allocation there runs with it: refused, nothing asked.
    let (code, out) = c.cli(&["volume", "unpublish", "-node", &node, VOLUME]);
    assert_eq!(code, 1, "refused without -force: {out}");
    assert!(
        out.contains("-force") && out.contains(&alloc_id),
        "names the allocation and the flag: {out}"
    );
    assert!(mounted(&c), "still mounted");

    // With -force but without -kill: the task's process holds the mount; the node refuses
    // (naming the holder) and the volume stays.
    let (code, out) = c.cli(&[
        "volume",
        "unpublish",
        "-node",
        &node,
        "-force",
        "-timeout",
        "60s",
        VOLUME,
    ]);
    assert_eq!(code, 1, "refused while a process holds it: {out}");
    assert!(
        out.contains("refused") && out.contains("-kill"),
        "says why and how to go on: {out}"
    );
    assert!(
        mounted(&c),
        "a refused forced unpublish leaves the volume mounted"
    );
    // ...and published for its allocation, as the node's journal records it.
    c.wait_for(30, "the mount record published again", || async {
        let (_, status) = c.status(0);
        let st: Value = serde_json::from_str(&status).unwrap_or_default();
        (st["mounts"][0]["state"] == "published").then_some(())
    })
    .await;
    let refused = forced_events(&c);
    assert!(
        refused
            .iter()
            .any(|e| e.to_string().contains("\"outcome\":\"refused\"")),
        "the refusal is audited: {refused:?}"
    );

    // With -kill: the holder is killed, the volume unpublished.
    let (code, out) = c.cli(&[
        "volume",
        "unpublish",
        "-node",
        &node,
        "-force",
        "-kill",
        "-timeout",
        "60s",
        VOLUME,
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("unpublished volume") && out.contains(&alloc_id),
        "says which allocation lost the volume: {out}"
    );
    assert!(!mounted(&c), "the mount table no longer shows it");
    let done = forced_events(&c);
    let last = done.last().expect("a forced-unpublish event").to_string();
    assert!(
        last.contains("\"outcome\":\"done\"")
            && last.contains("\"kill\":true")
            && last.contains("requested_by")
            && last.contains("key "),
        "the journal names who asked and what was done: {last}"
    );

    // A single-node volume's claim goes with the unpublish: another node may take it.
    c.wait_for(30, "the claim's lock released", || async {
        let claim = c
            .get(&format!(
                "/v1/var/dhv-binder/claims/{VOLUME}?namespace=default"
            ))
            .await;
        claim["Lock"].is_null().then_some(())
    })
    .await;

    // Not published again for the allocation that still runs.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(!mounted(&c), "published again for the withdrawn allocation");

    // `volume status -verbose` shows the audited event (through the node's record).
    let status = c
        .wait_for(30, "the event in volume status -verbose", || async {
            let (code, out) = c.cli(&["volume", "status", "-verbose", VOLUME]);
            (code == 0
                && out.contains("forced-unpublish")
                && out.contains(", done; ")
                && out.contains("killed pid")
                && out.contains(", refused")
                && out.contains("withdrawn by an operator"))
            .then_some(out)
        })
        .await;
    eprintln!("{status}");
    c.stop_job(&job, true).await;
}
