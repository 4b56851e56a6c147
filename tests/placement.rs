//! Placement that knows the storage (issue 48), end to end on a two-node simulator cluster:
//! attach limits, a publish that cannot succeed on a node sends the job to the other one.

mod support;

use serde_json::Value;
use support::cluster::{repo, Cluster};

/// The example job using `volume`, named `name`, with `extra` lines in its group (a
/// constraint), failing its allocation at the first failed prestart (`restart` attempts 0)
/// and rescheduling it 2 s later.
fn job(c: &Cluster, name: &str, volume: &str, extra: &str) -> std::path::PathBuf {
    let src = std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl")).unwrap();
    let out = src
        .replacen("job \"shared-data-demo\"", &format!("job \"{name}\""), 1)
        .replacen(
            "source          = \"shared-data\"",
            &format!("source          = \"{volume}\""),
            1,
        )
        .replacen(
            "    restart {\n      attempts = 3",
            &format!("    reschedule {{\n      delay = \"2s\"\n      delay_function = \"constant\"\n      unlimited = true\n    }}\n{extra}\n    restart {{\n      attempts = 0"),
            1,
        );
    assert!(
        out.contains(&format!("job \"{name}\""))
            && out.contains(&format!("\"{volume}\""))
            && out.contains("attempts = 0"),
        "the example job changed shape"
    );
    let path = c.sb.join(&format!("{name}.nomad.hcl"));
    std::fs::write(&path, out).unwrap();
    path
}

fn on_node(name: &str) -> String {
    format!(
        "    constraint {{\n      attribute = \"${{node.unique.name}}\"\n      value     = \"{name}\"\n    }}"
    )
}

/// The nodes (by name) with a ready placeholder of `volume`.
async fn ready_on(c: &Cluster, volume: &str) -> Vec<String> {
    let vols = c.get("/v1/volumes?type=host&namespace=*").await;
    let mut out: Vec<String> = vols
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["Name"] == volume && v["State"] == "ready")
        .filter_map(|v| {
            let id = v["NodeID"].as_str()?;
            c.nodes.iter().find(|n| n.id == id).map(|n| n.name.clone())
        })
        .collect();
    out.sort();
    out
}

async fn wait_ready_on(c: &Cluster, volume: &str, nodes: &[&str], secs: u64) {
    let want: Vec<String> = nodes.iter().map(|s| s.to_string()).collect();
    let what = format!("ready placeholders of {volume} on exactly {want:?}");
    c.wait_for(secs, &what, || async {
        (ready_on(c, volume).await == want).then_some(())
    })
    .await;
}

fn status(c: &Cluster, i: usize) -> Value {
    let (code, text) = c.status(i);
    assert_eq!(code, 0, "{text}");
    serde_json::from_str(&text).unwrap()
}

/// A spec's constraint blocks: one or several, `=` by default, unknown fields refused by
/// name (an old build refused every `constraint` block).
#[test]
fn a_spec_takes_nomads_constraint_blocks() {
    let base = "name = \"a\"\nplugin_id = \"bind\"\n";
    let (spec, _) = dhv_binder::volume::parse_spec(&format!(
        "{base}constraint {{\n  attribute = \"${{node.class}}\"\n  value = \"db\"\n}}\nconstraint {{\n  attribute = \"${{meta.rack}}\"\n  operator = \"!=\"\n  value = \"r9\"\n}}"
    ))
    .unwrap();
    assert_eq!(spec.constraints.len(), 2);
    assert_eq!(spec.constraints[0].operator, "=");
    let e = dhv_binder::volume::parse_spec(&format!("{base}constraint {{\n  attribut = \"x\"\n}}"))
        .unwrap_err();
    assert!(e.to_string().contains("attribut"), "{e}");
}

/// Restarts node `i`'s agent with `env` added to its environment.
async fn restart_agent_with(c: &mut Cluster, i: usize, env: &[(&str, &str)]) {
    c.kill_agent(i, nix::sys::signal::Signal::SIGTERM);
    let saved = c.agent_env.clone();
    c.agent_env
        .extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    c.start_agent(i);
    c.agent_env = saved;
}

