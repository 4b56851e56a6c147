//! Issue 31, the operator override: `volume claim release`. A holder whose dhv-binder is
//! down while its task runs blocks every other node (hand-over on evidence); a forged release
//! mark changes nothing, the command refuses without a terminal unless `-yes`, and with
//! `-yes` (signed with the operator's key) the waiting node takes the claim and publishes.

mod support;

use dhv_binder::cluster::claim_release::{release_path, ReleaseMark};
use dhv_binder::cluster::trust::SigningKey;
use dhv_binder::volume::VolumeKey;
use serde_json::{json, Value};
use std::time::Duration;
use support::cluster::Cluster;

const VOLUME: &str = "shared-data";

/// A service job named `name` whose task appends to `/data/log.txt` in the volume, with
/// `extra` lines in its group; the example's prestart task gates the volume.
fn writer_job(sb_dir: &std::path::Path, name: &str, extra: &str) -> std::path::PathBuf {
    support::jobs::exec_writer_job(
        sb_dir,
        name,
        VOLUME,
        extra,
        r#"while echo \"$NOMAD_ALLOC_ID\" >> /data/log.txt; do sleep 0.2; done; exit 1"#,
    )
}

async fn claim(c: &Cluster) -> Value {
    c.get(&format!(
        "/v1/var/dhv-binder/claims/{VOLUME}?namespace=default"
    ))
    .await
}

fn waiting_on_holder(c: &Cluster, i: usize, alloc: &str) -> bool {
    let (_, status) = c.status(i);
    let st: Value = serde_json::from_str(&status).unwrap_or_default();
    let w = st["waiting"].to_string();
    // The waiting line names the holder's allocation by its short ID (docs/operations/README.md,
    // "Waiting for a claim").
    w.contains("still runs with it") && w.contains(&alloc[..8])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_releases_the_claim_of_a_holder_whose_agent_is_down() {
    let mut c = Cluster::start_with(
        2,
        "",
        &[
            ("DHV_BINDER_CLAIM_TTL", "10s"),
            ("DHV_BINDER_CLAIM_LOCK_DELAY", "2s"),
        ],
    )
    .await;
    c.create_volume(VOLUME, "single-node-writer");
    let job = c.run_job(&writer_job(c.sb.path(), "writer", "")).await;
    let first: Value = c
        .running_alloc(&job, "app", 120, "the writer running")
        .await;
    let first_id = first["ID"].as_str().unwrap().to_string();
    let holder = c.node_index(first["NodeID"].as_str().unwrap());
    let other = 1 - holder;
    let holder_id = c.nodes[holder].id.clone();
    c.kill_agent(holder, nix::sys::signal::Signal::SIGKILL);
    c.run_job(&writer_job(
        c.sb.path(),
        "second",
        &format!(
            "    constraint {{\n      attribute = \"${{node.unique.id}}\"\n      value     = \"{}\"\n    }}",
            c.nodes[other].id
        ),
    ))
    .await;

    // Without a terminal and without -yes: refused, nothing written.
    let (code, out) = c.cli(&["volume", "claim", "release", VOLUME]);
    assert_eq!(code, 64, "refused without a terminal: {out}");
    assert!(out.contains("-yes"), "says how to go on: {out}");
    assert!(out.contains(&holder_id), "shows the holder first: {out}");
    assert!(
        c.get_opt(&format!(
            "{}?namespace=default",
            var_url(&release_path(VOLUME))
        ))
        .await
        .is_none(),
        "no release mark written without confirmation"
    );

    // Past the lapse, the holder still blocks the other node (its task runs).
    c.wait_for(
        40,
        "the holder's lock gone and the other node naming it",
        || async {
            (claim(&c).await["Lock"].is_null() && waiting_on_holder(&c, other, &first_id))
                .then_some(())
        },
    )
    .await;

    // A release mark signed by a key the nodes do not trust changes nothing.
    let index = claim(&c).await["ModifyIndex"].as_u64().unwrap();
    let (forger, _) = SigningKey::generate().unwrap();
    let mut forged = ReleaseMark::new(
        VolumeKey {
            namespace: "default".into(),
            name: VOLUME.into(),
        },
        holder_id.clone(),
        index,
        0,
    );
    forged.sign(&forger);
    let v = forged.to_variable();
    c.put(
        &format!("{}?namespace=default", var_url(&v.path)),
        json!({"Namespace": "default", "Path": v.path, "Items": v.items}),
    )
    .await;
    // Several acquire retries (at most 3 s apart) see the forged mark.
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        waiting_on_holder(&c, other, &first_id),
        "a forged release mark is ignored: {:?}",
        c.status(other)
    );
    assert!(!dhv_binder::node::mounts::is_mount_point(
        &c.target(other, VOLUME)
    ));

    // The operator's signed release, confirmed with -yes: the other node takes the claim.
    let (code, out) = c.cli(&["volume", "claim", "release", "-yes", VOLUME]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&holder_id) && out.contains(&first_id) && out.contains("Released"),
        "shows the holder node and allocation: {out}"
    );
    c.wait_for(60, "the volume published on the other node", || async {
        dhv_binder::node::mounts::is_mount_point(&c.target(other, VOLUME)).then_some(())
    })
    .await;
    assert_eq!(
        claim(&c).await["Items"]["node_id"],
        json!(c.nodes[other].id),
        "the claim is the other node's"
    );
}

fn var_url(path: &str) -> String {
    format!("/v1/var/{path}")
}

fn last_event_ms(c: &Cluster, i: usize, ev: &str) -> Option<u64> {
    c.journal(i)
        .iter()
        .filter(|e| e["event"] == ev)
        .filter_map(|e| e["unix_ms"].as_u64())
        .next_back()
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The holder's agent runs when the operator releases its claim: its next renewal is refused,
/// it finds the verified release mark for this very claim, records `claim-released` in its
/// journal and fences the volume at once, not when the lease would have ended (with the
/// default settings, 30 s after its last renewal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_fences_at_once_when_an_operator_releases_its_claim() {
    let c = Cluster::start_with(1, "", &[]).await;
    c.create_volume(VOLUME, "single-node-writer");
    let job = c.run_job(&writer_job(c.sb.path(), "writer", "")).await;
    c.running_alloc(&job, "app", 120, "the writer running")
        .await;
    c.wait_for(30, "the volume published", || async {
        dhv_binder::node::mounts::is_mount_point(&c.target(0, VOLUME)).then_some(())
    })
    .await;
    let t_release = now_ms();
    let (code, out) = c.cli(&["volume", "claim", "release", "-yes", VOLUME]);
    assert_eq!(code, 0, "{out}");
    let t_fence = c
        .wait_for(40, "the holder's fence", || async {
            last_event_ms(&c, 0, "fenced")
        })
        .await;
    let released = last_event_ms(&c, 0, "claim-released").expect("claim-released in the journal");
    let after = t_fence.saturating_sub(t_release);
    eprintln!("the holder fenced {after} ms after the operator's release");
    assert!(
        released <= t_fence && after < 12_000,
        "fenced {after} ms after the release: at once (the next renewal), not at the lease's end"
    );
    c.stop_job(&job, false).await;
}
