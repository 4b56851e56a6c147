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
        // `nestedUpdateAllocFromClient` copies the returning client's status: the lost
        // allocation, its task killed, becomes `complete` (`UpdateAlloc` refused the
        // updates only while the node was down).
        let old = sim
            .wait_for(10, "the lost allocation reported complete", || async {
                let a = sim.get(&format!("/v1/allocation/{old_id}")).await;
                (a["ClientStatus"] == "complete").then_some(a)
            })
            .await;
        assert_eq!(old["DesiredStatus"], "stop");
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

/// A system job and a service job whose task takes `stop_secs` to stop after its kill signal
/// (SIGINT, the default).
async fn system_and_slow_service(sim: &Sim, stop_secs: u32) {
    sim.run_job(
        r#"job "daemon" {
  type = "system"
  group "d" {
    task "d" {
      driver = "raw_exec"
      kill_timeout = "1s"
      config {
        command = "/bin/sleep"
        args = ["1000"]
      }
    }
  }
}"#,
    )
    .await;
    sim.run_job(&format!(
        r#"job "slow" {{
  group "g" {{
    task "t" {{
      driver = "raw_exec"
      kill_timeout = "30s"
      config {{
        command = "/bin/sh"
        args = ["-c", "trap 'sleep {stop_secs}; exit 0' INT TERM; while true; do sleep 0.1; done"]
      }}
    }}
  }}
}}"#
    ))
    .await;
}

async fn alloc_on(sim: &Sim, job: &str, node: &str) -> Value {
    sim.wait_for(20, "a running allocation on the node", || async {
        sim.job_allocs(job).await.into_iter().find(|a| {
            a["NodeID"] == node && a["ClientStatus"] == "running" && a["DesiredStatus"] == "run"
        })
    })
    .await
}

/// The node drainer (`nomad/drainer`): a system allocation is drained only once every other
/// allocation on the node is client-terminal (`IsDone`); at the drain deadline everything left,
/// system allocations included, is drained at once (`handleDeadlinedNodes`); either way the
/// drain then completes (no strategy, node ineligible).
#[tokio::test(flavor = "multi_thread")]
async fn drain_stops_system_allocations_last_or_all_at_once_at_the_deadline() {
    tokio::time::timeout(Duration::from_secs(120), async {
        for (deadline_ns, stop_secs) in [(60_000_000_000i64, 2u32), (1_000_000_000, 20)] {
            let sim = Sim::start("client \"node-1\" {}\n").await;
            let node = sim.node_id("node-1");
            system_and_slow_service(&sim, stop_secs).await;
            let svc = alloc_on(&sim, "slow", &node).await;
            let sys = alloc_on(&sim, "daemon", &node).await;
            let get = |id: &Value| {
                let path = format!("/v1/allocation/{}", id.as_str().unwrap());
                let sim = &sim;
                async move { sim.get(&path).await }
            };
            sim.put(
                &format!("/v1/node/{node}/drain"),
                json!({"DrainSpec": {"Deadline": deadline_ns, "IgnoreSystemJobs": false}, "MarkEligible": false}),
            )
            .await;
            let (svc_at_stop, _) = sim
                .wait_for(40, "the system allocation stopped", || async {
                    let s = get(&sys["ID"]).await;
                    let v = get(&svc["ID"]).await;
                    (s["DesiredStatus"] == "stop").then_some((v, s))
                })
                .await;
            if stop_secs < 10 {
                assert_eq!(
                    svc_at_stop["ClientStatus"], "complete",
                    "the system allocation was drained before the service one was done"
                );
            } else {
                assert_eq!(
                    svc_at_stop["ClientStatus"], "running",
                    "at the deadline the system allocation stops with the rest, at once"
                );
                assert_eq!(svc_at_stop["DesiredStatus"], "stop");
            }
            let n = sim
                .wait_for(10, "the drain complete", || async {
                    let n = sim.get(&format!("/v1/node/{node}")).await;
                    (n["Drain"] == false).then_some(n)
                })
                .await;
            assert_eq!(n["SchedulingEligibility"], "ineligible");
            assert!(n["DrainStrategy"].is_null(), "{n}");
        }
    })
    .await
    .expect("test timed out");
}

