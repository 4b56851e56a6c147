//! Fencing a volume on this node, without the network: what the agent does when its claim's
//! lease is about to end and no renewal has succeeded (docs/architecture.md, "Fencing").
//!
//! In order, each step on its own (a failed step does not stop the next):
//! 1. a FUSE mount's connection is aborted (`/sys/fs/fuse/connections/<minor>/abort`, the
//!    kernel's fusectl filesystem, Documentation/filesystems/fuse.rst): every copy of the mount,
//!    in every mount namespace, answers ENOTCONN at once;
//! 2. the host's mount of the target is made read-only (`MS_REMOUNT | MS_BIND | MS_RDONLY`):
//!    whatever is bound from it afterwards (a task restarted by its client) is read-only;
//! 3. the processes that still use the volume ([`crate::node::holders`]: a task's mount
//!    namespace holds its own copy of the mount, which step 2 does not reach, and open files
//!    keep writing) are killed (SIGKILL): every process on this node that holds the volume
//!    but the agent itself, whatever it says about itself. Whose a process is comes from its
//!    cgroup ([`crate::node::identity`]), never its environment; only processes in the
//!    cgroups the operator names as other nodes' (`--other-node-cgroup`, several nodes
//!    simulated on one host) are left. Then step 2 is tried again if it failed (EBUSY while a
//!    writer held the mount).
//!
//! Undoing the fence is the ordinary republish: the dead or read-only mount is detached and
//! published again, and the allocations that used it are restarted onto it
//! ([`crate::agent::mount_health`]).

use crate::node::holders::{self, Holder};
use crate::node::identity::NodeCgroups;
use crate::node::mounts::MountTable;
use serde::Serialize;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Where the kernel's fusectl filesystem shows FUSE connections.
pub const FUSE_CONNECTIONS: &str = "/sys/fs/fuse/connections";

/// What a fence did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct FenceReport {
    /// The target whose mount was fenced.
    pub target: PathBuf,
    /// Nothing was mounted at the target: nothing to fence.
    pub nothing_mounted: bool,
    /// The FUSE connection aborted (its number), for a FUSE mount.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fuse_aborted: Option<u32>,
    /// The host's mount is read-only now.
    pub read_only: bool,
    /// The processes killed (pid, name, allocation).
    pub stopped: Vec<Holder>,
    /// What failed (each step's error), empty when every step succeeded.
    pub errors: Vec<String>,
    /// The plugin's own `fence`, when its fingerprint declares it (run beside these steps by
    /// the agent, docs/plugin-protocol.md "fence"). Its failure is reported, and does not
    /// make the fence incomplete: the steps above decide whether a writer can remain.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plugin: Option<PluginFenced>,
}

/// What a plugin's `fence` call did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PluginFenced {
    /// The plugin's ID.
    pub plugin: String,
    /// `None` when the call succeeded; else its one-line report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl FenceReport {
    /// True when no writer can be left: nothing was mounted, or every step that applies
    /// succeeded (the holders were killed and the host's mount is read-only or aborted).
    pub fn complete(&self) -> bool {
        self.nothing_mounted || self.errors.is_empty()
    }

    /// One line for the log and the journal.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        match &self.plugin {
            Some(PluginFenced {
                plugin,
                error: None,
            }) => parts.push(format!("plugin {plugin:?} fenced it")),
            Some(PluginFenced {
                plugin,
                error: Some(e),
            }) => parts.push(format!("plugin {plugin:?} fence failed: {e}")),
            None => {}
        }
        if self.nothing_mounted {
            parts.push("nothing mounted".into());
            return parts.join("; ");
        }
        if let Some(n) = self.fuse_aborted {
            parts.push(format!("FUSE connection {n} aborted"));
        }
        if self.read_only {
            parts.push("host mount read-only".into());
        }
        if !self.stopped.is_empty() {
            let who: Vec<String> = self.stopped.iter().map(ToString::to_string).collect();
            parts.push(format!("killed {}", who.join(", ")));
        }
        parts.extend(self.errors.iter().map(|e| format!("failed: {e}")));
        parts.join("; ")
    }
}

/// Fences the volume mounted at `target` (blocking: run it off the agent's loop). Every
/// process that holds it is killed but the agent and the processes in `node`'s other nodes'
/// cgroups (the agent passes [`crate::node::identity::node`]), including those whose
/// namespace only holds a copy that the host's unmount would take along
/// ([`holders::Usage::copies`]): the read-only remount does not reach a copy, and the fence
/// unmounts nothing. Never fails as a whole: what failed is listed in
/// [`FenceReport::errors`].
pub fn fence(target: &Path, node: &NodeCgroups) -> FenceReport {
    fence_with(target, node, true)
}

