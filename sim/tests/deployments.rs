//! Deployments: the `update` block's canaries (promotion by hand or automatic) and rolling
//! updates, the deployment reads and `POST /v1/deployment/promote/:id`
//! (`scheduler/reconciler/reconcile_cluster.go`, `nomad/deploymentwatcher`,
//! `client/allochealth/tracker.go`, `nomad/state/state_store.go` `UpdateDeploymentPromotion`).

mod common;
use common::Sim;
use reqwest::Method;
use serde_json::{json, Value};
use std::time::Duration;

const NODES: &str = "client \"node-1\" {}\nclient \"node-2\" {}\n";

/// A service job; `gate` is the prestart task's command (a never-ending one keeps the main
/// task from starting, so the allocation never becomes healthy).
fn job(version: &str, count: u32, update: &str, gate: &str) -> String {
    format!(
        r#"job "web" {{
  update {{
    {update}
    min_healthy_time = "1s"
    healthy_deadline = "1m"
  }}
  group "web" {{
    count = {count}
    task "gate" {{
      driver = "raw_exec"
      lifecycle {{
        hook = "prestart"
      }}
      config {{
        command = "/bin/sh"
        args = ["-c", "{gate}"]
      }}
    }}
    task "app" {{
      driver = "raw_exec"
      kill_timeout = "1s"
      env {{
        VERSION = "{version}"
      }}
      config {{
        command = "/bin/sleep"
        args = ["1000"]
      }}
    }}
  }}
}}"#
    )
}

fn version(a: &Value) -> u64 {
    a["Job"]["Version"].as_u64().unwrap_or(0)
}

async fn latest(sim: &Sim) -> Value {
    sim.get("/v1/job/web/deployment").await
}

async fn allocs(sim: &Sim) -> Vec<Value> {
    let mut out = Vec::new();
    for stub in sim.job_allocs("web").await {
        out.push(
            sim.get(&format!("/v1/allocation/{}", stub["ID"].as_str().unwrap()))
                .await,
        );
    }
    out
}

fn live(list: &[Value]) -> Vec<Value> {
    list.iter()
        .filter(|a| a["DesiredStatus"] == "run")
        .cloned()
        .collect()
}

/// Runs version 1 and waits until its (first) deployment is successful.
async fn first_version(sim: &Sim, count: u32, update: &str) {
    sim.run_job(&job("v1", count, update, "true")).await;
    sim.wait_for(30, "the first deployment to succeed", || async {
        let d = latest(sim).await;
        (d["Status"] == "successful").then_some(())
    })
    .await;
    let j = sim.get("/v1/job/web").await;
    assert_eq!(
        j["Stable"], true,
        "a successful deployment makes the version stable"
    );
}

async fn promote(sim: &Sim, id: &str) -> (u16, String) {
    let (s, _, b) = sim
        .req(
            Method::PUT,
            &format!("/v1/deployment/promote/{id}"),
            Some(json!({"DeploymentID": id, "All": true})),
        )
        .await;
    (s, b)
}

/// A canary that never becomes healthy (its prestart never ends): the old allocation keeps
/// running, the deployment waits for a manual promotion, and the promotion is refused with
/// Nomad's uncoded (500) "Task group \"web\" has 0/1 healthy allocations".
#[tokio::test(flavor = "multi_thread")]
async fn an_unhealthy_canary_cannot_be_promoted_and_the_old_allocation_keeps_running() {
    tokio::time::timeout(Duration::from_secs(90), async {
        let sim = Sim::start(NODES).await;
        first_version(&sim, 1, "canary = 1").await;
        let old = live(&allocs(&sim).await)[0].clone();
        sim.run_job(&job("v2", 1, "canary = 1", "exec sleep 1000"))
            .await;
        let canary = sim
            .wait_for(20, "a canary of version 1", || async {
                live(&allocs(&sim).await)
                    .into_iter()
                    .find(|a| version(a) == 1)
            })
            .await;
        assert_eq!(canary["DeploymentStatus"]["Canary"], true);
        assert_eq!(
            canary["Name"], old["Name"],
            "a canary takes the name it will replace"
        );
        let d = latest(&sim).await;
        let id = d["ID"].as_str().unwrap().to_string();
        assert_eq!(canary["DeploymentID"], id.as_str());
        assert_eq!(d["Status"], "running");
        assert_eq!(
            d["StatusDescription"],
            "Deployment is running but requires manual promotion"
        );
        assert_eq!(d["TaskGroups"]["web"]["DesiredCanaries"], 1);
        assert_eq!(
            d["TaskGroups"]["web"]["PlacedCanaries"],
            json!([canary["ID"]])
        );
        let (s, b) = promote(&sim, &id).await;
        assert_eq!(s, 500, "{b}");
        assert!(
            b.contains("Task group \"web\" has 0/1 healthy allocations"),
            "{b}"
        );
        let now = allocs(&sim).await;
        let old_now = now.iter().find(|a| a["ID"] == old["ID"]).unwrap();
        assert_eq!(old_now["DesiredStatus"], "run");
        assert_eq!(old_now["ClientStatus"], "running");
        // Request validation (`deploymentPromote`): 400s before any lookup.
        let (s, _, _) = sim
            .req(
                Method::PUT,
                &format!("/v1/deployment/promote/{id}"),
                Some(json!({"All": true})),
            )
            .await;
        assert_eq!(s, 400, "no DeploymentID");
        let (s, _, _) = sim
            .req(
                Method::PUT,
                &format!("/v1/deployment/promote/{id}"),
                Some(json!({"DeploymentID": "other", "All": true})),
            )
            .await;
        assert_eq!(s, 400, "another DeploymentID");
        let (s, _, b) = sim
            .req(Method::GET, "/v1/deployment/no-such-id", None)
            .await;
        assert_eq!(s, 404, "{b}");
        let listed = sim.get("/v1/deployments").await;
        assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");
        let of_dep = sim.get(&format!("/v1/deployment/allocations/{id}")).await;
        assert_eq!(of_dep.as_array().unwrap().len(), 1, "{of_dep}");
    })
    .await
    .expect("test timed out");
}