/// A client agent restart (`PUT /v1/sim/node/:id/restart`): its allocation keeps running and
/// its prestart task is not run again (Nomad re-attaches, `alloc_runner.go` `Restore`); the
/// dynamic host volumes are restored by a `stat` of their path and one whose path fails is
/// dropped from the node and turns `unavailable` (`hostvolumemanager` `restoreForRegister`).
#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_client_keeps_its_tasks_and_restores_host_volumes_by_stat() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let node = sim.node_id("node-1");
        let marks = sim.path().join("prestart-runs");
        sim.run_job(&format!(
            r#"job "r" {{
  group "g" {{
    task "pre" {{
      driver = "raw_exec"
      lifecycle {{
        hook = "prestart"
      }}
      config {{
        command = "/bin/sh"
        args = ["-c", "echo run >> {}"]
      }}
    }}
    task "main" {{
      driver = "raw_exec"
      kill_timeout = "1s"
      config {{
        command = "/bin/sleep"
        args = ["1000"]
      }}
    }}
  }}
}}"#,
            marks.display()
        ))
        .await;
        let before = sim
            .wait_for(20, "main running", || async {
                let a = sim.job_allocs("r").await.first()?.clone();
                (a["TaskStates"]["main"]["State"] == "running").then_some(a)
            })
            .await;
        let mut ids = Vec::new();
        for name in ["kept", "gone"] {
            let path = sim.path().join(name);
            std::fs::create_dir_all(&path).unwrap();
            let r = sim
                .put(
                    "/v1/volume/host/register",
                    json!({"Volume": {"Name": name, "NodeID": node, "HostPath": path}}),
                )
                .await;
            ids.push(r["Volume"]["ID"].as_str().unwrap().to_string());
        }
        for id in &ids {
            sim.wait_for(5, "volume ready", || async {
                (sim.get(&format!("/v1/volume/host/{id}")).await["State"] == "ready").then_some(())
            })
            .await;
        }
        std::fs::remove_dir(sim.path().join("gone")).unwrap();
        let r = sim
            .put(&format!("/v1/sim/node/{node}/restart"), json!({}))
            .await;
        assert_eq!(r["DroppedHostVolumes"], json!([ids[1]]));
        let kept = sim.get(&format!("/v1/volume/host/{}", ids[0])).await;
        let gone = sim.get(&format!("/v1/volume/host/{}", ids[1])).await;
        assert_eq!(
            (kept["State"].as_str(), gone["State"].as_str()),
            (Some("ready"), Some("unavailable"))
        );
        let n = sim.get(&format!("/v1/node/{node}")).await;
        assert!(n["HostVolumes"]["kept"].is_object(), "{n}");
        assert!(n["HostVolumes"]["gone"].is_null(), "{n}");
        // The allocation was not touched: same task start, prestart ran once.
        let after = sim
            .get(&format!(
                "/v1/allocation/{}",
                before["ID"].as_str().unwrap()
            ))
            .await;
        assert_eq!(after["ClientStatus"], "running");
        assert_eq!(
            after["TaskStates"]["main"]["StartedAt"],
            before["TaskStates"]["main"]["StartedAt"]
        );
        assert_eq!(std::fs::read_to_string(&marks).unwrap(), "run\n");
    })
    .await
    .expect("test timed out");
}

