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
