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
    (job, alloc["ID"].as_str().unwrap().to_string(), node)
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webdav_volumes_rotated_password_is_used_by_the_next_publish() {
    let c = Cluster::start(2).await;
    let (one, two) = (
        format!("dav-one-{}", uuid::Uuid::new_v4().simple()),
        format!("dav-two-{}", uuid::Uuid::new_v4().simple()),
    );
    let mut server = WebdavServer::start(&c.sb.join("webdav-root"), "dhv", &one);
    set_password(&c, &one).await;
    let out = c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "webdav",
        &[("url", &server.url), ("user", "dhv")],
        &[],
        SECRET_REF,
    );
    assert!(out.contains("is ready"), "{out}");
    let id = records(&c).await[0]["Items"]["id"]
        .as_str()
        .unwrap()
        .to_string();
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
