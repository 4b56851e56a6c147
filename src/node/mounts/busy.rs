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
//! `statx` of the target) and after (another), asks one target at a time, and asks only
//! when the first `statx` shows the expected mount on top of the target: the question never
//! unmounts anything a dhv-binder call marked. Should another program have marked the mount
//! between our `statx` and the call, the kernel unmounts it, and only because nothing used
//! it; the answer is then [`MountUse::Unknown`], so the caller scans as without this check.
//!
//! The count covers the mount itself in the calling (host) namespace only: a task's
//! namespace holds a copy of the mount with a count of its own, and another bind of the
//! same content is another mount. The holder scan reads those first (`crate::node::holders`)
//! and asks the kernel only for a volume with no other mount anywhere. The count is a
//! superset of what a scan of `/proc` can find (it also counts a loop device backed by a
//! file on the mount, a descriptor in flight on a unix socket, the agent's own probes), so
//! an idle answer means a scan would find nobody; a busy one only sends the caller to that
//! scan, which decides and names the holders.
//!
//! Neither call reaches the filesystem's server: `statx` with `AT_STATX_DONT_SYNC` is
//! answered from the inode cache (NFS, FUSE, CIFS and Ceph) and with `AT_NO_AUTOMOUNT`
//! starts no automount, and `umount2` looks the target up with `LOOKUP_MOUNTPOINT`, which
//! revalidates nothing. (The rare unmount above may wait for the server in its final
//! release, as the plugin's own unmount would.)

use super::DeviceId;
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

/// `STATX_MNT_ID_UNIQUE` (Linux 6.8, `include/uapi/linux/stat.h`): a 64-bit mount ID never
/// used again (mountinfo's IDs are used again at once: three mounts made one after another
/// at one path may all get the same one). Rustix names no constant for it.
const STATX_MNT_ID_UNIQUE: u32 = 0x4000;

/// What `statx` shows of the mount on top of a target: mountinfo's mount ID and the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Top {
    id: u64,
    dev: DeviceId,
}

/// One `statx` of `target` asking for `mask`, answered from the filesystem's cache, following
/// no symbolic link at the end and starting no automount. Also clears the expiry mark of the
/// mount on top (the lookup's `mntput`). `None` when the kernel does not give that field.
fn mount_field(target: &Path, mask: StatxFlags) -> Result<Option<(u64, DeviceId)>, String> {
    let st = statx(
        CWD,
        target,
        AtFlags::STATX_DONT_SYNC | AtFlags::SYMLINK_NOFOLLOW | AtFlags::NO_AUTOMOUNT,
        mask,
    )
    .map_err(|e| format!("statx {}: {e}", target.display()))?;
    let dev = DeviceId {
        major: st.stx_dev_major,
        minor: st.stx_dev_minor,
    };
    Ok(StatxFlags::from_bits_retain(st.stx_mask)
        .contains(mask)
        .then_some((st.stx_mnt_id, dev)))
}

/// The mount on top of `target` ([`Top`], `STATX_MNT_ID`: Linux 5.8).
fn top(target: &Path) -> Result<Top, String> {
    match mount_field(target, StatxFlags::MNT_ID)? {
        Some((id, dev)) => Ok(Top { id, dev }),
        None => Err("the kernel gives no mount ID through statx (before Linux 5.8)".into()),
    }
}

/// The unique ID of the mount on top of `target`, where the kernel has one (Linux 6.8).
fn unique(target: &Path) -> Result<Option<u64>, String> {
    Ok(mount_field(target, StatxFlags::from_bits_retain(STATX_MNT_ID_UNIQUE))?.map(|(id, _)| id))
}