fn disconnect_job(lost_after: &str) -> String {
    format!(
        r#"job "dc" {{
  group "g" {{
    disconnect {{
      lost_after = "{lost_after}"
    }}
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

/// The group `disconnect` block (`nomad/heartbeat.go` `disconnectState`,
/// `scheduler/reconciler/reconcile_cluster.go` `computeDisconnecting`, `reconcileReconnecting`):
/// a node that misses its heartbeats is `disconnected`, its allocation `unknown` (still desired
/// to run) and replaced elsewhere; when the node returns within `lost_after` the client logs
/// "Reconnected" and reports the allocation running, and the replacement stops ("alloc not
/// needed due to disconnected client reconnect"). Past `lost_after` the allocation is lost and
/// the node down.
#[tokio::test(flavor = "multi_thread")]
async fn a_disconnected_node_makes_allocations_unknown_then_reconnects_or_loses_them() {
    tokio::time::timeout(Duration::from_secs(90), async {
        let sim = Sim::start(CFG).await;
        sim.run_job(&disconnect_job("1h")).await;
        let a = sim
            .wait_for(20, "running alloc", || async {
                sim.job_allocs("dc")
                    .await
                    .into_iter()
                    .find(|a| a["ClientStatus"] == "running")
            })
            .await;
        let (node, id) = (
            a["NodeID"].as_str().unwrap().to_string(),
            a["ID"].as_str().unwrap().to_string(),
        );
        let hb = |stop: bool| format!("/v1/sim/node/{node}/heartbeat?stop={stop}");
        sim.put(&hb(true), json!({})).await;
        let unknown = sim
            .wait_for(20, "the allocation unknown", || async {
                let a = sim.get(&format!("/v1/allocation/{id}")).await;
                (a["ClientStatus"] == "unknown").then_some(a)
            })
            .await;
        assert_eq!(unknown["DesiredStatus"], "run");
        assert_eq!(
            unknown["ClientDescription"],
            "alloc is unknown since its node is disconnected"
        );
        let states = unknown["AllocStates"].as_array().unwrap();
        assert_eq!(states.last().unwrap()["Value"], "unknown");
        assert_eq!(
            sim.get(&format!("/v1/node/{node}")).await["Status"],
            "disconnected"
        );
        let replacement = sim
            .wait_for(20, "a replacement elsewhere", || async {
                sim.job_allocs("dc")
                    .await
                    .into_iter()
                    .find(|a| a["ID"] != id.as_str() && a["ClientStatus"] == "running")
            })
            .await;
        assert_ne!(replacement["NodeID"], node.as_str());
        let rid = replacement["ID"].as_str().unwrap().to_string();
        sim.put(&hb(false), json!({})).await;
        let back = sim
            .wait_for(20, "the allocation reconnected", || async {
                let a = sim.get(&format!("/v1/allocation/{id}")).await;
                (a["ClientStatus"] == "running").then_some(a)
            })
            .await;
        assert_eq!(back["DesiredStatus"], "run");
        let events: Vec<&str> = back["TaskStates"]["t"]["Events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["Type"].as_str().unwrap())
            .collect();
        assert!(events.contains(&"Reconnected"), "{events:?}");
        let r = sim
            .wait_for(20, "the replacement stopped", || async {
                let r = sim.get(&format!("/v1/allocation/{rid}")).await;
                (r["DesiredStatus"] == "stop").then_some(r)
            })
            .await;
        assert_eq!(
            r["DesiredDescription"],
            "alloc not needed due to disconnected client reconnect"
        );
        assert_eq!(
            sim.get(&format!("/v1/node/{node}")).await["Status"],
            "ready"
        );

        // Past lost_after: lost, and the node down.
        sim.run_job(&disconnect_job("2s")).await;
        let a = sim
            .wait_for(30, "a running alloc of the new version", || async {
                sim.job_allocs("dc")
                    .await
                    .into_iter()
                    .find(|a| a["JobVersion"] == 1 && a["ClientStatus"] == "running")
            })
            .await;
        let (node, id) = (
            a["NodeID"].as_str().unwrap().to_string(),
            a["ID"].as_str().unwrap().to_string(),
        );
        sim.put(
            &format!("/v1/sim/node/{node}/heartbeat?stop=true"),
            json!({}),
        )
        .await;
        sim.wait_for(20, "the allocation unknown", || async {
            let a = sim.get(&format!("/v1/allocation/{id}")).await;
            (a["ClientStatus"] == "unknown").then_some(())
        })
        .await;
        let lost = sim
            .wait_for(20, "the allocation lost after lost_after", || async {
                let a = sim.get(&format!("/v1/allocation/{id}")).await;
                (a["ClientStatus"] == "lost").then_some(a)
            })
            .await;
        assert_eq!(lost["DesiredStatus"], "stop");
        sim.wait_for(10, "the node down", || async {
            (sim.get(&format!("/v1/node/{node}")).await["Status"] == "down").then_some(())
        })
        .await;
    })
    .await
    .expect("test timed out");
}

/// Registering a host volume with an ID: the volume must exist, and allocations that use it
/// and are not client-terminal make the update refused (`nomad/host_volume_endpoint.go`
/// `validateVolumeUpdate`; `nomad/structs/host_volumes.go` `HostVolume.ValidateUpdate`),
/// both HTTP 500. Once the allocation is client-terminal the same registration passes (a
/// restarted client's `unavailable` volume can be registered again only then).
#[tokio::test(flavor = "multi_thread")]
async fn registering_a_volume_again_is_refused_while_allocations_use_it() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let node = sim.node_id("node-1");
        let path = sim.path().join("data");
        std::fs::create_dir_all(&path).unwrap();
        let body = |id: &str| {
            json!({"Volume": {"Name": "data", "NodeID": node, "HostPath": path, "ID": id}})
        };
        let (s, _, b) = sim
            .req(
                reqwest::Method::PUT,
                "/v1/volume/host/register",
                Some(body("0b5a6e4c-0000-4000-8000-000000000001")),
            )
            .await;
        assert_eq!(s, 500, "{b}");
        assert_eq!(
            b,
            "cannot update volume \"0b5a6e4c-0000-4000-8000-000000000001\": volume does not exist"
        );
        let r = sim
            .put(
                "/v1/volume/host/register",
                json!({"Volume": {"Name": "data", "NodeID": node, "HostPath": path}}),
            )
            .await;
        let id = r["Volume"]["ID"].as_str().unwrap().to_string();
        sim.wait_for(5, "volume ready", || async {
            (sim.get(&format!("/v1/volume/host/{id}")).await["State"] == "ready").then_some(())
        })
        .await;
        let job = sim
            .run_job(
                r#"job "uses" {
  group "g" {
    volume "data" {
      type   = "host"
      source = "data"
    }
    task "t" {
      driver = "raw_exec"
      kill_timeout = "1s"
      config {
        command = "/bin/sleep"
        args = ["1000"]
      }
    }
  }
}"#,
            )
            .await;
        let alloc = sim
            .wait_for(20, "the task running", || async {
                sim.job_allocs(&job)
                    .await
                    .into_iter()
                    .find(|a| a["ClientStatus"] == "running")
            })
            .await;
        let (s, _, b) = sim
            .req(reqwest::Method::PUT, "/v1/volume/host/register", Some(body(&id)))
            .await;
        assert_eq!(s, 500, "{b}");
        assert_eq!(
            b,
            format!(
                "validating volume {id:?} update failed: cannot update a volume in use: claimed by allocs ({})",
                alloc["ID"].as_str().unwrap()
            )
        );
        sim.req(reqwest::Method::DELETE, &format!("/v1/job/{job}"), None)
            .await;
        sim.wait_for(20, "the allocation complete", || async {
            sim.job_allocs(&job)
                .await
                .into_iter()
                .find(|a| a["ClientStatus"] == "complete")
        })
        .await;
        sim.put("/v1/volume/host/register", body(&id)).await;
    })
    .await
    .expect("test timed out");
}

/// A restarted client runs the prestart hooks of its restored tasks again: a running task
/// whose group's dynamic host volume did not come back fails its `volumes` hook ("missing
/// <source>"), an unrecoverable start error (`task_runner_hooks.go` `prestart` wraps it with
/// `structs.WrapRecoverable`, recoverable only if the hook's error was): it is not restarted
/// whatever its policy, its process is killed and the allocation fails; then the volume can
/// be registered again (`taskrunner/volume_hook.go` `validateHostVolumes`, `task_runner.go`
/// `Run`, `restarts.go` `handleStartError`, `nomad/host_volume_endpoint.go`
/// `validateVolumeUpdate`).
#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_client_kills_allocations_whose_host_volume_did_not_come_back() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let node = sim.node_id("node-1");
        let path = sim.path().join("data");
        std::fs::create_dir_all(&path).unwrap();
        let r = sim
            .put(
                "/v1/volume/host/register",
                json!({"Volume": {"Name": "data", "NodeID": node, "HostPath": path}}),
            )
            .await;
        let vol = r["Volume"]["ID"].as_str().unwrap().to_string();
        sim.wait_for(5, "volume ready", || async {
            (sim.get(&format!("/v1/volume/host/{vol}")).await["State"] == "ready").then_some(())
        })
        .await;
        let job = sim
            .run_job(
                r#"job "uses" {
  group "g" {
    reschedule {
      attempts  = 0
      unlimited = false
    }
    volume "data" {
      type   = "host"
      source = "data"
    }
    task "t" {
      driver = "raw_exec"
      kill_timeout = "1s"
      restart {
        attempts = 1
        delay    = "2s"
        interval = "1m"
        mode     = "fail"
      }
      config {
        command = "/bin/sleep"
        args    = ["1000"]
      }
    }
  }
}"#,
            )
            .await;
        let alloc = sim
            .wait_for(20, "the task running", || async {
                sim.job_allocs(&job)
                    .await
                    .into_iter()
                    .find(|a| a["ClientStatus"] == "running")
            })
            .await;
        let id = alloc["ID"].as_str().unwrap().to_string();
        std::fs::remove_dir_all(&path).unwrap();
        let r = sim
            .put(&format!("/v1/sim/node/{node}/restart"), json!({}))
            .await;
        assert_eq!(r["DroppedHostVolumes"], json!([vol]));
        // The hook fails with an unrecoverable error: no restart, whatever the policy (one
        // attempt here); the task is killed and the allocation fails.
        let a = sim
            .wait_for(15, "the allocation failed", || async {
                let a = sim.get(&format!("/v1/allocation/{id}")).await;
                (a["ClientStatus"] == "failed").then_some(a)
            })
            .await;
        let events = a["TaskStates"]["t"]["Events"].as_array().unwrap();
        let hook = events
            .iter()
            .find(|e| e["Type"] == "Task hook failed")
            .expect("a Task hook failed event");
        assert_eq!(
            hook["Message"],
            "volumes: host volume validation error: 1 error occurred:\n\t* missing data\n\n"
        );
        let not_restarting = events
            .iter()
            .find(|e| e["Type"] == "Not Restarting")
            .expect("a Not Restarting event");
        assert_eq!(not_restarting["RestartReason"], "Error was unrecoverable");
        let evs: Vec<&str> = events
            .iter()
            .map(|e| e["Type"].as_str().unwrap())
            .collect();
        assert!(
            evs.ends_with(&["Task hook failed", "Not Restarting", "Killing", "Terminated", "Killed"]),
            "{evs:?}"
        );
        assert!(!evs.contains(&"Restarting"), "not restarted: {evs:?}");
        assert_eq!(a["TaskStates"]["t"]["Failed"], true);
        let again = json!({"Volume": {"Name": "data", "NodeID": node, "HostPath": sim.path().join("data"), "ID": vol}});
        std::fs::create_dir_all(&path).unwrap();
        // Client-terminal: the volume can be registered again.
        sim.put("/v1/volume/host/register", again).await;
        sim.wait_for(5, "volume ready again", || async {
            (sim.get(&format!("/v1/volume/host/{vol}")).await["State"] == "ready").then_some(())
        })
        .await;
    })
    .await
    .expect("test timed out");
}

