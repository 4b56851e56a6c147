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

/// B15: `job stop -purge` deletes the allocation from Nomad with no event; the client kills
/// the tasks a moment later. The periodic relist finds the allocation gone, its volume is
/// kept through the allocation's kill grace, then unpublished exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b15_purged_job_is_unpublished_after_its_tasks_are_gone() {
    let c = Cluster::start_with(1, "", &[("DHV_BINDER_RESYNC_INTERVAL", "2s")]).await;
    c.create_volume("shared-data", "single-node-writer");
    let job = c.run_job(&repo().join("jobspecs/example.nomad.hcl")).await;
    c.wait_for(60, "the main task running", || async {
        c.allocs(&job)
            .await
            .into_iter()
            .find(|a| task_state(a, "app")["State"] == "running")
    })
    .await;
    let purged_at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    c.stop_job(&job, true).await;
    c.wait_for(40, "the unpublish", || async {
        c.journal(0)
            .last()
            .filter(|e| e["event"] == "unpublish-done")
            .cloned()
    })
    .await;
    let intents: Vec<u64> = c
        .journal(0)
        .iter()
        .filter(|e| e["event"] == "unpublish-intent")
        .map(|e| e["unix_ms"].as_u64().unwrap())
        .collect();
    assert_eq!(intents.len(), 1);
    // Kill grace: the example's kill_timeout (5 s) plus the 5 s margin.
    assert!(
        intents[0] >= purged_at + 9_000,
        "unpublished {} ms after the purge, within the kill grace",
        intents[0] - purged_at
    );
    eprintln!(
        "B15: unpublished {} ms after the purge",
        intents[0] - purged_at
    );
    assert_eq!(
        support::cluster::mount_count(&c.target(0, "shared-data")),
        0
    );
}
