//! Blocking queries, variables CAS, host volume register and scheduler feasibility.

mod common;
use common::Sim;
use reqwest::Method;
use serde_json::json;
use std::time::{Duration, Instant};

const TWO_NODES: &str = "client \"node-1\" {}\nclient \"node-2\" {}\n";

fn sleeper(name: &str, extra_group: &str, ns: &str) -> String {
    format!(
        r#"job "{name}" {{
  namespace = "{ns}"
  group "g" {{
    {extra_group}
    task "t" {{
      driver = "raw_exec"
      kill_timeout = "1s"
      config {{
        command = "/bin/sleep"
        args = ["1000"]
      }}
    }}
  }}
}}"#
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn node_allocations_blocking_query_wakes_on_change() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start(TWO_NODES).await;
        let n1 = sim.node_id("node-1");
        let (s, idx, body) = sim
            .req(Method::GET, &format!("/v1/node/{n1}/allocations"), None)
            .await;
        assert_eq!(s, 200);
        assert_eq!(body, "[]");
        // Times out after `wait` with the same index.
        let t = Instant::now();
        let (_, idx2, _) = sim
            .req(
                Method::GET,
                &format!("/v1/node/{n1}/allocations?index={idx}&wait=1s"),
                None,
            )
            .await;
        assert!(t.elapsed() >= Duration::from_millis(900));
        assert_eq!(idx2, idx);
        // Wakes when an alloc is placed.
        let blocked = {
            let (http, url) = (
                sim.http.clone(),
                format!(
                    "{}/v1/node/{n1}/allocations?index={idx}&wait=30s",
                    sim.server
                ),
            );
            tokio::spawn(async move {
                let t = Instant::now();
                let r = http.get(url).send().await.unwrap();
                let i: u64 = r.headers()["x-nomad-index"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                (t.elapsed(), i, r.json::<serde_json::Value>().await.unwrap())
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        // count=2 spreads across both nodes, so node-1 gets one.
        sim.run_job(&sleeper("blk", "count = 2", "default")).await;
        let (elapsed, new_idx, allocs) = blocked.await.unwrap();
        assert!(elapsed < Duration::from_secs(10));
        assert!(new_idx > idx);
        let a = &allocs.as_array().unwrap()[0];
        assert!(
            a.get("Job").is_some(),
            "node allocations are full allocs with Job"
        );
        assert_eq!(a["NodeID"], n1);
        // Index already behind → immediate return.
        let t = Instant::now();
        sim.req(
            Method::GET,
            &format!("/v1/node/{n1}/allocations?index=1&wait=30s"),
            None,
        )
        .await;
        assert!(t.elapsed() < Duration::from_secs(2));
        // `Node.GetAllocs` has no existence check: an unknown node has no allocations.
        let (s, _, b) = sim
            .req(Method::GET, "/v1/node/nope/allocations", None)
            .await;
        assert_eq!((s, b.as_str()), (200, "[]"));
        let (s, _, b) = sim.req(Method::GET, "/v1/allocation/nope-nope", None).await;
        assert_eq!((s, b.as_str()), (404, "alloc not found"));
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread")]
async fn variables_cas() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start(TWO_NODES).await;
        let body = json!({"Items": {"node_id": "n1"}});
        let (s, idx, b) = sim
            .req(
                Method::PUT,
                "/v1/var/dhv-binder/claims/x?cas=0",
                Some(body.clone()),
            )
            .await;
        assert_eq!(s, 200, "{b}");
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["ModifyIndex"].as_u64().unwrap(), idx);
        assert_eq!(v["Items"]["node_id"], "n1");
        assert_eq!(v["Namespace"], "default");
        // cas=0 again → 409 with the current variable.
        let (s, cidx, b) = sim
            .req(
                Method::PUT,
                "/v1/var/dhv-binder/claims/x?cas=0",
                Some(body.clone()),
            )
            .await;
        assert_eq!(s, 409);
        let cur: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert_eq!(cur["ModifyIndex"].as_u64().unwrap(), idx);
        assert_eq!(cidx, idx);
        // Correct cas → 200; stale cas → 409.
        let (s, idx2, _) = sim
            .req(
                Method::PUT,
                &format!("/v1/var/dhv-binder/claims/x?cas={idx}"),
                Some(json!({"Items": {"node_id": "n2"}})),
            )
            .await;
        assert_eq!(s, 200);
        let (s, _, _) = sim
            .req(
                Method::PUT,
                &format!("/v1/var/dhv-binder/claims/x?cas={idx}"),
                Some(body.clone()),
            )
            .await;
        assert_eq!(s, 409);
        // Items required; path validated.
        let (s, _, b) = sim
            .req(
                Method::PUT,
                "/v1/var/dhv-binder/empty",
                Some(json!({"Items": {}})),
            )
            .await;
        assert_eq!(
            (s, b.as_str()),
            (400, "variable missing required Items object")
        );
        let (s, _, _) = sim
            .req(Method::PUT, "/v1/var/bad%20path", Some(body.clone()))
            .await;
        assert_eq!(s, 400);
        // List is metadata only.
        let list = sim.get("/v1/vars?prefix=dhv-binder/").await;
        assert_eq!(list.as_array().unwrap().len(), 1);
        assert!(list[0].get("Items").is_none());
        let all = sim.get("/v1/vars?namespace=*").await;
        assert_eq!(all.as_array().unwrap().len(), 1);
        // Delete with stale cas → 409, right cas → gone.
        let (s, _, _) = sim
            .req(
                Method::DELETE,
                &format!("/v1/var/dhv-binder/claims/x?cas={idx}"),
                None,
            )
            .await;
        assert_eq!(s, 409);
        let (s, _, _) = sim
            .req(
                Method::DELETE,
                &format!("/v1/var/dhv-binder/claims/x?cas={idx2}"),
                None,
            )
            .await;
        assert_eq!(s, 200);
        let (s, _, b) = sim
            .req(Method::GET, "/v1/var/dhv-binder/claims/x", None)
            .await;
        assert_eq!((s, b.as_str()), (404, "variable not found"));
        // Blocking list wakes on a write.
        let (_, li, _) = sim.req(Method::GET, "/v1/vars", None).await;
        let h = {
            let (http, url) = (
                sim.http.clone(),
                format!("{}/v1/vars?index={li}&wait=20s", sim.server),
            );
            tokio::spawn(async move {
                http.get(url)
                    .send()
                    .await
                    .unwrap()
                    .json::<serde_json::Value>()
                    .await
                    .unwrap()
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        sim.put("/v1/var/later", json!({"Items": {"a": "b"}})).await;
        let l = tokio::time::timeout(Duration::from_secs(5), h)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(l[0]["Path"], "later");
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread")]
async fn host_volume_register_and_feasibility() {
    tokio::time::timeout(Duration::from_secs(90), async {
        let sim = Sim::start(TWO_NODES).await;
        let n2 = sim.node_id("node-2");
        let path = sim.path().join("vol-a");
        std::fs::create_dir_all(&path).unwrap();
        // Missing path is refused by the client.
        let (s, _, _) = sim
            .req(Method::PUT, "/v1/volume/host/register", Some(json!({"Volume": {"Name": "data", "NodeID": n2, "HostPath": "/nonexistent/x"}})))
            .await;
        assert_eq!(s, 400);
        let r = sim
            .put("/v1/volume/host/register", json!({"Volume": {"Namespace": "default", "Name": "data", "NodeID": n2,
                "HostPath": path, "RequestedCapabilities": [{"AccessMode": "single-node-writer", "AttachmentMode": "file-system"}]}}))
            .await;
        let id = r["Volume"]["ID"].as_str().unwrap().to_string();
        assert_eq!(r["Warnings"], "");
        let v = sim
            .wait_for(5, "volume ready", || async {
                let v = sim.get(&format!("/v1/volume/host/{id}")).await;
                (v["State"] == "ready").then_some(v)
            })
            .await;
        assert_eq!(v["NodeID"], n2);
        let node = sim.get(&format!("/v1/node/{n2}")).await;
        assert_eq!(node["HostVolumes"]["data"]["ID"], id.as_str());
        // A second ID with the same name on that node is rejected.
        let (s, _, b) = sim
            .req(Method::PUT, "/v1/volume/host/register", Some(json!({"Volume": {"Name": "data", "NodeID": n2, "HostPath": path}})))
            .await;
        assert_eq!(s, 400);
        assert!(b.contains("volume name already exists on this node"), "{b}");
        let list = sim.get("/v1/volumes?type=host").await;
        assert_eq!(list.as_array().unwrap().len(), 1);
        assert_eq!(sim.get("/v1/volumes").await, json!([]));
        assert_eq!(sim.get(&format!("/v1/volumes?type=host&node_id={}", sim.node_id("node-1"))).await, json!([]));

        // Feasible only on node-2.
        let vol = r#"volume "d" {
      type = "host"
      source = "data"
      access_mode = "single-node-writer"
      attachment_mode = "file-system"
    }
    count = 2"#;
        sim.run_job(&sleeper("ok", vol, "default")).await;
        let allocs = sim.wait_for(5, "placement", || async {
            let a = sim.job_allocs("ok").await;
            (a.len() == 2).then_some(a)
        }).await;
        // Both land on node-2 (single-node-writer allows several allocs on the one node).
        for a in &allocs {
            assert_eq!(a["NodeID"], n2);
        }
        // The volume read lists the alloc; delete is refused while in use.
        let v = sim.get(&format!("/v1/volume/host/{id}")).await;
        assert_eq!(v["Allocations"].as_array().unwrap().len(), 2);
        // `HostVolume.Delete` returns plain errors: 500, in use or missing (issue 11 #7).
        let (s, _, b) = sim.req(Method::DELETE, &format!("/v1/volume/host/{id}"), None).await;
        assert_eq!(s, 500, "{b}");
        assert!(b.contains("in use by allocations"), "{b}");
        let (s, _, b) = sim
            .req(Method::DELETE, "/v1/volume/host/00000000-0000-0000-0000-000000000000", None)
            .await;
        assert_eq!((s, b.as_str()), (500, "no such volume: 00000000-0000-0000-0000-000000000000"));

        // Wrong namespace → not placed; wrong access mode → not placed.
        sim.put("/v1/namespace/other", json!({"Name": "other"})).await;
        sim.run_job(&sleeper("other-ns", vol, "other")).await;
        let ro = r#"volume "d" {
      type = "host"
      source = "data"
      read_only = true
      access_mode = "single-node-reader-only"
    }"#;
        sim.run_job(&sleeper("wrong-mode", ro, "default")).await;
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(sim.get("/v1/job/other-ns/allocations?namespace=other").await.as_array().unwrap().is_empty());
        assert!(sim.job_allocs("wrong-mode").await.is_empty());

        // A blocked placement is retried when a matching volume appears (on node-1).
        let vol2 = r#"volume "d" {
      type = "host"
      source = "data2"
    }"#;
        sim.run_job(&sleeper("later", vol2, "default")).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(sim.job_allocs("later").await.is_empty());
        let path_b = sim.path().join("vol-b");
        std::fs::create_dir_all(&path_b).unwrap();
        sim.put("/v1/volume/host/register", json!({"Volume": {"Name": "data2", "NodeID": sim.node_id("node-1"), "HostPath": path_b}})).await;
        let a = sim.wait_for(5, "blocked alloc placed on node-1", || async {
            let a = sim.job_allocs("later").await;
            (a.len() == 1).then_some(a)
        }).await;
        assert_eq!(a[0]["NodeID"], sim.node_id("node-1"));
    })
    .await
    .expect("test timed out");
}

/// Namespaces are not created on demand: a job (`upsertJobImpl`, nomad/state/state_store.go)
/// or a host volume (`validateVolumeUpdate`, nomad/host_volume_endpoint.go) in a missing
/// namespace is refused with an uncoded error (500); a variable is written without creating
/// it. `PUT /v1/namespace/:name` creates one (management only; name checked as
/// `Namespace.Validate` does).
#[tokio::test(flavor = "multi_thread")]
async fn namespaces_are_not_created_on_demand() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start(TWO_NODES).await;
        let job = |ns: &str| {
            json!({"Job": {"ID": "j", "Namespace": ns, "TaskGroups": [{"Name": "g",
                "Tasks": [{"Name": "t", "Driver": "raw_exec", "Config": {"command": "/bin/true"}}]}]}})
        };
        let (s, _, b) = sim.req(Method::PUT, "/v1/jobs", Some(job("team-a"))).await;
        assert_eq!(s, 500, "{b}");
        assert_eq!(b, "job \"j\" is in nonexistent namespace \"team-a\"");
        let path = sim.path().join("vol-ns");
        std::fs::create_dir_all(&path).unwrap();
        let vol = json!({"Volume": {"Namespace": "team-a", "Name": "data",
            "NodeID": sim.node_id("node-1"), "HostPath": path}});
        let (s, _, b) = sim
            .req(Method::PUT, "/v1/volume/host/register", Some(vol.clone()))
            .await;
        assert_eq!(s, 500, "{b}");
        assert_eq!(b, "volume validation failed: no such namespace \"team-a\"");
        sim.put(
            "/v1/var/x?namespace=team-a",
            json!({"Items": {"k": "v"}}),
        )
        .await;
        let (s, _, b) = sim.req(Method::GET, "/v1/namespace/team-a", None).await;
        assert_eq!((s, b.as_str()), (404, "Namespace not found"));
        let (s, _, b) = sim
            .req(Method::PUT, "/v1/namespace/team-a", Some(json!({"Name": "team-b"})))
            .await;
        assert_eq!((s, b.as_str()), (400, "Namespace name does not match request path"));
        let (s, _, _) = sim
            .req(Method::PUT, "/v1/namespace/bad_name", Some(json!({"Name": "bad_name"})))
            .await;
        assert_eq!(s, 500);
        sim.put("/v1/namespace/team-a", json!({"Name": "team-a"})).await;
        sim.get("/v1/namespace/team-a").await;
        let (s, _, b) = sim.req(Method::PUT, "/v1/jobs", Some(job("team-a"))).await;
        assert_eq!(s, 200, "{b}");
        let (s, _, b) = sim
            .req(Method::PUT, "/v1/volume/host/register", Some(vol))
            .await;
        assert_eq!(s, 200, "{b}");
    })
    .await
    .expect("test timed out");
}