/// One question at a time from this process: a second `MNT_EXPIRE` on a mount the first
/// marked would unmount it.
static ASKING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Asks the kernel whether the mount `mount_id` (mountinfo's first field) of device `dev`,
/// on top of `target` in this process's mount namespace, is used by anything.
/// [`MountUse::Idle`] only when `statx` shows that mount (ID and device) on top of `target`
/// before the question, the same one after it (the same unique mount ID where the kernel
/// has one, Linux 6.8; else the same ID and device), and the kernel found nothing but the
/// mount tree holding it. [`MountUse::Busy`] when the kernel counts a reference.
/// [`MountUse::Unknown`] (with why) otherwise: the target could not be looked up, another
/// mount is on top or came during the question, the call was refused (an LSM, no
/// `CAP_SYS_ADMIN`), or the kernel unmounted the mount because another program had marked
/// it. At most five system calls, none of which waits for a filesystem server; blocking
/// only as `statx` is. Calls from this process are made one at a time.
pub fn mount_use(target: &Path, mount_id: u32, dev: DeviceId) -> MountUse {
    let _one = ASKING.lock().unwrap_or_else(|e| e.into_inner());
    let expected = Top {
        id: u64::from(mount_id),
        dev,
    };
    let before = match top(target).and_then(|t| Ok((t, unique(target)?))) {
        Ok((t, u)) if t == expected => u,
        Ok((t, _)) => {
            return MountUse::Unknown(format!(
                "mount {} (device {}) is on top of {}, not mount {mount_id} (device {dev})",
                t.id,
                t.dev,
                target.display()
            ))
        }
        Err(e) => return MountUse::Unknown(e),
    };
    let asked = nix::mount::umount2(
        target,
        nix::mount::MntFlags::MNT_EXPIRE | nix::mount::MntFlags::UMOUNT_NOFOLLOW,
    );
    // Clears the mark an idle answer leaves, and checks that the question was about the
    // expected mount (nothing was mounted over it or put in its place meanwhile).
    let same = match before {
        Some(u) => unique(target).map(|after| after == Some(u)),
        None => top(target).map(|after| after == expected),
    };
    match (asked, same) {
        (Err(nix::errno::Errno::EAGAIN), Ok(true)) => MountUse::Idle,
        (Err(nix::errno::Errno::EAGAIN), Ok(false)) => MountUse::Unknown(format!(
            "the mount on top of {} changed while it was checked",
            target.display()
        )),
        (Err(nix::errno::Errno::EAGAIN), Err(e)) => MountUse::Unknown(e),
        (Err(nix::errno::Errno::EBUSY), _) => MountUse::Busy,
        (Err(e), _) => MountUse::Unknown(format!("umount2 MNT_EXPIRE {}: {e}", target.display())),
        (Ok(()), _) => {
            // Another program marked the mount after our statx, and nothing used it: the
            // kernel unmounted it. The scan decides as without this check (it finds the
            // mount gone), and the plugin's idempotent unpublish completes the release.
            tracing::warn!(
                target = %target.display(),
                "the in-use check unmounted the volume's mount: another program had marked it with MNT_EXPIRE and nothing used it"
            );
            MountUse::Unknown(format!(
                "{} was unmounted by the kernel during the check (marked MNT_EXPIRE by another program)",
                target.display()
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::mounts::scratch::Scratch;
    use crate::node::mounts::MountTable;
    use std::process::{Child, Command, Stdio};

    /// The mount ID and device of the mount on top of `target`, from the table.
    fn id_at(target: &Path) -> (u32, DeviceId) {
        let t = MountTable::read_self().unwrap();
        let top = t.top_at(target).expect("a mount at the target");
        (top.id, top.dev)
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
            assert_eq!(mount_use(&t, id.0, id.1), MountUse::Idle);
            assert_eq!(id_at(&t), id, "the mount stays");
        }
        // No mark is left behind: a plain MNT_EXPIRE now only marks it (a mark left by the
        // check would make this call unmount it).
        assert_eq!(
            nix::mount::umount2(&t, nix::mount::MntFlags::MNT_EXPIRE),
            Err(nix::errno::Errno::EAGAIN)
        );
        assert_eq!(id_at(&t), id, "the mount stays");
        // A mark left by another program is cleared before the question is asked.
        assert_eq!(mount_use(&t, id.0, id.1), MountUse::Idle);
        assert_eq!(id_at(&t), id, "the mount stays");
        // The same ID on another device is another mount.
        let other = DeviceId {
            major: id.1.major,
            minor: id.1.minor + 1,
        };
        assert!(matches!(mount_use(&t, id.0, other), MountUse::Unknown(_)));
        assert_eq!(id_at(&t), id, "the mount stays");
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
            assert_eq!(mount_use(&t, id.0, id.1), MountUse::Busy, "an open file");
        }
        {
            let _cwd = hold("echo ready; exec sleep 600", Some(&t));
            assert_eq!(
                mount_use(&t, id.0, id.1),
                MountUse::Busy,
                "a working directory"
            );
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
            assert_eq!(mount_use(&t, id.0, id.1), MountUse::Busy, "a mapping");
        }
        {
            let inner = s.tmpfs("v/inner");
            assert_eq!(
                mount_use(&t, id.0, id.1),
                MountUse::Busy,
                "a mount inside it"
            );
            nix::mount::umount(&inner).unwrap();
        }
        assert_eq!(
            mount_use(&t, id.0, id.1),
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
            matches!(mount_use(&t, id.0, id.1), MountUse::Unknown(why) if why.contains("on top")),
            "the stacked mount is not the one asked about"
        );
        nix::mount::umount(&t).unwrap();
        assert_eq!(mount_use(&t, id.0, id.1), MountUse::Idle);
        nix::mount::umount(&t).unwrap();
        assert!(matches!(mount_use(&t, id.0, id.1), MountUse::Unknown(_)));
        assert!(matches!(
            mount_use(&s.path().join("missing"), id.0, id.1),
            MountUse::Unknown(_)
        ));
    }
}
