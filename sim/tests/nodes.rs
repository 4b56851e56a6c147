//! Node heartbeats (lost node → allocs lost and replaced), drain with migrate, eligibility.

mod common;
use common::{Sim, Stream};
use reqwest::Method;
use serde_json::{json, Value};
use std::time::Duration;

const CFG: &str = "heartbeat_grace = \"1s\"\nclient \"node-1\" {}\nclient \"node-2\" {}\n";
const JOB: &str = r#"job "hb" {
  group "g" {
    task "t" {
      driver = "raw_exec"
      kill_timeout = "1s"
      config {
        command = "/bin/sleep"
        args = ["1000"]
      }
    }
  }
}"#;

async fn running_alloc(sim: &Sim) -> Value {
    sim.wait_for(20, "running alloc", || async {
        sim.job_allocs("hb")
            .await
            .into_iter()
            .find(|a| a["DesiredStatus"] == "run" && a["ClientStatus"] == "running")
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn missed_heartbeats_make_allocs_lost_and_replaced() {
    tokio::time::timeout(Duration::from_secs(90), async {
        let sim = Sim::start(CFG).await;
        sim.run_job(JOB).await;
        let a = running_alloc(&sim).await;
        let node = a["NodeID"].as_str().unwrap().to_string();
        let old_id = a["ID"].as_str().unwrap().to_string();
        let (_, idx, _) = sim.req(Method::GET, "/v1/allocations", None).await;
        let mut s = Stream::open(&sim, &format!("topic=Allocation&index={}", idx + 1)).await;
        sim.put(
            &format!("/v1/sim/node/{node}/heartbeat?stop=true"),
            json!({}),
        )
        .await;
        // Lost: PlanResult with ClientStatus lost / DesiredStatus stop, and a replacement elsewhere.
        let mut saw_lost = false;
        let mut replacement = None;
        while !(saw_lost && replacement.is_some()) {
            let f = s.frame(15).await.expect("lost/replacement events");
            for ev in f["Events"].as_array().unwrap() {
                let p = &ev["Payload"]["Allocation"];
                if p["ID"] == old_id.as_str() && ev["Type"] == "PlanResult" {
                    assert_eq!(p["ClientStatus"], "lost");
                    assert_eq!(p["DesiredStatus"], "stop");
                    assert_eq!(
                        p["DesiredDescription"],
                        "alloc is lost since its node is down"
                    );
                    saw_lost = true;
                }
                if p["ID"] != old_id.as_str()
                    && ev["Type"] == "PlanResult"
                    && p["DesiredStatus"] == "run"
                {
                    assert_ne!(p["NodeID"], node.as_str());
                    assert_eq!(p["PreviousAllocation"], old_id.as_str());
                    replacement = Some(p["ID"].as_str().unwrap().to_string());
                }
            }
        }
        assert_eq!(sim.get(&format!("/v1/node/{node}")).await["Status"], "down");
        // The partitioned node's task keeps running until the node is back.
        let pid_alive = || {
            std::fs::read_dir("/proc")
                .unwrap()
                .filter_map(|e| e.ok())
                .any(|e| {
                    std::fs::read_to_string(e.path().join("environ"))
                        .map(|env| env.contains(&old_id))
                        .unwrap_or(false)
                })
        };
        assert!(pid_alive(), "task on a partitioned node keeps running");
        sim.put(
            &format!("/v1/sim/node/{node}/heartbeat?stop=false"),
            json!({}),
        )
        .await;
        sim.wait_for(10, "node ready again", || async {
            (sim.get(&format!("/v1/node/{node}")).await["Status"] == "ready").then_some(())
        })
        .await;
        sim.wait_for(10, "old task killed after reconnect", || async {
            (!pid_alive()).then_some(())
        })
        .await;
        let old = sim.get(&format!("/v1/allocation/{old_id}")).await;
        assert_eq!(old["ClientStatus"], "lost");
        assert!(old["NextAllocation"].is_string());
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread")]
async fn drain_migrates_allocations() {
    tokio::time::timeout(Duration::from_secs(90), async {
        let sim = Sim::start(CFG).await;
        sim.run_job(JOB).await;
        let a = running_alloc(&sim).await;
        let node = a["NodeID"].as_str().unwrap().to_string();
        let old_id = a["ID"].as_str().unwrap().to_string();
        let (_, idx, _) = sim.req(Method::GET, "/v1/allocations", None).await;
        let mut s = Stream::open(&sim, &format!("topic=Allocation:hb&index={}", idx + 1)).await;
        sim.put(
            &format!("/v1/node/{node}/drain"),
            json!({"DrainSpec": {"Deadline": 60_000_000_000i64}, "MarkEligible": false}),
        )
        .await;
        let n = sim.get(&format!("/v1/node/{node}")).await;
        assert_eq!(n["SchedulingEligibility"], "ineligible");
        assert_eq!(n["Drain"], true);
        let ev = loop {
            let f = s.frame(10).await.expect("desired transition event");
            if let Some(ev) = f["Events"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["Type"] == "AllocationUpdateDesiredStatus")
            {
                break ev.clone();
            }
        };
        assert_eq!(ev["Payload"]["Allocation"]["ID"], old_id.as_str());
        assert_eq!(
            ev["Payload"]["Allocation"]["DesiredTransition"]["Migrate"],
            true
        );
        let new = sim
            .wait_for(20, "replacement running on the other node", || async {
                sim.job_allocs("hb")
                    .await
                    .into_iter()
                    .find(|a| a["ID"] != old_id.as_str() && a["ClientStatus"] == "running")
            })
            .await;
        assert_ne!(new["NodeID"], node.as_str());
        let old = sim
            .wait_for(20, "old alloc complete", || async {
                let o = sim.get(&format!("/v1/allocation/{old_id}")).await;
                (o["ClientStatus"] == "complete").then_some(o)
            })
            .await;
        assert_eq!(old["DesiredStatus"], "stop");
        assert_eq!(old["DesiredDescription"], "alloc is being migrated");
        // Eligibility toggles.
        sim.put(
            &format!("/v1/node/{node}/eligibility"),
            json!({"Eligibility": "eligible"}),
        )
        .await;
        assert_eq!(
            sim.get(&format!("/v1/node/{node}")).await["SchedulingEligibility"],
            "eligible"
        );
    })
    .await
    .expect("test timed out");
}
