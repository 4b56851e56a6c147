//! A per-test sandbox directory whose mounts are always cleaned up, even on panic.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// A temporary directory; on drop every mount below it is detached, deepest first.
pub struct Sandbox {
    dir: tempfile::TempDir,
}

impl Sandbox {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("dhv-binder-test-")
            .tempdir()
            .unwrap();
        Self { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn join(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// Detaches every mount below the sandbox.
    pub fn unmount_all(&self) {
        let mut mounts = dhv_binder::node::mounts::mounts_under(self.dir.path());
        mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for m in mounts {
            let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.unmount_all();
    }
}

/// Writes an executable shell script.
pub fn script(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, body).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A recording plugin named `name` in `plugin_dir`: it appends "<op> <namespace>/<volume>
/// <alloc>" to `<plugin_dir>/calls.log` and really bind-mounts
/// `<volumes_dir>/store/<volume id>` at the target.
pub fn recording_plugin(plugin_dir: &Path, name: &str) {
    script(
        &plugin_dir.join(name),
        r#"#!/bin/sh
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
# Nomad's contract: fingerprint gets DHV_OPERATION only.
if [ "$1" = fingerprint ]; then echo '{"version":"1.0.0","deferred_bind":true}'; exit 0; fi
# The call is logged once its work is done (a logged publish is mounted).
log() { echo "$1 $DHV_NAMESPACE/$DHV_VOLUME_NAME ${DHV_ALLOC_ID:-}" >> "$DHV_PLUGIN_DIR/calls.log"; }
case "$1" in
create) log "$1"; echo '{"bytes":1,"context":{"made":"yes"}}' ;;
publish)
  src="$DHV_VOLUMES_DIR/store/$DHV_VOLUME_ID"
  mkdir -p "$src" "$DHV_TARGET_PATH"
  mountpoint -q "$DHV_TARGET_PATH" || mount --bind "$src" "$DHV_TARGET_PATH"
  log "$1"
  echo "{\"path\":\"$DHV_TARGET_PATH\",\"context\":{}}" ;;
unpublish)
  while mountpoint -q "$DHV_TARGET_PATH"; do umount "$DHV_TARGET_PATH"; done
  log "$1"
  echo '{}' ;;
delete) log "$1"; echo '{}' ;;
esac
"#,
    );
}

/// The plugin calls recorded so far (fingerprints left out).
pub fn calls(plugin_dir: &Path) -> Vec<String> {
    std::fs::read_to_string(plugin_dir.join("calls.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.starts_with("fingerprint"))
        .map(|l| l.trim().to_string())
        .collect()
}

/// Polls `f` every 50 ms until it is true or `secs` pass; panics with `what` on timeout.
pub async fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        if f() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("timed out after {secs}s waiting for: {what}");
}

/// A plugin `name` that hands fingerprint straight to `<plugin_dir>/real` and runs `body`
/// (shell, with `$REAL` naming the real plugin) for every other operation.
pub fn wrapper_plugin(plugin_dir: &Path, name: &str, body: &str) {
    script(
        &plugin_dir.join(name),
        &format!(
            "#!/bin/sh\nPATH=/usr/bin:/bin\nREAL={real}\n[ \"$1\" = fingerprint ] && exec \"$REAL\" \"$@\"\n{body}\n",
            real = plugin_dir.join("real").display()
        ),
    );
}

/// A plugin `name` like a storage backend that refuses overlapping operations on one volume
/// (ceph-csi's "Aborted: an operation with the given volume ID already exists"): every call
/// takes `<locks>/<volume>` or fails, appending to `<locks>/aborts`; each takes `secs`.
pub fn aborting_plugin(plugin_dir: &Path, name: &str, locks: &Path, secs: &str) {
    wrapper_plugin(
        plugin_dir,
        name,
        &format!(
            "lock={locks}/$DHV_VOLUME_NAME\nmkdir -p {locks}\nif ! mkdir \"$lock\" 2>/dev/null; then echo aborted >> {locks}/aborts; echo '{{\"error\":\"Aborted: an operation with the given volume ID already exists\"}}'; exit 1; fi\nsleep {secs}\n\"$REAL\" \"$@\"; rc=$?\nrmdir \"$lock\"\nexit $rc",
            locks = locks.display()
        ),
    );
}
