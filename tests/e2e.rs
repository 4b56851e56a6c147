//! End to end: the real dhv-binder daemon (one process per simulated node) against the
//! Nomad simulator, with the example job from jobspecs/, real processes, real mounts and
//! the reference bind plugin.

mod support;

use serde_json::Value;
use support::cluster::{repo, Cluster};

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

/// Issue 2's acceptance path: volume created once, placeholders on every node, the example
/// job's prestart task blocks until the volume is published on the node the scheduler
/// picked, the main task finds a mount of the volume's storage and writes to it; after the
/// job stops the placeholder is no longer a mount point, the journal shows the unpublish
/// and the file is in the storage; running the job again finds the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn example_job_publishes_before_main_task_and_keeps_data_after_stop() {
    let c = Cluster::start(2).await;
    let out = c.create_volume("shared-data", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");

    c.wait_for(30, "a ready placeholder on every node", || async {
        let vols = c.get("/v1/volumes?type=host&namespace=*").await;
        let ready = vols
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v["Name"] == "shared-data" && v["State"] == "ready")
            .count();
        (ready == c.nodes.len()).then_some(())
    })
    .await;

    let jobspec = repo().join("jobspecs/example.nomad.hcl");
    let job = c.run_job(&jobspec).await;
    let alloc = c
        .wait_for(90, "the main task running", || async {
            c.allocs(&job)
                .await
                .into_iter()
                .find(|a| task_state(a, "app")["State"] == "running")
        })
        .await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    let prestart = task_state(&alloc, "publish-volumes");
    assert_eq!(prestart["State"], "dead", "{alloc}");
    assert_eq!(prestart["Failed"], false, "{alloc}");
    let node = c.node_index(alloc["NodeID"].as_str().unwrap());
    let other = 1 - node;
    assert!(dhv_binder::mounts::is_mount_point(
        &c.target(node, "shared-data")
    ));
    assert!(!dhv_binder::mounts::is_mount_point(
        &c.target(other, "shared-data")
    ));

    let storage = c
        .export
        .join("default")
        .join(volume_id(&c, "shared-data").await);
    let greetings = storage.join("greetings.txt");
    c.wait_for(20, "the main task's file in the storage", || async {
        std::fs::read_to_string(&greetings)
            .ok()
            .filter(|t| t.contains(&alloc_id))
            .map(|_| ())
    })
    .await;

    c.stop_job(&job, false).await;
    c.wait_for(60, "the allocation complete", || async {
        c.allocs(&job)
            .await
            .into_iter()
            .find(|a| a["ID"] == alloc_id.as_str() && a["ClientStatus"] == "complete")
    })
    .await;
    let target = c.target(node, "shared-data");
    c.wait_for(30, "the unpublish done in the journal", || async {
        c.journal(node)
            .last()
            .filter(|e| e["event"] == "unpublish-done")
            .map(|_| ())
    })
    .await;
    assert!(!dhv_binder::mounts::is_mount_point(&target));
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
    let text = std::fs::read_to_string(&greetings).unwrap();
    assert!(
        text.contains(&alloc_id),
        "the data is gone from the storage: {text:?}"
    );

    // Run the job again: the new allocation finds the file and appends to it.
    let job = c.run_job(&jobspec).await;
    let second = c
        .wait_for(90, "the second allocation's main task running", || async {
            c.allocs(&job).await.into_iter().find(|a| {
                a["ID"] != alloc_id.as_str() && task_state(a, "app")["State"] == "running"
            })
        })
        .await;
    let second_id = second["ID"].as_str().unwrap().to_string();
    c.wait_for(20, "the second write next to the first", || async {
        std::fs::read_to_string(&greetings)
            .ok()
            .filter(|t| t.contains(&alloc_id) && t.contains(&second_id))
            .map(|_| ())
    })
    .await;
    c.stop_job(&job, false).await;
    let node = c.node_index(second["NodeID"].as_str().unwrap());
    let target = c.target(node, "shared-data");
    c.wait_for(
        60,
        "the placeholder unmounted after the second run",
        || async { (!dhv_binder::mounts::is_mount_point(&target)).then_some(()) },
    )
    .await;

    // Delete is refused while in use and works once the volume is free.
    let (code, out) = c.cli(&["volume", "delete", "shared-data"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        !storage.exists(),
        "the plugin's delete left the storage behind"
    );
}
