//! `alloc restart` (one task, running tasks, all tasks), `alloc stop`, reschedule on failure.

mod common;
use common::Sim;
use reqwest::Method;
use serde_json::{json, Value};
use std::time::Duration;

const JOB: &str = r#"job "ops" {
  group "g" {
    task "pre" {
      driver = "raw_exec"
      lifecycle {
        hook = "prestart"
      }
      config {
        command = "/bin/sh"
        args = ["-c", "echo pre >> $NOMAD_ALLOC_DIR/starts"]
      }
    }
    task "main" {
      driver = "raw_exec"
      kill_timeout = "1s"
      config {
        command = "/bin/sh"
        args = ["-c", "echo main >> $NOMAD_ALLOC_DIR/starts; exec sleep 1000"]
      }
    }
  }
}"#;

fn starts(sim: &Sim, id: &str) -> String {
    std::fs::read_to_string(sim.nodes[0].3.join("alloc").join(id).join("alloc/starts"))
        .unwrap_or_default()
}

async fn alloc(sim: &Sim, id: &str) -> Value {
    sim.get(&format!("/v1/allocation/{id}")).await
}

#[tokio::test(flavor = "multi_thread")]
async fn restart_task_running_and_all() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        sim.run_job(JOB).await;
        let id = sim
            .wait_for(20, "main running", || async {
                let a = sim.job_allocs("ops").await.first()?.clone();
                (a["TaskStates"]["main"]["State"] == "running")
                    .then(|| a["ID"].as_str().unwrap().to_string())
            })
            .await;
        sim.wait_for(5, "first start", || async {
            (starts(&sim, &id) == "pre\nmain\n").then_some(())
        })
        .await;
        // One task.
        sim.put(
            &format!("/v1/client/allocation/{id}/restart"),
            json!({"TaskName": "main"}),
        )
        .await;
        sim.wait_for(10, "main restarted", || async {
            let a = alloc(&sim, &id).await;
            (a["TaskStates"]["main"]["Restarts"] == 1
                && a["TaskStates"]["main"]["State"] == "running")
                .then_some(())
        })
        .await;
        assert_eq!(
            starts(&sim, &id),
            "pre\nmain\nmain\n",
            "prestart not re-run for a task restart"
        );
        let a = alloc(&sim, &id).await;
        let evs: Vec<&str> = a["TaskStates"]["main"]["Events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["Type"].as_str().unwrap())
            .collect();
        assert_eq!(
            &evs[evs.len() - 4..],
            ["Restart Signaled", "Terminated", "Restarting", "Started"]
        );
        assert!(a["TaskStates"]["main"]["LastRestart"].is_string());
        // Running tasks (default).
        sim.put(&format!("/v1/client/allocation/{id}/restart"), json!({}))
            .await;
        sim.wait_for(10, "running tasks restarted", || async {
            (starts(&sim, &id) == "pre\nmain\nmain\nmain\n").then_some(())
        })
        .await;
        // All tasks: prestart runs again before main.
        sim.put(
            &format!("/v1/client/allocation/{id}/restart"),
            json!({"AllTasks": true}),
        )
        .await;
        sim.wait_for(10, "all tasks restarted", || async {
            (starts(&sim, &id) == "pre\nmain\nmain\nmain\npre\nmain\n").then_some(())
        })
        .await;
        let (s, _, _) = sim
            .req(
                Method::PUT,
                &format!("/v1/client/allocation/{id}/restart"),
                Some(json!({"TaskName": "nope"})),
            )
            .await;
        assert_eq!(s, 400);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread")]
async fn alloc_stop_replaces_and_failures_reschedule() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\nclient \"node-2\" {}\n").await;
        sim.run_job(JOB).await;
        let id = sim
            .wait_for(20, "running", || async {
                let a = sim.job_allocs("ops").await.first()?.clone();
                (a["ClientStatus"] == "running").then(|| a["ID"].as_str().unwrap().to_string())
            })
            .await;
        let (s, _, b) = sim
            .req(Method::PUT, &format!("/v1/allocation/{id}/stop"), None)
            .await;
        assert_eq!(s, 200, "{b}");
        let new = sim
            .wait_for(20, "replacement", || async {
                sim.job_allocs("ops")
                    .await
                    .into_iter()
                    .find(|a| a["ID"] != id.as_str() && a["ClientStatus"] == "running")
            })
            .await;
        let full = alloc(&sim, new["ID"].as_str().unwrap()).await;
        assert_eq!(full["PreviousAllocation"], id.as_str());
        let old = sim
            .wait_for(20, "old complete", || async {
                let o = alloc(&sim, &id).await;
                (o["ClientStatus"] == "complete").then_some(o)
            })
            .await;
        assert_eq!(old["DesiredStatus"], "stop");

        // Reschedule on failure: restart policy exhausted → failed → replaced after the delay,
        // at most `attempts` times.
        sim.run_job(
            r#"job "fail" {
  group "g" {
    restart {
      attempts = 0
      mode = "fail"
    }
    reschedule {
      attempts = 1
      interval = "1h"
      delay = "1s"
      delay_function = "constant"
      unlimited = false
    }
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/sh"
        args = ["-c", "exit 3"]
      }
    }
  }
}"#,
        )
        .await;
        let allocs = sim
            .wait_for(20, "two failed allocs", || async {
                let l = sim.job_allocs("fail").await;
                (l.len() == 2 && l.iter().all(|a| a["ClientStatus"] == "failed")).then_some(l)
            })
            .await;
        let first = allocs
            .iter()
            .find(|a| a["DesiredStatus"] == "stop")
            .expect("rescheduled alloc is stopped");
        assert_eq!(
            first["DesiredDescription"],
            "alloc was rescheduled because it failed"
        );
        let second = alloc(
            &sim,
            allocs.iter().find(|a| a["ID"] != first["ID"]).unwrap()["ID"]
                .as_str()
                .unwrap(),
        )
        .await;
        assert_eq!(second["PreviousAllocation"], first["ID"]);
        let t = &second["TaskStates"]["t"];
        assert_eq!(t["Failed"], true);
        let evs: Vec<&str> = t["Events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["Type"].as_str().unwrap())
            .collect();
        assert!(evs.contains(&"Not Restarting"), "{evs:?}");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            sim.job_allocs("fail").await.len(),
            2,
            "reschedule attempts exhausted"
        );
    })
    .await
    .expect("test timed out");
}
