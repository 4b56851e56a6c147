//! Test harness: runs a `nomad-sim agent` in a temp dir and talks to it over HTTP.
#![allow(dead_code)]

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running agent; SIGTERM + wait on drop.
pub struct Sim {
    pub dir: tempfile::TempDir,
    pub child: Child,
    pub server: String,
    pub nodes: Vec<(String, String, String, PathBuf)>, // name, id, address, data_dir
    pub http: reqwest::Client,
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_nomad-sim")
}

impl Sim {
    /// Starts an agent; `clients` is HCL appended to the generated config (client blocks etc.).
    pub async fn start(extra: &str) -> Sim {
        Sim::start_env(extra, &[]).await
    }

    /// Like [`Sim::start`], with extra environment variables for the agent process.
    pub async fn start_env(extra: &str, env: &[(&str, &str)]) -> Sim {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        let cfg = format!(
            "data_dir = \"{}\"\nbind_addr = \"127.0.0.1\"\nports {{ http = 0 }}\n{extra}\n",
            data.display()
        );
        let cfg_path = dir.path().join("agent.hcl");
        std::fs::write(&cfg_path, cfg).unwrap();
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let child = Command::new(bin())
            .args(["agent", "-config"])
            .arg(&cfg_path)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn nomad-sim");
        let ready = data.join("ready.json");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ready.exists() {
            assert!(
                Instant::now() < deadline,
                "agent did not become ready: {}",
                std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let r: Value = serde_json::from_slice(&std::fs::read(&ready).unwrap()).unwrap();
        let nodes = r["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| {
                (
                    n["name"].as_str().unwrap().to_string(),
                    n["id"].as_str().unwrap().to_string(),
                    n["address"].as_str().unwrap().to_string(),
                    PathBuf::from(n["data_dir"].as_str().unwrap()),
                )
            })
            .collect();
        Sim {
            server: r["server"]["address"].as_str().unwrap().to_string(),
            nodes,
            child,
            dir,
            http: reqwest::Client::new(),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn node_id(&self, name: &str) -> String {
        self.nodes.iter().find(|n| n.0 == name).unwrap().1.clone()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// (status, X-Nomad-Index, body)
    pub async fn req(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, u64, String) {
        self.req_tok(method, path, body, None).await
    }

    /// Like [`Sim::req`] with an `X-Nomad-Token`.
    pub async fn req_tok(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        token: Option<&str>,
    ) -> (u16, u64, String) {
        let mut r = self
            .http
            .request(method, format!("{}{}", self.server, path));
        if let Some(t) = token {
            r = r.header("X-Nomad-Token", t);
        }
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r.send().await.expect("request");
        let status = resp.status().as_u16();
        let idx = resp
            .headers()
            .get("x-nomad-index")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        (status, idx, resp.text().await.unwrap())
    }

    pub async fn get(&self, path: &str) -> Value {
        let (s, _, b) = self.req(reqwest::Method::GET, path, None).await;
        assert_eq!(s, 200, "GET {path}: {b}");
        serde_json::from_str(&b).unwrap()
    }

    pub async fn put(&self, path: &str, body: Value) -> Value {
        let (s, _, b) = self.req(reqwest::Method::PUT, path, Some(body)).await;
        assert_eq!(s, 200, "PUT {path}: {b}");
        serde_json::from_str(&b).unwrap_or(Value::Null)
    }

    /// Parses and registers a jobspec; returns the job ID.
    pub async fn run_job(&self, hcl: &str) -> String {
        let job = self
            .http
            .post(format!("{}/v1/jobs/parse", self.server))
            .json(&serde_json::json!({"JobHCL": hcl, "Canonicalize": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(job.status(), 200);
        let job: Value = job.json().await.unwrap();
        self.put("/v1/jobs", serde_json::json!({"Job": job})).await;
        job["ID"].as_str().unwrap().to_string()
    }

    /// Polls `f` every 100 ms until it returns Some or `secs` pass.
    pub async fn wait_for<T, F, Fut>(&self, secs: u64, what: &str, mut f: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(v) = f().await {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}\n--- agent log ---\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn job_allocs(&self, job: &str) -> Vec<Value> {
        self.get(&format!("/v1/job/{job}/allocations"))
            .await
            .as_array()
            .unwrap()
            .clone()
    }

    pub fn stop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Reads an NDJSON event stream line by line.
pub struct Stream {
    resp: reqwest::Response,
    buf: Vec<u8>,
}

impl Stream {
    pub async fn open(sim: &Sim, query: &str) -> Stream {
        Self::open_tok(sim, query, None).await
    }

    /// Like [`Stream::open`] with an `X-Nomad-Token`.
    pub async fn open_tok(sim: &Sim, query: &str, token: Option<&str>) -> Stream {
        let mut r = sim
            .http
            .get(format!("{}/v1/event/stream?{query}", sim.server));
        if let Some(t) = token {
            r = r.header("X-Nomad-Token", t);
        }
        let resp = r.send().await.unwrap();
        assert_eq!(resp.status(), 200);
        Stream {
            resp,
            buf: Vec::new(),
        }
    }

    /// Whether the server closes the stream within `secs` (lines read meanwhile are dropped).
    pub async fn closes_within(&mut self, secs: u64) -> bool {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        loop {
            match tokio::time::timeout_at(deadline, self.resp.chunk()).await {
                Ok(Ok(Some(_))) => continue,
                Ok(Ok(None)) | Ok(Err(_)) => return true,
                Err(_) => return false,
            }
        }
    }

    /// Next line as JSON, or None at EOF / after `secs`.
    pub async fn next(&mut self, secs: u64) -> Option<Value> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                return Some(serde_json::from_slice(&line).expect("ndjson line"));
            }
            match tokio::time::timeout_at(deadline, self.resp.chunk()).await {
                Ok(Ok(Some(c))) => self.buf.extend_from_slice(&c),
                _ => return None,
            }
        }
    }

    /// Next non-heartbeat frame.
    pub async fn frame(&mut self, secs: u64) -> Option<Value> {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .as_secs()
                .max(1);
            let v = self.next(left).await?;
            if v.as_object().is_some_and(|o| !o.is_empty()) {
                return Some(v);
            }
            if Instant::now() > deadline {
                return None;
            }
        }
    }
}

pub fn shared(dir: &str, name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata")
        .join(dir)
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the test data lives in testdata/ at the repository root)",
            p.display()
        )
    })
}
