//! Whether anything holds one mount, answered by the kernel in O(1): the mount's reference
//! count, read through `umount2(2)` with `MNT_EXPIRE`.
//!
//! Every open file, working directory, root, executable and memory mapping on a mount, and
//! every mount stacked on it or below it, holds a reference to it (`struct path` pins its
//! `vfsmount`; `mnt_set_mountpoint` counts a child mount). `umount2(target, MNT_EXPIRE)`
//! (`fs/namespace.c`, `do_umount`) refuses with `EBUSY` when the count is anything but the
//! mount's own reference and the call's lookup, and otherwise marks the mount "expired" and
//! refuses with `EAGAIN`. A second such call on a marked mount unmounts it; any use of the
//! mount through a path clears the mark (`mntput`), while the call's own lookup does not
//! (`path_umount` keeps it on purpose). So [`mount_use`] clears the mark before it asks (a
//! `statx` of the target) and after (another), and asks only when the first `statx` shows
//! the expected mount on top of the target: the question never unmounts anything a
//! dhv-binder call marked. Should another program have marked the mount between our
//! `statx` and the call, the kernel unmounts it only because nothing used it, which is what
//! the unpublish asking was about to do (its plugin's `unpublish` is idempotent).
//!
//! The count covers the mount itself in the calling (host) namespace only: a task's
//! namespace holds a copy of the mount with a count of its own, and another bind of the
//! same content is another mount. The holder scan reads those first ([`crate::holders`])
//! and asks the kernel only for a volume with no other mount anywhere. The count is a
//! superset of what a scan of `/proc` can find (it also counts a loop device backed by a
//! file on the mount, a descriptor in flight on a unix socket, the agent's own probes), so
//! an idle answer means a scan would find nobody; a busy one only sends the caller to that
//! scan, which decides and names the holders.
//!
//! Neither call reaches the filesystem's server: `statx` with `AT_STATX_DONT_SYNC` is
//! answered from the inode cache (NFS, FUSE, CIFS and Ceph), and `umount2` looks the target
//! up with `LOOKUP_MOUNTPOINT`, which revalidates nothing.

use rustix::fs::{statx, AtFlags, StatxFlags, CWD};
use std::path::Path;

/// What the kernel says of a mount's use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountUse {
    /// Nothing but the mount tree holds the mount: no file, directory, mapping or mount on
    /// it in this namespace.
    Idle,
    /// Something holds a reference to it (who, only a scan of `/proc` can tell).
    Busy,
    /// The kernel could not be asked, or the target's mount changed while asking
    /// (the reason): decide by scanning `/proc`.
    Unknown(String),
}

/// The ID of the mount on top of `target` (`statx` with `STATX_MNT_ID`, answered from the
/// filesystem's cache), following no symbolic link at the end. Also clears the expiry mark
/// of that mount (the lookup's `mntput`).
fn top_mount_id(target: &Path) -> Result<u64, String> {
    let st = statx(
        CWD,
        target,
        AtFlags::STATX_DONT_SYNC | AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::MNT_ID,
    )
    .map_err(|e| format!("statx {}: {e}", target.display()))?;
    if !StatxFlags::from_bits_retain(st.stx_mask).contains(StatxFlags::MNT_ID) {
        return Err("the kernel gives no mount ID through statx (before Linux 5.8)".into());
    }
    Ok(st.stx_mnt_id)
}