/// A blocking variables list wakes on the variables table index, which every variable write
/// raises, whatever its path or namespace (`nomad/variables_endpoint.go` `Variables.List`
/// watches the `variables` table; docs/simulator.md). A prefix-filtered list thus answers an
/// unrelated write with the same records at a higher index. The counting front
/// (`GET /v1/sim/counters`) counts each list and its bytes.
#[tokio::test(flavor = "multi_thread")]
async fn a_prefix_list_wakes_on_any_variable_write_and_is_counted() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("").await;
        sim.put("/v1/var/dhv-binder/volumes/a", json!({"Items": {"k": "v"}}))
            .await;
        let (_, li, first) = sim
            .req(
                Method::GET,
                "/v1/vars?prefix=dhv-binder/volumes/&namespace=*",
                None,
            )
            .await;
        let (s, _, _) = sim.req(Method::PUT, "/v1/sim/counters/reset", None).await;
        assert_eq!(s, 200);
        let h = {
            let (http, url) = (
                sim.http.clone(),
                format!(
                    "{}/v1/vars?prefix=dhv-binder/volumes/&namespace=*&index={li}&wait=20s",
                    sim.server
                ),
            );
            tokio::spawn(async move {
                let r = http.get(url).send().await.unwrap();
                let idx: u64 = r.headers()["x-nomad-index"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                (idx, r.text().await.unwrap())
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Unrelated: another application's variable, in another path.
        sim.put("/v1/var/other-app/config", json!({"Items": {"x": "1"}}))
            .await;
        let (idx, body) = tokio::time::timeout(Duration::from_secs(5), h)
            .await
            .expect("the list woke on an unrelated write")
            .unwrap();
        assert!(idx > li, "the table index rose: {idx} > {li}");
        assert_eq!(body, first, "same records, only the index moved");
        let c = sim.get("/v1/sim/counters").await;
        assert_eq!(c["GET /v1/vars"]["requests"], 1, "{c}");
        assert_eq!(c["GET /v1/vars"]["bytes"], body.len() as u64, "{c}");
        assert_eq!(c["PUT /v1/var/*path"]["requests"], 1, "{c}");
    })
    .await
    .expect("test timed out");
}

/// A blocking read of one variable (`GET /v1/var/<path>?index=N`) wakes only when that
/// variable changes (`nomad/variables_endpoint.go` `Variables.Read`: the answer's index is the
/// variable's ModifyIndex, and `blockingRPC` re-runs the query until it passes `index`), not on
/// other variable writes; a missing variable answers 404 with the variables table index, so
/// its blocking read wakes on any write (the change marker, docs/records.md).
#[tokio::test(flavor = "multi_thread")]
async fn a_blocking_single_variable_read_wakes_only_when_that_variable_changes() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("").await;
        sim.put("/v1/var/marker", json!({"Items": {"seq": "1"}}))
            .await;
        let (s, mi, _) = sim.req(Method::GET, "/v1/var/marker", None).await;
        assert_eq!(s, 200);
        let read = |path: &str, index: u64| {
            let (http, url) = (
                sim.http.clone(),
                format!("{}/v1/var/{path}?index={index}&wait=20s", sim.server),
            );
            tokio::spawn(async move {
                let r = http.get(url).send().await.unwrap();
                let idx: u64 = r.headers()["x-nomad-index"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                (r.status().as_u16(), idx)
            })
        };
        let mut h = read("marker", mi);
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Other variables' writes (sets, a delete) do not wake it.
        for i in 0..5 {
            sim.put(
                "/v1/var/other-app/config",
                json!({"Items": {"x": i.to_string()}}),
            )
            .await;
        }
        sim.req(Method::DELETE, "/v1/var/other-app/config", None)
            .await;
        assert!(
            tokio::time::timeout(Duration::from_millis(500), &mut h)
                .await
                .is_err(),
            "the read of one variable woke on other variables' writes"
        );
        // Its own write does, with its new ModifyIndex.
        sim.put("/v1/var/marker", json!({"Items": {"seq": "2"}}))
            .await;
        let (s, idx) = tokio::time::timeout(Duration::from_secs(5), h)
            .await
            .expect("the read did not wake on its variable's write")
            .unwrap();
        assert_eq!(s, 200);
        let (_, now, _) = sim.req(Method::GET, "/v1/var/marker", None).await;
        assert!(idx > mi && idx == now, "{idx} {mi} {now}");
        // A missing variable: 404 at the table index, woken by any write.
        let (s, ti, _) = sim.req(Method::GET, "/v1/var/missing", None).await;
        assert_eq!(s, 404);
        let h = read("missing", ti);
        tokio::time::sleep(Duration::from_millis(200)).await;
        sim.put("/v1/var/other-app/config", json!({"Items": {"x": "y"}}))
            .await;
        let (s, idx) = tokio::time::timeout(Duration::from_secs(5), h)
            .await
            .expect("a missing variable's read did not wake on the table index")
            .unwrap();
        assert_eq!(s, 404);
        assert!(idx > ti, "{idx} > {ti}");
    })
    .await
    .expect("test timed out");
}

