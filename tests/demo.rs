//! The README's main command, `scripts/demo`, runs to its end: the simulator, one agent per
//! node with signed records, the deferred volume, the example job, publish and unpublish
//! (it broke once unnoticed when signed records became the default: no test ran it).
//!
//! The demo builds with `cargo build --workspace --bins` (already built for this test run, so
//! it only checks) and cleans up its own temporary directory, mounts included.

use std::process::Command;
use std::sync::Mutex;

/// The demos run one at a time: each checks that no mount of a demo is left, and a demo
/// still running would show its own.
static ONE_DEMO: Mutex<()> = Mutex::new(());

/// Runs `scripts/demo <args>` (one demo at a time) and checks that it succeeded, printed each
/// of `steps`, and left no mount of a demo behind.
fn run_demo(args: &[&str], steps: &[&str]) {
    let _one = ONE_DEMO.lock().unwrap_or_else(|e| e.into_inner());
    let what = format!("scripts/demo {}", args.join(" "));
    let out = Command::new("timeout")
        .args(["600", "scripts/demo"])
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("DEMO_WAIT")
        .env_remove("DOCKER_HOST")
        .output()
        .unwrap_or_else(|e| panic!("run {what} (needs bash, timeout from coreutils): {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    for step in steps {
        assert!(
            stdout.contains(step),
            "no {step:?} in the demo's output:\n{stdout}"
        );
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    assert!(
        !mounts.contains("/dhv-binder-demo."),
        "the demo left mounts behind:\n{mounts}"
    );
}

#[test]
fn the_readme_demo_runs_to_its_end_and_leaves_nothing_mounted() {
    run_demo(
        &[],
        &[
            "Making the operator's signing key",
            "is published at the placeholder before the main task started",
            "has nothing mounted",
            "is no longer a mount point",
            "The data stays in the storage",
            "Done",
        ],
    );
}

/// `scripts/demo docker`: the same story with jobspecs/example-docker.nomad.hcl, its tasks run
/// as containers on a private Docker engine the demo starts and stops; the main container's
/// write is in the volume, and no engine, container or mount is left.
#[test]
fn the_docker_demo_runs_to_its_end_and_leaves_nothing_behind() {
    run_demo(
        &["docker"],
        &[
            "Starting a private Docker engine",
            "is published at the placeholder before the main task started",
            "in the volume: hello from",
            "placement -> the main task's first write in the volume",
            "is no longer a mount point",
            "Done",
        ],
    );
}

/// Issue 46: `DEMO_WAIT=1 scripts/demo` started in the background by a shell without job
/// control (SIGINT ignored when it starts, as `scripts/demo &` in a script or nohup leaves
/// it) prints the cluster's environment to export, which works from another process, and
/// stops at SIGINT, cleaning up: its directory removed, nothing of it mounted.
#[test]
fn a_waiting_demo_in_the_background_prints_its_environment_and_stops_at_sigint() {
    use std::io::BufRead as _;
    let _one = ONE_DEMO.lock().unwrap_or_else(|e| e.into_inner());
    let mut child = Command::new("sh")
        .args(["-c", "trap '' INT; exec scripts/demo"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("DEMO_WAIT", "1")
        .env_remove("DOCKER_HOST")
        .env_remove("DHV_DEMO_SIGNALS")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run scripts/demo");
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    /// Stops the demo if the test fails before it does.
    struct Stop(nix::unistd::Pid);
    impl Drop for Stop {
        fn drop(&mut self) {
            let _ = nix::sys::signal::kill(self.0, nix::sys::signal::Signal::SIGTERM);
        }
    }
    let _stop = Stop(pid);
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let mut env = std::collections::BTreeMap::new();
    while !env.contains_key("DHV_BINDER_SOCKET") {
        let line = rx
            .recv_timeout(std::time::Duration::from_secs(600))
            .unwrap_or_else(|e| {
                panic!(
                    "the demo did not print its environment ({e}):\n{}",
                    seen.join("\n")
                )
            });
        if let Some((k, v)) = line
            .trim()
            .strip_prefix("export ")
            .and_then(|l| l.split_once('='))
        {
            env.insert(k.to_string(), v.to_string());
        }
        seen.push(line);
    }
    let text = seen.join("\n");
    assert!(
        text.contains("stop it with Ctrl-C, or kill -TERM"),
        "{text}"
    );
    // The environment, as printed, reaches the cluster from another process.
    let out = Command::new(env!("CARGO_BIN_EXE_dhv-binder"))
        .args(["volume", "status", "shared-data"])
        .env_clear()
        .env("NOMAD_ADDR", &env["NOMAD_ADDR"])
        .env("DHV_BINDER_SIGNING_KEY", &env["DHV_BINDER_SIGNING_KEY"])
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && status.contains("shared-data"),
        "{status}"
    );
    // And node-1's agent, through the socket it names.
    let out = Command::new(env!("CARGO_BIN_EXE_dhv-binder"))
        .arg("status")
        .env_clear()
        .env("DHV_BINDER_SOCKET", &env["DHV_BINDER_SOCKET"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let work = std::path::Path::new(&env["DHV_BINDER_SIGNING_KEY"])
        .parent()
        .unwrap()
        .to_path_buf();
    assert!(work.is_dir(), "{}", work.display());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the demo did not stop within 120 s of SIGINT"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(code.code(), Some(130), "{code}");
    assert!(!work.exists(), "the demo left {} behind", work.display());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    assert!(
        !mounts.contains(&work.display().to_string()),
        "the demo left mounts behind:\n{mounts}"
    );
}