/// Asks the kernel whether the mount `mount_id` (mountinfo's first field), on top of
/// `target` in this process's mount namespace, is used by anything: [`MountUse::Idle`]
/// only when the mount on top of `target` was `mount_id` before and after the question and
/// the kernel found nothing but the mount tree holding it. Any other answer is
/// [`MountUse::Busy`] (the kernel counts a reference) or [`MountUse::Unknown`] (with why:
/// the target could not be looked up, another mount is on top, the call was refused).
/// Needs `CAP_SYS_ADMIN`; three system calls, none of which waits for a filesystem server.
/// Blocking only as `statx` is.
pub fn mount_use(target: &Path, mount_id: u32) -> MountUse {
    let expected = u64::from(mount_id);
    match top_mount_id(target) {
        Ok(id) if id == expected => {}
        Ok(id) => {
            return MountUse::Unknown(format!(
                "mount {id} is on top of {}, not mount {mount_id}",
                target.display()
            ))
        }
        Err(e) => return MountUse::Unknown(e),
    }
    let asked = nix::mount::umount2(
        target,
        nix::mount::MntFlags::MNT_EXPIRE | nix::mount::MntFlags::UMOUNT_NOFOLLOW,
    );
    // Clears the mark an idle answer leaves, and checks that the question was about the
    // expected mount (nothing was mounted over or under it meanwhile).
    let after = top_mount_id(target);
    match asked {
        Err(nix::errno::Errno::EAGAIN) => match after {
            Ok(id) if id == expected => MountUse::Idle,
            Ok(id) => MountUse::Unknown(format!(
                "mount {id} came on top of {} while it was checked",
                target.display()
            )),
            Err(e) => MountUse::Unknown(e),
        },
        Err(nix::errno::Errno::EBUSY) => MountUse::Busy,
        Err(e) => MountUse::Unknown(format!("umount2 MNT_EXPIRE {}: {e}", target.display())),
        Ok(()) => {
            // Another program marked it after our statx, and nothing used it: the kernel
            // unmounted the unused mount, as the unpublish was about to.
            tracing::warn!(
                target = %target.display(),
                "an expired-marked mount was unmounted by the in-use check (something else marked it with MNT_EXPIRE); the plugin's unpublish completes the release"
            );
            MountUse::Idle
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mounts::scratch::Scratch;
    use crate::mounts::MountTable;
    use std::process::{Child, Command, Stdio};

    fn id_at(target: &Path) -> u32 {
        MountTable::read_self()
            .unwrap()
            .top_at(target)
            .expect("a mount at the target")
            .id
    }

    /// A child killed and reaped on drop, also when the test fails.
    struct Held(Child);

    impl Drop for Held {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// Starts `sh -c script` and waits for its "ready" line.
    fn hold(script: &str, cwd: Option<&Path>) -> Held {
        use std::io::BufRead;
        let mut c = Command::new("sh");
        c.args(["-c", script]).stdout(Stdio::piped());
        if let Some(d) = cwd {
            c.current_dir(d);
        }
        let mut child = Held(c.spawn().expect("spawn sh"));
        let mut line = String::new();
        std::io::BufReader::new(child.0.stdout.take().expect("piped"))
            .read_line(&mut line)
            .expect("read the ready line");
        assert_eq!(
            line.trim(),
            "ready",
            "the holder `sh -c {script}` did not start (python3 comes with scripts/install-deps)"
        );
        child
    }

    #[test]
    fn an_unused_mount_is_idle_and_asking_again_never_unmounts_it() {
        let s = Scratch::new();
        let t = s.tmpfs("v");
        let id = id_at(&t);
        for _ in 0..3 {
            assert_eq!(mount_use(&t, id), MountUse::Idle);
            assert_eq!(id_at(&t), id, "the mount stays");
        }
    }

    #[test]
    fn files_directories_mappings_and_child_mounts_make_it_busy() {
        let s = Scratch::new();
        let t = s.tmpfs("v");
        let id = id_at(&t);
        std::fs::write(t.join("f"), "x").unwrap();
        {
            let _open = hold(
                &format!(
                    "exec 3<'{}'; echo ready; exec sleep 600",
                    t.join("f").display()
                ),
                None,
            );
            assert_eq!(mount_use(&t, id), MountUse::Busy, "an open file");
        }
        {
            let _cwd = hold("echo ready; exec sleep 600", Some(&t));
            assert_eq!(mount_use(&t, id), MountUse::Busy, "a working directory");
        }
        {
            // A mapping alone: the child closes the file once it is mapped.
            let _mapped = hold(
                &format!(
                    "exec python3 -c \"import mmap,time; f=open('{}','rb'); m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ); f.close(); print('ready', flush=True); time.sleep(600)\"",
                    t.join("f").display()
                ),
                None,
            );
            assert_eq!(mount_use(&t, id), MountUse::Busy, "a mapping");
        }
        {
            let inner = s.tmpfs("v/inner");
            assert_eq!(mount_use(&t, id), MountUse::Busy, "a mount inside it");
            nix::mount::umount(&inner).unwrap();
        }
        assert_eq!(
            mount_use(&t, id),
            MountUse::Idle,
            "nothing holds it any more"
        );
    }

    #[test]
    fn another_mount_on_top_or_none_is_unknown() {
        let s = Scratch::new();
        let t = s.tmpfs("v");
        let id = id_at(&t);
        let over = s.tmpfs("v");
        assert_eq!(over, t);
        assert!(
            matches!(mount_use(&t, id), MountUse::Unknown(why) if why.contains("on top")),
            "the stacked mount is not the one asked about"
        );
        nix::mount::umount(&t).unwrap();
        assert_eq!(mount_use(&t, id), MountUse::Idle);
        nix::mount::umount(&t).unwrap();
        assert!(matches!(mount_use(&t, id), MountUse::Unknown(_)));
        assert!(matches!(
            mount_use(&s.path().join("missing"), id),
            MountUse::Unknown(_)
        ));
    }
}