/// Host volume registration and deletion as `HostVolume.Register` and `HostVolume.Delete`
/// answer them: their own checks are uncoded errors (500: node ID, host path, `Validate`,
/// an unknown node); a node the servers have no connection to (down) turns its volumes
/// `unavailable`, cannot take a registration ("No path to node") and refuses a delete
/// unless `force=true` (`nomad/host_volume_endpoint.go`, `nomad/client_rpc.go`
/// `findNodeConnAndForward`, `nomad/state/state_store_host_volumes.go`).
#[tokio::test(flavor = "multi_thread")]
async fn host_volume_register_and_delete_answer_as_nomad_on_bad_input_and_a_down_node() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("heartbeat_grace = \"1s\"\nclient \"node-1\" {}\n").await;
        let node = sim.node_id("node-1");
        let path = sim.path().join("v");
        std::fs::create_dir_all(&path).unwrap();
        let sim = &sim;
        let reg = |v: Value| async move {
            let (s, _, b) = sim
                .req(Method::PUT, "/v1/volume/host/register", Some(json!({ "Volume": v })))
                .await;
            (s, b)
        };
        for (v, want) in [
            (
                json!({"Name": "v", "HostPath": path}),
                "cannot register volume: node ID is required".to_string(),
            ),
            (
                json!({"Name": "v", "NodeID": node}),
                "cannot register volume: host path is required".to_string(),
            ),
            (
                json!({"NodeID": node, "HostPath": path}),
                "volume validation failed: missing name".to_string(),
            ),
            (
                json!({"Name": "v", "NodeID": node, "HostPath": path, "ID": "not-a-uuid"}),
                "volume validation failed: invalid ID \"not-a-uuid\"".to_string(),
            ),
        ] {
            assert_eq!(reg(v).await, (500, want));
        }
        let (s, b) = reg(json!({"Name": "v", "NodeID": "5c0ffee0-0000-4000-8000-000000000000", "HostPath": path})).await;
        assert_eq!(s, 500, "{b}");
        assert!(
            b.starts_with("validating volume \"") && b.ends_with("against state failed: node \"5c0ffee0-0000-4000-8000-000000000000\" does not exist"),
            "{b}"
        );
        let r = sim
            .put(
                "/v1/volume/host/register",
                json!({"Volume": {"Name": "v", "NodeID": node, "HostPath": path}}),
            )
            .await;
        let id = r["Volume"]["ID"].as_str().unwrap().to_string();
        // `CanonicalizeForRegister` leaves a registered volume's PluginID as sent (none).
        assert_eq!(r["Volume"]["PluginID"], "", "{r}");
        sim.wait_for(5, "volume ready", || async {
            (sim.get(&format!("/v1/volume/host/{id}")).await["State"] == "ready").then_some(())
        })
        .await;

        sim.put(&format!("/v1/sim/node/{node}/heartbeat?stop=true"), json!({}))
            .await;
        sim.wait_for(10, "the node down", || async {
            (sim.get(&format!("/v1/node/{node}")).await["Status"] == "down").then_some(())
        })
        .await;
        assert_eq!(
            sim.get(&format!("/v1/volume/host/{id}")).await["State"],
            "unavailable"
        );
        let (s, b) = reg(json!({"Name": "w", "NodeID": node, "HostPath": path})).await;
        assert_eq!((s, b.as_str()), (500, "No path to node"));
        let del = |q: &'static str| {
            let id = id.clone();
            let sim = &sim;
            async move {
                let (s, _, b) = sim
                    .req(Method::DELETE, &format!("/v1/volume/host/{id}{q}"), None)
                    .await;
                (s, b)
            }
        };
        assert_eq!(
            del("").await,
            (
                500,
                "volume cannot be removed from unknown node without force=true".into()
            )
        );
        assert_eq!(del("?force=maybe").await, (400, "invalid force value".into()));
        assert_eq!(del("?force=true").await.0, 200);
        let (s, _, _) = sim
            .req(Method::GET, &format!("/v1/volume/host/{id}"), None)
            .await;
        assert_eq!(s, 404);
        sim.put(&format!("/v1/sim/node/{node}/heartbeat?stop=false"), json!({}))
            .await;
    })
    .await
    .expect("test timed out");
}