/// [`fence`], killing the processes that only hold a copy the unmount takes along when
/// `copies` is true.
fn fence_with(target: &Path, node: &NodeCgroups, copies: bool) -> FenceReport {
    let mut report = FenceReport {
        target: target.to_path_buf(),
        ..FenceReport::default()
    };
    let host = match MountTable::read() {
        Ok(t) => t,
        Err(e) => {
            report
                .errors
                .push(format!("cannot read the mount table: {e}"));
            // Still make the target read-only, blind.
            remount_read_only(target, &mut report);
            return report;
        }
    };
    let Some(top) = host.top_at(target).cloned() else {
        report.nothing_mounted = true;
        return report;
    };
    if top.fs_type() == "fuse" || top.fs_type().starts_with("fuse.") {
        match abort_fuse(top.dev.minor) {
            Ok(()) => report.fuse_aborted = Some(top.dev.minor),
            Err(e) => report.errors.push(format!(
                "cannot abort FUSE connection {}: {e}",
                top.dev.minor
            )),
        }
    }
    let first = remount(target);
    match holders::scan_many(&[(top.identity(), target.to_path_buf())], &host, node) {
        Ok(mut usages) => {
            let usage = usages.pop().unwrap_or_default().without_other_nodes();
            let me = std::process::id();
            let mut seen = BTreeSet::new();
            let copies = if copies { usage.copies } else { Vec::new() };
            for h in usage.holders.into_iter().chain(copies) {
                // Pid 1 cannot be killed by a signal it does not handle (signal(7)).
                if h.pid == me || h.pid == 1 || !seen.insert(h.pid) {
                    continue;
                }
                let pid = nix::unistd::Pid::from_raw(h.pid as i32);
                match nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL) {
                    Ok(()) | Err(nix::errno::Errno::ESRCH) => report.stopped.push(h),
                    Err(e) => report
                        .errors
                        .push(format!("cannot kill pid {} ({}): {e}", h.pid, h.comm)),
                }
            }
        }
        Err(e) => report
            .errors
            .push(format!("cannot find the processes using it: {e}")),
    }
    match first {
        Ok(()) => report.read_only = true,
        Err(_) => remount_read_only(target, &mut report),
    }
    report
}

/// The most rounds [`kill_holders`] fences in.
pub const KILL_ROUNDS: usize = 10;

/// [`fence`] for an operator's forced unpublish (`volume unpublish -force -kill`): fenced
/// again, 50 ms apart, until a round finds no process left to kill (a holder's child forked
/// between a round's scan and its kill holds the mount too), at most [`KILL_ROUNDS`] rounds.
/// A process whose namespace only holds a copy the unmount takes along
/// ([`holders::Usage::copies`]) is left: the unpublish that follows removes the copy. The
/// report lists every process killed; its errors are the last round's, plus one when the
/// last round still killed a process.
pub fn kill_holders(target: &Path, node: &NodeCgroups) -> FenceReport {
    let mut report = fence_with(target, node, false);
    if report.nothing_mounted {
        return report;
    }
    let mut rounds = 1;
    let mut last_killed = !report.stopped.is_empty();
    while last_killed && rounds < KILL_ROUNDS {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let again = fence_with(target, node, false);
        rounds += 1;
        last_killed = !again.stopped.is_empty();
        report.stopped.extend(again.stopped);
        report.read_only |= again.read_only;
        report.errors = again.errors;
    }
    if last_killed {
        report.errors.push(format!(
            "processes kept taking the mount after {KILL_ROUNDS} rounds of kills"
        ));
    }
    report
}

/// `MS_REMOUNT | MS_BIND | MS_RDONLY`, keeping the mount's other flags (`nosuid`, `nodev`,
/// `noexec`, atime): a bind remount sets them all, so one left out would be lifted.
fn remount(target: &Path) -> nix::Result<()> {
    use nix::mount::MsFlags;
    let kept = crate::node::beneath::restrictions_at(target)?;
    nix::mount::mount(
        None::<&str>,
        target,
        None::<&str>,
        MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY | kept,
        None::<&str>,
    )
}