/// Issue 48 #2: with `--max-volumes bind=1` on node-1 and one bind volume published there,
/// node-1 withdraws its placeholder of the other bind volume (only node-2 offers it, so its
/// job runs there), keeps the published one's (its user runs on), shows count and limit in
/// its status, and offers the other volume again once the first is unpublished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_limit_withholds_the_other_volumes_while_one_is_published() {
    let mut c = Cluster::start(2).await;
    c.create_volume("va", "single-node-writer");
    c.create_volume("vb", "single-node-writer");
    restart_agent_with(&mut c, 0, &[("DHV_BINDER_MAX_VOLUMES", "bind=1")]).await;
    wait_ready_on(&c, "va", &["node-1", "node-2"], 60).await;
    wait_ready_on(&c, "vb", &["node-1", "node-2"], 60).await;
    let a = c.run_job(&job(&c, "job-a", "va", &on_node("node-1"))).await;
    let first = c.running_alloc(&a, "app", 90, "job-a running").await;
    assert_eq!(first["NodeName"], "node-1");
    wait_ready_on(&c, "vb", &["node-2"], 30).await;
    assert_eq!(ready_on(&c, "va").await, ["node-1", "node-2"]);
    let s = status(&c, 0);
    assert_eq!(s["offers"]["plugins"]["bind"]["attached"], 1, "{s}");
    assert_eq!(s["offers"]["plugins"]["bind"]["max_volumes"], 1, "{s}");
    c.wait_for(
        30,
        "node status showing node-1's count and limit",
        || async {
            let (_, out) = c.cli(&["node", "status"]);
            out.contains("bind(1/1 attached)").then_some(())
        },
    )
    .await;
    let b = c.run_job(&job(&c, "job-b", "vb", "")).await;
    let second = c.running_alloc(&b, "app", 90, "job-b running").await;
    assert_eq!(second["NodeName"], "node-2", "node-1 is at its limit");
    // The first job's user was never disturbed.
    let still = c.allocs(&a).await;
    assert!(
        still
            .iter()
            .any(|x| x["ID"] == first["ID"] && x["TaskStates"]["app"]["State"] == "running"),
        "{still:?}"
    );
    c.stop_job(&a, false).await;
    wait_ready_on(&c, "vb", &["node-1", "node-2"], 60).await;
    assert_eq!(status(&c, 0)["offers"]["plugins"]["bind"]["attached"], 0);
}

/// Replaces the bind plugin with one whose `publish` fails on node-1 (exit `code`, printing
/// `error`), and runs the real one elsewhere.
fn failing_publish_on_node_1(c: &Cluster, code: i32, error: &str) {
    let real = c.sb.join("real-plugins/bind");
    std::fs::create_dir_all(real.parent().unwrap()).unwrap();
    std::fs::copy(c.plugin_dir.join("bind"), &real).unwrap();
    support::sandbox::script(
        &c.plugin_dir.join("bind"),
        &format!(
            r#"#!/bin/sh
if [ "$1" = publish ] && [ "$DHV_NODE_ID" = "{node}" ]; then
  echo "publish $(date +%s%N)" >> "$DHV_PLUGIN_DIR/node-1-failures.log"
  echo '{error}'
  exit {code}
fi
exec {real} "$@"
"#,
            node = c.nodes[0].id,
            real = real.display()
        ),
    );
}

/// The job runs on node-2 within 90 s, on the volume (its app checks that /data is a mount
/// point), after its allocation on node-1 failed at once with the plugin's `words`; node-1
/// withdrew its placeholder. Returns how many publishes node-1 ran.
async fn moves_to_node_2(c: &Cluster, volume: &str, words: &str) -> usize {
    let j = c.run_job(&job(c, "mover", volume, "")).await;
    let started = std::time::Instant::now();
    let a = c
        .running_alloc(&j, "app", 90, "the job running on node-2")
        .await;
    assert_eq!(a["NodeName"], "node-2", "{a}");
    assert!(started.elapsed() < std::time::Duration::from_secs(90));
    let failed: Vec<Value> = c
        .allocs(&j)
        .await
        .into_iter()
        .filter(|x| x["NodeName"] == "node-1")
        .collect();
    assert!(
        failed.iter().all(|x| x["ClientStatus"] == "failed"),
        "{failed:?}"
    );
    assert!(!failed.is_empty(), "the job was placed on node-1 first");
    // The prestart failed at once with why, in the plugin's words.
    let said = std::fs::read_to_string(c.sb.join(&format!(
        "sim/node-1/alloc/{}/alloc/logs/publish-volumes.stderr.0",
        failed[0]["ID"].as_str().unwrap()
    )))
    .unwrap_or_default();
    assert!(
        said.contains("is not published on this node") && said.contains(words),
        "{said}"
    );
    // Node-1 withdraws its placeholder as it cools down: a call of its own, which may land
    // after the rescheduled allocation already runs on node-2.
    c.wait_for(30, "node-1's placeholder withdrawn", || async {
        (ready_on(c, volume).await == ["node-2"]).then_some(())
    })
    .await;
    std::fs::read_to_string(c.plugin_dir.join("node-1-failures.log"))
        .unwrap_or_default()
        .lines()
        .count()
}

