//! The sim's JSON has the field names and JSON types of Nomad's (synthesised fixtures in
//! testdata/nomad-fixtures and real captures in testdata/nomad-captures), for every endpoint
//! they cover: node allocations, allocation read, allocations list, event frames, host volume
//! read/list, job read, variables, JWKS, workload identity. A schema diff, not a byte compare.

mod common;
use common::{shared, Sim, Stream};
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::Duration;

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Differences between `sim` and the union of `refs` (objects): keys the sim has that no
/// reference has, and keys whose non-null JSON types differ.
fn schema_diff(what: &str, sim: &Value, refs: &[&Value]) -> Vec<String> {
    let mut out = vec![];
    let sim_o = sim
        .as_object()
        .unwrap_or_else(|| panic!("{what}: not an object"));
    let ref_keys: BTreeSet<&String> = refs
        .iter()
        .filter_map(|r| r.as_object())
        .flat_map(|r| r.keys())
        .collect();
    assert!(!ref_keys.is_empty(), "{what}: no reference object");
    for (k, v) in sim_o {
        if !ref_keys.contains(k) {
            out.push(format!("{what}.{k}: not in any reference"));
            continue;
        }
        for r in refs {
            if let Some(rv) = r.get(k) {
                if !v.is_null() && !rv.is_null() && kind(v) != kind(rv) {
                    out.push(format!(
                        "{what}.{k}: sim {} vs reference {}",
                        kind(v),
                        kind(rv)
                    ));
                }
            }
        }
    }
    out
}

/// Keys of every reference that the sim lacks.
fn missing(what: &str, sim: &Value, reference: &Value) -> Vec<String> {
    reference
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| sim.get(k.as_str()).is_none())
        .map(|k| format!("{what}.{k}: missing in sim"))
        .collect()
}

