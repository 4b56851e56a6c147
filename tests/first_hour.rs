//! Issue 46, the first hour's questions, answered by the CLI against the simulator and real
//! agents: where a volume is mounted and who holds its claim (`volume status`), why one
//! allocation waits (`alloc status`), what one node has (`node status <node>`), which
//! operations each plugin declares (`plugin status`), and what a create would do
//! (`volume create -dry-run`).

mod support;

use serde_json::Value;
use support::cluster::Cluster;

const VOLUME: &str = "shared-data";

fn writer_job(sb_dir: &std::path::Path, name: &str, extra: &str) -> std::path::PathBuf {
    support::jobs::exec_writer_job(
        sb_dir,
        name,
        VOLUME,
        extra,
        r#"while echo \"$NOMAD_ALLOC_ID\" >> /data/log.txt; do sleep 0.2; done; exit 1"#,
    )
}

/// The row of a readable table that starts with `first`.
fn row<'a>(out: &'a str, first: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(first))
        .unwrap_or_else(|| panic!("no row {first:?} in:\n{out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_hours_questions_have_answers() {
    let c = Cluster::start(2).await;
    c.create_volume(VOLUME, "single-node-writer");
    let job = c.run_job(&writer_job(c.sb.path(), "writer", "")).await;
    let first: Value = c
        .running_alloc(&job, "app", 120, "the writer running")
        .await;
    let first_id = first["ID"].as_str().unwrap().to_string();
    let holder = c.node_index(first["NodeID"].as_str().unwrap());
    let other = 1 - holder;
    let second = c
        .run_job(&writer_job(
            c.sb.path(),
            "second",
            &format!(
                "    constraint {{\n      attribute = \"${{node.unique.id}}\"\n      value     = \"{}\"\n    }}",
                c.nodes[other].id
            ),
        ))
        .await;
    let waiting_id = c
        .wait_for(
            60,
            "the second job's allocation waiting for the claim",
            || async {
                let (_, st) = c.status(other);
                let st: Value = serde_json::from_str(&st).unwrap_or_default();
                if !st["waiting"].to_string().contains("still runs with it") {
                    return None;
                }
                c.allocs(&second)
                    .await
                    .first()
                    .and_then(|a| a["ID"].as_str().map(String::from))
            },
        )
        .await;

    // Item 7: where it is mounted, who holds the claim, the jobs and their states.
    let (code, out) = c.cli(&["volume", "status", VOLUME]);
    eprintln!("$ dhv-binder volume status {VOLUME}\n{out}");
    assert_eq!(code, 0, "{out}");
    let holder_name = &c.nodes[holder].name;
    let mounted = out
        .lines()
        .find(|l| l.starts_with("Mounted On"))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        mounted.contains(&format!(
            "= {holder_name} at {}",
            c.target(holder, VOLUME).display()
        )) && mounted.contains(" since "),
        "{out}"
    );
    let claim = row(&out, "Claim Holder");
    assert!(
        claim.contains(holder_name)
            && claim.contains("job writer")
            && claim.contains(&first_id[..8]),
        "{out}"
    );
    let alloc_row = row(&out, &first_id[..8]);
    assert!(
        alloc_row.contains("writer") && alloc_row.ends_with("running"),
        "{out}"
    );
    // The waiting node says `waiting`, with the wait under Why (not as an error).
    let other_row = row(&out, &c.nodes[other].name);
    assert!(other_row.contains(" waiting "), "{out}");
    assert!(other_row.contains("held by job writer"), "{out}");
    assert!(!out.contains("Last Error"), "{out}");

    // -verbose: the record's events beside the nodes'.
    let (code, out) = c.cli(&["volume", "status", "-verbose", VOLUME]);
    eprintln!("$ dhv-binder volume status -verbose {VOLUME}\n{out}");
    assert_eq!(code, 0, "{out}");
    let events = out
        .split("Recent Events")
        .nth(1)
        .unwrap_or_else(|| panic!("{out}"));
    for e in [" publish ", " create ", " claim "] {
        assert!(events.contains(e), "no{e}event: {out}");
    }
    assert!(out.contains(&first_id), "-verbose gives full IDs: {out}");

    // Item 8: why the second allocation waits, from its node.
    let (code, out) = c.cli(&["alloc", "status", &waiting_id[..8]]);
    eprintln!("$ dhv-binder alloc status {}\n{out}", &waiting_id[..8]);
    assert_eq!(code, 0, "{out}");
    let vol = row(&out, &format!("default/{VOLUME}"));
    assert!(
        vol.contains("waiting") && vol.contains("held by job writer"),
        "{out}"
    );
    assert!(out.contains(&c.nodes[other].name), "{out}");

    // Item 9: one node's agent, plugins with their operations, volumes and claims.
    let (code, out) = c.cli(&["node", "status", holder_name]);
    eprintln!("$ dhv-binder node status {holder_name}\n{out}");
    assert_eq!(code, 0, "{out}");
    assert!(
        row(&out, "Agent Version").contains(env!("CARGO_PKG_VERSION")),
        "{out}"
    );
    let bind = row(&out, "bind ");
    assert!(bind.contains("yes"), "{out}");
    let vol = row(&out, &format!("default/{VOLUME}"));
    assert!(vol.contains("published") && vol.contains("held"), "{out}");
    let (code, out) = c.cli(&["node", "status", "-verbose"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(&c.nodes[holder].id),
        "-verbose gives full IDs: {out}"
    );
    let (code, out) = c.cli(&["plugin", "status"]);
    eprintln!("$ dhv-binder plugin status\n{out}");
    assert_eq!(code, 0, "{out}");
    assert!(out.lines().next().unwrap().contains("Operations"), "{out}");

    // `-namespace '*'` finds the volume in whichever namespace has it.
    let (code, out) = c.cli(&["volume", "status", "-namespace", "*", VOLUME]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("Namespace      = default"), "{out}");

    // `claim release` warns that the holder's agent is alive and its task runs (refused
    // here: no terminal, no -yes).
    let (code, out) = c.cli(&["volume", "claim", "release", VOLUME]);
    eprintln!("$ dhv-binder volume claim release {VOLUME}\n{out}");
    assert_eq!(code, 64, "{out}");
    assert!(
        out.contains("the holder's dhv-binder agent is alive"),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "a task on the holder still runs with the volume (allocation {first_id} of job writer)"
        )),
        "{out}"
    );
    assert!(!out.contains("(Unix s)"), "{out}");

    // Item 10: a dry run writes nothing and says who would offer and what is refused.
    let spec = c.sb.join("dry.volume.hcl");
    std::fs::write(
        &spec,
        format!(
            "name = \"dry\"\ntype = \"host\"\nplugin_id = \"bind\"\nparameters {{\n  export = \"{}\"\n}}\ncapability {{\n  access_mode = \"single-node-writer\"\n  attachment_mode = \"file-system\"\n}}\n",
            c.export.display()
        ),
    )
    .unwrap();
    let (code, out) = c.cli(&["volume", "create", "-dry-run", spec.to_str().unwrap()]);
    eprintln!("$ dhv-binder volume create -dry-run dry.volume.hcl\n{out}");
    assert_eq!(code, 0, "{out}");
    for n in &c.nodes {
        assert!(row(&out, &n.name).contains("offers it"), "{out}");
    }
    assert!(out.contains("would be accepted"), "{out}");
    let (code, out) = c.cli(&["volume", "status", "dry"]);
    assert_eq!(code, 1, "the dry run wrote no record: {out}");
    std::fs::write(
        &spec,
        std::fs::read_to_string(&spec)
            .unwrap()
            .replace("plugin_id = \"bind\"", "plugin_id = \"nosuch\""),
    )
    .unwrap();
    let (code, out) = c.cli(&["volume", "create", "-dry-run", spec.to_str().unwrap()]);
    eprintln!("$ dhv-binder volume create -dry-run dry.volume.hcl (plugin nosuch)\n{out}");
    assert_eq!(code, 1, "{out}");
    assert!(
        row(&out, &c.nodes[0].name).contains("no: no such plugin"),
        "{out}"
    );
    assert!(out.contains("would be refused"), "{out}");
}
