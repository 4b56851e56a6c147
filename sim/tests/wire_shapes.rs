//! The sim's JSON has the field names and JSON types of Nomad's (synthesised fixtures in
//! ../shared/nomad-fixtures and real captures in ../shared/nomad-captures). A schema diff, not a
//! byte compare.

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
        .flat_map(|r| r.as_object().unwrap().keys())
        .collect();
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