/// A system job's allocations, as (node ID, job version, desired status, create time ns).
async fn system_allocs(sim: &Sim, job: &str) -> Vec<(String, u64, String, i64)> {
    sim.job_allocs(job)
        .await
        .into_iter()
        .map(|a| {
            (
                a["NodeID"].as_str().unwrap().to_string(),
                a["JobVersion"].as_u64().unwrap(),
                a["DesiredStatus"].as_str().unwrap().to_string(),
                a["CreateTime"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// Nomad 1.10's system scheduler (`scheduler/scheduler_system.go` `computeJobAllocs`,
/// `evictAndPlace`; `Evaluation.NextRollingEval`): with a rolling `update` block an update
/// replaces `max_parallel` allocations, then the next ones `stagger` later, node by node; a
/// replacement names the allocation it replaces. Without an `update` block every node's
/// allocation is replaced at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_system_job_update_goes_node_by_node_under_max_parallel_and_stagger() {
    let sim =
        Sim::start("client \"node-1\" {}\nclient \"node-2\" {}\nclient \"node-3\" {}\n").await;
    let job = |name: &str, update: &str, version: &str| {
        format!(
            r#"job "{name}" {{
  type = "system"
  {update}
  group "d" {{
    task "d" {{
      driver = "raw_exec"
      kill_timeout = "1s"
      env {{
        RELEASE = "{version}"
      }}
      config {{
        command = "/bin/sleep"
        args = ["1000"]
      }}
    }}
  }}
}}"#
        )
    };
    let rolling = "update {\n    max_parallel = 1\n    stagger = \"2s\"\n  }";
    for (name, update) in [("rolling", rolling), ("at-once", "")] {
        sim.run_job(&job(name, update, "1")).await;
        sim.wait_for(30, "three running allocations", || async {
            let a = sim.job_allocs(name).await;
            (a.iter().filter(|a| a["ClientStatus"] == "running").count() == 3).then_some(())
        })
        .await;
    }
    let at_once = sim.get("/v1/job/at-once").await;
    assert_eq!(at_once["Update"]["MaxParallel"], 0, "{}", at_once["Update"]);
    let updated_at = std::time::Instant::now();
    for (name, update) in [("rolling", rolling), ("at-once", "")] {
        sim.run_job(&job(name, update, "2")).await;
    }

    // Without an update block: all three replaced in one plan.
    sim.wait_for(10, "every at-once allocation replaced", || async {
        let a = system_allocs(&sim, "at-once").await;
        (a.iter().filter(|a| a.1 == 1 && a.2 == "run").count() == 3).then_some(())
    })
    .await;
    // Rolling: one node first; the others stay on version 0 until the stagger passes.
    sim.wait_for(10, "the first rolling replacement", || async {
        let a = system_allocs(&sim, "rolling").await;
        (a.iter().any(|a| a.1 == 1)).then_some(())
    })
    .await;
    if updated_at.elapsed() < Duration::from_millis(1500) {
        let a = system_allocs(&sim, "rolling").await;
        let new = a.iter().filter(|a| a.1 == 1).count();
        let old_running = a.iter().filter(|a| a.1 == 0 && a.2 == "run").count();
        assert_eq!((new, old_running), (1, 2), "not one node at a time: {a:?}");
    }
    sim.wait_for(20, "every rolling allocation replaced", || async {
        let a = system_allocs(&sim, "rolling").await;
        (a.iter().filter(|a| a.1 == 1 && a.2 == "run").count() == 3).then_some(())
    })
    .await;
    let allocs = sim.job_allocs("rolling").await;
    let mut created: Vec<i64> = allocs
        .iter()
        .filter(|a| a["JobVersion"] == 1)
        .map(|a| a["CreateTime"].as_i64().unwrap())
        .collect();
    created.sort();
    for w in created.windows(2) {
        assert!(
            w[1] - w[0] >= 2_000_000_000,
            "replacements less than the stagger apart: {created:?}"
        );
    }
    let mut nodes: Vec<&str> = allocs
        .iter()
        .filter(|a| a["JobVersion"] == 1)
        .map(|a| a["NodeID"].as_str().unwrap())
        .collect();
    nodes.sort();
    nodes.dedup();
    assert_eq!(nodes.len(), 3, "not one replacement per node");
    for a in allocs.iter().filter(|a| a["JobVersion"] == 1) {
        let a = sim
            .get(&format!("/v1/allocation/{}", a["ID"].as_str().unwrap()))
            .await;
        let prev = a["PreviousAllocation"].as_str().unwrap();
        let old = allocs
            .iter()
            .find(|o| o["ID"] == prev)
            .unwrap_or_else(|| panic!("replacement {} names no old allocation", a["ID"]));
        assert_eq!(old["NodeID"], a["NodeID"]);
        assert_eq!(old["JobVersion"], 0);
    }
}

/// `client/heartbeatstop.go`: a client that cannot heartbeat stops, after the group's
/// `disconnect { stop_on_client_after }` (or the older `stop_after_client_disconnect`), the
/// allocations of the groups that set it, while it is still cut off; a group without the
/// setting keeps running.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_cannot_heartbeat_stops_groups_with_stop_on_client_after() {
    tokio::time::timeout(Duration::from_secs(90), async {
        // Heartbeats every 0.5–1 s (`min_heartbeat_ttl`): both timeouts are longer.
        let sim = Sim::start(
            "heartbeat_grace = \"30s\"\nserver {\n  min_heartbeat_ttl = \"500ms\"\n}\nclient \"node-1\" {}\n",
        )
        .await;
        let task = r#"    task "t" {
      driver = "raw_exec"
      kill_timeout = "1s"
      config {
        command = "/bin/sleep"
        args = ["1000"]
      }
    }"#;
        sim.run_job(&format!(
            r#"job "hbstop" {{
  group "keep" {{
{task}
  }}
  group "stop" {{
    disconnect {{
      stop_on_client_after = "2s"
    }}
{task}
  }}
  group "old" {{
    stop_after_client_disconnect = "3s"
{task}
  }}
}}"#
        ))
        .await;
        let allocs = sim
            .wait_for(20, "three running allocations", || async {
                let a: Vec<Value> = sim
                    .job_allocs("hbstop")
                    .await
                    .into_iter()
                    .filter(|a| a["ClientStatus"] == "running")
                    .collect();
                (a.len() == 3).then_some(a)
            })
            .await;
        let id_of = |g: &str| {
            allocs.iter().find(|a| a["TaskGroup"] == g).unwrap()["ID"]
                .as_str()
                .unwrap()
                .to_string()
        };
        let alive = |id: &str| {
            std::fs::read_dir("/proc")
                .unwrap()
                .filter_map(|e| e.ok())
                .any(|e| {
                    std::fs::read_to_string(e.path().join("environ"))
                        .map(|env| env.contains(id))
                        .unwrap_or(false)
                })
        };
        let (keep, stop, old) = (id_of("keep"), id_of("stop"), id_of("old"));
        let node = sim.node_id("node-1");
        // Running well past 3 s while the client heartbeats.
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(alive(&keep) && alive(&stop) && alive(&old));
        let cut = std::time::Instant::now();
        sim.put(&format!("/v1/sim/node/{node}/partition?on=true"), json!({}))
            .await;
        sim.wait_for(10, "stop_on_client_after's task killed", || async {
            (!alive(&stop)).then_some(())
        })
        .await;
        let t_stop = cut.elapsed();
        sim.wait_for(10, "stop_after_client_disconnect's task killed", || async {
            (!alive(&old)).then_some(())
        })
        .await;
        let t_old = cut.elapsed();
        // The client's last heartbeat (at most 1 s before the cut: `min_heartbeat_ttl`)
        // starts the count, as Nomad's `lastOk` is its last heartbeat, not the cut.
        assert!(
            t_stop >= Duration::from_secs(1) && t_old >= Duration::from_secs(2),
            "stopped before the timeout: {t_stop:?}, {t_old:?}"
        );
        assert!(t_old > t_stop, "each group by its own timeout");
        assert!(alive(&keep), "a group without the setting keeps running");
        // The node was never marked down (grace 30 s): the client stopped them by itself.
        assert_eq!(
            sim.get(&format!("/v1/node/{node}")).await["Status"],
            "ready"
        );
        sim.put(
            &format!("/v1/sim/node/{node}/partition?on=false"),
            json!({}),
        )
        .await;
    })
    .await
    .expect("test timed out");
}