/// Issue 48 #3: a publish that fails on node-1 with the class "elsewhere" (its error
/// object's `error_class`) fails the allocation's prestart at once with the plugin's words,
/// node-1 withdraws its placeholder for a cool-down, and Nomad's reschedule places the job
/// on node-2, where it runs on the volume. node-1 ran the publish once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_failing_elsewhere_sends_the_job_to_the_other_node() {
    let c = Cluster::start(2).await;
    c.create_volume("vm", "single-node-writer");
    failing_publish_on_node_1(
        &c,
        1,
        r#"{"error":"no path to the array from this node","error_class":"elsewhere"}"#,
    );
    wait_ready_on(&c, "vm", &["node-1", "node-2"], 60).await;
    let calls = moves_to_node_2(&c, "vm", "no path to the array").await;
    assert_eq!(calls, 1, "one publish on node-1, then the cool-down");
    let s = status(&c, 0);
    let why = s["offers"]["cooling_down"]["default/vm"]["error"].to_string();
    assert!(why.contains("no path to the array"), "{s}");
    // The cool-down is an event of `volume status -verbose`, on node-1.
    c.wait_for(30, "the cool-down among vm's events", || async {
        let (_, out) = c.cli(&["volume", "status", "-verbose", "vm"]);
        out.lines()
            .any(|l| l.contains("node-1") && l.contains("cool-down") && l.contains("elsewhere"))
            .then_some(())
    })
    .await;
    // The plugin's words stay out of the node records (docs/security.md).
    let record = c
        .get(&format!(
            "/v1/var/dhv-binder/nodes/{}?namespace=default",
            c.nodes[0].id
        ))
        .await
        .to_string();
    assert!(record.contains("cool-down"), "{record}");
    assert!(!record.contains("no path to the array"), "{record}");
}

/// Issue 48 #3: a publish that always fails on node-1 with a transient error (exit 1, no
/// class) is tried there a bounded number of times, then node-1 cools the volume down and
/// the job runs on node-2 within 90 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_failing_transiently_sends_the_job_to_the_other_node() {
    let c = Cluster::start(2).await;
    c.create_volume("vt", "single-node-writer");
    failing_publish_on_node_1(&c, 1, r#"{"error":"array busy"}"#);
    wait_ready_on(&c, "vt", &["node-1", "node-2"], 60).await;
    let calls = moves_to_node_2(&c, "vt", "array busy").await;
    // TRANSIENT_LIMIT failures cool it down; the publish is still retried (with backoff)
    // while the failed allocation is on node-1, not after.
    assert!((3..=6).contains(&calls), "{calls} publishes on node-1");
}

/// A bind volume with the spec lines `extra` (constraints).
fn create_constrained(c: &Cluster, name: &str, extra: &str) {
    let export = c.export.display().to_string();
    c.create_volume_with(
        name,
        "single-node-writer",
        "bind",
        &[
            ("export", &export),
            support::cluster::NOBODY_UID,
            support::cluster::NOBODY_GID,
        ],
        &[],
        extra,
    );
}