/// A healthy canary waits for its promotion; once promoted the old allocation of the same
/// name stops ("alloc not needed due to job update") and the deployment succeeds. With
/// `auto_promote` the same happens without the call.
#[tokio::test(flavor = "multi_thread")]
async fn a_healthy_canary_replaces_the_old_allocation_only_after_promotion() {
    tokio::time::timeout(Duration::from_secs(120), async {
        for auto in [false, true] {
            let sim = Sim::start(NODES).await;
            let update = format!("canary = 1\n    auto_promote = {auto}");
            first_version(&sim, 1, &update).await;
            let old = live(&allocs(&sim).await)[0].clone();
            sim.run_job(&job("v2", 1, &update, "true")).await;
            let canary = sim
                .wait_for(30, "a healthy canary", || async {
                    allocs(&sim)
                        .await
                        .into_iter()
                        .find(|a| version(a) == 1 && a["DeploymentStatus"]["Healthy"] == true)
                })
                .await;
            let id = canary["DeploymentID"].as_str().unwrap().to_string();
            if !auto {
                let d = latest(&sim).await;
                assert_eq!(d["TaskGroups"]["web"]["Promoted"], false);
                let o = sim
                    .get(&format!("/v1/allocation/{}", old["ID"].as_str().unwrap()))
                    .await;
                assert_eq!(
                    o["DesiredStatus"], "run",
                    "the old allocation waits for promotion"
                );
                let (s, b) = promote(&sim, &id).await;
                assert_eq!(s, 200, "{b}");
            }
            sim.wait_for(30, "the deployment to succeed", || async {
                let d = latest(&sim).await;
                (d["ID"] == id.as_str() && d["Status"] == "successful").then_some(())
            })
            .await;
            let d = latest(&sim).await;
            assert_eq!(d["TaskGroups"]["web"]["Promoted"], true);
            let o = sim
                .get(&format!("/v1/allocation/{}", old["ID"].as_str().unwrap()))
                .await;
            assert_eq!(o["DesiredStatus"], "stop");
            assert_eq!(
                o["DesiredDescription"],
                "alloc not needed due to job update"
            );
            let l = live(&allocs(&sim).await);
            assert_eq!(l.len(), 1);
            assert_eq!(l[0]["ID"], canary["ID"], "auto_promote = {auto}");
        }
    })
    .await
    .expect("test timed out");
}

/// A rolling update without canaries replaces `max_parallel` (1) allocations at a time: the
/// second old allocation is stopped only after the first replacement is healthy.
#[tokio::test(flavor = "multi_thread")]
async fn a_rolling_update_replaces_one_allocation_at_a_time() {
    tokio::time::timeout(Duration::from_secs(90), async {
        let sim = Sim::start(NODES).await;
        first_version(&sim, 2, "max_parallel = 1").await;
        sim.run_job(&job("v2", 2, "max_parallel = 1", "true")).await;
        sim.wait_for(40, "the second deployment to succeed", || async {
            let d = latest(&sim).await;
            (d["JobVersion"] == 1 && d["Status"] == "successful").then_some(())
        })
        .await;
        let all = allocs(&sim).await;
        let mut new: Vec<&Value> = all.iter().filter(|a| version(a) == 1).collect();
        assert_eq!(new.len(), 2, "{all:?}");
        new.sort_by_key(|a| a["CreateIndex"].as_u64().unwrap());
        let first_healthy_at = new[0]["DeploymentStatus"]["ModifyIndex"].as_u64().unwrap();
        assert!(
            new[1]["CreateIndex"].as_u64().unwrap() > first_healthy_at,
            "the second replacement was placed before the first was healthy: {new:?}"
        );
        for n in &new {
            assert!(!n["PreviousAllocation"].as_str().unwrap().is_empty(), "{n}");
        }
    })
    .await
    .expect("test timed out");
}