/// `client/heartbeatstop.go` counts `stop_on_client_after` from the client's last heartbeat
/// that succeeded (`client/client.go` `updateNodeStatus` → `setLastOk`), and the client
/// heartbeats once per server-given TTL (`nomad/heartbeat.go` `resetHeartbeatTimer`: 10–20 s
/// on a small cluster with Nomad's defaults): a timeout below that interval stops a healthy
/// client's allocation between two heartbeats; a longer one never does.
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_on_client_after_below_the_heartbeat_interval_stops_a_healthy_client() {
    tokio::time::timeout(Duration::from_secs(90), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let task = r#"    task "t" {
      driver = "raw_exec"
      kill_timeout = "1s"
      config {
        command = "/bin/sleep"
        args = ["1000"]
      }
    }"#;
        sim.run_job(&format!(
            r#"job "hbshort" {{
  group "short" {{
    disconnect {{
      stop_on_client_after = "3s"
    }}
{task}
  }}
  group "long" {{
    disconnect {{
      stop_on_client_after = "25s"
    }}
{task}
  }}
}}"#
        ))
        .await;
        let node = sim.node_id("node-1");
        let allocs = sim
            .wait_for(20, "two running allocations", || async {
                let a: Vec<Value> = sim
                    .job_allocs("hbshort")
                    .await
                    .into_iter()
                    .filter(|a| a["ClientStatus"] == "running")
                    .collect();
                (a.len() == 2).then_some(a)
            })
            .await;
        let id_of = |g: &str| {
            allocs.iter().find(|a| a["TaskGroup"] == g).unwrap()["ID"]
                .as_str()
                .unwrap()
                .to_string()
        };
        let alive = |id: &str| {
            std::fs::read_dir("/proc")
                .unwrap()
                .filter_map(|e| e.ok())
                .any(|e| {
                    std::fs::read_to_string(e.path().join("environ"))
                        .map(|env| env.contains(id))
                        .unwrap_or(false)
                })
        };
        let (short, long) = (id_of("short"), id_of("long"));
        // Nothing cuts the client off; its next heartbeat is at least 10 s after the last.
        sim.wait_for(30, "the short group's task killed", || async {
            (!alive(&short)).then_some(())
        })
        .await;
        assert!(
            alive(&long),
            "a timeout above the heartbeat interval keeps running"
        );
        assert_eq!(
            sim.get(&format!("/v1/node/{node}")).await["Status"],
            "ready",
            "the node was never cut off"
        );
    })
    .await
    .expect("test timed out");
}
