//! `alloc restart` (one task, running tasks, all tasks), `alloc stop`, reschedule on failure.

mod common;
use common::{Sim, Stream};
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
        sim.wait_for(30, "running tasks restarted", || async {
            (starts(&sim, &id) == "pre\nmain\nmain\nmain\n").then_some(())
        })
        .await;
        // All tasks: prestart runs again before main.
        sim.put(
            &format!("/v1/client/allocation/{id}/restart"),
            json!({"AllTasks": true}),
        )
        .await;
        sim.wait_for(30, "all tasks restarted", || async {
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
        // A named task that is not running (the prestart task is dead): 500 "Task not
        // running" (`client/allocrunner/taskrunner/lifecycle.go` `Restart`,
        // `ErrTaskNotRunning`); the running tasks are not touched.
        sim.wait_for(10, "the prestart task dead", || async {
            (alloc(&sim, &id).await["TaskStates"]["pre"]["State"] == "dead").then_some(())
        })
        .await;
        let (s, _, b) = sim
            .req(
                Method::PUT,
                &format!("/v1/client/allocation/{id}/restart"),
                Some(json!({"TaskName": "pre"})),
            )
            .await;
        assert_eq!((s, b.trim()), (500, "Task not running"));
        assert_eq!(starts(&sim, &id), "pre\nmain\nmain\nmain\npre\nmain\n");
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

/// Forced GC (`PUT /v1/system/gc`) deletes terminal allocations without any Allocation event
/// (no `allocs` case in the `Deleted()` branch of `eventFromChange`), reaps the finished batch
/// job (a Job `JobBatchDeregistered` event), keeps running allocs, and wakes blocking queries.
#[tokio::test(flavor = "multi_thread")]
async fn gc_deletes_terminal_allocs_without_events() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("event_heartbeat_interval = \"1s\"\nclient \"node-1\" {}\n").await;
        let n1 = sim.node_id("node-1");
        sim.run_job(
            r#"job "done" {
  type = "batch"
  group "g" {
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/true"
      }
    }
  }
}"#,
        )
        .await;
        sim.run_job(JOB).await;
        let done = sim
            .wait_for(20, "batch alloc complete", || async {
                let a = sim.job_allocs("done").await.first()?.clone();
                (a["ClientStatus"] == "complete").then_some(a)
            })
            .await;
        let live = sim
            .wait_for(20, "service alloc running", || async {
                let a = sim.job_allocs("ops").await.first()?.clone();
                (a["ClientStatus"] == "running").then_some(a)
            })
            .await;
        let (s, idx, _) = sim
            .req(Method::GET, &format!("/v1/node/{n1}/allocations"), None)
            .await;
        assert_eq!(s, 200);
        let mut stream = Stream::open(&sim, "topic=Allocation").await;
        while stream.frame(1).await.is_some() {} // the buffered past
                                                 // A deletion never raises the node's index (`Node.GetAllocs`: the highest ModifyIndex
                                                 // of its allocations), so the query does not wake on the GC: it answers at the end of
                                                 // its wait (or on an unrelated client update) with the list as it is then.
        let done_id = done["ID"].as_str().unwrap().to_string();
        let blocked = {
            let http = sim.http.clone();
            let server = sim.server.clone();
            tokio::spawn(async move {
                let mut index = idx;
                for _ in 0..10 {
                    let url = format!("{server}/v1/node/{n1}/allocations?index={index}&wait=2s");
                    let r = http.get(url).send().await.unwrap();
                    let i: u64 = r.headers()["x-nomad-index"]
                        .to_str()
                        .unwrap()
                        .parse()
                        .unwrap();
                    let list = r.json::<Value>().await.unwrap();
                    let gone = !list
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|a| a["ID"] == done_id.as_str());
                    if gone {
                        return (i, list);
                    }
                    index = i;
                }
                panic!("the node allocations query never showed the GC");
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (s, _, b) = sim.req(Method::PUT, "/v1/system/gc", None).await;
        assert_eq!(s, 200, "{b}");
        let (answered_at, list) = blocked.await.unwrap();
        let highest = list
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["ModifyIndex"].as_u64().unwrap())
            .max()
            .unwrap();
        assert_eq!(
            answered_at, highest,
            "the index is the node's highest allocation ModifyIndex, whatever the GC did"
        );
        let ids: Vec<&str> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["ID"].as_str().unwrap())
            .collect();
        assert_eq!(ids, [live["ID"].as_str().unwrap()]);
        let (s, _, _) = sim
            .req(
                Method::GET,
                &format!("/v1/allocation/{}", done["ID"].as_str().unwrap()),
                None,
            )
            .await;
        assert_eq!(s, 404);
        let (s, _, _) = sim.req(Method::GET, "/v1/job/done", None).await;
        assert_eq!(s, 404, "the finished batch job is reaped");
        if let Some(f) = stream.frame(2).await {
            panic!("GC published an allocation event: {f}");
        }
        let (s, _, _) = sim.req(Method::POST, "/v1/system/gc", None).await;
        assert_eq!(s, 405, "only PUT");
    })
    .await
    .expect("test timed out");
}