/// Issue 48 #1: a volume constrained to `${node.unique.name} = node-2` is offered by node-2
/// only, one constrained to `${meta.rack} = r1` (client meta in the simulator's config) by
/// node-1 only; a job using each runs on that node, and the other node's status says why it
/// does not offer the volume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constraints_decide_which_nodes_offer_a_volume() {
    let c = Cluster::start_with_meta(2, &[(0, "rack", "r1"), (1, "rack", "r2")]).await;
    create_constrained(
        &c,
        "by-name",
        "constraint {\n  attribute = \"${node.unique.name}\"\n  value = \"node-2\"\n}",
    );
    create_constrained(
        &c,
        "by-rack",
        "constraint {\n  attribute = \"${meta.rack}\"\n  operator = \"=\"\n  value = \"r1\"\n}",
    );
    wait_ready_on(&c, "by-name", &["node-2"], 60).await;
    wait_ready_on(&c, "by-rack", &["node-1"], 60).await;
    let a = c.run_job(&job(&c, "on-name", "by-name", "")).await;
    let b = c.run_job(&job(&c, "on-rack", "by-rack", "")).await;
    let ra = c.running_alloc(&a, "app", 90, "on-name running").await;
    let rb = c.running_alloc(&b, "app", 90, "on-rack running").await;
    assert_eq!(ra["NodeName"], "node-2");
    assert_eq!(rb["NodeName"], "node-1");
    let why = status(&c, 0)["offers"]["constraints"]["default/by-name"].to_string();
    assert!(
        why.contains("does not satisfy") && why.contains("node-2"),
        "{why}"
    );
    let why = status(&c, 1)["offers"]["constraints"]["default/by-rack"].to_string();
    assert!(why.contains("${meta.rack} = r1"), "{why}");
    assert_eq!(ready_on(&c, "by-name").await, ["node-2"]);
    assert_eq!(ready_on(&c, "by-rack").await, ["node-1"]);
    // `volume status` says which nodes offer each volume and why the other does not.
    let (code, out) = c.cli(&["volume", "status", "by-rack"]);
    assert_eq!(code, 0, "{out}");
    let offered = out.split("Offered By").nth(1).unwrap_or_default();
    let row = |n: &str| {
        offered
            .lines()
            .find(|l| l.starts_with(n))
            .unwrap_or_default()
            .to_string()
    };
    assert!(row("node-1").contains(" yes "), "{out}");
    assert!(
        row("node-2").contains(" no ") && row("node-2").contains("${meta.rack} = r1"),
        "{out}"
    );
}

/// The first allocation of `job` on `node` that failed, and its prestart's stderr.
async fn failed_prestart(c: &Cluster, job: &str, node: &str) -> String {
    let what = format!("a failed allocation of {job} on {node}");
    let a = c
        .wait_for(60, &what, || async {
            c.allocs(job)
                .await
                .into_iter()
                .find(|a| a["NodeName"] == node && a["ClientStatus"] == "failed")
        })
        .await;
    std::fs::read_to_string(c.sb.join(&format!(
        "sim/{node}/alloc/{}/alloc/logs/publish-volumes.stderr.0",
        a["ID"].as_str().unwrap()
    )))
    .unwrap_or_default()
}

/// Issue 48 #4: `volume update -availability=pause` keeps the volume for its current user
/// on node-1, withdraws node-2's placeholder, and refuses a new allocation on node-1 at once
/// ("paused by an operator"); `-availability=drain` then unpublishes it when its user ends
/// and no node offers it; `-availability=active` offers it everywhere again. `volume list`
/// shows the availability.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_drain_keep_users_and_refuse_new_allocations() {
    let c = Cluster::start(2).await;
    c.create_volume("vp", "single-node-writer");
    wait_ready_on(&c, "vp", &["node-1", "node-2"], 60).await;
    let user = c.run_job(&job(&c, "user", "vp", &on_node("node-1"))).await;
    let u = c.running_alloc(&user, "app", 90, "the user running").await;
    let (code, out) = c.cli(&["volume", "update", "-availability=pause", "vp"]);
    assert_eq!(code, 0, "{out}");
    wait_ready_on(&c, "vp", &["node-1"], 30).await;
    let (_, list) = c.cli(&["volume", "list"]);
    assert!(list.contains("ready (pause)"), "{list}");
    // node-1, where it is published, says so in the volume's events.
    c.wait_for(30, "the pause among vp's events", || async {
        let (_, out) = c.cli(&["volume", "status", "-verbose", "vp"]);
        out.lines()
            .any(|l| {
                // An operator's choice, not a failure: its outcome is "ok".
                l.contains("node-1")
                    && l.contains("availability")
                    && l.contains("users here keep it")
                    && l.split_whitespace().any(|w| w == "ok")
                    && !l.contains("failed")
            })
            .then_some(())
    })
    .await;
    let waiter = c
        .run_job(&job(&c, "waiter", "vp", &on_node("node-1")))
        .await;
    let said = failed_prestart(&c, &waiter, "node-1").await;
    assert!(said.contains("paused by an operator"), "{said}");
    c.stop_job(&waiter, true).await;
    let still = c.allocs(&user).await;
    assert!(
        still
            .iter()
            .any(|x| x["ID"] == u["ID"] && x["TaskStates"]["app"]["State"] == "running"),
        "the user keeps the volume: {still:?}"
    );
    let (code, out) = c.cli(&["volume", "update", "-availability=drain", "vp"]);
    assert_eq!(code, 0, "{out}");
    c.stop_job(&user, false).await;
    let target = c.target(0, "vp");
    c.wait_for(60, "vp unpublished on node-1", || async {
        (support::cluster::mount_count(&target) == 0).then_some(())
    })
    .await;
    wait_ready_on(&c, "vp", &[], 60).await;
    let (code, out) = c.cli(&["volume", "update", "-availability=active", "vp"]);
    assert_eq!(code, 0, "{out}");
    wait_ready_on(&c, "vp", &["node-1", "node-2"], 60).await;
}

