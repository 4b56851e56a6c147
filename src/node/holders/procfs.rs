//! How a scan reads one process: its `/proc` directory opened once and every read made
//! relative to it (descriptors, their mount IDs, working directory, root, executable,
//! mappings), the listing of `/proc` without kernel threads, and the split of pass 2 over
//! the node's cores. What is read is decided in [`super::scan_many`].

use super::{Hold, Holder, HoldersError, Uninspected, Usage};
use crate::node::mounts::DeviceId;
use std::collections::{BTreeMap, BTreeSet};
use std::io::ErrorKind;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;

/// What one process holds on the volumes, and what of it could not be read: `None` when
/// the process is gone (a scan of a process ending as it is read).
pub(super) type Seen = Option<(Vec<(u32, Hold)>, Vec<(&'static str, std::io::Error)>)>;

/// Processes per thread below which pass 2 of a scan is not split.
const PER_THREAD: usize = 4;

/// [`inspect`] of every process in `procs`, in order. A scan's time is the number of
/// processes times the system calls each costs (about 60 with their descriptors and
/// mappings, a few microseconds each): the processes are split over up to as many
/// threads as the node has cores, about [`PER_THREAD`] or more each, so that the scan before
/// an unpublish does not make it wait for one core to read all of `/proc` (issue 10).
/// The work and what it reads are the same as on one thread.
pub(super) fn inspect_all(
    procs: &[u32],
    any: &BTreeSet<u32>,
    devs: &BTreeSet<DeviceId>,
) -> Vec<(u32, Seen)> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.min(procs.len() / PER_THREAD).max(1);
    let one = |chunk: &[u32]| -> Vec<(u32, Seen)> {
        chunk
            .iter()
            .map(|&pid| (pid, inspect(pid, any, devs)))
            .collect()
    };
    if threads == 1 {
        return one(procs);
    }
    let size = procs.len().div_ceil(threads);
    std::thread::scope(|s| {
        let mut chunks = procs.chunks(size);
        let first = chunks.next().unwrap_or_default();
        // A thread that cannot be started leaves its share to this one.
        let others: Vec<(&[u32], std::io::Result<_>)> = chunks
            .map(|c| {
                let thread = std::thread::Builder::new()
                    .name("holders-scan".into())
                    .spawn_scoped(s, move || one(c));
                (c, thread)
            })
            .collect();
        let mut out = one(first);
        for (c, thread) in others {
            match thread.map(|t| t.join()) {
                Ok(Ok(seen)) => out.extend(seen),
                // A thread that panicked: its processes are reported as not inspected,
                // as when their descriptors cannot be read (their namespaces were read
                // in pass 1; a descriptor on the host's mount fails the unmount, EBUSY).
                Ok(Err(_)) => out.extend(c.iter().map(|&pid| {
                    let e = std::io::Error::other("the scan of this process failed");
                    (pid, Some((Vec::new(), vec![("proc", e)])))
                })),
                // A thread that could not be started: its share is read here.
                Err(_) => out.extend(one(c)),
            }
        }
        out
    })
}

/// Pass 2 of a scan for one process: what it holds open on any of the volumes' mounts
/// (`any`, devices `devs`).
pub(super) fn inspect(pid: u32, any: &BTreeSet<u32>, devs: &BTreeSet<DeviceId>) -> Seen {
    let mut holds: Vec<(u32, Hold)> = Vec::new();
    let mut unread = Vec::new();
    // Every read below is made relative to the process's own `/proc` directory: one
    // lookup of `/proc/<pid>` per process instead of one per file, and all of them of
    // this process (were it to end and its pid be used again, they fail).
    let dir = match proc_dir(pid) {
        Ok(dir) => dir,
        Err(e) if gone(&e) => return None,
        Err(e) => {
            unread.push(("proc", e));
            return Some((holds, unread));
        }
    };
    for (link, how) in [("cwd", Hold::Cwd), ("root", Hold::Root), ("exe", Hold::Exe)] {
        match link_mount(&dir, link) {
            Ok(Some(id)) if any.contains(&id) => holds.push((id, how)),
            Ok(_) => {}
            Err(e) if gone(&e) || link == "exe" => {} // an exiting process has no exe
            Err(e) => unread.push((link, e)),
        }
    }
    match open_fds(&dir, any) {
        Ok(fds) => holds.extend(
            fds.into_iter()
                .map(|(id, fd, path)| (id, Hold::OpenFile { fd, path })),
        ),
        Err(e) if gone(&e) => {}
        Err(e) => unread.push(("fd", e)),
    }
    match mapped(&dir, devs, any) {
        Ok(paths) => holds.extend(
            paths
                .into_iter()
                .map(|(id, path)| (id, Hold::Mapped { path })),
        ),
        Err(e) if gone(&e) => {}
        Err(e) => unread.push(("maps", e)),
    }
    Some((holds, unread))
}

/// Adds what `pid` holds (`holds`: mount ID and how) to the usage of each volume of
/// `which` (indexes into `usages` and `volume_mounts`) whose mounts have that ID, and what
/// could not be read of it (`unread`) to each of those usages.
pub(super) fn report(
    usages: &mut [Usage],
    volume_mounts: &[BTreeSet<u32>],
    which: &[usize],
    pid: u32,
    holds: &[(u32, Hold)],
    unread: &[(&'static str, std::io::Error)],
) {
    if holds.is_empty() && unread.is_empty() {
        return;
    }
    let comm = comm_of(pid);
    for &i in which {
        let (Some(usage), Some(mounts)) = (usages.get_mut(i), volume_mounts.get(i)) else {
            continue;
        };
        usage.holders.extend(
            holds
                .iter()
                .filter(|(id, _)| mounts.contains(id))
                .map(|(_, how)| Holder {
                    pid,
                    comm: comm.clone(),
                    how: how.clone(),
                    alloc_id: None,
                    other_node: false,
                }),
        );
        usage
            .uninspected
            .extend(unread.iter().map(|(what, e)| Uninspected {
                pid,
                comm: comm.clone(),
                what,
                error: e.to_string(),
            }));
    }
}

/// `PF_KTHREAD` in the process flags (proc(5) `stat` field 9): a kernel thread has no
/// descriptors, mappings or working directory of its own to hold a volume with, and on a
/// typical node most entries of `/proc` are kernel threads. A `stat` that cannot be read
/// or parsed is not taken as a kernel thread (the process is checked).
pub(super) fn is_kernel_thread(pid: u32) -> bool {
    const PF_KTHREAD: u64 = 0x0020_0000;
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The command name (field 2) may hold spaces and parentheses: fields 3.. follow the
    // last ')'.
    stat.rsplit_once(") ")
        .and_then(|(_, rest)| rest.split_whitespace().nth(6))
        .and_then(|f| f.parse::<u64>().ok())
        .is_some_and(|flags| flags & PF_KTHREAD != 0)
}

/// `/proc/<pid>/comm`, read only for a process that is reported ("?" once it is gone).
pub(super) fn comm_of(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim_end().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// ENOENT/ESRCH: the process exited while being read; EINVAL: it is exiting and has no
/// mount namespace any more (its namespace, if others still use it, is read through them).
pub(super) fn gone(e: &std::io::Error) -> bool {
    e.kind() == ErrorKind::NotFound
        || matches!(e.raw_os_error(), Some(nix::libc::ESRCH | nix::libc::EINVAL))
}

/// The processes in `/proc`: (pid, inode number of its `/proc/<pid>` directory, as the
/// listing gives it). The inode is made when the directory is first looked up and belongs
/// to that process (a pid used again is a new directory, with a new number); procfs gives
/// 1 for an entry it could not make one for.
pub(super) fn pids() -> Result<Vec<(u32, u64)>, HoldersError> {
    use std::os::unix::fs::DirEntryExt;
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").map_err(HoldersError::Proc)? {
        let entry = entry.map_err(HoldersError::Proc)?;
        if let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) {
            out.push((pid, entry.ino()));
        }
    }
    Ok(out)
}

/// Kernel threads found by earlier scans: pid → inode number of its `/proc` directory.
pub(super) static KERNEL_THREADS: std::sync::Mutex<BTreeMap<u32, u64>> =
    std::sync::Mutex::new(BTreeMap::new());

/// The pids of `listed` ([`pids`]) that are not kernel threads ([`is_kernel_thread`]).
/// A kernel thread is remembered by its pid and the inode number of its `/proc` directory,
/// so that its `stat` is read by the first scan that sees it, not by every scan: the same
/// directory is the same thread, and a kernel thread stays one (only `exec` clears
/// `PF_KTHREAD`, and no thread started by kthreadd calls it). A pid whose directory has
/// another number (the thread ended and its pid was used again) is read again, and
/// threads no longer listed are forgotten.
pub(super) fn without_kernel_threads(listed: Vec<(u32, u64)>) -> Vec<u32> {
    let known: Vec<bool> = {
        let memo = KERNEL_THREADS.lock().unwrap_or_else(|e| e.into_inner());
        listed
            .iter()
            .map(|(pid, ino)| *ino > 1 && memo.get(pid) == Some(ino))
            .collect()
    };
    let mut out = Vec::with_capacity(listed.len());
    let mut found = Vec::new();
    for (&(pid, ino), known) in listed.iter().zip(known) {
        if known {
            continue;
        }
        if is_kernel_thread(pid) {
            found.push((pid, ino));
        } else {
            out.push(pid);
        }
    }
    let mut memo = KERNEL_THREADS.lock().unwrap_or_else(|e| e.into_inner());
    let here: BTreeMap<u32, u64> = listed.into_iter().collect();
    memo.retain(|pid, ino| here.get(pid) == Some(ino));
    memo.extend(found.into_iter().filter(|&(_, ino)| ino > 1));
    out
}

/// `/proc/<pid>` opened `O_PATH`: the directory the reads of one process are made in.
pub(super) fn proc_dir(pid: u32) -> std::io::Result<OwnedFd> {
    use rustix::fs::{openat, Mode, OFlags, CWD};
    Ok(openat(
        CWD,
        format!("/proc/{pid}"),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Reads the file `name` under the directory `dir` whole.
pub(super) fn read_at(dir: &OwnedFd, name: &str) -> std::io::Result<String> {
    use rustix::fs::{openat, Mode, OFlags};
    let fd = openat(dir, name, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())?;
    read_whole(std::fs::File::from(fd))
}

/// Reads a `/proc` file whole. Not `read_to_string`: it asks the file's size first (an
/// `fstat` and an `lseek` per file, for files whose size `/proc` shows as 0), two of the
/// few system calls per descriptor a scan makes. Bytes that are not UTF-8 (a mapped
/// file's name in `maps`) are replaced: names are only shown, the fields a scan decides by
/// are ASCII, and a name the agent cannot print must not leave a process uninspected.
pub(super) fn read_whole(f: std::fs::File) -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::with_capacity(4096);
    // Through `take`, whose `read_to_end` does not ask the file's size (`File`'s does);
    // it retries EINTR and grows the buffer without filling it first.
    f.take(u64::MAX).read_to_end(&mut bytes)?;
    Ok(match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    })
}

/// The `mnt_id:` line of an fdinfo file's text.
pub(super) fn fdinfo_mount(text: &str) -> Option<u32> {
    text.lines()
        .find_map(|l| l.strip_prefix("mnt_id:"))
        .and_then(|v| v.trim().parse().ok())
}

/// The mount the magic link `name` of a process's directory `dir` (`cwd`, `exe`,
/// `map_files/…`) leads to: `statx(2)` with `STATX_MNT_ID`, `AT_STATX_DONT_SYNC` and
/// `AT_NO_AUTOMOUNT` (one system call; NFS, FUSE, CIFS and Ceph answer from their cache, so
/// a dead server does not hang it, and a working directory on an automount trigger starts
/// no mount, whose daemon or server could make it wait); when that fails (kernels before
/// 5.8, a filesystem that refuses getattr) opened with `O_PATH` and read from our own
/// fdinfo, which calls no filesystem.
pub(super) fn link_mount(dir: &OwnedFd, name: &str) -> std::io::Result<Option<u32>> {
    use rustix::fs::{openat, statx, AtFlags, Mode, OFlags, StatxFlags};
    match statx(
        dir,
        name,
        AtFlags::STATX_DONT_SYNC | AtFlags::NO_AUTOMOUNT,
        StatxFlags::MNT_ID,
    ) {
        Ok(st) if StatxFlags::from_bits_retain(st.stx_mask).contains(StatxFlags::MNT_ID) => {
            return Ok(u32::try_from(st.stx_mnt_id).ok());
        }
        // The process or mapping is gone.
        Err(e) if e == rustix::io::Errno::NOENT || e == rustix::io::Errno::SRCH => {
            return Err(e.into());
        }
        // statx calls the filesystem's getattr, which may refuse (EACCES from a FUSE mount
        // without allow_other, EIO, an LSM): the mount is still found the way that calls no
        // filesystem.
        _ => {}
    }
    let f = openat(dir, name, OFlags::PATH | OFlags::CLOEXEC, Mode::empty())?;
    let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", f.as_raw_fd()))?;
    Ok(fdinfo_mount(&text))
}

/// Descriptors of the process whose directory is `dir` on one of `mounts`: (mount ID, fd,
/// the path the kernel shows).
pub(super) fn open_fds(
    dir: &OwnedFd,
    mounts: &BTreeSet<u32>,
) -> std::io::Result<Vec<(u32, u32, PathBuf)>> {
    use rustix::fs::{openat, readlinkat, Dir, Mode, OFlags};
    use std::os::unix::ffi::OsStringExt;
    let fd_dir = openat(
        dir,
        "fd",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut out = Vec::new();
    for entry in Dir::new(fd_dir)? {
        let Ok(entry) = entry else { continue };
        let Some(fd) = entry
            .file_name()
            .to_str()
            .ok()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        // What the descriptor shows (no filesystem call): pipes, sockets and anonymous
        // inodes ("pipe:[…]", "socket:[…]", "anon_inode:…") are on no volume, so only
        // files and directories cost an fdinfo read. A link that cannot be read is checked.
        let path = match readlinkat(dir, format!("fd/{fd}"), Vec::new()) {
            Ok(p) if !p.as_bytes().starts_with(b"/") => continue,
            Ok(p) => PathBuf::from(std::ffi::OsString::from_vec(p.into_bytes())),
            Err(rustix::io::Errno::NOENT) => continue, // closed meanwhile
            Err(_) => PathBuf::new(),
        };
        match read_at(dir, &format!("fdinfo/{fd}")) {
            Ok(text) => match fdinfo_mount(&text) {
                Some(id) if mounts.contains(&id) => out.push((id, fd, path)),
                _ => {}
            },
            Err(e) if e.kind() == ErrorKind::NotFound => {} // closed meanwhile
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Files mapped into memory by the process whose directory is `dir` from one of `mounts`,
/// with the mount: `maps` lines on one of the volumes' devices `devs`, confirmed through
/// `map_files` (needs CAP_SYS_ADMIN).
pub(super) fn mapped(
    dir: &OwnedFd,
    devs: &BTreeSet<DeviceId>,
    mounts: &BTreeSet<u32>,
) -> std::io::Result<Vec<(u32, PathBuf)>> {
    let maps = read_at(dir, "maps")?;
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), _, _, Some(d), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let path: PathBuf = f.collect::<Vec<_>>().join(" ").into();
        if inode == "0" || !seen.insert((d.to_string(), inode.to_string())) {
            continue;
        }
        let Some((maj, min)) = d.split_once(':') else {
            continue;
        };
        let on_dev = match (u32::from_str_radix(maj, 16), u32::from_str_radix(min, 16)) {
            (Ok(major), Ok(minor)) => devs.iter().any(|d| d.major == major && d.minor == minor),
            _ => false,
        };
        if !on_dev {
            continue;
        }
        match link_mount(dir, &format!("map_files/{range}")) {
            Ok(Some(id)) if mounts.contains(&id) => out.push((id, path)),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}
