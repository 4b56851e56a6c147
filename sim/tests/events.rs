//! Event stream: framing, heartbeats, inclusive index, closest resume, index=0 replay, filters.

mod common;
use common::{Sim, Stream};
use serde_json::json;

const CFG: &str =
    "event_buffer_size = 5\nevent_heartbeat_interval = \"1s\"\nclient \"node-1\" {}\n";

async fn put_var(sim: &Sim, path: &str, v: &str) -> u64 {
    let r = sim
        .put(&format!("/v1/var/{path}"), json!({"Items": {"v": v}}))
        .await;
    r["ModifyIndex"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn framing_heartbeat_and_index_semantics() {
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        let sim = Sim::start(CFG).await;
        // Heartbeat `{}` immediately on subscribe.
        let mut s = Stream::open(&sim, "topic=Variable").await;
        assert_eq!(s.next(5).await.unwrap(), json!({}));
        let i1 = put_var(&sim, "a/one", "1").await;
        let f = s.frame(5).await.unwrap();
        assert_eq!(f["Index"].as_u64().unwrap(), i1);
        let ev = &f["Events"][0];
        assert_eq!(ev["Topic"], "Variable");
        assert_eq!(ev["Type"], "VariableUpdated");
        assert_eq!(ev["Key"], "a/one");
        assert_eq!(ev["Index"].as_u64().unwrap(), i1);
        let keys: Vec<&str> = ev.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        assert_eq!(
            keys,
            [
                "Topic",
                "Type",
                "Key",
                "Namespace",
                "FilterKeys",
                "Index",
                "Payload"
            ]
        );
        assert!(ev["Payload"]["Metadata"].get("Items").is_none());
        // Periodic heartbeat (1s configured).
        assert_eq!(s.next(3).await.unwrap(), json!({}));

        // Inclusive index: subscribing at i1 re-sends the frame with Index == i1.
        let mut s2 = Stream::open(&sim, &format!("topic=Variable&index={i1}")).await;
        assert_eq!(s2.next(5).await.unwrap(), json!({}));
        assert_eq!(s2.frame(5).await.unwrap()["Index"].as_u64().unwrap(), i1);

        // Fill the 5-frame buffer past capacity.
        let mut idx = vec![i1];
        for i in 0..7 {
            idx.push(put_var(&sim, &format!("a/n{i}"), "x").await);
        }
        let newest = *idx.last().unwrap();
        let oldest_buffered = idx[idx.len() - 5];
        // index older than the buffer → closest (oldest buffered), no error.
        let mut s3 = Stream::open(&sim, "topic=Variable&index=1").await;
        assert_eq!(
            s3.frame(5).await.unwrap()["Index"].as_u64().unwrap(),
            oldest_buffered
        );
        // index=0 replays the whole buffer.
        let mut s4 = Stream::open(&sim, "topic=Variable&index=0").await;
        let mut got = vec![];
        for _ in 0..5 {
            got.push(s4.frame(5).await.unwrap()["Index"].as_u64().unwrap());
        }
        assert_eq!(got, idx[idx.len() - 5..].to_vec());
        // index newer than the newest → re-sends the newest.
        let mut s5 = Stream::open(&sim, &format!("topic=Variable&index={}", newest + 1000)).await;
        assert_eq!(
            s5.frame(5).await.unwrap()["Index"].as_u64().unwrap(),
            newest
        );

        // Key filter: Variable:<path> only.
        let mut s6 =
            Stream::open(&sim, &format!("topic=Variable:a/only&index={}", newest + 1)).await;
        put_var(&sim, "a/other", "x").await;
        let want = put_var(&sim, "a/only", "x").await;
        let f = s6.frame(5).await.unwrap();
        assert_eq!(f["Index"].as_u64().unwrap(), want);
        assert_eq!(f["Events"].as_array().unwrap().len(), 1);

        // Bad params → 400 before streaming.
        let (st, _, body) = sim
            .req(reqwest::Method::GET, "/v1/event/stream?index=x", None)
            .await;
        assert_eq!(st, 400, "{body}");
        let (st, _, _) = sim
            .req(reqwest::Method::GET, "/v1/event/stream?topic=a:b:c", None)
            .await;
        assert_eq!(st, 400);
    })
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread")]
async fn allocation_events_have_nomad_shape() {
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        let sim = Sim::start(CFG).await;
        let mut s = Stream::open(&sim, "topic=Allocation&namespace=*").await;
        let job = sim
            .run_job(
                r#"job "ev" {
  type = "batch"
  group "g" {
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/sh"
        args = ["-c", "sleep 0.5"]
      }
    }
  }
}"#,
            )
            .await;
        let f = s.frame(10).await.unwrap();
        let ev = &f["Events"][0];
        assert_eq!(ev["Type"], "PlanResult");
        let a = &ev["Payload"]["Allocation"];
        assert_eq!(ev["Key"], a["ID"]);
        assert_eq!(ev["FilterKeys"], json!([job, ""]));
        assert_eq!(a["ClientStatus"], "pending");
        assert_eq!(a["DesiredStatus"], "run");
        assert!(
            a.get("Job").is_none(),
            "Job is stripped from event payloads"
        );
        // Client updates arrive as AllocationUpdated until complete.
        let mut last = String::new();
        while last != "complete" {
            let f = s.frame(10).await.expect("alloc update");
            for ev in f["Events"].as_array().unwrap() {
                assert_eq!(ev["Type"], "AllocationUpdated");
                last = ev["Payload"]["Allocation"]["ClientStatus"]
                    .as_str()
                    .unwrap()
                    .to_string();
            }
        }
        // A purge deletes the job and its allocations (`DeleteJobTxn` →
        // `deleteAllocsForJobTxn`), with no Allocation event.
        let alloc_id = a["ID"].as_str().unwrap().to_string();
        while s.frame(1).await.is_some() {} // the client's last updates of the complete alloc
        sim.req(
            reqwest::Method::DELETE,
            &format!("/v1/job/{job}?purge=true"),
            None,
        )
        .await;
        assert!(
            s.frame(2).await.is_none(),
            "no allocation event for a terminal allocation of a purged job"
        );
        let (st, _, _) = sim
            .req(
                reqwest::Method::GET,
                &format!("/v1/allocation/{alloc_id}"),
                None,
            )
            .await;
        assert_eq!(st, 404, "a purge deletes the job's allocations");
    })
    .await
    .expect("test timed out");
}