fn first_task_state(a: &Value) -> &Value {
    a["TaskStates"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn allocations_and_events_match_nomad_shapes() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let fx_alloc: Value =
            serde_json::from_str(&shared("nomad-fixtures", "allocation.json")).unwrap();
        let fx_node: Value =
            serde_json::from_str(&shared("nomad-fixtures", "node-allocations.json")).unwrap();
        let cap_node: Value = serde_json::from_str(&shared(
            "nomad-captures",
            "node-allocations-3-allocs-1.0.x.json",
        ))
        .unwrap();
        let cap_frame: Value = serde_json::from_str(&shared(
            "nomad-captures",
            "event-stream-frame-allocupdated-alloc-job-node-1.6.3.json",
        ))
        .unwrap();
        let fx_stream = shared("nomad-fixtures", "event-stream-allocation.ndjson");
        let fx_frames: Vec<Value> = fx_stream
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let fx_events: Vec<&Value> = fx_frames
            .iter()
            .filter_map(|f| f.get("Events"))
            .flat_map(|e| e.as_array().unwrap())
            .collect();
        let cap_alloc_event = cap_frame["Events"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["Topic"] == "Allocation")
            .unwrap();

        let sim = Sim::start("client \"node-1\" {}\n").await;
        let mut stream = Stream::open(&sim, "topic=Allocation").await;
        sim.run_job(
            r#"job "shape" {
  group "g" {
    task "pre" {
      driver = "raw_exec"
      lifecycle { hook = "prestart" }
      config {
        command = "/bin/true"
      }
    }
    task "main" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args = ["1000"]
      }
    }
  }
}"#,
        )
        .await;
        let a = sim
            .wait_for(20, "main running", || async {
                let l = sim.job_allocs("shape").await;
                let a = l.first()?.clone();
                (a["TaskStates"]["main"]["State"] == "running").then_some(a)
            })
            .await;
        let id = a["ID"].as_str().unwrap();
        let full = sim.get(&format!("/v1/allocation/{id}")).await;
        let node_list = sim
            .get(&format!("/v1/node/{}/allocations", sim.node_id("node-1")))
            .await;

        let mut diffs = vec![];
        let refs_alloc = [
            &fx_alloc,
            &fx_node[0],
            &cap_node[0],
            &cap_alloc_event["Payload"]["Allocation"],
        ];
        diffs.extend(schema_diff("Allocation", &full, &refs_alloc));
        diffs.extend(schema_diff("NodeAllocation", &node_list[0], &refs_alloc));
        diffs.extend(schema_diff("Job", &full["Job"], &[&fx_alloc["Job"]]));
        diffs.extend(missing("Job", &full["Job"], &fx_alloc["Job"]));
        let ts = first_task_state(&full);
        diffs.extend(schema_diff(
            "TaskState",
            ts,
            &[first_task_state(&fx_alloc), first_task_state(&cap_node[0])],
        ));
        diffs.extend(missing("TaskState", ts, first_task_state(&fx_alloc)));
        let te = &ts["Events"][0];
        diffs.extend(schema_diff(
            "TaskEvent",
            te,
            &[&first_task_state(&fx_alloc)["Events"][0]],
        ));
        diffs.extend(missing(
            "TaskEvent",
            te,
            &first_task_state(&fx_alloc)["Events"][0],
        ));
        let g = &full["Job"]["TaskGroups"][0];
        diffs.extend(missing("TaskGroup", g, &fx_alloc["Job"]["TaskGroups"][0]));
        diffs.extend(missing(
            "Task",
            &g["Tasks"][0],
            &fx_alloc["Job"]["TaskGroups"][0]["Tasks"][0],
        ));
        // Every top-level key Nomad always sets for a placed, running alloc.
        for k in [
            "ID",
            "Namespace",
            "EvalID",
            "Name",
            "NodeID",
            "NodeName",
            "JobID",
            "Job",
            "TaskGroup",
            "AllocatedResources",
            "Metrics",
            "DesiredStatus",
            "ClientStatus",
            "ClientDescription",
            "TaskStates",
            "CreateIndex",
            "ModifyIndex",
            "AllocModifyIndex",
            "CreateTime",
            "ModifyTime",
            "Resources",
            "NetworkStatus",
            "SigningKeyID",
        ] {
            if full.get(k).is_none() {
                diffs.push(format!("Allocation.{k}: missing in sim"));
            }
        }
        // Zero times are null; floats keep a decimal point.
        assert!(ts.get("LastRestart").unwrap().is_null());
        let raw = serde_json::to_string(&full["Metrics"]).unwrap();
        assert!(raw.contains("\"job-anti-affinity\":0.0"), "{raw}");

        // Events: frame and event keys, alloc payload without Job.
        while let Some(f) = stream.frame(3).await {
            let frame_keys: Vec<&String> = f.as_object().unwrap().keys().collect();
            assert_eq!(frame_keys, ["Index", "Events"]);
            for ev in f["Events"].as_array().unwrap() {
                let refs: Vec<&Value> =
                    fx_events.iter().copied().chain([cap_alloc_event]).collect();
                diffs.extend(schema_diff("Event", ev, &refs));
                diffs.extend(missing("Event", ev, fx_events[0]));
                let p = &ev["Payload"]["Allocation"];
                let prefs: Vec<&Value> = fx_events
                    .iter()
                    .map(|e| &e["Payload"]["Allocation"])
                    .chain([&cap_alloc_event["Payload"]["Allocation"]])
                    .collect();
                diffs.extend(schema_diff("EventAllocation", p, &prefs));
                assert!(p.get("Job").is_none());
            }
            if f["Events"][0]["Payload"]["Allocation"]["TaskStates"]["main"]["State"] == "running" {
                break;
            }
        }
        assert!(
            diffs.is_empty(),
            "schema differences:\n{}",
            diffs.join("\n")
        );
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread")]
async fn host_volume_variable_and_jwks_shapes() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let fx_hv: Value =
            serde_json::from_str(&shared("nomad-fixtures", "host-volume.json")).unwrap();
        let fx_list: Value =
            serde_json::from_str(&shared("nomad-fixtures", "host-volumes-list.json")).unwrap();
        let fx_var: Value =
            serde_json::from_str(&shared("nomad-fixtures", "variable.json")).unwrap();
        let fx_jwks: Value = serde_json::from_str(&shared("nomad-fixtures", "jwks.json")).unwrap();
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let dir = sim.path().join("v");
        std::fs::create_dir_all(&dir).unwrap();
        let r = sim
            .put(
                "/v1/volume/host/register",
                serde_json::json!({"Volume": {"Name": "x", "NodeID": sim.node_id("node-1"),
            "HostPath": dir, "Parameters": {"a": "b"}}}),
            )
            .await;
        let id = r["Volume"]["ID"].as_str().unwrap();
        let v = sim.get(&format!("/v1/volume/host/{id}")).await;
        let mut diffs = schema_diff("HostVolume", &v, &[&fx_hv]);
        let mut fx_no_allocs = fx_hv.clone();
        fx_no_allocs.as_object_mut().unwrap().remove("Allocations");
        diffs.extend(missing("HostVolume", &v, &fx_no_allocs));
        let l = sim.get("/v1/volumes?type=host").await;
        diffs.extend(schema_diff("HostVolumeStub", &l[0], &[&fx_list[0]]));
        diffs.extend(missing("HostVolumeStub", &l[0], &fx_list[0]));
        let var = sim
            .put(
                "/v1/var/p/q?cas=0",
                serde_json::json!({"Items": {"k": "v"}}),
            )
            .await;
        diffs.extend(schema_diff(
            "Variable",
            &var,
            &[&fx_var["response"]["body"]],
        ));
        diffs.extend(missing("Variable", &var, &fx_var["response"]["body"]));
        let jwks = sim.get("/.well-known/jwks.json").await;
        diffs.extend(schema_diff("JWK", &jwks["keys"][0], &[&fx_jwks["keys"][0]]));
        diffs.extend(missing("JWK", &jwks["keys"][0], &fx_jwks["keys"][0]));
        assert!(
            diffs.is_empty(),
            "schema differences:\n{}",
            diffs.join("\n")
        );
    })
    .await
    .expect("test timed out");
}

