//! A third-party client that no one here wrote: python-nomad (PyPI, pinned in
//! scripts/install-deps) runs `tests/python/python_nomad_client.py` against the simulator, with
//! ACLs on and two nodes. Missing python3 or python-nomad fails the test (never a skip).

mod common;
use common::Sim;
use std::process::Command;
use std::time::{Duration, Instant};

const ROOT: &str = "0b1d2a3c-0000-4000-8000-00000000beef";

fn python() -> &'static str {
    let out = Command::new("python3")
        .args(["-c", "import nomad"])
        .output()
        .unwrap_or_else(|e| panic!("python3 is required for this test and was not found: {e}; run scripts/install-deps"));
    assert!(
        out.status.success(),
        "python-nomad is required for this test and is not importable by python3: {}; run scripts/install-deps",
        String::from_utf8_lossy(&out.stderr)
    );
    "python3"
}

#[tokio::test(flavor = "multi_thread")]
async fn python_nomad_client_against_the_sim() {
    let py = python();
    let sim = Sim::start(&format!(
        "event_heartbeat_interval = \"1s\"\nacl {{\n  enabled = true\n  bootstrap_token = \"{ROOT}\"\n}}\nclient \"node-1\" {{}}\nclient \"node-2\" {{}}\n"
    ))
    .await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/python_nomad_client.py"
    );
    let mut child = tokio::process::Command::new(py)
        .arg(script)
        .env("NOMAD_ADDR", &sim.server)
        .env("SIM_MANAGEMENT_TOKEN", ROOT)
        .env_remove("NOMAD_TOKEN")
        .env("NODE1", sim.node_id("node-1"))
        .env("NODE2", sim.node_id("node-2"))
        .env_remove("NOMAD_NAMESPACE")
        .env_remove("NOMAD_REGION")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn python3");
    let started = Instant::now();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let read = |mut r: Box<dyn tokio::io::AsyncRead + Unpin + Send>| async move {
        let mut s = String::new();
        let _ = tokio::io::AsyncReadExt::read_to_string(&mut r, &mut s).await;
        s
    };
    let (out, err, status) = match tokio::time::timeout(Duration::from_secs(180), async {
        tokio::join!(read(Box::new(stdout)), read(Box::new(stderr)), child.wait())
    })
    .await
    {
        Ok(r) => r,
        Err(_) => panic!(
            "python-nomad script timed out\n--- agent log ---\n{}",
            sim.log()
        ),
    };
    let status = status.expect("wait python3");
    assert!(
        status.success(),
        "python-nomad script failed ({status}) after {:?}\n--- stdout ---\n{out}\n--- stderr ---\n{err}\n--- agent log ---\n{}",
        started.elapsed(),
        sim.log()
    );
    assert!(out.contains("checks passed"), "{out}");
    println!("{out}");
}
