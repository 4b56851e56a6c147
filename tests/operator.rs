//! The operator's commands end to end against the simulator and real agents: every read
//! command's readable and `-json` forms (and `-t`), node records behind `plugin status`,
//! `node status` and the fail-fast `volume create`, and `volume register`/`deregister` of a
//! storage that already exists.

mod support;

use serde_json::Value;
use std::process::Command;
use support::cluster::{dhv_binder_bin, repo, Cluster};

/// The value of `key` in a readable `Key = value` block.
fn kv<'a>(out: &'a str, key: &str) -> &'a str {
    out.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(" = ")?;
            (k.trim_end() == key).then_some(v)
        })
        .unwrap_or_else(|| panic!("no {key} in:\n{out}"))
}

fn json(out: &str) -> Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON ({e}):\n{out}"))
}

/// `dhv-binder status` of node `i` in its readable form.
fn readable_status(c: &Cluster, i: usize) -> String {
    let out = Command::new(dhv_binder_bin())
        .arg("status")
        .env_clear()
        .env("DHV_BINDER_SOCKET", &c.nodes[i].socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The first allocation of `job` whose task `task` runs.
async fn running(c: &Cluster, job: &str, task: &str) -> Value {
    c.wait_for(90, &format!("task {task} of {job} running"), || async {
        c.allocs(job)
            .await
            .into_iter()
            .find(|a| a["TaskStates"][task]["State"] == "running")
    })
    .await
}

async fn ready_placeholders(c: &Cluster, name: &str, want: usize) {
    c.wait_for(
        30,
        &format!("{want} ready placeholder(s) of {name}"),
        || async {
            let vols = c.get("/v1/volumes?type=host&namespace=*").await;
            let n = vols
                .as_array()
                .unwrap()
                .iter()
                .filter(|v| v["Name"] == name && v["State"] == "ready")
                .count();
            (n == want).then_some(())
        },
    )
    .await;
}

/// A cluster whose agents log JSON and serve metrics on a free loopback port.
async fn observed_cluster(nodes: usize) -> Cluster {
    Cluster::start_with(
        nodes,
        "",
        &[
            ("DHV_BINDER_LOG_FORMAT", "json"),
            ("DHV_BINDER_METRICS_ADDR", "127.0.0.1:0"),
        ],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_read_command_prints_a_readable_and_a_json_form() {
    let c = observed_cluster(2).await;
    let export = c.export.display().to_string();
    let out = c.create_volume_with(
        "shared-data",
        "single-node-writer",
        "bind",
        &[("export", &export)],
        &[],
        "capacity_min = \"64MiB\"",
    );
    assert!(out.contains("took the create"), "{out}");
    assert!(out.contains("is ready (64.0 MiB)"), "{out}");
    ready_placeholders(&c, "shared-data", 2).await;

    let (code, out) = c.cli(&["volume", "list"]);
    assert_eq!(code, 0, "{out}");
    let header = out.lines().next().unwrap();
    assert!(
        header.starts_with("ID") && header.contains("Plugin ID  Capacity  State"),
        "{out}"
    );
    assert!(
        out.contains("shared-data  bind       64.0 MiB  ready"),
        "{out}"
    );
    let (code, out) = c.cli(&["volume", "list", "-json"]);
    assert_eq!(code, 0, "{out}");
    let v = json(&out);
    assert_eq!(v[0]["Name"], "shared-data", "{out}");
    assert_eq!(v[0]["CapacityBytes"], 64u64 << 20, "{out}");
    // Issue 37 #5: short IDs by default, full with -verbose; an ID prefix names the volume.
    let id = v[0]["ID"].as_str().unwrap().to_string();
    let (_, out) = c.cli(&["volume", "list"]);
    assert!(out.contains(&format!("\n{}  ", &id[..8])), "{out}");
    assert!(!out.contains(&id), "{out}");
    let (_, out) = c.cli(&["volume", "list", "-verbose"]);
    assert!(out.contains(&id), "{out}");
    let (code, out) = c.cli(&["volume", "status", &id[..8]]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(kv(&out, "Name"), "shared-data");
    let (code, out) = c.cli(&["volume", "status", "0000dead"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("no volume has that name or ID prefix"),
        "{out}"
    );
    let (code, out) = c.cli(&[
        "volume",
        "list",
        "-t",
        "{{range .}}{{.Name}}={{.State}}\\n{{end}}",
    ]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(out, "shared-data=ready\n");
    // Nomad's keys and Go template functions.
    let (code, out) = c.cli(&[
        "volume",
        "list",
        "-t",
        "{{range .}}{{printf \"%s %s\" .Name .PluginID}}{{if .Registered}} registered{{end}}{{end}}",
    ]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(out, "shared-data bind\n");

    let (code, out) = c.cli(&["volume", "status", "shared-data"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(kv(&out, "Requested Size"), "64.0 MiB");
    // The node that ran the create, by name and short ID.
    let creator = kv(&out, "Created On");
    assert!(
        c.nodes
            .iter()
            .any(|n| creator.ends_with(&format!("({})", n.id.chars().take(8).collect::<String>()))),
        "{out}"
    );
    assert!(out.contains("No allocations use this volume"), "{out}");
    let (code, out) = c.cli(&["volume", "status", "shared-data", "--json"]);
    assert_eq!(code, 0, "{out}");
    let v = json(&out);
    assert_eq!(v["PluginID"], "bind");
    assert!(v["Context"]["export_path"].is_string(), "{out}");
    assert!(v.get("Secrets").is_some_and(|s| s.is_u64()), "{out}");

    let (code, out) = c.cli(&["plugin", "status"]);
    assert_eq!(code, 0, "{out}");
    let bind = out
        .lines()
        .find(|l| l.starts_with("bind "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(
        bind.contains("1.1.0") && bind.contains("yes") && bind.ends_with("2/2"),
        "{out}"
    );
    let (code, out) = c.cli(&["plugin", "status", "-json"]);
    assert_eq!(code, 0, "{out}");
    let v = json(&out);
    let bind = v
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["ID"] == "bind")
        .unwrap();
    assert_eq!(bind["NodesHealthy"], 2, "{out}");
    let (code, out) = c.cli(&["plugin", "status", "bind"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(kv(&out, "Nodes Healthy"), "2");
    for n in &c.nodes {
        assert!(out.contains(&n.name), "{out}");
    }
    let (code, out) = c.cli(&["plugin", "status", "bind", "-json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json(&out).as_array().unwrap().len(), 2, "{out}");
    let (code, out) = c.cli(&["plugin", "status", "nosuch"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("no node reports plugin \"nosuch\""), "{out}");

    let (code, out) = c.cli(&["node", "status"]);
    assert_eq!(code, 0, "{out}");
    for n in &c.nodes {
        let line = out
            .lines()
            .find(|l| l.contains(&n.name))
            .unwrap_or_else(|| panic!("{out}"));
        assert!(line.contains(env!("CARGO_PKG_VERSION")), "{out}");
        assert!(!line.contains("stale"), "{out}");
    }
    let (code, out) = c.cli(&["node", "status", "-json"]);
    assert_eq!(code, 0, "{out}");
    let v = json(&out);
    assert_eq!(v.as_array().unwrap().len(), 2, "{out}");
    assert_eq!(v[0]["Stale"], false, "{out}");
    assert_eq!(v[0]["Plugins"]["bind"]["DeferredBind"], true, "{out}");

    let out = readable_status(&c, 0);
    assert!(out.starts_with("Node ID"), "{out}");
    assert!(
        out.contains(&format!("Node ID       = {}", c.nodes[0].id)),
        "{out}"
    );
    assert!(
        out.contains("Plugins       = bind 1.1.0 (deferred)"),
        "{out}"
    );
    assert!(out.contains("default/shared-data"), "{out}");
    // The socket's document is the agent's API, in snake_case.
    let (code, out) = c.status(0);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json(&out)["node_id"], c.nodes[0].id.as_str());
    // Issue 37 #6: `status -json` and `-t` use Nomad's casing; data keys (plugin IDs,
    // `namespace/name`) stay as they are.
    let status_cli = |args: &[&str]| {
        let out = Command::new(dhv_binder_bin())
            .arg("status")
            .args(args)
            .env_clear()
            .env("DHV_BINDER_SOCKET", &c.nodes[0].socket)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let out = status_cli(&["-json"]);
    eprintln!("what the operator sees (status -json):\n{out}");
    let v = json(&out);
    assert_eq!(v["NodeID"], c.nodes[0].id.as_str(), "{out}");
    assert_eq!(v["NodePool"], "default", "{out}");
    assert_eq!(v["View"]["Complete"], true, "{out}");
    assert_eq!(v["Plugins"]["bind"]["DeferredBind"], true, "{out}");
    let vol = v["Volumes"]
        .as_array()
        .and_then(|a| a.iter().find(|x| x["Name"] == "shared-data"))
        .unwrap_or_else(|| panic!("no shared-data in Volumes: {out}"));
    assert_eq!(vol["PluginID"], "bind", "{out}");
    assert!(vol["PlaceholderID"].is_string(), "{out}");
    assert!(
        v.get("node_id").is_none() && v.get("volumes").is_none(),
        "{out}"
    );
    let out = status_cli(&[
        "-t",
        "{{.NodeID}}{{range .Volumes}} {{.Namespace}}/{{.Name}}={{.PluginID}}{{end}}",
    ]);
    assert_eq!(
        out,
        format!("{} default/shared-data=bind\n", c.nodes[0].id),
        "{out}"
    );

    // Through a task's Task API socket, with its workload identity: no address, no TLS.
    let spec = c.sb.join("api.nomad.hcl");
    std::fs::write(
        &spec,
        "job \"api\" {\n  type = \"batch\"\n  group \"g\" {\n    task \"t\" {\n      driver = \"raw_exec\"\n      config {\n        command = \"/bin/sleep\"\n        args = [\"300\"]\n      }\n      identity {\n        file = true\n      }\n    }\n  }\n}\n",
    )
    .unwrap();
    let job = c.run_job(&spec).await;
    let alloc = running(&c, &job, "t").await;
    let node = c.node_index(alloc["NodeID"].as_str().unwrap());
    let secrets =
        c.sb.join(&format!("sim/{}/alloc", c.nodes[node].name))
            .join(alloc["ID"].as_str().unwrap())
            .join("t/secrets");
    let token = std::fs::read_to_string(secrets.join("nomad_token")).unwrap();
    let out = Command::new(dhv_binder_bin())
        .args(["node", "status", "-json"])
        .env_clear()
        .env(
            "NOMAD_ADDR",
            format!("unix://{}", secrets.join("api.sock").display()),
        )
        .env("NOMAD_TOKEN", token.trim())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(v.as_array().unwrap().len(), 2, "{v}");
    let out = Command::new(dhv_binder_bin())
        .args(["node", "status"])
        .env_clear()
        .env(
            "NOMAD_ADDR",
            format!("unix://{}", secrets.join("api.sock").display()),
        )
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "no token must be refused: {out:?}"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("token"),
        "{out:?}"
    );
    c.stop_job(&job, true).await;

    // JSON logs: one object a line, the event's fields as keys; the metrics endpoint answers.
    let log = std::fs::read_to_string(&c.nodes[0].log).unwrap();
    let lines: Vec<Value> = log.lines().map(json).collect();
    assert!(
        lines
            .iter()
            .any(|l| l["plugin"] == "bind" && l["level"] == "INFO"),
        "{log}"
    );
    let addr = lines
        .iter()
        .find(|l| l["message"] == "serving metrics at /metrics")
        .and_then(|l| l["addr"].as_str())
        .unwrap_or_else(|| panic!("no metrics address logged:\n{log}"));
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let build = format!(
        "dhv_binder_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    assert!(text.lines().any(|l| l == build), "{text}");
    eprintln!(
        "metrics scrape: {} bytes, {} samples",
        text.len(),
        text.lines().filter(|l| !l.starts_with('#')).count()
    );
}

/// Issue 37 #2 and #4: a create the plugin refuses fails with the plugin's own (redacted)
/// words and the node that ran it, `volume status` shows them, and `volume create` again
/// runs the plugin again (it used to answer "already exists" and exit 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_create_says_why_and_runs_again_when_asked() {
    let c = Cluster::start(1).await;
    let allow = c.sb.join("flaky-allowed");
    let plugin = c.plugin_dir.join("flaky");
    std::fs::write(
        &plugin,
        format!(
            r#"#!/bin/sh
case "$1" in
fingerprint) echo '{{"version":"1.0.0","deferred_bind":true}}' ;;
create)
  if [ -e "{}" ]; then echo '{{"bytes":0,"context":{{}}}}'; exit 0; fi
  echo "quota exceeded on pool p1 (password s3cret-pw)" >&2
  echo '{{"error":"backend said no"}}'
  exit 1 ;;
*) echo '{{}}' ;;
esac
"#,
            allow.display()
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    c.wait_plugin("flaky").await;
    let spec = c.sb.join("flaky.volume.hcl");
    std::fs::write(
        &spec,
        "name = \"flaky-data\"\ntype = \"host\"\nplugin_id = \"flaky\"\nsecrets {\n  password = \"s3cret-pw\"\n}\n",
    )
    .unwrap();
    let spec = spec.to_str().unwrap();
    let (code, out) = c.cli(&["volume", "create", spec]);
    eprintln!("{out}");
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("volume default/flaky-data failed to be created on node node-1 ("),
        "{out}"
    );
    assert!(out.contains("error: backend said no"), "{out}");
    assert!(out.contains("quota exceeded on pool p1"), "{out}");
    assert!(
        !out.contains("s3cret-pw"),
        "a secret reached the CLI: {out}"
    );
    assert!(!out.contains("agent's log"), "{out}");
    assert!(
        out.contains("run the same `dhv-binder volume create` again"),
        "{out}"
    );

    let (code, out) = c.cli(&["volume", "status", "flaky-data"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(kv(&out, "State"), "failed");
    assert!(kv(&out, "Failed On").starts_with("node-1 ("), "{out}");
    assert!(
        kv(&out, "Error").contains("error: backend said no"),
        "{out}"
    );

    std::fs::write(&allow, "").unwrap();
    let (code, out) = c.cli(&["volume", "create", spec]);
    eprintln!("{out}");
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("running its create again"), "{out}");
    assert!(out.contains("Volume default/flaky-data is ready"), "{out}");
    let (code, out) = c.cli(&["volume", "create", spec]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("already exists with this spec"), "{out}");
}

/// Issue 37 #3: a create no agent acts on (here: unsigned, and every node wants the
/// operator's signature) gives up after `-timeout` with exit 75, saying what the agents
/// recorded; `volume status` shows the same reason, and `-detach` returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_no_agent_acts_on_gives_up_saying_why() {
    let c = Cluster::start(2).await;
    let spec = format!(
        "name = \"unsigned-data\"\ntype = \"host\"\nplugin_id = \"bind\"\nparameters {{\n  export = \"{}\"\n}}\n",
        c.export.display()
    );
    // Without the operator's key, the spec from standard input (`-`), Nomad's flag spelling.
    let run = |args: &[&str]| {
        use std::io::Write as _;
        let mut child = Command::new(dhv_binder_bin())
            .args(args)
            .env_clear()
            .env("NOMAD_ADDR", &c.server)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(spec.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code().unwrap_or(-1), text)
    };
    let (code, out) = run(&["volume", "create", "-timeout", "10s", "-"]);
    eprintln!("{out}");
    assert_eq!(code, 75, "{out}");
    assert!(
        out.contains("volume default/unsigned-data is still pending after 10s"),
        "{out}"
    );
    assert!(out.contains("node-1, node-2 refuse it:"), "{out}");
    assert!(out.contains("the record is not signed"), "{out}");
    let (code, out) = c.cli(&["volume", "status", "unsigned-data"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        kv(&out, "Waiting For").contains("node-1, node-2 refuse it:"),
        "{out}"
    );
    assert!(out.contains("refuses the record:"), "{out}");
    let (code, out) = c.cli(&["volume", "delete", "unsigned-data"]);
    assert_eq!(code, 0, "{out}");
    let started = std::time::Instant::now();
    let (code, out) = run(&["volume", "create", "-detach", "-"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_fails_at_once_when_no_live_node_has_the_plugin() {
    let c = Cluster::start(2).await;
    let spec = c.sb.join("nfs.volume.hcl");
    std::fs::write(
        &spec,
        "name = \"nfs-data\"\ntype = \"host\"\nplugin_id = \"nfs\"\ncapability {\n  access_mode = \"single-node-writer\"\n  attachment_mode = \"file-system\"\n}\n",
    )
    .unwrap();
    let started = std::time::Instant::now();
    let (code, out) = c.cli(&["volume", "create", spec.to_str().unwrap()]);
    eprintln!(
        "fail-fast volume create answered in {:?}",
        started.elapsed()
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("no live node has a healthy deferred plugin \"nfs\""),
        "{out}"
    );
    assert!(out.contains("node-1 (no such plugin)"), "{out}");
    assert!(!out.contains("Waiting"), "it waited: {out}");
    let r = c
        .http
        .get(format!(
            "{}/v1/var/dhv-binder/volumes/nfs-data?namespace=default",
            c.server
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404, "a refused create left a record");

    // The plugin exists, but not in the spec's node pool.
    let spec = c.sb.join("gpu.volume.hcl");
    std::fs::write(
        &spec,
        "name = \"gpu-data\"\ntype = \"host\"\nplugin_id = \"bind\"\nnode_pool = \"gpu\"\nparameters {\n  export = \"/srv\"\n}\n",
    )
    .unwrap();
    let (code, out) = c.cli(&["volume", "create", spec.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("in node pool \"gpu\""), "{out}");
    assert!(out.contains("node-2 (pool default)"), "{out}");

    // Issue 11 #10: Nomad creates no namespace on demand; a volume in a missing one is
    // refused at create (before the fix its record was written and nothing could use it).
    let spec = c.sb.join("nope.volume.hcl");
    std::fs::write(
        &spec,
        "name = \"nope-data\"\nnamespace = \"nope\"\ntype = \"host\"\nplugin_id = \"bind\"\nparameters {\n  export = \"/srv\"\n}\n",
    )
    .unwrap();
    let (code, out) = c.cli(&["volume", "create", "--detach", spec.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("namespace \"nope\" does not exist"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_volume_is_published_without_create_and_deregistered_without_delete() {
    let c = Cluster::start(2).await;
    // The real bind plugin, with every call but fingerprint logged.
    std::fs::copy(c.plugin_dir.join("bind"), c.plugin_dir.join("real")).unwrap();
    support::sandbox::wrapper_plugin(
        &c.plugin_dir,
        "bind",
        &format!(
            "echo \"$1\" >> {}\nexec \"$REAL\" \"$@\"",
            c.plugin_dir.join("calls.log").display()
        ),
    );
    // The storage exists already, with data in it.
    let existing = c.export.join("legacy");
    std::fs::create_dir_all(&existing).unwrap();
    // Existing storage the job's user (exec driver default: nobody) may write.
    std::os::unix::fs::chown(&existing, Some(65534), Some(65534)).unwrap();
    std::fs::write(existing.join("old.txt"), "from before dhv-binder\n").unwrap();
    let spec = c.sb.join("shared-data.volume.hcl");
    std::fs::write(
        &spec,
        format!(
            "name = \"shared-data\"\ntype = \"host\"\nplugin_id = \"bind\"\ncapacity = \"10GiB\"\ncapability {{\n  access_mode = \"single-node-writer\"\n  attachment_mode = \"file-system\"\n}}\ncontext {{\n  export_path = \"{}\"\n}}\n",
            existing.display()
        ),
    )
    .unwrap();
    let (code, out) = c.cli(&["volume", "register", spec.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("no plugin create was run"), "{out}");
    let (_, out) = c.cli(&["volume", "status", "shared-data"]);
    assert_eq!(kv(&out, "State"), "ready (registered)");
    assert_eq!(kv(&out, "Requested Size"), "10.0 GiB");
    ready_placeholders(&c, "shared-data", 2).await;

    let job = c.run_job(&repo().join("jobspecs/example.nomad.hcl")).await;
    let alloc = running(&c, &job, "app").await;
    let alloc_id = alloc["ID"].as_str().unwrap().to_string();
    c.wait_for(20, "the task's line in the existing storage", || async {
        std::fs::read_to_string(existing.join("greetings.txt"))
            .ok()
            .filter(|t| t.contains(&alloc_id))
    })
    .await;
    let (code, out) = c.cli(&["volume", "deregister", "shared-data"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("in use by allocations"), "{out}");
    c.stop_job(&job, false).await;
    c.wait_for(60, "the allocation gone from the placeholders", || async {
        let (code, _) = c.cli(&["volume", "delete", "shared-data", "--detach"]);
        // Refused either way: in use, then registered.
        let (_, out) = c.cli(&["volume", "status", "shared-data"]);
        (code == 1 && out.contains("No allocations use this volume")).then_some(())
    })
    .await;
    let (code, out) = c.cli(&["volume", "delete", "shared-data"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("use `dhv-binder volume deregister shared-data`"),
        "{out}"
    );
    let (code, out) = c.cli(&["volume", "deregister", "shared-data"]);
    assert_eq!(code, 0, "{out}");
    ready_placeholders(&c, "shared-data", 0).await;
    let (code, out) = c.cli(&["volume", "list", "-json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json(&out), serde_json::json!([]));
    assert!(
        existing.join("old.txt").exists(),
        "deregister removed the storage"
    );
    let calls = support::sandbox::calls(&c.plugin_dir);
    assert!(calls.iter().any(|l| l.starts_with("publish")), "{calls:?}");
    assert!(
        !calls
            .iter()
            .any(|l| l.starts_with("create") || l.starts_with("delete")),
        "{calls:?}"
    );
}

/// The sample value of the metric line `series` (name and labels exactly as exposed).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split(' ').next()?.parse().ok())
}

/// Node `i`'s metrics address, from its JSON log.
fn metrics_addr(c: &Cluster, i: usize) -> String {
    let log = std::fs::read_to_string(&c.nodes[i].log).unwrap();
    log.lines()
        .map(json)
        .find(|l| l["message"] == "serving metrics at /metrics")
        .and_then(|l| l["addr"].as_str().map(str::to_string))
        .unwrap_or_else(|| panic!("no metrics address logged:\n{log}"))
}

async fn scrape(addr: &str) -> String {
    let r = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

/// The metrics an operator alerts on move with a real run: the example job's publish is
/// one `publish` plugin call and one answered prestart wait, the published-mounts gauge
/// goes to 1 and back to 0 with the unpublish after the job stops; fingerprints, journal
/// writes, the plugin inventory and the watch state are there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_follow_a_job_through_publish_and_unpublish() {
    let c = observed_cluster(1).await;
    let addr = metrics_addr(&c, 0);
    let publish_ok = r#"dhv_binder_plugin_call_duration_seconds_count{plugin="bind",operation="publish",outcome="ok"}"#;
    let unpublish_ok = r#"dhv_binder_plugin_call_duration_seconds_count{plugin="bind",operation="unpublish",outcome="ok"}"#;
    let waited = r#"dhv_binder_publish_wait_duration_seconds_count{outcome="published"}"#;
    let published = r#"dhv_binder_mounts{state="published"}"#;
    let before = scrape(&addr).await;
    assert_eq!(sample(&before, publish_ok), None, "{before}");
    assert_eq!(sample(&before, published), Some(0.0), "{before}");
    let unsigned = r#"dhv_binder_records_refused_total{reason="unsigned"}"#;
    assert_eq!(sample(&before, unsigned), Some(0.0), "{before}");
    assert_eq!(
        sample(&before, r#"dhv_binder_claims{state="held"}"#),
        Some(0.0),
        "{before}"
    );
    assert!(
        sample(
            &before,
            r#"dhv_binder_plugin_call_duration_seconds_count{plugin="bind",operation="fingerprint",outcome="ok"}"#
        )
        .is_some_and(|n| n >= 1.0),
        "{before}"
    );
    assert_eq!(
        sample(
            &before,
            r#"dhv_binder_plugin_up{plugin="bind",deferred="true"}"#
        ),
        Some(1.0),
        "{before}"
    );

    let out = c.create_volume("shared-data", "single-node-writer");
    assert!(out.contains("is ready"), "{out}");
    ready_placeholders(&c, "shared-data", 1).await;
    let job = c.run_job(&repo().join("jobspecs/example.nomad.hcl")).await;
    let alloc = running(&c, &job, "app").await;
    let alloc_id = alloc["ID"].as_str().unwrap();
    // Issue 37 #15: the prestart task says how long it waited, as measured.
    let prestart = std::fs::read_to_string(c.sb.join(&format!(
        "sim/node-1/alloc/{alloc_id}/alloc/logs/publish-volumes.stdout.0"
    )))
    .unwrap_or_default();
    let line = prestart
        .lines()
        .find(|l| l.contains("published at"))
        .unwrap_or_else(|| panic!("no published line in the prestart's output:\n{prestart}"));
    let took = line
        .rsplit_once(" after ")
        .map(|(_, d)| d)
        .unwrap_or_else(|| panic!("no measured wait: {line}"));
    assert!(
        took.strip_suffix("ms")
            .is_some_and(|n| n.parse::<u64>().is_ok())
            || took
                .strip_suffix('s')
                .is_some_and(|n| n.parse::<f64>().is_ok()),
        "{line}"
    );
    eprintln!("{line}");
    // The main task runs only after the prestart caller was answered: the wait and the
    // publish are counted by then, and the gauges follow within the same pass.
    let during = scrape(&addr).await;
    let exactly = [
        (publish_ok, 1.0),
        (published, 1.0),
        // Issue 37 #13: the single-node volume's claim, held by this node.
        (r#"dhv_binder_claims{state="held"}"#, 1.0),
        (r#"dhv_binder_claims{state="waiting"}"#, 0.0),
        ("dhv_binder_volumes_served", 1.0),
        (r#"dhv_binder_watch_state{state="polling"}"#, 1.0),
    ];
    for (series, want) in exactly {
        assert_eq!(sample(&during, series), Some(want), "{series}:\n{during}");
    }
    let at_least = [
        (waited, 1.0),
        ("dhv_binder_allocations", 1.0),
        ("dhv_binder_journal_write_duration_seconds_count", 2.0),
    ];
    for (series, least) in at_least {
        assert!(
            sample(&during, series).is_some_and(|n| n >= least),
            "{series}:\n{during}"
        );
    }
    eprintln!(
        "metrics scrape while the job runs:\n{}",
        during
            .lines()
            .filter(|l| !l.starts_with('#') && !l.contains("_bucket"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // Issue 37 #10: `volume status` shows the volume on each node: mounted since when,
    // its placeholder and the allocation using it.
    let short = &alloc_id[..8];
    let status = c
        .wait_for(20, "volume status showing the mount on node-1", || async {
            let (code, out) = c.cli(&["volume", "status", "shared-data"]);
            (code == 0
                && out.lines().any(|l| {
                    l.starts_with("node-1") && l.contains(" published ") && l.contains(short)
                }))
            .then_some(out)
        })
        .await;
    eprintln!("{status}");
    let (code, out) = c.cli(&["volume", "status", "shared-data", "-json"]);
    assert_eq!(code, 0, "{out}");
    let v = json(&out);
    // Issue 37 #6: Nomad's keys (`ID`, `Name`, `PluginID`), RFC 3339 times.
    for key in [
        "ID",
        "Name",
        "PluginID",
        "Namespace",
        "CapacityBytes",
        "State",
    ] {
        assert!(v.get(key).is_some(), "no {key}: {out}");
    }
    assert!(v.get("plugin_id").is_none(), "{out}");
    assert_eq!(v["Name"], "shared-data", "{out}");
    assert_eq!(v["PluginID"], "bind", "{out}");
    let n = &v["Nodes"][0];
    assert_eq!(n["NodeName"], "node-1", "{out}");
    assert_eq!(n["State"], "published", "{out}");
    let since = n["Since"].as_str().unwrap_or_else(|| panic!("{out}"));
    assert!(
        since.len() == 20 && since.as_bytes()[10] == b'T' && since.ends_with('Z'),
        "Since is not RFC 3339: {out}"
    );
    assert!(
        n["HostVolumeID"].as_str().is_some_and(|h| !h.is_empty()),
        "{out}"
    );
    assert_eq!(n["Allocations"][0], alloc_id, "{out}");

    c.stop_job(&job, false).await;
    // The plugin call's counter moves when the call returns, on the worker; the gauges move
    // when the agent's loop takes the completion in, a moment later. Wait for both.
    let unpublishing = r#"dhv_binder_mounts{state="unpublishing"}"#;
    let after = c
        .wait_for(
            60,
            "the unpublish counted and the mount gauges at 0",
            || async {
                let t = scrape(&addr).await;
                (sample(&t, unpublish_ok) == Some(1.0)
                    && sample(&t, published) == Some(0.0)
                    && sample(&t, unpublishing) == Some(0.0))
                .then_some(t)
            },
        )
        .await;
    for (series, want) in [
        (publish_ok, 1.0),
        ("dhv_binder_operations_pending", 0.0),
        ("dhv_binder_publish_waiters", 0.0),
    ] {
        assert_eq!(sample(&after, series), Some(want), "{series}:\n{after}");
    }

    // The claim is released with the unpublish; its variable keeps the last holder's node
    // (the hand-over's evidence), which is no holder: no `Claim Holder` line.
    c.wait_for(20, "no claim holder once the claim is released", || async {
        let (code, out) = c.cli(&["volume", "status", "shared-data"]);
        (code == 0 && !out.contains("Claim Holder")).then_some(())
    })
    .await;

    // Issue 37 #10: `-verbose` adds the recent events from the node records, newest first:
    // the unpublish, then the publish for the allocation with its measured time.
    let verbose = c
        .wait_for(
            20,
            "volume status -verbose showing the unpublish",
            || async {
                let (code, out) = c.cli(&["volume", "status", "shared-data", "-verbose"]);
                (code == 0
                    && out
                        .lines()
                        .any(|l| l.contains(" node-1  unpublish ") && l.ends_with(" ok")))
                .then_some(out)
            },
        )
        .await;
    eprintln!("{verbose}");
    let events = verbose
        .split("\nRecent Events\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no Recent Events:\n{verbose}"));
    let rows: Vec<&str> = events.lines().skip(1).collect();
    assert!(rows[0].contains(" node-1  unpublish  -"), "{verbose}");
    let publish = rows
        .iter()
        .find(|l| l.contains(" node-1  publish "))
        .unwrap_or_else(|| panic!("no publish event:\n{verbose}"));
    assert!(publish.contains(alloc_id), "{verbose}");
    assert!(publish.contains(" ok in "), "{verbose}");
    let (code, out) = c.cli(&["volume", "status", "shared-data", "-json"]);
    assert_eq!(code, 0, "{out}");
    let h = &json(&out)["History"];
    let publish = h
        .as_array()
        .and_then(|h| h.iter().find(|e| e["Event"] == "publish"))
        .unwrap_or_else(|| panic!("{out}"));
    assert_eq!(publish["AllocID"], alloc_id, "{out}");
    assert_eq!(publish["NodeName"], "node-1", "{out}");
    assert!(
        publish["Time"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{out}"
    );

    // The log lines about the volume name it as ns/name; those about the allocation, its ID.
    let log = std::fs::read_to_string(&c.nodes[0].log).unwrap();
    let lines: Vec<Value> = log.lines().map(json).collect();
    let line = |message: &str| {
        lines
            .iter()
            .find(|l| l["message"] == message)
            .unwrap_or_else(|| panic!("no {message:?} line:\n{log}"))
    };
    let publishing = line("publishing");
    assert_eq!(publishing["volume"], "default/shared-data", "{publishing}");
    assert_eq!(publishing["alloc_id"], alloc_id, "{publishing}");
    for message in ["published", "unpublishing", "unpublished"] {
        assert_eq!(line(message)["volume"], "default/shared-data", "{log}");
    }

    // Issue 33: a storage delete is logged at info, before and after, naming the volume,
    // its ID, namespace, plugin, node and the context the plugin deletes.
    let id = json(&c.cli(&["volume", "status", "shared-data", "-json"]).1)["ID"]
        .as_str()
        .unwrap()
        .to_string();
    let (code, out) = c.cli(&["volume", "delete", "shared-data"]);
    assert_eq!(code, 0, "{out}");
    let log = std::fs::read_to_string(&c.nodes[0].log).unwrap();
    for message in [
        "deleting the volume's storage",
        "deleted the volume's storage",
    ] {
        let l = log
            .lines()
            .map(json)
            .find(|l| l["message"] == message)
            .unwrap_or_else(|| panic!("no {message:?} line:\n{log}"));
        assert_eq!(l["level"], "INFO", "{l}");
        assert_eq!(l["volume"], "default/shared-data", "{l}");
        assert_eq!(l["volume_id"], id.as_str(), "{l}");
        assert_eq!(l["namespace"], "default", "{l}");
        assert_eq!(l["plugin"], "bind", "{l}");
        assert_eq!(l["node"], c.nodes[0].id.as_str(), "{l}");
        assert!(
            l["context"].as_str().is_some_and(|x| x.contains(&id)),
            "{l}"
        );
    }

    // Issue 37 #13: a record written without the operator's key is refused and counted,
    // by reason; the claim was given back with the unpublish.
    let spec = c.sb.join("unsigned.volume.hcl");
    std::fs::write(
        &spec,
        format!(
            "name = \"unsigned-data\"\ntype = \"host\"\nplugin_id = \"bind\"\nparameters {{\n  export = \"{}\"\n}}\n",
            c.export.display()
        ),
    )
    .unwrap();
    let out = Command::new(dhv_binder_bin())
        .args(["volume", "create", "-detach", spec.to_str().unwrap()])
        .env_clear()
        .env("NOMAD_ADDR", &c.server)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let refused = c
        .wait_for(20, "the unsigned record counted as refused", || async {
            let t = scrape(&addr).await;
            (sample(&t, unsigned) == Some(1.0)).then_some(t)
        })
        .await;
    assert_eq!(
        sample(
            &refused,
            r#"dhv_binder_records_refused_total{reason="bad-signature"}"#
        ),
        Some(0.0),
        "{refused}"
    );
    assert_eq!(
        sample(&refused, r#"dhv_binder_claims{state="held"}"#),
        Some(0.0),
        "{refused}"
    );
}

/// Configuration an operator got wrong is exit 64 with the reason, before the agent asks
/// Nomad anything: no record keys (and no --allow-unsigned-records).
#[test]
fn agent_configuration_errors_exit_64_and_say_why() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(dhv_binder_bin())
        .arg("agent")
        .arg("--state-dir")
        .arg(tmp.path().join("state"))
        .arg("--socket")
        .arg(tmp.path().join("api.sock"))
        .arg("--plugin-dir")
        .arg(tmp.path().join("plugins"))
        .env_clear()
        // Nothing listens here: reaching Nomad would be exit 69, not 64.
        .env("NOMAD_ADDR", "http://127.0.0.1:9")
        .output()
        .expect("run dhv-binder agent");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{err}");
    assert!(err.contains("no record keys configured"), "{err}");
}

/// A usage line names what a command needs, not what the environment happened to give: with
/// the operator's key and Nomad's address in the environment (as the demo's env file sets
/// them), a `volume update` missing its `-availability` shows the usage its help shows, not
/// `--signing-key <SIGNING_KEY> --address <ADDRESS>` as if both were required.
#[test]
fn a_usage_line_does_not_name_the_flags_the_environment_gave() {
    let run = |args: &[&str]| {
        let out = Command::new(dhv_binder_bin())
            .args(args)
            .env_clear()
            .env("DHV_BINDER_SIGNING_KEY", "/nonexistent/operator.key")
            .env("NOMAD_ADDR", "http://127.0.0.1:9")
            .env("NOMAD_NAMESPACE", "default")
            .output()
            .expect("run dhv-binder");
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(2), "{err}");
        err.lines()
            .find(|l| l.starts_with("Usage: "))
            .unwrap_or_else(|| panic!("no usage line:\n{err}"))
            .to_string()
    };
    assert_eq!(
        run(&["volume", "update", "shared-data"]),
        "Usage: dhv-binder volume update --availability <AVAILABILITY> <NAME>"
    );
    assert_eq!(
        run(&["volume", "update", "-repaired"]),
        "Usage: dhv-binder volume update --repaired <NAME>"
    );
    assert_eq!(
        run(&["volume", "delete"]),
        "Usage: dhv-binder volume delete <NAME>"
    );
}

/// A node not prepared yet (its record keys file and a storage root missing) gets one
/// message per missing item and a wait, not an exit (Nomad would restart the task for
/// ever): within the first delay (5 s) each item is named exactly once. Once both exist the
/// agent goes on by itself, and waits for the local Nomad agent instead of failing.
#[test]
fn an_unprepared_node_names_each_missing_item_once_and_waits() {
    let tmp = tempfile::tempdir().unwrap();
    let keys = tmp.path().join("record-keys.pub");
    let root = tmp.path().join("exports");
    let log = tmp.path().join("agent.log");
    /// Killed on drop, also when an assertion fails.
    struct Agent(std::process::Child);
    impl Drop for Agent {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut agent = Command::new(dhv_binder_bin())
        .arg("agent")
        .arg("--state-dir")
        .arg(tmp.path().join("state"))
        .arg("--socket")
        .arg(tmp.path().join("api.sock"))
        .arg("--plugin-dir")
        .arg(tmp.path().join("plugins"))
        .arg("--record-keys")
        .arg(&keys)
        .arg("--plugin-root")
        .arg(format!("bind={}", root.display()))
        .arg("--helper-cgroup")
        .arg("none")
        .env_clear()
        .env("NOMAD_ADDR", "http://127.0.0.1:9")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .map(Agent)
        .expect("run dhv-binder agent");
    let agent = &mut agent.0;
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert!(
        agent.try_wait().unwrap().is_none(),
        "the agent exited: {}",
        std::fs::read_to_string(&log).unwrap()
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let count = |needle: &str| text.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(count("record-keys.pub does not exist"), 1, "{text}");
    assert_eq!(count("exports of plugin \"bind\""), 1, "{text}");
    assert_eq!(count("not ready for dhv-binder"), 2, "{text}");

    let (key, _) = dhv_binder::cluster::trust::SigningKey::generate().unwrap();
    std::fs::write(&keys, key.public_line()).unwrap();
    std::fs::set_permissions(&keys, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    std::fs::create_dir(&root).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while !std::fs::read_to_string(&log)
        .unwrap()
        .contains("waiting for the local Nomad agent")
    {
        assert!(
            std::time::Instant::now() < deadline && agent.try_wait().unwrap().is_none(),
            "the agent did not go on once the node was prepared: {}",
            std::fs::read_to_string(&log).unwrap()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = agent.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
}

/// Issue 37 #7: a spec field dhv-binder does not know is refused by name before anything
/// is written (Nomad's parser refuses unknown arguments), and a `constraint` block, which
/// dhv-binder cannot honour, is refused saying what to use instead.
#[test]
fn a_spec_field_dhv_binder_cannot_honour_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let create = |body: &str| {
        let spec = tmp.path().join("v.hcl");
        std::fs::write(
            &spec,
            format!("name = \"v\"\ntype = \"host\"\nplugin_id = \"bind\"\n{body}"),
        )
        .unwrap();
        let out = Command::new(dhv_binder_bin())
            .args(["volume", "create", "-detach"])
            .arg(&spec)
            .env_clear()
            // Nothing listens here: reaching Nomad would be exit 69, not 64.
            .env("NOMAD_ADDR", "http://127.0.0.1:9")
            .output()
            .expect("run dhv-binder volume create");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // A constraint dhv-binder cannot evaluate (issue 48 #1: it evaluates Nomad's targets
    // and operators, not `regexp`).
    let (code, err) = create(
        "constraint {\n  attribute = \"${node.class}\"\n  operator = \"regexp\"\n  value = \"d.*\"\n}\n",
    );
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("\"regexp\" is not one dhv-binder evaluates"),
        "{err}"
    );
    let (code, err) = create("capacity_minimum = \"1GiB\"\n");
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("\"capacity_minimum\" is not a volume spec field"),
        "{err}"
    );
}

/// Issue 37 #15: a spec error names the file and the line, as a compiler does
/// (`spec.hcl:7: …`, `<stdin>:7: …` for `-`); a syntax error also its column.
#[test]
fn a_spec_error_names_the_file_and_the_line() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = tmp.path().join("spec.hcl");
    let head = "name      = \"data\"\ntype      = \"host\"\nplugin_id = \"bind\"\n\ncapability {\n  access_mode     = \"single-node-writer\"\n";
    let create = |body: &str, stdin: bool| {
        use std::io::Write as _;
        std::fs::write(&spec, format!("{head}{body}")).unwrap();
        let mut cmd = Command::new(dhv_binder_bin());
        cmd.args(["volume", "create", "-detach"])
            .current_dir(tmp.path())
            .env_clear()
            // Nothing listens here: reaching Nomad would be exit 69, not 64.
            .env("NOMAD_ADDR", "http://127.0.0.1:9")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd.arg(if stdin { "-" } else { "spec.hcl" });
        let mut child = cmd.spawn().expect("run dhv-binder volume create");
        let text = std::fs::read(&spec).unwrap();
        child.stdin.take().unwrap().write_all(&text).unwrap();
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // An unknown field of the capability block, on line 7.
    let (code, err) = create("  attachment_mod  = \"file-system\"\n}\n", false);
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("Error: spec.hcl:7: \"attachment_mod\" is not a field of a capability block"),
        "{err}"
    );
    let (_, err) = create("  attachment_mod  = \"file-system\"\n}\n", true);
    assert!(
        err.contains("Error: <stdin>:7: \"attachment_mod\""),
        "{err}"
    );
    // A bad value on line 7.
    let (code, err) = create("  attachment_mode = \"floppy\"\n}\n", false);
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("Error: spec.hcl:7: attachment_mode \"floppy\" is not one of"),
        "{err}"
    );
    // A syntax error on line 7, column 21.
    let (code, err) = create("  attachment_mode = \n}\n", false);
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("Error: spec.hcl:7:21: not valid HCL: invalid expression"),
        "{err}"
    );
    // A top-level field after the block, on line 9.
    let (code, err) = create("}\n\ncapacity_min = \"lots\"\n", false);
    assert_eq!(code, Some(64), "{err}");
    assert!(
        err.contains("Error: spec.hcl:9: capacity_min \"lots\" is not a size"),
        "{err}"
    );
}

/// Issue 33 finding 5: 300 idle TCP connections to the metrics endpoint of an agent whose
/// file-descriptor limit is 256 (the attack in the issue) neither exhaust its descriptors
/// nor keep the endpoint shut: the unix-socket `status` answers at once and a scrape within
/// a few seconds (the connections over the cap are closed at once, the rest when their
/// headers are late).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_exhaust_the_metrics_endpoint() {
    let c = observed_cluster(1).await;
    let addr = metrics_addr(&c, 0);
    scrape(&addr).await;
    let pid = c.nodes[0].agent.as_ref().expect("the agent runs").id();
    let out = Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg("--nofile=256:256")
        .output()
        .expect("run prlimit (util-linux)");
    assert!(out.status.success(), "prlimit: {out:?}");

    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    let start = std::time::Instant::now();
    // The unix socket answers while the connections are held.
    let status = tokio::task::spawn_blocking({
        let socket = c.nodes[0].socket.clone();
        move || {
            Command::new("timeout")
                .arg("5")
                .arg(dhv_binder_bin())
                .args(["status", "-json"])
                .env_clear()
                .env("DHV_BINDER_SOCKET", &socket)
                .output()
                .expect("run dhv-binder status")
        }
    })
    .await
    .unwrap();
    assert!(
        status.status.success(),
        "status with 300 idle metrics connections: {status:?}"
    );
    // A scrape answers within a few seconds (once the idle ones' header time is up).
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(2))
        .build()
        .unwrap();
    let scraped = loop {
        match client.get(format!("http://{addr}/metrics")).send().await {
            Ok(r) if r.status() == 200 => break start.elapsed(),
            other if start.elapsed() > std::time::Duration::from_secs(12) => {
                panic!("no scrape answered in 12 s with 300 idle connections: {other:?}")
            }
            _ => tokio::time::sleep(std::time::Duration::from_millis(200)).await,
        }
    };
    eprintln!("300 idle metrics connections: status answered, a scrape after {scraped:?}");
    drop(idle);
}