/// Payload of the first event of `topic` in a capture frame.
fn capture_payload<'a>(frame: &'a Value, topic: &str, key: &str) -> &'a Value {
    &frame["Events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["Topic"] == topic)
        .unwrap_or_else(|| panic!("no {topic} event in capture"))["Payload"][key]
}

fn jwt_part(token: &str, i: usize) -> Value {
    use base64::Engine;
    let part = token.split('.').nth(i).unwrap();
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(part)
        .unwrap();
    serde_json::from_slice(&raw).unwrap()
}

/// The remaining endpoints the captures cover: job read, allocations list, Job/Node/Evaluation
/// event payloads, host volume read against the 1.10 docs sample, workload identity header and
/// claims. (The Deployment capture: `deployment_matches_the_capture`.)
#[tokio::test(flavor = "multi_thread")]
async fn job_list_events_volume_and_identity_match_captures() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let load = |d: &str, f: &str| -> Value { serde_json::from_str(&shared(d, f)).unwrap() };
        let cap_job = load("nomad-captures", "job-read-service-group-services-1.6.json");
        let cap_list = load(
            "nomad-captures",
            "allocations-list-docs-sample-1.2.0-dev.json",
        );
        let cap_frame = load(
            "nomad-captures",
            "event-stream-frame-allocupdated-alloc-job-node-1.6.3.json",
        );
        let cap_eval = load(
            "nomad-captures",
            "event-stream-frame-evaluation-jobregistered-1.6.3.json",
        );
        let cap_hv = load(
            "nomad-captures",
            "host-volume-read-docs-sample-1.10.0-dev.json",
        );
        let cap_wi = load(
            "nomad-captures",
            "workload-identity-jwt-default-1.6.3-eddsa.json",
        );
        let fx_alloc = load("nomad-fixtures", "allocation.json");
        let fx_wi = load("nomad-fixtures", "workload-identity.json");
        let sidecar: Vec<Value> = shared(
            "nomad-captures",
            "event-stream-frame-allocupdated-complete-connect-sidecar-1.2.ndjson",
        )
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();

        let sim = Sim::start("client \"node-1\" {}\n").await;
        let mut stream = Stream::open(
            &sim,
            "topic=Job&topic=Node&topic=Evaluation&topic=Allocation",
        )
        .await;
        let dir = sim.path().join("v");
        std::fs::create_dir_all(&dir).unwrap();
        let r = sim
            .put(
                "/v1/volume/host/register",
                serde_json::json!({"Volume": {"Name": "hv", "NodeID": sim.node_id("node-1"),
                    "HostPath": dir, "Parameters": {"a": "b"}}}),
            )
            .await;
        let vol_id = r["Volume"]["ID"].as_str().unwrap().to_string();
        sim.run_job(
            r#"job "caps" {
  group "g" {
    volume "data" {
      type = "host"
      source = "hv"
    }
    task "t" {
      driver = "raw_exec"
      identity {
        env = true
        file = true
      }
      config {
        command = "/bin/sh"
        args = ["-c", "printf %s \"$NOMAD_TOKEN\" > $NOMAD_ALLOC_DIR/token; exec sleep 1000"]
      }
    }
  }
}"#,
        )
        .await;
        let a = sim
            .wait_for(20, "task running", || async {
                let a = sim.job_allocs("caps").await.first()?.clone();
                (a["TaskStates"]["t"]["State"] == "running").then_some(a)
            })
            .await;
        let mut diffs = vec![];

        let job = sim.get("/v1/job/caps").await;
        diffs.extend(schema_diff("Job", &job, &[&cap_job, &fx_alloc["Job"]]));
        diffs.extend(schema_diff(
            "TaskGroup",
            &job["TaskGroups"][0],
            &[&cap_job["TaskGroups"][0], &fx_alloc["Job"]["TaskGroups"][0]],
        ));
        diffs.extend(schema_diff(
            "Task",
            &job["TaskGroups"][0]["Tasks"][0],
            &[
                &cap_job["TaskGroups"][0]["Tasks"][0],
                &fx_alloc["Job"]["TaskGroups"][0]["Tasks"][0],
            ],
        ));
        for k in [
            "ID",
            "Name",
            "Namespace",
            "Type",
            "Status",
            "TaskGroups",
            "Version",
            "Stop",
        ] {
            if job.get(k).is_none() {
                diffs.push(format!("Job.{k}: missing in sim"));
            }
        }

        let list = sim.get("/v1/allocations").await;
        // NextAllocation is in `AllocListStub` (nomad/structs/alloc.go) but not in the 1.2 sample.
        let mut stub_ref = cap_list[0].clone();
        stub_ref["NextAllocation"] = Value::String(String::new());
        diffs.extend(schema_diff("AllocListStub", &list[0], &[&stub_ref]));
        let with_res = sim.get("/v1/allocations?resources=true").await;
        assert!(
            with_res[0]["AllocatedResources"].is_object(),
            "resources=true"
        );
        assert!(
            list[0].get("AllocatedResources").is_none(),
            "omitempty without resources=true"
        );
        let mut cap_stub = cap_list[0].clone();
        // Set only when a deployment/reschedule/preemption happened (omitempty-like in practice).
        for k in [
            "DeploymentStatus",
            "FollowupEvalID",
            "PreemptedByAllocation",
        ] {
            cap_stub.as_object_mut().unwrap().remove(k);
        }
        diffs.extend(missing("AllocListStub", &list[0], &cap_stub));
        assert!(list[0].get("Job").is_none(), "stubs carry no Job");

        // Event payloads of other topics.
        let mut seen = BTreeSet::new();
        while let Some(f) = stream.frame(2).await {
            for ev in f["Events"].as_array().unwrap() {
                let topic = ev["Topic"].as_str().unwrap().to_string();
                match topic.as_str() {
                    "Job" => diffs.extend(schema_diff(
                        "JobEvent.Job",
                        &ev["Payload"]["Job"],
                        &[capture_payload(&cap_frame, "Job", "Job"), &fx_alloc["Job"]],
                    )),
                    "Node" => diffs.extend(schema_diff(
                        "NodeEvent.Node",
                        &ev["Payload"]["Node"],
                        &[capture_payload(&cap_frame, "Node", "Node")],
                    )),
                    "Evaluation" => {
                        let p = &ev["Payload"]["Evaluation"];
                        let r = capture_payload(&cap_eval, "Evaluation", "Evaluation");
                        diffs.extend(schema_diff("EvaluationEvent.Evaluation", p, &[r]));
                        diffs.extend(missing("EvaluationEvent.Evaluation", p, r));
                    }
                    "Allocation" => {
                        let refs: Vec<&Value> = sidecar
                            .iter()
                            .flat_map(|f| f["Events"].as_array().unwrap())
                            .map(|e| &e["Payload"]["Allocation"])
                            .chain([capture_payload(&cap_frame, "Allocation", "Allocation")])
                            // An event's Allocation is the read's (`DeploymentID` is omitted
                            // in the captured frames: their jobs had no deployment).
                            .chain([&fx_alloc])
                            .collect();
                        diffs.extend(schema_diff(
                            "AllocationEvent.Allocation",
                            &ev["Payload"]["Allocation"],
                            &refs,
                        ));
                    }
                    _ => {}
                }
                seen.insert(topic);
            }
        }
        for t in ["Job", "Node", "Evaluation", "Allocation"] {
            assert!(seen.contains(t), "no {t} event seen: {seen:?}");
        }

        // Host volume read (with the alloc that uses it) against the 1.10 docs sample.
        let hv = sim.get(&format!("/v1/volume/host/{vol_id}")).await;
        diffs.extend(schema_diff("HostVolume", &hv, &[&cap_hv]));
        diffs.extend(missing("HostVolume", &hv, &cap_hv));
        assert_eq!(hv["Allocations"][0]["ID"], a["ID"], "{hv:#}");
        diffs.extend(schema_diff(
            "HostVolume.Allocations[0]",
            &hv["Allocations"][0],
            &[&cap_hv["Allocations"][0], &stub_ref],
        ));

        // Workload identity: header fields, claim names and types (RS256 here, EdDSA in 1.6).
        let alloc_dir = sim.nodes[0].3.join("alloc").join(a["ID"].as_str().unwrap());
        let token = sim
            .wait_for(10, "token written", || async {
                std::fs::read_to_string(alloc_dir.join("alloc/token"))
                    .ok()
                    .filter(|t| !t.is_empty())
            })
            .await;
        let header = jwt_part(&token, 0);
        let claims = jwt_part(&token, 1);
        diffs.extend(schema_diff(
            "JWTHeader",
            &header,
            &[
                &cap_wi["header_decoded"],
                &fx_wi["default_identity"]["header"],
            ],
        ));
        diffs.extend(missing("JWTHeader", &header, &cap_wi["header_decoded"]));
        diffs.extend(schema_diff(
            "JWTClaims",
            &claims,
            &[
                &cap_wi["claims_decoded"],
                &fx_wi["default_identity"]["claims"],
            ],
        ));
        diffs.extend(missing("JWTClaims", &claims, &cap_wi["claims_decoded"]));
        diffs.extend(missing(
            "JWTClaims",
            &claims,
            &fx_wi["default_identity"]["claims"],
        ));
        assert_eq!(header["alg"], "RS256");
        assert!(claims.get("exp").is_none(), "default identity has no exp");

        assert!(
            diffs.is_empty(),
            "schema differences:\n{}",
            diffs.join("\n")
        );
    })
    .await
    .expect("test timed out");
}