/// Issue 48 #3: a publish failing on node-1 with the class "final" (exit 65: the volume
/// itself is broken) fails the allocation's prestart at once with the plugin's words, and
/// node-1 writes the failure into the record: every node withdraws its placeholder (node-2
/// too, which never tried), `volume status` says why (where, the plugin's words) and
/// `-verbose` shows it as an event; `volume update -repaired` clears it and both nodes
/// offer the volume again. node-1 ran the publish once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_publish_failure_stops_every_node_from_offering_the_volume() {
    let c = Cluster::start(2).await;
    c.create_volume("vf", "single-node-writer");
    failing_publish_on_node_1(
        &c,
        65,
        r#"{"error":"the superblock of the image is corrupt"}"#,
    );
    wait_ready_on(&c, "vf", &["node-1", "node-2"], 60).await;
    let j = c
        .run_job(&job(&c, "broken", "vf", &on_node("node-1")))
        .await;
    let said = failed_prestart(&c, &j, "node-1").await;
    assert!(
        said.contains("superblock of the image is corrupt"),
        "{said}"
    );
    wait_ready_on(&c, "vf", &[], 60).await;
    c.stop_job(&j, true).await;
    let (code, out) = c.cli(&["volume", "status", "vf"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("Final Failure") && out.contains("node-1") && out.contains("superblock"),
        "{out}"
    );
    let offered = out
        .split("Offered By")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    assert_eq!(
        offered.matches("class \"final\"").count(),
        2,
        "both nodes say why: {out}"
    );
    let (_, out) = c.cli(&["volume", "status", "-verbose", "vf"]);
    assert!(out.contains("final-failure"), "{out}");
    let calls = std::fs::read_to_string(c.plugin_dir.join("node-1-failures.log"))
        .unwrap_or_default()
        .lines()
        .count();
    assert_eq!(calls, 1, "one publish on node-1");
    let (code, out) = c.cli(&["volume", "update", "-repaired", "vf"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("cleared"), "{out}");
    wait_ready_on(&c, "vf", &["node-1", "node-2"], 60).await;
    let (_, out) = c.cli(&["volume", "status", "vf"]);
    assert!(!out.contains("Final Failure"), "{out}");
}

/// A spec's `topology_request` in Nomad's CSI shape: required and preferred topologies,
/// one or several `topology` blocks each; a topology without segments and an unknown field
/// are refused by name (an old build refused `topology_request` as an unknown field).
#[test]
fn a_spec_takes_nomads_topology_request() {
    let base = "name = \"a\"\nplugin_id = \"bind\"\n";
    let (spec, _) = dhv_binder::volume::parse_spec(&format!(
        "{base}topology_request {{\n  required {{\n    topology {{\n      segments {{ zone = \"a\" }}\n    }}\n    topology {{ segments = {{ zone = \"b\", rack = \"r1\" }} }}\n  }}\n  preferred {{\n    topology {{ segments = {{ zone = \"b\" }} }}\n  }}\n}}"
    ))
    .unwrap();
    assert_eq!(spec.topology_request.required.len(), 2);
    assert_eq!(spec.topology_request.preferred.len(), 1);
    let e = dhv_binder::volume::parse_spec(&format!(
        "{base}topology_request {{\n  required {{\n    topology {{ segments = {{}} }}\n  }}\n}}"
    ))
    .unwrap_err();
    assert!(e.to_string().contains("missing its segments"), "{e}");
    let e = dhv_binder::volume::parse_spec(&format!(
        "{base}topology_request {{\n  requird {{\n    topology {{ segments = {{ zone = \"a\" }} }}\n  }}\n}}"
    ))
    .unwrap_err();
    assert!(e.to_string().contains("requird"), "{e}");
}

/// Issue 48 #1: a plugin that reports its topology in its fingerprint (here the bind plugin
/// wrapped: zone a on node-1, whose agent has an extra plugin root naming it, zone b on
/// node-2) and a volume whose `topology_request` requires zone a: only node-1 creates and
/// offers it, its job runs there, `node status -json` carries each node's topology, and
/// `volume status` says why node-2 does not offer it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_required_topology_decides_which_nodes_create_and_offer_a_volume() {
    let mut c = Cluster::start(2).await;
    let zone_a = c.sb.join("zone-a");
    std::fs::create_dir_all(&zone_a).unwrap();
    let real = c.sb.join("real-plugins/bind");
    std::fs::create_dir_all(real.parent().unwrap()).unwrap();
    std::fs::copy(c.plugin_dir.join("bind"), &real).unwrap();
    support::sandbox::script(
        &c.plugin_dir.join("bind"),
        &format!(
            r#"#!/bin/sh
if [ "$1" = fingerprint ]; then
  case "$DHV_ALLOWED_ROOTS" in
    *zone-a*) zone=a ;;
    *) zone=b ;;
  esac
  {real} fingerprint | sed "s/^{{/{{\"topology\":{{\"zone\":\"$zone\"}},/"
  exit 0
fi
exec {real} "$@"
"#,
            real = real.display()
        ),
    );
    let roots = format!(
        "bind={},bind={},ext4={}",
        c.export.display(),
        zone_a.display(),
        c.sb.join("images").display()
    );
    restart_agent_with(&mut c, 0, &[("DHV_BINDER_PLUGIN_ROOTS", &roots)]).await;
    c.wait_for(60, "both nodes' topology in their node records", || async {
        let (_, out) = c.cli(&["node", "status", "-json"]);
        let v: Value = serde_json::from_str(&out).ok()?;
        let zones: Vec<String> = v
            .as_array()?
            .iter()
            .map(|n| n["Plugins"]["bind"]["Topology"]["zone"].to_string())
            .collect();
        (zones.contains(&"\"a\"".to_string()) && zones.contains(&"\"b\"".to_string())).then_some(())
    })
    .await;
    let (_, out) = c.cli(&["node", "status"]);
    assert!(
        out.contains("bind(zone=a)") && out.contains("bind(zone=b)"),
        "{out}"
    );
    create_constrained(
        &c,
        "zoned",
        "topology_request {\n  required {\n    topology { segments = { zone = \"a\" } }\n  }\n}",
    );
    wait_ready_on(&c, "zoned", &["node-1"], 60).await;
    let (code, out) = c.cli(&["volume", "status", "-json", "zoned"]);
    assert_eq!(code, 0, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(
        v["WorkerNode"]
            .as_str()
            .unwrap_or_default()
            .starts_with("node-1"),
        "created on node-1: {v}"
    );
    let node2 = v["OfferedBy"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|o| o["NodeName"] == "node-2")
        .cloned()
        .unwrap_or_default();
    assert!(
        node2["Offered"] == false && node2["Why"].to_string().contains("zone=b"),
        "{v}"
    );
    let j = c.run_job(&job(&c, "zoned-job", "zoned", "")).await;
    let a = c.running_alloc(&j, "app", 90, "the job running").await;
    assert_eq!(a["NodeName"], "node-1");
    assert_eq!(ready_on(&c, "zoned").await, ["node-1"]);
}