/// `single-node-single-writer` (Nomad 1.10, `scheduler/feasible/feasible.go`
/// `HostVolumeChecker.hostVolumeIsAvailable`): a node where a proposed allocation's group
/// writes the volume is infeasible for another one, of the same job (count 2) or another
/// job; an allocation stopped by the plan that placed the other one does not count, one
/// stopped earlier counts until its client reports it terminal.
#[tokio::test(flavor = "multi_thread")]
async fn single_node_single_writer_places_one_writer_per_node() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start(TWO_NODES).await;
        let n2 = sim.node_id("node-2");
        let path = sim.path().join("vol-ssw");
        std::fs::create_dir_all(&path).unwrap();
        sim.put("/v1/volume/host/register", json!({"Volume": {"Namespace": "default", "Name": "ssw", "NodeID": n2,
            "HostPath": path, "RequestedCapabilities": [{"AccessMode": "single-node-single-writer", "AttachmentMode": "file-system"}]}}))
            .await;
        let vol = r#"volume "d" {
      type = "host"
      source = "ssw"
      access_mode = "single-node-single-writer"
      attachment_mode = "file-system"
    }
    count = 2"#;
        sim.run_job(&sleeper("w1", vol, "default")).await;
        sim.wait_for(5, "one placement", || async {
            (sim.job_allocs("w1").await.len() == 1).then_some(())
        })
        .await;
        let other = vol.replace("count = 2", "count = 1");
        sim.run_job(&sleeper("w2", &other, "default")).await;
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(sim.job_allocs("w1").await.len(), 1, "two writers of w1 on one node");
        assert!(sim.job_allocs("w2").await.is_empty(), "a second job's writer placed");
        // w1 stopped: w2 is placed once w1's allocation is client-terminal.
        sim.req(Method::DELETE, "/v1/job/w1", None).await;
        let a = sim
            .wait_for(10, "w2 placed after w1 stopped", || async {
                let a = sim.job_allocs("w2").await;
                (a.len() == 1).then_some(a)
            })
            .await;
        assert_eq!(a[0]["NodeID"], n2);
        for w1 in sim.job_allocs("w1").await {
            assert!(
                matches!(w1["ClientStatus"].as_str(), Some("complete" | "failed")),
                "w2 placed while w1 still runs: {w1}"
            );
        }
    })
    .await
    .expect("test timed out");
}
