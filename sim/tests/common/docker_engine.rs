//! A private Docker engine for a test: `scripts/dockerd-private` under the test's own temp dir
//! (its data root, exec root, socket; no network plumbing), with the example image
//! `dhv-binder-example:local` built from busybox and curl. Stopped on drop: containers removed,
//! dockerd and its containerd ended, nothing left mounted. [`DockerEngine::shared`] lets the
//! tests of one binary that run at once use one engine.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, Weak};

/// The image every docker test runs (built locally, never pulled).
pub const IMAGE: &str = "dhv-binder-example:local";

/// A running private dockerd.
pub struct DockerEngine {
    /// Its scratch dir (removed on drop).
    pub dir: tempfile::TempDir,
    /// `unix://<dir>/docker.sock`.
    pub host: String,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|a| a.join("scripts/dockerd-private"))
        .find(|p| p.exists())
        .expect("scripts/dockerd-private not found above the crate")
}

impl DockerEngine {
    /// Starts the engine; panics saying why when it cannot (dockerd or busybox missing: run
    /// scripts/install-deps as root).
    pub fn start() -> DockerEngine {
        let dir = tempfile::Builder::new()
            .prefix("dhv-docker-")
            .tempdir()
            .expect("tempdir");
        let out = Command::new(script())
            .arg("start")
            .arg(dir.path())
            .output()
            .expect("run scripts/dockerd-private (needs bash)");
        let engine = DockerEngine {
            host: format!("unix://{}/docker.sock", dir.path().display()),
            dir,
        };
        assert!(
            out.status.success(),
            "could not start a private Docker engine (run scripts/install-deps as root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        engine
    }

    /// The engine shared by the tests of this binary that run at the same time: the first
    /// caller starts it, and it stops when the last of them drops its handle (a test that
    /// starts later gets a new one), so no engine outlives the tests that used it.
    pub fn shared() -> Arc<DockerEngine> {
        static SHARED: Mutex<Weak<DockerEngine>> = Mutex::new(Weak::new());
        let mut slot = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = slot.upgrade() {
            return e;
        }
        let e = Arc::new(DockerEngine::start());
        *slot = Arc::downgrade(&e);
        e
    }

    /// IDs of the containers (running or not) of allocation `alloc_id`, by Nomad's label:
    /// empty when the driver removed them all.
    pub fn containers_of(&self, alloc_id: &str) -> String {
        self.docker(&[
            "ps",
            "-aq",
            "--filter",
            &format!("label=com.hashicorp.nomad.alloc_id={alloc_id}"),
        ])
    }

    /// Runs the docker CLI against this engine; returns stdout (panics on failure).
    pub fn docker(&self, args: &[&str]) -> String {
        let out = Command::new("docker")
            .env("DOCKER_HOST", &self.host)
            .args(args)
            .output()
            .expect("run docker");
        assert!(
            out.status.success(),
            "docker {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for DockerEngine {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .arg("stop")
            .arg(self.dir.path())
            .status();
    }
}
