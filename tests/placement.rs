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
