//! `artifact` blocks (docs/simulator.md, "Artifacts"): a tar.gz fetched over HTTP from a
//! loopback server, checked against its sha256 and unpacked into the task directory before
//! the task starts; a checksum mismatch fails the download with go-getter's message.

mod common;

use common::Sim;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Serves `body` for every request on a loopback port; returns the port.
/// Submits `hcl` as `nomad job run -var sha=<sha>` does: `/v1/jobs/parse` with `Variables`.
async fn run_with_sha(sim: &Sim, hcl: &str, sha: Option<&str>) {
    let vars = sha.map(|s| format!("sha = \"{s}\"\n")).unwrap_or_default();
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/jobs/parse", sim.server))
        .json(&serde_json::json!({"JobHCL": hcl, "Canonicalize": true, "Variables": vars}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let job: serde_json::Value = resp.json().await.unwrap();
    sim.put("/v1/jobs", serde_json::json!({"Job": job})).await;
}

async fn serve(body: Vec<u8>) -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            let body = body.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nContent-Type: application/gzip\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(&body).await;
            });
        }
    });
    port
}

/// A batch job whose artifact's checksum is the variable `sha` (default all zeros).
fn job(name: &str, port: u16) -> String {
    format!(
        r#"variable "sha" {{
  type    = string
  default = "0000000000000000000000000000000000000000000000000000000000000000"
}}

job "{name}" {{
  type = "batch"
  group "g" {{
    restart {{
      attempts = 0
      mode     = "fail"
    }}
    task "t" {{
      driver = "raw_exec"
      artifact {{
        source      = "http://127.0.0.1:{port}/hello_0.1.0.tar.gz"
        destination = "local/"
        options {{
          checksum = "sha256:${{var.sha}}"
        }}
      }}
      config {{
        command = "/bin/sh"
        args    = ["local/hello/run.sh"]
      }}
    }}
  }}
}}"#
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_checked_tarball_is_unpacked_into_the_task_dir_and_a_mismatch_fails() {
    tokio::time::timeout(Duration::from_secs(60), async {
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir(src.path().join("hello")).unwrap();
        std::fs::write(src.path().join("hello/run.sh"), "exit 0\n").unwrap();
        let tgz = src.path().join("hello.tar.gz");
        let st = std::process::Command::new("tar")
            .arg("-czf")
            .arg(&tgz)
            .arg("-C")
            .arg(src.path())
            .arg("hello")
            .status()
            .unwrap();
        assert!(st.success(), "tar must be installed");
        let body = std::fs::read(&tgz).unwrap();
        let out = std::process::Command::new("sha256sum")
            .arg(&tgz)
            .output()
            .unwrap();
        let sha = String::from_utf8(out.stdout).unwrap()[..64].to_string();
        let port = serve(body).await;
        let sim = Sim::start("client \"node-1\" {}").await;

        run_with_sha(&sim, &job("good", port), Some(&sha)).await;
        let a = sim
            .wait_for(20, "the good job to finish", || async {
                let a = sim.job_allocs("good").await.first()?.clone();
                matches!(a["ClientStatus"].as_str(), Some("complete" | "failed")).then_some(a)
            })
            .await;
        let evs = a["TaskStates"]["t"]["Events"].as_array().unwrap();
        let types: Vec<&str> = evs.iter().filter_map(|e| e["Type"].as_str()).collect();
        assert_eq!(a["ClientStatus"], "complete", "{types:?} {a:#}");
        assert!(types.contains(&"Downloading Artifacts"), "{types:?}");

        // The variable's default: the wrong sum.
        let wrong = "0".repeat(64);
        run_with_sha(&sim, &job("bad", port), None).await;
        let a = sim
            .wait_for(20, "the bad job to fail", || async {
                let a = sim.job_allocs("bad").await.first()?.clone();
                (a["ClientStatus"] == "failed").then_some(a)
            })
            .await;
        let evs = a["TaskStates"]["t"]["Events"].as_array().unwrap();
        let failed = evs
            .iter()
            .find(|e| e["Type"] == "Failed Artifact Download")
            .unwrap_or_else(|| panic!("no download failure: {evs:#?}"));
        let msg = failed["DownloadError"].as_str().unwrap();
        assert!(
            msg.starts_with(&format!(
                "failed to download artifact \"http://127.0.0.1:{port}/hello_0.1.0.tar.gz\": Checksums did not match for "
            )) && msg.contains(&format!("\nExpected: {wrong}\nGot: {sha}\n")),
            "{msg}"
        );
        assert!(
            !evs.iter().any(|e| e["Type"] == "Started"),
            "the task never started"
        );
    })
    .await
    .expect("test timed out");
}