/// A deployment (`GET /v1/job/:id/deployment`) has the fields and JSON types of the captured
/// Deployment event's payload, group state included.
#[tokio::test(flavor = "multi_thread")]
async fn deployment_matches_the_capture() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let cap: Value = serde_json::from_str(&shared(
            "nomad-captures",
            "event-deployment-planresult-via-vector-1.2.json",
        ))
        .unwrap();
        let cap_d = &cap["Payload"]["Deployment"];
        let sim = Sim::start("client \"node-1\" {}\n").await;
        sim.run_job(
            r#"job "example" {
  group "cache" {
    update {
      min_healthy_time = "1s"
    }
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args = ["1000"]
      }
    }
  }
}"#,
        )
        .await;
        let d = sim
            .wait_for(30, "a successful deployment", || async {
                let d = sim.get("/v1/job/example/deployment").await;
                (d["Status"] == "successful").then_some(d)
            })
            .await;
        // Fields newer than the 1.2 capture, in `structs.Deployment` at aa026cc
        // (nomad/structs/deployment.go): allowed beyond it, numbers as Nomad has them.
        let newer = ["EvalPriority", "CreateTime", "ModifyTime"];
        for k in newer {
            assert!(d[k].is_number(), "{k}: {d}");
        }
        let mut diff: Vec<String> = schema_diff("Deployment", &d, &[cap_d])
            .into_iter()
            .filter(|x| {
                !newer
                    .iter()
                    .any(|k| x.starts_with(&format!("Deployment.{k}:")))
            })
            .collect();
        diff.extend(missing("Deployment", &d, cap_d));
        let g = &d["TaskGroups"]["cache"];
        let cap_g = &cap_d["TaskGroups"]["cache"];
        diff.extend(schema_diff("DeploymentState", g, &[cap_g]));
        diff.extend(missing("DeploymentState", g, cap_g));
        assert!(diff.is_empty(), "{diff:#?}\n{d:#}");
        assert_eq!(d["StatusDescription"], cap_d["StatusDescription"]);
        assert_eq!(g["PlacedCanaries"], Value::Null);
        assert!(g["RequireProgressBy"].is_string(), "{g}");
    })
    .await
    .expect("test timed out");
}

/// `GET /.well-known/openid-configuration`: 404 "OIDC Discovery endpoint disabled" without
/// `server { oidc_issuer }`, the discovery document naming it with one
/// (`command/agent/keyring_endpoint.go` `OIDCDiscoveryRequest`).
#[tokio::test]
async fn oidc_discovery_is_off_without_an_issuer_and_names_it_with_one() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let (status, _, body) = sim
            .req(
                reqwest::Method::GET,
                "/.well-known/openid-configuration",
                None,
            )
            .await;
        assert_eq!(
            (status, body.trim()),
            (404, "OIDC Discovery endpoint disabled")
        );
        let sim = Sim::start(
            "server {\n  oidc_issuer = \"https://nomad.example:4646\"\n}\nclient \"node-1\" {}\n",
        )
        .await;
        let doc = sim.get("/.well-known/openid-configuration").await;
        assert_eq!(doc["issuer"], "https://nomad.example:4646");
        assert_eq!(
            doc["jwks_uri"],
            "https://nomad.example:4646/.well-known/jwks.json"
        );
    })
    .await
    .unwrap();
}