/// A job that runs `sleep` with raw_exec, its pid in `<alloc dir>/pid`.
fn sleeper(name: &str) -> String {
    format!(
        r#"job "{name}" {{
  group "g" {{
    task "t" {{
      driver = "raw_exec"
      config {{
        command = "/bin/sh"
        args = ["-c", "echo $$ > $NOMAD_ALLOC_DIR/pid; exec sleep 600"]
      }}
    }}
  }}
}}"#
    )
}

/// A purge deletes the job's allocations in the same write, running ones included
/// (`nomad/state/state_store.go` `DeleteJobTxn` → `deleteAllocsForJobTxn`, since 1.8): the
/// allocation reads 404 at once, no Allocation event is published (the Job topic has
/// `JobDeregistered` with `Deleted`), and the node's allocation index does not rise while
/// the node has other allocations (`Node.GetAllocs`: the highest ModifyIndex of the node's
/// allocations), so a blocking query on the node's allocations is not woken. The client then
/// kills the deleted allocation's tasks.
#[tokio::test(flavor = "multi_thread")]
async fn a_purge_deletes_running_allocations_at_once_without_an_allocation_event() {
    tokio::time::timeout(std::time::Duration::from_secs(60), async {
        let sim = Sim::start(CFG).await;
        let node = sim.node_id("node-1");
        let keep = sim.run_job(&sleeper("keep")).await;
        let job = sim.run_job(&sleeper("purged")).await;
        for j in [&keep, &job] {
            sim.wait_for(30, "the job running", || async {
                sim.job_allocs(j)
                    .await
                    .into_iter()
                    .find(|a| a["ClientStatus"] == "running")
            })
            .await;
        }
        let alloc = sim.job_allocs(&job).await.remove(0);
        let alloc_id = alloc["ID"].as_str().unwrap().to_string();
        let pid_file = sim
            .path()
            .join("data/node-1/alloc")
            .join(&alloc_id)
            .join("alloc/pid");
        let pid: i32 = sim
            .wait_for(10, "the task's pid", || async {
                std::fs::read_to_string(&pid_file)
                    .ok()
                    .and_then(|p| p.trim().parse().ok())
            })
            .await;
        let nodes_allocs = format!("/v1/node/{node}/allocations");
        let (_, before, _) = sim.req(reqwest::Method::GET, &nodes_allocs, None).await;
        let mut s = Stream::open(
            &sim,
            &format!(
                "topic=Allocation&topic=Job&namespace=*&index={}",
                before + 1
            ),
        )
        .await;
        while s.frame(1).await.is_some() {}
        let blocked = {
            let sim = &sim;
            let q = format!("{nodes_allocs}?index={before}&wait=2s");
            async move { sim.req(reqwest::Method::GET, &q, None).await }
        };
        let purge = async {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            sim.req(
                reqwest::Method::DELETE,
                &format!("/v1/job/{job}?purge=true"),
                None,
            )
            .await
        };
        let started = std::time::Instant::now();
        let ((st, after, body), (purged, _, _)) = tokio::join!(blocked, purge);
        assert_eq!(purged, 200);
        assert_eq!(st, 200);
        assert!(
            started.elapsed() >= std::time::Duration::from_secs(2),
            "the purge woke the node's allocations query"
        );
        assert_eq!(after, before, "the node's allocation index rose");
        let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(
            !listed.to_string().contains(&alloc_id),
            "the purged allocation is still listed"
        );
        let (st, _, _) = sim
            .req(
                reqwest::Method::GET,
                &format!("/v1/allocation/{alloc_id}"),
                None,
            )
            .await;
        assert_eq!(st, 404, "a purge deletes a running allocation at once");
        let f = s.frame(5).await.expect("the purge's frame");
        let events = f["Events"].as_array().unwrap();
        assert!(
            events.iter().all(|e| e["Topic"] != "Allocation"),
            "an allocation event for a purge: {f}"
        );
        let dereg = events
            .iter()
            .find(|e| e["Topic"] == "Job")
            .expect("the Job topic's deregistration");
        assert_eq!(dereg["Type"], "JobDeregistered");
        assert_eq!(dereg["Key"], job.as_str());
        assert_eq!(dereg["Payload"]["Deleted"], true);
        assert!(
            s.frame(2).await.is_none_or(|f| f["Events"]
                .as_array()
                .unwrap()
                .iter()
                .all(|e| e["Topic"] != "Allocation")),
            "an allocation event after the purge"
        );
        sim.wait_for(15, "the task killed by its client", || async {
            let alive = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok();
            (!alive).then_some(())
        })
        .await;
    })
    .await
    .expect("test timed out");
}
