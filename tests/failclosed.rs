//! Fail-closed start-up checks of the real binary (issue 12, input 5): the agent refuses to
//! run in a mount namespace that is not the host's.

use std::path::Path;
use std::process::{Command, Output};

/// Runs `dhv-binder agent` (through `prefix`, e.g. `unshare -m`) against a Nomad address
/// where nothing listens, bounded by `timeout`.
fn agent(prefix: &[&str], dir: &Path) -> Output {
    let mut args: Vec<String> = vec!["60".into()];
    args.extend(prefix.iter().map(|s| s.to_string()));
    args.push(env!("CARGO_BIN_EXE_dhv-binder").into());
    args.push("agent".into());
    Command::new("timeout")
        .args(&args)
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--socket")
        .arg(dir.join("api.sock"))
        .arg("--plugin-dir")
        .arg(dir.join("plugins"))
        .env_clear()
        .env("NOMAD_ADDR", "http://127.0.0.1:1")
        .output()
        .expect("run the agent")
}

#[test]
fn the_agent_refuses_a_private_mount_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let out = agent(
        &["unshare", "--mount", "--propagation", "unchanged"],
        dir.path(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.contains("private mount namespace") && stderr.contains("raw_exec"),
        "{stderr}"
    );
    assert!(
        !dir.path().join("state").exists(),
        "the agent touched its state before the check"
    );

    // The same agent in the host's namespace passes the check and stops only at Nomad.
    let out = agent(&[], dir.path());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(69), "{stderr}");
    assert!(!stderr.contains("private mount namespace"), "{stderr}");
}