/// Makes the mount at `target` read-only, retrying a few times while writers let go (the
/// kernel refuses with EBUSY while a file is open for writing on it).
fn remount_read_only(target: &Path, report: &mut FenceReport) {
    let mut last = None;
    for _ in 0..20 {
        match remount(target) {
            Ok(()) => {
                report.read_only = true;
                return;
            }
            Err(e) => last = Some(e),
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    if let Some(e) = last {
        report.errors.push(format!(
            "cannot remount {} read-only: {e}",
            target.display()
        ));
    }
}

/// Aborts FUSE connection `n` (the minor device number of the FUSE mount), mounting the
/// fusectl filesystem first when it is not.
fn abort_fuse(n: u32) -> std::io::Result<()> {
    let root = Path::new(FUSE_CONNECTIONS);
    let abort = root.join(n.to_string()).join("abort");
    if !abort.exists() && root.is_dir() {
        // Not mounted yet (most distributions mount it at boot); the error, if any, shows
        // in the write below.
        let _ = nix::mount::mount(
            Some("fusectl"),
            root,
            Some("fusectl"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        );
    }
    std::fs::write(&abort, b"1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_target_has_nothing_to_fence() {
        let dir = tempfile::tempdir().unwrap();
        let r = fence(dir.path(), &NodeCgroups::default());
        assert!(r.nothing_mounted && r.complete(), "{r:?}");
        assert_eq!(r.summary(), "nothing mounted");
    }

    #[test]
    fn the_plugins_fence_is_in_the_summary_and_does_not_decide_completeness() {
        let mut r = FenceReport {
            read_only: true,
            plugin: Some(PluginFenced {
                plugin: "bind".into(),
                error: Some("plugin \"bind\" fence failed (exit code 1): busy".into()),
            }),
            ..FenceReport::default()
        };
        assert!(r.complete(), "{r:?}");
        assert_eq!(
            r.summary(),
            "plugin \"bind\" fence failed: plugin \"bind\" fence failed (exit code 1): busy; host mount read-only"
        );
        r.plugin = Some(PluginFenced {
            plugin: "bind".into(),
            error: None,
        });
        assert_eq!(
            serde_json::to_value(&r).unwrap()["plugin"],
            serde_json::json!({"plugin": "bind"})
        );
        assert!(
            r.summary().starts_with("plugin \"bind\" fenced it; "),
            "{}",
            r.summary()
        );
    }

    /// A writer in the host's namespace appending to a file on a bind-mounted volume is
    /// killed (also when its environment names another allocation), the mount becomes
    /// read-only, and nothing more is appended.
    #[test]
    fn a_writer_is_stopped_and_the_mount_made_read_only() {
        let sb = crate::node::mounts::scratch::Scratch::new();
        let export = sb.tmpfs("export");
        let target = sb.dir("target");
        sb.rbind(&export, &target);
        let file = target.join("log");
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "while :; do echo x >> {}; sleep 0.05; done",
                file.display()
            ))
            .spawn()
            .unwrap();
        // Let it write, and open the file for writing for as long as it runs.
        // It says it is a task of an allocation this node does not know: no matter.
        let mut hold = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("exec 3>>{}; sleep 60", file.display()))
            .env("NOMAD_ALLOC_ID", "0b9a3c2e-1111-4000-8000-0000000000ff")
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let r = fence(&target, &NodeCgroups::default());
        assert!(r.complete(), "{r:?}");
        assert!(r.read_only, "{r:?}");
        let pids: BTreeSet<u32> = r.stopped.iter().map(|h| h.pid).collect();
        assert!(pids.contains(&hold.id()), "{r:?}");
        let _ = child.kill();
        let _ = child.wait();
        let _ = hold.wait();
        let err = std::fs::OpenOptions::new()
            .append(true)
            .open(&file)
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(nix::libc::EROFS), "{err}");
    }

    /// A holder that forks a new holder between a round's scan and its kill (a shell loop
    /// running `sleep`) leaves no process holding the mount after [`kill_holders`].
    #[test]
    fn kill_holders_leaves_no_holder_behind() {
        let sb = crate::node::mounts::scratch::Scratch::new();
        let export = sb.tmpfs("export");
        let target = sb.dir("target");
        sb.rbind(&export, &target);
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg("while :; do sleep 0.3 & sleep 0.01; done")
            .current_dir(&target)
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let r = kill_holders(&target, &NodeCgroups::default());
        let _ = child.wait();
        assert!(r.complete(), "{r:?}");
        let host = MountTable::read().unwrap();
        let top = host.top_at(&target).cloned().unwrap();
        let left = holders::scan_many(
            &[(top.identity(), target.clone())],
            &host,
            &NodeCgroups::default(),
        )
        .unwrap()
        .pop()
        .unwrap_or_default()
        .without_other_nodes()
        .holders;
        let me = std::process::id();
        assert!(
            left.iter().all(|h| h.pid == me),
            "left holding the mount: {left:?}"
        );
    }

    /// The fence's read-only remount keeps the mount's `nosuid`, `nodev` and `noexec`: a
    /// bind remount sets every per-mount flag, and one left out was lifted (a fenced
    /// volume ran setuid binaries).
    #[test]
    fn the_fence_keeps_nosuid_nodev_and_noexec() {
        use nix::mount::MsFlags;
        use nix::sys::statvfs::{statvfs, FsFlags};
        let sb = crate::node::mounts::scratch::Scratch::new();
        let export = sb.tmpfs("export");
        let target = sb.dir("target");
        sb.rbind(&export, &target);
        let hard = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        nix::mount::mount(
            None::<&str>,
            &target,
            None::<&str>,
            MsFlags::MS_REMOUNT | MsFlags::MS_BIND | hard,
            None::<&str>,
        )
        .unwrap();
        let r = fence(&target, &NodeCgroups::default());
        assert!(r.complete() && r.read_only, "{r:?}");
        let f = statvfs(&target).unwrap().flags();
        for st in [
            FsFlags::ST_RDONLY,
            FsFlags::ST_NOSUID,
            FsFlags::ST_NODEV,
            FsFlags::ST_NOEXEC,
        ] {
            assert!(f.contains(st), "{st:?} lifted by the fence: {f:?}");
        }
    }
}
