//! The Task API socket: served in every task's secrets directory while the task runs,
//! authenticated even with ACLs off (no token 401, a bad one 403, a workload identity or
//! ACL token passes), removed when the task stops.

mod common;
use common::Sim;
use std::path::Path;
use std::time::Duration;

async fn over(sock: &Path, path: &str, header: Option<(&str, &str)>) -> (u16, String) {
    let c = reqwest::Client::builder()
        .unix_socket(sock)
        .build()
        .unwrap();
    let mut rb = c.get(format!("http://localhost{path}"));
    if let Some((k, v)) = header {
        rb = rb.header(k, v);
    }
    let r = rb.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread")]
async fn task_api_socket_requires_a_token_and_goes_away_with_the_task() {
    tokio::time::timeout(Duration::from_secs(120), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let job = sim
            .run_job(
                r#"job "api" {
  type = "batch"
  group "g" {
    task "t" {
      driver = "raw_exec"
      config {
        command = "/bin/sleep"
        args    = ["120"]
      }
      identity {
        file = true
      }
    }
  }
}"#,
            )
            .await;
        let alloc = sim
            .wait_for(60, "the task running", || async {
                sim.job_allocs(&job)
                    .await
                    .into_iter()
                    .find(|a| a["TaskStates"]["t"]["State"] == "running")
            })
            .await;
        let secrets = sim.nodes[0]
            .3
            .join("alloc")
            .join(alloc["ID"].as_str().unwrap())
            .join("t/secrets");
        let sock = secrets.join("api.sock");
        assert!(sock.exists(), "no Task API socket at {}", sock.display());
        let token = std::fs::read_to_string(secrets.join("nomad_token")).unwrap();

        let (s, body) = over(&sock, "/v1/agent/self", None).await;
        assert_eq!((s, body.as_str()), (401, "Unauthorized"));
        let (s, body) = over(
            &sock,
            "/v1/agent/self",
            Some(("X-Nomad-Token", "not-a-token")),
        )
        .await;
        assert_eq!((s, body.as_str()), (403, "Forbidden"));
        let (s, body) = over(
            &sock,
            "/v1/agent/self",
            Some(("X-Nomad-Token", token.trim())),
        )
        .await;
        assert_eq!(s, 200, "{body}");
        let me: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(me["stats"]["client"]["node_id"], sim.nodes[0].1.as_str());
        let bearer = format!("bearer {}", token.trim());
        let (s, body) = over(&sock, "/v1/agent/self", Some(("Authorization", &bearer))).await;
        assert_eq!(s, 200, "{body}");

        // Through a client agent an uncoded server error carries `rpc error: `
        // (`helper/pool/pool.go` `ConnPool.RPC`); the server's own address has none.
        let gone = "/v1/volume/host/00000000-0000-0000-0000-000000000000";
        let node_addr = &sim.nodes[0].2;
        for (addr, want) in [
            (&sim.server, "no such volume: "),
            (node_addr, "rpc error: no such volume: "),
        ] {
            let r = sim
                .http
                .delete(format!("{addr}{gone}"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 500);
            let body = r.text().await.unwrap();
            assert!(body.starts_with(want), "{addr}: {body}");
        }
        // During an election the Task API cannot authenticate (`ACL.WhoAmI` fails):
        // 500 "Server error authenticating request"; the client agent's address answers a
        // forwarded request with "rpc error: No cluster leader".
        sim.put("/v1/sim/leader?leader=false", serde_json::json!({}))
            .await;
        let token_header = Some(("X-Nomad-Token", token.trim()));
        let (s, body) = over(&sock, "/v1/agent/self", token_header).await;
        assert_eq!(
            (s, body.as_str()),
            (500, "Server error authenticating request\n")
        );
        let r = sim
            .http
            .get(format!("{node_addr}/v1/jobs"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 500);
        assert_eq!(r.text().await.unwrap(), "rpc error: No cluster leader");
        sim.put("/v1/sim/leader?leader=true", serde_json::json!({}))
            .await;
        let (s, body) = over(&sock, "/v1/agent/self", token_header).await;
        assert_eq!(s, 200, "{body}");

        let r = sim
            .http
            .delete(format!("{}/v1/job/{job}", sim.server))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        sim.wait_for(60, "the socket removed with the task", || async {
            (!sock.exists()).then_some(())
        })
        .await;
    })
    .await
    .expect("test timed out");
}

/// A client agent that restarts is away for a while (`PUT /v1/sim/node/:id/restart?down=`):
/// its address refuses connections and its tasks' Task API sockets are gone; they come back
/// (the socket at the same path) once it has restored and registered, and the tasks never
/// stopped (`client/client.go` `NewClient`, `command/agent/http.go` `builtinAPI.Serve`,
/// `taskrunner/api_hook.go` `apiHook.Prestart`).
#[tokio::test(flavor = "multi_thread")]
async fn a_restarting_client_takes_its_address_and_task_api_away_until_it_is_back() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let sim = Sim::start("client \"node-1\" {}\n").await;
        let job = sim
            .run_job(
                r#"job "api" {
  group "g" {
    task "t" {
      driver = "raw_exec"
      kill_timeout = "1s"
      config {
        command = "/bin/sleep"
        args    = ["120"]
      }
      identity {
        file = true
      }
    }
  }
}"#,
            )
            .await;
        let alloc = sim
            .wait_for(30, "the task running", || async {
                sim.job_allocs(&job)
                    .await
                    .into_iter()
                    .find(|a| a["TaskStates"]["t"]["State"] == "running")
            })
            .await;
        let id = alloc["ID"].as_str().unwrap().to_string();
        let secrets = sim.nodes[0].3.join("alloc").join(&id).join("t/secrets");
        let sock = secrets.join("api.sock");
        let token = std::fs::read_to_string(secrets.join("nomad_token")).unwrap();
        let auth = Some(("X-Nomad-Token", token.trim()));
        assert_eq!(over(&sock, "/v1/agent/self", auth).await.0, 200);
        let node = sim.node_id("node-1");
        let node_addr = sim.nodes[0].2.clone();

        let restart = {
            let (http, server) = (sim.http.clone(), sim.server.clone());
            let node = node.clone();
            tokio::spawn(async move {
                let t0 = std::time::Instant::now();
                let r = http
                    .put(format!("{server}/v1/sim/node/{node}/restart?down=3s"))
                    .send()
                    .await
                    .unwrap();
                (r.status().as_u16(), t0.elapsed())
            })
        };
        sim.wait_for(5, "the Task API socket gone", || async {
            (!sock.exists()).then_some(())
        })
        .await;
        let refused = sim
            .http
            .get(format!("{node_addr}/v1/agent/self"))
            .send()
            .await;
        assert!(
            refused.as_ref().is_err_and(|e| e.is_connect()),
            "the restarting client's address answered: {refused:?}"
        );
        let (status, took) = restart.await.unwrap();
        assert_eq!(status, 200);
        assert!(took >= Duration::from_secs(3), "{took:?}");
        // The restored task's socket is bound again as the agent comes back (the file
        // appears at bind(2), a moment before listen(2): poll until it answers).
        sim.wait_for(5, "the Task API answering again", || async {
            let c = reqwest::Client::builder()
                .unix_socket(sock.as_path())
                .build()
                .ok()?;
            let r = c
                .get("http://localhost/v1/agent/self")
                .header("X-Nomad-Token", token.trim())
                .send()
                .await
                .ok()?;
            (r.status().as_u16() == 200).then_some(())
        })
        .await;
        let r = sim
            .http
            .get(format!("{node_addr}/v1/agent/self"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        let after = sim.get(&format!("/v1/allocation/{id}")).await;
        assert_eq!(after["ClientStatus"], "running");
        assert_eq!(
            after["TaskStates"]["t"]["StartedAt"],
            alloc["TaskStates"]["t"]["StartedAt"]
        );
        assert_eq!(
            sim.get(&format!("/v1/node/{node}")).await["Status"],
            "ready",
            "a 3 s restart is within the heartbeat grace"
        );
    })
    .await
    .expect("test timed out");
}
