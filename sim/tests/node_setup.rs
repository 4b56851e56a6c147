//! Client start-up as Nomad's `Client.setupNode` (client/client.go) does it: a static
//! `host_volume` whose path is missing stops the client, and with it the agent.

mod common;
use common::bin;
use std::process::Command;

#[test]
fn a_missing_static_host_volume_path_refuses_the_client() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("run/dhv-binder"); // tmpfs after a reboot: gone
    let cfg = format!(
        "data_dir = \"{}\"\nbind_addr = \"127.0.0.1\"\nports {{ http = 0 }}\nclient \"node-1\" {{\n  host_volume \"dhv-binder-socket\" {{\n    path = \"{}\"\n    read_only = true\n  }}\n}}\n",
        dir.path().join("data").display(),
        missing.display()
    );
    let cfg_path = dir.path().join("agent.hcl");
    std::fs::write(&cfg_path, &cfg).unwrap();
    let out = Command::new(bin())
        .args(["agent", "-config"])
        .arg(&cfg_path)
        .output()
        .expect("run nomad-sim");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the agent started: {stderr}");
    assert!(
        stderr.contains("node setup failed: failed to validate volume dhv-binder-socket"),
        "{stderr}"
    );
    assert!(!dir.path().join("data/ready.json").exists());
    // With the directory in place (a persistent path, as the README lays out) it starts.
    std::fs::create_dir_all(&missing).unwrap();
    let mut child = Command::new(bin())
        .args(["agent", "-config"])
        .arg(&cfg_path)
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn nomad-sim");
    let ready = dir.path().join("data/ready.json");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !ready.exists() {
        assert!(
            std::time::Instant::now() < deadline && child.try_wait().unwrap().is_none(),
            "the agent did not become ready with the path present"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    child.wait().unwrap();
}
