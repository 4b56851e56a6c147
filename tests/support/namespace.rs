//! Mount namespaces that tests make as a task's or a service's: each holds a copy of every
//! mount of the host at the moment it is made, other tests' volumes included, and another
//! test's agent rightly treats such a copy as its volume's holder (an unpublish waits for a
//! private copy; a fence kills whoever holds a copy). Tests that run beside each other (the
//! lanes of `scripts/test-lanes`, the threads of one binary) must not hold each other's
//! volumes: a namespace made here drops every mount under the temporary directory but its
//! own test's before it runs anything.

#![allow(dead_code)]

use std::path::Path;

/// A shell snippet, run first inside a new mount namespace: lazily unmounts (in that
/// namespace only) every mount under the temporary directory that is not under `keep`
/// (the test's own sandbox), deepest first. A slave or private namespace's unmounts do not
/// reach the host. `keep` = `None` drops them all.
pub fn drop_foreign_mounts(keep: Option<&Path>) -> String {
    let tmp = std::env::temp_dir();
    let keep = keep.map(|k| k.display().to_string()).unwrap_or_default();
    format!(
        r#"awk -v tmp='{tmp}/' -v keep='{keep}' 'index($5, tmp) == 1 && (keep == "" || ($5 != keep && index($5, keep "/") != 1)) {{ print $5 }}' /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done; "#,
        tmp = tmp.display().to_string().trim_end_matches('/'),
    )
}

/// A process in a mount namespace of its own (as a task's or a service's), holding none of
/// the other tests' mounts ([`drop_foreign_mounts`]); killed and reaped on drop.
pub struct Namespaced(std::process::Child);

impl Namespaced {
    /// Runs `unshare --mount --propagation <propagation> sh -c <script>` after dropping the
    /// mounts of every test but the one whose sandbox is `sandbox`, and waits until `script`
    /// prints `ready` (it holds what it should then). Panics if it does not.
    pub fn start(sandbox: &Path, propagation: &str, script: &str) -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new("unshare")
            .args(["--mount", "--propagation", propagation, "sh", "-c"])
            .arg(format!("{}{script}", drop_foreign_mounts(Some(sandbox))))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("unshare (util-linux), as root");
        let out = child.stdout.take().expect("piped stdout");
        let process = Namespaced(child);
        let mut line = String::new();
        std::io::BufReader::new(out)
            .read_line(&mut line)
            .expect("its ready line");
        assert_eq!(
            line.trim(),
            "ready",
            "the namespace's process did not start"
        );
        process
    }

    /// A task's namespace: `target` bound (`--rbind`) at `inner` (created), which the host's
    /// unmount of `target` does not reach, so it holds the volume until it exits.
    pub fn holding(sandbox: &Path, target: &Path, inner: &Path) -> Self {
        std::fs::create_dir_all(inner).expect("the bind's directory");
        Self::start(
            sandbox,
            "slave",
            &format!(
                "mount --rbind '{}' '{}' && cd / && echo ready && exec sleep 600",
                target.display(),
                inner.display()
            ),
        )
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// True while the process runs.
    pub fn alive(&mut self) -> bool {
        self.0.try_wait().expect("its status").is_none()
    }

    /// True when its namespace has a mount at `target`.
    pub fn has_mount_at(&self, target: &Path) -> bool {
        let table = std::fs::read_to_string(format!("/proc/{}/mountinfo", self.pid()))
            .expect("its mount table");
        let want = target.display().to_string();
        table
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
    }

    /// Kills it and waits for its exit.
    pub fn end(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Namespaced {
    fn drop(&mut self) {
        self.end();
    }
}
