//! A scratch cgroup (cgroup v2) of the test's own: every cgroup a test makes lives under it,
//! and on drop every process left in it is killed and every cgroup under it removed.

#![allow(dead_code)]

use dhv_binder::node::helpers;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A cgroup `<cgroup2 mount>/dhv-binder-test-<uuid>`.
pub struct ScratchCgroup {
    pub path: PathBuf,
}

impl ScratchCgroup {
    /// Makes one; fails the test, saying why, where cgroup v2 is not mounted or writable.
    pub fn new() -> ScratchCgroup {
        let mount = helpers::cgroup2_mount()
            .expect("read /proc/self/mountinfo")
            .expect("no cgroup v2 filesystem is mounted on this machine (see /proc/self/mountinfo): the helper-cgroup tests need one (Linux 5.14 or later for cgroup.kill)");
        let path = mount.join(format!("dhv-binder-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir(&path).unwrap_or_else(|e| {
            panic!(
                "cannot make the scratch cgroup {} (the tests run as root on a writable cgroup2 mount): {e}",
                path.display()
            )
        });
        ScratchCgroup { path }
    }

    /// The cgroup `<cgroup2 mount>/<name>` (made; fails the test if it exists), removed on
    /// drop as [`ScratchCgroup::new`]'s.
    pub fn at(name: &str) -> ScratchCgroup {
        let mount = helpers::cgroup2_mount()
            .expect("read /proc/self/mountinfo")
            .expect(
                "no cgroup v2 filesystem is mounted on this machine (see /proc/self/mountinfo)",
            );
        let path = mount.join(name);
        std::fs::create_dir(&path)
            .unwrap_or_else(|e| panic!("cannot make the scratch cgroup {}: {e}", path.display()));
        ScratchCgroup { path }
    }

    /// A child cgroup, made if missing.
    pub fn child(&self, name: &str) -> PathBuf {
        let p = self.path.join(name);
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    /// Kills every process in `cgroup` (and below) and waits until it is empty.
    pub fn kill(cgroup: &Path) {
        helpers::kill(cgroup).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while helpers::populated(cgroup).unwrap() {
            assert!(
                Instant::now() < deadline,
                "{} did not empty",
                cgroup.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ScratchCgroup {
    fn drop(&mut self) {
        let _ = helpers::kill(&self.path);
        let deadline = Instant::now() + Duration::from_secs(10);
        while helpers::populated(&self.path).unwrap_or(false) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = helpers::remove(&self.path);
    }
}