/// Restart policy in place (`client/allocrunner/taskrunner/restarts`): a failing task is
/// restarted `attempts` times after `delay`, then with mode "fail" it is "Not Restarting" and the
/// alloc fails. `shutdown_delay` holds the kill signal back on stop.
#[tokio::test(flavor = "multi_thread")]
async fn restart_policy_in_place_and_shutdown_delay() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        sim.run_job(
            r#"job "flaky" {
  group "g" {
    restart {
      attempts = 2
      interval = "1m"
      delay = "200ms"
      mode = "fail"
    }
    reschedule {
      attempts = 0
      unlimited = false
    }
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/sh"
        args = ["-c", "echo run >> $NOMAD_ALLOC_DIR/runs; exit 3"]
      }
    }
  }
}"#,
        )
        .await;
        let a = sim
            .wait_for(20, "alloc failed", || async {
                let a = sim.job_allocs("flaky").await.first()?.clone();
                (a["ClientStatus"] == "failed").then_some(a)
            })
            .await;
        let id = a["ID"].as_str().unwrap();
        let full = alloc(&sim, id).await;
        let ts = &full["TaskStates"]["t"];
        assert_eq!(ts["Restarts"], 2, "{ts:#}");
        assert_eq!(ts["Failed"], true);
        let types: Vec<&str> = ts["Events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["Type"].as_str().unwrap())
            .collect();
        assert_eq!(
            types.iter().filter(|t| **t == "Restarting").count(),
            2,
            "{types:?}"
        );
        assert_eq!(types.last(), Some(&"Not Restarting"), "{types:?}");
        let runs =
            std::fs::read_to_string(sim.nodes[0].3.join("alloc").join(id).join("alloc/runs"))
                .unwrap();
        assert_eq!(
            runs, "run\nrun\nrun\n",
            "1 start + 2 restarts, same alloc dir"
        );
        assert_eq!(sim.job_allocs("flaky").await.len(), 1, "no reschedule");

        // shutdown_delay: the kill signal comes only after the delay.
        sim.run_job(
            r#"job "slow" {
  group "g" {
    shutdown_delay = "1500ms"
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
        let id = sim
            .wait_for(20, "slow running", || async {
                let a = sim.job_allocs("slow").await.first()?.clone();
                (a["ClientStatus"] == "running").then(|| a["ID"].as_str().unwrap().to_string())
            })
            .await;
        let t0 = std::time::Instant::now();
        let (s, _, _) = sim.req(Method::DELETE, "/v1/job/slow", None).await;
        assert_eq!(s, 200);
        let a = sim
            .wait_for(20, "slow complete", || async {
                let a = alloc(&sim, &id).await;
                (a["ClientStatus"] == "complete").then_some(a)
            })
            .await;
        assert!(
            t0.elapsed() >= Duration::from_millis(1400),
            "stopped after {:?}",
            t0.elapsed()
        );
        let ev = a["TaskStates"]["t"]["Events"].as_array().unwrap();
        assert!(ev.iter().any(|e| e["Type"] == "Killing"), "{ev:?}");
    })
    .await
    .expect("test timed out");
}

/// The reschedule penalty (`scheduler/generic_sched.go` `getSelectOptions`,
/// `scheduler/feasible/rank.go` `NodeReschedulingPenaltyIterator`): a replacement ranks
/// below every other feasible node the node its predecessor failed on and every node of the
/// reschedule history, so an allocation that fails everywhere is tried on three nodes in
/// turn. (Avoiding only the last node sent the third attempt back to the first node.)
#[tokio::test(flavor = "multi_thread")]
async fn a_rescheduled_allocation_avoids_every_node_it_failed_on() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim =
            Sim::start("client \"node-1\" {}\nclient \"node-2\" {}\nclient \"node-3\" {}\n").await;
        sim.run_job(
            r#"job "fail" {
  group "g" {
    restart {
      attempts = 0
      mode = "fail"
    }
    reschedule {
      attempts = 2
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
            .wait_for(30, "three failed allocs", || async {
                let l = sim.job_allocs("fail").await;
                (l.len() == 3 && l.iter().all(|a| a["ClientStatus"] == "failed")).then_some(l)
            })
            .await;
        let nodes: std::collections::BTreeSet<&str> =
            allocs.iter().filter_map(|a| a["NodeID"].as_str()).collect();
        let names: Vec<&str> = allocs
            .iter()
            .filter_map(|a| a["NodeName"].as_str())
            .collect();
        assert_eq!(nodes.len(), 3, "the attempts ran on {names:?}");
    })
    .await
    .expect("test timed out");
}
