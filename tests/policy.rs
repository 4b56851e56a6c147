//! The daemon works with the narrowed ACL policy of jobspecs/dhv-binder-policy.hcl, against
//! the simulator with ACLs enabled, and the policy refuses what the daemon never needs; an
//! operator with jobspecs/operator-policy.hcl can create, inspect, snapshot and delete a
//! volume, and a token without it gets Nomad's reason and the policy to use (issue 37 #14).

mod support;

use dhv_binder::config::NomadConfig;
use dhv_binder::nomad::types::Variable;
use dhv_binder::nomad::{Client, NomadError};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use support::cluster::{dhv_binder_bin, repo, Cluster};

const ROOT: &str = "0b1d2a3c-0000-4000-8000-00000000beef";

async fn req(c: &Cluster, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
    let mut rb = c
        .http
        .request(method, format!("{}{path}", c.server))
        .header("X-Nomad-Token", ROOT);
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let r = rb.send().await.unwrap();
    assert!(r.status().is_success(), "{path}: {}", r.status());
    r.json().await.unwrap_or(Value::Null)
}

fn cli(c: &Cluster, token: &str, args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(dhv_binder_bin())
        .args(args)
        .env_clear()
        .env("NOMAD_ADDR", &c.server)
        .env("NOMAD_TOKEN", token)
        .env("DHV_BINDER_SIGNING_KEY", c.sb.join("operator.key"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_works_with_the_narrowed_policy() {
    let acl = format!("acl {{\n  enabled = true\n  bootstrap_token = \"{ROOT}\"\n}}\n");
    // The agent starts with the management token (the cluster waits for its node record),
    // then runs again with the policy's token below.
    let mut c = Cluster::start_with(1, &acl, &[("NOMAD_TOKEN", ROOT)]).await;
    let rules = std::fs::read_to_string(repo().join("jobspecs/dhv-binder-policy.hcl")).unwrap();
    req(
        &c,
        reqwest::Method::PUT,
        "/v1/acl/policy/dhv-binder",
        Some(json!({"Name": "dhv-binder", "Rules": rules})),
    )
    .await;
    let tok = req(
        &c,
        reqwest::Method::PUT,
        "/v1/acl/token",
        Some(json!({"Name": "binder", "Type": "client", "Policies": ["dhv-binder"]})),
    )
    .await;
    let secret = tok["SecretID"].as_str().unwrap().to_string();
    // An operator's token from jobspecs/operator-policy.hcl, and one without it.
    let operator_rules =
        std::fs::read_to_string(repo().join("jobspecs/operator-policy.hcl")).unwrap();
    req(
        &c,
        reqwest::Method::PUT,
        "/v1/acl/policy/dhv-binder-operator",
        Some(json!({"Name": "dhv-binder-operator", "Rules": operator_rules})),
    )
    .await;
    req(
        &c,
        reqwest::Method::PUT,
        "/v1/acl/policy/node-reader",
        Some(json!({"Name": "node-reader", "Rules": "namespace \"default\" {\n  capabilities = [\"read-job\"]\n}\nnode {\n  policy = \"read\"\n}\n"})),
    )
    .await;
    let token_of = |policy: &'static str| {
        let c = &c;
        async move {
            let t = req(
                c,
                reqwest::Method::PUT,
                "/v1/acl/token",
                Some(json!({"Name": policy, "Type": "client", "Policies": [policy]})),
            )
            .await;
            t["SecretID"].as_str().unwrap().to_string()
        }
    };
    let operator = token_of("dhv-binder-operator").await;
    let bystander = token_of("node-reader").await;
    // Run the agent with the policy's token; its node record is written with it.
    c.kill_agent(0, nix::sys::signal::Signal::SIGKILL);
    c.agent_env.retain(|(k, _)| k != "NOMAD_TOKEN");
    c.agent_env.push(("NOMAD_TOKEN".into(), secret.clone()));
    req(
        &c,
        reqwest::Method::DELETE,
        &format!(
            "/v1/var/dhv-binder/nodes/{}?namespace=default",
            c.nodes[0].id
        ),
        None,
    )
    .await;
    c.start_agent(0);
    c.wait_plugin("bind").await;

    // A secret the volume references, and one outside the agent's secrets path.
    for path in ["dhv-binder-secrets/shared-data", "team-secrets/db"] {
        req(
            &c,
            reqwest::Method::PUT,
            &format!("/v1/var/{path}?namespace=default"),
            Some(json!({"Namespace": "default", "Path": path, "Items": {"password": "pw"}})),
        )
        .await;
    }
    // The policy's token reads the secrets path, and nothing else outside dhv-binder/; it
    // never writes there (Nomad's variables ACL, enforced by the simulator).
    for (method, path, want) in [
        (reqwest::Method::GET, "dhv-binder-secrets/shared-data", 200),
        (reqwest::Method::GET, "team-secrets/db", 403),
        (reqwest::Method::PUT, "dhv-binder-secrets/shared-data", 403),
    ] {
        let r = c
            .http
            .request(
                method.clone(),
                format!("{}/v1/var/{path}?namespace=default", c.server),
            )
            .header("X-Nomad-Token", &secret)
            .json(&json!({"Namespace": "default", "Path": path, "Items": {"password": "x"}}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), want, "{method} {path}");
    }
    // Create: the agent reads the record and the referenced secret, runs the plugin, writes
    // the result back.
    let spec = c.sb.join("v.volume.hcl");
    std::fs::write(
        &spec,
        format!(
            "name = \"shared-data\"\nplugin_id = \"bind\"\ncapability {{\n  access_mode = \"single-node-writer\"\n  attachment_mode = \"file-system\"\n}}\nparameters {{\n  export = \"{}\"\n  uid = \"65534\"\n  gid = \"65534\"\n}}\nsecret_ref \"password\" {{\n  variable = \"dhv-binder-secrets/shared-data\"\n  item = \"password\"\n}}\n",
            c.export.display()
        ),
    )
    .unwrap();
    // Without the operator policy: Nomad's reason, the capability and the policy to use.
    let (code, out) = cli(
        &c,
        &bystander,
        &["volume", "create", spec.to_str().unwrap()],
    );
    assert_ne!(code, 0, "{out}");
    for says in [
        "Permission denied",
        "dhv-binder/volumes/*",
        "jobspecs/operator-policy.hcl",
    ] {
        assert!(out.contains(says), "{says:?} missing from the 403: {out}");
    }
    let (code, out) = cli(&c, &operator, &["volume", "create", spec.to_str().unwrap()]);
    assert!(!out.contains("change marker"), "{out}");
    assert_eq!(
        code,
        0,
        "{out}\n{}",
        std::fs::read_to_string(&c.nodes[0].log).unwrap_or_default()
    );
    assert!(out.contains("is ready"), "{out}");
    // Its placeholder is registered (host-volume-register, -read).
    c.wait_for(30, "the placeholder", || async {
        let vols = req(
            &c,
            reqwest::Method::GET,
            "/v1/volumes?type=host&namespace=*",
            None,
        )
        .await;
        vols.as_array()
            .unwrap()
            .iter()
            .any(|v| v["Name"] == "shared-data" && v["State"] == "ready")
            .then_some(())
    })
    .await;
    // A job using it: the agent sees its allocation (the node's list, filtered by read-job),
    // reads it, publishes for its prestart task; after the stop, unpublishes.
    let hcl = std::fs::read_to_string(repo().join("jobspecs/example.nomad.hcl")).unwrap();
    let job = req(
        &c,
        reqwest::Method::POST,
        "/v1/jobs/parse",
        Some(json!({"JobHCL": hcl, "Canonicalize": true})),
    )
    .await;
    let job_id = job["ID"].as_str().unwrap().to_string();
    req(
        &c,
        reqwest::Method::PUT,
        "/v1/jobs",
        Some(json!({"Job": job})),
    )
    .await;
    c.wait_for(60, "the example job's main task running", || async {
        let allocs = req(
            &c,
            reqwest::Method::GET,
            &format!("/v1/job/{job_id}/allocations"),
            None,
        )
        .await;
        allocs.as_array().and_then(|a| {
            a.iter()
                .find(|a| {
                    a["TaskStates"]["app"]["State"] == "running"
                        && a["TaskStates"]["publish-volumes"]["Failed"] == false
                })
                .cloned()
        })
    })
    .await;
    req(
        &c,
        reqwest::Method::DELETE,
        &format!("/v1/job/{job_id}?purge=false"),
        None,
    )
    .await;
    c.wait_for(60, "the unpublish", || async {
        c.journal(0)
            .last()
            .filter(|e| e["event"] == "unpublish-done")
            .map(|_| ())
    })
    .await;
    let (code, out) = cli(&c, &operator, &["volume", "status", "shared-data"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = cli(&c, &operator, &["volume", "snapshot", "list"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = cli(&c, &operator, &["volume", "list"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("shared-data"), "{out}");
    // A signed delete: the agent runs the plugin's delete and destroys the record.
    let (code, out) = cli(&c, &operator, &["volume", "delete", "shared-data"]);
    assert_eq!(code, 0, "{out}");
    let log = std::fs::read_to_string(&c.nodes[0].log).unwrap_or_default();
    assert!(
        !log.to_ascii_lowercase().contains("permission denied"),
        "{log}"
    );
    // The operator's writes and the agent's write-backs updated the change marker (issue
    // 35), which the agent followed: create (pending), take, ready, delete requested, gone.
    let marker = req(
        &c,
        reqwest::Method::GET,
        "/v1/var/dhv-binder/records-changed?namespace=default",
        None,
    )
    .await;
    let seq: u64 = marker["Items"]["seq"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    assert!(seq >= 4, "the change marker: {marker}");
    assert!(!log.contains("change marker"), "{log}");

    // What the policy refuses the daemon's token.
    let client = Client::new(&NomadConfig {
        token: Some(secret.clone()),
        ..NomadConfig::plain(&c.server)
    })
    .unwrap();
    for path in ["dhv-binder/other", "nomad/jobs/x", "app/config"] {
        let v = Variable {
            namespace: "default".into(),
            path: path.into(),
            items: BTreeMap::from([("a".to_string(), "b".to_string())]),
            ..Default::default()
        };
        let r = client.put_variable(&v, None).await;
        assert!(
            matches!(r, Err(NomadError::PermissionDenied { .. })),
            "{path}: {r:?}"
        );
    }
    for path in ["dhv-binder/claims/probe", "dhv-binder/snapshots/probe"] {
        let ok = Variable {
            namespace: "default".into(),
            path: path.into(),
            items: BTreeMap::from([("a".to_string(), "b".to_string())]),
            ..Default::default()
        };
        client.put_variable(&ok, None).await.unwrap();
    }

    // The agent published its node record (namespace default) with the narrowed token.
    let node_records = req(
        &c,
        reqwest::Method::GET,
        "/v1/vars?prefix=dhv-binder/nodes/&namespace=default",
        None,
    )
    .await;
    assert_eq!(
        node_records.as_array().map(Vec::len),
        Some(1),
        "{node_records}"
    );
    // Node records only in namespace default: not in another namespace.
    let elsewhere = Variable {
        namespace: "prod".into(),
        path: "dhv-binder/nodes/probe".into(),
        items: BTreeMap::from([("a".to_string(), "b".to_string())]),
        ..Default::default()
    };
    let r = client.put_variable(&elsewhere, None).await;
    assert!(
        matches!(r, Err(NomadError::PermissionDenied { .. })),
        "a node record outside namespace default: {r:?}"
    );
    // Issue 33 finding 6: nothing in a namespace the daemon does not serve: no allocation
    // read, no volume record, claim or snapshot written, no placeholder registered there.
    req(
        &c,
        reqwest::Method::PUT,
        "/v1/namespace/prod",
        Some(json!({"Name": "prod"})),
    )
    .await;
    for path in [
        "dhv-binder/volumes/planted",
        "dhv-binder/claims/planted",
        "dhv-binder/snapshots/planted",
    ] {
        let v = Variable {
            namespace: "prod".into(),
            path: path.into(),
            items: BTreeMap::from([("a".to_string(), "b".to_string())]),
            ..Default::default()
        };
        let r = client.put_variable(&v, None).await;
        assert!(
            matches!(r, Err(NomadError::PermissionDenied { .. })),
            "{path} in namespace prod, which the daemon does not serve: {r:?}"
        );
    }
    let r = c
        .http
        .get(format!("{}/v1/allocations?namespace=prod", c.server))
        .header("X-Nomad-Token", &secret)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403, "reading prod's allocations");
    let dir = c.sb.join("prod-placeholder");
    std::fs::create_dir_all(&dir).unwrap();
    let r = c
        .http
        .put(format!("{}/v1/volume/host/register", c.server))
        .header("X-Nomad-Token", &secret)
        .json(&json!({"Volume": {"Name": "planted", "Namespace": "prod",
            "NodeID": c.nodes[0].id, "HostPath": dir}}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status().as_u16(),
        403,
        "a placeholder in namespace prod: {}",
        r.text().await.unwrap_or_default()
    );
}

/// Issue 45 #1: with ACLs on, the daemon's documented policy (host-volume-read in the
/// namespaces it serves only) and another team's ordinary host volume on the node (namespace
/// `team-b`, registered by an administrator), the deferred volume still gets its
/// placeholder. Nomad lists every namespace's host volumes to the daemon's token
/// (`nomad/host_volume_endpoint.go` `HostVolume.List` checks the request's namespace `*`)
/// and refuses the foreign one by ID (403); the agent read every listed volume of its node
/// by ID and failed the whole listing on that 403, so no placeholder was ever registered
/// (and the listing was retried at every tick).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_namespaces_host_volume_does_not_stop_the_placeholders() {
    let acl = format!("acl {{\n  enabled = true\n  bootstrap_token = \"{ROOT}\"\n}}\n");
    let mut c = Cluster::start_with(1, &acl, &[("NOMAD_TOKEN", ROOT)]).await;
    let rules = std::fs::read_to_string(repo().join("jobspecs/dhv-binder-policy.hcl")).unwrap();
    req(
        &c,
        reqwest::Method::PUT,
        "/v1/acl/policy/dhv-binder",
        Some(json!({"Name": "dhv-binder", "Rules": rules})),
    )
    .await;
    let tok = req(
        &c,
        reqwest::Method::PUT,
        "/v1/acl/token",
        Some(json!({"Name": "binder", "Type": "client", "Policies": ["dhv-binder"]})),
    )
    .await;
    let secret = tok["SecretID"].as_str().unwrap().to_string();
    // Another team's namespace, with an ordinary host volume on the node.
    req(
        &c,
        reqwest::Method::PUT,
        "/v1/namespace/team-b",
        Some(json!({"Name": "team-b"})),
    )
    .await;
    let dir = c.sb.join("team-b-scratch");
    std::fs::create_dir_all(&dir).unwrap();
    req(
        &c,
        reqwest::Method::PUT,
        "/v1/volume/host/register",
        Some(json!({"Volume": {"Name": "scratch", "Namespace": "team-b",
            "NodeID": c.nodes[0].id, "HostPath": dir}})),
    )
    .await;
    // The agent runs with the policy's token.
    c.kill_agent(0, nix::sys::signal::Signal::SIGKILL);
    c.agent_env.retain(|(k, _)| k != "NOMAD_TOKEN");
    c.agent_env.push(("NOMAD_TOKEN".into(), secret.clone()));
    req(
        &c,
        reqwest::Method::DELETE,
        &format!(
            "/v1/var/dhv-binder/nodes/{}?namespace=default",
            c.nodes[0].id
        ),
        None,
    )
    .await;
    c.start_agent(0);
    c.wait_plugin("bind").await;
    let spec = c.sb.join("v.volume.hcl");
    std::fs::write(
        &spec,
        format!(
            "name = \"shared-data\"\nplugin_id = \"bind\"\ncapability {{\n  access_mode = \"single-node-writer\"\n  attachment_mode = \"file-system\"\n}}\nparameters {{\n  export = \"{}\"\n  uid = \"65534\"\n  gid = \"65534\"\n}}\n",
            c.export.display()
        ),
    )
    .unwrap();
    let (code, out) = cli(&c, ROOT, &["volume", "create", spec.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let vols = req(
            &c,
            reqwest::Method::GET,
            "/v1/volumes?type=host&namespace=*",
            None,
        )
        .await;
        let registered = vols.as_array().unwrap().iter().any(|v| {
            v["Name"] == "shared-data" && v["Namespace"] == "default" && v["State"] == "ready"
        });
        if registered {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no placeholder after 30 s: {vols}\n{}",
            std::fs::read_to_string(&c.nodes[0].log).unwrap_or_default()
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let log = std::fs::read_to_string(&c.nodes[0].log).unwrap_or_default();
    assert!(
        !log.contains("cannot list this node's placeholder host volumes"),
        "{log}"
    );
    // Team-b's volume is left alone.
    let vols = req(
        &c,
        reqwest::Method::GET,
        "/v1/volumes?type=host&namespace=team-b",
        None,
    )
    .await;
    assert_eq!(vols.as_array().map(Vec::len), Some(1), "{vols}");
}
